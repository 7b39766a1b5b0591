"""Decode attention: flashcpp's plan/run decode vs the decode paths PyTorch users have, one process.

    python -m flashcpp.bench decode [--quick] [--out reports/decode]
    python -m flashcpp.bench.decode [--quick] [--out reports/decode]
    python -m flashcpp.bench.decode --grid [--grid-max-seconds S | --grid-subset N] [--grid-dry-run] ...
        the decode grid (batch x context x heads x head_dim, contiguous / paged / ragged) against every
        decode peer: reports/decode/grid.csv and grid_heatmap.png (decode_grid.py says how)

Cases (bf16, D = 128 unless named):
  anchor   the four shapes of DESIGN.md's anchors: B=1 Hq=Hkv=32 N=8192; B=1 GQA 32/8 N=32768;
           B=16 GQA N=8192; B=64 GQA N=4096 (cuDNN 49 / 50 / 134 / 250 us on the anchor run)
  sweep    GQA 32/8 with batch * seqlen >= 32k tokens (the bandwidth bar)
  paged    page_size 1 / 16 / 64 / 256 (shuffled page order) vs the same step on a contiguous cache
  qlen4    4 query tokens per sequence (speculative decoding), bottom-right causal
  d64      the Llama-3.2-1B head shape (Hq 32, Hkv 8, D 64)
  ragged   16 sequences of random lengths in one 16k-slot cache

Implementations (all on the same KV bytes, CUDA-graph replays, medians of interleaved rounds):
  flashcpp                 BatchDecodeWithKVCache.plan(actual lengths) then run(): the kernel timed
  torch_cudnn, torch_flash SDPA's CUDNN / FLASH backends on q (B, Hq, q_len, D) and contiguous
                           (B, Hkv, N, D) K/V with enable_gqa=True, as the anchors were taken (that
                           run has no EFFICIENT time for GQA, which refuses enable_gqa); q_len 4 uses a
                           bottom-right causal mask; ragged lengths a key-padding mask
  flash_attn, flashinfer   flash_attn.flash_attn_with_kvcache / flashinfer's paged decode wrapper, when
                           they import (skipped and said so otherwise)
  flashcpp_prefill_naive   flashcpp's prefill kernel (flash_attn_func, seqlen_q = q_len) over the same
                           contiguous cache: the issue's ">= 3x the naive prefill path" bar
  flashcpp_contiguous      (paged cases) flashcpp on the contiguous copy of the same cache
  flashcpp_padded          (ragged case) flashcpp with every sequence at the full 16k (a padded cache)
  flashcpp_fused_merge     (anchor and sweep cases) our plan with fused_merge=True: the split kernel's
                           last CTA per (sequence, head) merges, no merge launch
  flashcpp_2x_splits       (anchor and sweep cases) our plan forced to twice the heuristic's splits

Columns per DESIGN.md; ours_tbps = K+V bytes the step must read / ours_us (peer_tbps likewise).
meets_bar: the issue's bars that apply to the row (listed in `bar`): >= 1.0x torch_cudnn on the
anchors, >= 3x flashcpp_prefill_naive, ours >= 85% of 4.3 TB/s once batch*seqlen >= 32k tokens,
paged ours_us <= 1.10 x contiguous for page_size >= 16; "n/a" where none applies.

Before timing, every flashcpp case is checked against an fp32 SDPA reference over the same keys
(max abs error printed; NaN fails at once); tolerance = 2 x (error of SDPA, default backend, in bf16
vs the same reference) + 1e-3 (flash-attn's rule). The checks go to bench_correctness.json; a
failed check prints CORRECTNESS FAIL (the case is still timed) and makes the exit code 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import re
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .common import ceilings, environment, interleaved, progress, write_csv, write_json

HBM_TBPS = 4.3
BW_FRAC_BAR = 0.85
BW_TOKENS = 32768
CUDNN_BAR = 1.0
NAIVE_BAR = 3.0
PAGED_SLACK = 1.10


class Case(NamedTuple):
    group: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen: int          # cache slots per sequence (= every length unless ragged)
    head_dim: int = 128
    seqlen_q: int = 1
    causal: bool = True  # bottom-right; the same as no mask for seqlen_q = 1
    page_size: int = 0
    ragged: bool = False

    @property
    def name(self) -> str:
        s = f"{self.group}_b{self.batch}_h{self.heads_q}kv{self.heads_kv}_n{self.seqlen}_d{self.head_dim}"
        if self.seqlen_q > 1:
            s += f"_q{self.seqlen_q}" + ("_causal" if self.causal else "")
        if self.page_size:
            s += f"_ps{self.page_size}"
        return s + "_bf16"


def _cases(quick: bool) -> List[Case]:
    anchors = [Case("anchor", 1, 32, 32, 8192), Case("anchor", 1, 32, 8, 32768), Case("anchor", 16, 32, 8, 8192),
               Case("anchor", 64, 32, 8, 4096)]
    sweep_full = [(2, 16384), (4, 8192), (8, 4096), (32, 1024), (128, 256), (4, 32768), (32, 8192)]
    sweep = [Case("sweep", b, 32, 8, n) for b, n in (sweep_full if not quick else [(4, 8192), (32, 1024)])]
    paged_shapes = [(16, 8192), (1, 32768)] if not quick else [(16, 8192)]
    paged = [Case("paged", b, 32, 8, n, page_size=ps) for b, n in paged_shapes for ps in (1, 16, 64, 256)]
    extra = [Case("qlen4", 16, 32, 8, 8192, seqlen_q=4, causal=True), Case("d64", 16, 32, 8, 8192, head_dim=64),
             Case("ragged", 16, 32, 8, 16384, ragged=True)]
    if not quick:
        extra.insert(2, Case("d64", 1, 32, 8, 32768, head_dim=64))
    return anchors + sweep + paged + extra


def _peers_available() -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Optional peer libraries: {name: module} and {name: why skipped}."""
    have: Dict[str, Any] = {}
    skipped: Dict[str, str] = {}
    try:
        from flash_attn import flash_attn_with_kvcache
        have["flash_attn"] = flash_attn_with_kvcache
    except Exception as e:  # ImportError, or a build for another torch
        skipped["flash_attn"] = f"does not import ({type(e).__name__}: {str(e)[:100]})"
    try:
        import flashinfer
        have["flashinfer"] = flashinfer
    except Exception as e:
        skipped["flashinfer"] = f"does not import ({type(e).__name__}: {str(e)[:100]})"
    return have, skipped


