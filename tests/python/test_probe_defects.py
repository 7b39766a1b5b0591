"""Defects an adversarial probe found in the Python layer; each now gets a sentence.

- In-place writes into torch inference tensors outside torch.inference_mode() (the eager fast
  paths included) went through, where torch's own in-place ops refuse them.
- An eps that rounds to 0 in float32 (1e-50) gave NaN rows; one past float32's range was reported
  as "eps inf".
- Misleading messages: a numpy out= for a CPU tensor q ("on cpu; got cpu"), meta tensors in the
  fused ops and decode ("x.data is null"), an expanded weight of qk_norm_rope (a shape problem),
  0-dim states of merge_attention_states ("got () and ()"), an int cache_seqlens in run() (a
  shape), zero heads in decode ("(0) must be a multiple of (0)").
- Bools taken as counts by flash_attn_with_kvcache (cache_seqlens=True, num_splits=True).
- plan(max_splits=300) was clamped to 256 without a word.
- An append into k_cache and v_cache that share memory wrote keys and values into the same bytes.

numpy tests run without torch; the torch ones skip without it.
"""
import numpy as np
import pytest

import flashcpp
from flashcpp.decode import BatchDecodeWithKVCache


def _torch():
    return pytest.importorskip("torch")


# ---- 1. in-place writes into inference tensors --------------------------------------------------

def _inference_writes(torch):
    """(what, make the targets under inference mode, call) for every in-place write: the call
    writes targets[0] (targets are inference tensors when made under inference mode)."""
    w = torch.ones(64)
    lens = torch.tensor([1, 2], dtype=torch.int32)

    def plan_append():
        p = BatchDecodeWithKVCache()
        p.plan(2, 4, 2, 64, kv_capacity=8, cache_seqlens=[1, 2], append=True, dtype=torch.float32, device="cpu")
        return p

    def plan_plain():
        p = BatchDecodeWithKVCache()
        p.plan(2, 4, 2, 64, kv_capacity=8, cache_seqlens=[1, 2], dtype=torch.float32, device="cpu")
        return p

    q, kc, vc = torch.randn(2, 1, 4, 64), torch.randn(2, 8, 2, 64), torch.randn(2, 8, 2, 64)
    kn, vn = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    qa, ka, va = torch.randn(1, 5, 2, 64), torch.randn(1, 7, 2, 64), torch.randn(1, 7, 2, 64)
    return [
        ("fused_add_rms_norm x (fast path)", lambda: [torch.randn(4, 64)],
         lambda t: flashcpp.fused_add_rms_norm(t[0], torch.randn(4, 64), w)),
        ("fused_add_rms_norm residual (fast path)", lambda: [torch.randn(4, 64)],
         lambda t: flashcpp.fused_add_rms_norm(torch.randn(4, 64), t[0], w)),
        ("fused_add_rms_norm residual_out=", lambda: [torch.zeros(4, 64)],
         lambda t: flashcpp.fused_add_rms_norm(torch.randn(4, 64), torch.randn(4, 64), w, out=torch.zeros(4, 64),
                                               residual_out=t[0])),
        ("rms_norm out=", lambda: [torch.zeros(4, 64)],
         lambda t: flashcpp.rms_norm(torch.randn(4, 64), w, out=t[0])),
        ("silu_and_mul out=", lambda: [torch.zeros(4, 64)],
         lambda t: flashcpp.silu_and_mul(torch.randn(4, 128), out=t[0])),
        ("apply_rotary inplace q (fast path)", lambda: [torch.randn(4, 2, 64)],
         lambda t: flashcpp.apply_rotary(t[0], None, inplace=True)),
        ("apply_rotary inplace k (fast path)", lambda: [torch.randn(4, 2, 64)],
         lambda t: flashcpp.apply_rotary(torch.randn(4, 2, 64), t[0], inplace=True)),
        ("apply_rotary q_out=", lambda: [torch.zeros(4, 2, 64)],
         lambda t: flashcpp.apply_rotary(torch.randn(4, 2, 64), None, q_out=t[0])),
        ("qk_norm_rope inplace", lambda: [torch.randn(1, 4, 2, 64)],
         lambda t: flashcpp.qk_norm_rope(t[0], None, w, inplace=True)),
        ("attention out=", lambda: [torch.zeros(1, 5, 2, 64)],
         lambda t: flashcpp.attention(qa, ka, va, out=t[0])),
        ("flash_attn_func Rotary(k_out=)", lambda: [torch.zeros(1, 7, 2, 64)],
         lambda t: flashcpp.flash_attn_func(qa, ka, va, rotary=flashcpp.Rotary(k_out=t[0]))),
        ("flash_attn_with_kvcache append (fast path)", lambda: [torch.randn(2, 8, 2, 64)],
         lambda t: flashcpp.flash_attn_with_kvcache(q, t[0], vc, kn, vn, cache_seqlens=lens)),
        ("flash_attn_with_kvcache append, v_cache (fast path)", lambda: [torch.randn(2, 8, 2, 64)],
         lambda t: flashcpp.flash_attn_with_kvcache(q, kc, t[0], kn, vn, cache_seqlens=lens)),
        ("BatchDecodeWithKVCache.run append", lambda: [torch.randn(2, 8, 2, 64)],
         lambda t: plan_append().run(q, t[0], vc, lens, k=kn, v=vn)),
        ("BatchDecodeWithKVCache.run out=", lambda: [torch.zeros(2, 1, 4, 64)],
         lambda t: plan_plain().run(q, kc, vc, lens, out=t[0])),
        ("rope_append_kv cache", lambda: [torch.zeros(2, 8, 2, 64)],
         lambda t: flashcpp.rope_append_kv(kn, vn, t[0], torch.zeros(2, 8, 2, 64), lens)),
    ]


