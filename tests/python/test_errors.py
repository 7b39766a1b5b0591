"""Bad input gives a Python exception with a sentence, never a crash (numpy path)."""
import numpy as np
import pytest

import flashcpp


def arrays(B=1, Nq=8, Nk=8, Hq=2, Hkv=2, D=64, dtype=np.float32):
    z = lambda *s: np.zeros(s, dtype=dtype)  # noqa: E731
    return z(B, Nq, Hq, D), z(B, Nk, Hkv, D), z(B, Nk, Hkv, D)


def test_dtype_mismatch_is_type_error():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="same dtype"):
        flashcpp.flash_attn_func(q, k.astype(np.float16), v)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_unsupported_dtypes_are_type_errors(dtype):
    q, k, v = (x.astype(dtype) for x in arrays())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        flashcpp.flash_attn_func(q, k, v)


def test_float64_runs_on_the_fp64_reference_only():
    # float64 is for gradcheck: "auto" takes the fp64 reference; the tiled backend says why not.
    q, k, v = arrays(dtype=np.float64)
    out = flashcpp.flash_attn_func(q, k, v)
    assert out.dtype == np.float64
    with pytest.raises(NotImplementedError, match="fp64 runs on the fp64 reference backend only"):
        flashcpp.attention(q, k, v, backend="cpu")


def test_non_array_input_is_type_error():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        flashcpp.flash_attn_func(q.tolist(), k, v)


def test_non_contiguous_last_dim_names_it():
    q, k, v = arrays(D=128)
    with pytest.raises(ValueError, match=r"k: the last dimension \(head_dim\) must be contiguous"):
        flashcpp.flash_attn_func(q[..., :64], k[..., ::2], v[..., :64])


def test_negative_strides_are_value_errors():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="negative stride"):
        flashcpp.flash_attn_func(q[:, ::-1], k, v)


@pytest.mark.parametrize("kw,match", [
    (dict(k_shape=(2, 8, 2, 64)), "same batch size"),
    (dict(k_shape=(1, 8, 2, 128)), "same head_dim"),
    (dict(k_shape=(1, 8, 3, 64)), "multiple of heads"),
    (dict(v_shape=(1, 9, 2, 64)), "k and v must have the same shape except the last dimension"),
    (dict(v_shape=(1, 8, 1, 64)), "k and v must have the same shape except the last dimension"),
    (dict(q_shape=(8, 2, 64)), "must be 4-D"),
])
def test_shape_disagreements_are_value_errors(kw, match):
    q, k, v = arrays()
    z = lambda s: np.zeros(s, dtype=np.float32)  # noqa: E731
    q = z(kw["q_shape"]) if "q_shape" in kw else q
    k = z(kw["k_shape"]) if "k_shape" in kw else k
    v = z(kw["v_shape"]) if "v_shape" in kw else (z(k.shape) if "k_shape" in kw else v)
    with pytest.raises(ValueError, match=match):
        flashcpp.flash_attn_func(q, k, v)


def test_unsupported_head_dim_names_the_rule():
    # The C++ sentence (src/core/head_dim_checks.h); 80 and 96 are supported now (CPU backends).
    for d in (84, 264, 4):
        q, k, v = arrays(D=d)
        with pytest.raises(ValueError, match=rf"^head_dim {d} is not supported \(it must be a multiple of 8 in "
                                             r"\[8, 256\]\)$"):
            flashcpp.flash_attn_func(q, k, v)


@pytest.mark.parametrize("window", [(-2, 0), (1,), "ab", None])
def test_bad_window_is_value_error(window):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="window_size"):
        flashcpp.flash_attn_func(q, k, v, window_size=window)


def test_bad_softcap_comes_back_from_the_cpp_validator():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="softcap"):
        flashcpp.flash_attn_func(q, k, v, softcap=-1.0)


def test_bad_alibi_shape():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashcpp.flash_attn_func(q, k, v, alibi_slopes=np.ones(3, dtype=np.float32))


