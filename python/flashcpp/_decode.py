"""Decode against a KV cache: the plan/run wrappers and the body of ``flash_attn_with_kvcache``
(``flashcpp.decode`` is the public face; its module doc has the semantics). Below ``_torch_ops``,
whose decode ops run ``_with_kvcache``, and below ``decode``, which re-exports the wrappers and
chooses between the op (inside torch.compile) and ``_with_kvcache`` (eager). Imports only ``_core``
and the binding.
"""
from __future__ import annotations

import atexit
import collections
import math
from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from . import _flashcpp as _C
from .fused import _rotary_spec

MAX_SEQLEN_Q = _C.DECODE_MAX_SEQLEN_Q
MAX_PAGE_SIZE = _C.DECODE_MAX_PAGE_SIZE
MAX_SPLITS = _C.DECODE_MAX_SPLITS
_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
#: The cache's dtype: q's, or OCP fp8 e4m3 ("e4m3fn": torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn)
#: with per-KV-head fp32 scales, K = code * k_scale and V = code * v_scale (both backends).
FP8_E4M3 = _core.FP8_E4M3
_CACHE_CODES = _core.CACHE_CODES
# The small-array and scale helpers live in _core: fused.rope_append_kv shares them.
_capturing = _core.capturing
_small = _core.small_array
_scales = _core.kv_scales
_ROTARY = {None: _C.ROPE_NONE, "none": _C.ROPE_NONE, "neox": _C.ROPE_NEOX,
           "interleaved": _C.ROPE_INTERLEAVED}
_WS_ALIGN = 256  # workspace offsets (the C++ API needs 16)


# ---- inputs ---------------------------------------------------------------------------------

def _is_torch(x: Any) -> bool:
    return _core.is_torch(x)


def _ints(x: Any, name: str) -> np.ndarray:
    """Host copy of an integer array (reads a CUDA tensor: only for host-side steps such as plans)."""
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32); got {a.dtype}")
    return _core.check_int32_values(a.astype(np.int64), name)  # an int32 quantity: a wider value would wrap


def _refuse_bool_lens(cache_seqlens: Any) -> None:
    """cache_seqlens as one int is every sequence's length; a bool is an int to Python (True ran as
    1), not a length."""
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError(f"cache_seqlens must be an int or int32 (batch,) lengths; got the bool {cache_seqlens!r} "
                        "(a bool is not a count)")


def _check_places(names: Tuple[str, ...], *tensors: Any) -> None:
    """Refuses a torch tensor argument (`tensors`, named by `names`) on a device flashcpp does not
    run on (meta) with _core.check_place's sentence, before a copy ("Cannot copy out of meta tensor")
    or its null data pointer ("q.data is null") speaks instead. None and non-tensors are skipped.
    (is_cpu / is_cuda: a tenth of what reading x.device costs, on run()'s path.)"""
    for name, x in zip(names, tensors):
        if x is not None and _is_torch(x) and not (x.is_cpu or x.is_cuda):
            _core.check_place(_core.meta(x, name))


_RUN_TENSORS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k", "v", "rotary_cos", "rotary_sin",
                "alibi_slopes", "out", "lse", "k_scale", "v_scale")
_STEP_TENSORS = ("k", "v", "cache_seqlens", "block_table", "rotary_cos", "rotary_sin", "alibi_slopes")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dtype_name(dtype: Any) -> str:
    """'float16' / 'bfloat16' / 'float32' of a torch dtype, numpy dtype or name."""
    if _core.torch is not None and isinstance(dtype, _core.torch.dtype):
        name = _core._TORCH_DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    elif isinstance(dtype, str):
        name = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                "float": "float32"}.get(dtype, dtype)
    else:
        name = np.dtype(dtype).name
    if name not in _FLOAT_DTYPES:
        raise TypeError(f"dtype {dtype!r} is not one of float16, bfloat16, float32")
    return name


def _names_fp8(kv_dtype: Any) -> bool:
    """Whether a dtype (torch, numpy/ml_dtypes or a name: 'float8_e4m3fn', 'fp8', 'fp8_e4m3',
    'e4m3') is fp8 e4m3."""
    torch = _core.torch
    if isinstance(kv_dtype, str):
        name = kv_dtype
    elif torch is not None and isinstance(kv_dtype, torch.dtype):
        name = str(kv_dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(kv_dtype).name
        except TypeError:
            return False
    return name in (FP8_E4M3, "fp8", "fp8_e4m3", "e4m3")


def _kv_dtype_name(kv_dtype: Any, dtype: str) -> str:
    """The cache's dtype name: None = q's dtype (`dtype`), else q's dtype or fp8 e4m3."""
    if kv_dtype is None:
        return dtype
    if _names_fp8(kv_dtype):
        return FP8_E4M3
    try:
        name = _dtype_name(kv_dtype)
    except TypeError:
        name = None
    if name != dtype:
        raise TypeError(f"kv_dtype {kv_dtype!r}: the cache holds q's dtype ({dtype}) or {FP8_E4M3} (with k_scale "
                        "and v_scale)")
    return name


def _device_of(x: Any) -> Tuple[bool, Any]:
    """(is_cuda, torch device or 'cpu')."""
    if _is_torch(x):
        return x.device.type == "cuda", x.device
    return False, "cpu"


class _DeviceGuard:
    """Makes x's CUDA device current for the C++ calls (they use the current device)."""

    def __init__(self, device: Any) -> None:
        self._ctx = None
        torch = _core.torch
        if (torch is not None and isinstance(device, torch.device) and device.type == "cuda"
                and device.index is not None and device.index != torch.cuda.current_device()):
            self._ctx = torch.cuda.device(device)

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _stream(device: Any) -> int:
    torch = _core.torch
    if torch is not None and isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def _tensor(x: Any, m: _core.Meta, dtype_code: int) -> Any:
    """The binding's TensorView of a 4-D view (for a paged cache batch_stride is the page stride)."""
    return _core.tensor_view(x, m, dtype_code)


def _check_4d(m: _core.Meta, shape: Tuple[int, ...], what: str) -> None:
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"{m.name} must be {what} = {tuple(shape)}; got {m.shape}")
    if 0 not in m.shape:
        if m.shape[-1] > 1 and m.strides[-1] != 1:
            raise ValueError(f"{m.name}: the last dimension (head_dim) must be contiguous (stride 1); "
                             f"got strides {m.strides}")
        if any(s < 0 for s in m.strides):
            raise ValueError(f"{m.name} has a negative stride {m.strides}")


# ---- workspaces -----------------------------------------------------------------------------------

