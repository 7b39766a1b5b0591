"""Fused kernels from Python: RMSNorm (+ residual), SwiGLU, rotary, on the CPU backend (numpy;
torch CPU tensors when torch imports) against float64 references written here, and on CUDA
tensors when a GPU and a CUDA build are present (skipped otherwise).

Tolerance (include/flashcpp/fused.h, tests/cpu/test_fused.cc): |out - ref| <= 1e-3 + 1e-3 |ref|
plus half an ulp of the output dtype (storing into bf16 alone costs up to 2^-8 relative).
"""
import math

import numpy as np
import pytest

import flashcpp

HALF_ULP = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def assert_close(got, ref, dtype_name):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    tol = 1e-3 + (1e-3 + HALF_ULP[dtype_name]) * np.abs(ref)
    err = np.abs(got - ref)
    bad = ~(err <= tol)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} out of tolerance, max err {np.nanmax(err):.3e} "
                           f"at {np.unravel_index(np.nanargmax(err / tol), err.shape)}")


# ---- float64 references -------------------------------------------------------------------

def rms_norm_ref(x, w, eps, residual=None, dtype=None):
    """Returns (y, h) in float64; h = round_dtype(fp32(x) + fp32(residual)) as fused.h defines."""
    if residual is not None:
        h = (x.astype(np.float32) + residual.astype(np.float32)).astype(dtype).astype(np.float64)
    else:
        h = x.astype(np.float64)
    rstd = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    return h * rstd * w.astype(np.float64), h


def silu_mul_ref(g, u):
    g = g.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u.astype(np.float64)


def inv_freq_ref(rot, theta, llama3=None):
    f = 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    if llama3 is None:
        return f
    factor, low, high = llama3["factor"], llama3["low_freq_factor"], llama3["high_freq_factor"]
    old = llama3["original_max_position_embeddings"]
    wavelen = 2 * math.pi / f
    scaled = np.where(wavelen > old / low, f / factor, f)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


def rope_ref(x, pos, rot, style, theta=10000.0, llama3=None, cache=None):
    """x (tokens, heads, d) float64, pos (tokens,) -> rotated float64."""
    x = x.astype(np.float64).copy()
    half = rot // 2
    if cache is not None:
        c, s = cache[pos, :half].astype(np.float64), cache[pos, half:].astype(np.float64)
    else:
        ang = pos.astype(np.float64)[:, None] * inv_freq_ref(rot, theta, llama3)[None, :]
        c, s = np.cos(ang), np.sin(ang)
    c, s = c[:, None, :], s[:, None, :]
    if style == "neox":
        a, b = x[..., :half].copy(), x[..., half:rot].copy()
        x[..., :half], x[..., half:rot] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:rot:2].copy(), x[..., 1:rot:2].copy()
        x[..., 0:rot:2], x[..., 1:rot:2] = a * c - b * s, b * c + a * s
    return x


# ---- RMSNorm ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("hidden", [1, 8, 4097])
def test_rms_norm_numpy(rng, dtype, hidden):
    x = rng.standard_normal((2, 3, hidden)).astype(dtype)
    w = rng.standard_normal(hidden).astype(dtype)
    y = flashcpp.rms_norm(x, w, eps=1e-5)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, rms_norm_ref(x, w, 1e-5)[0], np.dtype(dtype).name)


def test_rms_norm_strided_rows_and_in_place(rng):
    big = rng.standard_normal((5, 300)).astype(np.float32)
    big0 = big.copy()
    x = big[:, 10:138]  # row stride 300, offset 10
    w = rng.standard_normal(128).astype(np.float32)
    ref = rms_norm_ref(x, w, 1e-6)[0]
    y = flashcpp.rms_norm(x, w)
    assert_close(y, ref, "float32")
    out = flashcpp.rms_norm(x, w, out=x)  # in place into the strided view
    assert out is x
    assert_close(x, ref, "float32")
    assert np.array_equal(big[:, :10], big0[:, :10]) and np.array_equal(big[:, 138:], big0[:, 138:])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("hidden", [1, 8, 4097])
def test_fused_add_rms_norm_in_place(rng, dtype, hidden):
    x = rng.standard_normal((7, hidden)).astype(dtype)
    r = rng.standard_normal((7, hidden)).astype(dtype)
    w = rng.standard_normal(hidden).astype(dtype)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, residual=r, dtype=dtype)
    out, res = flashcpp.fused_add_rms_norm(x, r, w)
    assert out is x and res is r  # in place by default
    assert np.array_equal(r.astype(np.float64), h_ref)  # the updated residual is exact
    assert_close(x, y_ref, np.dtype(dtype).name)


