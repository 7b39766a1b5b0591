"""flash_attn_func / flash_attn_varlen_func on numpy arrays (CPU backend) vs the fp64 reference."""
import numpy as np
import pytest

import flashcpp
from attn_reference import alibi_slopes, attention_ref, tolerance, varlen_ref

LSE_ATOL = 1e-4


def randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def qkv(rng, B, Nq, Nk, Hq, Hkv, D, dtype=np.float32):
    return (randn(rng, (B, Nq, Hq, D), dtype), randn(rng, (B, Nk, Hkv, D), dtype),
            randn(rng, (B, Nk, Hkv, D), dtype))


def assert_close(out, ref, atol, what="out"):
    err = np.abs(np.asarray(out, dtype=np.float64) - ref)
    assert np.isfinite(np.asarray(out, dtype=np.float64)).all(), f"{what} has non-finite values"
    assert err.max() <= atol, f"{what}: max abs err {err.max():.3g} > {atol:.3g} (mean {err.mean():.3g})"


def assert_lse_close(lse, ref):
    lse = np.asarray(lse, dtype=np.float64)
    assert lse.shape == ref.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref)), "rows without keys must have LSE -inf"
    fin = np.isfinite(ref)
    if fin.any():
        assert np.abs(lse[fin] - ref[fin]).max() <= LSE_ATOL


# (B, Nq, Nk, Hq, Hkv, D, causal, window, softcap, alibi)
CASES = [
    (1, 1, 1, 1, 1, 64, False, (-1, -1), 0.0, False),
    (2, 7, 7, 4, 4, 64, True, (-1, -1), 0.0, False),
    (2, 33, 130, 4, 2, 64, True, (-1, -1), 0.0, False),      # causal bottom-right, Nq < Nk, GQA
    (1, 130, 33, 4, 1, 64, True, (-1, -1), 0.0, False),      # Nq > Nk: first rows see no key, MQA
    (2, 127, 127, 2, 2, 128, False, (-1, -1), 0.0, False),
    (1, 65, 97, 4, 2, 128, False, (16, 3), 0.0, False),      # sliding window
    (1, 65, 65, 2, 2, 64, True, (8, -1), 0.0, False),        # causal + left window
    (2, 40, 50, 2, 2, 64, False, (-1, -1), 5.0, False),      # softcap
    (2, 40, 50, 4, 2, 64, True, (-1, -1), 0.0, True),        # ALiBi
    (1, 17, 200, 2, 1, 256, True, (32, 0), 30.0, True),      # everything, head_dim 256
]


@pytest.mark.parametrize("B,Nq,Nk,Hq,Hkv,D,causal,window,softcap,alibi", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matches_fp64_reference(rng, B, Nq, Nk, Hq, Hkv, D, causal, window, softcap, alibi, dtype):
    q, k, v = qkv(rng, B, Nq, Nk, Hq, Hkv, D, dtype)
    slopes = alibi_slopes(Hq) if alibi else None
    out, lse = flashcpp.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                        alibi_slopes=slopes, return_lse=True)
    assert out.dtype == dtype and out.shape == (B, Nq, Hq, D)
    assert lse.dtype == np.float32 and lse.shape == (B, Hq, Nq)
    ref_o, ref_lse = attention_ref(q, k, v, causal=causal, window=window, softcap=softcap,
                                   alibi_slopes=slopes)
    assert_close(out, ref_o, tolerance(dtype))
    assert_lse_close(lse, ref_lse)


def test_rows_without_keys_are_zero_with_lse_minus_inf(rng):
    q, k, v = qkv(rng, 1, 10, 4, 2, 2, 64)
    out, lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
    # bottom-right: query i sees keys j <= i + 4 - 10, so rows 0..5 see nothing
    assert np.all(out[:, :6] == 0) and np.all(np.isneginf(lse[:, :, :6]))
    assert np.all(np.isfinite(lse[:, :, 6:]))


