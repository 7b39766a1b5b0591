"""Context parallelism: attention over a sequence whose rows are sharded across the ranks of a
``torch.distributed`` process group (docs/distributed.md).

Each rank holds a shard of the sequence of q, k and v in flash-attn layout: (batch, seqlen_local,
heads, head_dim), or packed (total_local, heads, head_dim) with ``cu_seqlens`` describing the
documents of the whole packed sequence. Two schedules compute exactly the attention of the full
sequence, each rank getting the output rows (and LSE) of its own queries:

* :func:`ring_attention`: the K/V shards travel around the ring of ranks (``batch_isend_irecv``;
  gloo on CPU, NCCL on GPU); at each step every rank attends its queries to the visiting K/V shard
  with flashcpp attention (``return_lse``) and merges the partial result by LSE. The exchange of
  the next step is posted before the current step computes. The backward runs a second ring in
  which the K/V shards travel again together with their dK/dV accumulators, which arrive home after
  the last step.
* :func:`allgather_attention`: all-gathers K and V, then one local attention per query chunk with
  the causal offset of its rows (Llama 3's context parallelism); differentiable through autograd
  (the gather's backward is a reduce-scatter).

Layouts: ``"contiguous"`` (rank r holds rows [r n, (r + 1) n)) and ``"zigzag"`` (the sequence in 2W
chunks of n / 2 rows; rank r holds chunks r and 2W - 1 - r, which balances causal work). The
helpers :func:`shard_sequence` / :func:`unshard_sequence` (and :func:`zigzag_shard` /
:func:`zigzag_unshard`) cut a full sequence into a rank's shard and put shards back together;
:func:`shard_positions` gives the global positions of a shard's rows (for rotary embeddings).

The merge of two partial results over disjoint key sets is the library's rule
(``merge_attention_states``, ``algebra::merge_two``): lse = log(e^lse_a + e^lse_b) and
o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse), an empty side (lse = -inf) weighing exactly 0.

Every rank of the group must make the same calls (the forward and, when gradients are wanted, the
backward): both are collective.
"""
from __future__ import annotations

import math
import struct
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import _core
from . import _torch_ops  # noqa: F401  (the backward ops: torch.ops.flashcpp.flash_attn_bwd, ...)
from .attention import flash_attn_func, flash_attn_varlen_func

__all__ = ["ring_attention", "allgather_attention", "shard_sequence", "unshard_sequence", "zigzag_shard",
           "zigzag_unshard", "shard_positions", "LAYOUTS"]

#: The ways a sequence is cut over the ranks.
LAYOUTS = ("contiguous", "zigzag")

_FULL, _CAUSAL, _SKIP = "full", "causal", "skip"


# ---- layouts -------------------------------------------------------------------------------------

def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return layout


