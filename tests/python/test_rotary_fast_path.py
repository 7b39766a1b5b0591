"""The eager fast path of apply_rotary (flashcpp/fused.py, _fast_rotary): plain calls on torch
tensors fill RopeParams directly and let the C++ validator check them.

It must compute exactly what the general path computes (backend="cpu" runs the general path: both
are compared bit for bit), refuse what the general path refuses with the same sentence (the C++
validator's), and step aside for everything it does not take, which then still works or refuses
as before. Host tensors here; the same code serves CUDA tensors on the current device."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp import fused  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _no_general(m):
    m.setattr(fused._core, "meta", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the general path ran")))


@pytest.fixture
def fast_only(monkeypatch):
    """Inside this fixture the general path cannot run (its first step, _core.meta, raises): a call
    that returns took the fast path."""
    _no_general(monkeypatch)


def _general(q, k, **kw):
    return flashcpp.apply_rotary(q, k, backend="cpu", **kw)


CASES = [  # (q shape, k shape or None, keywords without tensors, positions kind, cache)
    ((2, 5, 4, 64), (2, 5, 2, 64), {}, None, False),
    ((2, 5, 4, 64), (2, 5, 2, 64), {"style": "interleaved"}, "bs", False),
    ((7, 3, 32), (7, 1, 32), {"rotary_dim": 16}, "t", False),
    ((7, 3, 32), None, {"rotary_dim": 0, "theta": 500000}, "t", False),
    ((1, 9, 2, 128), (1, 9, 2, 128),
     {"theta": 500000.0, "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8}}, "bs", False),
    ((6, 2, 64), (6, 2, 64), {"style": "interleaved", "rotary_dim": 32}, "t", True),
    ((1, 1, 1, 16), None, {}, None, False),  # size-1 dims everywhere
]


def _args(qs, ks, pk, cache, dtype, seed):
    q = _rand(qs, dtype, seed)
    k = None if ks is None else _rand(ks, dtype, seed + 1)
    batch, seqlen = (1, qs[0]) if len(qs) == 3 else qs[:2]
    pos = None
    if pk == "t":
        pos = torch.randint(0, 40, (batch * seqlen,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    elif pk == "bs":
        pos = torch.randint(0, 4000, (batch, seqlen), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    extra = {}
    if cache:
        extra["cos_sin_cache"] = torch.randn(40, 32)
    return q, k, pos, extra


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fast_equals_general(dtype, case, monkeypatch):
    qs, ks, kw, pk, cache = CASES[case]
    q, k, pos, extra = _args(qs, ks, pk, cache, dtype, 10 + case)
    kw = dict(kw, **extra)
    general = _general(q, k, positions=pos, **kw)
    q0 = q.clone()
    with monkeypatch.context() as m:  # the default call takes the fast path
        _no_general(m)
        fast = flashcpp.apply_rotary(q, k, pos, **kw)
        assert torch.equal(q, q0)  # not in place
        qi, ki = q.clone(), None if k is None else k.clone()
        ret = flashcpp.apply_rotary(qi, ki, pos, inplace=True, **kw)
    assert ret[0] is qi and ret[1] is ki
    assert fast[0].shape == q.shape and fast[0].dtype == dtype and fast[0].is_contiguous()
    assert torch.equal(fast[0], general[0]) and torch.equal(qi, general[0])
    if k is None:
        assert fast[1] is None and general[1] is None
    else:
        assert torch.equal(fast[1], general[1]) and torch.equal(ki, general[1])


def test_packed_qkv_views_and_transposed_layout(monkeypatch):
    qkv = _rand((6, 4 + 2 + 2, 64), torch.bfloat16, 3)  # (tokens, heads_q + 2 heads_kv, head_dim)
    q, k = qkv[:, :4], qkv[:, 4:6]
    assert not q.is_contiguous()
    pos = torch.arange(6, dtype=torch.int32) * 7
    qt = _rand((2, 4, 5, 32), torch.float16, 4).transpose(1, 2)  # (b, s, h, d) view of (b, h, s, d)
    qkv2 = qkv.clone()
    with monkeypatch.context() as m:
        _no_general(m)
        fast = flashcpp.apply_rotary(q, k, pos)
        flashcpp.apply_rotary(qkv2[:, :4], qkv2[:, 4:6], pos, inplace=True)  # in place into the buffer
        ft = flashcpp.apply_rotary(qt)[0]
    assert fast[0].is_contiguous() and fast[1].is_contiguous()  # new tensors, as the general path's
    general = _general(q, k, positions=pos)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    assert torch.equal(qkv2[:, :4], general[0]) and torch.equal(qkv2[:, 4:6], general[1])
    assert torch.equal(qkv2[:, 6:], qkv[:, 6:])  # v untouched
    assert torch.equal(ft, _general(qt, None)[0])


def test_fast_path_is_rotary_against_fp64():
    # neox over all of head_dim, positions 0..S-1: x' = x*cos + rotate_half(x)*sin
    q = _rand((1, 12, 3, 32), torch.float32, 5)
    out = flashcpp.apply_rotary(q)[0]
    d = 32
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(12, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None, :], torch.cat([ang.sin()] * 2, -1)[None, :, None, :]
    x = q.double()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    ref = x * cos + rot * sin
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_nan_propagates_through_the_fast_path(fast_only):
    q = torch.randn(4, 2, 16)
    q[2, 1, 3] = math.nan  # neox: pair (3, 3 + 8) of token 2, head 1
    out = flashcpp.apply_rotary(q, rotary_dim=16)[0]
    bad = torch.isnan(out)
    assert bad[2, 1, 3] and bad[2, 1, 11] and int(bad.sum()) == 2
    q = torch.randn(4, 2, 16)
    q[1, 0, 14] = math.nan  # outside rotary_dim 8: passes through alone
    out = flashcpp.apply_rotary(q, rotary_dim=8, style="interleaved")[0]
    assert torch.isnan(out[1, 0, 14]) and int(torch.isnan(out).sum()) == 1


def _refusal(fn):
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), str(e.value)


@pytest.mark.parametrize("bad", [
    dict(theta=-1.0), dict(theta=math.nan), dict(theta=0), dict(rotary_dim=3),
    dict(llama3={"factor": 0.5}), dict(llama3={"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
    dict(llama3={"low_freq_factor": 1.0}),  # no factor: _llama3's sentence, on both paths
    dict(head_dim=7), dict(head_dim=2048), dict(alias=True), dict(out_of_table=True),
])
def test_fast_path_refuses_as_the_general_path_does(bad):
    bad = dict(bad)
    q = torch.randn(4, 2, bad.pop("head_dim", 8))
    k = None
    if bad.pop("alias", False):
        k = q  # rotated in place, q and k the same memory
        bad["inplace"] = True
    if bad.pop("out_of_table", False):
        bad["positions"] = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
        bad["cos_sin_cache"] = torch.randn(8, 8)
    fast = _refusal(lambda: flashcpp.apply_rotary(q, k, **bad))
    general = _refusal(lambda: _general(q, k, **bad))
    assert fast[0] is ValueError and fast == general


def test_what_the_fast_path_steps_aside_for():
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    args = dict(positions=None, style="neox", rotary_dim=None, theta=10000.0, llama3=None, cache=None,
                inplace=False, cpu_threads=0)

    def fast(q_, k_=None, **kw):
        return fused._fast_rotary(q_, k_, **dict(args, **kw))

    assert fast(q, k) is not None
    aside = {
        "numpy": lambda: fast(q.numpy()),
        "float64": lambda: fast(q.double()),
        "mixed dtypes": lambda: fast(q, k.half()),
        "head_dim strided": lambda: fast(torch.randn(5, 2, 32)[..., ::2]),
        "empty": lambda: fast(q[:0]),
        "no k heads": lambda: fast(q, k[:, :0]),
        "2-D": lambda: fast(q[0]),
        "k of another shape": lambda: fast(q, torch.randn(4, 1, 16)),
        "int64 positions": lambda: fast(q, positions=torch.arange(5)),
        "list positions": lambda: fast(q, positions=[0, 1, 2, 3, 4]),
        "positions of a wrong shape": lambda: fast(q, positions=torch.arange(4, dtype=torch.int32)),
        "strided positions": lambda: fast(q, positions=torch.arange(10, dtype=torch.int32)[::2]),
        "fp16 cache": lambda: fast(q, cache=torch.randn(8, 16).half()),
        "cache of a wrong width": lambda: fast(q, cache=torch.randn(8, 12)),
        "numpy cache": lambda: fast(q, cache=np.zeros((8, 16), np.float32)),
        "unknown style": lambda: fast(q, style="gptj"),
        "float rotary_dim": lambda: fast(q, rotary_dim=8.0),
        "bool rotary_dim": lambda: fast(q, rotary_dim=True),
        "rotary_dim over head_dim": lambda: fast(q, rotary_dim=18),
        "string theta": lambda: fast(q, theta="1e4"),
        "llama3 not a dict": lambda: fast(q, llama3=[("factor", 8.0)]),
        "inplace not a bool": lambda: fast(q, inplace=1),
        "cpu_threads -1": lambda: fast(q, cpu_threads=-1),
        "written tensor requiring grad": lambda: fast(q.clone().requires_grad_(), inplace=True),
    }
    for what, call in aside.items():
        assert call() is None, what
    # a q requiring grad is only read when not in place: the fast path takes it
    assert fast(q.clone().requires_grad_()) is not None
    # and the public calls still work or refuse through the general path
    want = flashcpp.apply_rotary(q, positions=torch.arange(5, dtype=torch.int32))[0]
    assert torch.equal(flashcpp.apply_rotary(q, positions=torch.arange(5))[0], want)
    assert torch.equal(flashcpp.apply_rotary(q, positions=[0, 1, 2, 3, 4])[0], want)
    assert np.array_equal(flashcpp.apply_rotary(q.numpy())[0], flashcpp.apply_rotary(q)[0].numpy())
    out = torch.empty_like(q)
    assert flashcpp.apply_rotary(q, q_out=out)[0] is out and torch.equal(out, flashcpp.apply_rotary(q)[0])
    with pytest.raises(ValueError, match="style must be one of"):
        flashcpp.apply_rotary(q, style="gptj")
    with pytest.raises(ValueError, match="rotary_dim must be an int"):
        flashcpp.apply_rotary(q, rotary_dim=8.0)
    with pytest.raises(ValueError, match="positions must have shape"):
        flashcpp.apply_rotary(q, positions=torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cos_sin_cache must have shape"):
        flashcpp.apply_rotary(q, cos_sin_cache=torch.randn(8, 12))
    with pytest.raises(TypeError, match="float64"):
        flashcpp.apply_rotary(q.double())
    with pytest.raises(ValueError, match="cpu_threads"):
        flashcpp.apply_rotary(q, cpu_threads=-1)
    assert flashcpp.apply_rotary(q[:0])[0].shape == (0, 2, 16)