def test_fused_add_rms_norm_out_of_place(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    r = rng.standard_normal((4, 64)).astype(np.float32)
    w = np.ones(64, dtype=np.float32)
    x0, r0 = x.copy(), r.copy()
    out, res = np.empty_like(x), np.empty_like(r)
    flashcpp.fused_add_rms_norm(x, r, w, out=out, residual_out=res)
    assert np.array_equal(x, x0) and np.array_equal(r, r0)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, residual=r, dtype=np.float32)
    assert np.array_equal(res.astype(np.float64), h_ref)
    assert_close(out, y_ref, "float32")


def test_norm_errors(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = np.ones(64, dtype=np.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        flashcpp.rms_norm(x, w[:32])
    with pytest.raises(TypeError, match="dtype"):
        flashcpp.rms_norm(x, w.astype(np.float16))
    with pytest.raises(ValueError, match="eps"):
        flashcpp.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="overlaps"):  # out shifted by one row over x
        big = np.zeros((5, 64), dtype=np.float32)
        flashcpp.rms_norm(big[:4], w, out=big[1:])
    with pytest.raises(ValueError, match="cuda"):
        flashcpp.rms_norm(x, w, backend="cuda")
    with pytest.raises(ValueError, match="residual must have"):
        flashcpp.fused_add_rms_norm(x, x[:2], w)


# ---- SwiGLU -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("d", [1, 8, 4097])
def test_silu_and_mul_both_forms(rng, dtype, d):
    x = (3 * rng.standard_normal((2, 3, 2 * d))).astype(dtype)
    out = flashcpp.silu_and_mul(x)
    assert out.shape == (2, 3, d) and out.dtype == x.dtype
    assert_close(out, silu_mul_ref(x[..., :d], x[..., d:]), np.dtype(dtype).name)
    g, u = x[..., :d].copy(), x[..., d:].copy()
    assert_close(flashcpp.silu_and_mul(g, u), silu_mul_ref(g, u), np.dtype(dtype).name)


def test_silu_and_mul_in_place_into_gate(rng):
    x = (3 * rng.standard_normal((5, 2 * 100))).astype(np.float32)
    x0 = x.copy()
    gate = x[:, :100]
    out = flashcpp.silu_and_mul(x, out=gate)
    assert out is gate
    assert_close(x[:, :100], silu_mul_ref(x0[:, :100], x0[:, 100:]), "float32")
    assert np.array_equal(x[:, 100:], x0[:, 100:])


def test_silu_errors(rng):
    x = rng.standard_normal((4, 7)).astype(np.float32)
    with pytest.raises(ValueError, match="even"):
        flashcpp.silu_and_mul(x)
    with pytest.raises(ValueError, match="same shape"):
        flashcpp.silu_and_mul(x, x[:, :6])
    with pytest.raises(TypeError, match="dtype"):
        flashcpp.silu_and_mul(x.astype(np.int32))


# ---- rotary -------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rot", [None, 32, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rotary_styles_partial(rng, style, rot, dtype):
    T, Hq, Hk, D = 9, 4, 2, 64
    q = rng.standard_normal((T, Hq, D)).astype(dtype)
    k = rng.standard_normal((T, Hk, D)).astype(dtype)
    pos = rng.integers(0, 100000, size=T).astype(np.int32)
    qo, ko = flashcpp.apply_rotary(q, k, pos, style=style, rotary_dim=rot)
    r = D if rot is None else rot
    assert_close(qo, rope_ref(q, pos, r, style), np.dtype(dtype).name)
    assert_close(ko, rope_ref(k, pos, r, style), np.dtype(dtype).name)


def test_rotary_batched_arange_llama3_and_inplace(rng):
    B, S, H, D = 2, 6, 3, 128
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    ref = np.stack([rope_ref(q[b], np.arange(S), D, "neox", 500000.0, llama3) for b in range(B)])
    q2 = q.copy()
    qo, ko = flashcpp.apply_rotary(q2, theta=500000.0, llama3=llama3, inplace=True)
    assert qo is q2 and ko is None
    assert_close(q2, ref, "float32")


def test_rotary_packed_qkv_views_in_place(rng):
    T, Hq, Hk, D = 5, 4, 2, 16
    qkv = rng.standard_normal((T, Hq + 2 * Hk, D)).astype(np.float32)
    qkv0 = qkv.copy()
    pos = np.arange(10, 10 + T, dtype=np.int32)
    q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hk]
    flashcpp.apply_rotary(q, k, pos, style="interleaved", inplace=True)
    assert_close(qkv[:, :Hq], rope_ref(qkv0[:, :Hq], pos, D, "interleaved"), "float32")
    assert_close(qkv[:, Hq:Hq + Hk], rope_ref(qkv0[:, Hq:Hq + Hk], pos, D, "interleaved"), "float32")
    assert np.array_equal(qkv[:, Hq + Hk:], qkv0[:, Hq + Hk:])  # v untouched