def test_softmax_scale_and_return_without_lse(rng):
    q, k, v = qkv(rng, 1, 9, 9, 2, 2, 64)
    out = flashcpp.flash_attn_func(q, k, v, softmax_scale=0.3)
    assert isinstance(out, np.ndarray)
    assert_close(out, attention_ref(q, k, v, softmax_scale=0.3)[0], tolerance(np.float32))


def test_sdpa_layout_runs_through_strides(rng):
    B, H, N, D = 2, 4, 37, 64
    q_s, k_s, v_s = (randn(rng, (B, H, N, D)) for _ in range(3))  # SDPA (B, H, N, D)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_s, k_s, v_s))  # views (B, N, H, D)
    assert not q.flags.c_contiguous and np.shares_memory(q, q_s)
    # The strides that reach C++ are the view's own: no copy on the way.
    m = flashcpp._core.meta(q, "q")
    assert m.strides == (H * N * D, D, N * D, 1)
    assert flashcpp._core._view(m, varlen=False) == (H * N * D, D, N * D)
    out = flashcpp.flash_attn_func(q, k, v, causal=True)
    ref = flashcpp.flash_attn_func(*(np.ascontiguousarray(x) for x in (q, k, v)), causal=True)
    assert np.array_equal(out, ref)
    assert_close(out, attention_ref(q, k, v, causal=True)[0], tolerance(np.float32))


def test_strided_output_and_packed_qkv(rng):
    B, N, H, D = 2, 21, 2, 64
    qkv_packed = randn(rng, (B, N, 3, H, D))  # one buffer, q/k/v interleaved
    q, k, v = qkv_packed[:, :, 0], qkv_packed[:, :, 1], qkv_packed[:, :, 2]
    out_s = np.full((B, H, N, D), np.nan, dtype=np.float32)  # caller-owned SDPA-layout output
    out, lse = flashcpp.attention(q, k, v, out=out_s.transpose(0, 2, 1, 3), causal=True)
    assert np.shares_memory(out, out_s) and lse is None
    assert_close(out_s.transpose(0, 2, 1, 3), attention_ref(q, k, v, causal=True)[0], tolerance(np.float32))


def test_tiled_backend_agrees_with_fp64_backend(rng):
    q, k, v = qkv(rng, 2, 70, 90, 4, 2, 128)
    kw = dict(causal=True, window_size=(40, 5), return_lse=True)
    o1, l1 = flashcpp.attention(q, k, v, backend="cpu", **kw)
    o2, l2 = flashcpp.attention(q, k, v, backend="cpu-reference", **kw)
    assert_close(o1, o2.astype(np.float64), 2e-5)
    assert_lse_close(l1, l2.astype(np.float64))


def test_global_tokens_attention_sinks(rng):
    q, k, v = qkv(rng, 1, 50, 50, 2, 2, 64)
    out = flashcpp.attention(q, k, v, causal=True, window_size=(8, 0), global_tokens=4)[0]
    # reference: the first 4 keys ignore window_left
    vis = np.zeros((50, 50), dtype=bool)
    for i in range(50):
        for j in range(50):
            vis[i, j] = j <= i and (j >= i - 8 or j < 4)
    s = np.einsum("ihd,jhd->hij", q[0].astype(np.float64), k[0].astype(np.float64)) / 8.0
    s = np.where(vis, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("hij,jhd->ihd", p, v[0].astype(np.float64))
    assert_close(out[0], ref, tolerance(np.float32))


def test_empty_problems(rng):
    q, k, v = qkv(rng, 2, 0, 5, 2, 2, 64)
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)
    q, k, v = qkv(rng, 2, 3, 0, 2, 2, 64)
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("causal,window,alibi", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                  (True, (6, -1), False), (False, (5, 5), False)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_varlen_matches_reference(rng, causal, window, alibi, dtype):
    lens_q = [5, 0, 33, 1, 64]
    lens_k = [9, 4, 33, 7, 40]  # includes Nq > Nk (rows without keys when causal)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    Hq, Hkv, D = 4, 2, 64
    q = randn(rng, (cu_q[-1], Hq, D), dtype)
    k = randn(rng, (cu_k[-1], Hkv, D), dtype)
    v = randn(rng, (cu_k[-1], Hkv, D), dtype)
    slopes = np.stack([alibi_slopes(Hq) * (b + 1) for b in range(len(lens_q))]) if alibi else None
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                               causal=causal, window_size=window,
                                               alibi_slopes=slopes, return_lse=True)
    assert out.shape == q.shape and lse.shape == (Hq, cu_q[-1])
    ref_o, ref_lse = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window=window, alibi_slopes=slopes)
    assert_close(out, ref_o, tolerance(dtype))
    assert_lse_close(lse, ref_lse)


