// `flashcpp check`: run a case table, print the aligned table and the closing summary line,
// write correctness_report.json.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "harness/harness.h"
#include "cli_checks.h"  // unwritable
#if FLASHCPP_WITH_CUDA
#include "flashcpp/device.h"
#endif

namespace flashcpp::harness {

namespace {

std::string sci(double x) { return std::isnan(x) ? "-" : fmt::format("{:.2e}", x); }

const char* status_word(CaseStatus s) {
  switch (s) {
    case CaseStatus::kPass: return "PASS";
    case CaseStatus::kFail: return "FAIL";
    case CaseStatus::kUnsupported: return "UNSUPPORTED";
  }
  return "?";
}

/// "1e-02/1e-02": atol/rtol as applied (fp32: atol widened by the plain-fp32 rule, 2 digits).
std::string tol_text(const CaseResult& r) {
  const double atol = std::isnan(r.effective_atol) ? r.tol.atol : r.effective_atol;
  return atol == r.tol.atol ? fmt::format("{:.0e}/{:.0e}", atol, r.tol.rtol)
                            : fmt::format("{:.1e}/{:.0e}", atol, r.tol.rtol);
}

/// A backend the user named explicitly must exist; returns the sentence when it does not.
std::string backend_unavailable(Backend requested) {
  if (requested != Backend::kCuda) return {};
#if FLASHCPP_WITH_CUDA
  cuda::DeviceInfo dev;
  const Status st = cuda::current_device(&dev);
  return st.ok() ? std::string() : "--backend cuda: " + st.message();
#else
  return "--backend cuda: this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)";
#endif
}

}  // namespace

int run_check(const CheckOptions& opt, std::ostream& out, std::ostream& err) {
  if (const std::string why = backend_unavailable(opt.backend); !why.empty()) {
    err << "flashcpp check: " << why << "\n";
    return 2;
  }
  const Backend backend = resolve_backend(opt.backend);
  // The selected areas' cases, in order: attention, decode, fused, backward.
  std::vector<AreaCase> cases;
  const bool all = opt.area == CheckArea::kAll;
  auto keep = [&](const std::string& name) { return opt.filter.empty() || name.find(opt.filter) != std::string::npos; };
  if (all || opt.area == CheckArea::kAttention)
    for (const Case& c : make_table(opt.table, backend))
      if (keep(c.name())) cases.push_back({c.name(), [c](const RunConfig& cfg) { return run_case(c, cfg); }});
  if (all || opt.area == CheckArea::kDecode)
    for (AreaCase& a : make_decode_table(opt.table, backend))
      if (keep(a.name)) cases.push_back(std::move(a));
  if (all || opt.area == CheckArea::kFused)
    for (AreaCase& a : make_fused_table(opt.table, backend))
      if (keep(a.name)) cases.push_back(std::move(a));
  if (all || opt.area == CheckArea::kBackward)
    for (AreaCase& a : make_backward_table(opt.table, backend))
      if (keep(a.name)) cases.push_back(std::move(a));
  if (cases.empty()) {
    err << "flashcpp check: no case of the " << table_name(opt.table) << " table"
        << (opt.area == CheckArea::kAttention ? std::string() : fmt::format(" (area {})", check_area_name(opt.area)))
        << " matches '" << opt.filter << "'\n";
    return 2;
  }
  if (opt.list_only) {
    for (const AreaCase& c : cases) out << c.name << "\n";
    return 0;
  }
  // A CUDA config would be ignored by the CPU backends: refuse it rather than drop it.
  if (!opt.cuda_config.empty() && backend != Backend::kCuda) {
    err << "flashcpp check: --cuda-config " << opt.cuda_config << " picks a CUDA kernel config, but the run is on "
        << backend_name(backend)
        << (opt.backend == Backend::kAuto ? " (--backend auto found no usable CUDA device)" : "")
        << "; leave --cuda-config out or add --backend cuda\n";
    return 2;
  }
  // The JSON is written after the whole run (minutes for --full): a path that cannot be written
  // fails now. A file that did not exist is created to prove it and removed again.
  if (!opt.json_path.empty()) {
    if (const std::string why = tools::unwritable("--json", opt.json_path, /*create_folder=*/true); !why.empty()) {
      err << "flashcpp check: cannot write --json: " << why << "; nothing was run\n";
      return 2;
    }
  }

  RunConfig cfg;
  cfg.backend = backend;
  cfg.seed = opt.seed ? *opt.seed : random_seed();
  cfg.cpu_threads = opt.cpu_threads;
  cfg.cuda_config = opt.cuda_config;
  cfg.perturb_output = opt.perturb_output;
  const Environment env = describe_environment(backend, cfg.seed);

  out << fmt::format("flashcpp check: backend {} on {}, {} table, {}{} cases, seed {} (replay with --seed {})\n",
                     backend_name(backend), env.device, table_name(opt.table),
                     opt.area == CheckArea::kAttention ? std::string() : fmt::format("area {}, ", check_area_name(opt.area)),
                     cases.size(), cfg.seed, cfg.seed);
  std::size_t wname = 4;
  for (const AreaCase& c : cases) wname = std::max(wname, c.name.size());
  const std::string header =
      fmt::format("{:<{}}  {:<28}  {:>11}  {:>11}  {:>9}  {:>9}  {:>13}  {:>9}  {}", "case", wname, "kernel",
                  "max_abs_err", "p99_row_err", "lse_err", "floor", "atol/rtol", "ms", "status");
  out << header << "\n" << std::string(header.size(), '-') << "\n" << std::flush;

  std::vector<CaseResult> results;
  std::map<std::string, int> unsupported_reasons;
  for (const AreaCase& c : cases) {
    CaseResult r = c.run(cfg);
    std::string kernel = r.kernel;
    if (!r.config.empty()) kernel += " " + r.config;
    out << fmt::format("{:<{}}  {:<28}  {:>11}  {:>11}  {:>9}  {:>9}  {:>13}  {:>9}  {}\n", r.name, wname, kernel,
                       sci(r.max_abs_err), sci(r.p99_row_err), sci(r.lse_max_abs_err), sci(r.floor_max_abs_err),
                       tol_text(r),
                       std::isnan(r.ms) ? std::string("-") : fmt::format("{:.2f}", r.ms), status_word(r.status));
    if (r.status == CaseStatus::kFail) out << "    -> " << r.message << "\n";
    if (r.status == CaseStatus::kUnsupported) ++unsupported_reasons[r.message];
    out << std::flush;
    results.push_back(std::move(r));
  }
  for (const auto& [why, n] : unsupported_reasons)
    out << fmt::format("unsupported ({} case{}): {}\n", n, n == 1 ? "" : "s", why);

  int rc = 0;
  if (!opt.json_path.empty()) {
    std::error_code ec;
    const std::filesystem::path path(opt.json_path);
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
    std::ofstream f(path);
    if (f << report_json(env, results).dump(2) << "\n" << std::flush) {  // a full disk shows at the flush
      out << "report: " << opt.json_path << "\n";
    } else {
      err << "flashcpp check: cannot write " << opt.json_path << "\n";
      rc = 2;
    }
  }
  const Summary s = summarize(results);
  out << summary_line(s) << "\n" << std::flush;
  if (s.failed > 0) return 1;
  return rc;
}

}  // namespace flashcpp::harness