def _reference(torch, q, kc, vc, lens, causal):
    """fp32 SDPA per sequence over its first lens[b] keys (bottom-right causal mask), (B, Sq, Hq, D)."""
    import torch.nn.functional as F

    B, Sq, Hq, D = q.shape
    g = Hq // kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(lens[b])
        qb = q[b].float().transpose(0, 1)[None]                                     # (1, Hq, Sq, D)
        kb = kc[b, :n].float().transpose(0, 1).repeat_interleave(g, 0)[None]        # (1, Hq, n, D)
        vb = vc[b, :n].float().transpose(0, 1).repeat_interleave(g, 0)[None]
        mask = None
        if causal and Sq > 1:
            i = torch.arange(Sq, device=q.device)[:, None] + n - Sq
            mask = torch.arange(n, device=q.device)[None, :] <= i
        out[b] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)[0].transpose(0, 1)
    return out


def _bottom_right(torch, sq: int, n: int, device) -> Any:
    i = torch.arange(sq, device=device)[:, None] + n - sq
    return torch.arange(n, device=device)[None, :] <= i


# [headdims]'s decode bar: the TB/s at head dims 96 and 80 within 5% of the TB/s at 128, on the same
# steps (contiguous and paged, a mid batch and a long context); 64 beside them.
HEADDIM_CASES = [Case("hd", b, 32, 8, n, head_dim=d, page_size=ps)
                 for b, n in ((16, 8192), (4, 32768)) for ps in (0, 16) for d in (128, 96, 80, 64)]
HEADDIM_BAR = 0.95


def headdim_table(rows: List[Dict[str, object]]) -> List[str]:
    """Lines of TB/s at each head dim against head dim 128 on the same step, with the 5% bar."""
    ours = {str(r["case"]): float(r["ours_tbps"]) for r in rows}
    lines = []
    for name, tbps in ours.items():
        if "_d128_" in name:
            continue
        ref = ours.get(re.sub(r"_d\d+_", "_d128_", name))
        if ref:
            ratio = tbps / ref
            verdict = "beside" if "_d64_" in name else "meets" if ratio >= HEADDIM_BAR else "BELOW"
            lines.append(f"{name:44s} {tbps:5.2f} TB/s vs {ref:5.2f} at d128: {ratio:.3f}x  {verdict} (bar {HEADDIM_BAR})")
    return lines


