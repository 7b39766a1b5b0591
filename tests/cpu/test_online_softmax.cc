// The online-softmax primitives (src/cpu/online_softmax.cc, derivation in docs/online_softmax.md):
// the one-pass recurrence against the three-pass softmax and against fp64, and the two merge
// rules (raw states (m, l, o) and LSE-weighted normalized outputs) against the unsplit row.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "test_util.h"

namespace flashcpp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kTol = 1e-6;  // absolute, on probabilities / normalized outputs in [0, 1]-ish

/// fp64 softmax of x, the ground truth (0 for an all -inf row, as the primitives define it).
std::vector<double> softmax_fp64(const std::vector<float>& x) {
  double m = -kInf;
  for (float v : x) m = std::max(m, double(v));
  std::vector<double> y(x.size(), 0.0);
  if (m == -kInf) return y;
  double sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) sum += (y[i] = std::exp(double(x[i]) - m));
  for (double& v : y) v /= sum;
  return y;
}

/// Rows that stress the recurrence: the max moving late, huge and tiny magnitudes, -inf entries.
std::vector<std::pair<std::string, std::vector<float>>> test_rows(std::mt19937_64& g) {
  std::vector<std::pair<std::string, std::vector<float>>> rows;
  std::normal_distribution<float> nd(0.f, 1.f);
  auto gen = [&](int n, float mean, float sd) {
    std::vector<float> x(n);
    for (float& v : x) v = mean + sd * nd(g);
    return x;
  };
  for (int n : {1, 2, 7, 64, 1000, 4097}) {
    const std::string tag = "n" + std::to_string(n);
    rows.emplace_back(tag + "_normal", gen(n, 0.f, 1.f));
    rows.emplace_back(tag + "_wide", gen(n, 0.f, 30.f));
    rows.emplace_back(tag + "_huge", gen(n, 1e4f, 3.f));
    rows.emplace_back(tag + "_very_negative", gen(n, -1e4f, 3.f));
    auto inc = gen(n, 0.f, 1.f);  // ascending: a new max at every step, maximal rescaling
    std::sort(inc.begin(), inc.end());
    rows.emplace_back(tag + "_ascending", inc);
    auto holes = gen(n, 0.f, 2.f);
    for (std::size_t i = 0; i < holes.size(); i += 3) holes[i] = -kInf;  // masked entries first
    rows.emplace_back(tag + "_with_minus_inf", holes);
  }
  rows.emplace_back("all_minus_inf", std::vector<float>(5, -kInf));
  rows.emplace_back("one_finite", std::vector<float>{-kInf, -kInf, 3.f, -kInf});
  rows.emplace_back("ties", std::vector<float>(9, 2.5f));
  return rows;
}

TEST(OnlineSoftmax, MatchesPlainAndFp64) {
  auto g = testing::rng(101);
  for (const auto& [name, x] : test_rows(g)) {
    SCOPED_TRACE(name);
    const int n = static_cast<int>(x.size());
    std::vector<float> plain(n), online(n);
    cpu::softmax_plain(x.data(), n, plain.data());
    cpu::softmax_online(x.data(), n, online.data());
    const auto want = softmax_fp64(x);
    double max_online_plain = 0, max_online_ref = 0, max_plain_ref = 0;
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(online[i]) && std::isfinite(plain[i])) << "i=" << i;
      max_online_plain = std::max(max_online_plain, std::fabs(double(online[i]) - plain[i]));
      max_online_ref = std::max(max_online_ref, std::fabs(online[i] - want[i]));
      max_plain_ref = std::max(max_plain_ref, std::fabs(plain[i] - want[i]));
    }
    EXPECT_LE(max_online_plain, kTol);
    EXPECT_LE(max_online_ref, kTol);
    EXPECT_LE(max_plain_ref, kTol);
  }
}

TEST(OnlineSoftmax, EmptyRowIsANoOp) {
  float y = 42.f;
  cpu::softmax_plain(nullptr, 0, &y);
  cpu::softmax_online(nullptr, 0, &y);
  EXPECT_EQ(y, 42.f);
}

