"""The eager fast paths under autograd: _torch_ops.EagerAttention and EagerVarlenAttention (the eager
autograd formulas of flash_attn_func and flash_attn_varlen_func) run their forward through
_C.attention_fast / _C.varlen_fast and their backward (flash_attn_bwd_eager,
flash_attn_varlen_bwd_eager) through _C.backward_fast / _C.varlen_backward_fast
(python/src/eager_fast.cc), each falling back to the general path when the fast call returns None.

What holds them: the outputs, the tensors the forward saves and the gradients equal the general
path's bit for bit (the general path forced by making the four fast entries return None), over
causal, window and softcap, GQA, odd sizes, fp32/bf16/fp16, with and without a gradient of the LSE,
deterministic or not; non-contiguous gradients (of a sum, of a transpose) and strided inputs; NaN
propagation; bad inputs get the general path's sentences; empty problems and calls autograd
records are left to it. Host tensors; CUDA tensors (bf16/fp16, deterministic where dq is compared
bit for bit: the default CUDA backward adds into dq in an order the timing decides) where a device
is present."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp import _flashcpp as _C  # noqa: E402
from flashcpp import _torch_ops  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashcpp.WITH_CUDA else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FAST = ("attention_fast", "varlen_fast", "backward_fast", "varlen_backward_fast")


def _rand(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _cu(lens, device="cpu"):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)


def _skip_fp32_cuda(device, dtype):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA attention kernels take bf16/fp16")


class _Paths:
    """Runs a call with the fast entries as they are (fast=True: each must take the call, counted) or
    returning None (fast=False: the general path)."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch
        self.taken = {}

    def run(self, fast, fn):
        with self.mp.context() as m:
            for name in FAST:
                real = getattr(_C, name)
                if fast:
                    def spy(*a, _real=real, _name=name):
                        r = _real(*a)
                        self.taken[_name] = self.taken.get(_name, 0) + (r is not None)
                        return r
                    m.setattr(_C, name, spy)
                else:
                    m.setattr(_C, name, lambda *a: None)
            return fn()


@pytest.fixture
def paths(monkeypatch):
    return _Paths(monkeypatch)


def _same(a, b):
    """Bit for bit, NaN where NaN is: shape, dtype, device, strides and values."""
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, (a.shape, b.shape, a.dtype, b.dtype)
    assert a.stride() == b.stride() or a.numel() <= 1, (a.stride(), b.stride())
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def _train_step(call, leaves, dout, dlse, deterministic):
    """Forward with grad, then the gradients of (out, lse) against (dout, dlse) (dlse None: the LSE
    unused). (out, lse, saved tensors, grads)."""
    out, lse = call(deterministic)
    saved = out.grad_fn.saved_tensors
    outputs, grads_in = ((out, lse), (dout, dlse)) if dlse is not None else ((out,), (dout,))
    grads = torch.autograd.grad(outputs, leaves, grads_in)
    return out, lse, saved, grads


def _compare(paths, call, leaves, dout, dlse, deterministic=False, dq_exact=True):
    fast = paths.run(True, lambda: _train_step(call, leaves, dout, dlse, deterministic))
    general = paths.run(False, lambda: _train_step(call, leaves, dout, dlse, deterministic))
    for a, b in zip(fast[:2], general[:2]):
        _same(a, b)
    assert len(fast[2]) == len(general[2])
    for a, b in zip(fast[2], general[2]):  # what the backward reads: the same tensors, values and layouts
        _same(a, b)
    dq_f, dq_g = fast[3][0], general[3][0]
    if dq_exact:
        _same(dq_f, dq_g)
    else:
        assert dq_f.shape == dq_g.shape and dq_f.dtype == dq_g.dtype
        torch.testing.assert_close(dq_f, dq_g, atol=2e-2, rtol=2e-2)
    for a, b in zip(fast[3][1:], general[3][1:]):
        _same(a, b)
    return fast


DENSE = [
    # (B, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap, scale)
    (1, 1, 1, 1, 1, 32, 32, False, (-1, -1), 0.0, None),
    (2, 7, 7, 4, 2, 64, 64, True, (-1, -1), 0.0, None),
    (1, 127, 127, 2, 1, 32, 48, True, (-1, -1), 0.0, None),
    (3, 7, 127, 2, 2, 32, 32, False, (8, 0), 30.0, 0.3),
    (1, 127, 7, 6, 3, 16, 16, False, (-1, 2), 5.0, 0.0),
    (2, 1, 127, 8, 1, 64, 32, True, (16, 16), 0.0, None),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DENSE)
