"""Decode A/B probe on CUDA: shapes x cache kinds x plan options, timed as the decode grid times
(CUDA graph of calls, replays interleaved across variants, median per call).

    python scripts/decode_probe.py --shape B,HQ,HKV,N,D,PS [--shape ...] [--kinds bf16,fp8]
                                   [--fused-merge 0,1] [--splits 0,1,4] [--reps 15] [--out FILE]

Prints one line per (shape, kind, option) with the plan it ran and its time and bandwidth (KV
bytes / time), and writes them as CSV to --out. --splits: forced split counts per sequence (0 = the
planner's heuristic), each a variant.
"""
import argparse
import csv
import statistics

import torch

from flashcpp.decode import BatchDecodeWithKVCache
from flashcpp.bench.common import cuda_graph_of as graph_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", required=True)
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--fused-merge", default="0")
    ap.add_argument("--splits", default="0")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for sh in a.shape:
        B, Hq, Hkv, N, D, ps = (int(x) for x in sh.split(","))
        g = torch.Generator(device="cuda").manual_seed(1)
        shape = (B * N // ps, ps, Hkv, D) if ps else (B, N, Hkv, D)
        kc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        ks = (kc.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
        vs = (vc.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
        k8 = (kc.float() / ks[:, None]).to(torch.float8_e4m3fn)
        v8 = (vc.float() / vs[:, None]).to(torch.float8_e4m3fn)
        lens_host = torch.full((B,), N, dtype=torch.int32)
        lens = lens_host.cuda()
        table = torch.randperm(B * N // ps).cuda().int().view(B, N // ps) if ps else None
        variants = {}
        for kind in a.kinds.split(","):
            for fm, sp in [(f, x) for f in a.fused_merge.split(",") for x in a.splits.split(",")]:
                w = BatchDecodeWithKVCache()
                extra = {"kv_dtype": torch.float8_e4m3fn} if kind == "fp8" else {}
                w.plan(B, Hq, Hkv, D, kv_capacity=N, page_size=ps, cache_seqlens=lens_host, causal=True,
                       dtype=torch.bfloat16, device="cuda", num_splits=int(sp), fused_merge=fm == "1", **extra)
                out = torch.empty_like(q)
                if kind == "fp8":
                    fn = (lambda w=w, out=out: w.run(q, k8, v8, lens, block_table=table, out=out, k_scale=ks,
                                                     v_scale=vs))
                else:
                    fn = lambda w=w, out=out: w.run(q, kc, vc, lens, block_table=table, out=out)
                variants[(kind, fm, sp)] = (w, fn)
        # calls per replay: about 300 us of work (one eager call to size it)
        graphs, calls = {}, {}
        for key, (w, fn) in variants.items():
            fn()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                fn()
            e1.record()
            e1.synchronize()
            per = max(e0.elapsed_time(e1) * 1e3 / 5, 1.0)
            calls[key] = max(2, min(200, int(300 / per)))
            graphs[key] = graph_of(fn, calls[key])
            graphs[key].replay()
        torch.cuda.synchronize()
        times = {k: [] for k in graphs}
        keys = list(graphs)
        for rep in range(a.reps):
            for i in range(len(keys)):
                k = keys[(i + rep) % len(keys)]
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graphs[k].replay()
                e1.record()
                e1.synchronize()
                times[k].append(e0.elapsed_time(e1) * 1e3 / calls[k])
        for k in keys:
            w = variants[k][0]
            info = w.plan_info
            us = statistics.median(times[k])
            kvb = B * N * Hkv * D * 2 * (1 if k[0] == "fp8" else 2)
            row = {"shape": sh, "kind": k[0], "fused_merge": k[1], "forced_splits": k[2], "us": round(us, 2),
                   "tbps": round(kvb / us / 1e6, 3), "ctas": info.ctas, "per_sm": getattr(info, "ctas_per_sm", 0), "splits": info.max_splits,
                   "merge": int(info.needs_merge), "fm": int(info.fused_merge)}
            rows.append(row)
            print(" ".join(f"{a_}={b_}" for a_, b_ in row.items()), flush=True)
        del graphs, variants
    if a.out:
        with open(a.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
