// Rotary position embedding: the one description of a rotation that every rotary path of the
// library takes. RotarySpec says how to rotate (style, rotary_dim, frequencies or cos/sin
// tables); each entry point adds where (positions) and what (tensors) in its own struct:
//   apply_rotary (fused.h)          RopeParams::rotary    + positions, q/k and their outputs
//   attention_forward (attention.h) AttnParams::rotary.spec + positions_q/k, k_rotated
//   decode_run (decode.h)           DecodeParams::rotary  (positions implied by the cache lengths)
//
// The rotation (every path computes exactly this): for a token at position p and pair index
// i in [0, rotary_dim / 2),
//   (c, s)  = (cos[p * table_stride + i], sin[p * table_stride + i])        with tables, else
//   inv_freq[i] = theta^(-2i / rotary_dim) in fp64, then the Llama-3 scaling when enabled
//   (fused.h has the formula); angle = p * inv_freq[i] reduced to [-pi, pi] in fp64 and
//   rounded to fp32; (c, s) = fp32 cos, sin(angle)
//   pair (a, b):  neox a = x[i], b = x[i + rotary_dim/2];  interleaved a = x[2i], b = x[2i + 1]
//   a' = fma(a, c, -(b*s)),  b' = fma(b, c, a*s)   in fp32, rounded to the tensor's dtype.
// Dims [rotary_dim, head_dim) pass through. (src/common/fused_math.h holds this arithmetic;
// the kernels and the CPU backends all call it, so one spec rotates to the same bits on every
// path and backend.)
//
// A position outside the tables' rows [0, max_position): the CPU backends read the positions
// and refuse the call with a sentence, on every path. On CUDA the positions (or decode's
// lengths) are device memory the host cannot read before launching, so nothing is ever read
// outside the tables, and the paths keep their documented answers: apply_rotary and attention
// write NaN into the rotated dims of that token (visible downstream); decode clamps the
// position into the tables (its kernels also clamp lengths and block-table entries, decode.h).
#pragma once

#include <cstdint>

namespace flashcpp {

/// Pairing of the rotated dims; kNone turns rotary off. The values are the codes the Python
/// binding and the kernel parameters use.
enum class RopeStyle : std::uint8_t {
  kNone = 0,         ///< no rotary (attention and decode: off; apply_rotary refuses it)
  kNeox = 1,         ///< half split: pairs (i, i + rotary_dim/2) (Llama, GPT-NeoX, vLLM's default)
  kInterleaved = 2,  ///< adjacent pairs (2i, 2i + 1) (GPT-J, Meta's original Llama code)
};
const char* rope_style_name(RopeStyle s) noexcept;  // "none", "neox", "interleaved"

/// Llama-3 (rope_type "llama3") frequency scaling; factor 0 turns it off.
struct Llama3Scaling {
  float factor = 0.f;            ///< 0 = off; else >= 1 (Llama-3.1: 8, Llama-3.2: 32)
  float low_freq_factor = 1.f;   ///< > 0
  float high_freq_factor = 4.f;  ///< > low_freq_factor
  int original_max_position = 8192;  ///< > 0
  bool enabled() const noexcept { return factor != 0.f; }
};

/// One rotary embedding: how the leading rotary_dim dims of a head rotate with the position.
///
/// The angles come either from theta (and the optional Llama-3 scaling), computed by the
/// kernels, or from caller-owned fp32 tables. The tables are two row-major arrays that share
/// a row stride: row p of `cos` holds cos(p * inv_freq[i]) for the rotary_dim / 2 pairs i, at
/// cos + p * table_stride, and likewise for `sin`. That covers both layouts in use:
///   separate tables (max_position, rotary_dim / 2), flash-attn's rotary_cos / rotary_sin:
///     cos, sin = the two arrays, table_stride = rotary_dim / 2 (or 0, its default);
///   one cos_sin_cache (max_position, rotary_dim), rows [cos | sin] (vLLM's layout):
///     cos = cache, sin = cache + rotary_dim / 2, table_stride = rotary_dim
///     (set_cos_sin_cache does this).
/// Every backend and every kernel reads any such tables. With tables, theta and llama3 are not used.
struct RotarySpec {
  RopeStyle style = RopeStyle::kNone;
  int rotary_dim = 0;        ///< leading dims that rotate: even, <= head_dim; 0 = head_dim
  double theta = 10000.0;    ///< base of the frequencies, finite and > 0 (without tables)
  Llama3Scaling llama3;      ///< without tables; factor 0 = off
  const float* cos = nullptr;  ///< fp32 table, row p at cos + p * table_stride; both or neither
  const float* sin = nullptr;  ///< fp32 table, row p at sin + p * table_stride
  /// Elements between rows p and p + 1 of both tables, >= rotary_dim / 2; 0 = rotary_dim / 2.
  std::int64_t table_stride = 0;
  int max_position = 0;      ///< rows of the tables (>= 1 with tables): positions lie in [0, it)

  /// A spec of style `s`, every other field at its default (theta 10000, all of head_dim).
  static constexpr RotarySpec of_style(RopeStyle s) noexcept {
    RotarySpec r;
    r.style = s;
    return r;
  }
  bool enabled() const noexcept { return style != RopeStyle::kNone; }
  bool has_tables() const noexcept { return cos != nullptr || sin != nullptr; }
  /// rotary_dim with 0 resolved to head_dim.
  int effective_rotary_dim(int head_dim) const noexcept { return rotary_dim == 0 ? head_dim : rotary_dim; }
  /// table_stride with 0 resolved to rotary_dim / 2.
  std::int64_t effective_table_stride(int head_dim) const noexcept {
    return table_stride == 0 ? effective_rotary_dim(head_dim) / 2 : table_stride;
  }
  /// Points the tables at a cos_sin_cache: fp32 (max_position, cache_rotary_dim) rows
  /// [cos | sin], cache_rotary_dim the effective rotary_dim (head_dim when rotary_dim is 0).
  void set_cos_sin_cache(const float* cache, int rows, int cache_rotary_dim) noexcept {
    cos = cache;
    sin = cache ? cache + cache_rotary_dim / 2 : nullptr;
    table_stride = cache ? cache_rotary_dim : 0;
    max_position = rows;
  }
  /// Whether the tables are one cos_sin_cache (sin = cos + rotary_dim / 2, table_stride =
  /// rotary_dim).
  bool is_cos_sin_cache(int head_dim) const noexcept {
    const int rd = effective_rotary_dim(head_dim);
    return cos != nullptr && sin == cos + rd / 2 && effective_table_stride(head_dim) == rd;
  }
};

/// inv_freq[i] for i in [0, rotary_dim / 2), in fp64, with the Llama-3 scaling when enabled.
/// What every backend uses (the CUDA kernels get these values from the host).
double rotary_inv_freq(int i, int rotary_dim, double theta, const Llama3Scaling& llama3) noexcept;

/// Pairs rotary_inv_freq_table holds: rotary_dim up to 1024.
inline constexpr int kRotaryTableMaxPairs = 512;

/// The whole table rotary_inv_freq(i, rotary_dim, theta, llama3) for i < rotary_dim / 2 (rotary_dim
/// in [2, 2 * kRotaryTableMaxPairs], even), memoized per thread over the last four specs: what the
/// CUDA launches copy into their kernel arguments at every call (64 fp64 pows cost ~1.2 us of host
/// time at rotary_dim 128). The pointer is valid until this thread has asked for four other specs;
/// copy the values at once. Null for a rotary_dim outside that range.
const double* rotary_inv_freq_table(int rotary_dim, double theta, const Llama3Scaling& llama3) noexcept;

}  // namespace flashcpp
