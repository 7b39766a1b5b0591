"""Attention backward: flashcpp vs FlashAttention-4 (flash_attn.cute, when it imports) and torch SDPA's
CUDNN and FLASH (FA2) backends, one process, bf16.

Each implementation runs its forward once with requires_grad inputs; what is timed is
torch.autograd.grad(out, (q, k, v), dout, retain_graph=True): the backward alone, through the same
autograd path for everyone, eager, medians of interleaved rounds after warm-up. flashcpp is also timed
with deterministic=True. Each backward is also replayed from a CUDA graph (the `*_graph_us` columns):
on the small rows an eager backward is bound by host time (1.03-1.31x SDPA's on an H100 host,
reports/integrations), which the graph removes for every implementation alike, so the two columns
tell the kernels apart from the launches. An implementation that cannot be captured keeps its eager
figure and says so.

TFLOP/s counts 2.5x the forward's FLOPs (4 B H N^2 D, halved for causal), as issue [backward] does.
Peak memory is torch.cuda.max_memory_allocated during one backward, beyond what was allocated before.
Every gradient is compared with cuDNN's (max |diff| over max |cudnn|); a peer whose gradients differ by
more than 5e-2 of that is dropped from the row and said so, never timed silently.
"""
from __future__ import annotations

import os
from typing import Dict, List

from .common import (bench_graph_us, environment, fa4, grouped_bars, interleaved, peer_value, progress, rep_ms_for,
                     write_csv, write_json)

