"""flashcpp from PyTorch on a GPU: vs SDPA (fp64 math backend as ground truth), torch.compile
(fullgraph=True), CUDA-graph capture/replay, torch.library.opcheck, stream handling and errors.

Needs torch, a CUDA device and a build with FLASHCPP_CUDA=ON (runs on the H200 machine:
``pip install --no-build-isolation . && pytest tests/python/test_torch_cuda.py``).
Tolerance (flash-attn's rule): max error vs fp64 <= 2 * (error of PyTorch's own SDPA in the
same dtype vs fp64) + 1e-3.
"""
import itertools

import pytest

torch = pytest.importorskip("torch", reason="GPU tests need torch")

import flashcpp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not flashcpp.WITH_CUDA, reason="this build has no CUDA kernels (FLASHCPP_CUDA=OFF)"),
]
DEV = "cuda"


def bottom_right_mask(nq, nk, causal, window=(-1, -1), device=DEV):
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    ia = i + nk - nq
    vis = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= ia
    if window[0] >= 0:
        vis &= j >= ia - window[0]
    if window[1] >= 0:
        vis &= j <= ia + window[1]
    return vis


def sdpa_bshd(q, k, v, mask=None):
    """SDPA on (B, N, H, D) tensors (GQA by repeating k/v heads), returns (B, N, H, D)."""
    g = q.shape[2] // k.shape[2]
    qs, ks, vs = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2)


def rand(shape, dtype, gen):
    return torch.randn(shape, dtype=torch.float32, device=DEV, generator=gen).to(dtype)


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    seed = g.seed()
    print(f"seed={seed}")
    return g


