// Scalar math of the fused kernels, shared by the CUDA kernels and the CPU backend so the two
// evaluate the same expressions (plain C++; __host__ __device__ when compiled by nvcc).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/hd.h"
#include "flashcpp/fused.h"

namespace flashcpp::fused {

constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInvTwoPi = 0.15915494309189533576888376337251;
/// 2*pi = kTwoPiHi + kTwoPiLo to ~2^-107: the reduction below subtracts k * 2*pi in two steps.
constexpr double kTwoPiHi = 6.283185307179586232;
constexpr double kTwoPiLo = 2.4492935982947064e-16;

/// silu(g) * u in fp32: g / (1 + exp(-g)) * u. For g -> -inf, exp(-g) = inf and silu -> -0.
FC_HD float silu_mul(float g, float u) {
#if defined(__CUDA_ARCH__)
  return g / (1.f + __expf(-g)) * u;  // ex2.approx: relative error ~2^-22, far below bf16/fp16
#else
  return g / (1.f + std::exp(-g)) * u;
#endif
}

/// inv_freq[i] = theta^(-2i / rotary_dim), then the Llama-3 scaling (see fused.h), in fp64.
FC_HD double inv_freq(int i, int rotary_dim, double theta, float factor, float low_freq_factor,
                            float high_freq_factor, int original_max_position) {
  const double f = pow(theta, -2.0 * i / rotary_dim);
  if (factor == 0.f) return f;
  const double wavelen = kTwoPi / f;
  const double old_len = static_cast<double>(original_max_position);
  const double low_wavelen = old_len / low_freq_factor;    // longer waves than this: scaled
  const double high_wavelen = old_len / high_freq_factor;  // shorter waves than this: kept
  if (wavelen < high_wavelen) return f;
  if (wavelen > low_wavelen) return f / factor;
  const double a = (old_len / wavelen - low_freq_factor) / (static_cast<double>(high_freq_factor) - low_freq_factor);
  return (1.0 - a) * f / factor + a * f;
}

/// p * inv_freq reduced to [-pi, pi] in fp64, then rounded to fp32. The fp64 product of an
/// int32 position and inv_freq is exact to ~2^-53 relative, and k = rint(a / 2pi) < 2^31 keeps
/// k * kTwoPiHi exact in an FMA, so the reduced angle carries ~1e-15 absolute error before the
/// final rounding: an fp32 sincos of it is as accurate as fp32 allows at any position.
FC_HD float reduced_angle(std::int32_t pos, double inv_freq) {
  const double a = static_cast<double>(pos) * inv_freq;
  const double k = rint(a * kInvTwoPi);
  double r = fma(-k, kTwoPiHi, a);
  r = fma(-k, kTwoPiLo, r);
  return static_cast<float>(r);
}

/// The fp32 cos/sin tables of a RotarySpec (rope.h) as kernel parameters: row p of each at
/// cos + p * stride (a cos_sin_cache is cos = cache, sin = cache + rotary_dim / 2, stride =
/// rotary_dim; separate tables have stride rotary_dim / 2).
struct CosSinTables {
  const float* cos = nullptr;  ///< null: no tables (the angles come from inv_freq)
  const float* sin = nullptr;
  std::int64_t stride = 0;
  int max_position = 0;
};

/// cos and sin of rotary angle pos * inv_freq: the fp64-reduced angle rounded to fp32 (above), then
/// the hardware sin/cos on the device (|angle| <= pi there: within ~4e-7) or libm on the host. Every
/// rotary path (apply_rotary, the rotary fused into attention, decode's append) takes its angles
/// from here.
FC_HD void cos_sin_angle(std::int32_t pos, double inv_freq, float* c, float* s) {
  const float a = reduced_angle(pos, inv_freq);
#if defined(__CUDA_ARCH__)
  __sincosf(a, s, c);
#else
  *c = std::cos(a);
  *s = std::sin(a);
#endif
}

/// (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) in fp32, with the FMAs spelled out, so that every rotary
/// path rounds the same way on every backend (not left to a compiler's contraction).
FC_HD void rotate_pair(float& x0, float& x1, float c, float s) {
  const float a = x0, b = x1;
#if defined(__CUDA_ARCH__)
  x0 = fmaf(a, c, -(b * s));
  x1 = fmaf(b, c, a * s);
#else
  x0 = std::fma(a, c, -(b * s));
  x1 = std::fma(b, c, a * s);
#endif
}

}  // namespace flashcpp::fused
