"""Arguments that used to run as something else now get a sentence (CPU torch tensors).

- Index tensors (cu_seqlens, positions, cache lengths, block tables, plan indices) wider than int32
  wrapped into plausible indices, and float or bool ones were truncated: refused.
- An empty cos_sin_cache read as "no tables" (theta rotation): refused.
- Ops without a backward returned outputs with no grad_fn when an input required grad, so training
  silently lost their share of the gradient: a backward through them now raises; their in-place
  forms refuse under grad mode; what they write in place moves its version counter, so a backward
  that saved it before the write says so.
- A negative view (torch._neg_view) was read as its raw memory: refused.
- causal="False" ran causal attention, "0.3" was parsed as a scale, True as 1.0, None reached the
  fast path's binding and came back as a signature dump: each is a TypeError naming the argument.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashcpp  # noqa: E402
from flashcpp import BatchDecodeWithPagedKVCache  # noqa: E402

BIG = 2**32 + 12  # wraps to 12 in int32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashcpp.WITH_CUDA else [])


def _varlen(cu_q, cu_k=None):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 32, generator=g) for n, h in ((12, 4), (20, 2), (20, 2)))
    return flashcpp.flash_attn_varlen_func(q, k, v, cu_q, torch.tensor([0, 9, 20]) if cu_k is None else cu_k, 7, 11)


def test_wide_and_non_integer_index_tensors_are_refused():
    with pytest.raises(ValueError, match="cu_seqlens_q values must fit int32"):
        _varlen(torch.tensor([0, 5, BIG]))
    with pytest.raises(ValueError, match="cu_seqlens_k values must fit int32"):
        _varlen(torch.tensor([0, 5, 12]), torch.tensor([0, -BIG, 20]))
    for bad in (torch.tensor([False, True, True]), torch.tensor([0.0, 5.0, 12.0])):
        with pytest.raises(TypeError, match="cu_seqlens_q must hold integers"):
            _varlen(bad)
    want = _varlen(torch.tensor([0, 5, 12], dtype=torch.int32))
    assert torch.equal(_varlen(torch.tensor([0, 5, 12])), want)  # int64 in range: converted
    assert torch.equal(_varlen([0, 5, 12]), want)  # a list too

    x = torch.randn(4, 2, 64)
    with pytest.raises(ValueError, match="positions values must fit int32"):
        flashcpp.apply_rotary(x, None, torch.tensor([0, 2**32 + 1, 2, 3]))
    with pytest.raises(TypeError, match="positions must hold integers"):
        flashcpp.apply_rotary(x, None, torch.tensor([0.0, 1.5, 2.0, 3.0]))
    assert torch.equal(flashcpp.apply_rotary(x, None, torch.tensor([0, 1, 2, 3]))[0],
                       flashcpp.apply_rotary(x, None, torch.tensor([0, 1, 2, 3], dtype=torch.int32))[0])


def test_rope_append_kv_refuses_wide_lengths_and_pages_before_writing():
    k, v = torch.randn(2, 3, 2, 64), torch.randn(2, 3, 2, 64)
    kc, vc = torch.zeros(2, 10, 2, 64), torch.zeros(2, 10, 2, 64)
    with pytest.raises(ValueError, match="cache_seqlens values must fit int32"):
        flashcpp.rope_append_kv(k, v, kc, vc, torch.tensor([0, 2**32 + 4]))
    with pytest.raises(TypeError, match="cache_seqlens must hold integers"):
        flashcpp.rope_append_kv(k, v, kc, vc, torch.tensor([0, 4.7]))
    kp, vp = torch.zeros(6, 4, 2, 64), torch.zeros(6, 4, 2, 64)
    with pytest.raises(ValueError, match="block_table values must fit int32"):
        flashcpp.rope_append_kv(k, v, kp, vp, torch.tensor([0, 2], dtype=torch.int32),
                                block_table=torch.tensor([[0, 1], [2, 2**32 + 3]]))
    assert not kc.any() and not kp.any()  # nothing was written


def test_paged_plan_refuses_indptr_past_indices_and_wide_pages():
    w = BatchDecodeWithPagedKVCache(device="cpu")
    with pytest.raises(ValueError, match="indptr must index into indices"):
        w.plan(np.array([0, 3]), np.array([1]), np.array([8]), 4, 2, 64, 8, q_data_type=torch.float32)
    with pytest.raises(ValueError, match="indices values must fit int32"):
        w.plan(np.array([0, 2]), np.array([1, 2**32 + 1]), np.array([8]), 4, 2, 64, 8, q_data_type=torch.float32)


def test_an_empty_cos_sin_cache_is_not_no_tables():
    x = torch.randn(4, 2, 64)
    with pytest.raises(ValueError, match="cos_sin_cache has no rows"):
        flashcpp.apply_rotary(x, None, None, cos_sin_cache=torch.randn(0, 64))
    with pytest.raises(ValueError, match="cos_sin_cache has no rows"):
        flashcpp.qk_norm_rope(x, None, torch.ones(64), cos_sin_cache=torch.randn(0, 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "apply_rotary", "qk_norm_rope", "kvcache"])
def test_ops_without_a_backward_raise_in_backward_not_silently(op, device):
    g = torch.Generator().manual_seed(1)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(4, 2, 64, generator=g).to(device, dt).requires_grad_()
    w = torch.nn.Parameter(torch.ones(64, device=device, dtype=dt))
    kc, vc = (torch.randn(2, 8, 2, 64, generator=g).to(device, dt) for _ in range(2))
    run = {
        "rms_norm": lambda: flashcpp.rms_norm(x, w),
        "silu_and_mul": lambda: flashcpp.silu_and_mul(x),
        "apply_rotary": lambda: flashcpp.apply_rotary(x, None)[0],
        "qk_norm_rope": lambda: flashcpp.qk_norm_rope(x, None, w)[0],
        "kvcache": lambda: flashcpp.flash_attn_with_kvcache(
            x.view(2, 1, 4, 64), kc, vc, cache_seqlens=torch.tensor([3, 8], dtype=torch.int32, device=device)),
    }[op]
    out = run()
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(NotImplementedError, match="has no backward in flashcpp"):
        out.sum().backward()
    with torch.no_grad():  # inference: the same values, no graph
        again = run()
    assert not again.requires_grad and torch.equal(again, out.detach())


def test_in_place_forms_refuse_under_grad_mode():
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="fused_add_rms_norm writes its results in place"):
        flashcpp.fused_add_rms_norm(x, torch.randn(4, 64), torch.ones(64))
    with pytest.raises(NotImplementedError, match="fused_add_rms_norm"):  # a weight that requires grad
        flashcpp.fused_add_rms_norm(torch.randn(4, 64), torch.randn(4, 64), torch.nn.Parameter(torch.ones(64)))
    q = torch.randn(4, 2, 64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="apply_rotary with inplace=True"):
        flashcpp.apply_rotary(q, None, inplace=True)
    with pytest.raises(NotImplementedError, match="rms_norm with out="):
        flashcpp.rms_norm(x, torch.ones(64), out=torch.empty(4, 64))
    kc, vc = torch.zeros(2, 8, 2, 64), torch.zeros(2, 8, 2, 64)
    with pytest.raises(NotImplementedError, match="appends k and v into the cache in place"):
        flashcpp.flash_attn_with_kvcache(torch.randn(2, 1, 4, 64), kc, vc, q[:2, None, :, :].expand(2, 1, 2, 64),
                                         torch.randn(2, 1, 2, 64), cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="requires grad"):  # a target that requires grad, written in place
        flashcpp.rms_norm(torch.randn(4, 64), torch.ones(64), out=torch.empty(4, 64, requires_grad=True))
    with torch.no_grad():  # the in-place forms run there
        y = torch.randn(4, 64)
        out, res = flashcpp.fused_add_rms_norm(y, torch.randn(4, 64), torch.nn.Parameter(torch.ones(64)))
        assert out is y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("write", ["fused_add_rms_norm", "apply_rotary", "kvcache_append"])
def test_in_place_writes_move_the_version_counter(write, device):
    """A tensor saved by autograd and then written in place by flashcpp (its eager fast paths
    included): the backward says it was modified (it used to compute with the new values, silently)."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dt)
    a = rnd(2, 8, 2, 64).requires_grad_()
    target = rnd(2, 8, 2, 64)
    saved = (a * target).sum()  # saves target
    if write == "fused_add_rms_norm":
        flashcpp.fused_add_rms_norm(target.view(-1, 64), rnd(32, 64), torch.ones(64, device=device, dtype=dt))
    elif write == "apply_rotary":
        flashcpp.apply_rotary(target.view(16, 2, 64), None, inplace=True)
    else:
        flashcpp.flash_attn_with_kvcache(rnd(2, 1, 4, 64), target, rnd(2, 8, 2, 64), rnd(2, 1, 2, 64), rnd(2, 1, 2, 64),
                                         cache_seqlens=torch.tensor([1, 2], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_negative_views_are_refused_on_every_path():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, 2, 32, generator=g) for n in (5, 9, 9))
    neg = torch._neg_view(q)
    assert neg.is_neg()
    with pytest.raises(ValueError, match="negative view"):
        flashcpp.flash_attn_func(neg, k, v)  # the fast path steps aside, the general path refuses
    with pytest.raises(ValueError, match="negative view"):
        flashcpp.rms_norm(torch._neg_view(torch.randn(4, 64)), torch.ones(64))
    torch.testing.assert_close(flashcpp.flash_attn_func(neg.resolve_neg(), k, v), flashcpp.flash_attn_func(-q, k, v),
                               atol=0, rtol=0)


