"""The attention problem, below the public functions and the torch ops: checks a call's inputs
into a ``_Problem`` (``_prepare``) and runs it through ``_core.launch`` (``_execute``,
``_select``). ``attention.py`` (numpy arrays, the low-level ``attention``) and ``_torch_ops.py``
(the bodies of the ``torch.ops.flashcpp`` attention ops) both call these, so neither imports the
other's internals. The flattened form of a :class:`Rotary` that the torch ops take
(``_rotary_op_args`` and its inverse) lives here too, for the same reason: the caller builds it
and the op reads it.

Imports only lower modules: ``_core``, ``fused`` (the rotary argument checks it shares with
apply_rotary) and ``masks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from . import _core
from . import _flashcpp as _C
from ._core import torch
from .fused import _STYLES, _cache_arg, _check_out, _llama3, _positions_arg, _rope_view, _rotary_spec
from .masks import BlockSparse, _to_torch


@dataclass(frozen=True)
class Rotary:
    """Rotary embedding fused into attention (``AttnParams::rotary``): q and k are rotated as
    :func:`flashcpp.apply_rotary` rotates them, then attention runs on the rotated values (in the
    input dtype); q and k themselves are not modified.

    rotary_dim: leading dims that rotate (None or 0 = head_dim). style: "neox" or "interleaved".
    theta / llama3 (a Hugging Face rope_scaling dict), or cos_sin_cache: float32
    (max_position, rotary_dim) rows of [cos | sin]. positions_q / positions_k: int32 per query /
    key row, shape (batch * seqlen,) or (batch, seqlen), or (total,) with varlen; None means
    query row i at i + len_k - len_q (the causal alignment) and key j at j. Arrays live where
    q does (flash_attn_func copies host arrays to q's device on each call).

    k_out: where the rotated keys go, a tensor (or numpy array) shaped like k, with k's dtype and
    device, any strides with a contiguous head_dim; k itself rotates k in place. A model stores
    these in its KV cache. Otherwise it must not overlap q, k, v or the outputs. On CUDA the keys
    are rotated once into it before the kernel reads them (without k_out, into a fresh buffer
    allocated per call); the CPU backends fill it only when it is given.

    The CUDA kernels read the rotated keys from that buffer and rotate q tiles as they load them
    (bit for bit apply_rotary's values); they need rotary_dim % 8 == 0 for neox, % 4 for
    interleaved (NotImplementedError otherwise).
    """
    rotary_dim: Optional[int] = None
    style: str = "neox"
    theta: float = 10000.0
    llama3: Optional[Mapping[str, Any]] = None
    cos_sin_cache: Any = None
    positions_q: Any = None
    positions_k: Any = None
    k_out: Any = None


class KernelChoice(NamedTuple):
    kernel: str  # e.g. "cpu_tiled_online_softmax", "cuda_sm80_fa2"
    config: str  # tile config name ("" for CPU kernels)
    reason: str  # one sentence: why this kernel


def _as_host_int32(cu: Any, name: str) -> np.ndarray:
    arr = np.asarray(cu)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32); got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > _core._INT32_MAX):
        raise ValueError(f"{name} values must fit int32 and be >= 0")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _as_host_f32(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


class _Problem(NamedTuple):
    q: Any
    k: Any
    v: Any
    dims: _core.Dims
    mq: _core.Meta
    mk: _core.Meta
    mv: _core.Meta
    varlen: bool
    shape_o: Tuple[int, ...]
    shape_lse: Tuple[int, ...]
    alibi: Any
    alibi_batch_stride: int
    cu_q: Any
    cu_k: Any
    window: Tuple[int, int]
    scale: float
    sparse: Optional[_core.BlockSparseSpec]
    rotary: Optional["_RotarySpec"] = None


class _RotarySpec(NamedTuple):
    """A checked Rotary: scalars plus its arrays converted to q's library and device."""
    rotary_dim: int
    style: int  # RopeStyle value
    theta: float
    llama3: Tuple[float, float, float, int]  # factor (0 = off), low, high, original_max_position
    cos_sin_cache: Any
    max_position: int
    positions_q: Any
    positions_k: Any
    k_out: Any  # Rotary.k_out, checked (None = not given)

    def binding(self, k_rotated: Any, dtype_code: int, varlen: bool) -> Any:
        """The binding's AttnRotary, with k_rotated (k_out or a buffer like it; None = none) in the
        inputs' dtype. rotary_dim is resolved (never 0), so the cache's columns are rotary_dim."""
        r = _C.AttnRotary()
        r.spec = _rotary_spec(self.style, self.rotary_dim, self.rotary_dim, self.theta, self.llama3,
                              self.cos_sin_cache, self.max_position)
        r.positions_q, r.positions_k = _core.data_ptr(self.positions_q), _core.data_ptr(self.positions_k)
        if k_rotated is not None and _core.data_ptr(k_rotated):
            r.k_rotated = _core.tensor_view(k_rotated, _core.meta(k_rotated, "rotary.k_out"), dtype_code, varlen)
        return r


def _sparse_for(block_sparse: Any, mq: _core.Meta) -> _core.BlockSparseSpec:
    """The mask with its arrays in q's library: CPU torch tensors become numpy views for numpy q,
    numpy arrays become (copied) torch tensors for CPU torch q. Host arrays are never copied to a
    GPU here: for CUDA tensors the caller converts the mask once with BlockSparse.to(device)."""
    if isinstance(block_sparse, _core.BlockSparseSpec):
        bs = block_sparse
    elif isinstance(block_sparse, BlockSparse):
        bs = _core.sparse_spec(block_sparse)
    else:
        raise TypeError(f"block_sparse must be a flashcpp.BlockSparse (from block_sparse_from_mask, "
                        f"block_sparse_from_rules, causal_block_sparse or document_block_sparse); got "
                        f"{type(block_sparse).__name__}")
    arrays = [getattr(bs, f) for f in _core.SPARSE_ARRAYS]
    if mq.lib == "numpy":
        for a in arrays:
            if _core.is_torch(a) and a.device.type != "cpu":
                raise ValueError(f"block_sparse has arrays on {a.device}, but q is a numpy array (host memory); "
                                 "use a mask with host arrays")
        conv = lambda a: a.detach().numpy() if _core.is_torch(a) else a  # noqa: E731
    else:
        if mq.is_cuda and any(isinstance(a, np.ndarray) for a in arrays):
            raise ValueError(f"block_sparse holds numpy (host) arrays, but q is on {mq.device}: move the mask to "
                             "the GPU once with block_sparse.to(q.device) and reuse it (it is not copied on "
                             "every call)")
        conv = lambda a: _to_torch(a, "cpu") if isinstance(a, np.ndarray) else a  # noqa: E731
    return bs._replace(**{f: conv(a) for f, a in zip(_core.SPARSE_ARRAYS, arrays)})


def _rotary_scalars(rotary: Any, head_dim: int) -> Tuple[int, int]:
    """(rotary_dim, style code) of a Rotary, checked."""
    if not isinstance(rotary, Rotary):
        raise TypeError(f"rotary must be a flashcpp.Rotary; got {type(rotary).__name__}")
    if rotary.style not in _STYLES:
        raise ValueError(f"rotary.style must be one of {', '.join(_STYLES)}; got {rotary.style!r}")
    rot = head_dim if rotary.rotary_dim is None else _core.check_int(rotary.rotary_dim, "rotary.rotary_dim", 0, head_dim)
    # 0 means head_dim, as in apply_rotary and RotarySpec (rope.h); resolved here, so the torch
    # ops' flattened arguments keep rotary_dim 0 for "no rotary".
    return rot or head_dim, int(_STYLES[rotary.style])


def _rotary_arg(rotary: Rotary, q: Any, mk: _core.Meta, dims: _core.Dims, varlen: bool, rows_q: int,
                rows_k: int) -> _RotarySpec:
    """The checked spec of a Rotary for these inputs (shapes, dtypes and devices only: no values
    are read, so FakeTensors pass through). Overlaps of k_out are the C++ validator's."""
    rot, style = _rotary_scalars(rotary, dims.head_dim)
    shapes_q = ((rows_q,),) if varlen else ((rows_q,), (dims.batch, dims.seqlen_q))
    shapes_k = ((rows_k,),) if varlen else ((rows_k,), (dims.batch, dims.seqlen_k))
    pos_q = _positions_arg(rotary.positions_q, q, "rotary.positions_q", shapes_q)
    pos_k = _positions_arg(rotary.positions_k, q, "rotary.positions_k", shapes_k)
    cache, max_position = _cache_arg(rotary.cos_sin_cache, q, rot)
    if rotary.k_out is not None:
        _rope_view(_check_out(rotary.k_out, "rotary.k_out", mk.shape, mk))  # head_dim contiguous, strides >= 0
    return _RotarySpec(rot, style, float(rotary.theta), _llama3(rotary.llama3), cache, max_position, pos_q, pos_k,
                       rotary.k_out)


def _rotary_binding(p: _Problem, stream: Optional[int] = None) -> Any:
    """The binding's AttnRotary (None without rotary). CUDA rotates the keys once into a buffer
    before the kernel reads them (AttnParams::rotary.k_rotated): Rotary.k_out, or without it a
    fresh one shaped like k that lives until the kernel on `stream` (None = torch's current
    stream) is done with it."""
    if p.rotary is None:
        return None
    k_rotated = p.rotary.k_out
    if k_rotated is None and p.mq.is_cuda:
        k_rotated = torch.empty(p.mk.shape, dtype=p.k.dtype, device=p.k.device)
        if stream is not None:  # freed on return: the caching allocator must wait for that stream
            k_rotated.record_stream(torch.cuda.ExternalStream(int(stream), device=p.k.device))
    return p.rotary.binding(k_rotated, _core._ATTN_DTYPE_CODES[p.mq.dtype], p.varlen)


def _prepare(q, k, v, softmax_scale, window_size, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q, max_seqlen_k, block_sparse=None, rotary=None) -> _Problem:
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    dims, mq, mk, mv = _core.check_qkv(q, k, v, varlen=varlen)
    if varlen and block_sparse is not None:
        raise NotImplementedError("varlen (cu_seqlens) together with a block-sparse mask is not supported; "
                                  "express the packed documents as document_block_sparse(cu_seqlens_q, "
                                  "cu_seqlens_k, ...) over the packed tensors viewed as batch 1")
    window = _core.check_window(window_size)
    torch_in = _core.is_torch(q)
    cu_q = cu_k = None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("varlen attention needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
                             "max_seqlen_k together")
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        if not torch_in:
            cu_q, cu_k = _as_host_int32(cu_q, "cu_seqlens_q"), _as_host_int32(cu_k, "cu_seqlens_k")
        batch = _core.check_cu_seqlens(cu_q, "cu_seqlens_q", mq)
        if _core.check_cu_seqlens(cu_k, "cu_seqlens_k", mq) != batch:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); "
                             f"got {batch + 1} and {cu_k.shape[0]}")
        if not (_core._is_int(max_seqlen_q) and _core._is_int(max_seqlen_k)
                and 0 <= max_seqlen_q <= _core._INT32_MAX and 0 <= max_seqlen_k <= _core._INT32_MAX):
            raise ValueError(f"max_seqlen_q/max_seqlen_k must be ints in [0, 2**31-1] (a float is not truncated); "
                             f"got {max_seqlen_q!r}, {max_seqlen_k!r}")
        max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
        if not mq.is_cuda:  # host memory: check the values (device memory would need a sync)
            host = (lambda c: c.numpy()) if torch_in else (lambda c: c)
            _core.check_cu_seqlens_values(host(cu_q), "cu_seqlens_q", mq.shape[0], max_q)
            _core.check_cu_seqlens_values(host(cu_k), "cu_seqlens_k", mk.shape[0], max_k)
        dims = dims._replace(batch=batch, seqlen_q=max_q, seqlen_k=max_k)
        shape_o = (mq.shape[0], dims.heads_q, dims.head_dim_v)
        shape_lse = (dims.heads_q, mq.shape[0])
    else:
        shape_o = (dims.batch, dims.seqlen_q, dims.heads_q, dims.head_dim_v)
        shape_lse = (dims.batch, dims.heads_q, dims.seqlen_q)
    alibi, alibi_bs = alibi_slopes, 0
    if alibi is not None:
        if not torch_in:
            alibi = _as_host_f32(alibi)
        alibi_bs = _core.check_alibi(alibi, dims, mq)
    sparse = None
    if block_sparse is not None:
        sparse = _sparse_for(block_sparse, mq)
        _core.check_block_sparse(sparse, dims, mq)
    scale = _core.default_scale(softmax_scale, dims.head_dim)
    rot = None
    if rotary is not None:
        rows_q = mq.shape[0] if varlen else dims.batch * dims.seqlen_q
        rows_k = mk.shape[0] if varlen else dims.batch * dims.seqlen_k
        rot = _rotary_arg(rotary, q, mk, dims, varlen, rows_q, rows_k)
    return _Problem(q, k, v, dims, mq, mk, mv, varlen, shape_o, shape_lse, alibi, alibi_bs,
                    cu_q, cu_k, window, scale, sparse, rot)


