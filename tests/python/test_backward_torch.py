"""The attention backward through torch.autograd (issue 28), on CPU tensors: flash_attn_func and
flash_attn_varlen_func are differentiable with every mask (torch.library.register_autograd on the
forward ops, whose backward is the flashcpp::flash_attn_bwd / flash_attn_varlen_bwd op):

* gradcheck in float64 (the forward and the backward on the fp64 reference) on every mask kind;
* fp32 gradients (the tiled CPU backward) against torch autograd of a float64 reference written
  here with torch ops, and the LSE's gradient (dlse) the same way;
* deterministic=True is bitwise repeatable;
* torch.compile(fullgraph=True) of forward plus backward equals eager, and opcheck passes for the
  forward (with its autograd registration) and the backward ops;
* what has no backward says so: rotary, a forward run without its LSE, and CUDA (no kernel yet).

Tolerance of the fp32 comparisons: the tiled backward keeps fp32 throughout, so against float64
its error is fp32 rounding of sums over head_dim and the keys: 2e-5 absolute plus 1e-4 relative
covers it with a wide margin (tests/cpu/test_backward.cc and `flashcpp check --area backward`
hold the CPU backward to the issue's rule: 2x a plain same-dtype implementation plus a small atol).
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the autograd tests need torch")

import flashcpp  # noqa: E402
from flashcpp import _flashcpp as _C  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashcpp.WITH_CUDA


def ref_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    """attention.h in torch ops (any dtype; autograd-friendly): (out, lse), q (B, Nq, Hq, D)."""
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    ia = torch.arange(Nq)[:, None] + (Nk - Nq)
    j = torch.arange(Nk)[None, :]
    if alibi is not None:
        s = s + alibi.to(s.dtype).view(1, Hq, 1, 1) * (j - ia).to(s.dtype)
    visible = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        visible &= j <= ia
    if window[0] >= 0:
        visible &= j >= ia - window[0]
    if window[1] >= 0:
        visible &= j <= ia + window[1]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Nq)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see nothing: P = 0
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def leaves(rng, shape_q, shape_k, dtype, scale=1.0):
    mk = lambda s: torch.from_numpy(rng.standard_normal(s) * scale).to(dtype).requires_grad_()  # noqa: E731
    return mk(shape_q), mk(shape_k), mk(shape_k)


MASKS = [
    dict(),
    dict(causal=True),
    dict(window_size=(2, 1)),
    dict(causal=True, window_size=(3, 0), softcap=1.5),
    dict(causal=True, alibi_slopes=[0.5, 0.25]),
]


# gradcheck's full mode: every input element perturbed (its fast mode, random projections of the
# Jacobian, let a dq 1% off pass at these sizes: test_gradcheck_would_catch_a_wrong_gradient).
@pytest.mark.parametrize("kw", MASKS, ids=lambda kw: "-".join(kw) or "none")
def test_gradcheck_float64(rng, kw):
    q, k, v = leaves(rng, (1, 4, 2, 64), (1, 5, 1, 64), torch.float64)  # GQA 2/1
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = torch.tensor(kw["alibi_slopes"], dtype=torch.float32)
    assert torch.autograd.gradcheck(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, **kw), (q, k, v))


def test_gradcheck_float64_block_sparse_and_varlen(rng):
    q, k, v = leaves(rng, (1, 5, 1, 64), (1, 6, 1, 64), torch.float64)
    dense = rng.random((5, 6)) < 0.6
    bs = flashcpp.block_sparse_from_mask(dense, block_m=2, block_n=3).to("cpu")  # tensors once, not per call
    f = lambda q, k, v: flashcpp.flash_attn_func(q, k, v, block_sparse=bs)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    q, k, v = leaves(rng, (5, 1, 64), (6, 1, 64), torch.float64)
    f = lambda q, k, v: flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("kw", MASKS, ids=lambda kw: "-".join(kw) or "none")
def test_fp32_gradients_match_a_float64_reference(rng, kw):
    q, k, v = leaves(rng, (2, 33, 4, 64), (2, 40, 2, 64), torch.float32)
    kw = dict(kw)
    slopes = None
    if "alibi_slopes" in kw:
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
        kw["alibi_slopes"] = slopes
    dout = torch.from_numpy(rng.standard_normal((2, 33, 4, 64))).float()
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True, **kw)
    dlse = torch.from_numpy(rng.standard_normal(lse.shape)).float()
    torch.autograd.backward((out, lse), (dout, dlse))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ro, rl = ref_attention(q64, k64, v64, causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                           softcap=kw.get("softcap", 0.0), alibi=slopes)
    torch.autograd.backward((ro, rl), (dout.double(), dlse.double()))
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-5 + 1e-4 * want.abs().max().item(), (name, err)


def test_grad_without_return_lse_and_only_some_leaves(rng):
    q, k, v = leaves(rng, (1, 9, 2, 64), (1, 9, 2, 64), torch.float32)
    v.requires_grad_(False)
    flashcpp.flash_attn_func(q, k, v, causal=True).sum().backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref_attention(q64, k64, v.double(), causal=True)[0].sum().backward()
    assert (q.grad.double() - q64.grad).abs().max().item() < 1e-4
    assert (k.grad.double() - k64.grad).abs().max().item() < 1e-4
    assert v.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradients_are_close(rng, dtype):
    q, k, v = leaves(rng, (1, 40, 2, 64), (1, 40, 2, 64), dtype)
    flashcpp.flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_attention(q64, k64, v64, causal=True)[0].square().sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.dtype == dtype
        # o is stored in the dtype (the loss's gradient reads it) and the gradients are rounded: a few
        # units of the dtype's epsilon relative to the largest gradient.
        eps = torch.finfo(dtype).eps
        assert (got.double() - want).abs().max().item() <= 16 * eps * want.abs().max().item()


def test_varlen_gradients_match_per_sequence_reference(rng):
    lens_q, lens_k = [3, 0, 17], [5, 4, 20]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q, k, v = leaves(rng, (sum(lens_q), 2, 64), (sum(lens_k), 1, 64), torch.float32)
    out = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    dout = torch.from_numpy(rng.standard_normal(out.shape)).float()
    out.backward(dout)
    for b in range(3):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        q64, k64, v64 = (x.detach()[s].double()[None].requires_grad_() for x, s in ((q, sq), (k, sk), (v, sk)))
        ro, _ = ref_attention(q64, k64, v64, causal=True)
        ro.backward(dout[sq].double()[None])
        for got, want in ((q.grad[sq], q64.grad), (k.grad[sk], k64.grad), (v.grad[sk], v64.grad)):
            want = torch.zeros_like(got, dtype=torch.float64) if want is None else want[0]
            assert got.numel() == 0 or (got.double() - want).abs().max().item() < 1e-4, b  # sequence 1: dk = dv = 0


def test_deterministic_gradients_are_bitwise_repeatable(rng):
    base = leaves(rng, (1, 200, 4, 64), (1, 200, 1, 64), torch.float32)
    grads = []
    for _ in range(3):
        q, k, v = (x.detach().clone().requires_grad_() for x in base)
        flashcpp.flash_attn_func(q, k, v, causal=True, deterministic=True).square().sum().backward()
        grads.append(torch.cat([q.grad.flatten(), k.grad.flatten(), v.grad.flatten()]))
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


def test_compile_fullgraph_forward_and_backward(rng):
    def loss(q, k, v):
        out, lse = flashcpp.flash_attn_func(q, k, v, causal=True, window_size=(16, 0), return_lse=True)
        return out.square().sum() + lse.sum()

    base = leaves(rng, (2, 37, 4, 64), (2, 37, 2, 64), torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    res = []
    for fn in (loss, compiled):
        q, k, v = (x.detach().clone().requires_grad_() for x in base)
        value = fn(q, k, v)
        value.backward()
        res.append((value.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)

    cu = torch.tensor([0, 7, 30], dtype=torch.int32)

    def varlen_loss(q, k, v):
        return flashcpp.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(varlen_loss, fullgraph=True, backend="aot_eager")
    vbase = leaves(rng, (30, 2, 64), (30, 2, 64), torch.float32)
    res = []
    for fn in (varlen_loss, compiled):
        q, k, v = (x.detach().clone().requires_grad_() for x in vbase)
        fn(q, k, v).backward()
        res.append((q.grad, k.grad, v.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_opcheck_forward_autograd_and_backward_ops(rng):
    q, k, v = (t.detach() for t in leaves(rng, (1, 9, 4, 64), (1, 12, 2, 64), torch.float32))
    for req in (True, False):
        qq, kk, vv = (x.clone().requires_grad_(req) for x in (q, k, v))
        torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default,
                              (qq, kk, vv, 0.125, True, -1, -1, 0.0, None, True))
    out, lse = torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, True, -1, -1, 0.0, None, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_bwd.default,
                          (dout, q, k, v, out, lse, None, 0.125, True, -1, -1, 0.0, None, False))
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_bwd.default,
                          (dout, q, k, v, out, lse, torch.randn_like(lse), 0.125, False, 4, 2, 5.0, None, True))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    qv, kv, vv = (torch.randn(10, 2, 64) for _ in range(3))
    ov, lv = torch.ops.flashcpp.flash_attn_varlen_fwd(qv, kv, vv, cu, cu, 6, 6, 0.125, True, -1, -1, 0.0, None, True)
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_varlen_bwd.default,
                          (torch.randn_like(ov), qv, kv, vv, ov, lv, None, cu, cu, 6, 6, 0.125, True, -1, -1, 0.0,
                           None, False))
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_varlen_fwd.default,
                          (qv.requires_grad_(), kv, vv, cu, cu, 6, 6, 0.125, True, -1, -1, 0.0, None, True))


def test_what_has_no_backward_says_so(rng):
    q, k, v = leaves(rng, (1, 8, 2, 64), (1, 8, 2, 64), torch.float32)
    out = flashcpp.flash_attn_func(q, k, v, rotary=flashcpp.Rotary())
    with pytest.raises(NotImplementedError, match="rotary is not implemented"):
        out.sum().backward()
    out, _ = torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match="return_lse=False"):
        out.sum().backward()


def test_cuda_backward_is_chosen_or_refused_with_a_sentence():
    # The C++ answer on the CUDA backend (without touching a device: validation and selection only).
    q = np.zeros((1, 8, 2, 64), dtype=np.float16)
    p = _C.AttnBackwardParams()
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim = 1, 8, 8, 2, 2, 64
    bufs = [np.zeros_like(q) for _ in range(8)]
    lse = np.zeros((1, 2, 8), dtype=np.float32)
    for name, b in zip(("q", "k", "v", "o", "dout", "dq", "dk", "dv"), bufs):
        setattr(p, name, _C.TensorView(b.ctypes.data, _C.DTYPE_F16, 8 * 2 * 64, 2 * 64, 64))
    p.lse = lse.ctypes.data
    if HAS_CUDA:
        assert _C.attention_backward_workspace_size(p, _C.RunOptions("cuda")) > 0
        # Hopper runs the warp-specialized wgmma kernel, other devices (and cuda_config "sm80") the
        # mma.sync one.
        kernel, config = _C.select_backward_kernel(p, _C.RunOptions("cuda"))[:2]
        assert (kernel == "cuda_sm80_fa2" and config.startswith("bwd_m")) or \
            (kernel == "cuda_sm90_wgmma" and config.startswith("bwd_sm90ws_m")), (kernel, config)
        assert _C.select_backward_kernel(p, _C.RunOptions("cuda", 0, 0, "sm80"))[0] == "cuda_sm80_fa2"
        with pytest.raises(ValueError, match="cuda_config"):
            _C.select_backward_kernel(p, _C.RunOptions("cuda", 0, 0, "m64n64"))
    else:
        with pytest.raises(NotImplementedError, match="no usable CUDA device|no CUDA kernels|this build leaves out"):
            _C.attention_backward_workspace_size(p, _C.RunOptions("cuda"))
    assert _C.attention_backward_workspace_size(p, _C.RunOptions("cpu-reference")) == 0
    assert _C.attention_backward_workspace_size(p, _C.RunOptions("cpu")) > 0
    assert _C.select_backward_kernel(p, _C.RunOptions("cpu"))[0] == "cpu_tiled_online_softmax"


def _sdpa_grads(q, k, v, dout, causal):
    """Gradients of torch's SDPA in float64 (the reference) for (batch, seq, heads, dim) leaves."""
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kk, vv = k64.repeat_interleave(rep, dim=1), v64.repeat_interleave(rep, dim=1)
    n_q, n_k = q.shape[1], k.shape[1]
    mask = None
    if causal:  # bottom-right aligned, as flashcpp's causal
        i = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
        mask = torch.arange(n_k, device=q.device)[None, :] <= i
    o = torch.nn.functional.scaled_dot_product_attention(q64, kk, vv, attn_mask=mask)
    o.backward(dout.double().transpose(1, 2))
    return [t.grad.transpose(1, 2) for t in (q64, k64, v64)]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a FLASHCPP_CUDA=ON build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 127, 200, 4, 2, 64), (1, 300, 300, 2, 1, 128), (1, 70, 90, 2, 2, 256),
                                   (1, 50, 60, 2, 2, 96)])
