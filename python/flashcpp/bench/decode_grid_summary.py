"""The decode grid's tables from its grid.csv, and what changed between two runs.

    python -m flashcpp.bench.decode_grid_summary GRID.csv [--compare OLD.csv] [--out FILE.md]

From the `best_peer` rows (one per point: speedup = the fastest agreeing peer's time / ours) it
prints, as markdown: the overall minimum, median and count below 1.0x; the bandwidth bar (ours
>= 3.9 TB/s where the KV cache is >= 1 GB) by layout and head dim; the median speedup per layout,
batch and context; and per (heads_q/heads_kv, head_dim) class the minimum, median, points below
1.0x and which peer was fastest there. These are the tables of reports/decode/README.md ("The
decode grid").

--compare OLD.csv matches the two runs' points by name (`case`) and prints, per layout and per class,
the median of new / old for our time and for the best-peer speedup, with the points that moved
most; a point timed in one run only is counted apart. Exit status 0, or 2 when a file cannot be
read or has no best_peer rows.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

BANDWIDTH_BAR_TBPS = 3.9
BANDWIDTH_MIN_BYTES = 10 ** 9
LAYOUTS = ("contiguous", "paged16", "paged64", "ragged", "ragged_paged16")


def best_rows(path: str) -> List[Dict[str, str]]:
    """The grid's best_peer rows that carry a speedup."""
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("peer") == "best_peer" and r.get("speedup")]


def _f(r: Dict[str, str], k: str) -> float:
    return float(r[k])


def _klass(r: Dict[str, str]) -> Tuple[int, int, int]:
    return int(r["heads_q"]), int(r["heads_kv"]), int(r["head_dim"])


def _layout_order(name: str) -> Tuple[int, str]:
    return (LAYOUTS.index(name), name) if name in LAYOUTS else (len(LAYOUTS), name)