def test_output_overlapping_an_input_is_rejected():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="overlaps"):
        flashcpp.attention(q, k, v, out=q)


def test_cuda_backend_on_host_arrays():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="backend 'cuda' needs CUDA tensors"):
        flashcpp.attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        flashcpp.attention(q, k, v, backend="gpu")


def test_varlen_errors():
    q = np.zeros((10, 2, 64), dtype=np.float32)
    k = np.zeros((10, 2, 64), dtype=np.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 12 exceeds the 10 packed tokens"):
        flashcpp.flash_attn_varlen_func(q, k, k, [0, 12], [0, 10], 12, 10)
    with pytest.raises(ValueError, match="non-decreasing"):
        flashcpp.flash_attn_varlen_func(q, k, k, [0, 6, 4], [0, 5, 10], 6, 5)
    with pytest.raises(ValueError, match="exceeds the max_seqlen"):
        flashcpp.flash_attn_varlen_func(q, k, k, [0, 10], [0, 10], 4, 10)
    with pytest.raises(ValueError, match="same length"):
        flashcpp.flash_attn_varlen_func(q, k, k, [0, 5, 10], [0, 10], 5, 10)
    with pytest.raises(TypeError, match="integers"):
        flashcpp.flash_attn_varlen_func(q, k, k, [0.0, 10.0], [0, 10], 10, 10)
    with pytest.raises(ValueError, match="must be 3-D"):
        flashcpp.flash_attn_varlen_func(q[None], k[None], k[None], [0, 10], [0, 10], 10, 10)


def test_non_native_byte_order_is_type_error():
    q, k, v = (x.astype(">f4") for x in arrays())
    with pytest.raises(TypeError, match="byte order"):
        flashcpp.flash_attn_func(q, k, v)


# ---- issue 25, item 7 ------------------------------------------------------------------------------

def _read_only(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


def test_read_only_outputs_are_refused():
    q, k, v = arrays()
    out = _read_only(np.zeros_like(q))
    with pytest.raises(ValueError, match="out is a read-only numpy array"):
        flashcpp.attention(q, k, v, out=out)
    assert not out.any()  # nothing was written
    lse = _read_only(np.zeros((1, 2, 8), np.float32))
    with pytest.raises(ValueError, match="lse is a read-only numpy array"):
        flashcpp.attention(q, k, v, lse=lse)
    with pytest.raises(ValueError, match="rotary.k_out is a read-only numpy array"):
        flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(k_out=_read_only(np.zeros_like(k))))


def test_read_only_arrays_are_not_rotated_in_place():
    x = np.random.default_rng(0).standard_normal((1, 8, 2, 64)).astype(np.float32)
    q, k = _read_only(x), _read_only(x[:, :, :1])
    with pytest.raises(ValueError, match="q is a read-only numpy array"):
        flashcpp.apply_rotary(q, inplace=True)
    with pytest.raises(ValueError, match="k is a read-only numpy array"):
        flashcpp.apply_rotary(np.array(x), k, inplace=True)
    with pytest.raises(ValueError, match="q_out is a read-only numpy array"):
        flashcpp.apply_rotary(x, q_out=_read_only(np.zeros_like(x)))
    assert np.array_equal(q, x) and np.array_equal(k, x[:, :, :1])
    w = np.ones(64, np.float32)
    with pytest.raises(ValueError, match="x is a read-only numpy array"):
        flashcpp.fused_add_rms_norm(q, np.array(x), w)
    with pytest.raises(ValueError, match="out is a read-only numpy array"):
        flashcpp.rms_norm(x, w, out=q)


def test_read_only_cache_is_not_appended_to():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    kc, vc = (_read_only(rng.standard_normal((2, 32, 2, 64)).astype(np.float32)) for _ in range(2))
    k, v = (rng.standard_normal((2, 1, 2, 64)).astype(np.float32) for _ in range(2))
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match="k_cache is a read-only numpy array"):
        flashcpp.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=5)
    with pytest.raises(ValueError, match="v_cache is a read-only numpy array"):
        flashcpp.flash_attn_with_kvcache(q, np.array(kc), vc, k, v, cache_seqlens=5)
    assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])
    # reading a read-only cache (no append) is fine
    flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale_zero_is_a_scale(causal):
    # every score 0: uniform weights over the visible keys (the default 1/sqrt(d) would not be)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 8, 2, 64)).astype(np.float32) * 4 for _ in range(3))
    out, lse = flashcpp.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal, return_lse=True)
    n = np.arange(1, 9) if causal else np.full(8, 8)
    want = (np.cumsum(v, axis=1) / n[None, :, None, None]) if causal else np.broadcast_to(v.mean(1, keepdims=True), v.shape)
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(lse, np.broadcast_to(np.log(n), lse.shape), atol=1e-5)
    ref, _ = flashcpp.attention(q, k, v, softmax_scale=0.0, causal=causal, backend="cpu-reference")
    np.testing.assert_allclose(ref, want, atol=1e-5)
    # decode too
    kv = rng.standard_normal((1, 16, 2, 64)).astype(np.float32)
    out = flashcpp.flash_attn_with_kvcache(q[:, :1], kv, kv, cache_seqlens=10, softmax_scale=0.0)
    np.testing.assert_allclose(out, np.broadcast_to(kv[:, :10].mean(1, keepdims=True), out.shape), atol=1e-5)