def _empty(like: Any, shape, dtype=None):
    if _core.is_torch(like):
        return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)
    return np.empty(shape, dtype=like.dtype if dtype is None else dtype)



def _execute(p: _Problem, out: Any, lse: Any, *, causal: bool, softcap: float,
             global_tokens: int = 0, global_queries: bool = False, backend: str = "auto",
             cpu_threads: int = 0, cuda_config: str = "", stream: Optional[int] = None) -> None:
    """Runs a checked problem into checked outputs (shared by `attention` and the torch ops)."""
    if p.dims.heads_q == 0 or p.mq.shape[0] == 0 or (not p.varlen and (p.dims.batch == 0 or p.dims.seqlen_q == 0)):
        return  # nothing to compute (and empty arrays may have null pointers)
    # varlen with batch 0 (cu_seqlens = [0]) or max_seqlen_q 0 still has packed rows: the C++ entry
    # point writes O = 0 and LSE = -inf into all of them (MaskParams::total_q), on every backend.
    if p.dims.seqlen_k == 0 or p.mk.shape[0] == 0:
        # No key at all: every row sees nothing, O = 0 and LSE = -inf (the documented rule).
        out[...] = 0
        if lse is not None:
            lse[...] = -np.inf
        return
    _core.launch(p.q, p.k, p.v, out, lse, p.dims, p.mq, p.mk, p.mv, varlen=p.varlen,
                 softmax_scale=p.scale, causal=causal, window=p.window, softcap=softcap,
                 alibi=p.alibi, alibi_batch_stride=p.alibi_batch_stride,
                 global_tokens=global_tokens, global_queries=global_queries,
                 cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, block_sparse=p.sparse,
                 rotary=_rotary_binding(p, stream), backend=backend,
                 cpu_threads=cpu_threads, cuda_config=cuda_config, stream=stream)




