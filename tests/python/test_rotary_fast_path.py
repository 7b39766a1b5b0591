"""The eager fast path of apply_rotary (_C.rotary_fast, python/src/eager_fast.cc): plain calls on
torch tensors are read and launched in one C++ call that fills RopeParams and lets the C++ validator
check them.

It must compute exactly what the general path computes (backend="cpu" runs the general path: both
are compared bit for bit), refuse what the general path refuses with the same sentence (the C++
validator's), and step aside for everything it does not take, which then still works or refuses
as before. Host tensors here, and the CUDA half at the end (skipped without a GPU)."""
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
    args = dict(positions=None, style="neox", rotary_dim=None, theta=10000.0, llama3=None, cos_sin_cache=None,
                inplace=False, cpu_threads=0)

    def fast(q_, k_=None, **kw):
        return fused._C.rotary_fast(q_, k_, **dict(args, **kw))

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
        "fp16 cache": lambda: fast(q, cos_sin_cache=torch.randn(8, 16).half()),
        "cache of a wrong width": lambda: fast(q, cos_sin_cache=torch.randn(8, 12)),
        "numpy cache": lambda: fast(q, cos_sin_cache=np.zeros((8, 16), np.float32)),
        "empty cache": lambda: fast(q, cos_sin_cache=torch.randn(0, 16)),
        "strided cache": lambda: fast(q, cos_sin_cache=torch.randn(8, 32)[:, ::2]),
        "cache with rotary_dim 0": lambda: fast(q, rotary_dim=0, cos_sin_cache=torch.randn(8, 16)),
        "unknown style": lambda: fast(q, style="gptj"),
        "style None": lambda: fast(q, style=None),
        "negative view": lambda: fast(torch._neg_view(q)),
        "None q": lambda: fast(None),
        "meta q": lambda: fast(q.to("meta")),
        "float rotary_dim": lambda: fast(q, rotary_dim=8.0),
        "bool rotary_dim": lambda: fast(q, rotary_dim=True),
        "rotary_dim over head_dim": lambda: fast(q, rotary_dim=18),
        "string theta": lambda: fast(q, theta="1e4"),
        "bool theta": lambda: fast(q, theta=True),
        "theta past float": lambda: fast(q, theta=10**400),
        "llama3 not a dict": lambda: fast(q, llama3=[("factor", 8.0)]),
        "llama3 without factor": lambda: fast(q, llama3={"low_freq_factor": 1.0}),
        "llama3 numpy factor": lambda: fast(q, llama3={"factor": np.float32(8.0)}),
        "llama3 string factor": lambda: fast(q, llama3={"factor": "8"}),
        "llama3 float original_max_position": lambda: fast(q, llama3={"factor": 8.0,
                                                                      "original_max_position_embeddings": 8.0}),
        "llama3 negative original_max_position": lambda: fast(q, llama3={"factor": 8.0, "original_max_position": -1}),
        "inplace not a bool": lambda: fast(q, inplace=1),
        "cpu_threads -1": lambda: fast(q, cpu_threads=-1),
        "written tensor requiring grad": lambda: fast(q.clone().requires_grad_(), inplace=True),
    }
    for what, call in aside.items():
        assert call() is None, what
    # a q requiring grad is only read when not in place: the fast path takes it where autograd does not
    # record, and steps aside for the public call's no_backward where it does (grad mode on)
    with torch.no_grad():
        assert fast(q.clone().requires_grad_()) is not None
    assert fast(q.clone().requires_grad_()) is None
    assert fast(q, k.clone().requires_grad_()) is None
    assert fast(torch.nn.Parameter(q.clone(), requires_grad=False), inplace=True) is not None
    assert fast(q, llama3={"factor": 8, "original_max_position": None}) is not None  # plain numbers, None: 8192
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
    with pytest.raises(ValueError, match="negative view"):
        flashcpp.apply_rotary(torch._neg_view(q))
    with pytest.raises(ValueError, match="llama3 must be a mapping"):
        flashcpp.apply_rotary(q, llama3={"factor": "eight"})
    with pytest.raises(ValueError, match="original_max_position_embeddings must be an int"):
        flashcpp.apply_rotary(q, llama3={"factor": 8.0, "original_max_position": -1})
    assert flashcpp.apply_rotary(q[:0])[0].shape == (0, 2, 16)
    l3 = {"factor": 8.0, "original_max_position_embeddings": 4}
    want = flashcpp.apply_rotary(q, llama3=l3)[0]
    for same in ({"factor": np.float64(8.0), "original_max_position_embeddings": 4},
                 {"factor": "8", "original_max_position": 4}):
        assert torch.equal(flashcpp.apply_rotary(q, llama3=same)[0], want)  # the general path reads them alike


