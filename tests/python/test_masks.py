"""flashcpp.alibi_slopes and the block-sparse builders (flashcpp/masks.py) on the host.

Slopes are checked against BLOOM's formula written again here. Every built mask is expanded by
a loop over its CSR arrays written here (independent of BlockSparse.to_dense, which is checked
too) and compared with the mask it came from, element by element, including ragged last blocks.
"""
import math

import numpy as np
import pytest

import flashcpp

try:
    import torch
except ImportError:  # CI has no torch
    torch = None


# ---- ALiBi ------------------------------------------------------------------------------------

def bloom_slopes(n):
    """BLOOM's build_alibi_tensor: base^power for the closest power of two, then odd powers of
    the base of twice as many heads."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, n - closest)
        slopes += [extra_base ** p for p in range(1, 1 + 2 * remaining, 2)]
    return np.array(slopes)


@pytest.mark.parametrize("n", [8, 12, 16, 20, 32, 40, 64])
def test_alibi_slopes_match_bloom(n):
    s = flashcpp.alibi_slopes(n)
    assert isinstance(s, np.ndarray) and s.dtype == np.float32 and s.shape == (n,)
    np.testing.assert_allclose(s, bloom_slopes(n), rtol=1e-7, atol=0)
    s[0] = 0  # the caller owns a writable copy


def test_alibi_slopes_known_values_and_errors():
    np.testing.assert_array_equal(flashcpp.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_array_equal(flashcpp.alibi_slopes(12)[8:], (2.0 ** (-0.5 - np.arange(4))).astype(np.float32))
    for bad in (0, -4):
        with pytest.raises(ValueError, match="num_heads"):
            flashcpp.alibi_slopes(bad)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_alibi_slopes_as_torch():
    t = flashcpp.alibi_slopes(20, device="cpu")
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), flashcpp.alibi_slopes(20))


# ---- block-sparse -----------------------------------------------------------------------------

def expand(bs):
    """Dense (num_batch, num_heads, seqlen_q, seqlen_k) bool mask from the CSR arrays, checking
    the builder's promises on the way (no empty listed block, partial blocks not full, no bits
    past the sequence ends, ascending columns)."""
    bm, bn, nq, nk = bs.block_m, bs.block_n, bs.seqlen_q, bs.seqlen_k
    words = (bn + 63) // 64
    assert bs.num_q_blocks == -(-nq // bm) and bs.num_k_blocks == -(-nk // bn)
    assert bs.row_ptr.dtype == np.int32 and bs.col_idx.dtype == np.int32 and bs.partial.dtype == np.int32
    assert bs.element_masks.dtype == np.uint64 and bs.element_masks.shape[1:] == (bm, words)
    rows = bs.num_batch * bs.num_heads * bs.num_q_blocks
    assert bs.row_ptr.shape == (rows + 1,) and bs.row_ptr[0] == 0 and bs.row_ptr[-1] == bs.num_blocks
    out = np.zeros((bs.num_batch, bs.num_heads, nq, nk), dtype=bool)
    full = 0
    for b in range(bs.num_batch):
        for h in range(bs.num_heads):
            for qb in range(bs.num_q_blocks):
                r = (b * bs.num_heads + h) * bs.num_q_blocks + qb
                cols = bs.col_idx[bs.row_ptr[r]:bs.row_ptr[r + 1]]
                assert np.all(np.diff(cols) > 0)
                for e in range(bs.row_ptr[r], bs.row_ptr[r + 1]):
                    kb, p = int(bs.col_idx[e]), int(bs.partial[e])
                    rows_in = min(bm, nq - qb * bm)
                    cols_in = min(bn, nk - kb * bn)
                    if p < 0:
                        block = np.ones((bm, bn), dtype=bool)
                        full += 1
                    else:
                        c = np.arange(bn)
                        word = bs.element_masks[p][:, c // 64]  # (bm, bn): the word holding column c
                        block = ((word >> (c % 64).astype(np.uint64)) & np.uint64(1)).astype(bool)
                        assert not block[rows_in:].any() and not block[:, cols_in:].any(), "bits past the end"
                        assert not block[:rows_in, :cols_in].all(), "a partial block that is full"
                    assert block[:rows_in, :cols_in].any(), "a listed block with no visible pair"
                    out[b, h, qb * bm:qb * bm + rows_in, kb * bn:kb * bn + cols_in] = block[:rows_in, :cols_in]
    assert bs.num_full_blocks == full
    assert bs.visible_pairs == int(out.sum())
    return out


def check_round_trip(bs, want):
    want = np.broadcast_to(want, (bs.num_batch, bs.num_heads, bs.seqlen_q, bs.seqlen_k))
    got = expand(bs)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} mismatches, first at (b, h, i, j) = {tuple(bad[0])}"
    np.testing.assert_array_equal(bs.to_dense(), want)


SIZES = [(1, 1), (7, 5), (64, 64), (100, 130), (129, 65)]
BLOCKS = [(1, 1), (7, 3), (16, 16), (32, 100), (128, 128)]


def block_structured(rng, shape, p):
    """Random mask with 16 x 16 regions that are hidden, visible, or random at density p."""
    nb, nh, nq, nk = shape
    kind = rng.integers(0, 3, size=(nb, nh, -(-nq // 16), -(-nk // 16)))
    kind = kind.repeat(16, axis=2).repeat(16, axis=3)[:, :, :nq, :nk]
    return (kind == 1) | ((kind == 2) & (rng.random(shape) < p))


@pytest.mark.parametrize("nq,nk", SIZES)
@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_dense_masks_round_trip(rng, nq, nk, bm, bn):
    for p in (0.1, 0.5, 0.97):
        dense = block_structured(rng, (2, 3, nq, nk), p)
        check_round_trip(flashcpp.block_sparse_from_mask(dense, bm, bn), dense)
    for dense in (np.ones((nq, nk), bool), np.zeros((nq, nk), bool), (np.arange(nq) % 3 != 0)[:, None] &
                  np.ones((nq, nk), bool)):  # all visible, all hidden, empty rows
        bs = flashcpp.block_sparse_from_mask(dense, bm, bn)
        assert (bs.num_batch, bs.num_heads) == (1, 1)
        check_round_trip(bs, dense)
    all_visible = flashcpp.block_sparse_from_mask(np.ones((nq, nk), bool), bm, bn)
    assert all_visible.num_full_blocks == all_visible.num_blocks == all_visible.num_q_blocks * all_visible.num_k_blocks
    assert all_visible.num_partial == 0 and all_visible.block_density == 1.0
    assert flashcpp.block_sparse_from_mask(np.zeros((nq, nk), bool), bm, bn).num_blocks == 0


def test_mask_functions_two_and_four_arguments(rng):
    nq, nk = 100, 130
    doc_q = np.sort(rng.integers(0, 4, nq))
    doc_k = np.sort(rng.integers(0, 4, nk))
    pair = lambda q, k: (doc_q[q] == doc_k[k]) & (k <= q + 30)  # noqa: E731
    bs = flashcpp.block_sparse_from_mask(pair, 32, 48, seqlen_q=nq, seqlen_k=nk)
    want = (doc_q[:, None] == doc_k[None, :]) & (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + 30)
    check_round_trip(bs, want)

    per_head = lambda b, h, q, k: ((q + 2 * k + b) % (h + 2) == 0) | (k < h)  # noqa: E731
    bs4 = flashcpp.block_sparse_from_mask(per_head, 16, 16, seqlen_q=nq, seqlen_k=nk, num_batch=2, num_heads=3)
    b, h, q, k = np.ix_(range(2), range(3), range(nq), range(nk))
    check_round_trip(bs4, per_head(b, h, q, k))

    # Not vectorizable (Python `if`): per-element evaluation on request.
    def scalar(q, k):
        if k <= q:
            return True
        return False
    with pytest.raises(TypeError, match="vectorized=False"):
        flashcpp.block_sparse_from_mask(scalar, 8, 8, seqlen_q=20, seqlen_k=20)
    bs_s = flashcpp.block_sparse_from_mask(scalar, 8, 8, seqlen_q=20, seqlen_k=20, vectorized=False)
    check_round_trip(bs_s, np.tri(20, dtype=bool))


def test_identical_partials_are_shared():
    shared = flashcpp.block_sparse_from_mask(np.tri(64, dtype=bool), 16, 16)
    separate = flashcpp.block_sparse_from_mask(np.tri(64, dtype=bool), 16, 16, share_identical_partials=False)
    assert shared.num_partial == 1 and separate.num_partial == 4
    assert shared.num_blocks == separate.num_blocks == 10
    check_round_trip(shared, np.tri(64, dtype=bool))
    check_round_trip(separate, np.tri(64, dtype=bool))


def rules_mask(nq, nk, causal=False, left=-1, right=-1, g=0, gq=False):
    """MaskParams visibility written from attention.h (bottom-right alignment)."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    ia = i + nk - nq
    global_key = j < g
    global_query = gq & (ia < g)
    vis = np.ones((nq, nk), dtype=bool)
    if causal:
        vis &= j <= ia
    if right >= 0:
        vis &= global_query | (j <= ia + right)
    if left >= 0:
        vis &= global_query | global_key | (j >= ia - left)
    return vis


