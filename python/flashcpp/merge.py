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


def merge_cuda(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any = None, out_lse: Any = None) -> Tuple[Any, Any]:
    """CUDA tensors of matching shapes -> (v, s) through flashcpp::merge_attention_states, on the
    current stream: no synchronization, and no allocation when ``out``/``out_lse`` are given
    (contiguous, v_a's shape and dtype / s_a's shape in fp32), so it can be captured in a CUDA graph.
    ``out`` may be ``v_a`` or ``v_b`` itself (in place)."""
    torch = _core.torch
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

    def view(t: Any) -> Any:
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
    check_merge(v_a, s_a, v_b, s_b)
    if _core.is_torch(v_a):
        torch = _core.torch
        if v_a.device.type == "cuda" and not torch.compiler.is_compiling():
            return merge_cuda(v_a, s_a, v_b, s_b)  # eager: skip the dispatcher (same body as the op's)
        return torch.ops.flashcpp.merge_attention_states(v_a, s_a, v_b, s_b)
    o, lse = merge_host(v_a, s_a, v_b, s_b)
    return o.astype(v_a.dtype, copy=False), lse


def _register_cuda_kernel() -> None:
    """The torch op flashcpp::merge_attention_states (``_torch_ops``) merges host tensors; its CUDA
    kernel is this module's merge_cuda (registered here, next to the code it runs)."""
    if _core.torch is None:
        return
    from ._torch_ops import merge_attention_states_op

    def cuda_kernel(v_a, s_a, v_b, s_b):
        check_merge(v_a, s_a, v_b, s_b)
        return merge_cuda(v_a, s_a, v_b, s_b)

    merge_attention_states_op.register_kernel("cuda", cuda_kernel)


_register_cuda_kernel()
