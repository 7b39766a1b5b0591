"""Mask builders: ALiBi slopes and block-sparse masks (the CSR ``BlockSparseMask`` of
``include/flashcpp/attention.h``), built on the host by ``include/flashcpp/masks.h``.

A block-sparse mask cuts the (seqlen_q, seqlen_k) mask into ``block_m x block_n`` blocks and
lists, per query block, the key blocks that have any visible pair: ``partial == -1`` marks a
block whose pairs are all visible (no bits needed), ``partial == p >= 0`` points at element
mask ``p`` of ``element_masks`` (bit ``c % 64`` of word ``c // 64`` in row ``r`` says key
``block_n*kb + c`` is visible to query ``block_m*qb + r``). Blocks with no visible pair are not
listed, so a kernel's work is proportional to ``num_blocks`` (FlexAttention's BlockMask idea).
docs/masks.md has the semantics of every mask kind and the cost model.

    >>> import flashcpp
    >>> slopes = flashcpp.alibi_slopes(12)                     # float32 (12,)
    >>> bs = flashcpp.block_sparse_from_mask(lambda q, k: k <= q, 128, 128,
    ...                                      seqlen_q=1000, seqlen_k=1000)
    >>> bs.num_blocks, bs.block_density                        # (36, 0.5625)
    >>> bool((bs.to_dense()[0, 0] == np.tri(1000, dtype=bool)).all())
    True
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np

from . import _core
from . import _flashcpp as _C
from ._core import torch

__all__ = ["BlockSparse", "alibi_slopes", "block_sparse_from_mask", "block_sparse_from_rules",
           "causal_block_sparse", "document_block_sparse"]


def alibi_slopes(num_heads: int, *, device: Any = None) -> Any:
    """The standard ALiBi slopes for ``num_heads`` heads (BLOOM / Press et al.), float32.

    With n the largest power of two <= num_heads, heads 0..n-1 get 2^(-8 (h+1) / n) and the
    remaining heads take every other slope of the 2n-head sequence, 2^(-8 (2k+1) / (2n)).
    Returns a numpy array of shape (num_heads,), or a torch tensor on ``device`` when given
    (pass it as ``alibi_slopes=`` to the attention functions).
    """
    n = _core.check_int(num_heads, "alibi_slopes: num_heads", 1)  # a float is not truncated
    slopes = np.array(_C.alibi_slopes(n), dtype=np.float32)  # a copy: the result owns its memory
    if device is None:
        return slopes
    if torch is None:
        raise ImportError("alibi_slopes(device=...) returns a torch tensor, but torch is not installed")
    return torch.from_numpy(slopes).to(device)


@dataclass(frozen=True)
class BlockSparse:
    """A block-sparse mask in CSR form over (mask_batch, mask_head, query_block) rows.

    Row r = (b * num_heads + h) * num_q_blocks + qb lists key blocks
    ``col_idx[row_ptr[r]:row_ptr[r+1]]`` (ascending) with ``partial`` entries (-1 = full block,
    p >= 0 = element mask p). num_batch / num_heads are 1 when one mask serves every sequence /
    head. Arrays are numpy (int32, int32, int32, uint64 of shape (num_partial, block_m,
    ceil(block_n / 64))) unless converted with :meth:`to`.
    """

    block_m: int
    block_n: int
    num_batch: int
    num_heads: int
    num_q_blocks: int
    num_k_blocks: int
    seqlen_q: int
    seqlen_k: int
    row_ptr: Any
    col_idx: Any
    partial: Any
    element_masks: Any
    num_full_blocks: int
    visible_pairs: int

    @property
    def num_partial(self) -> int:
        """Number of stored element masks (identical partial blocks may share one)."""
        return int(self.element_masks.shape[0])

    @property
    def num_blocks(self) -> int:
        """Listed blocks over all rows: the work a block-sparse kernel does."""
        return int(self.col_idx.shape[0])

    @property
    def block_density(self) -> float:
        """Listed blocks / all blocks of the grid (0 for an empty grid)."""
        grid = self.num_batch * self.num_heads * self.num_q_blocks * self.num_k_blocks
        return self.num_blocks / grid if grid else 0.0

    def to_dense(self) -> np.ndarray:
        """Expands to a bool (num_batch, num_heads, seqlen_q, seqlen_k) mask (numpy)."""
        bm, bn = self.block_m, self.block_n
        row_ptr, col_idx, partial = (_to_numpy(a) for a in (self.row_ptr, self.col_idx, self.partial))
        masks = _to_numpy(self.element_masks)
        if masks.dtype == np.int64:  # after .to(device): the same 64 bits, stored signed
            masks = masks.view(np.uint64)
        words = (bn + 63) // 64
        # uint64 words -> bits, little-endian within each word: column c is bit c % 64 of word c // 64.
        as_bytes = np.ascontiguousarray(masks, dtype="<u8").view(np.uint8).reshape(masks.shape[0], bm, words * 8)
        bits = np.unpackbits(as_bytes, axis=2, bitorder="little").astype(bool)[:, :, :bn]
        out = np.zeros((self.num_batch, self.num_heads, self.num_q_blocks * bm, self.num_k_blocks * bn),
                       dtype=bool)
        rows_per_head = self.num_q_blocks
        for r in range(row_ptr.shape[0] - 1):
            plane, qb = divmod(r, rows_per_head)
            b, h = divmod(plane, self.num_heads)
            for e in range(int(row_ptr[r]), int(row_ptr[r + 1])):
                kb, p = int(col_idx[e]), int(partial[e])
                out[b, h, qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn] = True if p < 0 else bits[p]
        return out[:, :, :self.seqlen_q, :self.seqlen_k]

    def to(self, device: Any) -> "BlockSparse":
        """The same mask with its arrays as torch tensors on ``device``: what the attention
        functions need for CUDA tensors (convert once, reuse the result for every call; keep it
        alive while a CUDA graph that captured a call with it replays). element_masks becomes
        int64 holding the same bits."""
        if torch is None:
            raise ImportError("BlockSparse.to(device) makes torch tensors, but torch is not installed")
        return dataclasses.replace(self, row_ptr=_to_torch(self.row_ptr, device),
                                   col_idx=_to_torch(self.col_idx, device), partial=_to_torch(self.partial, device),
                                   element_masks=_to_torch(self.element_masks, device))


def _to_numpy(a: Any) -> np.ndarray:
    if _core.is_torch(a):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _to_torch(a: Any, device: Any) -> Any:
    a = np.array(_to_numpy(a), copy=True)  # writable and owned, as torch.from_numpy wants
    if a.dtype == np.uint64:  # torch has no general uint64 arithmetic; the bits are what matter
        a = a.view(np.int64)
    return torch.from_numpy(a).to(device)


def _from_dict(d: dict) -> BlockSparse:
    return BlockSparse(**d)


def _check_blocks(block_m: int, block_n: int) -> Tuple[int, int]:
    if not (_core._is_int(block_m) and _core._is_int(block_n)) or block_m <= 0 or block_n <= 0:
        raise ValueError(f"block_m and block_n must be ints > 0 (a float is not truncated); got {block_m!r} and "
                         f"{block_n!r}")
    return _core.check_int(block_m, "block_m", 1), _core.check_int(block_n, "block_n", 1)


_MAX_ENTRIES = 2**31 - 1  # the CSR's int32 indices, and a dense mask's elements
_MAX_BLOCK_ELEMENTS = 2**26  # a partial block keeps a bit per element


def _check_grid(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, num_batch: int, num_heads: int) -> None:
    """Refuses, up front and with a sentence, a block grid too large to build: more blocks than
    int32 indexes (building it would run out of memory or time), or blocks whose element masks
    could not be held."""
    if block_m * block_n > _MAX_BLOCK_ELEMENTS:
        raise ValueError(f"block_m x block_n = {block_m} x {block_n} is too large for a block's element mask "
                         f"(at most {_MAX_BLOCK_ELEMENTS} elements; the kernels take 128 x 128)")
    q_blocks, k_blocks = -(-max(seqlen_q, 0) // block_m), -(-max(seqlen_k, 0) // block_n)
    blocks = max(num_batch, 1) * max(num_heads, 1) * q_blocks * k_blocks
    if blocks > _MAX_ENTRIES:
        raise ValueError(f"the block grid has {blocks} blocks ({q_blocks} x {k_blocks} per head, {num_batch} x "
                         f"{num_heads} heads): more than 2**31-1; use larger blocks")


def _counts(**named: Any) -> Tuple[int, ...]:
    """Sizes and counts for the C++ builders: ints (a float is not truncated) that fit in int32
    (the binding's own refusal is nanobind's 'incompatible function arguments'). Their sign is
    the C++ builder's to check, with its sentence."""
    return tuple(_core.check_int(v, k, -_core._INT32_MAX - 1) for k, v in named.items())