@pytest.mark.parametrize("nq,nk", SIZES + [(33, 200), (200, 33)])
@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_rule_masks_match_attention_semantics(nq, nk, bm, bn):
    for causal, window, g, gq in [(True, (-1, -1), 0, False), (False, (16, 0), 0, False), (True, (10, -1), 3, False),
                                  (False, (4, 2), 5, True), (False, (1000, 1000), 0, False)]:
        bs = flashcpp.block_sparse_from_rules(nq, nk, bm, bn, causal=causal, window_size=window,
                                              global_tokens=g, global_queries=gq)
        want = rules_mask(nq, nk, causal, *window, g, gq)
        check_round_trip(bs, want)
        # the function route builds the same arrays
        fn = flashcpp.block_sparse_from_mask(want, bm, bn)
        for name in ("row_ptr", "col_idx", "partial", "element_masks"):
            np.testing.assert_array_equal(getattr(bs, name), getattr(fn, name), err_msg=name)
    check_round_trip(flashcpp.causal_block_sparse(nq, nk, bm, bn), rules_mask(nq, nk, causal=True))


@pytest.mark.parametrize("len_q,len_k", [([30, 1, 50, 19], [30, 1, 50, 19]), ([10, 40, 0, 25], [20, 40, 5, 25]),
                                         ([3, 0, 7], [0, 4, 9])])
