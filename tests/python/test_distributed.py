"""Context parallelism (flashcpp.distributed, docs/distributed.md) on CPU tensors over gloo.

One process group per world size (2, 3 and 4 processes, started once each from a forkserver that
has torch and flashcpp imported, so a start costs a fork rather than an import) runs every case
of CASES: fresh random inputs (one seed per run, printed; the same full sequence on every rank),
sharded with shard_sequence; each rank's output, LSE and gradients (of sum(out * dout) +
sum(lse * dlse), dout and dlse random) are compared with single-process flashcpp attention over the
full sequence (flash_attn_func / flash_attn_varlen_func and its autograd), sharded the same way.
The checks run here, in the pytest process, on what the ranks report. World size 1 (the direct
path), the per-step plan against the global mask (dense and varlen), the accumulation by
merge_attention_states and the shard helpers run in this process without a group.

Tolerances (max |err| <= ATOL + RTOL * max |reference|, per tensor):
* fp32: the ring merges fp32 partial results whose own rounding differs from the single call's
  (a different summation order over the keys, then the fp32 merge): a few fp32 ulps of the values;
  1e-5 absolute + 1e-5 relative covers it with a margin.
* bf16: each partial output is rounded to bf16 before the merge (the single call rounds once), and
  each block's gradients are rounded to bf16 before they are summed in fp32: 4e-3 absolute + 1.6e-2
  relative (1 to 4 bf16 ulps).
* fp64: values in float64, but the LSEs are fp32 (flashcpp's LSE is fp32 for every dtype) and the
  library's merge is fp32, so the merged output carries fp32 rounding: 1e-6 absolute + 1e-6
  relative.
FLASHCPP_TEST_SEED=<n> replays a run (the seed is printed).
"""
import datetime
import json
import math
import multiprocessing
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="context parallelism needs torch")
import torch.distributed as dist  # noqa: E402

import flashcpp  # noqa: E402
import flashcpp.distributed as fd  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")

TOL = {"float32": (1e-5, 1e-5), "bfloat16": (4e-3, 1.6e-2), "float64": (1e-6, 1e-6)}
WORLD_SIZES = (2, 3, 4)
B, HQ, D = 2, 4, 16
N_LOCAL = 8          # rows per rank (dense), 4 per zigzag chunk
T_LOCAL = 12         # packed rows per rank (varlen)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _case(name, fn="ring", layout="contiguous", causal=True, dtype="float32", heads_kv=2, varlen=False,
          softcap=0.0, grad="out+lse", head_dim_v=D, n=None, batch=B, heads_q=HQ, d=D, nan=False):
    return dict(name=name, fn=fn, layout=layout, causal=causal, dtype=dtype, heads_kv=heads_kv, varlen=varlen,
                softcap=softcap, grad=grad, head_dim_v=head_dim_v, n=n or (T_LOCAL if varlen else N_LOCAL),
                batch=batch, heads_q=heads_q, d=d, nan=nan)


def _odd(name, layout, fn="ring", varlen=False, causal=True):
    """Odd sizes: 7 rows per rank (6 under zigzag: chunks of 3), 11 packed rows (10), batch 3,
    3 query heads on 1 KV head, head_dim 24, head_dim_v 40."""
    n = (6 if layout == "zigzag" else 7) if not varlen else (10 if layout == "zigzag" else 11)
    return _case(name, fn=fn, layout=layout, varlen=varlen, causal=causal, n=n, batch=3, heads_q=3, heads_kv=1,
                 d=24, head_dim_v=40)


