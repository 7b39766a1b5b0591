"""The steps `make bench` runs after the areas, in one process:

    python -m flashcpp.bench.finish DIR [--reference reports]

1. the audit's plots, when DIR/numerics/audit.json exists (flashcpp.bench.audit_plot);
2. the roofline, DIR/roofline.{csv,png} (flashcpp.bench.roofline);
3. DIR/SUMMARY.md (flashcpp.bench.summary);
4. with --reference: the reproduction check DIR/COMPARE.md against that directory (flashcpp.bench.compare).

Run one by one, each step paid the import of torch and the flashcpp extension again (about three
seconds apiece). Exit status: 0 when every step ran; 2 when a step could not run; a ratio outside the
reproduction tolerance is reported in COMPARE.md and does not fail the run (`python -m
flashcpp.bench.compare` on its own exits 1 for it).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.finish", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="report directory the areas wrote (reports, or the BENCH_OUT of a run)")
    ap.add_argument("--reference", default=None, help="report directory to check the ratios against (COMPARE.md)")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.dir):
        print(f"flashcpp.bench.finish: {a.dir} is not a directory", file=sys.stderr)
        return 2
    from . import audit_plot, compare, roofline, summary

    steps: List[tuple[str, Callable[[], int]]] = []
    audit_json = os.path.join(a.dir, "numerics", "audit.json")
    if os.path.isfile(audit_json):
        steps.append(("audit_plot", lambda: audit_plot.main([audit_json, "--out", os.path.dirname(audit_json)])))
    steps.append(("roofline", lambda: roofline.main([a.dir])))
    steps.append(("summary", lambda: summary.main(["summary", a.dir])))
    if a.reference is not None:
        steps.append(("compare", lambda: compare.main([a.reference, a.dir, "--out", os.path.join(a.dir, "COMPARE.md")])))
    failed: List[str] = []
    for name, step in steps:
        try:
            rc = step()
        except Exception:
            traceback.print_exc()
            rc = 2
        # compare exits 1 for drift past the tolerance: reported in COMPARE.md, not a failure to run
        if rc != 0 and not (name == "compare" and rc == 1):
            failed.append(f"{name} (exit {rc})")
    if failed:
        print("flashcpp.bench.finish: failed: " + ", ".join(failed), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
