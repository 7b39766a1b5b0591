"""Decode from PyTorch on a GPU: BatchDecodeWithKVCache plan/run, flash_attn_with_kvcache,
BatchDecodeWithPagedKVCache and merge_attention_states on CUDA tensors, against a float64 torch
reference on a dense copy of each sequence's keys.

Needs torch, a CUDA device and a build with FLASHCPP_CUDA=ON (the H200 machine: pip install the
package, then ``pytest tests/python/test_decode_cuda.py`` from outside the source tree).
Tolerance (flash-attn's rule): max error vs fp64 <= 2 * (error of PyTorch's SDPA in the same dtype
vs fp64) + 1e-3; for softcap/ALiBi, which SDPA does not take, a fixed dtype tolerance.
"""
import itertools
import math

import pytest

torch = pytest.importorskip("torch", reason="GPU decode tests need torch")

import flashcpp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flashcpp.decode import BatchDecodeWithKVCache  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not flashcpp.WITH_CUDA, reason="this build has no CUDA kernels (FLASHCPP_CUDA=OFF)"),
]
DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}  # O(1) outputs, one rounding to the dtype


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    seed = g.seed()
    print(f"seed={seed}")
    return g


def rand(shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(shape, dtype=torch.float32, device=DEV, generator=gen)).to(dtype)


# ---- reference ------------------------------------------------------------------------------------

def visible(sq, n, causal, window=(-1, -1)):
    ia = torch.arange(sq, device=DEV)[:, None] + n - sq
    j = torch.arange(n, device=DEV)[None, :]
    vis = torch.ones(sq, n, dtype=torch.bool, device=DEV)
    if causal:
        vis &= j <= ia
    if window[0] >= 0:
        vis &= j >= ia - window[0]
    if window[1] >= 0:
        vis &= j <= ia + window[1]
    return vis


def attn_ref(q, k, v, causal, scale=None, window=(-1, -1), softcap=0.0, slopes=None):
    """One sequence in float64: q (Sq, Hq, D), k/v (L, Hkv, D) -> o (Sq, Hq, D), lse (Hq, Sq)."""
    q, k, v = q.double(), k.double(), v.double()
    sq, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        ia = torch.arange(sq, device=DEV)[:, None] + n - sq
        s = s + slopes.double()[:, None, None] * (torch.arange(n, device=DEV)[None, :] - ia)[None]
    s = s.masked_fill(~visible(sq, n, causal, window)[None], float("-inf"))
    lse = torch.logsumexp(s, -1) if n else torch.full((hq, sq), float("-inf"), device=DEV, dtype=torch.float64)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return torch.einsum("hij,jhd->ihd", p, v), lse


def sdpa_same_dtype(q, k, v, causal, window=(-1, -1)):
    """PyTorch's SDPA in the input dtype on one sequence (the 'plain implementation' of the rule)."""
    hq, hkv = q.shape[1], k.shape[1]
    ks, vs = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    mask = visible(q.shape[0], k.shape[0], causal, window)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                          attn_mask=mask)[0].transpose(0, 1)


