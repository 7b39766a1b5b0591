"""Every head dim through the package (the C++ rule of cc93ae7, include/flashcpp/attention.h): q and
k share head_dim, v has its own, head_dim_v, each any multiple of 8 in [8, 256]; the output (and dv
in the backward) takes v's head dim, dq and dk keep head_dim. On the CPU backends here:

* every multiple of 8 from 8 to 256 through flash_attn_func (numpy and torch), as head_dim and as
  head_dim_v, against the fp64 reference of attn_reference.py;
* the pairs (head_dim, head_dim_v) = (192, 128), (128, 64), (64, 128), (96, 80) through
  flash_attn_func, attention(out=), flash_attn_varlen_func, flash_attn_with_kvcache (contiguous
  with append, paged), BatchDecodeWithKVCache (split) and BatchDecodeWithPagedKVCache;
* the backward: float64 gradients against torch autograd of a float64 reference, fp32 gradients of
  the tiled backward, torch.autograd.gradcheck (fast mode on the pairs, full mode on small pairs:
  a full-mode check perturbs every input element, seconds at head dim 192), torch.compile of
  forward plus backward, opcheck of the backward op, and the fakes' shapes (torch.compile and
  opcheck of the forward ops: HEAD_DIM_V_CASES in test_torch_compile_matrix.py);
* refusals: a head dim outside the rule is a ValueError with the C++ sentence (also for an empty
  problem, which never reaches C++), k and v that differ elsewhere than the last dim, and the CUDA
  backend's answer for what its kernels are not built for (NotImplementedError, from C++).

numpy tests run everywhere; the torch ones skip without torch.
"""
import numpy as np
import pytest

import flashcpp
from attn_reference import attention_ref, tolerance, varlen_ref
from flashcpp import _flashcpp as _C

try:
    import torch
except ImportError:  # pragma: no cover - CI without torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
PAIRS = [(192, 128), (128, 64), (64, 128), (96, 80)]
ALL_DIMS = list(range(8, 257, 8))
RULE = r"is not supported \(it must be a multiple of 8 in \[8, 256\]\)"


def arrays(rng, shapes, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def close(got, want, atol):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    assert np.abs(got[finite] - want[finite]).max(initial=0.0) <= atol


def test_the_exported_sets():
    assert tuple(flashcpp.SUPPORTED_HEAD_DIMS) == tuple(ALL_DIMS)
    assert tuple(flashcpp.CUDA_HEAD_DIMS) == (64, 128, 256)
    assert "CUDA_HEAD_DIMS" in flashcpp.__all__ and "SUPPORTED_HEAD_DIMS" in flashcpp.__all__


# ---- forward, numpy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("d", ALL_DIMS)
def test_every_head_dim_matches_fp64(rng, d):
    # d as head_dim with v alike, and as both sides of a mixed pair (d, 264 - d): every dim is also a head_dim_v
    q, k, v, w = arrays(rng, [(1, 5, 2, d), (1, 7, 1, d), (1, 7, 1, d), (1, 7, 1, 264 - d)])
    for vv in (v, w):
        out, lse = flashcpp.flash_attn_func(q, k, vv, causal=True, return_lse=True)
        ro, rl = attention_ref(q, k, vv, causal=True)
        assert out.shape == (1, 5, 2, vv.shape[-1])
        close(out, ro, tolerance(np.float32))
        close(lse, rl, tolerance(np.float32))


@pytest.mark.parametrize("d,dv", PAIRS)
def test_pairs_flash_attn_func_and_attention_out(rng, d, dv):
    q, k, v = arrays(rng, [(2, 9, 4, d), (2, 13, 2, d), (2, 13, 2, dv)])
    kw = dict(causal=True, window_size=(6, 1), softcap=3.0)
    ro, rl = attention_ref(q, k, v, causal=True, window=(6, 1), softcap=3.0)
    for dtype in (np.float32, np.float16):
        out, lse = flashcpp.flash_attn_func(q.astype(dtype), k.astype(dtype), v.astype(dtype), return_lse=True, **kw)
        assert out.dtype == dtype and out.shape == (2, 9, 4, dv)
        close(out, ro, 2 * tolerance(dtype) if dtype == np.float16 else tolerance(dtype))
        close(lse, rl, 1e-2 if dtype == np.float16 else 2e-5)
    # SDPA's (B, H, N, D) layout, strided through a transpose; caller-owned out with v's head dim
    qs, ks, vs = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    out = np.empty((2, 4, 9, dv), np.float32).transpose(0, 2, 1, 3)
    res, _ = flashcpp.attention(qs, ks, vs, out=out, **kw)
    assert res is out
    close(out, ro, tolerance(np.float32))
    with pytest.raises(ValueError, match=rf"out must have shape \(2, 9, 4, {dv}\)"):
        flashcpp.attention(q, k, v, out=np.empty((2, 9, 4, d + 8), np.float32))
    assert flashcpp.select_kernel(q, k, v).kernel == "cpu_tiled_online_softmax"


@pytest.mark.parametrize("d,dv", PAIRS)
def test_pairs_varlen(rng, d, dv):
    lens_q, lens_k = [3, 0, 11], [5, 4, 14]
    cu_q, cu_k = np.cumsum([0] + lens_q).astype(np.int32), np.cumsum([0] + lens_k).astype(np.int32)
    q, k, v = arrays(rng, [(sum(lens_q) + 2, 4, d), (sum(lens_k), 1, d), (sum(lens_k), 1, dv)])  # 2 rows past the end
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 14, causal=True, return_lse=True)
    ro, rl = varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (sum(lens_q) + 2, 4, dv)
    close(out, ro, tolerance(np.float32))
    close(lse, rl, 2e-5)
    if torch is not None:
        t = [torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k)]
        tout, tlse = flashcpp.flash_attn_varlen_func(*t, 11, 14, causal=True, return_lse=True)
        assert torch.equal(tout, torch.from_numpy(out)) and torch.equal(tlse, torch.from_numpy(lse))


