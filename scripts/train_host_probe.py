"""Host time of an eager training step's attention on CUDA: flash_attn_func forward with grad, and
its backward, against SDPA's (cuDNN), on small shapes where the launches, not the kernels, set the
pace (issue 32: a training step; issue 28: the backward bench's small rows).

    python scripts/train_host_probe.py [--reps 300]

For each shape and implementation: wall time per call of a loop of back-to-back calls (the host's
enqueue rate; the GPU keeps up on these shapes), after warm-up, median of 5 loops; and the kernels'
time per call from CUDA events around a loop, synchronized. Prints a table; no files.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcpp

SHAPES = [(1, 128, 8, 64), (1, 1024, 8, 128), (4, 512, 16, 128)]  # batch, seqlen, heads, head_dim


def per_call(fn, reps):
    """(host us per call, GPU us per call): loops of `reps` calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        walls.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return statistics.median(walls), e0.elapsed_time(e1) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    print(f"{'shape (B,N,H,D) causal bf16':32s} {'call':14s} {'impl':8s} {'host_us':>8s} {'gpu_us':>8s}")
    for (B, N, H, D) in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        o_f = flashcpp.flash_attn_func(q, k, v, causal=True)
        o_s = sdpa()
        rows = {
            ("forward", "flashcpp"): lambda: flashcpp.flash_attn_func(q, k, v, causal=True),
            ("forward", "sdpa"): sdpa,
            ("backward", "flashcpp"): lambda: torch.autograd.grad(o_f, (q, k, v), do, retain_graph=True),
            ("backward", "sdpa"): lambda: torch.autograd.grad(o_s, (q, k, v), do.transpose(1, 2), retain_graph=True),
        }
        for (call, impl), fn in rows.items():
            host, gpu = per_call(fn, a.reps)
            print(f"{str((B, N, H, D)):32s} {call:14s} {impl:8s} {host:8.1f} {gpu:8.1f}", flush=True)


if __name__ == "__main__":
    main()