def run(quick: bool, out: str, cases: Optional[List[Case]] = None) -> int:
    import torch

    import flashcpp

    if not torch.cuda.is_available() or not flashcpp.WITH_CUDA:
        progress("[bench decode] needs a CUDA device and a flashcpp build with FLASHCPP_CUDA=ON")
        return 2
    t_start = time.time()
    os.makedirs(out, exist_ok=True)
    rep_ms = 10 if quick else 20
    rounds = 2
    env = environment()
    env.update(ceilings())
    libs, skipped = _peers_available()
    env["peers_skipped"] = skipped
    env["timing"] = f"cuda_graph_median, rep {rep_ms} ms, {rounds} interleaved rounds"
    progress(f"[bench decode] {env}")
    for name, why in skipped.items():
        progress(f"[bench decode] peer {name} skipped: {why}")
    rows: List[Dict[str, object]] = []
    checks: List[Dict[str, object]] = []
    failed: List[str] = []

    for idx, c in enumerate(cases if cases is not None else _cases(quick)):
        case_rows, check = _run_case(c, idx, env, libs, rounds, rep_ms)
        rows += case_rows
        checks.append(check)
        if not check["pass"]:
            failed.append(c.name)
        torch.cuda.empty_cache()

    env["wall_s"] = round(time.time() - t_start, 1)
    write_csv(os.path.join(out, "benchmark.csv"), rows)
    write_json(os.path.join(out, "benchmark_env.json"), env)
    write_json(os.path.join(out, "bench_correctness.json"),
               {"environment": {"device": env["gpu"], "backend": "cuda", **env}, "cases": checks})
    plot(rows, os.path.join(out, "benchmark.png"), env)
    progress(f"[bench decode] wrote {out}/benchmark.csv, benchmark.png, bench_correctness.json in {env['wall_s']} s")
    _print_table(rows)
    for line in headdim_table(rows):  # steps that have a head-dim-128 twin (HEADDIM_CASES)
        progress(f"[bench decode] {line}")
    if failed:
        progress(f"[bench decode] CORRECTNESS FAILED: {', '.join(failed)}")
        return 1
    return 0


