"""One decode shape run eagerly, for a profiler to wrap (ncu -k regex:decode ...): a plan, then
--calls runs of it on the same cache (the cache stays in L2 where it fits, as in the grid's
CUDA-graph timing).

    python scripts/decode_ncu.py B,HQ,HKV,N,D,PS [--splits S] [--fused-merge 0|1] [--calls 12] [--peer 1]
"""
import argparse

import torch

from flashcpp.decode import BatchDecodeWithKVCache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("--splits", type=int, default=0)
    ap.add_argument("--fused-merge", type=int, default=0)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--peer", type=int, default=0, help="1: also SDPA's cuDNN backend on a head-major copy")
    a = ap.parse_args()
    B, Hq, Hkv, N, D, ps = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (B * N // ps, ps, Hkv, D) if ps else (B, N, Hkv, D)
    kc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens_host = torch.full((B,), N, dtype=torch.int32)
    lens = lens_host.cuda()
    table = torch.randperm(B * N // ps).cuda().int().view(B, N // ps) if ps else None
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, kv_capacity=N, page_size=ps, cache_seqlens=lens_host, causal=True, dtype=torch.bfloat16,
           device="cuda", num_splits=a.splits, fused_merge=a.fused_merge == 1)
    info = w.plan_info
    print(f"{a.shape}: ctas {info.ctas} splits {info.max_splits} merge {int(info.needs_merge)}", flush=True)
    out = torch.empty_like(q)
    for _ in range(a.calls):
        w.run(q, kc, vc, lens, block_table=table, out=out)
    torch.cuda.synchronize()
    if a.peer and not ps:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kh, vh, qt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous(), q.transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(a.calls):
                torch.nn.functional.scaled_dot_product_attention(qt, kh, vh, enable_gqa=Hq != Hkv)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
