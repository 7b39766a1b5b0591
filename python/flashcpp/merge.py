"""Merging partial attention outputs by their log-sum-exps (split-KV, cascade, ring attention).

Two outputs computed over disjoint key sets, each normalized over its own keys and carrying its
natural-log LSE, combine exactly into the output over the union:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

An empty side (lse = -inf) contributes nothing; both empty gives o = 0, lse = -inf. The LSEs
are natural logs, as flashcpp's attention returns them (FlashInfer's are base 2: multiply
those by ln 2 first).

Host arrays merge through ``_core`` (cpu::merge_by_lse); torch tensors through ``_torch_ops``, which
owns the torch op and its CUDA kernel.
"""
from __future__ import annotations

from typing import Any, Tuple

from . import _core
from ._core import check_merge, merge_host, torch

if torch is not None:
    from . import _torch_ops

__all__ = ["merge_attention_states"]


def merge_attention_states(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> Tuple[Any, Any]:
    """Merges two partial attention states (FlashInfer's ``merge_state``, natural-log LSE).

    Args:
        v_a, v_b: partial outputs (..., head_dim), e.g. (seqlen, heads, head_dim); fp16/bf16/fp32.
        s_a, s_b: their LSEs (...), fp32, natural log.
    Returns:
        (v, s): the merged output in v_a's dtype and the merged fp32 LSE.
    numpy arrays and CPU torch tensors run on the host (cpu::merge_by_lse); CUDA tensors run the
    CUDA merge kernel on the current stream (no synchronization: capturable in a CUDA graph).
    """
    if _core.transforms_active():  # vmap runs (the registered op); forward mode is refused
        _core.check_transforms("merge_attention_states", v_a, s_a, v_b, s_b)
    check_merge(v_a, s_a, v_b, s_b)
    if _core.is_torch(v_a):
        return _torch_ops.merge_attention_states(v_a, s_a, v_b, s_b)
    o, lse = merge_host(v_a, s_a, v_b, s_b)
    return o.astype(v_a.dtype, copy=False), lse