@pytest.mark.parametrize("window", [(1.5, 2), (2, 0.5), (2.0, 2), (True, 0)])
def test_window_entries_must_be_ints(window):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="a float is not truncated|pair .* of ints"):
        flashcpp.flash_attn_func(q, k, v, window_size=window)
    with pytest.raises(ValueError, match="window_size"):
        flashcpp.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=4, window_size=window)


@pytest.mark.parametrize("window", [(2**40, 0), (0, 2**31), (2**63, -1)])
def test_window_out_of_range_is_a_sentence(window):
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"window_size entries must be at most 2\*\*31-1"):
        flashcpp.flash_attn_func(q, k, v, window_size=window)
    flashcpp.flash_attn_func(q, k, v, window_size=(2**31 - 1, 0))  # the largest is fine


def test_numpy_int_windows_are_ints():
    q, k, v = arrays()
    flashcpp.flash_attn_func(q, k, v, window_size=np.array([3, 0]))
    flashcpp.flash_attn_func(q, k, v, window_size=(np.int64(3), np.int32(0)))


def test_head_dim_zero_is_a_value_error():
    q, k, v = arrays(D=0)
    with pytest.raises(ValueError, match=r"head_dim 0 is not supported \(it must be a multiple of 8"):
        flashcpp.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="head_dim"):
        flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], [0, 8], [0, 8], 8, 8)


def test_paged_plan_refuses_unknown_keywords():
    args = (np.array([0, 1]), np.array([0]), np.array([1]), 4, 2, 64, 16)
    with pytest.raises(TypeError, match="num_split"):
        flashcpp.BatchDecodeWithPagedKVCache().plan(*args, num_split=2)
    with pytest.raises(TypeError, match="sm_sacle"):
        flashcpp.BatchDecodeWithPagedKVCache().plan(*args, sm_sacle=0.1)
    with pytest.raises(NotImplementedError, match="ROPE_LLAMA"):
        flashcpp.BatchDecodeWithPagedKVCache().plan(*args, rope_theta=1e4)
    # FlashInfer's spelling of its other keywords is accepted
    flashcpp.BatchDecodeWithPagedKVCache().plan(*args, rope_scale=None, rope_theta=None, non_blocking=True,
                                                q_data_type=np.float32)


# ---- review of issue 25: counts that were truncated or taken silently ------------------------

