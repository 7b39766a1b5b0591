"""Fused LLM kernels: RMSNorm (plain and with the residual add), SwiGLU, rotary embedding.

Semantics are those of ``include/flashcpp/fused.h``; in short, with fp32 math and one rounding
into the tensors' dtype:

* ``rms_norm(x, w)``: ``y = x * rsqrt(mean(x**2, -1) + eps) * w``;
* ``fused_add_rms_norm(x, r, w)``: ``h = x + r`` (rounded to the dtype), ``r <- h``,
  ``x <- rms_norm(h) * w`` -- in place by default, as vLLM's and FlashInfer's functions;
* ``silu_and_mul(x)``: ``silu(x[..., :d]) * x[..., d:]`` (or ``silu(gate) * up``);
* ``apply_rotary(q, k, positions)``: neox (half split) or interleaved pairs, partial
  ``rotary_dim``, base ``theta`` with Llama-3 frequency scaling, angles formed in fp64 (accurate
  at any position), or cos/sin from an fp32 ``cos_sin_cache`` (max_position, rotary_dim) holding
  ``[cos | sin]`` per row (vLLM's layout).

Inputs are numpy arrays (CPU backend; float32 or float16) or torch tensors (CPU tensors on the
CPU backend, CUDA tensors on the CUDA kernels: float16/bfloat16). Strides are passed as they
are (no copy of an input): the last dimension must be contiguous, and for the norms and SwiGLU
the leading dimensions must flatten into rows of one stride. Torch tensors run eagerly (these
functions are not torch.library ops yet: inside ``torch.compile`` they break the graph).

Errors: wrong or mixed dtypes -> TypeError; device mismatch, bad shapes or strides, and what the
C++ validator refuses -> ValueError; unsupported combinations (fp32 on CUDA) -> NotImplementedError.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import numpy as np

from . import _core
from . import _flashcpp as _C
from ._core import torch

_STYLES = {"neox": _C.ROPE_NEOX, "interleaved": _C.ROPE_INTERLEAVED}


# ---- plumbing ------------------------------------------------------------------------------

def _check_dtype(m: _core.Meta, op: str) -> None:
    if m.dtype not in _core._DTYPE_CODES:
        raise TypeError(f"{m.name} has dtype {m.dtype}; flashcpp {op} takes float16, bfloat16 or float32")


def _check_same(ms, op: str) -> None:
    _core._same_library(", ".join(m.name for m in ms), *ms)
    first = ms[0]
    _core.check_place(first)  # a meta tensor: a sentence, not "x.data is null" (the others must match it)
    for m in ms[1:]:
        if m.dtype != first.dtype:
            raise TypeError(f"{m.name} has dtype {m.dtype} but {first.name} has {first.dtype} "
                            f"(the tensors of {op} share one dtype)")
        if m.device != first.device:
            raise ValueError(f"{m.name} is on {m.device} but {first.name} is on {first.device} "
                             f"(the tensors of {op} live on one device)")


def _check_weight_stride(mw: _core.Meta) -> None:
    """A norm weight (n,) of the right shape: the kernels read its n elements one after another."""
    if mw.shape[0] > 1 and mw.strides[0] != 1:
        raise ValueError(f"{mw.name} must be contiguous (stride 1); got stride {mw.strides[0]}"
                         + (" (an expanded view)" if mw.strides[0] == 0 else "") + ": pass a contiguous copy")


def _rows(m: _core.Meta) -> Tuple[int, int, int]:
    """(rows, row_stride, cols) of an array (..., cols) whose leading dims flatten into rows."""
    if len(m.shape) < 1:
        raise ValueError(f"{m.name} must have at least one dimension; got a scalar")
    cols = m.shape[-1]
    rows = int(np.prod(m.shape[:-1], dtype=np.int64)) if len(m.shape) > 1 else 1
    if rows == 0 or cols == 0:
        return rows, cols, cols
    if cols > 1 and m.strides[-1] != 1:
        raise ValueError(f"{m.name}: the last dimension must be contiguous (stride 1); got strides {m.strides}")
    lead = [(n, s) for n, s in zip(m.shape[:-1], m.strides[:-1]) if n != 1]
    if not lead:
        return rows, cols, cols
    if any(s < 0 for _, s in lead):
        raise ValueError(f"{m.name} has a negative stride {m.strides}; pass a contiguous copy")
    for (_, s_out), (n_in, s_in) in zip(lead, lead[1:]):
        if s_out != s_in * n_in:
            raise ValueError(f"{m.name}'s leading dimensions {m.shape[:-1]} (strides {m.strides[:-1]}) do "
                             "not flatten into rows of one stride; pass a contiguous copy")
    return rows, lead[-1][1], cols


def _empty(like: Any, shape, dtype=None) -> Any:
    if _core.is_torch(like):
        return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)
    return np.empty(shape, dtype=like.dtype if dtype is None else dtype)


def _check_out(out: Any, name: str, shape, like: _core.Meta) -> _core.Meta:
    m = _core.meta(out, name)
    _core.check_writable(out, name)
    _core.check_same_kind(m, like)
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {m.shape}")
    if m.dtype != like.dtype:
        raise TypeError(f"{name} must have {like.name}'s dtype {like.dtype}; got {m.dtype}")
    if m.device != like.device:
        raise ValueError(f"{name} must be on {like.name}'s device ({like.device}); got {m.device}")
    return m


def _stream(x: Any, m: _core.Meta, stream: Optional[int]) -> int:
    if stream is not None:
        return int(stream)
    if m.is_cuda:
        return torch.cuda.current_stream(x.device).cuda_stream
    return 0


def _call(like: Any, m: _core.Meta, fn, params: Any, options: Any) -> None:
    """Runs a binding on `like`'s device (the C++ launch uses the current CUDA device)."""
    if m.is_cuda and like.device.index is not None and like.device.index != torch.cuda.current_device():
        with torch.cuda.device(like.device):
            fn(params, options)
    else:
        fn(params, options)


