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
- An append into k_cache and v_cache that share memory wrote keys and values into the same bytes;
  torch caches over overlapping bytes in two storages (torch.from_numpy of overlapping slices)
  still did.
- Yes/no options took any truthy value (rotary_interleaved='no' ran as True, plan(fused_merge='no'),
  inplace='no'), return_softmax_lse=np.True_ on torch reached nanobind's "incompatible function
  arguments", and bools ran as numbers (plan(rope_theta=True), logits_soft_cap=True).
- eps 3.4028235e38 (float32's max as numpy prints it) was refused as rounding to inf; an eps that is
  not a real number (a 2-element tensor, 10**400, a complex) got messages without its name or a
  ComplexWarning only.
- Meta tensors in decode arguments other than q ("cache.k.data is null", "Cannot copy out of meta
  tensor").

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
    with pytest.raises(TypeError, match=r"^rope_theta must be a real number \(a Python or numpy number, or a "
                                        r"one-element tensor\); got True$"):
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


# ---- 7. overlapping caches in two torch storages ------------------------------------------------------

def test_overlapping_torch_caches_of_two_storages_are_refused():
    """torch.from_numpy of overlapping slices of one array gives two storages over shared bytes: the
    storage test alone called them apart, and the append wrote each key over a value."""
    torch = _torch()
    arr = np.zeros((3, 8, 1, 8), np.float32)
    kc, vc = torch.from_numpy(arr[0:2]), torch.from_numpy(arr[1:3])  # overlap at arr[1]
    assert kc.untyped_storage().data_ptr() != vc.untyped_storage().data_ptr()
    q, kn, vn = torch.randn(2, 1, 1, 8), torch.ones(2, 1, 1, 8), torch.full((2, 1, 1, 8), 2.0)
    lens = torch.tensor([0, 0], dtype=torch.int32)
    w = BatchDecodeWithKVCache()
    w.plan(2, 1, 1, 8, kv_capacity=8, cache_seqlens=[0, 0], append=True, dtype=torch.float32, device="cpu")
    calls = [lambda: flashcpp.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens),  # the fast path
             lambda: flashcpp.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, rope_theta=1e4),
             lambda: w.run(q, kc, vc, lens, k=kn, v=vn),
             lambda: flashcpp.rope_append_kv(kn, vn, kc, vc, lens)]
    for call in calls:
        with pytest.raises(ValueError, match=_SHARED):
            call()
        assert not arr.any()  # nothing written
    # storages over disjoint bytes of one array still append, adjacent or interleaved
    buf = np.zeros((4, 8, 1, 8), np.float32)
    for k_cache, v_cache in ((torch.from_numpy(buf[0:2]), torch.from_numpy(buf[2:4])),
                             (torch.from_numpy(buf[:, 0:4].reshape(2, 2, 4, 1, 8)[:, 0]),
                              torch.from_numpy(buf[:, 0:4].reshape(2, 2, 4, 1, 8)[:, 1]))):
        buf[:] = 0
        flashcpp.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=lens)
        assert (k_cache[:, 0] == 1).all() and (v_cache[:, 0] == 2).all()


# ---- 8. yes/no options and bools as numbers ---------------------------------------------------------

def _plan_args(**kw):
    return dict(dict(kv_capacity=8, cache_seqlens=[1, 2], dtype=np.float32, device="cpu"), **kw)


@pytest.mark.parametrize("flag", ["append", "causal", "non_blocking", "fused_merge", "fused_append"])
def test_plan_takes_true_or_false_only(flag):
    w = BatchDecodeWithKVCache()
    for bad in ("no", 2, None):
        with pytest.raises(TypeError, match=rf"^{flag} must be True or False; got {bad!r}$"):
            w.plan(2, 2, 2, 64, **_plan_args(**{flag: bad}))
    for good in (True, False, np.True_, np.False_):
        w.plan(2, 2, 2, 64, **_plan_args(**{flag: good}))


def test_plan_refuses_a_bool_rope_theta():
    w = BatchDecodeWithKVCache()
    for b in (True, np.True_):
        with pytest.raises(TypeError, match=r"^rope_theta must be a real number \(a Python or numpy number, or a "
                                            r"one-element tensor\); got (np\.)?True_?$"):
            w.plan(2, 2, 2, 64, **_plan_args(rotary="neox", rope_theta=b))
    w.plan(2, 2, 2, 64, **_plan_args(rotary="neox", rope_theta=500000))


def test_run_takes_true_or_false_for_return_lse():
    w = BatchDecodeWithKVCache()
    w.plan(2, 2, 2, 64, **_plan_args())
    q, kc = np.zeros((2, 1, 2, 64), np.float32), np.zeros((2, 8, 2, 64), np.float32)
    lens = np.array([1, 2], np.int32)
    for bad in ("no", 2):
        with pytest.raises(TypeError, match=rf"^return_lse must be True or False; got {bad!r}$"):
            w.run(q, kc, kc, lens, return_lse=bad)
    assert len(w.run(q, kc, kc, lens, return_lse=np.True_)) == 2
    assert w.run(q, kc, kc, lens, return_lse=np.False_).shape == (2, 1, 2, 64)