def dense(cache, table, b, n, page_size):
    """The first n keys of sequence b as a (n, heads_kv, D) tensor."""
    if table is None:
        return cache[b, :n]
    j = torch.arange(n, device=DEV)
    return cache[table[b, j // page_size].long(), j % page_size]


def check_step(out, lse, q, kc, vc, table, page_size, lens, causal, window=(-1, -1)):
    """out/lse of a step without append vs the reference; tolerance by flash-attn's rule."""
    err = err_peer = 0.0
    for b, n in enumerate(lens):
        k, v = dense(kc, table, b, n, page_size), dense(vc, table, b, n, page_size)
        ro, rl = attn_ref(q[b], k, v, causal, window=window)
        vis_rows = visible(q.shape[1], n, causal, window).any(-1)  # rows that see a key
        if vis_rows.any():
            err = max(err, (out[b].double() - ro)[vis_rows].abs().max().item())
            peer = sdpa_same_dtype(q[b], k, v, causal, window)
            err_peer = max(err_peer, (peer.double() - ro)[vis_rows].abs().max().item())
        assert torch.all(out[b][~vis_rows] == 0), f"sequence {b}: rows without keys must be 0"
        if lse is not None:
            lb = lse[b].double()
            fin = torch.isfinite(rl)
            assert torch.equal(torch.isfinite(lb), fin), f"sequence {b}: -inf LSE rows differ"
            if fin.any():
                assert (lb[fin] - rl[fin]).abs().max().item() < 1e-3 * max(1.0, rl[fin].abs().max().item())
    assert err <= 2 * err_peer + 1e-3, f"max err {err:.3g} vs SDPA's own {err_peer:.3g}"


def paged_copy(kc, vc, page_size, gen, spare=3):
    """A shuffled page pool holding the same keys as the contiguous (B, S, Hkv, D) caches, plus
    `spare` pages nobody owns (filled with NaN, so reading one shows)."""
    B, S, Hkv, D = kc.shape
    pps = -(-S // page_size)
    perm = torch.randperm(B * pps + spare, generator=gen, device=DEV)
    table = perm[:B * pps].view(B, pps).to(torch.int32)
    pool_k = torch.full((B * pps + spare, page_size, Hkv, D), float("nan"), dtype=kc.dtype, device=DEV)
    pool_v = pool_k.clone()
    j = torch.arange(S, device=DEV)
    for b in range(B):
        pool_k[table[b, j // page_size].long(), j % page_size] = kc[b]
        pool_v[table[b, j // page_size].long(), j % page_size] = vc[b]
    return pool_k, pool_v, table


def make_cache(B, S, Hkv, D, dtype, gen, lens):
    """Random keys below each length, NaN above (a kernel that reads past a length shows)."""
    kc = rand((B, S, Hkv, D), dtype, gen)
    vc = rand((B, S, Hkv, D), dtype, gen)
    for b, n in enumerate(lens):
        kc[b, n:] = float("nan")
        vc[b, n:] = float("nan")
    return kc, vc


def append_step(gen, lens, S, Hq, Hkv, D, Sq, page_size, dtype):
    """An appending step's inputs: the cache (make_cache; paged with a shuffled block table when
    page_size > 0, else table None), q (B, Sq, Hq, D) and the new k / v (B, Sq, Hkv, D)."""
    B = len(lens)
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    table = None
    if page_size:
        kc, vc, table = paged_copy(kc, vc, page_size, gen)
    q = rand((B, Sq, Hq, D), dtype, gen)
    kn, vn = rand((B, Sq, Hkv, D), dtype, gen), rand((B, Sq, Hkv, D), dtype, gen)
    return kc, vc, table, q, kn, vn


# ---- plan / run -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [8, 64, 80, 96, 128, 200, 256])  # between the classes: padded inside the kernel
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (8, 8), (16, 1)])
def test_contiguous_ragged(gen, dtype, D, Hq, Hkv):
    lens = [0, 1, 63, 64, 65, 1000, 4097]
    B, S = len(lens), 4100
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    q = rand((B, 1, Hq, D), dtype, gen)
    w = BatchDecodeWithKVCache()
    plan = w.plan(B, Hq, Hkv, D, kv_capacity=S, cache_seqlens=lens, dtype=dtype, device=DEV, causal=True)
    assert plan.backend == "cuda" and plan.batch == B
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = w.run(q, kc, vc, lens_dev, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, 1) and lse.dtype == torch.float32
    check_step(out, lse, q, kc, vc, None, 0, lens, True)


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_random_page_order(gen, page_size, dtype):
    Hq, Hkv, D = 32, 8, 128
    lens = [1, 700, 255, 256, 3000]
    B, S = len(lens), 3072
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    kp, vp, table = paged_copy(kc, vc, page_size, gen)
    q = rand((B, 1, Hq, D), dtype, gen)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, kv_capacity=table.shape[1] * page_size, page_size=page_size, cache_seqlens=lens,
           dtype=dtype, device=DEV)
    out, lse = w.run(q, kp, vp, lens_dev, block_table=table, return_lse=True)
    check_step(out, lse, q, kp, vp, table, page_size, lens, False)
    # the same step on the contiguous cache gives the same numbers (same splits, same order)
    wc = BatchDecodeWithKVCache()
    wc.plan(B, Hq, Hkv, D, kv_capacity=S, cache_seqlens=lens, dtype=dtype, device=DEV)
    oc = wc.run(q, kc, vc, lens_dev)
    assert (oc.float() - out.float()).abs().max().item() <= TOL[dtype] / 4


@pytest.mark.parametrize("paged", [False, True])
def test_qlen4_causal_gqa(gen, paged):
    dtype, Hq, Hkv, D = torch.bfloat16, 32, 8, 128
    lens = [4, 5, 1029, 2000]  # keys in the cache before the step, the 4 query tokens are its last 4
    B, S = len(lens), 2048
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    table, ps = None, 0
    if paged:
        ps = 16
        kc, vc, table = paged_copy(kc, vc, ps, gen)
    q = rand((B, 4, Hq, D), dtype, gen)
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, seqlen_q=4, kv_capacity=S, page_size=ps, cache_seqlens=lens, causal=True, dtype=dtype,
           device=DEV)
    out, lse = w.run(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device=DEV), block_table=table,
                     return_lse=True)
    check_step(out, lse, q, kc, vc, table, ps, lens, True)


@pytest.mark.parametrize("num_splits", [1, 3, 64, 256])
def test_forced_splits_agree(gen, num_splits):
    dtype, B, Hq, Hkv, D, S = torch.float16, 3, 16, 4, 128, 5000
    lens = [5000, 10, 2500]
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    q = rand((B, 1, Hq, D), dtype, gen)
    w = BatchDecodeWithKVCache()
    plan = w.plan(B, Hq, Hkv, D, kv_capacity=S, cache_seqlens=lens, dtype=dtype, device=DEV, num_splits=num_splits)
    assert plan.max_splits == num_splits and plan.needs_merge == (num_splits > 1)
    out, lse = w.run(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device=DEV), return_lse=True)
    check_step(out, lse, q, kc, vc, None, 0, lens, False)


@pytest.mark.parametrize("num_splits", [0, 3, 17])
def test_fused_merge_equals_the_merge_kernel(gen, num_splits):
    # The split-KV kernel's own merge runs the merge kernel's arithmetic: equal bit for bit, and
    # again on a graph replay (the arrival counters come back to zero every run).
    dtype, B, Hq, Hkv, D, S = torch.bfloat16, 3, 16, 4, 128, 5000
    lens = [5000, 10, 2500]
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    q = rand((B, 1, Hq, D), dtype, gen)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    runs = []
    for fused in (False, True):
        w = BatchDecodeWithKVCache()
        plan = w.plan(B, Hq, Hkv, D, kv_capacity=S, cache_seqlens=lens, dtype=dtype, device=DEV,
                      num_splits=num_splits, fused_merge=fused)
        assert plan.fused_merge == (fused and plan.needs_merge)
        out, lse = w.run(q, kc, vc, lens_dev, return_lse=True)
        runs.append((out.clone(), lse.clone()))
        if fused:
            g = capture(lambda: w.run(q, kc, vc, lens_dev, out=out, lse=lse))
            for _ in range(3):
                out.fill_(float("nan"))
                g.replay()
            torch.cuda.synchronize()
            runs.append((out.clone(), lse.clone()))
    for o, l in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(l, runs[0][1])
    check_step(runs[0][0], runs[0][1], q, kc, vc, None, 0, lens, False)


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("num_splits", [0, 2, 7])
def test_fused_append_equals_the_append_kernel(gen, page_size, num_splits):
    # plan(fused_append=True): the split-KV kernel writes the new k/v itself. Same cache bytes and
    # the same output as the append launch, with new tokens crossing a 64-key tile (62..65).
    dtype, Hq, Hkv, D, Sq = torch.bfloat16, 16, 4, 128, 4
    lens = [62, 0, 1021]
    B, S = len(lens), 1040
    kc0, vc0, table, q, kn, vn = append_step(gen, lens, S, Hq, Hkv, D, Sq, page_size, dtype)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    runs = []
    for fused in (False, True):
        kc, vc = kc0.clone(), vc0.clone()
        w = BatchDecodeWithKVCache()
        plan = w.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=S if not page_size else table.shape[1] * page_size,
                      page_size=page_size, cache_seqlens=lens, append=True, causal=True, rotary="neox",
                      dtype=dtype, device=DEV, num_splits=num_splits, fused_append=fused)
        assert plan.fused_append == fused
        out, lse = w.run(q, kc, vc, lens_dev, block_table=table, k=kn, v=vn, return_lse=True)
        runs.append((kc, vc, out, lse))
    (k0, v0, o0, l0), (k1, v1, o1, l1) = runs
    assert not torch.equal(torch.nan_to_num(k0), torch.nan_to_num(kc0)), "the append wrote nothing"
    for a, b in ((k0, k1), (v0, v1), (o0, o1), (l0, l1)):
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
        assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert not torch.isnan(o1).any()