def _shape(**sizes: int) -> Any:
    """The binding's BlockSparseShape with these fields set (the others keep their defaults)."""
    shape = _C.BlockSparseShape()
    for name, value in sizes.items():
        setattr(shape, name, value)
    return shape


def _rules(causal: bool, window_left: int, window_right: int, global_tokens: int, global_queries: bool) -> Any:
    """The visibility fields of a MaskParams (the rest stay off)."""
    rules = _C.MaskParams()
    rules.causal, rules.global_queries = bool(causal), bool(global_queries)
    rules.window_left, rules.window_right, rules.global_tokens = window_left, window_right, global_tokens
    return rules


def _options(share_identical_partials: bool) -> Any:
    opt = _C.BlockSparseOptions()
    opt.share_identical_partials = bool(share_identical_partials)
    return opt


def _arity(fn: Callable) -> int:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # builtins without a signature: assume FlexAttention's 4
        return 4
    return len(params)


def _is_flag(v: Any) -> bool:
    """A per-element mask value: a bool or an integer (a Python, numpy or 0-d torch one)."""
    if isinstance(v, (bool, np.bool_, int, np.integer)):
        return True
    if isinstance(v, np.ndarray):
        return v.ndim == 0 and v.dtype.kind in "bui"
    if torch is not None and isinstance(v, torch.Tensor):
        return v.dim() == 0 and not v.dtype.is_floating_point and not v.dtype.is_complex
    return False


