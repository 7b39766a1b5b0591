"""Attention with a block-sparse mask (``block_sparse=`` of flash_attn_func / attention /
select_kernel) on the CPU backends, against the fp64 reference given the same mask as a dense
bool array: odd lengths (1, 7, 130), blocks that do not divide them (ragged last blocks), full and
partial blocks, per-head masks with GQA, rows that see no key (O = 0, LSE = -inf), masks ANDed
with the other mask keywords; the equivalences with the causal flag and with varlen; the torch op
with a mask (CPU tensors, opcheck, torch.compile); and a sentence for every way a mask can be
wrong. The CUDA kernels are tested in test_torch_cuda.py.
"""
import dataclasses

import numpy as np
import pytest

import flashcpp
from attn_reference import alibi_slopes, attention_ref, tolerance, varlen_ref

try:
    import torch
except ImportError:  # CI has no torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
LSE_ATOL = 1e-4


def qkv(rng, B, Nq, Nk, Hq, Hkv, D=64, dtype=np.float32):
    r = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    return r(B, Nq, Hq, D), r(B, Nk, Hkv, D), r(B, Nk, Hkv, D)


def check(out, lse, ref_o, ref_lse, dtype):
    out = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out).all(), "out has non-finite values"
    err = np.abs(out - ref_o)
    assert err.max() <= tolerance(dtype), f"max abs err {err.max():.3g} (mean {err.mean():.3g})"
    lse = np.asarray(lse, dtype=np.float64)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "rows without keys must have LSE -inf"
    fin = np.isfinite(ref_lse)
    if fin.any():
        assert np.abs(lse[fin] - ref_lse[fin]).max() <= LSE_ATOL


