"""flashcpp.Rotary (rotary fused into attention) from Python, CPU backends: against an fp64 numpy
rotation written here, rounded to the input dtype, then the fp64 attention reference; identical
to apply_rotary followed by attention; Rotary(k_out=...) receives apply_rotary's keys (out of
place and in place, also through the torch op and torch.compile); bad specs raise with a
sentence."""
import numpy as np
import pytest

import flashcpp
from attn_reference import attention_ref
from test_fused import rope_ref

needs_torch = pytest.mark.skipif(not hasattr(flashcpp._core, "torch") or flashcpp._core.torch is None,
                                 reason="torch is not installed")


def rotate_ref(x, pos, rot, style="neox", theta=10000.0):
    """fp64 rotation of x (B, N, H, D) with positions pos (B, N): test_fused's rope_ref per token."""
    B, N, H, D = x.shape
    return rope_ref(np.asarray(x).reshape(B * N, H, D), np.asarray(pos).reshape(-1), rot, style,
                    theta).reshape(B, N, H, D)


@pytest.mark.parametrize("style,rot,dtype,explicit", [("neox", None, np.float32, False),
                                                        ("interleaved", 32, np.float16, True),
                                                        ("neox", 16, np.float32, True)])
def test_matches_rotate_then_attend(rng, style, rot, dtype, explicit):
    B, Nq, Nk, Hq, Hkv, D = 2, 13, 29, 4, 2, 64
    q, k, v = (rng.standard_normal((B, n, h, D)).astype(dtype) for n, h in ((Nq, Hq), (Nk, Hkv), (Nk, Hkv)))
    pos_q = rng.integers(0, 3000, (B, Nq)).astype(np.int32) if explicit else np.tile(np.arange(Nq) + Nk - Nq, (B, 1))
    pos_k = rng.integers(0, 3000, (B, Nk)).astype(np.int32) if explicit else np.tile(np.arange(Nk), (B, 1))
    spec = flashcpp.Rotary(rotary_dim=rot, style=style, positions_q=pos_q if explicit else None,
                           positions_k=pos_k.reshape(-1) if explicit else None)
    r = D if rot is None else rot
    qr = rotate_ref(q, pos_q, r, style).astype(dtype)  # rounded to the dtype, as documented
    kr = rotate_ref(k, pos_k, r, style).astype(dtype)
    want, want_lse = attention_ref(qr, kr, v, causal=True)
    for backend in ("cpu", "cpu-reference"):
        out, lse = flashcpp.attention(q, k, v, causal=True, rotary=spec, return_lse=True, backend=backend)
        np.testing.assert_allclose(out.astype(np.float64), want, atol=5e-3, rtol=5e-3)
        np.testing.assert_allclose(lse, want_lse, atol=5e-3)
    # Exactly apply_rotary followed by attention.
    q2 = flashcpp.apply_rotary(q, positions=pos_q, rotary_dim=rot, style=style)[0]
    k2 = flashcpp.apply_rotary(k, positions=pos_k, rotary_dim=rot, style=style)[0]
    out2, _ = flashcpp.attention(q2, k2, v, causal=True, backend="cpu")
    out, _ = flashcpp.attention(q, k, v, causal=True, rotary=spec, backend="cpu")
    assert np.array_equal(out, out2)


def test_cache_and_llama3(rng):
    B, N, H, D = 1, 17, 2, 64
    q, k, v = (rng.standard_normal((B, N, H, D)).astype(np.float32) for _ in range(3))
    inv = 10000.0 ** (-2.0 * np.arange(D // 2) / D)
    ang = np.arange(64)[:, None] * inv
    cache = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    a, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(cos_sin_cache=cache))
    b, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary())
    np.testing.assert_allclose(a, b, atol=1e-5)
    l3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(theta=500000.0, llama3=l3))
    assert np.isfinite(c).all()