_WRITES = ["fused_add_rms_norm x (fast path)", "fused_add_rms_norm residual (fast path)",
           "fused_add_rms_norm residual_out=", "rms_norm out=", "silu_and_mul out=", "apply_rotary inplace q (fast path)",
           "apply_rotary inplace k (fast path)", "apply_rotary q_out=", "qk_norm_rope inplace", "attention out=",
           "flash_attn_func Rotary(k_out=)", "flash_attn_with_kvcache append (fast path)",
           "flash_attn_with_kvcache append, v_cache (fast path)", "BatchDecodeWithKVCache.run append",
           "BatchDecodeWithKVCache.run out=", "rope_append_kv cache"]


def test_every_inference_write_case_is_listed():
    assert [w for w, _, _ in _inference_writes(_torch())] == _WRITES


@pytest.mark.parametrize("what", _WRITES)
def test_in_place_writes_into_inference_tensors_are_refused_outside_inference_mode(what):
    torch = _torch()
    make, call = {w: (m, c) for w, m, c in _inference_writes(torch)}[what]
    with torch.inference_mode():
        targets = make()
        before = [t.clone() for t in targets]
    assert targets[0].is_inference()
    with pytest.raises(RuntimeError, match=r"is an inference tensor \(made under torch.inference_mode\(\)\) and "
                                           r"flashcpp would write it in place outside inference mode"):
        call(targets)
    for t, b in zip(targets, before):  # refused before any write
        assert torch.equal(t, b), what
    with torch.inference_mode():  # inside inference mode the write is torch's rule too: it runs
        call(targets)
    call([t.clone() for t in targets])  # a normal tensor runs outside it


def test_inference_message_names_the_written_argument():
    torch = _torch()
    with torch.inference_mode():
        r = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="^residual is an inference tensor .* pass residual.clone\\(\\)$"):
        flashcpp.fused_add_rms_norm(torch.randn(4, 64), r, torch.ones(64))


def test_apply_rotary_inplace_with_a_numpy_k_gets_a_sentence():
    """The fast path read k.requires_grad of a numpy k (AttributeError)."""
    torch = _torch()
    with pytest.raises(TypeError, match="must all be numpy arrays or all torch tensors"):
        flashcpp.apply_rotary(torch.randn(4, 2, 64), np.zeros((4, 2, 64), np.float32), inplace=True)


# ---- 2. eps in float32 -------------------------------------------------------------------------

