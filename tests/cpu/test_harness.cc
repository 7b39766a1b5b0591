// The correctness harness behind `flashcpp check` (tools/harness/): table coverage, case names,
// the JSON report's keys and types, and that the harness really fails what is wrong: a perturbed
// output, a NaN, a wrong LSE; unsupported cases are never counted as passes; real CPU runs pass.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "flashcpp/fused.h"
#include "flashcpp/reference.h"
#include "harness/harness.h"
#include "test_util.h"

namespace flashcpp::harness {
namespace {

Case make_case(int b, int sq, int sk, int hq, int hkv, int d, DType dt, bool causal = false) {
  Case c;
  c.batch = b;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = hq;
  c.heads_kv = hkv;
  c.head_dim = d;
  c.dtype = dt;
  c.mask.causal = causal;
  return c;
}

RunConfig cpu_config(Backend b = Backend::kCpu) {
  RunConfig cfg;
  cfg.backend = b;
  cfg.seed = testing::run_seed();
  return cfg;
}

/// The last non-empty line of a text.
std::string last_line(const std::string& text) {
  std::istringstream in(text);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

// ---- tables and names ---------------------------------------------------------------------

TEST(HarnessTable, QuickCoversEveryMaskKindHeadDimDtypeAndLayout) {
  const auto table = make_table(TableKind::kQuick, Backend::kCpu);
  std::set<std::string> kinds, names;
  std::set<int> dims, seqlens;
  std::set<DType> dtypes;
  std::set<Layout> layouts;
  bool gqa = false, mqa = false, q_shorter = false, q_longer = false, no_lse = false;
  for (const Case& c : table) {
    for (const auto& k : c.mask_kinds()) kinds.insert(k);
    EXPECT_TRUE(names.insert(c.name()).second) << "duplicate name " << c.name();
    dims.insert(c.head_dim);
    dtypes.insert(c.dtype);
    layouts.insert(c.layout);
    seqlens.insert(c.seqlen_q);
    gqa |= c.heads_kv > 1 && c.heads_q > c.heads_kv;
    mqa |= c.heads_kv == 1 && c.heads_q > 1;
    q_shorter |= c.seqlen_q < c.seqlen_k;
    q_longer |= c.seqlen_q > c.seqlen_k;
    no_lse |= !c.return_lse;
    EXPECT_LE(c.work(), 1.1e9) << c.name() << " is too big for the quick table";
  }
  for (const char* k : kMaskKinds) EXPECT_TRUE(kinds.count(k)) << "no case with mask kind " << k;
  for (int d : kCudaHeadDims) EXPECT_TRUE(dims.count(d)) << "no case with head_dim " << d;
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) EXPECT_TRUE(dtypes.count(t)) << dtype_name(t);
  EXPECT_TRUE(layouts.count(Layout::kBshd));
  EXPECT_TRUE(layouts.count(Layout::kBhsd));
  for (int n : {1, 7, 17, 127, 1000}) EXPECT_TRUE(seqlens.count(n)) << "no case with seqlen_q " << n;
  EXPECT_TRUE(gqa);
  EXPECT_TRUE(mqa);
  EXPECT_TRUE(q_shorter);
  EXPECT_TRUE(q_longer);
  EXPECT_TRUE(no_lse);
}

TEST(HarnessTable, FullExtendsQuickAndStaysWithinTheCpuBudget) {
  const auto quick = make_table(TableKind::kQuick, Backend::kCpu);
  const auto full = make_table(TableKind::kFull, Backend::kCpu);
  ASSERT_GT(full.size(), quick.size());
  std::set<std::string> full_names;
  double total = 0;
  for (const Case& c : full) {
    full_names.insert(c.name());
    EXPECT_LE(c.work(), kCpuMaxWorkPerCase) << c.name();
    total += c.work();
  }
  for (const Case& c : quick) EXPECT_TRUE(full_names.count(c.name())) << c.name();
  EXPECT_TRUE(full_names.count("b1_h2_n4097_d64_bf16"));
  EXPECT_LE(total, 1.2e11) << "the CPU full table would take too long on 2 cores";
}

TEST(HarnessTable, CudaFullAddsTheCourseShapes) {
  std::set<std::string> names;
  for (const Case& c : make_table(TableKind::kFull, Backend::kCuda)) names.insert(c.name());
  for (const char* n : {"b1_h8_n512_d64_bf16", "b1_h8_n2048_d64_causal_fp16", "b4_h32_n4096_d128_causal_bf16",
                        "b1_h8_n8192_d128_fp16", "b2_h16_n16384_d64_causal_bf16", "b1_h32kv8_n4096_d128_causal_bf16",
                        "b2_h8_q1000_k4097_d128_bf16", "b2_h8_n2048_d256_causal_bf16"})
    EXPECT_TRUE(names.count(n)) << n;
  // The CPU tables never get them.
  for (const Case& c : make_table(TableKind::kFull, Backend::kCpu)) EXPECT_NE(c.name(), "b2_h16_n16384_d64_bf16");
}

TEST(HarnessTable, NamesAreReadable) {
  EXPECT_EQ(make_case(2, 4096, 4096, 16, 16, 64, DType::kBF16, true).name(), "b2_h16_n4096_d64_causal_bf16");
  Case c = make_case(1, 1000, 4097, 32, 8, 128, DType::kF16, true);
  c.mask.window_left = 64;
  c.mask.window_right = 0;
  c.mask.global_tokens = 4;
  c.layout = Layout::kBhsd;
  EXPECT_EQ(c.name(), "b1_h32kv8_q1000_k4097_d128_causal_wl64_wr0_sink4_bhsd_fp16");
  EXPECT_EQ(c.mask_description(), "causal, window_left=64, window_right=0, global_tokens=4");
  Case v = make_case(3, 50, 127, 2, 2, 64, DType::kF32, true);
  v.mask.varlen_q = {1, 7, 50};
  v.mask.varlen_k = {10, 7, 127};
  v.return_lse = false;
  EXPECT_EQ(v.name(), "b3_h2_q50_k127_d64_causal_varlen1-7-50_k10-7-127_fp32_nolse");
  EXPECT_EQ(v.total_q(), 58);
  EXPECT_EQ(v.total_k(), 144);
  EXPECT_EQ(make_case(1, 7, 7, 1, 1, 64, DType::kBF16).mask_kinds(), std::vector<std::string>{"none"});
}

TEST(HarnessSummary, ClosingLine) {
  EXPECT_EQ(summary_line({3, 0, 0}), "3 passed, 0 failed");
  EXPECT_EQ(summary_line({3, 1, 2}), "3 passed, 1 failed, 2 unsupported");
}

// ---- real runs ----------------------------------------------------------------------------

TEST(HarnessRun, SmallCpuCasesPass) {
  std::vector<Case> cases = {make_case(2, 17, 17, 2, 2, 64, DType::kBF16, true),
                             make_case(1, 127, 1000, 4, 1, 128, DType::kF16, false),
                             make_case(1, 1000, 17, 2, 2, 64, DType::kF32, true)};  // rows that see no key
  Case w = make_case(1, 300, 300, 2, 1, 256, DType::kF32, true);
  w.mask.window_left = 32;
  w.mask.window_right = 0;
  w.layout = Layout::kBhsd;
  cases.push_back(w);
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    for (const Case& c : cases) {
      const CaseResult r = run_case(c, cpu_config(b));
      SCOPED_TRACE(c.name() + " on " + backend_name(b));
      EXPECT_EQ(r.status, CaseStatus::kPass) << r.message;
      EXPECT_TRUE(r.pass());
      EXPECT_EQ(r.nan_count, 0);
      EXPECT_EQ(r.guard_violations, 0);
      EXPECT_TRUE(std::isfinite(r.max_abs_err));
      EXPECT_LE(r.p50_row_err, r.p99_row_err);
      EXPECT_LE(r.p99_row_err, r.max_row_err);
      EXPECT_EQ(r.max_row_err, r.max_abs_err);
      EXPECT_TRUE(std::isfinite(r.lse_max_abs_err));
      EXPECT_EQ(r.reference, "cpu_fp64");
      EXPECT_EQ(r.kernel, b == Backend::kCpu ? "cpu_tiled_online_softmax" : "cpu_reference_fp64");
      if (b == Backend::kCpuReference) {  // the reference rounded to the dtype is the floor itself
        EXPECT_LE(r.max_abs_err, 2 * r.floor_max_abs_err + 1e-12);
      }
      if (c.dtype == DType::kF32) {
        EXPECT_TRUE(std::isfinite(r.plain_max_abs_err));
        EXPECT_LE(r.plain_max_abs_err, kPlainSanityBound);
      }
    }
  }
}

TEST(HarnessRun, SameSeedSameInputs) {
  const Case c = make_case(1, 127, 127, 2, 2, 64, DType::kBF16, true);
  const CaseResult a = run_case(c, cpu_config()), b = run_case(c, cpu_config());
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.max_abs_err, b.max_abs_err);
  EXPECT_EQ(a.floor_max_abs_err, b.floor_max_abs_err);
  EXPECT_NE(case_seed(1, "a"), case_seed(1, "b"));
  EXPECT_NE(case_seed(1, "a"), case_seed(2, "a"));
}

