"""Prefill attention: flashcpp vs FlashAttention-4 (flash_attn.cute, when it imports) and torch SDPA's
FLASH (FA2), CUDNN and EFFICIENT backends, one process (and flashinfer's ragged prefill with
FLASHCPP_BENCH_FLASHINFER=1, when it imports). FA4 is the strongest peer on Hopper: the bar.

Two timings per implementation, both medians of interleaved rounds: `*_us` replays each call from
a CUDA graph (kernel time: launch and Python overhead removed for everyone alike), `*_eager_us`
calls it from Python with triton's do_bench (L2 flushed between runs: what an eager user sees).

TFLOP/s = 4*B*H*Nq*Nk*D / time, halved for causal (DESIGN.md; H = query heads). Every implementation
reads the same (B, N, H, D) bf16/fp16 tensors (K/V with fewer heads for GQA); SDPA gets the (B, H, N, D)
view of them through strides (enable_gqa for GQA). A peer that does not import, refuses a shape or
computes something else (max |diff| vs SDPA over 0.05) is reported on the progress lines and left out
of that row, never timed silently.
"""
from __future__ import annotations

import os
from typing import Dict, List

from .common import (bench_graph_us, ceilings, environment, fa4, grouped_bars, interleaved, peer_value, progress,
                     rep_ms_for, write_csv, write_json)

SHAPES = [  # batch, heads (query), seqlen, head_dim[, KV heads: GQA]
    (1, 8, 512, 64), (1, 8, 2048, 64), (2, 16, 4096, 64), (2, 16, 16384, 64),
    (4, 32, 4096, 128), (1, 8, 8192, 128), (1, 16, 16384, 128), (1, 16, 4096, 256),
    # short and batched prefill, and GQA 64/8: the shapes of the FA4 bar (issue [fa4])
    (16, 32, 512, 128), (8, 16, 1024, 128), (1, 64, 8192, 128, 8),
]
QUICK = [(2, 16, 4096, 64), (4, 32, 4096, 128)]
# The head dims of issue [headdims] (Phi-3's 96, Phi-2's 80, small models' 32, DeepSeek's 192/128):
# batch, heads, seqlen, head_dim, KV heads, head_dim_v. `python -m flashcpp.bench headdims`.
HEADDIM_SHAPES = [(2, 16, 4096, 96, 16, 96), (2, 16, 4096, 80, 16, 80), (2, 16, 4096, 32, 16, 32),
                  (1, 16, 4096, 192, 16, 128), (4, 32, 4096, 128, 32, 128)]


def _kv_heads(shape) -> int:
    return shape[4] if len(shape) > 4 else shape[1]


def _dim_v(shape) -> int:
    return shape[5] if len(shape) > 5 else shape[3]


def _flops(b, h, n, d, causal, dv=None):
    f = 2.0 * b * h * n * n * (d + (d if dv is None else dv))
    return f / 2 if causal else f


def _flashinfer():
    """flashinfer, if FLASHCPP_BENCH_FLASHINFER=1 and it imports here (a wheel carried to the GPU
    machine), else (None, why). Opt-in: flashinfer JIT-compiles each (dtype, head_dim, mask) kernel
    with nvcc at first use, minutes of GPU-machine time on a fresh machine."""
    if os.environ.get("FLASHCPP_BENCH_FLASHINFER") != "1":
        return None, "FLASHCPP_BENCH_FLASHINFER is not 1"
    try:
        import flashinfer
        return flashinfer, ""
    except Exception as e:  # ImportError, or a build for another torch / CUDA
        return None, f"{type(e).__name__}: {str(e)[:100]}"


def _flashinfer_prefill(torch, fi, q, k, v, causal):
    """flashinfer's ragged prefill wrapper on the same (B, N, H, D) tensors, viewed as B*N packed rows
    (equal lengths): planned once here, so the returned call only launches (graph-capturable).
    Returns (B, N, H, D) like flash_attn_func."""
    b, n, h, d = q.shape
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    indptr = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
    w.plan(indptr, indptr, h, h, d, causal=causal, q_data_type=q.dtype, kv_data_type=q.dtype)
    qf, kf, vf = (x.reshape(b * n, h, d) for x in (q, k, v))
    return lambda: w.run(qf, kf, vf).view(b, n, h, d)


