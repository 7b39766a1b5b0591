"""The generated summary of a benchmark run: reports/SUMMARY.md from the areas' benchmark.csv and
benchmark_env.json files (the last step of `make bench`, after the roofline).

    python -m flashcpp.bench.summary [reports_dir]      -> reports_dir/SUMMARY.md

It writes, from the files alone (no GPU, nothing hand-entered):
  - the hardware and software of each area's run (GPU, driver, CUDA, torch, cuDNN, the measured
    bf16 GEMM TFLOP/s and copy TB/s, the commit), so a rerun can be compared line by line;
  - one table of ratios against each peer per area (rows, min / median / max, rows below 1.0x),
    where a ratio above 1 means flashcpp is faster (every area's `speedup` column has that meaning:
    peer time / our time, or our tokens/s / the peer's for the engine);
  - the issue bars each area records (`bar`, `meets_bar`): rows that meet them out of rows that
    carry them;
  - where we lose: every external peer's row below 1.0x, worst first.
Peers named flashcpp_* are our own ablations (the prefill kernel used naively, a contiguous cache
next to a paged one, forced split counts): they are tabulated apart and never listed as losses.
The area READMEs explain the figures; this file only collects them.
"""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Optional, Tuple

AREAS = ("hopper", "prefill", "masks", "decode", "fused", "engine")
# The hopper and prefill tables come from one measurement; its environment is prefill's file.
ENV_FILE = {"hopper": "prefill"}
ENV_KEYS = (("gpu", "GPU"), ("sms", "SMs"), ("driver", "driver"), ("cuda_runtime", "CUDA"), ("torch", "torch"),
            ("cudnn", "cuDNN"), ("gemm_bf16_tflops", "bf16 GEMM TFLOP/s"), ("copy_tbps", "copy TB/s"),
            ("git_commit", "commit"))
LOSS_ROWS_PER_AREA = 12


def ratio(r: Dict[str, str]) -> Optional[float]:
    """A row's `speedup` as a positive finite float, else None (missing, NaN, not a number)."""
    try:
        v = float(r.get("speedup", "") or "nan")
    except ValueError:
        return None
    return v if math.isfinite(v) and v > 0 else None


def _is_internal(peer: str) -> bool:
    return peer.startswith("flashcpp")


def load(reports_dir: str) -> Dict[str, Tuple[List[Dict[str, str]], Dict[str, object]]]:
    """area -> (benchmark.csv rows, environment) for the areas whose CSV exists."""
    out: Dict[str, Tuple[List[Dict[str, str]], Dict[str, object]]] = {}
    for area in AREAS:
        path = os.path.join(reports_dir, area, "benchmark.csv")
        if not os.path.exists(path):
            continue
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        env: Dict[str, object] = {}
        env_path = os.path.join(reports_dir, ENV_FILE.get(area, area), "benchmark_env.json")
        if os.path.exists(env_path):
            try:
                with open(env_path) as fh:
                    env = json.load(fh)
            except (OSError, ValueError):
                env = {}
        out[area] = (rows, env)
    return out


def peer_table(rows: List[Dict[str, str]]) -> List[Dict[str, object]]:
    """One entry per peer: rows with a ratio, min / median / max, rows below 1.0x. Rows whose
    ratio is missing or not a positive finite number are counted apart as `unmeasured`."""
    by_peer: Dict[str, List[float]] = {}
    missing: Dict[str, int] = {}
    for r in rows:
        peer = r.get("peer", "") or "?"
        v = ratio(r)
        if v is None:
            missing[peer] = missing.get(peer, 0) + 1
        else:
            by_peer.setdefault(peer, []).append(v)
    out = []
    for peer in sorted(set(by_peer) | set(missing), key=lambda p: (_is_internal(p), p)):
        vals = by_peer.get(peer, [])
        out.append({"peer": peer, "internal": _is_internal(peer), "rows": len(vals),
                    "min": min(vals) if vals else None, "median": statistics.median(vals) if vals else None,
                    "max": max(vals) if vals else None, "below_1": sum(v < 1.0 for v in vals),
                    "unmeasured": missing.get(peer, 0)})
    return out


def _bar_name(bar: str) -> str:
    """A bare number is a ratio threshold (masks: "1.0" -> ">= 1.0x")."""
    try:
        float(bar)
    except ValueError:
        return bar
    return f">= {bar}x"