def check_vs_sdpa(q, k, v, out, causal, window=(-1, -1)):
    mask = bottom_right_mask(q.shape[1], k.shape[1], causal, window)
    ref = sdpa_bshd(q.double(), k.double(), v.double(), mask)
    peer = sdpa_bshd(q, k, v, mask)  # PyTorch in the same dtype
    rows = mask.any(-1)  # SDPA gives NaN for rows without keys; flashcpp gives 0
    err = (out.double() - ref)[:, rows].abs().max().item()
    err_peer = (peer.double() - ref)[:, rows].abs().max().item()
    assert err <= 2 * err_peer + 1e-3, f"max err {err:.3g} vs SDPA's own {err_peer:.3g}"
    assert torch.all(out[:, ~rows] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("B,Nq,Nk,Hq,Hkv,causal", [
    (2, 1000, 1000, 8, 8, True),
    (2, 127, 127, 8, 2, False),
    (1, 7, 4097, 4, 1, True),     # decode-like, bottom-right causal, MQA
    (1, 1, 1, 2, 2, False),
    (3, 515, 700, 4, 4, True),
])
def test_matches_sdpa(gen, dtype, D, B, Nq, Nk, Hq, Hkv, causal):
    q = rand((B, Nq, Hq, D), dtype, gen)
    k, v = rand((B, Nk, Hkv, D), dtype, gen), rand((B, Nk, Hkv, D), dtype, gen)
    out = flashcpp.flash_attn_func(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    check_vs_sdpa(q, k, v, out, causal)


def test_sliding_window(gen):
    q, k, v = (rand((2, 600, 4, 128), torch.bfloat16, gen) for _ in range(3))
    out = flashcpp.flash_attn_func(q, k, v, causal=True, window_size=(128, 0))
    check_vs_sdpa(q, k, v, out, True, (128, 0))


def test_lse(gen):
    q, k, v = (rand((2, 300, 4, 64), torch.float16, gen) for _ in range(3))
    out, lse = flashcpp.flash_attn_func(q, k, v, return_lse=True, softmax_scale=0.1)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 0.1
    assert lse.shape == (2, 4, 300) and lse.dtype == torch.float32
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-3


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sdpa_layout_without_a_copy(gen):
    B, H, N, D = 2, 8, 512, 128
    qs, ks, vs = (rand((B, H, N, D), torch.bfloat16, gen) for _ in range(3))
    with OpLog() as log:
        out = flashcpp.flash_attn_func(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), causal=True)
    copies = [op for op in log.ops if any(w in op for w in ("copy", "clone", "contiguous", "_to_copy"))]
    assert not copies, f"inputs were copied: {copies}"
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_compile_fullgraph(gen):
    class Block(torch.nn.Module):
        def __init__(self, dim=512, heads=4):
            super().__init__()
            self.heads, self.hd = heads, dim // heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.hd).unbind(2)
            return self.proj(flashcpp.flash_attn_func(q, k, v, causal=True).reshape(B, N, -1))

    block = Block().to(DEV, torch.bfloat16)
    x = rand((2, 256, 512), torch.bfloat16, gen)
    torch._dynamo.reset()
    with torch.no_grad():
        explain = torch._dynamo.explain(block)(x)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        compiled = torch.compile(block, fullgraph=True)
        eager = block(x)
        assert (compiled(x).float() - eager.float()).abs().max().item() < 5e-2


def test_cuda_graph_capture_and_replay(gen):
    q, k, v = (rand((2, 256, 8, 128), torch.bfloat16, gen) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        flashcpp.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(rand(x.shape, x.dtype, gen))
        graph.replay()
        ref, ref_lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_runs_on_the_current_stream(gen):
    q, k, v = (rand((1, 2048, 8, 128), torch.float16, gen) for _ in range(3))
    expected = flashcpp.flash_attn_func(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = flashcpp.flash_attn_func(q, k, v)
    s.synchronize()
    assert torch.equal(out, expected)


def test_opcheck(gen):
    q, k, v = (rand((1, 64, 4, 64), torch.bfloat16, gen) for _ in range(3))
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default,
                          (q, k, v, 0.125, True, -1, -1, 0.0, None, True))
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default,
                          (q, k, v, 0.125, False, 16, 0, 0.0, None, False))


def test_select_kernel_names_a_cuda_kernel(gen):
    q = rand((1, 128, 4, 128), torch.bfloat16, gen)
    choice = flashcpp.select_kernel(q, q, q, causal=True)
    assert choice.kernel.startswith("cuda_") and choice.config and choice.reason


def test_errors(gen):
    q = rand((1, 64, 4, 64), torch.bfloat16, gen)
    with pytest.raises(ValueError, match="same device"):
        flashcpp.flash_attn_func(q, q.cpu(), q)
    with pytest.raises(TypeError, match="same dtype"):
        flashcpp.flash_attn_func(q, q.half(), q)
    with pytest.raises(NotImplementedError, match="fp32"):
        flashcpp.flash_attn_func(q.float(), q.float(), q.float())
    wide = rand((1, 64, 4, 72), torch.bfloat16, gen)
    with pytest.raises(ValueError, match="aligned"):  # data pointer 2 bytes past a 16-byte boundary
        flashcpp.flash_attn_func(wide[..., 1:65], q, q)
    with pytest.raises(ValueError, match=r"the last dimension \(head_dim\) must be contiguous"):
        flashcpp.flash_attn_func(rand((1, 64, 4, 128), torch.bfloat16, gen)[..., ::2], q, q)
    with pytest.raises(ValueError, match="alibi_slopes must be on q's device"):
        flashcpp.flash_attn_func(q, q, q, alibi_slopes=torch.ones(4))


def masked_reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None, mask=None):
    """Attention of (N, H, D) tensors of one sequence, in q's dtype math or fp64 (upcast q first):
    scores, softcap, ALiBi bias slope * (j - ia), bottom-right mask ANDed with `mask` (bool,
    broadcastable to (H, Nq, Nk), e.g. a block-sparse mask's to_dense), softmax (empty rows -> 0)."""
    nq, nk, d = q.shape[0], k.shape[0], q.shape[-1]
    g = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype).repeat_interleave(g, 1), v.to(q.dtype).repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * (scale if scale is not None else d ** -0.5)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i = torch.arange(nq, device=q.device)[:, None] + nk - nq
        j = torch.arange(nk, device=q.device)[None, :]
        s = s + slopes.to(s.dtype)[:, None, None] * (j - i).to(s.dtype)
    vis = bottom_right_mask(nq, nk, causal, window, device=q.device)
    if mask is not None:
        vis = vis & mask.to(q.device)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s.float() if s.dtype != torch.float64 else s, dim=-1).nan_to_num(0.0).to(s.dtype)
    return torch.einsum("hij,jhd->ihd", p, v)