def _options(backend: str, cpu_threads: int, cuda_config: str, x: Any, m: _core.Meta,
             stream: Optional[int]) -> Any:
    stream = _stream(x, m, stream)
    return _C.RunOptions(_core.resolve_backend(backend, m), stream, _core.check_cpu_threads(cpu_threads),
                         str(cuda_config))


def _matrix(x: Any, dtype_code: int, row_stride: int) -> Any:
    return _C.MatrixView(_core.data_ptr(x), dtype_code, row_stride)


# ---- the eager fast path ---------------------------------------------------------------------
# A plain call on torch tensors (one of float16/bfloat16/float32, one device, the current CUDA
# device or the host; backend "auto", no cuda_config, no stream, outputs allocated here or in place
# as documented) goes straight into the params: pointers, sizes and strides, and the stream read
# with torch's raw-stream accessor, in one C++ call (_C.norm_fast, _C.silu_and_mul_fast,
# _C.rotary_fast: python/src/eager_fast.cc, which says what each takes). The C++ validator checks
# these params as it checks every call, so a bad value still gets its sentence; anything the fast
# path does not take (numpy, strides, out=, another backend, a device that is not the current one,
# an empty tensor) returns None and runs the general path below with its Python checks.
# tests/python/test_fused_fast_path.py, test_rotary_fast_path.py.
#
# The fast call comes first, before the Python tests of autograd: the C++ call returns None where
# autograd records (grad mode on and an input requires grad) before it checks anything that raises,
# and then checks what the Python guard checked, in the guard's order (eps, the inference tensors
# written in place), and moves the version counters of what it wrote in place under grad mode. A
# call it returns None for runs the guard and the general path as before; with autograd off, the
# fast call would return None again, so it is not repeated. The tests cost about 2-4 us per call
# on the CPU machine (grad_needed 0.7, refuse_grad_in_place 1.1, bump_versions 0.9 ...).
_FAST_TYPES = _core.FAST_TYPES
# An eps in (2**-150, float32 max] needs no further check (the default 1e-6 among them); any other
# value goes through _core.check_eps, which refuses or accepts it (0, an int, a numpy number, a value
# just past float32's max that rounds to it).
_EPS_LO, _EPS_HI = _core._FLOAT32_HALF_TRUE_MIN, _core._FLOAT32_MAX


# ---- RMSNorm -------------------------------------------------------------------------------

def _norm(x, residual, weight, eps, out, residual_out, backend, cpu_threads, cuda_config, stream):
    op = "fused_add_rms_norm" if residual is not None else "rms_norm"
    mx, mw = _core.meta(x, "x"), _core.meta(weight, "weight")
    ms = [mx, mw]
    if residual is not None:
        mr = _core.meta(residual, "residual")
        if tuple(mr.shape) != tuple(mx.shape):
            raise ValueError(f"residual must have x's shape {mx.shape}; got {mr.shape}")
        ms.append(mr)
    for m in ms:
        _check_dtype(m, op)
    _check_same(ms, op)
    rows, x_rs, hidden = _rows(mx)
    if tuple(mw.shape) != (hidden,):
        raise ValueError(f"weight must have shape (hidden,) = ({hidden},); got {mw.shape}")
    _check_weight_stride(mw)
    mo = _check_out(out, "out", mx.shape, mx)
    _, y_rs, _ = _rows(mo)
    code = _core._DTYPE_CODES[mx.dtype]
    p = _C.RmsNormParams()
    p.rows, p.hidden, p.eps = rows, hidden, _core.check_eps(eps)
    p.x, p.y, p.weight = _matrix(x, code, x_rs), _matrix(out, code, y_rs), _core.data_ptr(weight)
    if residual is not None:
        _, r_rs, _ = _rows(mr)
        mro = _check_out(residual_out, "residual_out", mx.shape, mx)
        _, ro_rs, _ = _rows(mro)
        p.residual, p.residual_out = _matrix(residual, code, r_rs), _matrix(residual_out, code, ro_rs)
    opt = _options(backend, cpu_threads, cuda_config, x, mx, stream)
    if rows == 0 or hidden == 0:
        return
    _call(x, mx, _C.fused_add_rms_norm if residual is not None else _C.rms_norm, p, opt)


