"""Prefill A/B probe on CUDA: shapes x sm90 configs x run-time variants, in one process.

    python scripts/prefill_probe.py --shape B,H,N,D[,HKV][,vDV][,c] [--shape ...]
                                    [--configs auto,sm90_m128n128s2p,...] [--env VAR=v1,v2]
                                    [--reps 15] [--out FILE]

Each (config, variant) becomes a CUDA graph of calls (about 2 ms of work); the graphs' replays are
interleaved over --reps rounds and each variant's median time per call is reported with its TFLOP/s
(causal counts half the score matrix, bottom-right aligned; vDV: v and o head dim DV). --env names an environment variable
the library reads at dispatch (a kernel-parameter switch baked into the graph when it is captured)
and the values to capture under. Every variant's output is compared with the first one's: the
largest absolute difference is printed, so a variant that changes results shows it.
"""
import argparse
import csv
import os
import statistics

import torch

from flashcpp.attention import attention
from flashcpp.bench.common import cuda_graph_of as graph_of, interleaved


def flops(B, H, N, D, DV, causal):
    pairs = N * (N + 1) / 2 if causal else N * N
    return 2.0 * B * H * pairs * (D + DV)


def replay_times(variants, reps):
    """us per call of each variant's graph: 2 warm-up replays, then reps interleaved replays."""
    times = {key: [] for key in variants}
    for _ in range(2):
        for gr, _, _, _ in variants.values():
            gr.replay()
    torch.cuda.synchronize()
    for _ in range(reps):
        for key, (gr, calls, _, _) in variants.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            gr.replay()
            e1.record()
            e1.synchronize()
            times[key].append(e0.elapsed_time(e1) * 1000 / calls)
    return times


def bench_times(variants, env_name, reps):
    """us per call as the prefill bench times (interleaved do_bench_cudagraph rounds of 25 ms); the
    environment variable is set inside each call, so every capture the harness makes sees its value."""
    def setting(value, fn):
        def run():
            if env_name:
                os.environ[env_name] = value
            fn()
        return run
    fns = {key: setting(key[1], v[3]) for key, v in variants.items()}
    med = interleaved(fns, rounds=reps, graph=True, rep_ms=25)
    if env_name:
        os.environ.pop(env_name, None)
    return {key: [med[key]] for key in variants}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", required=True)
    ap.add_argument("--configs", default="auto")
    ap.add_argument("--env", default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--harness", choices=["graph", "bench"], default="graph",
                    help="graph: this probe's replays; bench: the prefill bench's own timing "
                         "(flashcpp.bench.common.interleaved, triton's do_bench_cudagraph, 25 ms "
                         "a round, --reps rounds), to tell a harness effect from a kernel one")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    env_name, env_vals = (a.env.split("=", 1)[0], a.env.split("=", 1)[1].split(",")) if a.env else (None, [None])
    rows = []
    for sh in a.shape:
        parts = sh.split(",")
        causal = parts[-1] == "c"
        dvs = [int(x[1:]) for x in parts if x.startswith("v")]
        nums = [int(x) for x in parts if x != "c" and not x.startswith("v")]
        B, H, N, D = nums[:4]
        HKV = nums[4] if len(nums) > 4 else H
        DV = dvs[0] if dvs else D
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, N, HKV, DV, device="cuda", dtype=torch.bfloat16, generator=g)
        variants = {}
        for cfg in a.configs.split(","):
            for ev in env_vals:
                if env_name:
                    os.environ[env_name] = ev
                out = torch.full((B, N, H, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
                fn = (lambda out=out, cfg=cfg: attention(q, k, v, out=out, causal=causal, backend="cuda",
                                                         cuda_config="" if cfg == "auto" else cfg))
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # a config that does not take the shape
                    print(f"{sh} {cfg} {ev}: skipped ({str(e)[:90]})")
                    continue
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(5):
                    fn()
                e1.record()
                torch.cuda.synchronize()
                calls = max(2, min(200, int(2000 / max(1.0, e0.elapsed_time(e1) * 1000 / 5))))
                variants[(cfg, ev)] = (graph_of(fn, calls), calls, out, fn)
        if env_name:
            os.environ.pop(env_name, None)
        times = bench_times(variants, env_name, a.reps) if a.harness == "bench" else replay_times(variants, a.reps)
        ref = None
        for key, (_, calls, out, _) in variants.items():
            us = statistics.median(times[key])
            diff = 0.0 if ref is None else (out.float() - ref.float()).abs().max().item()
            if ref is None:
                ref = out
            nan = bool(torch.isnan(out).any())
            tf = flops(B, H, N, D, DV, causal) / us / 1e6
            rows.append(dict(shape=sh, config=key[0], variant=key[1], us=round(us, 2), tflops=round(tf, 1),
                             max_diff=diff, nan=nan))
            print(f"{sh:22} {key[0]:28} {str(key[1]):4} {us:9.2f} us {tf:7.1f} TFLOP/s  diff {diff:.3g}"
                  f"{'  NaN!' if nan else ''}", flush=True)
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
