"""Fused kernels: flashcpp vs eager PyTorch vs torch.compile, one process, at the DESIGN sizes.

    python -m flashcpp.bench fused [--quick] [--out reports/fused]

Cases (bf16; fp16 on the anchor cases unless --quick):
  rmsnorm_residual   h = x + r; y = RMSNorm(h) * w           8192 x 4096   (anchor 497 / 72.3 / 62.4 us)
  rmsnorm            y = RMSNorm(x) * w                      8192 x 4096
  swiglu_fused       silu(x[:, :d]) * x[:, d:]               8192 x 14336  (anchor 287.6 / 166.7 / 163.9 us)
  swiglu_two         silu(gate) * up                         8192 x 14336
  rope_q             q of (4, 4096, 32, 128), neox           (anchor 1066.8 / 84.3 / 62.4 us)
  rope_qk            q (4, 4096, 32, 128) and k (.., 8, ..)  (Llama-3-8B GQA)
  qk_norm_rope       Qwen3-8B per-head RMSNorm of q (32 heads) and k (8), then rotary, (4, 4096, .., 128)
  rope_append_kv     rotate k (and q), append k and v to a paged cache (page 16): a prefill chunk
                     (4, 2048, 32 / 8 heads, 128) and a decode step (256 sequences, 1 token)
  rope_append_kv_fp8 the same into an fp8 e4m3 cache (per-KV-head k_scale / v_scale, the codes of
                     rotate(k) / k_scale and v / v_scale), beside the bf16-cache rows

Peers are the PyTorch code a model runs today (Hugging Face LlamaRMSNorm, F.silu(g) * u,
apply_rotary_pos_emb with rotate_half and precomputed cos/sin), eager and under torch.compile, and,
where they import, quack (quack-kernels, CuTe DSL: rmsnorm_fwd with and without the residual,
apply_rotary) and Liger-Kernel (Triton: RMSNorm, fused add + RMSNorm, SiLU-mul, the fused gate-up
SiLU-mul, RoPE of q and k). A peer that does not import is named on the progress lines and in
benchmark_env.json; one whose result differs from eager PyTorch by more than 0.1 is dropped from the
case and said so, never timed silently. quack's rotary takes one tensor per call, so rope_qk times
two calls; Liger's RoPE rotates q and k together and in place (timed on copies), so it has no rope_q.
qk_norm_rope and rope_append_kv have no fused counterpart in quack or Liger (both have the norm and
the rotary as separate kernels only), so their peers are eager PyTorch (Qwen3's RMSNorm and
apply_rotary_pos_emb; the rotation then an index_copy_ into the cache) and torch.compile of the same;
`unfused_us` times the unfused sequence of our own ops (rms_norm of q's and k's heads, then
apply_rotary; apply_rotary, then the two scatters). The fp8-cache rows have one more peer where it
imports: FlashInfer's rope_quantize_fp8_append_paged_kv_cache (`flashinfer`), which rotates with
an fp32 cos_sin_cache, quantizes with one scalar scale for every head (quant_scale_kv, a multiplier:
the rows use scale 1 on every head so both compute the same codes) and writes q in fp8 too (half our
q_out bytes: the row counts our bytes). When flashinfer does not import, the progress line and
benchmark_env.json say so and the rows have no flashinfer peer. The eager peer of the fp8 rows
rotates in the dtype, divides by the scale, clamps to +-448 and casts to float8_e4m3fn.
flashcpp runs out of place (same bytes as in place, and repeatable). Every number is a median of
interleaved rounds: `*_us` replays each call from a CUDA graph (kernel time: launch and Python
overhead removed for everyone alike), `*_eager_us` calls it from Python with triton's do_bench
(L2 flushed). Bytes that must move count each input read once and each output written once
(weights and cos/sin tables excluded: they are L2-resident); floor_us = bytes / 4.3 TB/s.
flashcpp is also timed with cuda_config="streaming" (evict-first cache hints): `streaming_us`.

Rotary fused into attention (rope_attention.csv): flash_attn_func(..., rotary=Rotary()) against
apply_rotary (ours) followed by flash_attn_func, causal bf16 at (4, 4096, 32, 128) and GQA shapes;
bar >= 1.05x, and the outputs must be equal bit for bit (`exact_vs_separate`). Beside it,
`separate_fa2_us` / `speedup_vs_rotary_fa2`: apply_rotary followed by FA2 (SDPA's flash backend),
the issue's own wording of the bar; `meets_bar` stays with the stricter comparison.

The bars of the issue: rmsnorm_residual >= 1.8x eager, swiglu >= 1.5x eager, every case >= 1.0x
torch.compile and >= 85% of the floor (floor_us / ours_us). The `meets_bar` column says yes/no.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Dict, List, Tuple

from .common import ceilings, environment, grouped_bars, interleaved, peer_value, progress, rep_ms_for, write_csv, write_json

HBM_TBPS = 4.3
EAGER_BAR = {"rmsnorm_residual": 1.8, "swiglu_fused": 1.5, "swiglu_two": 1.5}
COMPILE_BAR = 1.0
FLOOR_BAR = 0.85


def _cases(torch, quick: bool) -> List[Tuple[str, torch.dtype]]:
    names = ["rmsnorm_residual", "swiglu_fused", "rope_q", "qk_norm_rope", "rope_append_kv_decode",
             "rope_append_kv_fp8_decode"]
    if not quick:
        names += ["rmsnorm", "swiglu_two", "rope_qk", "rope_append_kv_prefill", "rope_append_kv_fp8_prefill"]
    cases = [(n, torch.bfloat16) for n in names]
    if not quick:
        cases += [(n, torch.float16) for n in ("rmsnorm_residual", "swiglu_fused", "rope_q")]
    return cases


def _extra_peers() -> Tuple[Dict[str, object], Dict[str, str]]:
    """quack's and Liger-Kernel's modules, when they import: ({name: modules}, {name: why not})."""
    mods: Dict[str, object] = {}
    why: Dict[str, str] = {}
    try:
        # The submodules: quack's package exports functions of the same names (rmsnorm, ...).
        q_rms, q_rot = importlib.import_module("quack.rmsnorm"), importlib.import_module("quack.rotary")
        mods["quack"] = {"rmsnorm": q_rms, "rotary": q_rot}
    except Exception as e:  # not installed, or a build for another torch / CUDA
        why["quack"] = f"{type(e).__name__}: {str(e)[:100]}"
    try:
        from liger_kernel.ops import fused_add_rms_norm as l_add, rms_norm as l_rms, rope as l_rope, swiglu as l_sw
        mods["liger"] = {"rmsnorm": l_rms, "add_rmsnorm": l_add, "swiglu": l_sw, "rope": l_rope}
    except Exception as e:
        why["liger"] = f"{type(e).__name__}: {str(e)[:100]}"
    try:
        from flashinfer.rope import rope_quantize_fp8_append_paged_kv_cache as fi_rope_fp8_append
        mods["flashinfer"] = {"rope_quantize_fp8_append_paged_kv_cache": fi_rope_fp8_append}
    except Exception as e:
        why["flashinfer"] = f"{type(e).__name__}: {str(e)[:100]}"
    return mods, why


def _build(name: str, dtype, torch, flashcpp, extra_mods: Dict[str, object] = None
           ) -> Tuple[Dict[str, object], Callable, Callable, float, Callable, Dict[str, Callable]]:
    """(shape columns, ours, peer function, bytes that must move, check, {extra peer: function}) for
    one case; the extra peers are quack's and Liger's calls on the same tensors (extra_mods: _extra_peers)."""
    import torch.nn.functional as F

    dev = "cuda"
    esize = 2
    eps = 1e-6
    quack = (extra_mods or {}).get("quack")
    liger = (extra_mods or {}).get("liger")
    extra: Dict[str, Callable] = {}
    if name.startswith("rmsnorm"):
        rows, hidden = 8192, 4096
        x = torch.randn(rows, hidden, device=dev, dtype=dtype)
        r = torch.randn(rows, hidden, device=dev, dtype=dtype)
        w = torch.randn(hidden, device=dev, dtype=dtype)
        y, ro = torch.empty_like(x), torch.empty_like(x)

        def hf_norm(h):  # transformers' LlamaRMSNorm.forward
            hf = h.float()
            var = hf.pow(2).mean(-1, keepdim=True)
            return w * (hf * torch.rsqrt(var + eps)).to(h.dtype)

        if name == "rmsnorm_residual":
            def peer():
                h = x + r
                return hf_norm(h), h

            def ours(cfg=""):
                return flashcpp.fused_add_rms_norm(x, r, w, eps, out=y, residual_out=ro, cuda_config=cfg)
            nbytes = 4 * rows * hidden * esize
            if quack:
                extra["quack"] = lambda: quack["rmsnorm"].rmsnorm_fwd(x, w, residual=r, eps=eps)[:2]
            if liger:
                extra["liger"] = lambda: liger["add_rmsnorm"].LigerFusedAddRMSNormFunction.apply(x, r, w, eps)
        else:
            def peer():
                return hf_norm(x)

            def ours(cfg=""):
                return flashcpp.rms_norm(x, w, eps, out=y, cuda_config=cfg)
            nbytes = 2 * rows * hidden * esize
            if quack:
                extra["quack"] = lambda: quack["rmsnorm"].rmsnorm_fwd(x, w, eps=eps)[0]
            if liger:
                extra["liger"] = lambda: liger["rmsnorm"].LigerRMSNormFunction.apply(x, w, eps)

        def check():
            o = ours()
            p = peer()
            o, p = (o if isinstance(o, tuple) else (o,)), (p if isinstance(p, tuple) else (p,))
            return max((a.float() - b.float()).abs().max().item() for a, b in zip(o, p))
        return {"rows": rows, "hidden": hidden}, ours, peer, nbytes, check, extra

    if name.startswith("swiglu"):
        rows, d = 8192, 14336
        out = torch.empty(rows, d, device=dev, dtype=dtype)
        if name == "swiglu_fused":
            x = torch.randn(rows, 2 * d, device=dev, dtype=dtype)

            def peer():
                return F.silu(x[:, :d]) * x[:, d:]

            def ours(cfg=""):
                return flashcpp.silu_and_mul(x, out=out, cuda_config=cfg)
            if liger:
                extra["liger"] = lambda: liger["swiglu"].LigerFusedGateUpSiLUMulFunction.apply(x)
        else:
            g = torch.randn(rows, d, device=dev, dtype=dtype)
            u = torch.randn(rows, d, device=dev, dtype=dtype)

            def peer():
                return F.silu(g) * u

            def ours(cfg=""):
                return flashcpp.silu_and_mul(g, u, out=out, cuda_config=cfg)
            if liger:
                extra["liger"] = lambda: liger["swiglu"].LigerSiLUMulFunction.apply(g, u)

        def check():
            return (ours().float() - peer().float()).abs().max().item()
        return {"rows": rows, "d": d}, ours, peer, 3 * rows * d * esize, check, extra

    if name == "qk_norm_rope" or name.startswith("rope_append_kv"):
        return _build_new_fusions(name, dtype, torch, flashcpp, (extra_mods or {}).get("flashinfer"))

    # rotary: Hugging Face apply_rotary_pos_emb with cos/sin precomputed in fp32, cast to the dtype
    b, s, hq, dh = 4, 4096, 32, 128
    hk = 8 if name == "rope_qk" else 0
    theta = 10000.0
    q = torch.randn(b, s, hq, dh, device=dev, dtype=dtype)
    k = torch.randn(b, s, hk, dh, device=dev, dtype=dtype) if hk else None
    qo = torch.empty_like(q)
    ko = torch.empty_like(k) if hk else None
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, device=dev, dtype=torch.float32) / dh)
    freqs = torch.arange(s, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype)[None, :, None, :], emb.sin().to(dtype)[None, :, None, :]

    # The same rotation from an fp32 [cos | sin] cache (the layout vLLM keeps), timed as a variant:
    # the peer reads a precomputed cos/sin too.
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()

    def rotate_half(t):
        return torch.cat([-t[..., dh // 2:], t[..., : dh // 2]], dim=-1)

    if quack:  # (seqlen, head_dim / 2) fp32 tables, neox halves
        qc_cos, qc_sin = freqs.cos().contiguous(), freqs.sin().contiguous()
        rot = quack["rotary"].apply_rotary
        extra["quack"] = (lambda: (rot(q, qc_cos, qc_sin), rot(k, qc_cos, qc_sin))) if hk else \
            (lambda: rot(q, qc_cos, qc_sin))
    if liger and hk:  # (batch, heads, seqlen, head_dim) views of copies: it rotates in place
        lq, lk = q.clone().transpose(1, 2), k.clone().transpose(1, 2)
        l_cos, l_sin = cos[:, :, 0, :], sin[:, :, 0, :]  # (1, seqlen, head_dim)
        extra["liger"] = lambda: tuple(t.transpose(1, 2) for t in
                                       liger["rope"].LigerRopeFunction.apply(lq, lk, l_cos, l_sin))
        extra["liger"].check_inputs = lambda: (lq.copy_(q.transpose(1, 2)), lk.copy_(k.transpose(1, 2)))

    if hk:
        def peer():
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        def ours(cfg=""):
            return flashcpp.apply_rotary(q, k, q_out=qo, k_out=ko, theta=theta, cuda_config=cfg)

        def ours_cache():
            return flashcpp.apply_rotary(q, k, q_out=qo, k_out=ko, cos_sin_cache=cache)
    else:
        def peer():
            return q * cos + rotate_half(q) * sin

        def ours(cfg=""):
            return flashcpp.apply_rotary(q, q_out=qo, theta=theta, cuda_config=cfg)[0]

        def ours_cache():
            return flashcpp.apply_rotary(q, q_out=qo, cos_sin_cache=cache)[0]
    ours.cache_variant = ours_cache

    def check():
        o, p = ours(), peer()
        o, p = (o if isinstance(o, tuple) else (o,)), (p if isinstance(p, tuple) else (p,))
        return max((a.float() - c.float()).abs().max().item() for a, c in zip(o, p))
    nbytes = 2 * b * s * (hq + hk) * dh * esize
    return {"batch": b, "seqlen": s, "heads_q": hq, "heads_k": hk, "head_dim": dh}, ours, peer, nbytes, check, extra


def _build_new_fusions(name: str, dtype, torch, flashcpp, flashinfer=None):
    """qk_norm_rope and rope_append_kv: (shape columns, ours, eager peer, bytes, check, {extra peer:
    function}); ours carries `unfused_variant`, the same result from our separate ops. The fp8-cache
    rows of rope_append_kv take FlashInfer's fused op as an extra peer (flashinfer: its module dict)."""
    dev, esize, eps, theta = "cuda", 2, 1e-6, 1000000.0
    dh = 128
    extra: Dict[str, Callable] = {}

    def rope_tables(positions):  # Hugging Face: cos/sin of the positions in fp32, cast to the dtype
        inv = 1.0 / theta ** (torch.arange(0, dh, 2, device=dev, dtype=torch.float32) / dh)
        emb = positions.float()[..., None] * inv
        emb = torch.cat([emb, emb], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate_half(t):
        return torch.cat([-t[..., dh // 2:], t[..., : dh // 2]], dim=-1)

    if name == "qk_norm_rope":  # Qwen3-8B: q_norm / k_norm over head_dim, then apply_rotary_pos_emb
        b, s, hq, hk = 4, 4096, 32, 8
        q = torch.randn(b, s, hq, dh, device=dev, dtype=dtype)
        k = torch.randn(b, s, hk, dh, device=dev, dtype=dtype)
        wq = 1 + 0.1 * torch.randn(dh, device=dev, dtype=dtype)
        wk = 1 + 0.1 * torch.randn(dh, device=dev, dtype=dtype)
        qo, ko, nq, nk = torch.empty_like(q), torch.empty_like(k), torch.empty_like(q), torch.empty_like(k)
        cos, sin = rope_tables(torch.arange(s, device=dev))
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]

        def norm(x, w):  # transformers' Qwen3RMSNorm
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def peer():
            qn, kn = norm(q, wq), norm(k, wk)
            return qn * cos + rotate_half(qn) * sin, kn * cos + rotate_half(kn) * sin

        def ours(cfg=""):
            return flashcpp.qk_norm_rope(q, k, wq, wk, eps=eps, theta=theta, q_out=qo, k_out=ko, cuda_config=cfg)

        def unfused():
            flashcpp.rms_norm(q.view(-1, dh), wq, eps, out=nq.view(-1, dh))
            flashcpp.rms_norm(k.view(-1, dh), wk, eps, out=nk.view(-1, dh))
            return flashcpp.apply_rotary(nq, nk, theta=theta, inplace=True)
        shape = {"batch": b, "seqlen": s, "heads_q": hq, "heads_k": hk, "head_dim": dh}
        nbytes = 2 * b * s * (hq + hk) * dh * esize
    else:  # rope_append_kv: the step's q and k rotated, k and v appended to a paged cache
        decode = name.endswith("decode")
        fp8 = "_fp8" in name  # an fp8 e4m3 cache with per-KV-head scales
        b, s, hq, hk, page = (256, 1, 32, 8, 16) if decode else (4, 2048, 32, 8, 16)
        ctx = 1000 if decode else 0  # keys already cached per sequence
        pages_per_seq = (ctx + s + page - 1) // page
        num_pages = b * pages_per_seq
        q = torch.randn(b, s, hq, dh, device=dev, dtype=dtype)
        k = torch.randn(b, s, hk, dh, device=dev, dtype=dtype)
        v = torch.randn(b, s, hk, dh, device=dev, dtype=dtype)
        cache_dtype = torch.float8_e4m3fn if fp8 else dtype
        k_cache = torch.zeros(num_pages, page, hk, dh, device=dev, dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        # Scale 1 on every head: FlashInfer takes one scalar for all heads, and the codes then equal
        # the values (e4m3's relative precision is the same at every scale above its subnormals).
        ks = torch.ones(hk, device=dev, dtype=torch.float32) if fp8 else None
        vs = ks
        table = torch.randperm(num_pages, device=dev, dtype=torch.int32).view(b, pages_per_seq)
        lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        slot = lens[:, None].long() + torch.arange(s, device=dev)[None, :]  # (b, s)
        flat = (table.long().gather(1, slot // page) * page + slot % page).view(-1)  # rows of the flat cache
        positions = slot.to(torch.int32).contiguous()
        cos, sin = rope_tables(slot)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        qo, qo2, kr = torch.empty_like(q), torch.empty_like(q), torch.empty_like(k)

        def to_cache(x, scale):  # the rows as the cache stores them (fp8: the codes of x / scale)
            if not fp8:
                return x
            y = (x.float() / scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            return y.view(torch.uint8)  # index_copy_ into the cache's bytes

        def put(cache, rows):
            (cache.view(torch.uint8) if fp8 else cache).view(-1, hk, dh).index_copy_(0, flat, rows.reshape(-1, hk, dh))

        def peer():
            qr, kq = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            put(k_cache, to_cache(kq, ks))
            put(v_cache, to_cache(v, vs))
            return qr, k_cache, v_cache

        def ours(cfg=""):
            out = flashcpp.rope_append_kv(k, v, k_cache, v_cache, lens, q, block_table=table, theta=theta,
                                          q_out=qo, k_scale=ks, v_scale=vs, cuda_config=cfg)
            return out, k_cache, v_cache

        def unfused():  # our apply_rotary, then the scatters (fp8: the eager quantization between)
            flashcpp.apply_rotary(q, k, positions, theta=theta, q_out=qo2, k_out=kr)
            put(k_cache, to_cache(kr, ks))
            put(v_cache, to_cache(v, vs))
            return qo2, k_cache, v_cache
        shape = {"batch": b, "seqlen": s, "heads_q": hq, "heads_k": hk, "head_dim": dh, "page_size": page}
        # read q, k, v; write q_out and the cache rows (one byte a code for fp8)
        nbytes = b * s * dh * (2 * hq * esize + 2 * hk * esize + 2 * hk * (1 if fp8 else esize))
        if fp8 and flashinfer is not None:
            extra["flashinfer"] = _flashinfer_rope_fp8_append(
                torch, flashinfer, q, k, v, k_cache, v_cache, table, slot, theta, b, s, hq, hk, dh, page)
    ours.unfused_variant = unfused

    def check():
        p = tuple(t.clone() for t in peer())
        o = ours()
        return _max_diff(o, p)
    return shape, ours, peer, nbytes, check, extra


def _flashinfer_rope_fp8_append(torch, fi, q, k, v, k_cache, v_cache, table, slot, theta, b, s, hq, hk, dh, page):
    """FlashInfer's rope_quantize_fp8_append_paged_kv_cache on the case's tensors (NHD pages of
    `page` keys, the same block table and slots, a cos_sin_cache of the same theta, scale 1): it
    returns q in fp8 (compared as its values) and the caches it wrote."""
    fn = fi["rope_quantize_fp8_append_paged_kv_cache"]
    dev = q.device
    max_pos = int(slot.max().item()) + 1
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, device=dev, dtype=torch.float64) / dh)
    ang = torch.arange(max_pos, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).float().contiguous()  # (max_pos, dh): [cos | sin]
    pos_ids = slot.reshape(-1).to(torch.int32).contiguous()
    kv_indices = table.reshape(-1).contiguous()
    kv_indptr = (torch.arange(b + 1, device=dev, dtype=torch.int32) * table.shape[1]).contiguous()
    batch_indices = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(s).contiguous()
    q3, k3, v3 = q.reshape(-1, hq, dh), k.reshape(-1, hk, dh), v.reshape(-1, hk, dh)
    q8 = torch.empty(q3.shape, device=dev, dtype=torch.float8_e4m3fn)

    def run():
        fn(q3, k3, None, None, v3, cos_sin, pos_ids, (k_cache, v_cache), kv_indices, kv_indptr, batch_indices,
           pos_ids, is_neox=True, quantize_dtype=torch.float8_e4m3fn, quant_scale_q=1.0, quant_scale_kv=1.0,
           page_size=page, kv_layout="NHD", q_rope_out=q8)
        return q8.view(q.shape), k_cache, v_cache
    return run


def _max_diff(a, b) -> float:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _checked_extra(extra: Dict[str, Callable], peer: Callable, case: str, tol: float = 0.1) -> Dict[str, Callable]:
    """The extra peers that run on this case and agree with eager PyTorch (max |diff| <= tol on these
    O(1) values); the others are named on a progress line and left out."""
    kept: Dict[str, Callable] = {}
    for name, fn in extra.items():
        try:
            if hasattr(fn, "check_inputs"):
                fn.check_inputs()  # in-place peers start from the case's inputs
            d = _max_diff(fn(), peer())
        except Exception as e:  # a peer that refuses a shape is reported, not hidden
            progress(f"  {name} unavailable for {case}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if not d <= tol:
            progress(f"  {name} dropped for {case}: max |diff| vs eager {d:.3e}")
            continue
        kept[name] = fn
    return kept


def run(quick: bool, out: str) -> int:
    import torch

    import flashcpp

    os.makedirs(out, exist_ok=True)
    env = environment()
    env.update(ceilings())
    rep_ms = rep_ms_for(quick)
    env["timing"] = f"cuda_graph_median and eager median, rep {rep_ms} ms, 3 interleaved rounds"
    progress(f"[bench fused] {env}")
    rows: List[Dict[str, object]] = []
    extra_mods, extra_why = _extra_peers()
    for nm in ("quack", "liger", "flashinfer"):
        what = " (the rope_append_kv fp8-cache rows have no FlashInfer peer)" if nm == "flashinfer" else ""
        progress(f"[bench fused] {nm}: " + ("imports" if nm in extra_mods else f"not timed{what} ({extra_why[nm]})"))
        env[nm] = "imports" if nm in extra_mods else f"not available{what}: {extra_why[nm]}"
    for name, dtype in _cases(torch, quick):
        torch.manual_seed(0)
        shape, ours, peer, nbytes, check, extra = _build(name, dtype, torch, flashcpp, extra_mods)
        compiled = torch.compile(peer)
        for _ in range(3):  # compile and warm up outside the timing
            compiled()
        diff = check()
        # fp8 caches (and FlashInfer's fp8 q): two roundings of one value may land one e4m3 step
        # apart, at most 0.5 below |x| = 8 (these inputs are standard normal).
        extra = _checked_extra(extra, peer, name, tol=0.6 if "_fp8" in name else 0.1)
        # flashcpp_streaming: the same kernels with evict-first cache hints (cuda_config
        # "streaming"), timed alongside so the default can be chosen from data.
        fns = {"flashcpp": ours, "flashcpp_streaming": lambda: ours("streaming"), "torch_eager": peer,
               "torch_compile": compiled}
        if hasattr(ours, "cache_variant"):
            fns["flashcpp_cache"] = ours.cache_variant
        if hasattr(ours, "unfused_variant"):
            fns["flashcpp_unfused"] = ours.unfused_variant
        fns.update(extra)
        t = interleaved(fns, rounds=3, graph=True, rep_ms=rep_ms)
        te = interleaved(fns, rounds=3, graph=False, rep_ms=rep_ms)
        dts = "bf16" if dtype == torch.bfloat16 else "fp16"
        cid = f"{name}_{'x'.join(str(v) for v in shape.values())}_{dts}"
        floor_us = nbytes / (HBM_TBPS * 1e12) * 1e6
        frac = floor_us / t["flashcpp"]
        line = [f"{cid:44s} ours {t['flashcpp']:8.1f} us {nbytes / t['flashcpp'] / 1e6:5.2f} TB/s ({100 * frac:4.1f}% of floor)"
                f" streaming {t['flashcpp_streaming']:8.1f} us"
                + (f" cos/sin cache {t['flashcpp_cache']:8.1f} us" if "flashcpp_cache" in t else "")
                + (f" unfused (our ops) {t['flashcpp_unfused']:8.1f} us" if "flashcpp_unfused" in t else "")]
        for p in ("torch_eager", "torch_compile") + tuple(extra):
            sp = t[p] / t["flashcpp"]
            bar = EAGER_BAR.get(name, 1.0) if p == "torch_eager" else COMPILE_BAR
            meets = sp >= bar and frac >= FLOOR_BAR
            rows.append({"case": cid, "peer": p, "ours_us": round(t["flashcpp"], 2), "peer_us": round(t[p], 2),
                         "speedup": round(sp, 3), "kernel": name, "dtype": dts, **shape,
                         "bytes": nbytes, "ours_tbps": round(nbytes / t["flashcpp"] / 1e6, 3),
                         "peer_tbps": round(nbytes / t[p] / 1e6, 3), "floor_us": round(floor_us, 2),
                         "frac_of_floor": round(frac, 3), "bar_speedup": bar, "meets_bar": "yes" if meets else "no",
                         "streaming_us": round(t["flashcpp_streaming"], 2),
                         "streaming_speedup": round(t[p] / t["flashcpp_streaming"], 3),
                         "cache_us": round(t["flashcpp_cache"], 2) if "flashcpp_cache" in t else "",
                         "unfused_us": round(t["flashcpp_unfused"], 2) if "flashcpp_unfused" in t else "",
                         "ours_eager_us": round(te["flashcpp"], 2), "peer_eager_us": round(te[p], 2),
                         "eager_speedup": round(te[p] / te["flashcpp"], 3), "max_abs_diff_vs_eager": f"{diff:.3e}",
                         "timing": "cuda_graph_median", "gpu": env["gpu"], "git_commit": env["git_commit"]})
            line.append(f"{p} {t[p]:8.1f} us ({sp:.2f}x{'' if meets else ' BELOW BAR'})")
        progress("  ".join(line) + f"  maxdiff {diff:.1e}")
        del ours, peer, compiled, fns
        torch.cuda.empty_cache()
    write_csv(os.path.join(out, "benchmark.csv"), rows)
    write_csv(os.path.join(out, "rope_attention.csv"), _rope_attention(torch, flashcpp, quick, env))
    write_json(os.path.join(out, "benchmark_env.json"), env)
    plot(rows, os.path.join(out, "benchmark.png"), env)
    progress(f"[bench fused] wrote {out}/benchmark.csv and {out}/benchmark.png")
    return 0


ROPE_ATTN_BAR = 1.05


def _rope_attention(torch, flashcpp, quick: bool, env: Dict[str, object]) -> List[Dict[str, object]]:
    """Rotary fused into attention vs apply_rotary (ours) then attention, causal bf16, default
    positions (theta 10000, neox over all of head_dim). `attn_only_us` is attention alone on
    unrotated inputs: fused - attn_only is what the in-kernel rotation costs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = [(4, 4096, 32, 32, 128), (4, 4096, 32, 8, 128), (8, 1024, 32, 8, 128), (16, 512, 32, 8, 128)]
    if quick:
        shapes = shapes[1:3]
    rows: List[Dict[str, object]] = []
    for b, s, hq, hk, d in shapes:
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        spec = flashcpp.Rotary()
        # The same rotation from an fp32 cos/sin table (two loads per pair instead of the fp64
        # angle reduction and sincos): what a model with a precomputed cache passes.
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float64) / d)
        ang = torch.arange(s, device="cuda", dtype=torch.float64)[:, None] * inv[None, :]
        cache = torch.cat([ang.cos(), ang.sin()], dim=1).float().contiguous()
        spec_cache = flashcpp.Rotary(cos_sin_cache=cache)

        def fused():
            return flashcpp.flash_attn_func(q, k, v, causal=True, rotary=spec)

        def fused_cache():
            return flashcpp.flash_attn_func(q, k, v, causal=True, rotary=spec_cache)

        def separate():
            flashcpp.apply_rotary(q, k, q_out=qo, k_out=ko)
            return flashcpp.flash_attn_func(qo, ko, v, causal=True)

        def attn_only():
            return flashcpp.flash_attn_func(q, k, v, causal=True)

        # The wording of the bar: the unfused rotary followed by FA2 (PyTorch's SDPA flash
        # backend, GQA through enable_gqa), beside the stricter comparison with our own attention.
        def separate_fa2():
            flashcpp.apply_rotary(q, k, q_out=qo, k_out=ko)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    qo.transpose(1, 2), ko.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=hq != hk)

        fns = {"fused": fused, "fused_cache": fused_cache, "separate": separate, "attn_only": attn_only}
        try:
            separate_fa2()
            fns["separate_fa2"] = separate_fa2
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape: said, not timed
            progress(f"[bench fused] rotary + FA2 (SDPA flash) not timed at {(b, s, hq, hk, d)}: {type(e).__name__}: {str(e)[:80]}")
        exact = bool(torch.equal(fused(), separate()))
        t = interleaved(fns, rounds=3, graph=True, rep_ms=rep_ms_for(quick))
        fa2 = t.get("separate_fa2")
        sp = t["separate"] / t["fused"]
        cid = f"rope_attn_b{b}_s{s}_h{hq}kv{hk}_d{d}_bf16_causal"
        rows.append({"case": cid, "batch": b, "seqlen": s, "heads_q": hq, "heads_k": hk, "head_dim": d,
                     "fused_us": round(t["fused"], 2), "fused_cache_us": round(t["fused_cache"], 2),
                     "separate_us": round(t["separate"], 2),
                     "attn_only_us": round(t["attn_only"], 2),
                     "rotary_overhead_us": round(t["fused"] - t["attn_only"], 2),
                     "separate_rotary_us": round(t["separate"] - t["attn_only"], 2),
                     "separate_fa2_us": round(fa2, 2) if fa2 else "",
                     "speedup_vs_rotary_fa2": round(fa2 / t["fused"], 3) if fa2 else "",
                     "speedup": round(sp, 3), "bar_speedup": ROPE_ATTN_BAR,
                     "meets_bar": "yes" if sp >= ROPE_ATTN_BAR else "no", "exact_vs_separate": "yes" if exact else "no",
                     "timing": "cuda_graph_median", "gpu": env["gpu"], "git_commit": env["git_commit"]})
        progress(f"{cid:44s} fused {t['fused']:8.1f} us (cos/sin cache {t['fused_cache']:8.1f})  separate "
                 f"{t['separate']:8.1f} us  attention alone "
                 f"{t['attn_only']:8.1f} us  ({sp:.3f}x{'' if sp >= ROPE_ATTN_BAR else ' BELOW BAR'}, "
                 f"exact {'yes' if exact else 'NO'})" +
                 (f"  rotary + FA2 {fa2:8.1f} us ({fa2 / t['fused']:.3f}x)" if fa2 else ""))
        del q, k, v, qo, ko
        torch.cuda.empty_cache()
    return rows


def plot(rows: List[Dict[str, object]], path: str, env: Dict[str, object]) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    series = {"flashcpp": lambda rs: rs[0]["ours_tbps"]}
    peers = ["torch_eager", "torch_compile"] + [p for p in ("quack", "liger") if any(r["peer"] == p for r in rows)]
    series.update({p: peer_value(p, "peer_tbps") for p in peers})
    lines = [(HBM_TBPS, dict(color="k", ls="--", lw=1, label=f"HBM {HBM_TBPS} TB/s (floor)")),
             (FLOOR_BAR * HBM_TBPS, dict(color="r", ls=":", lw=1, label=f"{int(100 * FLOOR_BAR)}% of the floor"))]
    if "copy_tbps" in env:
        lines.append((float(env["copy_tbps"]), dict(color="g", ls="-.", lw=1,
                                                    label=f"measured copy {env['copy_tbps']} TB/s")))
    grouped_bars(path, cases, rows, series, "TB/s of bytes that must move (CUDA-graph replay)",
                 f"Fused kernels on {env['gpu']} (torch {env['torch']}, {env['git_commit']})",
                 width_per_case=1.1, rotation=35, lines=lines, legend_fontsize=8)