@pytest.mark.parametrize("config", ["", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_per_sequence_attention(gen, config, dtype):
    lq, lk = [1, 7, 300, 1000, 1], [1, 7, 300, 1000, 9]
    H, Hkv, D = 4, 2, 128
    cu_q = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lk)), dtype=torch.int32, device=DEV)
    q = rand((sum(lq), H, D), dtype, gen)
    k, v = rand((sum(lk), Hkv, D), dtype, gen), rand((sum(lk), Hkv, D), dtype, gen)
    slopes = flashcpp.alibi_slopes(H, device=DEV)
    kw = dict(causal=True, window_size=(256, 0), softcap=30.0, alibi_slopes=slopes)
    if config:
        out, lse = flashcpp.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                                      max_seqlen_k=max(lk), return_lse=True, backend="cuda", cuda_config=config, **kw)
    else:
        out, lse = flashcpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **kw)
    assert lse.shape == (H, sum(lq))
    for b in range(len(lq)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = masked_reference(q[qs].double(), k[ks].double(), v[ks].double(), True, (256, 0), 30.0, slopes)
        peer = masked_reference(q[qs], k[ks], v[ks], True, (256, 0), 30.0, slopes)
        err = (out[qs].double() - ref).abs().max().item()
        err_peer = (peer.double() - ref).abs().max().item()
        assert err <= 2 * err_peer + 1e-3, f"sequence {b}: max err {err:.3g} vs same-dtype math {err_peer:.3g}"
        assert torch.isfinite(lse[:, qs]).all()


@pytest.mark.parametrize("config", ["", "sm80"])
def test_varlen_batch_zero_and_padded_lse_layout_on_cuda(gen, config):
    # cu_seqlens = [0]: every packed row O = 0, LSE = -inf (poisoned outputs first); and with padding
    # (cu_seqlens_q[-1] < q.shape[0]) each head's LSE sits at lse[h, row] of the (heads, total) tensor.
    H, D = 4, 128
    q = rand((8, H, D), torch.bfloat16, gen)
    zero = torch.zeros(1, dtype=torch.int32, device=DEV)
    for max_k in (0, 5):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((H, 8), float("nan"), device=DEV)
        flashcpp.attention(q, q, q, out=out, lse=lse, cu_seqlens_q=zero, cu_seqlens_k=zero, max_seqlen_q=0,
                           max_seqlen_k=max_k, backend="cuda", cuda_config=config)
        assert (out == 0).all() and torch.isneginf(lse).all(), f"max_seqlen_k {max_k}"
    o, l = flashcpp.flash_attn_varlen_func(q, q, q, zero, zero, 0, 0, return_lse=True)
    assert (o == 0).all() and torch.isneginf(l).all()
    lq = [3, 200, 1]
    cu = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32, device=DEV)
    qp = rand((sum(lq) + 9, H, D), torch.bfloat16, gen)  # 9 rows of padding past cu_seqlens_q[-1]
    k, v = rand((sum(lq), 2, D), torch.bfloat16, gen), rand((sum(lq), 2, D), torch.bfloat16, gen)
    lse = torch.full((H, qp.shape[0]), float("nan"), device=DEV)
    out = torch.empty_like(qp)
    flashcpp.attention(qp, k, v, out=out, lse=lse, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lq),
                       max_seqlen_k=max(lq), causal=True, backend="cuda", cuda_config=config)
    for b in range(len(lq)):
        s = slice(int(cu[b]), int(cu[b + 1]))
        _, ref_lse = flashcpp.flash_attn_func(qp[None, s], k[None, s], v[None, s], causal=True, return_lse=True)
        assert (lse[:, s] - ref_lse[0]).abs().max().item() < 1e-3, f"sequence {b}"
    assert torch.isnan(lse[:, sum(lq):]).all()  # rows past the last sequence are left as they are on CUDA


