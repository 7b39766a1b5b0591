"""torch integration on CPU tensors: the custom ops, their fake implementations, opcheck,
torch.compile(fullgraph=True) tracing, and errors through the dispatcher. Needs torch (skipped
in CI, which has none; runs on the H200 machine and wherever torch is installed)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch integration tests need torch")

import flashcpp  # noqa: E402
from attn_reference import alibi_slopes, attention_ref, tolerance, varlen_ref  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def t(rng, shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


def to64(x):
    return x.detach().to(torch.float64).numpy()


class OpLog(TorchDispatchMode):
    """Records every aten/custom op that runs inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attn_func_matches_reference(rng, dtype):
    B, Nq, Nk, Hq, Hkv, D = 2, 19, 45, 4, 2, 64
    q, k, v = t(rng, (B, Nq, Hq, D), dtype), t(rng, (B, Nk, Hkv, D), dtype), t(rng, (B, Nk, Hkv, D), dtype)
    slopes = torch.from_numpy(alibi_slopes(Hq))
    out, lse = flashcpp.flash_attn_func(q, k, v, causal=True, window_size=(20, -1), softcap=10.0,
                                        alibi_slopes=slopes, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, Nq)
    ref_o, ref_lse = attention_ref(to64(q), to64(k), to64(v), causal=True, window=(20, -1),
                                   softcap=10.0, alibi_slopes=slopes.numpy())
    assert np.abs(to64(out) - ref_o).max() <= tolerance(str(dtype))
    assert np.abs(to64(lse) - ref_lse).max() <= 1e-4


def test_sdpa_layout_runs_without_a_copy(rng):
    B, H, N, D = 2, 4, 33, 64
    qs, ks, vs = (t(rng, (B, H, N, D)) for _ in range(3))
    qt, kt, vt = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    with OpLog() as log:
        out = flashcpp.flash_attn_func(qt, kt, vt)  # eager fast path (no dispatcher)
        out_op, _ = torch.ops.flashcpp.flash_attn_fwd(qt, kt, vt, 64 ** -0.5, False, -1, -1, 0.0, None, False)
    copies = [op for op in log.ops if any(w in op for w in ("copy", "clone", "contiguous", "_to_copy"))]
    assert not copies, f"inputs were copied: {copies}"
    assert any("flashcpp.flash_attn_fwd" in op for op in log.ops)
    assert torch.equal(out, out_op)
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    assert (out - ref).abs().max().item() < 1e-5


def test_varlen_torch_cpu(rng):
    cu_q = torch.tensor([0, 3, 3, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 30], dtype=torch.int32)
    q, k, v = t(rng, (20, 4, 64)), t(rng, (30, 2, 64)), t(rng, (30, 2, 64))
    out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 21, causal=True, return_lse=True)
    ref_o, ref_lse = varlen_ref(to64(q), to64(k), to64(v), cu_q.numpy(), cu_k.numpy(), causal=True)
    assert np.abs(to64(out) - ref_o).max() < 2e-5
    fin = np.isfinite(ref_lse)
    assert np.array_equal(fin, np.isfinite(to64(lse)))
    assert np.abs(to64(lse)[fin] - ref_lse[fin]).max() < 1e-4


def test_merge_torch_cpu(rng):
    q, k, v = t(rng, (1, 8, 2, 64)), t(rng, (1, 30, 2, 64)), t(rng, (1, 30, 2, 64))
    oa, la = flashcpp.flash_attn_func(q, k[:, :11], v[:, :11], return_lse=True)
    ob, lb = flashcpp.flash_attn_func(q, k[:, 11:], v[:, 11:], return_lse=True)
    o, s = flashcpp.merge_attention_states(oa[0], la[0].T.contiguous(), ob[0], lb[0].T.contiguous())
    full, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True)
    assert (o - full[0]).abs().max().item() < 2e-5
    assert (s - lse[0].T).abs().max().item() < 1e-4


def test_opcheck_flash_attn_fwd(rng):
    q, k, v = t(rng, (1, 9, 4, 64)), t(rng, (1, 12, 2, 64)), t(rng, (1, 12, 2, 64))
    slopes = torch.from_numpy(alibi_slopes(4))
    for args in [(q, k, v, 0.125, True, -1, -1, 0.0, None, True),
                 (q, k, v, 0.125, False, 4, 2, 5.0, slopes, False)]:
        torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default, args)