def _paged_plan(**kw):
    a = dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1]), last_page_len=np.array([3, 4]), num_qo_heads=2,
             num_kv_heads=2, head_dim=64, page_size=4, data_type="float32")
    a.update(kw)
    w = flashcpp.BatchDecodeWithPagedKVCache()
    w.plan(**a)
    return w


def test_paged_plan_refuses_bools_as_numbers():
    for b in (True, np.True_):
        with pytest.raises(TypeError, match=r"^logits_soft_cap must be a real number \(a Python or numpy number, or a "
                                            r"one-element tensor\); got (np\.)?True_?$"):
            _paged_plan(logits_soft_cap=b)
        with pytest.raises(ValueError, match=r"^window_left must be an int in \[-1, 2147483647\] \(the left of "
                                             r"window_size; -1 = unbounded\); got (np\.)?True_? \(a bool is not a "
                                             r"count\)$"):
            _paged_plan(window_left=b)
    with pytest.raises(ValueError, match=r"^logits_soft_cap 1e-50 rounds to 0 in float32"):  # silently off, else
        _paged_plan(logits_soft_cap=1e-50)
    with pytest.raises(TypeError, match="^non_blocking must be True or False; got 'no'$"):
        _paged_plan(non_blocking="no")
    w = _paged_plan(logits_soft_cap=30, window_left=2)
    q, cache = np.zeros((2, 2, 64), np.float32), np.zeros((2, 4, 2, 64), np.float32)
    with pytest.raises(TypeError, match="^return_lse must be True or False; got 'no'$"):
        w.run(q, (cache, cache), return_lse="no")
    assert len(w.run(q, (cache, cache), return_lse=np.True_)) == 2


def test_window_size_with_a_bool_gets_a_plain_sentence():
    q, kc = np.zeros((2, 1, 2, 64), np.float32), np.zeros((2, 8, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"^window_size must be a pair \(left, right\) of ints, -1 meaning unbounded; "
                                         r"got \(True, -1\) \(a bool is not a window size\)$"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1, window_size=(True, -1))
    with pytest.raises(ValueError, match=r"got \(1.5, -1\) \(a float is not truncated\)$"):
        flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1, window_size=(1.5, -1))


def _kvcache_inputs(torch):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((2, 1, 2, 64), (2, 8, 2, 64), (2, 8, 2, 64))]
    lens = np.array([3, 5], np.int32)
    if torch is None:
        return (*arrays, lens)
    return (*(torch.from_numpy(a) for a in arrays), torch.from_numpy(lens))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_flash_attn_with_kvcache_flags_are_true_or_false(lib):
    """return_softmax_lse=np.True_ on torch tensors reached the C++ fast path as nanobind's
    "incompatible function arguments"; 2 ran on numpy; rotary_interleaved='no' ran as True."""
    torch = _torch() if lib == "torch" else None
    q, kc, vc, lens = _kvcache_inputs(torch)
    for flag in ("return_softmax_lse", "rotary_interleaved", "causal"):
        for bad in ("no", 2, None):
            with pytest.raises(TypeError, match=rf"^{flag} must be True or False; got {bad!r}$"):
                flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, rope_theta=1e4, **{flag: bad})
            with pytest.raises(TypeError, match=rf"^{flag} must be True or False; got {bad!r}$"):
                flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **{flag: bad})
    out, lse = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_softmax_lse=np.True_)
    assert tuple(lse.shape) == (2, 2, 1)
    plain = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_softmax_lse=np.False_)
    assert tuple(plain.shape) == (2, 1, 2, 64)
    for style in (False, True):
        want = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, rope_theta=1e4,
                                                rotary_interleaved=style)
        got = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, rope_theta=1e4,
                                               rotary_interleaved=np.bool_(style))
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_kvcache_fast_path_steps_aside_for_a_flag_that_is_not_a_bool():
    torch = _torch()
    from flashcpp import _decode
    q, kc, vc, lens = _kvcache_inputs(torch)
    for flag in (np.True_, 1, "no"):
        assert _decode._fast_kvcache(q, kc, vc, None, None, lens, None, None, False, (-1, -1), 0.0, 0, flag) is None
    assert _decode._fast_kvcache(q, kc, vc, None, None, lens, None, None, False, (-1, -1), 0.0, 0, True) is not None


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_fused_in_place_options_are_true_or_false(lib):
    """inplace='no' rotated q in place."""
    torch = _torch() if lib == "torch" else None
    rng = np.random.default_rng(0)

    def z(*s):
        a = rng.standard_normal(s).astype(np.float32)
        return torch.from_numpy(a) if torch else a
    q, k = z(1, 4, 2, 64), z(1, 4, 2, 64)
    q0 = q.copy() if torch is None else q.clone()
    w = (torch.ones(64) if torch else np.ones(64, np.float32))
    lens = np.array([1], np.int32) if torch is None else torch.tensor([1], dtype=torch.int32)
    kc = z(1, 8, 2, 64)
    calls = [("inplace", lambda: flashcpp.apply_rotary(q, k, inplace="no")),
             ("inplace", lambda: flashcpp.qk_norm_rope(q, k, w, w, inplace="no")),
             ("inplace_q", lambda: flashcpp.rope_append_kv(k[:, :1], k[:, :1], kc, kc * 1, lens, q=q[:, :1],
                                                          inplace_q="no"))]
    for name, call in calls:
        with pytest.raises(TypeError, match=rf"^{name} must be True or False; got 'no'$"):
            call()
        assert (q == q0).all()
    flashcpp.apply_rotary(q, k, inplace=np.True_)
    assert not (q == q0).all()