TEST(HarnessRun, PerturbedOutputFails) {
  const Case c = make_case(1, 127, 127, 2, 2, 64, DType::kBF16, false);
  RunConfig cfg = cpu_config();
  cfg.perturb_output = [](const Case&, HostTensor& out, std::vector<float>&) { out.set(5, out.get(5) + 0.25f); };
  const CaseResult r = run_case(c, cfg);
  EXPECT_EQ(r.status, CaseStatus::kFail);
  EXPECT_FALSE(r.pass());
  EXPECT_EQ(r.violations, 1);
  EXPECT_GE(r.max_abs_err, 0.2);
  EXPECT_NE(r.message.find("O[b=0,i=0,h=0,d=5]"), std::string::npos) << r.message;
}

// fp32 with ALiBi: the plain error is scaled by the ratio of the score's ulp in q.k's units (the
// kernels' algebra) to its ulp scaled (plain.cc's order), between 1 and 2, and only there; an
// error a few times the band still fails.
TEST(HarnessRun, Fp32AlibiBandScalesThePlainErrorByTheBinadeOnly) {
  Case c = make_case(1, 1000, 1000, 4, 2, 128, DType::kF32, false);
  c.mask.alibi = true;
  const CaseResult r = run_case(c, cpu_config());
  EXPECT_EQ(r.status, CaseStatus::kPass) << r.message;
  const double plain_part = r.effective_atol - r.tol.atol;
  EXPECT_GE(plain_part, r.tol.plain_factor * r.plain_max_abs_err * (1 - 1e-9));
  EXPECT_LE(plain_part, 2 * r.tol.plain_factor * r.plain_max_abs_err * (1 + 1e-9));
  // Here |s| <= 0.25 * 999 + a few (below 256: an ulp of 1.5e-5) and |s| / scale ~ 2830 (an ulp of
  // 2.4e-4, times the scale 0.088): the factor is 1.41.
  EXPECT_GT(plain_part, 1.3 * r.tol.plain_factor * r.plain_max_abs_err);
  Case plain_case = make_case(1, 300, 300, 2, 2, 128, DType::kF32, false);  // no ALiBi: factor 1
  const CaseResult q = run_case(plain_case, cpu_config());
  EXPECT_EQ(q.status, CaseStatus::kPass) << q.message;
  EXPECT_DOUBLE_EQ(q.effective_atol - q.tol.atol, q.tol.plain_factor * q.plain_max_abs_err);
  RunConfig cfg = cpu_config();
  const double bump = 3 * r.effective_atol;
  cfg.perturb_output = [bump](const Case&, HostTensor& out, std::vector<float>&) {
    out.set(7, out.get(7) + static_cast<float>(bump));
  };
  const CaseResult f = run_case(c, cfg);
  EXPECT_EQ(f.status, CaseStatus::kFail) << "an error of 3x the band passed";
}

