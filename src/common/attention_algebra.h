// The attention algebra that every kernel and backend shares: the score transform, the online
// softmax of one row, its final scale and LSE, the merge of partial results by their LSEs, the
// named constants and the shared-memory swizzle. The sm80 (fa2) and sm90 (fa3) prefill kernels,
// the split-KV decode kernel and its merges, and the CPU backends that mirror them all call these
// functions; docs/online_softmax.md derives the recurrence.
//
// Units. From the matrix product to the softmax a score stays in RAW q.k units, u = q.k (the CPU
// backends negate it for a negative softmax_scale, which the CUDA kernels refuse). The softmax
// scale and log2(e) fold into one positive constant c = |softmax_scale| * log2(e) that multiplies
// u inside the exponent, so the hot loop pays one FFMA per score:
//     p = exp2(u c - m c)                                  m: the row's running (reference) max of u
// Softcap and ALiBi are rewritten into raw units once, on the host (ScoreTransform::make): with
// s = scale * q.k the score of attention.h,
//     softcap:  cap tanh(s / cap)      = |scale| * cap_raw tanh(u / cap_raw),  cap_raw = cap / |scale|
//     ALiBi:    + slope (j - ia)       = |scale| * slope_raw (j - ia),         slope_raw = slope / |scale|
// so the recurrence below never changes; the cap comes first, then the bias (attention.h's order).
//
// The online softmax of one row (RowSoftmax). m never becomes NaN (fmaxf keeps the other
// operand); l is the sum of the row's p. A key block whose row max is mx moves m to m' and
// rescales what was summed (and the output accumulator) by
//     corr = exp2(m c - m' c)
// The rounding rule, the same everywhere: m c is rounded once, by itself (mul_rn, never
// contracted into an FMA), and that one rounded value is what every exponent of the block
// subtracts and what the LSE adds back. So corr is exactly 1 while the max stays put (no drift over
// thousands of key blocks: a drift of exactly this kind once put errors of 1e-5 into LSEs at 32k-64k
// keys), and the rounding of m c cancels in O = acc / l and in LSE = (m c + log2 l) ln 2.
// While a row has seen nothing (m = -inf) the exponents subtract 0, so exp2(-inf - 0) = 0 and
// never -inf - (-inf) = NaN. A row is empty when l == 0 (O = 0, LSE = -inf), never when m = -inf:
// a row whose visible scores are all NaN keeps m = -inf but has l = NaN, and that NaN must reach
// O and the LSE (attention.h).
//
// Lazy rescale (the Hopper kernel's policy): the reference max moves only when the block's max
// passes it by more than kLazyRescaleLog2 in exp2 units; otherwise p <= 2^kLazyRescaleLog2 (exact
// enough in fp32; P's 16-bit rounding is relative), corr = 1 and the O rescale can be skipped. O / l
// and the LSE use the same reference max, so the result is the exact softmax either way.
//
// Host and device evaluate the same rules. The device uses the fast instructions named below
// (MUFU ex2/rcp/lg2, relative error ~2^-22); the host (the CPU backends, which check the algorithm
// rather than the GPU's rounding) evaluates each expression exactly in double and rounds once to
// fp32. So the device's one fp32 rounding of m c, and its limit, do not apply on the host: once
// |m c| >= 2^31 (|scale * q.k| above ~1.5e9) the rounding residual of m c exceeds 128 and a
// device exponent overflows or flushes, while the host stays finite.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/hd.h"

namespace flashcpp::algebra {

// ---- named constants ---------------------------------------------------------------------------
inline constexpr float kLog2e = 1.4426950408889634f;  ///< log2(e)
inline constexpr float kLn2 = 0.6931471805599453f;    ///< ln(2)
inline constexpr double kLog2eD = 1.4426950408889634074;
inline constexpr double kLn2D = 0.69314718055994530942;
/// Lazy rescale threshold, in exp2 units (see the header comment): p of a block may reach 2^8.
inline constexpr float kLazyRescaleLog2 = 8.f;

// ---- the fast operations (device: one MUFU or one rounded op; host: exact) ----------------------
/// 2^x. Device: MUFU.EX2 (ex2.approx.ftz), subnormal results flushed to 0; exp2(-inf) = 0.
FC_HD float exp2_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}
/// 1 / x. Device: MUFU.RCP (rcp.approx.ftz, ~1 ulp); 1 / inf = 0.
FC_HD float rcp_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.f / x;
#endif
}
/// log2(x). Device: MUFU.LG2 (__log2f).
FC_HD float log2_fast(float x) {
#if defined(__CUDA_ARCH__)
  return __log2f(x);
#else
  return std::log2(x);
#endif
}
/// a * b rounded once and never fused into a neighbouring add (the rounding rule's m c).
FC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;  // a separate rounding even where the host compiler contracts a*b+c
  return r;