def test_cuda_backward_matches_fp64(dtype, causal, shape):
    _check_cuda_grads(dtype, causal, shape)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a FLASHCPP_CUDA=ON build")
@pytest.mark.parametrize("config", ["sm80", "sm90", "sm90ws"])
def test_each_cuda_backward_kernel_through_the_env_knob(config, monkeypatch):
    # FLASHCPP_BWD_CONFIG sets the backward's cuda_config (docs/backward.md): each kernel matches fp64.
    if config != "sm80" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma kernels run on sm_90 devices")
    monkeypatch.setenv("FLASHCPP_BWD_CONFIG", config)
    _check_cuda_grads(torch.bfloat16, True, (1, 300, 300, 2, 1, 128))
    monkeypatch.setenv("FLASHCPP_BWD_CONFIG", "m64n64")  # a prefill config names no backward kernel
    q = torch.randn(1, 8, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="cuda_config"):
        flashcpp.flash_attn_func(q, q.detach(), q.detach()).sum().backward()


def _check_cuda_grads(dtype, causal, shape):
    """flash_attn_func's gradients on CUDA against SDPA's in float64, within the documented tolerance."""
    b, n_q, n_k, h_q, h_kv, d = shape
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, n_q, h_q, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(b, n_k, h_kv, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(b, n_k, h_kv, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    dout = torch.randn(b, n_q, h_q, d, device="cuda", dtype=dtype, generator=g)
    flashcpp.flash_attn_func(q, k, v, causal=causal).backward(dout)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3  # of max |ref| (docs/backward.md)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), _sdpa_grads(q, k, v, dout, causal)):
        assert torch.isfinite(got).all(), name
        err = (got.double() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item() + 1e-6, f"{name}: max err {err}, max |ref| {ref.abs().max().item()}"


def test_empty_sides_give_zero_gradients(rng):
    q, k, v = leaves(rng, (1, 5, 2, 64), (1, 0, 2, 64), torch.float32)
    flashcpp.flash_attn_func(q, k, v).sum().backward()
    assert torch.count_nonzero(q.grad) == 0
    q, k, v = leaves(rng, (1, 0, 2, 64), (1, 6, 2, 64), torch.float32)
    flashcpp.flash_attn_func(q, k, v).sum().backward()
    assert torch.count_nonzero(k.grad) == 0 and torch.count_nonzero(v.grad) == 0


def test_gradcheck_would_catch_a_wrong_gradient(rng, monkeypatch):
    # The gradcheck above is not vacuous: a backward that is 1% off in dq fails it (full mode; the
    # fast mode passed this at these sizes).
    from flashcpp import _torch_ops

    real = _torch_ops._execute_backward

    def off_by_one_percent(p, out, lse, dout, dlse, dq, dk, dv, **kw):
        real(p, out, lse, dout, dlse, dq, dk, dv, **kw)
        dq.mul_(1.01)

    monkeypatch.setattr(_torch_ops, "_execute_backward", off_by_one_percent)
    q, k, v = leaves(rng, (1, 5, 2, 64), (1, 6, 1, 64), torch.float64)
    f = lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    assert not torch.autograd.gradcheck(f, (q, k, v), raise_exception=False)


# ---- the eager autograd formulas (_torch_ops.EagerAttention, EagerVarlenAttention) ------------------
# Eager calls that autograd records skip the registered op's autograd wrapper (hundreds of us of host
# time per call). They must give what the op gives, bit for bit, and behave as it does around autograd.

def _op_grads(q, k, v, dout, dlse, *args, deterministic=False):
    out, lse = torch.ops.flashcpp.flash_attn_fwd(q, k, v, *args, deterministic=deterministic)
    return (out, lse) + torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))


@pytest.mark.parametrize("kw", MASKS, ids=lambda kw: "-".join(kw) or "none")
def test_eager_formula_equals_the_op_bit_for_bit(rng, kw):
    q, k, v = leaves(rng, (2, 7, 2, 64), (2, 9, 1, 64), torch.float32)  # GQA 2/1 (MASKS' ALiBi has 2 heads)
    dout = torch.from_numpy(rng.standard_normal((2, 7, 2, 64))).float()
    dlse = torch.from_numpy(rng.standard_normal((2, 2, 7))).float()
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True, deterministic=True, **kw)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"  # the eager formula ran
    got = (out, lse) + torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    alibi = kw.get("alibi_slopes")
    wl, wr = kw.get("window_size", (-1, -1))
    want = _op_grads(q, k, v, dout, dlse, 0.125, kw.get("causal", False), wl, wr, kw.get("softcap", 0.0),
                     None if alibi is None else torch.tensor(alibi, dtype=torch.float32), True, deterministic=True)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_eager_formula_block_sparse_and_varlen_equal_the_ops(rng):
    q, k, v = leaves(rng, (1, 256, 2, 64), (1, 256, 2, 64), torch.float32)
    bs = flashcpp.causal_block_sparse(256, 256, 64, 64)
    # deterministic: the CPU backward's threads otherwise sum dq in the order they finish
    out = flashcpp.flash_attn_func(q, k, v, block_sparse=bs, deterministic=True)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    dout = torch.from_numpy(rng.standard_normal(out.shape)).float()
    got = torch.autograd.grad(out, (q, k, v), dout)
    want_out, _ = torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, True,
                                                    *flashcpp._core.sparse_to_args(
                                                        flashcpp._attn._sparse_for(bs, flashcpp._core.meta(q, "q"))),
                                                    deterministic=True)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want))

    q, k, v = leaves(rng, (13, 4, 64), (17, 2, 64), torch.float32)
    cu_q, cu_k = torch.tensor([0, 6, 13], dtype=torch.int32), torch.tensor([0, 9, 17], dtype=torch.int32)
    out = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True, deterministic=True)
    assert type(out.grad_fn).__name__ == "EagerVarlenAttentionBackward"
    dout = torch.from_numpy(rng.standard_normal(out.shape)).float()
    got = torch.autograd.grad(out, (q, k, v), dout)
    want_out, _ = torch.ops.flashcpp.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, 7, 9, 0.125, True, -1, -1, 0.0,
                                                           None, True, deterministic=True)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_eager_formula_refuses_a_double_backward_and_a_changed_input(rng):
    for varlen in (False, True):
        if varlen:
            q, k, v = leaves(rng, (5, 2, 64), (6, 2, 64), torch.float32)
            cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
            f = lambda: flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)  # noqa: E731
        else:
            q, k, v = leaves(rng, (1, 5, 2, 64), (1, 6, 2, 64), torch.float32)
            f = lambda: flashcpp.flash_attn_func(q, k, v, causal=True)  # noqa: E731
        dq, dk = torch.autograd.grad(f().sum(), (q, k), create_graph=True)
        assert dq.requires_grad  # a gradient penalty through dq fails instead of dropping its term
        with pytest.raises(RuntimeError, match="has no backward of its own"):
            (dq.square().sum() + dk.sum()).backward()
        out = f()
        with torch.no_grad():
            k.add_(1.0)  # a saved input changed before the backward: torch's version check says so
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