SHAPES = [  # batch, heads (query), seqlen, head_dim, causal[, KV heads: GQA]
    (4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (1, 16, 16384, 128, False), (1, 16, 16384, 128, True),
    (2, 16, 4096, 64, False), (2, 16, 16384, 64, True), (1, 16, 4096, 256, False), (16, 32, 512, 128, True),
    (1, 64, 8192, 128, True, 8),
    # the prefill bench's other shapes with N >= 2048
    (1, 8, 2048, 64, False), (1, 8, 8192, 128, True),
]
QUICK = [(2, 16, 4096, 64, False), (4, 32, 4096, 128, True)]
# The head dims of issue [headdims]: batch, heads, seqlen, head_dim, causal, KV heads, head_dim_v.
HEADDIM_SHAPES = [(2, 16, 4096, 96, False, 16, 96), (2, 16, 4096, 80, False, 16, 80), (2, 16, 4096, 32, True, 16, 32),
                  (1, 16, 4096, 192, True, 16, 128), (2, 16, 4096, 128, False, 16, 128)]


def _flops(b, h, n, d, causal, dv=None):
    f = 2.0 * b * h * n * n * (d + (d if dv is None else dv)) * 2.5
    return f / 2 if causal else f


def _peak_bytes(torch, fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def run(quick: bool, out: str, shapes=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcpp

    os.makedirs(out, exist_ok=True)
    env = environment()
    rep_ms = rep_ms_for(quick)
    env["timing"] = (f"eager median (triton do_bench), rep {rep_ms} ms, 2 interleaved rounds; backward only; "
                     f"*_graph_us: CUDA-graph replay median (do_bench_cudagraph), one round")
    progress(f"[bench backward] {env}")
    fa4_fn, fa4_ver = fa4()
    progress("[bench backward] fa4: " + (f"flash-attn-4 {fa4_ver}" if fa4_fn else f"does not import, not timed ({fa4_ver})"))
    env["fa4"] = fa4_ver if fa4_fn else f"not available: {fa4_ver}"
    rows: List[Dict[str, object]] = []
    for idx, shape in enumerate(shapes or (QUICK if quick else SHAPES)):
        b, h, n, d, causal = shape[:5]
        hkv = shape[5] if len(shape) > 5 else h
        dv = shape[6] if len(shape) > 6 else d
        g = torch.Generator(device="cuda").manual_seed(2000 + idx)
        dt = torch.bfloat16
        q0 = torch.randn(b, n, h, d, device="cuda", dtype=dt, generator=g)
        k0 = torch.randn(b, n, hkv, d, device="cuda", dtype=dt, generator=g)
        v0 = torch.randn(b, n, hkv, dv, device="cuda", dtype=dt, generator=g)
        dout = torch.randn(b, n, h, dv, device="cuda", dtype=dt, generator=g)
        gqa = {"enable_gqa": True} if hkv != h else {}
        graphs = {}  # name -> (out, (q, k, v), dout in the out's layout)

        def leaves():
            return tuple(x.detach().clone().requires_grad_() for x in (q0, k0, v0))

        q, k, v = leaves()
        graphs["flashcpp"] = (flashcpp.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
        q, k, v = leaves()
        graphs["flashcpp_det"] = (flashcpp.flash_attn_func(q, k, v, causal=causal, deterministic=True), (q, k, v), dout)
        for name, be in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION), ("torch_flash", SDPBackend.FLASH_ATTENTION)):
            q, k, v = leaves()
            try:
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=causal, **gqa)
                graphs[name] = (o, (q, k, v), dout.transpose(1, 2))
            except Exception as e:  # a backend that refuses a shape is reported, not hidden
                progress(f"  {name} unavailable for this case: {type(e).__name__}: {str(e)[:120]}")
        if fa4_fn is not None:
            q, k, v = leaves()
            try:
                graphs["fa4"] = (fa4_fn(q, k, v, causal=causal)[0], (q, k, v), dout)
            except Exception as e:
                progress(f"  fa4 unavailable for this case: {type(e).__name__}: {str(e)[:120]}")
        fns = {}
        for name, (o, ins, do) in graphs.items():
            def f(o=o, ins=ins, do=do):
                return torch.autograd.grad(o, ins, do, retain_graph=True)
            try:
                f()  # compiles / warms this variant outside the timing
                fns[name] = f
            except Exception as e:
                progress(f"  {name} backward failed for this case: {type(e).__name__}: {str(e)[:160]}")
        ref_name = next((n for n in ("torch_cudnn", "torch_flash") if n in fns), None)
        if ref_name is None:  # no SDPA backend computes these gradients: nothing to check flashcpp against
            progress(f"  neither cuDNN nor FA2 through SDPA runs {shape}; row skipped")
            continue
        ref = [x.float() for x in fns[ref_name]()]
        diffs = {}
        for name in list(fns):
            got = [x.float() for x in fns[name]()]
            diffs[name] = max(((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for a, r in zip(got, ref))
            if name != ref_name and not diffs[name] <= 5e-2:
                progress(f"  {name} dropped for this case: gradients differ from {ref_name} by {diffs[name]:.3e} of max")
                fns.pop(name)
        if "flashcpp" not in fns:
            progress(f"  flashcpp has no result for this case; row skipped")
            continue
        peaks = {name: _peak_bytes(torch, fns[name]) for name in fns}
        t = interleaved(fns, rounds=2, graph=False, rep_ms=rep_ms)
        tg = _graph_times(torch, fns, rep_ms)
        cid = (f"b{b}_h{h}{f'kv{hkv}' if hkv != h else ''}_n{n}_d{d}{f'v{dv}' if dv != d else ''}"
               f"{'_causal' if causal else ''}_bf16")
        fl = _flops(b, h, n, d, causal, dv)
        line = [f"{cid:34s} ours {fl / t['flashcpp'] / 1e6:6.1f} TF/s"]
        if "flashcpp_det" in t:
            line.append(f"det {t['flashcpp'] / t['flashcpp_det']:.2f}x of default")
        for peer in ("fa4", "torch_cudnn", "torch_flash"):
            if peer not in t:
                continue
            rows.append({"case": cid, "peer": peer, "ours_us": round(t["flashcpp"], 2), "peer_us": round(t[peer], 2),
                         "speedup": round(t[peer] / t["flashcpp"], 3), "batch": b, "heads_q": h, "heads_kv": hkv,
                         "seqlen_q": n, "seqlen_k": n, "head_dim": d, "head_dim_v": dv, "causal": int(causal),
                         "dtype": "bf16",
                         "ours_tflops": round(fl / t["flashcpp"] / 1e6, 1), "peer_tflops": round(fl / t[peer] / 1e6, 1),
                         "det_us": round(t.get("flashcpp_det", float("nan")), 2),
                         "det_slowdown": round(t.get("flashcpp_det", float("nan")) / t["flashcpp"], 3),
                         "ours_peak_bytes": peaks["flashcpp"], "peer_peak_bytes": peaks[peer],
                         "ours_rel_diff_vs_ref": f"{diffs['flashcpp']:.3e}", "peer_rel_diff_vs_ref": f"{diffs[peer]:.3e}",
                         "reference": ref_name, "timing": "eager_median", "gpu": env["gpu"],
                         "git_commit": env["git_commit"],
                         "ours_graph_us": _rounded(tg.get("flashcpp")), "peer_graph_us": _rounded(tg.get(peer)),
                         "graph_speedup": (round(tg[peer] / tg["flashcpp"], 3)
                                           if peer in tg and "flashcpp" in tg else "")})
            line.append(f"{peer} {fl / t[peer] / 1e6:6.1f} ({t[peer] / t['flashcpp']:.2f}x)")
        progress("  ".join(line) + f"  rel diff {diffs['flashcpp']:.1e}  peak {peaks['flashcpp'] / 2**20:.0f} MiB")
        if "flashcpp" in tg:
            progress("    graph: ours " + "  ".join(
                [f"{fl / tg['flashcpp'] / 1e6:6.1f} TF/s"]
                + [f"{peer} {tg[peer] / tg['flashcpp']:.2f}x" for peer in ("fa4", "torch_cudnn", "torch_flash")
                   if peer in tg]))
        write_csv(os.path.join(out, "benchmark.csv"), rows)  # after every case: a cut-short run keeps its rows
        del graphs, fns, q0, k0, v0, dout
        torch.cuda.empty_cache()
    write_csv(os.path.join(out, "benchmark.csv"), rows)
    write_json(os.path.join(out, "benchmark_env.json"), env)
    try:
        plot(rows, os.path.join(out, "benchmark.png"), env)
    except ImportError as e:  # matplotlib missing: the table is the result
        progress(f"[bench backward] no plot ({e})")
    progress(f"[bench backward] wrote {out}/benchmark.csv")
    return 0


def _rounded(us):
    return "" if us is None else round(us, 2)


def _graph_times(torch, fns, rep_ms: int) -> Dict[str, float]:
    """us per backward replayed from a CUDA graph, per implementation (flashcpp_det included); one
    that cannot be captured (a host synchronization, a library that refuses capture) is left out
    with a line that says why, and the run goes on with the others."""
    times: Dict[str, float] = {}
    for name, fn in fns.items():
        try:
            times[name] = bench_graph_us(fn, rep_ms)
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves that peer's eager figure
            progress(f"  {name}: no CUDA-graph timing ({type(e).__name__}: {str(e)[:120]})")
            torch.cuda.synchronize()
    return times


def plot(rows: List[Dict[str, object]], path: str, env: Dict[str, object]) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    series = {"flashcpp": lambda rs: rs[0]["ours_tflops"]}
    series.update({p: peer_value(p, "peer_tflops") for p in ("fa4", "torch_cudnn", "torch_flash")
                   if any(r["peer"] == p for r in rows)})
    grouped_bars(path, cases, rows, series, "TFLOP/s (2.5x forward FLOPs, bf16)",
                 f"Attention backward on {env['gpu']} (torch {env['torch']}, {env['git_commit']})",
                 label=lambda c: c.replace("_bf16", ""))