def random_mask(rng, shape, region=5, p=0.5):
    """Regions of region x region pairs that are hidden, visible or random at density p (regions
    not aligned with the mask's blocks, so listed blocks are full, partial and ragged), and a few
    query rows that see no key at all."""
    *lead, nq, nk = shape
    kind = rng.integers(0, 3, size=(*lead, -(-nq // region), -(-nk // region)))
    kind = kind.repeat(region, axis=-2).repeat(region, axis=-1)[..., :nq, :nk]
    mask = (kind == 1) | ((kind == 2) & (rng.random(shape) < p))
    mask[..., rng.integers(0, nq, size=max(1, nq // 10)), :] = False
    return mask


SIZES = [(1, 1), (7, 7), (130, 130), (7, 130), (130, 7)]
BLOCKS = [(16, 16), (7, 3), (64, 128), (128, 128)]


@pytest.mark.parametrize("nq,nk", SIZES)
@pytest.mark.parametrize("bm,bn", BLOCKS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_random_per_head_masks_with_gqa(rng, nq, nk, bm, bn, dtype):
    B, Hq, Hkv = 2, 4, 2
    q, k, v = qkv(rng, B, nq, nk, Hq, Hkv, dtype=dtype)
    dense = random_mask(rng, (B, Hq, nq, nk))
    bs = flashcpp.block_sparse_from_mask(dense, bm, bn)
    assert (bs.num_batch, bs.num_heads) == (B, Hq)
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=bs, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (B, Hq, nq)
    ref_o, ref_lse = attention_ref(q, k, v, mask=dense)
    check(out, lse, ref_o, ref_lse, dtype)
    empty = ~dense.any(-1)  # (B, Hq, nq): rows that see nothing
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all() and np.isneginf(lse[empty]).all()


@pytest.mark.parametrize("nq,nk", SIZES)
@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_causal_block_mask_equals_the_causal_flag(rng, nq, nk, bm, bn):
    """Bottom-right causal as block-sparse, vs the reference written from the rule (not from
    to_dense), and vs the causal flag of the same call."""
    q, k, v = qkv(rng, 1, nq, nk, 4, 1)
    bs = flashcpp.causal_block_sparse(nq, nk, bm, bn)
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=bs, return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, causal=True)
    check(out, lse, ref_o, ref_lse, np.float32)
    flag_o, flag_lse = flashcpp.flash_attn_func(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, flag_o, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(flag_lse))


def test_shared_mask_anded_with_every_other_mask(rng):
    B, nq, nk, Hq, Hkv, D = 2, 130, 97, 4, 2, 128
    q, k, v = qkv(rng, B, nq, nk, Hq, Hkv, D)
    dense = random_mask(rng, (nq, nk), region=9, p=0.7)
    bs = flashcpp.block_sparse_from_mask(dense, 32, 64)
    slopes = alibi_slopes(Hq)
    kw = dict(causal=True, window_size=(40, -1), softcap=8.0, alibi_slopes=slopes)
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=bs, return_lse=True, **kw)
    ref_o, ref_lse = attention_ref(q, k, v, causal=True, window=(40, -1), softcap=8.0, alibi_slopes=slopes,
                                   mask=dense)
    check(out, lse, ref_o, ref_lse, np.float32)


def test_fp64_reference_backend_and_caller_outputs(rng):
    q, k, v = qkv(rng, 1, 33, 50, 2, 2)
    dense = random_mask(rng, (1, 2, 33, 50))
    bs = flashcpp.block_sparse_from_mask(dense, 8, 16)
    ref_o, ref_lse = attention_ref(q, k, v, mask=dense)
    out, lse = np.full_like(q, np.nan), np.full((1, 2, 33), np.nan, np.float32)
    flashcpp.attention(q, k, v, out=out, lse=lse, block_sparse=bs, backend="cpu-reference")
    check(out, lse, ref_o, ref_lse, np.float32)
    assert flashcpp.select_kernel(q, k, v, block_sparse=bs).kernel == "cpu_tiled_online_softmax"


def test_rows_and_masks_that_see_nothing(rng):
    q, k, v = qkv(rng, 2, 40, 30, 2, 1)
    dense = np.ones((40, 30), bool)
    dense[:9] = False      # whole query blocks with no listed block
    dense[20:23] = False   # empty rows inside a listed block
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=flashcpp.block_sparse_from_mask(dense, 8, 8),
                                        return_lse=True)
    ref_o, ref_lse = attention_ref(q, k, v, mask=dense)
    check(out, lse, ref_o, ref_lse, np.float32)
    assert (out[:, :9] == 0).all() and (out[:, 20:23] == 0).all()
    assert np.isneginf(lse[:, :, :9]).all() and np.isneginf(lse[:, :, 20:23]).all()

    nothing = flashcpp.block_sparse_from_mask(np.zeros((40, 30), bool), 16, 16)
    assert nothing.num_blocks == 0
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=nothing, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask_equals_varlen(rng, causal):
    lens_q, lens_k = [1, 7, 60, 0, 62], [3, 7, 60, 5, 55]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = qkv(rng, 1, int(cu_q[-1]), int(cu_k[-1]), 4, 2)
    bs = flashcpp.document_block_sparse(cu_q, cu_k, 16, 32, causal=causal)
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=bs, return_lse=True)
    ref_o, ref_lse = varlen_ref(q[0], k[0], v[0], cu_q, cu_k, causal=causal)
    check(out[0], lse[0], ref_o, ref_lse, np.float32)
    vo, vl = flashcpp.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, return_lse=True)
    np.testing.assert_allclose(out[0], vo, atol=2e-5, rtol=0)


# ---- torch tensors (CPU) ---------------------------------------------------------------------------

@needs_torch
def test_torch_cpu_with_numpy_or_tensor_arrays(rng):
    q, k, v = qkv(rng, 2, 70, 45, 4, 2)
    dense = random_mask(rng, (2, 1, 70, 45))
    bs = flashcpp.block_sparse_from_mask(dense, 16, 8)
    ref_o, ref_lse = attention_ref(q, k, v, mask=dense)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    for mask in (bs, bs.to("cpu")):  # numpy arrays (converted per call) or CPU tensors
        out, lse = flashcpp.flash_attn_func(qt, kt, vt, block_sparse=mask, return_lse=True)
        assert isinstance(out, torch.Tensor)
        check(out.numpy(), lse.numpy(), ref_o, ref_lse, np.float32)
    out, lse = flashcpp.flash_attn_func(q, k, v, block_sparse=bs.to("cpu"), return_lse=True)  # numpy q, tensors
    check(out, lse, ref_o, ref_lse, np.float32)
    for dtype in (torch.float16, torch.bfloat16):
        xs = [x.to(dtype) for x in (qt, kt, vt)]
        out = flashcpp.flash_attn_func(*xs, block_sparse=bs.to("cpu"))
        ref_o, _ = attention_ref(*(x.double().numpy() for x in xs), mask=dense)
        assert out.dtype == dtype and np.abs(out.double().numpy() - ref_o).max() <= tolerance(str(dtype))
    nothing = flashcpp.block_sparse_from_mask(np.zeros((70, 45), bool), 16, 16).to("cpu")
    out, lse = flashcpp.flash_attn_func(qt, kt, vt, block_sparse=nothing, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@needs_torch
def test_op_with_a_mask_opcheck_and_compile(rng):
    from flashcpp import _core
    q, k, v = (torch.from_numpy(x) for x in qkv(rng, 1, 20, 24, 4, 2))
    bs = flashcpp.block_sparse_from_mask(random_mask(rng, (1, 4, 20, 24)), 8, 16).to("cpu")
    tensors, sizes = _core.sparse_to_lists(_core.sparse_spec(bs))  # the op takes *tensors, sizes
    torch.library.opcheck(torch.ops.flashcpp.flash_attn_fwd.default,
                          (q, k, v, 0.125, False, -1, -1, 0.0, None, True, *tensors, sizes))
    eager = flashcpp.flash_attn_func(q, k, v, causal=True, block_sparse=bs)
    out, _ = torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, True, -1, -1, 0.0, None, False, *tensors, sizes)
    assert torch.equal(out, eager)

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, causal=True, block_sparse=bs),
                             fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v), eager)
    # the op checks its arguments itself, also at trace time (fake tensors)
    with pytest.raises(ValueError, match="both or neither"):
        torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, True, -1, -1, 0.0, None, False, *tensors, None)
    bad = list(sizes)
    bad[6] = 21  # seqlen_q
    with pytest.raises(ValueError, match="built for seqlen_q=21"):
        torch.ops.flashcpp.flash_attn_fwd(q, k, v, 0.125, True, -1, -1, 0.0, None, False, *tensors, bad)
    torch._dynamo.reset()
    other = flashcpp.block_sparse_from_mask(np.ones((20, 25), bool), 8, 16).to("cpu")
    with pytest.raises(Exception, match="built for seqlen_q=20, seqlen_k=25"):
        torch.compile(lambda q, k, v: flashcpp.flash_attn_func(q, k, v, block_sparse=other), fullgraph=True,
                      backend="aot_eager")(q, k, v)