@pytest.mark.parametrize("kw,what", [(dict(causal="False"), "causal"), (dict(causal=None), "causal"),
                                     (dict(softcap=None), "softcap"), (dict(softcap="1"), "softcap"),
                                     (dict(softmax_scale="0.3"), "softmax_scale"),
                                     (dict(softmax_scale=True), "softmax_scale")])
def test_attention_arguments_are_what_they_say(kw, what):
    q, k, v = torch.randn(1, 5, 2, 32), torch.randn(1, 9, 2, 32), torch.randn(1, 9, 2, 32)
    with pytest.raises(TypeError, match=what):
        flashcpp.flash_attn_func(q, k, v, **kw)
    with pytest.raises(TypeError, match=what):
        flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], [0, 5], [0, 9], 5, 9, **kw)
    cache = dict(cache_seqlens=torch.tensor([9], dtype=torch.int32))
    if what != "softmax_scale":  # the decode plan's checks own the scale
        with pytest.raises(TypeError, match=what):
            flashcpp.flash_attn_with_kvcache(q[:, :1], k, v, **cache, **kw)
    # numbers of numpy and one-element tensors are numbers
    flashcpp.flash_attn_func(q, k, v, softmax_scale=np.float32(0.3), softcap=torch.tensor(2.0))


@pytest.mark.parametrize("kw,what", [(dict(eps=None), "eps"), (dict(eps="1e-6"), "eps"),
                                     (dict(cpu_threads=None), "cpu_threads")])