def _execute_backward(p: _Problem, out: Any, lse: Any, dout: Any, dlse: Any, dq: Any, dk: Any, dv: Any, *,
                      causal: bool, softcap: float, deterministic: bool = False, backend: str = "auto",
                      cpu_threads: int = 0) -> None:
    """The backward of a checked problem (include/flashcpp/backward.h) into checked dq, dk, dv: out and
    lse are the forward's, dout (out's shape) and dlse (lse's shape, or None) the incoming gradients.
    Empty problems write their zeros here (an empty array may have a null pointer)."""
    if p.rotary is not None:
        raise NotImplementedError("the backward of attention with fused rotary is not implemented: rotate q and "
                                  "k with flashcpp.apply_rotary first and differentiate through that rotation")
    no_q = p.dims.heads_q == 0 or p.mq.shape[0] == 0 or (not p.varlen and (p.dims.batch == 0 or p.dims.seqlen_q == 0))
    no_k = p.dims.heads_kv == 0 or p.mk.shape[0] == 0 or (not p.varlen and (p.dims.batch == 0 or p.dims.seqlen_k == 0))
    if no_q or no_k:
        # No pair at all: every gradient is 0 (backward.h: keys without queries, rows without keys).
        for g in (dq, dk, dv):
            g[...] = 0
        return
    _core.launch_backward(p.q, p.k, p.v, out, lse, dout, dlse, dq, dk, dv, p.dims, p.mq, p.mk, p.mv,
                          varlen=p.varlen, softmax_scale=p.scale, causal=causal, window=p.window, softcap=softcap,
                          alibi=p.alibi, alibi_batch_stride=p.alibi_batch_stride, cu_seqlens_q=p.cu_q,
                          cu_seqlens_k=p.cu_k, block_sparse=p.sparse, deterministic=deterministic,
                          backend=backend, cpu_threads=cpu_threads)


