"""Context parallelism (flashcpp.distributed, docs/distributed.md) on CPU tensors over gloo.

One process group per world size (2, 3 and 4 processes, started once each from a forkserver that
has torch and flashcpp imported, so a start costs a fork rather than an import) runs every case
of CASES: random inputs, the same on every rank (one seed), sharded with shard_sequence; each
rank's output, LSE and gradients (of sum(out * dout) + sum(lse * dlse), dout and dlse random) are
compared with single-process flashcpp attention over the full sequence (flash_attn_func /
flash_attn_varlen_func and its autograd), sharded the same way. The checks run here, in the
pytest process, on the errors the ranks report. World size 1 (the direct path), the per-step
plan against the global mask, the merge against merge_attention_states and the shard helpers
run in this process without a group.

Tolerances (max |err| <= ATOL + RTOL * max |reference|, per tensor):
* fp32: the ring merges fp32 partial results whose own rounding differs from the single call's
  (a different summation order over the keys, then the fp32 merge): a few fp32 ulps of the values;
  1e-5 absolute + 1e-5 relative covers it with a margin (measured: below 1e-6 on outputs and
  LSEs, below 2e-6 on gradients).
* bf16: each partial output is rounded to bf16 before the merge (the single call rounds once), and
  each block's gradients are rounded to bf16 before they are summed in fp32: 4e-3 absolute + 1.6e-2
  relative (measured: at most 7.3e-3 of the largest value, 1 to 4 bf16 ulps).
* fp64: values in float64, but the LSEs are fp32 (flashcpp's LSE is fp32 for every dtype), so the
  merge weights carry fp32 rounding: 1e-6 absolute + 1e-6 relative.
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
                                reason="torch.distributed with gloo is not available")

TOL = {"float32": (1e-5, 1e-5), "bfloat16": (4e-3, 1.6e-2), "float64": (1e-6, 1e-6)}
WORLD_SIZES = (2, 3, 4)
B, HQ, D = 2, 4, 16
N_LOCAL = 8          # rows per rank (dense), 4 per zigzag chunk
T_LOCAL = 12         # packed rows per rank (varlen)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _case(name, fn="ring", layout="contiguous", causal=True, dtype="float32", heads_kv=2, varlen=False,
          softcap=0.0, grad="out+lse", head_dim_v=D):
    return dict(name=name, fn=fn, layout=layout, causal=causal, dtype=dtype, heads_kv=heads_kv, varlen=varlen,
                softcap=softcap, grad=grad, head_dim_v=head_dim_v)


CASES = [
    _case("ring_contiguous_noncausal_fp32_mha", causal=False, heads_kv=4),
    _case("ring_contiguous_causal_fp32_gqa"),
    _case("ring_zigzag_causal_fp32_gqa", layout="zigzag"),
    _case("ring_zigzag_noncausal_fp32_mqa", layout="zigzag", causal=False, heads_kv=1),
    _case("ring_zigzag_causal_softcap_fp32", layout="zigzag", softcap=5.0),
    _case("ring_zigzag_causal_lse_grad_only", layout="zigzag", grad="lse"),
    _case("ring_zigzag_causal_out_grad_only", layout="zigzag", grad="out"),
    _case("ring_contiguous_causal_bf16_gqa", dtype="bfloat16"),
    _case("ring_zigzag_causal_bf16_gqa", layout="zigzag", dtype="bfloat16"),
    _case("ring_zigzag_causal_fp64", layout="zigzag", dtype="float64"),
    _case("ring_zigzag_causal_fp32_head_dim_v", layout="zigzag", head_dim_v=24),
    _case("ring_varlen_contiguous_causal_fp32", varlen=True),
    _case("ring_varlen_zigzag_causal_fp32", layout="zigzag", varlen=True),
    _case("ring_varlen_zigzag_noncausal_fp32", layout="zigzag", causal=False, varlen=True),
    _case("ring_varlen_zigzag_causal_fp64", layout="zigzag", dtype="float64", varlen=True),
    _case("allgather_contiguous_causal_fp32_gqa", fn="allgather"),
    _case("allgather_zigzag_causal_fp32_gqa", fn="allgather", layout="zigzag"),
    _case("allgather_contiguous_noncausal_bf16", fn="allgather", causal=False, dtype="bfloat16"),
    _case("allgather_zigzag_causal_softcap_fp32", fn="allgather", layout="zigzag", softcap=5.0),
    _case("allgather_zigzag_causal_fp32_head_dim_v", fn="allgather", layout="zigzag", head_dim_v=24),
    _case("allgather_varlen_contiguous_causal_fp32", fn="allgather", varlen=True),
    _case("allgather_varlen_zigzag_causal_fp32", fn="allgather", layout="zigzag", varlen=True),
    _case("allgather_varlen_zigzag_noncausal_fp32", fn="allgather", layout="zigzag", causal=False, varlen=True),
]
ERROR_CASES = ["seqlen_differs", "causal_differs", "zigzag_odd_length", "cu_seqlens_end", "cu_seqlens_differ"]


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
    rng = np.random.default_rng([seed, world, CASES.index(case) if case in CASES else 99])
    dt = DTYPES[case["dtype"]]
    hkv, dv = case["heads_kv"], case["head_dim_v"]
    if case["varlen"]:
        total = T_LOCAL * world
        shapes = [(total, HQ, D), (total, hkv, D), (total, hkv, dv), (total, HQ, dv), (HQ, total)]
        cu = _documents(rng, total)
    else:
        n = N_LOCAL * world
        shapes = [(B, n, HQ, D), (B, n, hkv, D), (B, n, hkv, dv), (B, n, HQ, dv), (B, HQ, n)]
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


def _reference(case, q, k, v, dout, dlse, cu):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    if case["varlen"]:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        mx = int(np.diff(cu).max())
        out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_t, cu_t, mx, mx, causal=case["causal"],
                                                   softcap=case["softcap"], return_lse=True)
    else:
        out, lse = flashcpp.flash_attn_func(q, k, v, causal=case["causal"], softcap=case["softcap"], return_lse=True)
    _loss(out, lse, dout, dlse, case["grad"]).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _err(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max()), float(ref.abs().max())


def _head_dim_v_runs():
    """Whether this build's Python attention takes v with another head dim than q and k."""
    x, y = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 24)
    try:
        flashcpp.flash_attn_func(x, x, y)
    except ValueError:
        return False
    return True


