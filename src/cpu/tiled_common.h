// What the tiled CPU backends (tiled.cc, the forward; tiled_backward.cc, the backward) share: where
// a sequence lives, and how a dot product becomes a score (the kernels' rule,
// common/attention_algebra.h: sign and scale, softcap, then ALiBi with the (batch, head)'s slope in
// raw units). One copy, so that the backward recomputes the P the forward used.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/attention_algebra.h"
#include "flashcpp/attention.h"

namespace flashcpp::cpu {

/// Where sequence b lives (the reference's convention; see attention.h).
struct Sequence {
  int len_q = 0, len_k = 0;
  std::int64_t first_q = 0, first_k = 0;  // token index when varlen, else b * seqlen
};

/// For AttnParams or AttnBackwardParams (their seqlens and mask mean the same).
template <class Params>
Sequence sequence(const Params& p, int b) {
  const MaskParams& m = p.mask;
  Sequence s;
  s.first_q = m.cu_seqlens_q ? m.cu_seqlens_q[b] : static_cast<std::int64_t>(b) * p.seqlen_q;
  s.len_q = std::max(m.cu_seqlens_q ? m.cu_seqlens_q[b + 1] - m.cu_seqlens_q[b] : p.seqlen_q, 0);
  s.first_k = m.cu_seqlens_k ? m.cu_seqlens_k[b] : static_cast<std::int64_t>(b) * p.seqlen_k;
  s.len_k = std::max(m.cu_seqlens_k ? m.cu_seqlens_k[b + 1] - m.cu_seqlens_k[b] : p.seqlen_k, 0);
  return s;
}

/// Element offset of row `row` of sequence b (first: its first token when varlen), head h.
inline std::int64_t row_offset(const TensorView& t, bool varlen, int b, std::int64_t first, std::int64_t row, int h) {
  const std::int64_t seq_base = varlen ? first * t.seq_stride : b * t.batch_stride;
  return seq_base + row * t.seq_stride + h * t.head_stride;
}

struct Logits {
  algebra::ScoreTransform score;
  bool softcap = false, alibi = false;
  float slope_raw = 0.f;

  /// For AttnParams or AttnBackwardParams (their mask and effective_scale() mean the same).
  template <class Params>
  static Logits make(const Params& p, int b, int h) {
    Logits g;
    const MaskParams& m = p.mask;
    g.score = algebra::ScoreTransform::make(p.effective_scale(), m.softcap);
    g.softcap = m.softcap > 0.f;
    g.alibi = m.alibi_slopes != nullptr;
    if (g.alibi) g.slope_raw = g.score.slope_raw(m.alibi_slopes[b * m.alibi_batch_stride + h]);
    return g;
  }
  /// The transformed score of dot product s, query position ia (bottom-right aligned), key j.
  float operator()(float s, int ia, int j) const {
    const float u = score.raw(s);
    return with_alibi(softcap ? score.softcap(u) : u, ia, j);
  }
  /// ALiBi's bias added to a score already scaled and softcapped (the backward keeps the scaled u
  /// for the softcap's chain rule).
  float with_alibi(float t, int ia, int j) const {
    return alibi ? algebra::alibi(t, slope_raw, static_cast<float>(j - ia)) : t;
  }
};

/// Sums rows [0, n) of a row-major array (rows `stride` apart, `width` used columns) into row 0,
/// pairwise: the upper half is added onto the lower half until one row is left (an odd middle
/// row waits a round). Every column is a binary-tree sum, vectorized across the columns.
/// Why a tree and not a running sum: the rounding error of a sum of n terms grows like n for a
/// running sum and like log2(n) for a tree. Over head_dim = 64..256 products, and again over Bc
/// keys for l and P.V, the running sums were the largest fp32 error against the fp64 reference
/// (up to ~1.8e-6 in O at head_dim 256); the tree brings it to a few 1e-7. The GPU's MMA units
/// also reduce the k dimension in hardware trees rather than one term at a time.
inline void pairwise_sum_rows(float* a, int n, int width, std::size_t stride) {
  while (n > 1) {
    const int half = n / 2, upper = n - half;
    for (int row = 0; row < half; ++row) {
      float* dst = a + static_cast<std::size_t>(row) * stride;
      const float* src = a + static_cast<std::size_t>(row + upper) * stride;
      for (int col = 0; col < width; ++col) dst[col] += src[col];
    }
    n = upper;
  }
}

}  // namespace flashcpp::cpu
