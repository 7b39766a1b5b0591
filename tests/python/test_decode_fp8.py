"""Decode over an fp8 e4m3 KV cache with per-KV-head scales (include/flashcpp/decode.h), on the
host backend: flash_attn_with_kvcache and the plan/run wrapper, numpy (ml_dtypes.float8_e4m3fn)
and torch (torch.float8_e4m3fn) caches.

The reference is the fp64 attention of attn_reference.py over the dequantized cache
(K = code * k_scale, V = code * v_scale): the fp8 kernel must compute that function to the
tolerance of q's dtype (the scales are folded into the score and the output, the same numbers up
to fp32 rounding). The append's codes are checked against an independent quantizer: ml_dtypes'
round-to-nearest-even cast of x / scale computed in fp32, clipped to +-448 first (flashcpp
saturates where ml_dtypes would give NaN)."""
import numpy as np
import pytest

import flashcpp
from attn_reference import attention_ref, tolerance
from test_decode import dense, make_cache, rotate_ref

ml_dtypes = pytest.importorskip("ml_dtypes")
FP8 = ml_dtypes.float8_e4m3fn


def quantize(x, scale):
    """x (..., H, D) float -> fp8 codes of x / scale[h], in fp32 then RNE, saturating at +-448."""
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]
    return np.clip(y, -448, 448).astype(FP8)


def dequantize(codes, scale):
    return codes.astype(np.float64) * np.asarray(scale, np.float64)[:, None]


def fp8_cache(rng, B, lens, slots, Hkv, D, page_size=0):
    """make_cache's random cache (NaN above each length) quantized with random per-head scales, and
    the dequantized cache (fp64) the reference attends over."""
    kc, vc, table = make_cache(rng, B, lens, slots, Hkv, D, np.float32, page_size)
    ks = rng.uniform(0.002, 0.02, Hkv).astype(np.float32)  # |x| / scale spans most of e4m3's range
    vs = rng.uniform(0.002, 0.02, Hkv).astype(np.float32)
    kq, vq = quantize(kc, ks), quantize(vc, vs)
    return kq, vq, table, ks, vs, dequantize(kq, ks), dequantize(vq, vs)


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fp8_cache_is_attention_over_the_dequantized_cache(rng, page_size, dtype):
    B, Hq, Hkv, D, slots = 3, 8, 2, 64, 200
    lens = [0, 5, 193]
    kq, vq, table, ks, vs, kd, vd = fp8_cache(rng, B, lens, slots, Hkv, D, page_size)
    q = rng.standard_normal((B, 2, Hq, D)).astype(dtype)
    out, lse = flashcpp.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=np.array(lens, np.int32), block_table=table,
                                                causal=True, softcap=20.0, return_softmax_lse=True,
                                                k_scale=ks, v_scale=vs)
    assert out.dtype == dtype and out.shape == q.shape and np.isfinite(out).all()
    ps = page_size or 1
    for b, n in enumerate(lens):
        ro, rl = attention_ref(q[b:b + 1], dense(kd, table, b, n, ps)[None], dense(vd, table, b, n, ps)[None],
                               causal=True, softcap=20.0)
        assert np.abs(out[b] - ro[0]).max() <= tolerance(dtype), (b, n)
        if n:
            assert np.abs(lse[b] - rl[0]).max() < 1e-4
        else:
            assert np.all(out[b] == 0) and np.all(np.isneginf(lse[b]))


def test_a_number_is_every_heads_scale(rng):
    B, Hq, Hkv, D, slots = 2, 4, 2, 32, 40
    kq, vq, _, _, _, _, _ = fp8_cache(rng, B, [40, 17], slots, Hkv, D)
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    lens = np.array([40, 17], np.int32)
    a = flashcpp.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=lens, k_scale=0.01, v_scale=0.5)
    b = flashcpp.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=lens, k_scale=np.full(Hkv, 0.01, np.float32),
                                         v_scale=np.full(Hkv, 0.5, np.float32))
    np.testing.assert_array_equal(a, b)
    # and the scales act: another v_scale scales O exactly (a power of two), another k_scale changes it
    c = flashcpp.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=lens, k_scale=0.01, v_scale=1.0)
    np.testing.assert_allclose(c * 0.5, a, rtol=0, atol=0)
    d = flashcpp.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=lens, k_scale=0.02, v_scale=0.5)
    assert np.abs(d - a).max() > 1e-3


