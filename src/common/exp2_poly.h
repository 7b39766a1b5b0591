// exp2 on the FMA pipe: a degree-5 polynomial and an exponent shift, for softmax tiles whose
// exponentials would otherwise all queue on the multi-function unit (MUFU.EX2: 16 per clock per
// SM on Hopper, against 128 FFMA). The sm90 prefill kernel evaluates a fixed share of a tile's
// scores with it (Fa3Config::kPolyEvery); the CPU tests check it against std::exp2 on the host,
// with the same fused multiply-adds, so the device and host results are the same bits.
//
//   x = j + f,  j = round(x) (the 1.5 * 2^23 trick), f in [-0.5, 0.5]
//   2^f ~ 1 + f (c1 + f (c2 + f (c3 + f (c4 + f c5))))   (relative error <= 1.7e-7 in float)
//   2^x = 2^f * 2^j                                      (2^j built from its exponent bits)
//
// The coefficients minimize the relative error on [-0.5, 0.5] with p(0) = 1 exactly, so an
// integer x (the row max itself: x = 0) gives exactly 2^x. The error is that of ex2.approx.f32
// (2 ulp); the P of the softmax is rounded to 16 bits after it either way.
// Like ex2.approx.ftz: results below 2^-126 (x < -126, including -inf) are 0, and NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FC_EXP2_HD __host__ __device__ __forceinline__
#else
#define FC_EXP2_HD inline
#endif

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace flashcpp {

namespace exp2_poly_detail {
FC_EXP2_HD std::uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
FC_EXP2_HD float float_of(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}
FC_EXP2_HD float fma_(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
FC_EXP2_HD float add_(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);  // never contracted or reassociated
#else
  return a + b;
#endif
}
}  // namespace exp2_poly_detail

/// 2^x with FMA-pipe instructions only (three adds, five FMAs, one integer multiply-add, one
/// multiply, one compare and select).
FC_EXP2_HD float exp2_poly(float x) {
  using namespace exp2_poly_detail;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: x + kRound rounds x to an integer (|x| < 2^22)
  const float t = add_(x, kRound);
  const float j = add_(t, -kRound);
  const float f = add_(x, -j);  // exact: |f| <= 0.5
  float p = fma_(f, 1.3264527e-3f, 9.6714515e-3f);
  p = fma_(p, f, 5.5507336e-2f);
  p = fma_(p, f, 2.4022242e-1f);
  p = fma_(p, f, 6.9314700e-1f);
  p = fma_(p, f, 1.f);
  // 2^j: exponent field j + 127. The low 9 bits of t's pattern are j mod 512 (t = 1.5 * 2^23 + j),
  // so t << 23 is j << 23 modulo 2^32. For x >= -126, j >= -126 and 2^j is a normal float.
  const float scale = float_of((bits_of(t) << 23) + 0x3F800000u);
  const float r = p * scale;  // NaN x: p is NaN, so r is NaN
  return x < -126.f ? 0.f : r;
}

}  // namespace flashcpp
