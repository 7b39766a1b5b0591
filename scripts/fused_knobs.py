"""Times the fused kernels' cuda_config knobs against their defaults on the GPU (a measurement aid for
reports/fused, not part of `make bench`): RMSNorm and RMSNorm + residual per row count and hidden
size, rotary at the DESIGN shape. CUDA-graph medians (flashcpp.bench.common.interleaved), % of the
floor = bytes that must move / 4.3 TB/s.

    python scripts/fused_knobs.py [--knobs default,slots2,...]
"""
import argparse
import importlib
import sys

import torch

import flashcpp
from flashcpp.bench import common

ROOF = 4.3e12
NORM_SHAPES = [(8192, 4096), (32768, 4096), (8192, 8192), (4096, 2048)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--knobs", default="default,two_pass,stream,stream+stages2",
                    help="comma-separated cuda_config values; '+' joins tokens of one value")
    a = ap.parse_args()
    knobs = a.knobs.split(",")
    try:
        quack = importlib.import_module("quack.rmsnorm")  # the package's `rmsnorm` is a function
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
            fns = {k: mk("" if k == "default" else k.replace("+", ",")) for k in knobs}
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
    rot_knobs = ["default", "shared", "stream+stages2", "stream+stages4", "heads1"]
    try:
        quack_rot = importlib.import_module("quack.rotary")
        inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
        freqs = torch.outer(torch.arange(4096, device="cuda", dtype=torch.float32), inv)
        qc_cos, qc_sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    except Exception:  # noqa: BLE001 - not timed (said above for the norms)
        quack_rot = None
    for name, nbytes, mk in (
        ("rotary q (4,4096,32,128)", 2 * q.numel() * 2,
         lambda cfg: (lambda: flashcpp.apply_rotary(q, q_out=qo, theta=10000.0, cuda_config=cfg))),
        ("rotary q+k (4,4096,32/8,128)", 2 * (q.numel() + k.numel()) * 2,
         lambda cfg: (lambda: flashcpp.apply_rotary(q, k, q_out=qo, k_out=ko, theta=10000.0, cuda_config=cfg))),
    ):
        fns = {kn: mk("" if kn == "default" else kn.replace("+", ",")) for kn in rot_knobs}
        fns["copy"] = (lambda: qo.copy_(q)) if name.startswith("rotary q ") else (lambda: (qo.copy_(q), ko.copy_(k)))
        if quack_rot is not None:  # fp32 (seqlen, head_dim / 2) tables, as the fused bench gives it
            fns["quack"] = ((lambda: quack_rot.apply_rotary(q, qc_cos, qc_sin)) if name.startswith("rotary q ")
                            else (lambda: (quack_rot.apply_rotary(q, qc_cos, qc_sin), quack_rot.apply_rotary(k, qc_cos, qc_sin))))
        t = common.interleaved(fns, rounds=3, graph=True, rep_ms=50)
        print(name + " " + "  ".join(f"{kn} {v:7.1f} us {nbytes / (v * 1e-6) / ROOF * 100:5.1f}%"
                                     for kn, v in t.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
