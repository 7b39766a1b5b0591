"""The eager fast path of flash_attn_func (flashcpp/attention.py, _fast_flash_attn): a plain call on
torch tensors fills the C++ params straight from shapes, strides and pointers.

It must give exactly what the general path gives (flashcpp.attention, the low-level entry point,
runs the general path: compared bit for bit), refuse what it refuses, and step aside for what it
does not take (those calls then behave as before). Host tensors here; CUDA tensors on the current
device take the same code."""
import importlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
attn_mod = importlib.import_module("flashcpp.attention")  # the module (flashcpp.attention is the function)
from attn_reference import attention_ref, tolerance  # noqa: E402


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap, scale)
    (2, 7, 7, 4, 2, 64, 64, True, (-1, -1), 0.0, None),
    (1, 1, 130, 8, 1, 128, 128, False, (-1, -1), 0.0, None),
    (3, 33, 17, 2, 2, 32, 48, True, (8, 0), 30.0, 0.3),
    (1, 5, 300, 6, 3, 96, 96, False, (100, 4), 0.0, 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_fast_path_equals_the_general_path(dtype, case):
    B, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap, scale = case
    q, k, v = _rand((B, Sq, Hq, D), dtype, 1), _rand((B, Sk, Hkv, D), dtype, 2), _rand((B, Sk, Hkv, Dv), dtype, 3)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    assert attn_mod._fast_flash_attn(q, k, v, scale, causal, window, softcap, True) is not None
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True, **kw)
    go, gl = flashcpp.attention(q, k, v, return_lse=True, **kw)
    assert out.shape == (B, Sq, Hq, Dv) and out.dtype == dtype and lse.shape == (B, Hq, Sq)
    assert torch.equal(out, go) and torch.equal(lse, gl)
    assert torch.equal(flashcpp.flash_attn_func(q, k, v, **kw), out)  # without the LSE
    ro, _ = attention_ref(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                          softmax_scale=(1 / math.sqrt(D) if scale is None else (2.0 ** -100 if scale == 0 else scale)),
                          causal=causal, window=window, softcap=softcap)
    assert np.abs(out.float().numpy() - ro).max() <= tolerance(str(dtype).replace("torch.", ""))


def test_strided_layouts_through_the_fast_path():
    # SDPA's (B, H, N, D) transposed to (B, N, H, D): no size-1 dim, last dim contiguous.
    q = _rand((2, 4, 9, 64), torch.float32, 4).transpose(1, 2)
    k = _rand((2, 2, 11, 64), torch.float32, 5).transpose(1, 2)
    v = _rand((2, 2, 11, 64), torch.float32, 6).transpose(1, 2)
    assert attn_mod._plain_view(q, 2) is not None
    out = flashcpp.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, flashcpp.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))
    # a size-1 dim with an arbitrary stride is left to the general path (which normalizes it)
    q1 = _rand((1, 4, 9, 64), torch.float32, 7).transpose(1, 2)
    assert not q1.is_contiguous() and attn_mod._plain_view(q1, 2) is None
    assert torch.equal(flashcpp.flash_attn_func(q1, k[:1], v[:1]), flashcpp.attention(q1, k[:1], v[:1])[0])


def test_nan_propagates():
    q, k, v = _rand((1, 4, 2, 32), torch.float32, 8), _rand((1, 6, 2, 32), torch.float32, 9), _rand((1, 6, 2, 32), torch.float32, 10)
    v[0, 3, 1, 5] = math.nan
    out = flashcpp.flash_attn_func(q, k, v)
    assert torch.isnan(out[0, :, 1, 5]).all()
    assert torch.isfinite(out[0, :, 0]).all() and torch.isfinite(out[0, :, 1, :5]).all()


def test_refusals_are_the_general_paths():
    q, k, v = _rand((1, 4, 2, 32), torch.float32, 11), _rand((1, 6, 2, 32), torch.float32, 12), _rand((1, 6, 2, 32), torch.float32, 13)
    for kw, exc in ((dict(softcap=-1.0), ValueError), (dict(softcap=math.nan), ValueError),
                    (dict(softmax_scale=math.inf), ValueError), (dict(window_size=(-2, 0)), ValueError),
                    (dict(window_size=3), ValueError)):
        with pytest.raises(exc) as fast:
            flashcpp.flash_attn_func(q, k, v, **kw)
        with pytest.raises(exc) as general:
            flashcpp.attention(q, k, v, **kw)
        assert str(fast.value) == str(general.value), kw
    with pytest.raises(ValueError, match="head_dim 36 is not supported"):
        flashcpp.flash_attn_func(q[..., :18].contiguous().repeat(1, 1, 1, 2), k[..., :18].repeat(1, 1, 1, 2),
                                 v[..., :18].repeat(1, 1, 1, 2))


def test_what_the_fast_path_steps_aside_for():
    q, k, v = _rand((1, 4, 2, 32), torch.float32, 14), _rand((1, 6, 2, 32), torch.float32, 15), _rand((1, 6, 2, 32), torch.float32, 16)
    f = attn_mod._fast_flash_attn
    args = (None, False, (-1, -1), 0.0, False)
    assert f(q, k, v, *args) is not None
    assert f(q.double(), k.double(), v.double(), *args) is None  # float64: the fp64 reference, general path
    assert f(q, k.half(), v, *args) is None  # mixed dtypes: the general path's TypeError
    assert f(q[:, :0], k, v, *args) is None  # empty
    assert f(q, k[:, :0], v[:, :0], *args) is None  # no keys: O = 0, LSE = -inf by the general path
    assert f(q, k, v[:, :5], *args) is None  # mismatched: the general path's sentence
    assert f(q.requires_grad_(), k, v, *args) is None  # autograd: the registered op
    q.requires_grad_(False)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flashcpp.flash_attn_func(q, k, v[:, :5])
    with pytest.raises(TypeError):
        flashcpp.flash_attn_func(q, k.half(), v)
    o, l = flashcpp.flash_attn_func(q, k[:, :0], v[:, :0], return_lse=True)
    assert torch.all(o == 0) and torch.all(torch.isneginf(l))
    g = q.clone().requires_grad_()
    flashcpp.flash_attn_func(g, k, v).sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad).all()