TEST(HarnessRun, NanOutputFails) {
  const Case c = make_case(2, 17, 17, 2, 2, 128, DType::kF16, true);
  RunConfig cfg = cpu_config();
  cfg.perturb_output = [](const Case&, HostTensor& out, std::vector<float>&) { out.set(out.size() - 1, NAN); };
  const CaseResult r = run_case(c, cfg);
  EXPECT_EQ(r.status, CaseStatus::kFail);
  EXPECT_EQ(r.nan_count, 1);
  EXPECT_EQ(r.violations, 0);
}

// NaN-input cases (MaskSpec::nan_inputs): the truth has NaN rows, the backend must give NaN
// exactly there; both CPU backends pass. A finite value where the truth is NaN fails (before,
// |got - NaN| > tol was false and such a value passed), and so does a NaN LSE turned finite.
TEST(HarnessRun, NanInputCasesPassOnlyWithNanWhereTheTruthIsNan) {
  Case c = make_case(2, 127, 127, 4, 2, 64, DType::kBF16, true);
  c.mask.nan_inputs = true;
  c.mask.alibi = true;
  EXPECT_NE(c.name().find("_nan"), std::string::npos) << c.name();
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    const CaseResult r = run_case(c, cpu_config(b));
    EXPECT_EQ(r.status, CaseStatus::kPass) << backend_name(b) << ": " << r.message;
    EXPECT_GT(r.nan_expected, 0) << backend_name(b);
  }
  RunConfig cfg = cpu_config();
  cfg.perturb_output = [](const Case&, HostTensor& out, std::vector<float>&) {
    for (std::int64_t i = 0; i < out.size(); ++i)
      if (std::isnan(out.get(i))) {
        out.set(i, 0.f);
        return;
      }
  };
  CaseResult r = run_case(c, cfg);
  EXPECT_EQ(r.status, CaseStatus::kFail);
  EXPECT_EQ(r.nan_count, 1);
  EXPECT_NE(r.message.find("where the truth is NaN"), std::string::npos) << r.message;
  cfg.perturb_output = [](const Case&, HostTensor&, std::vector<float>& lse) {
    for (float& x : lse)
      if (std::isnan(x)) {
        x = 1.f;
        return;
      }
  };
  r = run_case(c, cfg);
  EXPECT_EQ(r.status, CaseStatus::kFail);
  EXPECT_EQ(r.lse_nan_count, 1);
}

