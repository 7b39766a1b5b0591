"""Per-area report files from one prefill measurement (both flashcpp kernels were timed together).

`prefill` reports the FA2-style mma.sync kernel (sm80 path) as "ours"; `hopper` reports the
wgmma/TMA kernel (sm90 path, the default on H100/H200). Same rows, same run: only the "ours"
columns differ. Usage on an existing measurement:
    python -m flashcpp.bench.report reports/prefill/raw/measured_both_kernels.csv
"""
from __future__ import annotations

import csv
import os
import sys
from typing import Dict, List

AREA_KERNEL = {"prefill": "sm80", "hopper": "sm90"}


def area_rows(rows: List[Dict[str, object]], area: str) -> List[Dict[str, object]]:
    """Rows with ours_* describing the area's kernel (speedup = peer_us / ours_us), and the other
    flashcpp kernel's TFLOP/s on the same run as other_kernel / other_tflops (the issue asks for
    both kernels next to the peers in one table and one plot)."""
    out = []
    for r in rows:
        r = dict(r)
        r["other_kernel"] = "sm90" if AREA_KERNEL[area] == "sm80" else "sm80"
        r["other_tflops"] = r["ours_tflops"] if AREA_KERNEL[area] == "sm80" else r.get("sm80_tflops", "")
        if AREA_KERNEL[area] == "sm80":
            r["ours_us"], r["ours_tflops"], r["speedup"] = r["sm80_us"], r["sm80_tflops"], r["sm80_speedup"]
        r["ours_kernel"] = AREA_KERNEL[area]
        for k in ("sm80_us", "sm80_tflops", "sm80_speedup"):
            r.pop(k, None)
        if AREA_KERNEL[area] == "sm80":  # eager columns were measured for the default (sm90) path only
            for k in ("ours_eager_us", "peer_eager_us", "eager_speedup"):
                r.pop(k, None)
        out.append(r)
    return out


def plot_vs_seqlen(rows: List[Dict[str, object]], path: str, title: str) -> None:
    """TFLOP/s vs seqlen, one panel per (head_dim, causal): ours and each peer (bf16)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf = [r for r in rows if r["dtype"] == "bf16"]
    panels = sorted({(int(r["head_dim"]), int(r["causal"])) for r in bf})
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7), squeeze=False)
    for ax, (d, c) in zip([a for row in axes for a in row], panels):
        sel = [r for r in bf if int(r["head_dim"]) == d and int(r["causal"]) == c]
        ns = sorted({int(r["seqlen_q"]) for r in sel})
        def series(key, peer=None):
            ys = []
            for n in ns:
                m = [r for r in sel if int(r["seqlen_q"]) == n and (peer is None or r["peer"] == peer)]
                ys.append(float(m[0][key]) if m else float("nan"))
            return ys
        ax.plot(ns, series("ours_tflops"), "o-", lw=2, label=f"flashcpp ({rows[0]['ours_kernel']})")
        if all(r.get("other_tflops") not in (None, "") for r in sel):
            ax.plot(ns, series("other_tflops"), "o:", label=f"flashcpp ({rows[0]['other_kernel']})")
        for peer in ("fa4", "torch_flash", "torch_cudnn", "torch_efficient", "flashinfer"):
            if any(r["peer"] == peer for r in sel):
                ax.plot(ns, series("peer_tflops", peer), "s--", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_title(f"head_dim {d}{' causal' if c else ''}")
        ax.set_xlabel("seqlen")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("TFLOP/s (CUDA-graph replay)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_areas(rows: List[Dict[str, object]], reports_dir: str, env: Dict[str, object]) -> None:
    from .common import write_csv
    for area in AREA_KERNEL:
        out = os.path.join(reports_dir, area)
        os.makedirs(out, exist_ok=True)
        ar = area_rows(rows, area)
        write_csv(os.path.join(out, "benchmark.csv"), ar)
        plot_vs_seqlen(ar, os.path.join(out, "benchmark.png"),
                       f"{env.get('gpu', '')}, torch {env.get('torch', '')}, cuDNN {env.get('cudnn', '')}, "
                       f"commit {env.get('git_commit', '')}")


def main(argv: List[str]) -> int:
    src = argv[0] if argv else "reports/prefill/raw/measured_both_kernels.csv"
    with open(src) as f:
        rows = list(csv.DictReader(f))
    env = {"gpu": rows[0]["gpu"], "git_commit": rows[0]["git_commit"], "torch": "", "cudnn": ""}
    envf = os.path.join(os.path.dirname(os.path.dirname(src)), "benchmark_env.json")
    if os.path.exists(envf):
        import json
        env.update(json.load(open(envf)))
    write_areas(rows, os.path.dirname(os.path.dirname(os.path.dirname(src))) or "reports", env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
