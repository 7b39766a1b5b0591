"""python -m flashcpp.bench {prefill,fused,decode,engine,masks,backward,headdims} [--quick] [--out reports/<area>]
                           [--flashcpp-bin build/flashcpp] [--model-dir /tmp/llama1b]   (engine only)
                           [--grid] [--grid-max-seconds S] [...]   (decode only: bench/decode.py's options)"""
import argparse
import os
import sys
from typing import Optional


def _no_gpu_reason() -> Optional[str]:
    """Why the benchmarks cannot run here (one sentence), or None. Every area measures CUDA
    kernels against PyTorch's on a GPU."""
    try:
        import torch
    except ImportError:
        return "the benchmarks need PyTorch with CUDA and an NVIDIA GPU, and torch is not installed"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"the benchmarks need an NVIDIA GPU, and this torch ({torch.__version__}) is a CPU-only build"
        return "the benchmarks need an NVIDIA GPU, and no NVIDIA driver or GPU was found"
    import flashcpp
    if not flashcpp.WITH_CUDA:
        return ("this flashcpp build has no CUDA kernels (built with FLASHCPP_CUDA=OFF); reinstall it with the "
                "CUDA toolkit present to benchmark it")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench", description=__doc__)
    ap.add_argument("area", choices=["prefill", "fused", "decode", "engine", "masks", "backward", "headdims"], help="which kernels to compare")
    ap.add_argument("--quick", action="store_true", help="a small subset with shorter measurements (about 20 to 60 s per area on an H200)")
    ap.add_argument("--out", default=None, help="report folder (default reports/<area>)")
    ap.add_argument("--flashcpp-bin", default="build/flashcpp", help="engine: the flashcpp CLI to run")
    ap.add_argument("--model-dir", default="/tmp/llama1b",
                    help="engine: a Llama checkpoint (a random Llama-3.2-1B-shaped one is made if absent)")
    args, rest = ap.parse_known_args(argv)  # decode takes its own options too (--grid ...: bench/decode.py)
    if rest and args.area != "decode":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    reason = _no_gpu_reason()
    if reason is not None:
        print(f"python -m flashcpp.bench {args.area}: {reason}.", file=sys.stderr)
        return 2
    if args.area == "prefill":
        from . import prefill
        return prefill.run(quick=args.quick, out=args.out or "reports/prefill")
    if args.area == "headdims":  # issue [headdims]'s bar: prefill and backward at 96, 80, 32, 192/128 (128 beside),
        from . import backward, decode, prefill  # and decode's TB/s at 96 and 80 against 128
        out = args.out or "reports/headdims"
        rc = prefill.run(quick=args.quick, out=os.path.join(out, "prefill"), shapes=prefill.HEADDIM_SHAPES,
                         area_reports=False)
        rc = rc or backward.run(quick=args.quick, out=os.path.join(out, "backward"), shapes=backward.HEADDIM_SHAPES)
        return rc or decode.run(quick=args.quick, out=os.path.join(out, "decode"), cases=decode.HEADDIM_CASES)
    if args.area == "backward":
        from . import backward
        return backward.run(quick=args.quick, out=args.out or "reports/backward")
    if args.area == "masks":
        from . import masks
        return masks.run(quick=args.quick, out=args.out or "reports/masks")
    if args.area == "fused":
        from . import fused
        return fused.run(quick=args.quick, out=args.out or "reports/fused")
    if args.area == "decode":
        from . import decode
        if rest:  # python -m flashcpp.bench decode --grid [...]: the decode bench's own command line
            return decode.main((["--quick"] if args.quick else []) + ["--out", args.out or "reports/decode"] + rest)
        return decode.run(quick=args.quick, out=args.out or "reports/decode")
    if args.area == "engine":
        from . import engine
        return engine.run(quick=args.quick, out=args.out or "reports/engine", flashcpp_bin=args.flashcpp_bin,
                          model_dir=args.model_dir)
    return 2


if __name__ == "__main__":
    sys.exit(main())
