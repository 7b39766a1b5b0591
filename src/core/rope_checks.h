// Scalar checks of a rotary embedding (style, rotary_dim, theta / Llama-3 scaling / cos-sin
// cache), shared by apply_rotary's validator (fused_validate.cc) and the rotary fused into
// attention (validate.cc). Header-only: the validate() fuzzer compiles validate.cc on its own.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/message.h"
#include "flashcpp/rope.h"
#include "flashcpp/status.h"

namespace flashcpp::detail {

/// `prefix` names the fields in the sentences ("" for RopeParams, "rotary." for AttnRotary);
/// rotary_dim 0 means head_dim here (the caller decides what 0 means).
inline Status check_rope_scalars(const char* prefix, int head_dim, int rotary_dim, RopeStyle style, double theta,
                                 const Llama3Scaling& s, const float* cos_sin_cache, int max_position) {
  const int rot = rotary_dim == 0 ? head_dim : rotary_dim;
  if (rotary_dim < 0 || rot % 2 != 0 || rot > head_dim)
    return Status::Invalid(cat(prefix, "rotary_dim ", rotary_dim, " must be even and in [2, head_dim ", head_dim,
                               "] (0 = head_dim)"));
  if (style != RopeStyle::kNeox && style != RopeStyle::kInterleaved)
    return Status::Invalid(cat(prefix, "style ", static_cast<int>(style), " is not a rotary style (1 = neox, 2 = interleaved)"));
  if (cos_sin_cache) {
    if (max_position < 1)
      return Status::Invalid(cat(prefix, "max_position ", max_position, " must be >= 1 with a cos_sin_cache"));
    if (reinterpret_cast<std::uintptr_t>(cos_sin_cache) % alignof(float) != 0)
      return Status::Invalid(cat(prefix, "cos_sin_cache ", static_cast<const void*>(cos_sin_cache),
                                 " is not 4-byte aligned (fp32)"));
    return Status::Ok();
  }
  if (!std::isfinite(theta) || theta <= 0.0) return Status::Invalid(cat(prefix, "theta ", theta, " must be finite and > 0"));
  if (s.enabled()) {
    if (!std::isfinite(s.factor) || s.factor < 1.f)
      return Status::Invalid(cat(prefix, "llama3.factor ", static_cast<double>(s.factor), " must be >= 1 (0 = off)"));
    if (!std::isfinite(s.low_freq_factor) || s.low_freq_factor <= 0.f)
      return Status::Invalid(
          cat(prefix, "llama3.low_freq_factor ", static_cast<double>(s.low_freq_factor), " must be > 0"));
    if (!std::isfinite(s.high_freq_factor) || s.high_freq_factor <= s.low_freq_factor)
      return Status::Invalid(cat(prefix, "llama3.high_freq_factor ", static_cast<double>(s.high_freq_factor),
                                 " must be greater than low_freq_factor ", static_cast<double>(s.low_freq_factor)));
    if (s.original_max_position < 1)
      return Status::Invalid(cat(prefix, "llama3.original_max_position ", s.original_max_position, " must be >= 1"));
  }
  return Status::Ok();
}

}  // namespace flashcpp::detail
