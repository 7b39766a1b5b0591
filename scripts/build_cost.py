#!/usr/bin/env python3
"""CPU seconds of a build, by part, from ninja's log (what README "Two commands" quotes).

  scripts/build_cost.py [BUILD]        (default build)

Reads BUILD/.ninja_log (for each output, its most recent build step) and prints the CPU seconds of
each part: the kernel families (sm80 prefill, sm90 prefill, backward, decode, fused), the
library's host code, the engine, the tools (harness, CLI) and the tests, then the total and the
least wall time it allows on 2 and on 16 cores. A part is named by the source path
of the object; links and custom steps count under "other". Run it after a clean build: an
incremental build's log keeps the steps of earlier builds too.
"""
import os
import sys

# (part, substring of the object path), first match wins.
PARTS = [
    ("sm80 prefill kernels", "src/cuda/prefill/fa2_"),
    ("sm90 prefill kernels", "src/cuda/prefill/fa3_"),
    ("backward kernels", "src/cuda/backward/"),
    ("decode kernels", "src/cuda/decode/"),
    ("fused kernels", "src/cuda/fused/"),
    ("other library CUDA", "flashcpp.dir/src/cuda/"),
    ("library host code", "flashcpp.dir/src/"),
    ("engine", "flashcpp_engine.dir/"),
    ("harness and CLI", "flashcpp_harness.dir/"),
    ("harness and CLI", "flashcpp_cli.dir/"),
    ("CPU and CLI tests", "flashcpp_cpu_tests.dir/"),
    ("CPU and CLI tests", "flashcpp_cli_tests.dir/"),
    ("GPU tests (built, run on a GPU)", "flashcpp_gpu_tests.dir/"),
]


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    log = os.path.join(build, ".ninja_log")
    if not os.path.exists(log):
        print(f"build_cost: no {log} (build first)", file=sys.stderr)
        return 2
    last = {}
    with open(log) as f:
        for line in f:
            if line.startswith("#"):
                continue
            start, end, _, out, *_ = line.rstrip("\n").split("\t")
            last[out] = (int(end) - int(start)) / 1000.0
    secs = {}
    for out, s in last.items():
        part = next((p for p, key in PARTS if key in out), "other (links, custom steps)")
        secs[part] = secs.get(part, 0.0) + s
    order = list(dict.fromkeys(p for p, _ in PARTS)) + ["other (links, custom steps)"]
    total = sum(secs.values())
    for p in order:
        if p in secs:
            print(f"{p:34s} {secs[p]:8.1f} CPU-s  {100 * secs[p] / total:5.1f}%")
    print(f"{'total':34s} {total:8.1f} CPU-s  (at least {total / 2:.0f} s on 2 cores, {total / 16:.0f} s on 16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
