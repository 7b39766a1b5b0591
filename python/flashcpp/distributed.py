"""Context parallelism: attention over a sequence whose rows are sharded across the ranks of a
``torch.distributed`` process group (docs/distributed.md).

Each rank holds a shard of the sequence of q, k and v in flash-attn layout: (batch, seqlen_local,
heads, head_dim), or packed (total_local, heads, head_dim) with ``cu_seqlens`` describing the
documents of the whole packed sequence. Two schedules compute exactly the attention of the full
sequence, each rank getting the output rows (and LSE, and gradients) of its own queries:

* :func:`ring_attention`: the K/V shards travel around the ring of ranks (``batch_isend_irecv``;
  gloo on CPU, NCCL on GPU); at each step every rank attends its queries to the visiting K/V shard
  with flashcpp attention (``return_lse``) and merges the partial result into its accumulator with
  :func:`flashcpp.merge_attention_states`. The exchange of the next shard is posted before the
  current step computes. The backward runs a second ring in which the K/V shards travel again
  together with their dK/dV accumulators, which arrive home after the last step.
* :func:`allgather_attention`: all-gathers K and V, then local attention with the causal offset of
  each query chunk (Llama 3's context parallelism); the gradients of K and V go home through a
  reduce-scatter.

Layouts (``LAYOUTS``): ``"contiguous"`` (rank r holds rows [r n, (r + 1) n)), ``"zigzag"`` (the
sequence in 2W chunks of n / 2 rows; rank r holds chunks r and 2W - 1 - r) and ``"stripe"`` (rank r
holds rows r, r + W, r + 2W, ...). Zigzag and stripe balance causal work over the ranks.
:func:`shard_sequence` / :func:`unshard_sequence` cut a full sequence into a rank's shard and put
shards back together; :func:`shard_positions` gives the global positions of a shard's rows (for
rotary embeddings).

The communication is torch.distributed's only (P2P batches, all_gather_into_tensor,
reduce_scatter_tensor); the attention, its backward and the merge are the library's.

Every rank of the group must make the same calls (the forward and, when gradients are wanted, the
backward): both are collective.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import _core
from . import _torch_ops  # noqa: F401  (the backward ops: torch.ops.flashcpp.flash_attn_bwd, ...)
from .attention import flash_attn_func, flash_attn_varlen_func
from .merge import merge_attention_states

__all__ = ["ring_attention", "allgather_attention", "shard_sequence", "unshard_sequence", "zigzag_shard",
           "zigzag_unshard", "shard_positions", "LAYOUTS"]

#: The ways a sequence is cut over the ranks.
LAYOUTS = ("contiguous", "zigzag", "stripe")


# ---- layouts -------------------------------------------------------------------------------------

def _check_layout(layout: Any, name: str = "") -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{name + ': ' if name else ''}layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return layout


def _parts(layout: str) -> int:
    """How many equal chunks a rank's shard holds (the local length must be a multiple)."""
    return 2 if layout == "zigzag" else 1


def _positions(layout: str, rank: int, world: int, n: int) -> np.ndarray:
    """The global positions (int64, ascending) of the n local rows of rank's shard."""
    if layout == "stripe":
        return np.arange(n, dtype=np.int64) * world + rank
    if layout == "contiguous":
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
    c = n // 2
    return np.concatenate((np.arange(rank * c, (rank + 1) * c), np.arange((2 * world - 1 - rank) * c,
                                                                        (2 * world - rank) * c))).astype(np.int64)