def _run_case(c: Case, idx: int, env: Dict[str, object], libs: Dict[str, Any], rounds: int, rep_ms: int,
              dev: str = "cuda") -> Tuple[List[Dict[str, object]], Dict[str, object]]:
    """Checks and times one case; returns its CSV rows and its correctness record."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcpp
    from flashcpp.decode import BatchDecodeWithKVCache

    dt = torch.bfloat16
    esize = 2
    rows: List[Dict[str, object]] = []
    B, Hq, Hkv, N, D, Sq = c.batch, c.heads_q, c.heads_kv, c.seqlen, c.head_dim, c.seqlen_q
    g = torch.Generator(device=dev).manual_seed(7000 + idx)
    kc = torch.randn(B, N, Hkv, D, device=dev, dtype=dt, generator=g)
    vc = torch.randn(B, N, Hkv, D, device=dev, dtype=dt, generator=g)
    q = torch.randn(B, Sq, Hq, D, device=dev, dtype=dt, generator=g)
    if c.ragged:
        gl = torch.Generator().manual_seed(99)
        lens_host = torch.randint(256, N + 1, (B,), generator=gl, dtype=torch.int32)
    else:
        lens_host = torch.full((B,), N, dtype=torch.int32)
    # cache_seqlens = keys before the step; no append here, so the step attends to lens keys
    lens = lens_host.to(dev)
    kv_bytes = int(lens_host.sum()) * Hkv * D * 2 * esize
    tokens = int(lens_host.sum())

    # ---- flashcpp (paged: pool of shuffled pages, same keys) ---------------------------
    o_ours = torch.empty_like(q)
    w = BatchDecodeWithKVCache()
    table = None
    kp = vp = None
    if c.page_size:
        ps = c.page_size
        pps = N // ps
        perm = torch.randperm(B * pps, generator=torch.Generator().manual_seed(5 + idx)).to(dev)
        table = perm.view(B, pps).to(torch.int32)
        kp = torch.empty(B * pps, ps, Hkv, D, device=dev, dtype=dt)
        vp = torch.empty_like(kp)
        kp[perm] = kc.view(B * pps, ps, Hkv, D)
        vp[perm] = vc.view(B * pps, ps, Hkv, D)
    info = w.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=N, page_size=c.page_size, cache_seqlens=lens_host,
                  causal=c.causal, dtype=dt, device=dev)
    if c.page_size:
        def ours():
            return w.run(q, kp, vp, lens, block_table=table, out=o_ours)
    else:
        def ours():
            return w.run(q, kc, vc, lens, out=o_ours)

    # ---- correctness, once, before timing ------------------------------------------------
    ours()
    if dev != "cpu":
        torch.cuda.synchronize(dev)
    ref = _reference(torch, q, kc, vc, lens_host, c.causal)
    got = o_ours.float()
    if not torch.isfinite(got).all():
        raise RuntimeError(f"[bench decode] {c.name}: flashcpp output has NaN/Inf ({info})")
    err = (got - ref).abs()
    max_err, mean_err = err.max().item(), err.mean().item()

    # ---- peers ------------------------------------------------------------------------------
    fns: Dict[str, Callable[[], object]] = {"flashcpp": ours}
    notes: Dict[str, str] = {}
    k_bhnd = vc_bhnd = None
    qt = q.transpose(1, 2)  # (B, Hq, Sq, D) view, as SDPA takes it
    mask = None
    if c.ragged:  # key padding: sequence b sees its first lens[b] keys
        mask = (torch.arange(N, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    elif Sq > 1 and c.causal:
        mask = _bottom_right(torch, Sq, N, dev)
    # the tolerance rule: error of SDPA (default backend) in bf16 vs the same fp32 reference
    sdpa_bf16 = F.scaled_dot_product_attention(qt, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask,
                                               enable_gqa=Hq != Hkv).transpose(1, 2)
    peer_err = (sdpa_bf16.float() - ref).abs().max().item()
    del sdpa_bf16
    if not c.page_size:
        k_bhnd = kc.transpose(1, 2).contiguous()  # SDPA gets contiguous (B, Hkv, N, D), as the anchors
        vc_bhnd = vc.transpose(1, 2).contiguous()
        for pname, be in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION), ("torch_flash", SDPBackend.FLASH_ATTENTION)):
            def f(be=be, mask=mask):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, k_bhnd, vc_bhnd, attn_mask=mask,
                                                          enable_gqa=Hq != Hkv)
            try:
                f()
                fns[pname] = f
            except Exception as e:  # a backend that refuses a case is reported, not hidden
                notes[pname] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        if c.ragged:  # the same step with every sequence padded to the cache (a static padded cache)
            o_pad = torch.empty_like(q)
            full = torch.full((B,), N, dtype=torch.int32)
            wp = BatchDecodeWithKVCache()
            wp.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=N, cache_seqlens=full, causal=c.causal, dtype=dt,
                    device=dev)
            full_dev = full.to(dev)
            fns["flashcpp_padded"] = lambda: wp.run(q, kc, vc, full_dev, out=o_pad)
        else:
            o_pf = torch.empty_like(q)

            def prefill(o_pf=o_pf):
                return flashcpp.attention(q, kc, vc, out=o_pf, causal=c.causal, backend="cuda")[0]
            try:
                prefill()
                fns["flashcpp_prefill_naive"] = prefill
            except Exception as e:
                notes["flashcpp_prefill_naive"] = f"refused: {type(e).__name__}: {str(e)[:100]}"
    else:
        o_c = torch.empty_like(q)
        wc = BatchDecodeWithKVCache()
        wc.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=N, cache_seqlens=lens_host, causal=c.causal, dtype=dt,
                device=dev)
        fns["flashcpp_contiguous"] = lambda: wc.run(q, kc, vc, lens, out=o_c)
    # Our own variants on the anchor and sweep shapes, for the split-KV design questions
    # (reports/decode "Where it loses"): the split kernel merging in its last CTA, and twice the
    # planned splits (more CTAs in flight per SM on the latency-bound B1-B8 problems).
    if c.group in ("anchor", "sweep") and not c.page_size and dev != "cpu":
        variants = {"flashcpp_fused_merge": dict(fused_merge=True)}
        if info.max_splits > 1 or N >= 4096:
            variants["flashcpp_2x_splits"] = dict(num_splits=2 * info.max_splits)
        for vname, kw in variants.items():
            wv, o_v = BatchDecodeWithKVCache(), torch.empty_like(q)
            try:
                wv.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=N, cache_seqlens=lens_host, causal=c.causal,
                        dtype=dt, device=dev, **kw)
                fv = (lambda wv=wv, o_v=o_v: wv.run(q, kc, vc, lens, out=o_v))
                fv()
                torch.cuda.synchronize(dev)
                gap = (o_v.float() - o_ours.float()).abs().max().item()
                if gap > 2 * peer_err + 1e-3:
                    notes[vname] = "differs from the default plan beyond the tolerance; not timed"
                    continue
                fns[vname] = fv
            except Exception as e:
                notes[vname] = f"refused: {type(e).__name__}: {str(e)[:100]}"
    if "flash_attn" in libs:
        fa = libs["flash_attn"]
        if c.page_size:
            fa_args = dict(block_table=table)
            fk, fv = kp, vp
        else:
            fa_args = {}
            fk, fv = kc, vc

        def fa_fn(fk=fk, fv=fv, fa_args=fa_args):
            return fa(q, fk, fv, cache_seqlens=lens, causal=c.causal, **fa_args)
        try:
            fa_fn()
            fns["flash_attn"] = fa_fn
        except Exception as e:
            notes["flash_attn"] = f"refused: {type(e).__name__}: {str(e)[:100]}"
    if "flashinfer" in libs:
        if Sq > 1:
            notes["flashinfer"] = "its decode wrapper takes one query token per sequence"
        else:
            try:
                fns["flashinfer"] = _flashinfer_fn(torch, libs["flashinfer"], q, kc, vc, kp, vp, table, lens_host,
                                                   c)
                fns["flashinfer"]()
            except Exception as e:
                fns.pop("flashinfer", None)
                notes["flashinfer"] = f"refused: {type(e).__name__}: {str(e)[:100]}"

    tol = 2 * peer_err + 1e-3
    ok = max_err <= tol
    check = {"name": c.name, "pass": ok, "max_abs_err": max_err, "mean_abs_err": mean_err, "tolerance": tol,
             "sdpa_bf16_max_abs_err": peer_err, "reference": "fp32 SDPA per sequence",
             "tolerance_rule": "2 x (SDPA bf16 error vs the reference) + 1e-3", "plan": repr(info)}
    if not ok:
        progress(f"  CORRECTNESS FAIL {c.name}: max abs err {max_err:.3e} > tolerance {tol:.3e}")
    del ref, got, err

    # ---- timing ---------------------------------------------------------------------------------
    t = interleaved(fns, rounds=rounds, graph=True, rep_ms=rep_ms)
    ours_us = t["flashcpp"]
    ours_tbps = kv_bytes / ours_us / 1e6
    line = [f"{c.name:44s} ours {ours_us:8.1f} us {ours_tbps:5.2f} TB/s  err {max_err:.1e}"]
    for peer, pus in t.items():
        if peer == "flashcpp":
            continue
        sp = pus / ours_us
        bars: List[str] = []
        verdicts: List[bool] = []
        if c.group == "anchor" and peer == "torch_cudnn":
            bars.append(f"cudnn>={CUDNN_BAR}x")
            verdicts.append(sp >= CUDNN_BAR)
        if peer == "flashcpp_prefill_naive":
            bars.append(f"naive_prefill>={NAIVE_BAR}x")
            verdicts.append(sp >= NAIVE_BAR)
        if peer == "flashcpp_contiguous" and c.page_size >= 16:
            bars.append(f"paged<={PAGED_SLACK}x_contiguous")
            verdicts.append(ours_us <= PAGED_SLACK * pus)
        if B * N >= BW_TOKENS and not c.ragged:
            bars.append(f"tbps>={BW_FRAC_BAR}x{HBM_TBPS}")
            verdicts.append(ours_tbps >= BW_FRAC_BAR * HBM_TBPS)
        meets = "n/a" if not verdicts else ("yes" if all(verdicts) else "no")
        rows.append({"case": c.name, "peer": peer, "ours_us": round(ours_us, 2), "peer_us": round(pus, 2),
                     "speedup": round(sp, 3), "batch": B, "heads_q": Hq, "heads_kv": Hkv, "seqlen_q": Sq,
                     "seqlen_k": N, "head_dim": D, "causal": int(c.causal), "dtype": "bf16",
                     "page_size": c.page_size, "ragged": int(c.ragged), "group": c.group,
                     "kv_tokens": tokens, "kv_bytes": kv_bytes, "ours_tbps": round(ours_tbps, 3),
                     "peer_tbps": round(kv_bytes / pus / 1e6, 3), "bar": ";".join(bars), "meets_bar": meets,
                     "max_abs_err": f"{max_err:.3e}", "splits": info.max_splits, "ctas": info.ctas,
                     "timing": "cuda_graph_median", "gpu": env["gpu"], "git_commit": env["git_commit"]})
        line.append(f"{peer} {pus:7.1f} ({sp:.2f}x{' BELOW BAR' if meets == 'no' else ''})")
    for peer, why in notes.items():
        line.append(f"[{peer}: {why}]")
    progress("  ".join(line))
    return rows, check


def _flashinfer_fn(torch, flashinfer, q, kc, vc, kp, vp, table, lens_host, c: Case) -> Callable[[], object]:
    """flashinfer's paged decode wrapper (CUDA-graph mode, static buffers) on the same keys: the paged
    pool of a paged case, or the contiguous cache viewed as in-order pages of 16 keys (no copy)."""
    B, Hq, Hkv, N, D = c.batch, c.heads_q, c.heads_kv, c.seqlen, c.head_dim
    dev = q.device
    if c.page_size:
        ps, pk, pv = c.page_size, kp, vp
        pages = table.to(torch.int32)
    else:
        ps = 16
        pk, pv = kc.view(B * N // ps, ps, Hkv, D), vc.view(B * N // ps, ps, Hkv, D)
        pages = torch.arange(B * N // ps, device=dev, dtype=torch.int32).view(B, N // ps)
    n_pages = [(int(n) + ps - 1) // ps for n in lens_host]
    indptr = torch.tensor([0] + list(_cumsum(n_pages)), dtype=torch.int32, device=dev)
    indices = torch.cat([pages[b, :n_pages[b]] for b in range(B)]).contiguous()
    last = torch.tensor([int(n) - (p - 1) * ps for n, p in zip(lens_host, n_pages)], dtype=torch.int32, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True,
                                                      use_tensor_cores=False,
                                                      paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                                                      paged_kv_last_page_len_buffer=last)
    w.plan(indptr, indices, last, Hq, Hkv, D, ps, pos_encoding_mode="NONE", q_data_type=q.dtype,
           kv_data_type=q.dtype)
    q3 = q[:, 0]
    o = torch.empty_like(q3)

    def fn():
        return w.run(q3, (pk, pv), out=o)
    fn.keep = (ws, indptr, indices, last)  # the wrapper reads these buffers at run time
    return fn


def _cumsum(xs: List[int]) -> List[int]:
    s, out = 0, []
    for x in xs:
        s += x
        out.append(s)
    return out


def _print_table(rows: List[Dict[str, object]]) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    short = {"torch_cudnn": "cudnn", "torch_flash": "flash", "flashcpp_prefill_naive": "naive",
             "flashcpp_contiguous": "contig", "flashcpp_padded": "padded", "flash_attn": "fa", "flashinfer": "fi",
             "flashcpp_fused_merge": "fmerge", "flashcpp_2x_splits": "2xsplit"}
    head = f"{'case':44s} {'ours_us':>8s} {'TB/s':>5s} " + " ".join(f"{short.get(p, p):>8s}" for p in peers) + "  bar"
    progress("")
    progress("speedup = peer_us / ours_us (above 1: flashcpp faster); '!' = below the issue's bar")
    progress(head)
    for cname in cases:
        rs = {r["peer"]: r for r in rows if r["case"] == cname}
        r0 = next(iter(rs.values()))
        cells = []
        for p in peers:
            r = rs.get(p)
            cells.append(f"{'-':>8s}" if r is None else f"{r['speedup']:7.2f}{'!' if r['meets_bar'] == 'no' else ' '}")
        verdicts = {r["meets_bar"] for r in rs.values()}
        bar = "no" if "no" in verdicts else ("yes" if "yes" in verdicts else "n/a")
        progress(f"{cname:44s} {r0['ours_us']:8.1f} {r0['ours_tbps']:5.2f} " + " ".join(cells) + f"  {bar}")


def plot(rows: List[Dict[str, object]], path: str, env: Dict[str, object]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    impls = ["flashcpp"] + peers
    vals: Dict[str, List[float]] = {i: [] for i in impls}
    for cname in cases:
        rs = [r for r in rows if r["case"] == cname]
        vals["flashcpp"].append(float(rs[0]["ours_tbps"]))
        for p in peers:
            m = [r for r in rs if r["peer"] == p]
            vals[p].append(float(m[0]["peer_tbps"]) if m else 0.0)
    fig, ax = plt.subplots(figsize=(max(10, len(cases) * 0.8), 5.5))
    w = 0.8 / len(impls)
    for i, name in enumerate(impls):
        ax.bar([x + (i - (len(impls) - 1) / 2) * w for x in range(len(cases))], vals[name], w, label=name)
    ax.axhline(HBM_TBPS, color="k", ls="--", lw=1, label=f"HBM {HBM_TBPS} TB/s")
    ax.axhline(BW_FRAC_BAR * HBM_TBPS, color="r", ls=":", lw=1, label=f"{int(100 * BW_FRAC_BAR)}% of {HBM_TBPS} TB/s")
    if "copy_tbps" in env:
        ax.axhline(float(env["copy_tbps"]), color="g", ls="-.", lw=1, label=f"measured copy {env['copy_tbps']} TB/s")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace("_bf16", "") for c in cases], rotation=50, ha="right", fontsize=7)
    ax.set_ylabel("TB/s of K+V read (CUDA-graph replay)")
    ax.set_title(f"Decode on {env['gpu']} (torch {env['torch']}, cuDNN {env['cudnn']}, {env['git_commit']})", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    """The decode bench's own command line: the cases above, or (--grid) the decode grid."""
    t0 = time.time()
    from . import decode_grid

    ap = argparse.ArgumentParser(prog="python -m flashcpp.bench.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the decode cases' --quick subset (not the grid)")
    ap.add_argument("--out", default="reports/decode", help="report folder (default reports/decode)")
    ap.add_argument("--grid", action="store_true", help="time the decode grid instead of the cases")
    ap.add_argument("--grid-subset", type=int, default=None, metavar="N",
                    help="the first N points of the stratified order (at least the prefix covering every class, "
                         "batch, context and layout)")
    ap.add_argument("--grid-max-seconds", type=float, default=None, metavar="S",
                    help="start no point that would end past S seconds after start; write what finished")
    ap.add_argument("--grid-repeats", type=int, default=5, metavar="R", help="timed replays per peer and point")
    ap.add_argument("--grid-peers", default=",".join(decode_grid.PEERS),
                    help=f"comma-separated peers (default {','.join(decode_grid.PEERS)})")
    ap.add_argument("--grid-dry-run", action="store_true",
                    help="no GPU: print the selection and the estimate, write grid_plan.csv")
    args = ap.parse_args(argv)
    peers = [x for x in args.grid_peers.split(",") if x]
    unknown = [x for x in peers if x not in decode_grid.PEERS]
    if unknown:
        ap.error(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(decode_grid.PEERS)}")
    if args.grid_repeats < 1:
        ap.error("--grid-repeats must be at least 1")
    if args.grid_dry_run:
        return decode_grid.dry_run(args.out, args.grid_subset, args.grid_max_seconds, args.grid_repeats, peers)
    from .__main__ import _no_gpu_reason
    reason = _no_gpu_reason()
    if reason is not None:
        print(f"python -m flashcpp.bench.decode: {reason}.", file=sys.stderr)
        return 2
    if args.grid:
        return decode_grid.run_grid(args.out, subset=args.grid_subset, max_seconds=args.grid_max_seconds,
                                    repeats=args.grid_repeats, peers=peers, t0=t0)
    return run(quick=args.quick, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
