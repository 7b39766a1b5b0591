// Device side of the prefill masks, shared by the sm80 (fa2) and sm90 (fa3) kernels:
//   - CtaWork: one CTA's (sequence, head) problem: the sequence's lengths and first rows (varlen),
//     its LSE row, and the key tiles it visits, in order;
//   - the ALiBi slope of a (batch, head) in raw q.k units (common/attention_algebra.h says why);
//   - the element mask of a boundary or partial key tile, on an accumulator fragment.
//
// Key tiles a CTA visits (work proportional to the unmasked blocks):
//   window walk (no block-sparse mask): the tiles of MaskRules::key_range, last to first (the
//     diagonal tiles that need masking come first), then the attention-sink tiles (global keys)
//     that lie entirely below the window, again last to first. Same walk as the tiled CPU
//     backend (src/cpu/tiled.cc), so both visit exactly the same tiles.
//   block-sparse walk: the listed key blocks of the CTA's mask row, last to first, each split
//     into bs_block_n / BlockN tiles. MaskRules still applies element by element (the mask
//     kinds AND together), so causal/window flags combine with a block-sparse mask.
// A tile needs the element mask only when it holds a boundary of the rules or is a partial
// block; every other tile skips it.
#pragma once

#include <cstdint>

#include "common/mask_rules.h"
#include "cuda/prefill/prefill_mask.h"

namespace flashcpp::cuda {

/// One key tile of a CTA's walk.
struct KeyTile {
  int n0;       ///< first key (sequence-local) of the tile
  int partial;  ///< block-sparse element mask index, -1 = none (full block or no sparse mask)
  int c0;       ///< column of n0 inside its block-sparse block (0 without a sparse mask)
};

/// What one CTA computes: rows [m0, m_end) of one (sequence, head), over n_iters key tiles.
struct CtaWork {
  MaskRules rules;             ///< the rules with this sequence's lengths
  std::int64_t q_row0 = 0;     ///< varlen: packed row of the sequence's first query (else 0)
  std::int64_t k_row0 = 0;     ///< varlen: packed row of the sequence's first key (else 0)
  std::int64_t lse_row0 = 0;   ///< index in lse of query row 0 of this (sequence, head)
  int m_end = 0;               ///< min(m0 + BlockM, len_q)
  int n_iters = 0;             ///< key tiles to visit
  int n_window = 0, n_last = 0, sink_last = 0;  ///< window walk: see key_tile()
  const std::int32_t* bs_cols = nullptr;     ///< block-sparse: this CTA's listed key blocks
  const std::int32_t* bs_partial = nullptr;  ///< ... and their element-mask indices
  int bs_sub = 1;              ///< key tiles per block-sparse block
  int bs_q0 = 0;               ///< first query row of the CTA's block-sparse block
  int bs_last_block = 0;       ///< num_k_blocks - 1 (device arrays are clamped to the grid)
  int bs_last_partial = -1;    ///< num_partial - 1

