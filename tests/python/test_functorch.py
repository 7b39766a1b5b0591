"""torch.func transforms and forward-mode AD on flashcpp's entry points (CPU tensors).

torch.func.vmap over flash_attn_func / flash_attn_varlen_func runs the ops' batching rules (dense:
the vmapped dim folded into the batch, one call; varlen, and dense calls with rotary or a
block-sparse mask: one call per entry) and equals a loop bit for bit, without torch's fallback. Forward mode (torch.func.jvp, jacfwd,
torch.autograd.forward_ad) would get a zero or no tangent from any custom op, silently; and
torch.func.grad / vjp raise about an autograd.Function the caller never wrote. Both are refused
with a sentence that names reverse mode. Entry points without a registered op (attention,
flash_attn_with_kvcache) refuse vmap too.
"""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as fwAD  # noqa: E402

import flashcpp  # noqa: E402
from flashcpp.decode import flash_attn_with_kvcache  # noqa: E402


def _qkv(seed, b=1, s=37, h=2, d=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


def test_vmap_equals_a_loop():
    q, k, v = _qkv(1)
    qs = torch.stack([q, 2 * q, -q])
    got = torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v, causal=True))(qs)
    want = torch.stack([flashcpp.flash_attn_func(x, k, v, causal=True) for x in qs])
    assert torch.equal(got, want)
    # over k and v too, with the LSE
    ks, vs = torch.stack([k, k.flip(1)]), torch.stack([v, v * 0.5])
    out, lse = torch.func.vmap(lambda a, b: flashcpp.flash_attn_func(q, a, b, return_lse=True))(ks, vs)
    for i in range(2):
        o_i, l_i = flashcpp.flash_attn_func(q, ks[i], vs[i], return_lse=True)
        assert torch.equal(out[i], o_i) and torch.equal(lse[i], l_i)


def test_vmap_of_varlen_equals_a_loop():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(30, 2, 64, generator=g) for _ in range(3))
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    qs = torch.stack([q, q * 3])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = torch.func.vmap(lambda x: flashcpp.flash_attn_varlen_func(x, k, v, cu, cu, 19, 19, causal=True))(qs)
    assert _no_fallback_warning(record)
    want = torch.stack([flashcpp.flash_attn_varlen_func(x, k, v, cu, cu, 19, 19, causal=True) for x in qs])
    assert torch.equal(got, want)


def _no_fallback_warning(record):
    return not [w for w in record if "performance drop" in str(w.message)]


@pytest.mark.parametrize("fold", ["heads", "batch"])
@pytest.mark.parametrize("lse", [False, True])
@pytest.mark.parametrize("slopes", [None, "heads", "batch", "vmapped_heads", "vmapped_batch"])
def test_vmap_folds_into_the_batch_and_equals_a_loop(slopes, lse, fold):
    # batch 2, GQA 4/2, odd length; q vmapped at dim 1. fold "heads": k and v shared by the entries
    # (folded into q's heads, K and V read as they are); "batch": k vmapped too (folded into the
    # batch, v copied per entry)
    g = torch.Generator().manual_seed(21)
    B, S, Hq, Hkv, D, n = 2, 23, 4, 2, 16, 3
    qs = torch.randn(B, n, S, Hq, D, generator=g)
    ks = torch.randn(n, B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, 24, generator=g)
    al = {None: None, "heads": torch.rand(Hq, generator=g), "batch": torch.rand(B, Hq, generator=g),
          "vmapped_heads": torch.rand(n, Hq, generator=g), "vmapped_batch": torch.rand(n, B, Hq, generator=g)}[slopes]
    vm_al = slopes is not None and slopes.startswith("vmapped")

    def f(x, kk, a):
        return flashcpp.flash_attn_func(x, kk, v, causal=True, alibi_slopes=a, return_lse=lse)

    k_dim = 0 if fold == "batch" else None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = torch.func.vmap(f, in_dims=(1, k_dim, 0 if vm_al else None))(qs, ks if k_dim == 0 else ks[0], al)
    assert _no_fallback_warning(record)
    for i in range(n):
        want = f(qs[:, i], ks[i] if k_dim == 0 else ks[0], al[i] if vm_al else al)
        if lse:
            assert torch.equal(got[0][i], want[0]) and torch.equal(got[1][i], want[1])
        else:
            assert torch.equal(got[i], want)


