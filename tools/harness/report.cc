// Environment description, summary and the correctness_report.json document.
#include <cmath>
#include <ctime>
#include <fstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "harness/harness.h"
#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "flashcpp_git_commit.h"  // FLASHCPP_GIT_COMMIT, written at build time (cmake/git_commit.cmake)

namespace flashcpp::harness {

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto s = line.substr(colon + 1);
        s.erase(0, s.find_first_not_of(" \t"));
        return s;
      }
    }
  }
  return "unknown CPU";
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

/// A number, or null when it was not measured (NaN) or is infinite (JSON has no Inf).
nlohmann::json num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

/// 12080 -> "12.8" (the CUDA API's integer version encoding).
std::string cuda_version(int v) { return v > 0 ? fmt::format("{}.{}", v / 1000, (v % 1000) / 10) : "unknown"; }

}  // namespace

Environment describe_environment(Backend backend, std::uint64_t seed) {
  Environment env;
  env.backend = backend_name(backend);
  env.git_commit = FLASHCPP_GIT_COMMIT;
  env.seed = seed;
  env.timestamp = utc_timestamp();
  env.device = fmt::format("{} ({} threads)", cpu_model(), std::thread::hardware_concurrency());
#if FLASHCPP_WITH_CUDA
  env.cuda_build = true;
  if (cudaDriverGetVersion(&env.cuda_driver) != cudaSuccess) env.cuda_driver = 0;
  if (cudaRuntimeGetVersion(&env.cuda_runtime) != cudaSuccess) env.cuda_runtime = 0;
  if (backend == Backend::kCuda) {
    int dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
      env.device = fmt::format("{} (sm_{}{}, {} SMs)", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    else
      env.device = "no CUDA device";
  }
#endif
  return env;
}

Summary summarize(const std::vector<CaseResult>& results) {
  Summary s;
  for (const auto& r : results) {
    switch (r.status) {
      case CaseStatus::kPass: ++s.passed; break;
      case CaseStatus::kFail: ++s.failed; break;
      case CaseStatus::kUnsupported: ++s.unsupported; break;
    }
  }
  return s;
}

std::string summary_line(const Summary& s) {
  std::string line = fmt::format("{} passed, {} failed", s.passed, s.failed);
  if (s.unsupported > 0) line += fmt::format(", {} unsupported", s.unsupported);
  return line;
}

nlohmann::json case_json(const CaseResult& r) {
  const Case& c = r.c;
  nlohmann::json j;
  j["name"] = r.name;
  j["pass"] = r.pass();
  j["status"] = case_status_name(r.status);
  j["batch"] = c.batch;
  j["heads_q"] = c.heads_q;
  j["heads_kv"] = c.heads_kv;
  j["seqlen_q"] = c.seqlen_q;
  j["seqlen_k"] = c.seqlen_k;
  j["head_dim"] = c.head_dim;
  j["dtype"] = dtype_name(c.dtype);
  j["layout"] = c.mask.is_varlen() ? "varlen" : layout_name(c.layout);
  j["mask"] = c.mask_description();
  j["mask_kinds"] = c.mask_kinds();
  j["causal"] = c.mask.causal;
  j["window_left"] = c.mask.window_left;
  j["window_right"] = c.mask.window_right;
  j["softmax_scale"] = c.softmax_scale;
  j["return_lse"] = c.return_lse;
  j["kernel"] = r.kernel;
  j["config"] = r.config;
  j["kernel_reason"] = r.kernel_reason;
  j["reference"] = r.reference;
  j["seed"] = r.seed;
  j["message"] = r.message;
  j["max_abs_err"] = num(r.max_abs_err);
  j["mean_abs_err"] = num(r.mean_abs_err);
  j["p50_row_err"] = num(r.p50_row_err);
  j["p99_row_err"] = num(r.p99_row_err);
  j["max_row_err"] = num(r.max_row_err);
  j["max_rel_err"] = num(r.max_rel_err);
  j["tol_ratio"] = num(r.tol_ratio);
  j["floor_max_abs_err"] = num(r.floor_max_abs_err);
  j["floor_mean_abs_err"] = num(r.floor_mean_abs_err);
  j["err_over_floor"] = num(r.floor_max_abs_err > 0 ? r.max_abs_err / r.floor_max_abs_err : NAN);
  j["lse_max_abs_err"] = num(r.lse_max_abs_err);
  j["plain_max_abs_err"] = num(r.plain_max_abs_err);
  j["plain_lse_max_abs_err"] = num(r.plain_lse_max_abs_err);
  j["err_over_plain"] = num(r.plain_max_abs_err > 0 ? r.max_abs_err / r.plain_max_abs_err : NAN);
  j["tolerance"] = {{"atol", r.tol.atol},
                    {"rtol", r.tol.rtol},
                    {"lse_atol", r.tol.lse_atol},
                    {"effective_atol", num(r.effective_atol)},
                    {"effective_lse_atol", num(r.effective_lse_atol)}};
  if (r.tol.plain_factor > 0) j["tolerance"]["plain_factor"] = r.tol.plain_factor;
  j["nan_count"] = r.nan_count;
  j["nan_expected"] = r.nan_expected;
  j["lse_nan_count"] = r.lse_nan_count;
  j["guard_violations"] = r.guard_violations;
  j["violations"] = r.violations;
  j["lse_violations"] = r.lse_violations;
  j["ms"] = num(r.ms);
  j["ref_ms"] = num(r.ref_ms);
  if (r.area != "attention") {  // attention cases keep their original fields
    j["area"] = r.area;
    j["page_size"] = r.page_size;
    j["num_splits"] = r.num_splits;
  }
  return j;
}

nlohmann::json environment_json(const Environment& env) {
  nlohmann::json e;
  e["device"] = env.device;
  e["backend"] = env.backend;
  e["git_commit"] = env.git_commit;
  e["seed"] = env.seed;
  e["build"] = {{"cuda", env.cuda_build}};
  if (env.cuda_build) {
    e["cuda_driver"] = cuda_version(env.cuda_driver);
    e["cuda_runtime"] = cuda_version(env.cuda_runtime);
  }
  e["timestamp"] = env.timestamp;
  return e;
}

nlohmann::json report_json(const Environment& env, const std::vector<CaseResult>& results) {
  nlohmann::json j;
  j["environment"] = environment_json(env);
  j["tolerance_policy"] = tolerance_policy_json();
  const Summary s = summarize(results);
  j["summary"] = {{"passed", s.passed}, {"failed", s.failed}, {"unsupported", s.unsupported}};
  j["cases"] = nlohmann::json::array();
  for (const auto& r : results) j["cases"].push_back(case_json(r));
  return j;
}

}  // namespace flashcpp::harness
