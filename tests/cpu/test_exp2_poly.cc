// exp2_poly (src/common/exp2_poly.h), the FMA-pipe exp2 of the sm90 prefill kernel's "e" configs,
// against std::exp2 in double on the host (same fused multiply-adds as the device code): the
// relative error of ex2.approx.f32 (2 ulp) over the softmax's range, exact powers of two at
// integers (the row max's own P is exactly 1), and ftz-like zero below 2^-126, NaN kept.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "common/exp2_poly.h"

namespace flashcpp::testing {
namespace {

double rel_err(float x) {
  const double ref = std::exp2(static_cast<double>(x));
  return std::fabs(static_cast<double>(exp2_poly(x)) / ref - 1.0);
}

// The softmax feeds x = s * c - m * c <= 0, or up to 8 under the sm90 kernel's lazy rescale;
// the range below also covers what a caller outside the softmax would pass.
TEST(Exp2Poly, WithinTwoUlpOverTheRange) {
  constexpr double kBound = 2.4e-7;  // 2 ulp of float at 1
  double worst = 0;
  float worst_x = 0;
  for (int i = 0; i <= (126 + 64) * 4096; ++i) {
    const float x = -126.f + static_cast<float>(i) / 4096.f;
    const double e = rel_err(x);
    if (e > worst) worst = e, worst_x = x;
  }
  std::mt19937_64 g(20261130);
  std::uniform_real_distribution<float> u(-126.f, 64.f);
  for (int i = 0; i < 1000000; ++i) {
    const float x = u(g);
    const double e = rel_err(x);
    if (e > worst) worst = e, worst_x = x;
  }
  // Around the seams j -> j + 1 (f = +-0.5), where the polynomial's two ends meet.
  for (int k = -125; k < 64; ++k)
    for (float x = std::nextafter(k + 0.5f, -1e9f), n = 0; n < 6; ++n, x = std::nextafter(x, 1e9f)) {
      const double e = rel_err(x);
      if (e > worst) worst = e, worst_x = x;
    }
  EXPECT_LT(worst, kBound) << "at x = " << worst_x;
  std::printf("    exp2_poly: max relative error %.3e (at x = %.6f)\n", worst, worst_x);
}

TEST(Exp2Poly, IntegersArePowersOfTwoExactly) {
  for (int k = -126; k <= 100; ++k)
    EXPECT_EQ(exp2_poly(static_cast<float>(k)), std::ldexp(1.f, k)) << "k = " << k;
  EXPECT_EQ(exp2_poly(0.f), 1.f);
  EXPECT_EQ(exp2_poly(-0.f), 1.f);
}

TEST(Exp2Poly, BelowTheNormalRangeIsZeroAndNaNStaysNaN) {
  EXPECT_EQ(exp2_poly(-126.0001f), 0.f);
  EXPECT_EQ(exp2_poly(-127.f), 0.f);
  EXPECT_EQ(exp2_poly(-1e30f), 0.f);
  EXPECT_EQ(exp2_poly(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_TRUE(std::isnan(exp2_poly(std::numeric_limits<float>::quiet_NaN())));
  // Just above the cut every result is a normal float.
  for (float x = -126.f; x < -125.f; x += 1.f / 64)
    EXPECT_TRUE(std::isnormal(exp2_poly(x))) << "x = " << x;
}

}  // namespace
}  // namespace flashcpp::testing
