"""Context parallelism (flashcpp.distributed) on one GPU: exactness, and what world size 1 costs.

    python -m flashcpp.bench.cp [--out reports/cp] [--quick]

Needs one NVIDIA GPU and a flashcpp build with CUDA; no network, no second GPU. About a minute
on an H200 (--quick: about 20 s). Exit status 0 when every check passes.

Checks (exactness.csv):
  ws1_*      ring_attention and allgather_attention at world size 1, with group=None and with a
             one-rank NCCL process group, against flash_attn_func / flash_attn_varlen_func on the
             same tensors: bit for bit (world size 1 is the plain call).
  sim_*      the ring's algorithm on the CUDA kernels: W = 2, 4, 8 ranks simulated in this process,
             each rank's steps (its plan, the block calls with return_lse, the merges by
             merge_attention_states' CUDA kernel) over shards cut from one sequence, every layout,
             causal and not, dense and varlen, bf16; the unsharded output and LSE against the single
             call: max |err| <= 4e-3 + 1.6e-2 max |ref| (the CPU tests' bf16 band), LSE <= 1e-3 +
             1e-5 max |ref|. No communication: NCCL, the overlap and scaling need several GPUs.
Timing (ws1_overhead.csv), bf16: flash_attn_func against ring_attention and allgather_attention at
world size 1 (no group), medians of CUDA-event timings after warm-up, in interleaved rounds:
  *_us           back to back: one event pair around `iters` calls (what a training step sees: the
                 host enqueues ahead, so Python costs nothing until the kernel is shorter than it)
  *_latency_us   one call at a time: synchronize, event, call, event (Python and launch included)
  overhead_pct   ring_us / plain_us - 1; the bar of the issue is <= 2% (meets_bar)
Also sim_compute.csv: one simulated rank's compute for a W-way ring (zigzag and stripe, causal; no
communication) against the single call's time / W: the cost of cutting the problem into blocks
and merging, the floor of what a W-GPU ring can scale to.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from typing import Callable, Dict, List

BF16_BAND = (4e-3, 1.6e-2)
LSE_BAND = (1e-3, 1e-5)
OVERHEAD_BAR_PCT = 2.0


def _medians(torch, fns: Dict[str, Callable[[], object]], rounds: int, target_ms: float) -> Dict[str, Dict[str, float]]:
    """Per implementation: back-to-back us per call and one-call latency us (medians over rounds,
    the implementations interleaved, the order reversed every other round)."""
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    # warm-up (first-call costs, allocator) and the number of calls per timing
    per_call = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        a, b = ev(), ev()
        a.record()
        for _ in range(5):
            fn()
        b.record()
        b.synchronize()
        per_call[name] = a.elapsed_time(b) / 5
    iters = max(3, min(2000, int(target_ms / max(min(per_call.values()), 1e-3))))
    stream: Dict[str, List[float]] = {k: [] for k in fns}
    latency: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn = fns[name]
            a, b = ev(), ev()
            torch.cuda.synchronize()
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            stream[name].append(1e3 * a.elapsed_time(b) / iters)
            lat = []
            for _ in range(5):
                torch.cuda.synchronize()
                a, b = ev(), ev()
                a.record()
                fn()
                b.record()
                b.synchronize()
                lat.append(1e3 * a.elapsed_time(b))
            latency[name].append(min(lat))
    return {k: {"us": statistics.median(stream[k]), "latency_us": statistics.median(latency[k]), "iters": iters}
            for k in fns}


def _max_err(torch, got, ref):
    got, ref = got.double(), ref.double()
    finite = torch.isfinite(ref)
    same_nonfinite = bool(torch.equal(torch.isfinite(got), finite))
    err = float((got - ref)[finite].abs().max()) if finite.any() else 0.0
    return err, float(ref[finite].abs().max()) if finite.any() else 0.0, same_nonfinite


def _documents(np, rng, total, docs):
    cuts = np.sort(rng.choice(np.arange(1, total), size=docs - 1, replace=False))
    return np.concatenate(([0], cuts, [total])).astype(np.int64)


def _ws1_checks(torch, np, flashcpp, fd, rows: List[dict]) -> None:
    import torch.distributed as dist
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 2048, 16, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 2048, 4, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 2048, 4, 128, device=dev, dtype=torch.bfloat16, generator=g)
    cu = _documents(np, np.random.default_rng(0), 4096, 5)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    mx = int(np.diff(cu).max())
    qv, kv, vv = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))

    def check(label: str, group) -> None:
        for causal in (False, True):
            want = flashcpp.flash_attn_func(q, k, v, causal=causal, return_lse=True)
            want_v = flashcpp.flash_attn_varlen_func(qv, kv, vv, cu_t, cu_t, mx, mx, causal=causal, return_lse=True)
            for fn_name, fn in (("ring", fd.ring_attention), ("allgather", fd.allgather_attention)):
                for layout in fd.LAYOUTS:
                    got = fn(q, k, v, group, causal, layout=layout, return_lse=True)
                    # a host list (planned on the host, as the ring does) and the device tensor with max_seqlen
                    got_v = fn(qv, kv, vv, group, causal, layout=layout, cu_seqlens=cu.tolist(), return_lse=True)
                    got_d = fn(qv, kv, vv, group, causal, layout=layout, cu_seqlens=cu_t, max_seqlen=mx,
                               return_lse=True)
                    for varlen, a, b in ((False, got, want), (True, got_v, want_v), (True, got_d, want_v)):
                        same = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
                        rows.append(dict(check=f"ws1_{label}_{fn_name}", world=1, layout=layout, causal=causal,
                                         varlen=varlen, dtype="bfloat16", shape=list(q.shape),
                                         max_err_out=0.0 if same else _max_err(torch, a[0], b[0])[0],
                                         max_err_lse=0.0 if same else _max_err(torch, a[1], b[1])[0],
                                         bitwise=same, passed=same))

    check("nogroup", None)
    if dist.is_available() and dist.is_nccl_available():
        with tempfile.TemporaryDirectory() as d:
            dist.init_process_group("nccl", init_method=f"file://{d}/rdzv", rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
            try:
                check("nccl1", dist.group.WORLD)
            finally:
                dist.destroy_process_group()
    else:
        rows.append(dict(check="ws1_nccl1", passed=True, note="NCCL not available in this torch: not run"))


def _cut(fd, x, world: int, layout: str, dim: int):
    """Every rank's shard of x (contiguous tensors)."""
    return [fd.shard_sequence(x, r, world, layout, dim).contiguous() for r in range(world)]