# ---- decode -------------------------------------------------------------------------------------------

def _cache(rng, B, slots, hkv, d, dv, lens):
    k = np.full((B, slots, hkv, d), np.nan, np.float32)  # NaN past the lengths: never read
    v = np.full((B, slots, hkv, dv), np.nan, np.float32)
    for b, n in enumerate(lens):
        k[b, :n], v[b, :n] = rng.standard_normal((n, hkv, d)), rng.standard_normal((n, hkv, dv))
    return k, v


@pytest.mark.parametrize("d,dv", PAIRS)
def test_pairs_kvcache_append_and_paged(rng, d, dv):
    B, S, Hq, Hkv, Sq = 2, 32, 4, 2, 2
    lens = np.array([5, 27], np.int32)
    kc, vc = _cache(rng, B, S, Hkv, d, dv, lens)
    q, kn, vn = arrays(rng, [(B, Sq, Hq, d), (B, Sq, Hkv, d), (B, Sq, Hkv, dv)])
    k0, v0 = kc.copy(), vc.copy()
    out, lse = flashcpp.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True,
                                                return_softmax_lse=True)
    assert out.shape == (B, Sq, Hq, dv)
    for b, n in enumerate(lens):
        assert np.array_equal(vc[b, n:n + Sq], vn[b]) and np.array_equal(kc[b, n:n + Sq], kn[b])  # appended
        kk, vv = np.concatenate([k0[b, :n], kn[b]]), np.concatenate([v0[b, :n], vn[b]])
        ro, rl = attention_ref(q[b:b + 1], kk[None], vv[None], causal=True)
        close(out[b], ro[0], tolerance(np.float32))
        close(lse[b], rl[0], 2e-5)
    # the same step on a paged cache (torch tensors when torch is here: the op's body), reading the cache as appended
    page, pps = 8, S // 8
    table = rng.permutation(B * pps).astype(np.int32).reshape(B, pps)
    kp, vp = np.empty((B * pps, page, Hkv, d), np.float32), np.empty((B * pps, page, Hkv, dv), np.float32)
    for b in range(B):
        for j in range(pps):
            kp[table[b, j]], vp[table[b, j]] = kc[b, j * page:(j + 1) * page], vc[b, j * page:(j + 1) * page]
    args = (q, kp, vp)
    if torch is not None:
        args, table = tuple(torch.from_numpy(x) for x in args), torch.from_numpy(table)
    paged = flashcpp.flash_attn_with_kvcache(*args, cache_seqlens=lens + Sq, block_table=table, causal=True)
    close(np.asarray(paged), out.astype(np.float64), 1e-6)