_EPS_CASES = [(1e-50, r"eps 1e-50 rounds to 0 in float32 \(an all-zero row would give NaN\)"),
              (1e300, r"eps 1e\+300 rounds to inf in float32"),
              (-1.0, r"eps -1.0 must be finite and >= 0"),
              (float("nan"), r"eps nan must be finite and >= 0"),
              (float("inf"), r"eps inf must be finite and >= 0")]


def _norm_calls(zeros, ones):
    return [lambda eps: flashcpp.rms_norm(zeros(4, 64), ones(64), eps=eps),
            lambda eps: flashcpp.fused_add_rms_norm(zeros(4, 64), zeros(4, 64), ones(64), eps=eps),
            lambda eps: flashcpp.qk_norm_rope(zeros(1, 4, 2, 64), zeros(1, 4, 2, 64), ones(64), ones(64), eps=eps)]


@pytest.mark.parametrize("eps,msg", _EPS_CASES)
def test_eps_outside_float32_is_refused_numpy(eps, msg):
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    o = lambda *s: np.ones(s, np.float32)  # noqa: E731
    for call in _norm_calls(z, o):
        with pytest.raises(ValueError, match=msg + r".*pass 0 or a value in \[1.4e-45, 3.4e\+38\]"):
            call(eps)


@pytest.mark.parametrize("eps,msg", _EPS_CASES)
def test_eps_outside_float32_is_refused_torch_fast_paths(eps, msg):
    torch = _torch()
    for call in _norm_calls(torch.zeros, torch.ones):
        with pytest.raises(ValueError, match=msg):
            call(eps)
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    x0, r0 = x.clone(), r.clone()
    with pytest.raises(ValueError, match=msg):  # the in-place fast path: nothing written
        flashcpp.fused_add_rms_norm(x, r, torch.ones(64), eps=eps)
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_eps_in_float32_range_still_runs():
    x = np.zeros((2, 64), np.float32)
    for eps in (0, 0.0, 1e-45, np.float32(1e-6), 3e38):
        y = flashcpp.rms_norm(x + 1, np.ones(64, np.float32), eps=eps)
        assert np.isfinite(y).all()
    assert np.isfinite(flashcpp.rms_norm(x, np.ones(64, np.float32), eps=1e-45)).all()  # no NaN on a zero row


# ---- 3. messages --------------------------------------------------------------------------------

def test_numpy_out_for_a_torch_q_names_the_library():
    torch = _torch()
    q, k, v = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)
    with pytest.raises(TypeError, match="^out must be a torch tensor like q; got a numpy array$"):
        flashcpp.attention(q, k, v, out=np.empty((1, 4, 2, 64), np.float32))
    with pytest.raises(TypeError, match="^lse must be a torch tensor like q; got a numpy array$"):
        flashcpp.attention(q, k, v, lse=np.empty((1, 2, 4), np.float32))
    with pytest.raises(TypeError, match="^out must be a numpy array like q; got a torch tensor$"):
        flashcpp.attention(q.numpy(), k.numpy(), v.numpy(), out=torch.empty(1, 4, 2, 64))
    with pytest.raises(TypeError, match="^q_out must be a torch tensor like q; got a numpy array$"):
        flashcpp.apply_rotary(torch.randn(4, 2, 64), q_out=np.empty((4, 2, 64), np.float32))
    w = BatchDecodeWithKVCache()
    w.plan(2, 2, 2, 64, kv_capacity=8, cache_seqlens=[3, 4], dtype=torch.float32, device="cpu")
    lens = torch.tensor([3, 4], dtype=torch.int32)
    kc = torch.randn(2, 8, 2, 64)
    with pytest.raises(TypeError, match="^out must be a torch tensor like q; got a numpy array$"):
        w.run(torch.randn(2, 1, 2, 64), kc, kc.clone(), lens, out=np.empty((2, 1, 2, 64), np.float32))
    with pytest.raises(TypeError, match="^lse must be a torch tensor like q; got a numpy array$"):
        w.run(torch.randn(2, 1, 2, 64), kc, kc.clone(), lens, lse=np.empty((2, 2, 1), np.float32))


