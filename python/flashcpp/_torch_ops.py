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
                           rotary_positions_k?=None, rotary_k_rotated(a!)?=None) -> (out, lse)
  flashcpp::flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, window_left, window_right,
                           softcap, alibi_slopes?, return_lse) -> (out, lse)
  flashcpp::merge_attention_states(v_a, s_a, v_b, s_b) -> (v, s)
When return_lse is False the lse output is an empty (0,) tensor. A block-sparse mask travels as
the four tensors bs_row_ptr, bs_col_idx, bs_partial, bs_element_masks (int32, int32, int32, int64
on q's device, as BlockSparse.to(device) makes them) and block_sparse_sizes = [block_m, block_n,
num_batch, num_heads, num_q_blocks, num_k_blocks, seqlen_q, seqlen_k] (_core.sparse_to_args).
Four optional tensors, not one optional list: torch 2.11's schema inference has no Tensor[]?.
Rotary in attention travels flattened the same way (rotary_dim 0 = none; attention._rotary_op_args).
rotary_k_rotated is Rotary.k_out: the op writes the rotated keys into it (the one mutated
argument; it may be k itself). Without it, a CUDA call rotates the keys into a temporary that the
op body allocates with torch.empty, as it allocates its outputs (the C++ library allocates nothing).

No annotations from __future__ here: torch.library reads the real annotations for the schema.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _core
from .attention import _execute, _prepare, _rotary_from_op_args

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
    """The body of flashcpp::flash_attn_fwd. Eager callers use it directly: going through the
    torch.library dispatcher costs tens of microseconds per call, which is the whole kernel time
    of a short sequence."""
    p = _dense(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, bs_row_ptr, bs_col_idx,
               bs_partial, bs_element_masks, block_sparse_sizes, rotary_dim, rotary_style, rotary_theta,
               rotary_llama3_factor, rotary_llama3_low, rotary_llama3_high, rotary_llama3_orig,
               rotary_cos_sin_cache, rotary_positions_q, rotary_positions_k, rotary_k_rotated)
    out = torch.empty(p.shape_o, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.shape_lse if return_lse else _NO_LSE, dtype=torch.float32, device=q.device)
    _execute(p, out, lse if return_lse else None, causal=causal, softcap=softcap)
    return out, lse


# The op is the eager body itself (one signature: its annotations are the op's schema). It writes
# rotary_k_rotated (Rotary.k_out) when one is given, so torch.compile functionalizes that.
flash_attn_fwd = torch.library.custom_op("flashcpp::flash_attn_fwd",
                                         mutates_args=("rotary_k_rotated",))(flash_attn_fwd_eager)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                         alibi_slopes, return_lse, *mask_args, **mask_kwargs):
    # The block-sparse and rotary arguments go to _dense as the op received them.
    # softmax_scale 1.0: the fake needs shapes only (and math.sqrt of a SymInt is best avoided).
    # The block-sparse checks read shapes, dtypes and devices only: bad masks fail at trace time.
    p = _dense(q, k, v, 1.0, window_left, window_right, alibi_slopes, *mask_args, **mask_kwargs)
    return (q.new_empty(p.shape_o),
            q.new_empty(p.shape_lse if return_lse else _NO_LSE, dtype=torch.float32))


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
    return (total_q, dims.heads_q, dims.head_dim), (dims.heads_q, total_q)


@torch.library.custom_op("flashcpp::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          softmax_scale: float, causal: bool, window_left: int, window_right: int,
                          softcap: float, alibi_slopes: Optional[Tensor],
                          return_lse: bool) -> Tuple[Tensor, Tensor]:
    p = _prepare(q, k, v, softmax_scale, (window_left, window_right), alibi_slopes, cu_seqlens_q,
                 cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.empty(p.shape_o, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.shape_lse if return_lse else _NO_LSE, dtype=torch.float32, device=q.device)
    _execute(p, out, lse if return_lse else None, causal=causal, softcap=softcap)
    return out, lse


@flash_attn_varlen_fwd.register_fake
def _flash_attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, window_left, window_right, softcap,
                                alibi_slopes, return_lse):
    shape_o, shape_lse = _varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, window_left, window_right, alibi_slopes)
    return (q.new_empty(shape_o),
            q.new_empty(shape_lse if return_lse else _NO_LSE, dtype=torch.float32))


@torch.library.custom_op("flashcpp::merge_attention_states", mutates_args=())
def merge_attention_states_op(v_a: Tensor, s_a: Tensor, v_b: Tensor,
                              s_b: Tensor) -> Tuple[Tensor, Tensor]:
    from .merge import check_merge, merge_host

    check_merge(v_a, s_a, v_b, s_b)
    if v_a.device.type != "cpu":
        raise NotImplementedError(
            "merge_attention_states on CUDA is not implemented yet (the CPU path merges host "
            "tensors through cpu::merge_by_lse)")
    f32 = lambda t: t.detach().to(torch.float32).contiguous().numpy()  # noqa: E731
    o, lse = merge_host(f32(v_a), f32(s_a), f32(v_b), f32(s_b))
    return torch.from_numpy(o).to(v_a.dtype), torch.from_numpy(lse)


@merge_attention_states_op.register_fake
def _merge_attention_states_fake(v_a, s_a, v_b, s_b):
    from .merge import check_merge

    check_merge(v_a, s_a, v_b, s_b)
    return v_a.new_empty(v_a.shape), s_a.new_empty(s_a.shape, dtype=torch.float32)
