"""Where an eager flashcpp call spends its host time (issue 32): each step of the fast paths of
flash_attn_func and rms_norm timed alone, back to back, beside torch's own costs on the same host.

    python3 scripts/host_probe.py [--calls N] [--repeats R]

Each row: microseconds per call, wall time (perf_counter) of N back-to-back calls / N, median of R
loops, after a warm-up; the GPU is synchronized between loops, never inside one. Steps that launch
nothing show the host's cost of the step; steps that launch show the enqueue cost as long as the
launch queue does not fill (N is small). The rows are differences to read, not a benchmark: e.g.
attention_forward(p) minus select_kernel(p) is the launcher's own time (tensor maps, the launch).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashcpp
from flashcpp import _core
from flashcpp import _flashcpp as _C



def per_call_us(fn, n: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        xs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    bf = torch.bfloat16
    q = torch.randn(1, 128, 8, 128, dtype=bf, device=dev)
    k, v = torch.randn_like(q), torch.randn_like(q)
    x = torch.randn(8, 2048, dtype=bf, device=dev)
    w = torch.randn(2048, dtype=bf, device=dev)
    small = torch.zeros(16, device=dev)
    code = _core.FAST_CODES[bf]
    where = _core.fast_device(dev, bf)
    out = torch.empty_like(q)

    def params():
        p = _C.AttnParams()
        p.batch, p.seqlen_q, p.seqlen_k = 1, 128, 128
        p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v = 8, 8, 128, 128
        p.q, p.k, p.v = _C.fast_view(q, code), _C.fast_view(k, code), _C.fast_view(v, code)
        p.o = _C.fast_view(out, code)
        p.lse = 0
        p.softmax_scale = 128 ** -0.5
        m = p.mask
        m.causal, m.window_left, m.window_right, m.softcap = True, -1, -1, 0.0
        return p

    p = params()
    opt = _C.RunOptions(where[0], where[1], 0, "")
    r = torch.randn_like(x)
    g2 = torch.randn(8, 4096, dtype=bf, device=dev)
    steps = [
        ("python: empty loop body", lambda: None),
        ("torch: small.add_(1) (one torch launch)", lambda: small.add_(1)),
        ("torch: torch.empty((1,128,8,128))", lambda: torch.empty((1, 128, 8, 128), dtype=bf, device=dev)),
        ("torch: torch.empty_like(x 8x2048)", lambda: torch.empty_like(x)),
        ("torch: x.new_empty((8, 2048))", lambda: x.new_empty((8, 2048))),
        ("torch: q.data_ptr()", lambda: q.data_ptr()),
        ("torch: q.shape, q.stride(), q.device", lambda: (q.shape, q.stride(), q.device)),
        ("torch: torch.compiler.is_compiling()", lambda: torch.compiler.is_compiling()),
        ("torch: torch.cuda.current_device()", lambda: torch.cuda.current_device()),
        ("torch: torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("flashcpp: _C.fast_view(q)", lambda: _C.fast_view(q, code)),
        ("flashcpp: AttnParams filled in Python", params),
        ("flashcpp: _C.select_kernel(p)", lambda: _C.select_kernel(p, opt)),
        ("flashcpp: _C.attention_forward(p)", lambda: _C.attention_forward(p, opt)),
        ("flashcpp: _C.attention_fast(q, k, v)", lambda: _C.attention_fast(q, k, v, None, True, -1, -1, 0.0, False)),
        ("flashcpp: flash_attn_func(causal)", lambda: flashcpp.flash_attn_func(q, k, v, causal=True)),
        ("peer: F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)),
        ("flashcpp: _C.norm_fast(x, None, w)", lambda: _C.norm_fast(x, None, w, 1e-6, 0)),
        ("flashcpp: rms_norm(x, w)", lambda: flashcpp.rms_norm(x, w)),
        ("peer: F.rms_norm(x, (2048,), w)", lambda: F.rms_norm(x, (2048,), w, 1e-6)),
        ("flashcpp: fused_add_rms_norm(x, r, w)", lambda: flashcpp.fused_add_rms_norm(x, r, w)),
        ("flashcpp: silu_and_mul(8x4096)", lambda: flashcpp.silu_and_mul(g2)),
        ("peer: F.silu(g) * u", lambda: F.silu(g2[:, :2048]) * g2[:, 2048:]),
    ]
    print(f"host_probe: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, N={a.calls}, R={a.repeats}")
    print(f"kernel choice: {_C.select_kernel(p, opt)[:2]}")
    print(f"{'step':<48} {'us/call':>8}")
    for name, fn in steps:
        print(f"{name:<48} {per_call_us(fn, a.calls, a.repeats):8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