def test_window_softcap_alibi(gen):
    dtype, B, Hq, Hkv, D, S = torch.bfloat16, 2, 8, 2, 128, 1500
    lens = [1500, 333]
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    slopes = flashcpp.alibi_slopes(Hq)
    slopes_dev = torch.as_tensor(slopes, device=DEV)
    for kw in (dict(window_size=(100, -1)), dict(softcap=5.0), dict(sm_scale=0.05)):
        q = rand((B, 2, Hq, D), dtype, gen)
        w = BatchDecodeWithKVCache()
        w.plan(B, Hq, Hkv, D, seqlen_q=2, kv_capacity=S, cache_seqlens=lens, causal=True, dtype=dtype, device=DEV,
               **kw)
        use_alibi = "sm_scale" in kw
        out = w.run(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device=DEV),
                    alibi_slopes=slopes_dev if use_alibi else None)
        for b, n in enumerate(lens):
            ro, _ = attn_ref(q[b], kc[b, :n], vc[b, :n], True, scale=kw.get("sm_scale"),
                             window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                             slopes=slopes_dev if use_alibi else None)
            assert (out[b].double() - ro).abs().max().item() < TOL[dtype], kw


def rotate_ref(x, pos, rotary_dim, interleaved, theta=10000.0, cos=None, sin=None):
    """x (T, H, D) rotated at positions pos (T,), float64."""
    x = x.double().clone()
    half = rotary_dim // 2
    if cos is None:
        inv = theta ** (-torch.arange(half, device=DEV, dtype=torch.float64) * 2.0 / rotary_dim)
        ang = pos.double()[:, None] * inv[None, :]
        c, s = torch.cos(ang), torch.sin(ang)
    else:
        c, s = cos.double()[pos.long()], sin.double()[pos.long()]
    c, s = c[:, None, :], s[:, None, :]
    if interleaved:
        a, b = x[..., 0:rotary_dim:2].clone(), x[..., 1:rotary_dim:2].clone()
        x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].clone(), x[..., half:rotary_dim].clone()
        x[..., :half], x[..., half:rotary_dim] = a * c - b * s, b * c + a * s
    return x


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tables", [False, True])
@pytest.mark.parametrize("page_size", [0, 16])
def test_append_with_rotary(gen, interleaved, tables, page_size):
    dtype, Hq, Hkv, D, Sq = torch.bfloat16, 16, 4, 128, 3
    lens = [0, 100, 1021]
    B, S = len(lens), 1040
    kc, vc, table, q, kn, vn = append_step(gen, lens, S, Hq, Hkv, D, Sq, page_size, dtype)
    k0 = kc.clone()
    rd = 64 if tables else D
    cos = sin = None
    if tables:
        ang = torch.rand(S, rd // 2, device=DEV, generator=gen, dtype=torch.float32) * 2 * math.pi
        cos, sin = torch.cos(ang), torch.sin(ang)
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, seqlen_q=Sq, kv_capacity=S if not page_size else table.shape[1] * page_size,
           page_size=page_size, cache_seqlens=lens, append=True, causal=True,
           rotary="interleaved" if interleaved else "neox", dtype=dtype, device=DEV)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = w.run(q, kc, vc, lens_dev, block_table=table, k=kn, v=vn, rotary_cos=cos, rotary_sin=sin)
    assert torch.equal(lens_dev.cpu(), torch.tensor(lens, dtype=torch.int32)), "cache_seqlens must not be written"
    err = err_peer = 0.0
    for b, c in enumerate(lens):
        pos = torch.arange(c, c + Sq, device=DEV)
        want_k = rotate_ref(kn[b], pos, rd, interleaved, cos=cos, sin=sin)
        got_k = dense(kc, table, b, c + Sq, page_size)[c:]
        assert (got_k.double() - want_k).abs().max().item() <= 1e-2 * (1 + want_k.abs().max().item())
        assert torch.equal(dense(vc, table, b, c + Sq, page_size)[c:], vn[b]), "V is copied as it is"
        old = dense(kc, table, b, c, page_size)
        assert torch.equal(torch.isnan(old), torch.isnan(dense(k0, table, b, c, page_size)))
        assert torch.equal(torch.nan_to_num(old), torch.nan_to_num(dense(k0, table, b, c, page_size)))
        # attention over the cache as written, q rotated at the same positions and rounded to bf16
        qr = rotate_ref(q[b], pos, rd, interleaved, cos=cos, sin=sin).to(dtype)
        k_all, v_all = dense(kc, table, b, c + Sq, page_size), dense(vc, table, b, c + Sq, page_size)
        ro, _ = attn_ref(qr, k_all, v_all, True)
        err = max(err, (out[b].double() - ro).abs().max().item())
        err_peer = max(err_peer, (sdpa_same_dtype(qr, k_all, v_all, True).double() - ro).abs().max().item())
    assert err <= 2 * err_peer + 2e-3, f"max err {err:.3g} vs SDPA's own {err_peer:.3g}"