@pytest.mark.parametrize("d,dv", [(192, 128), (96, 80)])
def test_plan_run_wrappers_with_head_dim_v(rng, d, dv):
    from flashcpp.decode import BatchDecodeWithKVCache
    B, S, Hq, Hkv = 2, 300, 4, 1
    lens = [300, 170]
    kc, vc = _cache(rng, B, S, Hkv, d, dv, lens)
    (q,) = arrays(rng, [(B, 1, Hq, d)])
    w = BatchDecodeWithKVCache()
    plan = w.plan(B, Hq, Hkv, d, head_dim_v=dv, kv_capacity=S, cache_seqlens=lens, dtype="float32", device="cpu",
                  num_splits=3)
    assert (plan.head_dim, plan.head_dim_v) == (d, dv) and plan.needs_merge  # split partials at head_dim_v
    out = np.empty((B, 1, Hq, dv), np.float32)
    assert w.run(q, kc, vc, np.array(lens, np.int32), out=out) is out
    for b, n in enumerate(lens):
        close(out[b], attention_ref(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n])[0][0], tolerance(np.float32))
    with pytest.raises(ValueError, match=rf"v_cache must be \(batch, capacity, heads_kv, head_dim_v\) = "
                                         rf"\(2, 300, 1, {dv}\)"):
        w.run(q, kc, kc, np.array(lens, np.int32))
    with pytest.raises(ValueError, match=r"out must be \(batch, seqlen_q, heads_q, head_dim_v\)"):
        w.run(q, kc, vc, np.array(lens, np.int32), out=np.empty((B, 1, Hq, d), np.float32))
    # FlashInfer's paged wrapper: head_dim_vo, a (k, v) pair of page arrays (pages, page_size, heads_kv, dim)
    page = 16
    used = [-(-n // page) for n in lens]
    first = np.cumsum([0] + used)  # sequence b owns pages first[b] .. first[b + 1] - 1
    kp = np.zeros((first[-1], page, Hkv, d), np.float32)
    vp = np.zeros((first[-1], page, Hkv, dv), np.float32)
    for b, n in enumerate(lens):
        for j in range(n):
            kp[first[b] + j // page, j % page], vp[first[b] + j // page, j % page] = kc[b, j], vc[b, j]
    indices = np.arange(first[-1], dtype=np.int32)
    last = np.array([n - (u - 1) * page for n, u in zip(lens, used)], np.int32)
    fw = flashcpp.BatchDecodeWithPagedKVCache()
    fw.plan(first, indices, last, Hq, Hkv, d, page, q_data_type="float32", head_dim_vo=dv)
    got = fw.run(q[:, 0], (kp, vp))
    assert got.shape == (B, Hq, dv)
    close(got, out[:, 0].astype(np.float64), 1e-5)


# ---- refusals --------------------------------------------------------------------------------------

def test_head_dims_outside_the_rule_are_refused_with_the_cpp_sentence(rng):
    q, k = arrays(rng, [(1, 4, 2, 64), (1, 4, 2, 64)])
    for dv in (84, 264, 0):
        (v,) = arrays(rng, [(1, 4, 2, dv)])
        with pytest.raises(ValueError, match=rf"^head_dim_v {dv} {RULE}$"):
            flashcpp.flash_attn_func(q, k, v)
        with pytest.raises(ValueError, match=rf"^head_dim_v {dv} {RULE}$"):
            flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], [0, 4], [0, 4], 4, 4)
    # an empty problem never reaches C++: refused all the same
    empty = np.zeros((0, 4, 2, 84), np.float32)
    with pytest.raises(ValueError, match=rf"^head_dim 84 {RULE}$"):
        flashcpp.flash_attn_func(empty, empty, empty)
    # k and v agree on everything but the last dim
    with pytest.raises(ValueError, match=r"k and v must have the same shape except the last dimension"):
        flashcpp.flash_attn_func(q, k, np.zeros((1, 5, 2, 128), np.float32))
    with pytest.raises(ValueError, match=r"q and k must have the same head_dim; got 64 and 128"):
        flashcpp.flash_attn_func(q, np.zeros((1, 4, 2, 128), np.float32), k)


def test_decode_refusals(rng):
    q = np.zeros((2, 1, 4, 64), np.float32)
    kc = np.zeros((2, 16, 2, 64), np.float32)
    with pytest.raises(ValueError, match=rf"^head_dim_v 84 {RULE}$"):
        flashcpp.flash_attn_with_kvcache(q, kc, np.zeros((2, 16, 2, 84), np.float32), cache_seqlens=3)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must be 4-D with the same shape except the last"):
        flashcpp.flash_attn_with_kvcache(q, kc, np.zeros((2, 16, 1, 64), np.float32), cache_seqlens=3)
    with pytest.raises(ValueError, match=r"v must be \(batch, seqlen_q, heads_kv, head_dim_v\) = \(2, 1, 2, 128\)"):
        flashcpp.flash_attn_with_kvcache(q, kc, np.zeros((2, 16, 2, 128), np.float32),
                                         np.zeros((2, 1, 2, 64), np.float32), np.zeros((2, 1, 2, 64), np.float32),
                                         cache_seqlens=3)
    from flashcpp.decode import BatchDecodeWithKVCache
    with pytest.raises(ValueError, match=r"head_dim_v must be an int in \[1, 2147483647\] \(None = head_dim\)"):
        BatchDecodeWithKVCache().plan(2, 4, 2, 64, head_dim_v=64.0, kv_capacity=16, dtype="float32", device="cpu")


def _views(p, dims):
    """Host buffers for the named views of a params struct, each (1, 8, 2, dim) fp16; kept alive by the caller."""
    bufs = []
    for name, d in dims.items():
        b = np.zeros((1, 8, 2, d), np.float16)
        bufs.append(b)
        setattr(p, name, _C.TensorView(b.ctypes.data, _C.DTYPE_F16, 16 * d, 2 * d, d))
    return bufs


@pytest.mark.parametrize("d,dv", [(96, 96), (128, 64), (24, 40)])
def test_cuda_takes_every_pair_and_refuses_fp8_decode_off_16(d, dv):
    # The C++ answer on the CUDA backend, through the binding (validation only: no device is touched).
    # The CUDA prefill, backward and decode kernels take every pair (padded to their class inside);
    # decode over an fp8 cache refuses head dims that are not multiples of 16.
    p = _C.AttnParams()
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v = 1, 8, 8, 2, 2, d, dv
    keep = _views(p, dict(q=d, k=d, v=dv, o=dv))
    try:
        choice = _C.select_kernel(p, _C.RunOptions("cuda"))
    except (NotImplementedError, RuntimeError) as e:  # no CUDA in this build, or no device: not the head dims
        assert "head_dim" not in str(e), str(e)
    else:
        assert f"{64 if max(d, dv) <= 64 else 128} class" in choice[2], choice
    assert _C.select_kernel(p, _C.RunOptions("cpu"))[0] == "cpu_tiled_online_softmax"
    if dv != d:
        b = _C.AttnBackwardParams()
        b.batch, b.seqlen_q, b.seqlen_k, b.heads_q, b.heads_kv, b.head_dim, b.head_dim_v = 1, 8, 8, 2, 2, d, dv
        keep += _views(b, dict(q=d, k=d, v=dv, o=dv, dout=dv, dq=d, dk=d, dv=dv))
        lse = np.zeros((1, 2, 8), np.float32)
        b.lse = lse.ctypes.data
        try:  # the CUDA backward pads like the prefill kernels: only a missing device or build refuses
            assert _C.attention_backward_workspace_size(b, _C.RunOptions("cuda")) > 0
        except (NotImplementedError, RuntimeError) as e:
            assert "head_dim" not in str(e) and ("no usable CUDA device" in str(e) or "no CUDA kernels" in str(e)
                                                 or "this build leaves out" in str(e)), str(e)
        assert _C.attention_backward_workspace_size(b, _C.RunOptions("cpu")) > 0
    dp = _C.DecodeParams()
    dp.batch, dp.heads_q, dp.heads_kv, dp.head_dim, dp.head_dim_v = 2, 4, 4, d, dv
    dp.q = dp.o = _C.TensorView(0, _C.DTYPE_F16)
    dp.cache.capacity = 16
    dp.cache.k = dp.cache.v = _C.TensorView(0, _C.DTYPE_F16)
    opt = _C.DecodePlanOptions()
    opt.backend = "cuda"
    try:  # sized like the CPU plan's; only a missing device or build refuses
        assert _C.decode_workspace_size(dp, opt, False)[0] > 0
    except (NotImplementedError, RuntimeError) as e:
        assert "head_dim" not in str(e) and ("no usable CUDA device" in str(e) or "no CUDA kernels" in str(e)
                                             or "this build leaves out" in str(e)), str(e)
    dp.cache.k = dp.cache.v = _C.TensorView(0, _C.DTYPE_F8E4M3)
    if d % 16 or dv % 16:
        name, bad = ("head_dim", d) if d % 16 else ("head_dim_v", dv)
        want = f"an fp8_e4m3 cache with {name} {bad} runs on the CPU backend only"
        with pytest.raises(NotImplementedError, match=want + "|no CUDA kernels"):  # a CUDA-off build says that first
            _C.decode_workspace_size(dp, opt, False)
    opt.backend = "cpu"
    assert _C.decode_workspace_size(dp, opt, False)[0] > 0


# ---- torch: forward, fakes, backward -------------------------------------------------------------------

def _t(rng, shape, dtype=None, grad=False):
    x = torch.from_numpy(rng.standard_normal(shape))
    x = x.to(torch.float32 if dtype is None else dtype)
    return x.requires_grad_(grad)


def ref_attention(q, k, v, causal=False):
    """attention.h's forward in torch ops (autograd-friendly; v's head dim may differ): (out, lse)."""
    Nq, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    Nk, Hkv = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / D ** 0.5
    if causal:
        visible = torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None] + (Nk - Nq)
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