LLAMA3 = [  # every way _llama3 reads a dict of plain numbers
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    {"factor": 32, "low_freq_factor": 2, "high_freq_factor": 8},  # ints; original_max_position 8192
    {"factor": 8.0, "original_max_position": 16},
    {"factor": 8.0, "original_max_position_embeddings": None, "original_max_position": 16},  # None: 8192
    {"factor": 4.0, "low_freq_factor": 1.0 / 3.0, "high_freq_factor": 4.1, "original_max_position_embeddings": 32},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(LLAMA3)))
def test_llama3_dicts_take_the_fast_path(dtype, case, monkeypatch):
    q, k = _rand((2, 7, 3, 64), dtype, 30 + case), _rand((2, 7, 1, 64), dtype, 40 + case)
    pos = torch.randint(0, 30000, (2, 7), dtype=torch.int32, generator=torch.Generator().manual_seed(case))
    kw = dict(theta=500000.0, llama3=LLAMA3[case])
    general = _general(q, k, positions=pos, **kw)
    with monkeypatch.context() as m:
        _no_general(m)
        fast = flashcpp.apply_rotary(q, k, pos, **kw)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    assert not torch.equal(fast[0], flashcpp.apply_rotary(q, k, pos, theta=500000.0)[0])  # the scaling applied


def test_inference_tensors_in_place(monkeypatch):
    """In place into inference tensors: taken on the fast path inside inference mode; refused with the
    general path's sentence outside it, before anything is written."""
    with torch.inference_mode():
        q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
        want = _general(q, k)
        with monkeypatch.context() as m:
            _no_general(m)
            ret = flashcpp.apply_rotary(q, k, inplace=True)
        assert ret[0] is q and ret[1] is k and torch.equal(q, want[0]) and torch.equal(k, want[1])
        q0, k0 = q.clone(), k.clone()
    for args, name in (((q, None), "q"), ((q.clone(), k), "k")):
        with monkeypatch.context() as m:
            _no_general(m)  # the refusal comes from the fast path
            with pytest.raises(RuntimeError, match=f"^{name} is an inference tensor .* pass {name}.clone\\(\\)$"):
                flashcpp.apply_rotary(*args, inplace=True)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    out = flashcpp.apply_rotary(q, k)  # read only: fine outside inference mode
    assert torch.equal(out[0], _general(q, k)[0]) and not out[0].is_inference()


@pytest.mark.parametrize("grad", [True, False])
def test_in_place_moves_the_version_counters_as_the_general_path(grad, monkeypatch):
    q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
    with torch.set_grad_enabled(grad):
        qg, kg = q.clone(), k.clone()
        vq, vk = qg._version, kg._version
        flashcpp.apply_rotary(qg, kg, inplace=True, backend="cpu")
        moved = (qg._version - vq, kg._version - vk)
        with monkeypatch.context() as m:
            _no_general(m)
            qf, kf = q.clone(), k.clone()
            vq, vk = qf._version, kf._version
            flashcpp.apply_rotary(qf, kf, inplace=True)
            assert (qf._version - vq, kf._version - vk) == moved
            qf = q.clone()
            vq = qf._version
            flashcpp.apply_rotary(qf, None, inplace=True)
            assert qf._version - vq == moved[0]
            vq = qf._version
            flashcpp.apply_rotary(qf, None)  # not in place: no move
            assert qf._version == vq
    assert moved == ((1, 1) if grad else (0, 0))
    assert torch.equal(qf, flashcpp.apply_rotary(q)[0]) and torch.equal(qg, qf) and torch.equal(kg, kf)