def _check_world(rank: Any, world_size: Any) -> Tuple[int, int]:
    world = _core.check_int(world_size, "world_size", 1)
    return _core.check_int(rank, "rank", 0, world - 1, f" (world_size {world})"), world


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The shard of the full sequence ``x`` that ``rank`` holds under ``layout`` (along ``dim``: 1
    for (batch, seqlen, ...) tensors, 0 for packed (total, ...) ones, -1 for an LSE). Contiguous:
    rows [rank n, (rank + 1) n) with n = len / world_size (a view); zigzag: chunks rank and
    2 world_size - 1 - rank of 2 world_size equal chunks; stripe: rows rank, rank + world_size, ...
    (both new tensors)."""
    layout = _check_layout(layout)
    rank, world = _check_world(rank, world_size)
    total = x.shape[dim]
    parts = world * _parts(layout)
    if total % parts:
        raise ValueError(f"the sequence length {total} must be divisible by {parts} to be sharded {layout} over "
                         f"{world} ranks")
    n = total // world
    if layout == "contiguous":
        return x.narrow(dim, rank * n, n)
    pos = torch.from_numpy(_positions(layout, rank, world, n)).to(x.device)
    return x.index_select(dim, pos)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` is rank r's, as
    :func:`shard_sequence` cuts it): the inverse of shard_sequence."""
    layout = _check_layout(layout)
    world = len(shards)
    if world == 0:
        raise ValueError("unshard_sequence needs one shard per rank; got none")
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"every shard must have one shape; got {[tuple(s.shape) for s in shards]}")
    dim = dim % shards[0].dim()
    n = shards[0].shape[dim]
    if layout == "contiguous" or world == 1:
        return torch.cat(list(shards), dim)
    if layout == "stripe":
        return torch.stack(list(shards), dim + 1).flatten(dim, dim + 1)
    if n % 2:
        raise ValueError(f"a zigzag shard holds two chunks of equal length; got a shard of {n} rows")
    c = n // 2
    lows = [s.narrow(dim, 0, c) for s in shards]
    highs = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(lows + highs, dim)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """:func:`shard_sequence` with the zigzag layout: chunks rank and 2 world_size - 1 - rank."""
    return shard_sequence(x, rank, world_size, "zigzag", dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """:func:`unshard_sequence` with the zigzag layout."""
    return unshard_sequence(shards, "zigzag", dim)


def shard_positions(seqlen_local: int, rank: int, world_size: int, layout: str = "zigzag",
                    device: Any = None) -> torch.Tensor:
    """The global positions (int64) of the ``seqlen_local`` rows a rank holds: what rotary
    embeddings of the shard need (e.g. ``Rotary(positions_q=..., positions_k=...)`` as int32)."""
    layout = _check_layout(layout)
    rank, world = _check_world(rank, world_size)
    n = _core.check_int(seqlen_local, "seqlen_local", 0)
    if n % _parts(layout):
        raise ValueError(f"a zigzag shard holds two chunks of equal length; got seqlen_local {n}")
    return torch.from_numpy(_positions(layout, rank, world, n)).to(device)


# ---- the per-step plan: which (query rows, key rows) pairs to attend, and how --------------------

class _Call(NamedTuple):
    """One attention call of a step: local query rows [q0, q1) against rows [k0, k1) of the
    visiting shard; causal means bottom-right aligned (equal lengths in every dense call, where it
    is also top-left)."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _runs(cols: List[int]) -> List[Tuple[int, int]]:
    """Sorted column indices as [start, end) runs of consecutive ones."""
    out: List[Tuple[int, int]] = []
    for j in cols:
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def _chunk_calls(q_chunks: Sequence[int], kv_chunks: Sequence[int], c: int) -> List[_Call]:
    """Causal calls between shards of equal chunks (global chunk indices in local order, ascending;
    c rows each). A query chunk a against a key chunk b is full when b < a, causal when b == a,
    skipped when b > a. The identical chunk lists of a rank's own shard are one causal call (the
    local causal mask is then the global one); otherwise query chunks whose visible key chunks
    are the same full run share one call, and each diagonal pair is a causal call of its own."""
    nq, nk = len(q_chunks), len(kv_chunks)
    if tuple(q_chunks) == tuple(kv_chunks):
        return [_Call(0, nq * c, 0, nk * c, True)]
    calls: List[_Call] = []
    groups: List[Tuple[int, int, Tuple[Tuple[int, int], ...]]] = []  # (first q chunk, last + 1, full runs)
    for i, a in enumerate(q_chunks):
        full = tuple(_runs([j for j, b in enumerate(kv_chunks) if b < a]))
        calls += [_Call(i * c, (i + 1) * c, j * c, (j + 1) * c, True) for j, b in enumerate(kv_chunks) if b == a]
        if full and groups and groups[-1][1] == i and groups[-1][2] == full:
            groups[-1] = (groups[-1][0], i + 1, full)
        elif full:
            groups.append((i, i + 1, full))
    for i0, i1, full in groups:
        calls += [_Call(i0 * c, i1 * c, j0 * c, j1 * c, False) for j0, j1 in full]
    return calls


def _step_calls(layout: str, rank: int, src: int, world: int, n: int, causal: bool) -> List[_Call]:
    """The attention calls of rank's queries (n local rows) against the shard of rank src: their
    union is exactly the global mask restricted to these rows and keys, each visible pair once.

    Stripe: the query at global i W + rank sees the key at j W + src when j < i, or j == i and
    src <= rank: the local causal mask (src <= rank) or the one below the diagonal, which is query
    rows [1, n) against key rows [0, n - 1) causal."""
    if not causal:
        return [_Call(0, n, 0, n, False)]
    if layout == "stripe":
        if src <= rank:
            return [_Call(0, n, 0, n, True)]
        return [_Call(1, n, 0, n - 1, True)] if n > 1 else []
    c = n // _parts(layout)
    if layout == "contiguous":
        return _chunk_calls((rank,), (src,), c)
    return _chunk_calls((rank, 2 * world - 1 - rank), (src, 2 * world - 1 - src), c)


def _varlen_lengths(cu: np.ndarray, pq: np.ndarray, pk: np.ndarray,
                    causal: bool) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """The sequences (query counts, key counts) of one varlen call whose query rows sit at global
    positions pq and key rows at pk (both ascending), under documents cu: each document's rows of
    the call are consecutive in the local buffers (local positions ascend and a document is an
    interval), so each is one sequence. Causal: bottom-right alignment is exact once a document's
    keys after its last query are cut off (they are visible to none of its rows); in every layout
    the kept keys and the queries of a document step alike (chunk calls: the same rows; stripe:
    both every W positions), so key j is visible to query i exactly when j <= i + lk - lq. The cut
    keys become a sequence of their own with no queries, so the sequences still tile the key rows.
    None when no query of the call sees a key."""
    iq, ik = np.searchsorted(pq, cu), np.searchsorted(pk, cu)
    lq, lk = np.diff(iq), np.diff(ik)
    vis = lk
    if causal:
        last_q = pq[np.maximum(iq[1:] - 1, 0)] if len(pq) else np.zeros(len(lq), np.int64)
        vis = np.where(lq > 0, np.clip(np.searchsorted(pk, last_q, "right") - ik[:-1], 0, lk), 0)
    if not np.any((lq > 0) & (vis > 0)):
        return None
    seq_q = np.stack((lq, np.zeros_like(lq)), 1).reshape(-1)
    seq_k = np.stack((vis, lk - vis), 1).reshape(-1)
    keep = (seq_q > 0) | (seq_k > 0)
    return seq_q[keep], seq_k[keep]


class _Block(NamedTuple):
    """One call of the plan: the call, its varlen sequences on the device (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) or None, the ring step and the shard's owner."""
    call: _Call
    varlen: Optional[Tuple[torch.Tensor, torch.Tensor, int, int]]
    step: int
    src: int