@needs_torch
def test_every_head_dim_through_torch(rng):
    for d in ALL_DIMS:
        q, k, v = _t(rng, (1, 5, 2, d)), _t(rng, (1, 6, 1, d)), _t(rng, (1, 6, 1, 264 - d))
        out = flashcpp.flash_attn_func(q, k, v, causal=True)
        assert out.shape == (1, 5, 2, 264 - d)
        close(out.numpy(), attention_ref(q.numpy(), k.numpy(), v.numpy(), causal=True)[0], tolerance(np.float32))


@needs_torch
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fakes_return_v_head_dim_shapes(device):
    # What torch.compile sees at trace time (CUDA fakes need no GPU): out and dv at head_dim_v.
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.flashcpp
    with FakeTensorMode():
        e = lambda *s: torch.empty(s, device=device)  # noqa: E731
        q, k, v = e(2, 9, 4, 192), e(2, 11, 2, 192), e(2, 11, 2, 128)
        out, lse = ops.flash_attn_fwd(q, k, v, 0.1, True, -1, -1, 0.0, None, True)
        assert out.shape == (2, 9, 4, 128) and lse.shape == (2, 4, 9)
        dq, dk, dv = ops.flash_attn_bwd(e(2, 9, 4, 128), q, k, v, out, lse, None, 0.1, True, -1, -1, 0.0, None, False)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        cu = torch.empty(3, dtype=torch.int32, device=device)
        qv, kv, vv = e(12, 4, 96), e(15, 2, 96), e(15, 2, 80)
        ov, lv = ops.flash_attn_varlen_fwd(qv, kv, vv, cu, cu, 8, 8, 0.1, True, -1, -1, 0.0, None, True)
        assert ov.shape == (12, 4, 80) and lv.shape == (4, 12)
        grads = ops.flash_attn_varlen_bwd(e(12, 4, 80), qv, kv, vv, ov, lv, None, cu, cu, 8, 8, 0.1, True, -1, -1,
                                          0.0, None, False)
        assert [g.shape for g in grads] == [qv.shape, kv.shape, vv.shape]
        qd, kc, vc = e(2, 1, 4, 64), e(2, 16, 2, 64), e(2, 16, 2, 128)
        od, ld = ops.flash_attn_with_kvcache(qd, kc, vc, None, [3, 4], None, None, None, None, True, -1, -1, 0.0,
                                             False, None, 0, True, None)
        assert od.shape == (2, 1, 4, 128) and ld.shape == (2, 4, 1)
        od, _ = ops.flash_attn_with_kvcache_append(qd, kc, vc, e(2, 1, 2, 64), e(2, 1, 2, 128), None, [3, 4], None,
                                                   None, None, None, True, -1, -1, 0.0, False, None, 0, False, None)
        assert od.shape == (2, 1, 4, 128)
        with pytest.raises(ValueError, match=rf"^head_dim_v 84 {RULE}$"):  # refused at trace time too
            ops.flash_attn_fwd(q, k, e(2, 11, 2, 84), 0.1, True, -1, -1, 0.0, None, True)


