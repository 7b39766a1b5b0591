"""Framework-neutral plumbing between the public functions and the C++ binding.

Describes numpy arrays and torch tensors alike (shape, element strides, dtype, device), checks
them with sentences a user can act on, and launches ``flashcpp::attention_forward`` by filling one
``_flashcpp.AttnParams`` (raw pointers, element strides) and one ``_flashcpp.RunOptions``. Nothing
here copies an input: strides go to C++ as they are, so an SDPA-layout tensor (B, H, N, D)
transposed to (B, N, H, D) runs in place.

The bottom of the package's imports: this module imports only the binding (and numpy, torch), so
every other module may import it.

Errors: wrong or mixed dtypes -> TypeError; device mismatch, bad shapes or strides -> ValueError;
what the C++ validator rejects -> ValueError (invalid) or NotImplementedError (unsupported).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _flashcpp as _C

try:  # torch is optional: the package works on numpy arrays without it.
    import torch
except ImportError:  # pragma: no cover - exercised in CI, which has no torch
    torch = None

_DTYPE_CODES = {"float16": _C.DTYPE_F16, "bfloat16": _C.DTYPE_BF16, "float32": _C.DTYPE_F32}
# Attention (forward and backward) also takes float64, on the fp64 reference backend only: what
# torch.autograd.gradcheck needs. "auto" picks that backend for float64 host arrays (resolve_backend).
_ATTN_DTYPE_CODES = dict(_DTYPE_CODES, float64=_C.DTYPE_F64)
if torch is not None:
    _TORCH_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                          torch.float64: "float64"}
_NUMPY_DTYPE_NAMES = {np.dtype(n): n for n in ("float16", "float32", "float64", "int32")}  # dtype.name is slow
_INT32_MAX = 2**31 - 1
BACKENDS = ("auto", "cpu", "cpu-reference", "cuda")


# ---- what the eager fast paths share (attention.py, fused.py, _decode.py) -------------------------
# A fast path takes plain tensors (not subclasses such as FakeTensor) of these dtypes, on the host or
# the current CUDA device, fills the binding's params itself, and leaves every check to the C++
# validator; anything else runs the general path.
FAST_TYPES = () if torch is None else (torch.Tensor, torch.nn.Parameter)
FAST_CODES = {} if torch is None else {torch.float16: _C.DTYPE_F16, torch.bfloat16: _C.DTYPE_BF16,
                                       torch.float32: _C.DTYPE_F32}
_raw_stream = None if torch is None else getattr(torch._C, "_cuda_getCurrentRawStream", None)


def fast_device(device: Any, dtype: Any, fp32_on_cuda: bool = False) -> Optional[Tuple[str, int]]:
    """(backend, stream) of a fast-path call on `device`: the host, or the current CUDA device with
    its current stream (torch's raw-stream accessor); None for anything else, and for fp32 on CUDA
    unless the kernels take it (`fp32_on_cuda`)."""
    if device.type == "cpu":
        return "cpu", 0
    if (device.type != "cuda" or _raw_stream is None or (dtype == torch.float32 and not fp32_on_cuda)
            or device.index != torch.cuda.current_device()):
        return None
    return "cuda", _raw_stream(device.index)


def is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


class Meta(NamedTuple):
    """What the checks need of an array: no data access, so it works on torch FakeTensors."""

    name: str
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  # elements
    dtype: str  # "float16", "bfloat16", "float32", or the library's own name for others
    device: Any  # "cpu" for numpy, a torch.device for torch
    is_cuda: bool
    lib: str  # "torch" or "numpy"


def meta(x: Any, name: str) -> Meta:
    if is_torch(x):
        if not torch.compiler.is_compiling() and x.is_neg():  # (dynamo cannot trace is_neg's bool)
            raise ValueError(f"{name} is a negative view (torch._neg_view: its memory holds the values' negatives); "
                             f"pass {name}.resolve_neg()")
        dt = _TORCH_DTYPE_NAMES.get(x.dtype)
        if dt is None:
            dt = str(x.dtype).replace("torch.", "")
        return Meta(name, tuple(x.shape), tuple(x.stride()), dt, x.device, x.device.type == "cuda", "torch")
    if isinstance(x, np.ndarray):
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError(f"{name} has byte strides {x.strides} that are not multiples of its "
                             f"element size {item}; pass np.ascontiguousarray({name})")
        dt = _NUMPY_DTYPE_NAMES.get(x.dtype)
        if dt is None:
            if not x.dtype.isnative:
                raise TypeError(f"{name} has non-native byte order ({x.dtype.str}); convert it with "
                                f"{name}.astype({name}.dtype.newbyteorder('='))")
            dt = x.dtype.name
        return Meta(name, tuple(x.shape), tuple(s // item for s in x.strides), dt, "cpu", False, "numpy")
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def check_place(m: Meta) -> None:
    """Refuses a torch tensor on a device flashcpp does not run on: a meta tensor has no data, and
    its null data pointer would reach the C++ validator as "x.data is null"."""
    if m.lib == "torch" and torch.device(m.device).type not in ("cpu", "cuda"):
        raise ValueError(f"{m.name} is on the {m.device} device: flashcpp runs on CPU and CUDA tensors (a meta tensor "
                         f"has no data to read)")


def check_same_kind(m: Optional[Meta], like: Meta) -> None:
    """Refuses an output (m; None: not given) of another library than the input it follows (a numpy
    out for a CPU tensor q would otherwise be told "must be on q's device (cpu); got cpu")."""
    if m is not None and m.lib != like.lib:
        kind = lambda lib: "a torch tensor" if lib == "torch" else "a numpy array"  # noqa: E731
        raise TypeError(f"{m.name} must be {kind(like.lib)} like {like.name}; got {kind(m.lib)}")


def _same_library(name_list: str, *xs: Any) -> None:
    kinds = {x.lib if isinstance(x, Meta) else
             "torch" if is_torch(x) else "numpy" if isinstance(x, np.ndarray) else type(x).__name__
             for x in xs}
    if len(kinds) > 1:
        raise TypeError(f"{name_list} must all be numpy arrays or all torch tensors "
                        f"(got a mix: {', '.join(sorted(kinds))})")


class Dims(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int    # of q and k
    head_dim_v: int  # of v and the output (AttnParams::head_dim_v); may differ from head_dim


def head_dim_error(name: str, d: Any) -> Optional[str]:
    """The C++ validator's sentence (src/core/head_dim_checks.h) for a head dim (`name`: head_dim or
    head_dim_v) that no backend takes, else None. SUPPORTED_HEAD_DIMS is every multiple of 8 in
    [8, 256], and every backend runs all of them; what a backend refuses beyond that (CUDA decode over
    an fp8 cache: head dims that are not multiples of 16) is left to C++, which says so as Unsupported
    (NotImplementedError)."""
    dims = _C.SUPPORTED_HEAD_DIMS
    if d in dims:
        return None
    step, top = dims[0], dims[-1]
    return f"{name} {d} is not supported (it must be a multiple of {step} in [{step}, {top}])"


def check_head_dims(head_dim: int, head_dim_v: int) -> None:
    """Refuses early (here, and in the torch ops' fakes at trace time) the head dims no backend
    takes, with the C++ sentence; C++ would refuse them too, but an empty problem never reaches it."""
    for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        msg = head_dim_error(name, d)
        if msg is not None:
            raise ValueError(msg)


def check_qkv(q: Any, k: Any, v: Any, varlen: bool = False) -> Tuple[Dims, Meta, Meta, Meta]:
    """Type, device, rank, stride and shape checks of q/k/v; returns the problem dims.

    Dense: q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim), v
    (batch, seqlen_k, heads_kv, head_dim_v). Varlen: q (total_q, heads_q, head_dim), k (total_k,
    heads_kv, head_dim), v (total_k, heads_kv, head_dim_v); batch and the sequence lengths come
    from cu_seqlens and are filled in by the caller (0 here). q and k share head_dim; v (and the
    output) may have another head dim, head_dim_v.
    """
    mq, mk, mv = meta(q, "q"), meta(k, "k"), meta(v, "v")
    if not (mq.lib == mk.lib == mv.lib):
        _same_library("q, k and v", mq, mk, mv)
    check_place(mq)
    for m in (mq, mk, mv):
        if m.dtype not in _ATTN_DTYPE_CODES:
            raise TypeError(f"{m.name} has dtype {m.dtype}; flashcpp attention takes float16, "
                            "bfloat16 or float32 (float64 on the CPU, through the fp64 reference)")
    if not (mq.dtype == mk.dtype == mv.dtype):
        raise TypeError(f"q, k and v must have the same dtype (got q {mq.dtype}, k {mk.dtype}, "
                        f"v {mv.dtype})")
    if not (mq.device == mk.device == mv.device):
        raise ValueError(f"q, k and v must be on the same device (got q on {mq.device}, "
                         f"k on {mk.device}, v on {mv.device})")
    rank = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for m in (mq, mk, mv):
        if len(m.shape) != rank:
            raise ValueError(f"{m.name} must be {rank}-D {layout}; got shape {m.shape}")
    for m in (mq, mk, mv):
        if 0 in m.shape:
            continue  # an empty array is never read; numpy gives it arbitrary strides
        if m.strides[-1] != 1 and m.shape[-1] > 1:
            raise ValueError(f"{m.name}: the last dimension (head_dim) must be contiguous (stride 1); "
                             f"got strides {m.strides}. Other dimensions may have any stride.")
        if any(s < 0 for s in m.strides):
            raise ValueError(f"{m.name} has a negative stride {m.strides}; flashcpp takes "
                             "non-negative strides (np.ascontiguousarray makes a copy)")
    if tuple(mk.shape[:-1]) != tuple(mv.shape[:-1]):
        raise ValueError(f"k and v must have the same shape except the last dimension (v's head_dim_v may "
                         f"differ from head_dim); got k {mk.shape}, v {mv.shape}")
    if mq.shape[-1] != mk.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim; got {mq.shape[-1]} and {mk.shape[-1]}")
    check_head_dims(mq.shape[-1], mv.shape[-1])
    heads_q, heads_kv = mq.shape[-2], mk.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k/v ({heads_kv}) "
                         "(GQA/MQA)")
    if varlen:
        dims = Dims(0, 0, 0, heads_q, heads_kv, mq.shape[-1], mv.shape[-1])
    else:
        if mq.shape[0] != mk.shape[0]:
            raise ValueError(f"q and k must have the same batch size; got {mq.shape[0]} and {mk.shape[0]}")
        dims = Dims(mq.shape[0], mq.shape[1], mk.shape[1], heads_q, heads_kv, mq.shape[-1], mv.shape[-1])
    for m in (mq, mk, mv):
        if any(n > _INT32_MAX for n in m.shape):
            raise ValueError(f"{m.name} has a dimension above 2**31-1: {m.shape}")
    return dims, mq, mk, mv


_INT_TYPES = (numbers.Integral, np.integer) + ((torch.SymInt,) if torch is not None and hasattr(torch, "SymInt") else ())


def _is_int(x: Any) -> bool:
    """A Python or numpy integer, or a torch.SymInt under torch.compile (not a bool, not a float
    that happens to be whole)."""
    return isinstance(x, _INT_TYPES) and not isinstance(x, (bool, np.bool_))


MAX_CPU_THREADS = 1024  # the CLI's --threads limit (tools/cli_checks.h kMaxThreads)

def check_int(value: Any, name: str, lo: int, hi: int = _INT32_MAX, what: str = "") -> int:
    """An int in [lo, hi] (a float is not truncated, a bool is not a count); returns it as int."""
    if not _is_int(value) or not lo <= int(value) <= hi:
        why = ("" if _is_int(value) else " (a bool is not a count)" if isinstance(value, (bool, np.bool_))
               else f" (a {type(value).__name__} is not truncated)")
        raise ValueError(f"{name} must be an int in [{lo}, {hi}]{what}; got {value!r}{why}")
    return int(value)


if torch is not None:
    from torch.autograd import forward_ad as _forward_ad
    _functorch_active = torch._C._are_functorch_transforms_active


_plain = threading.local()  # depth of plain_call() on this thread


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) or a forward-mode AD level is active
    (and this thread is not inside plain_call). The eager fast paths read raw data pointers, which
    transformed tensors do not have: under one, calls take the registered op or plain_call
    (check_transforms first). About 0.2 us on the eager path."""
    return (torch is not None and (_functorch_active() or _forward_ad._current_level >= 0)
            and not getattr(_plain, "depth", 0))