@pytest.mark.parametrize("threads", [-1, 10**6, 1.5, True])
def test_cpu_threads_is_a_checked_int(threads):
    # -1 and 10**6 ran (the CLI refuses --threads -1); 1.5 ran as 1
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"cpu_threads must be an int in \[0, 1024\]"):
        flashcpp.attention(q, k, v, cpu_threads=threads)
    with pytest.raises(ValueError, match="cpu_threads"):
        flashcpp.apply_rotary(q, positions=np.arange(8), cpu_threads=threads)
    with pytest.raises(ValueError, match="cpu_threads"):
        flashcpp.rms_norm(q, np.ones(64, np.float32), cpu_threads=threads)
    flashcpp.attention(q, k, v, cpu_threads=np.int64(2))


@pytest.mark.parametrize("kw", [dict(global_tokens=1.5), dict(global_tokens=-1)])
def test_global_tokens_is_a_checked_int(kw):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="global_tokens"):
        flashcpp.attention(q, k, v, **kw)


def test_rotary_dim_is_not_truncated():
    # rotary_dim=2.5 rotated 2 dims without a word
    q = np.zeros((1, 8, 2, 64), np.float32)
    with pytest.raises(ValueError, match="rotary_dim must be an int .*not truncated"):
        flashcpp.apply_rotary(q, positions=np.arange(8), rotary_dim=2.5)
    with pytest.raises(ValueError, match="rotary.rotary_dim must be an int"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(rotary_dim=32.0))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e300])
def test_non_finite_softmax_scale_names_the_python_rule(scale):
    # the C++ sentence said "0 selects 1/sqrt(head_dim)", which in Python is None's rule
    q, k, v = arrays()
    for call in (lambda: flashcpp.flash_attn_func(q, k, v, softmax_scale=scale),
                 lambda: flashcpp.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=4, softmax_scale=scale)):
        with pytest.raises(ValueError, match=r"not a finite float32 \(None selects 1/sqrt\(head_dim\)") as e:
            call()
        assert "0 selects" not in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(window_left=1.5), "window_size"), (dict(window_left=-2), "window_size"),
    (dict(num_splits=1.5), "num_splits"), (dict(head_dim=0), "head_dim"), (dict(head_dim=64.0), "head_dim"),
    (dict(sm_scale=float("nan")), "softmax_scale"), (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(page_size=1.5), "page_size")])
def test_paged_plan_checks_its_numbers(kw, match):
    # window_left=1.5 and num_splits=1.5 were truncated; the others were taken until run()
    a = dict(indptr=np.array([0, 1]), indices=np.array([0]), last_page_len=np.array([1]), num_qo_heads=4,
             num_kv_heads=2, head_dim=64, page_size=16)
    a.update(kw)
    with pytest.raises(ValueError, match=match):
        flashcpp.BatchDecodeWithPagedKVCache().plan(**a)


def test_varlen_max_seqlen_is_not_truncated():
    q = np.zeros((8, 2, 64), np.float32)
    with pytest.raises(ValueError, match="max_seqlen_q/max_seqlen_k must be ints"):
        flashcpp.flash_attn_varlen_func(q, q, q, [0, 8], [0, 8], 8.5, 8)
    flashcpp.flash_attn_varlen_func(q, q, q, [0, 8], [0, 8], np.int64(8), 8)


@pytest.mark.parametrize("kw", [dict(rotary_dim=2.5), dict(num_qo_heads=True)])
def test_decode_plan_counts_are_ints(kw):
    a = dict(kv_capacity=16, cache_seqlens=[4], append=True, rotary="neox", dtype="float32", device="cpu")
    a.update(kw)
    heads = a.pop("num_qo_heads", 2)
    with pytest.raises(ValueError, match="must be an int"):
        flashcpp.BatchDecodeWithKVCache().plan(1, heads, 2 if heads is not True else True, 64, **a)


