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


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.float64, np.bool_])
def test_unsupported_dtypes_are_type_errors(dtype):
    q, k, v = (x.astype(dtype) for x in arrays())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        flashcpp.flash_attn_func(q, k, v)


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
    (dict(v_shape=(1, 9, 2, 64)), "k and v must have the same shape"),
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


def test_unsupported_head_dim_names_the_supported_set():
    q, k, v = arrays(D=80)
    with pytest.raises(ValueError, match=r"head_dim 80 is not supported \(supported: 64, 128, 256\)"):
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