def test_vmap_with_rotary_or_block_sparse_runs_entry_by_entry():
    q, k, v = _qkv(22, b=2, s=20, d=16)
    qs = torch.stack([q, 0.5 * q])
    rot = flashcpp.Rotary(theta=500.0)
    got = torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v, causal=True, rotary=rot))(qs)
    assert torch.equal(got, torch.stack([flashcpp.flash_attn_func(x, k, v, causal=True, rotary=rot) for x in qs]))


@pytest.mark.parametrize("vmapped", ["q", "kv"])
def test_backward_through_vmap_equals_a_loop(vmapped):
    # A vmapped tensor's requires_grad reads False inside the transform, yet autograd records the
    # folded call: the LSE is kept so that backward() works, and the gradients are the loop's.
    g = torch.Generator().manual_seed(23)
    n, B, S, H, D = 3, 2, 9, 2, 16
    qs = torch.randn(n, B, S, H, D, generator=g)
    k, v = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    ks, vs = torch.stack([k, 2 * k, -k]), torch.stack([v, v, 0.5 * v])
    dout = torch.randn(n, B, S, H, D, generator=g)
    if vmapped == "q":
        a, b = qs.clone().requires_grad_(), k.clone().requires_grad_()
        out = torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, b, v, causal=True))(a)
        (out * dout).sum().backward()
        a2, b2 = qs.clone().requires_grad_(), k.clone().requires_grad_()
        loop = torch.stack([flashcpp.flash_attn_func(a2[i], b2, v, causal=True) for i in range(n)])
        (loop * dout).sum().backward()
        assert torch.equal(out, loop) and torch.equal(a.grad, a2.grad)
        torch.testing.assert_close(b.grad, b2.grad)  # summed over the entries in another order
    else:
        a, b = ks.clone().requires_grad_(), vs.clone().requires_grad_()
        out = torch.func.vmap(lambda x, y: flashcpp.flash_attn_func(qs[0], x, y, deterministic=True))(a, b)
        (out * dout).sum().backward()
        a2, b2 = ks.clone().requires_grad_(), vs.clone().requires_grad_()
        loop = torch.stack([flashcpp.flash_attn_func(qs[0], a2[i], b2[i], deterministic=True) for i in range(n)])
        (loop * dout).sum().backward()
        assert torch.equal(out, loop) and torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)
    # varlen, entry by entry
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    x = qs[:, 0].reshape(n, S, H * D).reshape(n, S, H, D).clone().requires_grad_()
    out = torch.func.vmap(lambda t: flashcpp.flash_attn_varlen_func(t, k[0], v[0], cu, cu, 5, 5, causal=True))(x)
    out.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.stack([flashcpp.flash_attn_varlen_func(x2[i], k[0], v[0], cu, cu, 5, 5, causal=True) for i in range(n)]).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_vmap_with_a_block_sparse_mask_runs_entry_by_entry():
    q, k, v = _qkv(24, b=2, s=8, d=16)
    bs = flashcpp.causal_block_sparse(8, 8, 4, 4)
    qs = torch.stack([q, 2 * q, -q])
    got = torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v, block_sparse=bs))(qs)
    assert torch.equal(got, torch.stack([flashcpp.flash_attn_func(x, k, v, block_sparse=bs) for x in qs]))


def test_vmap_edge_cases_get_results_or_sentences():
    q, k, v = _qkv(25, b=2, s=7, d=16)
    # an empty vmapped dimension: empty outputs from the folded call
    got = torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v))(q[None][:0])
    assert got.shape == (0,) + q.shape
    # ... and a sentence where the call runs entry by entry
    with pytest.raises(ValueError, match="over an empty dimension"):
        torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v, rotary=flashcpp.Rotary()))(q[None][:0])
    # Rotary(k_out=...) would write every entry's keys into one buffer
    with pytest.raises(NotImplementedError, match="k_out.*does not run under torch.func.vmap"):
        torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v, rotary=flashcpp.Rotary(k_out=torch.empty_like(k))))(
            torch.stack([q, q]))
    # a bad shape is named as the caller wrote it, not as the folded call saw it
    with pytest.raises(ValueError) as plain:
        flashcpp.flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(ValueError) as vm:
        torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k[:1], v[:1]))(torch.stack([q, q, q]))
    assert str(vm.value) == str(plain.value)
    with pytest.raises(ValueError) as plain:
        flashcpp.flash_attn_func(q, k, v, alibi_slopes=torch.tensor(0.5))
    with pytest.raises(ValueError) as vm:  # per-entry 0-dim slopes
        torch.func.vmap(lambda x, s: flashcpp.flash_attn_func(x, k, v, alibi_slopes=s))(torch.stack([q, q]),
                                                                                           torch.rand(2))
    assert str(vm.value) == str(plain.value)


