// Checks of a RotarySpec (rope.h), shared by the validators of every rotary path:
// apply_rotary (fused_validate.cc), the rotary fused into attention (validate.cc) and decode
// (decode_validate.cc), so one spec is accepted or refused with the same sentence everywhere.
// Header-only: the validate() fuzzer compiles validate.cc on its own.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "core/message.h"
#include "flashcpp/rope.h"
#include "flashcpp/status.h"

namespace flashcpp::detail {

/// The scalars of an enabled spec (the caller decides what kNone means): style, rotary_dim, the
/// tables' pairing, rows, stride and alignment, or theta and the Llama-3 scaling without
/// tables. `prefix` names the spec's fields in the sentences ("rotary." for apply_rotary and
/// decode, "rotary.spec." for attention).
inline Status check_rotary_spec(const char* prefix, int head_dim, const RotarySpec& r) {
  if (r.style != RopeStyle::kNeox && r.style != RopeStyle::kInterleaved)
    return Status::Invalid(cat(prefix, "style ", static_cast<int>(r.style),
                               " is not a rotary style (0 = none, 1 = neox, 2 = interleaved)"));
  const int rot = r.effective_rotary_dim(head_dim);
  if (r.rotary_dim < 0 || rot < 2 || rot % 2 != 0 || rot > head_dim)
    return Status::Invalid(cat(prefix, "rotary_dim ", r.rotary_dim, " must be even and in [2, head_dim ", head_dim,
                               "] (0 = head_dim)"));
  if (r.has_tables()) {
    if (r.cos == nullptr || r.sin == nullptr)
      return Status::Invalid(r.cos ? cat(prefix, "sin is null but ", prefix, "cos is set (tables come in pairs)")
                                   : cat(prefix, "cos is null but ", prefix, "sin is set (tables come in pairs)"));
    if (r.max_position < 1)
      return Status::Invalid(cat(prefix, "max_position ", r.max_position, " must be >= 1 with cos/sin tables"));
    if (r.table_stride != 0 && r.table_stride < rot / 2)
      return Status::Invalid(cat(prefix, "table_stride ", r.table_stride, " must be >= rotary_dim / 2 = ", rot / 2,
                                 " (0 = rotary_dim / 2)"));
    std::int64_t n = 0;
    if (__builtin_mul_overflow(static_cast<std::int64_t>(r.max_position - 1), r.effective_table_stride(head_dim), &n) ||
        __builtin_add_overflow(n, static_cast<std::int64_t>(rot / 2), &n) ||
        n > INT64_MAX / static_cast<std::int64_t>(sizeof(float)))
      return Status::Invalid(cat(prefix, "cos/sin tables of ", r.max_position, " rows at table_stride ",
                                 r.table_stride, " overflow int64"));
    for (auto [name, t] : {std::pair{"cos ", r.cos}, std::pair{"sin ", r.sin}})
      if (reinterpret_cast<std::uintptr_t>(t) % alignof(float) != 0)
        return Status::Invalid(cat(prefix, name, static_cast<const void*>(t), " is not 4-byte aligned (fp32)"));
    return Status::Ok();
  }
  if (!std::isfinite(r.theta) || r.theta <= 0.0)
    return Status::Invalid(cat(prefix, "theta ", r.theta, " must be finite and > 0 (or pass cos/sin tables)"));
  const Llama3Scaling& s = r.llama3;
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

/// Elements each table spans from its pointer: (max_position - 1) * stride + rotary_dim / 2
/// (check_rotary_spec has ruled out overflow). 0 without tables.
inline std::int64_t rotary_table_elems(const RotarySpec& r, int head_dim) {
  if (!r.has_tables()) return 0;
  return static_cast<std::int64_t>(r.max_position - 1) * r.effective_table_stride(head_dim) +
         r.effective_rotary_dim(head_dim) / 2;
}

}  // namespace flashcpp::detail