@pytest.mark.parametrize("causal", [False, True])
def test_document_masks(len_q, len_k, causal):
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    bs = flashcpp.document_block_sparse(cu_q, cu_k, 32, 16, causal=causal)
    want = np.zeros((cu_q[-1], cu_k[-1]), dtype=bool)
    for d in range(len(len_q)):
        want[cu_q[d]:cu_q[d + 1], cu_k[d]:cu_k[d + 1]] = rules_mask(len_q[d], len_k[d], causal=causal)
    check_round_trip(bs, want)


def test_broadcast_shapes_repeat_the_mask():
    bs = flashcpp.block_sparse_from_rules(50, 60, 16, 16, causal=True, num_batch=2, num_heads=3)
    assert (bs.num_batch, bs.num_heads) == (2, 3)
    check_round_trip(bs, rules_mask(50, 60, causal=True))


def test_errors():
    with pytest.raises(ValueError, match="block_m and block_n"):
        flashcpp.block_sparse_from_mask(np.ones((4, 4), bool), 0, 16)
    with pytest.raises(ValueError, match="seqlen_q and seqlen_k"):
        flashcpp.block_sparse_from_mask(lambda q, k: k <= q, 16, 16)
    with pytest.raises(ValueError, match="num_heads"):
        flashcpp.block_sparse_from_mask(lambda q, k: k <= q, 16, 16, seqlen_q=4, seqlen_k=4, num_heads=2)
    with pytest.raises(TypeError, match="takes 3"):
        flashcpp.block_sparse_from_mask(lambda h, q, k: k <= q, 16, 16, seqlen_q=4, seqlen_k=4)
    with pytest.raises(TypeError, match="bools"):
        flashcpp.block_sparse_from_mask(np.ones((4, 4), np.float32), 16, 16)
    with pytest.raises(ValueError, match="shape"):
        flashcpp.block_sparse_from_mask(np.ones((2, 4, 4), bool), 16, 16)
    with pytest.raises(ValueError, match="num_heads=3 disagrees"):
        flashcpp.block_sparse_from_mask(np.ones((1, 2, 4, 4), bool), 16, 16, num_heads=3)
    with pytest.raises(ValueError, match="must be 0"):
        flashcpp.document_block_sparse([1, 4], [0, 4], 16, 16)
    with pytest.raises(ValueError, match="non-decreasing"):
        flashcpp.document_block_sparse([0, 4, 2], [0, 4, 8], 16, 16)
    with pytest.raises(ValueError, match=">= -1"):
        flashcpp.block_sparse_from_rules(8, 8, 4, 4, window_size=(-3, 0))


def test_arrays_outlive_the_builder():
    bs = flashcpp.block_sparse_from_mask(np.tri(100, dtype=bool), 16, 16)
    col_idx = bs.col_idx
    del bs
    import gc
    gc.collect()
    assert col_idx.shape[0] == 28 and col_idx.flags.writeable is False


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_inputs_and_conversion():
    dense = torch.rand(1, 2, 40, 50) < 0.5
    bs = flashcpp.block_sparse_from_mask(dense, 16, 32)
    check_round_trip(bs, dense.numpy())
    flex_style = lambda b, h, q, k: torch.where(k <= q, True, False)  # noqa: E731  (torch-only function)
    bs2 = flashcpp.block_sparse_from_mask(flex_style, 16, 16, seqlen_q=40, seqlen_k=40)
    check_round_trip(bs2, np.tri(40, dtype=bool))
    t = bs2.to("cpu")
    assert isinstance(t.col_idx, torch.Tensor) and t.col_idx.dtype == torch.int32
    np.testing.assert_array_equal(t.to_dense(), bs2.to_dense())
