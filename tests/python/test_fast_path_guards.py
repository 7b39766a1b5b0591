"""What the eager fast paths' C++ calls do in place of the Python guard that ran before them
(python/src/eager_fast.cc, its header comment): they step aside where autograd records (grad mode
on and an input requires grad), so the public call refuses it or runs it without a backward as
before; they check eps, window_size and the tensors written in place in the guard's order, with
its sentences; they move the version counters of what they write in place under grad mode, as the
general path does. Host tensors; each case is compared with the general path (backend="cpu", a
list of lengths, or out= / residual_out=, which the fast paths do not take)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashcpp  # noqa: E402
from flashcpp import _decode, fused  # noqa: E402


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _raised(fn):
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), str(e.value)


def _decode_inputs():
    q = _rand(2, 1, 4, 32, seed=1)
    kc, vc = _rand(2, 16, 2, 32, seed=2), _rand(2, 16, 2, 32, seed=3)
    k, v = _rand(2, 1, 2, 32, seed=4), _rand(2, 1, 2, 32, seed=5)
    return q, kc, vc, k, v, torch.tensor([5, 6], dtype=torch.int32)


def test_the_fast_calls_step_aside_where_autograd_records_and_take_it_under_no_grad():
    x, w, r = _rand(4, 32, seed=6), _rand(32, seed=7), _rand(4, 32, seed=8)
    q, k = _rand(5, 2, 16, seed=9), _rand(5, 1, 16, seed=10)
    qd, kc, vc, kn, vn, lens = _decode_inputs()
    rot = dict(positions=None, style="neox", rotary_dim=None, theta=10000.0, llama3=None, cos_sin_cache=None,
               cpu_threads=0)
    calls = {
        "rms_norm x": lambda g: fused._C.norm_fast(g(x), None, w, 1e-6, 0),
        "rms_norm weight": lambda g: fused._C.norm_fast(x, None, g(w), 1e-6, 0),
        "silu_and_mul": lambda g: fused._C.silu_and_mul_fast(g(x), 0),
        "apply_rotary q": lambda g: fused._C.rotary_fast(g(q), k, inplace=False, **rot),
        "apply_rotary k": lambda g: fused._C.rotary_fast(q, g(k), inplace=False, **rot),
        "kvcache q": lambda g: _decode._fast_kvcache(g(qd), kc, vc, None, None, lens, None, None, False, (-1, -1),
                                                     0.0, 0, False),
        "kvcache v_cache": lambda g: _decode._fast_kvcache(qd, kc, g(vc), None, None, lens, None, None, False,
                                                           (-1, -1), 0.0, 0, False),
    }
    for what, call in calls.items():
        assert call(lambda t: t.clone().requires_grad_()) is None, what
        with torch.no_grad():  # nothing records: the fast path takes a tensor requiring grad that it only reads
            assert call(lambda t: t.clone().requires_grad_()) is not None, what
        assert call(lambda t: t) is not None, what
    # what the fast calls write in place they refuse requiring grad with grad mode off too, as before
    with torch.no_grad():
        assert fused._C.norm_fast(x.clone().requires_grad_(), r.clone(), w, 1e-6, 0) is None
        assert fused._C.norm_fast(x.clone(), r.clone(), w.clone().requires_grad_(), 1e-6, 0) is not None
        assert fused._C.rotary_fast(q.clone().requires_grad_(), k.clone(), inplace=True, **rot) is None


def test_public_calls_with_grad_behave_as_before():
    """Autograd records: out-of-place calls run without a backward (their outputs' backward raises,
    their values those of the plain call), in-place ones are refused with their sentence."""
    x, w, r = _rand(4, 32, seed=11), _rand(32, seed=12), _rand(4, 32, seed=13)
    q, k = _rand(5, 2, 16, seed=14), _rand(5, 1, 16, seed=15)
    qd, kc, vc, kn, vn, lens = _decode_inputs()
    xg, wg, qg = x.clone().requires_grad_(), w.clone().requires_grad_(), q.clone().requires_grad_()
    for got, want in ((flashcpp.rms_norm(xg, wg), flashcpp.rms_norm(x, w)),
                      (flashcpp.silu_and_mul(xg), flashcpp.silu_and_mul(x)),
                      (flashcpp.apply_rotary(qg, k)[0], flashcpp.apply_rotary(q, k)[0]),
                      (flashcpp.flash_attn_with_kvcache(qd.clone().requires_grad_(), kc, vc, cache_seqlens=lens),
                       flashcpp.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens))):
        assert got.grad_fn is not None and torch.equal(got.detach(), want)
        with pytest.raises(NotImplementedError, match="has no backward"):
            got.sum().backward()
    with pytest.raises(NotImplementedError, match="fused_add_rms_norm writes its results in place"):
        flashcpp.fused_add_rms_norm(x.clone(), r.clone(), wg)
    with pytest.raises(NotImplementedError, match="apply_rotary with inplace=True"):
        flashcpp.apply_rotary(qg, k, inplace=True)
    with pytest.raises(NotImplementedError, match="appends k and v into the cache in place"):
        flashcpp.flash_attn_with_kvcache(qd, kc.clone(), vc.clone(), kn.clone().requires_grad_(), vn,
                                         cache_seqlens=lens)
    # the grad refusal comes before the checks of eps and window_size, as it did
    with pytest.raises(NotImplementedError, match="fused_add_rms_norm"):
        flashcpp.fused_add_rms_norm(x.clone(), r.clone(), wg, eps=-1.0)
    with pytest.raises(NotImplementedError, match="appends k and v"):
        flashcpp.flash_attn_with_kvcache(qd.clone().requires_grad_(), kc.clone(), vc.clone(), kn, vn,
                                         cache_seqlens=lens, window_size=(-3, 0))
    # out of place: the call runs without a backward, and its eps / window check raises inside
    with pytest.raises(ValueError, match="eps"):
        flashcpp.rms_norm(xg, w, eps=-1.0)
    with pytest.raises(ValueError, match="window_size"):
        flashcpp.flash_attn_with_kvcache(qd.clone().requires_grad_(), kc, vc, cache_seqlens=lens, window_size=(-3, 0))


@pytest.mark.parametrize("grad", [True, False])
def test_versions_move_as_on_the_general_path(grad):
    """In-place writes move the written tensors' version counters under grad mode, once each, as the
    general path moves them (and not with grad mode off)."""
    x, w, r = _rand(4, 32, seed=16), _rand(32, seed=17), _rand(4, 32, seed=18)
    q, k = _rand(5, 2, 16, seed=19), _rand(5, 1, 16, seed=20)
    qd, kc, vc, kn, vn, lens = _decode_inputs()

    def moved(call, *written):
        before = [t._version for t in written]
        with torch.set_grad_enabled(grad):
            call(*written)
        return [t._version - b for t, b in zip(written, before)]

    a, b = x.clone(), r.clone()
    fast = moved(lambda a, b: flashcpp.fused_add_rms_norm(a, b, w), a, b)
    c, d = x.clone(), r.clone()
    general = moved(lambda c, d: flashcpp.fused_add_rms_norm(c, d, w, out=c, residual_out=d), c, d)
    assert fast == general == ([1, 1] if grad else [0, 0]) and torch.equal(a, c) and torch.equal(b, d)
    a, b = q.clone(), k.clone()
    fast = moved(lambda a, b: flashcpp.apply_rotary(a, b, inplace=True), a, b)
    c, d = q.clone(), k.clone()
    general = moved(lambda c, d: flashcpp.apply_rotary(c, d, inplace=True, backend="cpu"), c, d)
    assert fast == general == ([1, 1] if grad else [0, 0]) and torch.equal(a, c) and torch.equal(b, d)
    assert moved(lambda a: flashcpp.apply_rotary(a, None, inplace=True), q.clone()) == ([1] if grad else [0])
    a, b = kc.clone(), vc.clone()
    fast = moved(lambda a, b: flashcpp.flash_attn_with_kvcache(qd, a, b, kn, vn, cache_seqlens=lens), a, b)
    c, d = kc.clone(), vc.clone()
    general = moved(lambda c, d: flashcpp.flash_attn_with_kvcache(qd, c, d, kn, vn, cache_seqlens=[5, 6]), c, d)
    assert fast == general == ([1, 1] if grad else [0, 0]) and torch.equal(a, c) and torch.equal(b, d)


def test_inference_tensors_written_in_place():
    """Outside inference mode an inference tensor written in place gets the general path's sentence;
    under inference mode the fast calls take it."""
    with torch.inference_mode():
        x, r, w = _rand(4, 32, seed=21), _rand(4, 32, seed=22), _rand(32, seed=23)
        qd, kc, vc, kn, vn, lens = _decode_inputs()
    fast = _raised(lambda: flashcpp.fused_add_rms_norm(x, r.clone(), w))
    assert fast[0] is RuntimeError and fast[1].startswith("x is an inference tensor")
    # where the fast call steps aside (x not contiguous) the sentence is the same
    assert fast == _raised(lambda: flashcpp.fused_add_rms_norm(x.t(), r.clone().t(), w[:4]))
    fast = _raised(lambda: flashcpp.fused_add_rms_norm(x.clone(), r, w))
    assert fast[0] is RuntimeError and "residual is an inference tensor" in fast[1]
    fast = _raised(lambda: flashcpp.flash_attn_with_kvcache(qd, kc, vc.clone(), kn, vn, cache_seqlens=lens))
    general = _raised(lambda: flashcpp.flash_attn_with_kvcache(qd, kc, vc.clone(), kn, vn, cache_seqlens=[5, 6]))
    assert fast[0] is RuntimeError and "k_cache is an inference tensor" in fast[1] and fast == general
    with torch.inference_mode():
        a, b = x.clone(), r.clone()
        assert fused._C.norm_fast(a, b, w, 1e-6, 0) is not None
        c, d = x.clone(), r.clone()
        flashcpp.fused_add_rms_norm(c, d, w, out=c, residual_out=d)
        assert torch.equal(a, c) and torch.equal(b, d)
        a, b = kc.clone(), vc.clone()
        assert _decode._fast_kvcache(qd, a, b, kn, vn, lens, None, None, False, (-1, -1), 0.0, 0, False) is not None


def test_eps_and_window_are_checked_as_before():
    x, w, r = _rand(4, 32, seed=24), _rand(32, seed=25), _rand(4, 32, seed=26)
    for eps in (0.0, 0, 1, np.float32(1e-6), 3.4028235e38):  # taken: the fast call asks _core.check_eps
        assert torch.equal(flashcpp.rms_norm(x, w, eps=eps), flashcpp.rms_norm(x, w, eps=eps, backend="cpu")), eps
    for eps in (-1.0, 1e-50, 1e39, float("nan"), "1e-6", None, True):
        fast = _raised(lambda: flashcpp.rms_norm(x, w, eps=eps))
        assert fast == _raised(lambda: flashcpp.rms_norm(x, w, eps=eps, backend="cpu")), eps
        assert fast == _raised(lambda: flashcpp.fused_add_rms_norm(x.clone(), r.clone(), w, eps=eps)), eps
        # where the fast call steps aside first (numpy, not contiguous) the sentence is the same
        assert fast == _raised(lambda: flashcpp.rms_norm(_rand(4, 64)[:, :32], w, eps=eps)), eps
        assert fast == _raised(lambda: flashcpp.fused_add_rms_norm(_rand(4, 64)[:, :32], r.clone(), w, eps=eps))
    qd, kc, vc, kn, vn, lens = _decode_inputs()
    for window in ((-3, 0), (1.0, 0), [2], None, (True, 0)):
        fast = _raised(lambda: flashcpp.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, window_size=window))
        assert fast[0] is ValueError and "window_size" in fast[1], window
        # int64 lengths: the fast call steps aside before its window check; the sentence is the same
        assert fast == _raised(lambda: flashcpp.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens.long(),
                                                                        window_size=window)), window
    for window in ([-1, -1], (np.int64(3), 0), (4, 2)):  # taken, as the general path takes them
        got = flashcpp.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, window_size=window)
        assert torch.equal(got, flashcpp.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=[5, 6],
                                                                 window_size=window)), window


def test_kvcache_output_strides_are_the_general_paths():
    """The step's output is allocated like q only where q's strides are exactly row-major; a q whose
    size-1 dim has another stride gets new_empty's strides, as on the general path."""
    _, kc, vc, _, _, lens = _decode_inputs()
    for q in (_rand(2, 1, 4, 32, seed=27), _rand(2, 3, 4, 32, seed=28)[:, 1:2]):  # strides (..., 128, ...), (384, 128, ...)
        fast = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        general = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[5, 6])
        assert fast.stride() == general.stride() == (128, 128, 32, 1) and torch.equal(fast, general)