CASES = [
    _case("ring_contiguous_noncausal_fp32_mha", causal=False, heads_kv=4),
    _case("ring_contiguous_causal_fp32_gqa"),
    _case("ring_zigzag_causal_fp32_gqa", layout="zigzag"),
    _case("ring_stripe_causal_fp32_gqa", layout="stripe"),
    _case("ring_zigzag_noncausal_fp32_mqa", layout="zigzag", causal=False, heads_kv=1),
    _case("ring_stripe_causal_softcap_fp32", layout="stripe", softcap=5.0),
    _case("ring_zigzag_causal_lse_grad_only", layout="zigzag", grad="lse"),
    _case("ring_stripe_causal_out_grad_only", layout="stripe", grad="out"),
    _case("ring_contiguous_causal_bf16_gqa", dtype="bfloat16"),
    _case("ring_zigzag_causal_bf16_gqa", layout="zigzag", dtype="bfloat16"),
    _case("ring_stripe_causal_bf16_gqa", layout="stripe", dtype="bfloat16"),
    _case("ring_zigzag_causal_fp64", layout="zigzag", dtype="float64"),
    _case("ring_stripe_causal_fp64", layout="stripe", dtype="float64"),
    _odd("ring_odd_contiguous_causal", "contiguous"),
    _odd("ring_odd_zigzag_causal", "zigzag"),
    _odd("ring_odd_stripe_causal", "stripe"),
    _odd("ring_odd_stripe_noncausal", "stripe", causal=False),
    _case("ring_varlen_contiguous_causal_fp32", varlen=True),
    _case("ring_varlen_zigzag_causal_fp32", layout="zigzag", varlen=True),
    _case("ring_varlen_stripe_causal_fp32", layout="stripe", varlen=True),
    _case("ring_varlen_zigzag_noncausal_fp32", layout="zigzag", causal=False, varlen=True),
    _case("ring_varlen_zigzag_causal_fp64", layout="zigzag", dtype="float64", varlen=True),
    _odd("ring_odd_varlen_stripe_causal", "stripe", varlen=True),
    _odd("ring_odd_varlen_zigzag_causal", "zigzag", varlen=True),
    _case("allgather_contiguous_causal_fp32_gqa", fn="allgather"),
    _case("allgather_zigzag_causal_fp32_gqa", fn="allgather", layout="zigzag"),
    _case("allgather_stripe_causal_fp32_gqa", fn="allgather", layout="stripe"),
    _case("allgather_contiguous_noncausal_bf16", fn="allgather", causal=False, dtype="bfloat16"),
    _case("allgather_stripe_causal_bf16", fn="allgather", layout="stripe", dtype="bfloat16"),
    _case("allgather_zigzag_causal_softcap_fp32", fn="allgather", layout="zigzag", softcap=5.0),
    _odd("allgather_odd_zigzag_causal", "zigzag", fn="allgather"),
    _odd("allgather_odd_stripe_causal", "stripe", fn="allgather"),
    _case("allgather_varlen_contiguous_causal_fp32", fn="allgather", varlen=True),
    _case("allgather_varlen_zigzag_causal_fp32", fn="allgather", layout="zigzag", varlen=True),
    _case("allgather_varlen_stripe_causal_fp32", fn="allgather", layout="stripe", varlen=True),
    _case("allgather_varlen_stripe_noncausal_fp32", fn="allgather", layout="stripe", causal=False, varlen=True),
    _odd("allgather_odd_varlen_zigzag_causal", "zigzag", fn="allgather", varlen=True),
    # NaN in one q row, one k row and one v element (forward only): see _run_nan_case
    _case("nan_ring_zigzag_causal", layout="zigzag", nan=True),
    _case("nan_ring_stripe_causal", layout="stripe", nan=True),
    _case("nan_ring_varlen_contiguous_causal", varlen=True, nan=True),
    _case("nan_allgather_contiguous_causal", fn="allgather", nan=True),
    _case("nan_allgather_stripe_causal", fn="allgather", layout="stripe", nan=True),
]
# (name, the exception every rank must raise)
ERROR_CASES = {"seqlen_differs": "ValueError", "causal_differs": "ValueError", "zigzag_odd_length": "ValueError",
               "cu_seqlens_end": "ValueError", "cu_seqlens_differ": "ValueError", "one_rank_refuses": "ValueError",
               "one_rank_wrong_dtype": "TypeError", "gradients_differ": "ValueError"}
# The ring's order (the overlap) is checked on these cases (a second run each).
ORDER_CASES = {"ring_zigzag_causal_fp32_gqa", "ring_stripe_causal_fp32_gqa", "ring_contiguous_causal_fp32_gqa",
               "ring_varlen_zigzag_causal_fp32"}