def test_flash_attn_with_kvcache_rope_theta(gen):
    dtype, B, Hq, Hkv, D, S = torch.float16, 2, 8, 2, 64, 300
    lens = [17, 250]
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, lens)
    q = rand((B, 1, Hq, D), dtype, gen)
    kn, vn = rand((B, 1, Hkv, D), dtype, gen), rand((B, 1, Hkv, D), dtype, gen)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = flashcpp.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens_dev, causal=True,
                                                rope_theta=500000.0, rotary_interleaved=False,
                                                return_softmax_lse=True)
    assert lse.shape == (B, Hq, 1)
    for b, c in enumerate(lens):
        pos = torch.tensor([c], device=DEV)
        want_k = rotate_ref(kn[b], pos, D, False, theta=500000.0)
        assert (kc[b, c:c + 1].double() - want_k).abs().max().item() < 5e-3 * (1 + want_k.abs().max().item())
        qr = rotate_ref(q[b], pos, D, False, theta=500000.0).to(dtype)
        ro, rl = attn_ref(qr, kc[b, :c + 1], vc[b, :c + 1], True)
        assert (out[b].double() - ro).abs().max().item() < TOL[dtype]
        assert (lse[b].double() - rl).abs().max().item() < 1e-2


# ---- CUDA graphs ------------------------------------------------------------------------------------

