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

using ::flashcpp::fused::CosSinTables;

/// cos/sin of rotary pair i at position pos from the tables; NaN for a position outside
/// [0, max_position) (poisons the row, never reads out of bounds).
__device__ __forceinline__ void cos_sin_table(const CosSinTables& t, std::int32_t pos, int i, float* c, float* sn) {
  if (pos >= 0 && pos < t.max_position) {
    const std::int64_t at = static_cast<std::int64_t>(pos) * t.stride + i;
    *c = __ldg(t.cos + at);
    *sn = __ldg(t.sin + at);
  } else {
    *c = *sn = __int_as_float(0x7fffffff);
  }
}

/// cos/sin of rotary pair i at position pos: from the tables when there are any, else from the angle.
__device__ __forceinline__ void cos_sin(const CosSinTables& t, const double* inv_freq, std::int32_t pos, int i, float* c,
                                        float* sn) {
  if (t.cos != nullptr)
    cos_sin_table(t, pos, i, c, sn);
  else
    cos_sin_angle(pos, inv_freq[i], c, sn);
}

}  // namespace flashcpp::cuda::rope
