"""Attention: flash-attn style functions over numpy arrays and torch tensors (torch tensors are
differentiable: gradients of q, k and v through torch.autograd, include/flashcpp/backward.h).

Semantics are those of ``include/flashcpp/attention.h``; in short:

* layout (batch, seqlen, heads, head_dim), any strides except a contiguous head_dim, so
  PyTorch SDPA's (B, H, N, D) tensors run after ``.transpose(1, 2)`` without a copy;
* GQA/MQA: heads_q a multiple of heads_kv;
* head dims: q and k share head_dim, v (and the output) has its own, head_dim_v (e.g. DeepSeek's
  192/128); each any multiple of 8 in [8, 256] (``SUPPORTED_HEAD_DIMS``), on every backend: the
  CUDA kernels run a pair in the smallest class of ``CUDA_HEAD_DIMS`` that holds both, padding
  inside the kernel (nothing is copied);
* causal masks are aligned **bottom-right** as in flash-attn: query i sees keys
  j <= i + seqlen_k - seqlen_q (SDPA's ``is_causal`` is top-left; they agree when
  seqlen_q == seqlen_k);
* window_size=(left, right): keys in [ia - left, ia + right] with ia = i + seqlen_k - seqlen_q,
  -1 meaning unbounded on that side;
* softcap > 0: s = softcap * tanh(s / softcap) (Gemma-2);
* ALiBi: s += slope * (j - ia). With causal masking this equals flash-attn's
  -slope * |i + seqlen_k - seqlen_q - j|; without it, flash-attn uses the absolute distance
  while flashcpp keeps the signed one (keys right of ia get a positive bias);
* block_sparse (a :class:`flashcpp.BlockSparse`): key j is visible to query i only if block
  (i // block_m, j // block_n) is listed for the row's (batch, head) and, for a partial block,
  its element bit is set; ANDed with every other mask. Built for exactly (seqlen_q, seqlen_k),
  num_batch 1 or batch, num_heads 1 or heads_q. Not with varlen (use document_block_sparse);
* LSE: natural log, fp32, (batch, heads_q, seqlen_q) ((heads_q, total_q) for varlen);
  a row that sees no key gets O = 0 and LSE = -inf;
* rotary (a :class:`Rotary`): q and k rotated as
  :func:`flashcpp.apply_rotary` rotates them, rounded to the input dtype, then attention on the
  results; positions default to i + len_k - len_q (queries) and j (keys). ``Rotary(k_out=...)``
  also receives the rotated keys (on CUDA they go to a buffer in any case: a fresh one without
  k_out).

Torch tensors go through the ``torch.ops.flashcpp.*`` custom ops (see ``_torch_ops``, which owns
their bodies), so ``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque op; numpy
arrays run on the CPU backend directly (``_attn``). This module calls into both and neither
imports it back.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from . import _flashcpp as _C
from ._attn import (KernelChoice, Rotary, _empty, _execute, _prepare, _rotary_op_args, _select,
                    _sparse_for)
from ._core import torch
from .masks import BlockSparse

if torch is not None:
    from . import _torch_ops

__all__ = ["KernelChoice", "Rotary", "attention", "flash_attn_func", "flash_attn_varlen_func", "select_kernel"]


def attention(q: Any, k: Any, v: Any, *, out: Any = None, lse: Any = None, return_lse: bool = False,
              softmax_scale: Optional[float] = None, causal: bool = False,
              window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
              global_tokens: int = 0, global_queries: bool = False, cu_seqlens_q: Any = None,
              cu_seqlens_k: Any = None, max_seqlen_q: Optional[int] = None,
              max_seqlen_k: Optional[int] = None, block_sparse: Optional[BlockSparse] = None,
              rotary: Optional[Rotary] = None, backend: str = "auto", cpu_threads: int = 0,
              cuda_config: str = "", stream: Optional[int] = None) -> Tuple[Any, Any]:
    """Low-level eager entry point: every mask field, a backend choice and caller-owned outputs.

    No torch.library op sits in between (use :func:`flash_attn_func` inside ``torch.compile``);
    benchmarks and tests use this to pass preallocated ``out``/``lse`` or to force
    ``backend`` = "cpu", "cpu-reference" (fp64 ground truth) or "cuda". ``stream`` is a
    ``cudaStream_t`` as an int (default: torch's current stream for CUDA tensors).
    Varlen when ``cu_seqlens_q``/``cu_seqlens_k`` are given (q/k/v packed (total, heads, dim)).
    ``block_sparse`` as in :func:`flash_attn_func`. ``rotary``: a :class:`Rotary` (rotates q
    and k first; its k_out, if given, receives the rotated keys).
    Returns ``(out, lse)``; lse is None unless given or ``return_lse``.
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(attention, "attention", locals(), ("q", "k", "v", "out", "lse", "alibi_slopes"),
                        _rotary_tensors(rotary))
        if r is not None:
            return r[0]
    p = _prepare(q, k, v, softmax_scale, window_size, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, block_sparse, rotary)
    if out is None:
        out = _empty(q, p.shape_o)
    if lse is None and return_lse:
        lse = _empty(q, p.shape_lse, np.float32 if not _core.is_torch(q) else torch.float32)
    _core.check_out(out, lse, p.shape_o, p.shape_lse, p.mq)
    _execute(p, out, lse, causal=causal, softcap=softcap, global_tokens=global_tokens,
             global_queries=global_queries, backend=backend, cpu_threads=cpu_threads,
             cuda_config=cuda_config, stream=stream)
    return out, lse


def select_kernel(q: Any, k: Any, v: Any, *, softmax_scale: Optional[float] = None,
                  causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Any = None, cu_seqlens_q: Any = None,
                  cu_seqlens_k: Any = None, max_seqlen_q: Optional[int] = None,
                  max_seqlen_k: Optional[int] = None, block_sparse: Optional[BlockSparse] = None,
                  rotary: Optional[Rotary] = None, backend: str = "auto", cuda_config: str = "") -> KernelChoice:
    """Which kernel (and tile config) flashcpp would run for these inputs, and why.
    Validates like a real call (raising the same errors) but launches nothing."""
    p = _prepare(q, k, v, softmax_scale, window_size, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, block_sparse, rotary)
    return KernelChoice(*_select(p, causal=causal, softcap=softcap, backend=backend, cuda_config=cuda_config))


def _rotary_tensors(rotary: Optional[Rotary]) -> Tuple[Any, ...]:
    """The tensors a Rotary holds (for the torch.func checks)."""
    return () if rotary is None else (rotary.cos_sin_cache, rotary.k_out)


def _torch_alibi(alibi_slopes: Any, q: Any) -> Any:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        return torch.tensor(alibi_slopes, dtype=torch.float32, device=q.device)
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device ({q.device}); got {alibi_slopes.device}")
    return alibi_slopes.to(torch.float32).contiguous()


def _torch_cu(cu: Any, q: Any, name: str) -> Any:
    return _core.int32_tensor(cu, name, q.device)


def _all_torch(q: Any, k: Any, v: Any) -> bool:
    if _core.is_torch(q) or _core.is_torch(k) or _core.is_torch(v):
        _core._same_library("q, k and v", q, k, v)
        return True
    return False


# The eager fast path of flash_attn_func: a plain call (no gradient, alibi, block-sparse mask or
# rotary, not traced) on torch tensors of one dtype on the host or the current CUDA device, each
# with a contiguous last dim (a size-1 dim's arbitrary stride normalized as _core._view does it:
# batch-1 K/V views of (B, H, S, D) caches take this path too), is read, checked and launched
# by one C++ call (_C.attention_fast, python/src/eager_fast.cc), which fills AttnParams directly
# from shapes, strides and pointers. The C++ validator checks those params as it checks every
# call; a call the fast path does not take (numpy, empty, mismatched, float64, other devices,
# FakeTensors) runs the general path with its Python checks and sentences.
# tests/python/test_attention_fast_path.py. flash_attn_varlen_func's is _C.varlen_fast, the same
# reads plus cu_seqlens (tests/python/test_varlen_fast_path.py).
_FAST_TYPES = _core.FAST_TYPES


def _fast_flash_attn(q, k, v, softmax_scale, causal, window_size, softcap, return_lse) -> Any:
    """flash_attn_func on the fast path: out, or (out, lse) with return_lse; None when it does not apply."""
    wl, wr = _core.check_window(window_size)
    return _C.attention_fast(q, k, v, softmax_scale, causal, wl, wr, softcap, return_lse)


def _check_flash_attn_extras(dropout_p: Any, deterministic: Any) -> None:
    """flash-attn's positional slots that flashcpp keeps so that ported positional calls land
    where they did: dropout_p (4th; flashcpp runs no dropout, so only 0 is accepted) and
    deterministic (the backward's: bitwise-repeatable gradients, dq included; the forward kernels
    are deterministic already)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_p must be a number (0.0: flashcpp runs no dropout); got {dropout_p!r}")
    if dropout_p != 0:
        raise NotImplementedError(f"dropout_p={dropout_p!r}: flashcpp's attention runs no dropout (pass 0.0)")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")


def flash_attn_func(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False, *,
                    return_lse: bool = False, block_sparse: Optional[BlockSparse] = None,
                    rotary: Optional[Rotary] = None):
    """flash-attn's ``flash_attn_func`` (no dropout), with its positional order:
    (q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic);
    everything after that is keyword-only (flash-attn's return_attn_probs is return_lse here).

    Differentiable (torch tensors): q, k and v get gradients through torch.autograd with every mask
    below (the LSE output too, when returned), on CPU tensors by the CPU backward (float64 by the
    fp64 reference, so torch.autograd.gradcheck works), on CUDA tensors (fp16/bf16) by the CUDA
    backward kernels (docs/backward.md); rotary has no backward (NotImplementedError).
    torch.func.vmap runs it (the op's batching rule folds the vmapped dim into the batch: one call;
    with rotary or a block-sparse mask, one call per entry); forward
    mode (torch.func.jvp, jacfwd, torch.autograd.forward_ad) and torch.func.grad / vjp / jacrev
    over its arguments raise NotImplementedError (torch would drop the tangent, or cannot reach
    the backward); a call on constants inside such a transform runs.

    Args:
        dropout_p: must be 0 (no dropout is run); kept so that positional calls ported from
            flash-attn put softmax_scale where it belongs.
        deterministic: bitwise-repeatable gradients (dq included) from the backward; the forward
            is deterministic either way.
        q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim); v:
            (batch, seqlen_k, heads_kv, head_dim_v), head_dim_v may differ from head_dim (both
            multiples of 8 in [8, 256]).
            torch tensors (CPU or CUDA; fp16/bf16, fp32 on CPU) or numpy arrays (CPU backend;
            float16/float32, bfloat16 via ml_dtypes). Only the last dim must be contiguous.
        softmax_scale: multiplies q.k; default 1/sqrt(head_dim).
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: (left, right) sliding window, -1 = unbounded.
        softcap: > 0 enables s = softcap * tanh(s / softcap).
        alibi_slopes: (heads_q,) or (batch, heads_q) fp32 slopes, bias slope * (j - ia).
        return_lse: also return the fp32 natural-log LSE, (batch, heads_q, seqlen_q).
        block_sparse: a :class:`flashcpp.BlockSparse` (block_sparse_from_mask, ...rules,
            causal_block_sparse, document_block_sparse) built for exactly (seqlen_q, seqlen_k),
            with num_batch 1 or batch and num_heads 1 or heads_q; ANDed with the other masks.
            Its arrays must be where q is: numpy arrays or CPU tensors for CPU inputs (numpy
            arrays are copied into tensors on every call for torch inputs), torch tensors on
            q's device for CUDA inputs: convert once with ``block_sparse.to(q.device)`` and
            reuse it (inside ``torch.compile`` pass tensors too). The CUDA kernels need block
            sizes that their tiles divide: use multiples of 128x128 (docs/masks.md); other
            sizes raise NotImplementedError there (the CPU backend takes any size). Values of
            device arrays are not checked (that would synchronize): build them with flashcpp's
            builders. A row none of whose keys is visible gets out = 0, lse = -inf.
        rotary: a :class:`flashcpp.Rotary`: q and k rotated as apply_rotary rotates them,
            then attention. Its arrays are copied to q's device on each call unless they
            already live there. Its k_out (a tensor like k, or k itself) receives the rotated
            keys, for a KV cache; on CUDA, without it, a fresh buffer is allocated per call.

    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype, or (out, lse).
    """
    if dropout_p.__class__ is not float or dropout_p != 0.0 or deterministic.__class__ is not bool:
        _check_flash_attn_extras(dropout_p, deterministic)  # the defaults need no check
    transformed = _core.transforms_active()  # torch.func / forward AD: the registered op, or a refusal
    if (alibi_slopes is None and block_sparse is None and rotary is None and type(q) in _FAST_TYPES
            and not transformed and not torch.compiler.is_compiling()):
        wl, wr = _core.check_window(window_size)  # _fast_flash_attn's body, inlined: a Python call less per call
        fast = _C.attention_fast(q, k, v, softmax_scale, causal, wl, wr, softcap, return_lse)
        if fast is not None:
            return fast
    if _all_torch(q, k, v):
        if transformed:
            transformed = _core.check_transforms("flash_attn_func", q, k, v, alibi_slopes, *_rotary_tensors(rotary))
        wl, wr = _core.check_window(window_size)
        scale = _core.default_scale(softmax_scale, q.shape[-1])
        sparse = None if block_sparse is None else _sparse_for(block_sparse, _core.meta(q, "q"))
        rot_args, k_out = _rotary_op_args(rotary, q)
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        # The backward reads the forward's LSE: computed whenever a gradient may be asked for, and
        # under a transform, where a vmapped tensor's requires_grad reads False even when the
        # tensor it wraps requires grad (autograd records the folded call all the same).
        args = (q, k, v, scale, _core.check_flag(causal, "causal"), wl, wr, _core.check_real(softcap, "softcap"), _torch_alibi(alibi_slopes, q),
                bool(return_lse or need_grad or transformed), *_core.sparse_to_args(sparse), *rot_args)
        # Traced (torch.compile) or autograd-visible calls go through the registered op; plain
        # eager calls skip the dispatcher (same body, same checks, a fraction of the overhead).
        # An eager call that autograd records takes the ops' formula without their wrapper
        # (_torch_ops.EagerAttention says why); rotary (no backward) keeps the op.
        if need_grad and k_out is None and not (transformed or torch.compiler.is_compiling()):
            out, lse = _torch_ops.EagerAttention.apply(*args[:3], args[3:] + (bool(deterministic),))
        elif torch.compiler.is_compiling() or need_grad or transformed:
            out, lse = _torch_ops.call_flash_attn_fwd(*args, rotary_k_out=k_out, deterministic=bool(deterministic))
        else:
            out, lse = _torch_ops.flash_attn_fwd_eager(*args, rotary_k_rotated=k_out)
        return (out, lse) if return_lse else out
    out, lse = attention(q, k, v, return_lse=return_lse, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         block_sparse=block_sparse, rotary=rotary)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Any = None, deterministic: bool = False, *,
                           return_lse: bool = False):
    """flash-attn's ``flash_attn_varlen_func`` (no dropout), with its positional order up to
    ``deterministic`` (dropout_p must be 0, as in :func:`flash_attn_func`); return_lse is
    keyword-only. Differentiable as :func:`flash_attn_func` (CPU and CUDA tensors;
    ``deterministic`` for the backward).

    q: (total_q, heads_q, head_dim), k: (total_k, heads_kv, head_dim), v: (total_k, heads_kv,
    head_dim_v) (head dims as in :func:`flash_attn_func`), sequences packed back to back;
    cu_seqlens_q/k: int32 (batch + 1,) prefix sums starting at 0; max_seqlen_q/k: the
    longest sequence. Each sequence is its own problem (causal alignment per sequence).
    Returns out (total_q, heads_q, head_dim_v), or (out, lse) with lse (heads_q, total_q) fp32.
    Runs on both backends; on CUDA tensors the kernels read cu_seqlens on the device (no
    synchronization), size the grid by max_seqlen_q and fuse every mask keyword (causal,
    window_size, softcap, alibi_slopes) per sequence. Packed rows past cu_seqlens_q[-1] are left
    as they are on CUDA (flash-attn's behaviour; reading the device array would synchronize) and
    set to 0 / -inf on the CPU; with batch 0 (cu_seqlens = [0]) every packed row is 0 / -inf on
    both. The LSE is (heads_q, q.shape[0]) whatever cu_seqlens_q[-1] is.
    There is no block_sparse argument: varlen and block-sparse do not combine; a document_block_sparse mask over the packed tensors (batch 1) is the block-sparse
    form of a varlen batch.
    """
    if dropout_p.__class__ is not float or dropout_p != 0.0 or deterministic.__class__ is not bool:
        _check_flash_attn_extras(dropout_p, deterministic)  # the defaults need no check
    transformed = _core.transforms_active()  # as flash_attn_func
    if alibi_slopes is None and type(q) in _FAST_TYPES and not transformed and not torch.compiler.is_compiling():
        wl, wr = _core.check_window(window_size)
        fast = _C.varlen_fast(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                              causal, wl, wr, softcap, return_lse)
        if fast is not None:
            return fast
    if _all_torch(q, k, v):
        if transformed:
            transformed = _core.check_transforms("flash_attn_varlen_func", q, k, v, alibi_slopes)
        wl, wr = _core.check_window(window_size)
        scale = _core.default_scale(softmax_scale, q.shape[-1])
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        args = (q, k, v, _torch_cu(cu_seqlens_q, q, "cu_seqlens_q"), _torch_cu(cu_seqlens_k, q, "cu_seqlens_k"),
                _core.check_int(max_seqlen_q, "max_seqlen_q", 0), _core.check_int(max_seqlen_k, "max_seqlen_k", 0),
                scale, _core.check_flag(causal, "causal"), wl, wr, _core.check_real(softcap, "softcap"),
                _torch_alibi(alibi_slopes, q), bool(return_lse or need_grad or transformed))  # as flash_attn_func
        # As flash_attn_func: traced or autograd-visible calls take the registered op, plain eager
        # calls its body.
        if need_grad and not (transformed or torch.compiler.is_compiling()):
            out, lse = _torch_ops.EagerVarlenAttention.apply(*args[:3], args[3:] + (bool(deterministic),))
        elif torch.compiler.is_compiling() or need_grad or transformed:
            out, lse = _torch_ops.flash_attn_varlen_fwd(*args, deterministic=bool(deterministic))
        else:
            out, lse = _torch_ops.flash_attn_varlen_fwd_eager(*args)
        return (out, lse) if return_lse else out
    out, lse = attention(q, k, v, return_lse=return_lse, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return (out, lse) if return_lse else out