class _Workspace:
    """The int32 work list and the fp32 partials of a plan, carved from one byte buffer: a torch
    uint8 tensor on the CUDA device, or an aligned numpy array for the CPU backend. The buffer is
    either the caller's (never replaced: a plan that needs more raises) or ours (grown when a plan
    needs more; a CUDA graph captured before the growth must be captured again)."""

    def __init__(self, buffer: Any = None) -> None:
        self._user = buffer is not None
        self._buf = buffer
        if buffer is not None:
            m = _core.meta(buffer, "workspace_buffer")
            if len(m.shape) != 1 or (m.shape[0] > 1 and m.strides[0] != 1):
                raise ValueError(f"workspace_buffer must be a contiguous 1-D buffer; got shape {m.shape}, "
                                 f"strides {m.strides}")
            self._bytes = m.shape[0] * (buffer.element_size() if _is_torch(buffer) else buffer.itemsize)
            self._is_cuda = m.is_cuda
            self._device = m.device
        else:
            self._bytes = 0
            self._is_cuda = False
            self._device = None

    def carve(self, int_bytes: int, float_bytes: int, is_cuda: bool, device: Any) -> Tuple[int, int]:
        """(int_ptr, float_ptr) for a plan needing these bytes on this device (0 for an empty part)."""
        float_off = -(-int_bytes // _WS_ALIGN) * _WS_ALIGN
        need = float_off + float_bytes + _WS_ALIGN  # + slack to align the start
        if self._user:
            if self._is_cuda != is_cuda or (is_cuda and self._device != device):
                raise ValueError(f"workspace_buffer is on {self._device}; the step runs on {device}")
            if self._bytes < need:
                raise ValueError(f"workspace_buffer has {self._bytes} bytes; this plan needs {need} "
                                 "(pass a larger buffer, e.g. 128 MiB)")
        elif self._buf is None or self._is_cuda != is_cuda or self._device != device or self._bytes < need:
            size = max(need, 2 * self._bytes if self._device == device else 0, 1 << 16)
            if is_cuda:
                self._buf = _core.torch.empty(size, dtype=_core.torch.uint8, device=device)
            else:
                self._buf = np.empty(size, dtype=np.uint8)
            self._bytes, self._is_cuda, self._device = size, is_cuda, device
        base = _core.data_ptr(self._buf)
        base = -(-base // _WS_ALIGN) * _WS_ALIGN
        return (base if int_bytes else 0), (base + float_off if float_bytes else 0)


# ---- plan / run -----------------------------------------------------------------------------------

class BatchDecodeWithKVCache:
    """Plan/run decode over a contiguous or paged KV cache (flash-attn cache layout), the way
    FlashInfer's wrappers work: ``plan()`` decides on the host how every sequence's keys are split
    over CTAs and writes the work list into the workspace; ``run()`` launches only.

    ``run()`` is CUDA-graph capturable: capture it after ``plan()`` (and after one warm-up run) and
    replay with new cache_seqlens / tensor contents; plan again (and capture again) when batch,
    seqlen_q, heads, head_dim, dtype, the cache kind or append change, or when the lengths outgrow
    what was planned for (still correct then, but split for shorter sequences).

    Example::

        w = flashcpp.decode.BatchDecodeWithKVCache()
        w.plan(batch, heads_q, heads_kv, 128, kv_capacity=k_cache.shape[1], cache_seqlens=lens_host,
               dtype=torch.bfloat16, device="cuda", causal=True)
        out = w.run(q, k_cache, v_cache, lens_dev)               # q (batch, 1, heads_q, 128)

    Args of the constructor:
        workspace_buffer: optional 1-D uint8 buffer (torch on the device, or numpy for the CPU
            backend) to carve the workspaces from; by default the wrapper allocates and grows its own.
    """

    def __init__(self, workspace_buffer: Any = None) -> None:
        self._ws = _Workspace(workspace_buffer)
        self._plan: Optional[Any] = None
        self._cfg: Optional[dict] = None

    @property
    def plan_info(self) -> Any:
        """The C++ DecodePlan (backend, num_items, max_splits, needs_merge, ctas, ...), or None."""
        return self._plan

    def plan(self, batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
             head_dim_v: Optional[int] = None, seqlen_q: int = 1, kv_capacity: Optional[int] = None, page_size: int = 0,
             cache_seqlens: Any = None, append: bool = False, causal: bool = False,
             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, sm_scale: Optional[float] = None,
             rotary: Optional[str] = None, rotary_dim: int = 0, rope_theta: float = 10000.0,
             dtype: Any = "bfloat16", device: Any = "cuda", num_splits: int = 0, max_splits: int = 0,
             num_sms: int = 0, non_blocking: bool = False, fused_merge: bool = False,
             fused_append: bool = False, kv_dtype: Any = None, small_plan: str = "full_wave") -> Any:
        """Plans the steps that ``run()`` will compute.

        Args:
            batch_size, num_qo_heads, num_kv_heads, head_dim, seqlen_q: the step's shape
                (q is (batch_size, seqlen_q, num_qo_heads, head_dim), 1 <= seqlen_q <= 16).
            head_dim_v: the head dim of v_cache (and of v and out); None = head_dim. Any multiple
                of 8 in [8, 256] on both backends (the CUDA kernels run it in the class 64, 128
                or 256 holding both head dims, padded inside); an fp8 cache on CUDA takes
                multiples of 16 and refuses the rest (NotImplementedError).
            kv_capacity: key slots per sequence: k_cache.shape[1] (contiguous), or
                pages_per_seq * page_size (paged). Default: the largest planned length (+ seqlen_q
                with append); required when cache_seqlens is None.
            page_size: 0 for a contiguous cache, else the page size of the paged cache.
            cache_seqlens: host lengths to plan for (the meaning of run's cache_seqlens: keys
                before the step). For a CUDA graph replayed with growing lengths pass the largest
                it will see. None: every sequence planned at its full capacity.
            append: run() will get k/v (new tokens written into the cache).
            causal, window_size, softcap, sm_scale: the mask (as flash_attn_with_kvcache).
            rotary: None, "neox" or "interleaved" (q and the appended keys rotated in the kernel);
                rotary_dim (0 = head_dim) and rope_theta when run() gets no cos/sin tables.
            dtype, device: of q (and of the cache unless kv_dtype says otherwise); device "cpu"
                plans for the CPU backend.
            kv_dtype: the cache's dtype: None (q's), or "float8_e4m3fn" / torch.float8_e4m3fn /
                ml_dtypes.float8_e4m3fn, an fp8 e4m3 cache that run() dequantizes with its
                k_scale and v_scale (the append quantizes into it). Both backends; on CUDA the
                cache strides are multiples of 16 codes.
            num_splits: force this many key splits per sequence (0 = heuristic); max_splits caps
                the heuristic (0 = 256; at most 256, as num_splits); num_sms: plan for this many SMs
                (0 = the device's).
            non_blocking: CUDA: the work list is uploaded on the current stream; by default plan()
                then waits for that stream, so run() may be called on any stream. True skips the
                wait (run() must then be ordered after the current stream).
            fused_merge: CUDA: the split-KV kernel merges the splits itself (the last CTA of each
                sequence and KV head to finish), instead of a merge launch; same results.
            fused_append: CUDA, with append: the split-KV kernel writes the new k/v into the cache
                itself (each split the tokens in its tiles), instead of an append launch; same
                cache bytes and results.
            small_plan: how widely a latency-bound step (one whose 256-key splits cannot fill the
                GPU) spreads its splits: "full_wave" (one full wave of CTAs: the fastest attention
                alone) or "shared" (5/8 of the SMs: for a step whose other kernels run beside
                attention, as the engine's GEMVs do). Splits only; results are the same.
        Returns:
            the C++ DecodePlan (also ``self.plan_info``).
        """
        if small_plan not in ("full_wave", "shared"):
            raise ValueError(f"small_plan must be 'full_wave' or 'shared'; got {small_plan!r}")
        # Yes/no options are True or False, not any truthy value (fused_merge='no' ran as True), and
        # checked first: append decides the planned lengths below.
        append, causal = _core.check_flag(append, "append"), _core.check_flag(causal, "causal")
        non_blocking = _core.check_flag(non_blocking, "non_blocking")
        fused_merge = _core.check_flag(fused_merge, "fused_merge")
        fused_append = _core.check_flag(fused_append, "fused_append")
        rope_theta = _core.check_real(rope_theta, "rope_theta")  # a number: True is not a base of 1.0
        torch = _core.torch
        dt = _dtype_name(dtype)
        kv_dt = _kv_dtype_name(kv_dtype, dt)
        if str(device) != "cpu":
            if torch is None:
                raise ValueError(f"device {device!r} needs torch; without it decode runs on the CPU (device='cpu')")
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"device must be 'cpu' or a CUDA device; got {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            is_cuda = True
        else:
            device, is_cuda = "cpu", False
        if is_cuda and _capturing(device):
            raise RuntimeError("plan() runs on the host and uploads the work list: call it before the CUDA "
                               "graph capture, and capture run() only")
        for name, val, lo in (("batch_size", batch_size, 0), ("num_qo_heads", num_qo_heads, 1),
                              ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1),
                              ("seqlen_q", seqlen_q, 1), ("num_splits", num_splits, 0),
                              ("num_sms", num_sms, 0), ("page_size", page_size, 0), ("rotary_dim", rotary_dim, 0)):
            # a float is not truncated, a bool is not a count; past int32 the binding refuses
            # with nanobind's "incompatible function arguments"
            if not _core._is_int(val) or not lo <= val <= _core._INT32_MAX:
                raise ValueError(f"{name} must be an int in [{lo}, 2**31-1]; got {val!r}")
        if not _core._is_int(max_splits):
            raise ValueError(f"max_splits must be an int in [0, {MAX_SPLITS}]; got {max_splits!r}")
        if not 0 <= max_splits <= MAX_SPLITS:
            # decode_plan's sentence (decode_api.cc), here too: a value past int32 would not reach it
            # (the binding's int refuses it with "incompatible function arguments")
            raise ValueError(f"max_splits {max_splits} is outside [0, {MAX_SPLITS}] (0 = {MAX_SPLITS}, the most "
                             f"splits a plan makes)")
        if kv_capacity is not None:
            _core.check_int(kv_capacity, "kv_capacity", 0)
        head_dim_v = int(head_dim) if head_dim_v is None else _core.check_int(head_dim_v, "head_dim_v", 1,
                                                                             what=" (None = head_dim)")
        window = _core.check_window(window_size)
        if rotary not in _ROTARY:
            raise ValueError(f"rotary must be None, 'neox' or 'interleaved'; got {rotary!r}")
        batch = int(batch_size)
        add = int(seqlen_q) if append else 0
        lens = None
        if cache_seqlens is not None:
            _refuse_bool_lens(cache_seqlens)
            if isinstance(cache_seqlens, (int, np.integer)):
                lens = np.full(batch, int(cache_seqlens), dtype=np.int64)
            else:
                lens = _ints(cache_seqlens, "cache_seqlens").reshape(-1)
            if lens.shape != (batch,):
                raise ValueError(f"cache_seqlens must be an int or have shape (batch,) = ({batch},); got {lens.shape}")
            if lens.size and lens.min() < 0:
                raise ValueError(f"cache_seqlens[{int(np.argmin(lens))}] {int(lens.min())} is negative")
        if kv_capacity is None:
            if lens is None:
                raise ValueError("plan() needs kv_capacity (key slots per sequence) or cache_seqlens")
            kv_capacity = int(lens.max()) + add if lens.size else add
        kv_capacity = int(kv_capacity)
        if lens is not None and lens.size and int(lens.max()) + add > kv_capacity:
            b = int(np.argmax(lens))
            raise ValueError(f"cache_seqlens[{b}] {int(lens[b])}" + (f" + seqlen_q {add}" if add else "") +
                             f" = {int(lens[b]) + add} keys exceed the cache's {kv_capacity} slots per sequence")
        if page_size:
            if not _is_pow2(int(page_size)) or page_size > MAX_PAGE_SIZE:
                raise ValueError(f"page_size {page_size} is not a power of two in [1, {MAX_PAGE_SIZE}]")
            pages_per_seq = max(1, -(-kv_capacity // int(page_size)))
            capacity = 0
        else:
            pages_per_seq, capacity = 0, kv_capacity
        scale = _core.default_scale(sm_scale, int(head_dim))
        cfg = dict(batch=batch, seqlen_q=int(seqlen_q), heads_q=int(num_qo_heads), heads_kv=int(num_kv_heads),
                   head_dim=int(head_dim), head_dim_v=head_dim_v, dtype=dt, kv_dtype=kv_dt, device=device,
                   is_cuda=is_cuda,
                   page_size=int(page_size),
                   append=append, causal=causal, window=window,
                   softcap=_core.check_softcap(softcap), scale=scale,
                   rotary=_ROTARY[rotary], rotary_dim=int(rotary_dim), rope_theta=rope_theta)
        # decode_plan reads the scalars only: the tensors are absent (null views of the planned dtype).
        code = _core._DTYPE_CODES[dt]
        params = _C.DecodeParams()
        params.batch, params.seqlen_q = batch, cfg["seqlen_q"]
        params.heads_q, params.heads_kv, params.head_dim = cfg["heads_q"], cfg["heads_kv"], cfg["head_dim"]
        params.head_dim_v = head_dim_v
        params.q = params.o = _C.TensorView(0, code)
        cache = params.cache
        cache.k = cache.v = _C.TensorView(0, _CACHE_CODES[kv_dt])
        cache.capacity, cache.page_size, cache.num_pages = capacity, cfg["page_size"], 1 if page_size else 0
        cache.block_table_stride = cache.pages_per_seq = pages_per_seq
        params.rotary = _rotary_spec(cfg["rotary"], cfg["rotary_dim"], cfg["head_dim"], cfg["rope_theta"])
        params.softmax_scale = scale
        mask = params.mask
        mask.causal, mask.window_left, mask.window_right = cfg["causal"], window[0], window[1]
        mask.softcap = cfg["softcap"]
        opt = _C.DecodePlanOptions()
        opt.backend = "cuda" if is_cuda else "cpu"
        opt.host_cache_seqlens = None if lens is None else np.ascontiguousarray(lens, dtype=np.int32)
        opt.num_splits, opt.max_splits, opt.num_sms = int(num_splits), int(max_splits), int(num_sms)
        opt.fused_merge, opt.fused_append = fused_merge, fused_append
        opt.small_plan = small_plan
        with _DeviceGuard(device):
            ib, fb = _C.decode_workspace_size(params, opt, append)
            iptr, fptr = self._ws.carve(ib, fb, is_cuda, device)
            opt.stream = _stream(device)
            self._plan = _C.decode_plan(params, opt, append, iptr, ib, fptr, fb)
            if is_cuda and not non_blocking:
                torch.cuda.current_stream(device).synchronize()
        self._cfg = cfg
        return self._plan

    def run(self, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, *, block_table: Any = None,
            k: Any = None, v: Any = None, rotary_cos: Any = None, rotary_sin: Any = None,
            alibi_slopes: Any = None, out: Any = None, lse: Any = None, return_lse: bool = False,
            cpu_threads: int = 0, k_scale: Any = None, v_scale: Any = None) -> Any:
        """One decode step as planned.

        Args:
            q: (batch, seqlen_q, heads_q, head_dim), head_dim contiguous, other strides free.
            k_cache, v_cache: (batch, capacity, heads_kv, head_dim), or paged (num_pages, page_size,
                heads_kv, head_dim) with block_table (batch, pages_per_seq) int32; v_cache's last
                dim is the planned head_dim_v.
            cache_seqlens: (batch,) int32 keys in the cache before the step, on q's device (read by
                the kernels at run time: a replayed CUDA graph picks up new values).
            k, v: the new tokens (batch, seqlen_q, heads_kv, head_dim / head_dim_v) when planned
                with append.
            rotary_cos, rotary_sin: optional fp32 tables (max_position, rotary_dim / 2) when planned
                with rotary; without them the angles come from rope_theta.
            alibi_slopes: optional fp32 (heads_q,) or (batch, heads_q).
            k_scale, v_scale: an fp8 cache's scales (K = code * k_scale, V = code * v_scale): a
                number, or fp32 (heads_kv,) one per KV head, positive and finite; None otherwise.
            out, lse: optional outputs ((batch, seqlen_q, heads_q, head_dim_v) in q's dtype; fp32
                (batch, heads_q, seqlen_q)); pass
                them to run without allocating (CUDA graphs with static outputs).
        Returns:
            out, or (out, lse) when return_lse or lse is given.
        """
        if _core.transforms_active():  # torch.func / forward AD (_core.guard)
            r = _core.guard(self.run, "BatchDecodeWithKVCache.run", {n: x for n, x in locals().items() if n != "self"},
                            ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "alibi_slopes", "out",
                             "lse", "k_scale", "v_scale"))
            if r is not None:
                return r[0]
        if _core.grad_needed(q, k_cache, v_cache, k, v, alibi_slopes):
            # no backward: the outputs get a grad_fn that refuses (flash_attn_with_kvcache's rule), and
            # a step that writes in place is refused at once
            if k is not None or v is not None or out is not None:
                _core.refuse_grad_in_place("BatchDecodeWithKVCache.run", "writes in place (the appended k and v, "
                                           "or out=)", (q, k_cache, v_cache, k, v, alibi_slopes))
            return _core.no_backward("BatchDecodeWithKVCache.run", lambda: self.run(  # (grad off in there)
                q, k_cache, v_cache, cache_seqlens, block_table=block_table, rotary_cos=rotary_cos,
                rotary_sin=rotary_sin, alibi_slopes=alibi_slopes, lse=lse, return_lse=return_lse,
                cpu_threads=cpu_threads, k_scale=k_scale, v_scale=v_scale), (q, k_cache, v_cache, alibi_slopes))
        c = self._cfg
        if c is None:
            raise RuntimeError("call plan() before run()")
        return_lse = _core.check_flag(return_lse, "return_lse")
        _check_places(_RUN_TENSORS, q, k_cache, v_cache, cache_seqlens, block_table, k, v, rotary_cos, rotary_sin,
                      alibi_slopes, out, lse, k_scale, v_scale)
        mq, mk, mv = _core.meta(q, "q"), _core.meta(k_cache, "k_cache"), _core.meta(v_cache, "v_cache")
        for m, want in ((mq, c["dtype"]), (mk, c["kv_dtype"]), (mv, c["kv_dtype"])):
            if m.dtype != want:
                raise TypeError(f"{m.name} has dtype {m.dtype}; the plan is for {want}")
            if m.is_cuda != c["is_cuda"] or (m.is_cuda and m.device != c["device"]):
                raise ValueError(f"{m.name} is on {m.device}; the plan is for {c['device']}")
        B, Sq, Hq, Hkv, D = c["batch"], c["seqlen_q"], c["heads_q"], c["heads_kv"], c["head_dim"]
        Dv = c["head_dim_v"]
        _check_4d(mq, (B, Sq, Hq, D), "(batch, seqlen_q, heads_q, head_dim) as planned")
        if len(mk.shape) != 4 or len(mv.shape) != 4 or tuple(mk.shape[:-1]) != tuple(mv.shape[:-1]):
            raise ValueError(f"k_cache and v_cache must be 4-D with the same shape except the last dimension; "
                             f"got {mk.shape} and {mv.shape}")
        ps = c["page_size"]
        if ps:
            if block_table is None:
                raise ValueError(f"the plan is for a paged cache (page_size {ps}): pass block_table")
            _check_4d(mk, (mk.shape[0], ps, Hkv, D), "(num_pages, page_size, heads_kv, head_dim)")
            _check_4d(mv, (mv.shape[0], ps, Hkv, Dv), "(num_pages, page_size, heads_kv, head_dim_v)")
        else:
            if block_table is not None:
                raise ValueError("block_table given but the plan is for a contiguous cache (plan with page_size)")
            _check_4d(mk, (B, mk.shape[1], Hkv, D), "(batch, capacity, heads_kv, head_dim)")
            _check_4d(mv, (B, mv.shape[1], Hkv, Dv), "(batch, capacity, heads_kv, head_dim_v)")
        if (k is None) != (v is None):
            raise ValueError("k and v come together (the new tokens' keys and values)")
        if (k is not None) != c["append"]:
            raise ValueError("k/v given but the plan has append=False" if k is not None else
                             "the plan has append=True: pass k and v (the new tokens)")
        mkn = mvn = None
        if k is not None:
            _core.check_writable(k_cache, "k_cache")  # the append writes the new tokens into the cache
            _core.check_writable(v_cache, "v_cache")
            _core.check_caches_apart(k_cache, v_cache)  # the C++ validator does not compare the pair
            mkn, mvn = _core.meta(k, "k"), _core.meta(v, "v")
            for m, d, what in ((mkn, D, "head_dim"), (mvn, Dv, "head_dim_v")):
                if m.dtype != c["dtype"] or m.device != mq.device:
                    raise ValueError(f"{m.name} must be {c['dtype']} on {mq.device}; got {m.dtype} on {m.device}")
                _check_4d(m, (B, Sq, Hkv, d), f"(batch, seqlen_q, heads_kv, {what})")
        return self._launch(q, mq, k_cache, mk, v_cache, mv, cache_seqlens, block_table, k, mkn, v, mvn,
                            rotary_cos, rotary_sin, alibi_slopes, out, lse, return_lse, cpu_threads, k_scale, v_scale)

    def _launch(self, q, mq, k_cache, mk, v_cache, mv, cache_seqlens, block_table, k, mkn, v, mvn, rotary_cos,
                rotary_sin, alibi_slopes, out, lse, return_lse, cpu_threads, k_scale=None, v_scale=None):
        c = self._cfg
        is_cuda, device = c["is_cuda"], c["device"]
        B, Sq, Hq, D, Dv = c["batch"], c["seqlen_q"], c["heads_q"], c["head_dim"], c["head_dim_v"]
        torch = _core.torch
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required by run() (keys in the cache before the step)")
        # the shape as given: a number (or a 0-dim array) would become shape (1,) in the conversion below
        given = tuple(cache_seqlens.shape) if hasattr(cache_seqlens, "shape") else np.shape(cache_seqlens)
        if given == ():
            raise TypeError(f"cache_seqlens must be an int32 array of shape (batch,) = ({B},) (a tensor on q's "
                            f"device for torch inputs); got {type(cache_seqlens).__name__} {cache_seqlens!r}, and "
                            f"run() takes no single length (flash_attn_with_kvcache does)")
        lens = _small(cache_seqlens, "cache_seqlens", "int32", q, is_cuda, device)
        if tuple(lens.shape) != (B,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({B},); got {tuple(lens.shape)}")
        table = _small(block_table, "block_table", "int32", q, is_cuda, device)
        if table is not None and (table.ndim != 2 or table.shape[0] != B or table.shape[1] < 1):
            raise ValueError(f"block_table must be (batch, pages_per_seq) = ({B}, n >= 1); got {tuple(table.shape)}")
        if is_cuda and not (_is_torch(cache_seqlens) and cache_seqlens.device.type == "cuda"):
            # host lengths for a CUDA step: their values are here, check them (no synchronization)
            slots = table.shape[1] * c["page_size"] if c["page_size"] else mk.shape[1]
            add = Sq if c["append"] else 0
            host = _ints(cache_seqlens, "cache_seqlens").reshape(-1)
            for b, n in enumerate(host):
                if n < 0:
                    raise ValueError(f"cache_seqlens[{b}] {int(n)} is negative")
                if n + add > slots:
                    raise ValueError(f"cache_seqlens[{b}] {int(n)}" + (f" + seqlen_q {add}" if add else "") +
                                     f" = {int(n) + add} keys exceed the cache's {slots} slots per sequence")
        rot = c["rotary"]
        cos = sin = None
        rd, max_pos = c["rotary_dim"], 0
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin come together")
        if rotary_cos is not None:
            if rot == _C.ROPE_NONE:
                raise ValueError("rotary_cos/rotary_sin given but the plan has rotary=None")
            cos = _small(rotary_cos, "rotary_cos", "float32", q, is_cuda, device)
            sin = _small(rotary_sin, "rotary_sin", "float32", q, is_cuda, device)
            if cos.ndim != 2 or tuple(cos.shape) != tuple(sin.shape):
                raise ValueError(f"rotary_cos and rotary_sin must be 2-D (max_position, rotary_dim / 2) of one shape; "
                                 f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
            if rd and rd != 2 * cos.shape[1]:
                raise ValueError(f"rotary_cos has {cos.shape[1]} columns but the plan has rotary_dim {rd}")
            rd, max_pos = 2 * cos.shape[1], cos.shape[0]
            if not 2 <= rd <= D:
                raise ValueError(f"rotary_cos has {rd // 2} columns: rotary_dim {rd} must be in [2, head_dim {D}]")
        ks, vs = _scales(k_scale, v_scale, c["kv_dtype"] == FP8_E4M3, c["heads_kv"], q, is_cuda, device)
        alibi = _small(alibi_slopes, "alibi_slopes", "float32", q, is_cuda, device)
        alibi_bs = 0
        if alibi is not None:
            if tuple(alibi.shape) == (B, Hq):
                alibi_bs = Hq
            elif tuple(alibi.shape) != (Hq,):
                raise ValueError(f"alibi_slopes must be (heads_q,) or (batch, heads_q); got {tuple(alibi.shape)}")
        shape_o = (B, Sq, Hq, Dv)  # v's head dim
        if out is None:
            out = torch.empty(shape_o, dtype=q.dtype, device=q.device) if _is_torch(q) else np.empty(shape_o, q.dtype)
        mo = _core.meta(out, "out")
        _core.check_same_kind(mo, mq)
        _core.check_same_kind(None if lse is None else _core.meta(lse, "lse"), mq)
        _core.check_writable(out, "out")
        if lse is not None:
            _core.check_writable(lse, "lse")
        if mo.dtype != mq.dtype or mo.device != mq.device:
            raise ValueError(f"out must be {mq.dtype} on {mq.device}; got {mo.dtype} on {mo.device}")
        _check_4d(mo, shape_o, "(batch, seqlen_q, heads_q, head_dim_v)")
        want_lse = return_lse or lse is not None
        if lse is None and return_lse:
            shape = (B, Hq, Sq)
            lse = (torch.empty(shape, dtype=torch.float32, device=q.device) if _is_torch(q)
                   else np.empty(shape, np.float32))
        if lse is not None:
            ml = _core.meta(lse, "lse")
            if ml.shape != (B, Hq, Sq) or ml.dtype != "float32" or ml.device != mq.device:
                raise ValueError(f"lse must be float32 (batch, heads_q, seqlen_q) = {(B, Hq, Sq)} on {mq.device}; "
                                 f"got {ml.dtype} {ml.shape} on {ml.device}")
            if not (lse.is_contiguous() if _is_torch(lse) else lse.flags.c_contiguous):
                raise ValueError("lse must be contiguous")
        if B == 0:
            return (out, lse) if want_lse else out
        code = _core._DTYPE_CODES[c["dtype"]]
        params = _C.DecodeParams()
        params.batch, params.seqlen_q, params.heads_q, params.heads_kv, params.head_dim = B, Sq, Hq, c["heads_kv"], D
        params.head_dim_v = Dv
        params.q, params.o = _tensor(q, mq, code), _tensor(out, mo, code)
        params.lse = _core.data_ptr(lse)
        cache = params.cache
        kv_code = _CACHE_CODES[c["kv_dtype"]]
        cache.k, cache.v = _tensor(k_cache, mk, kv_code), _tensor(v_cache, mv, kv_code)
        cache.k_scale, cache.v_scale = _core.data_ptr(ks), _core.data_ptr(vs)
        cache.capacity = mk.shape[1] if not c["page_size"] else 0
        cache.page_size, cache.num_pages = c["page_size"], mk.shape[0] if c["page_size"] else 0
        if table is not None:
            cache.block_table = _core.data_ptr(table)
            cache.block_table_stride = cache.pages_per_seq = table.shape[1]
        params.cache_seqlens = _core.data_ptr(lens)
        if k is not None:
            params.k_new, params.v_new = _tensor(k, mkn, code), _tensor(v, mvn, code)
        # Separate (max_position, rotary_dim / 2) tables: RotarySpec's default table_stride.
        params.rotary = _rotary_spec(rot, rd, D, c["rope_theta"], cos=cos, sin=sin, max_position=max_pos)
        params.softmax_scale = c["scale"]
        mask = params.mask
        mask.causal, mask.window_left, mask.window_right = c["causal"], c["window"][0], c["window"][1]
        mask.softcap = c["softcap"]
        mask.alibi_slopes, mask.alibi_batch_stride = _core.data_ptr(alibi), alibi_bs
        opt = _C.RunOptions("cuda" if is_cuda else "cpu", _stream(device), _core.check_cpu_threads(cpu_threads))
        with _DeviceGuard(device):
            _C.decode_run(params, self._plan, opt)
        return (out, lse) if want_lse else out


# ---- flash-attn's flash_attn_with_kvcache ------------------------------------------------------------

class _Step:
    """Checked shapes of one flash_attn_with_kvcache call (values too, for host memory)."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                 alibi_slopes, check_values: bool = True):
        # check_values False: shapes, dtypes and devices only (the fake of the torch op: no data).
        mq, mkc, mvc = _core.meta(q, "q"), _core.meta(k_cache, "k_cache"), _core.meta(v_cache, "v_cache")
        extra = [x for x in (k, v) if x is not None]
        _core._same_library("q, k_cache, v_cache, k and v", q, k_cache, v_cache, *extra)
        if mq.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"q has dtype {mq.dtype}; decode takes float16, bfloat16 or float32")
        for m in (mkc, mvc):
            if m.dtype not in _FLOAT_DTYPES and m.dtype != FP8_E4M3:
                raise TypeError(f"{m.name} has dtype {m.dtype}; the cache takes float16, bfloat16, float32 or "
                                f"{FP8_E4M3} (with k_scale and v_scale)")
        if mkc.dtype != mvc.dtype or (mkc.dtype != FP8_E4M3 and mkc.dtype != mq.dtype):
            raise TypeError(f"k_cache and v_cache must share q's dtype, or both be {FP8_E4M3} (got {mq.dtype}, "
                            f"{mkc.dtype}, {mvc.dtype})")
        if not (mq.device == mkc.device == mvc.device):
            raise ValueError(f"q, k_cache and v_cache must be on one device (got {mq.device}, {mkc.device}, "
                             f"{mvc.device})")
        _core.check_place(mq)  # a meta tensor: a sentence, not "q.data is null"
        _check_places(_STEP_TENSORS, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes)
        self.mq, self.mk, self.mv = mq, mkc, mvc
        self.is_cuda = mq.is_cuda
        self.device = mq.device
        self.dtype = mq.dtype      # of q, the output and the new k/v
        self.kv_dtype = mkc.dtype  # of the cache: q's, or fp8 e4m3
        if len(mq.shape) != 4:
            raise ValueError(f"q must be 4-D (batch, seqlen_q, heads_q, head_dim); got shape {mq.shape}")
        self.batch, self.seqlen_q, self.heads_q, self.head_dim = mq.shape
        if not 1 <= self.seqlen_q <= MAX_SEQLEN_Q:
            raise ValueError(f"seqlen_q {self.seqlen_q} is outside the decode range 1..{MAX_SEQLEN_Q} "
                             "(longer query blocks go through flash_attn_func)")
        if len(mkc.shape) != 4 or len(mvc.shape) != 4 or tuple(mkc.shape[:-1]) != tuple(mvc.shape[:-1]):
            raise ValueError(f"k_cache and v_cache must be 4-D with the same shape except the last dimension "
                             f"(v_cache's head_dim_v may differ from head_dim); got {mkc.shape} and {mvc.shape}")
        self.heads_kv = mkc.shape[2]
        self.head_dim_v = mvc.shape[3]  # of v_cache, v and the output
        if mkc.shape[3] != self.head_dim:
            raise ValueError(f"k_cache's head_dim {mkc.shape[3]} differs from q's {self.head_dim}")
        _core.check_head_dims(self.head_dim, self.head_dim_v)
        if self.heads_q < 1 or self.heads_kv < 1:  # "(0) must be a multiple of (0)" said nothing
            raise ValueError(f"decode needs at least one head in q and in the cache; got heads_q {self.heads_q} "
                             f"(q.shape[2]) and heads_kv {self.heads_kv} (k_cache.shape[2])")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads of q ({self.heads_q}) must be a multiple of heads of the cache "
                             f"({self.heads_kv}) (GQA/MQA)")
        self.paged = block_table is not None
        self.page_size = 0
        if self.paged:
            self.num_pages, self.page_size = mkc.shape[0], mkc.shape[1]
            if not _is_pow2(self.page_size) or self.page_size > MAX_PAGE_SIZE:
                raise ValueError(f"page_size {self.page_size} (k_cache.shape[1]) is not a power of two in "
                                 f"[1, {MAX_PAGE_SIZE}]")
            bt = _core.meta(block_table, "block_table")
            if len(bt.shape) != 2 or bt.shape[0] != self.batch:
                raise ValueError(f"block_table must be (batch, pages_per_seq) = ({self.batch}, n); got {bt.shape}")
            self.pages_per_seq = bt.shape[1]
            self.slots = self.pages_per_seq * self.page_size
        else:
            if mkc.shape[0] != self.batch:
                raise ValueError(f"k_cache's batch {mkc.shape[0]} differs from q's {self.batch} (cache_batch_idx "
                                 "is not built)")
            self.slots = mkc.shape[1]
        self.append = k is not None or v is not None
        if self.append:
            if k is None or v is None:
                raise ValueError("k and v come together (the new tokens' keys and values)")
            lead = (self.batch, self.seqlen_q, self.heads_kv)
            for x, n, d, what in ((k, "k", self.head_dim, "head_dim"), (v, "v", self.head_dim_v, "head_dim_v")):
                m = _core.meta(x, n)
                if tuple(m.shape) != lead + (d,):
                    raise ValueError(f"{n} must be (batch, seqlen_q, heads_kv, {what}) = {lead + (d,)}; got {m.shape}")
                if m.dtype != self.dtype:
                    raise TypeError(f"{n} has dtype {m.dtype}; q's is {self.dtype} (the new tokens come in q's dtype"
                                    + (", quantized into the fp8 cache by the append)" if self.kv_dtype != self.dtype
                                       else ")"))
                if m.device != self.device:
                    raise ValueError(f"{n} is on {m.device}; the cache is on {self.device}")
            if self.slots < self.seqlen_q:
                raise ValueError(f"the cache has {self.slots} slots per sequence, fewer than the {self.seqlen_q} "
                                 "tokens an append writes")
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin come together")
        if alibi_slopes is not None:
            shape = tuple(alibi_slopes.shape) if hasattr(alibi_slopes, "shape") else np.shape(alibi_slopes)
            if shape not in ((self.heads_q,), (self.batch, self.heads_q)):
                raise ValueError(f"alibi_slopes must be (heads_q,) or (batch, heads_q); got {shape}")
        add = self.seqlen_q if self.append else 0
        _refuse_bool_lens(cache_seqlens)
        self.lens = None  # host values (None on CUDA, where only the device holds them)
        if self.is_cuda or not check_values:
            # Values on the device are not read (the kernels clamp them); host values (an int, a
            # list, a numpy array, a CPU tensor) are checked: that needs no synchronization.
            if isinstance(cache_seqlens, (int, np.integer)):
                self._check_lens(np.full(self.batch, int(cache_seqlens), dtype=np.int64), add, one=True)
            elif cache_seqlens is not None:
                n = tuple(cache_seqlens.shape) if hasattr(cache_seqlens, "shape") else (len(cache_seqlens),)
                if n != (self.batch,):
                    raise ValueError(f"cache_seqlens must be an int or have shape (batch,) = ({self.batch},); "
                                     f"got {n}")
                # a list or a numpy array always; a CPU tensor unless this is a fake (no data)
                if not _is_torch(cache_seqlens) or (check_values and cache_seqlens.device.type == "cpu"):
                    self._check_lens(_ints(cache_seqlens, "cache_seqlens").reshape(-1), add)
            return
        if cache_seqlens is None:
            lens = np.full(self.batch, self.slots - add, dtype=np.int64)
        elif isinstance(cache_seqlens, (int, np.integer)):
            lens = np.full(self.batch, int(cache_seqlens), dtype=np.int64)
        else:
            lens = _ints(cache_seqlens, "cache_seqlens").reshape(-1)
            if lens.shape != (self.batch,):
                raise ValueError(f"cache_seqlens must be an int or have shape (batch,) = ({self.batch},); "
                                 f"got {lens.shape}")
        self._check_lens(lens, add)
        self.lens = lens
        if self.paged:
            table = _ints(block_table, "block_table")
            for b in range(self.batch):
                used = (int(lens[b]) + add + self.page_size - 1) // self.page_size
                row = table[b, :used]
                if row.size and (row.min() < 0 or row.max() >= self.num_pages):
                    bad = int(row[(row < 0) | (row >= self.num_pages)][0])
                    raise ValueError(f"block_table[{b}] holds page {bad}, outside [0, num_pages {self.num_pages})")

    def _check_lens(self, lens: np.ndarray, add: int, one: bool = False) -> None:
        for b, c in enumerate(lens):
            name = "cache_seqlens" if one else f"cache_seqlens[{b}]"
            if c < 0:
                raise ValueError(f"{name} {int(c)} is negative")
            if c + add > self.slots:
                raise ValueError(f"{name} {int(c)}" + (f" + seqlen_q {add}" if add else "") +
                                 f" = {int(c) + add} keys exceed the cache's {self.slots} slots per sequence")
            if one:
                return


_PLAN_CACHE: "collections.OrderedDict[tuple, BatchDecodeWithKVCache]" = collections.OrderedDict()
_PLAN_CACHE_SIZE = 32
# Emptied before the interpreter finalizes the extension: its DecodePlans would otherwise still be
# alive when nanobind checks for leaks at shutdown, and it prints a leak warning for each.
atexit.register(_PLAN_CACHE.clear)


def _cached_plan(key: tuple, make: Any) -> BatchDecodeWithKVCache:
    w = _PLAN_CACHE.get(key)
    if w is not None:
        _PLAN_CACHE.move_to_end(key)
        return w
    w = make()
    _PLAN_CACHE[key] = w
    while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    return w


def _check_kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                        window_size, softcap, alibi_slopes, num_splits, rope_theta,
                        check_values: bool = True, k_scale: Any = None,
                        v_scale: Any = None) -> Tuple["_Step", Tuple[int, int]]:
    """The checks of a flash_attn_with_kvcache call (shapes only with check_values False: the
    fake of the torch op). Returns the checked step and the window."""
    _core.check_int(num_splits, "num_splits", 0, MAX_SPLITS, " (0 = heuristic)")  # not a bool, not a float
    window = _core.check_window(window_size)
    if _core.check_softcap(softcap) < 0 or not np.isfinite(softcap):
        raise ValueError(f"softcap must be finite and >= 0; got {softcap}")
    if rotary_cos is not None and rope_theta is not None:
        raise ValueError("pass rotary_cos/rotary_sin or rope_theta, not both")
    if rope_theta is not None:
        _core.check_real(rope_theta, "rope_theta")  # a number: True is not a base of 1.0
    st = _Step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes,
               check_values)
    if not check_values:  # the fake: the scales' presence and shapes (a number never reaches the op)
        _scales(k_scale, v_scale, st.kv_dtype == FP8_E4M3, st.heads_kv, q, st.is_cuda, st.device, check_values=False)
    if rotary_cos is not None:
        cols = _core.meta(rotary_cos, "rotary_cos").shape
        rd = 2 * cols[1] if len(cols) == 2 else 0
        if not 2 <= rd <= st.head_dim:
            raise ValueError(f"rotary_cos has {rd // 2} columns: rotary_dim {rd} must be in [2, head_dim {st.head_dim}]")
    return st, window


def _with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, softmax_scale,
                  causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
                  rope_theta, k_scale=None, v_scale=None) -> Any:
    """The body of flash_attn_with_kvcache (eager, and the torch ops' body)."""
    st, window = _check_kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                                     window_size, softcap, alibi_slopes, num_splits, rope_theta)
    rotary = None
    if rotary_cos is not None or rope_theta is not None:
        rotary = "interleaved" if rotary_interleaved else "neox"
    device = st.device if st.is_cuda else "cpu"
    cfg = dict(seqlen_q=st.seqlen_q, kv_capacity=st.slots, page_size=st.page_size, append=st.append,
               causal=_core.check_flag(causal, "causal"), window_size=window, softcap=float(softcap),
               sm_scale=softmax_scale, rotary=rotary, rope_theta=float(rope_theta) if rope_theta is not None else 10000.0,
               dtype=st.dtype, device=device, num_splits=int(num_splits), head_dim_v=st.head_dim_v,
               kv_dtype=st.kv_dtype)
    shape = (st.batch, st.heads_q, st.heads_kv, st.head_dim)
    if st.is_cuda:
        if isinstance(cache_seqlens, (int, np.integer)):
            cache_seqlens = _core.torch.full((st.batch,), int(cache_seqlens), dtype=_core.torch.int32, device=device)
        elif cache_seqlens is None:
            cache_seqlens = _core.torch.full((st.batch,), st.slots - (st.seqlen_q if st.append else 0),
                                             dtype=_core.torch.int32, device=device)
        key = (str(device), shape, tuple(sorted((n, str(x)) for n, x in cfg.items())))

        def make() -> BatchDecodeWithKVCache:
            if _capturing(device):
                raise RuntimeError("flash_attn_with_kvcache: no plan for this shape yet and a CUDA graph is being "
                                   "captured; call it once before the capture (warm-up), or capture "
                                   "BatchDecodeWithKVCache.run() after its plan()")
            w = BatchDecodeWithKVCache()
            w.plan(*shape, **cfg)  # waits for the work-list upload: later calls may use any stream
            return w

        w = _cached_plan(key, make)
    else:
        w = BatchDecodeWithKVCache()
        w.plan(*shape, cache_seqlens=st.lens, **cfg)
        cache_seqlens = np.ascontiguousarray(st.lens, dtype=np.int32)
    return w.run(q, k_cache, v_cache, cache_seqlens, block_table=block_table, k=k, v=v, rotary_cos=rotary_cos,
                 rotary_sin=rotary_sin, alibi_slopes=alibi_slopes, return_lse=return_softmax_lse, k_scale=k_scale,
                 v_scale=v_scale)


# ---- the eager fast path of flash_attn_with_kvcache ------------------------------------------------
# A plain step (torch tensors of one dtype on the host or the current CUDA device: q, the caches
# and the new k/v; int32 cache_seqlens and block_table tensors there; no rotary, ALiBi, fp8 scales,
# cache_batch_idx or cache_leftpad) is read, checked and run by one C++ call (_C.kvcache_fast,
# python/src/eager_fast.cc), which fills DecodeParams straight from shapes, strides and pointers. On
# CUDA it looks the plan of the shape up in the plan table itself, under a key of plain values, and
# asks plan_for (below) only on a miss: the plan made as the general path makes it (for full caches)
# and kept in the same table. On the host plan_for makes a plan for this call's lengths (host
# lengths: the C++ validator checks them). Anything else, a first call under CUDA graph capture
# included, runs the general path with its Python checks and sentences.
# tests/python/test_kvcache_fast_path.py.
#
# The C++ call also does what flash_attn_with_kvcache's guard did before it, in the guard's order:
# it returns None where autograd records (grad mode on and q, a cache or the new k/v requires grad;
# the caller then refuses or runs without a backward), then checks window_size and, for an append,
# the caches (inference tensors, shared memory), and moves the caches' version counters after an
# append under grad mode. So flash_attn_with_kvcache calls it before its grad test (~1.7 us on the
# CPU machine with six arguments), and again after that test only for a call it stepped aside for.
torch = _core.torch
_FAST_TYPES = _core.FAST_TYPES


_DTYPE_OF_CODE = {} if torch is None else {code: dt for dt, code in _core.FAST_CODES.items()}


def _plain_kvcache_args(causal, softcap, num_splits, return_lse) -> bool:
    """Whether the fast path takes these arguments (anything else: the general path says why;
    kvcache_fast takes a bool)."""
    return (causal.__class__ is bool and return_lse.__class__ is bool and softcap.__class__ in (float, int)
            and type(num_splits) is int and 0 <= num_splits <= MAX_SPLITS)


def _fast_kvcache_checks(q, k_cache, v_cache, k, causal, window_size, softcap, num_splits, return_lse) -> None:
    """What _C.kvcache_fast checks before it runs a step, in Python, in its order: for a call it
    returned None for (after flash_attn_with_kvcache's grad test), so that the sentences come as
    they came when these checks ran before it."""
    if not _plain_kvcache_args(causal, softcap, num_splits, return_lse):
        return
    _core.check_window(window_size)
    if k is not None and type(k_cache) in _FAST_TYPES and type(v_cache) in _FAST_TYPES:
        # the C++ call appends into both caches: what the general path's run() refuses is refused first
        _core.check_inference_write(k_cache, "k_cache")
        _core.check_inference_write(v_cache, "v_cache")
        _core.check_caches_apart(k_cache, v_cache)


def _fast_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size,
                  softcap, num_splits, return_lse) -> Any:
    """flash_attn_with_kvcache on the fast path: (out, lse or None), or None when it does not apply
    (where autograd records too). The tensors are read, checked and run by _C.kvcache_fast
    (python/src/eager_fast.cc); it asks plan_for below for a plan it does not find."""
    if not _plain_kvcache_args(causal, softcap, num_splits, return_lse):
        return None

    def plan_for(B, Sq, Hq, Hkv, D, Dv, slots, ps, append, device, code, window, key) -> Any:
        # (the C++ call asks only with heads_q > 0, window the checked window_size, and on CUDA
        # with the key it missed in _PLAN_CACHE)
        dt = _DTYPE_OF_CODE[code]
        shape = (B, Hq, Hkv, D)

        def config() -> dict:  # the plan's arguments: built only when a plan is made
            return dict(seqlen_q=Sq, kv_capacity=slots, page_size=ps, append=append, causal=bool(causal),
                        window_size=window, softcap=float(softcap), sm_scale=softmax_scale, rotary=None,
                        rope_theta=10000.0, dtype=_core._TORCH_DTYPE_NAMES[dt],
                        device=q.device if device >= 0 else "cpu", num_splits=num_splits, head_dim_v=Dv,
                        kv_dtype=None)

        if device < 0:  # the host: a plan for this call's lengths (the C++ validator checks them)
            w = BatchDecodeWithKVCache()
            w.plan(*shape, cache_seqlens=cache_seqlens.numpy(), **config())
            return w
        if key not in _PLAN_CACHE and _capturing(q.device):
            return None  # the general path says why a first call cannot be captured

        def make() -> BatchDecodeWithKVCache:
            w = BatchDecodeWithKVCache()
            w.plan(*shape, **config())  # waits for the work-list upload: later calls may use any stream
            return w

        return _cached_plan(key, make)

    return _C.kvcache_fast(q, k_cache, v_cache, k, v, cache_seqlens, block_table, plan_for, return_lse, _PLAN_CACHE,
                           causal, window_size, softcap, softmax_scale, num_splits)


# ---- FlashInfer's paged wrapper ---------------------------------------------------------------------

class BatchDecodeWithPagedKVCache:
    """Plan/run decode over a paged KV cache (FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``).

    ``plan()`` takes FlashInfer's page description on the host (``indptr``, ``indices``,
    ``last_page_len``), builds the block table and lengths (on the workspace's device) and plans;
    ``run()`` computes one step for every sequence and is CUDA-graph capturable.
    ``kv_layout`` "NHD" caches are (pages, page_size, heads_kv, head_dim), "HND" (pages, heads_kv,
    page_size, head_dim); ``paged_kv_cache`` is a (k, v) pair or one (pages, 2, ...) array (a pair
    when v's head dim differs: plan with ``head_dim_vo``). The LSE
    is the natural log (FlashInfer's is base 2). Keys are expected already rotated (flashcpp rotates
    at append time), so ``pos_encoding_mode`` must be "NONE".

    Where it runs: on ``device``, else on ``workspace_buffer``'s CUDA device, else where ``indptr``
    lives (host arrays: the CPU backend). plan() needs the dtype (``q_data_type`` or ``data_type``)
    to plan right away; without it the first run() plans (outside a CUDA graph capture), and a
    run() with another dtype or device than planned plans again.
    """

    def __init__(self, workspace_buffer: Any = None, kv_layout: str = "NHD", device: Any = None) -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND'; got {kv_layout!r}")
        self._layout = kv_layout
        self._inner = BatchDecodeWithKVCache(workspace_buffer)
        self._device = device
        if device is None and _is_torch(workspace_buffer) and workspace_buffer.device.type == "cuda":
            self._device = workspace_buffer.device
        self._plan: Optional[dict] = None

    def plan(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: Optional[float] = 0.0, q_data_type: Any = None, kv_data_type: Any = None,
             data_type: Any = None, sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True, num_splits: int = 0,
             head_dim_vo: Optional[int] = None) -> None:
        """FlashInfer's plan(). Its keywords that flashcpp has no use for are accepted as FlashInfer
        spells them: rope_scale / rope_theta only as None (they belong to pos_encoding_mode
        "ROPE_LLAMA", which is not built), non_blocking (ignored: the work list is uploaded and
        waited for). Any other keyword is a TypeError, as a misspelling must be. head_dim_vo (the
        name FlashInfer's prefill wrappers give it): the head dim of the value cache and the
        output, when it differs from head_dim (None = head_dim)."""
        if rope_scale is not None or rope_theta is not None:
            raise NotImplementedError("rope_scale / rope_theta belong to pos_encoding_mode 'ROPE_LLAMA', which is not "
                                      "built: rotate keys when they are appended (flash_attn_with_kvcache with rotary)")
        if pos_encoding_mode != "NONE":
            raise NotImplementedError(f"pos_encoding_mode {pos_encoding_mode!r} is not built: flashcpp rotates keys "
                                      "when they are appended (flash_attn_with_kvcache with rotary), so the cache "
                                      "holds rotated keys and decode reads them as they are")
        if _capturing(self._device if self._device is not None else "cpu"):
            raise RuntimeError("plan() runs on the host: call it before the CUDA graph capture")
        # Checked here, not at run(): a float is not truncated (window_left=1.5 ran as 1).
        for name, val, lo in (("num_qo_heads", num_qo_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                              ("head_dim", head_dim, 1), ("page_size", page_size, 1), ("num_splits", num_splits, 0)):
            _core.check_int(val, name, lo)
        if head_dim_vo is not None:
            _core.check_int(head_dim_vo, "head_dim_vo", 1, what=" (None = head_dim)")
        _core.check_int(window_left, "window_left", -1, what=" (the left of window_size; -1 = unbounded)")
        _core.check_flag(non_blocking, "non_blocking")  # ignored, but a yes/no all the same
        if logits_soft_cap is not None:
            cap = _core.check_softcap(logits_soft_cap, "logits_soft_cap")  # a number: True is not a cap of 1.0
            if not (math.isfinite(cap) and cap >= 0):
                raise ValueError(f"logits_soft_cap must be finite and >= 0 (0 or None = off); got {logits_soft_cap!r}")
        if sm_scale is not None:
            _core.default_scale(sm_scale, int(head_dim))
        device = self._device
        if device is None and _is_torch(indptr) and indptr.device.type == "cuda":
            device = indptr.device
        indptr, indices, last = (_ints(x, n) for x, n in ((indptr, "indptr"), (indices, "indices"),
                                                           (last_page_len, "last_page_len")))
        batch = indptr.size - 1
        if batch < 0 or last.shape != (batch,):
            raise ValueError(f"last_page_len must have one entry per sequence ({batch}); got {last.shape}")
        if not _is_pow2(int(page_size)) or page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size {page_size} is not a power of two in [1, {MAX_PAGE_SIZE}]")
        pages = np.diff(indptr)
        if pages.size and pages.min() < 0:
            raise ValueError("indptr must be non-decreasing")
        if indptr.size and (indptr[0] < 0 or indptr[-1] > indices.size):
            raise ValueError(f"indptr must index into indices: it runs from {int(indptr[0])} to {int(indptr[-1])}, "
                             f"and indices has {indices.size} entries")
        width = max(int(pages.max()) if pages.size else 1, 1)
        table = np.zeros((batch, width), dtype=np.int32)
        lens = np.zeros(batch, dtype=np.int32)
        for b in range(batch):
            n = int(pages[b])
            table[b, :n] = indices[indptr[b]:indptr[b + 1]]
            if n and not 1 <= last[b] <= page_size:
                raise ValueError(f"last_page_len[{b}] {int(last[b])} must be in [1, page_size {page_size}]")
            lens[b] = (n - 1) * page_size + int(last[b]) if n else 0
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        dtype = q_data_type if q_data_type is not None else data_type
        # The cache's dtype: q's unless kv_data_type names fp8 e4m3 (run() then takes k_scale/v_scale).
        kv_fp8 = kv_data_type is not None and _names_fp8(kv_data_type)
        self._plan = dict(table=table, lens=lens, heads_q=int(num_qo_heads), heads_kv=int(num_kv_heads),
                          head_dim=int(head_dim), head_dim_v=int(head_dim if head_dim_vo is None else head_dim_vo),
                          page_size=int(page_size), window=(int(window_left), -1),
                          softcap=0.0 if logits_soft_cap is None else cap, scale=sm_scale, num_splits=int(num_splits),
                          device=device, dtype=None, table_dev=table, lens_dev=lens, kv_fp8=kv_fp8)
        if dtype is not None:
            self._plan_for(_dtype_name(dtype), device)

    def _plan_for(self, dtype: str, device: Any) -> None:
        p = self._plan
        is_cuda = device is not None and str(device) != "cpu"
        torch = _core.torch
        if is_cuda:
            device = torch.device(device)
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            p["table_dev"] = torch.as_tensor(p["table"], device=device)
            p["lens_dev"] = torch.as_tensor(p["lens"], device=device)
        else:
            device = "cpu"
            p["table_dev"], p["lens_dev"] = p["table"], p["lens"]
        self._inner.plan(p["lens"].size, p["heads_q"], p["heads_kv"], p["head_dim"], head_dim_v=p["head_dim_v"],
                         kv_capacity=p["table"].shape[1] * p["page_size"], page_size=p["page_size"],
                         cache_seqlens=p["lens"], causal=True, window_size=p["window"], softcap=p["softcap"],
                         sm_scale=p["scale"], dtype=dtype, device=device, num_splits=p["num_splits"],
                         kv_dtype=FP8_E4M3 if p["kv_fp8"] else None)
        p["dtype"], p["device"] = dtype, device

    def run(self, q: Any, paged_kv_cache: Any, return_lse: bool = False, out: Any = None, lse: Any = None, *,
            k_scale: Any = None, v_scale: Any = None) -> Any:
        """One step (FlashInfer's run()). k_scale, v_scale: an fp8 cache's scales (planned with
        kv_data_type float8_e4m3fn): a number or fp32 (num_kv_heads,), K = code * k_scale."""
        if self._plan is None:
            raise RuntimeError("call plan() before run()")
        p = self._plan
        if isinstance(paged_kv_cache, (tuple, list)):
            k_cache, v_cache = paged_kv_cache
        else:
            k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
        if self._layout == "HND":
            k_cache, v_cache = (x.transpose(0, 2, 1, 3) if isinstance(x, np.ndarray) else x.transpose(1, 2)
                                for x in (k_cache, v_cache))
        mq = _core.meta(q, "q")
        shape = tuple(mq.shape)
        if shape != (p["lens"].size, p["heads_q"], p["head_dim"]):
            raise ValueError(f"q must be (batch, num_qo_heads, head_dim) = ({p['lens'].size}, {p['heads_q']}, "
                             f"{p['head_dim']}) as planned; got {shape}")
        if _core.meta(k_cache, "k_cache").shape[1] != p["page_size"]:
            raise ValueError(f"the cache's page size {_core.meta(k_cache, 'k_cache').shape[1]} differs from the "
                             f"planned {p['page_size']}")
        is_cuda, device = _device_of(q)
        want_dev = device if is_cuda else "cpu"
        if p["dtype"] != mq.dtype or str(p["device"]) != str(want_dev):
            if mq.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"q has dtype {mq.dtype}; decode takes float16, bfloat16 or float32")
            if _capturing(want_dev):
                raise RuntimeError("run() inside a CUDA graph capture needs a plan for q's dtype and device: pass "
                                   "q_data_type to plan() or run once before the capture")
            self._plan_for(mq.dtype, want_dev)
        q4 = q[:, None]
        o4 = None if out is None else out[:, None]
        l3 = None if lse is None else lse[:, :, None]
        res = self._inner.run(q4, k_cache, v_cache, p["lens_dev"], block_table=p["table_dev"], out=o4, lse=l3,
                              return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
        if not (return_lse or lse is not None):
            return res[:, 0]
        o, l = res
        return o[:, 0], l[:, :, 0]
