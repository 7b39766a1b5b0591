// The tile walk of attention as plain host/device arithmetic: which (query tile, key tile) pairs the
// forward visits, and, transposed, which query tiles the backward visits for a key tile; the order
// in which deterministic dQ accumulation adds them; the backward's workspace layout. The tiled CPU
// backward walks exactly this, and a GPU backward kernel (and its scheduler) calls the same
// functions, so CPU tests check the walk the kernels will run (tests/cpu/test_backward.cc).
//
// Forward (src/cpu/tiled.cc and the CUDA kernels, for one query tile of rows [i0, i1)):
//   MaskRules::key_range gives the keys [lo, hi) some row sees through its window and sink_hi the
//   global keys below lo; without block-sparse the walk visits key tiles floor(lo / bn) ..
//   ceil(hi / bn) - 1 and the sink tiles below them; with block-sparse it visits the sub-tiles of
//   the listed key blocks that meet [lo, hi) or lie below sink_hi. visit() answers that for one pair.
// Backward (per key tile n): the query tiles m in query_tiles(n) for which backward_visit(m, n)
//   holds. query_tiles bounds the rows that can see a key of the tile (an O(1) rule from the mask's
//   window arithmetic), and backward_visit keeps the forward's tile-level decision inside those
//   bounds; so every pair (i, j) that row i sees lies in a visited pair of tiles, the backward never
//   visits a pair the forward skips, and the elements it visits are masked as the forward masks them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/hd.h"
#include "common/mask_rules.h"
#include "flashcpp/attention.h"
#include "flashcpp/backward.h"

namespace flashcpp::walk {

/// BlockSparseMask::partial of a block listed whole (no element mask).
inline constexpr std::int32_t kFullBlock = -1;

/// The tiles of one (sequence, head): query tiles of up to bm rows, key tiles of up to bn keys. With
/// a block-sparse mask a tile never straddles a sparse block: bm and bn shrink to the block sizes
/// and each sparse block holds sub_m (sub_n) tiles, the last one of a block possibly shorter.
struct Tiles {
  int len_q = 0, len_k = 0;
  int bm = 0, bn = 0;
  int sparse_m = 0, sparse_n = 0;  ///< block-sparse block sizes; 0 = no block-sparse mask
  int sub_m = 1, sub_n = 1;        ///< tiles per sparse block

  /// bm, bn > 0; bs: the problem's block-sparse mask or null.
  FC_HD static Tiles make(int len_q, int len_k, int bm, int bn, const BlockSparseMask* bs) {
    Tiles t;
    t.len_q = len_q > 0 ? len_q : 0;
    t.len_k = len_k > 0 ? len_k : 0;
    t.bm = bm;
    t.bn = bn;
    if (bs) {
      t.sparse_m = bs->block_m;
      t.sparse_n = bs->block_n;
      if (t.bm > t.sparse_m) t.bm = t.sparse_m;
      if (t.bn > t.sparse_n) t.bn = t.sparse_n;
      t.sub_m = (t.sparse_m + t.bm - 1) / t.bm;
      t.sub_n = (t.sparse_n + t.bn - 1) / t.bn;
    }
    return t;
  }
  FC_HD bool sparse() const { return sparse_m > 0; }
  FC_HD int num_q_tiles() const {
    return sparse() ? (len_q + sparse_m - 1) / sparse_m * sub_m : (len_q + bm - 1) / bm;
  }
  FC_HD int num_k_tiles() const {
    return sparse() ? (len_k + sparse_n - 1) / sparse_n * sub_n : (len_k + bn - 1) / bn;
  }
  /// Rows [*i0, *i1) of query tile m (empty when the tile lies past the sequence).
  FC_HD void q_rows(int m, int* i0, int* i1) const { span(m, len_q, bm, sparse_m, sub_m, i0, i1); }
  /// Keys [*j0, *j1) of key tile n (empty when the tile lies past the sequence).
  FC_HD void k_cols(int n, int* j0, int* j1) const { span(n, len_k, bn, sparse_n, sub_n, j0, j1); }
  /// The query tile holding row i (0 <= i < len_q).
  FC_HD int q_tile_of(int i) const {
    if (!sparse()) return i / bm;
    const int blk = i / sparse_m;
    return blk * sub_m + (i - blk * sparse_m) / bm;
  }

