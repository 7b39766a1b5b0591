"""merge_attention_states (CPU) and the API names whose kernels have not landed."""
import numpy as np
import pytest

import flashcpp
from attn_reference import attention_ref


def test_merge_of_two_key_halves_equals_full_attention(rng):
    B, Nq, Nk, H, D = 1, 16, 48, 4, 64
    q = rng.standard_normal((B, Nq, H, D)).astype(np.float32)
    k = rng.standard_normal((B, Nk, H, D)).astype(np.float32)
    v = rng.standard_normal((B, Nk, H, D)).astype(np.float32)
    oa, la = flashcpp.flash_attn_func(q, k[:, :20], v[:, :20], return_lse=True)
    ob, lb = flashcpp.flash_attn_func(q, k[:, 20:], v[:, 20:], return_lse=True)
    # merge_attention_states takes (seq, heads, dim) outputs and (seq, heads) LSEs
    sa, sb = la[0].T.copy(), lb[0].T.copy()
    o, s = flashcpp.merge_attention_states(oa[0], sa, ob[0], sb)
    ref_o, ref_lse = attention_ref(q, k, v)
    assert o.shape == (Nq, H, D) and s.shape == (Nq, H) and s.dtype == np.float32
    assert np.abs(o - ref_o[0]).max() < 2e-5
    assert np.abs(s - ref_lse[0].T).max() < 1e-4


def test_merge_with_empty_sides():
    v = np.ones((3, 2, 64), dtype=np.float32)
    s_empty = np.full((3, 2), -np.inf, dtype=np.float32)
    s = np.zeros((3, 2), dtype=np.float32)
    o, lse = flashcpp.merge_attention_states(v, s, 5 * v, s_empty)
    assert np.allclose(o, 1) and np.allclose(lse, 0)
    o, lse = flashcpp.merge_attention_states(v, s_empty, v, s_empty)
    assert np.all(o == 0) and np.all(np.isneginf(lse))


def test_merge_keeps_the_value_dtype():
    v = np.ones((3, 2, 64), dtype=np.float16)
    s = np.zeros((3, 2), dtype=np.float32)
    o, lse = flashcpp.merge_attention_states(v, s, v, s)
    assert o.dtype == np.float16 and np.allclose(o, 1) and np.allclose(lse, np.log(2))


def test_merge_errors():
    v = np.ones((3, 2, 64), dtype=np.float32)
    s = np.zeros((3, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        flashcpp.merge_attention_states(v, s, v[:2], s)
    with pytest.raises(ValueError, match="s_a and s_b"):
        flashcpp.merge_attention_states(v, s[:, :1], v, s)
    with pytest.raises(TypeError, match="float32"):
        flashcpp.merge_attention_states(v, s.astype(np.float16), v, s)
    with pytest.raises(TypeError, match="same dtype"):
        flashcpp.merge_attention_states(v, s, v.astype(np.float16), s)
