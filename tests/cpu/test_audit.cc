// The numerics audit (tools/audit.h): every input family produces what it claims (measured in fp64
// by score_stats on the rounded inputs), inputs are deterministic and representable, the
// `flashcpp audit --quick` run passes on the CPU backend and writes the documented JSON, and the
// audit really fails what is wrong: a perturbed element, a NaN, a wrong LSE.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "audit.h"
#include "flashcpp/half.h"
#include "test_util.h"

namespace flashcpp::audit {
namespace {

Problem problem(Family f, MaskKind m, int n = 256, DType t = DType::kBF16) {
  Problem p;
  p.family = f;
  p.mask = m;
  p.seqlen = n;
  p.heads = 2;
  p.head_dim = 64;
  p.dtype = t;
  p.window = 128;
  return p;
}

std::uint64_t seed_for(const Problem& p) { return harness::case_seed(testing::run_seed(), p.name()); }

Inputs inputs(const Problem& p) { return generate(p, seed_for(p), 2); }

std::string last_line(const std::string& text) {
  std::istringstream in(text);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

/// A fresh folder under the system temp directory, removed when the test ends.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() /
             ("flashcpp_test_audit_" + name + "_" + std::to_string(testing::run_seed()))) {
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// ---- names and inputs -----------------------------------------------------------------------

TEST(AuditFamilies, NamesRoundTripAndEachSaysWhatItProvokes) {
  std::set<std::string> names;
  for (Family f : kAllFamilies) {
    Family back{};
    ASSERT_TRUE(parse_family(family_name(f), &back)) << family_name(f);
    EXPECT_EQ(back, f);
    EXPECT_TRUE(names.insert(family_name(f)).second);
    EXPECT_GT(std::string(family_provokes(f)).size(), 40u) << family_name(f);
  }
  EXPECT_EQ(names.size(), 8u);
  for (MaskKind m : kAllMasks) {
    MaskKind back{};
    ASSERT_TRUE(parse_mask_kind(mask_kind_name(m), &back));
    EXPECT_EQ(back, m);
  }
  Family f{};
  EXPECT_FALSE(parse_family("gaussian", &f));
  EXPECT_EQ(problem(Family::kOneHot, MaskKind::kCausal, 512).name(), "one_hot/b1_h2_n512_d64_causal_bf16");
  EXPECT_EQ(problem(Family::kRandom, MaskKind::kWindow, 512, DType::kF16).name(),
            "random/b1_h2_n512_d64_causal_wl128_fp16");
}

TEST(AuditInputs, VisibleRangesFollowTheMask) {
  Problem p = problem(Family::kRandom, MaskKind::kNone, 300);
  EXPECT_EQ(p.key_lo(10), 0);
  EXPECT_EQ(p.key_hi(10), 299);
  p.mask = MaskKind::kCausal;
  EXPECT_EQ(p.key_hi(10), 10);
  EXPECT_EQ(p.visible_keys(0), 1);
  p.mask = MaskKind::kWindow;
  EXPECT_EQ(p.key_lo(200), 72);
  EXPECT_EQ(p.visible_keys(200), 129);
  EXPECT_EQ(p.key_lo(5), 0);
  const MaskParams m = p.mask_params();
  EXPECT_TRUE(m.causal);
  EXPECT_EQ(m.window_left, 128);
}

TEST(AuditInputs, DeterministicThreadIndependentAndRoundedToTheDtype) {
  for (Family f : kAllFamilies)
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
      const Problem p = problem(f, MaskKind::kCausal, 130, t);
      const Inputs a = generate(p, 42, 1), b = generate(p, 42, 2), c = generate(p, 43, 2);
      ASSERT_EQ(a.q.size(), static_cast<std::size_t>(130 * 2 * 64));
      EXPECT_EQ(a.q, b.q) << p.name();
      EXPECT_EQ(a.k, b.k) << p.name();
      EXPECT_EQ(a.v, b.v) << p.name();
      EXPECT_NE(a.v, c.v) << p.name() << ": the seed must matter";
      for (const auto* tensor : {&a.q, &a.k, &a.v})
        for (float x : *tensor) {
          ASSERT_TRUE(std::isfinite(x)) << p.name();
          harness::HostTensor one(t, 1);
          one.set(0, x);
          ASSERT_EQ(one.get(0), x) << p.name() << ": input not representable in " << dtype_name(t);
        }
    }
}

// ---- each family produces what it claims -----------------------------------------------------

TEST(AuditInputs, RandomIsTheUnremarkableControl) {
  for (MaskKind m : kAllMasks) {
    const Problem p = problem(Family::kRandom, m);
    const ScoreStats s = score_stats(p, inputs(p), 64);
    EXPECT_LT(s.max_abs_score, 8) << p.name();
    EXPECT_LT(s.mean_top_weight, 0.5) << p.name();
    EXPECT_EQ(s.frac_pairs_underflow, 0.0) << p.name();
  }
}

TEST(AuditInputs, SubnormalUnderflowsExpForMostKeys) {
  for (MaskKind m : kAllMasks)
    for (DType t : {DType::kBF16, DType::kF16}) {
      const Problem p = problem(Family::kSubnormal, m, 256, t);
      const ScoreStats s = score_stats(p, inputs(p), 64);
      // exp(s - m) below FLT_MIN for most (row, key) pairs, in (nearly) every row ...
      EXPECT_GT(s.frac_pairs_underflow, 0.6) << p.name();
      EXPECT_GT(s.frac_rows_majority_underflow, 0.95) << p.name();
      // ... most of them all the way to 0, some in the subnormal band, and |s| beyond exp's range.
      EXPECT_GT(s.frac_pairs_zero, 0.4) << p.name();
      EXPECT_GT(s.frac_pairs_underflow - s.frac_pairs_zero, 0.01) << p.name() << ": no subnormal weights";
      EXPECT_GT(s.max_abs_score, 150) << p.name();
    }
}

TEST(AuditInputs, OneHotHasOneDominantScorePerRow) {
  for (MaskKind m : kAllMasks)
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
      const Problem p = problem(Family::kOneHot, m, 256, t);
      const ScoreStats s = score_stats(p, inputs(p));
      EXPECT_GT(s.min_top_weight, 1 - 1e-6) << p.name() << ": a row without a dominant key";
      EXPECT_GT(s.min_top_gap, 15) << p.name();
    }
}

TEST(AuditInputs, NearTiesShareTheRowMaxAcrossTiles) {
  for (MaskKind m : kAllMasks) {
    const Problem p = problem(Family::kNearTies, m, 256);
    // Rows that see >= 128 keys hold >= 2 keys of their tie group (every 64th key) within 0.05 nats.
    const ScoreStats s = score_stats(p, inputs(p), 128, 0.05);
    ASSERT_GT(s.rows, 0) << p.name();
    EXPECT_GE(s.min_ties, 2) << p.name();
    EXPECT_LT(s.min_top_gap, 0.05) << p.name();
    // Ties at the top, not a flat row: the top keys carry the weight.
    EXPECT_GT(s.max_abs_score, 10) << p.name();
  }
  // Without a mask every row sees all 256 keys: 4 tied keys each.
  const Problem p = problem(Family::kNearTies, MaskKind::kNone, 256);
  EXPECT_GE(score_stats(p, inputs(p), 1, 0.05).min_ties, 4);
}

TEST(AuditInputs, ConstantRowsHaveOneScoreBeyondExpRange) {
  for (MaskKind m : kAllMasks) {
    const Problem p = problem(Family::kConstant, m);
    const ScoreStats s = score_stats(p, inputs(p));
    EXPECT_EQ(s.max_row_score_spread, 0.0) << p.name() << ": keys must be identical";
    EXPECT_GT(s.max_abs_score, 150) << p.name();
  }
}

TEST(AuditInputs, OutlierKeysAreFewAndHuge) {
  const Problem p = problem(Family::kOutlierKeys, MaskKind::kNone, 2048);
  const Inputs in = inputs(p);
  for (int h = 0; h < p.heads; ++h) {
    std::vector<double> norms;
    for (int j = 0; j < p.seqlen; ++j) {
      double s = 0;
      for (int e = 0; e < p.head_dim; ++e) {
        const double x = in.k[(static_cast<std::size_t>(j) * p.heads + h) * p.head_dim + e];
        s += x * x;
      }
      norms.push_back(std::sqrt(s));
    }
    std::vector<double> sorted = norms;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    EXPECT_GT(norms[0], 30 * median) << "key 0 (the sink) must be an outlier";
    // Key 0 plus one key in every block of 512 (at a random offset per head).
    const auto outliers = std::count_if(norms.begin(), norms.end(), [&](double x) { return x > 30 * median; });
    EXPECT_GE(outliers, p.seqlen / 512);
    EXPECT_LE(outliers, p.seqlen / 512 + 1);
  }
  const ScoreStats s = score_stats(p, in);
  EXPECT_GT(s.max_abs_score, 100);
}

TEST(AuditInputs, LargeScaleHasHugeScoresWithASmallSpread) {
  for (MaskKind m : kAllMasks)
    for (DType t : {DType::kBF16, DType::kF16}) {
      const Problem p = problem(Family::kLargeScale, m, 256, t);
      const ScoreStats s = score_stats(p, inputs(p));
      EXPECT_GT(s.mean_abs_score, 1000) << p.name();
      EXPECT_LT(s.max_abs_score, 4500) << p.name();
      EXPECT_LT(s.max_row_score_std, 10) << p.name() << ": the spread within a row must stay O(1)";
    }
}

TEST(AuditInputs, LongRangeIsDominatedByTheFarthestKey) {
  for (MaskKind m : kAllMasks) {
    const Problem p = problem(Family::kLongRange, m, 512);
    const ScoreStats s = score_stats(p, inputs(p), 2);
    EXPECT_GT(s.frac_rows_argmax_farthest, 0.99) << p.name();
    EXPECT_GT(s.frac_rows_farthest_majority, 0.99) << p.name();
  }
}

// ---- the bound and the metrics ----------------------------------------------------------------

TEST(AuditBound, TermsAreTheDocumentedOnes) {
  EXPECT_EQ(DefectBound::unit_roundoff(DType::kBF16), std::ldexp(1.0, -8));
  EXPECT_EQ(DefectBound::unit_roundoff(DType::kF16), std::ldexp(1.0, -11));
  EXPECT_EQ(DefectBound::unit_roundoff(DType::kF32), std::ldexp(1.0, -24));
  // u_p + eps_exp + eta + gamma for D = 64, scale|q||k| = 10, 1024 keys.
  const double want =
      std::ldexp(1.0, -8) + std::ldexp(1.0, -21) + 72 * std::ldexp(1.0, -24) * 10 + (256 + 16) * std::ldexp(1.0, -24);
  EXPECT_DOUBLE_EQ(DefectBound::weight_error(DType::kBF16, 64, 10, 1024), want);
  const auto q = cdf_quantiles();
  EXPECT_EQ(q.front(), 0.0);
  EXPECT_EQ(q.back(), 1.0);
  EXPECT_TRUE(std::is_sorted(q.begin(), q.end()));
}

Result fake(int n, MaskKind m, std::int64_t over, std::int64_t lse_over = 0) {
  Result r;
  r.problem = problem(Family::kRandom, m, n);
  r.kernel = "cpu";
  r.status = harness::CaseStatus::kPass;
  r.rows = 100;
  r.rows_over_tol = over;
  r.rows_lse_over_tol = lse_over;
  r.frac_rows_over_tol = over / 100.0;
  return r;
}

TEST(AuditBound, FirstExceedIsTheSmallestNOverTheBand) {
  const std::vector<Result> rs = {fake(1024, MaskKind::kNone, 3), fake(128, MaskKind::kNone, 0),
                                  fake(512, MaskKind::kNone, 1, 2), fake(128, MaskKind::kCausal, 0),
                                  fake(512, MaskKind::kCausal, 0)};
  const auto j = first_exceed_json(rs);
  ASSERT_EQ(j.size(), 2u);
  for (const auto& g : j) {
    if (g["mask"] == "none") {
      EXPECT_EQ(g["seqlens"], nlohmann::json({128, 512, 1024}));
      EXPECT_EQ(g["first_n_over_tol"], 512);
      EXPECT_EQ(g["first_n_lse_over_tol"], 512);
      EXPECT_FALSE(g["over_tol_at_smallest_n"].get<bool>());
    } else {
      EXPECT_TRUE(g["first_n_over_tol"].is_null());
    }
  }
}

// ---- the run ----------------------------------------------------------------------------------

AuditOptions quick_cpu() {
  AuditOptions o;
  o.backend = Backend::kCpu;
  o.quick = true;
  o.seed = testing::run_seed();
  return o;
}

TEST(AuditRun, QuickPassesOnTheCpuBackendAndWritesTheDocumentedJson) {
  AuditOptions o = quick_cpu();
  const TempDir dir("quick");
  o.json_path = (dir.path / "audit.json").string();
  std::ostringstream out, err;
  const int rc = run_audit(o, out, err);
  const std::string text = out.str();
  EXPECT_EQ(rc, 0) << text << err.str();
  const std::vector<Problem> problems = plan_problems(o, Backend::kCpu);
  EXPECT_EQ(problems.size(), 2u * 3 * 8 * 3) << "N x dtype x family x mask";
  // Two kernels on the CPU: the tiled backend on every row, and the decode backend (split-KV +
  // merge) on the last kAuditDecodeRows rows of each problem.
  EXPECT_EQ(last_line(text), std::to_string(2 * problems.size()) + " passed, 0 failed");
  EXPECT_NE(text.find("first N"), std::string::npos);

  std::ifstream f(o.json_path);
  ASSERT_TRUE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  for (const char* key : {"tool", "environment", "config", "families", "tolerance_policy", "defect_bound", "metrics",
                          "cdf_quantiles", "results", "first_exceed", "mask_effect", "summary"})
    EXPECT_TRUE(j.contains(key)) << key;
  for (const char* key : {"device", "backend", "git_commit", "seed", "timestamp"})
    EXPECT_TRUE(j["environment"].contains(key)) << key;
  EXPECT_EQ(j["families"].size(), 8u);
  EXPECT_EQ(j["summary"]["failed"], 0);
  ASSERT_EQ(j["results"].size(), 2 * problems.size());
  const std::size_t nq = j["cdf_quantiles"].size();
  for (const auto& r : j["results"]) {
    for (const char* key : {"name",
                            "family",
                            "dtype",
                            "seqlen",
                            "heads",
                            "head_dim",
                            "mask",
                            "kernel",
                            "kernel_name",
                            "status",
                            "reference",
                            "seed",
                            "rows",
                            "row_rel_err",
                            "cdf",
                            "floor_rel_err",
                            "max_abs_err",
                            "max_tol_ratio",
                            "rows_over_tol",
                            "frac_rows_over_tol",
                            "lse_max_abs_err",
                            "nonfinite_rows",
                            "defect_rows",
                            "lse_defect_rows",
                            "max_bound_ratio",
                            "tolerance",
                            "ms",
                            "ref_ms"})
      ASSERT_TRUE(r.contains(key)) << key;
    for (const char* q : {"p50", "p90", "p99", "p999", "max"}) ASSERT_TRUE(r["row_rel_err"].contains(q)) << q;
    EXPECT_EQ(r["cdf"].size(), nq);
    const bool decode = r["kernel"] == "cpu_decode";
    EXPECT_EQ(r["kernel_name"], decode ? "cpu_decode_split_kv" : "cpu_tiled_online_softmax");
    EXPECT_EQ(r["rows"].get<int>(), r["heads"].get<int>() * (decode ? kAuditDecodeRows : r["seqlen"].get<int>()));
    EXPECT_EQ(r["reference"], "cpu_fp64");
    EXPECT_EQ(r["nonfinite_rows"], 0);
    EXPECT_LT(r["max_bound_ratio"].get<double>(), 1.0) << r["name"];
    // The CDF is monotone and ends at the max.
    double prev = -1;
    for (const auto& x : r["cdf"]) {
      ASSERT_FALSE(x.is_null());
      EXPECT_GE(x.get<double>(), prev);
      prev = x.get<double>();
    }
    EXPECT_EQ(prev, r["row_rel_err"]["max"].get<double>());
    // The CPU backend computes in fp32 and rounds once: its 16-bit outputs sit at the rounding floor.
    // The decode backend forms y = s * scale * log2(e) rounded, then exp2(y - m), as the decode
    // kernel does; at the large_scale family's scores that rounding (|y| * 2^-24 in the exponent)
    // lifts it above the floor (up to ~2.2x at N = 512), still inside the band. The tiled backend
    // keeps the product inside an FMA, but its fp32 dot products still err by ~|s| * 2^-24 in the
    // exponent: at large_scale that error moves some outputs across a rounding boundary, and the
    // row error reaches ~1.56x the floor (max over 100 seeds); every other family stays under
    // 1.02x. Hence 2x for large_scale and 1.5x elsewhere (the ratio is random per seed).
    if (r["dtype"] != "fp32") {
      EXPECT_EQ(r["rows_over_tol"], 0) << r["name"];
      const double over_floor = r["family"] == "large_scale" ? 2.0 : 1.5;
      if (!decode)
        EXPECT_LE(r["row_rel_err"]["max"].get<double>(),
                  over_floor * r["floor_rel_err"]["max"].get<double>() + 1e-6)
            << r["name"];
    }
  }
  // One first_exceed group per (kernel, dtype, family, mask), each over both N.
  EXPECT_EQ(j["first_exceed"].size(), 2u * 3 * 8 * 3);
  for (const auto& g : j["first_exceed"]) EXPECT_EQ(g["seqlens"], nlohmann::json({128, 512}));
}

/// Runs a small audit (two families, one N, bf16) with an output hook; returns the exit code.
/// `kernels`: the tiled backend by default, "decode" for the decode backend (last rows only).
int run_with_hook(OutputHook hook, std::string* text, const char* kernels = "cpu") {
  AuditOptions o = quick_cpu();
  o.kernels = {kernels};
  o.seqlens = {128};
  o.dtypes = {DType::kBF16};
  o.families = {Family::kRandom, Family::kOneHot};
  o.masks = {MaskKind::kCausal};
  o.perturb_output = std::move(hook);
  std::ostringstream out, err;
  const int rc = run_audit(o, out, err);
  *text = out.str();
  return rc;
}

TEST(AuditRun, APerturbedElementIsADefect) {
  std::string text;
  const int rc = run_with_hook(
      [](const Problem&, const std::string&, harness::HostTensor& out, std::vector<float>&) {
        const std::int64_t at = 77 * 2 * 64 + 5;                             // row 77, head 0, element 5
        out.set(at, out.get(at) + 0.125f + 0.25f * std::fabs(out.get(at)));  // moves it by >= 0.125
      },
      &text);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_EQ(last_line(text), "0 passed, 2 failed") << text;
  EXPECT_NE(text.find("O[i=77,h=0,d=5]"), std::string::npos) << text;
  EXPECT_NE(text.find("defect bound"), std::string::npos) << text;
}

TEST(AuditRun, TheDecodeBackendIsMeasuredOnItsRowsOnly) {
  std::string text;
  // A perturbed last row (127 of 128) fails the decode backend.
  int rc = run_with_hook(
      [](const Problem&, const std::string&, harness::HostTensor& out, std::vector<float>&) {
        const std::int64_t at = 127 * 2 * 64 + 3;
        out.set(at, out.get(at) + 0.125f + 0.25f * std::fabs(out.get(at)));
      },
      &text, "decode");
  EXPECT_EQ(rc, 1) << text;
  EXPECT_EQ(last_line(text), "0 passed, 2 failed") << text;
  EXPECT_NE(text.find("O[i=127,h=0,d=3]"), std::string::npos) << text;
  // Rows it does not compute (NaN-filled) are not measured: a change there is invisible to it.
  rc = run_with_hook(
      [](const Problem&, const std::string&, harness::HostTensor& out, std::vector<float>&) {
        out.set(77 * 2 * 64 + 5, 1e6f);
      },
      &text, "decode");
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("cpu_decode"), std::string::npos) << text;
}