def _seed():
    return int(os.environ.get("FLASHCPP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def _documents(rng, total):
    """Random document boundaries over total rows: some documents cross the shards' boundaries,
    one may be empty (a repeated boundary)."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=max(1, total // 7), replace=False))
    cu = np.concatenate(([0], cuts, [cuts[len(cuts) // 2]], [total]))
    return np.sort(cu).astype(np.int64)


def _inputs(case, world, seed):
    """Full-sequence q, k, v, dout, dlse (and cu_seqlens), the same on every rank."""
    rng = np.random.default_rng([seed, world, CASES.index(case)])
    dt = DTYPES[case["dtype"]]
    hq, hkv, d, dv, b = case["heads_q"], case["heads_kv"], case["d"], case["head_dim_v"], case["batch"]
    total = case["n"] * world
    if case["varlen"]:
        shapes = [(total, hq, d), (total, hkv, d), (total, hkv, dv), (total, hq, dv), (hq, total)]
        cu = _documents(rng, total)
    else:
        shapes = [(b, total, hq, d), (b, total, hkv, d), (b, total, hkv, dv), (b, total, hq, dv), (b, hq, total)]
        cu = None
    q, k, v, dout, dlse = (torch.from_numpy(rng.standard_normal(s)) for s in shapes)
    return q.to(dt), k.to(dt), v.to(dt), dout.float(), dlse.float(), cu


def _loss(out, lse, dout, dlse, grad):
    loss = 0
    if "out" in grad:
        loss = loss + (out.float() * dout).sum()
    if "lse" in grad:
        loss = loss + (lse * dlse).sum()
    return loss


def _reference(case, q, k, v, cu):
    if case["varlen"]:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        mx = int(np.diff(cu).max())
        return flashcpp.flash_attn_varlen_func(q, k, v, cu_t, cu_t, mx, mx, causal=case["causal"],
                                               softcap=case["softcap"], return_lse=True)
    return flashcpp.flash_attn_func(q, k, v, causal=case["causal"], softcap=case["softcap"], return_lse=True)


def _err(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max()), float(ref.abs().max())


def _fn(case):
    return fd.ring_attention if case["fn"] == "ring" else fd.allgather_attention


def _kwargs(case, cu):
    return dict(causal=case["causal"], layout=case["layout"], softcap=case["softcap"], return_lse=True,
                cu_seqlens=None if cu is None else cu.tolist())


def _run_case(case, rank, world, seed):
    q, k, v, dout, dlse, cu = _inputs(case, world, seed)
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = _reference(case, qf, kf, vf, cu)
    _loss(ref_out, ref_lse, dout, dlse, case["grad"]).backward()
    rows = 0 if case["varlen"] else 1
    shard = lambda x, dim=rows: fd.shard_sequence(x, rank, world, case["layout"], dim)  # noqa: E731
    ql, kl, vl = (shard(x).detach().clone().requires_grad_() for x in (q, k, v))
    fn, kw = _fn(case), _kwargs(case, cu)
    out, lse = fn(ql, kl, vl, **kw)
    _loss(out, lse, shard(dout), shard(dlse, -1), case["grad"]).backward()
    with torch.no_grad():
        out_ng, lse_ng = fn(ql, kl, vl, **kw)
    errs = {"out": _err(out, shard(ref_out)), "lse": _err(lse, shard(ref_lse, -1)),
            "dq": _err(ql.grad, shard(qf.grad)), "dk": _err(kl.grad, shard(kf.grad)),
            "dv": _err(vl.grad, shard(vf.grad))}
    order_ok = _order_ok(case, rank, world, ql, kl, vl, kw) if case["name"] in ORDER_CASES else None
    return dict(errors=errs, order_ok=order_ok,
                no_grad_same=bool(torch.equal(out_ng, out.detach()) and torch.equal(lse_ng, lse.detach())),
                dtype=str(out.dtype), lse_dtype=str(lse.dtype), out_shape=list(out.shape),
                want_out_shape=list(shard(ref_out).shape), lse_shape=list(lse.shape),
                want_lse_shape=list(shard(ref_lse, -1).shape))


def _run_nan_case(case, rank, world, seed):
    """NaN in q at one row (head 0), in k at one row (KV head 1: query heads 2 and 3) and in v at one
    element (KV head 0, dim 3). A NaN in q or k reaches exactly the rows (and their LSEs) whose
    scores it enters, in the ring as in the single call: those masks must be equal. A NaN in v
    reaches the rows that see its key; the kernels also multiply zero weights by whole tiles, so
    it may reach hidden rows of the same tile too, differently in the single call and in the
    blocks: every row seeing it must be NaN in both, and where both are finite the values agree."""
    q, k, v, _, _, cu = _inputs(case, world, seed)
    rng = np.random.default_rng([seed, world, 7])
    total = q.shape[0] if case["varlen"] else q.shape[1]
    pq, pk, pv = (int(x) for x in rng.integers(0, total, 3))
    at = (lambda p: (p,)) if case["varlen"] else (lambda p: (slice(None), p))  # noqa: E731
    q[at(pq) + (0, 0)] = math.nan
    k[at(pk) + (1, 0)] = math.nan
    v[at(pv) + (0, 3)] = math.nan
    with torch.no_grad():
        ref_out, ref_lse = _reference(case, q, k, v, cu)
        rows = 0 if case["varlen"] else 1
        shard = lambda x, dim=rows: fd.shard_sequence(x, rank, world, case["layout"], dim)  # noqa: E731
        out, lse = _fn(case)(shard(q), shard(k), shard(v), **_kwargs(case, cu))
    ref_out, ref_lse = shard(ref_out), shard(ref_lse, -1)
    # rows that see key pv (global positions of this rank's rows), in heads 0 and 1
    pos = fd.shard_positions(out.shape[rows], rank, world, case["layout"]).numpy()
    doc = (lambda p: np.searchsorted(cu, p, "right")) if cu is not None else (lambda p: 0 * p)  # noqa: E731
    sees = (pos >= pv) & (doc(pos) == doc(np.int64(pv)))
    must = torch.zeros(out.shape[:-1], dtype=torch.bool)
    must[at(torch.from_numpy(sees)) + (slice(0, 2),)] = True
    on, rn = out.isnan().any(-1), ref_out.isnan().any(-1)
    both = ~(out.isnan() | ref_out.isnan())
    return dict(lse_nan_equal=bool(torch.equal(lse.isnan(), ref_lse.isnan())),
                lse_nan_rows=int(lse.isnan().sum()),
                lse_finite_err=_err(lse[~lse.isnan()], ref_lse[~lse.isnan()]) if (~lse.isnan()).any() else [0, 0],
                qk_out_nan_equal=bool(torch.equal(on[..., 2:], rn[..., 2:])),
                v_nan_reached=bool((on[must]).all() and (rn[must]).all()), v_rows=int(must.sum()),
                finite_err=_err(out[both], ref_out[both]))


def _order_ok(case, rank, world, q, k, v, kw):
    """The ring posts the exchange of step s + 1 before step s computes (forward and backward),
    and in the backward posts step s's dK/dV accumulator before step s + 1 computes: the order of
    _Ring.exchange calls (by tag) and block computations (by step) on a second run."""
    events = []
    orig = fd._Ring.exchange, fd._block_forward, fd._block_backward

    def exchange(self, tensors, tag):
        events.append(("x", tag))
        return orig[0](self, tensors, tag)

    def fwd(sp, q, k, v, blk):
        events.append(("f", blk.step))
        return orig[1](sp, q, k, v, blk)

    def bwd(sp, dout, q, k, v, out, lse, dlse, blk):
        events.append(("b", blk.step))
        return orig[2](sp, dout, q, k, v, out, lse, dlse, blk)

    fd._Ring.exchange, fd._block_forward, fd._block_backward = exchange, fwd, bwd
    try:
        out, lse = _fn(case)(q, k, v, **kw)
        (out.float().sum() + lse.sum()).backward()
    finally:
        fd._Ring.exchange, fd._block_forward, fd._block_backward = orig
    split = next(i for i, e in enumerate(events) if e[0] == "b") - 1  # the backward's first exchange
    ok = True
    for kind, ev in (("f", events[:split]), ("b", events[split:])):
        idx = lambda e: [i for i, x in enumerate(ev) if x == e]  # noqa: E731
        for s in range(world - 1):
            posted = idx(("x", 4 * s))
            ok &= len(posted) == 1 and all(i > posted[0] for i in idx((kind, s)))
            if kind == "b":  # the accumulator of step s leaves after step s and before step s + 1
                sent = idx(("x", 4 * s + 2))
                ok &= len(sent) == 1 and all(i < sent[0] for i in idx(("b", s)))
                ok &= all(i > sent[0] for i in idx(("b", s + 1)))
        ok &= sum(1 for e in ev if e[0] == kind) > 0
    return bool(ok)


def _run_error_case(name, rank, world):
    """Each rank calls with the arguments below; every rank must raise (no hang: the checks run
    before the ring, and what one rank refuses reaches the others through the check's all_gather)."""
    g = torch.Generator().manual_seed(0)
    n = N_LOCAL
    kw = dict(causal=True)
    dtype = torch.float32
    if name == "seqlen_differs":
        n = N_LOCAL if rank == 0 else N_LOCAL - 2
    elif name == "causal_differs":
        kw["causal"] = rank != world - 1
    elif name == "zigzag_odd_length":
        n, kw["layout"] = N_LOCAL - 1, "zigzag"
    elif name == "one_rank_refuses":
        n, kw["layout"] = (N_LOCAL - 1 if rank == world - 1 else N_LOCAL), "zigzag"
    elif name == "one_rank_wrong_dtype" and rank == 0:
        dtype = torch.int32
    q = torch.randn(B, n, HQ, D, generator=g).to(dtype)
    if name in ("cu_seqlens_end", "cu_seqlens_differ"):
        q = torch.randn(T_LOCAL, HQ, D, generator=g)
        end = T_LOCAL * world if name == "cu_seqlens_differ" else T_LOCAL * world - 1
        kw["cu_seqlens"] = [0, 3 + (rank if name == "cu_seqlens_differ" else 0), end]
    k = q[..., :2, :].contiguous()
    if name == "gradients_differ" and rank == 1:
        q.requires_grad_()
    try:
        fd.ring_attention(q, k, k, **kw)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        return dict(raised=type(e).__name__, message=str(e))
    return dict(raised=None, message="")


def _run_failed_step(rank, world):
    """A block that raises at step 1 on every rank (as the library's backward does on CUDA, where its
    kernel is not built yet), in the forward and then in the backward: every rank gets the error,
    the exchanges already posted complete, and the group's next ring call is unaffected (equal bit
    for bit to the same call before the failures)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, N_LOCAL, HQ if i == 0 else 2, D, generator=g) for i in range(3))
    kw = dict(causal=True, layout="zigzag", return_lse=True)
    before = fd.ring_attention(q, k, v, **kw)
    raised = []
    orig = fd._block_forward, fd._block_backward

    def fails(fn):
        def f(*args):
            if args[-1].step == 1:
                raise NotImplementedError("no backward kernel in this build")
            return fn(*args)
        return f

    for which in ("forward", "backward"):
        if which == "forward":
            fd._block_forward = fails(orig[0])
        else:
            fd._block_backward = fails(orig[1])
        try:
            ql = q.clone().requires_grad_()
            out, lse = fd.ring_attention(ql, k, v, **kw)
            (out.sum() + lse.sum()).backward()
            raised.append(None)
        except NotImplementedError as e:
            raised.append(str(e))
        finally:
            fd._block_forward, fd._block_backward = orig
    after = fd.ring_attention(q, k, v, **kw)
    return dict(raised=raised, same_after=bool(torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])))


def _worker(rank, world, init_file, out_dir, seed):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for case in CASES:
        t0 = time.perf_counter()
        results[case["name"]] = (_run_nan_case if case["nan"] else _run_case)(case, rank, world, seed)
        results[case["name"]]["seconds"] = time.perf_counter() - t0
    for name in ERROR_CASES:
        results["error_" + name] = _run_error_case(name, rank, world)
    results["failed_step"] = _run_failed_step(rank, world)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    """Every rank's results for one world size: one process group that runs all cases."""
    world = request.param
    seed = _seed()
    print(f"seed={seed}")
    d = tmp_path_factory.mktemp(f"cp_world{world}")
    import torch.multiprocessing as tmp
    # A forkserver with torch and flashcpp imported: each start is a fork of it (not a fresh
    # interpreter importing torch), and the children exit without tearing the interpreter down.
    # torch._dynamo too: the first autograd-visible call of a torch.library op imports it (~2 s
    # of CPU per process otherwise).
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "flashcpp",
                                            "flashcpp.distributed"])
    t0 = time.perf_counter()
    tmp.start_processes(_worker, args=(world, str(d / "rendezvous"), str(d), seed), nprocs=world,
                        start_method="forkserver")
    wall = time.perf_counter() - t0
    res = []
    for r in range(world):
        with open(d / f"rank{r}.json") as f:
            res.append(json.load(f))
    print(f"world {world}: {wall:.2f} s wall for {len(CASES)} cases and {len(ERROR_CASES)} error checks")
    return world, res


def _check(case, res):
    atol, rtol = TOL[case["dtype"]]
    bad = []
    for t, (err, scale) in res["errors"].items():
        if not err <= atol + rtol * scale:
            bad.append(f"{t}: max |err| {err:.3g} > {atol} + {rtol} * {scale:.3g}")
    return bad


@pytest.mark.parametrize("name", [c["name"] for c in CASES if not c["nan"]])
def test_matches_single_process(ranks, name):
    world, res = ranks
    case = next(c for c in CASES if c["name"] == name)
    dt = str(DTYPES[case["dtype"]])
    for r in range(world):
        got = res[r][name]
        assert got["order_ok"] in (None, True), f"rank {r}: a ring exchange was not posted before the step it overlaps"
        assert got["dtype"] == dt and got["lse_dtype"] == "torch.float32", got
        assert got["out_shape"] == got["want_out_shape"] and got["lse_shape"] == got["want_lse_shape"], got
        bad = _check(case, got)
        assert not bad, f"rank {r} of {world}: " + "; ".join(bad)
        assert got["no_grad_same"], f"rank {r}: the no-grad path differs from the autograd path"
    worst = {t: max(res[r][name]["errors"][t][0] for r in range(world)) for t in res[0][name]["errors"]}
    rel = {t: max(e / max(s, 1e-30) for e, s in (res[r][name]["errors"][t] for r in range(world))) for t in worst}
    print(f"world {world} {name}: " + " ".join(f"{t} {e:.2e} ({rel[t]:.1e} rel)" for t, e in worst.items()) +
          f" ({max(res[r][name]['seconds'] for r in range(world)):.3f} s)")


@pytest.mark.parametrize("name", [c["name"] for c in CASES if c["nan"]])
def test_nan_propagates_as_in_single_process(ranks, name):
    world, res = ranks
    atol, rtol = TOL["float32"]
    assert sum(res[r][name]["lse_nan_rows"] for r in range(world)) > 0  # the NaNs were visible somewhere
    for r in range(world):
        got = res[r][name]
        assert got["lse_nan_equal"], f"rank {r}: the LSE's NaN rows differ from the single call's"
        assert got["qk_out_nan_equal"], f"rank {r}: the output's NaN rows (q, k NaN) differ from the single call's"
        assert got["v_nan_reached"], f"rank {r}: a row that sees the NaN value is not NaN"
        for key in ("finite_err", "lse_finite_err"):
            err, scale = got[key]
            assert err <= atol + rtol * scale, f"rank {r}: {key} {err:.3g} (finite values)"


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_inputs_raise_on_every_rank(ranks, name):
    world, res = ranks
    msgs = [res[r]["error_" + name] for r in range(world)]
    for r, m in enumerate(msgs):
        assert m["raised"] == ERROR_CASES[name], f"rank {r}: {m}"
        assert m["message"].count(". ") == 0 and m["message"].startswith("ring_attention"), m["message"]
    if name in ("seqlen_differs", "causal_differs", "cu_seqlens_differ", "gradients_differ"):  # the all_gather
        assert len({m["message"] for m in msgs}) == 1, msgs
        assert "disagree" in msgs[0]["message"]
    if name in ("one_rank_refuses", "one_rank_wrong_dtype"):  # the others name the rank that refused
        bad = world - 1 if name == "one_rank_refuses" else 0
        for r, m in enumerate(msgs):
            assert r == bad or f"rank {bad} refused its inputs" in m["message"], m


def test_a_failed_step_leaves_the_group_usable(ranks):
    world, res = ranks
    for r in range(world):
        got = res[r]["failed_step"]
        assert got["raised"] == ["no backward kernel in this build"] * 2, f"rank {r}: {got}"
        assert got["same_after"], f"rank {r}: the ring call after the failures differs from the one before"


# ---- in this process: world size 1, the plan, the merge, the shard helpers -----------------------------

def test_world_size_one_is_the_plain_call():
    """group=None without a process group, and a real group of one rank: the plain attention
    call, bit for bit, with its gradients."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 12, HQ, D, generator=g)
    k, v = torch.randn(B, 12, 2, D, generator=g), torch.randn(B, 12, 2, D, generator=g)
    want, want_lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)

    def run(fn, group=None, layout="zigzag"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = fn(qq, kk, vv, group, True, layout=layout, return_lse=True)
        (out.sum() + lse.sum()).backward()
        return out.detach(), lse.detach(), qq.grad, kk.grad

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o, l = flashcpp.flash_attn_func(qq, kk, vv, causal=True, return_lse=True)
    (o.sum() + l.sum()).backward()
    assert not dist.is_initialized()
    for fn in (fd.ring_attention, fd.allgather_attention):
        for layout in fd.LAYOUTS:
            got = run(fn, layout=layout)
            assert torch.equal(got[0], want) and torch.equal(got[1], want_lse)
            assert torch.equal(got[2], qq.grad) and torch.equal(got[3], kk.grad)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdzv", rank=0, world_size=1)
        try:
            for fn in (fd.ring_attention, fd.allgather_attention):
                got = run(fn, dist.group.WORLD)
                assert torch.equal(got[0], want) and torch.equal(got[2], qq.grad)
            cu = [0, 5, 12]
            qv, kv = q[0], k[0]
            got = fd.ring_attention(qv, kv, kv, causal=True, cu_seqlens=cu)
            cu_t = torch.tensor(cu, dtype=torch.int32)
            assert torch.equal(got, flashcpp.flash_attn_varlen_func(qv, kv, kv, cu_t, cu_t, 7, 7, causal=True))
            for fn in (fd.ring_attention, fd.allgather_attention):  # the device tensor as it is, with max_seqlen
                assert torch.equal(fn(qv, kv, kv, causal=True, cu_seqlens=cu_t, max_seqlen=7), got)
        finally:
            dist.destroy_process_group()


def _mask_of_calls(calls, n):
    m = np.zeros((n, n), dtype=np.int64)
    for c in calls:
        nq, nk = c.q1 - c.q0, c.k1 - c.k0
        # bottom-right causal: query i sees key j <= i + nk - nq
        m[c.q0:c.q1, c.k0:c.k1] += np.tril(np.ones((nq, nk), np.int64), nk - nq) if c.causal else 1
    return m


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_step_plan_is_the_global_mask(layout):
    """Over every (rank, visiting shard) pair, the calls of a step cover exactly the global
    (causal or full) mask between those rows, each pair once; zigzag and stripe steps are one call
    each, and balanced: every step but the first does the same work on every rank (zigzag), or
    within n pairs of it (stripe: n(n+1)/2 or n(n-1)/2)."""
    for world in range(1, 6):
        for n in ((8, 6) if layout == "zigzag" else (8, 7, 1)):
            pos = [fd.shard_positions(n, r, world, layout).numpy() for r in range(world)]
            for causal in (False, True):
                work = np.zeros((world, world), np.int64)
                for r in range(world):
                    for s in range(world):
                        src = (r - s) % world
                        calls = fd._step_calls(layout, r, src, world, n, causal)
                        got = _mask_of_calls(calls, n)
                        want = (pos[r][:, None] >= pos[src][None, :]) if causal else np.ones((n, n), bool)
                        assert np.array_equal(got, want.astype(np.int64)), (world, n, r, src, causal, calls)
                        if layout != "contiguous":
                            assert len(calls) <= 1, calls
                        work[r, s] = got.sum()
                if causal and world > 1 and layout == "zigzag":
                    assert (work[:, 1:] == n * n // 2).all(), work
                if causal and world > 1 and layout == "stripe":
                    assert work[:, 1:].max() - work[:, 1:].min() <= n, work


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_varlen_plan_is_the_document_mask(layout, rng):
    """The varlen sequences of every call (_varlen_lengths: each document's rows of the call, with
    a causal document's keys after its last query cut off into a sequence without queries), each
    sequence bottom-right causal or full, cover exactly the global document mask between the
    rows, each pair once; random documents (empty ones too), 1 to 5 ranks, odd lengths."""
    for world in range(1, 6):
        for n in ((10, 6) if layout == "zigzag" else (11, 6, 1)):
            total = n * world
            cu = _documents(rng, total) if total > 1 else np.array([0, 1])
            pos = [fd.shard_positions(n, r, world, layout).numpy() for r in range(world)]
            doc = [np.searchsorted(cu, p, "right") for p in pos]
            for causal in (False, True):
                for r in range(world):
                    for src in range(world):
                        got = np.zeros((n, n), np.int64)
                        for c in fd._step_calls(layout, r, src, world, n, causal):
                            lens = fd._varlen_lengths(cu, pos[r][c.q0:c.q1], pos[src][c.k0:c.k1], c.causal)
                            if lens is None:
                                continue
                            assert lens[0].sum() == c.q1 - c.q0 and lens[1].sum() == c.k1 - c.k0
                            i0, j0 = c.q0, c.k0
                            for lq, lk in zip(*lens):
                                blk = np.tril(np.ones((lq, lk), np.int64), lk - lq) if c.causal else 1
                                got[i0:i0 + lq, j0:j0 + lk] += blk
                                i0, j0 = i0 + lq, j0 + lk
                        want = doc[r][:, None] == doc[src][None, :]
                        if causal:
                            want &= pos[r][:, None] >= pos[src][None, :]
                        assert np.array_equal(got, want.astype(np.int64)), (world, n, r, src, causal, cu)


def test_accumulation_is_merge_attention_states():
    """_Acc merges each block with flashcpp.merge_attention_states, whole rows or a range of them:
    the result is the attention over the union (here against its definition in float64), an empty
    side (LSE -inf) with NaN garbage in its output weighs nothing, and rows no block reached keep
    o = 0, lse = -inf."""
    g = torch.Generator().manual_seed(2)
    b, n, h, d = 2, 6, 3, 8
    q = torch.zeros(b, n, h, d)
    acc = fd._Acc(q, d, varlen=False)
    parts = []
    for q0, q1 in ((0, n), (2, 5), (0, n), (4, 6)):
        o = torch.randn(b, q1 - q0, h, d, generator=g)
        lse = torch.randn(b, h, q1 - q0, generator=g) * 3
        lse[0, 0, 0] = -math.inf
        o[0, 0, 0] = math.nan
        parts.append((q0, q1, o, lse))
        acc.add(o.to(torch.bfloat16) if q0 == 2 else o.clone(), lse.clone(), q0, q1)  # add owns what it gets
    out, lse = acc.result(torch.float32)
    # the definition: lse = log sum_p e^lse_p, o = sum_p o_p e^(lse_p - lse), over the parts covering a row
    want_l = torch.full((b, h, n), -math.inf, dtype=torch.float64)
    terms = []
    for q0, q1, o, l in parts:
        full_l = torch.full((b, h, n), -math.inf, dtype=torch.float64)
        full_l[..., q0:q1] = l.double()
        full_o = torch.zeros(b, n, h, d, dtype=torch.float64)
        full_o[:, q0:q1] = torch.nan_to_num(o.to(torch.bfloat16).double() if q0 == 2 else o.double(), nan=0.0)
        terms.append((full_o, full_l))
        want_l = torch.logaddexp(want_l, full_l)
    want_o = sum(o * torch.exp(l - want_l).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1) for o, l in terms)
    torch.testing.assert_close(lse.double(), want_l, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.double(), want_o, atol=1e-6, rtol=1e-6)
    assert not out.isnan().any()
    empty = fd._Acc(q, d, varlen=False)
    empty.add(torch.randn(b, 2, h, d), torch.randn(b, h, 2), 1, 3)
    out, lse = empty.result(torch.float32)
    assert (out[:, 0] == 0).all() and (lse[..., 0] == -math.inf).all() and (lse[..., 3:] == -math.inf).all()


def test_shard_helpers():
    x = torch.arange(2 * 24).view(2, 24)
    for layout in fd.LAYOUTS:
        for world in (1, 2, 3, 4):
            shards = [fd.shard_sequence(x, r, world, layout) for r in range(world)]
            assert torch.equal(fd.unshard_sequence(shards, layout), x)
            assert torch.equal(fd.unshard_sequence([s.t() for s in shards], layout, dim=0), x.t())
            for r in range(world):
                assert torch.equal(shards[r][0], fd.shard_positions(24 // world, r, world, layout))
    assert fd.zigzag_shard(x, 1, 3)[0].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert fd.shard_sequence(x, 1, 3, "stripe")[0].tolist() == [1, 4, 7, 10, 13, 16, 19, 22]
    assert torch.equal(fd.zigzag_unshard([fd.zigzag_shard(x, r, 3, 1) for r in range(3)]), x)
    with pytest.raises(ValueError, match="divisible by 10"):
        fd.zigzag_shard(x, 0, 5)
    with pytest.raises(ValueError, match="divisible by 5"):
        fd.shard_sequence(x, 0, 5, "stripe")
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.shard_sequence(x, 0, 2, "diagonal")
    with pytest.raises(ValueError, match="rank"):
        fd.shard_sequence(x, 2, 2)


def test_input_checks_without_a_group():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="^ring_attention: layout must be one of contiguous, zigzag, stripe"):
        fd.ring_attention(q, q, q, layout="diagonal")
    with pytest.raises(ValueError, match="must be even"):
        fd.ring_attention(q[:, :7], q[:, :7], q[:, :7], layout="zigzag")
    with pytest.raises(ValueError, match="q has 8 local rows but k and v have 6"):
        fd.ring_attention(q, q[:, :6], q[:, :6])
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        fd.allgather_attention(q[0], q[0], q[0], cu_seqlens=[0, 3, 7])
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        fd.ring_attention(q[0], q[0], q[0], cu_seqlens=[0.0, 8.0])
    with pytest.raises(TypeError, match="torch tensors"):
        fd.ring_attention(q.numpy(), q, q)
    with pytest.raises(TypeError, match="q has dtype int32"):
        fd.ring_attention(q.int(), q.int(), q.int())
    with pytest.raises(ValueError, match="softcap -1 must be finite and >= 0"):
        fd.allgather_attention(q, q, q, softcap=-1.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fd.ring_attention(q, q, q, causal="yes")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashcpp.WITH_CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_ring_forward_in_one_process(device, layout, varlen):
    """The ring's forward without a process group: every rank's steps (the plan, the block calls,
    the merges by merge_attention_states) run here one after another, the visiting shards cut from
    one full sequence, against the single call. On a GPU this is the ring's forward on the CUDA
    kernels and merge kernel (bf16; the CUDA backward is not built yet); on the CPU in fp32."""
    world, n = 3, (T_LOCAL if varlen else N_LOCAL)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    rows = 0 if varlen else 1
    shape = (n * world,) if varlen else (B, n * world)
    q = torch.randn(*shape, HQ, 64, generator=g).to(device, dt)
    k, v = (torch.randn(*shape, 2, 64, generator=g).to(device, dt) for _ in range(2))
    cu = _documents(np.random.default_rng(3), shape[0]) if varlen else None
    for causal in (False, True):
        if varlen:
            cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
            mx = int(np.diff(cu).max())
            want, want_lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_t, cu_t, mx, mx, causal=causal,
                                                             return_lse=True)
        else:
            want, want_lse = flashcpp.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        outs, lses = [], []
        shard = lambda x, r, dim=rows: fd.shard_sequence(x, r, world, layout, dim)  # noqa: E731
        for r in range(world):
            sp = fd._Spec(None, r, world, layout, causal, 64 ** -0.5, 0.0, False, cu, n)
            steps = ((s, shard(k, (r - s) % world), shard(v, (r - s) % world)) for s in range(world))
            o, l = fd._attend(sp, shard(q, r), 64, steps)
            outs.append(o)
            lses.append(l)
        got = fd.unshard_sequence(outs, layout, rows)
        got_lse = fd.unshard_sequence(lses, layout, -1)
        atol = 1e-5 if dt == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


def test_gpu_script_says_why_without_a_gpu(capsys, tmp_path):
    """python -m flashcpp.bench.cp (the world-size-1 check and timing on one GPU) where it cannot
    run ends in one sentence and exit status 2, having started nothing."""
    from flashcpp.bench.__main__ import _no_gpu_reason
    reason = _no_gpu_reason()
    if reason is None:
        pytest.skip("this machine can run the GPU script")
    from flashcpp.bench import cp
    assert cp.main(["--quick", "--out", str(tmp_path / "cp")]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m flashcpp.bench.cp: {reason}.\n"
    assert not (tmp_path / "cp").exists()
