// The rotary embedding fused into both prefill kernels (AttnRotary of attention.h), as one plain
// block of kernel parameters. `half` = 0 means off. The kernels rotate the q tile once after it
// lands in shared memory, in place, with the same rotation and cos/sin rule as apply_rotary
// (src/cuda/common/rope.cuh); the keys were rotated before the launch by a pre-pass with
// apply_rotary's kernel (rotate_keys, src/cuda/prefill/prefill_rotate_keys.cc). So the scores see
// exactly the q and k that a separate apply_rotary would have written.
#pragma once

#include <cstdint>

#include "common/fused_math.h"

namespace flashcpp::cuda {

struct PrefillRope {
  /// Pairs of rotated dims (rotary_dim / 2); 0 = no rotary. The kernels rotate 8-byte pieces:
  /// half % 4 == 0 for neox (a piece of the first half meets its partner piece half elements
  /// on), half % 2 == 0 for interleaved (a piece holds 2 adjacent pairs).
  int half = 0;
  int neox = 1;  ///< 1: pairs (i, i + half); 0: interleaved pairs (2i, 2i + 1)
  fused::CosSinTables tables;  ///< the spec's cos/sin tables; tables.cos null: angles from inv_freq
  const std::int32_t* positions_q = nullptr;  ///< null: query row i at i + len_k - len_q
  /// Without tables: fp64 inv_freq per pair (theta and Llama-3 scaling applied on the host by
  /// fused::inv_freq, as for apply_rotary). head_dim <= 256, so at most 128 pairs.
  double inv_freq[128] = {};
};

}  // namespace flashcpp::cuda
