// Rotary embedding math shared by apply_rotary (src/cuda/fused/rotary.cu) and the rotary fused into
// the prefill kernels (fa2/fa3): one rotation expression and one cos/sin rule, so a q or k rotated
// inside attention is bit for bit the q or k that apply_rotary writes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fused_math.h"

namespace flashcpp::cuda::rope {

/// (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), fp32, with the FMAs spelled out so that every kernel
/// that includes this rounds the same way (not left to the compiler's contraction).
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, float c, float s) {
  const float a = x0, b = x1;
  x0 = fmaf(a, c, -(b * s));
  x1 = fmaf(b, c, a * s);
}

/// cos/sin of rotary pair i at position pos from an fp32 cache of rows [cos(half) | sin(half)]; NaN
/// for a position outside [0, max_position) (poisons the row, never reads out of bounds).
__device__ __forceinline__ void cos_sin_cached(const float* cache, int half, int max_position, std::int32_t pos, int i,
                                               float* c, float* sn) {
  if (pos >= 0 && pos < max_position) {
    const float* row = cache + static_cast<std::int64_t>(pos) * (2 * half);
    *c = __ldg(row + i);
    *sn = __ldg(row + half + i);
  } else {
    *c = *sn = __int_as_float(0x7fffffff);
  }
}

/// cos/sin of the fp64-reduced angle pos * inv_freq (|angle| <= pi there: the hardware sin/cos is
/// within ~4e-7).
__device__ __forceinline__ void cos_sin_angle(std::int32_t pos, double inv_freq, float* c, float* sn) {
  __sincosf(::flashcpp::fused::reduced_angle(pos, inv_freq), sn, c);
}

/// cos/sin of rotary pair i at position pos: from the cache when there is one, else from the angle.
__device__ __forceinline__ void cos_sin(const float* cache, int half, int max_position, const double* inv_freq,
                                        std::int32_t pos, int i, float* c, float* sn) {
  if (cache)
    cos_sin_cached(cache, half, max_position, pos, i, c, sn);
  else
    cos_sin_angle(pos, inv_freq[i], c, sn);
}

}  // namespace flashcpp::cuda::rope
