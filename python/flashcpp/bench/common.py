"""Shared pieces of the benchmark drivers: environment block, measured ceilings, timing, CSV, plots."""
from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Sequence, Tuple


def git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=here,
                                       stderr=subprocess.DEVNULL).decode().strip()
    except Exception:
        return os.environ.get("FLASHCPP_GIT_COMMIT", "unknown")


def environment() -> Dict[str, object]:
    import torch
    env: Dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
    }
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = out.decode().strip()
    except Exception:
        env["driver"] = "unknown"
    return env


# Repetition time of one measurement: milliseconds of back-to-back calls. triton's do_bench times
# rep_ms of calls once; do_bench_cudagraph captures rep_ms of calls in a graph and replays it ten times,
# so a graph measurement costs about 11 x rep_ms. The full suite uses 100 ms; --quick uses 25 ms, which
# still times 50 to 300 calls of a prefill or fused kernel per replay (a quarter of the time per number).
FULL_REP_MS = 100
QUICK_REP_MS = 25


def rep_ms_for(quick: bool) -> int:
    return QUICK_REP_MS if quick else FULL_REP_MS


def bench_us(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = FULL_REP_MS) -> float:
    """Median time of fn in microseconds (CUDA events; triton's do_bench clears L2 between runs)."""
    import triton.testing
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def bench_graph_us(fn: Callable[[], object], rep_ms: int = FULL_REP_MS) -> float:
    """Median time of fn in microseconds replayed from a CUDA graph: launch and Python overhead
    removed for every implementation alike, so this compares the kernels themselves."""
    import triton.testing
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def cuda_graph_of(fn: Callable[[], object], calls: int):
    """A CUDA graph of `calls` back-to-back calls of fn (one warm-up call first, on a side stream as
    capture wants), for A/B probes that replay several such graphs interleaved."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def interleaved(fns: Dict[str, Callable[[], object]], rounds: int = 2, graph: bool = False,
                rep_ms: int = FULL_REP_MS) -> Dict[str, float]:
    """Time each implementation `rounds` times in alternating order; the median of the rounds."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench_graph_us(fn, rep_ms) if graph else bench_us(fn, rep_ms=rep_ms))
    return {k: statistics.median(v) for k, v in times.items()}


def ceilings() -> Dict[str, float]:
    """Measured bf16 GEMM TFLOP/s (8192^3) and device copy TB/s (read + write), on random data."""
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = bench_us(lambda: a @ b)
    gemm = 2 * 8192 ** 3 / (us * 1e-6) / 1e12
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    us = bench_us(lambda: y.copy_(x))
    copy = 2 * x.numel() * 2 / (us * 1e-6) / 1e12
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"gemm_bf16_tflops": round(gemm, 1), "copy_tbps": round(copy, 3)}


def write_csv(path: str, rows: List[Dict[str, object]]) -> None:
    if not rows:
        return
    keys: List[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_json(path: str, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def fa4():
    """FlashAttention-4's forward (flash_attn.cute.flash_attn_func, CuTe DSL; its sm90 kernels run on
    Hopper), when it imports here: (flash_attn_func, version), else (None, why). On a machine without
    network it travels as wheels (../shared/tools/fa4-carry.sh); each kernel variant is compiled at its
    first call (seconds), so callers run it once before timing."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
        try:
            from importlib.metadata import version
            ver = version("flash-attn-4")
        except Exception:
            ver = "?"
        return flash_attn_func, ver
    except Exception as e:  # not installed, or a build for another torch / CUDA
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def grouped_bars(path: str, cases: List[str], rows: List[Dict[str, object]], series: Dict[str, Callable],
                 ylabel: str, title: str, width_per_case: float = 0.9, rotation: int = 45,
                 label: Callable[[str], str] = lambda c: c, lines: Sequence[Tuple[float, Dict[str, object]]] = (),
                 legend_fontsize=None) -> None:
    """One group of bars per case, one bar per series: series[name](case_rows) is the bar's value (0
    where it has none); `lines` are (y, axhline keyword arguments) drawn across. The areas' plots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(cases) * width_per_case), 5))
    w = 0.8 / len(series)
    for i, (name, value) in enumerate(series.items()):
        vals = [value([r for r in rows if r["case"] == c]) for c in cases]
        ax.bar([x + (i - (len(series) - 1) / 2) * w for x in range(len(cases))], vals, w, label=name)
    for y, kw in lines:
        ax.axhline(y, **kw)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([label(c) for c in cases], rotation=rotation, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_fontsize)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def peer_value(peer: str, column: str) -> Callable:
    """A grouped_bars series: `column` of the case's row for `peer` (0 without one)."""
    return lambda rs: next((r[column] for r in rs if r["peer"] == peer), 0)


def progress(msg: str) -> None:
    print(msg, flush=True)
