"""One CUDA backward at one shape, for a profiler (ncu, nsys): a forward, a warm-up backward, then
the backward to profile (ncu: --launch-skip 1 --launch-count 1 -k regex:bwd_).
Usage (on a GPU, flashcpp installed): python3 scripts/bwd_one.py B H N D [causal] [det] [config]
config is FLASHCPP_BWD_CONFIG (sm80, sm90, sm90ws; default: the selector's choice)."""
import os
import sys

import torch

import flashcpp

b, h, n, d = (int(x) for x in sys.argv[1:5])
flags = sys.argv[5:]
causal, det = "causal" in flags, "det" in flags
cfg = [f for f in flags if f.startswith("sm")]
if cfg:
    os.environ["FLASHCPP_BWD_CONFIG"] = cfg[0]
g = torch.Generator(device="cuda").manual_seed(1)
q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
q, k, v = (x.requires_grad_() for x in (q, k, v))
o = flashcpp.flash_attn_func(q, k, v, causal=causal, deterministic=det)
for _ in range(2):
    grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
torch.cuda.synchronize()
print(f"({b},{h},{n},{d}) causal={causal} det={det} config={cfg[0] if cfg else 'default'}: "
      f"|dq| {grads[0].float().norm():.4e} finite {all(torch.isfinite(x).all().item() for x in grads)}")