@contextlib.contextmanager
def plain_call():
    """Runs an entry point without a registered op whose arguments no torch.func transform wrapped
    (check_transforms found none) as if no transform were active: under one, every tensor an op
    makes is wrapped (and has no data pointer), so its outputs are made outside the transform and
    enter it as constants, which they are."""
    _plain.depth = getattr(_plain, "depth", 0) + 1
    try:
        with torch._C._DisableFuncTorch():
            yield
    finally:
        _plain.depth -= 1


def check_transforms(what: str, *tensors: Any, vmap: bool = True) -> bool:
    """Whether a call runs transformed, refusing the transforms flashcpp's ops cannot serve with a
    sentence, where torch itself would drop the tangent (forward mode: torch.func.jvp, jacfwd and
    torch.autograd.forward_ad give a custom op's outputs a zero or no tangent, silently) or raise
    about an autograd.Function the caller never wrote (torch.func.grad, vjp, jacrev: torch 2.11's
    custom ops have no functorch gradient). torch.func.vmap is served by the registered op's
    batching rule (_torch_ops) where the entry point has one (vmap=True);
    the others refuse it too. Only arguments the transform wrapped count (constants captured by
    the transformed function are plain tensors, and their calls run as usual); `tensors` are all
    of the call's tensor arguments (None and non-tensors are skipped). Returns True when some
    argument is transformed (the caller then takes its registered op). Called only when
    transforms_active(); inside torch.compile the check is the tracer's (it returns False)."""
    if torch.compiler.is_compiling():
        return False
    if _functorch_active():
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        if any(isinstance(t, torch.Tensor) and wrapped(t) for t in tensors):
            from torch._C._functorch import TransformType
            from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
            kinds = {i.key() for i in retrieve_all_functorch_interpreters()}
            if TransformType.Jvp in kinds:
                raise NotImplementedError(f"{what}: forward-mode AD (torch.func.jvp, jacfwd) is not implemented; "
                                          "torch would return a zero tangent. Use reverse mode (loss.backward() or "
                                          "torch.autograd.grad)")
            if TransformType.Grad in kinds:
                raise NotImplementedError(f"{what}: torch.func.grad, vjp and jacrev do not reach flashcpp's backward "
                                          "(torch's custom ops have no functorch gradient); use loss.backward() or "
                                          "torch.autograd.grad")
            if not vmap:
                raise NotImplementedError(f"{what} does not run under torch.func.vmap: loop over the batch (of "
                                          "flashcpp's calls, flash_attn_func and flash_attn_varlen_func take vmap)")
        return True  # under a transform every op's result is wrapped: the registered op, not raw pointers
    if _forward_ad._current_level >= 0:
        for t in tensors:
            if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
                raise NotImplementedError(f"{what}: forward-mode AD (torch.autograd.forward_ad) is not implemented; "
                                          "the output would carry no tangent. Use reverse mode (loss.backward() "
                                          "or torch.autograd.grad)")
    return False