@pytest.mark.parametrize("config", ["", "sm80"])
def test_mask_kwargs_on_cuda(gen, config):
    B, Nq, Nk, H, Hkv, D = 2, 515, 700, 6, 3, 64
    q = rand((B, Nq, H, D), torch.bfloat16, gen)
    k, v = rand((B, Nk, Hkv, D), torch.bfloat16, gen), rand((B, Nk, Hkv, D), torch.bfloat16, gen)
    slopes = flashcpp.alibi_slopes(H, device=DEV)  # 6 heads: BLOOM's non-power-of-two rule
    for kw in (dict(causal=True, window_size=(128, 0)), dict(window_size=(64, 64), softcap=5.0),
               dict(causal=True, alibi_slopes=slopes), dict(causal=True, softcap=50.0, alibi_slopes=slopes)):
        out = flashcpp.attention(q, k, v, backend="cuda", cuda_config=config, **kw)[0]
        for b in range(B):
            args = (kw.get("causal", False), kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                    kw.get("alibi_slopes"))
            ref = masked_reference(q[b].double(), k[b].double(), v[b].double(), *args)
            peer = masked_reference(q[b], k[b], v[b], *args)
            err = (out[b].double() - ref).abs().max().item()
            err_peer = (peer.double() - ref).abs().max().item()
            assert err <= 2 * err_peer + 1e-3, f"{kw}: max err {err:.3g} vs same-dtype math {err_peer:.3g}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_device(gen):
    q = torch.randn(1, 128, 4, 64, device="cuda:1", dtype=torch.bfloat16)
    with torch.cuda.device(0):
        out = flashcpp.flash_attn_func(q, q, q)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, q, q))).transpose(1, 2)
    assert out.device == q.device and (out.float() - ref.float()).abs().max().item() < 2e-2


# ---- block-sparse masks -----------------------------------------------------------------------------
# The mask's arrays must be on q's device (BlockSparse.to(q.device)); blocks must be whole multiples
# of the kernels' tiles (128x128 and its multiples fit every config of both families).

def block_kind_mask(gen, shape, block=(128, 128), p_full=0.4, p_partial=0.2):
    """Bool mask on DEV, (..., nq, nk): each block x block tile is hidden, visible, or random at
    density 0.5 (a partial block), and query rows 5 and 6 see nothing."""
    *lead, nq, nk = shape
    bq, bk = -(-nq // block[0]), -(-nk // block[1])
    u = torch.rand((*lead, bq, bk), device=DEV, generator=gen)
    kind = (u < p_full).int() + 2 * ((u >= p_full) & (u < p_full + p_partial)).int()
    kind = kind.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :nq, :nk]
    mask = (kind == 1) | ((kind == 2) & (torch.rand(shape, device=DEV, generator=gen) < 0.5))
    mask[..., 5:7, :] = False
    return mask


def check_masked(q, k, v, out, lse, mask, **kw):
    """flash-attn's rule per sequence vs masked_reference in fp64 and in q's dtype; rows that see
    nothing: out 0 and lse -inf."""
    for b in range(q.shape[0]):
        m = mask[b] if mask.dim() == 4 else mask
        ref = masked_reference(q[b].double(), k[b].double(), v[b].double(), mask=m, **kw)
        peer = masked_reference(q[b], k[b], v[b], mask=m, **kw)
        err = (out[b].double() - ref).abs().max().item()
        err_peer = (peer.double() - ref).abs().max().item()
        assert err <= 2 * err_peer + 1e-3, f"batch {b}: max err {err:.3g} vs same-dtype math {err_peer:.3g}"
        vis = bottom_right_mask(q.shape[1], k.shape[1], kw.get("causal", False), kw.get("window", (-1, -1))) & m
        empty = ~vis.expand(q.shape[2], -1, -1).any(-1)  # (H, Nq)
        assert torch.all(out[b].transpose(0, 1)[empty] == 0)
        if lse is not None:
            assert torch.all(torch.isneginf(lse[b][empty])) and torch.all(torch.isfinite(lse[b][~empty]))