@pytest.mark.parametrize("rotary", [False, True])
def test_append_quantizes_into_the_cache(rng, rotary):
    B, Hq, Hkv, D, slots, Sq = 2, 4, 2, 64, 50, 3
    lens = [10, 47]
    kq, vq, _, ks, vs, kd, vd = fp8_cache(rng, B, [n + Sq for n in lens], slots, Hkv, D)
    kq[0, 10:13] = vq[0, 10:13] = np.float32(0)  # the append must overwrite these slots
    q = rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)
    k = (rng.standard_normal((B, Sq, Hkv, D)) * 3).astype(np.float32)
    v = (rng.standard_normal((B, Sq, Hkv, D)) * 3).astype(np.float32)
    k[1, 0, 0, :4] = [1e6, -1e6, 4.4, -4.5]  # saturates at +-448 codes; ties of the rounding nearby
    kw = dict(rope_theta=10000.0, rotary_interleaved=False) if rotary else {}
    out = flashcpp.flash_attn_with_kvcache(q, kq, vq, k=k, v=v, cache_seqlens=np.array(lens, np.int32),
                                           causal=True, k_scale=ks, v_scale=vs, **kw)
    for b, n in enumerate(lens):
        kn = k[b]
        if rotary:  # rotated in fp64 here, in fp32 by flashcpp: the codes may differ by one step at a tie
            kn = rotate_ref(kn, np.arange(n, n + Sq), D, False).astype(np.float32)
        want_k, want_v = quantize(kn, ks), quantize(v[b], vs)
        got_k, got_v = kq[b, n:n + Sq], vq[b, n:n + Sq]
        np.testing.assert_array_equal(got_v.view(np.uint8), want_v.view(np.uint8))
        if rotary:
            step = np.abs(got_k.astype(np.float64) - want_k.astype(np.float64))
            ulp = np.abs(want_k.astype(np.float64)) * 2.0 ** -3 + 2.0 ** -9
            assert (step <= ulp).all() and (got_k.view(np.uint8) == want_k.view(np.uint8)).mean() > 0.99
        else:
            np.testing.assert_array_equal(got_k.view(np.uint8), want_k.view(np.uint8))
        if b == 1 and not rotary:
            assert float(got_k[0, 0, 0]) == 448.0 and float(got_k[0, 0, 1]) == -448.0
        # the step attended over the cache as it is after the append
        kd_b, vd_b = dequantize(kq[b, :n + Sq], ks), dequantize(vq[b, :n + Sq], vs)
        qb = rotate_ref(q[b], np.arange(n, n + Sq), D, False)[None] if rotary else q[b:b + 1]
        ro, _ = attention_ref(qb, kd_b[None], vd_b[None], causal=True)
        assert np.abs(out[b] - ro[0]).max() <= tolerance(np.float32)


def test_plan_run_wrapper_with_an_fp8_cache(rng):
    B, Hq, Hkv, D, slots = 2, 8, 1, 128, 300
    lens = [300, 129]
    kq, vq, table, ks, vs, kd, vd = fp8_cache(rng, B, lens, slots, Hkv, D, page_size=64)
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float16)
    w = flashcpp.BatchDecodeWithKVCache()
    w.plan(B, Hq, Hkv, D, page_size=64, cache_seqlens=lens, dtype="float16", device="cpu", kv_dtype="fp8_e4m3",
           num_splits=3)
    out = w.run(q, kq, vq, np.array(lens, np.int32), block_table=table, k_scale=ks, v_scale=vs)
    for b, n in enumerate(lens):
        ro, _ = attention_ref(q[b:b + 1], dense(kd, table, b, n, 64)[None], dense(vd, table, b, n, 64)[None])
        assert np.abs(out[b] - ro[0]).max() <= tolerance(np.float16)
    with pytest.raises(TypeError, match="k_cache has dtype float16; the plan is for float8_e4m3fn"):
        w.run(q, kq.astype(np.float16), vq, np.array(lens, np.int32), block_table=table, k_scale=ks, v_scale=vs)


def test_nan_in_the_cache_gives_nan_out(rng):
    B, Hq, Hkv, D = 1, 2, 1, 32
    kq, vq, _, ks, vs, _, _ = fp8_cache(rng, B, [20], 20, Hkv, D)
    vq[0, 7, 0, 3] = np.nan  # the e4m3 NaN code
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    out = flashcpp.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=20, k_scale=ks, v_scale=vs)
    assert np.isnan(out[0, 0, :, 3]).all() and np.isfinite(np.delete(out[0, 0], 3, axis=-1)).all()