def test_opcheck_varlen_and_merge(rng):
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    q, k, v = t(rng, (10, 2, 64)), t(rng, (10, 2, 64)), t(rng, (10, 2, 64))
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_varlen_fwd.default,
                          (q, k, v, cu, cu, 6, 6, 0.125, True, -1, -1, 0.0, None, True))
    torch.library.opcheck(torch.ops.flashcpp.merge_attention_states.default,
                          (q, t(rng, (10, 2)), k, t(rng, (10, 2))))


def test_compile_fullgraph_traces_the_op(rng):
    class Block(torch.nn.Module):
        def __init__(self, dim=128, heads=2):
            super().__init__()
            self.heads, self.hd = heads, dim // heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.hd).unbind(2)
            return self.proj(flashcpp.flash_attn_func(q, k, v, causal=True).reshape(B, N, -1))

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 17, 128)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():  # forward only: the ops register no autograd formula
        eager = block(x)
        assert (compiled(x) - eager).abs().max().item() < 1e-5


def test_errors_through_the_custom_op(rng):
    q = t(rng, (1, 8, 2, 64))
    with pytest.raises(TypeError, match="same dtype"):
        flashcpp.flash_attn_func(q, q.half(), q)
    with pytest.raises(TypeError, match="int32"):
        flashcpp.flash_attn_func(q.int(), q.int(), q.int())
    with pytest.raises(TypeError, match="must all be numpy arrays or all torch tensors"):
        flashcpp.flash_attn_func(q, q.numpy(), q)
    wide = t(rng, (1, 8, 2, 128))
    with pytest.raises(ValueError, match=r"q: the last dimension \(head_dim\) must be contiguous"):
        flashcpp.flash_attn_func(wide[..., ::2], q, q)
    with pytest.raises(ValueError, match="multiple of heads"):
        flashcpp.flash_attn_func(t(rng, (1, 8, 3, 64)), q, q)
    with pytest.raises(ValueError, match=r"head_dim 84 is not supported \(it must be a multiple of 8 in \[8, 256\]\)"):
        x = t(rng, (1, 8, 2, 84))
        flashcpp.flash_attn_func(x, x, x)
    with pytest.raises(ValueError, match=r"head_dim_v 264 is not supported"):
        flashcpp.flash_attn_func(q, q, t(rng, (1, 8, 2, 264)))
    # called directly, the op checks too
    with pytest.raises(ValueError, match="same batch size"):
        torch.ops.flashcpp.flash_attn_fwd(q, t(rng, (2, 8, 2, 64)), t(rng, (2, 8, 2, 64)),
                                          0.1, False, -1, -1, 0.0, None, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_on_a_build_without_cuda():
    if flashcpp.WITH_CUDA:
        pytest.skip("this build has the CUDA kernels")
    x = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="no CUDA kernels"):
        flashcpp.flash_attn_func(x, x, x)


def test_head_dim_zero_and_scale_zero_through_torch(rng):
    z = torch.zeros(1, 8, 2, 0)
    with pytest.raises(ValueError, match="head_dim"):
        flashcpp.flash_attn_func(z, z, z)
    q, k, v = (t(rng, (1, 8, 2, 64)) * 4 for _ in range(3))
    out = flashcpp.flash_attn_func(q, k, v, softmax_scale=0.0)  # uniform weights, not 1/sqrt(d)
    assert (out - v.mean(1, keepdim=True)).abs().max().item() < 1e-5
    op_out, _ = torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.0, False, -1, -1, 0.0, None, False)
    assert torch.equal(op_out, out)


def test_host_cache_seqlens_checked_for_cuda_tensors_without_a_gpu():
    # The CUDA branch of flash_attn_with_kvcache's checks, on fake CUDA tensors: host lengths
    # past the cache are refused before anything runs (device tensors are left to the kernels).
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16, device="cuda")
        for lens in ([200, 3], np.array([3, 65], np.int32), 65):
            with pytest.raises(ValueError, match="exceed the cache's 64 slots"):
                flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
        with pytest.raises(ValueError, match="negative"):
            flashcpp.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=[3, -1])