TEST(AuditRun, RotaryTwinsRunOnTheCpuAndDecodeReportsThemUnsupported) {
  AuditOptions o = quick_cpu();
  o.seqlens = {128};
  o.dtypes = {DType::kBF16};
  o.families = {Family::kRandom, Family::kLongRange};
  o.masks = {MaskKind::kCausal};
  o.rotary = true;
  const TempDir dir("rotary");
  o.json_path = (dir.path / "audit.json").string();
  std::ostringstream out, err;
  EXPECT_EQ(run_audit(o, out, err), 0) << out.str() << err.str();
  const std::vector<Problem> problems = plan_problems(o, Backend::kCpu);
  ASSERT_EQ(problems.size(), 4u);  // each problem and its rotary twin
  // 2 kernels x 4 problems; the decode kernels skip the rotary twins with a sentence.
  EXPECT_EQ(last_line(out.str()), "6 passed, 0 failed, 2 unsupported") << out.str();
  EXPECT_NE(out.str().find("causal+rotary"), std::string::npos);
  std::ifstream f(o.json_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  int rotary_results = 0;
  for (const auto& r : j["results"]) {
    if (!r["rotary"].get<bool>()) continue;
    ++rotary_results;
    EXPECT_NE(r["name"].get<std::string>().find("_rope64"), std::string::npos);
    if (r["kernel"] == "cpu") EXPECT_EQ(r["status"], "pass");
  }
  EXPECT_EQ(rotary_results, 4);
}

TEST(AuditRun, RoundingSizedChangesAreNotDefects) {
  // One bf16 ulp on every element of a row is rounding, not a defect.
  std::string text;
  const int rc = run_with_hook(
      [](const Problem&, const std::string&, harness::HostTensor& out, std::vector<float>&) {
        for (std::int64_t e = 0; e < 64; ++e) {
          const std::int64_t at = 77 * 2 * 64 + e;
          const float x = out.get(at);
          out.set(at, x + std::ldexp(std::fabs(x), -7));
        }
      },
      &text);
  EXPECT_EQ(rc, 0) << text;
}

TEST(AuditRun, ANanOrAWrongLseIsADefect) {
  std::string text;
  EXPECT_EQ(run_with_hook(
                [](const Problem&, const std::string&, harness::HostTensor& out, std::vector<float>&) {
                  out.set(3 * 2 * 64 + 64, NAN);  // row 3, head 1, element 0
                },
                &text),
            1);
  EXPECT_NE(text.find("O[i=3,h=1,d=0] is nan"), std::string::npos) << text;
  EXPECT_EQ(run_with_hook(
                [](const Problem&, const std::string&, harness::HostTensor&, std::vector<float>& lse) {
                  lse[100] += 0.05f;  // head 0, row 100
                },
                &text),
            1);
  EXPECT_NE(text.find("LSE[h=0,i=100]"), std::string::npos) << text;
}

TEST(AuditRun, ListAndUsageErrors) {
  AuditOptions o = quick_cpu();
  o.list_only = true;
  std::ostringstream out, err;
  EXPECT_EQ(run_audit(o, out, err), 0);
  for (Family f : kAllFamilies) EXPECT_NE(out.str().find(family_name(f)), std::string::npos);
  o.list_only = false;
  o.head_dim = 84;
  EXPECT_EQ(run_audit(o, out, err), 2);
  EXPECT_NE(err.str().find("head_dim 84 is not supported (it must be a multiple of 8 in [8, 256])"), std::string::npos)
      << err.str();
#if !FLASHCPP_WITH_CUDA
  AuditOptions c = quick_cpu();
  c.backend = Backend::kCuda;
  std::ostringstream out2, err2;
  EXPECT_EQ(run_audit(c, out2, err2), 2);
  EXPECT_NE(err2.str().find("no CUDA kernels"), std::string::npos);
#endif
}

// A negative size used to select the preset without a word (`--heads -2` ran with 2 heads).
TEST(AuditRun, NegativeSizesAreRefusedNotReplacedByThePreset) {
  struct Bad {
    const char* flag;
    int AuditOptions::*field;
    int value;
  };
  const Bad bad[] = {{"--heads -2", &AuditOptions::heads, -2},
                     {"--head-dim -64", &AuditOptions::head_dim, -64},
                     {"--window -5", &AuditOptions::window, -5},
                     {"--threads -1", &AuditOptions::cpu_threads, -1}};
  for (const Bad& b : bad) {
    AuditOptions o = quick_cpu();
    o.list_only = true;  // refused before anything is planned, even a listing
    o.*b.field = b.value;
    std::ostringstream out, err;
    EXPECT_EQ(run_audit(o, out, err), 2) << b.flag << ": " << out.str();
    EXPECT_NE(err.str().find(b.flag), std::string::npos) << err.str();
    EXPECT_NE(err.str().find("negative"), std::string::npos) << err.str();
  }
}

// --json was written only after the whole run: an unwritable path now fails before it.
TEST(AuditRun, AnUnwritableJsonPathFailsBeforeTheRun) {
  const TempDir dir("json");
  const std::filesystem::path file = dir.path / "plain_file";
  std::ofstream(file) << "x";
  AuditOptions o = quick_cpu();
  o.json_path = (file / "audit.json").string();  // a folder that is a file: cannot be created
  std::ostringstream out, err;
  EXPECT_EQ(run_audit(o, out, err), 2);
  EXPECT_NE(err.str().find("cannot write --json"), std::string::npos) << err.str();
  EXPECT_NE(err.str().find("nothing was run"), std::string::npos) << err.str();
  EXPECT_EQ(out.str().find("passed"), std::string::npos) << "it ran:\n" << out.str();
  o.json_path = dir.path.string();  // a directory
  std::ostringstream out2, err2;
  EXPECT_EQ(run_audit(o, out2, err2), 2);
  EXPECT_NE(err2.str().find("cannot write --json"), std::string::npos) << err2.str();
}

// A problem too large for host memory is refused with a sentence, not left to fail an allocation.
TEST(AuditRun, AProblemTooLargeForHostMemoryIsRefused) {
  AuditOptions o = quick_cpu();
  o.list_only = true;
  o.seqlens = {1 << 20};
  o.heads = 64;
  o.head_dim = 128;  // 2^33 elements per tensor
  std::ostringstream out, err;
  EXPECT_EQ(run_audit(o, out, err), 2) << out.str();
  EXPECT_NE(err.str().find("at most 2^30"), std::string::npos) << err.str();
  o.heads = 4;  // 2^29: listed
  std::ostringstream out2, err2;
  EXPECT_EQ(run_audit(o, out2, err2), 0) << err2.str();
}

// The table's last column is the defect verdict, not the tolerance band: a result 100% over the
// band passes. Its name and the legend say so ("over_tol 100.00% ... PASS" read as a contradiction).
TEST(AuditRun, TheTableSaysWhatItsColumnsMean) {
  std::string text;
  ASSERT_EQ(run_with_hook(nullptr, &text), 0) << text;
  std::istringstream in(text);
  std::string line, header;
  while (std::getline(in, line))
    if (line.rfind("problem", 0) == 0) header = line;
  ASSERT_FALSE(header.empty()) << text;
  EXPECT_NE(header.find("rows_over_band"), std::string::npos) << header;
  EXPECT_NE(header.find("err/bound"), std::string::npos) << header;
  EXPECT_NE(header.find("defect_check"), std::string::npos) << header;
  EXPECT_EQ(header.find("over_tol"), std::string::npos) << header;
  EXPECT_EQ(header.find(" status"), std::string::npos) << header;
  EXPECT_NE(text.find("a finding, never a failure"), std::string::npos) << text;
  EXPECT_NE(text.find("PASS =\n  no defect"), std::string::npos) << text;
  // Every result row keeps its columns under the header: the verdict word starts where
  // "defect_check" does.
  const std::size_t col = header.find("defect_check");
  int rows = 0;
  std::istringstream in2(text);
  while (std::getline(in2, line))
    if (line.find("/b1_") != std::string::npos && line.size() > col) {
      EXPECT_EQ(line.substr(col, 4), "PASS") << line;
      ++rows;
    }
  EXPECT_EQ(rows, 2) << text;
}

TEST(AuditRun, DumpedInputsAreTheGeneratedOnes) {
  AuditOptions o = quick_cpu();
  o.seqlens = {64};
  o.dtypes = {DType::kF16};
  o.families = {Family::kLongRange};
  o.masks = {MaskKind::kWindow};
  const TempDir dir("dump");
  o.dump_dir = dir.path.string();
  std::ostringstream out, err;
  ASSERT_EQ(run_audit(o, out, err), 0) << err.str();
  std::ifstream mf(std::filesystem::path(o.dump_dir) / "manifest.json");
  const nlohmann::json m = nlohmann::json::parse(mf);
  ASSERT_EQ(m["problems"].size(), 1u);
  const auto& e = m["problems"][0];
  EXPECT_EQ(e["causal"], true);
  EXPECT_EQ(e["window_left"], 64);
  const Problem p = plan_problems(o, Backend::kCpu).front();
  EXPECT_EQ(e["name"], p.name());
  const Inputs in = generate(p, e["seed"].get<std::uint64_t>(), 1);
  std::ifstream vf(std::filesystem::path(o.dump_dir) / e["files"]["v"].get<std::string>(), std::ios::binary);
  std::vector<std::uint16_t> bits(in.v.size());
  ASSERT_TRUE(vf.read(reinterpret_cast<char*>(bits.data()), static_cast<std::streamsize>(bits.size() * 2)));
  for (std::size_t i = 0; i < bits.size(); ++i) ASSERT_EQ(half_bits_to_float(bits[i]), in.v[i]) << i;
}

}  // namespace
}  // namespace flashcpp::audit
