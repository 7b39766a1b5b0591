"""Plots of a numerics-audit JSON: per-row relative error CDFs and the p99 against N.

    python -m flashcpp.bench.audit_plot reports/numerics/audit.json [--out reports/numerics] [--prefix audit]

Reads the document that ``flashcpp audit --json`` writes (or ``python -m flashcpp.bench.audit``'s
``audit_peers.json``, same ``results`` schema) and writes, into ``--out`` (default: the JSON's folder):

* ``<prefix>_cdf_<dtype>_n<N>.png``: one figure per (dtype, N), one panel per mask, one curve per
  (family, kernel): the CDF of the per-row relative error ``max_e |o - r| / max(max_e |r|, atol)``
  sampled at the report's ``cdf_quantiles``, with the dtype's rtol as a vertical line;
* ``<prefix>_p99_vs_n.png``: the p99 of that error against N, one panel per (dtype, mask).

Only matplotlib and the standard library; imports nothing else from flashcpp, so it runs anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

#: Smallest error drawn on the log axis (rows whose error is exactly 0 are drawn here).
ERR_FLOOR = 1e-12
FAMILY_ORDER = ["random", "subnormal", "one_hot", "near_ties", "constant", "outlier_keys", "large_scale", "long_range"]
MASK_ORDER = ["none", "causal", "window"]
DTYPE_ORDER = ["bf16", "fp16", "fp32"]
LINESTYLES = ["-", "--", ":", "-."]


def load(path: str) -> Dict[str, object]:
    with open(path) as f:
        return json.load(f)


def _order(values, preferred: Sequence[str]) -> List[str]:
    vals = list(dict.fromkeys(values))
    return sorted(vals, key=lambda v: (preferred.index(v) if v in preferred else len(preferred), v))


def _plottable(r: Dict[str, object]) -> bool:
    return r.get("status") != "unsupported" and bool(r.get("cdf"))


def _rtol(report: Dict[str, object], dtype: str) -> Optional[float]:
    for r in report.get("results", []):
        if r.get("dtype") == dtype and isinstance(r.get("tolerance"), dict):
            return float(r["tolerance"]["rtol"])
    return None


def _curve(r: Dict[str, object], quantiles: Sequence[float]) -> Tuple[List[float], List[float]]:
    """(errors, quantiles) of one result; non-finite rows (null) are drawn at the right edge."""
    xs, ys = [], []
    for x, q in zip(r["cdf"], quantiles):
        xs.append(float("inf") if x is None else max(float(x), ERR_FLOOR))
        ys.append(q)
    return xs, ys


def plot_cdfs(report: Dict[str, object], out_dir: str, prefix: str = "audit") -> List[str]:
    """One PNG per (dtype, N); returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report.get("results", []) if _plottable(r)]
    quantiles = report["cdf_quantiles"]
    kernels = _order([r["kernel"] for r in results], [])
    families = _order([r["family"] for r in results], FAMILY_ORDER)
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    styles = {k: LINESTYLES[i % len(LINESTYLES)] for i, k in enumerate(kernels)}
    env = report.get("environment", {})
    paths = []
    for dtype in _order([r["dtype"] for r in results], DTYPE_ORDER):
        for n in sorted({int(r["seqlen"]) for r in results if r["dtype"] == dtype}):
            sel = [r for r in results if r["dtype"] == dtype and int(r["seqlen"]) == n]
            masks = _order([r["mask"] for r in sel], MASK_ORDER)
            fig, axes = plt.subplots(1, len(masks), figsize=(5.2 * len(masks), 4.4), squeeze=False, sharey=True)
            for ax, mask in zip(axes[0], masks):
                for r in sel:
                    if r["mask"] != mask:
                        continue
                    xs, ys = _curve(r, quantiles)
                    finite = [(x, y) for x, y in zip(xs, ys) if x != float("inf")]
                    if not finite:
                        continue
                    ax.step([x for x, _ in finite], [y for _, y in finite], where="post", color=colors[r["family"]],
                            linestyle=styles[r["kernel"]], lw=1.3,
                            label=f"{r['family']} ({r['kernel']})" if len(kernels) > 1 else r["family"])
                rtol = _rtol(report, dtype)
                if rtol:
                    ax.axvline(rtol, color="k", lw=0.8, ls="--")
                    ax.text(rtol, 0.02, " rtol", fontsize=7, rotation=90, va="bottom")
                ax.set_xscale("log")
                ax.set_xlim(left=ERR_FLOOR)
                ax.set_ylim(0, 1.0)
                ax.set_title(f"mask {mask}", fontsize=9)
                ax.set_xlabel("per-row relative error")
                ax.grid(alpha=0.3, which="both", lw=0.4)
            axes[0][0].set_ylabel("fraction of rows <= error")
            axes[0][-1].legend(fontsize=6, loc="lower right", ncol=1 if len(kernels) == 1 else 2)
            fig.suptitle(f"{dtype}, N = {n}: per-row error CDF vs fp64 ({env.get('device', '')}, "
                         f"commit {env.get('git_commit', '')})", fontsize=9)
            fig.tight_layout()
            path = os.path.join(out_dir, f"{prefix}_cdf_{dtype}_n{n}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def plot_p99(report: Dict[str, object], out_dir: str, prefix: str = "audit") -> Optional[str]:
    """p99 of the per-row relative error against N, one panel per (dtype, mask)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report.get("results", []) if _plottable(r)]
    if not results:
        return None
    dtypes = _order([r["dtype"] for r in results], DTYPE_ORDER)
    masks = _order([r["mask"] for r in results], MASK_ORDER)
    kernels = _order([r["kernel"] for r in results], [])
    families = _order([r["family"] for r in results], FAMILY_ORDER)
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    styles = {k: LINESTYLES[i % len(LINESTYLES)] for i, k in enumerate(kernels)}
    fig, axes = plt.subplots(len(dtypes), len(masks), figsize=(4.6 * len(masks), 3.6 * len(dtypes)), squeeze=False)
    for row, dtype in zip(axes, dtypes):
        for ax, mask in zip(row, masks):
            for fam in families:
                for k in kernels:
                    pts = sorted((int(r["seqlen"]), r["row_rel_err"]["p99"]) for r in results
                                 if (r["dtype"], r["mask"], r["family"], r["kernel"]) == (dtype, mask, fam, k)
                                 and r["row_rel_err"]["p99"] is not None)
                    if pts:
                        ax.plot([p[0] for p in pts], [max(p[1], ERR_FLOOR) for p in pts], marker="o", ms=3,
                                color=colors[fam], ls=styles[k], label=f"{fam} ({k})" if len(kernels) > 1 else fam)
            rtol = _rtol(report, dtype)
            if rtol:
                ax.axhline(rtol, color="k", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, mask {mask}", fontsize=9)
            ax.set_xlabel("N")
            ax.grid(alpha=0.3, which="both", lw=0.4)
        row[0].set_ylabel("p99 per-row relative error")
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}_p99_vs_n.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_report(json_path: str, out_dir: Optional[str] = None, prefix: str = "audit") -> List[str]:
    report = load(json_path)
    out_dir = out_dir or os.path.dirname(os.path.abspath(json_path))
    os.makedirs(out_dir, exist_ok=True)
    paths = plot_cdfs(report, out_dir, prefix)
    p = plot_p99(report, out_dir, prefix)
    if p:
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.audit_plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="audit JSON (flashcpp audit --json, or audit_peers.json)")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: the JSON's folder)")
    ap.add_argument("--prefix", default="audit", help="file name prefix (default: audit)")
    args = ap.parse_args(argv)
    for p in plot_report(args.json, args.out, args.prefix):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
