"""One RotarySpec (include/flashcpp/rope.h) across the binding: one class held by AttnRotary.spec,
RopeParams.rotary and DecodeParams.rotary, and the same rotation through apply_rotary, the rotary
fused into attention and decode's append (numpy, CPU backend): identical bytes for the same
angles, whether they come from theta, a cos_sin_cache or separate cos/sin tables."""
import numpy as np
import pytest

import flashcpp
from flashcpp import _flashcpp as _C

B, SQ, HQ, HKV, D = 2, 3, 4, 2, 64


def test_one_class_in_every_params_struct():
    s = _C.RotarySpec()
    assert (s.style, s.rotary_dim, s.theta, s.table_stride, s.max_position, s.cos, s.sin) == (
        _C.ROPE_NONE, 0, 10000.0, 0, 0, 0, 0)
    assert (_C.ROPE_NONE, _C.ROPE_NEOX, _C.ROPE_INTERLEAVED) == (0, 1, 2)
    assert not hasattr(_C, "ROTARY_NEOX") and not hasattr(_C, "RotaryParams")  # one style enum, one struct
    for holder in (_C.AttnRotary().spec, _C.RopeParams().rotary, _C.DecodeParams().rotary):
        assert isinstance(holder, _C.RotarySpec)
    assert _C.RopeParams().rotary.style == _C.ROPE_NEOX  # apply_rotary always rotates: neox by default
    assert _C.AttnRotary().spec.style == _C.DecodeParams().rotary.style == _C.ROPE_NONE  # off by default
    s.set_cos_sin_cache(0x1000, 8, 32)
    assert (s.cos, s.sin, s.table_stride, s.max_position) == (0x1000, 0x1000 + 16 * 4, 32, 8)
    p = _C.DecodeParams()
    p.rotary = s  # a copy of the spec goes in
    assert (p.rotary.cos, p.rotary.table_stride) == (0x1000, 32)
    p.rotary.rotary_dim = 32  # and the field is a view of the struct inside p
    assert p.rotary.rotary_dim == 32


def _angles(rng, max_position, half):
    a = rng.uniform(-np.pi, np.pi, (max_position, half))
    return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)


def _three_ways(rng, lens, neox, theta=None, tables=None):
    """k_new rotated at positions lens[b] + t by apply_rotary, attention's k_out and decode's append."""
    k_new = rng.standard_normal((B, SQ, HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((B, SQ, HKV, D)).astype(np.float32)
    q = rng.standard_normal((B, SQ, HQ, D)).astype(np.float32)
    pos = (np.asarray(lens, np.int32)[:, None] + np.arange(SQ, dtype=np.int32)[None, :])
    style = "neox" if neox else "interleaved"
    cache = None if tables is None else np.concatenate(tables, axis=1)  # rows [cos | sin]
    a, _ = flashcpp.apply_rotary(k_new, positions=pos, style=style, cos_sin_cache=cache,
                                 theta=theta or 10000.0, backend="cpu")
    k_out = np.empty_like(k_new)
    flashcpp.attention(q, k_new, v_new, backend="cpu",
                       rotary=flashcpp.Rotary(style=style, theta=theta or 10000.0, cos_sin_cache=cache,
                                              positions_q=pos, positions_k=pos, k_out=k_out))
    capacity = max(lens) + SQ + 4
    k_cache = np.zeros((B, capacity, HKV, D), np.float32)
    v_cache = np.zeros_like(k_cache)
    flashcpp.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=np.asarray(lens, np.int32),
                                     rotary_cos=None if tables is None else tables[0],
                                     rotary_sin=None if tables is None else tables[1],
                                     rope_theta=theta, rotary_interleaved=not neox, causal=True)
    d = np.stack([k_cache[b, lens[b]:lens[b] + SQ] for b in range(B)])
    return a, k_out, d


@pytest.mark.parametrize("neox", [True, False])
def test_same_bits_from_theta(rng, neox):
    a, k_out, d = _three_ways(rng, [1000, 17], neox, theta=10000.0)
    np.testing.assert_array_equal(k_out, a)
    np.testing.assert_array_equal(d, a)


@pytest.mark.parametrize("neox", [True, False])
def test_same_bits_from_tables_in_either_layout(rng, neox):
    # apply_rotary and attention read a cos_sin_cache, decode the same angles as two tables.
    tables = _angles(rng, 64, D // 2)
    a, k_out, d = _three_ways(rng, [40, 3], neox, tables=tables)
    np.testing.assert_array_equal(k_out, a)
    np.testing.assert_array_equal(d, a)


def _rope_params(x, out, pos, spec):
    p = _C.RopeParams()
    p.batch, p.seqlen, p.heads_q, p.head_dim = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    s = [n // x.itemsize for n in x.strides]
    p.q = _C.TensorView(x.ctypes.data, _C.DTYPE_F32, s[0], s[1], s[2])
    p.q_out = _C.TensorView(out.ctypes.data, _C.DTYPE_F32, s[0], s[1], s[2])
    p.positions = pos.ctypes.data
    p.rotary = spec
    return p


def test_apply_rotary_reads_separate_and_strided_tables_through_the_binding(rng):
    # RopeParams.rotary takes any tables: separate ones with a padded row stride (NaN padding, so a
    # stride mistake shows) rotate exactly as the same angles in one cos_sin_cache.
    cos, sin = _angles(rng, 32, D // 2)
    x = rng.standard_normal((B, SQ, HKV, D)).astype(np.float32)
    pos = np.ascontiguousarray(rng.integers(0, 32, (B, SQ)).astype(np.int32))
    want, _ = flashcpp.apply_rotary(x, positions=pos, cos_sin_cache=np.concatenate([cos, sin], axis=1), backend="cpu")
    stride = D // 2 + 3
    cos_p = np.full((32, stride), np.nan, np.float32)
    sin_p = np.full((32, stride), np.nan, np.float32)
    cos_p[:, :D // 2], sin_p[:, :D // 2] = cos, sin
    spec = _C.RotarySpec()
    spec.style, spec.cos, spec.sin = _C.ROPE_NEOX, cos_p.ctypes.data, sin_p.ctypes.data
    spec.table_stride, spec.max_position = stride, 32
    got = np.empty_like(x)
    _C.apply_rotary(_rope_params(x, got, pos, spec), _C.RunOptions("cpu"))
    np.testing.assert_array_equal(got, want)
    spec.table_stride = D // 2 - 1  # the validator's sentence arrives as ValueError
    with pytest.raises(ValueError, match=r"rotary.table_stride 31 must be >= rotary_dim / 2 = 32"):
        _C.apply_rotary(_rope_params(x, got, pos, spec), _C.RunOptions("cpu"))
    spec.table_stride = stride
    spec.style = _C.ROPE_NONE
    with pytest.raises(ValueError, match="rotary.style is none: apply_rotary rotates neox or interleaved pairs"):
        _C.apply_rotary(_rope_params(x, got, pos, spec), _C.RunOptions("cpu"))


def test_rotary_dim_zero_is_head_dim_everywhere(rng):
    # Rotary(rotary_dim=0) now means head_dim, as apply_rotary's rotary_dim=0 and RotarySpec do.
    q, k, v = (rng.standard_normal((1, 8, 2, D)).astype(np.float32) for _ in range(3))
    a, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(rotary_dim=0), backend="cpu")
    b, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(), backend="cpu")
    np.testing.assert_array_equal(a, b)