def rms_norm(x: Any, weight: Any, eps: float = 1e-6, *, out: Any = None, backend: str = "auto",
             cpu_threads: int = 0, cuda_config: str = "", stream: Optional[int] = None) -> Any:
    """``y = x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dimension.

    x: (..., hidden); weight: (hidden,), x's dtype. ``out`` (default: a new array) may be x
    itself (in place). ``backend``: "auto", "cpu" or "cuda"; ``cuda_config``: "" or
    "scalar"/"two_pass" to force a kernel path (tests, tuning). Returns out.
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(rms_norm, "rms_norm", locals(), ("x", "weight", "out"))
        if r is not None:
            return r[0]
    plain = out is None and backend == "auto" and not cuda_config and stream is None
    if plain:
        fast = _C.norm_fast(x, None, weight, eps, cpu_threads)  # None where autograd records
        if fast is not None:
            return fast
    if _core.grad_needed(x, weight):
        if out is not None:
            _core.refuse_grad_in_place("rms_norm", "with out= writes out", (x, weight))
        return _core.no_backward("rms_norm", lambda: rms_norm(x, weight, eps, backend=backend, cpu_threads=cpu_threads,
                                                             cuda_config=cuda_config, stream=stream), (x, weight))
    if plain and (eps.__class__ is not float or not _EPS_LO < eps <= _EPS_HI):
        # where norm_fast stepped aside before its eps check: the binding rounds eps to float32
        # unchecked, so what rounds to 0 or inf is refused here first, as before
        _core.check_eps(eps)
    if out is None:
        out = _empty(x, tuple(_core.meta(x, "x").shape))
    _norm(x, None, weight, eps, out, None, backend, cpu_threads, cuda_config, stream)
    return out


def fused_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float = 1e-6, *, out: Any = None,
                       residual_out: Any = None, backend: str = "auto", cpu_threads: int = 0,
                       cuda_config: str = "", stream: Optional[int] = None) -> Tuple[Any, Any]:
    """``h = x + residual`` (rounded to the dtype); ``residual_out = h``;
    ``out = h * rsqrt(mean(h**2, -1) + eps) * weight``.

    In place by default, as vLLM/FlashInfer: ``residual`` receives h and ``x`` the normalized
    output. Pass ``out`` / ``residual_out`` to keep the inputs. Returns ``(out, residual_out)``.
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(fused_add_rms_norm, "fused_add_rms_norm", locals(), ("x", "residual", "weight", "out", "residual_out"))
        if r is not None:
            return r[0]
    plain = out is None and residual_out is None and backend == "auto" and not cuda_config and stream is None
    # in place: x receives the normalized output, residual x + residual (their versions moved in C++)
    if plain and _C.norm_fast(x, residual, weight, eps, cpu_threads) is not None:  # None where autograd records
        return x, residual
    _core.refuse_grad_in_place("fused_add_rms_norm", "writes its results in place (or into out= / residual_out=)",
                               (x, residual, weight))
    if plain:  # what norm_fast checks, for a call it stepped aside for before checking it
        if eps.__class__ is not float or not _EPS_LO < eps <= _EPS_HI:
            _core.check_eps(eps)  # the binding rounds eps to float32 unchecked: refuses what rounds to 0 or inf
        if type(x) in _FAST_TYPES and type(residual) in _FAST_TYPES and (x.is_inference() or residual.is_inference()):
            _core.check_inference_write(x, "x")  # the general path writes them: checked first, as before
            _core.check_inference_write(residual, "residual")
    if out is None:
        _core.check_writable(x, "x")  # in place: x receives the normalized output
        out = x
    if residual_out is None:
        _core.check_writable(residual, "residual")  # in place: residual receives x + residual
        residual_out = residual
    _norm(x, residual, weight, eps, out, residual_out, backend, cpu_threads, cuda_config, stream)
    return out, residual_out


# ---- SwiGLU --------------------------------------------------------------------------------

def silu_and_mul(x: Any, up: Any = None, *, out: Any = None, backend: str = "auto", cpu_threads: int = 0,
                 cuda_config: str = "", stream: Optional[int] = None) -> Any:
    """SwiGLU: ``silu(gate) * up`` with ``silu(g) = g / (1 + exp(-g))``.

    One argument: x is the fused projection output (..., 2d) = [gate | up] and the result is
    (..., d). Two arguments: ``silu_and_mul(gate, up)`` with equal shapes (..., d). ``out`` may be
    the gate (or up) array itself, e.g. ``x[..., :d]`` for an in-place fused call.
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(silu_and_mul, "silu_and_mul", locals(), ("x", "up", "out"))
        if r is not None:
            return r[0]
    if up is None and out is None and backend == "auto" and not cuda_config and stream is None:
        fast = _C.silu_and_mul_fast(x, cpu_threads)  # None where autograd records
        if fast is not None:
            return fast
    if _core.grad_needed(x, up):
        if out is not None:
            _core.refuse_grad_in_place("silu_and_mul", "with out= writes out", (x, up))
        return _core.no_backward("silu_and_mul", lambda: silu_and_mul(x, up, backend=backend, cpu_threads=cpu_threads,
                                                                      cuda_config=cuda_config, stream=stream), (x, up))
    mg = _core.meta(x, "x" if up is None else "gate")
    _check_dtype(mg, "silu_and_mul")
    _core.check_place(mg)
    rows, g_rs, cols = _rows(mg)
    itemsize = 2 if mg.dtype in ("float16", "bfloat16") else 4
    if up is None:
        if cols % 2:
            raise ValueError(f"x's last dimension ({cols}) must be even: [gate | up] halves of d each")
        d = cols // 2
        gate_ptr, up_ptr, u_rs = _core.data_ptr(x), _core.data_ptr(x) + d * itemsize, g_rs
    else:
        mu = _core.meta(up, "up")
        _check_dtype(mu, "silu_and_mul")
        _check_same([mg, mu], "silu_and_mul")
        if tuple(mu.shape) != tuple(mg.shape):
            raise ValueError(f"gate and up must have the same shape; got {mg.shape} and {mu.shape}")
        _, u_rs, _ = _rows(mu)
        d = cols
        gate_ptr, up_ptr = _core.data_ptr(x), _core.data_ptr(up)
    shape_out = tuple(mg.shape[:-1]) + (d,)
    if out is None:
        out = _empty(x, shape_out)
    mo = _check_out(out, "out", shape_out, mg)
    _, o_rs, _ = _rows(mo)
    if rows == 0 or d == 0:
        return out
    code = _core._DTYPE_CODES[mg.dtype]
    p = _C.SiluMulParams()
    p.rows, p.d = rows, d
    p.gate = _C.MatrixView(gate_ptr, code, g_rs)
    p.up = _C.MatrixView(up_ptr, code, u_rs)
    p.out = _matrix(out, code, o_rs)
    _call(x, mg, _C.silu_and_mul, p, _options(backend, cpu_threads, cuda_config, x, mg, stream))
    return out


# ---- rotary --------------------------------------------------------------------------------

def _llama3(llama3: Optional[Mapping[str, Any]]) -> Tuple[float, float, float, int]:
    """(factor, low_freq_factor, high_freq_factor, original_max_position) from a Hugging Face
    ``rope_scaling`` dict (rope_type "llama3"); factor 0 = off."""
    if llama3 is None:
        return 0.0, 1.0, 4.0, 8192
    try:
        orig = llama3.get("original_max_position_embeddings", llama3.get("original_max_position"))
        out = (float(llama3["factor"]), float(llama3.get("low_freq_factor", 1.0)),
               float(llama3.get("high_freq_factor", 4.0)), 8192 if orig is None else orig)
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ValueError("llama3 must be a mapping with 'factor' and optionally 'low_freq_factor', "
                         "'high_freq_factor', 'original_max_position_embeddings' (a Hugging Face "
                         f"rope_scaling dict); got {llama3!r}") from None
    # an int (8.5 is not truncated) that fits the binding's int32
    return out[:3] + (_core.check_int(out[3], "llama3.original_max_position_embeddings", 0),)


def _positions_arg(pos: Any, q: Any, name: str, shapes) -> Any:
    """int32 positions in q's library and device (None stays None), shape one of `shapes`."""
    if pos is None:
        return None
    if _core.is_torch(q):
        pos = _core.int32_tensor(pos, name, q.device)
    else:
        pos = np.asarray(pos)
        if pos.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers; got {pos.dtype}")
        pos = np.ascontiguousarray(_core.check_int32_values(pos, name), dtype=np.int32)
    if tuple(pos.shape) not in tuple(tuple(sh) for sh in shapes):
        raise ValueError(f"{name} must have shape {' or '.join(str(tuple(sh)) for sh in shapes)}; got {tuple(pos.shape)}")
    return pos


