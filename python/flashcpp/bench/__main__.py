"""python -m flashcpp.bench {prefill} [--quick] [--out reports/<area>]"""
import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench", description=__doc__)
    ap.add_argument("area", choices=["prefill", "fused"], help="which kernels to compare")
    ap.add_argument("--quick", action="store_true", help="a small subset (about a minute)")
    ap.add_argument("--out", default=None, help="report folder (default reports/<area>)")
    args = ap.parse_args(argv)
    if args.area == "prefill":
        from . import prefill
        return prefill.run(quick=args.quick, out=args.out or "reports/prefill")
    if args.area == "fused":
        from . import fused
        return fused.run(quick=args.quick, out=args.out or "reports/fused")
    return 2


if __name__ == "__main__":
    sys.exit(main())