def _run_case(case, rank, world, seed):
    if case["head_dim_v"] != D and not _head_dim_v_runs():
        return dict(skipped="this build's flash_attn_func refuses head_dim_v != head_dim")
    q, k, v, dout, dlse, cu = _inputs(case, world, seed)
    ref = _reference(case, q, k, v, dout, dlse, cu)
    rows = 0 if case["varlen"] else 1
    shard = lambda x, dim=rows: fd.shard_sequence(x, rank, world, case["layout"], dim)  # noqa: E731
    ql, kl, vl = (shard(x).detach().clone().requires_grad_() for x in (q, k, v))
    fn = fd.ring_attention if case["fn"] == "ring" else fd.allgather_attention
    kw = dict(causal=case["causal"], layout=case["layout"], softcap=case["softcap"], return_lse=True,
              cu_seqlens=None if cu is None else cu.tolist())
    out, lse = fn(ql, kl, vl, **kw)
    _loss(out, lse, shard(dout), shard(dlse, -1), case["grad"]).backward()
    with torch.no_grad():
        out_ng, lse_ng = fn(ql, kl, vl, **kw)
    errs = {"out": _err(out, shard(ref[0])), "lse": _err(lse, shard(ref[1], -1)), "dq": _err(ql.grad, shard(ref[2])),
            "dk": _err(kl.grad, shard(ref[3])), "dv": _err(vl.grad, shard(ref[4]))}
    return dict(errors=errs, order_ok=_order_ok(fn, case, rank, world, ql, kl, vl, kw), no_grad_same=bool(torch.equal(out_ng, out.detach()) and torch.equal(lse_ng, lse.detach())),
                dtype=str(out.dtype), lse_dtype=str(lse.dtype), out_shape=list(out.shape), lse_shape=list(lse.shape))