def test_meta_tensors_in_fused_ops_and_decode_name_the_device():
    torch = _torch()

    def m(*s):
        return torch.empty(*s, device="meta")
    calls = {
        "x": [lambda: flashcpp.rms_norm(m(4, 64), m(64)),
              lambda: flashcpp.fused_add_rms_norm(m(4, 64), m(4, 64), m(64)),
              lambda: flashcpp.silu_and_mul(m(4, 128))],
        "gate": [lambda: flashcpp.silu_and_mul(m(4, 64), m(4, 64))],
        "q": [lambda: flashcpp.apply_rotary(m(1, 4, 2, 64)),
              lambda: flashcpp.qk_norm_rope(m(1, 4, 2, 64), None, m(64)),
              lambda: flashcpp.flash_attn_with_kvcache(m(2, 1, 2, 64), m(2, 8, 2, 64), m(2, 8, 2, 64),
                                                       cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))],
        "k": [lambda: flashcpp.rope_append_kv(m(2, 1, 2, 64), m(2, 1, 2, 64), m(2, 8, 2, 64), m(2, 8, 2, 64),
                                              torch.tensor([1, 2], dtype=torch.int32))],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=f"^{name} is on the meta device: flashcpp runs on CPU and CUDA "
                                                 r"tensors \(a meta tensor has no data to read\)$"):
                fn()


def test_an_expanded_norm_weight_is_refused_as_a_stride_not_a_shape():
    q = np.zeros((1, 4, 2, 64), np.float32)
    expanded = np.broadcast_to(np.ones(1, np.float32), (64,))  # stride 0
    msg = r"must be contiguous \(stride 1\); got stride 0 \(an expanded view\): pass a contiguous copy"
    with pytest.raises(ValueError, match="^q_weight " + msg):
        flashcpp.qk_norm_rope(q, q.copy(), expanded, np.ones(64, np.float32))
    with pytest.raises(ValueError, match="^k_weight " + msg):
        flashcpp.qk_norm_rope(q, q.copy(), np.ones(64, np.float32), expanded)
    with pytest.raises(ValueError, match="^weight " + msg):  # rms_norm's rule, which qk_norm_rope now shares
        flashcpp.rms_norm(q[0, 0], expanded)
    with pytest.raises(ValueError, match="q_weight must be a contiguous"):  # a wrong shape is still a shape
        flashcpp.qk_norm_rope(q, None, np.ones(32, np.float32))
    flashcpp.qk_norm_rope(q, q.copy(), np.ascontiguousarray(expanded), np.ones(64, np.float32))


def test_merge_of_0_dim_states_says_what_rank_is_expected():
    s = np.zeros((), np.float32)
    with pytest.raises(ValueError, match=r"v_a and v_b must have at least one dimension, \(\.\.\., head_dim\); "
                                         r"got shapes \(\) and \(\)"):
        flashcpp.merge_attention_states(s, s, s, s)


def test_merge_of_0_dim_tensors_says_what_rank_is_expected():
    torch = _torch()
    s = torch.tensor(1.0)
    with pytest.raises(ValueError, match="at least one dimension"):
        flashcpp.merge_attention_states(s, s, s, s)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("lens", [5, np.int32(5), np.array(5, np.int32), True])
def test_run_takes_no_single_length(batch, lens):
    """An int read as shape (1,): refused with batch 2 as a shape, and run as every length with batch 1."""
    w = BatchDecodeWithKVCache()
    w.plan(batch, 2, 2, 64, kv_capacity=8, cache_seqlens=[5] * batch, dtype=np.float32, device="cpu")
    q, kc = np.zeros((batch, 1, 2, 64), np.float32), np.zeros((batch, 8, 2, 64), np.float32)
    with pytest.raises(TypeError, match=rf"^cache_seqlens must be an int32 array of shape \(batch,\) = \({batch},\) "
                                        r"\(a tensor on q's device for torch inputs\); got .*, and run\(\) takes no "
                                        r"single length \(flash_attn_with_kvcache does\)$"):
        w.run(q, kc, kc.copy(), lens)
    w.run(q, kc, kc.copy(), np.full(batch, 5, np.int32))


