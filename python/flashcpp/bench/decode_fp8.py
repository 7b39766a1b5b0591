"""Decode over an fp8 e4m3 KV cache against the same step over a bf16 cache, on CUDA.

    python -m flashcpp.bench.decode_fp8 [--quick] [--out reports/decode]

Per shape (one query token per sequence, bf16 q and output, causal): the bf16 cache holds N(0, 1)
values; the fp8 cache holds their e4m3 codes at per-KV-head scales amax / 448 (torch's
float8_e4m3fn cast of x / scale, which rounds to nearest even; |x| / scale <= 448 by the choice of
scale, so nothing saturates). flashcpp runs both through the plan/run wrapper
(BatchDecodeWithKVCache, planned for the step's lengths), each captured in a CUDA graph and timed
interleaved with the other (medians of rounds, common.interleaved). FlashInfer's fp8 decode joins
as a peer where it imports (`flashinfer_fp8`, on the same codes viewed as pages of 16 keys).

Columns of fp8.csv (one row per shape): the shape, `ours_us` (fp8 cache), `bf16_us` (bf16 cache),
`speedup_vs_bf16` = bf16_us / ours_us (the issue's bar: >= 1.8 where decode is memory bound, that is
where the bf16 step moves >= 1 GB), `ours_tbps` (KV codes + q + o bytes / time), `bf16_tbps`,
`err_vs_ref` (max |O - fp32 attention over code * scale|: the kernel's own error, judged by
attn tolerance of bf16), `err_vs_bf16_cache` (max |O_fp8 - O_bf16|: what quantizing the cache
costs), and peer columns where a peer ran.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Tuple

from flashcpp.bench import common

# (batch, heads_q, heads_kv, context, head_dim, page_size)
SHAPES: List[Tuple[int, int, int, int, int, int]] = [
    (1, 32, 8, 32768, 128, 0),
    (1, 32, 8, 131072, 128, 0),
    (1, 32, 32, 8192, 128, 0),
    (8, 32, 8, 8192, 128, 0),
    (16, 32, 8, 8192, 128, 16),
    (32, 32, 8, 4096, 128, 64),
    (64, 32, 8, 2048, 128, 0),
    (4, 64, 8, 16384, 128, 16),
    (8, 16, 2, 32768, 64, 0),
    (8, 8, 1, 16384, 256, 0),
    (128, 32, 8, 1024, 128, 16),
]
QUICK = [0, 3, 4, 8]
# fp16 q over the same kinds of cache: the e4m3 -> fp16 conversion is one instruction per pair
# (bf16 goes through fp32), which tells the conversion's share of the step.
FP16_SHAPES = [0, 1, 3]


def _case_name(s: Tuple[int, int, int, int, int, int]) -> str:
    b, hq, hkv, n, d, ps = s
    return f"b{b}_h{hq}kv{hkv}_n{n}_d{d}" + (f"_paged{ps}" if ps else "")


def run_shape(torch, s, idx: int, rounds: int, rep_ms: int, dt=None) -> Dict[str, object]:
    from flashcpp.decode import BatchDecodeWithKVCache

    B, Hq, Hkv, N, D, ps = s
    dev = "cuda"
    dt = dt or torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(9100 + idx)
    shape = (B * N // ps, ps, Hkv, D) if ps else (B, N, Hkv, D)
    kc = torch.randn(shape, device=dev, dtype=dt, generator=g)
    vc = torch.randn(shape, device=dev, dtype=dt, generator=g)
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=dt, generator=g)
    # per-KV-head scales: amax / 448 over the head's values
    ks = (kc.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
    vs = (vc.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
    k8 = (kc.float() / ks[:, None]).to(torch.float8_e4m3fn)
    v8 = (vc.float() / vs[:, None]).to(torch.float8_e4m3fn)
    lens_host = torch.full((B,), N, dtype=torch.int32)
    lens = lens_host.to(dev)
    table = None
    if ps:
        table = torch.randperm(B * N // ps, generator=torch.Generator().manual_seed(idx)).to(dev, torch.int32)
        table = table.view(B, N // ps)
    o16, o8 = torch.empty_like(q), torch.empty_like(q)
    w16, w8 = BatchDecodeWithKVCache(), BatchDecodeWithKVCache()
    w16.plan(B, Hq, Hkv, D, kv_capacity=N, page_size=ps, cache_seqlens=lens_host, causal=True,
             dtype=dt, device=dev)
    w8.plan(B, Hq, Hkv, D, kv_capacity=N, page_size=ps, cache_seqlens=lens_host, causal=True,
            dtype=dt, device=dev, kv_dtype=torch.float8_e4m3fn)

    def ours16():
        return w16.run(q, kc, vc, lens, block_table=table, out=o16)

    def ours8():
        return w8.run(q, k8, v8, lens, block_table=table, out=o8, k_scale=ks, v_scale=vs)

    ours16()
    ours8()
    torch.cuda.synchronize()
    # fp32 reference over the dequantized cache (and the bf16 cache's own answer for context)
    kd = k8.float() * ks[:, None]
    vd = v8.float() * vs[:, None]
    if ps:
        kd = kd[table.flatten().long()].view(B, N, Hkv, D)
        vd = vd[table.flatten().long()].view(B, N, Hkv, D)
    qf = q.float().transpose(1, 2)
    rep = Hq // Hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf, kd.transpose(1, 2).repeat_interleave(rep, 1), vd.transpose(1, 2).repeat_interleave(rep, 1)).transpose(1, 2)
    del kd, vd
    if not torch.isfinite(o8).all():
        raise RuntimeError(f"[bench decode_fp8] {_case_name(s)}: NaN/Inf in the fp8 output")
    err = (o8.float() - ref).abs().max().item()
    err16 = (o8.float() - o16.float()).abs().max().item()
    fns = {"fp8": ours8, "bf16": ours16}
    notes = {}
    fi = _flashinfer_fp8(torch, q, k8, v8, ks, vs, table, B, Hq, Hkv, N, D, ps)
    if isinstance(fi, str):
        notes["flashinfer_fp8"] = fi
    else:
        fns["flashinfer_fp8"] = fi
    t = common.interleaved(fns, rounds=rounds, graph=True, rep_ms=rep_ms)
    kv8 = B * N * Hkv * D * 2
    qo = 2 * B * Hq * D * 2
    row: Dict[str, object] = {
        "case": _case_name(s) + ("" if dt == torch.bfloat16 else "_fp16"), "batch": B, "heads_q": Hq, "heads_kv": Hkv, "seqlen_k": N, "head_dim": D,
        "page_size": ps, "dtype": "bf16" if dt == torch.bfloat16 else "fp16", "kv_dtype": "fp8_e4m3",
        "ours_us": round(t["fp8"], 2), "bf16_us": round(t["bf16"], 2),
        "speedup_vs_bf16": round(t["bf16"] / t["fp8"], 3),
        "bf16_kv_gb": round(2 * kv8 / 1e9, 3),
        "ours_tbps": round((kv8 + qo) / (t["fp8"] * 1e-6) / 1e12, 3),
        "bf16_tbps": round((2 * kv8 + qo) / (t["bf16"] * 1e-6) / 1e12, 3),
        "err_vs_ref": f"{err:.3e}", "err_vs_bf16_cache": f"{err16:.3e}",
    }
    if "flashinfer_fp8" in t:
        row["flashinfer_fp8_us"] = round(t["flashinfer_fp8"], 2)
        row["speedup_vs_flashinfer_fp8"] = round(t["flashinfer_fp8"] / t["fp8"], 3)
    for k, v in notes.items():
        row[k + "_note"] = v
    return row


def _flashinfer_fp8(torch, q, k8, v8, ks, vs, table, B, Hq, Hkv, N, D, ps):
    """FlashInfer's paged decode over the fp8 codes (scales as per-tensor floats: it takes one scale
    per tensor, so only shapes whose heads share a scale would compare exactly; the timing is what
    this column is for), or the reason it cannot run."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # not installed here: said so in the row
        return f"not importable: {type(e).__name__}: {str(e)[:80]}"
    try:
        page = ps or 16
        kp = k8.view(-1, page, Hkv, D)
        vp = v8.view(-1, page, Hkv, D)
        pages_per = N // page
        if table is None:
            indices = torch.arange(B * pages_per, device="cuda", dtype=torch.int32)
        else:
            indices = table.flatten()
        indptr = torch.arange(0, B * pages_per + 1, pages_per, device="cuda", dtype=torch.int32)
        last = torch.full((B,), page, device="cuda", dtype=torch.int32)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=False)
        w.plan(indptr, indices, last, Hq, Hkv, D, page, q_data_type=q.dtype,
               kv_data_type=torch.float8_e4m3fn)
        q2 = q.view(B, Hq, D)
        kscale, vscale = float(ks.mean()), float(vs.mean())

        def f():
            return w.run(q2, (kp, vp), k_scale=kscale, v_scale=vscale)
        f()
        return f
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.decode_fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} of the {len(SHAPES)} shapes")
    ap.add_argument("--out", default="reports/decode", help="report folder (default reports/decode)")
    a = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("[bench decode_fp8] needs PyTorch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("[bench decode_fp8] needs a CUDA device: nothing timed", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    env = common.environment()
    shapes = [(SHAPES[i], torch.bfloat16) for i in QUICK] if a.quick else [(x, torch.bfloat16) for x in SHAPES]
    if not a.quick:
        shapes += [(SHAPES[i], torch.float16) for i in FP16_SHAPES]
    rows = []
    for i, (s, dt) in enumerate(shapes):
        r = run_shape(torch, s, i, rounds=3, rep_ms=common.rep_ms_for(a.quick), dt=dt)
        r["gpu"] = env.get("gpu", "")
        r["git_commit"] = env.get("git_commit", "")
        rows.append(r)
        print(f"[bench decode_fp8] {r['case']:<32} fp8 {r['ours_us']:>9.2f} us  bf16 {r['bf16_us']:>9.2f} us  "
              f"x{r['speedup_vs_bf16']:.2f}  {r['ours_tbps']:.2f} TB/s  err {r['err_vs_ref']}", flush=True)
        torch.cuda.empty_cache()
    common.write_csv(os.path.join(a.out, "fp8.csv"), rows)
    mem = [r for r in rows if float(r["bf16_kv_gb"]) >= 1.0]
    if mem:
        worst = min(mem, key=lambda r: r["speedup_vs_bf16"])
        print(f"[bench decode_fp8] memory-bound shapes (bf16 KV >= 1 GB): min fp8/bf16 speedup "
              f"{worst['speedup_vs_bf16']:.2f}x at {worst['case']} (bar 1.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
