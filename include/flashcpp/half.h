// Host-side fp16/bf16 <-> float conversions (round to nearest even), for the CPU backend,
// the tests, the tools and any caller that fills or reads fp16/bf16 host buffers. Device code
// uses cuda_fp16.h / cuda_bf16.h instead.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashcpp/types.h"

namespace flashcpp {

inline float bf16_bits_to_float(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400u));
      u = sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline std::uint16_t float_to_half_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t absu = u & 0x7fffffffu;
  if (absu >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u : 0));
  if (absu >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absu < 0x38800000u) {  // subnormal or zero in half
    if (absu < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = absu >> 23;
    const std::uint32_t man = (absu & 0x7fffffu) | 0x800000u;
    // value = man * 2^(e-150); the half subnormal unit is 2^-24, so q = man * 2^(e-126)
    const int rs = 126 - static_cast<int>(e);  // right shift amount, 1..24
    std::uint32_t q = man >> rs;
    const std::uint32_t rem = man & ((1u << rs) - 1), halfway = 1u << (rs - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  std::uint32_t h = ((absu >> 13) - ((127 - 15) << 10));
  const std::uint32_t rem = absu & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

/// FP8 e4m3 (types.h): 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal
/// (m/8 * 2^-6), 0x7f / 0xff are NaN, there is no infinity. Every code is exact in float.
inline float fp8e4m3_bits_to_float(std::uint8_t b) {
  const float sign = (b & 0x80u) ? -1.f : 1.f;
  const int exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0xf && man == 0x7) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);
  return sign * std::ldexp(static_cast<float>(8 + man), exp - 10);
}
/// Round to nearest even, saturating: |x| beyond 448 (infinity included) gives +-448, NaN gives
/// NaN (0x7f with x's sign), as cvt.rn.satfinite does on the GPU.
inline std::uint8_t float_to_fp8e4m3_bits(float x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80u : 0x00u;
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7fu);
  const float a = std::fabs(x);
  if (a >= 448.f) return static_cast<std::uint8_t>(sign | 0x7eu);
  if (a < 0x1p-6f) {  // subnormal range: a multiple of 2^-9 (8 of them reach the smallest normal)
    const float q = std::nearbyint(std::ldexp(a, 9));  // exact scaling; nearbyint rounds half to even
    return static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(q));
  }
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): the exponent of 1.m is e - 1
  float q = std::nearbyint(std::ldexp(f, 4)) - 8.f;  // 3 mantissa bits of (2f - 1), rounded
  int biased = e - 1 + 7;
  if (q >= 8.f) q = 0.f, ++biased;  // rounded up to the next power of two
  if (biased > 15 || (biased == 15 && q >= 7.f)) return static_cast<std::uint8_t>(sign | 0x7eu);
  return static_cast<std::uint8_t>(sign | (biased << 3) | static_cast<int>(q));
}

/// x rounded to the nearest value of dtype t (through float), as a kernel storing x would.
inline float round_to_dtype(DType t, float x) {
  switch (t) {
    case DType::kF32:
    case DType::kF64: return x;
    case DType::kBF16: return bf16_bits_to_float(float_to_bf16_bits(x));
    case DType::kF16: return half_bits_to_float(float_to_half_bits(x));
    case DType::kF8E4M3: return fp8e4m3_bits_to_float(float_to_fp8e4m3_bits(x));
  }
  return x;
}

/// Load element `idx` of a host buffer of dtype `t` as float.
inline float load_as_float(const void* base, DType t, std::int64_t idx) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[idx];
    case DType::kBF16: return bf16_bits_to_float(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::kF16: return half_bits_to_float(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[idx]);
    case DType::kF8E4M3: return fp8e4m3_bits_to_float(static_cast<const std::uint8_t*>(base)[idx]);
  }
  return NAN;
}
/// Load element `idx` as double: exact for every dtype (the fp64 references read fp64 inputs so).
inline double load_as_double(const void* base, DType t, std::int64_t idx) {
  return t == DType::kF64 ? static_cast<const double*>(base)[idx] : static_cast<double>(load_as_float(base, t, idx));
}
/// Store `v` (rounded to nearest even) as element `idx` of a host buffer of dtype `t`.
inline void store_from_float(void* base, DType t, std::int64_t idx, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[idx] = v; break;
    case DType::kBF16: static_cast<std::uint16_t*>(base)[idx] = float_to_bf16_bits(v); break;
    case DType::kF16: static_cast<std::uint16_t*>(base)[idx] = float_to_half_bits(v); break;
    case DType::kF64: static_cast<double*>(base)[idx] = v; break;
    case DType::kF8E4M3: static_cast<std::uint8_t*>(base)[idx] = float_to_fp8e4m3_bits(v); break;
  }
}
/// Store `v` as element `idx` of dtype `t`: exactly for fp64, else through float as
/// store_from_float (double -> float -> the dtype, as the fp64 reference always stored).
inline void store_from_double(void* base, DType t, std::int64_t idx, double v) {
  if (t == DType::kF64) {
    static_cast<double*>(base)[idx] = v;
  } else {
    store_from_float(base, t, idx, static_cast<float>(v));
  }
}

}  // namespace flashcpp