def test_varlen_accepts_lists_and_pads_unused_rows(rng):
    q = randn(rng, (12, 2, 64))  # 10 rows used, 2 rows of padding
    k = randn(rng, (10, 2, 64))
    v = randn(rng, (10, 2, 64))
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, [0, 4, 10], [0, 6, 10], 6, 6, return_lse=True)
    assert np.all(out[10:] == 0) and np.all(np.isneginf(lse[:, 10:]))
    ref_o, _ = varlen_ref(q, k, v, [0, 4, 10], [0, 6, 10])
    assert_close(out, ref_o, tolerance(np.float32))


def test_varlen_lse_layout_follows_the_packed_rows_with_padding(rng):
    # The LSE is (heads_q, q.shape[0]): head h's row r at lse[h, r] even when cu_seqlens_q[-1] <
    # q.shape[0] (the row stride used to be cu_seqlens_q[-1], misplacing every head past the first).
    q = randn(rng, (12, 3, 64))  # 10 rows used, 2 of padding, 3 heads
    k = randn(rng, (10, 3, 64))
    v = randn(rng, (10, 3, 64))
    cu_q, cu_k = [0, 4, 10], [0, 6, 10]
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, return_lse=True)
    ref_o, ref_lse = varlen_ref(q[:10], k, v, cu_q, cu_k)
    assert lse.shape == (3, 12)
    assert_lse_close(lse[:, :10], ref_lse)
    assert np.all(np.isneginf(lse[:, 10:])) and np.all(out[10:] == 0)


def test_varlen_batch_zero_writes_zeros_and_minus_inf():
    # cu_seqlens = [0]: no sequence, every packed row is O = 0, LSE = -inf (outputs start poisoned).
    q = np.full((8, 2, 64), 3.0, np.float32)
    for max_k in (0, 5):
        out = np.full_like(q, np.nan)
        lse = np.full((2, 8), np.nan, np.float32)
        flashcpp.attention(q, q, q, out=out, lse=lse, cu_seqlens_q=[0], cu_seqlens_k=[0],
                           max_seqlen_q=0, max_seqlen_k=max_k)
        assert np.all(out == 0) and np.all(np.isneginf(lse)), f"max_seqlen_k {max_k}"
    out, lse = flashcpp.flash_attn_varlen_func(q, q, q, [0], [0], 0, 0, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_bfloat16_via_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="numpy bfloat16 needs ml_dtypes")
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in qkv(rng, 1, 19, 23, 2, 1, 64))
    out = flashcpp.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == q.dtype
    assert_close(out.astype(np.float32), attention_ref(q.astype(np.float32), k.astype(np.float32),
                                                       v.astype(np.float32), causal=True)[0], 2e-2)


def test_select_kernel_names_the_cpu_kernel(rng):
    q, k, v = qkv(rng, 1, 8, 8, 2, 2, 64)
    choice = flashcpp.select_kernel(q, k, v, causal=True)
    assert choice.kernel == "cpu_tiled_online_softmax" and choice.reason
    assert flashcpp.select_kernel(q, k, v, backend="cpu-reference").kernel == "cpu_reference_fp64"


def test_build_flags():
    assert isinstance(flashcpp.WITH_CUDA, bool)
    assert tuple(flashcpp.SUPPORTED_HEAD_DIMS) == tuple(range(8, 257, 8))
    assert tuple(flashcpp.CUDA_HEAD_DIMS) == (64, 128, 256)
    assert flashcpp.__version__ and flashcpp.GIT_COMMIT