def test_run_takes_no_0_dim_length_tensor():
    torch = _torch()
    w = BatchDecodeWithKVCache()
    w.plan(1, 2, 2, 64, kv_capacity=8, cache_seqlens=[5], dtype=torch.float32, device="cpu")
    kc = torch.zeros(1, 8, 2, 64)
    with pytest.raises(TypeError, match=r"cache_seqlens must be an int32 array of shape \(batch,\) = \(1,\)"):
        w.run(torch.zeros(1, 1, 2, 64), kc, kc.clone(), torch.tensor(5, dtype=torch.int32))


@pytest.mark.parametrize("hq,hkv", [(0, 0), (2, 0), (0, 2)])
def test_decode_with_zero_heads_says_heads_must_be_at_least_one(hq, hkv):
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    with pytest.raises(ValueError, match=rf"^decode needs at least one head in q and in the cache; got heads_q {hq} "
                                         rf"\(q.shape\[2\]\) and heads_kv {hkv} \(k_cache.shape\[2\]\)$"):
        flashcpp.flash_attn_with_kvcache(z(2, 1, hq, 64), z(2, 8, hkv, 64), z(2, 8, hkv, 64),
                                         cache_seqlens=np.array([1, 2], np.int32))


@pytest.mark.parametrize("hq,hkv", [(0, 0), (2, 0), (0, 2)])
def test_decode_with_zero_heads_on_the_torch_fast_path(hq, hkv):
    torch = _torch()
    with pytest.raises(ValueError, match="decode needs at least one head in q and in the cache"):
        flashcpp.flash_attn_with_kvcache(torch.zeros(2, 1, hq, 64), torch.zeros(2, 8, hkv, 64),
                                         torch.zeros(2, 8, hkv, 64), cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))


# ---- 4. bools are not counts ----------------------------------------------------------------------

def test_flash_attn_with_kvcache_refuses_bools_as_counts():
    q, kc = np.zeros((2, 1, 2, 64), np.float32), np.zeros((2, 8, 2, 64), np.float32)
    lens = np.array([1, 2], np.int32)
    for b in (True, np.bool_(True)):
        with pytest.raises(TypeError, match=r"^cache_seqlens must be an int or int32 \(batch,\) lengths; got the bool "
                                            r"(np\.)?True_? \(a bool is not a count\)$"):
            flashcpp.flash_attn_with_kvcache(q, kc, kc.copy(), cache_seqlens=b)
        with pytest.raises(ValueError, match=r"^num_splits must be an int in \[0, 256\] \(0 = heuristic\); got "
                                             r"(np\.)?True_? \(a bool is not a count\)$"):
            flashcpp.flash_attn_with_kvcache(q, kc, kc.copy(), cache_seqlens=lens, num_splits=b)
    with pytest.raises(TypeError, match="^rope_theta must be a number; got True$"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc.copy(), cache_seqlens=lens, rope_theta=True)
    with pytest.raises(TypeError, match="cache_seqlens must be an int or int32 .*a bool is not a count"):
        BatchDecodeWithKVCache().plan(2, 2, 2, 64, kv_capacity=8, cache_seqlens=True, dtype=np.float32, device="cpu")
    flashcpp.flash_attn_with_kvcache(q, kc, kc.copy(), cache_seqlens=1, num_splits=1)  # ints still count


def test_flash_attn_with_kvcache_refuses_bools_as_counts_torch():
    torch = _torch()
    q, kc = torch.zeros(2, 1, 2, 64), torch.zeros(2, 8, 2, 64)
    with pytest.raises(TypeError, match="a bool is not a count"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=True)
    with pytest.raises(ValueError, match="num_splits must be an int in .*a bool is not a count"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=torch.tensor([1, 2], dtype=torch.int32),
                                         num_splits=True)


# ---- 5. max_splits ---------------------------------------------------------------------------------