def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("page_size", [0, 16])
def test_graph_replay_with_new_lengths(gen, page_size):
    dtype, B, Hq, Hkv, D, S = torch.bfloat16, 4, 32, 8, 128, 4096
    kc, vc = rand((B, S, Hkv, D), dtype, gen), rand((B, S, Hkv, D), dtype, gen)
    table = None
    if page_size:
        kc, vc, table = paged_copy(kc, vc, page_size, gen)
    q = rand((B, 1, Hq, D), dtype, gen)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, 1, dtype=torch.float32, device=DEV)
    lens_dev = torch.tensor([S, S, S, S], dtype=torch.int32, device=DEV)
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, kv_capacity=S, page_size=page_size, cache_seqlens=[S] * B, dtype=dtype, device=DEV)
    g = capture(lambda: w.run(q, kc, vc, lens_dev, block_table=table, out=out, lse=lse))
    for lens in ([S, 1, 2000, 64], [0, 4095, 65, 3000], [7, 7, 7, 7]):
        lens_dev.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(rand((B, 1, Hq, D), dtype, gen))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_step(out, lse, q, kc, vc, table, page_size, lens, True)


def test_graph_decode_loop_with_append(gen):
    """A captured step replayed as a decode loop: each replay appends one token at cache_seqlens and
    the host bumps the lengths between replays (what an engine's CUDA-graph runner does)."""
    dtype, B, Hq, Hkv, D, S, ps = torch.bfloat16, 3, 16, 4, 64, 512, 16
    start = [0, 100, 400]
    kc, vc = make_cache(B, S, Hkv, D, dtype, gen, start)
    kc, vc, table = paged_copy(kc, vc, ps, gen)
    q = rand((B, 1, Hq, D), dtype, gen)
    kn, vn = rand((B, 1, Hkv, D), dtype, gen), rand((B, 1, Hkv, D), dtype, gen)
    out = torch.empty_like(q)
    lens_dev = torch.tensor(start, dtype=torch.int32, device=DEV)
    w = BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, kv_capacity=table.shape[1] * ps, page_size=ps, cache_seqlens=[n + 8 for n in start],
           append=True, causal=True, rotary="neox", dtype=dtype, device=DEV)
    step = lambda: w.run(q, kc, vc, lens_dev, block_table=table, k=kn, v=vn, out=out)  # noqa: E731
    g = capture(step)  # the warm-up and the capture each appended at `start` (same slot, same values)
    for i in range(1, 6):
        lens = [n + i for n in start]
        lens_dev.copy_(torch.tensor(lens, dtype=torch.int32))
        for x in (q, kn, vn):
            x.copy_(rand(x.shape, dtype, gen))
        g.replay()
        torch.cuda.synchronize()
        for b, c in enumerate(lens):
            pos = torch.tensor([c], device=DEV)
            got_k = dense(kc, table, b, c + 1, ps)[c:]
            want_k = rotate_ref(kn[b], pos, D, False)
            assert (got_k.double() - want_k).abs().max().item() <= 1e-2 * (1 + want_k.abs().max().item())
            assert torch.equal(dense(vc, table, b, c + 1, ps)[c:], vn[b])
            qr = rotate_ref(q[b], pos, D, False).to(dtype)
            ro, _ = attn_ref(qr, dense(kc, table, b, c + 1, ps), dense(vc, table, b, c + 1, ps), True)
            assert (out[b].double() - ro).abs().max().item() < TOL[dtype]


