#!/usr/bin/env python3
"""Turns the per-case lines of a flashcpp_gpu_tests log into a correctness_report.json for one
kernel family. Each line is one case the GPU test compared with the fp64 GPU reference
(atol = rtol = 1e-2 per element, LSE atol 1e-3); a case only counts as passed when the log's
gtest summary shows no failed test.
Usage: gtest_log_report.py LOG KERNEL_NAME OUT.json [GIT_COMMIT]"""
import json
import re
import sys

LINE = re.compile(r"^\s+b(\d+) sq(\d+) sk(\d+) hq(\d+) hkv(\d+) d(\d+)( causal)? (bf16|fp16)( sdpa)? wl(-?\d+) wr(-?\d+)"
                  r"(?: cfg (\S+))?\s+(\S+)\s+max_abs_err (\S+)\s+lse_err (\S+)")


def main(log, kernel, out, commit="unknown"):
    text = open(log).read()
    suite_ok = "[  PASSED  ]" in text and "[  FAILED  ]" not in text
    cases = []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m or m.group(13) != kernel:
            continue
        b, sq, sk, hq, hkv, d = (int(m.group(i)) for i in range(1, 7))
        name = (f"b{b}_hq{hq}_hkv{hkv}_sq{sq}_sk{sk}_d{d}{'_causal' if m.group(7) else ''}_{m.group(8)}"
                f"{'_sdpa' if m.group(9) else ''}_wl{m.group(10)}_wr{m.group(11)}" + (f"_{m.group(12)}" if m.group(12) else ""))
        err, lse = float(m.group(14)), float(m.group(15))
        cases.append({"name": name, "pass": suite_ok and err == err, "status": "pass" if suite_ok else "fail",
                      "batch": b, "heads_q": hq, "heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk, "head_dim": d,
                      "dtype": m.group(8), "causal": bool(m.group(7)), "layout": "bhsd" if m.group(9) else "bshd",
                      "window_left": int(m.group(10)), "window_right": int(m.group(11)), "kernel": kernel,
                      "config": m.group(12) or "tuned", "max_abs_err": err, "lse_max_abs_err": lse,
                      "tolerance": {"atol": 1e-2, "rtol": 1e-2, "lse_atol": 1e-3}})
    report = {"environment": {"device": "NVIDIA H200", "backend": "cuda", "kernel": kernel, "git_commit": commit,
                              "source": "flashcpp_gpu_tests (tests/gpu/test_prefill.cc) per-case lines",
                              "reference": "fp64 GPU reference (cuBLAS DGEMM + fp64 softmax)"},
              "summary": {"passed": sum(c["pass"] for c in cases), "failed": sum(not c["pass"] for c in cases)},
              "cases": cases}
    json.dump(report, open(out, "w"), indent=1)
    print(f"{out}: {report['summary']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
