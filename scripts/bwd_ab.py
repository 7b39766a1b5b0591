"""The CUDA backward under several kernel choices (FLASHCPP_BWD_CONFIG = RunOptions::cuda_config), interleaved in one
process, with cuDNN through SDPA beside; each choice's gradients are checked against cuDNN's first.
A config ending in "+det" runs that config with deterministic=True ("+det" alone: the automatic choice), and its
gradients must repeat bit for bit. "+g<N>" before it forces N key tiles per group of the grid (docs/backward.md),
e.g. sm90ws+g5 (default mode in groups) against sm90ws+g32+det (deterministic, one group per head).
Usage (on a GPU, flashcpp installed): python3 scripts/bwd_ab.py [configs, default sm90,sm90ws] [shape indices, e.g. 0,2]"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcpp
from flashcpp.bench.common import bench_us

configs = (sys.argv[1] if len(sys.argv) > 1 else "sm90,sm90ws").split(",")
shapes = [(2, 16, 4096, 64, False), (4, 32, 4096, 128, True), (4, 32, 4096, 128, False), (1, 16, 16384, 128, True),
          (2, 16, 16384, 64, True), (16, 32, 512, 128, True)]
if len(sys.argv) > 2:  # a subset by index, e.g. 0,1,2
    shapes = [shapes[int(i)] for i in sys.argv[2].split(",")]
for (b, h, n, d, causal) in shapes:
    g = torch.Generator(device="cuda").manual_seed(1)
    q0, k0, v0, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    leaves = lambda: tuple(x.clone().requires_grad_() for x in (q0, k0, v0))
    fns = {}
    for cfg in configs:
        q, k, v = leaves()
        det = cfg.endswith("+det")
        o = flashcpp.flash_attn_func(q, k, v, causal=causal, deterministic=det)

        def run(o=o, q=q, k=k, v=v, cfg=cfg.removesuffix("+det")):
            os.environ["FLASHCPP_BWD_CONFIG"] = cfg
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        fns[cfg] = run
    q, k, v = leaves()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    fns["cudnn"] = lambda: torch.autograd.grad(oc, (q, k, v), do.transpose(1, 2), retain_graph=True)
    ref = [x.float() for x in fns["cudnn"]()]
    for cfg in configs:
        got = [x.float() for x in fns[cfg]()]
        diff = max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref))
        same = ""
        if cfg.endswith("+det"):
            again = fns[cfg]()
            same = ", bitwise repeat " + ("yes" if all(torch.equal(x, y) for x, y in zip(fns[cfg](), again)) else "NO")
        print(f"  {cfg}: max rel diff vs cudnn {diff:.2e}{same}", flush=True)
    times = {k_: [] for k_ in fns}
    for _ in range(3):
        for k_, f in fns.items():
            f()
            times[k_].append(bench_us(f, rep_ms=150))
    fl = 4 * b * h * n * n * d * 2.5 / (2 if causal else 1)
    print(f"({b},{h},{n},{d}){' causal' if causal else ''}: " + "  ".join(
        f"{k_} {fl / statistics.median(v_) / 1e6:6.1f}" for k_, v_ in times.items()) + " TF/s", flush=True)