TEST(HarnessTable, QuickHasNanInputCases) {
  int nan_cases = 0;
  for (const Case& c : make_table(TableKind::kQuick, Backend::kCpu)) nan_cases += c.mask.nan_inputs;
  EXPECT_GE(nan_cases, 3);
}

TEST(HarnessRun, WrongLseFails) {
  const Case c = make_case(1, 1000, 17, 2, 2, 64, DType::kBF16, true);
  for (float bad : {0.01f, NAN, 0.f}) {  // 0.f lands on a row that sees no key (LSE must be -inf)
    RunConfig cfg = cpu_config();
    cfg.perturb_output = [bad](const Case&, HostTensor&, std::vector<float>& lse) {
      if (std::isnan(bad) || bad == 0.f)
        lse[0] = bad;  // row 0 sees no key with seqlen_q 1000 > seqlen_k 17
      else
        lse.back() += bad;
    };
    const CaseResult r = run_case(c, cfg);
    EXPECT_EQ(r.status, CaseStatus::kFail) << "bad = " << bad;
    EXPECT_EQ(r.lse_nan_count + r.lse_violations, 1) << "bad = " << bad;
  }
}

TEST(HarnessRun, UnsupportedIsNeverAPass) {
  // fp32 never runs on CUDA: unsupported in a CPU-only build, without a device, and on a GPU.
  const Case c = make_case(1, 7, 7, 2, 2, 64, DType::kF32);
  RunConfig cfg = cpu_config(Backend::kCuda);
  bool hook_called = false;
  cfg.perturb_output = [&](const Case&, HostTensor&, std::vector<float>&) { hook_called = true; };
  const CaseResult r = run_case(c, cfg);
  EXPECT_EQ(r.status, CaseStatus::kUnsupported);
  EXPECT_FALSE(r.pass());
  EXPECT_FALSE(r.message.empty());
  EXPECT_FALSE(hook_called);
  const Summary s = summarize({r});
  EXPECT_EQ(s.passed, 0);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.unsupported, 1);
  const auto j = case_json(r);
  EXPECT_EQ(j["pass"], false);
  EXPECT_EQ(j["status"], "unsupported");
  EXPECT_TRUE(j["max_abs_err"].is_null());
}