def _cache_arg(cache: Any, q: Any, rot: int) -> Tuple[Any, int]:
    """(float32 C-contiguous cos/sin cache in q's library and device, max_position); (None, 0)."""
    if cache is None:
        return None, 0
    if _core.is_torch(q):
        if not isinstance(cache, torch.Tensor) or cache.device != q.device:
            raise ValueError(f"cos_sin_cache must be a float32 tensor on q's device ({q.device})")
        if cache.dtype != torch.float32:
            raise TypeError(f"cos_sin_cache must be float32; got {cache.dtype}")
        cache = cache.contiguous()
    else:
        cache = np.ascontiguousarray(cache, dtype=np.float32)
    if len(cache.shape) != 2 or cache.shape[1] != rot:
        raise ValueError(f"cos_sin_cache must have shape (max_position, rotary_dim={rot}); got {tuple(cache.shape)}")
    if cache.shape[0] == 0:  # an empty array has no address, which would read as "no tables"
        raise ValueError(f"cos_sin_cache has no rows (shape {tuple(cache.shape)}): every position is outside it; "
                         f"pass None to rotate by rope_theta instead")
    return cache, int(cache.shape[0])


def _rotary_spec(style: int, rotary_dim: int, head_dim: int, theta: float = 10000.0,
                 llama3: Tuple[float, float, float, int] = (0.0, 1.0, 4.0, 8192), cache: Any = None,
                 max_position: int = 0, cos: Any = None, sin: Any = None) -> Any:
    """The binding's RotarySpec (flashcpp/rope.h), the one rotary description that apply_rotary,
    the rotary fused into attention and decode all take: style code, rotary_dim (0 = head_dim),
    theta and llama3 (factor, low, high, original_max_position), and optionally the tables: a
    cos_sin_cache (rows [cos | sin]) or separate cos and sin (rows of rotary_dim / 2), float32
    arrays the caller keeps alive through the call."""
    s = _C.RotarySpec()
    s.style, s.rotary_dim, s.theta = int(style), int(rotary_dim), float(theta)
    s.llama3 = _C.Llama3Scaling(*llama3)
    if cache is not None:
        s.set_cos_sin_cache(_core.data_ptr(cache), int(max_position), int(rotary_dim or head_dim))
    elif cos is not None:
        s.cos, s.sin, s.max_position = _core.data_ptr(cos), _core.data_ptr(sin), int(max_position)
    return s


def _rope_view(m: _core.Meta) -> Tuple[int, int, int]:
    for s in m.strides:
        if s < 0:
            raise ValueError(f"{m.name} has a negative stride {m.strides}; pass a contiguous copy")
    if m.shape[-1] > 1 and 0 not in m.shape and m.strides[-1] != 1:
        raise ValueError(f"{m.name}: the last dimension (head_dim) must be contiguous; got strides {m.strides}")
    return _core._view(m, varlen=len(m.shape) == 3)