# ---- 9. eps at float32's max, and eps that is not a real number -------------------------------------

_F32_TO_INF = 2.0**128 - 2.0**103  # the least value that rounds to inf in float32


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_eps_that_rounds_to_float32_max_runs(lib):
    torch = _torch() if lib == "torch" else None
    x = torch.ones(2, 64) if torch else np.ones((2, 64), np.float32)
    w = torch.ones(64) if torch else np.ones(64, np.float32)
    for eps in (3.4028235e38, float(np.finfo(np.float32).max), np.float32(3.4028235e38), np.nextafter(_F32_TO_INF, 0),
                float(np.nextafter(_F32_TO_INF, 0))):
        y = flashcpp.rms_norm(x, w, eps=eps)
        assert np.isfinite(np.asarray(y)).all() and (np.asarray(y) > 0).all(), eps
        flashcpp.fused_add_rms_norm(x * 1, x * 1, w, eps=eps)
    for eps in (_F32_TO_INF, 3.5e38, 10**39):
        with pytest.raises(ValueError, match=r"^eps \S+ rounds to inf in float32: pass 0 or a value in "
                                             r"\[1.4e-45, 3.4e\+38\], float32's positive range$"):
            flashcpp.rms_norm(x, w, eps=eps)


def _bad_eps(torch):
    from decimal import Decimal
    cases = [(10**400, ValueError, r"got 10{59}\.\.\. \(401 characters\), which it refuses \(int too large to "
                                   r"convert to float\)"),
             (10**5000, ValueError, r"got an int of 16610 bits, which it refuses"),
             (np.array([1e-5]), TypeError, r"\(a Python or numpy number, or a one-element tensor\); got a float64 "
                                           r"numpy array of shape \(1,\)"),
             (Decimal("sNaN"), ValueError, r"got Decimal\('sNaN'\), which it refuses \(cannot convert signaling NaN"),
             (np.complex128(1e-5 + 1j), TypeError, r"got np.complex128\(1e-05\+1j\)"),
             (np.complex64(1e-5), TypeError, r"got np.complex64"),
             (1e-5 + 0j, TypeError, r"got \(1e-05\+0j\)")]
    if torch is not None:
        cases += [(torch.tensor([1e-5, 2e-5]), TypeError, r"got a torch.float32 tensor of shape \(2,\) on cpu$"),
                  (torch.tensor(1e-5 + 0j), TypeError, r"got a torch.complex64 tensor of shape \(\) on cpu$"),
                  (torch.tensor([True]), TypeError, r"got a torch.bool tensor"),
                  (torch.empty(1, device="meta"), TypeError, r"on meta, which it refuses")]
    return cases


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_eps_that_is_not_a_real_number_gets_a_sentence_naming_eps(lib):
    torch = _torch() if lib == "torch" else None
    x = torch.ones(2, 64) if torch else np.ones((2, 64), np.float32)
    w = torch.ones(64) if torch else np.ones(64, np.float32)
    import warnings
    for eps, exc, tail in _bad_eps(torch):
        for call in (lambda: flashcpp.rms_norm(x, w, eps=eps),
                     lambda: flashcpp.fused_add_rms_norm(x * 1, x * 1, w, eps=eps),
                     lambda: flashcpp.qk_norm_rope(x.reshape(1, 2, 1, 64), None, w, eps=eps)):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # numpy's ComplexWarning was all a complex eps got
                with pytest.raises(exc, match=r"^eps must be a real number .*" + tail):
                    call()
    # a one-element tensor and a 0-dim array still count as numbers
    flashcpp.rms_norm(x, w, eps=np.array(1e-5))
    if torch is not None:
        flashcpp.rms_norm(x, w, eps=torch.tensor([1e-5]))