// ---- the check command -----------------------------------------------------------------------

TEST(HarnessCheck, WrongOutputMakesTheExitStatusNonZero) {
  CheckOptions opt;
  opt.backend = Backend::kCpu;
  opt.filter = "b2_h2_n17_d64_causal_bf16";
  opt.seed = testing::run_seed();
  std::ostringstream out, err;
  ASSERT_EQ(run_check(opt, out, err), 0) << out.str() << err.str();
  EXPECT_EQ(last_line(out.str()), "1 passed, 0 failed");

  opt.perturb_output = [](const Case&, HostTensor& out_t, std::vector<float>&) { out_t.set(0, out_t.get(0) - 1.f); };
  std::ostringstream out2, err2;
  EXPECT_EQ(run_check(opt, out2, err2), 1);
  EXPECT_EQ(last_line(out2.str()), "0 passed, 1 failed");
  EXPECT_NE(out2.str().find("FAIL"), std::string::npos);
}

TEST(HarnessCheck, FilterMatchingNothingIsAUsageError) {
  CheckOptions opt;
  opt.backend = Backend::kCpu;
  opt.filter = "no-such-case";
  std::ostringstream out, err;
  EXPECT_EQ(run_check(opt, out, err), 2);
  EXPECT_NE(err.str().find("no-such-case"), std::string::npos);
}

TEST(HarnessCheck, ListPrintsNames) {
  CheckOptions opt;
  opt.backend = Backend::kCpu;
  opt.filter = "_varlen";
  opt.list_only = true;
  std::ostringstream out, err;
  EXPECT_EQ(run_check(opt, out, err), 0);
  std::istringstream in(out.str());
  int n = 0;
  for (std::string line; std::getline(in, line); ++n) EXPECT_NE(line.find("_varlen"), std::string::npos);
  EXPECT_GE(n, 3);
}