#endif
}

// ---- the score transform ------------------------------------------------------------------------
/// Softmax scale, softcap and the ALiBi slope unit of a problem, in raw q.k units (header comment).
/// Plain data: it travels in the kernels' parameter structs.
struct ScoreTransform {
  float c = 0.f;          ///< |softmax_scale| * log2(e) > 0: p = exp2(u c - m c)
  float sign = 1.f;       ///< sign of softmax_scale; the CUDA kernels run +1 only (dispatch)
  float cap = 0.f;        ///< softcap / |scale| (raw units); 0 = no softcap
  float cap_k = 0.f;      ///< 2 log2(e) / cap: tanh(u / cap) = 1 - 2 / (1 + exp2(u cap_k))
  float inv_scale = 1.f;  ///< 1 / |softmax_scale|: an ALiBi slope in raw units per natural unit

  /// scale = the effective softmax scale (finite, != 0); softcap >= 0 (0 = off). Host and device:
  /// the decode kernels form it per KV head for an fp8 cache (scale * k_scale[hk], a device value),
  /// with the same IEEE operations, so both sides get the same bits.
  FC_HD static ScoreTransform make(float scale, float softcap) {
    ScoreTransform t;
    const float a = fabsf(scale);
    t.c = a * kLog2e;
    t.sign = scale < 0.f ? -1.f : 1.f;
    t.inv_scale = 1.f / a;
    if (softcap > 0.f) {
      t.cap = softcap / a;
      t.cap_k = 2.f * kLog2e / t.cap;
    }
    return t;
  }
  /// Whether softcap and ALiBi have representable raw units: 1 / |scale| and cap / |scale| finite
  /// (validation refuses a softcap or ALiBi whose scale is too small for them).
  bool raw_units_finite() const { return std::isfinite(inv_scale) && std::isfinite(cap) && std::isfinite(cap_k); }

  /// The raw score of a dot product: the dot itself, negated for a negative scale. The prefill
  /// kernels run scale > 0 only (dispatch) and skip this multiply.
  FC_HD float raw(float dot) const { return dot * sign; }

  /// cap tanh(u / cap). Device: as cap - 2 cap / (1 + exp2(u cap_k)), two MUFU ops and an absolute
  /// error of a few ulp of cap (tanh.approx.f32 would be one op but has a relative error of 2^-11,
  /// up to cap * 5e-4 on the logit: too coarse for fp16 outputs); saturates to +-cap. Host: tanh.
  FC_HD float softcap(float u) const {
#if defined(__CUDA_ARCH__)
    return fmaf(-2.f * cap, rcp_fast(1.f + exp2_fast(u * cap_k)), cap);
#else
    return static_cast<float>(static_cast<double>(cap) * std::tanh(static_cast<double>(u) / cap));
#endif
  }
  /// An ALiBi slope (natural units, attention.h) in raw units.
  FC_HD float slope_raw(float slope) const { return slope * inv_scale; }
};

/// u + slope_raw * dist, dist = j - ia (an exact small integer in fp32), one FFMA.
FC_HD float alibi(float u, float slope_raw, float dist) { return fmaf(slope_raw, dist, u); }

// ---- the online softmax of one row --------------------------------------------------------------
/// m c rounded once, or 0 while the row has seen nothing (m = -inf): the exponent offset.
FC_HD float scaled_max(float m, float c) { return m == -INFINITY ? 0.f : mul_rn(m, c); }

/// What the epilogue writes for a row: O = acc * inv and the LSE (natural log).
struct RowResult {
  float inv;  ///< 1 / l, or 0 for an empty row (l == 0)
  float lse;  ///< (m c + log2 l) ln 2, or -inf for an empty row; NaN when l is NaN
};

