"""torch.library custom ops (namespace ``flashcpp``), registered when torch imports.

Each op allocates its outputs with ``torch.empty`` and hands raw pointers plus the current CUDA
stream (as an int) to the C++ entry point: no DLPack export, no synchronization, so the ops
can be captured in CUDA graphs. Each has a ``register_fake`` (shape-only) implementation that
runs the same checks, so ``torch.compile(fullgraph=True)`` traces through without graph breaks
and bad inputs fail at trace time with the same sentences.

Ops:
  flashcpp::flash_attn_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                           alibi_slopes?, return_lse, bs_row_ptr?=None, bs_col_idx?=None,
                           bs_partial?=None, bs_element_masks?=None,
                           block_sparse_sizes?=None, rotary_dim=0, rotary_style=1,
                           rotary_theta=1e4, rotary_llama3_factor=0, rotary_llama3_low=1,
                           rotary_llama3_high=4, rotary_llama3_orig=8192,
                           rotary_cos_sin_cache?=None, rotary_positions_q?=None,
                           rotary_positions_k?=None, deterministic=False) -> (out, lse)
  flashcpp::flash_attn_fwd_rotary_k_out(q, k, v, rotary_k_out(a!), softmax_scale, ...the same...)
                           -> (out, lse)
  flashcpp::flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, window_left, window_right,
                           softcap, alibi_slopes?, return_lse, deterministic=False) -> (out, lse)
  flashcpp::flash_attn_bwd / flashcpp::flash_attn_varlen_bwd -> (dq, dk, dv): the backward, which
                           register_autograd makes the two forward ops' derivative (deterministic
                           only travels to it; see "the backward" below).
  flashcpp::merge_attention_states(v_a, s_a, v_b, s_b) -> (v, s)
q and k share head_dim; v may have another head dim (head_dim_v), which out (and dv) take: out is
(..., heads_q, head_dim_v), dq, dk and dv have the shapes of q, k and v (the fakes return the
same shapes). When return_lse is False the lse output is an empty (0,) tensor. A block-sparse mask travels as
the four tensors bs_row_ptr, bs_col_idx, bs_partial, bs_element_masks (int32, int32, int32, int64
on q's device, as BlockSparse.to(device) makes them) and block_sparse_sizes = [block_m, block_n,
num_batch, num_heads, num_q_blocks, num_k_blocks, seqlen_q, seqlen_k] (_core.sparse_to_args).
Four optional tensors, not one optional list: torch 2.11's schema inference has no Tensor[]?.
Rotary in attention travels flattened the same way (rotary_dim 0 = none; attention._rotary_op_args).
rotary_k_out is Rotary.k_out: flash_attn_fwd_rotary_k_out writes the rotated keys into it (its one
mutated argument; it may be k itself). Without it, a CUDA call rotates the keys into a temporary
that the op body allocates with torch.empty, as it allocates its outputs (the C++ library
allocates nothing).
  flashcpp::flash_attn_with_kvcache(q, k_cache, v_cache, ...) and
  flashcpp::flash_attn_with_kvcache_append(q, k_cache(a!), v_cache(a!), k, v, ...): decode's
  flash_attn_with_kvcache as ops, used inside torch.compile (eager calls skip the dispatcher).

This module owns the op bodies: the code that allocates the outputs and launches through the lower
modules (``_attn`` for attention, ``_decode`` for decode, ``_core`` for the merge), for the registered
ops and for the eager calls that skip the dispatcher. The public modules (``attention``, ``merge``,
``decode``) call into it; it imports none of them, so the package's imports run one way
(tests/python/test_import_order.py holds them to it).

No annotations from __future__ here: torch.library reads the real annotations for the schema.
"""
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor
from torch._C import _functions as _autograd_functions

from . import _core
from . import _flashcpp as _C
from ._attn import _execute, _execute_backward, _prepare, _rotary_from_op_args
from ._decode import _check_kvcache_call, _with_kvcache

_NO_LSE = (0,)


def _dense(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, bs_row_ptr=None,
           bs_col_idx=None, bs_partial=None, bs_element_masks=None, block_sparse_sizes=None, rotary_dim=0,
           rotary_style=1, rotary_theta=10000.0, rotary_llama3_factor=0.0, rotary_llama3_low=1.0,
           rotary_llama3_high=4.0, rotary_llama3_orig=8192, rotary_cos_sin_cache=None, rotary_positions_q=None,
           rotary_positions_k=None, rotary_k_rotated=None):
    sparse = _core.sparse_from_args(bs_row_ptr, bs_col_idx, bs_partial, bs_element_masks, block_sparse_sizes)
    rotary = _rotary_from_op_args(rotary_dim, rotary_style, rotary_theta, rotary_llama3_factor, rotary_llama3_low,
                                  rotary_llama3_high, rotary_llama3_orig, rotary_cos_sin_cache, rotary_positions_q,
                                  rotary_positions_k, rotary_k_rotated)
    return _prepare(q, k, v, softmax_scale, (window_left, window_right), alibi_slopes,
                    None, None, None, None, sparse, rotary)