@pytest.mark.parametrize("config", ["", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_block_sparse_per_head_masks(gen, config, dtype, D):
    B, Nq, Nk, H, Hkv = 2, 1000, 777, 4, 2  # ragged last blocks, GQA, a mask per (batch, head)
    q = rand((B, Nq, H, D), dtype, gen)
    k, v = rand((B, Nk, Hkv, D), dtype, gen), rand((B, Nk, Hkv, D), dtype, gen)
    mask = block_kind_mask(gen, (B, H, Nq, Nk))
    bs = flashcpp.block_sparse_from_mask(mask, 128, 128)
    assert bs.num_full_blocks > 0 and bs.num_partial > 0 and bs.block_density < 0.9
    bs_dev = bs.to(DEV)
    out, lse = flashcpp.attention(q, k, v, block_sparse=bs_dev, return_lse=True, backend="cuda", cuda_config=config)
    check_masked(q, k, v, out, lse, mask)
    if not config:
        out2, lse2 = flashcpp.flash_attn_func(q, k, v, block_sparse=bs_dev, return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("config", ["", "sm80"])
@pytest.mark.parametrize("Nq,Nk", [(1, 1), (7, 7), (130, 130), (7, 300), (300, 7)])
def test_block_sparse_odd_sizes_and_other_masks(gen, config, Nq, Nk):
    H, D = 4, 64
    q = rand((1, Nq, H, D), torch.bfloat16, gen)
    k, v = rand((1, Nk, 1, D), torch.bfloat16, gen), rand((1, Nk, 1, D), torch.bfloat16, gen)
    mask = block_kind_mask(gen, (Nq, Nk), p_full=0.5, p_partial=0.5)
    bs = flashcpp.block_sparse_from_mask(mask, 128, 128).to(DEV)
    slopes = flashcpp.alibi_slopes(H, device=DEV)
    for kw in (dict(), dict(causal=True), dict(causal=True, window_size=(64, 0), softcap=20.0, alibi_slopes=slopes)):
        out, lse = flashcpp.attention(q, k, v, block_sparse=bs, return_lse=True, backend="cuda", cuda_config=config,
                                      **kw)
        ref_kw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                      softcap=kw.get("softcap", 0.0), slopes=kw.get("alibi_slopes"))
        check_masked(q, k, v, out, lse, mask, **ref_kw)


def test_causal_and_document_block_masks(gen):
    """causal_block_sparse == the causal flag; document_block_sparse over packed tensors == varlen."""
    q, k, v = (rand((2, 1000, 4, 128), torch.bfloat16, gen) for _ in range(3))
    out = flashcpp.flash_attn_func(q, k, v, block_sparse=flashcpp.causal_block_sparse(1000, 1000, 128, 128).to(DEV))
    check_vs_sdpa(q, k, v, out, True)

    lens = [1, 7, 300, 1000, 228]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    n = int(cu[-1])
    qp, kp, vp = (rand((1, n, 4, 128), torch.bfloat16, gen) for _ in range(3))
    bs = flashcpp.document_block_sparse(cu, cu, 128, 128, causal=True).to(DEV)
    out, lse = flashcpp.flash_attn_func(qp, kp, vp, block_sparse=bs, return_lse=True)
    cu_dev = cu.to(DEV)
    ref, ref_lse = flashcpp.flash_attn_varlen_func(qp[0], kp[0], vp[0], cu_dev, cu_dev, max(lens), max(lens),
                                                   causal=True, return_lse=True)
    assert (out[0].float() - ref.float()).abs().max().item() < 2e-2
    assert (lse[0] - ref_lse).abs().max().item() < 1e-3


def test_block_sparse_block_sizes_and_kernel_choice(gen):
    q, k, v = (rand((1, 512, 4, 128), torch.bfloat16, gen) for _ in range(3))
    mask = block_kind_mask(gen, (512, 512), block=(256, 128))
    for bm, bn in ((128, 128), (256, 128), (128, 256), (64, 64)):
        bs = flashcpp.block_sparse_from_mask(mask, bm, bn).to(DEV)
        choice = flashcpp.select_kernel(q, k, v, block_sparse=bs)
        assert choice.kernel.startswith("cuda_") and f"block-sparse {bm}x{bn}" in choice.reason
        if torch.cuda.get_device_capability()[0] == 9 and (bm, bn) == (64, 64):
            assert choice.kernel == "cuda_sm80_fa2" and "sm90 tiles" in choice.reason
        out = flashcpp.flash_attn_func(q, k, v, block_sparse=bs)
        check_masked(q, k, v, out, None, mask)
    with pytest.raises(NotImplementedError, match="block-sparse blocks"):  # no compiled tile divides 16x16
        flashcpp.flash_attn_func(q, k, v, block_sparse=flashcpp.block_sparse_from_mask(mask, 16, 16).to(DEV))


def test_block_sparse_graph_capture_opcheck_and_compile(gen):
    from flashcpp import _core
    q, k, v = (rand((2, 384, 4, 64), torch.bfloat16, gen) for _ in range(3))
    bs = flashcpp.block_sparse_from_mask(block_kind_mask(gen, (384, 384)), 128, 128).to(DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        flashcpp.flash_attn_func(q, k, v, block_sparse=bs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # bs must outlive the graph: the kernels read its arrays at replay
        out = flashcpp.flash_attn_func(q, k, v, block_sparse=bs)
    for x in (q, k, v):
        x.copy_(rand(x.shape, x.dtype, gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashcpp.flash_attn_func(q, k, v, block_sparse=bs))

    tensors, sizes = _core.sparse_to_lists(_core.sparse_spec(bs))
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default,
                          (q, k, v, 0.125, True, -1, -1, 0.0, None, True, *tensors, sizes))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True, block_sparse=bs),
                             fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v), flashcpp.flash_attn_func(q, k, v, causal=True, block_sparse=bs))


def test_block_sparse_errors(gen):
    q = rand((1, 256, 4, 64), torch.bfloat16, gen)
    bs = flashcpp.causal_block_sparse(256, 256, 128, 128)
    with pytest.raises(ValueError, match=r"numpy \(host\) arrays, but q is on cuda.*block_sparse.to\(q.device\)"):
        flashcpp.flash_attn_func(q, q, q, block_sparse=bs)
    with pytest.raises(ValueError, match=r"block_sparse.row_ptr must be on q's device \(cuda:0\); got cpu"):
        flashcpp.flash_attn_func(q, q, q, block_sparse=bs.to("cpu"))
    with pytest.raises(ValueError, match="built for seqlen_q=256"):
        flashcpp.flash_attn_func(q[:, :255], q, q, block_sparse=bs.to(DEV))
    with pytest.raises(ValueError, match="must be on q's device"):  # the mask on the CPU, q on the GPU
        flashcpp.flash_attn_func(q.cpu(), q.cpu(), q.cpu(), block_sparse=bs.to(DEV))


@pytest.mark.parametrize("style,rot,explicit", [("neox", None, False), ("interleaved", 32, True), ("neox", 64, True)])
def test_rotary_in_attention_on_cuda_equals_apply_rotary_then_attention(gen, style, rot, explicit):
    # The kernels rotate q and k tiles in shared memory with apply_rotary's arithmetic: the fused
    # call must equal apply_rotary followed by attention, bit for bit, and q/k stay untouched.
    b, sq, sk, h, hk, d = 2, 150, 190, 4, 2, 128
    q = rand((b, sq, h, d), torch.bfloat16, gen)
    k = rand((b, sk, hk, d), torch.bfloat16, gen)
    v = rand((b, sk, hk, d), torch.bfloat16, gen)
    q0, k0 = q.clone(), k.clone()
    if explicit:
        pos_q = torch.randint(0, 4000, (b, sq), dtype=torch.int32, generator=gen, device=DEV)
        pos_k = torch.randint(0, 4000, (b, sk), dtype=torch.int32, generator=gen, device=DEV)
    else:  # the defaults: query i at i + sk - sq, key j at j
        pos_q = (torch.arange(sq, dtype=torch.int32, device=DEV) + (sk - sq)).expand(b, sq).contiguous()
        pos_k = torch.arange(sk, dtype=torch.int32, device=DEV).expand(b, sk).contiguous()
    spec = flashcpp.Rotary(rotary_dim=rot, style=style, positions_q=pos_q if explicit else None,
                           positions_k=pos_k if explicit else None)
    fused = flashcpp.flash_attn_func(q, k, v, causal=True, rotary=spec)
    qr, _ = flashcpp.apply_rotary(q, None, pos_q, style=style, rotary_dim=rot)
    kr, _ = flashcpp.apply_rotary(k, None, pos_k, style=style, rotary_dim=rot)
    assert torch.equal(fused, flashcpp.flash_attn_func(qr, kr, v, causal=True))
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_in_attention_cuda_refuses_odd_pieces_with_a_sentence(gen):
    # The CUDA kernels rotate 8-byte pieces: neox needs rotary_dim % 8 == 0, interleaved % 4.
    q = rand((1, 128, 4, 64), torch.bfloat16, gen)
    with pytest.raises(NotImplementedError, match="rotary_dim 12 is not a multiple of 8"):
        flashcpp.flash_attn_func(q, q, q, rotary=flashcpp.Rotary(rotary_dim=12))
    with pytest.raises(NotImplementedError, match="apply_rotary"):
        flashcpp.attention(q, q, q, rotary=flashcpp.Rotary(rotary_dim=6, style="interleaved"))



@pytest.mark.parametrize("varlen", [False, True])
def test_rotary_k_out_receives_apply_rotarys_keys(gen, varlen):
    # The CUDA path rotates the keys once into a buffer before the kernel reads them:
    # Rotary(k_out=buf) is that buffer, and must hold apply_rotary's keys bit for bit, with the
    # attention output the same as without it. buf has strides of its own (SDPA's storage).
    b, sq, sk, h, hk, d = 2, 150, 190, 4, 2, 128
    q = rand((b, sq, h, d), torch.bfloat16, gen)
    k = rand((b, sk, hk, d), torch.bfloat16, gen)
    v = rand((b, sk, hk, d), torch.bfloat16, gen)
    pos_q = torch.randint(0, 4000, (b, sq), dtype=torch.int32, generator=gen, device=DEV)
    pos_k = torch.randint(0, 4000, (b, sk), dtype=torch.int32, generator=gen, device=DEV)
    kw = dict(rotary_dim=64, style="interleaved", positions_q=pos_q, positions_k=pos_k)
    want_k, _ = flashcpp.apply_rotary(k, None, pos_k, style="interleaved", rotary_dim=64)
    if varlen:  # the two sequences packed: (total, heads, d), positions (total,)
        q, k, v, want_k = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v, want_k))
        kw.update(positions_q=pos_q.reshape(-1), positions_k=pos_k.reshape(-1))
        cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device=DEV)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
        buf = torch.full((k.shape[1], k.shape[0], d), float("nan"), dtype=k.dtype, device=DEV).transpose(0, 1)
    else:
        extra = {}
        buf = torch.full((b, hk, sk, d), float("nan"), dtype=k.dtype, device=DEV).transpose(1, 2)
    k0 = k.clone()
    want, _ = flashcpp.attention(q, k, v, causal=True, rotary=flashcpp.Rotary(**kw), **extra)
    out, _ = flashcpp.attention(q, k, v, causal=True, rotary=flashcpp.Rotary(**kw, k_out=buf), **extra)
    assert torch.equal(out, want)
    assert torch.equal(buf, want_k)
    assert torch.equal(k, k0)
    if not varlen:  # flash_attn_func as well
        buf.fill_(float("nan"))
        out = flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(**kw, k_out=buf))
        assert torch.equal(out, want) and torch.equal(buf, want_k)