@pytest.mark.parametrize("with_dlse", [False, True])
def test_dense_training_step_equals_the_general_path(paths, case, dtype, device, with_dlse):
    _skip_fp32_cuda(device, dtype)
    B, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap, scale = case
    q = _rand((B, Sq, Hq, D), dtype, 1, device).requires_grad_()
    k = _rand((B, Sk, Hkv, D), dtype, 2, device).requires_grad_()
    v = _rand((B, Sk, Hkv, Dv), dtype, 3, device).requires_grad_()
    dout = _rand((B, Sq, Hq, Dv), dtype, 4, device)
    dlse = _rand((B, Hq, Sq), torch.float32, 5, device) if with_dlse else None
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, return_lse=True)

    def call(det):
        return flashcpp.flash_attn_func(q, k, v, deterministic=det, **kw)

    for det in (False, True):
        _compare(paths, call, (q, k, v), dout, dlse, det, dq_exact=det or device == "cpu")
    assert paths.taken == {"attention_fast": 2, "backward_fast": 2}


VARLEN = [
    # (lens_q, lens_k, spare_q, Hq, Hkv, D, Dv, causal, window, softcap, scale)
    ([1, 7, 127], [1, 7, 127], 0, 4, 2, 32, 32, True, (-1, -1), 0.0, None),
    ([7, 1], [127, 7], 3, 2, 1, 64, 48, False, (8, 0), 30.0, 0.3),  # packed rows past cu_seqlens_q[-1]
    ([3, 0, 9], [20, 4, 9], 0, 6, 3, 16, 16, True, (-1, 2), 0.0, 0.0),  # an empty sequence
    ([127], [127], 0, 8, 1, 32, 32, False, (16, 16), 5.0, None),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", VARLEN)
@pytest.mark.parametrize("with_dlse", [False, True])
def test_varlen_training_step_equals_the_general_path(paths, case, dtype, device, with_dlse):
    _skip_fp32_cuda(device, dtype)
    lens_q, lens_k, spare, Hq, Hkv, D, Dv, causal, window, softcap, scale = case
    if device == "cuda" and spare:
        spare = 0  # rows past cu_seqlens_q[-1] are left as they are in out there (the general path too)
    Tq, Tk = sum(lens_q) + spare, sum(lens_k)
    q = _rand((Tq, Hq, D), dtype, 1, device).requires_grad_()
    k = _rand((Tk, Hkv, D), dtype, 2, device).requires_grad_()
    v = _rand((Tk, Hkv, Dv), dtype, 3, device).requires_grad_()
    cq, ck = _cu(lens_q, device), _cu(lens_k, device)
    mq, mk = max(lens_q), max(lens_k)
    dout = _rand((Tq, Hq, Dv), dtype, 4, device)
    dlse = _rand((Hq, Tq), torch.float32, 5, device) if with_dlse else None
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, return_lse=True)

    def call(det):
        return flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, deterministic=det, **kw)

    for det in (False, True):
        _compare(paths, call, (q, k, v), dout, dlse, det, dq_exact=det or device == "cpu")
    assert paths.taken == {"varlen_fast": 2, "varlen_backward_fast": 2}


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_gradients_and_strided_inputs(paths, device):
    """dout of a sum (expanded, stride 0) and of a transpose, dlse of a sum: made contiguous as
    _grad_views makes them. q, k and v as views of (B, H, S, D) leaves (batch 1 too: a size-1 dim's
    stride): dq, dk and dv come from torch.empty_like, which keeps their strides."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for B in (2, 1):
        qb = _rand((B, 4, 9, 32), dtype, 6, device).requires_grad_()
        kb = _rand((B, 2, 11, 32), dtype, 7, device).requires_grad_()
        vb = _rand((B, 2, 11, 32), dtype, 8, device).requires_grad_()

        def step(loss_of):
            out, lse = flashcpp.flash_attn_func(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                                causal=True, return_lse=True, deterministic=True)
            grads = torch.autograd.grad(loss_of(out, lse), (qb, kb, vb))
            return (out, lse) + grads

        dt = _rand((B, 4, 9, 32), dtype, 9, device)
        for loss_of in (lambda o, l: o.sum(), lambda o, l: o.float().sum() + l.sum(),
                        lambda o, l: (o * dt.transpose(1, 2)).sum()):
            fast = paths.run(True, lambda: step(loss_of))
            general = paths.run(False, lambda: step(loss_of))
            for a, b in zip(fast, general):
                _same(a, b)
    assert paths.taken == {"attention_fast": 6, "backward_fast": 6}


def test_saved_tensors_and_the_forward_with_grad_off():
    """With grad mode off the fast path takes inputs that require grad (the formulas' forward runs
    there); with it on, autograd's calls are the formulas', so the entries step aside."""
    q, k, v = (_rand(s, torch.float32, i).requires_grad_() for i, s in enumerate(((1, 5, 2, 32), (1, 6, 2, 32),
                                                                                    (1, 6, 2, 32))))
    assert _C.attention_fast(q, k, v, None, False, -1, -1, 0.0, True) is None  # grad mode on
    with torch.no_grad():
        out, lse = _C.attention_fast(q, k, v, None, False, -1, -1, 0.0, True)
        go, gl = flashcpp.attention(q, k, v, return_lse=True)
        _same(out, go)
        _same(lse, gl)
        assert not out.requires_grad and not lse.requires_grad
        assert not flashcpp.flash_attn_func(q, k, v).requires_grad
    dout = torch.ones_like(out)
    args = (dout, q, k, v, out, lse, None, 1 / math.sqrt(32), False, -1, -1, 0.0, False)
    assert _C.backward_fast(*args) is None  # grad mode on and q requiring grad: autograd's
    with torch.no_grad():
        assert _C.backward_fast(*args) is not None


def _bwd_args(dtype=torch.float32, device="cpu"):
    q = _rand((1, 5, 2, 32), dtype, 20, device)
    k, v = _rand((1, 6, 2, 32), dtype, 21, device), _rand((1, 6, 2, 32), dtype, 22, device)
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True)
    return dict(dout=torch.ones_like(out), q=q, k=k, v=v, out=out, lse=lse, dlse=None, softmax_scale=0.25,
                causal=True, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False)


def _raises_alike(paths, fn):
    with pytest.raises(Exception) as fast:
        paths.run(True, fn)
    with pytest.raises(Exception) as general:
        paths.run(False, fn)
    assert type(fast.value) is type(general.value) and str(fast.value) == str(general.value)
    return fast.value


def test_bad_inputs_get_the_general_paths_sentences(paths):
    bwd = _torch_ops.flash_attn_bwd_eager
    a = _bwd_args()
    for bad in (dict(dout=a["dout"][:, :4]), dict(dout=a["dout"].half()), dict(dlse=a["lse"][:, :1]),
                dict(dlse=a["lse"].double()), dict(lse=torch.empty((0,))), dict(v=a["v"][:, :5]),
                dict(k=a["k"].half()), dict(window_left=-2)):
        e = _raises_alike(paths, lambda: bwd(**dict(a, **bad)))
        assert isinstance(e, (ValueError, TypeError, RuntimeError)), bad
    assert "return_lse=False" in str(_raises_alike(paths, lambda: bwd(**dict(a, lse=torch.empty((0,))))))
    assert "dout must match out" in str(_raises_alike(paths, lambda: bwd(**dict(a, dout=a["dout"][:, :4]))))
    # a head dim no backend takes: the C++ validator's sentence is the Python check's
    q, k, v = (_rand((1, 4, 2, 36), torch.float32, 23 + i) for i in range(3))
    out, lse = torch.zeros((1, 4, 2, 36)), torch.zeros((1, 2, 4))
    e = _raises_alike(paths, lambda: bwd(torch.ones_like(out), q, k, v, out, lse, None, 0.25, False, -1, -1, 0.0,
                                         None, False))
    assert "head_dim 36 is not supported" in str(e)
    assert paths.taken.get("backward_fast", 0) == 0  # none of them returned gradients


def test_varlen_bad_inputs_get_the_general_paths_sentences(paths):
    bwd = _torch_ops.flash_attn_varlen_bwd_eager
    q = _rand((9, 2, 32), torch.float32, 30)
    k, v = _rand((11, 2, 32), torch.float32, 31), _rand((11, 2, 32), torch.float32, 32)
    cq, ck = _cu([4, 5]), _cu([5, 6])
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, return_lse=True)
    a = (torch.ones_like(out), q, k, v, out, lse, None, cq, ck, 5, 6, 0.25, True, -1, -1, 0.0, None, False)
    assert paths.run(True, lambda: bwd(*a)) is not None
    assert paths.taken == {"varlen_backward_fast": 1}
    for i, bad in ((0, out[:8]), (5, torch.empty((0,))), (6, lse[:1]), (7, _cu([4, 6])), (9, 3), (7, cq.long())):
        args = list(a)
        args[i] = bad
        _raises_alike(paths, lambda: bwd(*args))
    assert paths.taken == {"varlen_backward_fast": 1}


def test_nan_in_q_propagates(paths):
    q = _rand((1, 7, 2, 32), torch.float32, 40)
    q[0, 3, 1, 5] = math.nan
    q.requires_grad_()
    k, v = (_rand((1, 7, 2, 32), torch.float32, 41 + i).requires_grad_() for i in range(2))
    dout = _rand((1, 7, 2, 32), torch.float32, 43)
    fast = _compare(paths, lambda det: flashcpp.flash_attn_func(q, k, v, return_lse=True, deterministic=det),
                    (q, k, v), dout, None)
    out, lse, _, (dq, dk, dv) = fast
    assert torch.isnan(out[0, 3, 1]).all() and torch.isfinite(out[0, :, 0]).all()
    assert torch.isnan(dq[0, 3, 1]).any() and torch.isnan(dk[:, :, 1]).any() and torch.isfinite(dq[:, :, 0]).all()
    assert paths.taken == {"attention_fast": 1, "backward_fast": 1}


def test_empty_problems_are_the_general_paths(paths):
    """No keys (O = 0, LSE = -inf, zero gradients) and no queries: the fast entries step aside and
    the general path fills the zeros, on both runs."""
    for sq, sk in ((5, 0), (0, 6)):
        q = _rand((1, sq, 2, 32), torch.float32, 50).requires_grad_()
        k, v = (_rand((1, sk, 2, 32), torch.float32, 51 + i).requires_grad_() for i in range(2))
        dout = torch.ones((1, sq, 2, 32))
        _, _, _, grads = _compare(paths, lambda det: flashcpp.flash_attn_func(q, k, v, return_lse=True,
                                                                              deterministic=det),
                                  (q, k, v), dout, None)
        assert all(torch.all(g == 0) for g in grads)
    assert paths.taken == {"attention_fast": 0, "backward_fast": 0}


def test_what_the_backward_steps_aside_for():
    a = _bwd_args()
    f = lambda **kw: _C.backward_fast(*(dict(a, **kw)[n] for n in (  # noqa: E731
        "dout", "q", "k", "v", "out", "lse", "dlse", "softmax_scale", "causal", "window_left", "window_right",
        "softcap", "deterministic")))
    assert f() is not None
    assert f(dout=a["dout"].numpy()) is None  # numpy
    assert f(q=a["q"].double(), k=a["k"].double(), v=a["v"].double()) is None  # float64: the fp64 reference
    assert f(lse=a["lse"].transpose(1, 2).contiguous().transpose(1, 2)) is None  # a strided LSE
    assert f(lse=torch.empty((0,))) is None  # no LSE: the general path's sentence
    assert f(dout=torch._neg_view(a["dout"])) is None  # memory holding -x
    assert f(deterministic=1) is None
    assert f(q=a["q"].to("meta"), k=a["k"].to("meta"), v=a["v"].to("meta")) is None


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device (the fast paths' CUDA half)")
def test_cuda_backward_runs_on_the_current_stream(paths):
    """On a side stream the fast backward launches where torch's current stream is (the general path
    does, through torch.cuda.current_stream): the results equal a default-stream run."""
    dev = torch.device("cuda", torch.cuda.current_device())
    q = _rand((2, 300, 8, 128), torch.bfloat16, 60, dev).requires_grad_()
    k, v = (_rand((2, 300, 2, 128), torch.bfloat16, 61 + i, dev).requires_grad_() for i in range(2))
    dout = _rand((2, 300, 8, 128), torch.bfloat16, 63, dev)

    def step():
        out = flashcpp.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    want = paths.run(False, step)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = paths.run(True, step)
    torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(got, want):
        _same(a, b)
    assert paths.taken == {"attention_fast": 1, "backward_fast": 1}
