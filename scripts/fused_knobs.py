"""Times the fused kernels' cuda_config knobs against their defaults on the GPU (a measurement aid for
reports/fused, not part of `make bench`): RMSNorm and RMSNorm + residual per row count and hidden
size, rotary at the DESIGN shape. CUDA-graph medians (flashcpp.bench.common.interleaved), % of the
floor = bytes that must move / 4.3 TB/s.

    python scripts/fused_knobs.py [--knobs default,slots2,...]
"""
import argparse
import sys

import torch

import flashcpp
from flashcpp.bench import common

ROOF = 4.3e12
NORM_SHAPES = [(8192, 4096), (32768, 4096), (8192, 8192), (4096, 2048), (16384, 1024), (32768, 8192), (4096, 16384)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--knobs", default="default,two_pass,stages2,stages3,stages4,streaming")
    a = ap.parse_args()
    knobs = a.knobs.split(",")
    try:
        from quack import rmsnorm as quack
    except Exception as e:  # noqa: BLE001 - any import failure: not timed, and said so
        quack = None
        print(f"quack: not timed ({type(e).__name__}: {str(e)[:80]})", flush=True)
    for rows, hidden in NORM_SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        y, ro = torch.empty_like(x), torch.empty_like(x)
        for name, nbytes, mk in (
            ("rmsnorm", 2 * x.numel() * 2,
             lambda cfg: (lambda: flashcpp.rms_norm(x, w, 1e-6, out=y, cuda_config=cfg))),
            ("rmsnorm_res", 4 * x.numel() * 2,
             lambda cfg: (lambda: flashcpp.fused_add_rms_norm(x, r, w, 1e-6, out=y, residual_out=ro,
                                                              cuda_config=cfg))),
        ):
            fns = {k: mk("" if k == "default" else k) for k in knobs}
            # The same bytes as a copy (x -> y, and x, r -> y, ro), and quack's kernel when it imports.
            if name == "rmsnorm":
                fns["copy"] = lambda: y.copy_(x)
            else:
                fns["copy"] = lambda: (y.copy_(x), ro.copy_(r))
            if quack is not None:
                fns["quack"] = ((lambda: quack.rmsnorm_fwd(x, w, eps=1e-6)) if name == "rmsnorm"
                                else (lambda: quack.rmsnorm_fwd(x, w, residual=r, eps=1e-6)))
            t = common.interleaved(fns, rounds=3, graph=True, rep_ms=50)
            line = "  ".join(f"{k} {t[k]:7.1f} us {nbytes / (t[k] * 1e-6) / ROOF * 100:5.1f}%" for k in t)
            print(f"{name:<12} {rows}x{hidden:<6} {line}", flush=True)
    q = torch.randn(4, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    rot_knobs = ["default", "shared", "heads1", "stages2", "stages3"]
    for name, nbytes, mk in (
        ("rotary q (4,4096,32,128)", 2 * q.numel() * 2,
         lambda cfg: (lambda: flashcpp.apply_rotary(q, q_out=qo, theta=10000.0, cuda_config=cfg))),
        ("rotary q+k (4,4096,32/8,128)", 2 * (q.numel() + k.numel()) * 2,
         lambda cfg: (lambda: flashcpp.apply_rotary(q, k, q_out=qo, k_out=ko, theta=10000.0, cuda_config=cfg))),
    ):
        fns = {kn: mk("" if kn == "default" else kn) for kn in rot_knobs}
        fns["copy"] = lambda: qo.copy_(q)
        t = common.interleaved(fns, rounds=3, graph=True, rep_ms=50)
        print(name + " " + "  ".join(f"{kn} {v:7.1f} us {nbytes / (v * 1e-6) / ROOF * 100:5.1f}%"
                                     for kn, v in t.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
