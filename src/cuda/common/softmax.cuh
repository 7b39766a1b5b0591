// The online softmax on tensor-core accumulator fragments: the row algebra of
// common/attention_algebra.h applied to the scores a thread holds, shared by the sm80 prefill
// (mma.sync), sm90 prefill (wgmma) and split-KV decode kernels.
//
// Both instruction families lay a thread's fp32 accumulators out alike: per n8 column chunk j, four
// floats k = 0..3 with k = 2r + e holding row g + 8r (r = 0, 1) and column 2t + e of the chunk
// (lane = 4g + t). A row's values are spread over the 4 lanes of a quad, so a row reduction is the
// thread's own chunks, then two xor-shuffles. A fragment is passed as an accessor f(j, k) -> float&
// (the kernels keep different array shapes; after inlining the accessor is free).
#pragma once

#include "common/attention_algebra.h"

namespace flashcpp::cuda {

using algebra::RowSoftmax;

/// Max of row r over the thread's NC chunks and its quad, starting at `init`.
template <int NC, class Frag>
__device__ __forceinline__ float quad_row_max(Frag&& s, int r, float init) {
  float mx = init;
#pragma unroll
  for (int j = 0; j < NC; ++j) mx = fmaxf(mx, fmaxf(s(j, 2 * r), s(j, 2 * r + 1)));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

/// Sum of a per-thread partial over the row's quad (the epilogue's l).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/// One key block of the online softmax, in place: the raw scores of the fragment become P, both
/// rows fold the block into their (m, l), and corr[r] is the factor for row r of the output
/// accumulator (exactly 1 where the row's max did not move). c = ScoreTransform::c.
template <int NC, bool kLazy = false, class Frag>
__device__ __forceinline__ void softmax_block(Frag&& s, RowSoftmax (&row)[2], float c, float (&corr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    corr[r] = row[r].rescale<kLazy>(quad_row_max<NC>(s, r, row[r].m), c);
    const float mc = row[r].offset(c);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      const float p0 = row[r].p(s(j, 2 * r), c, mc);
      const float p1 = row[r].p(s(j, 2 * r + 1), c, mc);
      s(j, 2 * r) = p0;
      s(j, 2 * r + 1) = p1;
      sum += p0 + p1;
    }
    row[r].accumulate(corr[r], sum);  // a per-thread partial: quad_sum in the epilogue
  }
}

/// Output rows *= corr, over an accumulator fragment of NC chunks.
template <int NC, class Frag>
__device__ __forceinline__ void rescale_rows(Frag&& o, const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < NC; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) o(j, k) *= corr[k >> 1];
}

/// The same, skipped when no row of the warp moved its max (every corr exactly 1): past the first
/// key blocks a row's max rarely moves, and the rescale is most of the per-block vector work.
template <int NC, class Frag>
__device__ __forceinline__ void rescale_rows_if_moved(Frag&& o, const float (&corr)[2]) {
  if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
  rescale_rows<NC>(o, corr);
}

}  // namespace flashcpp::cuda