def test_rotary_k_out_in_place_and_compiled(gen):
    # k_out=k rotates k in place (what a model does before storing k in its cache); also through
    # torch.compile, which functionalizes the op's one mutated argument.
    b, s, h, d = 2, 200, 4, 64
    q, k, v = (rand((b, s, h, d), torch.float16, gen) for _ in range(3))
    want = flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary())
    want_k, _ = flashcpp.apply_rotary(k)
    kin = k.clone()
    out = flashcpp.flash_attn_func(q, kin, v, causal=True, rotary=flashcpp.Rotary(k_out=kin))
    assert torch.equal(out, want) and torch.equal(kin, want_k)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True, rotary=flashcpp.Rotary(k_out=k)),
        fullgraph=True)
    kin = k.clone()
    with torch.no_grad():
        assert torch.equal(compiled(q, kin, v), want)
    assert torch.equal(kin, want_k)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale_zero_is_a_scale_on_cuda(gen, causal):
    # 0.0 is a scale (uniform weights over the visible keys), not the default 1/sqrt(d); also with
    # ALiBi, which the kernels keep in q.k units (slope / scale stays finite)
    q, k, v = (rand((2, 300, 4, 128), torch.bfloat16, gen) * 4 for _ in range(3))
    vis = bottom_right_mask(300, 300, causal).double()
    want = torch.einsum("ij,bjhd->bihd", vis / vis.sum(-1, keepdim=True), v.double())
    # Tolerance: the bf16 rounding of the output itself (half an ulp, 2^-9 relative: rows that
    # average few keys, or ALiBi rows that weight one key, keep |out| up to ~18, where a fixed 3e-2
    # is below half an ulp) plus a small atol for the fp32 accumulation.
    def close(out, want):
        excess = (out.double() - want).abs() - (1e-2 + 2.0 ** -8 * want.abs())
        return excess.max().item() <= 0
    out = flashcpp.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal)
    assert close(out, want)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEV)
    i = torch.arange(300, device=DEV)[:, None]
    j = torch.arange(300, device=DEV)[None, :]
    bias = slopes[:, None, None].double() * (j - i)[None]  # (H, Nq, Nk)
    p = torch.softmax(bias.masked_fill(vis[None] == 0, float("-inf")), -1)
    want = torch.einsum("hij,bjhd->bihd", p, v.double())
    out = flashcpp.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal, alibi_slopes=slopes)
    assert close(out, want)
