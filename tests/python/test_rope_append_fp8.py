"""rope_append_kv into an fp8 e4m3 KV cache with per-KV-head scales (include/flashcpp/fused.h), on
the host backend: numpy caches of ml_dtypes.float8_e4m3fn and torch caches of torch.float8_e4m3fn.

The expected codes come from an independent quantizer: the key rotated in fp32 (apply_rotary on an
fp32 copy: the rotation, not rounded to k's dtype), divided by the head's scale in fp32, clipped to
+-448 (flashcpp saturates where ml_dtypes would give NaN) and cast with ml_dtypes' round to nearest
even. The same bytes must come out of flash_attn_with_kvcache's append (decode) for the same inputs.
"""
import numpy as np
import pytest

import flashcpp

ml_dtypes = pytest.importorskip("ml_dtypes")
FP8 = ml_dtypes.float8_e4m3fn


def quantize(x, scale):
    """x (..., H, D) -> fp8 codes of fp32(x) / scale[h], RNE, saturating at +-448 (NaN stays NaN)."""
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]
    return np.clip(y, -448, 448).astype(FP8)


def codes(a):
    return np.asarray(a).view(np.uint8)


def nan_code(c):
    return (np.asarray(c, np.uint8) & 0x7F) == 0x7F


def _caches(rng, B, S, Hkv, D, Dv, page):
    cap = S + 9
    if page:
        pages_per_seq = (cap + page - 1) // page
        num_pages = B * pages_per_seq + 2
        table = rng.permutation(num_pages)[:B * pages_per_seq].reshape(B, pages_per_seq).astype(np.int32)
        slots, shape = pages_per_seq * page, (num_pages, page, Hkv)
    else:
        table, slots, shape = None, cap, (B, cap, Hkv)
    k_cache = np.full(shape + (D,), np.nan, FP8)  # every untouched code must stay NaN (0x7f)
    v_cache = np.full(shape + (Dv,), np.nan, FP8)
    return k_cache, v_cache, table, slots, shape


