"""Decode against a KV cache (flash-attn's ``flash_attn_with_kvcache``, FlashInfer's paged
plan/run wrapper), with the semantics of ``include/flashcpp/decode.h``:

* the cache is contiguous ``(batch, capacity, heads_kv, head_dim)`` or paged
  ``(num_pages, page_size, heads_kv, head_dim)`` with ``block_table`` (batch, pages_per_seq),
  any power-of-two page size from 1 to 256;
* ``cache_seqlens[b]`` keys are in the cache before the step; with ``k``/``v`` the step's new
  tokens are written into slots ``cache_seqlens[b] + t`` (in place), K rotated, and attention runs
  over ``L_b = cache_seqlens[b] + seqlen_q`` keys;
* causal alignment is bottom-right over the total length: query token ``t`` sits at position
  ``ia = L_b - seqlen_q + t`` and is rotated at that position (flash-attn rotates a non-causal q
  at ``cache_seqlens`` for every token instead);
* 1 <= seqlen_q <= 16; GQA/MQA; sliding window, softcap and ALiBi as in ``flash_attn_func``.

Where it runs. numpy arrays and CPU torch tensors run on the host here, in numpy: the step is
computed in float64 from the rounded inputs (the rotary rule in float32, as decode.h fixes it), so
it is a reference-quality CPU path. CUDA tensors need the ``_flashcpp.decode`` binding of
``flashcpp::decode_plan`` / ``decode_run``; until it lands they raise NotImplementedError. When the
binding is present every input goes through it (the C++ CPU backend for host memory).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from . import _flashcpp as _C

MAX_SEQLEN_Q = 16
MAX_PAGE_SIZE = 256
_FLOAT_DTYPES = ("float16", "bfloat16", "float32")


# ---- inputs ---------------------------------------------------------------------------------

def _is_torch(x: Any) -> bool:
    return _core.is_torch(x)


def _f32(x: Any) -> np.ndarray:
    """A float32 numpy copy of an array or tensor (bfloat16 torch tensors included)."""
    if _is_torch(x):
        return x.detach().to(_core.torch.float32).cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _round_like(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the storage dtype -> float32 (round to nearest even), as a kernel stores it."""
    if dtype == "float32":
        return x.astype(np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    t = _core.torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(_core.torch.bfloat16).to(_core.torch.float32).numpy()


def _ints(x: Any, name: str) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32); got {a.dtype}")
    return a.astype(np.int64)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Step:
    """Checked shapes of one decode step."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                 alibi_slopes):
        mq, mkc, mvc = _core.meta(q, "q"), _core.meta(k_cache, "k_cache"), _core.meta(v_cache, "v_cache")
        extra = [x for x in (k, v) if x is not None]
        _core._same_library("q, k_cache, v_cache, k and v", q, k_cache, v_cache, *extra)
        for m in (mq, mkc, mvc):
            if m.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"{m.name} has dtype {m.dtype}; decode takes float16, bfloat16 or float32")
        if not (mq.dtype == mkc.dtype == mvc.dtype):
            raise TypeError(f"q, k_cache and v_cache must share one dtype (got {mq.dtype}, {mkc.dtype}, "
                            f"{mvc.dtype})")
        if not (mq.device == mkc.device == mvc.device):
            raise ValueError(f"q, k_cache and v_cache must be on one device (got {mq.device}, {mkc.device}, "
                             f"{mvc.device})")
        self.is_cuda = mq.is_cuda
        self.dtype = mq.dtype
        if len(mq.shape) != 4:
            raise ValueError(f"q must be 4-D (batch, seqlen_q, heads_q, head_dim); got shape {mq.shape}")
        self.batch, self.seqlen_q, self.heads_q, self.head_dim = mq.shape
        if not 1 <= self.seqlen_q <= MAX_SEQLEN_Q:
            raise ValueError(f"seqlen_q {self.seqlen_q} is outside the decode range 1..{MAX_SEQLEN_Q} "
                             "(longer query blocks go through flash_attn_func)")
        if self.head_dim not in _C.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} is not supported (supported: "
                             f"{', '.join(map(str, _C.SUPPORTED_HEAD_DIMS))})")
        if len(mkc.shape) != 4 or tuple(mkc.shape) != tuple(mvc.shape):
            raise ValueError(f"k_cache and v_cache must be 4-D and of one shape; got {mkc.shape} and {mvc.shape}")
        self.heads_kv = mkc.shape[2]
        if mkc.shape[3] != self.head_dim:
            raise ValueError(f"k_cache's head_dim {mkc.shape[3]} differs from q's {self.head_dim}")
        if self.heads_kv == 0 or self.heads_q % self.heads_kv:
            raise ValueError(f"heads of q ({self.heads_q}) must be a multiple of heads of the cache "
                             f"({self.heads_kv}) (GQA/MQA)")
        self.paged = block_table is not None
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
            want = (self.batch, self.seqlen_q, self.heads_kv, self.head_dim)
            for x, n in ((k, "k"), (v, "v")):
                m = _core.meta(x, n)
                if tuple(m.shape) != want:
                    raise ValueError(f"{n} must be (batch, seqlen_q, heads_kv, head_dim) = {want}; got {m.shape}")
                if m.dtype != self.dtype:
                    raise TypeError(f"{n} has dtype {m.dtype}; the cache's is {self.dtype}")
            if self.slots < self.seqlen_q:
                raise ValueError(f"the cache has {self.slots} slots per sequence, fewer than the {self.seqlen_q} "
                                 "tokens an append writes")
        if cache_seqlens is None:
            lens = np.full(self.batch, self.slots - (self.seqlen_q if self.append else 0), dtype=np.int64)
        elif isinstance(cache_seqlens, (int, np.integer)):
            lens = np.full(self.batch, int(cache_seqlens), dtype=np.int64)
        else:
            lens = _ints(cache_seqlens, "cache_seqlens").reshape(-1)
            if lens.shape != (self.batch,):
                raise ValueError(f"cache_seqlens must be an int or have shape (batch,) = ({self.batch},); "
                                 f"got {lens.shape}")
        add = self.seqlen_q if self.append else 0
        for b, c in enumerate(lens):
            if c < 0:
                raise ValueError(f"cache_seqlens[{b}] {int(c)} is negative")
            if c + add > self.slots:
                raise ValueError(f"cache_seqlens[{b}] {int(c)}" + (f" + seqlen_q {add}" if add else "") +
                                 f" = {int(c) + add} keys exceed the cache's {self.slots} slots per sequence")
        self.lens = lens
        if self.paged:
            table = _ints(block_table, "block_table")
            for b in range(self.batch):
                used = (int(lens[b]) + add + self.page_size - 1) // self.page_size
                row = table[b, :used]
                if row.size and (row.min() < 0 or row.max() >= self.num_pages):
                    bad = int(row[(row < 0) | (row >= self.num_pages)][0])
                    raise ValueError(f"block_table[{b}] holds page {bad}, outside [0, num_pages {self.num_pages})")
            self.table = table
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin come together")
        if alibi_slopes is not None:
            a = _f32(alibi_slopes)
            if a.shape not in ((self.heads_q,), (self.batch, self.heads_q)):
                raise ValueError(f"alibi_slopes must be (heads_q,) or (batch, heads_q); got {a.shape}")
            self.alibi = np.broadcast_to(a, (self.batch, self.heads_q))
        else:
            self.alibi = None

    def slot_index(self, b: int, j: np.ndarray) -> Tuple[Any, np.ndarray]:
        """(page or sequence index, slot) arrays that address keys j of sequence b."""
        if self.paged:
            return self.table[b, j // self.page_size], j % self.page_size
        return np.full_like(j, b), j


# ---- the rules of decode.h ----------------------------------------------------------------------

def _rotate(x: np.ndarray, pos: np.ndarray, rotary_dim: int, interleaved: bool, cos: Optional[np.ndarray],
            sin: Optional[np.ndarray], theta: float) -> np.ndarray:
    """x (T, H, D) float32 rotated at positions pos (T,), in float32 (decode.h's rule)."""
    half = rotary_dim // 2
    if cos is not None:
        if pos.size and (pos.min() < 0 or pos.max() >= cos.shape[0]):
            raise ValueError(f"rotary positions [{int(pos.min())}, {int(pos.max())}] are outside the cos/sin "
                             f"tables' rows [0, {cos.shape[0]})")
        c, s = cos[pos][:, None, :half], sin[pos][:, None, :half]
    else:
        i = np.arange(half, dtype=np.float32)
        inv = (np.float32(1.0) / np.power(np.float32(theta), (2 * i) / np.float32(rotary_dim))).astype(np.float32)
        ang = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float32)
        c = np.cos(ang.astype(np.float64)).astype(np.float32)[:, None, :]
        s = np.sin(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    y = x.copy()
    ia = np.arange(0, rotary_dim, 2) if interleaved else np.arange(half)
    ib = ia + 1 if interleaved else ia + half
    x1, x2 = x[..., ia].astype(np.float64), x[..., ib].astype(np.float64)
    c64, s64 = c.astype(np.float64), s.astype(np.float64)
    # fma(x1, c, -(x2*s)): the product x2*s rounded to float32 first, as in the kernels
    y[..., ia] = (x1 * c64 - (x2 * s64).astype(np.float32)).astype(np.float32)
    y[..., ib] = (x2 * c64 + (x1 * s64).astype(np.float32)).astype(np.float32)
    return y


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool, window: Tuple[int, int],
            softcap: float, slopes: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """One sequence in float64: q (Sq, Hq, D), k/v (L, Hkv, D) -> o (Sq, Hq, D), lse (Hq, Sq)."""
    sq, hq, _ = q.shape
    L, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    kk = np.repeat(k, group, axis=1)
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    ia = np.arange(sq)[:, None] + L - sq
    j = np.arange(L)[None, :]
    if slopes is not None:
        s = s + slopes[:, None, None] * (j - ia)[None]
    vis = np.ones((sq, L), dtype=bool)
    if causal:
        vis &= j <= ia
    if window[0] >= 0:
        vis &= j >= ia - window[0]
    if window[1] >= 0:
        vis &= j <= ia + window[1]
    s = np.where(vis[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if L else np.full((hq, sq, 1), -np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(den > 0, np.log(den) + m, -np.inf)[..., 0]
        p = np.where(den > 0, p / np.where(den > 0, den, 1.0), 0.0)
    return np.einsum("hij,jhd->ihd", p, vv), lse


def _write(cache: Any, idx: Tuple[np.ndarray, np.ndarray], values: np.ndarray) -> None:
    """cache[idx] = values (float32, rounded to the cache's dtype), in place."""
    if _is_torch(cache):
        t = _core.torch
        i0, i1 = (t.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in idx)
        cache[i0, i1] = t.from_numpy(np.ascontiguousarray(values)).to(cache.dtype)
    else:
        cache[idx] = values.astype(cache.dtype)


def _host_decode(st: _Step, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved, rope_theta,
                 scale, causal, window, softcap):
    qf = _f32(q)
    kn = _f32(k) if st.append else None
    vn = _f32(v) if st.append else None
    rot = rotary_cos is not None or rope_theta is not None
    cos = _f32(rotary_cos) if rotary_cos is not None else None
    sin = _f32(rotary_sin) if rotary_sin is not None else None
    rd = 2 * cos.shape[1] if cos is not None else st.head_dim
    if rot and not (2 <= rd <= st.head_dim):
        raise ValueError(f"rotary_cos has {rd // 2} columns: rotary_dim {rd} must be in [2, head_dim {st.head_dim}]")
    theta = float(rope_theta) if rope_theta is not None else 10000.0
    out = np.zeros((st.batch, st.seqlen_q, st.heads_q, st.head_dim), dtype=np.float32)
    lse = np.full((st.batch, st.heads_q, st.seqlen_q), -np.inf, dtype=np.float32)
    sq = st.seqlen_q
    for b in range(st.batch):
        c = int(st.lens[b])
        L = c + (sq if st.append else 0)
        if st.append:
            pos = c + np.arange(sq)
            kr = kn[b]
            if rot:
                kr = _rotate(kr, pos, rd, rotary_interleaved, cos, sin, theta)
            idx = st.slot_index(b, pos)
            _write(k_cache, idx, kr)
            _write(v_cache, idx, vn[b])
        j = np.arange(L)
        idx = st.slot_index(b, j)
        kb = _f32(k_cache[idx] if not _is_torch(k_cache) else
                  k_cache[tuple(_core.torch.from_numpy(np.ascontiguousarray(a)) for a in idx)])
        vb = _f32(v_cache[idx] if not _is_torch(v_cache) else
                  v_cache[tuple(_core.torch.from_numpy(np.ascontiguousarray(a)) for a in idx)])
        qb = qf[b]
        if rot:
            qb = _round_like(_rotate(qb, L - sq + np.arange(sq), rd, rotary_interleaved, cos, sin, theta), st.dtype)
        o, l = _attend(qb.astype(np.float64), kb.astype(np.float64), vb.astype(np.float64), scale, causal, window,
                       softcap, None if st.alibi is None else st.alibi[b].astype(np.float64))
        out[b] = o
        lse[b] = l
    return out, lse


def _result(out32: np.ndarray, like: Any, dtype: str) -> Any:
    if _is_torch(like):
        return _core.torch.from_numpy(out32).to(like.dtype)
    return out32.astype(dtype)


# ---- public API ---------------------------------------------------------------------------------

def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                            rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None,
                            cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, rope_theta: Optional[float] = None) -> Any:
    """flash-attn's ``flash_attn_with_kvcache`` on flashcpp's decode (semantics in the module doc).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), 1 <= seqlen_q <= 16.
        k_cache, v_cache: (batch, capacity, heads_kv, head_dim), or (num_pages, page_size, heads_kv,
            head_dim) with ``block_table``. Updated in place when ``k``/``v`` are given.
        k, v: the step's new keys/values (batch, seqlen_q, heads_kv, head_dim), or None.
        rotary_cos, rotary_sin: fp32 tables (max_position, rotary_dim / 2); rotary_dim = 2 * columns.
        rope_theta: instead of tables, rotate all of head_dim by angles pos * theta^(-2i/head_dim).
        rotary_interleaved: True = GPT-J pairs (2i, 2i+1), False = GPT-NeoX halves (i, i + d/2).
        cache_seqlens: int or (batch,) int32: keys in the cache before the step (None: full caches).
        num_splits: the split count of the C++ planner (0 = heuristic); the host path does not split.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim) in q's dtype, and with ``return_softmax_lse`` the
        fp32 natural-log LSE (batch, heads_q, seqlen_q).
    """
    if cache_batch_idx is not None:
        raise NotImplementedError("cache_batch_idx is not built in flashcpp decode (index the cache instead)")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not built in flashcpp decode")
    if not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic); got {num_splits!r}")
    window = _core.check_window(window_size)
    if softcap < 0 or not np.isfinite(softcap):
        raise ValueError(f"softcap must be finite and >= 0; got {softcap}")
    if rotary_cos is not None and rope_theta is not None:
        raise ValueError("pass rotary_cos/rotary_sin or rope_theta, not both")
    st = _Step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes)
    scale = _core.default_scale(softmax_scale, st.head_dim)
    if st.is_cuda:
        raise NotImplementedError("flash_attn_with_kvcache on CUDA tensors needs the _flashcpp.decode binding "
                                  "of flashcpp::decode_plan/decode_run, which has not landed (the C++ API "
                                  "runs the CUDA decode kernels)")
    out, lse = _host_decode(st, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved, rope_theta,
                            scale, causal, window, float(softcap))
    o = _result(out, q, st.dtype)
    if not return_softmax_lse:
        return o
    return o, (_core.torch.from_numpy(lse) if _is_torch(q) else lse)


class BatchDecodeWithPagedKVCache:
    """Plan/run decode over a paged KV cache (FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``).

    ``plan()`` takes FlashInfer's page description on the host (``indptr``, ``indices``,
    ``last_page_len``) and fixes the shapes; ``run()`` computes one step for every sequence.
    ``kv_layout`` "NHD" caches are (pages, page_size, heads_kv, head_dim), "HND" (pages, heads_kv,
    page_size, head_dim); ``paged_kv_cache`` is a (k, v) pair or one (pages, 2, ...) array. The LSE
    is the natural log (FlashInfer's is base 2). Keys are expected already rotated (flashcpp rotates
    at append time), so ``pos_encoding_mode`` must be "NONE".
    """

    def __init__(self, workspace_buffer: Any = None, kv_layout: str = "NHD") -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND'; got {kv_layout!r}")
        self._layout = kv_layout
        self._plan: Optional[dict] = None

    def plan(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float = 0.0, sm_scale: Optional[float] = None, num_splits: int = 0,
             **unused: Any) -> None:
        if pos_encoding_mode != "NONE":
            raise NotImplementedError(f"pos_encoding_mode {pos_encoding_mode!r} is not built: flashcpp rotates keys "
                                      "when they are appended (flash_attn_with_kvcache with rotary), so the cache "
                                      "holds rotated keys and decode reads them as they are")
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
        width = max(int(pages.max()) if pages.size else 1, 1)
        table = np.zeros((batch, width), dtype=np.int32)
        lens = np.zeros(batch, dtype=np.int32)
        for b in range(batch):
            n = int(pages[b])
            table[b, :n] = indices[indptr[b]:indptr[b + 1]]
            if n and not 1 <= last[b] <= page_size:
                raise ValueError(f"last_page_len[{b}] {int(last[b])} must be in [1, page_size {page_size}]")
            lens[b] = (n - 1) * page_size + int(last[b]) if n else 0
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self._plan = dict(table=table, lens=lens, heads_q=num_qo_heads, heads_kv=num_kv_heads, head_dim=head_dim,
                          page_size=int(page_size), window=(int(window_left), -1), softcap=float(logits_soft_cap),
                          scale=sm_scale, num_splits=num_splits)

    def run(self, q: Any, paged_kv_cache: Any, return_lse: bool = False) -> Any:
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
        shape = tuple(_core.meta(q, "q").shape)
        if shape != (p["lens"].size, p["heads_q"], p["head_dim"]):
            raise ValueError(f"q must be (batch, num_qo_heads, head_dim) = ({p['lens'].size}, {p['heads_q']}, "
                             f"{p['head_dim']}) as planned; got {shape}")
        if _core.meta(k_cache, "k_cache").shape[1] != p["page_size"]:
            raise ValueError(f"the cache's page size {_core.meta(k_cache, 'k_cache').shape[1]} differs from the "
                             f"planned {p['page_size']}")
        q4 = q[:, None]
        table = p["table"] if not _is_torch(q) else _core.torch.from_numpy(p["table"])
        res = flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=p["lens"], block_table=table,
                                      softmax_scale=p["scale"], causal=True, window_size=p["window"],
                                      softcap=p["softcap"], num_splits=p["num_splits"],
                                      return_softmax_lse=return_lse)
        if not return_lse:
            return res[:, 0]
        o, lse = res
        return o[:, 0], lse[:, :, 0]