def guard(fn: Any, what: str, params: dict, tensor_names: Tuple[str, ...], extra: Tuple[Any, ...] = ()
          ) -> Optional[Tuple[Any]]:
    """First statement of an entry point without a registered op when transforms_active(), with
    params = its locals() (its arguments): refuses what check_transforms refuses (vmap included)
    for the arguments named in tensor_names and the tensors in `extra` (held inside an argument);
    under a torch.func transform none of whose arguments is transformed, runs fn(**params) in
    plain_call and returns (its result,); else None (the call proceeds as usual)."""
    check_transforms(what, *(params.get(n) for n in tensor_names), *extra, vmap=False)
    if _functorch_active() and not torch.compiler.is_compiling():
        with plain_call():
            return (fn(**params),)
    return None


def check_cpu_threads(cpu_threads: Any) -> int:
    return check_int(cpu_threads, "cpu_threads", 0, MAX_CPU_THREADS, " (0 = choose: up to every core, fewer for small calls)")


def check_window(window_size: Any) -> Tuple[int, int]:
    if (window_size.__class__ is tuple and window_size == (-1, -1) and window_size[0].__class__ is int
            and window_size[1].__class__ is int):
        return -1, -1  # the default, first: the eager fast paths call this on every call
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, -1 meaning unbounded; "
                         f"got {window_size!r}") from None
    for x in (left, right):
        if not _is_int(x):
            why = ("a bool is not a window size" if isinstance(x, (bool, np.bool_)) else "a float is not truncated"
                   if isinstance(x, (float, np.floating)) else f"a {type(x).__name__} is not an int")
            raise ValueError(f"window_size must be a pair (left, right) of ints, -1 meaning unbounded; got "
                             f"{window_size!r} ({why})")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded); got {window_size!r}")
    if left > _INT32_MAX or right > _INT32_MAX:
        raise ValueError(f"window_size entries must be at most 2**31-1 (-1 = unbounded); got {window_size!r}")
    return left, right


# The C++ API reads softmax_scale 0 as "1/sqrt(head_dim)"; Python's default is None, and 0.0 is a
# scale like any other (every score 0: uniform weights over the visible keys). It goes to C++ as
# 2**-100: scores below 1e-26 for any |q.k| < 1e4, so exp() rounds each to 1 exactly (fp32 and
# fp64), and 1/scale stays finite for the CUDA kernels' softcap and ALiBi (kept in q.k units).
ZERO_SCALE = _C.ZERO_SCALE  # 2**-100, one value with the eager fast path's (python/src/eager_fast.cc)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TRUE_MIN = float(np.finfo(np.float32).smallest_subnormal)
_FLOAT32_HALF_TRUE_MIN = 2.0 ** -150  # at most this rounds to 0 in float32 (pure Python: torch.compile traces it)
# At least this rounds to inf in float32: halfway between float32's max (2**128 - 2**104) and 2**128,
# where round-to-nearest-even goes up; anything below rounds to the max (3.4028235e38 among them).
_FLOAT32_ROUNDS_TO_INF = 2.0 ** 128 - 2.0 ** 103


def _shown(x: Any) -> str:
    """x for a sentence: an array or tensor by kind, dtype and shape; anything else by a repr of at
    most 80 characters (an int past 4300 digits has none)."""
    if is_torch(x):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    if isinstance(x, np.ndarray):
        return f"a {x.dtype} numpy array of shape {x.shape}"
    try:
        r = repr(x)
    except ValueError:
        return f"an int of {x.bit_length()} bits"
    return r if len(r) <= 80 else f"{r[:60]}... ({len(r)} characters)"


def check_real(x: Any, name: str) -> float:
    """A real-number argument as a float: a Python or numpy number (a 0-dim array too) or a
    one-element real tensor (or anything else with __float__), never a bool, a string ("0.3" is not
    parsed) or a complex number (numpy would drop its imaginary part with only a warning). What
    float() refuses (an int past float's range, Decimal('sNaN')) gets the sentence too."""
    if x.__class__ is float:
        return x  # the common case: no further test
    if (isinstance(x, (bool, np.bool_, str, bytes, complex, np.complexfloating)) or not hasattr(type(x), "__float__")
            or (isinstance(x, np.ndarray) and (x.ndim != 0 or x.dtype.kind not in "iuf"))
            or (is_torch(x) and (x.numel() != 1 or x.dtype.is_complex or x.dtype == torch.bool))):
        raise TypeError(f"{name} must be a real number (a Python or numpy number, or a one-element tensor); "
                        f"got {_shown(x)}")
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:  # RuntimeError: torch (a meta tensor)
        kind = ValueError if isinstance(e, (ValueError, OverflowError)) else TypeError
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise kind(f"{name} must be a real number that float() takes; got {_shown(x)}, which it refuses "
                   f"({why})") from None


def check_softcap(x: Any, name: str = "softcap") -> float:
    """A softcap as a float. The kernels take float32, where 0 means off: a nonzero value that
    rounds to 0 there would turn the softcap off without a word, so it is refused."""
    c = check_real(x, name)
    if c != 0.0 and abs(c) <= _FLOAT32_HALF_TRUE_MIN:
        raise ValueError(f"{name} {x!r} rounds to 0 in float32, which turns the softcap off; pass 0 for no "
                         f"softcap, or a value of at least {_FLOAT32_TRUE_MIN:.1e}")
    return c


def check_eps(x: Any, name: str = "eps") -> float:
    """A norm's eps as a float. The kernels add it in float32: a positive eps that rounds to 0 there
    leaves an all-zero row at rsqrt(0) (NaN), and one past float32's range rounds to inf; both are
    refused here, as a negative or non-finite eps is refused by the C++ validator (which takes 0).
    A value a little past float32's max that rounds to it (3.4028235e38, as numpy prints the max)
    is taken. The eager fast paths call this only for an eps outside (2**-150, float32 max]."""
    e = check_real(x, name)
    if e == 0.0 or _FLOAT32_HALF_TRUE_MIN < e < _FLOAT32_ROUNDS_TO_INF:
        return e
    span = f"0 or a value in [{_FLOAT32_TRUE_MIN:.1e}, {_FLOAT32_MAX:.1e}], float32's positive range"
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"{name} {x!r} must be finite and >= 0: pass {span}")
    if e <= _FLOAT32_HALF_TRUE_MIN:
        raise ValueError(f"{name} {x!r} rounds to 0 in float32 (an all-zero row would give NaN): pass {span}")
    raise ValueError(f"{name} {x!r} rounds to inf in float32: pass {span}")


def check_flag(x: Any, name: str) -> bool:
    """A yes/no argument: True or False (a numpy bool, or the ints 0 and 1, too), not any truthy
    value ("False" is truthy)."""
    if not (isinstance(x, (bool, np.bool_)) or (isinstance(x, (int, np.integer)) and x in (0, 1))):
        if torch is not None and torch.compiler.is_compiling() and isinstance(x, np.ndarray) and x in (0, 1):
            return bool(x)  # torch.compile traces a numpy bool as a 0-dim ndarray: not a np.bool_ there
        raise TypeError(f"{name} must be True or False; got {x!r}")
    return bool(x)


def default_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    """The scale to run with: softmax_scale itself (only None means the default 1/sqrt(head_dim))."""
    if softmax_scale is not None:
        scale = check_real(softmax_scale, "softmax_scale")
        # The C++ message would say "0 selects 1/sqrt(head_dim)", which is not Python's rule.
        if not math.isfinite(scale) or abs(scale) > _FLOAT32_MAX:
            raise ValueError(f"softmax_scale {softmax_scale!r} is not a finite float32 (None selects "
                             f"1/sqrt(head_dim); 0.0 gives uniform weights)")
        # 0 (or a scale float32 rounds to 0, which C++ would read as the default) gives uniform weights
        return ZERO_SCALE if abs(scale) <= _FLOAT32_HALF_TRUE_MIN else scale
    if head_dim <= 0:
        raise ValueError(head_dim_error("head_dim", head_dim))
    return 1.0 / math.sqrt(head_dim)