class _Spec:
    """A checked problem (everything but the tensors), with its plan built once per device."""

    def __init__(self, group, rank, world, layout, causal, scale, softcap, deterministic, cu, n):
        self.group, self.rank, self.world, self.layout = group, rank, world, layout
        self.causal, self.scale, self.softcap, self.deterministic = causal, scale, softcap, deterministic
        self.cu = cu  # global document boundaries (int64, host), varlen only
        self.varlen = cu is not None
        self.n = n    # local rows
        self._plans: Dict[Any, List[List[_Block]]] = {}

    def calls(self, src: int) -> List[_Call]:
        return _step_calls(self.layout, self.rank, src, self.world, self.n, self.causal)

    def plan(self, device: Any) -> List[List[_Block]]:
        """Per ring step s (the shard of rank (rank - s) mod W), its blocks. The varlen sequences of
        every block travel to the device in one copy."""
        if device in self._plans:
            return self._plans[device]
        raw = []
        pq = _positions(self.layout, self.rank, self.world, self.n)
        for s in range(self.world):
            src = (self.rank - s) % self.world
            pk = _positions(self.layout, src, self.world, self.n)
            for call in self.calls(src):
                lens = None
                if self.varlen:
                    lens = _varlen_lengths(self.cu, pq[call.q0:call.q1], pk[call.k0:call.k1], call.causal)
                    if lens is None:
                        continue
                raw.append((s, src, call, lens))
        host = [np.concatenate(([0], np.cumsum(x))) for _, _, _, lens in raw if lens is not None for x in lens]
        dev = _to_device(np.concatenate(host).astype(np.int32), device) if host else None
        plan: List[List[_Block]] = [[] for _ in range(self.world)]
        off = 0
        for s, src, call, lens in raw:
            args = None
            if lens is not None:
                m = len(lens[0]) + 1
                args = (dev[off:off + m], dev[off + m:off + 2 * m], int(lens[0].max()), int(lens[1].max()))
                off += 2 * m
            plan[s].append(_Block(call, args, s, src))
        self._plans[device] = plan
        return plan


# ---- one block: forward and backward --------------------------------------------------------------

def _to_device(host: np.ndarray, device: Any) -> torch.Tensor:
    """A host array on device: to a GPU from pinned memory without blocking (a copy from pageable
    memory would wait for the stream's queued work, serializing the host with the GPU)."""
    t = torch.from_numpy(host)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _rows(x: torch.Tensor, a: int, b: int, varlen: bool) -> torch.Tensor:
    return x[a:b] if varlen else x[:, a:b]