def test_fp8_errors(rng):
    B, Hq, Hkv, D = 1, 2, 2, 32
    kq, vq, _, ks, vs, _, _ = fp8_cache(rng, B, [8], 8, Hkv, D)
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    call = lambda **kw: flashcpp.flash_attn_with_kvcache(q, kw.pop("kc", kq), kw.pop("vc", vq), cache_seqlens=8, **kw)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        call(k_scale=ks)
    with pytest.raises(ValueError, match=r"k_scale must be a number or have shape \(heads_kv,\) = \(2,\)"):
        call(k_scale=np.ones(3, np.float32), v_scale=vs)
    with pytest.raises(ValueError, match=r"k_scale\[1\] .* must be positive and finite"):
        call(k_scale=np.array([1.0, 0.0], np.float32), v_scale=vs)
    with pytest.raises(ValueError, match=r"v_scale\[0\] nan must be positive and finite"):
        call(k_scale=ks, v_scale=np.array([np.nan, 1.0], np.float32))
    with pytest.raises(TypeError, match="must share q's dtype, or both be float8_e4m3fn"):
        call(vc=vq.astype(np.float32), k_scale=ks, v_scale=vs)
    kf, vf = kq.astype(np.float32), vq.astype(np.float32)
    with pytest.raises(ValueError, match="k_scale is given but the cache is not float8_e4m3fn"):
        call(kc=kf, vc=vf, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="q has dtype float8_e4m3fn"):
        flashcpp.flash_attn_with_kvcache(q.astype(FP8), kq, vq, cache_seqlens=8, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="kv_dtype 'int8'"):
        flashcpp.BatchDecodeWithKVCache().plan(1, 2, 2, 32, kv_capacity=8, dtype="float32", device="cpu",
                                               kv_dtype="int8")


def test_torch_cpu_fp8_cache_and_compile(rng):
    torch = pytest.importorskip("torch")
    B, Hq, Hkv, D, slots = 2, 4, 2, 64, 64
    lens = [64, 30]
    kq, vq, _, ks, vs, kd, vd = fp8_cache(rng, B, lens, slots, Hkv, D)
    q = torch.from_numpy(rng.standard_normal((B, 1, Hq, D)).astype(np.float32)).to(torch.bfloat16)
    kt = torch.from_numpy(kq.view(np.uint8)).view(torch.float8_e4m3fn)
    vt = torch.from_numpy(vq.view(np.uint8)).view(torch.float8_e4m3fn)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kst, vst = torch.from_numpy(ks), torch.from_numpy(vs)
    out = flashcpp.flash_attn_with_kvcache(q, kt, vt, cache_seqlens=lens_t, k_scale=kst, v_scale=vst)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for b, n in enumerate(lens):
        ro, _ = attention_ref(q[b:b + 1].float().numpy(), kd[b:b + 1, :n], vd[b:b + 1, :n])
        assert np.abs(out[b].float().numpy() - ro[0]).max() <= tolerance("bfloat16")
    # the same call traced by torch.compile (the registered op, scales as tensors)
    f = torch.compile(lambda q, k, v, l, a, c: flashcpp.flash_attn_with_kvcache(q, k, v, cache_seqlens=l, k_scale=a,
                                                                                v_scale=c), fullgraph=True)
    torch.testing.assert_close(f(q, kt, vt, lens_t, kst, vst), out, rtol=0, atol=0)