def test_bad_specs_raise(rng):
    q = rng.standard_normal((1, 8, 2, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="flashcpp.Rotary"):
        flashcpp.attention(q, q, q, rotary={"rotary_dim": 64})
    with pytest.raises(ValueError, match="rotary.style"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(style="gptj"))
    with pytest.raises(ValueError, match="rotary_dim 7 must be even"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(rotary_dim=7))
    with pytest.raises(ValueError, match=r"rotary.positions_q must have shape"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(positions_q=np.arange(5)))
    with pytest.raises(ValueError, match=r"cos_sin_cache must have shape"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(cos_sin_cache=np.zeros((4, 32), np.float32)))
    cache = np.zeros((4, 64), np.float32)  # positions 0..7 run past its 4 rows
    with pytest.raises(ValueError, match=r"rotary \(q\)"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(cos_sin_cache=cache))


@needs_torch
def test_torch_cpu_tensors(rng):
    torch = flashcpp._core.torch
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 9, 2, 64)).astype(np.float32)) for _ in range(3))
    pos = torch.arange(9, dtype=torch.int64) * 3
    out, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(positions_q=pos, positions_k=pos))
    ref, _ = flashcpp.attention(q.numpy(), k.numpy(), v.numpy(),
                                rotary=flashcpp.Rotary(positions_q=pos.numpy(), positions_k=pos.numpy()))
    np.testing.assert_array_equal(out.numpy(), ref)


@needs_torch
def test_flash_attn_func_op_opcheck_and_compile(rng):
    torch = flashcpp._core.torch
    q = torch.from_numpy(rng.standard_normal((2, 11, 4, 64)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((2, 19, 2, 64)).astype(np.float32)) for _ in range(2))
    pos_q = torch.from_numpy(rng.integers(0, 500, (2, 11)).astype(np.int32))
    spec = flashcpp.Rotary(rotary_dim=32, style="interleaved", positions_q=pos_q)
    want, _ = flashcpp.attention(q.numpy(), k.numpy(), v.numpy(), causal=True,
                                 rotary=flashcpp.Rotary(rotary_dim=32, style="interleaved", positions_q=pos_q.numpy()))
    eager = flashcpp.flash_attn_func(q, k, v, causal=True, rotary=spec)
    np.testing.assert_array_equal(eager.numpy(), want)
    from flashcpp.attention import _rotary_op_args
    rot_args, k_out = _rotary_op_args(spec, q)
    assert k_out is None
    args = (q, k, v, 0.125, True, -1, -1, 0.0, None, True, None, None, None, None, None, *rot_args)
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default, args)
    out, _ = torch.ops.flashcpp.flash_attn_fwd(*args)
    np.testing.assert_array_equal(out.numpy(), flashcpp.attention(q.numpy(), k.numpy(), v.numpy(), causal=True,
                                                                   softmax_scale=0.125, rotary=flashcpp.Rotary(
                                                                       rotary_dim=32, style="interleaved",
                                                                       positions_q=pos_q.numpy()))[0])
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True, rotary=spec),
                             fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v), eager)
    # the op checks the rotary shapes itself, also at trace time (fake tensors)
    bad = flashcpp.Rotary(positions_q=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="rotary.positions_q must have shape"):
        flashcpp.flash_attn_func(q, k, v, rotary=bad)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="rotary.positions_q must have shape"):
        torch.compile(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, rotary=bad), fullgraph=True,
                      backend="aot_eager")(q, k, v)


def nan_like(x):
    """A NaN-poisoned buffer like x (a test that forgets to fill it fails)."""
    return np.full(x.shape, np.nan, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_k_out_receives_apply_rotarys_keys(rng, dtype):
    B, Nq, Nk, Hq, Hkv, D = 2, 13, 29, 4, 2, 64
    q, k, v = (rng.standard_normal((B, n, h, D)).astype(dtype) for n, h in ((Nq, Hq), (Nk, Hkv), (Nk, Hkv)))
    pos_q = rng.integers(0, 3000, (B, Nq)).astype(np.int32)
    pos_k = rng.integers(0, 3000, (B, Nk)).astype(np.int32)
    kw = dict(rotary_dim=32, style="interleaved", positions_q=pos_q, positions_k=pos_k)
    want_k = flashcpp.apply_rotary(k, positions=pos_k, rotary_dim=32, style="interleaved")[0]
    k0 = k.copy()
    for backend in ("cpu", "cpu-reference"):
        want, want_lse = flashcpp.attention(q, k, v, causal=True, rotary=flashcpp.Rotary(**kw), return_lse=True,
                                            backend=backend)
        # Out of place, into a view with strides of its own (SDPA's (B, H, N, D) storage).
        buf = nan_like(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        out, lse = flashcpp.attention(q, k, v, causal=True, rotary=flashcpp.Rotary(**kw, k_out=buf),
                                      return_lse=True, backend=backend)
        assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
        assert np.array_equal(buf, want_k)
        assert np.array_equal(k, k0)  # k itself untouched
        # In place: k_out is k.
        kin = k.copy()
        out, _ = flashcpp.attention(q, kin, v, causal=True, rotary=flashcpp.Rotary(**kw, k_out=kin), backend=backend)
        assert np.array_equal(out, want)
        assert np.array_equal(kin, want_k)


def test_k_out_varlen(rng):
    lens_q, lens_k, Hq, Hkv, D = [5, 1, 9], [7, 1, 12], 4, 2, 64
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], Hkv, D)).astype(np.float32) for _ in range(2))
    # Default key positions restart at 0 in every packed sequence.
    pos_k = np.concatenate([np.arange(n) for n in lens_k]).astype(np.int32)
    want_k = flashcpp.apply_rotary(k, positions=pos_k)[0]
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    want, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(), **kw)
    buf = nan_like(k)
    out, _ = flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(k_out=buf), **kw)
    assert np.array_equal(out, want) and np.array_equal(buf, want_k)
    kin = k.copy()
    out, _ = flashcpp.attention(q, kin, v, rotary=flashcpp.Rotary(k_out=kin), **kw)
    assert np.array_equal(out, want) and np.array_equal(kin, want_k)


