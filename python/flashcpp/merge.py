"""Merging partial attention outputs by their log-sum-exps (split-KV, cascade, ring attention).

Two outputs computed over disjoint key sets, each normalized over its own keys and carrying its
natural-log LSE, combine exactly into the output over the union:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

An empty side (lse = -inf) contributes nothing; both empty gives o = 0, lse = -inf. The LSEs
are natural logs, as flashcpp's attention returns them (FlashInfer's are base 2: multiply
those by ln 2 first).
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from . import _core
from . import _flashcpp as _C


def check_merge(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> None:
    ma, mb = _core.meta(v_a, "v_a"), _core.meta(v_b, "v_b")
    sa, sb = _core.meta(s_a, "s_a"), _core.meta(s_b, "s_b")
    _core._same_library("v_a, s_a, v_b and s_b", v_a, s_a, v_b, s_b)
    for m in (ma, mb):
        if m.dtype not in _core._DTYPE_CODES:
            raise TypeError(f"{m.name} has dtype {m.dtype}; merge takes float16, bfloat16 or float32")
    if ma.dtype != mb.dtype:
        raise TypeError(f"v_a and v_b must have the same dtype; got {ma.dtype} and {mb.dtype}")
    for m in (sa, sb):
        if m.dtype != "float32":
            raise TypeError(f"{m.name} (an LSE) must be float32; got {m.dtype}")
    if not (ma.device == mb.device == sa.device == sb.device):
        raise ValueError(f"v_a, s_a, v_b and s_b must be on one device; got {ma.device}, {sa.device}, "
                         f"{mb.device}, {sb.device}")
    if len(ma.shape) < 1 or ma.shape != mb.shape:
        raise ValueError(f"v_a and v_b must have the same shape (..., head_dim); got {ma.shape} and {mb.shape}")
    if sa.shape != ma.shape[:-1] or sb.shape != ma.shape[:-1]:
        raise ValueError(f"s_a and s_b must have the shape of v without its last dim, {ma.shape[:-1]}; "
                         f"got {sa.shape} and {sb.shape}")


def merge_host(v_a: np.ndarray, s_a: np.ndarray, v_b: np.ndarray, s_b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """fp32 host arrays of matching shapes -> fp32 (v, s) through cpu::merge_by_lse."""
    dim = v_a.shape[-1] if v_a.ndim else 1
    rows = int(np.prod(v_a.shape[:-1], dtype=np.int64))
    o = np.empty((rows, dim), dtype=np.float32)
    lse = np.empty((rows,), dtype=np.float32)
    if rows and dim:
        c = lambda x, shape: np.ascontiguousarray(x, dtype=np.float32).reshape(shape)  # noqa: E731
        _C.merge_by_lse(c(v_a, (rows, dim)), c(s_a, (rows,)), c(v_b, (rows, dim)), c(s_b, (rows,)), o, lse)
    return o.reshape(v_a.shape), lse.reshape(s_a.shape)


def merge_attention_states(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> Tuple[Any, Any]:
    """Merges two partial attention states (FlashInfer's ``merge_state``, natural-log LSE).

    Args:
        v_a, v_b: partial outputs (..., head_dim), e.g. (seqlen, heads, head_dim); fp16/bf16/fp32.
        s_a, s_b: their LSEs (...), fp32, natural log.
    Returns:
        (v, s): the merged output in v_a's dtype and the merged fp32 LSE.
    numpy arrays and CPU torch tensors run on the host; CUDA tensors raise NotImplementedError.
    """
    check_merge(v_a, s_a, v_b, s_b)
    if _core.is_torch(v_a):
        return _core.torch.ops.flashcpp.merge_attention_states(v_a, s_a, v_b, s_b)
    o, lse = merge_host(v_a, s_a, v_b, s_b)
    return o.astype(v_a.dtype, copy=False), lse