def test_flashinfer_style_paged_wrapper_with_an_fp8_cache(rng):
    # FlashInfer's spelling: plan(..., kv_data_type=float8_e4m3fn), run(q, (k, v), k_scale=, v_scale=).
    B, Hq, Hkv, D, ps = 3, 4, 2, 64, 16
    lens = [33, 16, 1]
    n_pages = [(n + ps - 1) // ps for n in lens]
    total = sum(n_pages)
    pages = rng.permutation(total + 2).astype(np.int32)[:total]
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * ps for n, p in zip(lens, n_pages)], np.int32)
    ks = rng.uniform(0.002, 0.02, Hkv).astype(np.float32)
    vs = rng.uniform(0.002, 0.02, Hkv).astype(np.float32)
    kq = quantize(rng.standard_normal((total + 2, ps, Hkv, D)), ks)
    vq = quantize(rng.standard_normal((total + 2, ps, Hkv, D)), vs)
    w = flashcpp.BatchDecodeWithPagedKVCache(None, "NHD")
    w.plan(indptr, pages, last, Hq, Hkv, D, ps, q_data_type="float32", kv_data_type=FP8)
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    o = w.run(q, (kq, vq), k_scale=ks, v_scale=vs)
    for b, n in enumerate(lens):
        pg = pages[indptr[b]:indptr[b + 1]]
        j = np.arange(n)
        ro, _ = attention_ref(q[b][None, None], dequantize(kq[pg[j // ps], j % ps], ks)[None],
                              dequantize(vq[pg[j // ps], j % ps], vs)[None])
        assert np.abs(o[b] - ro[0, 0]).max() <= tolerance(np.float32)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        w.run(q, (kq, vq))
    # kv_data_type equal to q's dtype is the plain cache, as FlashInfer callers often pass it
    w2 = flashcpp.BatchDecodeWithPagedKVCache(None, "NHD")
    w2.plan(indptr, pages, last, Hq, Hkv, D, ps, q_data_type="float32", kv_data_type="float32")
    o2 = w2.run(q, (dequantize(kq, ks).astype(np.float32), dequantize(vq, vs).astype(np.float32)))
    assert np.abs(o2 - o).max() <= 2 * tolerance(np.float32)


def test_cuda_fp8_cache_matches_the_host_backend(rng):
    # The CUDA kernels over the same fp8 cache (paged, with an append of 2 tokens and rotary): the
    # output against the host backend's (itself tested against fp64 above) within bf16's tolerance,
    # and the cache after the append equal to the host's codes (K may be one code apart where the
    # device's rotation angle rounds differently; V exactly).
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not flashcpp.WITH_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of flashcpp")
    B, Hq, Hkv, D, Sq, ps = 3, 8, 2, 128, 2, 16
    lens = [0, 40, 300]
    slots = 320
    kq, vq, table, ks, vs, _, _ = fp8_cache(rng, B, lens, slots, Hkv, D, page_size=ps)
    q = torch.from_numpy(rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)).to(torch.bfloat16)
    kn = torch.from_numpy(rng.standard_normal((B, Sq, Hkv, D)).astype(np.float32)).to(torch.bfloat16)
    vn = torch.from_numpy(rng.standard_normal((B, Sq, Hkv, D)).astype(np.float32)).to(torch.bfloat16)
    out = {}
    caches = {}
    for dev in ("cpu", "cuda"):
        kt = torch.from_numpy(kq.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(dev)
        vt = torch.from_numpy(vq.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(dev)
        out[dev] = flashcpp.flash_attn_with_kvcache(
            q.to(dev), kt, vt, kn.to(dev), vn.to(dev), cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_table=torch.from_numpy(table).to(dev), causal=True, rope_theta=10000.0,
            k_scale=torch.from_numpy(ks).to(dev), v_scale=torch.from_numpy(vs).to(dev)).float().cpu()
        caches[dev] = (kt.view(torch.uint8).cpu().numpy(), vt.view(torch.uint8).cpu().numpy())
    assert torch.isfinite(out["cuda"]).all()
    assert (out["cuda"] - out["cpu"]).abs().max().item() <= 2 * tolerance("bfloat16")
    kc, vc = caches["cpu"]
    kg, vg = caches["cuda"]
    nan = lambda x: (x & 0x7F) == 0x7F  # noqa: E731
    assert ((vg == vc) | (nan(vg) & nan(vc))).all()
    dk = np.abs((kg & 0x7F).astype(int) - (kc & 0x7F).astype(int))
    assert (((kg == kc) | (nan(kg) & nan(kc))) | (((kg & 0x80) == (kc & 0x80)) & (dk == 1))).all()
    assert (kg != kq.view(np.uint8)).any(), "the append wrote nothing"


@pytest.mark.parametrize("nan_codes", [False, True])
@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_cuda_fp8_contiguous_forced_splits_match_the_host_backend(num_splits, nan_codes):
    # Seen on an H100 (reports/raw_decode_cluster_ebcfbe9_2026-12-05, the cluster-merge A/B): a
    # contiguous fp8 cache quantized from N(0, 1) keys with per-head scales 0.005-0.015, forced
    # splits over lengths 2000 / 10 / 777, gave NaN rows on the device. The cause is the inputs:
    # torch 2.11's cast to float8_e4m3fn does not saturate (|x| >= 464 becomes the NaN code 0x7F;
    # newer torch clamps to 448), so the cache held NaN codes and NaN rows are the right answer.
    # Both cases here: codes clamped to +-448 (finite rows, within bf16's tolerance of the host
    # backend), and NaN codes where |x| >= 464 whatever torch does (the same rows NaN on both
    # backends, the other rows as close).
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not flashcpp.WITH_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of flashcpp")
    from flashcpp.decode import BatchDecodeWithKVCache
    g = torch.Generator().manual_seed(11)
    B, S, Hq, Hkv, D = 3, 2112, 16, 4, 128
    lens = [2000, 10, 777]
    kc = torch.randn(B, S, Hkv, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(B, S, Hkv, D, generator=g).to(torch.bfloat16)
    ks = torch.rand(Hkv, generator=g) * 0.01 + 0.005
    vs = torch.rand(Hkv, generator=g) * 0.01 + 0.005

    def codes(x):
        c = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        if nan_codes:
            c.view(torch.uint8)[x.abs() >= 464.0] = 0x7F
        return c

    k8 = codes(kc.float() / ks[:, None])
    v8 = codes(vc.float() / vs[:, None])
    q = torch.randn(B, 1, Hq, D, generator=g).to(torch.bfloat16)
    res = {}
    for dev in ("cpu", "cuda"):
        w = BatchDecodeWithKVCache()
        w.plan(B, Hq, Hkv, D, kv_capacity=S, cache_seqlens=lens, causal=True, dtype=torch.bfloat16, device=dev,
               num_splits=num_splits, kv_dtype=torch.float8_e4m3fn)
        out, lse = w.run(q.to(dev), k8.to(dev), v8.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                         k_scale=ks.to(dev), v_scale=vs.to(dev), return_lse=True)
        res[dev] = (out.float().cpu(), lse.cpu())
    (oc, lc), (og, lg) = res["cpu"], res["cuda"]
    assert torch.equal(oc.isnan(), og.isnan()) and torch.equal(lc.isnan(), lg.isnan())
    assert oc.isnan().any() == nan_codes, "the NaN codes reach no row" if nan_codes else "NaN from finite codes"
    assert torch.isfinite(og[~og.isnan()]).all() and torch.isfinite(lg[~lg.isnan()]).all()
    assert (og - oc).nan_to_num(0.0).abs().max().item() <= 2 * tolerance("bfloat16")
    scale = max(1.0, lc.nan_to_num(0.0).abs().max().item())
    assert (lg - lc).nan_to_num(0.0).abs().max().item() <= 1e-3 * scale


@pytest.mark.parametrize("D, B, per_sm", [(128, 64, 2), (128, 1, 3), (64, 75, 3), (256, 3, 2)])
def test_cuda_fp8_launch_occupancy_matches_the_host_backend(D, B, per_sm):
    # An fp8 cache runs more CTAs per SM than a 16-bit one (4 / 3 / 2 at D = 64 / 128 / 256); a
    # batch of whole sequences that fills several waves may launch at the 16-bit count instead,
    # its shared memory padded (DecodePlan.ctas_per_sm: 64 x 8 KV heads at D = 128, 75 x 8 at D = 64
    # on 132 SMs). Every launch form gives the host backend's rows within bf16's tolerance.
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not flashcpp.WITH_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of flashcpp")
    from flashcpp.decode import BatchDecodeWithKVCache
    g = torch.Generator().manual_seed(D + B)
    Hq, Hkv, S = 32, 8, 200
    lens = torch.randint(1, S + 1, (B,), generator=g, dtype=torch.int32)
    q = torch.randn(B, 1, Hq, D, generator=g).to(torch.bfloat16)
    k8 = (torch.randn(B, S, Hkv, D, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (torch.randn(B, S, Hkv, D, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ks = torch.rand(Hkv, generator=g) * 0.01 + 0.005
    vs = torch.rand(Hkv, generator=g) * 0.01 + 0.005
    res = {}
    for dev in ("cpu", "cuda"):
        w = BatchDecodeWithKVCache()
        w.plan(B, Hq, Hkv, D, kv_capacity=S, cache_seqlens=lens, causal=True, dtype=torch.bfloat16, device=dev,
               kv_dtype=torch.float8_e4m3fn, num_sms=132)
        if dev == "cuda":
            assert w.plan_info.ctas_per_sm == per_sm
        out = torch.full((B, 1, Hq, D), float("nan"), dtype=torch.bfloat16, device=dev)
        w.run(q.to(dev), k8.to(dev), v8.to(dev), lens.to(dev), k_scale=ks.to(dev), v_scale=vs.to(dev), out=out)
        res[dev] = out.float().cpu()
    assert torch.isfinite(res["cuda"]).all()
    assert (res["cuda"] - res["cpu"]).abs().max().item() <= 2 * tolerance("bfloat16")
