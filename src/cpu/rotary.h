// The (cos, sin) of a RotarySpec (flashcpp/rope.h) on the CPU backends: read from its tables
// (any stride, either layout) or formed from theta and the Llama-3 scaling by the rule every
// rotary path shares (common/fused_math.h). apply_rotary (cpu/fused.cc) and decode's append and
// q rotation (cpu/decode.cc) both read their angles here, and attention's rotary goes through
// apply_rotary, so one spec gives the same bits through every CPU entry point.
#pragma once

#include <cstdint>
#include <vector>

#include "common/fused_math.h"
#include "flashcpp/rope.h"

namespace flashcpp::cpu {

class RotaryAngles {
 public:
  /// `r` must outlive this object and be validated (check_rotary_spec) and enabled.
  RotaryAngles(const RotarySpec& r, int head_dim)
      : r_(r), half_(r.effective_rotary_dim(head_dim) / 2), stride_(r.effective_table_stride(head_dim)) {
    if (!r.has_tables()) {
      inv_freq_.resize(static_cast<std::size_t>(half_));
      for (int i = 0; i < half_; ++i) inv_freq_[i] = rotary_inv_freq(i, 2 * half_, r.theta, r.llama3);
    }
  }

  int half() const noexcept { return half_; }

  /// cos and sin of pair i at position pos; with tables pos must lie in [0, max_position) (the
  /// validators read the positions on the CPU and refuse others).
  void at(std::int32_t pos, int i, float* c, float* s) const {
    if (r_.has_tables()) {
      const std::int64_t at = static_cast<std::int64_t>(pos) * stride_ + i;
      *c = r_.cos[at];
      *s = r_.sin[at];
    } else {
      fused::cos_sin_angle(pos, inv_freq_[static_cast<std::size_t>(i)], c, s);
    }
  }

 private:
  const RotarySpec& r_;
  int half_;
  std::int64_t stride_;
  std::vector<double> inv_freq_;  // empty with tables
};

}  // namespace flashcpp::cpu