def check_writable(x: Any, name: str) -> None:
    """Refuses a read-only numpy array as something flashcpp writes. A torch tensor that flashcpp
    writes in place while autograd records (grad mode on) must not require grad, as torch's own
    in-place ops refuse a leaf that does (flashcpp's in-place writes have no backward), and its
    version counter moves, as an in-place torch op moves it: a backward that saved the tensor
    before the write then says so instead of using the new values (under grad mode only: a
    tensor saved in a grad-mode forward and written later under torch.no_grad() is not caught)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} is a read-only numpy array (its WRITEABLE flag is off) and flashcpp would "
                         f"write into it; pass a writable array (np.array({name}) makes a copy)")
    if torch is not None and isinstance(x, torch.Tensor):
        check_inference_write(x, name)
        if torch.is_grad_enabled():
            if x.requires_grad:
                raise RuntimeError(f"flashcpp would write {name} in place, and {name} requires grad: flashcpp's "
                                   f"in-place writes have no backward (run under torch.no_grad(), or pass a tensor "
                                   f"that does not require grad)")
            torch._C._increment_version([x])  # a list: the one-tensor form costs ~9 us, this ~0.6


def check_inference_write(x: Any, name: str) -> None:
    """Refuses a torch inference tensor (made under torch.inference_mode()) as something flashcpp
    writes in place outside inference mode, as torch's own in-place ops refuse it: it has no version
    counter, and code outside inference mode may rely on it not changing. x is a torch tensor (the
    eager fast paths' C++ calls call this for a tensor whose is_inference() is True before they
    write it; is_inference() first, the cheaper test)."""
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name} is an inference tensor (made under torch.inference_mode()) and flashcpp would "
                           f"write it in place outside inference mode, which torch does not allow; run the call "
                           f"under torch.inference_mode(), or pass {name}.clone()")


def check_caches_apart(k_cache: Any, v_cache: Any) -> None:
    """An append writes the new keys into k_cache and the new values into v_cache: refused when the
    two share an element (one tensor or array passed twice, or overlapping views of one buffer).
    Views of one buffer that interleave without meeting stay allowed, as the C++ validator allows
    them (FlashInfer's (pages, 2, page_size, heads, dim) layout: k = buf[:, 0], v = buf[:, 1]).
    Cheap where it matters: two torch tensors whose storages' byte ranges do not meet cost a few
    attribute reads; views of one memory are decided by _views_meet (numpy arrays: after a bounds
    test). Two storages are not two memories: torch.from_numpy of overlapping slices of one array
    gives two storages over shared bytes, so the test is on the bytes, not on the storage."""
    if is_torch(k_cache):
        sk, sv = k_cache.untyped_storage(), v_cache.untyped_storage()
        k0, v0 = sk.data_ptr(), sv.data_ptr()
        if not k0 or not v0 or k0 + sk.nbytes() <= v0 or v0 + sv.nbytes() <= k0:
            return  # apart (a null pointer holds no bytes: a meta tensor is the caller's check_place's)
        if k_cache.numel() == 0 or v_cache.numel() == 0:
            return
        item = k_cache.element_size()
        layout = (tuple(k_cache.shape), k_cache.stride(), tuple(v_cache.shape), v_cache.stride())
    else:
        if k_cache.size == 0 or v_cache.size == 0 or not np.may_share_memory(k_cache, v_cache):
            return
        item = k_cache.itemsize
        layout = (k_cache.shape, tuple(st // item for st in k_cache.strides), v_cache.shape,
                  tuple(st // item for st in v_cache.strides))
    delta = data_ptr(v_cache) - data_ptr(k_cache)
    if delta == 0 or (delta % item == 0 and _views_meet(delta // item, *layout)):
        raise ValueError("k_cache and v_cache share memory (one tensor passed twice, or overlapping views of one "
                         "buffer), and the append would write the new keys and values into the same bytes; pass "
                         "two separate caches")


if torch is not None:  # what the C++ fast paths read tensors with and call (python/src/eager_fast.cc)
    _C._eager_bind(torch.Tensor, torch.nn.Parameter, torch.float16, torch.bfloat16, torch.float32, torch.int32,
                   getattr(torch._C, "_cuda_getDevice", None), _raw_stream, torch.empty_like, check_inference_write,
                   MAX_CPU_THREADS, torch.is_grad_enabled, torch._C._increment_version, check_eps, check_window,
                   check_caches_apart)


def _dense(shape: Tuple[int, ...], strides: Tuple[int, ...]) -> bool:
    """Row-major contiguous (size-1 dims aside): the view covers its element range with no gap and
    no element twice (an element count equal to the span is not enough: strides (3, 3) over (5, 5)
    revisit elements and skip others)."""
    expected = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if st != expected:
                return False
            expected *= n
    return True


def _views_meet(delta: int, shape_k: Tuple[int, ...], strides_k: Tuple[int, ...], shape_v: Tuple[int, ...],
                strides_v: Tuple[int, ...]) -> bool:
    """Whether strided views k (at element 0) and v (at element `delta`) of one buffer share an
    element. Exact where both are contiguous, or where both step their dimensions by one set of
    positive strides (views of one buffer): then they meet when delta = sum(i_d * stride_d) with
    -(v's extent_d - 1) <= i_d <= k's extent_d - 1, searched from the largest stride down. Other
    layouts, or a search past a few hundred steps, count as apart (the caller's to keep so)."""
    if any(st < 0 for st in strides_k + strides_v):
        return False
    span_k = 1 + sum((n - 1) * st for n, st in zip(shape_k, strides_k))
    span_v = 1 + sum((n - 1) * st for n, st in zip(shape_v, strides_v))
    if -span_v >= delta or delta >= span_k:
        return False  # their element ranges do not meet
    if _dense(shape_k, strides_k) and _dense(shape_v, strides_v):
        return True  # contiguous blocks whose ranges meet
    if len(shape_k) != len(shape_v):
        return False
    dims = []
    for st_k, st_v, nk, nv in zip(strides_k, strides_v, shape_k, shape_v):
        if nk > 1 or nv > 1:
            if st_k != st_v or st_k == 0:
                return False
            dims.append((st_k, nk, nv))
    dims.sort(reverse=True)
    up, down = [0] * (len(dims) + 1), [0] * (len(dims) + 1)  # what the dims after d reach, up (k) and down (v)
    for d in range(len(dims) - 1, -1, -1):
        st, nk, nv = dims[d]
        up[d], down[d] = up[d + 1] + (nk - 1) * st, down[d + 1] + (nv - 1) * st
    steps = [0]

    def walk(d: int, rest: int) -> bool:
        if d == len(dims):
            return rest == 0
        st, nk, nv = dims[d]
        lo = max(-(nv - 1), -((up[d + 1] - rest) // st))  # rest - i * st <= up[d + 1]
        hi = min(nk - 1, (rest + down[d + 1]) // st)      # rest - i * st >= -down[d + 1]
        for i in range(lo, hi + 1):
            steps[0] += 1
            if steps[0] > 256:
                return False
            if walk(d + 1, rest - i * st):
                return True
        return False
    return walk(0, delta)


def grad_needed(*tensors: Any) -> bool:
    """Autograd records (grad mode on) and one of these torch tensors requires grad. (A plain loop:
    on the eager fast paths' budget, any() over a generator costs about a microsecond more.)"""
    if torch is None or not torch.is_grad_enabled():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


if torch is not None:
    class _NoBackward(torch.autograd.Function):
        """Runs an op that has no backward so that its outputs still depend on its inputs: a
        backward through them raises, where it would otherwise leave the inputs' gradients
        silently without this op's share."""

        @staticmethod
        def forward(ctx: Any, op: str, run: Any, *inputs: Any) -> Any:
            ctx.op = op
            return run()

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            raise NotImplementedError(f"{ctx.op} has no backward in flashcpp: its outputs carry no gradient to its "
                                      f"inputs. Call it under torch.no_grad() (inference), or use a differentiable "
                                      f"op where gradients are needed")


def no_backward(op: str, run: Any, inputs: Any) -> Any:
    """run() (a call of op whose outputs are new tensors) for inputs of which some require grad
    under grad mode: the outputs get a grad_fn whose backward raises NotImplementedError."""
    return _NoBackward.apply(op, run, *[t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad])


def refuse_grad_in_place(op: str, what: str, inputs: Any) -> None:
    """An op that writes its results in place (``what``) has no backward: refused when autograd would
    need one (grad mode on and an input requires grad)."""
    if grad_needed(*inputs):
        raise NotImplementedError(f"{op} {what} and has no backward, and an input requires grad: call it under "
                                  f"torch.no_grad() (inference), or use a differentiable op where gradients are needed")


def check_alibi(alibi: Any, dims: Dims, mq: Meta) -> int:
    """Checks ALiBi slopes ((heads_q,) or (batch, heads_q), fp32, contiguous, q's device).
    Returns alibi_batch_stride (0 or heads_q)."""
    m = meta(alibi, "alibi_slopes")
    if m.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32; got {m.dtype}")
    if m.device != mq.device:
        raise ValueError(f"alibi_slopes must be on q's device ({mq.device}); got {m.device}")
    h = dims.heads_q
    if m.shape == (h,):
        batch_stride = 0
    elif len(m.shape) == 2 and m.shape[1] == h and (dims.batch == 0 or m.shape[0] == dims.batch):
        batch_stride = h
    else:
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({h},) or (batch, heads_q); "
                         f"got {m.shape}")
    if m.strides[-1] != 1 or (len(m.shape) == 2 and m.shape[0] > 1 and m.strides[0] != h):
        raise ValueError(f"alibi_slopes must be contiguous; got strides {m.strides}")
    return batch_stride


def check_cu_seqlens(cu: Any, name: str, mq: Meta) -> int:
    """Checks a cu_seqlens array (int32, 1-D, contiguous, q's device); returns batch."""
    m = meta(cu, name)
    if m.dtype != "int32":
        raise TypeError(f"{name} must be int32; got {m.dtype}")
    if m.device != mq.device:
        raise ValueError(f"{name} must be on q's device ({mq.device}); got {m.device}")
    if len(m.shape) != 1 or m.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (batch + 1,); got shape {m.shape}")
    if m.shape[0] > 1 and m.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous; got stride {m.strides}")
    return m.shape[0] - 1


def check_cu_seqlens_values(cu: np.ndarray, name: str, total: int, max_seqlen: int) -> None:
    """Host-side value checks (CPU tensors only: reading device memory would synchronize).
    The C++ TensorView does not know the packed length, so this is what keeps reads in bounds."""
    if cu.size == 0:
        return
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0; got {int(cu[0])}")
    lens = np.diff(cu.astype(np.int64))
    if lens.size and lens.min() < 0:
        raise ValueError(f"{name} must be non-decreasing; got {cu.tolist()}")
    if int(cu[-1]) > total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the {total} packed tokens")
    if lens.size and int(lens.max()) > max_seqlen:
        raise ValueError(f"a sequence of {int(lens.max())} tokens exceeds the max_seqlen passed "
                         f"for {name} ({max_seqlen})")


class BlockSparseSpec(NamedTuple):
    """What attention needs of a block-sparse mask: the fields of ``flashcpp.BlockSparse`` of
    the same names (the torch op carries them as a tensor list and an int list, SPARSE_ARRAYS and
    SPARSE_SIZES, and rebuilds one of these)."""

    row_ptr: Any        # int32 (num_batch * num_heads * num_q_blocks + 1,)
    col_idx: Any        # int32 (listed blocks,)
    partial: Any        # int32 (listed blocks,): -1 = full block, p >= 0 = element mask p
    element_masks: Any  # uint64 (or int64 holding the same bits) (num_partial, block_m, ceil(block_n / 64))
    block_m: int
    block_n: int
    num_batch: int
    num_heads: int
    num_q_blocks: int
    num_k_blocks: int
    seqlen_q: int
    seqlen_k: int


SPARSE_ARRAYS = BlockSparseSpec._fields[:4]
SPARSE_SIZES = BlockSparseSpec._fields[4:]


def sparse_spec(bs: Any) -> BlockSparseSpec:
    """The BlockSparseSpec of a flashcpp.BlockSparse (or of anything with its fields)."""
    return BlockSparseSpec(*(getattr(bs, f) for f in BlockSparseSpec._fields))


def sparse_to_lists(bs: Optional[BlockSparseSpec]) -> Tuple[Optional[list], Optional[list]]:
    """(tensors, sizes): how the torch ops take a block-sparse mask (None, None = no mask)."""
    if bs is None:
        return None, None
    return [getattr(bs, f) for f in SPARSE_ARRAYS], [int(getattr(bs, f)) for f in SPARSE_SIZES]


def sparse_to_args(bs: Optional[BlockSparseSpec]) -> tuple:
    """The op arguments of a mask: its four arrays, then the sizes list (all None = no mask).
    Four Optional[Tensor] arguments rather than one Optional[List[Tensor]]: torch.library's
    schema inference (torch 2.11) has no optional list of tensors."""
    tensors, sizes = sparse_to_lists(bs)
    return (*(tensors if tensors is not None else (None,) * len(SPARSE_ARRAYS)), sizes)


def sparse_from_args(row_ptr: Any, col_idx: Any, partial: Any, element_masks: Any,
                     sizes: Optional[list]) -> Optional[BlockSparseSpec]:
    tensors = [row_ptr, col_idx, partial, element_masks]
    return sparse_from_lists(None if all(t is None for t in tensors) else tensors, sizes)


def sparse_from_lists(tensors: Optional[list], sizes: Optional[list]) -> Optional[BlockSparseSpec]:
    if tensors is None and sizes is None:
        return None
    if tensors is None or sizes is None or len(tensors) != len(SPARSE_ARRAYS) or len(sizes) != len(SPARSE_SIZES):
        raise ValueError(f"block_sparse takes the tensors [{', '.join(SPARSE_ARRAYS)}] (all of them) and block_sparse_sizes "
                         f"the ints [{', '.join(SPARSE_SIZES)}], both or neither")
    return BlockSparseSpec(*tensors, *sizes)


def check_block_sparse(bs: BlockSparseSpec, dims: Dims, mq: Meta) -> None:
    """Sizes, dtypes, devices and array shapes of a block-sparse mask against the problem. Reads
    no values (so it works on FakeTensors and device arrays); check_block_sparse_values reads the
    host ones before a launch."""
    if (bs.seqlen_q, bs.seqlen_k) != (dims.seqlen_q, dims.seqlen_k):
        raise ValueError(f"block_sparse was built for seqlen_q={bs.seqlen_q}, seqlen_k={bs.seqlen_k}, but q and k "
                         f"have seqlen_q={dims.seqlen_q}, seqlen_k={dims.seqlen_k}; build it for these lengths")
    if bs.block_m <= 0 or bs.block_n <= 0:
        raise ValueError(f"block_sparse.block_m and block_n must be > 0; got {bs.block_m} and {bs.block_n}")
    nq, nk = -(-dims.seqlen_q // bs.block_m), -(-dims.seqlen_k // bs.block_n)
    if (bs.num_q_blocks, bs.num_k_blocks) != (nq, nk):
        raise ValueError(f"block_sparse has {bs.num_q_blocks} x {bs.num_k_blocks} blocks, but ceil(seqlen_q "
                         f"{dims.seqlen_q} / block_m {bs.block_m}) x ceil(seqlen_k {dims.seqlen_k} / block_n "
                         f"{bs.block_n}) = {nq} x {nk}")
    if bs.num_batch not in (1, dims.batch):
        raise ValueError(f"block_sparse.num_batch {bs.num_batch} must be 1 (one mask for every sequence) or "
                         f"batch {dims.batch}")
    if bs.num_heads not in (1, dims.heads_q):
        raise ValueError(f"block_sparse.num_heads {bs.num_heads} must be 1 (one mask for every head) or heads_q "
                         f"{dims.heads_q} (one mask per query head, also with GQA)")
    ms = {f: meta(getattr(bs, f), f"block_sparse.{f}") for f in SPARSE_ARRAYS}
    for f in ("row_ptr", "col_idx", "partial"):
        if ms[f].dtype != "int32":
            raise TypeError(f"block_sparse.{f} must be int32; got {ms[f].dtype}")
    me = ms["element_masks"]
    if me.dtype not in ("uint64", "int64"):
        raise TypeError(f"block_sparse.element_masks must hold 64-bit words (uint64, or int64 as "
                        f"BlockSparse.to(device) stores them); got {me.dtype}")
    for m in ms.values():
        if m.device != mq.device:
            raise ValueError(f"{m.name} must be on q's device ({mq.device}); got {m.device}")
    rows = bs.num_batch * bs.num_heads * bs.num_q_blocks
    if ms["row_ptr"].shape != (rows + 1,):
        raise ValueError(f"block_sparse.row_ptr must have shape (num_batch * num_heads * num_q_blocks + 1,) = "
                         f"({rows + 1},); got {ms['row_ptr'].shape}")
    mc, mp = ms["col_idx"], ms["partial"]
    if len(mc.shape) != 1 or mp.shape != mc.shape:
        raise ValueError(f"block_sparse.col_idx and partial must be 1-D with one entry per listed block; got "
                         f"shapes {mc.shape} and {mp.shape}")
    words = (bs.block_n + 63) // 64
    if len(me.shape) != 3 or me.shape[1:] != (bs.block_m, words):
        raise ValueError(f"block_sparse.element_masks must have shape (num_partial, block_m, ceil(block_n / 64)) "
                         f"= (num_partial, {bs.block_m}, {words}); got {me.shape}")
    for m in ms.values():
        if 0 in m.shape:
            continue  # never read; numpy and torch give empty arrays arbitrary strides
        contiguous = 1
        for n, s in reversed(list(zip(m.shape, m.strides))):
            if n > 1 and s != contiguous:
                raise ValueError(f"{m.name} must be contiguous; got strides {m.strides}")
            contiguous *= n


def check_block_sparse_values(bs: BlockSparseSpec) -> None:
    """Host arrays only (reading device memory would synchronize). The C++ validator checks
    row_ptr[0] == 0, that row_ptr does not decrease, and every col_idx / partial entry it walks,
    but cannot know the arrays' lengths: this keeps its walk inside col_idx and partial."""
    row_ptr = bs.row_ptr.numpy() if is_torch(bs.row_ptr) else bs.row_ptr
    listed = bs.col_idx.shape[0]
    if int(row_ptr[-1]) != listed:
        raise ValueError(f"block_sparse.row_ptr[-1] = {int(row_ptr[-1])} must equal the number of listed blocks "
                         f"(len(col_idx) = {listed})")


def block_sparse_mask(bs: BlockSparseSpec) -> Any:
    """The binding's BlockSparseMask of a checked mask: its arrays as data pointers (the caller
    keeps the arrays alive through the call)."""
    m = _C.BlockSparseMask()
    row_ptr = data_ptr(bs.row_ptr)
    m.row_ptr = row_ptr
    # An empty torch tensor may have a null data pointer, which the validator refuses. With no
    # listed block col_idx and partial are never read, so row_ptr's (never empty) memory stands in.
    m.col_idx = data_ptr(bs.col_idx) or row_ptr
    m.partial = data_ptr(bs.partial) or row_ptr
    m.element_masks = data_ptr(bs.element_masks)
    m.num_partial = int(bs.element_masks.shape[0])
    m.block_m, m.block_n = int(bs.block_m), int(bs.block_n)
    m.num_batch, m.num_heads = int(bs.num_batch), int(bs.num_heads)
    m.num_q_blocks, m.num_k_blocks = int(bs.num_q_blocks), int(bs.num_k_blocks)
    return m


def _view(m: Meta, varlen: bool) -> Tuple[int, int, int]:
    """(batch_stride, seq_stride, head_stride) in elements. A dimension of size 1 is never
    stepped over, and torch leaves its stride arbitrary; give it the tensor's extent instead so
    the validator sees a stride that cannot overlap anything."""
    extent = 1 + sum((n - 1) * s for n, s in zip(m.shape, m.strides) if n > 0)
    strides = [s if n > 1 else extent for n, s in zip(m.shape, m.strides)]
    if varlen:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]


def tensor_view(x: Any, m: Meta, dtype_code: int, varlen: bool = False) -> Any:
    """The binding's TensorView of x (a 4-D (batch, seqlen, heads, head_dim) array, or 3-D packed
    (total, heads, head_dim) with varlen)."""
    return _C.TensorView(data_ptr(x), dtype_code, *_view(m, varlen))


def data_ptr(x: Any) -> int:
    if x is None:
        return 0
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    return x.data_ptr()


def resolve_backend(backend: str, mq: Meta) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        # float64 runs on the fp64 reference only (gradcheck); elsewhere the C++ validator says why not
        return "cuda" if mq.is_cuda else "cpu-reference" if mq.dtype == "float64" else "cpu"
    if backend == "cuda" and not mq.is_cuda:
        raise ValueError(f"backend 'cuda' needs CUDA tensors; q is on {mq.device}")
    if backend != "cuda" and mq.is_cuda:
        raise ValueError(f"backend {backend!r} runs on the host; q is on {mq.device}")
    return backend


def _fill_mask(mask: Any, mq: Meta, *, varlen: bool, causal: bool, window: Tuple[int, int], softcap: float,
               alibi: Any, alibi_batch_stride: int, global_tokens: int, global_queries: bool, cu_seqlens_q: Any,
               cu_seqlens_k: Any, block_sparse: Optional[BlockSparseSpec]) -> Any:
    """Fills a _flashcpp.MaskParams (of AttnParams or AttnBackwardParams); returns the BlockSparseMask
    it points at (or None), which the caller holds until the call returns."""
    mask.causal = check_flag(causal, "causal")
    mask.window_left, mask.window_right = int(window[0]), int(window[1])
    mask.softcap = check_softcap(softcap)
    mask.alibi_slopes, mask.alibi_batch_stride = data_ptr(alibi), int(alibi_batch_stride)
    mask.global_tokens = check_int(global_tokens, "global_tokens", 0)
    mask.global_queries = bool(global_queries)
    if varlen:
        mask.cu_seqlens_q, mask.cu_seqlens_k = data_ptr(cu_seqlens_q), data_ptr(cu_seqlens_k)
        mask.total_q = int(mq.shape[0])  # the packed row count (LSE layout, batch-0 fill)
    sparse = None if block_sparse is None else block_sparse_mask(block_sparse)
    if sparse is not None:
        mask.block_sparse = sparse
    return sparse


def launch(q: Any, k: Any, v: Any, out: Any, lse: Any, dims: Dims, mq: Meta, mk: Meta, mv: Meta,
           *, varlen: bool = False, softmax_scale: float, causal: bool = False,
           window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi: Any = None,
           alibi_batch_stride: int = 0, global_tokens: int = 0, global_queries: bool = False,
           cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
           block_sparse: Optional[BlockSparseSpec] = None, rotary: Any = None,
           backend: str = "auto", cpu_threads: int = 0, cuda_config: str = "", stream: Optional[int] = None,
           select_only: bool = False) -> Any:
    """Fills one AttnParams and one RunOptions from checked inputs and makes the call. `out`/`lse`
    are allocated by the caller (lse may be None); `rotary` is a filled _flashcpp.AttnRotary or
    None. Returns None, or the kernel choice tuple with select_only."""
    backend = resolve_backend(backend, mq)
    if block_sparse is not None and not mq.is_cuda:
        check_block_sparse_values(block_sparse)
    mo = meta(out, "out")
    if stream is None:
        stream = 0
        if mq.is_cuda:
            stream = torch.cuda.current_stream(q.device).cuda_stream
    code = _ATTN_DTYPE_CODES[mq.dtype]
    p = _C.AttnParams()
    p.batch, p.seqlen_q, p.seqlen_k = dims.batch, dims.seqlen_q, dims.seqlen_k
    p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v = dims.heads_q, dims.heads_kv, dims.head_dim, dims.head_dim_v
    p.q, p.k = tensor_view(q, mq, code, varlen), tensor_view(k, mk, code, varlen)
    p.v, p.o = tensor_view(v, mv, code, varlen), tensor_view(out, mo, code, varlen)
    p.lse = data_ptr(lse)
    p.softmax_scale = float(softmax_scale)
    # Held here until the call returns: the mask points at it (the binding copies it for the call).
    sparse = _fill_mask(p.mask, mq, varlen=varlen, causal=causal, window=window, softcap=softcap, alibi=alibi,
                        alibi_batch_stride=alibi_batch_stride, global_tokens=global_tokens,
                        global_queries=global_queries, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        block_sparse=block_sparse)
    if rotary is not None:
        p.rotary = rotary
    opt = _C.RunOptions(backend, int(stream), check_cpu_threads(cpu_threads), str(cuda_config))
    call = _C.select_kernel if select_only else _C.attention_forward
    if mq.is_cuda and q.device.index is not None and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # the C++ launch uses the current device
            return call(p, opt)
    return call(p, opt)


def launch_backward(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dlse: Any, dq: Any, dk: Any, dv: Any,
                    dims: Dims, mq: Meta, mk: Meta, mv: Meta, *, varlen: bool = False, softmax_scale: float,
                    causal: bool = False, window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi: Any = None, alibi_batch_stride: int = 0, global_tokens: int = 0,
                    global_queries: bool = False, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                    block_sparse: Optional[BlockSparseSpec] = None, deterministic: bool = False,
                    backend: str = "auto", cpu_threads: int = 0) -> None:
    """flashcpp::attention_backward on checked inputs: fills one AttnBackwardParams (the forward's
    q, k, v, out and lse, dout and dlse (None = 0), the caller's dq, dk, dv shaped like q, k, v: dv
    and dout at head_dim_v), asks for the workspace size, allocates the workspace on q's device (torch) or the host (numpy) and makes the
    call on the current stream. CUDA: the mma.sync backward (src/cuda/backward); a refusal is raised
    as NotImplementedError."""
    backend = resolve_backend(backend, mq)
    if block_sparse is not None and not mq.is_cuda:
        check_block_sparse_values(block_sparse)
    code = _ATTN_DTYPE_CODES[mq.dtype]
    p = _C.AttnBackwardParams()
    p.batch, p.seqlen_q, p.seqlen_k = dims.batch, dims.seqlen_q, dims.seqlen_k
    p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v = dims.heads_q, dims.heads_kv, dims.head_dim, dims.head_dim_v
    p.q, p.k, p.v = tensor_view(q, mq, code, varlen), tensor_view(k, mk, code, varlen), tensor_view(v, mv, code, varlen)
    p.o, p.dout = tensor_view(out, meta(out, "out"), code, varlen), tensor_view(dout, meta(dout, "dout"), code, varlen)
    p.dq, p.dk = tensor_view(dq, meta(dq, "dq"), code, varlen), tensor_view(dk, meta(dk, "dk"), code, varlen)
    p.dv = tensor_view(dv, meta(dv, "dv"), code, varlen)
    p.lse, p.dlse = data_ptr(lse), data_ptr(dlse)
    p.softmax_scale = float(softmax_scale)
    p.deterministic = bool(deterministic)
    sparse = _fill_mask(p.mask, mq, varlen=varlen, causal=causal, window=window, softcap=softcap, alibi=alibi,
                        alibi_batch_stride=alibi_batch_stride, global_tokens=global_tokens,
                        global_queries=global_queries, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        block_sparse=block_sparse)
    if varlen:
        p.total_k = int(mk.shape[0])  # the packed key rows: rows past cu_seqlens_k[-1] get dk = dv = 0
    stream = torch.cuda.current_stream(q.device).cuda_stream if mq.is_cuda else 0
    # FLASHCPP_BWD_CONFIG: the CUDA backward's RunOptions::cuda_config ("sm80", "sm90", "sm90ws"; unset =
    # the selector's choice), for kernel A/B measurements (scripts/bwd_ab.py, docs/backward.md).
    opt = _C.RunOptions(backend, int(stream), check_cpu_threads(cpu_threads), os.environ.get("FLASHCPP_BWD_CONFIG", ""))

    def call() -> None:
        nbytes = _C.attention_backward_workspace_size(p, opt)
        workspace = None  # held until the call returns (CUDA: the caching allocator orders its reuse on the stream)
        if nbytes:
            if is_torch(q):
                workspace = torch.empty((nbytes + 255,), dtype=torch.uint8, device=q.device)
            else:
                workspace = np.empty((nbytes + 255,), dtype=np.uint8)
            p.workspace = (data_ptr(workspace) + 255) // 256 * 256
            p.workspace_bytes = nbytes
        _C.attention_backward(p, opt)

    if mq.is_cuda and q.device.index is not None and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            call()
    else:
        call()


def check_out(out: Any, lse: Any, shape_o: Tuple[int, ...], shape_lse: Tuple[int, ...], mq: Meta) -> None:
    """Checks caller-provided outputs of the low-level `attention` function."""
    mo = meta(out, "out")
    ml = None if lse is None else meta(lse, "lse")
    check_same_kind(mo, mq)
    check_same_kind(ml, mq)
    check_writable(out, "out")
    if lse is not None:
        check_writable(lse, "lse")
    if mo.shape != tuple(shape_o):
        raise ValueError(f"out must have shape {tuple(shape_o)}; got {mo.shape}")
    if mo.dtype != mq.dtype:
        raise TypeError(f"out must have q's dtype {mq.dtype}; got {mo.dtype}")
    if mo.device != mq.device:
        raise ValueError(f"out must be on q's device ({mq.device}); got {mo.device}")
    if 0 in mo.shape:
        pass  # nothing is written
    elif mo.strides[-1] != 1 and mo.shape[-1] > 1:
        raise ValueError(f"out: the last dimension (head_dim) must be contiguous; got strides {mo.strides}")
    elif any(s < 0 for s in mo.strides):
        raise ValueError(f"out has a negative stride {mo.strides}")
    if lse is not None:
        if ml.shape != tuple(shape_lse) or ml.dtype != "float32" or ml.device != mq.device:
            raise ValueError(f"lse must be a float32 array of shape {tuple(shape_lse)} on {mq.device}; "
                             f"got {ml.dtype} {ml.shape} on {ml.device}")
        contiguous = 1
        for n, s in reversed(list(zip(ml.shape, ml.strides))):
            if n > 1 and s != contiguous and 0 not in ml.shape:
                raise ValueError(f"lse must be contiguous; got strides {ml.strides}")
            contiguous *= n


# ---- merging partial states (flashcpp.merge_attention_states) ----------------------------------

def check_merge(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> None:
    ma, mb = meta(v_a, "v_a"), meta(v_b, "v_b")
    sa, sb = meta(s_a, "s_a"), meta(s_b, "s_b")
    _same_library("v_a, s_a, v_b and s_b", v_a, s_a, v_b, s_b)
    for m in (ma, mb):
        if m.dtype not in _DTYPE_CODES:
            raise TypeError(f"{m.name} has dtype {m.dtype}; merge takes float16, bfloat16 or float32")
    if ma.dtype != mb.dtype:
        raise TypeError(f"v_a and v_b must have the same dtype; got {ma.dtype} and {mb.dtype}")
    for m in (sa, sb):
        if m.dtype != "float32":
            raise TypeError(f"{m.name} (an LSE) must be float32; got {m.dtype}")
    if not (ma.device == mb.device == sa.device == sb.device):
        raise ValueError(f"v_a, s_a, v_b and s_b must be on one device; got {ma.device}, {sa.device}, "
                         f"{mb.device}, {sb.device}")
    if len(ma.shape) < 1 or len(mb.shape) < 1:
        raise ValueError(f"v_a and v_b must have at least one dimension, (..., head_dim); got shapes {ma.shape} and "
                         f"{mb.shape} (a 0-dim tensor has no head_dim)")
    if ma.shape != mb.shape:
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
    c = lambda x, shape: np.ascontiguousarray(x, dtype=np.float32).reshape(shape)  # noqa: E731
    if rows and dim:
        _C.merge_by_lse(c(v_a, (rows, dim)), c(s_a, (rows,)), c(v_b, (rows, dim)), c(s_b, (rows,)), o, lse)
    elif rows:  # no output columns, but the merged LSE is still defined: merge one zero column for it
        zero = np.zeros((rows, 1), dtype=np.float32)
        _C.merge_by_lse(zero, c(s_a, (rows,)), zero.copy(), c(s_b, (rows,)), np.empty_like(zero), lse)
    return o.reshape(v_a.shape), lse.reshape(s_a.shape)


# ---- KV caches (decode and rope_append_kv) ---------------------------------------------------
#: The cache's dtype: q's, or OCP fp8 e4m3 ("e4m3fn": torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn)
#: with per-KV-head fp32 scales, K = code * k_scale and V = code * v_scale (both backends).
FP8_E4M3 = "float8_e4m3fn"
CACHE_CODES = dict(_DTYPE_CODES, **{FP8_E4M3: _C.DTYPE_F8E4M3})


def capturing(device: Any) -> bool:
    return (torch is not None and isinstance(device, torch.device) and device.type == "cuda"
            and torch.cuda.is_current_stream_capturing())


def int32_tensor(x: Any, name: str, device: Any) -> Any:
    """An index argument (lengths, cu_seqlens, positions, block tables) for torch inputs: a
    contiguous int32 tensor on ``device`` (a list or a numpy array becomes one). Only integer
    dtypes: a float or bool tensor is refused, not truncated. Host values must fit int32 (a wider
    value would wrap into a plausible index); device values are not read (that would synchronize):
    they are the caller's to keep in range, as every device array's values are."""
    if not isinstance(x, torch.Tensor):
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers (int32); got {a.dtype}")
        x = torch.as_tensor(a)
        if x.device != device and device.type != "cpu":
            x = check_int32_values(x, name).to(device=device, dtype=torch.int32)
    if x.device != device:
        raise ValueError(f"{name} must be on q's device ({device}); got {x.device}")
    if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(f"{name} must hold integers (int32); got {x.dtype}")
    if x.dtype != torch.int32:
        x = (check_int32_values(x, name) if x.device.type == "cpu" else x).to(torch.int32)
    return x.contiguous()


_UNSIGNED_WIDE = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if torch is not None and hasattr(torch, n))


def check_int32_values(a: Any, name: str) -> Any:
    """Refuses host integers (a numpy array or a CPU tensor) outside int32, which a conversion
    would wrap into plausible indices; returns a."""
    v = a
    if torch is not None and isinstance(a, torch.Tensor):
        # Under torch.func.vmap a vmapped tensor's values cannot be read through the wrapper (its
        # .item() raises): the check reads the tensor it wraps, every entry at once.
        f = getattr(torch._C, "_functorch", None)
        while f is not None and f.is_batchedtensor(v):
            v = f.get_unwrapped(v)
        if v.dtype in _UNSIGNED_WIDE:  # torch has no host min/max for the wide unsigned dtypes
            v = v.numpy()
    if (v.size if isinstance(v, np.ndarray) else v.numel()) and (int(v.min()) < -2**31 or int(v.max()) > _INT32_MAX):
        raise ValueError(f"{name} values must fit int32; got {int(v.min())} .. {int(v.max())}")
    return a


def small_array(x: Any, name: str, kind: str, like: Any, is_cuda: bool, device: Any) -> Any:
    """A small array (lengths, block table, slopes, rotary tables) as the binding wants it: int32 or
    float32, contiguous, where the step runs. No copy when it already is; a copy otherwise (outside
    a CUDA graph capture: the run of a captured graph must be handed the right tensors)."""
    if x is None:
        return None
    want_np = np.int32 if kind == "int32" else np.float32
    if is_cuda:
        want = torch.int32 if kind == "int32" else torch.float32
        if isinstance(x, torch.Tensor):
            if kind == "int32" and (x.dtype.is_floating_point or x.dtype.is_complex):
                raise TypeError(f"{name} must hold integers (int32); got {x.dtype}")
            if x.device != device:
                if x.device.type == "cuda":
                    raise ValueError(f"{name} must be on q's device ({device}); got {x.device}")
            elif x.dtype == want and x.is_contiguous():
                return x
            if capturing(device):
                raise ValueError(f"{name} must already be a contiguous {kind} tensor on {device} inside a CUDA "
                                 f"graph capture (got {x.dtype} on {x.device}); converting it would copy")
            return x.to(device=device, dtype=want).contiguous()
        if capturing(device):
            raise ValueError(f"{name} must be a {kind} tensor on {device} inside a CUDA graph capture")
        a = np.asarray(x)
        if kind == "int32" and a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers (int32); got {a.dtype}")
        return torch.as_tensor(np.ascontiguousarray(a, dtype=want_np), device=device)
    if is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the host like q; got {x.device}")
        if kind == "int32" and (x.dtype.is_floating_point or x.dtype.is_complex):
            raise TypeError(f"{name} must hold integers (int32); got {x.dtype}")
        x = x.detach().numpy() if x.dtype != torch.bfloat16 else x.detach().float().numpy()
    a = np.asarray(x)
    if kind == "int32":
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers (int32); got {a.dtype}")
        check_int32_values(a, name)
    return np.ascontiguousarray(a, dtype=want_np)


def kv_scales(k_scale: Any, v_scale: Any, fp8: bool, heads_kv: int, like: Any, is_cuda: bool, device: Any,
              check_values: bool = True) -> Tuple[Any, Any]:
    """k_scale and v_scale of an fp8 cache as fp32 (heads_kv,) arrays on the cache's device: a
    number is every head's scale. They belong to an fp8 cache only. Host values are checked by the
    C++ validator (positive and finite); device values are the caller's to keep so."""
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{'k_scale' if k_scale is not None else 'v_scale'} is given but the cache is not "
                             f"{FP8_E4M3} (the scales dequantize an fp8 cache)")
        return None, None
    if k_scale is None or v_scale is None:
        raise ValueError(f"an {FP8_E4M3} cache needs k_scale and v_scale (K = code * k_scale, V = code * v_scale): "
                         "a number, or one per KV head")
    out = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
            x = np.full(heads_kv, float(x), dtype=np.float32)
        if not check_values and is_torch(x):  # the fake of the torch op: shapes only
            if tuple(x.shape) != (heads_kv,):
                raise ValueError(f"{name} must be a number or have shape (heads_kv,) = ({heads_kv},); "
                                 f"got {tuple(x.shape)}")
            out.append(x)
            continue
        a = small_array(x, name, "float32", like, is_cuda, device)
        if tuple(a.shape) != (heads_kv,):
            raise ValueError(f"{name} must be a number or have shape (heads_kv,) = ({heads_kv},); "
                             f"got {tuple(a.shape)}")
        out.append(a)  # values: the C++ validator checks host ones (positive and finite)
    return out[0], out[1]