def test_other_real_arguments_get_the_same_sentence():
    q = np.zeros((1, 4, 2, 64), np.float32)
    with pytest.raises(TypeError, match=r"^softmax_scale must be a real number .*got a float64 numpy array of shape "
                                        r"\(1,\)$"):
        flashcpp.flash_attn_func(q, q, q, softmax_scale=np.array([0.1]))
    with pytest.raises(TypeError, match=r"^softcap must be a real number .*got np.complex128"):
        flashcpp.flash_attn_func(q, q, q, softcap=np.complex128(1))


# ---- 10. meta tensors anywhere in decode -------------------------------------------------------------

def test_meta_tensors_in_every_decode_argument_name_the_device():
    torch = _torch()

    def m(*s, dtype=torch.float32):
        return torch.empty(*s, device="meta", dtype=dtype)
    q, kc, vc = torch.randn(2, 1, 2, 64), torch.randn(2, 8, 2, 64), torch.randn(2, 8, 2, 64)
    kn, vn = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    plain, append = BatchDecodeWithKVCache(), BatchDecodeWithKVCache()
    plain.plan(2, 2, 2, 64, **_plan_args(dtype=torch.float32))
    append.plan(2, 2, 2, 64, **_plan_args(dtype=torch.float32, append=True))
    paged = BatchDecodeWithKVCache()
    paged.plan(2, 2, 2, 64, **_plan_args(dtype=torch.float32, page_size=4))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    pages = torch.randn(4, 4, 2, 64)
    fa = flashcpp.flash_attn_with_kvcache
    calls = {
        "q": [lambda: plain.run(m(2, 1, 2, 64), kc, vc, lens)],
        "k_cache": [lambda: plain.run(q, m(2, 8, 2, 64), m(2, 8, 2, 64), lens),
                    lambda: append.run(q, m(2, 8, 2, 64), m(2, 8, 2, 64), lens, k=kn, v=vn)],
        "v_cache": [lambda: plain.run(q, kc, m(2, 8, 2, 64), lens)],
        "cache_seqlens": [lambda: plain.run(q, kc, vc, m(2, dtype=torch.int32)),
                          lambda: fa(q, kc, vc, cache_seqlens=m(2, dtype=torch.int32)),
                          lambda: fa(q, kc, vc, kn, vn, cache_seqlens=m(2, dtype=torch.int32))],
        "block_table": [lambda: paged.run(q, pages, pages, lens, block_table=m(2, 2, dtype=torch.int32)),
                        lambda: fa(q, pages, pages, cache_seqlens=lens, block_table=m(2, 2, dtype=torch.int32))],
        "k": [lambda: append.run(q, kc, vc, lens, k=m(2, 1, 2, 64), v=m(2, 1, 2, 64)),
              lambda: fa(q, kc, vc, m(2, 1, 2, 64), m(2, 1, 2, 64), cache_seqlens=lens)],
        "alibi_slopes": [lambda: plain.run(q, kc, vc, lens, alibi_slopes=m(2)),
                         lambda: fa(q, kc, vc, cache_seqlens=lens, alibi_slopes=m(2))],
        "out": [lambda: plain.run(q, kc, vc, lens, out=m(2, 1, 2, 64))],
        "lse": [lambda: plain.run(q, kc, vc, lens, lse=m(2, 2, 1))],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=f"^{name} is on the meta device: flashcpp runs on CPU and CUDA "
                                                 r"tensors \(a meta tensor has no data to read\)$"):
                fn()
    assert table is not None  # (a real table runs)
    paged.run(q, pages, pages, lens, block_table=table)
    # meta caches beside a host q: the devices differ (not "k_cache and v_cache share memory")
    with pytest.raises(ValueError, match="must be on one device"):
        fa(q, m(2, 8, 2, 64), m(2, 8, 2, 64), kn, vn, cache_seqlens=lens)


def test_kvcache_flags_under_torch_compile():
    """The registered op's caller casts flags with bool() ('no' ran as True); torch.compile traces a
    numpy bool as a 0-dim ndarray, which check_flag takes there as the bool it is."""
    torch = _torch()
    q, kc, vc, lens = _kvcache_inputs(torch)
    for flag in (np.True_, "no"):
        torch._dynamo.reset()
        f = torch.compile(lambda q, kc, vc, lens: flashcpp.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, return_softmax_lse=flag, rotary_interleaved=flag), backend="eager")
        if flag == "no":
            with pytest.raises(TypeError, match="^rotary_interleaved must be True or False; got 'no'$"):
                f(q, kc, vc, lens)
        else:
            out, lse = f(q, kc, vc, lens)
            want, want_lse = flashcpp.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_softmax_lse=True)
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
    torch._dynamo.reset()