def test_rotary_cos_sin_cache(rng):
    T, H, D, rot, P = 8, 2, 64, 32, 50
    ang = np.arange(P)[:, None] * inv_freq_ref(rot, 10000.0)[None, :]
    cache = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = rng.integers(0, P, size=T)
    qo, _ = flashcpp.apply_rotary(q, None, pos, rotary_dim=rot, cos_sin_cache=cache)
    assert_close(qo, rope_ref(q, pos, rot, "neox", cache=cache), "float32")
    with pytest.raises(ValueError, match="outside the cos/sin tables' rows"):
        flashcpp.apply_rotary(q, None, np.full(T, P), rotary_dim=rot, cos_sin_cache=cache)


def test_rotary_errors(rng):
    q = rng.standard_normal((4, 2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="rotary_dim"):
        flashcpp.apply_rotary(q, rotary_dim=33)
    with pytest.raises(ValueError, match="style"):
        flashcpp.apply_rotary(q, style="gptj")
    with pytest.raises(ValueError, match="positions must have shape"):
        flashcpp.apply_rotary(q, positions=np.arange(3))
    with pytest.raises(ValueError, match="3-D"):
        flashcpp.apply_rotary(q[0])
    with pytest.raises(ValueError, match="llama3"):
        flashcpp.apply_rotary(q, llama3={"low_freq_factor": 1.0})


# ---- torch ----------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="torch tests need torch")


def test_torch_cpu_bf16(rng):
    torch = _torch()
    x = torch.from_numpy(rng.standard_normal((6, 4097)).astype(np.float32)).to(torch.bfloat16)
    r = torch.from_numpy(rng.standard_normal((6, 4097)).astype(np.float32)).to(torch.bfloat16)
    w = torch.from_numpy(rng.standard_normal(4097).astype(np.float32)).to(torch.bfloat16)
    h = (x.float() + r.float()).to(torch.bfloat16).double()
    ref = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w.double()
    out, res = flashcpp.fused_add_rms_norm(x.clone(), r.clone(), w)
    assert torch.equal(res.double(), h)
    assert_close(out.double().numpy(), ref.numpy(), "bfloat16")
    g = torch.from_numpy(3 * rng.standard_normal((6, 2 * 100)).astype(np.float32)).to(torch.bfloat16)
    assert_close(flashcpp.silu_and_mul(g).double().numpy(), silu_mul_ref(g[:, :100].double().numpy(),
                                                                          g[:, 100:].double().numpy()), "bfloat16")


def _cuda_or_skip():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not flashcpp.WITH_CUDA:
        pytest.skip("this build has no CUDA kernels (FLASHCPP_CUDA=OFF)")
    return torch


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_cuda_kernels_vs_float64(rng, dtype_name):
    torch = _cuda_or_skip()
    dt = getattr(torch, dtype_name)
    t = lambda a: torch.from_numpy(a.astype(np.float32)).to("cuda", dt)  # noqa: E731
    x, r = t(rng.standard_normal((64, 4096))), t(rng.standard_normal((64, 4096)))
    w = t(rng.standard_normal(4096))
    h = (x.float() + r.float()).to(dt).double()
    ref = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w.double()
    out, res = flashcpp.fused_add_rms_norm(x.clone(), r.clone(), w)
    torch.cuda.synchronize()
    assert torch.equal(res.double(), h)
    assert_close(out.double().cpu().numpy(), ref.cpu().numpy(), dtype_name)
    g = t(3 * rng.standard_normal((64, 2 * 1000)))
    o = flashcpp.silu_and_mul(g)
    ref = silu_mul_ref(g[:, :1000].double().cpu().numpy(), g[:, 1000:].double().cpu().numpy())
    assert_close(o.double().cpu().numpy(), ref, dtype_name)
    q = t(rng.standard_normal((2, 33, 8, 128)))
    pos = torch.randint(0, 100000, (2, 33), device="cuda", dtype=torch.int32)
    qo, _ = flashcpp.apply_rotary(q, positions=pos, style="interleaved", rotary_dim=64)
    ref = np.stack([rope_ref(q[b].double().cpu().numpy(), pos[b].cpu().numpy(), 64, "interleaved")
                    for b in range(2)])
    assert_close(qo.double().cpu().numpy(), ref, dtype_name)


def test_cuda_rejects_fp32_and_host_backend_mismatch(rng):
    torch = _cuda_or_skip()
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(NotImplementedError, match="fp32"):
        flashcpp.rms_norm(x, torch.ones(64, device="cuda"))
    with pytest.raises(ValueError, match="host"):
        flashcpp.rms_norm(x.half(), torch.ones(64, device="cuda").half(), backend="cpu")


# ---- QK-RMSNorm + rotary, rotary + KV-cache append ------------------------------------------

@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_qk_norm_rope_equals_rms_norm_then_apply_rotary(rng, style, dtype):
    """fused.h's rounding rule: the normed head is rounded before the rotation, so the fused op has
    the bits of rms_norm per head followed by apply_rotary."""
    T, Hq, Hk, D = 7, 4, 2, 64
    q = (2 * rng.standard_normal((T, Hq, D))).astype(dtype)
    k = (2 * rng.standard_normal((T, Hk, D))).astype(dtype)
    wq, wk = rng.standard_normal(D).astype(dtype), rng.standard_normal(D).astype(dtype)
    pos = rng.integers(0, 100000, size=T).astype(np.int32)
    qo, ko = flashcpp.qk_norm_rope(q, k, wq, wk, pos, style=style, rotary_dim=32)
    uq = flashcpp.rms_norm(q.reshape(-1, D), wq).reshape(q.shape)
    uk = flashcpp.rms_norm(k.reshape(-1, D), wk).reshape(k.shape)
    rq, rk = flashcpp.apply_rotary(uq, uk, pos, style=style, rotary_dim=32)
    assert np.array_equal(qo.view(np.uint8), rq.view(np.uint8))
    assert np.array_equal(ko.view(np.uint8), rk.view(np.uint8))
    q2, k2 = q.copy(), k.copy()
    out = flashcpp.qk_norm_rope(q2, k2, wq, wk, pos, style=style, rotary_dim=32, inplace=True)
    assert out[0] is q2 and out[1] is k2
    assert np.array_equal(q2.view(np.uint8), rq.view(np.uint8))


def test_qk_norm_rope_gemma_offset_vs_float64(rng):
    B, S, H, D = 2, 5, 3, 128
    q = (3 * rng.standard_normal((B, S, H, D))).astype(np.float32)
    w = (0.2 * rng.standard_normal(D)).astype(np.float32)
    qo, ko = flashcpp.qk_norm_rope(q, None, w, weight_offset=1.0, eps=1e-6, theta=1e6)
    assert ko is None
    x = q.astype(np.float64)
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1.0 + w.astype(np.float64))
    ref = np.stack([rope_ref(n[b], np.arange(S), D, "neox", 1e6) for b in range(B)])
    assert_close(qo, ref, "float32")
    # style None: the per-head norm only; NaN in a head stays in that head.
    q[0, 1, 2, 7] = np.nan
    qo, _ = flashcpp.qk_norm_rope(q, None, w, weight_offset=1.0, style=None)
    assert np.isnan(qo[0, 1, 2]).all() and not np.isnan(qo[0, 1, :2]).any() and not np.isnan(qo[1]).any()