def test_flash_attn_with_kvcache_graph_after_warmup(gen):
    dtype, B, Hq, Hkv, D, S = torch.float16, 2, 8, 8, 128, 1024
    kc, vc = rand((B, S, Hkv, D), dtype, gen), rand((B, S, Hkv, D), dtype, gen)
    q = rand((B, 1, Hq, D), dtype, gen)
    lens_dev = torch.tensor([S, S], dtype=torch.int32, device=DEV)
    holder = {}

    def step():
        holder["out"] = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens_dev, causal=True)
    g = capture(step)  # the warm-up made and cached the plan; the capture reuses it
    for lens in ([1, 1024], [513, 2]):
        lens_dev.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(rand(q.shape, dtype, gen))
        g.replay()
        torch.cuda.synchronize()
        check_step(holder["out"], None, q, kc, vc, None, 0, lens, True)


# ---- FlashInfer-style paged wrapper, merge, errors -----------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_decode_paged_wrapper(gen, layout):
    dtype, Hq, Hkv, D, ps = torch.bfloat16, 32, 8, 128, 16
    lens = [33, 16, 1, 500]
    n_pages = [-(-n // ps) for n in lens]
    total = sum(n_pages)
    pages = torch.randperm(total + 2, generator=gen, device=DEV)[:total].to(torch.int32)
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)), dtype=torch.int32, device=DEV)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, n_pages)], dtype=torch.int32, device=DEV)
    kc = rand((total + 2, ps, Hkv, D), dtype, gen)
    vc = rand((total + 2, ps, Hkv, D), dtype, gen)
    cache = (kc, vc) if layout == "NHD" else (kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous())
    ws = torch.empty(16 << 20, dtype=torch.uint8, device=DEV)
    w = flashcpp.BatchDecodeWithPagedKVCache(ws, layout)
    w.plan(indptr, pages, last, Hq, Hkv, D, ps, q_data_type=dtype)
    q = rand((len(lens), Hq, D), dtype, gen)
    o, lse = w.run(q, cache, return_lse=True)
    assert o.shape == (len(lens), Hq, D) and lse.shape == (len(lens), Hq)
    for b, n in enumerate(lens):
        pg = pages[indptr[b]:indptr[b + 1]].long()
        j = torch.arange(n, device=DEV)
        ro, rl = attn_ref(q[b][None], kc[pg[j // ps], j % ps], vc[pg[j // ps], j % ps], False)
        assert (o[b].double() - ro[0]).abs().max().item() < TOL[dtype]
        assert (lse[b].double() - rl[:, 0]).abs().max().item() < 1e-2
    g = capture(lambda: w.run(q, cache))  # run() is capturable once planned
    g.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_attention_states_cuda(gen, dtype):
    S, H, D = 37, 8, 128
    va, vb = rand((S, H, D), dtype, gen), rand((S, H, D), dtype, gen)
    sa = rand((S, H), torch.float32, gen, 3.0)
    sb = rand((S, H), torch.float32, gen, 3.0)
    sa[0, :] = float("-inf")               # side a empty
    sb[1, :] = float("-inf")               # side b empty
    sa[2, :] = sb[2, :] = float("-inf")    # both empty: o = 0, lse = -inf
    o, s = flashcpp.merge_attention_states(va, sa, vb, sb)
    assert o.dtype == dtype and o.device.type == "cuda" and s.dtype == torch.float32
    la, lb = sa.double(), sb.double()
    ls = torch.logaddexp(la, lb)
    wa = torch.nan_to_num(torch.exp(la - ls), nan=0.0)[..., None]
    wb = torch.nan_to_num(torch.exp(lb - ls), nan=0.0)[..., None]
    ro = va.double() * wa + vb.double() * wb
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert (o.double() - ro).abs().max().item() < tol
    assert torch.all(o[2] == 0) and torch.all(torch.isneginf(s[2]))
    fin = torch.isfinite(ls)
    assert (s.double()[fin] - ls[fin]).abs().max().item() < 1e-5
    # the torch op (what torch.compile sees) runs the same CUDA kernel
    o2, s2 = torch.ops.flashcpp.merge_attention_states(va, sa, vb, sb)
    assert torch.equal(o2, o) and torch.equal(s2, s)


def test_merge_of_two_decode_halves_equals_the_whole(gen):
    dtype, B, Hq, Hkv, D, S = torch.bfloat16, 2, 8, 2, 128, 2048
    kc, vc = rand((B, S, Hkv, D), dtype, gen), rand((B, S, Hkv, D), dtype, gen)
    q = rand((B, 1, Hq, D), dtype, gen)
    half = S // 2
    oa, la = flashcpp.flash_attn_with_kvcache(q, kc[:, :half].contiguous(), vc[:, :half].contiguous(),
                                              return_softmax_lse=True)
    ob, lb = flashcpp.flash_attn_with_kvcache(q, kc[:, half:].contiguous(), vc[:, half:].contiguous(),
                                              return_softmax_lse=True)
    o, _ = flashcpp.merge_attention_states(oa[:, 0], la[..., 0].contiguous(), ob[:, 0], lb[..., 0].contiguous())
    whole = flashcpp.flash_attn_with_kvcache(q, kc, vc)
    assert (o.float() - whole[:, 0].float()).abs().max().item() < TOL[dtype]


def test_errors_on_cuda(gen):
    w = BatchDecodeWithKVCache()
    with pytest.raises(NotImplementedError, match="fp32 decode runs on the CPU backend only"):
        w.plan(1, 8, 2, 128, kv_capacity=64, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="num_splits 300 is outside"):
        w.plan(1, 8, 2, 128, kv_capacity=64, dtype=torch.bfloat16, device=DEV, num_splits=300)
    w.plan(2, 8, 2, 128, kv_capacity=64, dtype=torch.bfloat16, device=DEV)
    kc = rand((2, 64, 2, 128), torch.bfloat16, gen)
    lens = torch.tensor([64, 3], dtype=torch.int32, device=DEV)
    buf = torch.empty(2 * 8 * 128 + 8, dtype=torch.bfloat16, device=DEV)
    q_misaligned = buf[1:1 + 2 * 8 * 128].view(2, 1, 8, 128)  # 2-byte offset: not 16-byte aligned
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        w.run(q_misaligned, kc, kc.clone(), lens)
    q = rand((2, 1, 8, 128), torch.bfloat16, gen)
    with pytest.raises(ValueError, match="as planned"):
        w.run(q[:1], kc, kc.clone(), lens)
    with pytest.raises(ValueError, match="plan has append=False"):
        w.run(q, kc, kc.clone(), lens, k=rand((2, 1, 2, 128), torch.bfloat16, gen),
              v=rand((2, 1, 2, 128), torch.bfloat16, gen))
    with pytest.raises(TypeError, match="the plan is for bfloat16"):
        w.run(q.half(), kc, kc.clone(), lens)


def test_host_cache_seqlens_are_checked_on_cuda(gen):
    # Host values (a list, a numpy array, a CPU tensor) are checked without a synchronization;
    # device tensors keep the documented clamp (not read by the host).
    import numpy as np
    q = rand((2, 1, 8, 128), torch.bfloat16, gen)
    kc, vc = rand((2, 64, 2, 128), torch.bfloat16, gen), rand((2, 64, 2, 128), torch.bfloat16, gen)
    for lens in ([200, 3], np.array([3, 65], np.int32), torch.tensor([70, 3], dtype=torch.int32)):
        with pytest.raises(ValueError, match="exceed the cache's 64 slots"):
            flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="negative"):
        flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[-1, 3])
    k, v = rand((2, 1, 2, 128), torch.bfloat16, gen), rand((2, 1, 2, 128), torch.bfloat16, gen)
    with pytest.raises(ValueError, match=r"64 \+ seqlen_q 1 = 65 keys exceed"):
        flashcpp.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=[64, 3])
    w = BatchDecodeWithKVCache()
    w.plan(2, 8, 2, 128, kv_capacity=64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="exceed the cache's 64 slots"):
        w.run(q, kc, vc, [65, 1])
    # the host lengths that fit run and agree with the same lengths on the device
    want = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([64, 3], dtype=torch.int32,
                                                                                   device=DEV))
    assert torch.equal(flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[64, 3]), want)
    # a device tensor past the cache is not read by the host: accepted, clamped by the kernels
    flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([500, 3], dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