def flash_attn_fwd_eager(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
                         window_left: int, window_right: int, softcap: float,
                         alibi_slopes: Optional[Tensor], return_lse: bool,
                         bs_row_ptr: Optional[Tensor] = None, bs_col_idx: Optional[Tensor] = None,
                         bs_partial: Optional[Tensor] = None, bs_element_masks: Optional[Tensor] = None,
                         block_sparse_sizes: Optional[List[int]] = None,
                         rotary_dim: int = 0, rotary_style: int = 1, rotary_theta: float = 10000.0,
                         rotary_llama3_factor: float = 0.0, rotary_llama3_low: float = 1.0,
                         rotary_llama3_high: float = 4.0, rotary_llama3_orig: int = 8192,
                         rotary_cos_sin_cache: Optional[Tensor] = None, rotary_positions_q: Optional[Tensor] = None,
                         rotary_positions_k: Optional[Tensor] = None,
                         rotary_k_rotated: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The body of flashcpp::flash_attn_fwd and flash_attn_fwd_rotary_k_out. Eager callers use it
    directly: going through the torch.library dispatcher costs tens of microseconds per call, which
    is the whole kernel time of a short sequence."""
    p = _dense(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, bs_row_ptr, bs_col_idx,
               bs_partial, bs_element_masks, block_sparse_sizes, rotary_dim, rotary_style, rotary_theta,
               rotary_llama3_factor, rotary_llama3_low, rotary_llama3_high, rotary_llama3_orig,
               rotary_cos_sin_cache, rotary_positions_q, rotary_positions_k, rotary_k_rotated)
    out = torch.empty(p.shape_o, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.shape_lse if return_lse else _NO_LSE, dtype=torch.float32, device=q.device)
    _execute(p, out, lse if return_lse else None, causal=causal, softcap=softcap)
    return out, lse


# Two ops, one body. flash_attn_fwd mutates nothing. flash_attn_fwd_rotary_k_out writes the rotated
# keys into rotary_k_out (Rotary.k_out; torch.compile functionalizes that), which is a required
# argument right after v: torch 2.11's ADInplaceOrView kernel of a mutating custom op indexes the
# boxed arguments by the mutated argument's position, and the dispatcher drops trailing arguments
# that equal their defaults, so a mutated Optional[Tensor] = None at the end of the schema raised
# IndexError('tuple index out of range') in every traced or autograd-visible call.
@torch.library.custom_op("flashcpp::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
                   window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], return_lse: bool,
                   bs_row_ptr: Optional[Tensor] = None, bs_col_idx: Optional[Tensor] = None,
                   bs_partial: Optional[Tensor] = None, bs_element_masks: Optional[Tensor] = None,
                   block_sparse_sizes: Optional[List[int]] = None,
                   rotary_dim: int = 0, rotary_style: int = 1, rotary_theta: float = 10000.0,
                   rotary_llama3_factor: float = 0.0, rotary_llama3_low: float = 1.0,
                   rotary_llama3_high: float = 4.0, rotary_llama3_orig: int = 8192,
                   rotary_cos_sin_cache: Optional[Tensor] = None, rotary_positions_q: Optional[Tensor] = None,
                   rotary_positions_k: Optional[Tensor] = None, deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    # deterministic changes nothing here: it travels to the backward (register_autograd below).
    return flash_attn_fwd_eager(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                alibi_slopes, return_lse, bs_row_ptr, bs_col_idx, bs_partial, bs_element_masks,
                                block_sparse_sizes, rotary_dim, rotary_style, rotary_theta, rotary_llama3_factor,
                                rotary_llama3_low, rotary_llama3_high, rotary_llama3_orig, rotary_cos_sin_cache,
                                rotary_positions_q, rotary_positions_k)


@torch.library.custom_op("flashcpp::flash_attn_fwd_rotary_k_out", mutates_args=("rotary_k_out",))
def flash_attn_fwd_rotary_k_out(q: Tensor, k: Tensor, v: Tensor, rotary_k_out: Tensor, softmax_scale: float,
                                causal: bool, window_left: int, window_right: int, softcap: float,
                                alibi_slopes: Optional[Tensor], return_lse: bool,
                                bs_row_ptr: Optional[Tensor] = None, bs_col_idx: Optional[Tensor] = None,
                                bs_partial: Optional[Tensor] = None, bs_element_masks: Optional[Tensor] = None,
                                block_sparse_sizes: Optional[List[int]] = None,
                                rotary_dim: int = 0, rotary_style: int = 1, rotary_theta: float = 10000.0,
                                rotary_llama3_factor: float = 0.0, rotary_llama3_low: float = 1.0,
                                rotary_llama3_high: float = 4.0, rotary_llama3_orig: int = 8192,
                                rotary_cos_sin_cache: Optional[Tensor] = None,
                                rotary_positions_q: Optional[Tensor] = None,
                                rotary_positions_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if rotary_dim == 0:
        raise ValueError("flash_attn_fwd_rotary_k_out needs rotary (rotary_dim > 0): rotary_k_out receives "
                         "the rotated keys")
    return flash_attn_fwd_eager(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                alibi_slopes, return_lse, bs_row_ptr, bs_col_idx, bs_partial, bs_element_masks,
                                block_sparse_sizes, rotary_dim, rotary_style, rotary_theta, rotary_llama3_factor,
                                rotary_llama3_low, rotary_llama3_high, rotary_llama3_orig, rotary_cos_sin_cache,
                                rotary_positions_q, rotary_positions_k, rotary_k_out)


def _dense_fake(q, k, v, window_left, window_right, alibi_slopes, return_lse, mask_args, mask_kwargs,
                k_out=None):
    # The block-sparse and rotary arguments go to _dense as the op received them.
    # softmax_scale 1.0: the fake needs shapes only (and math.sqrt of a SymInt is best avoided).
    # The block-sparse checks read shapes, dtypes and devices only: bad masks fail at trace time.
    if k_out is not None:
        mask_kwargs = dict(mask_kwargs, rotary_k_rotated=k_out)
    p = _dense(q, k, v, 1.0, window_left, window_right, alibi_slopes, *mask_args, **mask_kwargs)
    return (q.new_empty(p.shape_o),
            q.new_empty(p.shape_lse if return_lse else _NO_LSE, dtype=torch.float32))


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                         alibi_slopes, return_lse, *mask_args, deterministic=False, **mask_kwargs):
    # The op's arguments after return_lse are the 15 block-sparse and rotary ones, then deterministic
    # (not a mask argument), positional or by name.
    return _dense_fake(q, k, v, window_left, window_right, alibi_slopes, return_lse, mask_args[:15], mask_kwargs)


@flash_attn_fwd_rotary_k_out.register_fake
def _flash_attn_fwd_rotary_k_out_fake(q, k, v, rotary_k_out, softmax_scale, causal, window_left, window_right,
                                      softcap, alibi_slopes, return_lse, *mask_args, **mask_kwargs):
    return _dense_fake(q, k, v, window_left, window_right, alibi_slopes, return_lse, mask_args, mask_kwargs,
                       rotary_k_out)


def call_flash_attn_fwd(*args: Any, rotary_k_out: Optional[Tensor] = None,
                        deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """The registered op for flash_attn_fwd's arguments: flash_attn_fwd, or with rotary_k_out
    flash_attn_fwd_rotary_k_out (the same arguments with rotary_k_out after v, and no backward:
    rotary has none, so deterministic does not travel there)."""
    if rotary_k_out is None:
        return torch.ops.flashcpp.flash_attn_fwd(*args, deterministic=bool(deterministic))
    return torch.ops.flashcpp.flash_attn_fwd_rotary_k_out(*args[:3], rotary_k_out, *args[3:])



# ---- torch.func.vmap: batching rules ----------------------------------------------------------------
# Without a rule torch's fallback calls the op once per vmapped entry and warns of the cost. Dense
# attention folds the vmapped dimension into the batch instead: entries are independent sequences,
# so (n, B, S, H, D) -> (n * B, S, H, D) is one call with the same per-sequence arithmetic (on the
# CPU the results equal a loop's bit for bit; on CUDA the selector may pick another config for the
# larger problem, within the kernels' tolerance of the loop). An unbatched q, k or v is copied to n
# entries (the batch of the folded call is n * B); alibi slopes follow the batch when they have one.
# Only q vmapped (k and v shared by the entries, the common case) folds into the heads instead:
# (n, B, S, H, D) -> (B, S, H * n, D) with entry e of head h at h * n + e, whose group still maps
# to KV head h // (H / H_kv), so K and V are read as they are, not copied n times. Calls whose other
# tensors are vmapped, or that carry a block-sparse mask or rotary (their tensors are laid out per
# batch entry), and varlen calls (folding would need cu_seqlens' last entries on the host) run one
# entry at a time here, as the fallback would. A folded call that fails its checks runs entry by
# entry too, so that the sentence names the caller's shapes, not the folded ones.

def _vmap_entries(op, n: int, in_dims, args):
    """op over each of the n vmapped entries, outputs stacked along dim 0. in_dims has an int for
    a vmapped tensor and None (or, for a list argument, a list of Nones) otherwise."""
    if n == 0:
        raise ValueError(f"flashcpp::{op._name} under torch.func.vmap over an empty dimension: it runs entry by entry "
                         "here and has no entry to take its output shapes from; skip the call for an empty batch")
    outs = []
    for i in range(n):
        outs.append(op(*(a.select(d, i) if isinstance(d, int) else a for a, d in zip(args, in_dims))))
    return tuple(torch.stack(list(o)) for o in zip(*outs)), (0,) * len(outs[0])


def _fold(x: Tensor, d: Optional[int], n: int) -> Tensor:
    """x with its vmapped dim d folded into the batch dim 0; not vmapped (d None): n copies (a view
    with a stride-0 batch would alias its entries, which the kernels refuse)."""
    if d is None:
        return x.repeat(n, *([1] * (x.dim() - 1)))
    x = x.movedim(d, 0)
    return x.reshape(n * x.shape[1], *x.shape[2:])


def _fold_into_batch(n, qkv, dims, alibi, alibi_dim):
    """(q, k, v) with the vmapped dim folded into the batch, the slopes to match, and the unfolds of
    out and lse."""
    q, d = qkv[0], dims[0]
    batch = q.shape[0] if d is None else q.shape[1 if d % q.dim() == 0 else 0]
    if alibi is not None:
        if alibi_dim is not None:
            s_ = alibi.movedim(alibi_dim, 0)
            # (n, H): one row of slopes per entry, shared by its batch; (n, B, H): per sequence
            alibi = _fold(s_.unsqueeze(1).expand(n, batch, s_.shape[-1]) if s_.dim() == 2 else s_, 0, n)
        elif alibi.dim() == 2:
            alibi = _fold(alibi, None, n)
    unfold = lambda t: t.reshape(n, batch, *t.shape[1:])  # noqa: E731  (out and lse alike)
    return tuple(_fold(t, dt, n) for t, dt in zip(qkv, dims)), alibi, (unfold, unfold)


def _fold_into_heads(n, qn, alibi, alibi_dim):
    """q (qn: (n, B, S, H, D), k and v shared) with the entries folded into the heads, the slopes
    to match, and the unfolds of out and lse."""
    _, B, S, H, D = qn.shape
    if alibi is not None:
        if alibi_dim is None:  # (H,) or (B, H): each head's slope for its n entries
            alibi = alibi.repeat_interleave(n, dim=-1)
        else:  # (n, H) or (n, B, H): entry e's slopes at h * n + e
            a = alibi.movedim(alibi_dim, 0)
            alibi = a.movedim(0, -1).reshape(*a.shape[1:-1], a.shape[-1] * n)
    unfold_out = lambda out: out.view(B, S, H, n, out.shape[-1]).permute(3, 0, 1, 2, 4)  # noqa: E731
    unfold_lse = lambda lse: lse.view(B, H, n, S).permute(2, 0, 1, 3)  # noqa: E731
    return (qn.permute(1, 2, 3, 0, 4).reshape(B, S, H * n, D),), alibi, (unfold_out, unfold_lse)


@flash_attn_fwd.register_vmap
def _flash_attn_fwd_vmap(info, in_dims, *args):
    n = info.batch_size
    q, k, v, alibi, return_lse, rest = args[0], args[1], args[2], args[8], args[9], args[10:]
    entries = lambda: _vmap_entries(flash_attn_fwd, n, in_dims, args)  # noqa: E731
    rotary = len(rest) > 5 and rest[5] != 0  # rotary_dim
    if any(isinstance(a, Tensor) for a in rest) or rotary or any(d is not None for d in in_dims[10:]):
        return entries()
    if any(t.dim() - (d is not None) != 4 for t, d in zip((q, k, v), in_dims[:3])):
        return entries()  # not (batch, seqlen, heads, dim) per entry: the plain call's sentence
    if alibi is not None and alibi.dim() - (in_dims[8] is not None) not in (1, 2):
        return entries()  # slopes neither (H,) nor (B, H) per entry: the plain call's sentence
    if in_dims[0] is not None and in_dims[1] is None and in_dims[2] is None:
        qkv, slopes, unfold = _fold_into_heads(n, q.movedim(in_dims[0], 0), alibi, in_dims[8])
        qkv += (k, v)
    else:
        qkv, slopes, unfold = _fold_into_batch(n, (q, k, v), in_dims[:3], alibi, in_dims[8])
    try:
        out, lse = flash_attn_fwd(*qkv, *args[3:8], slopes, *args[9:])
    except (ValueError, TypeError):
        return entries()  # the first bad entry raises, with the caller's shapes in the sentence
    unfold_out, unfold_lse = unfold
    if not return_lse:  # lse is the (0,) placeholder: the same for every entry
        return (unfold_out(out), lse), (0, None)
    return (unfold_out(out), unfold_lse(lse)), (0, 0)


@flash_attn_fwd_rotary_k_out.register_vmap
def _flash_attn_fwd_rotary_k_out_vmap(info, in_dims, *args):
    raise NotImplementedError(
        "flash_attn_func with Rotary(k_out=...) does not run under torch.func.vmap: every entry would write its "
        "rotated keys into the one k_out; leave k_out out (the call rotates into a buffer of its own) or loop "
        "over the entries")


def _varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   window_left, window_right, alibi_slopes):
    # Shape/type checks only; the host-side value checks of cu_seqlens run in _prepare for CPU
    # tensors (eager only: a fake tensor has no values).
    dims, mq, _, _ = _core.check_qkv(q, k, v, varlen=True)
    _core.check_window((window_left, window_right))
    batch = _core.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", mq)
    if _core.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", mq) != batch:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
    if alibi_slopes is not None:
        _core.check_alibi(alibi_slopes, dims._replace(batch=batch), mq)
    total_q = q.shape[0]
    return (total_q, dims.heads_q, dims.head_dim_v), (dims.heads_q, total_q)


def flash_attn_varlen_fwd_eager(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                softmax_scale: float, causal: bool, window_left: int, window_right: int,
                                softcap: float, alibi_slopes: Optional[Tensor],
                                return_lse: bool) -> Tuple[Tensor, Tensor]:
    """The body of flashcpp::flash_attn_varlen_fwd, which eager calls without a gradient use
    directly, as flash_attn_fwd_eager: the dispatcher and the custom op's wrappers cost more host
    time than the kernels of a short packed batch (a transformers layer's padded prefill)."""
    p = _prepare(q, k, v, softmax_scale, (window_left, window_right), alibi_slopes, cu_seqlens_q,
                 cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.empty(p.shape_o, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.shape_lse if return_lse else _NO_LSE, dtype=torch.float32, device=q.device)
    _execute(p, out, lse if return_lse else None, causal=causal, softcap=softcap)
    return out, lse


@torch.library.custom_op("flashcpp::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          softmax_scale: float, causal: bool, window_left: int, window_right: int,
                          softcap: float, alibi_slopes: Optional[Tensor],
                          return_lse: bool, deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    # deterministic changes nothing here: it travels to the backward (register_autograd below).
    return flash_attn_varlen_fwd_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                                       return_lse)


@flash_attn_varlen_fwd.register_fake
def _flash_attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, window_left, window_right, softcap,
                                alibi_slopes, return_lse, deterministic=False):
    shape_o, shape_lse = _varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, window_left, window_right, alibi_slopes)
    return (q.new_empty(shape_o),
            q.new_empty(shape_lse if return_lse else _NO_LSE, dtype=torch.float32))


@flash_attn_varlen_fwd.register_vmap
def _flash_attn_varlen_fwd_vmap(info, in_dims, *args):
    return _vmap_entries(flash_attn_varlen_fwd, info.batch_size, in_dims, args)


# ---- the backward: flash_attn_bwd, flash_attn_varlen_bwd and the autograd formulas ---------------------
# Ops (CPU tensors run the CPU backward: the fp64 reference for float64, else the tiled backend; CUDA
# tensors the mma.sync backward of src/cuda/backward, fp16 and bf16):
#   flashcpp::flash_attn_bwd(dout, q, k, v, out, lse, dlse?, softmax_scale, causal, window_left,
#                            window_right, softcap, alibi_slopes?, deterministic, bs_row_ptr?, ...,
#                            block_sparse_sizes?) -> (dq, dk, dv)
#   flashcpp::flash_attn_varlen_bwd(dout, q, k, v, out, lse, dlse?, cu_seqlens_q, cu_seqlens_k,
#                            max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
#                            window_right, softcap, alibi_slopes?, deterministic) -> (dq, dk, dv)
# register_autograd makes flash_attn_fwd and flash_attn_varlen_fwd differentiable with these: the
# forward's outputs (out and the LSE) are saved, so the forward must return the LSE (the public
# functions ask for it whenever a gradient is needed, and drop it when the caller did not).

def _grad_views(p, out, lse, dout, dlse):
    """dout and dlse as the backward reads them (contiguous: autograd hands out expanded, stride-0
    gradients, e.g. of a sum), checked against out and lse."""
    if lse.numel() == 0 and out.numel() != 0:
        raise RuntimeError("the forward was run with return_lse=False, so its LSE was not saved and there is "
                           "nothing to differentiate with: call flashcpp.flash_attn_func / flash_attn_varlen_func, "
                           "which keep the LSE whenever q, k or v requires grad")
    if tuple(dout.shape) != tuple(out.shape) or dout.dtype != out.dtype:
        raise ValueError(f"dout must match out ({out.dtype} {tuple(out.shape)}); got {dout.dtype} {tuple(dout.shape)}")
    if dlse is not None and (tuple(dlse.shape) != tuple(lse.shape) or dlse.dtype != torch.float32):
        raise ValueError(f"dlse must be float32 of the LSE's shape {tuple(lse.shape)}; got {dlse.dtype} "
                         f"{tuple(dlse.shape)}")
    return dout.contiguous(), None if dlse is None else dlse.contiguous()


@torch.library.custom_op("flashcpp::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                   softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], deterministic: bool,
                   bs_row_ptr: Optional[Tensor] = None, bs_col_idx: Optional[Tensor] = None,
                   bs_partial: Optional[Tensor] = None, bs_element_masks: Optional[Tensor] = None,
                   block_sparse_sizes: Optional[List[int]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    return flash_attn_bwd_eager(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right,
                                softcap, alibi_slopes, deterministic, bs_row_ptr, bs_col_idx, bs_partial,
                                bs_element_masks, block_sparse_sizes)


def flash_attn_bwd_eager(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
                         alibi_slopes, deterministic, bs_row_ptr=None, bs_col_idx=None, bs_partial=None,
                         bs_element_masks=None, block_sparse_sizes=None):
    """The body of flashcpp::flash_attn_bwd, which the eager autograd formula (EagerAttention) calls
    directly, as flash_attn_fwd_eager. A plain call (no ALiBi or block-sparse mask) is tried on the
    C++ fast path first (_C.backward_fast: the same checks, allocations and launch as the lines
    below, without their ~300 us of Python on the CPU machine); None sends it down those lines."""
    if (alibi_slopes is None and bs_row_ptr is None and bs_col_idx is None and bs_partial is None
            and bs_element_masks is None and block_sparse_sizes is None):
        grads = _C.backward_fast(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right,
                                 softcap, deterministic)
        if grads is not None:
            return grads
    p = _dense(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, bs_row_ptr, bs_col_idx,
               bs_partial, bs_element_masks, block_sparse_sizes)
    dout, dlse = _grad_views(p, out, lse, dout, dlse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _execute_backward(p, out, lse, dout, dlse, dq, dk, dv, causal=causal, softcap=softcap, deterministic=deterministic)
    return dq, dk, dv


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
                         alibi_slopes, deterministic, *mask_args, **mask_kwargs):
    _dense(q, k, v, 1.0, window_left, window_right, alibi_slopes, *mask_args, **mask_kwargs)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("flashcpp::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                          window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                          deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return flash_attn_varlen_bwd_eager(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                                       alibi_slopes, deterministic)


def flash_attn_varlen_bwd_eager(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic):
    """The body of flashcpp::flash_attn_varlen_bwd (EagerVarlenAttention calls it directly), with
    flash_attn_bwd_eager's fast path (_C.varlen_backward_fast) for a call without ALiBi."""
    if alibi_slopes is None:
        grads = _C.varlen_backward_fast(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                                        deterministic)
        if grads is not None:
            return grads
    p = _prepare(q, k, v, softmax_scale, (window_left, window_right), alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k)
    dout, dlse = _grad_views(p, out, lse, dout, dlse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _execute_backward(p, out, lse, dout, dlse, dq, dk, dv, causal=causal, softcap=softcap, deterministic=deterministic)
    return dq, dk, dv


@flash_attn_varlen_bwd.register_fake
def _flash_attn_varlen_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                                alibi_slopes, deterministic):
    _varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                   alibi_slopes)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# flash_attn_fwd's inputs, in schema order (register_autograd passes them all, defaults filled in).
_FWD_ARGS = ("q", "k", "v", "softmax_scale", "causal", "window_left", "window_right", "softcap", "alibi_slopes",
             "return_lse", "bs_row_ptr", "bs_col_idx", "bs_partial", "bs_element_masks", "block_sparse_sizes",
             "rotary_dim", "rotary_style", "rotary_theta", "rotary_llama3_factor", "rotary_llama3_low",
             "rotary_llama3_high", "rotary_llama3_orig", "rotary_cos_sin_cache", "rotary_positions_q",
             "rotary_positions_k", "deterministic")


def _fwd_setup_context(ctx, inputs, output):
    a = dict(zip(_FWD_ARGS, inputs))
    out, lse = output
    ctx.save_for_backward(a["q"], a["k"], a["v"], out, lse, a["alibi_slopes"], a["bs_row_ptr"], a["bs_col_idx"],
                          a["bs_partial"], a["bs_element_masks"])
    ctx.scalars = (a["softmax_scale"], a["causal"], a["window_left"], a["window_right"], a["softcap"],
                   a["deterministic"], a["block_sparse_sizes"], a["rotary_dim"])


def _fwd_backward(ctx, dout, dlse, bwd=None):
    q, k, v, out, lse, alibi, rp, ci, pa, em = ctx.saved_tensors
    scale, causal, wl, wr, softcap, deterministic, sizes, rotary_dim = ctx.scalars
    if rotary_dim != 0:
        raise NotImplementedError("the backward of attention with fused rotary is not implemented: rotate q and k "
                                  "with flashcpp.apply_rotary first and differentiate through that rotation")
    dq, dk, dv = (bwd or torch.ops.flashcpp.flash_attn_bwd)(dout, q, k, v, out, lse, dlse, scale, causal, wl, wr,
                                                            softcap, alibi, deterministic, rp, ci, pa, em, sizes)
    return (dq, dk, dv) + (None,) * (len(_FWD_ARGS) - 3)


flash_attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)

_VARLEN_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
                "causal", "window_left", "window_right", "softcap", "alibi_slopes", "return_lse", "deterministic")


def _varlen_setup_context(ctx, inputs, output):
    a = dict(zip(_VARLEN_ARGS, inputs))
    out, lse = output
    ctx.save_for_backward(a["q"], a["k"], a["v"], out, lse, a["cu_seqlens_q"], a["cu_seqlens_k"], a["alibi_slopes"])
    ctx.scalars = (a["max_seqlen_q"], a["max_seqlen_k"], a["softmax_scale"], a["causal"], a["window_left"],
                   a["window_right"], a["softcap"], a["deterministic"])


def _varlen_backward(ctx, dout, dlse, bwd=None):
    q, k, v, out, lse, cu_q, cu_k, alibi = ctx.saved_tensors
    mq, mk, scale, causal, wl, wr, softcap, deterministic = ctx.scalars
    dq, dk, dv = (bwd or torch.ops.flashcpp.flash_attn_varlen_bwd)(dout, q, k, v, out, lse, dlse, cu_q, cu_k, mq, mk,
                                                                   scale, causal, wl, wr, softcap, alibi,
                                                                   deterministic)
    return (dq, dk, dv) + (None,) * (len(_VARLEN_ARGS) - 3)


flash_attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---- the eager autograd formulas ------------------------------------------------------------------
# An eager call that autograd records (grad mode on, q, k or v requiring grad; not traced, no torch.func
# transform, no rotary) takes these autograd.Functions instead of the registered ops: the same bodies,
# setup and backward as register_autograd's, without the op's autograd wrapper. That wrapper fills the
# schema's defaults per call (torch._library.utils.fill_defaults) by reading schema.arguments, a fresh
# list, once per argument: for flash_attn_fwd's 26 arguments about 300 us of host time per forward on
# the CPU machine (torch 2.15; flashcpp's own share of the call was ~35 us), more than the kernels of a
# training step at short lengths. Traced calls (torch.compile) and transforms keep the ops, whose
# registrations they read. The kernels record nothing for a double backward: under create_graph the
# gradients come out behind a node that raises when reached (as the ops' missing formula for
# flash_attn_bwd does), so that a gradient penalty through dq fails instead of dropping its term.
def _eager_backward(formula, body, ctx, dout, dlse):
    """The eager formulas' backward: (dq, dk, dv, None) from `formula` (register_autograd's) with
    the op's `body` (the rest of the op's inputs travel as one argument), and no double backward
    through them."""
    if not torch.is_grad_enabled():  # grad mode is on in a backward only under create_graph=True
        return formula(ctx, dout, dlse, body)[:3] + (None,)
    with torch.no_grad():
        grads = formula(ctx, dout, dlse, body)[:3]
    refuse = _autograd_functions.DelayedError(
        b"flashcpp's attention backward has no backward of its own (a double backward, such as a gradient penalty "
        b"through dq, dk or dv); differentiate the gradients with another attention implementation", 3)
    return tuple(refuse(*(g.detach().requires_grad_() for g in grads))) + (None,)


# Their forward tries the eager fast path first (_C.attention_fast, _C.varlen_fast) for a plain call
# with the LSE: grad mode is off inside forward, so it takes inputs that require grad, and it returns
# what the ops' body returns (out and the fp32 LSE of the same shape, bit for bit), which the backward
# reads; anything else (ALiBi, a block-sparse mask, rotary, a call it does not take) runs the body.
class EagerAttention(torch.autograd.Function):
    """flash_attn_fwd's autograd for eager calls: apply(q, k, v, rest) with rest the other inputs in
    _FWD_ARGS order, as one tuple: autograd's per-call cost grows with a Function's arguments (26
    of them took 19.7 us of Function.apply on the CPU machine against 11.5 us for 4), and only q, k
    and v take gradients."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        inputs = (q, k, v) + rest
        output = None
        # alibi_slopes, return_lse, the block-sparse mask's five and rotary_dim (_FWD_ARGS)
        if (inputs[8] is None and inputs[9] is True and inputs[10] is None and inputs[11] is None
                and inputs[12] is None and inputs[13] is None and inputs[14] is None and inputs[15] == 0):
            output = _C.attention_fast(*inputs[:8], True)
        if output is None:
            output = flash_attn_fwd_eager(*inputs[:-1])  # the last input is deterministic (the backward's)
        _fwd_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _eager_backward(_fwd_backward, flash_attn_bwd_eager, ctx, dout, dlse)


class EagerVarlenAttention(torch.autograd.Function):
    """flash_attn_varlen_fwd's autograd for eager calls: apply(q, k, v, rest) with rest the other
    inputs in _VARLEN_ARGS order (one tuple, as EagerAttention)."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        inputs = (q, k, v) + rest
        output = None
        if inputs[12] is None and inputs[13] is True:  # alibi_slopes, return_lse (_VARLEN_ARGS)
            output = _C.varlen_fast(*inputs[:12], True)
        if output is None:
            output = flash_attn_varlen_fwd_eager(*inputs[:-1])
        _varlen_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _eager_backward(_varlen_backward, flash_attn_varlen_bwd_eager, ctx, dout, dlse)


# ---- merge_attention_states -----------------------------------------------------------------------
# The op merges host tensors through cpu::merge_by_lse; its CUDA kernel is merge_cuda
# (flashcpp::merge_attention_states on the current stream).

@torch.library.custom_op("flashcpp::merge_attention_states", mutates_args=())
def merge_attention_states_op(v_a: Tensor, s_a: Tensor, v_b: Tensor,
                              s_b: Tensor) -> Tuple[Tensor, Tensor]:
    _core.check_merge(v_a, s_a, v_b, s_b)
    if v_a.device.type != "cpu":
        raise NotImplementedError(
            "merge_attention_states on CUDA is not implemented yet (the CPU path merges host "
            "tensors through cpu::merge_by_lse)")
    f32 = lambda t: t.detach().to(torch.float32).contiguous().numpy()  # noqa: E731
    o, lse = _core.merge_host(f32(v_a), f32(s_a), f32(v_b), f32(s_b))
    return torch.from_numpy(o).to(v_a.dtype), torch.from_numpy(lse)


@merge_attention_states_op.register_fake
def _merge_attention_states_fake(v_a, s_a, v_b, s_b):
    _core.check_merge(v_a, s_a, v_b, s_b)
    return v_a.new_empty(v_a.shape), s_a.new_empty(s_a.shape, dtype=torch.float32)


@merge_attention_states_op.register_vmap
def _merge_attention_states_vmap(info, in_dims, v_a, s_a, v_b, s_b):
    # The merge is row by row over any leading shape: the vmapped dim becomes one more leading dim.
    n = info.batch_size
    xs = [x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(n, *x.shape)
          for x, d in zip((v_a, s_a, v_b, s_b), in_dims)]
    return merge_attention_states_op(*xs), (0, 0)


def merge_cuda(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, out: Optional[Tensor] = None,
               out_lse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """CUDA tensors of matching shapes -> (v, s) through flashcpp::merge_attention_states, on the
    current stream: no synchronization, and no allocation when ``out``/``out_lse`` are given
    (contiguous, v_a's shape and dtype / s_a's shape in fp32), so it can be captured in a CUDA graph.
    ``out`` may be ``v_a`` or ``v_b`` itself (in place)."""
    dim = v_a.shape[-1] if v_a.dim() else 1
    rows = v_a.numel() // dim if dim else 0
    if out is None:
        out = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    if out_lse is None:
        out_lse = torch.empty(s_a.shape, dtype=torch.float32, device=v_a.device)
    for x, n, shape, dt in ((out, "out", v_a.shape, v_a.dtype), (out_lse, "out_lse", s_a.shape, torch.float32)):
        if x.shape != shape or x.dtype != dt or x.device != v_a.device or not x.is_contiguous():
            raise ValueError(f"{n} must be a contiguous {dt} tensor of shape {tuple(shape)} on {v_a.device}; got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if dim == 0 and s_a.numel():  # no output columns, but the merged LSE is still defined: merge one zero column
        zero = torch.zeros((s_a.numel(), 1), dtype=v_a.dtype, device=v_a.device)
        merge_cuda(zero, s_a.reshape(-1), zero, s_b.reshape(-1), out_lse=out_lse.view(-1))
        return out, out_lse
    if rows == 0 or dim == 0:
        return out, out_lse
    if rows > 2**31 - 1:
        raise ValueError(f"merge_attention_states: {rows} rows exceed 2**31-1")
    # (rows, dim) views when the layout allows it, else copies (kept alive until the launch is queued)
    va, vb = (x.reshape(rows, dim) for x in (v_a, v_b))
    va, vb = (x if dim == 1 or x.stride(1) == 1 else x.contiguous() for x in (va, vb))
    sa, sb = s_a.reshape(rows).contiguous(), s_b.reshape(rows).contiguous()
    o2 = out.view(rows, dim)
    code = _core._DTYPE_CODES[_core.meta(v_a, "v_a").dtype]

    def view(t: Tensor) -> Any:
        # (batch = rows, seqlen = 1, heads = 1, head_dim): only the row stride is ever stepped
        return _C.TensorView(t.data_ptr(), code, t.stride(0) if rows > 1 else dim, 0, 0)

    p = _C.MergeStatesParams()
    p.batch, p.seqlen, p.heads, p.head_dim = rows, 1, 1, dim
    p.o_a, p.o_b, p.o = view(va), view(vb), view(o2)
    p.lse_a, p.lse_b, p.lse = sa.data_ptr(), sb.data_ptr(), out_lse.data_ptr()
    dev = v_a.device
    opt = _C.RunOptions("cuda", torch.cuda.current_stream(dev).cuda_stream)
    if dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            _C.merge_attention_states(p, opt)
    else:
        _C.merge_attention_states(p, opt)
    return out, out_lse


def _merge_cuda_kernel(v_a, s_a, v_b, s_b):
    _core.check_merge(v_a, s_a, v_b, s_b)
    return merge_cuda(v_a, s_a, v_b, s_b)


merge_attention_states_op.register_kernel("cuda", _merge_cuda_kernel)


def merge_attention_states(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> Tuple[Tensor, Tensor]:
    """flashcpp.merge_attention_states on checked torch tensors: eager CUDA calls skip the dispatcher
    (merge_cuda, the op's own CUDA kernel); traced and CPU calls go through the registered op."""
    if v_a.device.type == "cuda" and not torch.compiler.is_compiling():
        return merge_cuda(v_a, s_a, v_b, s_b)
    return torch.ops.flashcpp.merge_attention_states(v_a, s_a, v_b, s_b)


# ---- decode: flash_attn_with_kvcache --------------------------------------------------------------
# Host values of cache_seqlens (an int, a list, a numpy array) travel as cache_seqlens_host (a list
# of ints, checked at trace time); a tensor as cache_seqlens. The append op takes k and v and
# writes them into k_cache and v_cache (its mutated arguments, required ones: see flash_attn_fwd).

def _kvcache_body(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_host, block_table, rotary_cos,
                  rotary_sin, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  alibi_slopes, num_splits, return_softmax_lse, rope_theta, k_scale=None, v_scale=None):
    lens = cache_seqlens if cache_seqlens is not None else cache_seqlens_host
    res = _with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lens, block_table, softmax_scale, causal,
                        (window_left, window_right), softcap, rotary_interleaved, alibi_slopes, num_splits,
                        return_softmax_lse, rope_theta, k_scale, v_scale)
    if return_softmax_lse:
        return res
    return res, q.new_empty(_NO_LSE, dtype=torch.float32)


def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_host, block_table, rotary_cos,
                  rotary_sin, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  alibi_slopes, num_splits, return_softmax_lse, rope_theta, k_scale=None, v_scale=None):
    lens = cache_seqlens if cache_seqlens is not None else cache_seqlens_host
    st, _ = _check_kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lens, block_table,
                                (window_left, window_right), softcap, alibi_slopes, num_splits, rope_theta,
                                check_values=False, k_scale=k_scale, v_scale=v_scale)
    shape_lse = (st.batch, st.heads_q, st.seqlen_q) if return_softmax_lse else _NO_LSE
    shape_o = (st.batch, st.seqlen_q, st.heads_q, st.head_dim_v)  # o has v_cache's head dim
    return q.new_empty(shape_o), q.new_empty(shape_lse, dtype=torch.float32)


@torch.library.custom_op("flashcpp::flash_attn_with_kvcache", mutates_args=())
def flash_attn_with_kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
                               cache_seqlens_host: Optional[List[int]], block_table: Optional[Tensor],
                               rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                               softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                               softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                               num_splits: int, return_softmax_lse: bool, rope_theta: Optional[float],
                               k_scale: Optional[Tensor] = None,
                               v_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _kvcache_body(q, k_cache, v_cache, None, None, cache_seqlens, cache_seqlens_host, block_table,
                         rotary_cos, rotary_sin, softmax_scale, causal, window_left, window_right, softcap,
                         rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, rope_theta, k_scale,
                         v_scale)


@flash_attn_with_kvcache_op.register_fake
def _flash_attn_with_kvcache_fake(q, k_cache, v_cache, *args):
    return _kvcache_fake(q, k_cache, v_cache, None, None, *args)


@torch.library.custom_op("flashcpp::flash_attn_with_kvcache_append", mutates_args=("k_cache", "v_cache"))
def flash_attn_with_kvcache_append_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor,
                                      cache_seqlens: Optional[Tensor], cache_seqlens_host: Optional[List[int]],
                                      block_table: Optional[Tensor], rotary_cos: Optional[Tensor],
                                      rotary_sin: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                                      window_left: int, window_right: int, softcap: float,
                                      rotary_interleaved: bool, alibi_slopes: Optional[Tensor], num_splits: int,
                                      return_softmax_lse: bool, rope_theta: Optional[float],
                                      k_scale: Optional[Tensor] = None,
                                      v_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _kvcache_body(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_host, block_table, rotary_cos,
                         rotary_sin, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                         alibi_slopes, num_splits, return_softmax_lse, rope_theta, k_scale, v_scale)


@flash_attn_with_kvcache_append_op.register_fake
def _flash_attn_with_kvcache_append_fake(q, k_cache, v_cache, k, v, *args):
    return _kvcache_fake(q, k_cache, v_cache, k, v, *args)


def _as_tensor(x: Any, dtype: torch.dtype, like: Tensor) -> Optional[Tensor]:
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, dtype=dtype, device=like.device)


