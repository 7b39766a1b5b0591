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

// A NaN entry makes the whole row NaN, as torch.softmax does, also when every other entry is
// -inf or the NaN comes first (the max never takes a NaN, so the row looked empty before).
TEST(OnlineSoftmax, NanEntryMakesTheRowNan) {
  const std::vector<std::vector<float>> rows = {
      {NAN}, {NAN, NAN, NAN}, {-kInf, NAN, -kInf}, {NAN, 1.f, 2.f}, {1.f, NAN, 2.f}, {3.f, -kInf, NAN}};
  for (const auto& x : rows) {
    const int n = static_cast<int>(x.size());
    std::vector<float> plain(n, 0.f), online(n, 0.f);
    cpu::softmax_plain(x.data(), n, plain.data());
    cpu::softmax_online(x.data(), n, online.data());
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(std::isnan(plain[i])) << "softmax_plain, entry " << i << " of a row of " << n;
      EXPECT_TRUE(std::isnan(online[i])) << "softmax_online, entry " << i << " of a row of " << n;
    }
  }
}

// Entries of ~1e10: x * log2(e) ~ 2^33.7, whose fp32 rounding residual (up to 512) is no
// exponent exp2 survives. The recurrence takes exp2((x - m) * log2e), so the max's term is 1.
TEST(OnlineSoftmax, HugeMagnitudesStayFinite) {
  for (float base : {3e9f, 1e10f, 1.3e10f, 4e10f, -1e10f}) {
    for (const std::vector<float>& x :
         {std::vector<float>(6, base), std::vector<float>{base, base * (1 - 1e-6f), base, base * (1 + 2e-7f)}}) {
      SCOPED_TRACE("base " + std::to_string(base) + " n " + std::to_string(x.size()));
      const int n = static_cast<int>(x.size());
      std::vector<float> online(n);
      cpu::softmax_online(x.data(), n, online.data());
      const auto want = softmax_fp64(x);
      for (int i = 0; i < n; ++i) EXPECT_NEAR(online[i], want[i], kTol) << "i=" << i;  // NaN fails
    }
  }
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

// A side whose every score was NaN keeps m = -inf but has l = NaN: it must spread, not be taken
// for an empty side; an empty side stays harmless next to it.
TEST(MergeStates, NanSideSpreads) {
  std::vector<float> o_a(kD, 1.f), o_nan(kD, NAN);
  cpu::SoftmaxState a{2.f, 3.f}, nan_side{-kInf, NAN};
  cpu::merge_states(&a, o_a.data(), nan_side, o_nan.data(), kD);
  EXPECT_TRUE(std::isnan(a.l));
  for (float e : o_a) EXPECT_TRUE(std::isnan(e));
  cpu::SoftmaxState empty, b = nan_side;
  std::vector<float> o_b = o_nan, zeros(kD, 0.f);
  cpu::merge_states(&b, o_b.data(), empty, zeros.data(), kD);  // NaN side + empty side
  EXPECT_TRUE(std::isnan(b.l));
  cpu::merge_states(&empty, zeros.data(), nan_side, o_nan.data(), kD);  // empty side + NaN side
  EXPECT_TRUE(std::isnan(empty.l));
}

// A NaN LSE on either side gives a NaN LSE and NaN O (std::max / std::min used to drop a NaN
// second argument and return a finite LSE beside a NaN O).
TEST(MergeByLse, NanSideSpreads) {
  std::vector<float> o_a(kD, 1.f), o_b(kD, 2.f), o(kD);
  for (auto [la, lb] : {std::pair{NAN, 1.f}, std::pair{1.f, NAN}, std::pair{NAN, NAN}, std::pair{NAN, -kInf},
                        std::pair{-kInf, NAN}}) {
    SCOPED_TRACE("lse_a " + std::to_string(la) + " lse_b " + std::to_string(lb));
    float lse = 0.f;
    cpu::merge_by_lse(o_a.data(), la, o_b.data(), lb, kD, o.data(), &lse);
    EXPECT_TRUE(std::isnan(lse));
    if (!(std::isinf(la) || std::isinf(lb)))  // with one side empty, O is the other side's as given
      for (float e : o) EXPECT_TRUE(std::isnan(e));
  }
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