@pytest.mark.parametrize("call", [
    lambda: flashcpp.alibi_slopes(2.5),
    lambda: flashcpp.block_sparse_from_rules(8, 8, 1.5, 4),
    lambda: flashcpp.block_sparse_from_rules(8.5, 8, 4, 4),
    lambda: flashcpp.block_sparse_from_rules(8, 8, 4, 4, global_tokens=1.5),
    lambda: flashcpp.block_sparse_from_rules(8, 8, 4, 4, num_heads=1.5),
    lambda: flashcpp.block_sparse_from_mask(lambda b, h, q, k: q >= k, 4, 4, seqlen_q=8.5, seqlen_k=8),
    lambda: flashcpp.document_block_sparse([0, 8], [0, 8], 4, 4, num_batch=1.0)])
def test_mask_builders_do_not_truncate_floats(call):
    # each ran with the float truncated
    with pytest.raises(ValueError, match="not truncated"):
        call()


def test_mask_builders_past_int32_are_a_sentence():
    # nanobind's "incompatible function arguments" before
    with pytest.raises(ValueError, match=r"seqlen_q must be an int in \[-2147483648, 2147483647\]"):
        flashcpp.causal_block_sparse(2**31, 2**31, 1, 1)


@pytest.mark.parametrize("kw", [dict(kv_capacity=2**40), dict(num_sms=2**40), dict(seqlen_q=2**40),
                                dict(head_dim=2**40), dict(kv_capacity=16.5)])
def test_decode_plan_sizes_past_int32_or_floats_are_a_sentence(kw):
    # nanobind's "incompatible function arguments" past int32; kv_capacity=16.5 ran as 16
    a = dict(kv_capacity=16, cache_seqlens=[4], dtype="float32", device="cpu")
    a.update(kw)
    args = [1, 2, 2, a.pop("head_dim", 64)]
    with pytest.raises(ValueError, match="must be an int in"):
        flashcpp.BatchDecodeWithKVCache().plan(*args, **a)


@pytest.mark.parametrize("orig", [2**40, 8.5])
def test_llama3_original_positions_is_a_checked_int(orig):
    q = np.zeros((1, 8, 2, 64), np.float32)
    l3 = {"factor": 8.0, "original_max_position_embeddings": orig}
    with pytest.raises(ValueError, match="llama3.original_max_position_embeddings must be an int"):
        flashcpp.apply_rotary(q, positions=np.arange(8), llama3=l3)
    with pytest.raises(ValueError, match="llama3.original_max_position_embeddings must be an int"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(llama3=l3))


def test_torch_varlen_max_seqlen_is_not_truncated():
    torch = pytest.importorskip("torch")
    q = torch.zeros(8, 2, 64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int"):
        flashcpp.flash_attn_varlen_func(q, q, q, cu, cu, 8.5, 8)
    flashcpp.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)


def test_flash_attn_positional_order_matches_flash_attn(rng):
    # flash-attn's 4th positional is dropout_p: a ported call flash_attn_func(q, k, v, 0.0, scale, True)
    # must put scale and causal where they belong (it used to take the 0.0 as softmax_scale).
    q = rng.standard_normal((1, 9, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 9, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 9, 2, 64)).astype(np.float32)
    ported = flashcpp.flash_attn_func(q, k, v, 0.0, 0.3, True)
    keyword = flashcpp.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    assert np.array_equal(ported, keyword)
    cu = np.array([0, 4, 9], np.int32)
    ported = flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, 0.0, 0.3, True)
    keyword = flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, softmax_scale=0.3, causal=True)
    assert np.array_equal(ported, keyword)
    with pytest.raises(NotImplementedError, match="no dropout"):
        flashcpp.flash_attn_func(q, k, v, 0.1)
    with pytest.raises(NotImplementedError, match="no dropout"):
        flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, dropout_p=0.5)
    with pytest.raises(TypeError, match="deterministic"):
        flashcpp.flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, "yes")
    with pytest.raises(TypeError):  # flash-attn's 11th positional (return_attn_probs) has no slot here
        flashcpp.flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, False, True)