def _evaluate(fn: Callable, shape: Tuple[int, int, int, int], vectorized: bool) -> np.ndarray:
    """The mask function on every (b, h, q, k) of `shape`, as a C-contiguous uint8 array."""
    nb_, nh, nq, nk = shape
    arity = _arity(fn)
    if arity not in (2, 4):
        raise TypeError(f"mask_fn must take (q_idx, kv_idx) or (b, h, q_idx, kv_idx); it takes {arity} "
                        "required positional arguments")
    if arity == 2 and (nb_ != 1 or nh != 1):
        raise ValueError(f"a (q_idx, kv_idx) mask function is shared by every batch and head: num_batch "
                         f"({nb_}) and num_heads ({nh}) must be 1; use a (b, h, q_idx, kv_idx) function")
    if not vectorized:
        out = np.empty(shape, dtype=np.uint8)
        for idx in np.ndindex(*shape):
            v = fn(*idx[2:]) if arity == 2 else fn(*idx)
            if not _is_flag(v):
                raise TypeError(f"mask_fn must return a boolean (True where the key is visible); at {idx} it "
                                f"returned {v!r}")
            out[idx] = bool(v)
        return out

    def index_arrays(arange):
        b = arange(nb_).reshape(nb_, 1, 1, 1)
        h = arange(nh).reshape(1, nh, 1, 1)
        q = arange(nq).reshape(1, 1, nq, 1)
        k = arange(nk).reshape(1, 1, 1, nk)
        return (q[0, 0], k[0, 0]) if arity == 2 else (b, h, q, k)

    try:
        res = fn(*index_arrays(np.arange))
    except Exception as numpy_error:  # e.g. a FlexAttention mask_mod that calls torch functions
        if torch is None:
            raise TypeError("mask_fn must work on broadcastable integer index arrays (numpy); it raised "
                            f"{type(numpy_error).__name__}: {numpy_error}. Pass vectorized=False to call "
                            "it once per element") from numpy_error
        try:
            res = fn(*index_arrays(lambda n: torch.arange(n)))
        except Exception as torch_error:
            raise TypeError("mask_fn must work on broadcastable integer index arrays (numpy or torch); "
                            f"it raised {type(torch_error).__name__}: {torch_error}. Pass vectorized=False "
                            "to call it once per element") from torch_error
    res = _to_numpy(res)
    if res.dtype.kind not in "bui":  # None (a forgotten return), floats, objects: not a visibility
        raise TypeError(f"mask_fn must return booleans (True where the key is visible); it returned "
                        f"{'None' if res.dtype == object and res.ndim == 0 and res.item() is None else res.dtype}")
    try:
        res = np.broadcast_to(res, (nq, nk) if arity == 2 else shape)
    except ValueError:
        raise ValueError(f"mask_fn returned shape {res.shape}, which does not broadcast to "
                         f"{(nq, nk) if arity == 2 else shape}") from None
    return np.ascontiguousarray(res.reshape(shape) != 0, dtype=np.uint8)