def _scale_tensor(x: Any, k_cache: Tensor) -> Optional[Tensor]:
    """An fp8 cache's scale as the op takes it: a number becomes every KV head's (heads_kv,)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.full((int(k_cache.shape[2]),), float(x), dtype=torch.float32, device=k_cache.device)
    return torch.as_tensor(x, dtype=torch.float32, device=k_cache.device)


def call_flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                                 softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                                 num_splits, return_softmax_lse, rope_theta, k_scale=None, v_scale=None) -> Any:
    """flash_attn_with_kvcache through its registered op (what torch.compile traces)."""
    wl, wr = _core.check_window(window_size)
    lens_host = None
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        if isinstance(cache_seqlens, int) or (hasattr(cache_seqlens, "ndim") and cache_seqlens.ndim == 0):
            lens_host = [int(cache_seqlens)] * int(q.shape[0])
        else:
            lens_host = [int(c) for c in cache_seqlens]
        cache_seqlens = None
    args = (cache_seqlens, lens_host, block_table if block_table is None or isinstance(block_table, torch.Tensor)
            else torch.as_tensor(block_table, dtype=torch.int32, device=q.device),
            _as_tensor(rotary_cos, torch.float32, q), _as_tensor(rotary_sin, torch.float32, q),
            None if softmax_scale is None else float(softmax_scale), bool(causal), wl, wr, float(softcap),
            bool(rotary_interleaved), _as_tensor(alibi_slopes, torch.float32, q), int(num_splits),
            bool(return_softmax_lse), None if rope_theta is None else float(rope_theta),
            *(_scale_tensor(x, k_cache) for x in (k_scale, v_scale)))
    if k is None and v is None:
        out, lse = torch.ops.flashcpp.flash_attn_with_kvcache(q, k_cache, v_cache, *args)
    else:
        if k is None or v is None:
            raise ValueError("k and v come together (the new tokens' keys and values)")
        out, lse = torch.ops.flashcpp.flash_attn_with_kvcache_append(q, k_cache, v_cache, k, v, *args)
    return (out, lse) if return_softmax_lse else out