def test_bad_k_out_raises(rng):
    q = rng.standard_normal((1, 8, 2, 64)).astype(np.float32)
    k, v = q.copy(), q.copy()
    with pytest.raises(ValueError, match=r"rotary.k_out must have shape \(1, 8, 2, 64\)"):
        flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(k_out=np.zeros((1, 8, 2, 32), np.float32)))
    with pytest.raises(TypeError, match="rotary.k_out must have k's dtype float32"):
        flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(k_out=np.zeros(k.shape, np.float16)))
    with pytest.raises(ValueError, match="rotary.k_out: the last dimension"):
        flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(k_out=np.zeros((1, 8, 64, 2), np.float32).swapaxes(2, 3)))
    # It is an output: overlapping an input or out is refused (the C++ validator's sentence).
    with pytest.raises(ValueError, match="rotary.k_rotated overlaps q"):
        flashcpp.attention(q, k, v, rotary=flashcpp.Rotary(k_out=q))
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="o overlaps rotary.k_rotated"):
        flashcpp.attention(q, k, v, out=out, rotary=flashcpp.Rotary(k_out=out))
    with pytest.raises(ValueError, match="rotary.k_rotated is k .rotated in place., but v"):
        flashcpp.attention(q, k, k, rotary=flashcpp.Rotary(k_out=k))


@needs_torch
def test_k_out_torch_op_and_compile(rng):
    torch = flashcpp._core.torch
    q = torch.from_numpy(rng.standard_normal((2, 11, 4, 64)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((2, 19, 2, 64)).astype(np.float32)) for _ in range(2))
    want_k = torch.from_numpy(flashcpp.apply_rotary(k.numpy())[0])
    want = flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary())
    buf = torch.full_like(k, float("nan"))
    out = flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(k_out=buf))
    assert torch.equal(out, want) and torch.equal(buf, want_k)
    kin = k.clone()
    out = flashcpp.flash_attn_func(q, kin, v, causal=True, rotary=flashcpp.Rotary(k_out=kin))
    assert torch.equal(out, want) and torch.equal(kin, want_k)
    # Through the registered op: rotary_k_out is its one mutated argument.
    from flashcpp.attention import _rotary_op_args
    buf = torch.full_like(k, float("nan"))
    rot_args, k_out = _rotary_op_args(flashcpp.Rotary(k_out=buf), q)
    assert k_out is buf
    args = (q, k, v, buf, 0.125, True, -1, -1, 0.0, None, True, None, None, None, None, None, *rot_args)
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd_rotary_k_out.default, args)
    buf.fill_(float("nan"))
    torch.ops.flashcpp.flash_attn_fwd_rotary_k_out(*args)
    assert torch.equal(buf, want_k)
    # torch.compile functionalizes the mutation and writes the keys back, out of place and in place.
    for in_place in (False, True):
        torch._dynamo.reset()
        kin = k.clone()
        buf = kin if in_place else torch.full_like(k, float("nan"))
        compiled = torch.compile(
            lambda q, k, v, buf: flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(k_out=buf)),
            fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            assert torch.equal(compiled(q, kin, v, buf), want)
        assert torch.equal(buf, want_k)