/// The state of one query row (on the GPU: one thread's share of it; l is reduced over the row's
/// threads before finalize). See the header comment for the rules.
struct RowSoftmax {
  float m = -INFINITY;  ///< running (reference) max of u
  float l = 0.f;        ///< running sum of p

  /// Folds in a key block: mx = max(m, the block's row max), over all of the row's threads (the
  /// reductions start from m). Returns corr, the factor for l and the output accumulator: exactly
  /// 1 when the (reference) max did not move. kLazy: the Hopper policy (kLazyRescaleLog2).
  template <bool kLazy = false>
  FC_HD float rescale(float mx, float c) {
    const float old = m;
    // Lazy: the reference max stays unless mx passes it by more than the threshold (selects, not
    // branches: both rows of a thread decide apart, and a branch would split the warp).
    const bool move = !kLazy || old == -INFINITY || (mx - old) * c > kLazyRescaleLog2;
    m = move ? mx : old;
#if defined(__CUDA_ARCH__)
    // mul_rn(-inf, c) = -inf: an empty row's corr is exp2(-inf) = 0, never 0 * inf.
    const float corr = exp2_fast(mul_rn(old, c) - scaled_max(m, c));
#else
    const float corr =
        old == -INFINITY ? 0.f : static_cast<float>(std::exp2((static_cast<double>(old) - m) * static_cast<double>(c)));
#endif
    return move ? corr : 1.f;
  }
  /// The exponent offset of the current block (pass it to p()): scaled_max(m, c).
  FC_HD float offset(float c) const { return scaled_max(m, c); }
  /// p = exp2(u c - m c) for a score u of the current block; mc = offset(c). Device: one FFMA and
  /// one MUFU.EX2. Host: (u - m) c in double (exact difference, the max's own term exactly 1).
  FC_HD float p(float u, float c, float mc) const {
#if defined(__CUDA_ARCH__)
    return exp2_fast(fmaf(u, c, -mc));
#else
    (void)mc;
    const double m_use = m == -INFINITY ? 0.0 : m;
    return static_cast<float>(std::exp2((static_cast<double>(u) - m_use) * static_cast<double>(c)));
#endif
  }
  /// l = l corr + block_sum.
  FC_HD void accumulate(float corr, float block_sum) { l = l * corr + block_sum; }

  /// The row's result from its total l (after the cross-thread reduction). shift: a per-row constant
  /// (raw units) that the kernel left out of every score of the row and that belongs in the LSE
  /// (fa3's ALiBi row term). m = -inf needs no test: l is then 0 (LSE -inf) or NaN (LSE NaN).
  FC_HD RowResult finalize(float l_total, float c) const { return finalize_at(m, l_total, c); }
  FC_HD RowResult finalize(float l_total, float c, float shift) const { return finalize_at(m + shift, l_total, c); }

 private:
  FC_HD static RowResult finalize_at(float mm, float l_total, float c) {
    RowResult r;
    r.inv = l_total != 0.f ? 1.f / l_total : 0.f;
#if defined(__CUDA_ARCH__)
    r.lse = l_total != 0.f ? (mul_rn(mm, c) + log2_fast(l_total)) * kLn2 : -INFINITY;
#else
    const double mu = mm == -INFINITY ? 0.0 : static_cast<double>(mm);
    r.lse = l_total != 0.f ? static_cast<float>((mu * c + std::log2(static_cast<double>(l_total))) * kLn2D)
                           : -INFINITY;
#endif
    return r;
  }
};

/// The weight of a partial state with max m_part when partials meet at max m_all (>= m_part):
/// exp2(m_part c - m_all c) with both rounded by the rule above (an in-kernel merge of warps or of
/// threads that split a row's keys). m_part = -inf gives 0; m_all = -inf (nothing anywhere) gives 1.
FC_HD float partial_weight(float m_part, float m_all, float c) {
#if defined(__CUDA_ARCH__)
  return exp2_fast(mul_rn(m_part, c) - scaled_max(m_all, c));
#else
  if (m_part == -INFINITY) return 0.f;
  return static_cast<float>(std::exp2((static_cast<double>(m_part) - m_all) * static_cast<double>(c)));
#endif
}