def block_sparse_from_mask(mask: Union[Callable, Any], block_m: int, block_n: int, *,
                           seqlen_q: Optional[int] = None, seqlen_k: Optional[int] = None,
                           num_batch: int = 1, num_heads: int = 1, vectorized: bool = True,
                           share_identical_partials: bool = True) -> BlockSparse:
    """Builds the block-sparse form of a mask given as a function or as a dense bool array.

    mask:
        * a function ``mask_fn(q_idx, kv_idx)`` (one mask for every batch and head) or
          ``mask_fn(b, h, q_idx, kv_idx)`` (FlexAttention's mask_mod signature) returning True
          where the key is visible. It is called once with broadcastable index arrays
          (numpy; torch tensors if numpy fails and torch is installed), so write it with
          operators (``(k <= q) & (doc[q] == doc[k])``); ``vectorized=False`` calls it per
          element instead (slow). Needs ``seqlen_q``/``seqlen_k``; ``num_batch``/``num_heads``
          (1 or the problem's batch / heads_q) size the b and h ranges.
        * a dense bool array (numpy or torch) of shape (seqlen_q, seqlen_k) or
          (num_batch, num_heads, seqlen_q, seqlen_k).
    block_m, block_n: query rows and key columns per block (any positive sizes; the last block
        of each axis may be ragged).

    The dense mask is materialized (num_batch * num_heads * seqlen_q * seqlen_k bytes), then cut
    into blocks in C++ (``build_block_sparse_from_dense``): empty blocks dropped, full ones
    listed without bits, partial ones with bits. ``share_identical_partials`` stores identical
    element masks once. The result expands back to exactly the mask (:meth:`BlockSparse.to_dense`).
    """
    bm, bn = _check_blocks(block_m, block_n)
    if callable(mask):
        if seqlen_q is None or seqlen_k is None:
            raise ValueError("block_sparse_from_mask with a mask function needs seqlen_q and seqlen_k")
        shape = _counts(num_batch=num_batch, num_heads=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        if min(shape[2:]) < 0 or min(shape[:2]) < 1:
            raise ValueError(f"seqlen_q/seqlen_k must be >= 0 and num_batch/num_heads >= 1; got "
                             f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, num_batch={num_batch}, "
                             f"num_heads={num_heads}")
        _check_grid(shape[2], shape[3], bm, bn, shape[0], shape[1])
        if shape[0] * shape[1] * shape[2] * shape[3] > _MAX_ENTRIES:
            raise ValueError(f"a mask function is evaluated on every element: {shape[0]} x {shape[1]} x {shape[2]} x "
                             f"{shape[3]} elements are more than 2**31-1; express the mask as rules "
                             f"(block_sparse_from_rules) or documents (document_block_sparse)")
        dense = _evaluate(mask, shape, vectorized)
    else:
        arr = _to_numpy(mask)
        if arr.ndim == 2:
            arr = arr[None, None]
        if arr.ndim != 4:
            raise ValueError("a dense mask must have shape (seqlen_q, seqlen_k) or (num_batch, num_heads, "
                             f"seqlen_q, seqlen_k); got {arr.shape}")
        if arr.dtype != np.bool_:
            raise TypeError(f"a dense mask must hold bools; got {arr.dtype}")
        for name, want, got in (("seqlen_q", seqlen_q, arr.shape[2]), ("seqlen_k", seqlen_k, arr.shape[3]),
                                ("num_batch", None if num_batch == 1 else num_batch, arr.shape[0]),
                                ("num_heads", None if num_heads == 1 else num_heads, arr.shape[1])):
            if want is not None and int(want) != got:
                raise ValueError(f"{name}={want} disagrees with the dense mask's shape {arr.shape}")
        dense = np.ascontiguousarray(arr).view(np.uint8)
    return _from_dict(_C.block_sparse_from_dense(dense, _shape(block_m=bm, block_n=bn),
                                                 _options(share_identical_partials)))


def block_sparse_from_rules(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, *,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                            global_tokens: int = 0, global_queries: bool = False, num_batch: int = 1,
                            num_heads: int = 1, share_identical_partials: bool = True) -> BlockSparse:
    """The causal / sliding-window / global-token mask of the attention functions as block-sparse.

    Same visibility as passing ``causal``, ``window_size``, ``global_tokens``, ``global_queries``
    to :func:`flashcpp.attention` (bottom-right aligned: ia = i + seqlen_k - seqlen_q; keys in
    [ia - left, ia + right]; the first ``global_tokens`` keys ignore the left bound; with
    ``global_queries`` rows with ia < global_tokens ignore the window). Built from the window
    arithmetic, evaluating elements only in blocks on a boundary: cheap at any length.
    """
    bm, bn = _check_blocks(block_m, block_n)
    left, right = _core.check_window(window_size)
    sq, sk, gt, nb, nh = _counts(seqlen_q=seqlen_q, seqlen_k=seqlen_k, global_tokens=global_tokens,
                                 num_batch=num_batch, num_heads=num_heads)
    _check_grid(sq, sk, bm, bn, nb, nh)
    shape = _shape(seqlen_q=sq, seqlen_k=sk, block_m=bm, block_n=bn, num_batch=nb, num_heads=nh)
    return _from_dict(_C.block_mask_from_rules(shape, _rules(causal, left, right, gt, global_queries),
                                               _options(share_identical_partials)))


def causal_block_sparse(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, **kw) -> BlockSparse:
    """Bottom-right aligned causal mask (query i sees keys j <= i + seqlen_k - seqlen_q)."""
    return block_sparse_from_rules(seqlen_q, seqlen_k, block_m, block_n, causal=True, **kw)


def document_block_sparse(cu_seqlens_q: Any, cu_seqlens_k: Any, block_m: int, block_n: int, *,
                          causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                          global_tokens: int = 0, global_queries: bool = False, num_batch: int = 1,
                          num_heads: int = 1, share_identical_partials: bool = True) -> BlockSparse:
    """Document mask over packed sequences: one problem of cu_seqlens_q[-1] queries and
    cu_seqlens_k[-1] keys in which query i of document d sees only keys of document d, by the
    given rules aligned per document (as ``flash_attn_varlen_func`` does). Attention over the
    packed tensors (batch 1) with this mask equals the varlen call over the same cu_seqlens.
    """
    bm, bn = _check_blocks(block_m, block_n)
    left, right = _core.check_window(window_size)
    cu = []
    for name, a in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        a = _to_numpy(a)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array; got shape {a.shape}, dtype {a.dtype}")
        if a.size and (a.min() < 0 or a.max() > _core._INT32_MAX):
            raise ValueError(f"{name} values must lie in [0, 2**31-1]")
        cu.append(np.ascontiguousarray(a, dtype=np.int32))
    cu_q, cu_k = cu
    gt, nb, nh = _counts(global_tokens=global_tokens, num_batch=num_batch, num_heads=num_heads)
    _check_grid(int(cu_q[-1]) if cu_q.size else 0, int(cu_k[-1]) if cu_k.size else 0, bm, bn, nb, nh)
    shape = _shape(block_m=bm, block_n=bn, num_batch=nb, num_heads=nh)
    return _from_dict(_C.document_block_mask(shape, cu_q, cu_k, _rules(causal, left, right, gt, global_queries),
                                             _options(share_identical_partials)))