def run(quick: bool, out: str, shapes=None, area_reports: bool = True) -> int:
    """The bench over `shapes` (default SHAPES, or QUICK with quick). area_reports: also write the
    reports/prefill and reports/hopper views (the default shapes only)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcpp

    os.makedirs(out, exist_ok=True)
    env = environment()
    env.update(ceilings())
    rep_ms = rep_ms_for(quick)
    env["timing"] = f"cuda_graph_median and eager median, rep {rep_ms} ms, 2 interleaved rounds"
    progress(f"[bench prefill] {env}")
    rows: List[Dict[str, object]] = []
    peers = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION,
             "torch_efficient": SDPBackend.EFFICIENT_ATTENTION}
    fi, fi_why = _flashinfer()
    progress("[bench prefill] flashinfer: " + (f"version {getattr(fi, '__version__', '?')}" if fi else f"not used ({fi_why})"))
    env["flashinfer"] = getattr(fi, "__version__", "?") if fi else f"not available: {fi_why}"
    fa4_fn, fa4_ver = fa4()
    progress("[bench prefill] fa4: " + (f"flash-attn-4 {fa4_ver}" if fa4_fn else f"does not import, not timed ({fa4_ver})"))
    env["fa4"] = fa4_ver if fa4_fn else f"not available: {fa4_ver}"
    peer_names = (["fa4"] if fa4_fn else []) + list(peers) + (["flashinfer"] if fi else [])
    # bf16 on every shape; fp16 on the QUICK shapes (same kernels, other mma type)
    cases = [(s, c, torch.bfloat16) for s in (shapes or (QUICK if quick else SHAPES)) for c in (False, True)]
    if not quick and shapes is None:
        cases += [(s, c, torch.float16) for s in QUICK for c in (False, True)]
    for idx, (shape, causal, dtype) in enumerate(cases):
        b, h, n, d = shape[:4]
        hkv, dv = _kv_heads(shape), _dim_v(shape)
        g = torch.Generator(device="cuda").manual_seed(1000 + idx)
        q = torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(b, n, hkv, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(b, n, hkv, dv, device="cuda", dtype=dtype, generator=g)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gqa = {"enable_gqa": True} if hkv != h else {}
        o_sm80 = torch.empty(b, n, h, dv, device="cuda", dtype=dtype)
        fns = {"flashcpp": lambda: flashcpp.flash_attn_func(q, k, v, causal=causal),
               # the FA2-style mma.sync kernel on the same GPU (what A100-class devices run)
               "flashcpp_sm80": lambda: flashcpp.attention(q, k, v, out=o_sm80, causal=causal, backend="cuda",
                                                           cuda_config="sm80")[0]}
        for name, be in peers.items():
            def f(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)
            try:
                f()
                fns[name] = f
            except Exception as e:  # a backend that refuses a shape is reported, not hidden
                progress(f"  {name} unavailable for this case: {type(e).__name__}: {str(e)[:120]}")
        if fa4_fn is not None:
            def f4():
                with torch.no_grad():
                    return fa4_fn(q, k, v, causal=causal)[0]
            try:
                f4()  # compiles this variant (seconds), outside the timing
                bench_graph_us(f4, rep_ms=1)  # and it must capture into a graph like the others
                fns["fa4"] = f4
            except Exception as e:  # a shape FA4 refuses is reported, not hidden
                progress(f"  fa4 unavailable for this case: {type(e).__name__}: {str(e)[:120]}")
        if fi is not None and hkv == h and dv == d:  # the ragged wrapper here is set up for MHA
            try:
                fns["flashinfer"] = _flashinfer_prefill(torch, fi, q, k, v, causal)
                fns["flashinfer"]()
                bench_graph_us(fns["flashinfer"])  # its run() must capture into a graph like the others
            except Exception as e:
                fns.pop("flashinfer", None)
                progress(f"  flashinfer unavailable for this case: {type(e).__name__}: {str(e)[:120]}")
        # sanity: same function (SDPA causal is top-left; equal lengths here, so identical)
        ref_name = next((n for n in ("torch_cudnn", "torch_flash", "torch_efficient") if n in fns), None)
        if ref_name is None:  # no SDPA backend takes this shape: nothing to check flashcpp against here
            progress(f"  no SDPA backend runs {shape} (causal {causal}); row skipped")
            continue
        ref = fns[ref_name]().transpose(1, 2).float()
        err = max((fns[n]().float() - ref).abs().max().item() for n in ("flashcpp", "flashcpp_sm80"))
        for peer in ("fa4", "flashinfer"):  # a peer that computes something else would make its ratio meaningless
            if peer in fns:
                p_err = (fns[peer]().float() - ref).abs().max().item()
                if not p_err <= 0.05:
                    progress(f"  {peer} dropped for this case: max |diff| vs SDPA {p_err:.3e}")
                    fns.pop(peer)
        t = interleaved(fns, graph=True, rep_ms=rep_ms)
        te = interleaved(fns, graph=False, rep_ms=rep_ms)
        dts = "bf16" if dtype == torch.bfloat16 else "fp16"
        cid = (f"b{b}_h{h}{f'kv{hkv}' if hkv != h else ''}_n{n}_d{d}{f'v{dv}' if dv != d else ''}"
               f"{'_causal' if causal else ''}_{dts}")
        fl = _flops(b, h, n, d, causal, dv)
        line = [f"{cid:34s} ours {fl / t['flashcpp'] / 1e6:6.1f} sm80 {fl / t['flashcpp_sm80'] / 1e6:6.1f} TF/s"]
        for peer in peer_names:
            if peer not in t:
                continue
            rows.append({"case": cid, "peer": peer, "ours_us": round(t["flashcpp"], 2), "peer_us": round(t[peer], 2),
                         "speedup": round(t[peer] / t["flashcpp"], 3), "batch": b, "heads_q": h, "heads_kv": hkv,
                         "seqlen_q": n, "seqlen_k": n, "head_dim": d, "head_dim_v": dv, "causal": int(causal),
                         "mask": "causal" if causal else "none",
                         "dtype": dts, "ours_tflops": round(fl / t["flashcpp"] / 1e6, 1),
                         "peer_tflops": round(fl / t[peer] / 1e6, 1), "max_abs_diff_vs_sdpa": f"{err:.3e}",
                         "ours_kernel": "sm90", "sm80_us": round(t["flashcpp_sm80"], 2),
                         "sm80_tflops": round(fl / t["flashcpp_sm80"] / 1e6, 1),
                         "sm80_speedup": round(t[peer] / t["flashcpp_sm80"], 3),
                         "ours_eager_us": round(te["flashcpp"], 2), "peer_eager_us": round(te[peer], 2),
                         "eager_speedup": round(te[peer] / te["flashcpp"], 3), "timing": "cuda_graph_median",
                         "gpu": env["gpu"], "git_commit": env["git_commit"]})
            line.append(f"{peer} {fl / t[peer] / 1e6:6.1f} ({t[peer] / t['flashcpp']:.2f}x, eager {te[peer] / te['flashcpp']:.2f}x)")
        progress("  ".join(line) + f"  maxdiff {err:.1e}")
        del q, k, v, qt, kt, vt, fns
    # The raw measurement (both kernels), then the per-area views: reports/prefill (sm80 kernel)
    # and reports/hopper (sm90 kernel) from the same rows.
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    write_csv(os.path.join(out, "raw", "measured_both_kernels.csv"), rows)
    write_json(os.path.join(out, "benchmark_env.json"), env)
    plot(rows, os.path.join(out, "raw", "all_kernels.png"), env)
    if not area_reports:
        progress(f"[bench prefill] wrote {out}/raw/measured_both_kernels.csv")
        return 0
    from .report import write_areas
    write_areas(rows, os.path.dirname(os.path.abspath(out)), env)
    progress(f"[bench prefill] wrote {out}/raw/measured_both_kernels.csv and the prefill/hopper reports")
    return 0


def plot(rows: List[Dict[str, object]], path: str, env: Dict[str, object]) -> None:
    cases = sorted({r["case"] for r in rows if r["dtype"] == "bf16"}, key=lambda c: [r["case"] for r in rows].index(c))
    series = {"flashcpp": lambda rs: rs[0]["ours_tflops"], "flashcpp_sm80": lambda rs: rs[0]["sm80_tflops"]}
    peers = ["torch_flash", "torch_cudnn", "torch_efficient"] + [p for p in ("fa4", "flashinfer") if any(r["peer"] == p for r in rows)]
    series.update({p: peer_value(p, "peer_tflops") for p in peers})
    grouped_bars(path, cases, rows, series, "TFLOP/s (bf16, CUDA-graph replay)",
                 f"Prefill forward on {env['gpu']} (torch {env['torch']}, cuDNN {env['cudnn']}, {env['git_commit']})",
                 label=lambda c: c.replace("_bf16", ""))
