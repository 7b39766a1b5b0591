"""Decode against a KV cache (flash-attn's ``flash_attn_with_kvcache``, FlashInfer's plan/run
wrappers), with the semantics of ``include/flashcpp/decode.h``:

* the cache is contiguous ``(batch, capacity, heads_kv, head_dim)`` or paged
  ``(num_pages, page_size, heads_kv, head_dim)`` with ``block_table`` (batch, pages_per_seq),
  any power-of-two page size from 1 to 256;
* ``cache_seqlens[b]`` keys are in the cache before the step; with ``k``/``v`` the step's new
  tokens are written into slots ``cache_seqlens[b] + t`` (in place), K rotated, and attention runs
  over ``L_b = cache_seqlens[b] + seqlen_q`` keys;
* causal alignment is bottom-right over the total length: query token ``t`` sits at position
  ``ia = L_b - seqlen_q + t`` and is rotated at that position (flash-attn rotates a non-causal q
  at ``cache_seqlens`` for every token instead);
* 1 <= seqlen_q <= 16; GQA/MQA; sliding window, softcap and ALiBi as in ``flash_attn_func``;
* head dims as in ``flash_attn_func``: ``v_cache`` (and ``v``, the output) may have its own head
  dim, head_dim_v; both backends take any multiple of 8 in [8, 256] (the CUDA kernels pad inside
  to the class 64, 128 or 256 that holds both; an fp8 cache on CUDA takes multiples of 16).

Three entry points, one C++ path (``flashcpp::decode_plan`` / ``decode_run`` through the
``_flashcpp`` binding, in ``_decode``; CUDA tensors run the CUDA kernels, numpy arrays and CPU
tensors the CPU backend, which walks the same work list):

* :class:`BatchDecodeWithKVCache` -- plan once on the host (shapes, lengths to plan for, split
  counts, workspaces), then ``run()`` as often as wanted. ``run()`` only launches: no allocation
  when ``out`` (and ``lse``) are given, no host synchronization, so it can be captured in a CUDA
  graph and replayed with new ``cache_seqlens`` and new tensor contents.
* :func:`flash_attn_with_kvcache` -- plan + run in one call. On CUDA the plan is cached per shape
  (planned for full caches, as flash-attn sizes its splits by the cache capacity), so after a
  first call for a shape the call is capturable too.
* :class:`BatchDecodeWithPagedKVCache` -- FlashInfer's page description (indptr, indices,
  last_page_len) on top of the first.

Values that only the device holds (cache_seqlens, block-table entries) are not read on CUDA (that
would synchronize): the kernels clamp them into the views instead (decode.h, "Safety"). On the
host they are checked, with a sentence naming the bad entry.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _core
from ._core import is_torch, torch
from ._decode import (_FAST_TYPES, MAX_PAGE_SIZE, MAX_SEQLEN_Q, MAX_SPLITS, BatchDecodeWithKVCache,
                      BatchDecodeWithPagedKVCache, _fast_kvcache, _fast_kvcache_checks, _with_kvcache)

if torch is not None:
    from . import _torch_ops

__all__ = ["BatchDecodeWithKVCache", "BatchDecodeWithPagedKVCache", "flash_attn_with_kvcache", "MAX_SEQLEN_Q",
           "MAX_PAGE_SIZE", "MAX_SPLITS"]


def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                            rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None,
                            cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, rope_theta: Optional[float] = None,
                            k_scale: Any = None, v_scale: Any = None) -> Any:
    """flash-attn's ``flash_attn_with_kvcache`` on flashcpp's decode (semantics in the module doc).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), 1 <= seqlen_q <= 16.
        k_cache, v_cache: (batch, capacity, heads_kv, head_dim), or (num_pages, page_size, heads_kv,
            head_dim) with ``block_table``; v_cache's last dim is head_dim_v (may differ from
            head_dim). Updated in place when ``k``/``v`` are given.
        k, v: the step's new keys/values (batch, seqlen_q, heads_kv, head_dim / head_dim_v), or None.
        rotary_cos, rotary_sin: fp32 tables (max_position, rotary_dim / 2); rotary_dim = 2 * columns.
        rope_theta: instead of tables, rotate all of head_dim by angles pos * theta^(-2i/head_dim).
        rotary_interleaved: True = GPT-J pairs (2i, 2i+1), False = GPT-NeoX halves (i, i + d/2).
        cache_seqlens: int or (batch,) int32: keys in the cache before the step (None: full caches).
            On CUDA pass an int32 tensor on q's device to stay capturable in a CUDA graph.
        num_splits: key splits per sequence (0 = the planner's heuristic).
        k_scale, v_scale: with an fp8 e4m3 cache (k_cache and v_cache of torch.float8_e4m3fn or
            ml_dtypes.float8_e4m3fn; q, k, v and the output in fp16, bf16 or fp32): the per-KV-head
            scales, a number or fp32 (heads_kv,), positive and finite. The step attends over
            K = code * k_scale and V = code * v_scale; an append stores the code of k / k_scale
            (after rotary) and v / v_scale, rounded to nearest even and saturated at +-448. Both
            backends; the CUDA kernels read half the bytes of a 16-bit cache.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype, and with ``return_softmax_lse`` the
        fp32 natural-log LSE (batch, heads_q, seqlen_q).

    On CUDA the plan is made once per shape (planned for full caches, as flash-attn does) and cached;
    the first call of a shape must happen outside a CUDA graph capture (a warm-up), later calls are
    capturable. Use :class:`BatchDecodeWithKVCache` to plan for the actual lengths.
    """
    if cache_batch_idx is not None:
        raise NotImplementedError("cache_batch_idx is not built in flashcpp decode (index the cache instead)")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not built in flashcpp decode")
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(flash_attn_with_kvcache, "flash_attn_with_kvcache", locals(),
                        ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "alibi_slopes", "k_scale",
                         "v_scale"))
        if r is not None:
            return r[0]
    # (rotary_interleaved is unused without rotary, but a value that is not a bool gets the general path's sentence)
    plain = (type(q) in _FAST_TYPES and rotary_cos is None and rotary_sin is None and rope_theta is None
             and alibi_slopes is None and k_scale is None and v_scale is None and rotary_interleaved.__class__ is bool
             and not torch.compiler.is_compiling())
    if plain:  # first: None where autograd records (the test below), before anything it checks raises
        fast = _fast_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                             window_size, softcap, num_splits, return_softmax_lse)
        if fast is not None:
            return fast if return_softmax_lse else fast[0]
    if _core.grad_needed(q, k_cache, v_cache, k, v, alibi_slopes) and not torch.compiler.is_compiling():
        if k is not None or v is not None:
            _core.refuse_grad_in_place("flash_attn_with_kvcache", "appends k and v into the cache in place",
                                       (q, k_cache, v_cache, k, v))
        return _core.no_backward("flash_attn_with_kvcache", lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, None, None, rotary_cos, rotary_sin, cache_seqlens, None, None, block_table,
            softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse, rope_theta, k_scale, v_scale), (q, k_cache, v_cache, alibi_slopes))
    if plain:
        # Autograd does not record: the fast call's checks, which it may have stepped aside before
        # (window_size, an append's caches), raise their sentences here, in their order; the call
        # itself would return None again.
        _fast_kvcache_checks(q, k_cache, v_cache, k, causal, window_size, softcap, num_splits, return_softmax_lse)
    # Yes/no options are True or False (a numpy bool too), not any truthy value: rotary_interleaved='no'
    # ran as True, and the registered op's caller casts with bool(). (The fast path took exact bools only.)
    causal = _core.check_flag(causal, "causal")
    rotary_interleaved = _core.check_flag(rotary_interleaved, "rotary_interleaved")
    return_softmax_lse = _core.check_flag(return_softmax_lse, "return_softmax_lse")
    if is_torch(q) and torch.compiler.is_compiling():
        # Traced by torch.compile: one opaque op (flashcpp::flash_attn_with_kvcache, or
        # ..._append, which mutates the caches); eager calls skip the dispatcher.
        return _torch_ops.call_flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, softmax_scale, causal,
            window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, rope_theta,
            k_scale, v_scale)
    return _with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                         softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                         return_softmax_lse, rope_theta, k_scale, v_scale)
