// `flashcpp check --area decode|fused` on the CPU backend: quick runs pass, a perturbed output
// fails, and the JSON report carries the area (and page_size / num_splits) of every case.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "harness/harness.h"

namespace flashcpp::harness {
namespace {

CheckOptions quick(CheckArea area, const std::string& filter) {
  CheckOptions opt;
  opt.backend = Backend::kCpu;
  opt.area = area;
  opt.filter = filter;
  opt.seed = 1234;
  return opt;
}

TEST(CheckAreas, ParseNames) {
  CheckArea a = CheckArea::kAttention;
  EXPECT_TRUE(parse_check_area("decode", &a));
  EXPECT_EQ(a, CheckArea::kDecode);
  EXPECT_TRUE(parse_check_area("fused", &a));
  EXPECT_EQ(a, CheckArea::kFused);
  EXPECT_TRUE(parse_check_area("all", &a));
  EXPECT_EQ(a, CheckArea::kAll);
  EXPECT_FALSE(parse_check_area("prefill", &a));
}

TEST(CheckAreas, DecodeQuickPassesWithJson) {
  const std::string path = ::testing::TempDir() + "check_areas_decode.json";
  CheckOptions opt = quick(CheckArea::kDecode, "");
  opt.json_path = path;
  std::ostringstream out, err;
  ASSERT_EQ(run_check(opt, out, err), 0) << out.str() << err.str();
  EXPECT_NE(out.str().find("area decode"), std::string::npos);
  EXPECT_NE(out.str().find("passed, 0 failed"), std::string::npos);
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_FALSE(j["cases"].empty());
  bool paged = false, split = false;
  for (const auto& c : j["cases"]) {
    EXPECT_EQ(c["area"], "decode");
    EXPECT_TRUE(c.contains("page_size"));
    EXPECT_TRUE(c.contains("num_splits"));
    EXPECT_EQ(c["status"], "pass") << c["name"] << ": " << c["message"];
    paged |= c["page_size"].get<int>() > 0;
    split |= c["num_splits"].get<int>() > 1;
  }
  EXPECT_TRUE(paged);
  EXPECT_TRUE(split);
  std::remove(path.c_str());
}

TEST(CheckAreas, FusedQuickPassesWithJson) {
  const std::string path = ::testing::TempDir() + "check_areas_fused.json";
  CheckOptions opt = quick(CheckArea::kFused, "");
  opt.json_path = path;
  std::ostringstream out, err;
  ASSERT_EQ(run_check(opt, out, err), 0) << out.str() << err.str();
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_FALSE(j["cases"].empty());
  for (const auto& c : j["cases"]) {
    EXPECT_EQ(c["area"], "fused");
    EXPECT_EQ(c["status"], "pass") << c["name"] << ": " << c["message"];
  }
  std::remove(path.c_str());
}

TEST(CheckAreas, AttentionJsonUnchanged) {
  CheckOptions opt = quick(CheckArea::kAttention, "b2_h2_n1_d64_bf16");
  const std::string path = ::testing::TempDir() + "check_areas_attn.json";
  opt.json_path = path;
  std::ostringstream out, err;
  const int rc = run_check(opt, out, err);
  if (rc == 2) GTEST_SKIP() << "no such attention case: " << err.str();
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  for (const auto& c : j["cases"]) EXPECT_FALSE(c.contains("area"));
  std::remove(path.c_str());
}

void expect_perturbed_fails(CheckArea area, const std::string& filter) {
  CheckOptions opt = quick(area, filter);
  opt.perturb_output = [](const Case&, HostTensor& o, std::vector<float>&) { o.set(o.size() / 2, o.get(o.size() / 2) + 0.5f); };
  std::ostringstream out, err;
  EXPECT_EQ(run_check(opt, out, err), 1) << out.str();
  EXPECT_NE(out.str().find("FAIL"), std::string::npos);
  EXPECT_NE(out.str().find("\n0 passed"), std::string::npos) << out.str();
}

TEST(CheckAreas, PerturbedDecodeOutputFails) { expect_perturbed_fails(CheckArea::kDecode, "paged16"); }
TEST(CheckAreas, PerturbedFusedOutputFails) { expect_perturbed_fails(CheckArea::kFused, "rms_norm_r7_h4097"); }

// The decode area's NaN-input cases (NaN in one q row): they pass on the CPU backend (checked
// in DecodeQuickPassesWithJson too), and a finite value where the truth is NaN fails.
TEST(CheckAreas, DecodeNanInputCase) {
  CheckOptions opt = quick(CheckArea::kDecode, "_nan");
  std::ostringstream out, err;
  ASSERT_EQ(run_check(opt, out, err), 0) << out.str() << err.str();
  EXPECT_NE(out.str().find("passed, 0 failed"), std::string::npos) << out.str();
  opt.perturb_output = [](const Case&, HostTensor& o, std::vector<float>&) {
    for (std::int64_t i = 0; i < o.size(); ++i)
      if (std::isnan(o.get(i))) {
        o.set(i, 0.f);
        return;
      }
  };
  std::ostringstream out2;
  EXPECT_EQ(run_check(opt, out2, err), 1) << out2.str();
  EXPECT_NE(out2.str().find("where the truth is NaN"), std::string::npos) << out2.str();
}

TEST(CheckAreas, NanOutputFails) {
  CheckOptions opt = quick(CheckArea::kFused, "silu_and_mul_r7_d8_bf16");
  opt.perturb_output = [](const Case&, HostTensor& o, std::vector<float>&) { o.set(0, NAN); };
  std::ostringstream out, err;
  EXPECT_EQ(run_check(opt, out, err), 1) << out.str();
}

}  // namespace
}  // namespace flashcpp::harness