def _order_ok(fn, case, rank, world, q, k, v, kw):
    """The ring posts the exchange of step s + 1 before it computes step s, forward and backward
    (the overlap): the order of _Ring.exchange calls (by tag) and block computations (by the rank
    whose shard visits) on a second run."""
    if fn is not fd.ring_attention:
        return True
    events = []
    orig = fd._Ring.exchange, fd._block_forward, fd._block_backward

    def exchange(self, tensors, tag):
        events.append(("x", tag))
        return orig[0](self, tensors, tag)

    def fwd(sp, q, k, v, call, src):
        events.append(("f", src))
        return orig[1](sp, q, k, v, call, src)

    def bwd(sp, dout, q, k, v, out, lse, dlse, call, src):
        events.append(("b", src))
        return orig[2](sp, dout, q, k, v, out, lse, dlse, call, src)

    fd._Ring.exchange, fd._block_forward, fd._block_backward = exchange, fwd, bwd
    try:
        out, lse = fn(q, k, v, **kw)
        (out.float().sum() + lse.sum()).backward()
    finally:
        fd._Ring.exchange, fd._block_forward, fd._block_backward = orig
    ok = True
    for kind in ("f", "b"):
        start = events.index(next(e for e in events if e[0] == kind)) - 1  # the step-0 exchange precedes it
        ev = events[start:] if kind == "b" else events[:next(i for i, e in enumerate(events) if e[0] == "b")]
        for s in range(world - 1):
            src = (rank - s) % world
            first = next((i for i, e in enumerate(ev) if e == (kind, src)), None)
            posted = ev.index(("x", 4 * s))
            ok &= first is None or posted < first
            later = [i for i, e in enumerate(ev) if e[0] == kind and e[1] == (rank - s - 1) % world]
            ok &= all(i > posted for i in later)
    return bool(ok)


def _run_error_case(name, rank, world):
    """Each rank calls with the arguments below; every rank must raise the same ValueError (no
    hang: the checks run before the ring, or in one all_gather every rank joins)."""
    g = torch.Generator().manual_seed(0)
    n = N_LOCAL
    kw = dict(causal=True)
    if name == "seqlen_differs":
        n = N_LOCAL if rank == 0 else N_LOCAL - 2
    elif name == "causal_differs":
        kw["causal"] = rank != world - 1
    elif name == "zigzag_odd_length":
        n, kw["layout"] = N_LOCAL - 1, "zigzag"
    q = torch.randn(B, n, HQ, D, generator=g)
    if name in ("cu_seqlens_end", "cu_seqlens_differ"):
        q = torch.randn(T_LOCAL, HQ, D, generator=g)
        end = T_LOCAL * world if name == "cu_seqlens_differ" else T_LOCAL * world - 1
        kw["cu_seqlens"] = [0, 3 + (rank if name == "cu_seqlens_differ" else 0), end]
    k = q[..., :2, :].contiguous()
    try:
        fd.ring_attention(q, k, k, **kw)
    except ValueError as e:
        return dict(raised="ValueError", message=str(e))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        return dict(raised=type(e).__name__, message=str(e))
    return dict(raised=None, message="")


def _worker(rank, world, init_file, out_dir, seed):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for case in CASES:
        t0 = time.perf_counter()
        results[case["name"]] = _run_case(case, rank, world, seed)
        results[case["name"]]["seconds"] = time.perf_counter() - t0
    for name in ERROR_CASES:
        results["error_" + name] = _run_error_case(name, rank, world)
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


