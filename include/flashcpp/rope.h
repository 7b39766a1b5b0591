// Rotary position embedding: the pairing styles and the Llama-3 frequency scaling, shared by
// apply_rotary (fused.h) and the rotary fused into attention (attention.h).
#pragma once

#include <cstdint>

namespace flashcpp {

/// Pairing of the rotated dims. Numbered like decode.h's RotaryStyle (whose 0 means "no rotary"),
/// so the two convert by value.
enum class RopeStyle : std::uint8_t {
  kNeox = 1,         ///< half split: pairs (i, i + rotary_dim/2) (Llama, GPT-NeoX, vLLM's default)
  kInterleaved = 2,  ///< adjacent pairs (2i, 2i + 1) (GPT-J, Meta's original Llama code)
};
const char* rope_style_name(RopeStyle s) noexcept;  // "neox", "interleaved"

/// Llama-3 (rope_type "llama3") frequency scaling; factor 0 turns it off.
struct Llama3Scaling {
  float factor = 0.f;            ///< 0 = off; else >= 1 (Llama-3.1: 8, Llama-3.2: 32)
  float low_freq_factor = 1.f;   ///< > 0
  float high_freq_factor = 4.f;  ///< > low_freq_factor
  int original_max_position = 8192;  ///< > 0
  bool enabled() const noexcept { return factor != 0.f; }
};

}  // namespace flashcpp