// ---- merging results by their LSE (split-KV, cascades, ring attention) --------------------------
/// The weight of a result whose LSE is lse when results meet at the largest LSE lse_max:
/// exp(lse - lse_max); an empty result (lse = -inf) weighs 0, and lse_max = -inf (every result
/// empty) is taken as 0 so that -inf - (-inf) never makes a NaN. A NaN LSE gives a NaN weight.
FC_HD float lse_weight(float lse, float lse_max) {
  if (lse == -INFINITY) return 0.f;
  const float ref = lse_max == -INFINITY ? 0.f : lse_max;
#if defined(__CUDA_ARCH__)
  return exp2f((lse - ref) * kLog2e);
#else
  return static_cast<float>(std::exp(static_cast<double>(lse) - ref));
#endif
}
/// The merged LSE from the largest LSE and the sum of the weights: lse_max + ln(sum), or -inf when
/// the sum is 0 (every result empty); NaN propagates through the sum.
FC_HD float merged_lse(float lse_max, float sum) {
  if (sum == 0.f) return -INFINITY;
#if defined(__CUDA_ARCH__)
  return lse_max + logf(sum);
#else
  return static_cast<float>(static_cast<double>(lse_max) + std::log(static_cast<double>(sum)));
#endif
}

/// The merge of two results by their LSEs (merge_attention_states, cascades): the weights of each
/// side and the merged LSE, log(e^a + e^b) = hi + log1p(e^(lo - hi)), which cannot overflow. An empty
/// side (LSE -inf) weighs exactly 0, and callers skip a zero weight, so whatever its O holds never
/// leaks; both empty: weights 0 and LSE -inf. hi and lo come from one comparison, false when either
/// side is NaN: the NaN then lands in hi or lo and so in the merged LSE and both weights (fmaxf /
/// fminf would drop it, leaving a finite LSE beside a NaN O).
FC_HD void merge_two(float lse_a, float lse_b, float* w_a, float* w_b, float* lse) {
  if (lse_a == -INFINITY || lse_b == -INFINITY) {
    *w_a = lse_a == -INFINITY ? 0.f : 1.f;
    *w_b = lse_b == -INFINITY ? 0.f : 1.f;
    *lse = lse_a == -INFINITY ? lse_b : lse_a;
    return;
  }
  const bool a_hi = lse_a > lse_b;
  const float hi = a_hi ? lse_a : lse_b, lo = a_hi ? lse_b : lse_a;
#if defined(__CUDA_ARCH__)
  const float merged = hi + log1pf(expf(lo - hi));
  *w_a = expf(lse_a - merged);
  *w_b = expf(lse_b - merged);
#else
  const double merged = static_cast<double>(hi) + std::log1p(std::exp(static_cast<double>(lo) - hi));
  *w_a = static_cast<float>(std::exp(lse_a - merged));
  *w_b = static_cast<float>(std::exp(lse_b - merged));
#endif
  *lse = static_cast<float>(merged);
}

// ---- the shared-memory swizzle -----------------------------------------------------------------
/// The 128-byte XOR swizzle every tile in shared memory uses (and TMA's CU_TENSOR_MAP_SWIZZLE_128B
/// writes): 16-byte chunk `chunk` of row `row` is stored at chunk ^ (row % 8), so the 8 rows that
/// one ldmatrix phase or wgmma core matrix reads land in 8 distinct bank groups. Only the chunk's
/// low 3 bits change, so the chunk stays inside its 128-byte segment of the row.
FC_HD int swizzle_chunk(int row, int chunk) { return chunk ^ (row & 7); }

/// Element offset of chunk `chunk` (8 x 16-bit) of row `row` of a row-major [rows][D] tile (sm80
/// kernels: rows of D * 2 bytes, the tile starting on a multiple of 128 bytes).
template <int D>
FC_HD int swizzled_offset(int row, int chunk) {
  return row * D + (swizzle_chunk(row, chunk) << 3);
}

/// Byte offset of chunk `chunk` of row `row` of a tile of Rows rows stored as 64-column panels of
/// 128-byte rows (sm90 kernels: the TMA box layout; the tile starts 1024-byte aligned).
template <int Rows>
FC_HD std::uint32_t panel_offset(int row, int chunk) {
  return static_cast<std::uint32_t>((chunk >> 3) * (Rows * 128) + row * 128 + (swizzle_chunk(row, chunk & 7) << 4));
}

}  // namespace flashcpp::algebra