def _chunks(layout: str, rank: int, world: int) -> Tuple[int, ...]:
    """The global chunk indices rank holds, in the order of its local rows (ascending), of
    world (contiguous) or 2 * world (zigzag) equal chunks."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _check_world(rank: Any, world_size: Any) -> Tuple[int, int]:
    world = _core.check_int(world_size, "world_size", 1)
    return _core.check_int(rank, "rank", 0, world - 1, f" (world_size {world})"), world


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The shard of the full sequence ``x`` that ``rank`` holds under ``layout`` (along ``dim``: 1
    for (batch, seqlen, ...) tensors, 0 for packed (total, ...) ones). Contiguous: rows
    [rank n, (rank + 1) n) with n = len / world_size; zigzag: chunks rank and 2 world_size - 1 - rank
    of 2 world_size equal chunks, concatenated (a new tensor)."""
    layout = _check_layout(layout)
    rank, world = _check_world(rank, world_size)
    total = x.shape[dim]
    parts = world if layout == "contiguous" else 2 * world
    if total % parts:
        raise ValueError(f"the sequence length {total} must be divisible by {parts} to be sharded {layout} over "
                         f"{world} ranks")
    c = total // parts
    pieces = [x.narrow(dim, a * c, c) for a in _chunks(layout, rank, world)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` is rank r's, as
    :func:`shard_sequence` cuts it): the inverse of shard_sequence."""
    layout = _check_layout(layout)
    world = len(shards)
    if world == 0:
        raise ValueError("unshard_sequence needs one shard per rank; got none")
    n = shards[0].shape[dim]
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"every shard must have one shape; got {[tuple(s.shape) for s in shards]}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
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
    chunks = _chunks(layout, rank, world)
    if n % len(chunks):
        raise ValueError(f"a zigzag shard holds two chunks of equal length; got seqlen_local {n}")
    c = n // len(chunks)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device) for a in chunks])


# ---- the per-step plan: which (query rows, key rows) pairs to attend, and how --------------------

class _Call(NamedTuple):
    q0: int  # local query rows [q0, q1)
    q1: int
    k0: int  # local rows of the visiting K/V shard [k0, k1)
    k1: int
    causal: bool


def _pair_mode(a: int, b: int, causal: bool) -> str:
    """Query chunk a against key chunk b (global chunk indices, equal lengths): keys entirely in
    the past are full, the diagonal is causal (bottom-right = top-left for equal lengths), keys
    entirely in the future are skipped."""
    if not causal or a > b:
        return _FULL
    return _CAUSAL if a == b else _SKIP


def _runs(cols: List[int]) -> List[Tuple[int, int]]:
    """Sorted column indices as [start, end) runs of consecutive ones."""
    out: List[Tuple[int, int]] = []
    for j in cols:
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def _step_calls(q_chunks: Sequence[int], kv_chunks: Sequence[int], c: int, causal: bool) -> List[_Call]:
    """The attention calls of one ring step: local query chunks q_chunks against the visiting
    shard's chunks kv_chunks (global chunk indices in local order, ascending; c rows each). Their
    union is exactly the global mask restricted to these rows and keys, each visible pair once.

    The identical, ascending chunk lists of a rank's own shard are one causal call (the local
    causal mask is then the global one); otherwise query chunks whose visible key chunks are the
    same full run share one call, and each diagonal pair is a causal call of its own."""
    nq, nk = len(q_chunks), len(kv_chunks)
    if not causal:
        return [_Call(0, nq * c, 0, nk * c, False)]
    if tuple(q_chunks) == tuple(kv_chunks):
        return [_Call(0, nq * c, 0, nk * c, True)]
    calls: List[_Call] = []
    groups: List[Tuple[int, int, Tuple[Tuple[int, int], ...]]] = []  # (first q chunk, last + 1, full runs)
    for i, a in enumerate(q_chunks):
        modes = [_pair_mode(a, b, True) for b in kv_chunks]
        full = tuple(_runs([j for j, m in enumerate(modes) if m == _FULL]))
        for j, m in enumerate(modes):
            if m == _CAUSAL:
                calls.append(_Call(i * c, (i + 1) * c, j * c, (j + 1) * c, True))
        if full and groups and groups[-1][1] == i and groups[-1][2] == full:
            groups[-1] = (groups[-1][0], i + 1, full)
        elif full:
            groups.append((i, i + 1, full))
    for i0, i1, full in groups:
        for j0, j1 in full:
            calls.append(_Call(i0 * c, i1 * c, j0 * c, j1 * c, False))
    return calls


# ---- the merge by LSE (the library's rule, in torch ops on any device) ---------------------------

def _merge(o_a: torch.Tensor, l_a: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor):
    """merge_attention_states' rule (algebra::merge_two, cpu::merge_by_lse) in torch ops: o_* (..., d)
    partial outputs, l_* (...) their natural-log LSEs. Returns (o, lse) in o_a's and l_a's dtypes.
    The LSE arithmetic runs in float64 and rounds once, as the host merge does; an empty side
    (-inf) weighs exactly 0 and its o is never read (so garbage there cannot leak); a NaN LSE
    propagates into both weights and the merged LSE."""
    a, b = l_a.double(), l_b.double()
    a_empty, b_empty = a == -math.inf, b == -math.inf
    a_hi = a > b
    hi, lo = torch.where(a_hi, a, b), torch.where(a_hi, b, a)
    merged = hi + torch.log1p(torch.exp(lo - hi))
    merged = torch.where(a_empty, b, torch.where(b_empty, a, merged))
    one = torch.ones((), dtype=torch.float64, device=a.device)
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    both = a_empty | b_empty
    w_a = torch.where(a_empty, zero, torch.where(both, one, torch.exp(a - merged)))
    w_b = torch.where(b_empty, zero, torch.where(both, one, torch.exp(b - merged)))
    w_a, w_b = w_a.to(o_a.dtype).unsqueeze(-1), w_b.to(o_a.dtype).unsqueeze(-1)
    o = torch.where(w_a != 0, o_a * w_a, 0) + torch.where(w_b != 0, o_b.to(o_a.dtype) * w_b, 0)
    return o, merged.to(l_a.dtype)


def _lse_rows(lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    """An LSE ((batch, heads, rows) or (heads, rows)) as out's leading dims ((batch, rows, heads)
    or (rows, heads)): a view."""
    return lse.t() if varlen else lse.transpose(1, 2)


def _rows(x: torch.Tensor, a: int, b: int, varlen: bool) -> torch.Tensor:
    return x[a:b] if varlen else x[:, a:b]


def _merge_rows(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, a: int, b: int,
                varlen: bool) -> None:
    """Merges a partial (o, lse) of query rows [a, b) into the accumulators, in place."""
    ao, al = _rows(acc_o, a, b, varlen), acc_lse[..., a:b]
    mo, ml = _merge(ao, _lse_rows(al, varlen), o, _lse_rows(lse, varlen))
    ao.copy_(mo)
    _lse_rows(al, varlen).copy_(ml)


# ---- varlen: documents cut by the rows a call sees ------------------------------------------------

def _doc_lengths(cu: np.ndarray, intervals: Sequence[Tuple[int, int]]) -> np.ndarray:
    """Per document (cu: global boundaries), how many of its rows lie in the intervals."""
    starts, ends = cu[:-1], cu[1:]
    n = np.zeros(len(starts), dtype=np.int64)
    for g0, g1 in intervals:
        n += np.clip(np.minimum(ends, g1) - np.maximum(starts, g0), 0, None)
    return n


def _intervals(chunks: Sequence[int], c: int, r0: int, r1: int) -> List[Tuple[int, int]]:
    """The global row intervals of local rows [r0, r1) (whole chunks) of a shard holding chunks."""
    return [(chunks[i] * c, chunks[i] * c + c) for i in range(r0 // c, r1 // c)]


def _varlen_call_args(cu: np.ndarray, q_chunks, kv_chunks, c: int, call: _Call, device: Any):
    """cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k of one call over packed shards, or
    None when no query row of the call sees a key of it. Each document is one sequence: its query
    rows in the call's rows and its keys in the call's key rows. Both are consecutive in the local
    buffers because the local chunks ascend (a document present in two of them covers the global
    rows between). Every row of the call belongs to a document (cu_seqlens[-1] is the whole
    length), so the sequences tile both ranges."""
    lq = _doc_lengths(cu, _intervals(q_chunks, c, call.q0, call.q1))
    lk = _doc_lengths(cu, _intervals(kv_chunks, c, call.k0, call.k1))
    if not np.any((lq > 0) & (lk > 0)):
        return None
    keep = (lq > 0) | (lk > 0)
    lq, lk = lq[keep], lk[keep]
    cu_q = torch.tensor(np.concatenate(([0], np.cumsum(lq))), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate(([0], np.cumsum(lk))), dtype=torch.int32, device=device)
    return cu_q, cu_k, int(lq.max()), int(lk.max())


# ---- one block: forward and backward --------------------------------------------------------------

class _Spec(NamedTuple):
    """A checked ring problem (everything but the tensors)."""
    group: Any
    rank: int
    world: int
    layout: str
    causal: bool
    scale: float
    softcap: float
    deterministic: bool
    varlen: bool
    cu: Optional[np.ndarray]  # global document boundaries (int64, host), varlen only
    c: int                    # rows per chunk

    def chunks(self, rank: int) -> Tuple[int, ...]:
        return _chunks(self.layout, rank, self.world)

    def calls(self, src: int) -> List[_Call]:
        return _step_calls(self.chunks(self.rank), self.chunks(src), self.c, self.causal)


def _block_forward(sp: _Spec, q, k, v, call: _Call, src: int):
    """(o, lse) of local query rows call.q0:q1 against rows call.k0:k1 of the shard of rank src,
    or None when nothing is visible."""
    qs, ks, vs = _rows(q, call.q0, call.q1, sp.varlen), _rows(k, call.k0, call.k1, sp.varlen), \
        _rows(v, call.k0, call.k1, sp.varlen)
    if not sp.varlen:
        return flash_attn_func(qs, ks, vs, softmax_scale=sp.scale, causal=call.causal, softcap=sp.softcap,
                               return_lse=True)
    args = _varlen_call_args(sp.cu, sp.chunks(sp.rank), sp.chunks(src), sp.c, call, q.device)
    if args is None:
        return None
    return flash_attn_varlen_func(qs, ks, vs, *args, softmax_scale=sp.scale, causal=call.causal,
                                  softcap=sp.softcap, return_lse=True)


def _block_backward(sp: _Spec, dout, q, k, v, out, lse, dlse, call: _Call, src: int):
    """(dq, dk, dv) of one block of the ring, given the merged (global) out, lse and their
    gradients, or None when the block has no visible pair.

    The backward of backward.h computes P = exp(s - LSE) and D = rowsum(dO * O) - dLSE from the
    lse and o it is handed; with the global ones, the gradients of a block are exactly its share of
    the full problem's (dS = P (dP - D) only involves the block's own keys otherwise). The fp64
    reference backward reads neither o nor lse (it recomputes P and D over the keys it is given),
    so for float64 the block's own forward state is recomputed and the gradients scaled into the
    global ones: with w = exp(lse_block - lse), dout_block = w dO and
    dLSE_block = w (rowsum(dO * O_block) - D + dLSE) give dS_block = w P_block (dP - D + dLSE),
    which is the global dS."""
    V = sp.varlen
    qs, ks, vs = _rows(q, call.q0, call.q1, V), _rows(k, call.k0, call.k1, V), _rows(v, call.k0, call.k1, V)
    do, os_ = _rows(dout, call.q0, call.q1, V).contiguous(), _rows(out, call.q0, call.q1, V).contiguous()
    ls = lse[..., call.q0:call.q1].contiguous()
    dls = None if dlse is None else dlse[..., call.q0:call.q1].contiguous()
    if V:
        args = _varlen_call_args(sp.cu, sp.chunks(sp.rank), sp.chunks(src), sp.c, call, q.device)
        if args is None:
            return None
    if q.dtype == torch.float64:
        if V:
            ob, lb = flash_attn_varlen_func(qs, ks, vs, *args, softmax_scale=sp.scale, causal=call.causal,
                                            softcap=sp.softcap, return_lse=True)
        else:
            ob, lb = flash_attn_func(qs, ks, vs, softmax_scale=sp.scale, causal=call.causal, softcap=sp.softcap,
                                     return_lse=True)
        lb64, l64 = lb.double(), ls.double()
        w = torch.where(lb64 == -math.inf, torch.zeros((), dtype=torch.float64, device=lb.device),
                        torch.exp(lb64 - l64))
        w = torch.nan_to_num(w, nan=0.0)  # rows empty in the whole problem (lse -inf) get no gradient
        wr = _lse_rows(w, V)  # aligned with out's leading dims
        d_glob = (do * os_).sum(-1)
        d_blk = (do * ob).sum(-1)
        extra = _lse_rows(dls, V).double() if dls is not None else 0.0
        dlse_b = wr * (d_blk - d_glob + extra)
        do = (do * wr.unsqueeze(-1)).contiguous()
        dls = (dlse_b.t() if V else dlse_b.transpose(1, 2)).to(torch.float32).contiguous()
        os_, ls = ob, lb
    if V:
        cu_q, cu_k, mq, mk = args
        return torch.ops.flashcpp.flash_attn_varlen_bwd(do, qs, ks, vs, os_, ls, dls, cu_q, cu_k, mq, mk, sp.scale,
                                                        call.causal, -1, -1, sp.softcap, None, sp.deterministic)
    return torch.ops.flashcpp.flash_attn_bwd(do, qs, ks, vs, os_, ls, dls, sp.scale, call.causal, -1, -1,
                                             sp.softcap, None, sp.deterministic)


# ---- the ring --------------------------------------------------------------------------------------

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


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ring_forward(sp: _Spec, q, k, v):
    ring = _Ring(sp.group, sp.rank, sp.world)
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_shape = (q.shape[1], q.shape[0]) if sp.varlen else (q.shape[0], q.shape[2], q.shape[1])
    acc_o = torch.zeros(out_shape, dtype=_acc_dtype(q), device=q.device)
    acc_lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k, v
    for s in range(sp.world):
        if s + 1 < sp.world:  # the next step's K/V travel while this step computes
            nxt, reqs = ring.exchange((k_cur, v_cur), tag=4 * s)
        src = (sp.rank - s) % sp.world
        for call in sp.calls(src):
            res = _block_forward(sp, q, k_cur, v_cur, call, src)
            if res is not None:
                _merge_rows(acc_o, acc_lse, res[0], res[1], call.q0, call.q1, sp.varlen)
        if s + 1 < sp.world:
            _wait(reqs)
            k_cur, v_cur = nxt
    return acc_o.to(q.dtype), acc_lse


def _ring_backward(sp: _Spec, dout, dlse, q, k, v, out, lse):
    ring = _Ring(sp.group, sp.rank, sp.world)
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    acc_reqs: list = []
    acc_recv = None
    for s in range(sp.world):
        if s + 1 < sp.world:
            nxt, kv_reqs = ring.exchange((k_cur, v_cur), tag=4 * s)
        src = (sp.rank - s) % sp.world
        dk_blk = dv_blk = None
        for call in sp.calls(src):
            g = _block_backward(sp, dout, q, k_cur, v_cur, out, lse, dlse, call, src)
            if g is None:
                continue
            if dk_blk is None:
                dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
            _rows(dq, call.q0, call.q1, sp.varlen).add_(g[0])
            _rows(dk_blk, call.k0, call.k1, sp.varlen).add_(g[1])
            _rows(dv_blk, call.k0, call.k1, sp.varlen).add_(g[2])
        # The dK/dV accumulators of the visiting shard: received from the previous rank (which
        # added its share one step earlier), plus this rank's share, sent on to the next rank.
        if s == 0:
            dk_acc = dk_blk if dk_blk is not None else torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = dv_blk if dv_blk is not None else torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            _wait(acc_reqs)
            dk_acc, dv_acc = acc_recv
            if dk_blk is not None:
                dk_acc.add_(dk_blk)
                dv_acc.add_(dv_blk)
        # After the last step this send takes each accumulator home (the shard's own rank).
        acc_recv, acc_reqs = ring.exchange((dk_acc, dv_acc), tag=4 * s + 2)
        if s + 1 < sp.world:
            _wait(kv_reqs)
            k_cur, v_cur = nxt
    _wait(acc_reqs)
    dk, dv = acc_recv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sp):
        out, lse = _ring_forward(sp, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sp = sp
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(ctx.sp, dout, dlse, q, k, v, out, lse)
        return dq, dk, dv, None


# ---- checks ------------------------------------------------------------------------------------------

def _group_info(group: Any) -> Tuple[Any, int, int]:
    """(group, rank, world size); group None without an initialized default group is a world of 1."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _host_cu(cu_seqlens: Any) -> np.ndarray:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            raise TypeError(f"cu_seqlens must hold integers; got {cu_seqlens.dtype}")
        cu = cu_seqlens.detach().cpu().numpy()  # a CUDA tensor is copied once (a synchronization)
    else:
        cu = np.asarray(cu_seqlens)
        if cu.dtype.kind not in "iu":
            raise TypeError(f"cu_seqlens must hold integers; got {cu.dtype}")
    return cu.astype(np.int64).reshape(-1) if cu.ndim <= 1 else cu


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("batch", "seqlen_local", "heads_q", "heads_kv", "head_dim", "head_dim_v", "dtype", "causal", "layout",
           "varlen", "cu_seqlens", "softmax_scale", "softcap")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _shown(field: str, x: int) -> Any:
    if field == "dtype":
        return _DTYPES[x]
    if field == "layout":
        return LAYOUTS[x]
    if field in ("softmax_scale", "softcap"):
        return struct.unpack("<d", struct.pack("<q", x))[0]
    return x


def _check_across_ranks(name: str, sp: _Spec, q, k, v) -> None:
    """One small all_gather: every rank must describe the same problem (shapes, dtype, mask,
    layout, documents), or each raises the same ValueError (before any ring traffic, which a
    mismatch would deadlock or corrupt)."""
    cu_sig = 0
    if sp.cu is not None:
        cu_sig = int((sp.cu * (np.arange(len(sp.cu)) % 1009 + 1)).sum() % (1 << 61)) + len(sp.cu)
    fields = [0, q.shape[0]] if sp.varlen else [q.shape[0], q.shape[1]]
    fields += [q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], _DTYPES.index(q.dtype), int(sp.causal),
               LAYOUTS.index(sp.layout), int(sp.varlen), cu_sig, _float_bits(sp.scale), _float_bits(sp.softcap)]
    mine = torch.tensor(fields, dtype=torch.int64, device=q.device)
    every = torch.empty((sp.world * len(fields),), dtype=torch.int64, device=q.device)
    dist.all_gather_into_tensor(every, mine, group=sp.group)
    rows = every.view(sp.world, len(fields)).cpu().tolist()
    for i, field in enumerate(_FIELDS):
        vals = [r[i] for r in rows]
        bad = next((r for r, x in enumerate(vals) if x != vals[0]), None)
        if bad is not None and field == "cu_seqlens":
            raise ValueError(f"{name}: the ranks' shards disagree: rank {bad} passed other cu_seqlens than rank 0 "
                             "(every rank must pass the same problem)")
        if bad is not None:
            raise ValueError(f"{name}: the ranks' shards disagree: {field} is {_shown(field, vals[0])} on rank 0 "
                             f"but {_shown(field, vals[bad])} on rank {bad} (every rank must pass the same problem)")


def _prepare(name: str, q, k, v, group, causal, softmax_scale, layout, cu_seqlens, softcap, deterministic,
             check_inputs) -> Tuple[_Spec, bool]:
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} takes torch tensors; {n} is a {type(x).__name__}")
    layout = _check_layout(layout)
    varlen = cu_seqlens is not None
    _core.check_qkv(q, k, v, varlen=varlen)  # the library's checks: dtypes, devices, ranks, heads, strides
    rows = 0 if varlen else 1
    n = q.shape[rows]
    if k.shape[rows] != n:
        raise ValueError(f"{name} shards q, k and v alike: q has {n} local rows but k and v have {k.shape[rows]}")
    group, rank, world = _group_info(group)
    if n < 1:
        raise ValueError(f"{name} needs at least one local row per rank; got {n}")
    parts = 2 if layout == "zigzag" else 1
    if n % parts:
        raise ValueError(f"{name}: the zigzag layout holds two equal chunks per rank, so the local length must be "
                         f"even; got {n}")
    cu = None
    if varlen:
        cu = _host_cu(cu_seqlens)
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != world * n:
            raise ValueError(f"{name}: cu_seqlens must be the whole packed sequence's document boundaries, "
                             f"non-decreasing from 0 to world_size * total_local = {world * n}; got "
                             f"{cu.tolist() if cu.size <= 16 else cu[:8].tolist() + ['...']}")
    scale = _core.default_scale(softmax_scale, q.shape[-1])
    sp = _Spec(group, rank, world, layout, bool(causal), float(scale), float(softcap), bool(deterministic), varlen,
               cu, n // parts)
    if world > 1 and check_inputs:
        _check_across_ranks(name, sp, q, k, v)
    return sp, varlen


def _direct(q, k, v, sp: _Spec, return_lse: bool):
    """World size 1: the plain attention call (differentiable through the library's autograd)."""
    if sp.varlen:
        cu = torch.tensor(sp.cu, dtype=torch.int32, device=q.device)
        mx = int(np.diff(sp.cu).max())
        return flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, softmax_scale=sp.scale, causal=sp.causal,
                                      softcap=sp.softcap, deterministic=sp.deterministic, return_lse=return_lse)
    return flash_attn_func(q, k, v, softmax_scale=sp.scale, causal=sp.causal, softcap=sp.softcap,
                           deterministic=sp.deterministic, return_lse=return_lse)


# ---- public functions --------------------------------------------------------------------------------

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, causal: bool = False,
                   softmax_scale: Optional[float] = None, *, layout: str = "contiguous", cu_seqlens: Any = None,
                   softcap: float = 0.0, return_lse: bool = False, deterministic: bool = False,
                   check_inputs: bool = True):
    """Ring attention over ``group`` (default: the default process group; none initialized means a
    world of one rank, a plain attention call).

    Args:
        q: this rank's queries, (batch, seqlen_local, heads_q, head_dim), or (total_local, heads_q,
            head_dim) with ``cu_seqlens``; k, v: the same rows' keys and values, (.., heads_kv, ..)
            (GQA: heads_q % heads_kv == 0). Torch tensors (CPU with gloo, CUDA with NCCL); every rank
            passes the same shapes.
        causal: global causal attention (query at global position i sees keys j <= i).
        softmax_scale: default 1 / sqrt(head_dim).
        layout: how the sequence is cut over the ranks, "contiguous" or "zigzag"
            (:func:`shard_sequence`; zigzag balances causal work).
        cu_seqlens: varlen: the document boundaries of the whole packed sequence (global, the same on
            every rank; a list, numpy array or tensor of world_size * total_local + ... ending at
            world_size * total_local). Each document attends within itself.
        softcap: > 0 applies s = softcap * tanh(s / softcap) to the scores.
        return_lse: also return the fp32 LSE of this rank's rows, (batch, heads_q, seqlen_local) or
            (heads_q, total_local).
        deterministic: bitwise-repeatable gradients (passed to each block's backward; the ring's
            own order is fixed).
        check_inputs: one small all_gather that checks every rank passes the same problem (raising
            the same ValueError on each when not); False skips it.

    Returns:
        out (q's shape with head_dim_v, q's dtype), or (out, lse). Differentiable (q, k, v and the
        LSE): the backward is a second ring in which dK/dV accumulators travel with the K/V shards;
        every rank must run it.
    """
    sp, varlen = _prepare("ring_attention", q, k, v, group, causal, softmax_scale, layout, cu_seqlens, softcap,
                          deterministic, check_inputs)
    if sp.world == 1:
        return _direct(q, k, v, sp, return_lse)
    k, v = k.contiguous(), v.contiguous()  # sent as they are: dense buffers
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _RingAttention.apply(q, k, v, sp)
    else:
        out, lse = _ring_forward(sp, q, k, v)
    return (out, lse) if return_lse else out


class _AllGather(torch.autograd.Function):
    """All-gather of the shards along a new leading dim (world, *x.shape); its backward sums the
    ranks' gradients of each shard onto the rank that owns it (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, world):
        x = x.contiguous()
        buf = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(buf, x, group=group)
        ctx.group, ctx.world = group, world
        return buf.view((world,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        out = g.new_empty(g.shape[1:])
        dist.reduce_scatter_tensor(out, g.view((-1,) + tuple(g.shape[2:])), group=ctx.group)
        return out, None, None


def _to_global(buf: torch.Tensor, layout: str, rows: int) -> torch.Tensor:
    """Gathered shards (world, ...) as the full sequence in global order (rows: the row dim of a
    shard, 0 packed or 1 batched)."""
    world = buf.shape[0]
    shards = list(buf.unbind(0))
    return unshard_sequence(shards, layout, rows) if world > 1 else shards[0]


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None,
                        causal: bool = False, softmax_scale: Optional[float] = None, *, layout: str = "contiguous",
                        cu_seqlens: Any = None, softcap: float = 0.0, return_lse: bool = False,
                        deterministic: bool = False, check_inputs: bool = True):
    """All-gather context parallelism (Llama 3): K and V are all-gathered over ``group``, then each
    rank attends its queries to the full keys, one call per local chunk of rows with the keys up to
    that chunk's end (bottom-right causal alignment puts query i at its global position). Arguments
    and returns as :func:`ring_attention`. Differentiable through torch autograd (the library's
    attention backward, then a reduce-scatter of dK/dV); every rank must run the backward.
    Memory: the full K and V on every rank."""
    sp, varlen = _prepare("allgather_attention", q, k, v, group, causal, softmax_scale, layout, cu_seqlens,
                          softcap, deterministic, check_inputs)
    if sp.world == 1:
        return _direct(q, k, v, sp, return_lse)
    rows = 0 if varlen else 1
    kf = _to_global(_AllGather.apply(k, sp.group, sp.world), layout, rows)
    vf = _to_global(_AllGather.apply(v, sp.group, sp.world), layout, rows)
    c = sp.c
    kw = dict(softmax_scale=sp.scale, softcap=sp.softcap, deterministic=sp.deterministic, return_lse=True)
    chunks = sp.chunks(sp.rank)
    if not varlen:
        if not causal:
            out, lse = flash_attn_func(q, kf, vf, causal=False, **kw)
        else:
            res = [flash_attn_func(q[:, i * c:(i + 1) * c], kf[:, :(a + 1) * c], vf[:, :(a + 1) * c], causal=True, **kw)
                   for i, a in enumerate(chunks)]
            out, lse = _cat(res, rows)
    else:
        cu = sp.cu
        pieces = [(0, len(chunks) * c, [(a * c, (a + 1) * c) for a in chunks])] if not causal else \
            [(i * c, (i + 1) * c, [(a * c, (a + 1) * c)]) for i, a in enumerate(chunks)]
        res = []
        for r0, r1, iv in pieces:
            lq = _doc_lengths(cu, iv)
            docs = np.nonzero(lq)[0]
            d0, d1 = int(docs[0]), int(docs[-1]) + 1  # documents first..last (those between hold no rows of q)
            lq = lq[d0:d1]
            ends = cu[d0 + 1:d1 + 1].copy()
            if causal:
                ends[-1] = min(ends[-1], iv[-1][1])  # the last document's keys up to the chunk's end
            lk = ends - cu[d0:d1]
            cu_q = torch.tensor(np.concatenate(([0], np.cumsum(lq))), dtype=torch.int32, device=q.device)
            cu_k = torch.tensor(np.concatenate(([0], np.cumsum(lk))), dtype=torch.int32, device=q.device)
            k0, k1 = int(cu[d0]), int(ends[-1])
            res.append(flash_attn_varlen_func(q[r0:r1], kf[k0:k1], vf[k0:k1], cu_q, cu_k, int(lq.max()),
                                              int(lk.max()), causal=bool(causal), **kw))
        out, lse = _cat(res, rows)
    return (out, lse) if return_lse else out


def _cat(res, rows: int):
    if len(res) == 1:
        return res[0]
    return torch.cat([o for o, _ in res], rows), torch.cat([l for _, l in res], -1)