# ---- errors ----------------------------------------------------------------------------------------

def problem(rng, B=2, nq=40, nk=30, Hq=4, Hkv=2):
    q, k, v = qkv(rng, B, nq, nk, Hq, Hkv)
    dense = random_mask(rng, (nq, nk))
    dense[:, [0, -1]] = True  # every row lists the first and the last key block
    return q, k, v, flashcpp.block_sparse_from_mask(dense, 8, 8)


def test_mask_for_another_problem(rng):
    q, k, v, bs = problem(rng)
    with pytest.raises(ValueError, match=r"built for seqlen_q=40, seqlen_k=30, but q and k have seqlen_q=39"):
        flashcpp.flash_attn_func(q[:, :39], k, v, block_sparse=bs)
    with pytest.raises(ValueError, match=r"seqlen_k=31"):
        flashcpp.flash_attn_func(q, np.concatenate([k, k[:, :1]], 1), np.concatenate([v, v[:, :1]], 1),
                                 block_sparse=bs)
    with pytest.raises(ValueError, match=r"num_heads 2 must be 1 \(one mask for every head\) or heads_q 4"):
        flashcpp.flash_attn_func(q, k, v, block_sparse=flashcpp.block_sparse_from_rules(40, 30, 8, 8, num_heads=2))
    with pytest.raises(ValueError, match=r"num_batch 3 must be 1 .* or batch 2"):
        flashcpp.flash_attn_func(q, k, v, block_sparse=flashcpp.block_sparse_from_rules(40, 30, 8, 8, num_batch=3))
    with pytest.raises(ValueError, match=r"has 5 x 3 blocks, but ceil\(seqlen_q 40 / block_m 8\) .* = 5 x 4"):
        flashcpp.flash_attn_func(q, k, v, block_sparse=dataclasses.replace(bs, num_k_blocks=3))
    with pytest.raises(ValueError, match="built for seqlen_q"):  # select_kernel validates the same way
        flashcpp.select_kernel(q[:, :39], k, v, block_sparse=bs)