def _check(name, case, res):
    atol, rtol = TOL[case["dtype"]]
    bad = []
    for t, (err, scale) in res["errors"].items():
        if not err <= atol + rtol * scale:
            bad.append(f"{t}: max |err| {err:.3g} > {atol} + {rtol} * {scale:.3g}")
    return bad


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_matches_single_process(ranks, name):
    world, res = ranks
    case = next(c for c in CASES if c["name"] == name)
    dt = str(DTYPES[case["dtype"]])
    if "skipped" in res[0][name]:
        pytest.skip(res[0][name]["skipped"])
    for r in range(world):
        got = res[r][name]
        assert got["order_ok"], f"rank {r}: a ring exchange was not posted before the step it overlaps"
        assert got["dtype"] == dt and got["lse_dtype"] == "torch.float32", got
        bad = _check(name, case, got)
        assert not bad, f"rank {r} of {world}: " + "; ".join(bad)
        assert got["no_grad_same"], f"rank {r}: the no-grad path differs from the autograd path"
    worst = {t: max(res[r][name]["errors"][t][0] for r in range(world)) for t in res[0][name]["errors"]}
    rel = {t: max(e / max(s, 1e-30) for e, s in (res[r][name]["errors"][t] for r in range(world))) for t in worst}
    print(f"world {world} {name}: " + " ".join(f"{t} {e:.2e} ({rel[t]:.1e} rel)" for t, e in worst.items()) +
          f" ({max(res[r][name]['seconds'] for r in range(world)):.3f} s)")


@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_inputs_raise_on_every_rank(ranks, name):
    world, res = ranks
    msgs = [res[r]["error_" + name] for r in range(world)]
    for r, m in enumerate(msgs):
        assert m["raised"] == "ValueError", f"rank {r}: {m}"
        assert m["message"].count(". ") == 0 and m["message"].startswith("ring_attention"), m["message"]
    if name in ("seqlen_differs", "causal_differs", "cu_seqlens_differ"):  # found by the all_gather
        assert len({m["message"] for m in msgs}) == 1, msgs
        assert "disagree" in msgs[0]["message"]


# ---- in this process: world size 1, the plan, the merge, the shard helpers -----------------------------

def test_world_size_one_is_the_plain_call():
    """group=None without a process group, and a real group of one rank: the plain attention
    call, bit for bit, with its gradients."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 12, HQ, D, generator=g)
    k, v = torch.randn(B, 12, 2, D, generator=g), torch.randn(B, 12, 2, D, generator=g)
    want, want_lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)

    def run(fn, group=None):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = fn(qq, kk, vv, group, True, layout="zigzag", return_lse=True)
        (out.sum() + lse.sum()).backward()
        return out.detach(), lse.detach(), qq.grad, kk.grad

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o, l = flashcpp.flash_attn_func(qq, kk, vv, causal=True, return_lse=True)
    (o.sum() + l.sum()).backward()
    assert not dist.is_initialized()
    for fn in (fd.ring_attention, fd.allgather_attention):
        got = run(fn)
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
    (causal or full) mask between those rows, each pair once; zigzag steps are one call each and
    every step but the first does the same work on every rank (the balance)."""
    for world in range(1, 6):
        n = 8
        c = n // (2 if layout == "zigzag" else 1)
        pos = [fd.shard_positions(n, r, world, layout).numpy() for r in range(world)]
        for causal in (False, True):
            for r in range(world):
                work = []
                for s in range(world):
                    src = (r - s) % world
                    calls = fd._step_calls(fd._chunks(layout, r, world), fd._chunks(layout, src, world), c, causal)
                    got = _mask_of_calls(calls, n)
                    want = (pos[r][:, None] >= pos[src][None, :]) if causal else np.ones((n, n), bool)
                    assert np.array_equal(got, want.astype(np.int64)), (world, r, src, causal, calls)
                    if layout == "zigzag":
                        assert len(calls) <= 1, calls
                    work.append(int(got.sum()))
                if layout == "zigzag" and causal and world > 1:
                    assert len(set(work[1:])) == 1 and work[1] == n * n // 2, work