TEST(HarnessCheck, JsonReportHasTheRequiredKeysAndTypes) {
  RunConfig cfg = cpu_config();
  std::vector<CaseResult> results;
  results.push_back(run_case(make_case(1, 7, 7, 2, 2, 64, DType::kBF16, true), cfg));
  Case lse_off = make_case(1, 17, 17, 2, 1, 128, DType::kF32);
  lse_off.return_lse = false;
  results.push_back(run_case(lse_off, cfg));
  RunConfig bad = cfg;
  bad.perturb_output = [](const Case&, HostTensor& out, std::vector<float>&) { out.set(0, 100.f); };
  results.push_back(run_case(make_case(1, 7, 7, 2, 2, 64, DType::kF16), bad));
  results.push_back(run_case(make_case(1, 7, 7, 2, 2, 64, DType::kF32), cpu_config(Backend::kCuda)));

  const auto j = report_json(describe_environment(Backend::kCpu, cfg.seed), results);
  ASSERT_TRUE(j.contains("environment"));
  const auto& env = j["environment"];
  for (const char* k : {"device", "backend", "git_commit", "timestamp"}) {
    ASSERT_TRUE(env.contains(k)) << k;
    EXPECT_TRUE(env[k].is_string()) << k;
  }
  EXPECT_EQ(env["backend"], "cpu");
  EXPECT_TRUE(env["seed"].is_number_unsigned());
  EXPECT_EQ(env["seed"].get<std::uint64_t>(), cfg.seed);
  ASSERT_TRUE(env["build"].is_object());
  EXPECT_TRUE(env["build"]["cuda"].is_boolean());
  if (env["build"]["cuda"].get<bool>()) {
    EXPECT_TRUE(env["cuda_driver"].is_string());
    EXPECT_TRUE(env["cuda_runtime"].is_string());
  }
  ASSERT_TRUE(j["tolerance_policy"].is_object());
  for (const char* t : {"bf16", "fp16", "fp32"}) {
    EXPECT_TRUE(j["tolerance_policy"][t]["atol"].is_number()) << t;
    EXPECT_TRUE(j["tolerance_policy"][t]["rtol"].is_number()) << t;
    EXPECT_TRUE(j["tolerance_policy"][t]["lse_atol"].is_number()) << t;
  }
  EXPECT_EQ(j["summary"]["passed"], 2);
  EXPECT_EQ(j["summary"]["failed"], 1);
  EXPECT_EQ(j["summary"]["unsupported"], 1);
  ASSERT_TRUE(j["cases"].is_array());
  ASSERT_EQ(j["cases"].size(), 4u);
  for (const auto& c : j["cases"]) {
    for (const char* k : {"name", "status", "dtype", "layout", "mask", "kernel", "config", "message"})
      EXPECT_TRUE(c[k].is_string()) << k;
    EXPECT_TRUE(c["pass"].is_boolean());
    EXPECT_TRUE(c["causal"].is_boolean());
    for (const char* k : {"batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "nan_count"})
      EXPECT_TRUE(c[k].is_number_integer()) << k;
    EXPECT_TRUE(c["tolerance"]["atol"].is_number());
    EXPECT_TRUE(c["tolerance"]["rtol"].is_number());
    EXPECT_EQ(c["pass"].get<bool>(), c["status"] == "pass");
    const bool ran = c["status"] != "unsupported";
    for (const char* k : {"max_abs_err", "mean_abs_err", "p99_row_err", "max_row_err", "ms"})
      EXPECT_EQ(c[k].is_number(), ran) << c["name"] << " " << k;
    if (!ran) {
      EXPECT_TRUE(c["lse_max_abs_err"].is_null());
    }
  }
  EXPECT_EQ(j["cases"][0]["status"], "pass");
  EXPECT_TRUE(j["cases"][0]["lse_max_abs_err"].is_number());
  EXPECT_TRUE(j["cases"][1]["lse_max_abs_err"].is_null());  // not requested
  EXPECT_EQ(j["cases"][2]["status"], "fail");
  EXPECT_EQ(j["cases"][3]["status"], "unsupported");
  // Round trip through text: nothing non-finite leaked into the document.
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
}

TEST(HarnessCheck, WritesTheJsonFile) {
  CheckOptions opt;
  opt.backend = Backend::kCpu;
  opt.filter = "b2_h2_n7_d64_bf16";
  opt.seed = 7;
  opt.json_path = ::testing::TempDir() + "flashcpp_harness_test/report.json";
  std::ostringstream out, err;
  ASSERT_EQ(run_check(opt, out, err), 0) << out.str() << err.str();
  std::ifstream f(opt.json_path);
  ASSERT_TRUE(f.good());
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["environment"]["seed"], 7);
  EXPECT_EQ(j["cases"].size(), 1u);
  EXPECT_EQ(j["cases"][0]["name"], "b2_h2_n7_d64_bf16");
  EXPECT_TRUE(std::regex_search(out.str(), std::regex("\\n1 passed, 0 failed\\n$")));
}

// cpu::run_with_rotary (flashcpp/reference.h), through which the harness's fp64 reference and plain
// fp32 implementation see rotary problems: the callee gets rotary off and q, k rotated by the CPU
// apply_rotary in the input dtype (default positions: queries bottom-right aligned), so its result
// is bit-identical to apply_rotary on copies followed by the plain call; the caller's q and k are
// untouched, rotary.k_rotated receives the rotated keys, and without rotary p passes through.
TEST(HarnessReference, RunWithRotaryIsApplyRotaryThenTheCall) {
  const int B = 2, sq = 7, sk = 11, hq = 4, hkv = 2, d = 64;
  const DType dt = DType::kBF16;
  auto g = testing::rng(26);
  testing::HostBuffer q(dt, std::int64_t{B} * sq * hq * d), k(dt, std::int64_t{B} * sk * hkv * d),
      v(dt, std::int64_t{B} * sk * hkv * d), kr(dt, k.size());
  q.fill_normal(g);
  k.fill_normal(g);
  v.fill_normal(g);
  kr.poison();
  const testing::HostBuffer q0 = q, k0 = k;
  auto params = [&](const void* qd, const void* kd, bool rotary) {
    AttnParams p;
    p.batch = B;
    p.seqlen_q = sq;
    p.seqlen_k = sk;
    p.heads_q = hq;
    p.heads_kv = hkv;
    p.head_dim = d;
    p.q = bshd_view(const_cast<void*>(qd), dt, sq, hq, d);
    p.k = bshd_view(const_cast<void*>(kd), dt, sk, hkv, d);
    p.v = bshd_view(v.data(), dt, sk, hkv, d);
    p.mask.causal = true;
    if (rotary) {
      p.rotary.spec.rotary_dim = d / 2;
      p.rotary.spec.style = RopeStyle::kInterleaved;
      p.rotary.k_rotated = bshd_view(kr.data(), dt, sk, hkv, d);
    }
    return p;
  };

  // Expected: apply_rotary on copies (queries at i + sk - sq, keys at j), then the reference.
  testing::HostBuffer qe = q, ke = k;
  std::vector<std::int32_t> pos_q, pos_k;
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < sq; ++i) pos_q.push_back(i + sk - sq);
    for (int j = 0; j < sk; ++j) pos_k.push_back(j);
  }
  RunOptions cpu;
  cpu.backend = Backend::kCpu;
  for (const bool query : {true, false}) {
    RopeParams rp;
    rp.batch = B;
    rp.seqlen = query ? sq : sk;
    rp.heads_q = query ? hq : hkv;
    rp.head_dim = d;
    rp.rotary.rotary_dim = d / 2;
    rp.rotary.style = RopeStyle::kInterleaved;
    rp.q = query ? bshd_view(qe.data(), dt, sq, hq, d) : bshd_view(ke.data(), dt, sk, hkv, d);
    rp.positions = query ? pos_q.data() : pos_k.data();
    const Status s = apply_rotary(rp, cpu);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  cpu::RefOutput want, got;
  ASSERT_TRUE(cpu::reference_attention(params(qe.data(), ke.data(), false), &want, 1).ok());

  bool callee_saw_rotary = true;
  const Status s = cpu::run_with_rotary(params(q.data(), k.data(), true), cpu, [&](const AttnParams& a) {
    callee_saw_rotary = a.rotary.enabled();
    return cpu::reference_attention(a, &got, 1);
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_FALSE(callee_saw_rotary);
  EXPECT_EQ(got.total_q, want.total_q);
  EXPECT_EQ(got.o, want.o);
  EXPECT_EQ(got.lse, want.lse);
  EXPECT_EQ(q.bytes, q0.bytes) << "q was changed";
  EXPECT_EQ(k.bytes, k0.bytes) << "k was changed";
  EXPECT_EQ(kr.bytes, ke.bytes) << "rotary.k_rotated does not hold apply_rotary's keys";
  EXPECT_NE(ke.bytes, k0.bytes);  // the rotation did something

  const void* seen_q = nullptr;
  ASSERT_TRUE(cpu::run_with_rotary(params(q.data(), k.data(), false), cpu, [&](const AttnParams& a) {
                seen_q = a.q.data;
                return Status::Ok();
              }).ok());
  EXPECT_EQ(seen_q, q.data());
}

}  // namespace
}  // namespace flashcpp::harness