 private:
  FC_HD static void span(int t, int len, int size, int block, int sub, int* a, int* b) {
    int lo, end;
    if (block > 0) {
      const int blk = t / sub;
      lo = blk * block + (t - blk * sub) * size;
      end = (blk + 1) * block;
    } else {
      lo = t * size;
      end = lo + size;
    }
    if (end > lo + size) end = lo + size;
    if (end > len) end = len;
    *a = lo;
    *b = end > lo ? end : lo;
  }
};

/// The listed key blocks of one query block of a block-sparse mask (one CSR row).
struct SparseRow {
  const std::int32_t* col = nullptr;      ///< ascending key-block indices
  const std::int32_t* partial = nullptr;  ///< kFullBlock or the element-mask index, per entry
  int count = 0;
};

/// The CSR row of (batch b, query head h, query block qb); empty past the mask's query blocks.
FC_HD SparseRow sparse_row(const BlockSparseMask& bs, int b, int h, int qb) {
  SparseRow r;
  if (qb < 0 || qb >= bs.num_q_blocks) return r;
  const std::int64_t row =
      (static_cast<std::int64_t>(bs.num_batch == 1 ? 0 : b) * bs.num_heads + (bs.num_heads == 1 ? 0 : h)) *
          bs.num_q_blocks +
      qb;
  const std::int32_t begin = bs.row_ptr[row];
  r.col = bs.col_idx + begin;
  r.partial = bs.partial + begin;
  r.count = bs.row_ptr[row + 1] - begin;
  return r;
}

/// The entry of key block kb in a CSR row (binary search: the row ascends), or -1 when not listed.
FC_HD int sparse_find(const SparseRow& r, int kb) {
  int lo = 0, hi = r.count;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (r.col[mid] < kb) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < r.count && r.col[lo] == kb ? lo : -1;
}

/// Bit c of row r of element mask `partial` (block_m x block_n bits, rows of ceil(block_n / 64) words).
FC_HD bool sparse_bit(const BlockSparseMask& bs, std::int32_t partial, int r, int c) {
  const int words_per_row = (bs.block_n + 63) / 64;
  const std::uint64_t word = bs.element_masks[(static_cast<std::int64_t>(partial) * bs.block_m + r) * words_per_row + c / 64];
  return (word >> (c % 64)) & 1u;
}

/// How a walk treats one (query tile, key tile) pair.
struct TileVisit {
  bool visit = false;      ///< the pair is walked
  bool need_mask = false;  ///< some element may be hidden (else every element is visible)
  std::int32_t partial = kFullBlock;  ///< block-sparse element mask of the pair, or kFullBlock
};

/// Whether the forward's walk of query tile m visits key tile n (header comment), for (batch b,
/// query head h); bs: the block-sparse mask or null. need_mask as the forward decides it: an
/// element mask, or a tile MaskRules cannot prove fully visible.
FC_HD TileVisit visit(const MaskRules& r, const Tiles& t, const BlockSparseMask* bs, int b, int h, int m, int n) {
  TileVisit v;
  int i0, i1, j0, j1;
  t.q_rows(m, &i0, &i1);
  t.k_cols(n, &j0, &j1);
  if (i0 >= i1 || j0 >= j1) return v;
  int lo, hi;
  r.key_range(i0, i1, &lo, &hi);
  const int sink = r.sink_hi(i0, i1, lo);
  if (bs == nullptr) {
    const int first = lo / t.bn, end = (hi + t.bn - 1) / t.bn;
    const int sink_end_raw = (sink + t.bn - 1) / t.bn;
    const int sink_end = sink_end_raw < first ? sink_end_raw : first;
    v.visit = (n >= first && n < end) || n < sink_end;
  } else {
    const SparseRow row = sparse_row(*bs, b, h, m / t.sub_m);
    const int entry = sparse_find(row, n / t.sub_n);
    if (entry < 0) return v;
    v.visit = (j0 < hi && j1 > lo) || j0 < sink;
    v.partial = row.partial[entry];
  }
  v.need_mask = v.partial != kFullBlock || !r.tile_fully_visible(i0, i1, j0, j1);
  return v;
}

/// Query tiles [*m_lo, *m_hi) that can hold a row seeing a key of key tile n: the rows i with
/// key_hi(i) > j0 and (key_lo(i) < j1 or a global key in the tile), bounded from the window
/// arithmetic of MaskRules (causal, window_right and global queries bound the first row;
/// window_left, global keys and global queries the last). A superset: filter with backward_visit.
FC_HD void query_tiles(const MaskRules& r, const Tiles& t, int n, int* m_lo, int* m_hi) {
  *m_lo = *m_hi = 0;
  int j0, j1;
  t.k_cols(n, &j0, &j1);
  if (j0 >= j1 || t.len_q == 0) return;
  const long long off = r.offset();
  // First row: causal needs ia >= j0, window_right ia + wr >= j0; a global query (the first rows)
  // ignores window_right.
  long long i_min = 0;
  if (r.causal && j0 - off > i_min) i_min = j0 - off;
  if (r.window_right >= 0 && !r.global_queries && j0 - off - r.window_right > i_min) i_min = j0 - off - r.window_right;
  // Last row (exclusive): window_left needs ia - wl <= j1 - 1, unless the tile holds a global key
  // (visible to every row that reaches it) or the row is a global query (ia < G).
  long long i_end = t.len_q;
  if (r.window_left >= 0 && j0 >= r.global_tokens) {
    i_end = j1 + static_cast<long long>(r.window_left) - off;
    if (r.global_queries && r.global_tokens - off > i_end) i_end = r.global_tokens - off;
    if (i_end > t.len_q) i_end = t.len_q;
  }
  if (i_min >= i_end) return;
  *m_lo = t.q_tile_of(static_cast<int>(i_min));
  *m_hi = t.q_tile_of(static_cast<int>(i_end - 1)) + 1;
}

/// The backward's decision for the pair (m, n): visit(m, n) inside query_tiles(n).
FC_HD TileVisit backward_visit(const MaskRules& r, const Tiles& t, const BlockSparseMask* bs, int b, int h, int m,
                               int n) {
  int lo, hi;
  query_tiles(r, t, n, &lo, &hi);
  if (m < lo || m >= hi) return TileVisit{};
  return visit(r, t, bs, b, h, m, n);
}

/// Deterministic dQ: the additions to query tile m's accumulator happen in ascending key-tile
/// order, so key tile n adds after exactly rank = #{n' < n : backward_visit(m, n')} others (it
/// waits for the tile's semaphore to reach rank, adds, and sets it to rank + 1). O(n) here; a
/// kernel can count incrementally while it walks m.
FC_HD int key_tile_rank(const MaskRules& r, const Tiles& t, const BlockSparseMask* bs, int b, int h, int m, int n) {
  int rank = 0;
  for (int k = 0; k < n; ++k) rank += backward_visit(r, t, bs, b, h, m, k).visit ? 1 : 0;
  return rank;
}

// ---- the backward's workspace ---------------------------------------------------------------------

/// Byte alignment of each part of the workspace (TMA and vector loads want 16; 256 keeps each part
/// on its own cache lines and DRAM bursts).
inline constexpr std::size_t kWorkspaceAlign = 256;

/// First padded row of sequence b (BackwardWorkspaceLayout): floor((first_q + b row_pad) / row_pad)
/// row_pad, with first_q the sequence's first packed row. Sequence b's padded rows end before
/// sequence b+1's start, and all of them before round_up(total_q + batch row_pad, row_pad).
FC_HD std::int64_t padded_row_start(std::int64_t first_q, int b, int row_pad) {
  return (first_q + static_cast<std::int64_t>(b) * row_pad) / row_pad * row_pad;
}

/// The layout for a problem of `batch` sequences whose packed query rows number at most `total_q`
/// (batch * seqlen_q, or the varlen packed count), with query tiles of row_pad rows.
inline BackwardWorkspaceLayout workspace_layout(int batch, std::int64_t total_q, int heads_q, int head_dim,
                                                int row_pad, bool deterministic) {
  BackwardWorkspaceLayout w;
  if (row_pad <= 0 || heads_q <= 0) return w;
  auto align = [](std::size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; };
  w.row_pad = row_pad;
  const std::int64_t rows = (total_q + static_cast<std::int64_t>(batch) * row_pad + row_pad - 1) / row_pad * row_pad;
  w.rows = rows;
  const std::size_t row_vec = align(static_cast<std::size_t>(heads_q) * static_cast<std::size_t>(rows) * sizeof(float));
  w.delta = 0;
  w.lse_log2 = w.delta + row_vec;
  w.dq_accum = w.lse_log2 + row_vec;
  w.semaphores = w.dq_accum + align(static_cast<std::size_t>(heads_q) * static_cast<std::size_t>(rows) *
                                    static_cast<std::size_t>(head_dim) * sizeof(float));
  const std::size_t sems =
      deterministic ? align(static_cast<std::size_t>(heads_q) * static_cast<std::size_t>(rows / row_pad) * sizeof(std::int32_t))
                    : 0;
  w.bytes = w.semaphores + sems;
  return w;
}

}  // namespace flashcpp::walk