TEST(OnlineSoftmax, AllMinusInfGivesZeros) {
  const std::vector<float> x(4, -kInf);
  std::vector<float> y(4, NAN);
  cpu::softmax_online(x.data(), 4, y.data());
  for (float v : y) EXPECT_EQ(v, 0.f);
}

// ---- merge of raw states -----------------------------------------------------------------------

constexpr int kD = 8;  // accumulator width

/// The raw state of x[lo, hi) (x in the log2 domain) with accumulator o = sum exp2(x - m) v,
/// summed in double and rounded once, so that the test measures merge_states and not the
/// rounding of the sums that produced its inputs.
cpu::SoftmaxState state_of(const std::vector<float>& x, const std::vector<float>& v, int lo, int hi,
                           std::vector<float>* o) {
  cpu::SoftmaxState s;
  o->assign(kD, 0.f);
  for (int i = lo; i < hi; ++i) s.m = std::max(s.m, x[i]);
  if (s.m == -kInf) return s;
  double l = 0;
  std::vector<double> acc(kD, 0.0);
  for (int i = lo; i < hi; ++i) {
    const double p = std::exp2(double(x[i]) - s.m);
    l += p;
    for (int d = 0; d < kD; ++d) acc[d] += p * v[i * kD + d];
  }
  s.l = static_cast<float>(l);
  for (int d = 0; d < kD; ++d) (*o)[d] = static_cast<float>(acc[d]);
  return s;
}

TEST(MergeStates, SplitRowEqualsUnsplit) {
  auto g = testing::rng(102);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int n : {1, 2, 9, 100}) {
    for (bool holes : {false, true}) {
      std::vector<float> x(n), v(n * kD);
      for (float& e : x) e = nd(g);
      for (float& e : v) e = nd(g);
      if (holes)
        for (int i = 0; i < n; i += 2) x[i] = -kInf;
      std::vector<float> o_full;
      const cpu::SoftmaxState full = state_of(x, v, 0, n, &o_full);
      for (int split = 0; split <= n; ++split) {  // includes an empty side at both ends
        SCOPED_TRACE("n=" + std::to_string(n) + " holes=" + std::to_string(holes) +
                     " split=" + std::to_string(split));
        for (bool swap : {false, true}) {
          std::vector<float> o_a, o_b;
          cpu::SoftmaxState a = state_of(x, v, 0, split, &o_a);
          cpu::SoftmaxState b = state_of(x, v, split, n, &o_b);
          if (swap) {
            std::swap(a, b);
            std::swap(o_a, o_b);
          }
          cpu::merge_states(&a, o_a.data(), b, o_b.data(), kD);
          EXPECT_EQ(a.m, full.m);
          if (full.m == -kInf) {
            EXPECT_EQ(a.l, 0.f);
            continue;
          }
          EXPECT_NEAR(a.l, full.l, kTol * full.l);
          // Relative to the output's size: o / l is a weighted mean of v (|v| up to ~10 here).
          for (int d = 0; d < kD; ++d) {
            const float want = o_full[d] / full.l;
            EXPECT_NEAR(o_a[d] / a.l, want, kTol * std::max(1.f, std::fabs(want)));
          }
        }
      }
    }
  }
}

// ---- merge by LSE ------------------------------------------------------------------------------

/// Normalized output and natural-log LSE of x[lo, hi) (x in natural units).
float normalized_of(const std::vector<float>& x, const std::vector<float>& v, int lo, int hi,
                    std::vector<float>* o) {
  double m = -kInf;
  for (int i = lo; i < hi; ++i) m = std::max(m, double(x[i]));
  o->assign(kD, 0.f);
  if (m == -kInf) return -kInf;
  double sum = 0;
  std::vector<double> acc(kD, 0.0);
  for (int i = lo; i < hi; ++i) {
    const double p = std::exp(x[i] - m);
    sum += p;
    for (int d = 0; d < kD; ++d) acc[d] += p * v[i * kD + d];
  }
  for (int d = 0; d < kD; ++d) (*o)[d] = static_cast<float>(acc[d] / sum);
  return static_cast<float>(m + std::log(sum));
}

