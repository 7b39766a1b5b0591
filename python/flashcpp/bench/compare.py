"""Does a new benchmark run reproduce the shipped one? Compares the ratios against each peer of two
report directories, case by case.

    python -m flashcpp.bench.compare REFERENCE NEW [--tolerance 0.10] [--out FILE.md]

For every area with a benchmark.csv in both directories, the rows are matched on (case, peer)
and the ratio (`speedup`: peer time / our time, or our tokens/s / the peer's) of the new run is
set against the reference: drift = new / reference - 1. A row is out of tolerance when |drift| >
tolerance (10% by default: what "reproduces within ~10%" means for `make bench`). A `--quick` run
compares on the cases it shares with a full one.

Some rows carry their repeats (the engine's `peer_tok_s_runs` / `ours_tok_s_runs`: one figure per
repeat of the whole measurement). Where the repeats inside one run already spread by more than the
tolerance (max / min - 1, in the reference or the new run), the ratio is not defined to better than
that spread; such a row outside the tolerance is listed apart as "noisy" with its spread, and does
not fail the check unless --strict. Prints a markdown report (and writes it with --out); the exit
status is 0 when every matched row is within tolerance (noisy rows aside), 1 when one is not, 2
when no row could be matched.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

from flashcpp.bench.summary import load, ratio as _ratio


def _by_key(rows: List[Dict[str, str]]) -> Dict[Tuple[str, str], Dict[str, str]]:
    return {(r.get("case", ""), r.get("peer", "")): r for r in rows}


RUN_COLUMNS = ("peer_tok_s_runs", "ours_tok_s_runs")


def repeat_spread(row: Dict[str, str]) -> Optional[float]:
    """max / min - 1 over the repeats of each timed side of a row (the larger of the two), or None when
    the row carries no repeats."""
    spreads = []
    for col in RUN_COLUMNS:
        try:
            vals = [float(v) for v in (row.get(col) or "").split()]
        except ValueError:
            continue
        vals = [v for v in vals if v > 0]
        if len(vals) >= 2:
            spreads.append(max(vals) / min(vals) - 1.0)
    return max(spreads) if spreads else None


def compare(ref_dir: str, new_dir: str, tolerance: float = 0.10) -> List[Dict[str, object]]:
    """One entry per (area, case, peer) present in both runs with a ratio in each."""
    out: List[Dict[str, object]] = []
    ref_runs, new_runs = load(ref_dir), load(new_dir)
    for area, (ref_rows, _) in ref_runs.items():  # in AREAS order
        if area not in new_runs:
            continue
        ref, new = _by_key(ref_rows), _by_key(new_runs[area][0])
        for key in sorted(set(ref) & set(new)):
            a, b = _ratio(ref[key]), _ratio(new[key])
            if a is None or b is None:
                continue
            drift = b / a - 1.0
            spreads = [x for x in (repeat_spread(ref[key]), repeat_spread(new[key])) if x is not None]
            spread = max(spreads) if spreads else None
            out.append({"area": area, "case": key[0], "peer": key[1], "reference": a, "new": b, "drift": drift,
                        "ok": abs(drift) <= tolerance, "spread": spread,
                        "noisy": spread is not None and spread > tolerance,
                        "ref_commit": ref[key].get("git_commit", ""), "new_commit": new[key].get("git_commit", "")})
    return out


def render(rows: List[Dict[str, object]], ref_dir: str, new_dir: str, tolerance: float) -> str:
    lines = [f"# Reproduction check: {new_dir} against {ref_dir}", "",
             f"Ratio drift = new / reference - 1 on every (case, peer) both runs have; tolerance ±{tolerance:.0%}.", ""]
    if not rows:
        lines.append("No (case, peer) row is in both runs: nothing to compare.")
        return "\n".join(lines) + "\n"
    lines += ["| area | rows | within tolerance | noisy, outside | median drift | largest drift |",
              "| --- | --- | --- | --- | --- | --- |"]
    by_area: Dict[str, List[Dict[str, object]]] = {}
    for r in rows:
        by_area.setdefault(str(r["area"]), []).append(r)
    for area, rs in by_area.items():
        drifts = sorted(float(r["drift"]) for r in rs)
        worst = max(rs, key=lambda r: abs(float(r["drift"])))
        noisy_out = sum((not r["ok"]) and bool(r["noisy"]) for r in rs)
        lines.append(f"| {area} | {len(rs)} | {sum(bool(r['ok']) for r in rs)} | {noisy_out} | {drifts[len(drifts) // 2]:+.1%} | "
                     f"{float(worst['drift']):+.1%} ({worst['case']} vs {worst['peer']}) |")
    bad = [r for r in rows if not r["ok"] and not r["noisy"]]
    noisy = [r for r in rows if not r["ok"] and r["noisy"]]

    def table(rs: List[Dict[str, object]]) -> List[str]:
        out = ["| area | case | peer | reference | new | drift | repeats spread |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(rs, key=lambda r: -abs(float(r["drift"]))):
            sp = "-" if r["spread"] is None else f"{float(r['spread']):.0%}"
            out.append(f"| {r['area']} | {r['case']} | {r['peer']} | {float(r['reference']):.3f}x | "
                       f"{float(r['new']):.3f}x | {float(r['drift']):+.1%} | {sp} |")
        return out

    lines += ["", f"## Out of tolerance: {len(bad)} of {len(rows)}", ""]
    lines += table(bad) if bad else ["Every matched row is within tolerance" + (" (noisy rows aside)." if noisy else ".")]
    if noisy:
        lines += ["", f"## Outside, on noisy rows: {len(noisy)} of {len(rows)}", "",
                  f"The repeats inside one run spread by more than ±{tolerance:.0%} (max / min - 1 of a timed side's "
                  "repeats, reference or new): the ratio is not reproducible more tightly than that.", ""]
        lines += table(noisy)
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", help="report directory of the reference run (e.g. reports)")
    ap.add_argument("new", help="report directory of the new run (e.g. build/bench-quick)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="largest |drift| that counts as reproduced")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    ap.add_argument("--strict", action="store_true", help="noisy rows outside the tolerance fail the check too")
    a = ap.parse_args(argv)
    for d in (a.reference, a.new):
        if not os.path.isdir(d):
            print(f"flashcpp.bench.compare: {d} is not a directory", file=sys.stderr)
            return 2
    if not a.tolerance > 0:
        print("flashcpp.bench.compare: --tolerance must be positive", file=sys.stderr)
        return 2
    rows = compare(a.reference, a.new, a.tolerance)
    text = render(rows, a.reference, a.new, a.tolerance)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    if not rows:
        return 2
    return 0 if all(r["ok"] or (r["noisy"] and not a.strict) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