def bar_table(rows: List[Dict[str, str]]) -> List[Dict[str, object]]:
    """One entry per recorded bar: cases meeting it out of cases carrying it (a case's peer rows
    repeat its bar: each (case, bar) counts once)."""
    bars: Dict[str, Dict[str, bool]] = {}
    for r in rows:
        bar, met = (r.get("bar") or "").strip(), (r.get("meets_bar") or "").strip().lower()
        if not bar or met in ("", "n/a", "none"):
            continue
        bars.setdefault(_bar_name(bar), {}).setdefault(r.get("case", ""), met in ("yes", "true", "1"))
    return [{"bar": b, "met": sum(v.values()), "rows": len(v)} for b, v in sorted(bars.items())]


def losses(rows: List[Dict[str, str]]) -> List[Dict[str, object]]:
    """External peers' rows below 1.0x, worst first."""
    out = []
    for r in rows:
        v = ratio(r)
        if v is None or v >= 1.0 or _is_internal(r.get("peer", "")):
            continue
        out.append({"case": r.get("case", ""), "peer": r.get("peer", ""), "ratio": v})
    return sorted(out, key=lambda x: (x["ratio"], x["case"], x["peer"]))


def _fmt(v: Optional[float]) -> str:
    """Two decimals, three where two would round a loss (or a win) to 1.00x."""
    if v is None:
        return "—"
    return f"{v:.3f}x" if 0.995 <= v < 1.005 and v != 1.0 else f"{v:.2f}x"


def render(data: Dict[str, Tuple[List[Dict[str, str]], Dict[str, object]]]) -> str:
    lines = ["# Benchmark summary (generated)", "",
             "Written by `python -m flashcpp.bench.summary` from each area's `benchmark.csv` and",
             "`benchmark_env.json` (the last step of `make bench`). A ratio above 1 means flashcpp is",
             "faster. The area READMEs explain the figures; `flashcpp_*` peers are our own ablations.", ""]
    if not data:
        lines.append("No area has a benchmark.csv yet: run `make bench` on an NVIDIA machine.")
        return "\n".join(lines) + "\n"
    lines += ["## Hardware and software of each run", "",
              "| area | " + " | ".join(label for _, label in ENV_KEYS) + " |",
              "| --- |" + " --- |" * len(ENV_KEYS)]
    for area, (_, env) in data.items():
        cells = [str(env.get(k, "—")) for k, _ in ENV_KEYS]
        lines.append(f"| {area} | " + " | ".join(cells) + " |")
    lines += ["", "## Ratios against each peer", "",
              "| area | peer | rows | min | median | max | below 1.0x |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for area, (rows, _) in data.items():
        for p in peer_table(rows):
            name = p["peer"] + (" (ours)" if p["internal"] else "")
            extra = f" ({p['unmeasured']} unmeasured)" if p["unmeasured"] else ""
            lines.append(f"| {area} | {name} | {p['rows']}{extra} | {_fmt(p['min'])} | {_fmt(p['median'])} | "
                         f"{_fmt(p['max'])} | {p['below_1']} |")
    bar_lines = []
    for area, (rows, _) in data.items():
        for b in bar_table(rows):
            bar_lines.append(f"| {area} | {b['bar']} | {b['met']} of {b['rows']} |")
    if bar_lines:
        lines += ["", "## Bars recorded by the runs", "", "| area | bar | cases meeting it |", "| --- | --- | --- |"]
        lines += bar_lines
    lines += ["", "## Where we lose (external peers, below 1.0x, worst first)", ""]
    any_loss = False
    for area, (rows, _) in data.items():
        ls = losses(rows)
        if not ls:
            continue
        any_loss = True
        shown = ls[:LOSS_ROWS_PER_AREA]
        more = f" (the {LOSS_ROWS_PER_AREA} worst of {len(ls)})" if len(ls) > len(shown) else ""
        lines.append(f"- **{area}**{more}: " + "; ".join(f"{x['case']} vs {x['peer']} {_fmt(x['ratio'])}" for x in shown))
    if not any_loss:
        lines.append("No row below 1.0x against an external peer.")
    return "\n".join(lines) + "\n"


def write(reports_dir: str) -> str:
    path = os.path.join(reports_dir, "SUMMARY.md")
    text = render(load(reports_dir))
    with open(path, "w") as fh:
        fh.write(text)
    return path


def main(argv: List[str]) -> int:
    reports_dir = argv[1] if len(argv) > 1 else "reports"
    if not os.path.isdir(reports_dir):
        print(f"flashcpp.bench.summary: {reports_dir} is not a directory", file=sys.stderr)
        return 2
    print("wrote", write(reports_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
