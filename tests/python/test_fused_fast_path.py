"""The eager fast path of rms_norm, fused_add_rms_norm and silu_and_mul (flashcpp/fused.py): plain
calls on contiguous torch tensors skip the Python checks and hand the params to C++ directly.

It must compute exactly what the general path computes (the general path runs when a keyword
such as backend="cpu" or out= is given: both are compared bit for bit), refuse what the general
path refuses with the same sentence (the C++ validator's), and step aside for everything it does
not take. Host tensors here; the same code serves CUDA tensors on the current device."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp import fused  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(3, 5, 64), (1, 8), (7, 136), (2, 1, 1, 24)]


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fast_equals_general(dtype, shape):
    x = _rand(shape, dtype, 1)
    w = torch.nn.Parameter(_rand(shape[-1:], dtype, 2), requires_grad=False)
    assert fused._C.norm_fast(x, None, w, 1e-5, 0) is not None  # the fast path applies
    fast = flashcpp.rms_norm(x, w, 1e-5)
    general = flashcpp.rms_norm(x, w, 1e-5, backend="cpu")
    assert fast.shape == x.shape and fast.dtype == dtype
    assert torch.equal(fast, general)
    # and it is RMSNorm: against an fp64 evaluation
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (fast.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_fast_equals_general_in_place(dtype):
    x, r, w = _rand((4, 9, 96), dtype, 3), _rand((4, 9, 96), dtype, 4), _rand((96,), dtype, 5)
    xf, rf = x.clone(), r.clone()
    out, res = flashcpp.fused_add_rms_norm(xf, rf, w)
    assert out is xf and res is rf  # in place, as documented
    xg, rg = x.clone(), r.clone()
    flashcpp.fused_add_rms_norm(xg, rg, w, out=xg, residual_out=rg)  # out=: the general path
    assert torch.equal(xf, xg) and torch.equal(rf, rg)
    assert torch.equal(rf, (x.float() + r.float()).to(dtype))  # residual_out = x + residual, rounded


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 128), (1, 16), (6, 272)])
def test_silu_and_mul_fast_equals_general(dtype, shape):
    x = _rand(shape, dtype, 6)
    fast = flashcpp.silu_and_mul(x)
    general = flashcpp.silu_and_mul(x, backend="cpu")
    d = shape[-1] // 2
    assert fast.shape == shape[:-1] + (d,) and torch.equal(fast, general)
    g, u = x[..., :d].double(), x[..., d:].double()
    ref = g / (1 + torch.exp(-g)) * u
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fast.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_nan_propagates_through_the_fast_path():
    x, w = torch.randn(3, 32), torch.randn(32)
    x[1, 7] = math.nan
    y = flashcpp.rms_norm(x, w)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    g = torch.randn(2, 64)
    g[0, 40] = math.nan  # in the up half: column 40 - 32 = 8 of row 0
    z = flashcpp.silu_and_mul(g)
    assert torch.isnan(z[0, 8]) and torch.isfinite(z[1]).all() and torch.isfinite(z[0, :8]).all()


def test_fast_path_refuses_as_the_general_path_does():
    x, w = torch.randn(2, 16), torch.randn(16)
    for eps in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError) as fast:
            flashcpp.rms_norm(x, w, eps)
        with pytest.raises(ValueError) as general:
            flashcpp.rms_norm(x, w, eps, backend="cpu")
        assert str(fast.value) == str(general.value) and "eps" in str(fast.value)
    r = torch.randn(2, 16)
    with pytest.raises(ValueError) as fast:
        flashcpp.fused_add_rms_norm(x, x, w)  # residual is x: the outputs alias
    with pytest.raises(ValueError) as general:
        flashcpp.fused_add_rms_norm(x, x, w, out=x, residual_out=x)
    assert str(fast.value) == str(general.value)
    del r


def test_what_the_fast_path_steps_aside_for():
    x, w = torch.randn(4, 32), torch.randn(32)
    fast = fused._C.norm_fast
    assert fast(x, None, w, 1e-6, 0) is not None
    xs = torch.randn(4, 64)[:, :32]  # rows 64 apart: not contiguous, which the general path takes
    assert fast(xs, None, w, 1e-6, 0) is None
    assert fast(x, None, w.double(), 1e-6, 0) is None  # mixed dtypes
    assert fast(x.double(), None, w.double(), 1e-6, 0) is None  # float64 is not a fused dtype
    assert fast(x[:0], None, w, 1e-6, 0) is None  # empty
    assert fast(x, None, w, 1e-6, -1) is None  # cpu_threads: the general path says why
    assert fast(x, None, w, 1e-6, True) is None  # a bool is not a thread count
    assert fast(x, None, w, np.float32(1e-6), 0) is None  # eps of another type
    assert fast(x, None, w.numpy(), 1e-6, 0) is None  # a numpy weight: the general path's TypeError
    assert fast(x.to("meta"), None, w.to("meta"), 1e-6, 0) is None
    xg = x.clone().requires_grad_()
    assert fast(xg, torch.randn(4, 32), w, 1e-6, 0) is None  # written and requiring grad
    assert fused._C.silu_and_mul_fast(torch.randn(2, 33), 0) is None  # odd: the general path's sentence
    assert fused._C.silu_and_mul_fast(torch.randn(2, 64)[:, :32], 0) is None  # not contiguous
    # and those calls still work or refuse through the general path
    assert torch.equal(flashcpp.rms_norm(xs, w), flashcpp.rms_norm(xs.contiguous(), w))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        flashcpp.rms_norm(x.t(), w[:4])
    with pytest.raises(TypeError, match="float64"):
        flashcpp.rms_norm(x.double(), w.double())
    with pytest.raises(ValueError, match="cpu_threads"):
        flashcpp.rms_norm(x, w, cpu_threads=-1)
    with pytest.raises(ValueError, match="weight must have shape"):
        flashcpp.rms_norm(x, torch.randn(31))
    with pytest.raises(ValueError, match="even"):
        flashcpp.silu_and_mul(torch.randn(2, 33))
    assert flashcpp.rms_norm(x[:0], w).shape == (0, 32)
    y = np.asarray(flashcpp.rms_norm(x.numpy(), w.numpy()))  # numpy: the general path
    assert np.array_equal(y, flashcpp.rms_norm(x, w).numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fast path's CUDA half)")
def test_cuda_fast_paths_equal_general_and_capture_in_a_graph():
    """On CUDA tensors rms_norm, fused_add_rms_norm and silu_and_mul take the fast path, equal the
    general path bit for bit, and launch on torch's current stream (a CUDA graph captures them)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(21)
    x32, w32 = torch.randn((2, 64), device=dev), torch.randn((64,), device=dev)
    for fn in (lambda **kw: flashcpp.rms_norm(x32, w32, **kw), lambda **kw: flashcpp.silu_and_mul(x32, **kw)):
        with pytest.raises(NotImplementedError) as fast:  # fp32 on CUDA: the kernels' own sentence, both paths
            fn()
        with pytest.raises(NotImplementedError) as general:
            fn(backend="cuda")
        assert str(fast.value) == str(general.value) and "fp32" in str(fast.value)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn((5, 3, 2048), generator=g, device=dev, dtype=dtype)
        r = torch.randn((5, 3, 2048), generator=g, device=dev, dtype=dtype)
        w = torch.randn((2048,), generator=g, device=dev, dtype=dtype)
        assert fused._C.norm_fast(x, None, w, 1e-6, 0) is not None
        assert torch.equal(flashcpp.rms_norm(x, w), flashcpp.rms_norm(x, w, backend="cuda"))
        assert torch.equal(flashcpp.silu_and_mul(x), flashcpp.silu_and_mul(x, backend="cuda"))
        xf, rf, xg, rg = x.clone(), r.clone(), x.clone(), r.clone()
        flashcpp.fused_add_rms_norm(xf, rf, w)
        flashcpp.fused_add_rms_norm(xg, rg, w, out=xg, residual_out=rg, backend="cuda")
        assert torch.equal(xf, xg) and torch.equal(rf, rg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = flashcpp.rms_norm(x, w)
            z = flashcpp.silu_and_mul(x)
        x.copy_(torch.randn(x.shape, generator=g, device=dev, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, flashcpp.rms_norm(x, w, backend="cuda"))
        assert torch.equal(z, flashcpp.silu_and_mul(x, backend="cuda"))