@needs_torch
@pytest.mark.parametrize("d,dv", PAIRS)
def test_pair_gradients_match_torch_autograd_of_a_reference(rng, d, dv):
    # float64 (the fp64 reference backward; P comes back from the fp32 LSE, so 1e-6 relative) and fp32
    # (the tiled backward: fp32 rounding, as test_backward_torch.py); dlse too
    for dtype, atol, rtol in ((torch.float64, 1e-9, 1e-6), (torch.float32, 2e-5, 1e-4)):
        q, k, v = (_t(rng, s, dtype, True) for s in ((1, 6, 4, d), (1, 7, 2, d), (1, 7, 2, dv)))
        out, lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        torch.autograd.backward((out, lse), (dout, dlse))
        r = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ro, rl = ref_attention(*r, causal=True)
        torch.autograd.backward((ro, rl), (dout.double(), dlse.double()))
        assert (q.grad.shape, k.grad.shape, v.grad.shape) == ((1, 6, 4, d), (1, 7, 2, d), (1, 7, 2, dv))
        for got, want in ((q.grad, r[0].grad), (k.grad, r[1].grad), (v.grad, r[2].grad)):
            assert (got.double() - want).abs().max().item() <= atol + rtol * want.abs().max().item()


@needs_torch
@pytest.mark.parametrize("d,dv", PAIRS)
def test_pair_gradcheck_fast_mode(rng, d, dv):
    # Fast mode (random projections of the Jacobian): a full check of head dim 192 takes seconds;
    # the comparison above pins every element of the gradients, the full checks below small pairs.
    q, k, v = _t(rng, (1, 2, 2, d), torch.float64, True), _t(rng, (1, 3, 1, d), torch.float64, True), \
        _t(rng, (1, 3, 1, dv), torch.float64, True)
    f = lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@needs_torch
@pytest.mark.parametrize("d,dv", [(16, 8), (8, 24)])
def test_small_pair_gradcheck_full_mode(rng, d, dv):
    q, k, v = _t(rng, (1, 3, 2, d), torch.float64, True), _t(rng, (1, 4, 1, d), torch.float64, True), \
        _t(rng, (1, 4, 1, dv), torch.float64, True)
    assert torch.autograd.gradcheck(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, window_size=(2, 0)), (q, k, v))
    cu_q, cu_k = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32)
    qv, kv, vv = (x.detach()[0, :, :1].clone().requires_grad_() for x in (q, k, v))
    f = lambda q, k, v: flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 2, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (qv, kv, vv))


@needs_torch
def test_compile_forward_and_backward_and_opcheck_with_head_dim_v(rng):
    def loss(q, k, v):
        out, lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.square().sum() + lse.sum()

    base = (_t(rng, (1, 17, 4, 96)), _t(rng, (1, 17, 2, 96)), _t(rng, (1, 17, 2, 80)))
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
    q, k, v = base
    out, lse = torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, True, -1, -1, 0.0, None, True)
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), 0.125, True, -1, -1, 0.0,
                           None, False))