@pytest.mark.parametrize("page", [0, 1, 16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_codes_of_the_fp32_rotation_per_head(rng, page, style, dtype):
    B, S, Hq, Hkv, D, Dv, rot = 3, 4, 4, 2, 64, 48, 32
    k_cache, v_cache, table, slots, shape = _caches(rng, B, S, Hkv, D, Dv, page)
    k = (3 * rng.standard_normal((B, S, Hkv, D))).astype(dtype)
    v = (3 * rng.standard_normal((B, S, Hkv, Dv))).astype(dtype)
    q = rng.standard_normal((B, S, Hq, D)).astype(dtype)
    k[2, 3, 1, 5] = np.nan  # NaN in: a NaN code out (and in its rotary partner)
    v[0, 0, 0, :3] = [np.inf, -np.inf, 6e4]  # saturate at +-448
    ks = np.exp2(rng.uniform(-7, 1, Hkv)).astype(np.float32)  # some heads saturate, some reach subnormals
    vs = np.exp2(rng.uniform(-7, 1, Hkv)).astype(np.float32)
    lens = rng.integers(0, slots - S + 1, size=B).astype(np.int32)
    pos = rng.integers(0, 50000, size=(B, S)).astype(np.int32)
    qo = flashcpp.rope_append_kv(k, v, k_cache, v_cache, lens, q, pos, block_table=table, style=style, rotary_dim=rot,
                                 k_scale=ks, v_scale=vs)
    assert qo.dtype == q.dtype
    rq = flashcpp.apply_rotary(q, positions=pos, style=style, rotary_dim=rot)[0]
    assert np.array_equal(qo.view(np.uint8), rq.view(np.uint8))
    rk = flashcpp.apply_rotary(k.astype(np.float32), positions=pos, style=style, rotary_dim=rot)[0]
    written = np.zeros(shape, bool)
    for b in range(B):
        for s in range(S):
            j = lens[b] + s
            blk, row = (table[b, j // page], j % page) if page else (b, j)
            want_k, want_v = quantize(rk[b, s], ks), quantize(v[b, s].astype(np.float32), vs)
            got_k, got_v = codes(k_cache[blk, row]), codes(v_cache[blk, row])
            both_nan = nan_code(got_k) & nan_code(codes(want_k))
            assert np.array_equal(np.where(both_nan, 0, got_k), np.where(both_nan, 0, codes(want_k))), (b, s)
            assert np.array_equal(got_v, codes(want_v)), (b, s)
            written[blk, row] = True
    i, j = lens[2] + 3, 5  # the NaN key and its partner
    blk, row = (table[2, i // page], i % page) if page else (2, i)
    assert nan_code(codes(k_cache[blk, row, 1, j]))
    vblk, vrow = (table[0, lens[0] // page], lens[0] % page) if page else (0, lens[0])
    assert list(codes(v_cache[vblk, vrow, 0, :3])) == [0x7E, 0xFE, 0x7E]
    assert (codes(k_cache[~written]) == 0x7F).all() and (codes(v_cache[~written]) == 0x7F).all()


@pytest.mark.parametrize("rotary", [False, True])
def test_same_bytes_as_the_decode_append(rng, rotary):
    B, Sq, Hq, Hkv, D = 2, 3, 4, 2, 64
    kc = (rng.standard_normal((B, 20, Hkv, D)) * 50).astype(FP8)
    vc = (rng.standard_normal((B, 20, Hkv, D)) * 50).astype(FP8)
    kc0, kc2, vc2 = kc.copy(), kc.copy(), vc.copy()
    q = rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)
    k = (3 * rng.standard_normal((B, Sq, Hkv, D))).astype(np.float32)
    v = (3 * rng.standard_normal((B, Sq, Hkv, D))).astype(np.float32)
    ks = np.exp2(rng.uniform(-6, 0, Hkv)).astype(np.float32)
    vs = np.exp2(rng.uniform(-6, 0, Hkv)).astype(np.float32)
    lens = np.array([4, 17], np.int32)
    kw = dict(rope_theta=10000.0, rotary_interleaved=False) if rotary else {}
    flashcpp.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, k_scale=ks, v_scale=vs, **kw)
    flashcpp.rope_append_kv(k, v, kc2, vc2, lens, style="neox" if rotary else None, k_scale=ks, v_scale=vs)
    assert np.array_equal(codes(kc), codes(kc2)) and np.array_equal(codes(vc), codes(vc2))
    assert not np.array_equal(codes(kc2[0, 4:7]), codes(kc0[0, 4:7]))  # the slots were written


def test_a_number_is_every_heads_scale(rng):
    B, S, Hkv, D = 2, 2, 3, 16
    k = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    caches = [np.zeros((B, 4, Hkv, D), FP8) for _ in range(4)]
    flashcpp.rope_append_kv(k, k, caches[0], caches[1], np.zeros(B, np.int32), k_scale=0.01, v_scale=0.5)
    flashcpp.rope_append_kv(k, k, caches[2], caches[3], np.zeros(B, np.int32), k_scale=np.full(Hkv, 0.01, np.float32),
                            v_scale=[0.5] * Hkv)
    assert all(np.array_equal(codes(a), codes(b)) for a, b in zip(caches[:2], caches[2:]))


def test_fp8_errors(rng):
    B, S, Hkv, D = 2, 1, 2, 16
    k = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    kc, vc = np.zeros((B, 4, Hkv, D), FP8), np.zeros((B, 4, Hkv, D), FP8)
    lens = np.zeros(B, np.int32)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        flashcpp.rope_append_kv(k, k, kc, vc, lens, k_scale=1.0)
    with pytest.raises(ValueError, match="k_scale is given but the cache is not float8_e4m3fn"):
        flashcpp.rope_append_kv(k, k, np.zeros((B, 4, Hkv, D), np.float32), np.zeros((B, 4, Hkv, D), np.float32), lens,
                                k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="or both be float8_e4m3fn"):
        flashcpp.rope_append_kv(k, k, kc, np.zeros((B, 4, Hkv, D), np.float32), lens, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"must be a number or have shape \(heads_kv,\)"):
        flashcpp.rope_append_kv(k, k, kc, vc, lens, k_scale=np.ones(3, np.float32), v_scale=1.0)
    for bad in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match=r"cache.v_scale\[1\] .* must be positive and finite"):
            flashcpp.rope_append_kv(k, k, kc, vc, lens, k_scale=1.0, v_scale=np.array([1.0, bad], np.float32))
    assert (codes(kc) == 0).all() and (codes(vc) == 0).all()  # refused calls write nothing


def _torch():
    return pytest.importorskip("torch")


def test_torch_cpu_fp8_cache(rng):
    torch = _torch()
    B, S, Hq, Hkv, D = 2, 3, 4, 2, 32
    k = torch.from_numpy(3 * rng.standard_normal((B, S, Hkv, D)).astype(np.float32)).to(torch.bfloat16)
    v = torch.from_numpy(3 * rng.standard_normal((B, S, Hkv, D)).astype(np.float32)).to(torch.bfloat16)
    q = torch.from_numpy(rng.standard_normal((B, S, Hq, D)).astype(np.float32)).to(torch.bfloat16)
    kc = torch.full((5, 4, Hkv, D), float("nan")).to(torch.float8_e4m3fn)
    vc = kc.clone()
    table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    lens = torch.tensor([1, 4], dtype=torch.int32)
    ks = torch.tensor([0.02, 0.1])
    qo = flashcpp.rope_append_kv(k, v, kc, vc, lens, q, block_table=table, k_scale=ks, v_scale=0.05)
    assert qo.dtype == torch.bfloat16 and torch.equal(qo, flashcpp.apply_rotary(q, positions=(lens[:, None] + torch.arange(S, dtype=torch.int32)).contiguous())[0])
    # The same call on numpy arrays (ml_dtypes' fp8) writes the same bytes.
    kn = np.full((5, 4, Hkv, D), np.nan, FP8)
    vn = kn.copy()
    flashcpp.rope_append_kv(k.float().numpy(), v.float().numpy(), kn, vn, lens.numpy(), block_table=table.numpy(),
                            k_scale=ks.numpy(), v_scale=0.05)
    assert np.array_equal(kc.view(torch.uint8).numpy(), codes(kn)) and np.array_equal(vc.view(torch.uint8).numpy(), codes(vn))
    assert (kc.view(torch.uint8)[2] == 0x7F).all()  # a page no sequence names