TEST(MergeByLse, SplitRowEqualsUnsplit) {
  auto g = testing::rng(103);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (int n : {2, 17, 300}) {
    std::vector<float> x(n), v(n * kD);
    for (float& e : x) e = nd(g);
    for (float& e : v) e = nd(g);
    x[n / 2] += 40.f;  // one dominant key: the two halves get very different LSEs
    std::vector<float> o_full;
    const float lse_full = normalized_of(x, v, 0, n, &o_full);
    for (int split : {1, n / 3, n / 2, n - 1}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " split=" + std::to_string(split));
      std::vector<float> o_a, o_b, o(kD);
      const float lse_a = normalized_of(x, v, 0, split, &o_a);
      const float lse_b = normalized_of(x, v, split, n, &o_b);
      float lse = 0;
      cpu::merge_by_lse(o_a.data(), lse_a, o_b.data(), lse_b, kD, o.data(), &lse);
      EXPECT_NEAR(lse, lse_full, kTol * std::max(1.f, std::fabs(lse_full)));
      for (int d = 0; d < kD; ++d) EXPECT_NEAR(o[d], o_full[d], kTol * 4);  // |v| up to ~8
      // In place (o aliasing o_a), as a combine kernel does.
      cpu::merge_by_lse(o_a.data(), lse_a, o_b.data(), lse_b, kD, o_a.data(), &lse);
      for (int d = 0; d < kD; ++d) EXPECT_EQ(o_a[d], o[d]);
    }
  }
}

TEST(MergeByLse, OneSideEmpty) {
  std::vector<float> o_a = {1.f, -2.f, 3.f, 0.5f, 0.f, 7.f, -1.f, 2.f};
  std::vector<float> garbage(kD, NAN), o(kD);  // an empty side's output must never leak in
  float lse = 0;
  cpu::merge_by_lse(o_a.data(), 1.5f, garbage.data(), -kInf, kD, o.data(), &lse);
  EXPECT_EQ(lse, 1.5f);
  EXPECT_EQ(o, o_a);
  cpu::merge_by_lse(garbage.data(), -kInf, o_a.data(), -3.f, kD, o.data(), &lse);
  EXPECT_EQ(lse, -3.f);
  EXPECT_EQ(o, o_a);
}

TEST(MergeByLse, BothSidesEmpty) {
  std::vector<float> garbage(kD, NAN), o(kD, NAN);
  float lse = 0;
  cpu::merge_by_lse(garbage.data(), -kInf, garbage.data(), -kInf, kD, o.data(), &lse);
  EXPECT_EQ(lse, -kInf);
  for (float e : o) EXPECT_EQ(e, 0.f);
}

TEST(MergeStates, EmptySides) {
  std::vector<float> o_a(kD, 0.f), o_b(kD, 2.f);
  cpu::SoftmaxState a, b{1.f, 3.f};
  cpu::merge_states(&a, o_a.data(), b, o_b.data(), kD);  // empty a takes b
  EXPECT_EQ(a.m, 1.f);
  EXPECT_EQ(a.l, 3.f);
  EXPECT_EQ(o_a, o_b);
  cpu::merge_states(&a, o_a.data(), cpu::SoftmaxState{}, o_b.data(), kD);  // empty b: no change
  EXPECT_EQ(a.m, 1.f);
  EXPECT_EQ(a.l, 3.f);
  cpu::SoftmaxState e1, e2;
  std::vector<float> z1(kD, 0.f), z2(kD, 0.f);
  cpu::merge_states(&e1, z1.data(), e2, z2.data(), kD);
  EXPECT_EQ(e1.m, -kInf);
  EXPECT_EQ(e1.l, 0.f);
}

}  // namespace
}  // namespace flashcpp
