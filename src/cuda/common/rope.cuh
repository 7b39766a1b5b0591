// Rotary embedding on the device, shared by apply_rotary (src/cuda/fused/rotary.cu), the rotary fused
// into the prefill kernels (fa2/fa3) and decode's append: the rotation and the angle's cos/sin are
// common/fused_math.h's (the CPU backends use the same functions), so a q or k rotated inside
// attention is bit for bit the q or k that apply_rotary writes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fused_math.h"

namespace flashcpp::cuda::rope {

using ::flashcpp::fused::cos_sin_angle;
using ::flashcpp::fused::rotate_pair;

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

/// cos/sin of rotary pair i at position pos: from the cache when there is one, else from the angle.
__device__ __forceinline__ void cos_sin(const float* cache, int half, int max_position, const double* inv_freq,
                                        std::int32_t pos, int i, float* c, float* sn) {
  if (cache)
    cos_sin_cached(cache, half, max_position, pos, i, c, sn);
  else
    cos_sin_angle(pos, inv_freq[i], c, sn);
}

}  // namespace flashcpp::cuda::rope
