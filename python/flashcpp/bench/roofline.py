"""Roofline of flashcpp's kernels from the areas' benchmark.csv files: each measured case placed by
arithmetic intensity (FLOPs per byte that must move) against the ceilings measured on the same
GPU (bf16 GEMM TFLOP/s and copy TB/s from reports/prefill/benchmark_env.json).

    python -m flashcpp.bench.roofline [reports_dir]      -> reports/roofline.{csv,png}

How each area is counted (bytes are the minimum that must move through DRAM, bf16/fp16):
  hopper, prefill, masks  FLOPs = achieved TFLOP/s x time (the bench's own count: 4 B H Sq Sk D,
                          causal halved, masks on visible pairs); bytes = q + k + v + o.
  decode                  FLOPs = 4 heads_q seqlen_q head_dim kv_tokens; bytes = the KV read
                          (kv_bytes; q and o are negligible).
  fused                   bytes from the bench; FLOPs per element of the main tensor: RMSNorm
                          4 (+1 with the residual add), SwiGLU 5 (exp, add, divide, 2 multiplies),
                          rotary 3 per element (2 multiplies and an add).
A point under the bandwidth roof is memory bound; its distance to the roof is what is left.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from typing import Dict, List, Optional

AREAS = ("hopper", "prefill", "masks", "decode", "fused")


def _f(r: Dict[str, str], k: str, default: float = 0.0) -> float:
    try:
        return float(r.get(k, "") or default)
    except ValueError:
        return default


def _attention_bytes(r: Dict[str, str], esize: int = 2) -> float:
    b, hq, hk = _f(r, "batch"), _f(r, "heads_q"), _f(r, "heads_kv", _f(r, "heads_q"))
    sq, sk, d = _f(r, "seqlen_q"), _f(r, "seqlen_k", _f(r, "seqlen_q")), _f(r, "head_dim")
    return esize * b * d * (2 * hq * sq + 2 * hk * sk)


def _fused_flops(r: Dict[str, str]) -> float:
    name = r.get("kernel", "")
    if name.startswith("rmsnorm"):
        return (5.0 if "residual" in name else 4.0) * _f(r, "rows") * _f(r, "hidden")
    if name.startswith("swiglu"):
        return 5.0 * _f(r, "rows") * _f(r, "d")
    heads = _f(r, "heads_q") + _f(r, "heads_k")
    return 3.0 * _f(r, "batch") * _f(r, "seqlen") * heads * _f(r, "head_dim")


def points(reports_dir: str) -> List[Dict[str, object]]:
    """One point per (area, case) for flashcpp's kernel, from the CSVs that exist."""
    out: List[Dict[str, object]] = []
    for area in AREAS:
        path = os.path.join(reports_dir, area, "benchmark.csv")
        if not os.path.exists(path):
            continue
        seen = set()
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                if r["case"] in seen:
                    continue  # one row per peer: the case's own figures repeat
                seen.add(r["case"])
                us = _f(r, "ours_us")
                if us <= 0:
                    continue
                if area in ("hopper", "prefill", "masks"):
                    tflops = _f(r, "sm80_tflops") if area == "prefill" and "sm80_tflops" in r else _f(r, "ours_tflops")
                    flops = tflops * 1e12 * (_f(r, "sm80_us") if area == "prefill" and "sm80_us" in r else us) * 1e-6
                    nbytes = _attention_bytes(r)
                    if area == "prefill" and "sm80_us" in r:
                        us = _f(r, "sm80_us")
                elif area == "decode":
                    flops = 4.0 * _f(r, "heads_q") * _f(r, "seqlen_q") * _f(r, "head_dim") * _f(r, "kv_tokens")
                    nbytes = _f(r, "kv_bytes")
                else:
                    flops, nbytes = _fused_flops(r), _f(r, "bytes")
                if flops <= 0 or nbytes <= 0:
                    continue
                out.append({"area": area, "case": r["case"], "us": us, "flops": flops, "bytes": nbytes,
                            "intensity": flops / nbytes, "tflops": flops / us * 1e-6, "tbps": nbytes / us * 1e-6})
    return out


def ceilings(reports_dir: str) -> Dict[str, float]:
    """Measured ceilings (bf16 GEMM TFLOP/s, copy TB/s) from the prefill run's environment."""
    path = os.path.join(reports_dir, "prefill", "benchmark_env.json")
    env = json.load(open(path)) if os.path.exists(path) else {}
    return {"tflops": float(env.get("gemm_bf16_tflops", 0) or 0), "tbps": float(env.get("copy_tbps", 0) or 0),
            "gpu": env.get("gpu", "unknown GPU")}


def attained_fraction(p: Dict[str, object], ceil: Dict[str, float]) -> Optional[float]:
    """Achieved / roof at the point's intensity (None without measured ceilings)."""
    if not ceil["tflops"] or not ceil["tbps"]:
        return None
    roof = min(ceil["tflops"], ceil["tbps"] * float(p["intensity"]))
    return float(p["tflops"]) / roof


def write(reports_dir: str) -> List[Dict[str, object]]:
    pts = points(reports_dir)
    ceil = ceilings(reports_dir)
    for p in pts:
        f = attained_fraction(p, ceil)
        p["frac_of_roof"] = "" if f is None else round(f, 3)
    with open(os.path.join(reports_dir, "roofline.csv"), "w", newline="") as fh:
        cols = ["area", "case", "us", "flops", "bytes", "intensity", "tflops", "tbps", "frac_of_roof"]
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        digits = {"us": 2, "intensity": 3, "tflops": 2, "tbps": 3}
        for p in pts:
            w.writerow({k: round(p[k], digits[k]) if k in digits else p[k] for k in cols})
    if pts and ceil["tflops"] and ceil["tbps"]:
        plot(pts, ceil, os.path.join(reports_dir, "roofline.png"))
    return pts


def plot(pts: List[Dict[str, object]], ceil: Dict[str, float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    lo = min(float(p["intensity"]) for p in pts) / 2
    hi = max(float(p["intensity"]) for p in pts) * 2
    ridge = ceil["tflops"] / ceil["tbps"]
    xs = [lo, ridge, hi]
    ax.plot(xs, [min(ceil["tflops"], ceil["tbps"] * x) for x in xs], "k-", lw=1.5,
            label=f"measured roof: {ceil['tbps']:.2f} TB/s copy, {ceil['tflops']:.0f} TFLOP/s bf16 GEMM")
    markers = {"hopper": "o", "prefill": "s", "masks": "^", "decode": "D", "fused": "v"}
    for area in AREAS:
        ap = [p for p in pts if p["area"] == area]
        if ap:
            ax.scatter([p["intensity"] for p in ap], [p["tflops"] for p in ap], marker=markers[area], s=28,
                       label=f"{area} ({len(ap)} cases)", alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte that must move)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"flashcpp kernels on the roofline ({ceil['gpu']})")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: List[str]) -> int:
    reports_dir = argv[0] if argv else "reports"
    pts = write(reports_dir)
    ceil = ceilings(reports_dir)
    print(f"[roofline] {len(pts)} points, roof {ceil['tbps']} TB/s / {ceil['tflops']} TFLOP/s -> "
          f"{reports_dir}/roofline.csv" + (" and roofline.png" if pts and ceil["tflops"] else ""))
    for area in AREAS:
        fr = [p["frac_of_roof"] for p in pts if p["area"] == area and p["frac_of_roof"] != ""]
        if fr:
            print(f"  {area:8s} {len(fr):3d} cases, fraction of the roof {min(fr):.2f}..{max(fr):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