def test_vmap_of_varlen_takes_vmapped_int64_cu_seqlens():
    # int64 lengths are checked against int32's range before the conversion; under vmap that check
    # reads the tensor the vmapped one wraps (.item() through the wrapper raises)
    g = torch.Generator().manual_seed(26)
    q, k, v = (torch.randn(12, 2, 16, generator=g) for _ in range(3))
    cus = torch.tensor([[0, 5, 12], [0, 7, 12]])
    got = torch.func.vmap(lambda c: flashcpp.flash_attn_varlen_func(q, k, v, c, c, 7, 7, causal=True))(cus)
    want = torch.stack([flashcpp.flash_attn_varlen_func(q, k, v, c, c, 7, 7, causal=True) for c in cus])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="must fit int32"):
        torch.func.vmap(lambda c: flashcpp.flash_attn_varlen_func(q, k, v, c, c, 7, 7))(
            torch.tensor([[0, 5, 12], [0, 7, 2**40]]))


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_is_refused(transform):
    q, k, v = _qkv(3, s=5, d=8)
    f = lambda x: flashcpp.flash_attn_func(x, k, v)  # noqa: E731
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        if transform == "jvp":
            torch.func.jvp(f, (q,), (torch.ones_like(q),))
        else:
            torch.func.jacfwd(f)(q)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: flashcpp.flash_attn_varlen_func(x[0], k[0], v[0], *[torch.tensor([0, 5], dtype=torch.int32)] * 2, 5, 5),
                       (q,), (q,))


def test_forward_ad_dual_is_refused_and_plain_calls_still_run():
    q, k, v = _qkv(4)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flashcpp.flash_attn_func(fwAD.make_dual(q, torch.ones_like(q)), k, v)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flashcpp.flash_attn_func(q, k, fwAD.make_dual(v, torch.ones_like(v)))
        out = flashcpp.flash_attn_func(q, k, v)  # no tangent anywhere: the call runs
    assert torch.equal(out, flashcpp.flash_attn_func(q, k, v))


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_functorch_reverse_mode_is_refused_with_the_way_that_works(transform):
    q, k, v = _qkv(5, s=6, d=8)
    f = lambda x: flashcpp.flash_attn_func(x, k, v)  # noqa: E731
    with pytest.raises(NotImplementedError, match="loss.backward"):
        if transform == "grad":
            torch.func.grad(lambda x: f(x).sum())(q)
        elif transform == "vjp":
            torch.func.vjp(f, q)
        else:
            torch.func.jacrev(f)(q)
    # the way that works: torch.autograd
    x = q.clone().requires_grad_()
    f(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_entry_points_without_an_op_refuse_vmap():
    q, k, v = _qkv(6, s=8)
    with pytest.raises(NotImplementedError, match="does not run under torch.func.vmap"):
        torch.func.vmap(lambda x: flashcpp.attention(x, k, v)[0])(torch.stack([q, q]))
    kc, vc = torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64)
    lens = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="does not run under torch.func.vmap"):
        torch.func.vmap(lambda x: flash_attn_with_kvcache(x, kc, vc, cache_seqlens=lens))(torch.stack([q[:, :1]] * 2))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flash_attn_with_kvcache(fwAD.make_dual(q[:, :1], torch.ones_like(q[:, :1])), kc, vc, cache_seqlens=lens)
    assert np.isfinite(flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens).numpy()).all()


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "qk_norm_rope"])
def test_fused_ops_refuse_vmap_and_forward_mode(op):
    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(2, 4, 64, generator=g), torch.randn(2, 4, 64, generator=g)
    w = torch.randn(64, generator=g)
    pos = torch.arange(4, dtype=torch.int32)
    calls = {
        "rms_norm": lambda a: flashcpp.rms_norm(a, w),
        "fused_add_rms_norm": lambda a: flashcpp.fused_add_rms_norm(a, r[0].clone(), w, out=torch.empty_like(a),
                                                                      residual_out=torch.empty_like(a))[0],
        "silu_and_mul": lambda a: flashcpp.silu_and_mul(a),
        "apply_rotary": lambda a: flashcpp.apply_rotary(a[:, None], None, pos)[0],
        "qk_norm_rope": lambda a: flashcpp.qk_norm_rope(a[:, None], a[:, None].clone(), w, w, pos)[0],
    }
    f = calls[op]
    with pytest.raises(NotImplementedError, match="does not run under torch.func.vmap"):
        torch.func.vmap(f)(x)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):  # jacfwd is forward mode, whatever vmaps it
        torch.func.jacfwd(f)(x[0])
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            f(fwAD.make_dual(x[0], torch.ones_like(x[0])))
    assert torch.isfinite(f(x[0])).all()  # and the plain call runs