def _lse_rows(lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    """An LSE ((batch, heads, rows) or (heads, rows)) as out's leading dims ((batch, rows, heads)
    or (rows, heads)), the shape merge_attention_states pairs with the output: a view."""
    return lse.t() if varlen else lse.transpose(1, 2)


def _block_forward(sp: _Spec, q, k, v, blk: _Block):
    """(o, lse) of local query rows call.q0:q1 against rows call.k0:k1 of the visiting shard."""
    c, V = blk.call, sp.varlen
    qs, ks, vs = _rows(q, c.q0, c.q1, V), _rows(k, c.k0, c.k1, V), _rows(v, c.k0, c.k1, V)
    if blk.varlen is None:
        return flash_attn_func(qs, ks, vs, softmax_scale=sp.scale, causal=c.causal, softcap=sp.softcap,
                               return_lse=True)
    return flash_attn_varlen_func(qs, ks, vs, *blk.varlen, softmax_scale=sp.scale, causal=c.causal,
                                  softcap=sp.softcap, return_lse=True)


def _block_backward(sp: _Spec, dout, q, k, v, out, lse, dlse, blk: _Block):
    """(dq, dk, dv) of one block, given the merged (global) out, lse and their gradients.

    The library's backward (backward.h) computes P = exp(s - LSE) and D = rowsum(dO * O) - dLSE
    from the lse and o it is handed; with the global ones, the gradients of a block are exactly its
    share of the full problem's (dS = P (dP - D) involves only the block's own keys otherwise).
    The fp64 reference backward reads neither o nor lse (it recomputes P and D over the keys it is
    given), so for float64 the block's own forward state is recomputed and the gradients scaled into
    the global ones: with w = exp(lse_block - lse), dout_block = w dO and
    dLSE_block = w (rowsum(dO * O_block) - D + dLSE) give dS_block = w P_block (dP - D + dLSE),
    which is the global dS."""
    c, V = blk.call, sp.varlen
    qs, ks, vs = _rows(q, c.q0, c.q1, V), _rows(k, c.k0, c.k1, V), _rows(v, c.k0, c.k1, V)
    do, os_ = _rows(dout, c.q0, c.q1, V).contiguous(), _rows(out, c.q0, c.q1, V).contiguous()
    ls = lse[..., c.q0:c.q1].contiguous()
    dls = None if dlse is None else dlse[..., c.q0:c.q1].contiguous()
    if q.dtype == torch.float64:
        ob, lb = _block_forward(sp, q, k, v, blk)
        lb64, l64 = lb.double(), ls.double()
        w = torch.where(lb64 == -math.inf, torch.zeros((), dtype=torch.float64, device=lb.device),
                        torch.exp(lb64 - l64))
        w = torch.nan_to_num(w, nan=0.0)  # rows empty in the whole problem (lse -inf) get no gradient
        wr = _lse_rows(w, V)  # aligned with out's leading dims
        extra = _lse_rows(dls, V).double() if dls is not None else 0.0
        dlse_b = wr * ((do * ob).sum(-1) - (do * os_).sum(-1) + extra)
        do = (do * wr.unsqueeze(-1)).contiguous()
        dls = _lse_rows(dlse_b, V).to(torch.float32).contiguous()
        os_, ls = ob, lb
    if blk.varlen is not None:
        cu_q, cu_k, mq, mk = blk.varlen
        return torch.ops.flashcpp.flash_attn_varlen_bwd(do, qs, ks, vs, os_, ls, dls, cu_q, cu_k, mq, mk, sp.scale,
                                                        c.causal, -1, -1, sp.softcap, None, sp.deterministic)
    return torch.ops.flashcpp.flash_attn_bwd(do, qs, ks, vs, os_, ls, dls, sp.scale, c.causal, -1, -1,
                                             sp.softcap, None, sp.deterministic)


# ---- the accumulation of partial results -----------------------------------------------------------

class _Acc:
    """The output (fp32) and LSE (fp32, in out's leading dims) of the local rows, merged block by
    block with flashcpp.merge_attention_states (algebra::merge_two: an empty side, LSE -inf,
    weighs exactly 0; a NaN LSE propagates)."""

    def __init__(self, q: torch.Tensor, head_dim_v: int, varlen: bool):
        self.varlen, self.q = varlen, q
        self.n = q.shape[0] if varlen else q.shape[1]
        self.o_shape = tuple(q.shape[:-1]) + (head_dim_v,)
        self.o: Optional[torch.Tensor] = None
        self.l: Optional[torch.Tensor] = None

    def add(self, o: torch.Tensor, lse: torch.Tensor, q0: int, q1: int) -> None:
        """Merges a block's (o, lse) of local rows [q0, q1) in; takes ownership of both (a block's
        fresh outputs: the first whole-rows result becomes the accumulator without a copy)."""
        o = o if o.dtype == torch.float32 else o.float()  # the merge takes one dtype; fp32 accumulates
        lse = _lse_rows(lse, self.varlen)
        whole = q0 == 0 and q1 == self.n
        if self.o is None:
            if whole:  # the first partial result is the accumulator
                self.o, self.l = o, lse
                return
            self.o = torch.zeros(self.o_shape, dtype=torch.float32, device=o.device)
            self.l = torch.full(self.o_shape[:-1], -math.inf, dtype=torch.float32, device=o.device)
        if whole:
            self.o, self.l = merge_attention_states(self.o, self.l, o, lse)
            return
        ao, al = _rows(self.o, q0, q1, self.varlen), _rows(self.l, q0, q1, self.varlen)
        mo, ml = merge_attention_states(ao, al, o, lse)
        ao.copy_(mo)
        al.copy_(ml)

    def result(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(out in dtype, rounded once; lse as the attention returns it, (batch, heads, rows) or
        (heads, rows))."""
        if self.o is None:  # no block at all (not reached: every row sees itself at step 0)
            self.o = torch.zeros(self.o_shape, dtype=torch.float32, device=self.q.device)
            self.l = torch.full(self.o_shape[:-1], -math.inf, dtype=torch.float32, device=self.q.device)
        return self.o.to(dtype), _lse_rows(self.l, self.varlen).contiguous()


# ---- where the K/V shards come from: the ring, or all of them gathered ----------------------------

class _Ring:
    """Neighbour exchange over a process group: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: Any, rank: int, world: int):
        self.group, self.next, self.prev = group, (rank + 1) % world, (rank - 1) % world

    def exchange(self, tensors: Sequence[torch.Tensor], tag: int):
        """Posts the sends of tensors to the next rank and the receives of their likes from the
        previous one; returns (received buffers, requests). Nothing waits here."""
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, group=self.group, tag=tag + i, group_peer=self.next)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, tag=tag + i, group_peer=self.prev)
                for i, t in enumerate(recv)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _ring_shards(sp: _Spec, k: torch.Tensor, v: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    """(step, k, v) of each ring step. The exchange that brings the next step's shard is posted
    before this step is handed out (so it travels while the step computes) and waited for after."""
    ring = _Ring(sp.group, sp.rank, sp.world)
    k_cur, v_cur = k, v
    reqs: list = []
    try:
        for s in range(sp.world):
            last = s + 1 == sp.world
            if not last:
                nxt, reqs = ring.exchange((k_cur, v_cur), tag=4 * s)
            yield s, k_cur, v_cur
            if not last:
                _wait(reqs)
                reqs = []
                k_cur, v_cur = nxt
    finally:
        # Closed early (a step raised, on every rank alike since every rank computes the same
        # problem): the posted exchange is matched on both sides, so it completes; waiting for it
        # leaves nothing in flight for the group's next call.
        _wait(reqs)


def _gathered_shards(sp: _Spec, kf: torch.Tensor, vf: torch.Tensor):
    """(step, k, v) from all-gathered shards (world, ...), in the ring's order."""
    for s in range(sp.world):
        src = (sp.rank - s) % sp.world
        yield s, kf[src], vf[src]


def _attend(sp: _Spec, q: torch.Tensor, head_dim_v: int, shards) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward over every step's blocks: (out in q's dtype, fp32 lse)."""
    acc = _Acc(q, head_dim_v, sp.varlen)
    plan = sp.plan(q.device)
    try:
        for s, k_s, v_s in shards:
            for blk in plan[s]:
                o, lse = _block_forward(sp, q, k_s, v_s, blk)
                acc.add(o, lse, blk.call.q0, blk.call.q1)
    finally:
        shards.close()
    return acc.result(q.dtype)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _attend_backward(sp: _Spec, dout, dlse, q, out, lse, shards, sink) -> torch.Tensor:
    """The backward over every step's blocks: dq (fp32, or fp64 for fp64), each step's dK/dV share
    of the visiting shard handed to sink(step, dk, dv) (None when the step had no block)."""
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    plan = sp.plan(q.device)
    try:
        for s, k_s, v_s in shards:
            dk = dv = None
            for blk in plan[s]:
                g = _block_backward(sp, dout, q, k_s, v_s, out, lse, dlse, blk)
                if dk is None:
                    dk = torch.zeros(k_s.shape, dtype=acc, device=k_s.device)
                    dv = torch.zeros(v_s.shape, dtype=acc, device=v_s.device)
                c = blk.call
                _rows(dq, c.q0, c.q1, sp.varlen).add_(g[0])
                _rows(dk, c.k0, c.k1, sp.varlen).add_(g[1])
                _rows(dv, c.k0, c.k1, sp.varlen).add_(g[2])
            sink(s, dk, dv)
    except BaseException:
        shards.close()
        getattr(sink, "drain", lambda: None)()
        raise
    return dq


class _RingGrads:
    """The dK/dV accumulator of the visiting shard: received from the previous rank (which added its
    share one step earlier; zero at step 0), plus this rank's share, sent on to the next rank. The
    send after the last step takes each accumulator home; it travels while the next step computes."""

    def __init__(self, sp: _Spec, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        self.ring, self.k, self.v, self.dtype = _Ring(sp.group, sp.rank, sp.world), k, v, dtype
        self.recv, self.reqs = None, []

    def __call__(self, s: int, dk, dv) -> None:
        if s == 0:
            dk = dk if dk is not None else torch.zeros(self.k.shape, dtype=self.dtype, device=self.k.device)
            dv = dv if dv is not None else torch.zeros(self.v.shape, dtype=self.dtype, device=self.v.device)
        else:
            _wait(self.reqs)
            acc_k, acc_v = self.recv
            if dk is not None:
                acc_k.add_(dk)
                acc_v.add_(dv)
            dk, dv = acc_k, acc_v
        self.recv, self.reqs = self.ring.exchange((dk, dv), tag=4 * s + 2)

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        self.drain()
        return self.recv[0], self.recv[1]

    def drain(self) -> None:
        """Waits for the accumulator in flight (also when a step raised: see _ring_shards)."""
        _wait(self.reqs)
        self.reqs = []


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sp):
        out, lse = _attend(sp, q, v.shape[-1], _ring_shards(sp, k, v))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sp = sp
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        sp = ctx.sp
        if dout is None:
            dout = torch.zeros_like(out)
        sink = _RingGrads(sp, k, v, _acc_dtype(q))
        dq = _attend_backward(sp, dout, dlse, q, out, lse, _ring_shards(sp, k, v), sink)
        dk, dv = sink.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _gather(x: torch.Tensor, sp: _Spec) -> torch.Tensor:
    """Every rank's shard of x, (world, *x.shape) (all_gather_into_tensor)."""
    x = x.contiguous()
    buf = x.new_empty((sp.world * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(buf, x, group=sp.group)
    return buf.view((sp.world,) + tuple(x.shape))


def _reduce_scatter(full: torch.Tensor, sp: _Spec) -> torch.Tensor:
    """The sum over ranks of full (world, *shape), slice r onto rank r (reduce_scatter_tensor)."""
    full = full.contiguous()
    out = full.new_empty(full.shape[1:])
    dist.reduce_scatter_tensor(out, full.view((-1,) + tuple(full.shape[2:])), group=sp.group)
    return out


class _GatheredAttention(torch.autograd.Function):
    """All-gather attention by the ring's plan (the stripe layout, whose rows no single
    bottom-right call covers): K and V gathered once, the blocks and merges of the ring run
    locally; the backward sums each shard's dK/dV share and reduce-scatters it home."""

    @staticmethod
    def forward(ctx, q, k, v, sp):
        kf, vf = _gather(k, sp), _gather(v, sp)
        out, lse = _attend(sp, q, v.shape[-1], _gathered_shards(sp, kf, vf))
        ctx.save_for_backward(q, kf, vf, out, lse)
        ctx.sp, ctx.kv_dtypes = sp, (k.dtype, v.dtype)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kf, vf, out, lse = ctx.saved_tensors
        sp = ctx.sp
        if dout is None:
            dout = torch.zeros_like(out)
        acc = _acc_dtype(q)
        dkf = torch.zeros(kf.shape, dtype=acc, device=kf.device)
        dvf = torch.zeros(vf.shape, dtype=acc, device=vf.device)

        def sink(s, dk, dv):
            if dk is not None:
                src = (sp.rank - s) % sp.world
                dkf[src].add_(dk)
                dvf[src].add_(dv)

        dq = _attend_backward(sp, dout, dlse, q, out, lse, _gathered_shards(sp, kf, vf), sink)
        dk, dv = _reduce_scatter(dkf, sp), _reduce_scatter(dvf, sp)
        return dq.to(q.dtype), dk.to(ctx.kv_dtypes[0]), dv.to(ctx.kv_dtypes[1]), None


class _AllGather(torch.autograd.Function):
    """All-gather of the shards along a new leading dim (world, *x.shape); its backward sums the
    ranks' gradients of each shard onto the rank that owns it (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp = sp
        return _gather(x, sp)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.sp), None


# ---- checks ------------------------------------------------------------------------------------------

def _group_info(name: str, group: Any) -> Tuple[Any, int, int]:
    """(group, rank, world size); group None without an initialized default group is a world of 1."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process is not a member of the group it was given (rank {dist.get_rank()} "
                         "of the default group)")
    return group, rank, dist.get_world_size(group)


def _host_cu(name: str, cu_seqlens: Any) -> np.ndarray:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"{name}: cu_seqlens must hold integers; got {cu_seqlens.dtype}")
        return cu_seqlens.detach().cpu().numpy().astype(np.int64)  # a CUDA tensor: one copy (a synchronization)
    try:
        cu = np.asarray(cu_seqlens)
    except (TypeError, ValueError):
        cu = np.asarray([], dtype=object)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name}: cu_seqlens must hold integers; got {cu.dtype} values")
    return cu.astype(np.int64)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("refused", "batch", "seqlen_local", "heads_q", "heads_kv", "head_dim", "head_dim_v", "dtype", "device",
           "causal", "layout", "varlen", "cu_seqlens", "softmax_scale", "softcap", "gradients")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _shown(field: str, x: int) -> Any:
    if field == "dtype":
        return _DTYPES[x] if 0 <= x < len(_DTYPES) else "another dtype"
    if field == "layout":
        return LAYOUTS[x] if 0 <= x < len(LAYOUTS) else "another layout"
    if field == "device":
        return ("cpu", "cuda", "another device")[x]
    if field in ("softmax_scale", "softcap"):
        return struct.unpack("<d", struct.pack("<q", x))[0]
    if field in ("causal", "varlen", "gradients"):
        return bool(x)
    return x