def apply_rotary(q: Any, k: Any = None, positions: Any = None, *, style: str = "neox",
                 rotary_dim: Optional[int] = None, theta: float = 10000.0,
                 llama3: Optional[Mapping[str, Any]] = None, cos_sin_cache: Any = None,
                 inplace: bool = False, q_out: Any = None, k_out: Any = None, backend: str = "auto",
                 cpu_threads: int = 0, cuda_config: str = "", stream: Optional[int] = None) -> Tuple[Any, Any]:
    """Rotary position embedding of q (and k).

    q: (tokens, heads_q, head_dim) or (batch, seqlen, heads_q, head_dim), any strides but a
    contiguous head_dim; k (optional) the same with heads_k heads (q and k may be views of one
    packed qkv buffer). positions: int32 per token, (tokens,) or (batch, seqlen); None means
    0..seqlen-1 in every sequence. style "neox" (pairs i, i + rotary_dim/2) or "interleaved"
    (pairs 2i, 2i+1); rotary_dim (default head_dim) rotates the leading dims only.
    llama3: a Hugging Face rope_scaling dict with factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings. cos_sin_cache: float32 (max_position, rotary_dim) with
    [cos | sin] per row, used instead of theta/llama3.
    Returns (q_out, k_out): new arrays, or q and k themselves with ``inplace=True``
    (k_out is None without k).
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(apply_rotary, "apply_rotary", locals(), ("q", "k", "cos_sin_cache", "q_out", "k_out"))
        if r is not None:
            return r[0]
    if q_out is None and k_out is None and backend == "auto" and not cuda_config and stream is None:
        # None where autograd records; in place, it moved q's and k's versions
        fast = _C.rotary_fast(q, k, positions, style, rotary_dim, theta, llama3, cos_sin_cache, inplace, cpu_threads)
        if fast is not None:
            return fast
    if _core.grad_needed(q, k):
        if _core.check_flag(inplace, "inplace") or q_out is not None or k_out is not None:
            _core.refuse_grad_in_place("apply_rotary", "with inplace=True or q_out= / k_out= writes in place", (q, k))
        return _core.no_backward("apply_rotary", lambda: apply_rotary(
            q, k, positions, style=style, rotary_dim=rotary_dim, theta=theta, llama3=llama3,
            cos_sin_cache=cos_sin_cache, backend=backend, cpu_threads=cpu_threads, cuda_config=cuda_config,
            stream=stream), (q, k))
    inplace = _core.check_flag(inplace, "inplace")  # not any truthy value: inplace='no' wrote in place
    mq = _core.meta(q, "q")
    _check_dtype(mq, "apply_rotary")
    if len(mq.shape) not in (3, 4):
        raise ValueError(f"q must be 3-D (tokens, heads, head_dim) or 4-D (batch, seqlen, heads, head_dim); "
                         f"got shape {mq.shape}")
    lead = tuple(mq.shape[:-2])
    batch, seqlen = (1, mq.shape[0]) if len(lead) == 1 else lead
    heads_q, head_dim = mq.shape[-2], mq.shape[-1]
    ms = [mq]
    heads_k = 0
    if k is not None:
        mk = _core.meta(k, "k")
        _check_dtype(mk, "apply_rotary")
        if len(mk.shape) != len(mq.shape) or tuple(mk.shape[:-2]) != lead or mk.shape[-1] != head_dim:
            raise ValueError(f"k must have q's leading dims {lead} and head_dim {head_dim}; got shape {mk.shape}")
        heads_k = mk.shape[-2]
        ms.append(mk)
    _check_same(ms, "apply_rotary")
    if style not in _STYLES:
        raise ValueError(f"style must be one of {', '.join(_STYLES)}; got {style!r}")
    rot = head_dim if rotary_dim is None else _core.check_int(rotary_dim, "rotary_dim", 0, head_dim, " (0 = head_dim)")
    rot = rot or head_dim  # 0 = head_dim (the cos_sin_cache's width too)
    tokens = batch * seqlen
    if inplace and (q_out is not None or k_out is not None):
        raise ValueError("inplace=True writes into q and k: do not pass q_out / k_out too")
    if inplace:
        _core.check_writable(q, "q")
        _core.check_writable(k, "k")
    if not inplace:
        q_out = _empty(q, mq.shape) if q_out is None else q_out
        if k is not None and k_out is None:
            k_out = _empty(k, ms[1].shape)
    views = {"q": _rope_view(mq), "k": _rope_view(ms[1]) if k is not None else (0, 0, 0),
             "q_out": (0, 0, 0), "k_out": (0, 0, 0)}
    ptrs = {"q": _core.data_ptr(q), "k": _core.data_ptr(k), "q_out": 0, "k_out": 0}
    if not inplace:
        views["q_out"] = _rope_view(_check_out(q_out, "q_out", mq.shape, mq))
        ptrs["q_out"] = _core.data_ptr(q_out)
        if k is not None:
            views["k_out"] = _rope_view(_check_out(k_out, "k_out", ms[1].shape, ms[1]))
            ptrs["k_out"] = _core.data_ptr(k_out)
    pos = _positions_arg(positions, q, "positions", ((tokens,), (batch, seqlen)))
    cache, max_position = _cache_arg(cos_sin_cache, q, rot)
    l3 = _llama3(llama3)

    if tokens > 0 and heads_q == 0 and k is not None and heads_k > 0:
        # q has no heads: k alone (the launch below needs q's heads), as apply_rotary(k) rotates it
        apply_rotary(k, None, positions, style=style, rotary_dim=rotary_dim, theta=theta, llama3=llama3,
                     cos_sin_cache=cos_sin_cache, inplace=inplace, q_out=None if inplace else k_out, backend=backend,
                     cpu_threads=cpu_threads, cuda_config=cuda_config, stream=stream)
    if tokens > 0 and heads_q > 0:
        code = _core._DTYPE_CODES[mq.dtype]
        p = _C.RopeParams()
        p.batch, p.seqlen, p.heads_q, p.heads_k = int(batch), int(seqlen), int(heads_q), int(heads_k)
        p.head_dim = int(head_dim)
        p.q, p.k = (_C.TensorView(ptrs[n], code, *views[n]) for n in ("q", "k"))
        p.q_out, p.k_out = (_C.TensorView(ptrs[n], code, *views[n]) for n in ("q_out", "k_out"))
        p.positions = _core.data_ptr(pos)
        p.rotary = _rotary_spec(_STYLES[style], rot, int(head_dim), theta, l3, cache, max_position)
        _call(q, mq, _C.apply_rotary, p, _options(backend, cpu_threads, cuda_config, q, mq, stream))
    if inplace:
        return q, k
    return q_out, k_out


# ---- QK-RMSNorm + rotary ---------------------------------------------------------------------

def _rotary_args(style: Optional[str], rotary_dim: Optional[int], head_dim: int, theta: float,
                 llama3: Optional[Mapping[str, Any]], cos_sin_cache: Any, like: Any) -> Tuple[Any, Any]:
    """(RotarySpec, the cache array to keep alive) of the rotary arguments the fused ops share with
    apply_rotary; style None is no rotation."""
    if style is None:
        return _C.RotarySpec(), None
    if style not in _STYLES:
        raise ValueError(f"style must be one of {', '.join(_STYLES)} or None; got {style!r}")
    rot = head_dim if rotary_dim is None else _core.check_int(rotary_dim, "rotary_dim", 0, head_dim, " (0 = head_dim)")
    cache, max_position = _cache_arg(cos_sin_cache, like, rot or head_dim)
    return _rotary_spec(_STYLES[style], rot, int(head_dim), theta, _llama3(llama3), cache, max_position), cache


def _bshd(m: _core.Meta, one_token_per_batch: bool = False) -> Tuple[int, int, Tuple[int, int, int]]:
    """(batch, seqlen, (batch_stride, seq_stride, head_stride)) of a 4-D (batch, seqlen, heads, d)
    array, or of a 3-D one: (tokens, heads, d) as batch 1 (apply_rotary's reading), or with
    one_token_per_batch (batch, heads, d), one token a sequence."""
    if len(m.shape) not in (3, 4):
        raise ValueError(f"{m.name} must be 3-D or 4-D (..., heads, head_dim); got shape {m.shape}")
    if m.shape[-1] > 1 and 0 not in m.shape and m.strides[-1] != 1:
        raise ValueError(f"{m.name}: the last dimension (head_dim) must be contiguous; got strides {m.strides}")
    if any(s < 0 for s in m.strides):
        raise ValueError(f"{m.name} has a negative stride {m.strides}; pass a contiguous copy")
    if len(m.shape) == 4:
        return m.shape[0], m.shape[1], _core._view(m, varlen=False)
    if one_token_per_batch:
        bs, hs = _core._view(m, varlen=True)[1:]
        return m.shape[0], 1, (bs, bs, hs)
    return 1, m.shape[0], _core._view(m, varlen=True)


def qk_norm_rope(q: Any, k: Any, q_weight: Any, k_weight: Any = None, positions: Any = None, *,
                 eps: float = 1e-6, weight_offset: float = 0.0, style: Optional[str] = "neox",
                 rotary_dim: Optional[int] = None, theta: float = 10000.0,
                 llama3: Optional[Mapping[str, Any]] = None, cos_sin_cache: Any = None,
                 inplace: bool = False, q_out: Any = None, k_out: Any = None, backend: str = "auto",
                 cpu_threads: int = 0, cuda_config: str = "", stream: Optional[int] = None) -> Tuple[Any, Any]:
    """Per-head RMSNorm of q and k (Qwen3, Gemma3), then the rotary embedding, in one pass.

    ``y = rotary(round(x * rsqrt(mean(x**2, -1) + eps) * (weight_offset + weight)))`` per head of
    head_dim elements, with q_weight for q's heads and k_weight for k's; the normed value is
    rounded to the dtype before the rotation, so the result equals ``rms_norm`` over each head
    followed by ``apply_rotary``, bit for bit (weight_offset 0). ``weight_offset=1.0`` is
    Gemma3's ``1 + weight``. q, k, positions and the rotary arguments are apply_rotary's (k may be
    None); ``style=None`` norms without rotating. Returns (q_out, k_out): new arrays, or q and k
    with ``inplace=True``.
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(qk_norm_rope, "qk_norm_rope", locals(), ("q", "k", "q_weight", "k_weight", "cos_sin_cache", "q_out", "k_out"))
        if r is not None:
            return r[0]
    inplace = _core.check_flag(inplace, "inplace")  # not any truthy value: inplace='no' wrote in place
    if _core.grad_needed(q, k, q_weight, k_weight):
        if inplace or q_out is not None or k_out is not None:
            _core.refuse_grad_in_place("qk_norm_rope", "with inplace=True or q_out= / k_out= writes in place",
                                       (q, k, q_weight, k_weight))
        return _core.no_backward("qk_norm_rope", lambda: qk_norm_rope(
            q, k, q_weight, k_weight, positions, eps=eps, weight_offset=weight_offset, style=style,
            rotary_dim=rotary_dim, theta=theta, llama3=llama3, cos_sin_cache=cos_sin_cache, backend=backend,
            cpu_threads=cpu_threads, cuda_config=cuda_config, stream=stream), (q, k, q_weight, k_weight))
    mq = _core.meta(q, "q")
    _check_dtype(mq, "qk_norm_rope")
    batch, seqlen, qv = _bshd(mq)
    heads_q, head_dim = mq.shape[-2], mq.shape[-1]
    ms = [mq]
    heads_k, kv = 0, (0, 0, 0)
    if k is not None:
        mk = _core.meta(k, "k")
        _check_dtype(mk, "qk_norm_rope")
        if len(mk.shape) != len(mq.shape) or tuple(mk.shape[:-2]) != tuple(mq.shape[:-2]) or mk.shape[-1] != head_dim:
            raise ValueError(f"k must have q's leading dims {tuple(mq.shape[:-2])} and head_dim {head_dim}; "
                             f"got shape {mk.shape}")
        heads_k, kv = mk.shape[-2], _bshd(mk)[2]
        ms.append(mk)
    for name, w, needed in (("q_weight", q_weight, True), ("k_weight", k_weight, k is not None)):
        if w is None:
            if needed:
                raise ValueError(f"{name} is required (shape (head_dim,) = ({head_dim},))")
            continue
        mw = _core.meta(w, name)
        if tuple(mw.shape) != (head_dim,):
            raise ValueError(f"{name} must be a contiguous (head_dim,) = ({head_dim},) array; got shape {mw.shape}")
        _check_weight_stride(mw)  # as rms_norm's weight: an expanded (stride 0) view is refused
        ms.append(mw)
    if k is None and k_weight is not None:
        raise ValueError("k_weight given without k")
    _check_same(ms, "qk_norm_rope")
    if inplace and (q_out is not None or k_out is not None):
        raise ValueError("inplace=True writes into q and k: do not pass q_out / k_out too")
    if inplace:
        _core.check_writable(q, "q")
        if k is not None:
            _core.check_writable(k, "k")
    else:
        q_out = _empty(q, mq.shape) if q_out is None else q_out
        if k is not None and k_out is None:
            k_out = _empty(k, ms[1].shape)
    spec, cache = _rotary_args(style, rotary_dim, head_dim, theta, llama3, cos_sin_cache, q)
    pos = _positions_arg(positions, q, "positions", ((batch * seqlen,), (batch, seqlen)))
    code = _core._DTYPE_CODES[mq.dtype]
    p = _C.QkNormRopeParams()
    p.batch, p.seqlen, p.heads_q, p.heads_k, p.head_dim = int(batch), int(seqlen), int(heads_q), int(heads_k), int(head_dim)
    p.eps, p.weight_offset = _core.check_eps(eps), _core.check_real(weight_offset, "weight_offset")
    p.q = _C.TensorView(_core.data_ptr(q), code, *qv)
    if k is not None:
        p.k = _C.TensorView(_core.data_ptr(k), code, *kv)
    if not inplace:
        p.q_out = _C.TensorView(_core.data_ptr(q_out), code, *_bshd(_check_out(q_out, "q_out", mq.shape, mq))[2])
        if k is not None:
            p.k_out = _C.TensorView(_core.data_ptr(k_out), code, *_bshd(_check_out(k_out, "k_out", ms[1].shape, ms[1]))[2])
    p.q_weight, p.k_weight = _core.data_ptr(q_weight), _core.data_ptr(k_weight)
    p.positions = _core.data_ptr(pos)
    p.rotary = spec
    opt = _options(backend, cpu_threads, cuda_config, q, mq, stream)
    if batch * seqlen > 0 and heads_q == 0 and k is not None and heads_k > 0:
        # q has no heads: k alone (the launch needs q's heads), normed with k_weight
        qk_norm_rope(k, None, k_weight, None, positions, eps=eps, weight_offset=weight_offset, style=style,
                     rotary_dim=rotary_dim, theta=theta, llama3=llama3, cos_sin_cache=cos_sin_cache, inplace=inplace,
                     q_out=None if inplace else k_out, backend=backend, cpu_threads=cpu_threads,
                     cuda_config=cuda_config, stream=stream)
    if batch * seqlen > 0 and heads_q > 0:
        _call(q, mq, _C.qk_norm_rope, p, opt)
    del cache  # kept alive through the call
    return (q, k) if inplace else (q_out, k_out)


# ---- rotary + KV-cache append ------------------------------------------------------------------

def rope_append_kv(k: Any, v: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, q: Any = None,
                   positions: Any = None, *, block_table: Any = None, style: Optional[str] = "neox",
                   rotary_dim: Optional[int] = None, theta: float = 10000.0,
                   llama3: Optional[Mapping[str, Any]] = None, cos_sin_cache: Any = None,
                   inplace_q: bool = False, q_out: Any = None, k_scale: Any = None, v_scale: Any = None,
                   backend: str = "auto", cpu_threads: int = 0, cuda_config: str = "",
                   stream: Optional[int] = None) -> Any:
    """Rotates the new keys and writes them and the new values into a KV cache (and rotates q).

    k, v: (batch, seqlen, heads_kv, head_dim[_v]) new tokens, or 3-D (batch, heads_kv, ...) with one
    token a sequence. k_cache / v_cache: contiguous (batch, capacity, heads_kv, ...) or, with
    block_table (batch, pages_per_seq) int32, paged (num_pages, page_size, heads_kv, ...), the
    layout of flash_attn_with_kvcache. Token s of sequence b goes to slot cache_seqlens[b] + s
    (int32 (batch,)); positions (int32, one per token; default: the slot) drive the rotary, whose
    arguments are apply_rotary's (style None: no rotation). q (optional, k's leading dims and
    head_dim) is rotated at the same positions into q_out (a new array) or in place (inplace_q).
    The cache is written in place; cache_seqlens is not advanced. Returns q_out (None without q).

    The cache holds k's dtype, or fp8 e4m3 (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn on numpy;
    both backends) with k_scale and v_scale (a number, or fp32 (heads_kv,) per KV head), as
    flash_attn_with_kvcache takes them: the cache then receives the codes of
    rotate(k) / k_scale (the rotation in fp32, not rounded to k's dtype first) and v / v_scale,
    rounded to nearest even and saturated at +-448, the bytes decode's append writes. q_out stays
    in q's dtype.
    """
    if _core.transforms_active():  # torch.func / forward AD (_core.guard)
        r = _core.guard(rope_append_kv, "rope_append_kv", locals(),
                        ("k", "v", "k_cache", "v_cache", "q", "cos_sin_cache", "q_out", "k_scale", "v_scale"))
        if r is not None:
            return r[0]
    _core.refuse_grad_in_place("rope_append_kv", "writes the cache in place", (k, v, q))
    inplace_q = _core.check_flag(inplace_q, "inplace_q")  # not any truthy value: inplace_q='no' rotated q in place
    mk, mv = _core.meta(k, "k"), _core.meta(v, "v")
    mkc, mvc = _core.meta(k_cache, "k_cache"), _core.meta(v_cache, "v_cache")
    for m in (mk, mv):
        _check_dtype(m, "rope_append_kv")
    for m in (mkc, mvc):
        if m.dtype != _core.FP8_E4M3:
            _check_dtype(m, "rope_append_kv")
    if mkc.dtype != mvc.dtype or (mkc.dtype != _core.FP8_E4M3 and mkc.dtype != mk.dtype):
        raise TypeError(f"k_cache and v_cache must share k's dtype, or both be {_core.FP8_E4M3} (with k_scale and "
                        f"v_scale); got k {mk.dtype}, k_cache {mkc.dtype}, v_cache {mvc.dtype}")
    fp8 = mkc.dtype == _core.FP8_E4M3
    batch, seqlen, knv = _bshd(mk, one_token_per_batch=True)
    heads_kv, head_dim = mk.shape[-2], mk.shape[-1]
    if tuple(mv.shape[:-1]) != tuple(mk.shape[:-1]):
        raise ValueError(f"v must have k's leading dims {tuple(mk.shape[:-1])}; got shape {mv.shape}")
    head_dim_v = mv.shape[-1]
    vnv = _bshd(mv, one_token_per_batch=True)[2]
    for mc, d in ((mkc, head_dim), (mvc, head_dim_v)):
        if len(mc.shape) != 4 or mc.shape[2] != heads_kv or mc.shape[3] != d:
            raise ValueError(f"{mc.name} must be 4-D (blocks, slots, heads_kv={heads_kv}, {d}); got shape {mc.shape}")
    if tuple(mkc.shape[:2]) != tuple(mvc.shape[:2]):
        raise ValueError(f"v_cache must have k_cache's leading dims {tuple(mkc.shape[:2])}; got {mvc.shape}")
    ms = [mk, mv]
    heads_q = 0
    if q is not None:
        mq = _core.meta(q, "q")
        _check_dtype(mq, "rope_append_kv")
        if len(mq.shape) != len(mk.shape) or tuple(mq.shape[:-2]) != tuple(mk.shape[:-2]) or mq.shape[-1] != head_dim:
            raise ValueError(f"q must have k's leading dims {tuple(mk.shape[:-2])} and head_dim {head_dim}; got {mq.shape}")
        heads_q = mq.shape[-2]
        ms.append(mq)
    elif q_out is not None or inplace_q:
        raise ValueError("q_out / inplace_q given without q")
    _check_same(ms, "rope_append_kv")
    _core._same_library("k, k_cache, v_cache", mk, mkc, mvc)
    for mc in (mkc, mvc):
        if mc.device != mk.device:
            raise ValueError(f"{mc.name} is on {mc.device} but k is on {mk.device} "
                             "(the tensors of rope_append_kv live on one device)")
    first = ms[0]
    code, cache_code = _core._DTYPE_CODES[mk.dtype], _core.CACHE_CODES[mkc.dtype]
    ks, vs = _core.kv_scales(k_scale, v_scale, fp8, int(heads_kv), k, mk.is_cuda, mk.device)
    lens = _positions_arg(cache_seqlens, k, "cache_seqlens", ((batch,),))
    pos = _positions_arg(positions, k, "positions", ((batch * seqlen,), (batch, seqlen)))
    cache = _C.KVCacheView()
    cache.k = _C.TensorView(_core.data_ptr(k_cache), cache_code, *_core._view(mkc, varlen=False))
    cache.v = _C.TensorView(_core.data_ptr(v_cache), cache_code, *_core._view(mvc, varlen=False))
    cache.k_scale, cache.v_scale = _core.data_ptr(ks), _core.data_ptr(vs)
    table = None
    if block_table is not None:
        table = _positions_arg(block_table, k, "block_table", ((batch, _core.meta(block_table, "block_table").shape[-1]),))
        cache.page_size, cache.num_pages = int(mkc.shape[1]), int(mkc.shape[0])
        cache.block_table = _core.data_ptr(table)
        cache.block_table_stride = cache.pages_per_seq = int(table.shape[1])
    else:
        if mkc.shape[0] != batch:
            raise ValueError(f"a contiguous k_cache must have batch {batch} rows; got shape {mkc.shape} "
                             "(pass block_table for a paged cache)")
        cache.capacity = int(mkc.shape[1])
    spec, tables = _rotary_args(style, rotary_dim, head_dim, theta, llama3, cos_sin_cache, k)
    p = _C.RopeAppendParams()
    p.batch, p.seqlen, p.heads_q, p.heads_kv = int(batch), int(seqlen), int(heads_q), int(heads_kv)
    p.head_dim, p.head_dim_v = int(head_dim), int(head_dim_v)
    p.k_new = _C.TensorView(_core.data_ptr(k), code, *knv)
    p.v_new = _C.TensorView(_core.data_ptr(v), code, *vnv)
    p.cache = cache
    p.cache_seqlens = _core.data_ptr(lens)
    p.positions = _core.data_ptr(pos)
    p.rotary = spec
    if q is not None:
        if inplace_q and q_out is not None:
            raise ValueError("inplace_q=True rotates q itself: do not pass q_out too")
        if inplace_q:
            _core.check_writable(q, "q")
        p.q = _C.TensorView(_core.data_ptr(q), code, *_bshd(mq, one_token_per_batch=True)[2])
        if not inplace_q:
            q_out = _empty(q, mq.shape) if q_out is None else q_out
            mqo = _check_out(q_out, "q_out", mq.shape, mq)
            p.q_out = _C.TensorView(_core.data_ptr(q_out), code, *_bshd(mqo, one_token_per_batch=True)[2])
    _core.check_writable(k_cache, "k_cache")
    _core.check_writable(v_cache, "v_cache")
    _core.check_caches_apart(k_cache, v_cache)  # as decode's append: the keys and values must not share bytes
    opt = _options(backend, cpu_threads, cuda_config, k, first, stream)
    if batch * seqlen > 0:
        _call(k, first, _C.rope_append_kv, p, opt)
    del tables, table, ks, vs  # kept alive through the call
    if q is None:
        return None
    return q if inplace_q else q_out