def _cuda_cases(dev):
    g = torch.Generator(device=dev).manual_seed(31)
    for i, (qs, ks, kw, pk, cache) in enumerate(CASES):
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.randn(qs, generator=g, device=dev).to(dtype)
            k = None if ks is None else torch.randn(ks, generator=g, device=dev).to(dtype)
            batch, seqlen = (1, qs[0]) if len(qs) == 3 else qs[:2]
            pos = None
            if pk == "t":
                pos = torch.randint(0, 40, (batch * seqlen,), dtype=torch.int32, device=dev, generator=g)
            elif pk == "bs":
                pos = torch.randint(0, 4000, (batch, seqlen), dtype=torch.int32, device=dev, generator=g)
            extra = dict(kw)
            if cache:
                extra["cos_sin_cache"] = torch.randn(40, 32, device=dev, generator=g)
            yield f"case {i} {dtype}", q, k, pos, extra


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fast path's CUDA half)")
def test_cuda_fast_path_equals_general_and_captures_in_a_graph(monkeypatch):
    """On CUDA tensors apply_rotary takes the fast path (new outputs and in place), equals the general
    path bit for bit, and launches on torch's current stream (a side stream's work is ordered after
    it, and a CUDA graph captures it)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    q32 = torch.randn(3, 2, 32, device=dev)
    with pytest.raises(NotImplementedError) as fast:  # fp32 on CUDA: the kernel's own sentence, both paths
        flashcpp.apply_rotary(q32)
    with pytest.raises(NotImplementedError) as general:
        flashcpp.apply_rotary(q32, backend="cuda")
    assert str(fast.value) == str(general.value)
    for what, q, k, pos, kw in _cuda_cases(dev):
        assert fused._C.rotary_fast(q, k, pos, kw.get("style", "neox"), kw.get("rotary_dim"), kw.get("theta", 10000.0),
                                    kw.get("llama3"), kw.get("cos_sin_cache"), False, 0) is not None, what
        general = flashcpp.apply_rotary(q, k, pos, backend="cuda", **kw)
        qi, ki = q.clone(), None if k is None else k.clone()
        with monkeypatch.context() as m:
            _no_general(m)
            fast = flashcpp.apply_rotary(q, k, pos, **kw)
            flashcpp.apply_rotary(qi, ki, pos, inplace=True, **kw)
        assert torch.equal(fast[0], general[0]) and torch.equal(qi, general[0]), what
        if k is not None:
            assert torch.equal(fast[1], general[1]) and torch.equal(ki, general[1]), what
    g = torch.Generator(device=dev).manual_seed(32)
    q = torch.randn((2, 64, 8, 128), generator=g, device=dev, dtype=torch.bfloat16)
    k = torch.randn((2, 64, 2, 128), generator=g, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (2, 64), dtype=torch.int32, device=dev, generator=g)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # a long kernel first: a launch on another stream would overtake it
        qs = q.clone()
        flashcpp.apply_rotary(qs, None, pos, inplace=True)
    torch.cuda.synchronize()
    assert torch.equal(qs, flashcpp.apply_rotary(q, None, pos, backend="cuda")[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = flashcpp.apply_rotary(q, k, pos, style="interleaved")
    q.copy_(torch.randn(q.shape, generator=g, device=dev, dtype=q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = flashcpp.apply_rotary(q, k, pos, style="interleaved", backend="cuda")
    assert torch.equal(y[0], want[0]) and torch.equal(y[1], want[1])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tensors_off_the_current_device_step_aside():
    q = torch.randn(3, 2, 32, device="cuda:1", dtype=torch.bfloat16)
    with torch.cuda.device(0):
        assert fused._C.rotary_fast(q, None, None, "neox", None, 10000.0, None, None, False, 0) is None
        out = flashcpp.apply_rotary(q)[0]  # the general path runs it on q's device
    with torch.cuda.device(1):
        assert torch.equal(out, flashcpp.apply_rotary(q)[0])