def summarize(rows: Sequence[Dict[str, str]]) -> str:
    """The markdown tables of one run."""
    sp = [_f(r, "speedup") for r in rows]
    out = [f"**{len(rows)} points; best-peer speedup min {min(sp):.3f}x, median {statistics.median(sp):.3f}x, "
           f"max {max(sp):.3f}x; {sum(x < 1.0 for x in sp)} below 1.0x.**", ""]
    # bandwidth bar
    big = [r for r in rows if int(r["kv_bytes"]) >= BANDWIDTH_MIN_BYTES and r.get("ours_tbps")]
    out += [f"Bandwidth bar (>= {BANDWIDTH_BAR_TBPS} TB/s where KV >= 1 GB): "
            f"{sum(_f(r, 'ours_tbps') >= BANDWIDTH_BAR_TBPS for r in big)} of {len(big)} points meet it.", "",
            "| layout | head dim | points >= 1 GB | min TB/s | median TB/s | below the bar |",
            "| --- | --- | --- | --- | --- | --- |"]
    groups: Dict[Tuple[str, int], List[float]] = defaultdict(list)
    for r in big:
        groups[(r["layout"], int(r["head_dim"]))].append(_f(r, "ours_tbps"))
    for (lay, d) in sorted(groups, key=lambda k: (_layout_order(k[0]), k[1])):
        v = groups[(lay, d)]
        out.append(f"| {lay} | {d} | {len(v)} | {min(v):.2f} | {statistics.median(v):.2f} | "
                   f"{sum(x < BANDWIDTH_BAR_TBPS for x in v)} |")
    # layout x batch x context
    contexts = sorted({int(r["seqlen_k"]) for r in rows})
    cells: Dict[Tuple[str, int, int], List[float]] = defaultdict(list)
    for r in rows:
        cells[(r["layout"], int(r["batch"]), int(r["seqlen_k"]))].append(_f(r, "speedup"))
    for lay in sorted({r["layout"] for r in rows}, key=_layout_order):
        batches = sorted({b for (l, b, _) in cells if l == lay})
        out += ["", f"Median best-peer speedup, {lay}, batch x context:", "",
                "| batch | " + " | ".join(str(c) for c in contexts) + " |",
                "| --- | " + " | ".join("---" for _ in contexts) + " |"]
        for b in batches:
            vals = [cells.get((lay, b, c)) for c in contexts]
            out.append(f"| {b} | " + " | ".join(f"{statistics.median(v):.2f}" if v else "-" for v in vals) + " |")
    # classes
    out += ["", "| heads q/kv | d | points | min | median | below 1.0 | fastest peer where below |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    by_class: Dict[Tuple[int, int, int], List[Dict[str, str]]] = defaultdict(list)
    for r in rows:
        by_class[_klass(r)].append(r)
    for k in sorted(by_class, key=lambda k: (k[1] if k[0] != k[1] else 10 ** 6, k[0], k[2])):
        rs = by_class[k]
        v = [_f(r, "speedup") for r in rs]
        peers = Counter(r.get("best_of", "") for r in rs if _f(r, "speedup") < 1.0)
        who = ", ".join(f"{p} {n}" for p, n in peers.most_common())
        out.append(f"| {k[0]}/{k[1]} | {k[2]} | {len(v)} | {min(v):.2f} | {statistics.median(v):.2f} | "
                   f"{sum(x < 1.0 for x in v)} | {who} |")
    return "\n".join(out) + "\n"


def compare(new: Sequence[Dict[str, str]], old: Sequence[Dict[str, str]], top: int = 10) -> str:
    """Per layout and class, the median new / old of our time and of the best-peer speedup."""
    o = {r["case"]: r for r in old}
    n = {r["case"]: r for r in new}
    both = [c for c in n if c in o]
    out = [f"{len(both)} points in both runs; {len(n) - len(both)} only in the new one, "
           f"{len(o) - len(both)} only in the old one.", ""]
    if not both:
        return "\n".join(out) + "\n"

    def table(title: str, key) -> List[str]:
        g: Dict[object, List[str]] = defaultdict(list)
        for c in both:
            g[key(n[c])].append(c)
        lines = ["", f"| {title} | points | our time, new / old (median) | best-peer speedup, new / old (median) | "
                     "speedup below 1.0x, old -> new |",
                 "| --- | --- | --- | --- | --- |"]
        for k in sorted(g, key=str):
            cs = g[k]
            t = statistics.median(_f(n[c], "ours_us") / _f(o[c], "ours_us") for c in cs)
            s = statistics.median(_f(n[c], "speedup") / _f(o[c], "speedup") for c in cs)
            below_o = sum(_f(o[c], "speedup") < 1.0 for c in cs)
            below_n = sum(_f(n[c], "speedup") < 1.0 for c in cs)
            lines.append(f"| {k} | {len(cs)} | {t:.3f} | {s:.3f} | {below_o} -> {below_n} |")
        return lines

    out += table("layout", lambda r: r["layout"])
    out += table("heads q/kv, d", lambda r: f"{r['heads_q']}/{r['heads_kv']}, {r['head_dim']}")
    moved = sorted(both, key=lambda c: _f(n[c], "ours_us") / _f(o[c], "ours_us"))
    out += ["", f"Our time, the {top} points that gained most and the {top} that lost most (new / old):", ""]
    for c in moved[:top] + moved[-top:]:
        out.append(f"- {c}: {_f(o[c], 'ours_us'):.2f} -> {_f(n[c], 'ours_us'):.2f} us "
                   f"({_f(n[c], 'ours_us') / _f(o[c], 'ours_us'):.3f})")
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.decode_grid_summary",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a decode grid's grid.csv")
    ap.add_argument("--compare", metavar="OLD.csv", help="an earlier run's grid.csv to compare with")
    ap.add_argument("--out", metavar="FILE.md", help="also write the markdown here")
    a = ap.parse_args(argv)
    loaded = {}
    for path in [a.grid] + ([a.compare] if a.compare else []):
        try:
            loaded[path] = best_rows(path)
        except (OSError, KeyError, ValueError) as e:
            print(f"{path}: cannot read it as a decode grid's grid.csv ({e})", file=sys.stderr)
            return 2
        if not loaded[path]:
            print(f"{path}: no best_peer rows (is it a decode grid's grid.csv?)", file=sys.stderr)
            return 2
    rows = loaded[a.grid]
    text = summarize(rows)
    if a.compare:
        text += "\n## Against " + a.compare + "\n\n" + compare(rows, loaded[a.compare])
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
