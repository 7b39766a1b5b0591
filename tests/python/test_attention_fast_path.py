"""The eager fast path of flash_attn_func (flashcpp/attention.py, _fast_flash_attn, which calls
_C.attention_fast in python/src/eager_fast.cc): a plain call on torch tensors fills the C++ params
straight from shapes, strides and pointers.

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
    plain = (None, True, (-1, -1), 0.0, False)
    assert attn_mod._fast_flash_attn(q, k, v, *plain) is not None
    out = flashcpp.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, flashcpp.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))
    # batch 1 of a (B, H, N, D) layout: a size-1 dim, not contiguous. Its stride is normalized
    # as the general path normalizes it (also when torch gives the size-1 dim a stride of 0 or a
    # huge one), so both give the same result bit for bit.
    q1 = _rand((1, 4, 9, 64), torch.float32, 7).transpose(1, 2)
    k1, v1 = k[:1], v[:1]
    assert not q1.is_contiguous() and not k1.is_contiguous()
    want = flashcpp.attention(q1, k1, v1, causal=True)[0]
    assert torch.equal(attn_mod._fast_flash_attn(q1, k1, v1, *plain), want)
    for s0 in (0, 1, 10**9):
        q0 = torch.as_strided(q1, q1.shape, (s0,) + q1.stride()[1:])
        assert torch.equal(attn_mod._fast_flash_attn(q0, k1, v1, *plain), want)
        assert torch.equal(flashcpp.attention(q0, k1, v1, causal=True)[0], want)


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


def test_fast_path_takes_plain_arguments_only():
    """Arguments of other Python types (an int causal, a numpy softcap or scale) and tensors it does
    not read plainly (Parameters are taken; meta tensors are not) go to the general path, which
    gives the same answer or its own sentence."""
    q, k, v = _rand((1, 5, 2, 32), torch.float32, 17), _rand((1, 7, 2, 32), torch.float32, 18), _rand((1, 7, 2, 32), torch.float32, 19)
    f = attn_mod._fast_flash_attn
    want = flashcpp.attention(q, k, v, causal=True, softcap=5.0, softmax_scale=0.2)[0]
    assert torch.equal(f(q, k, v, 0.2, True, (-1, -1), 5.0, False), want)
    assert f(q, k, v, 0.2, 1, (-1, -1), 5.0, False) is None
    assert f(q, k, v, np.float32(0.2), True, (-1, -1), 5.0, False) is None
    assert f(q, k, v, 0.2, True, (-1, -1), np.float64(5.0), False) is None
    assert torch.equal(flashcpp.flash_attn_func(q, k, v, np.float64(0.0), np.float32(0.2), 1, softcap=np.float64(5.0)), want)
    pq = torch.nn.Parameter(q, requires_grad=False)
    assert torch.equal(f(pq, k, v, 0.2, True, (-1, -1), 5.0, False), want)
    out, lse = f(q, k, v, None, False, [-1, -1], 0, True)  # a list window, an int softcap
    go, gl = flashcpp.attention(q, k, v, return_lse=True)
    assert torch.equal(out, go) and torch.equal(lse, gl) and lse.dtype == torch.float32
    assert f(q.to("meta"), k.to("meta"), v.to("meta"), None, False, (-1, -1), 0.0, False) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fast path's CUDA half)")
def test_cuda_fast_path_equals_general_and_launches_on_the_current_stream():
    """On CUDA tensors the fast path runs the kernel the general path runs (bit for bit), on
    torch's current stream: a CUDA graph captures it (a launch on another stream would break the
    capture) and its replays reproduce the eager result for new inputs."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(20)
    q, k, v = (torch.randn((2, 300, 8, 128), generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    kv_h = (2, 300, 2, 128)
    k2, v2 = (torch.randn(kv_h, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for kk, vv, kw in ((k, v, dict(causal=True)), (k2, v2, dict(window_size=(64, 0), softcap=20.0))):
        fast = attn_mod._fast_flash_attn(q, kk, vv, None, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                                         kw.get("softcap", 0.0), True)
        assert fast is not None
        go, gl = flashcpp.attention(q, kk, vv, return_lse=True, backend="cuda", **kw)
        assert torch.equal(fast[0], go) and torch.equal(fast[1], gl)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = flashcpp.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(eager, flashcpp.attention(q, k, v, causal=True, backend="cuda")[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashcpp.flash_attn_func(q, k, v, causal=True)
    q.copy_(torch.randn(q.shape, generator=g, device=dev, dtype=q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, flashcpp.attention(q, k, v, causal=True, backend="cuda")[0])
    assert torch.isfinite(captured.float()).all()