def test_qk_norm_rope_errors(rng):
    q = rng.standard_normal((4, 2, 512)).astype(np.float32)
    w = np.ones(512, np.float32)
    with pytest.raises(ValueError, match=r"head_dim 512 must be even and in \[2, 256\]"):
        flashcpp.qk_norm_rope(q, None, w)
    q, w = q[..., :64].copy(), w[:64].copy()
    with pytest.raises(ValueError, match="weight_offset 0.5 must be 0"):
        flashcpp.qk_norm_rope(q, None, w, weight_offset=0.5)
    with pytest.raises(ValueError, match="k_weight is required"):
        flashcpp.qk_norm_rope(q, q.copy(), w)
    with pytest.raises(ValueError, match="q_weight must be a contiguous"):
        flashcpp.qk_norm_rope(q, None, w[:32])
    with pytest.raises(TypeError, match="share one dtype"):
        flashcpp.qk_norm_rope(q, None, w.astype(np.float16))


def _append_expect(k_new, v_new, q, lens, pos, style, rot, table=None, page=0, cap_shape=None):
    """float64-free expectation: apply_rotary's bits for k and q, v copied, per slot."""
    B, S = k_new.shape[:2]
    rq = flashcpp.apply_rotary(q, positions=pos, style=style, rotary_dim=rot)[0] if q is not None else None
    rk = flashcpp.apply_rotary(k_new, positions=pos, style=style, rotary_dim=rot)[0]
    places = []
    for b in range(B):
        for s in range(S):
            j = lens[b] + s
            places.append(((table[b, j // page], j % page) if page else (b, j), b, s))
    return rq, rk, places


@pytest.mark.parametrize("page", [0, 1, 16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_append_kv_paged_and_contiguous(rng, page, style):
    B, S, Hq, Hkv, D, Dv, rot = 3, 4, 4, 2, 64, 48, 32
    dtype = np.float16
    cap = S + 9
    pages_per_seq = (cap + page - 1) // page if page else 0
    if page:
        num_pages = B * pages_per_seq + 2
        table = rng.permutation(num_pages)[:B * pages_per_seq].reshape(B, pages_per_seq).astype(np.int32)
        slots, shape = pages_per_seq * page, (num_pages, page, Hkv)
    else:
        table, slots, shape = None, cap, (B, cap, Hkv)
    k_cache = np.full(shape + (D,), np.nan, dtype)
    v_cache = np.full(shape + (Dv,), np.nan, dtype)
    k = rng.standard_normal((B, S, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, S, Hkv, Dv)).astype(dtype)
    q = rng.standard_normal((B, S, Hq, D)).astype(dtype)
    lens = rng.integers(0, slots - S + 1, size=B).astype(np.int32)
    pos = (lens[:, None] + np.arange(S)[None, :]).astype(np.int32)  # the default: the slots
    qo = flashcpp.rope_append_kv(k, v, k_cache, v_cache, lens, q, block_table=table, style=style, rotary_dim=rot)
    rq, rk, places = _append_expect(k, v, q, lens, pos, style, rot, table, page)
    assert np.array_equal(qo.view(np.uint16), rq.view(np.uint16))
    written = np.zeros(shape, bool)
    for (blk, row), b, s in places:
        assert np.array_equal(k_cache[blk, row].view(np.uint16), rk[b, s].view(np.uint16))
        assert np.array_equal(v_cache[blk, row].view(np.uint16), v[b, s].view(np.uint16))
        written[blk, row] = True
    assert np.isnan(k_cache[~written]).all() and np.isnan(v_cache[~written]).all()


def test_rope_append_kv_decode_step_positions_and_errors(rng):
    B, H, D = 5, 2, 16
    k = rng.standard_normal((B, H, D)).astype(np.float32)  # 3-D: one new token a sequence
    v = rng.standard_normal((B, H, D)).astype(np.float32)
    kc, vc = np.zeros((B, 8, H, D), np.float32), np.zeros((B, 8, H, D), np.float32)
    lens = np.array([0, 3, 7, 1, 2], np.int32)
    pos = np.array([100, 5, 9, 0, 77], np.int32)
    assert flashcpp.rope_append_kv(k, v, kc, vc, lens, positions=pos, style="interleaved") is None
    rk, _ = flashcpp.apply_rotary(k[:, None], positions=pos[:, None], style="interleaved")
    for b in range(B):
        assert np.array_equal(kc[b, lens[b]], rk[b, 0]) and np.array_equal(vc[b, lens[b]], v[b])
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 8 leaves no room for the 1 new tokens"):
        flashcpp.rope_append_kv(k, v, kc, vc, np.array([0, 3, 8, 1, 2], np.int32))
    with pytest.raises(ValueError, match="outside the pool's pages"):
        flashcpp.rope_append_kv(k, v, kc, vc, np.zeros(B, np.int32), block_table=np.full((B, 1), 9, np.int32))
    with pytest.raises(ValueError, match="must be 4-D"):
        flashcpp.rope_append_kv(k, v, kc[0], vc, lens)


def test_new_fusions_torch_cpu_bf16(rng):
    torch = _torch()
    q = torch.from_numpy(2 * rng.standard_normal((2, 5, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    k = torch.from_numpy(2 * rng.standard_normal((2, 5, 2, 64)).astype(np.float32)).to(torch.bfloat16)
    w = torch.from_numpy(rng.standard_normal(64).astype(np.float32)).to(torch.bfloat16)
    qo, ko = flashcpp.qk_norm_rope(q, k, w, w)
    nq = flashcpp.rms_norm(q.reshape(-1, 64), w).reshape(q.shape)
    nk = flashcpp.rms_norm(k.reshape(-1, 64), w).reshape(k.shape)
    rq, rk = flashcpp.apply_rotary(nq, nk)
    assert torch.equal(qo, rq) and torch.equal(ko, rk)
    kc = torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    lens = torch.tensor([0, 3], dtype=torch.int32)
    flashcpp.rope_append_kv(ko, k, kc, vc, lens, style=None)
    assert torch.equal(kc[0, :5], ko[0]) and torch.equal(kc[1, 3:8], ko[1]) and torch.equal(vc[1, 3:8], k[1])


def test_new_fusions_cuda(rng):
    torch = _cuda_or_skip()
    q = torch.randn(3, 17, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 17, 2, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    qo, ko = flashcpp.qk_norm_rope(q, k, w, w)
    nq = flashcpp.rms_norm(q.reshape(-1, 128), w).reshape(q.shape)
    nk = flashcpp.rms_norm(k.reshape(-1, 128), w).reshape(k.shape)
    rq, rk = flashcpp.apply_rotary(nq, nk)
    assert torch.equal(qo, rq) and torch.equal(ko, rk)
    kc = torch.full((8, 16, 2, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc = kc.clone()
    table = torch.randperm(8, device="cuda", dtype=torch.int32)[:6].view(3, 2)
    lens = torch.tensor([0, 5, 15], device="cuda", dtype=torch.int32)
    qr = flashcpp.rope_append_kv(k, k, kc, vc, lens, q, block_table=table)
    pos = (lens[:, None] + torch.arange(17, device="cuda", dtype=torch.int32)[None, :]).contiguous()
    eq, ek = flashcpp.apply_rotary(q, k, pos)
    assert torch.equal(qr, eq)
    for b in range(3):
        for s in range(17):
            j = int(lens[b]) + s
            page = int(table[b, j // 16])
            assert torch.equal(kc[page, j % 16], ek[b, s]) and torch.equal(vc[page, j % 16], k[b, s])


@pytest.mark.parametrize("op", ["apply_rotary", "qk_norm_rope"])
@pytest.mark.parametrize("inplace", [False, True])
def test_q_without_heads_still_rotates_k(op, inplace):
    # q with 0 heads and k with some: k is rotated (normed) as if alone. Both used to skip the
    # launch whenever q had no heads, leaving k_out uninitialized (or k unchanged in place).
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 3, 2, 16)).astype(np.float32)
    q = np.zeros((1, 3, 0, 16), np.float32)
    kw = rng.standard_normal(16).astype(np.float32)
    if op == "apply_rotary":
        want = flashcpp.apply_rotary(k.copy(), None)[0]
        run = lambda q_, k_, **kw_: flashcpp.apply_rotary(q_, k_, **kw_)  # noqa: E731
    else:
        want = flashcpp.qk_norm_rope(k.copy(), None, kw)[0]
        run = lambda q_, k_, **kw_: flashcpp.qk_norm_rope(q_, k_, np.ones(16, np.float32), kw, **kw_)  # noqa: E731
    kk = k.copy()
    q_out, k_out = run(q, kk, inplace=inplace)
    assert q_out.shape == q.shape
    np.testing.assert_array_equal(kk if inplace else k_out, want)
    if not inplace:
        np.testing.assert_array_equal(kk, k)  # the input is left alone


def test_apply_rotary_rotary_dim_0_is_head_dim_with_a_cache():
    # rotary_dim=0 means head_dim, with a cos_sin_cache too (it said the cache must be (max_position, 0))
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 2, 16)).astype(np.float32)
    cache = rng.standard_normal((50, 16)).astype(np.float32)
    a = flashcpp.apply_rotary(q, None, rotary_dim=0, cos_sin_cache=cache)[0]
    b = flashcpp.apply_rotary(q, None, rotary_dim=16, cos_sin_cache=cache)[0]
    np.testing.assert_array_equal(a, b)