def test_constants_inside_a_transform_run():
    # Calls whose arguments the transform did not wrap (captured constants) run inside it, also on
    # the entry points that refuse a transformed argument; only the transformed ones are refused.
    q, k, v = _qkv(8, s=6, d=16)
    q1, lens, w16 = q[:, :1].contiguous(), torch.tensor([6], dtype=torch.int32), torch.ones(16)
    x = torch.ones(3)
    for name, c in [("flash_attn_func", lambda: flashcpp.flash_attn_func(q, k, v).sum()),
                    ("attention", lambda: flashcpp.attention(q, k, v)[0].sum()),
                    ("rms_norm", lambda: flashcpp.rms_norm(q, w16).sum()),
                    ("kvcache", lambda: flash_attn_with_kvcache(q1, k, v, cache_seqlens=lens).sum())]:
        want = c()
        assert torch.equal(torch.func.grad(lambda a: (a * c()).sum())(x), want.expand(3)), name
        assert torch.equal(torch.func.jvp(lambda a: a * c(), (x,), (x,))[1], want.expand(3)), name
        assert torch.equal(torch.func.vmap(lambda a: a * c())(x), want.expand(3)), name


def test_every_tensor_argument_counts_for_forward_mode():
    q, k, v = _qkv(9, s=6, d=16)
    al = torch.rand(2)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flashcpp.flash_attn_func(q, k, v, alibi_slopes=fwAD.make_dual(al, torch.ones_like(al)), causal=True)
        cache = torch.randn(8, 16)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flashcpp.apply_rotary(q[0], None, torch.arange(6, dtype=torch.int32),
                                  cos_sin_cache=fwAD.make_dual(cache, torch.ones_like(cache)))


def test_vmap_inside_torch_compile_fullgraph():
    q, k, v = _qkv(10, s=6, d=16)
    qs = torch.stack([q, 2 * q])
    f = torch.compile(lambda a: torch.func.vmap(lambda x: flashcpp.flash_attn_func(x, k, v, causal=True))(a),
                      fullgraph=True, backend="eager")
    assert torch.equal(f(qs), torch.stack([flashcpp.flash_attn_func(x, k, v, causal=True) for x in qs]))


def test_plan_run_has_no_backward_and_no_vmap():
    from flashcpp.decode import BatchDecodeWithKVCache
    q, k, v = _qkv(11, s=6, d=16)
    q1, lens = q[:, :1].contiguous(), torch.tensor([6], dtype=torch.int32)
    w = BatchDecodeWithKVCache()
    w.plan(1, 2, 2, 16, kv_capacity=6, dtype="float32", device="cpu")
    qq = q1.clone().requires_grad_()
    out = w.run(qq, k, v, lens)
    assert out.requires_grad  # it stays in the graph (it used to detach: a silently missing gradient)
    with pytest.raises(NotImplementedError, match="no backward"):
        out.sum().backward()
    with torch.no_grad():
        assert torch.equal(w.run(qq, k, v, lens), out.detach())
    with pytest.raises(NotImplementedError, match="does not run under torch.func.vmap"):
        torch.func.vmap(lambda x: w.run(x, k, v, lens))(torch.stack([q1, q1]))


def test_merge_attention_states_vmaps_and_refuses_forward_mode():
    g = torch.Generator().manual_seed(12)
    va, vb = torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    sa, sb = torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = torch.func.vmap(lambda x: flashcpp.merge_attention_states(x, sa, vb, sb)[0])(torch.stack([va, 2 * va]))
        # the LSEs vmapped at dim 1, the values not
        sas = torch.stack([sa, sa - 1], dim=1)
        o2, s2 = torch.func.vmap(lambda a: flashcpp.merge_attention_states(va, a, vb, sb), in_dims=1)(sas)
    assert _no_fallback_warning(record)
    assert torch.equal(got[1], flashcpp.merge_attention_states(2 * va, sa, vb, sb)[0])
    for i in range(2):
        oi, si = flashcpp.merge_attention_states(va, sas[:, i], vb, sb)
        assert torch.equal(o2[i], oi) and torch.equal(s2[i], si)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: flashcpp.merge_attention_states(x, sa, vb, sb)[0], (va,), (torch.ones_like(va),))