def _select(p: _Problem, *, causal: bool, softcap: float, backend: str = "auto", cuda_config: str = "") -> tuple:
    """(kernel, config, reason) that _execute would run for a checked problem; launches nothing.
    Outputs are allocated for the validator to see real, non-overlapping pointers."""
    out = _empty(p.q, p.shape_o)
    lse = _empty(p.q, p.shape_lse, np.float32 if not _core.is_torch(p.q) else torch.float32)
    return _core.launch(p.q, p.k, p.v, out, lse, p.dims, p.mq, p.mk, p.mv, varlen=p.varlen,
                        softmax_scale=p.scale, causal=causal, window=p.window, softcap=softcap,
                        alibi=p.alibi, alibi_batch_stride=p.alibi_batch_stride,
                        cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, block_sparse=p.sparse,
                        rotary=_rotary_binding(p), backend=backend, cuda_config=cuda_config, select_only=True)


_NO_ROTARY_OP_ARGS = (0, 1, 10000.0, 0.0, 1.0, 4.0, 8192, None, None, None)
_STYLE_NAMES = {int(code): name for name, code in _STYLES.items()}


def _rotary_op_args(rotary: Optional[Rotary], q: Any) -> Tuple[tuple, Any]:
    """(args, k_out): the flashcpp::flash_attn_fwd arguments of a Rotary (rotary_dim 0 = none):
    scalars, its arrays as tensors on q's device (positions int32, the cache float32); and k_out
    as it is (None, or the tensor flashcpp::flash_attn_fwd_rotary_k_out writes the rotated keys
    into). Shapes are checked by the op itself (_prepare), at trace time too."""
    if rotary is None:
        return _NO_ROTARY_OP_ARGS, None
    rot, style = _rotary_scalars(rotary, q.shape[-1])

    def tensor(x, dtype, name):
        if x is None:
            return None
        if isinstance(x, torch.Tensor):
            if x.device != q.device:
                raise ValueError(f"rotary.{name} must be on q's device ({q.device}); got {x.device}")
            return x.to(dtype).contiguous()
        return torch.as_tensor(np.asarray(x), dtype=dtype, device=q.device)
    factor, low, high, orig = _llama3(rotary.llama3)
    k_out = rotary.k_out
    if k_out is not None and not isinstance(k_out, torch.Tensor):
        raise TypeError(f"rotary.k_out must be a torch tensor like k; got {type(k_out).__name__}")
    return (rot, style, float(rotary.theta), factor, low, high, orig,
            tensor(rotary.cos_sin_cache, torch.float32, "cos_sin_cache"),
            tensor(rotary.positions_q, torch.int32, "positions_q"),
            tensor(rotary.positions_k, torch.int32, "positions_k")), k_out


def _rotary_from_op_args(rotary_dim, style, theta, factor, low, high, orig, cache, pos_q, pos_k,
                         k_out=None) -> Optional[Rotary]:
    """The Rotary that _rotary_op_args flattened (None for rotary_dim 0)."""
    if rotary_dim == 0:
        return None
    llama3 = None if factor == 0.0 else {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                                         "original_max_position_embeddings": orig}
    if style not in _STYLE_NAMES:
        raise ValueError(f"rotary style code {style} is not 1 (neox) or 2 (interleaved)")
    return Rotary(rotary_dim=rotary_dim, style=_STYLE_NAMES[style], theta=theta, llama3=llama3,
                  cos_sin_cache=cache, positions_q=pos_q, positions_k=pos_k, k_out=k_out)