def _fields(q, k, v, layout, causal, cu, scale, softcap, grad) -> List[int]:
    varlen = cu is not None
    cu_sig = 0
    if varlen:
        cu_sig = int((cu.reshape(-1) * (np.arange(cu.size) % 1009 + 1)).sum() % (1 << 61)) + cu.size
    dims = [0, q.shape[0]] if varlen else [q.shape[0], q.shape[1]]
    dev = {"cpu": 0, "cuda": 1}.get(q.device.type, 2)
    dt = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else len(_DTYPES)
    return [0] + dims + [q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], dt, dev, int(bool(causal)),
                         LAYOUTS.index(layout) if layout in LAYOUTS else len(LAYOUTS), int(varlen), cu_sig,
                         _float_bits(scale), _float_bits(softcap), int(grad)]


def _comm_device(group: Any) -> torch.device:
    """Where a collective's tensors of this group live: CUDA for an NCCL group, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(name: str, group: Any, world: int, refusal: Optional[Exception], fields: Optional[List[int]]) -> None:
    """One small all_gather: every rank must describe the same problem (shapes, dtype, mask, layout,
    documents, whether gradients are wanted), and none may have refused its inputs, or every rank
    raises (before any ring traffic, which a mismatch would deadlock or corrupt). A rank that
    refused its inputs raises its own error; the others raise the same type with its message
    (one all_gather_object, only then)."""
    mine = [1] + [0] * (len(_FIELDS) - 1) if refusal is not None else fields
    dev = _comm_device(group)
    every = torch.empty((world * len(_FIELDS),), dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(every, torch.tensor(mine, dtype=torch.int64, device=dev), group=group)
    rows = every.view(world, len(_FIELDS)).cpu().tolist()
    refused = [r for r in range(world) if rows[r][0]]
    if refused:
        msgs: List[Any] = [None] * world
        dist.all_gather_object(msgs, None if refusal is None else (type(refusal).__name__, str(refusal)), group=group)
        if refusal is not None:
            raise refusal
        r = refused[0]
        kind, msg = msgs[r]
        cls = TypeError if kind == "TypeError" else ValueError
        raise cls(f"{name}: rank {r} refused its inputs, so no rank runs ({msg})")
    for i, field in enumerate(_FIELDS[1:], 1):
        vals = [row[i] for row in rows]
        bad = next((r for r, x in enumerate(vals) if x != vals[0]), None)
        if bad is None:
            continue
        if field == "cu_seqlens":
            raise ValueError(f"{name}: the ranks' shards disagree: rank {bad} passed other cu_seqlens than rank 0 "
                             "(every rank must pass the same problem)")
        if field == "gradients":
            raise ValueError(f"{name}: the ranks disagree on gradients: rank 0 {'does' if vals[0] else 'does not'} "
                             f"record the call for autograd but rank {bad} {'does' if vals[bad] else 'does not'} "
                             "(the backward is collective: every rank or none must need it)")
        raise ValueError(f"{name}: the ranks' shards disagree: {field} is {_shown(field, vals[0])} on rank 0 "
                         f"but {_shown(field, vals[bad])} on rank {bad} (every rank must pass the same problem)")


def _check_rows(name: str, n: int, nk: int, layout: str) -> None:
    if nk != n:
        raise ValueError(f"{name} shards q, k and v alike: q has {n} local rows but k and v have {nk}")
    if n < 1:
        raise ValueError(f"{name} needs at least one local row per rank; got {n}")
    if n % _parts(layout):
        raise ValueError(f"{name}: the zigzag layout holds two equal chunks per rank, so the local length must be "
                         f"even; got {n}")


def _local_checks(name: str, q, k, v, world: int, causal, softmax_scale, layout, cu_seqlens, softcap,
                  deterministic) -> Tuple[str, Optional[np.ndarray], float, float, int]:
    """What a rank can check alone; returns (layout, host cu_seqlens or None, scale, softcap, n)."""
    layout = _check_layout(layout, name)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{name}: causal must be a bool; got {causal!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"{name}: deterministic must be a bool; got {deterministic!r}")
    varlen = cu_seqlens is not None
    try:
        _core.check_qkv(q, k, v, varlen=varlen)  # the library's checks: dtypes, devices, ranks, heads, strides
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    rows = 0 if varlen else 1
    n = q.shape[rows]
    _check_rows(name, n, k.shape[rows], layout)
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: q and k must have the same batch; got {q.shape[0]} and {k.shape[0]}")
    try:
        sc = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: softcap must be a float; got {softcap!r}") from None
    if not (math.isfinite(sc) and sc >= 0):
        raise ValueError(f"{name}: softcap must be finite and >= 0 (0 = off); got {softcap!r}")
    try:
        scale = _core.default_scale(softmax_scale, q.shape[-1])
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    cu = None
    if varlen:
        cu = _host_cu(name, cu_seqlens)
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != world * n:
            shown = cu.reshape(-1).tolist()
            shown = shown if len(shown) <= 16 else shown[:8] + ["..."]
            raise ValueError(f"{name}: cu_seqlens must be the whole packed sequence's document boundaries, "
                             f"non-decreasing from 0 to world_size * total_local = {world * n}; got {shown}")
    return layout, cu, scale, sc, n


def _check_tensors(name: str, q, k, v) -> None:
    for x, nm in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} takes torch tensors; {nm} is a {type(x).__name__}")


def _prepare(name: str, q, k, v, group, rank: int, world: int, causal, softmax_scale, layout, cu_seqlens, softcap,
             deterministic, check_inputs, grad: bool) -> _Spec:
    """The checked problem of a world of two or more ranks; with check_inputs, every rank agrees on
    it (or every rank raises)."""
    if dist.get_backend(group) == "nccl" and q.device.type != "cuda":
        raise ValueError(f"{name}: the group's backend is nccl, which moves CUDA tensors; q is on {q.device} "
                         "(use a gloo group for CPU tensors)")
    refusal, fields = None, None
    try:
        layout, cu, scale, sc, n = _local_checks(name, q, k, v, world, causal, softmax_scale, layout, cu_seqlens,
                                                 softcap, deterministic)
        fields = _fields(q, k, v, layout, causal, cu, scale, sc, grad)
    except (TypeError, ValueError) as e:
        if not check_inputs:
            raise
        refusal = e
    if check_inputs:
        _agree(name, group, world, refusal, fields)
    return _Spec(group, rank, world, layout, bool(causal), float(scale), sc, bool(deterministic), cu, n)


def _direct(name: str, q, k, v, causal, softmax_scale, layout, cu_seqlens, max_seqlen, softcap, deterministic,
            return_lse):
    """World size 1: the plain attention call (differentiable through the library's autograd), after
    the checks of this module's own arguments only (the call checks the rest): nothing else runs,
    so the call costs what flash_attn_func costs. Varlen with cu_seqlens an int32 tensor on q's
    device and max_seqlen given: both go to flash_attn_varlen_func as they are (no host copy)."""
    _check_layout(layout, name)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{name}: causal must be a bool; got {causal!r}")
    rows = 0 if cu_seqlens is not None else 1
    if q.dim() > rows and k.dim() > rows:  # else the call refuses the ranks
        _check_rows(name, q.shape[rows], k.shape[rows], layout)
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, softcap=softcap,
                               deterministic=deterministic, return_lse=return_lse)
    if max_seqlen is not None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device == q.device and \
            cu_seqlens.dtype == torch.int32:
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      softmax_scale=softmax_scale, causal=causal, softcap=softcap,
                                      deterministic=deterministic, return_lse=return_lse)
    cu = _host_cu(name, cu_seqlens)
    n = q.shape[0] if q.dim() else 0
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != n:
        raise ValueError(f"{name}: cu_seqlens must be the packed sequence's document boundaries, non-decreasing "
                         f"from 0 to total_local = {n}; got {cu.reshape(-1).tolist()[:16]}")
    cu_t = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device == q.device and \
        cu_seqlens.dtype == torch.int32 else _to_device(cu.astype(np.int32), q.device)
    mx = int(np.diff(cu).max()) if max_seqlen is None else max_seqlen
    return flash_attn_varlen_func(q, k, v, cu_t, cu_t, mx, mx, softmax_scale=softmax_scale, causal=causal,
                                  softcap=softcap, deterministic=deterministic, return_lse=return_lse)


def _needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


# ---- public functions --------------------------------------------------------------------------------

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, causal: bool = False,
                   softmax_scale: Optional[float] = None, *, layout: str = "contiguous", cu_seqlens: Any = None,
                   max_seqlen: Optional[int] = None, softcap: float = 0.0, return_lse: bool = False,
                   deterministic: bool = False, check_inputs: bool = True):
    """Ring attention over ``group`` (default: the default process group; none initialized means a
    world of one rank, a plain attention call).

    Args:
        q: this rank's queries, (batch, seqlen_local, heads_q, head_dim), or (total_local, heads_q,
            head_dim) with ``cu_seqlens``; k, v: the same rows' keys and values, (.., heads_kv, ..)
            (GQA: heads_q % heads_kv == 0; v may have another head dim, which out takes). Torch
            tensors (CPU with gloo, CUDA with NCCL); every rank passes the same shapes.
        causal: global causal attention (the query at global position i sees keys j <= i).
        softmax_scale: default 1 / sqrt(head_dim).
        layout: how the sequence is cut over the ranks, "contiguous", "zigzag" or "stripe"
            (:func:`shard_sequence`; zigzag and stripe balance causal work).
        cu_seqlens: varlen: the document boundaries of the whole packed sequence (global, the same on
            every rank; a list, numpy array or tensor from 0 to world_size * total_local). Each
            document attends within itself. The ring plans its calls on the host: a tensor on a
            GPU costs a copy to the host (a synchronization) per call, a host array does not.
        max_seqlen: varlen: the longest document. Only world size 1 reads it: with it and
            cu_seqlens an int32 tensor on q's device, the call is flash_attn_varlen_func's as it is
            (no host copy, no synchronization).
        softcap: > 0 applies s = softcap * tanh(s / softcap) to the scores.
        return_lse: also return the fp32 LSE of this rank's rows, (batch, heads_q, seqlen_local) or
            (heads_q, total_local).
        deterministic: bitwise-repeatable gradients (passed to each block's backward; the ring's
            own order is fixed).
        check_inputs: one small all_gather that checks every rank passes the same problem and
            none refused its inputs (each rank then raises); False skips it.

    Returns:
        out (q's shape with head_dim_v, q's dtype), or (out, lse). Differentiable (q, k, v and the
        LSE): the backward is a second ring in which dK/dV accumulators travel with the K/V shards;
        every rank must run it.
    """
    name = "ring_attention"
    _check_tensors(name, q, k, v)
    group, rank, world = _group_info(name, group)
    if world == 1:
        return _direct(name, q, k, v, causal, softmax_scale, layout, cu_seqlens, max_seqlen, softcap, deterministic,
                       return_lse)
    grad = _needs_grad(q, k, v)
    sp = _prepare(name, q, k, v, group, rank, world, causal, softmax_scale, layout, cu_seqlens, softcap,
                  deterministic, check_inputs, grad)
    k, v = k.contiguous(), v.contiguous()  # sent as they are: dense buffers
    if grad:
        out, lse = _RingAttention.apply(q, k, v, sp)
    else:
        out, lse = _attend(sp, q, v.shape[-1], _ring_shards(sp, k, v))
    return (out, lse) if return_lse else out


def _to_global(buf: torch.Tensor, layout: str, rows: int) -> torch.Tensor:
    """Gathered shards (world, ...) as the full sequence in global order (rows: the row dim of a
    shard, 0 packed or 1 batched)."""
    return unshard_sequence(list(buf.unbind(0)), layout, rows)


def _cat(res, rows: int):
    if len(res) == 1:
        return res[0]
    return torch.cat([o for o, _ in res], rows), torch.cat([l for _, l in res], -1)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None,
                        causal: bool = False, softmax_scale: Optional[float] = None, *, layout: str = "contiguous",
                        cu_seqlens: Any = None, max_seqlen: Optional[int] = None, softcap: float = 0.0,
                        return_lse: bool = False, deterministic: bool = False, check_inputs: bool = True):
    """All-gather context parallelism (Llama 3): K and V are all-gathered over ``group``, then each
    rank attends its queries to the full keys, one call per local chunk of rows with the keys up to
    that chunk's end (bottom-right causal alignment puts the chunk's rows at their global
    positions). Under the stripe layout, whose rows no single call covers that way, the ring's
    plan runs locally on the gathered shards (W calls merged by LSE). Arguments and returns as
    :func:`ring_attention`. Differentiable (the library's attention backward, then a reduce-scatter
    of dK/dV); every rank must run the backward. Memory: the full K and V on every rank."""
    name = "allgather_attention"
    _check_tensors(name, q, k, v)
    group, rank, world = _group_info(name, group)
    if world == 1:
        return _direct(name, q, k, v, causal, softmax_scale, layout, cu_seqlens, max_seqlen, softcap, deterministic,
                       return_lse)
    grad = _needs_grad(q, k, v)
    sp = _prepare(name, q, k, v, group, rank, world, causal, softmax_scale, layout, cu_seqlens, softcap,
                  deterministic, check_inputs, grad)
    if sp.layout == "stripe" and sp.causal:
        if grad:
            out, lse = _GatheredAttention.apply(q, k, v, sp)
        else:
            out, lse = _attend(sp, q, v.shape[-1], _gathered_shards(sp, _gather(k, sp), _gather(v, sp)))
        return (out, lse) if return_lse else out
    rows = 0 if sp.varlen else 1
    kf = _to_global(_AllGather.apply(k, sp), sp.layout, rows)
    vf = _to_global(_AllGather.apply(v, sp), sp.layout, rows)
    kw = dict(softmax_scale=sp.scale, softcap=sp.softcap, deterministic=sp.deterministic, return_lse=True)
    n, c = sp.n, sp.n // _parts(sp.layout)
    pos = _positions(sp.layout, sp.rank, sp.world, n)
    # query pieces: (local rows [r0, r1), their global end); one piece without a causal mask
    pieces = [(0, n, None)] if not sp.causal else [(i, i + c, int(pos[i + c - 1]) + 1) for i in range(0, n, c)]
    res = []
    for r0, r1, end in pieces:
        if not sp.varlen:
            ks, vs = (kf, vf) if end is None else (kf[:, :end], vf[:, :end])
            res.append(flash_attn_func(q[:, r0:r1], ks, vs, causal=sp.causal, **kw))
            continue
        # one sequence per document from the first to the last that the piece's rows touch (those
        # between hold none of them: sequences without queries); keys from each document's start to
        # its end, or to the piece's end (causal; only the last document can be cut there)
        cu = sp.cu
        iq = np.searchsorted(pos[r0:r1], cu)
        lq = np.diff(iq)
        docs = np.nonzero(lq)[0]
        d0, d1 = int(docs[0]), int(docs[-1]) + 1
        ends = cu[d0 + 1:d1 + 1].copy()
        if end is not None:
            ends[-1] = min(ends[-1], end)
        lk = ends - cu[d0:d1]
        host = np.concatenate(([0], np.cumsum(lq[d0:d1]), [0], np.cumsum(lk))).astype(np.int32)
        dev = _to_device(host, q.device)
        m = d1 - d0 + 1
        k0, k1 = int(cu[d0]), int(ends[-1])
        res.append(flash_attn_varlen_func(q[r0:r1], kf[k0:k1], vf[k0:k1], dev[:m], dev[m:], int(lq.max()),
                                          int(lk.max()), causal=sp.causal, **kw))
    out, lse = _cat(res, rows)
    return (out, lse) if return_lse else out
