"""Fused masks: flashcpp vs FlexAttention (torch.compile'd, same masks as BlockMask / score_mod),
vs FlashAttention-4 where it expresses the mask natively (window, softcap, document as varlen; when
flash_attn.cute imports) and vs SDPA with the equivalent dense attn_mask, one process,
(2, 16, 8192, 128) bf16.

Cases (causal except block_sparse; bottom-right = top-left here since seqlen_q == seqlen_k):
  window        sliding window: key j visible to query i iff i - 1024 <= j <= i
  document      3 packed documents per sequence (4096, 2560, 1536 tokens), causal inside each;
                flashcpp runs it as varlen (cu_seqlens over the 2 x 3 documents)
  alibi         causal + ALiBi bias slope_h * (j - i), BLOOM slopes for 16 heads
  window_global window 1024 plus 64 global keys (attention sinks: keys j < 64 ignore the window)
  softcap       causal + Gemma-2 logit softcap 50 * tanh(s / 50)
  block_sparse  random block-sparse mask of 128x128 blocks, not causal: each off-diagonal block
                listed with probability 0.5 (a tenth of the listed ones partial: a triangle of
                element bits), every diagonal block partial (no query row is empty); flashcpp
                gets it as a BlockSparse built from the mask function, Flex as the BlockMask
                create_block_mask builds from the same function
  document_bs   the document case as a 128x128 block-sparse mask (document_block_sparse over one
                sequence's 3 documents, causal inside each, shared by the batch) instead of varlen

TFLOP/s = 4 * B * H * D * (visible (i, j) pairs per (batch, head)), the pairs counted exactly from
the mask (DESIGN.md: a mask that skips work shows it). Timing: medians of interleaved rounds of
CUDA-graph replays (launch and Python overhead removed for everyone alike), as bench/prefill.py.
Before timing, every implementation's output (flashcpp on both kernel families, Flex, SDPA) is
checked against a dense fp32 reference (SDPA with the dense mask / bias, or the softcap written
out) on batch 0 and two heads; a case whose check fails is reported, its bar marked unmet.

Bars (issue #6): flashcpp >= 1.0x Flex on every case, >= 8x SDPA-with-a-dense-mask on window;
issue [fa4]: >= 1.0x FA4 where FA4 runs the mask.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

from .common import ceilings, environment, fa4, interleaved, progress, rep_ms_for, write_csv, write_json

B, H, N, D = 2, 16, 8192, 128
WINDOW = 1024
GLOBAL = 64
SOFTCAP = 50.0
DOCS = (4096, 2560, 1536)
BS_BLOCK = 128     # block-sparse cases: 128x128 blocks (every kernel config's tiles divide them)
BS_DENSITY = 0.5   # block_sparse: probability that an off-diagonal block is listed
BS_PARTIAL = 0.1   # block_sparse: share of the listed off-diagonal blocks that are partial
BS_SEED = 7
CASES = ["window", "document", "alibi", "window_global", "softcap", "block_sparse", "document_bs"]
QUICK = ["window", "document", "block_sparse"]
SPARSE_CASES = ("block_sparse", "document_bs")
FLEX_BAR, SDPA_BAR, FA4_BAR = 1.0, 8.0, 1.0
FA4_CASES = ("window", "softcap", "document")  # the masks FA4 takes as arguments (window_size, softcap, varlen)
CHECK_ATOL = 2e-2  # bf16 output vs an fp32 reference (max over batch 0, two heads)


# ---- exact pair counts -------------------------------------------------------------------------

def visible_pairs(case: str) -> int:
    """Visible (query, key) pairs of one (batch, head), from the mask's definition."""
    import numpy as np
    i = np.arange(N, dtype=np.int64)
    if case in ("alibi", "softcap"):
        return int((i + 1).sum())
    if case == "window":
        return int((np.minimum(i, WINDOW) + 1).sum())
    if case == "window_global":
        lo = np.maximum(i - WINDOW, 0)                   # window [lo, i]
        sinks = np.minimum(GLOBAL, lo)                   # global keys below the window
        return int((i - lo + 1 + sinks).sum())
    if case in ("document", "document_bs"):
        return int(sum(n * (n + 1) // 2 for n in DOCS))
    if case == "block_sparse":
        return block_sparse_pairs(block_kinds())
    raise ValueError(case)


def mask_description(case: str) -> str:
    return {"window": f"causal sliding window {WINDOW}", "document": f"causal document mask {DOCS}",
            "alibi": "causal + ALiBi (BLOOM slopes)", "window_global": f"window {WINDOW} + {GLOBAL} global keys",
            "softcap": f"causal + softcap {SOFTCAP:g}",
            "block_sparse": f"random block-sparse {BS_BLOCK}x{BS_BLOCK}, {BS_DENSITY:g} of the blocks, "
                            f"{BS_PARTIAL:g} of them partial, diagonal blocks partial",
            "document_bs": f"causal document mask {DOCS} as block-sparse {BS_BLOCK}x{BS_BLOCK}"}[case]


# ---- the block-sparse cases ------------------------------------------------------------------------

def block_kinds(n: int = N, block: int = BS_BLOCK, seed: int = BS_SEED):
    """The block_sparse case's (ceil(n / block),) * 2 int8 grid (numpy): 0 hidden, 1 visible,
    2 partial. A partial block shows key column c to query row r (within the block) iff c <= r,
    so a diagonal block, partial always, lets every query see itself (no empty row: the dense
    SDPA reference would give NaN there)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    nb = -(-n // block)
    u = rng.random((nb, nb))
    kinds = np.where(u < BS_DENSITY * (1 - BS_PARTIAL), 1, np.where(u < BS_DENSITY, 2, 0)).astype(np.int8)
    np.fill_diagonal(kinds, 2)
    return kinds


def block_sparse_mask_fn(kinds, block: int = BS_BLOCK):
    """mask(q_idx, kv_idx) of the block_sparse case over broadcastable index arrays: numpy with a
    numpy `kinds` (flashcpp's builder), torch with a torch `kinds` (Flex's mask_mod, the dense
    reference)."""
    def mask(q, kv):
        kind = kinds[q // block, kv // block]
        return (kind == 1) | ((kind == 2) & (kv % block <= q % block))
    return mask


def block_sparse_pairs(kinds, n: int = N, block: int = BS_BLOCK) -> int:
    """Visible pairs of the block_sparse mask, counted per block (ragged last blocks included)."""
    import numpy as np
    sizes = np.minimum(block, n - block * np.arange(kinds.shape[0]))  # rows (= columns) per block
    r, c = sizes[:, None], sizes[None, :]
    # partial: pairs (row, col) with col <= row inside an r x c block
    tri = np.where(c >= r, r * (r + 1) // 2, c * (c + 1) // 2 + (r - c) * c)
    return int(np.where(kinds == 1, r * c, np.where(kinds == 2, tri, 0)).sum())


def build_block_sparse(case: str, n: int = N, block: int = BS_BLOCK, docs=DOCS):
    """flashcpp's host BlockSparse of a block-sparse case (one mask for every batch and head)."""
    import numpy as np

    import flashcpp
    if case == "block_sparse":
        kinds = block_kinds(n, block)
        return flashcpp.block_sparse_from_mask(block_sparse_mask_fn(kinds, block), block, block,
                                               seqlen_q=n, seqlen_k=n)
    if case == "document_bs":
        assert sum(docs) == n, f"documents {docs} must fill the sequence of {n}"
        cu = np.concatenate([[0], np.cumsum(docs)]).astype(np.int32)
        return flashcpp.document_block_sparse(cu, cu, block, block, causal=True)
    raise ValueError(case)


# ---- the masks as functions (Flex mask_mod / score_mod, and the dense reference) ----------------

def make_masks(case: str, doc_id, slopes, kinds=None):
    """(mask_mod, score_mod) for FlexAttention; either may be None. `kinds`: block_kinds() as a
    torch tensor on the device (block_sparse)."""
    import torch

    def causal(b, h, q, kv):
        return q >= kv

    if case == "window":
        return (lambda b, h, q, kv: (q >= kv) & (q - kv <= WINDOW)), None
    if case == "window_global":
        return (lambda b, h, q, kv: (q >= kv) & ((q - kv <= WINDOW) | (kv < GLOBAL))), None
    if case in ("document", "document_bs"):
        return (lambda b, h, q, kv: (doc_id[q] == doc_id[kv]) & (q >= kv)), None
    if case == "block_sparse":
        fn = block_sparse_mask_fn(kinds)
        return (lambda b, h, q, kv: fn(q, kv)), None
    if case == "alibi":
        return causal, (lambda score, b, h, q, kv: score + slopes[h] * (kv - q).to(score.dtype))
    if case == "softcap":
        return causal, (lambda score, b, h, q, kv: SOFTCAP * torch.tanh(score / SOFTCAP))
    raise ValueError(case)


def dense_visibility(case: str, doc_id, device, kinds=None):
    import torch
    i = torch.arange(N, device=device)[:, None]
    j = torch.arange(N, device=device)[None, :]
    if case == "block_sparse":
        return block_sparse_mask_fn(kinds)(i, j)
    vis = j <= i
    if case == "window":
        vis &= i - j <= WINDOW
    elif case == "window_global":
        vis &= (i - j <= WINDOW) | (j < GLOBAL)
    elif case in ("document", "document_bs"):
        vis &= doc_id[:, None] == doc_id[None, :]
    return vis


def reference_heads(case: str, q, k, v, heads, vis, slopes, scale: float):
    """fp32 reference of batch 0 for `heads`, (N, len(heads), D): SDPA with the dense mask (and
    the ALiBi bias as an additive float mask), or for softcap the softmax written out."""
    import torch
    import torch.nn.functional as F
    outs = []
    for h in heads:
        qh, kh, vh = (x[0, :, h].float() for x in (q, k, v))
        if case == "softcap":
            s = (qh @ kh.T) * scale
            s = SOFTCAP * torch.tanh(s / SOFTCAP)
            s = s.masked_fill(~vis, float("-inf"))
            o = torch.softmax(s, dim=-1) @ vh
            del s
        else:
            bias = torch.zeros(N, N, device=q.device, dtype=torch.float32).masked_fill(~vis, float("-inf"))
            if case == "alibi":
                i = torch.arange(N, device=q.device, dtype=torch.float32)
                bias += float(slopes[h]) * (i[None, :] - i[:, None])
            o = F.scaled_dot_product_attention(qh[None, None], kh[None, None], vh[None, None], attn_mask=bias,
                                               scale=scale)[0, 0]
            del bias
        outs.append(o)
    return torch.stack(outs, dim=1)


# ---- the run ---------------------------------------------------------------------------------------

def run(quick: bool, out: str) -> int:
    import torch
    import torch.nn.functional as F

    import flashcpp

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex_compiled = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # a torch without FlexAttention: the flex rows are left out, and said so
        progress(f"[bench masks] FlexAttention unavailable: {type(e).__name__}: {e}")
        flex_compiled = create_block_mask = None

    fa4_fn, fa4_ver = fa4()
    fa4_varlen = None
    if fa4_fn is not None:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    progress("[bench masks] fa4: " + (f"flash-attn-4 {fa4_ver}" if fa4_fn else f"does not import, not timed ({fa4_ver})"))

    os.makedirs(out, exist_ok=True)
    env = environment()
    env["fa4"] = fa4_ver if fa4_fn else f"not available: {fa4_ver}"
    env.update(ceilings())
    rep_ms = rep_ms_for(quick)
    env["timing"] = f"cuda_graph_median, rep {rep_ms} ms, 2 interleaved rounds"
    progress(f"[bench masks] {env}")
    dev = "cuda"
    dtype = torch.bfloat16
    scale = 1.0 / D ** 0.5
    g = torch.Generator(device=dev).manual_seed(6)
    q, k, v = (torch.randn(B, N, H, D, device=dev, dtype=dtype, generator=g) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # (B, H, N, D) for Flex and SDPA
    slopes = flashcpp.alibi_slopes(H, device=dev)
    doc_id = torch.repeat_interleave(torch.arange(len(DOCS), device=dev), torch.tensor(DOCS, device=dev))
    cu = torch.tensor([0] + [sum(DOCS[:i + 1]) + b * N for b in range(B) for i in range(len(DOCS))],
                      device=dev, dtype=torch.int32)
    kinds = torch.from_numpy(block_kinds()).to(dev)
    o_auto, o_sm80 = torch.empty_like(q), torch.empty_like(q)
    hopper = torch.cuda.get_device_capability()[0] == 9

    def ours(case: str, config: str, o, sparse) -> Callable[[], object]:
        if case in SPARSE_CASES:  # the whole mask is in the block-sparse arrays
            return lambda: flashcpp.attention(q, k, v, out=o, block_sparse=sparse, backend="cuda",
                                              cuda_config=config)[0]
        kw: Dict[str, object] = dict(out=o, causal=True, backend="cuda", cuda_config=config)
        if case in ("window", "window_global"):
            kw["window_size"] = (WINDOW, 0)
        if case == "window_global":
            kw["global_tokens"] = GLOBAL
        if case == "alibi":
            kw["alibi_slopes"] = slopes
        if case == "softcap":
            kw["softcap"] = SOFTCAP
        if case == "document":  # packed: the 2 x 3 documents as 6 varlen sequences
            qv, kv, vv, ov = (x.view(B * N, H, D) for x in (q, k, v, o))
            kw.update(out=ov, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(DOCS), max_seqlen_k=max(DOCS))
            return lambda: flashcpp.attention(qv, kv, vv, **kw)[0]
        return lambda: flashcpp.attention(q, k, v, **kw)[0]

    def select(case: str, sparse):
        """The automatic kernel choice for the case (what "flashcpp" runs)."""
        if case in SPARSE_CASES:
            return flashcpp.select_kernel(q, k, v, block_sparse=sparse, backend="cuda")
        kw: Dict[str, object] = dict(causal=True, backend="cuda")
        if case in ("window", "window_global"):
            kw["window_size"] = (WINDOW, 0)
        if case == "alibi":
            kw["alibi_slopes"] = slopes
        if case == "softcap":
            kw["softcap"] = SOFTCAP
        if case == "document":
            qv, kv, vv = (x.view(B * N, H, D) for x in (q, k, v))
            return flashcpp.select_kernel(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(DOCS),
                                          max_seqlen_k=max(DOCS), **kw)
        return flashcpp.select_kernel(q, k, v, **kw)

    rows: List[Dict[str, object]] = []
    checks: List[Dict[str, object]] = []
    summary: List[Tuple[str, Dict[str, float], Dict[str, object]]] = []
    heads = (0, H - 1)
    for case in (QUICK if quick else CASES):
        progress(f"[bench masks] {case}: {mask_description(case)}")
        pairs = visible_pairs(case)
        flops = 4.0 * B * H * D * pairs
        sparse = None
        if case in SPARSE_CASES:  # built on the host once, then moved to the GPU once
            host = build_block_sparse(case)
            assert host.visible_pairs == pairs, f"{case}: the built mask has {host.visible_pairs} pairs, not {pairs}"
            progress(f"  block-sparse {host.block_m}x{host.block_n}: {host.num_blocks} blocks listed "
                     f"({host.block_density:.1%}), {host.num_blocks - host.num_full_blocks} partial")
            sparse = host.to(dev)
        fns: Dict[str, Callable[[], object]] = {"flashcpp": ours(case, "", o_auto, sparse),
                                                "flashcpp_sm80": ours(case, "sm80", o_sm80, sparse)}
        choice = select(case, sparse)
        mask_mod, score_mod = make_masks(case, doc_id, slopes, kinds)
        if flex_compiled is not None:
            try:
                bm = create_block_mask(mask_mod, None, None, N, N, device=dev)
                fns["flex"] = lambda bm=bm, sm=score_mod: flex_compiled(qt, kt, vt, score_mod=sm, block_mask=bm)
                fns["flex"]()  # compile outside the timing
            except Exception as e:
                progress(f"  flex unavailable for {case}: {type(e).__name__}: {str(e)[:160]}")
                fns.pop("flex", None)
        if fa4_fn is not None and case in FA4_CASES:
            def f4(case=case):
                with torch.no_grad():
                    if case == "document":
                        qv, kv, vv = (x.view(B * N, H, D) for x in (q, k, v))
                        return fa4_varlen(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(DOCS),
                                          max_seqlen_k=max(DOCS), causal=True)[0]
                    kw = {"window_size": (WINDOW, 0)} if case == "window" else {"softcap": SOFTCAP}
                    return fa4_fn(q, k, v, causal=True, **kw)[0]
            try:
                f4()  # compile outside the timing
                fns["fa4"] = f4
            except Exception as e:
                progress(f"  fa4 unavailable for {case}: {type(e).__name__}: {str(e)[:160]}")
        vis = dense_visibility(case, doc_id, dev, kinds)
        if case == "window":  # the dense-mask route users fall back to
            fns["sdpa_dense"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=vis)

        # ---- correctness before timing: batch 0, two heads, vs the dense fp32 reference ----------
        ref = reference_heads(case, q, k, v, heads, vis, slopes, scale)
        errs: Dict[str, float] = {}
        for name, fn in fns.items():
            o = fn()
            o = o.transpose(1, 2) if name in ("flex", "sdpa_dense") else o.view(B, N, H, D)
            got = o[0][:, list(heads)].float()
            errs[name] = float((got - ref).abs().max().item()) if torch.isfinite(got).all() else float("inf")
            checks.append({"name": f"{case}/{name}", "pass": errs[name] <= CHECK_ATOL, "max_abs_err": errs[name],
                           "tolerance": CHECK_ATOL, "mask": mask_description(case)})
            progress(f"  check {name:14s} max |err| {errs[name]:.2e} {'ok' if errs[name] <= CHECK_ATOL else 'FAIL'}")
        del ref

        t = interleaved(fns, graph=True, rep_ms=rep_ms)
        ours_ok = errs["flashcpp"] <= CHECK_ATOL
        tf = {n: flops / us / 1e6 for n, us in t.items()}
        for peer in ("flex", "fa4", "sdpa_dense"):
            if peer not in t:
                continue
            bar = {"flex": FLEX_BAR, "fa4": FA4_BAR, "sdpa_dense": SDPA_BAR}[peer]
            speedup = t[peer] / t["flashcpp"]
            rows.append({"case": f"b{B}_h{H}_n{N}_d{D}_{case}", "peer": peer, "ours_us": round(t["flashcpp"], 2),
                         "peer_us": round(t[peer], 2), "speedup": round(speedup, 3), "batch": B, "heads_q": H,
                         "heads_kv": H, "seqlen_q": N, "seqlen_k": N, "head_dim": D,
                         "causal": int(case != "block_sparse"), "mask": case,
                         "mask_description": mask_description(case), "dtype": "bf16", "visible_pairs": pairs,
                         "ours_tflops": round(tf["flashcpp"], 1), "peer_tflops": round(tf[peer], 1),
                         "ours_kernel": choice.kernel, "ours_config": choice.config,
                         "sm80_us": round(t["flashcpp_sm80"], 2), "sm80_tflops": round(tf["flashcpp_sm80"], 1),
                         "sm80_speedup": round(t[peer] / t["flashcpp_sm80"], 3), "bar": bar,
                         "meets_bar": bool(ours_ok and errs.get(peer, 0.0) <= CHECK_ATOL and speedup >= bar),
                         "max_abs_err_ours": f"{errs['flashcpp']:.3e}", "max_abs_err_sm80": f"{errs['flashcpp_sm80']:.3e}",
                         "max_abs_err_peer": f"{errs[peer]:.3e}", "timing": "cuda_graph_median",
                         "gpu": env["gpu"], "git_commit": env["git_commit"]})
        summary.append((case, tf, {p: t[p] / t["flashcpp"] for p in t if p.startswith(("flex", "sdpa", "fa4"))}))
        progress("  " + "  ".join(f"{n} {tf[n]:6.1f} TF/s" for n in tf))
        del vis, sparse
        torch.cuda.empty_cache()

    write_csv(os.path.join(out, "benchmark.csv"), rows)
    write_json(os.path.join(out, "benchmark_env.json"), env)
    write_json(os.path.join(out, "bench_correctness.json"),
               {"environment": {"device": env["gpu"], "backend": "cuda", "git_commit": env["git_commit"],
                                "reference": "fp32 dense (SDPA with the dense mask / bias; softcap written out)",
                                "scope": "batch 0, heads 0 and 15"}, "cases": checks})
    plot(summary, os.path.join(out, "benchmark.png"), env, hopper)
    # ---- the short table, last --------------------------------------------------------------------
    progress(f"\n[bench masks] TFLOP/s on visible pairs, {env['gpu']}, (B, H, N, D) = ({B}, {H}, {N}, {D}) bf16")
    progress(f"{'case':15s} {'flashcpp':>9s} {'sm80':>7s} {'flex':>7s} {'fa4':>7s} {'sdpa':>7s}  {'vs flex':>8s} "
             f"{'vs fa4':>8s} {'vs sdpa':>8s}  bars")
    nan = float("nan")
    for case, tf, sp in summary:
        met = [r["meets_bar"] for r in rows if r["mask"] == case]
        progress(f"{case:15s} {tf['flashcpp']:9.1f} {tf['flashcpp_sm80']:7.1f} {tf.get('flex', nan):7.1f} "
                 f"{tf.get('fa4', nan):7.1f} {tf.get('sdpa_dense', nan):7.1f}  {sp.get('flex', nan):7.2f}x "
                 f"{sp.get('fa4', nan):7.2f}x {sp.get('sdpa_dense', nan):7.2f}x  {'met' if met and all(met) else 'NOT met'}")
    return 0


def plot(summary, path: str, env: Dict[str, object], hopper: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [("flashcpp", "flashcpp (sm90)" if hopper else "flashcpp"), ("flashcpp_sm80", "flashcpp sm80"),
             ("flex", "FlexAttention"), ("fa4", "FlashAttention-4"), ("sdpa_dense", "SDPA + dense mask")]
    cases = [c for c, _, _ in summary]
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(cases)), 4.5))
    w = 0.8 / len(impls)
    for n, (key, label) in enumerate(impls):
        vals = [tf.get(key, 0.0) for _, tf, _ in summary]
        if any(vals):
            ax.bar([x + (n - (len(impls) - 1) / 2) * w for x in range(len(cases))], vals, w, label=label)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases)
    ax.set_ylabel("TFLOP/s on visible pairs (bf16, CUDA-graph replay)")
    ax.set_title(f"Masks, ({B}, {H}, {N}, {D}) on {env['gpu']} (torch {env['torch']}, {env['git_commit']})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