def test_plan_refuses_max_splits_above_the_cap():
    w = BatchDecodeWithKVCache()
    for cap in (300, 2**31, -1):
        with pytest.raises(ValueError, match=rf"^max_splits {cap} is outside \[0, 256\] \(0 = 256, the most splits a "
                                             r"plan makes\)$"):
            w.plan(1, 2, 2, 64, kv_capacity=4096, dtype=np.float32, device="cpu", max_splits=cap)
    for bad in (True, 8.0):
        with pytest.raises(ValueError, match=r"^max_splits must be an int in \[0, 256\]; got"):
            w.plan(1, 2, 2, 64, kv_capacity=4096, dtype=np.float32, device="cpu", max_splits=bad)
    with pytest.raises(ValueError, match=r"num_splits 300 is outside \[0, 256\]"):  # the same kind of sentence
        w.plan(1, 2, 2, 64, kv_capacity=4096, dtype=np.float32, device="cpu", num_splits=300)
    assert w.plan(1, 2, 2, 64, kv_capacity=4096, dtype=np.float32, device="cpu", max_splits=256).max_splits <= 256


# ---- 6. an append into one memory --------------------------------------------------------------------

_SHARED = r"^k_cache and v_cache share memory \(one tensor passed twice, or overlapping views of one buffer\)"


def test_append_into_one_cache_twice_is_refused_numpy():
    q = np.zeros((2, 1, 2, 64), np.float32)
    kn, vn = np.ones((2, 1, 2, 64), np.float32), np.full((2, 1, 2, 64), 2, np.float32)
    lens = np.array([1, 2], np.int32)
    kc = np.zeros((2, 8, 2, 64), np.float32)
    buf = np.zeros((2, 12, 2, 64), np.float32)
    for k_cache, v_cache in ((kc, kc), (kc, kc[:]), (buf[:, :8], buf[:, 4:])):
        before = k_cache.copy()
        with pytest.raises(ValueError, match=_SHARED):
            flashcpp.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=lens)
        assert np.array_equal(k_cache, before)  # nothing written
    w = BatchDecodeWithKVCache()
    w.plan(2, 2, 2, 64, kv_capacity=8, cache_seqlens=[1, 2], append=True, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match=_SHARED):
        w.run(q, kc, kc, lens, k=kn, v=vn)
    flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)  # no append: reading one cache twice is fine
    flashcpp.flash_attn_with_kvcache(q, buf[:, :6], buf[:, 6:], kn, vn, cache_seqlens=lens)  # disjoint halves


def test_append_into_one_cache_twice_is_refused_torch_fast_path():
    torch = _torch()
    q = torch.zeros(2, 1, 2, 64)
    kn, vn = torch.ones(2, 1, 2, 64), torch.full((2, 1, 2, 64), 2.0)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    kc = torch.zeros(2, 8, 2, 64)
    buf = torch.zeros(2, 12, 2, 64)
    for k_cache, v_cache in ((kc, kc), (kc, kc.view(2, 8, 2, 64)), (buf[:, :8], buf[:, 4:])):
        with pytest.raises(ValueError, match=_SHARED):
            flashcpp.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=lens)
        assert not kc.any() and not buf.any()  # nothing written


def test_interleaved_caches_of_one_buffer_still_append():
    """FlashInfer's (pages, 2, page_size, heads, dim) layout: k = buf[:, 0], v = buf[:, 1] share a
    buffer, not an element; the append gives what two separate caches give."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 64)).astype(np.float32)
    kn, vn = (rng.standard_normal((2, 1, 2, 64)).astype(np.float32) for _ in range(2))
    lens = np.array([3, 5], np.int32)
    table = np.array([[0, 1], [2, 3]], np.int32)
    buf = rng.standard_normal((4, 2, 4, 2, 64)).astype(np.float32)
    k_sep, v_sep = buf[:, 0].copy(), buf[:, 1].copy()
    got = flashcpp.flash_attn_with_kvcache(q, buf[:, 0], buf[:, 1], kn, vn, cache_seqlens=lens, block_table=table)
    want = flashcpp.flash_attn_with_kvcache(q, k_sep, v_sep, kn, vn, cache_seqlens=lens, block_table=table)
    assert np.array_equal(got, want)
    assert np.array_equal(buf[:, 0], k_sep) and np.array_equal(buf[:, 1], v_sep)