@pytest.mark.parametrize("field,value,exc,match", [
    ("row_ptr", lambda a: a.astype(np.int64), TypeError, "block_sparse.row_ptr must be int32; got int64"),
    ("col_idx", lambda a: a.astype(np.uint32), TypeError, "block_sparse.col_idx must be int32"),
    ("partial", lambda a: a.astype(np.float32), TypeError, "block_sparse.partial must be int32"),
    ("element_masks", lambda a: a.astype(np.float64), TypeError, "must hold 64-bit words"),
    ("col_idx", lambda a: a.tolist(), TypeError, "numpy array or a torch tensor"),
    ("row_ptr", lambda a: a[:-1], ValueError, r"row_ptr must have shape \(num_batch \* num_heads \* num_q_blocks"),
    ("partial", lambda a: a[:-1], ValueError, "col_idx and partial must be 1-D"),
    ("element_masks", lambda a: a[:, :, None], ValueError, "element_masks must have shape"),
    ("element_masks", lambda a: a[:, :4], ValueError, r"\(num_partial, 8, 1\)"),
    ("col_idx", lambda a: np.repeat(a, 2)[::2], ValueError, "block_sparse.col_idx must be contiguous"),
])
def test_bad_arrays(rng, field, value, exc, match):
    q, k, v, bs = problem(rng)
    with pytest.raises(exc, match=match):
        flashcpp.flash_attn_func(q, k, v, block_sparse=dataclasses.replace(bs, **{field: value(getattr(bs, field))}))


def test_bad_values_get_the_validators_sentence(rng):
    """Values are read on the host (CPU backends): Python checks what bounds the C++ walk, the
    C++ validator says what is wrong with the CSR."""
    q, k, v, bs = problem(rng)

    def with_(**arrays):
        return dataclasses.replace(bs, **{n: np.array(a, dtype=getattr(bs, n).dtype) for n, a in arrays.items()})

    row_ptr, col_idx, partial = (np.array(getattr(bs, n)) for n in ("row_ptr", "col_idx", "partial"))
    cases = []
    rp = row_ptr.copy()
    rp[-1] -= 1
    cases.append((with_(row_ptr=rp), r"row_ptr\[-1\] = \d+ must equal the number of listed blocks"))
    rp = row_ptr.copy()
    rp[2] = rp[3] + 1
    cases.append((with_(row_ptr=rp), r"block_sparse.row_ptr\[3\] \d+ is less than row_ptr\[2\]"))
    ci = col_idx.copy()
    ci[0] = bs.num_k_blocks
    cases.append((with_(col_idx=ci), r"block_sparse.col_idx\[0\] 4 is outside \[0, num_k_blocks 4\)"))
    ci = col_idx.copy()
    ci[1] = ci[0]  # row 0 lists at least two blocks
    cases.append((with_(col_idx=ci), "must be strictly ascending within a row"))
    pa = partial.copy()
    pa[0] = bs.num_partial
    cases.append((with_(partial=pa), r"is outside \[-1, num_partial"))
    rp = row_ptr.copy()
    rp[0] = 1
    cases.append((with_(row_ptr=rp), r"block_sparse.row_ptr\[0\] is 1 \(must be 0\)"))
    for mask, match in cases:
        with pytest.raises(ValueError, match=match):
            flashcpp.flash_attn_func(q, k, v, block_sparse=mask)


def test_not_a_mask_and_varlen(rng):
    q, k, v, bs = problem(rng)
    with pytest.raises(TypeError, match="block_sparse must be a flashcpp.BlockSparse"):
        flashcpp.flash_attn_func(q, k, v, block_sparse=bs.to_dense())
    cu = np.array([0, 40], np.int32)
    with pytest.raises(NotImplementedError, match="varlen .* with a block-sparse mask .* document_block_sparse"):
        flashcpp.attention(q[0], k[0, :30], v[0, :30], cu_seqlens_q=cu, cu_seqlens_k=np.array([0, 30], np.int32),
                           max_seqlen_q=40, max_seqlen_k=30, block_sparse=bs)


@needs_torch
def test_torch_dtypes_and_devices(rng):
    q, k, v, bs = problem(rng)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    tb = bs.to("cpu")
    with pytest.raises(TypeError, match="block_sparse.row_ptr must be int32; got int64"):
        flashcpp.flash_attn_func(qt, kt, vt, block_sparse=dataclasses.replace(tb, row_ptr=tb.row_ptr.long()))
    with pytest.raises(TypeError, match="element_masks must hold 64-bit words"):
        flashcpp.flash_attn_func(qt, kt, vt, block_sparse=dataclasses.replace(tb, element_masks=tb.element_masks.int()))
    on_meta = bs.to("meta")  # another device, without a GPU
    with pytest.raises(ValueError, match=r"block_sparse.row_ptr must be on q's device \(cpu\); got meta"):
        flashcpp.flash_attn_func(qt, kt, vt, block_sparse=on_meta)
    with pytest.raises(ValueError, match="has arrays on meta, but q is a numpy array"):
        flashcpp.flash_attn_func(q, k, v, block_sparse=on_meta)
