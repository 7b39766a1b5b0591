"""The block-sparse cases of the masks benchmark (python/flashcpp/bench/masks.py) on the CPU, at
small sizes: the random block grid, flashcpp's BlockSparse of each case against the mask function
evaluated densely (numpy, and torch index arrays as FlexAttention calls it), the exact pair count
the TFLOP/s use, FlexAttention's BlockMask of the same function listing the same blocks, and
attention with the built mask against the fp64 reference. The timed run needs a GPU
(``python -m flashcpp.bench masks``)."""
import numpy as np
import pytest

import flashcpp
from attn_reference import attention_ref, tolerance
from flashcpp.bench import masks as bench

try:
    import torch
except ImportError:  # CI has no torch
    torch = None


def listed_blocks(bs):
    """(num_q_blocks, num_k_blocks) bool: which blocks the CSR lists (one mask for all b, h)."""
    out = np.zeros((bs.num_q_blocks, bs.num_k_blocks), dtype=bool)
    for r in range(bs.num_q_blocks):
        out[r, bs.col_idx[bs.row_ptr[r]:bs.row_ptr[r + 1]]] = True
    return out


def test_cases_are_listed():
    assert set(bench.QUICK) <= set(bench.CASES) and set(bench.SPARSE_CASES) <= set(bench.CASES)
    assert "block_sparse" in bench.QUICK
    for case in bench.CASES:
        assert bench.mask_description(case)


def test_block_grid_at_the_benchmark_size():
    kinds = bench.block_kinds()
    nb = bench.N // bench.BS_BLOCK
    assert kinds.shape == (nb, nb) and (np.diag(kinds) == 2).all()
    off = kinds[~np.eye(nb, dtype=bool)]
    assert abs((off > 0).mean() - bench.BS_DENSITY) < 0.05  # about half of the blocks
    assert 0.05 < (off == 2).sum() / (off > 0).sum() < 0.15  # a few partial ones
    np.testing.assert_array_equal(kinds, bench.block_kinds())  # deterministic: one mask per run


@pytest.mark.parametrize("n,block", [(512, 128), (300, 64), (100, 7)])
def test_block_sparse_case(rng, n, block):
    kinds = bench.block_kinds(n, block)
    fn = bench.block_sparse_mask_fn(kinds, block)
    dense = fn(np.arange(n)[:, None], np.arange(n)[None, :])
    assert dense.any(-1).all(), "every query row sees at least itself"
    bs = bench.build_block_sparse("block_sparse", n, block)
    assert (bs.block_m, bs.block_n, bs.num_batch, bs.num_heads) == (block, block, 1, 1)
    np.testing.assert_array_equal(bs.to_dense()[0, 0], dense)
    np.testing.assert_array_equal(listed_blocks(bs), kinds > 0)
    assert bs.visible_pairs == bench.block_sparse_pairs(kinds, n, block) == int(dense.sum())
    assert bs.num_full_blocks == int((kinds == 1).sum())  # a triangle is never full, even ragged

    q, k, v = (rng.standard_normal((1, n, 2, 64)).astype(np.float32) for _ in range(3))
    out = flashcpp.flash_attn_func(q, k, v, block_sparse=bs)
    ref, _ = attention_ref(q, k, v, mask=dense)
    assert np.abs(out - ref).max() <= tolerance(np.float32)


def test_document_case():
    docs = (256, 128, 128)
    n = sum(docs)
    bs = bench.build_block_sparse("document_bs", n, 128, docs)
    doc = np.repeat(np.arange(len(docs)), docs)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    np.testing.assert_array_equal(bs.to_dense()[0, 0], (doc[:, None] == doc[None, :]) & (j <= i))
    assert bs.visible_pairs == sum(d * (d + 1) // 2 for d in docs)
    bs_full = bench.build_block_sparse("document_bs")  # the benchmark's size: documents on block bounds
    assert bs_full.seqlen_q == bench.N and bs_full.visible_pairs == bench.visible_pairs("document_bs")
    assert bs_full.num_partial == 1  # the diagonal blocks share one triangle
    with pytest.raises(AssertionError, match="must fill"):
        bench.build_block_sparse("document_bs", n + 1, 128, docs)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_flex_sees_the_same_mask():
    n, block = 512, 128
    kinds = bench.block_kinds(n, block)
    fn_t = bench.block_sparse_mask_fn(torch.from_numpy(kinds), block)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bs = bench.build_block_sparse("block_sparse", n, block)
    np.testing.assert_array_equal(fn_t(i, j).numpy(), bs.to_dense()[0, 0])  # the dense reference's route
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        pytest.skip("this torch has no FlexAttention")
    mask_mod, score_mod = bench.make_masks("block_sparse", None, None, torch.from_numpy(kinds))
    assert score_mod is None
    bm = create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=block)
    np.testing.assert_array_equal(bm.to_dense()[0, 0].numpy().astype(bool), listed_blocks(bs))
    assert int(bm.full_kv_num_blocks.sum()) == bs.num_full_blocks