  /// The it-th key tile (0 <= it < n_iters).
  template <int BN>
  __device__ __forceinline__ KeyTile key_tile(int it) const {
    if (bs_cols != nullptr) {
      const int x = n_iters - 1 - it;
      const int e = x / bs_sub, sub = x - e * bs_sub;
      const int kb = min(max(__ldg(bs_cols + e), 0), bs_last_block);
      const int partial = min(max(__ldg(bs_partial + e), -1), bs_last_partial);
      return KeyTile{(kb * bs_sub + sub) * BN, partial, sub * BN};
    }
    const int tile = it < n_window ? n_last - it : sink_last - (it - n_window);
    return KeyTile{tile * BN, -1, 0};
  }
  /// Only the first key of the it-th tile (no element-mask lookups): for the loads.
  template <int BN>
  __device__ __forceinline__ int key_n0(int it) const {
    if (bs_cols != nullptr) {
      const int x = n_iters - 1 - it;
      const int e = x / bs_sub;
      const int kb = min(max(__ldg(bs_cols + e), 0), bs_last_block);
      return (kb * bs_sub + (x - e * bs_sub)) * BN;
    }
    return (it < n_window ? n_last - it : sink_last - (it - n_window)) * BN;
  }
};

static_assert(sizeof(CtaWork) <= kCtaWorkBytes && alignof(CtaWork) <= 16, "CtaWork fits its shared-memory slot");

/// Fills *w for the CTA of query rows [m0, m0 + BM) of (batch b, head h). Returns false when the
/// CTA lies past its sequence's end (varlen: the grid is sized by the longest sequence); the
/// whole CTA then exits before touching memory. P is Fa2Params or Fa3Params (same field names).
template <int BM, int BN, class P>
__device__ __forceinline__ bool make_cta_work(const P& p, int b, int h, int m0, CtaWork* w) {
  const PrefillMask& mk = p.mask;
  w->rules = p.rules;
  if (mk.flags & PrefillMask::kVarlen) {
    const int q0 = __ldg(mk.cu_seqlens_q + b), q1 = __ldg(mk.cu_seqlens_q + b + 1);
    const int k0 = __ldg(mk.cu_seqlens_k + b), k1 = __ldg(mk.cu_seqlens_k + b + 1);
    w->rules.seqlen_q = min(max(q1 - q0, 0), p.seqlen_q);
    w->rules.seqlen_k = min(max(k1 - k0, 0), p.seqlen_k);
    w->q_row0 = q0;
    w->k_row0 = k0;
    // LSE of varlen is (heads_q, total_q), total_q = mask.total_q or cu_seqlens_q[batch] (attention.h).
    const std::int64_t lse_rows = mk.lse_rows > 0 ? mk.lse_rows : __ldg(mk.cu_seqlens_q + p.batch);
    w->lse_row0 = static_cast<std::int64_t>(h) * lse_rows + q0;
  } else {
    w->lse_row0 = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q;
  }
  if (m0 >= w->rules.seqlen_q) return false;
  w->m_end = min(m0 + BM, w->rules.seqlen_q);

  if (mk.flags & PrefillMask::kSparse) {
    const int qb = m0 / mk.bs_block_m;  // BM divides bs_block_m: the CTA lies in one mask row
    const std::int64_t row =
        (static_cast<std::int64_t>(mk.bs_per_batch ? b : 0) * mk.bs_num_heads + (mk.bs_num_heads == 1 ? 0 : h)) *
            mk.bs_num_q_blocks + qb;
    const int e0 = __ldg(mk.bs_row_ptr + row), e1 = __ldg(mk.bs_row_ptr + row + 1);
    w->bs_cols = mk.bs_col_idx + e0;
    w->bs_partial = mk.bs_partial + e0;
    w->bs_sub = mk.bs_block_n / BN;
    w->bs_q0 = qb * mk.bs_block_m;
    w->bs_last_block = mk.bs_num_k_blocks - 1;
    w->bs_last_partial = mk.bs_num_partial - 1;
    w->n_iters = e1 > e0 ? (e1 - e0) * w->bs_sub : 0;
    return true;
  }
  int lo, hi;
  w->rules.key_range(m0, w->m_end, &lo, &hi);
  const int first = lo / BN;
  w->n_window = hi > lo ? (hi + BN - 1) / BN - first : 0;
  w->n_last = first + w->n_window - 1;
  // Sink tiles: the global keys below the window. A tile that also holds window keys is already
  // a window tile (so the sink walk stops below `first`), unless the window is empty.
  const int sink_hi = w->rules.sink_hi(m0, w->m_end, lo);
  int n_sink = (sink_hi + BN - 1) / BN;
  if (w->n_window > 0 && n_sink > first) n_sink = first;
  w->sink_last = n_sink - 1;
  w->n_iters = w->n_window + n_sink;
  return true;
}

/// Iterations [lo, hi) of a CTA's walk whose tiles need neither a score modifier nor the element
/// mask: window-walk tiles lying wholly inside every row's [key_lo, key_hi). The loops test `it`
/// against these two registers and skip the record lookups and the visibility test, which put
/// shared-memory loads and ~20 integer ops between Q K^T and the softmax of every tile.
/// Conservative (a subset of MaskRules::tile_fully_visible); empty with softcap, ALiBi or a
/// block-sparse mask, whose tiles all take the full path.
struct PlainIters {
  int lo = 0, hi = 0;
  __device__ __forceinline__ bool contains(int it) const { return it >= lo && it < hi; }
};
template <int BN, class P>
__device__ __forceinline__ PlainIters plain_iters(const P& p, const CtaWork& w, int m0) {
  PlainIters r;
  if (w.bs_cols != nullptr || (p.mask.flags & (PrefillMask::kSoftcap | PrefillMask::kAlibi))) return r;
  w.rules.plain_window_iters(m0, w.m_end, BN, w.n_last, w.n_window, &r.lo, &r.hi);
  return r;
}

/// A CTA's key walk kept in one register when it is window tiles only (no block-sparse list, no
/// sink tiles): tile it is last - it. Otherwise (last = -1) the lookups read the shared-memory
/// record, as CtaWork::key_tile / key_n0 do.
struct RegWalk {
  int last = -1;
  template <int BN>
  __device__ __forceinline__ KeyTile key_tile(const CtaWork& w, int it) const {
    return last >= 0 ? KeyTile{(last - it) * BN, -1, 0} : w.key_tile<BN>(it);
  }
  template <int BN>
  __device__ __forceinline__ int key_n0(const CtaWork& w, int it) const {
    return last >= 0 ? (last - it) * BN : w.key_n0<BN>(it);
  }
};
__device__ __forceinline__ RegWalk reg_walk(const CtaWork& w) {
  return RegWalk{w.bs_cols == nullptr && w.n_iters == w.n_window ? w.n_last : -1};
}

/// Whether the tile of query rows [m0, m0 + BM) of batch b has rows: make_cta_work's test alone
/// (varlen: m0 inside this sequence's length), for the roles that read the record from shared
/// memory instead of computing it.
template <class P>
__device__ __forceinline__ bool tile_exists(const P& p, int b, int m0) {
  if (!(p.mask.flags & PrefillMask::kVarlen)) return m0 < p.seqlen_q;
  const int len = __ldg(p.mask.cu_seqlens_q + b + 1) - __ldg(p.mask.cu_seqlens_q + b);
  return m0 < min(max(len, 0), p.seqlen_q);
}

/// Element-mask words of query row `r` (inside its block-sparse block) for the key tile that
/// starts at column c0 of the block: bit (c0 % 64 + c) of word (c / 64) is key c of the tile.
/// Needs BN % 64 == 0 (c0 % 64 == 0) or 64 % BN == 0 (the tile lies in one word).
__device__ __forceinline__ const std::uint64_t* sparse_row_bits(const PrefillMask& mk, int partial, int r, int c0) {
  return mk.bs_bits + (static_cast<std::int64_t>(partial) * mk.bs_block_m + r) * mk.bs_words + (c0 >> 6);
}

/// ALiBi slope of (b, h) in raw q.k units (0 when ALiBi is off).
template <class P>
__device__ __forceinline__ float alibi_slope_raw(const P& p, int b, int h) {
  const PrefillMask& mk = p.mask;
  if (!(mk.flags & PrefillMask::kAlibi)) return 0.f;
  return p.score.slope_raw(__ldg(mk.alibi_slopes + b * mk.alibi_batch_stride + h));
}

/// The element mask of one row of a boundary or partial key tile: the scores of the keys query
/// row i does not see become -inf. s(j, 2r + e) is key kt.n0 + 8j + 2t + e of the row (the
/// accumulator layout of common/softmax.cuh), NC chunks = BN / 8 keys. kSparseBits: also read the
/// block-sparse element bits of a partial block (kt.partial >= 0), one 64-bit word at a time next to
/// its use (the ping-pong consumer, short of registers, passes false: dispatch gives it no
/// block-sparse masks). bs_q0: the first query row of the CTA's block-sparse block.
template <int NC, bool kSparseBits, class Frag>
__device__ __forceinline__ void mask_row(Frag&& s, int r, int i, int t, const KeyTile& kt, const MaskRules& rules,
                                         const PrefillMask& mk, int bs_q0) {
  constexpr int BN = 8 * NC;
  static_assert(!kSparseBits || BN % 64 == 0 || 64 % BN == 0, "a key tile covers whole 64-bit words or lies in one");
  constexpr int kWords = kSparseBits && BN >= 64 ? BN / 64 : 1;  // element-mask words a tile row spans
  constexpr int kChunksPerWord = NC / kWords;
  const int hi = rules.key_hi(i), lo = rules.key_lo(i);
  const std::uint64_t* rb = nullptr;
  if constexpr (kSparseBits)
    if (kt.partial >= 0) rb = sparse_row_bits(mk, kt.partial, i - bs_q0, kt.c0);
  const int bit0 = (kt.c0 & 63) + 2 * t;
#pragma unroll
  for (int wd = 0; wd < kWords; ++wd) {
    const std::uint64_t bits = rb != nullptr ? __ldg(rb + wd) : ~0ull;
#pragma unroll
    for (int jj = 0; jj < kChunksPerWord; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = wd * kChunksPerWord + jj;
        const int col = kt.n0 + 8 * j + 2 * t + e;
        const bool bit = !kSparseBits || ((bits >> (bit0 + 8 * jj + e)) & 1u);
        if (!(col < hi && (col >= lo || col < rules.global_tokens) && bit)) s(j, 2 * r + e) = -INFINITY;
      }
  }
}

/// mask_row for the lean-mask configs (TileConfig::lean_mask: no window, sinks or block-sparse
/// mask): only the keys at or past the row's causal or sequence end become -inf.
template <int NC, class Frag>
__device__ __forceinline__ void mask_row_lean(Frag&& s, int r, int i, int t, int n0, const MaskRules& rules) {
  const int hi = rules.causal_key_hi(i);
#pragma unroll
  for (int j = 0; j < NC; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (n0 + 8 * j + 2 * t + e >= hi) s(j, 2 * r + e) = -INFINITY;
}

}  // namespace flashcpp::cuda