def test_merge_is_the_library_rule():
    g = torch.Generator().manual_seed(2)
    oa, ob = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    la, lb = torch.randn(3, 5, generator=g) * 4, torch.randn(3, 5, generator=g) * 4
    la[0, :2] = -math.inf
    lb[0, 1:3] = -math.inf
    ob[0, 1] = float("nan")  # an empty side's garbage never leaks
    want_o, want_l = flashcpp.merge_attention_states(oa, la, ob, lb)
    got_o, got_l = fd._merge(oa, la, ob, lb)
    assert torch.equal(got_l, want_l)
    torch.testing.assert_close(got_o, want_o, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_o[0, 1], torch.zeros(16)) and got_l[0, 1] == -math.inf


def test_shard_helpers():
    x = torch.arange(2 * 24).view(2, 24)
    for layout in fd.LAYOUTS:
        for world in (1, 2, 3, 4):
            shards = [fd.shard_sequence(x, r, world, layout) for r in range(world)]
            assert torch.equal(fd.unshard_sequence(shards, layout), x)
            for r in range(world):
                assert torch.equal(shards[r][0], fd.shard_positions(24 // world, r, world, layout))
    assert fd.zigzag_shard(x, 1, 3)[0].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert torch.equal(fd.zigzag_unshard([fd.zigzag_shard(x, r, 3, 1) for r in range(3)]), x)
    assert torch.equal(fd.unshard_sequence([fd.zigzag_shard(x.t(), r, 2, 0) for r in range(2)], dim=0), x.t())
    with pytest.raises(ValueError, match="divisible by 10"):
        fd.zigzag_shard(x, 0, 5)
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.shard_sequence(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank"):
        fd.shard_sequence(x, 2, 2)


def test_input_checks_without_a_group():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="must be even"):
        fd.ring_attention(q[:, :7], q[:, :7], q[:, :7], layout="zigzag")
    with pytest.raises(ValueError, match="q has 8 local rows but k and v have 6"):
        fd.ring_attention(q, q[:, :6], q[:, :6])
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        fd.allgather_attention(q[0], q[0], q[0], cu_seqlens=[0, 3, 7])
    with pytest.raises(TypeError, match="torch tensors"):
        fd.ring_attention(q.numpy(), q, q)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashcpp.WITH_CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_ring_plan_and_merge_in_one_process(device, layout, varlen):
    """The ring's forward without a process group: every rank's steps (the plan, the block calls,
    the merge) run here one after another on shards of one full sequence, against the single call.
    On a GPU this is the ring's forward on the CUDA kernels (bf16; the CUDA backward is not built
    yet); on the CPU in fp32."""
    world = 3
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    dim_rows = 0 if varlen else 1
    shape = (T_LOCAL * world,) if varlen else (B, N_LOCAL * world)
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
        for r in range(world):
            n = shape[0] // world if varlen else N_LOCAL
            sp = fd._Spec(None, r, world, layout, causal, 64 ** -0.5, 0.0, False, varlen, cu,
                          n // (2 if layout == "zigzag" else 1))
            shard = lambda x, rr, dim=dim_rows: fd.shard_sequence(x, rr, world, layout, dim)  # noqa: E731
            ql = shard(q, r)
            acc_o = torch.zeros(ql.shape, dtype=torch.float32, device=device)
            acc_l = torch.full(shard(want_lse, r, -1).shape, -math.inf, device=device)
            for s in range(world):
                src = (r - s) % world
                for call in sp.calls(src):
                    res = fd._block_forward(sp, ql, shard(k, src), shard(v, src), call, src)
                    if res is not None:
                        fd._merge_rows(acc_o, acc_l, res[0], res[1], call.q0, call.q1, varlen)
            outs.append(acc_o.to(dt))
            lses.append(acc_l)
        got = fd.unshard_sequence(outs, layout, dim_rows)
        got_lse = fd.unshard_sequence(lses, layout, -1)
        atol = 1e-5 if dt == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