def _simulate_rank(fd, r: int, qs, ks, vs, cu, world: int, layout: str, causal: bool):
    """Rank r's ring forward in this process, the visiting shards taken from ks, vs (no
    communication): (out, lse) of its rows."""
    varlen = cu is not None
    n = qs[r].shape[0 if varlen else 1]
    sp = fd._Spec(None, r, world, layout, causal, qs[r].shape[-1] ** -0.5, 0.0, False, cu, n)
    steps = ((s, ks[(r - s) % world], vs[(r - s) % world]) for s in range(world))
    return fd._attend(sp, qs[r], vs[r].shape[-1], steps)


def _simulate(fd, q, k, v, cu, world: int, layout: str, causal: bool):
    """Every rank's ring forward in this process: the unsharded (out, lse)."""
    dim = 0 if cu is not None else 1
    qs, ks, vs = (_cut(fd, x, world, layout, dim) for x in (q, k, v))
    res = [_simulate_rank(fd, r, qs, ks, vs, cu, world, layout, causal) for r in range(world)]
    return fd.unshard_sequence([o for o, _ in res], layout, dim), fd.unshard_sequence([l for _, l in res], layout, -1)


def _sim_checks(torch, np, flashcpp, fd, rows: List[dict], quick: bool) -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    b, s, hq, hkv, d = 2, 4096, 16, 4, 128
    q = torch.randn(b, s, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    qv, kv, vv = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
    cu = _documents(np, np.random.default_rng(1), b * s, 9)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    mx = int(np.diff(cu).max())
    for world in ((2, 8) if quick else (2, 4, 8)):
        for layout in fd.LAYOUTS:
            for causal in (False, True):
                for varlen in (False, True):
                    if varlen:
                        want = flashcpp.flash_attn_varlen_func(qv, kv, vv, cu_t, cu_t, mx, mx, causal=causal,
                                                               return_lse=True)
                        got = _simulate(fd, qv, kv, vv, cu, world, layout, causal)
                    else:
                        want = flashcpp.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                        got = _simulate(fd, q, k, v, None, world, layout, causal)
                    eo, so, fo = _max_err(torch, got[0], want[0])
                    el, sl, fl = _max_err(torch, got[1], want[1])
                    ok = (eo <= BF16_BAND[0] + BF16_BAND[1] * so and el <= LSE_BAND[0] + LSE_BAND[1] * sl
                          and fo and fl and got[0].dtype == want[0].dtype)
                    rows.append(dict(check="sim_ring_forward", world=world, layout=layout, causal=causal,
                                     varlen=varlen, dtype="bfloat16", shape=list(qv.shape if varlen else q.shape),
                                     max_err_out=eo, max_ref_out=so, max_err_lse=el, max_ref_lse=sl,
                                     tolerance=f"out {BF16_BAND[0]} + {BF16_BAND[1]} max|ref|; lse {LSE_BAND[0]} + "
                                               f"{LSE_BAND[1]} max|ref|", bitwise=False, passed=bool(ok)))


def _shapes(quick: bool):
    # (name, batch, seqlen, heads_q, heads_kv, head_dim, causal, varlen documents or 0)
    out = [("llama8b_4k_causal", 1, 4096, 32, 8, 128, True, 0),
           ("mha_16k_causal", 1, 16384, 32, 32, 128, True, 0),
           ("batch8_1k_noncausal", 8, 1024, 32, 32, 128, False, 0),
           ("small_1k_hd64_causal", 1, 1024, 8, 8, 64, True, 0),
           ("varlen_16k_8docs_causal", 1, 16384, 32, 8, 128, True, 8)]
    if not quick:
        out += [("gqa_32k_causal", 1, 32768, 32, 8, 128, True, 0),
                ("batch4_8k_causal", 4, 8192, 32, 8, 128, True, 0)]
    return out


def _ws1_timing(torch, np, flashcpp, fd, quick: bool) -> List[dict]:
    dev = "cuda"
    rows = []
    for name, b, s, hq, hkv, d, causal, docs in _shapes(quick):
        g = torch.Generator(device=dev).manual_seed(2)
        q = torch.randn(b, s, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        if docs:
            q, k, v = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
            cu = _documents(np, np.random.default_rng(2), b * s, docs)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            mx = int(np.diff(cu).max())
            fns = {"plain": lambda: flashcpp.flash_attn_varlen_func(q, k, v, cu_t, cu_t, mx, mx, causal=causal),
                   "ring": lambda: fd.ring_attention(q, k, v, None, causal, cu_seqlens=cu_t, max_seqlen=mx),
                   "allgather": lambda: fd.allgather_attention(q, k, v, None, causal, cu_seqlens=cu_t,
                                                               max_seqlen=mx)}
        else:
            fns = {"plain": lambda: flashcpp.flash_attn_func(q, k, v, causal=causal),
                   "ring": lambda: fd.ring_attention(q, k, v, None, causal),
                   "allgather": lambda: fd.allgather_attention(q, k, v, None, causal)}
        t = _medians(torch, fns, rounds=5 if quick else 11, target_ms=10 if quick else 25)
        p = t["plain"]
        row = dict(case=name, batch=b, seqlen=s, heads_q=hq, heads_kv=hkv, head_dim=d, causal=causal,
                   varlen_docs=docs, dtype="bfloat16", iters=p["iters"], plain_us=round(p["us"], 2))
        for impl in ("ring", "allgather"):
            row[f"{impl}_us"] = round(t[impl]["us"], 2)
            row[f"{impl}_overhead_pct"] = round(100 * (t[impl]["us"] / p["us"] - 1), 2)
        row["plain_latency_us"] = round(p["latency_us"], 2)
        for impl in ("ring", "allgather"):
            row[f"{impl}_latency_us"] = round(t[impl]["latency_us"], 2)
        row["meets_bar"] = "yes" if max(row["ring_overhead_pct"], row["allgather_overhead_pct"]) <= \
            OVERHEAD_BAR_PCT else "no"
        rows.append(row)
        print(f"  {name}: plain {row['plain_us']:.1f} us, ring {row['ring_us']:.1f} us "
              f"({row['ring_overhead_pct']:+.2f}%), allgather {row['allgather_us']:.1f} us "
              f"({row['allgather_overhead_pct']:+.2f}%); one call: plain {row['plain_latency_us']:.1f} us, "
              f"ring {row['ring_latency_us']:.1f} us", flush=True)
    return rows


def _sim_timing(torch, np, flashcpp, fd, quick: bool) -> List[dict]:
    """One rank's compute of a W-way causal ring, zigzag and stripe (no communication), against
    1/W of the single call: rank 0 and rank W-1 (both layouts give every rank about the same work,
    so both should be near the single call / W plus the cost of the blocks and merges)."""
    dev = "cuda"
    rows = []
    b, s, hq, hkv, d = 1, 32768, 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(b, s, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    for world in ((4,) if quick else (2, 4, 8)):
        for layout in ("zigzag", "stripe"):
            qs, ks, vs = (_cut(fd, x, world, layout, 1) for x in (q, k, v))
            fns = {"single": lambda: flashcpp.flash_attn_func(q, k, v, causal=True)}
            for r in (0, world - 1):
                fns[f"rank{r}"] = (lambda r=r, qs=qs, ks=ks, vs=vs, world=world, layout=layout:
                                   _simulate_rank(fd, r, qs, ks, vs, None, world, layout, True))
            t = _medians(torch, fns, rounds=3 if quick else 5, target_ms=20)
            single = t["single"]["us"]
            for r in (0, world - 1):
                us = t[f"rank{r}"]["us"]
                rows.append(dict(case=f"{layout}_causal", world=world, rank=r, batch=b, seqlen=s, heads_q=hq,
                                 heads_kv=hkv, head_dim=d, single_us=round(single, 1),
                                 single_over_world_us=round(single / world, 1), rank_compute_us=round(us, 1),
                                 efficiency=round(single / world / us, 3)))
                print(f"  W={world} {layout} rank {r}: {us:.0f} us of compute vs single/W {single / world:.0f} us "
                      f"(efficiency {single / world / us:.2f})", flush=True)
    return rows


def run(out: str, quick: bool) -> int:
    import numpy as np
    import torch

    import flashcpp
    import flashcpp.distributed as fd
    from .common import environment, write_csv, write_json

    os.makedirs(out, exist_ok=True)
    env = environment()
    env["flashcpp_git_commit"] = flashcpp.GIT_COMMIT
    env["date"] = datetime.date.today().isoformat()
    env["quick"] = quick
    print(f"flashcpp.bench.cp on {env['gpu']} (flashcpp {flashcpp.GIT_COMMIT}, torch {env['torch']})", flush=True)
    checks: List[dict] = []
    print("checks: world size 1 (bit for bit)", flush=True)
    _ws1_checks(torch, np, flashcpp, fd, checks)
    print("checks: the ring simulated on the CUDA kernels (bf16 band)", flush=True)
    _sim_checks(torch, np, flashcpp, fd, checks, quick)
    failed = [c for c in checks if not c["passed"]]
    for c in failed:
        print(f"  FAILED: {c}", flush=True)
    worst = max((c["max_err_out"] / max(c["max_ref_out"], 1e-30) for c in checks if "max_ref_out" in c), default=0)
    print(f"  {len(checks) - len(failed)} of {len(checks)} checks passed; the simulated ring's worst output error "
          f"{worst:.2e} of max |ref|", flush=True)
    write_csv(os.path.join(out, "exactness.csv"), [dict(c, git_commit=flashcpp.GIT_COMMIT, date=env["date"])
                                                   for c in checks])
    print("timing: world size 1 against the plain call (bf16)", flush=True)
    timing = _ws1_timing(torch, np, flashcpp, fd, quick)
    write_csv(os.path.join(out, "ws1_overhead.csv"), [dict(r, git_commit=flashcpp.GIT_COMMIT, date=env["date"])
                                                      for r in timing])
    print("timing: one simulated rank's compute (no communication)", flush=True)
    sim = _sim_timing(torch, np, flashcpp, fd, quick)
    write_csv(os.path.join(out, "sim_compute.csv"), [dict(r, git_commit=flashcpp.GIT_COMMIT, date=env["date"])
                                                     for r in sim])
    env["checks_passed"] = len(checks) - len(failed)
    env["checks"] = len(checks)
    env["overhead_bar_met"] = all(r["meets_bar"] == "yes" for r in timing)
    write_json(os.path.join(out, "environment.json"), env)
    over = ", ".join(f"{r['case']} {r['ring_overhead_pct']:+.2f}%" for r in timing)
    print(f"cp: {'PASS' if not failed else 'FAIL'} | checks {len(checks) - len(failed)}/{len(checks)} | "
          f"ring world size 1 overhead: {over} | written to {out}", flush=True)
    return 0 if not failed else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.cp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="reports/cp", help="folder for the CSVs and environment.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, worlds and rounds (about 20 s)")
    args = ap.parse_args(argv)
    from .__main__ import _no_gpu_reason
    reason = _no_gpu_reason()
    if reason is not None:
        print(f"python -m flashcpp.bench.cp: {reason}.", file=sys.stderr)
        return 2
    return run(os.path.abspath(args.out), args.quick)


if __name__ == "__main__":
    sys.exit(main())