def test_norm_arguments_are_what_they_say(kw, what):
    with pytest.raises((TypeError, ValueError), match=what):  # cpu_threads: "must be an int in [0, 1024]"
        flashcpp.rms_norm(torch.randn(4, 64), torch.ones(64), **kw)


def test_meta_tensors_get_a_sentence():
    q = torch.empty(1, 5, 2, 32, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        flashcpp.flash_attn_func(q, q, q)


def test_merging_states_without_columns_still_merges_the_lse():
    """head_dim 0: the merged LSE came back as uninitialized memory."""
    want = [np.log(2.0), -np.inf, np.nan]
    a, b = np.array([0.0, -np.inf, np.nan], np.float32), np.array([0.0, -np.inf, 1.0], np.float32)
    _, lse = flashcpp.merge_attention_states(np.zeros((3, 0), np.float32), a, np.zeros((3, 0), np.float32), b)
    np.testing.assert_allclose(lse, want, rtol=1e-6)
    _, lse_t = flashcpp.merge_attention_states(torch.zeros(3, 0), torch.from_numpy(a), torch.zeros(3, 0), torch.from_numpy(b))
    np.testing.assert_allclose(lse_t.numpy(), want, rtol=1e-6)


def test_mask_functions_must_return_booleans_and_grids_must_fit():
    from flashcpp import masks
    for vectorized in (True, False):  # a mask_fn that forgets to return was dense (vectorized) or empty
        with pytest.raises(TypeError, match="must return"):
            masks.block_sparse_from_mask(lambda q, k: None, 4, 4, seqlen_q=8, seqlen_k=8, vectorized=vectorized)
        with pytest.raises(TypeError, match="must return"):
            masks.block_sparse_from_mask(lambda q, k: 0.5 * (k <= q), 4, 4, seqlen_q=8, seqlen_k=8, vectorized=vectorized)
    a = masks.block_sparse_from_mask(lambda q, k: k <= q, 4, 4, seqlen_q=8, seqlen_k=8)
    b = masks.block_sparse_from_mask(lambda q, k: k <= q, 4, 4, seqlen_q=8, seqlen_k=8, vectorized=False)
    assert np.array_equal(np.asarray(a.col_idx), np.asarray(b.col_idx))
    # sizes that used to hang, run out of memory or fail inside C++: a sentence up front
    for build in (lambda: masks.causal_block_sparse(2**31 - 1, 2**31 - 1, 64, 64),
                  lambda: masks.causal_block_sparse(2**31 - 1, 2**31 - 1, 1, 1),
                  lambda: masks.document_block_sparse([0, 2**31 - 1], [0, 2**31 - 1], 1, 1)):
        with pytest.raises(ValueError, match="block grid has"):
            build()
    with pytest.raises(ValueError, match="too large for a block's element mask"):
        masks.causal_block_sparse(128, 128, 2**31 - 1, 2**31 - 1)
    with pytest.raises(ValueError, match="evaluated on every element"):
        masks.block_sparse_from_mask(lambda q, k: k <= q, 1024, 1024, seqlen_q=2**20, seqlen_k=2**20)
