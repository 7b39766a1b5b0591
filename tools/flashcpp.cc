// The flashcpp command-line tool.
//
//   flashcpp info  [shape options]   build, devices, supported head dims, the kernel choice for a shape
//   flashcpp check [--backend ...]   the correctness harness (tools/harness/), JSON report
//   flashcpp bench | tune            time / tune the CUDA prefill kernels (tools/tune.cc)
//   flashcpp audit [--quick ...]     numerics under stress inputs, per-row error CDFs (tools/audit.h)
//   flashcpp decode --model DIR ...  the Llama decode engine (tools/decode_cmd.cc, src/engine/)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "audit.h"
#include "cli_checks.h"
#if FLASHCPP_HAS_ENGINE
#include "decode_cmd.h"
#endif
#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/build.h"
#include "flashcpp/decode.h"
#include "harness/harness.h"
#include "tune.h"
#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "flashcpp/device.h"
#include "flashcpp/tune.h"
#endif

#include "flashcpp_git_commit.h"  // FLASHCPP_GIT_COMMIT, written at build time (cmake/git_commit.cmake)

namespace {

// Keep in step with project(flashcpp VERSION ...) in CMakeLists.txt.
constexpr const char* kVersion = "0.1.0";

using flashcpp::AttnParams;
using flashcpp::Backend;
using flashcpp::DType;
using flashcpp::KernelChoice;
using flashcpp::RunOptions;
using flashcpp::Status;

struct ShapeOptions {
  int batch = 1, seqlen_q = 4096, seqlen_k = -1, heads_q = 32, heads_kv = -1, head_dim = 128;
  int head_dim_v = 0;  ///< 0 = head_dim
  std::string dtype = "bf16";
  bool causal = false;
  int window_left = -1, window_right = -1;
};

DType parse_dtype(const std::string& s) {
  if (s == "fp16") return DType::kF16;
  if (s == "fp32") return DType::kF32;
  return DType::kBF16;
}

/// Where info_params puts q, k, v and o. Validation and kernel selection read no element, so
/// `flashcpp info` allocates nothing for the shape it is asked about: the tensors are laid out
/// back to back from a fake base address (256-byte aligned, never dereferenced).
struct InfoLayout {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  unsigned __int128 q_bytes = 0, k_bytes = 0, v_bytes = 0, o_bytes = 0;
  unsigned __int128 end = 0;  ///< the first byte past o
  bool fits = false;  ///< false: the four tensors would not fit in a 64-bit address space
};

/// Addresses for q, k, v, o of a shape, 256-byte aligned from `base` on (never dereferenced).
InfoLayout info_layout(const ShapeOptions& s, unsigned __int128 base = static_cast<unsigned __int128>(1) << 20) {
  using U = unsigned __int128;
  InfoLayout l;
  const U es = flashcpp::dtype_size(parse_dtype(s.dtype));
  const U dv = U(s.head_dim_v ? s.head_dim_v : s.head_dim);
  l.q_bytes = U(s.batch) * U(s.seqlen_q) * U(s.heads_q) * U(s.head_dim) * es;
  l.k_bytes = U(s.batch) * U(s.seqlen_k) * U(s.heads_kv) * U(s.head_dim) * es;
  l.v_bytes = U(s.batch) * U(s.seqlen_k) * U(s.heads_kv) * dv * es;
  l.o_bytes = U(s.batch) * U(s.seqlen_q) * U(s.heads_q) * dv * es;
  constexpr U kAlign = 256;
  auto up = [&](U x) { return (x + kAlign - 1) / kAlign * kAlign; };
  const U q = up(base), k = up(q + l.q_bytes), v = up(k + l.k_bytes), o = up(v + l.v_bytes), end = o + l.o_bytes;
  l.end = end;
  l.fits = end < (U(1) << 63);
  if (l.fits) {
    l.q = reinterpret_cast<void*>(static_cast<std::uintptr_t>(q));
    l.k = reinterpret_cast<void*>(static_cast<std::uintptr_t>(k));
    l.v = reinterpret_cast<void*>(static_cast<std::uintptr_t>(v));
    l.o = reinterpret_cast<void*>(static_cast<std::uintptr_t>(o));
  }
  return l;
}

/// The shape's sizes and mask into an attention or decode params struct (the same field names).
template <class Params>
void set_shape(const ShapeOptions& s, Params* p) {
  p->batch = s.batch;
  p->seqlen_q = s.seqlen_q;
  p->heads_q = s.heads_q;
  p->heads_kv = s.heads_kv;
  p->head_dim = s.head_dim;
  p->head_dim_v = s.head_dim_v;
  p->mask.causal = s.causal;
  p->mask.window_left = s.window_left;
  p->mask.window_right = s.window_right;
}

AttnParams info_params(const ShapeOptions& s, void* q, void* k, void* v, void* o) {
  AttnParams p;
  set_shape(s, &p);
  p.seqlen_k = s.seqlen_k;
  const DType dt = parse_dtype(s.dtype);
  p.q = flashcpp::bshd_view(q, dt, s.seqlen_q, s.heads_q, s.head_dim);
  p.k = flashcpp::bshd_view(k, dt, s.seqlen_k, s.heads_kv, s.head_dim);
  p.v = flashcpp::bshd_view(v, dt, s.seqlen_k, s.heads_kv, p.effective_head_dim_v());
  p.o = flashcpp::bshd_view(o, dt, s.seqlen_q, s.heads_q, p.effective_head_dim_v());
  return p;
}

std::string bytes_str(unsigned __int128 b) {
  const double x = static_cast<double>(b);
  if (x < 1024) return fmt::format("{:.0f} B", x);
  if (x < 1024.0 * 1024) return fmt::format("{:.1f} KiB", x / 1024);
  if (x < 1024.0 * 1024 * 1024) return fmt::format("{:.1f} MiB", x / (1024.0 * 1024));
  return fmt::format("{:.4g} GiB", x / (1024.0 * 1024 * 1024));
}

/// What is wrong with a shape whose every flag is in range (CLI11's validators, main()), as one
/// sentence for exit status 2; "" when info can ask the dispatcher about it.
std::string info_shape_error(const ShapeOptions& s) {
  if (s.heads_q % s.heads_kv != 0)
    return fmt::format("--heads-q {} is not a multiple of --heads-kv {} (each key/value head serves a whole "
                       "group of query heads)",
                       s.heads_q, s.heads_kv);
  if (const InfoLayout l = info_layout(s); !l.fits)
    return fmt::format("q, k, v and o of this shape would take {}, more than a 64-bit address space holds",
                       bytes_str(l.q_bytes + l.k_bytes + l.v_bytes + l.o_bytes));
  return {};
}

/// The split plan decode would make for the shape's heads and head dims: seqlen_q new tokens a
/// sequence over a contiguous cache of seqlen_k keys, as the CUDA backend plans it for the 132 SMs of
/// an H200 (the CPU planner walks the same rule), with each DecodePlanOptions::small_plan. The planner
/// reads no tensor element: only its work list is allocated, and only when under 64 MiB.
void print_decode_plan(const ShapeOptions& s) {
  using Small = flashcpp::DecodePlanOptions::SmallPlan;
  constexpr int kSms = 132;
  constexpr std::size_t kMaxWorkList = std::size_t{64} << 20;
  flashcpp::DecodeParams p;
  set_shape(s, &p);
  const DType dt = parse_dtype(s.dtype);
  const int dv = p.effective_head_dim_v();
  p.q = flashcpp::bshd_view(nullptr, dt, s.seqlen_q, s.heads_q, s.head_dim);
  p.o = flashcpp::bshd_view(nullptr, dt, s.seqlen_q, s.heads_q, dv);
  p.cache.k = flashcpp::bshd_view(nullptr, dt, s.seqlen_k, s.heads_kv, s.head_dim);
  p.cache.v = flashcpp::bshd_view(nullptr, dt, s.seqlen_k, s.heads_kv, dv);
  p.cache.capacity = s.seqlen_k;
  fmt::print("decode plan for the same heads, {} new token(s) a sequence over a cache of {} keys ({} SMs):\n",
             s.seqlen_q, s.seqlen_k, kSms);
  for (const Small small : {Small::kFullWave, Small::kShared}) {
    const char* name = small == Small::kFullWave ? "full_wave" : "shared";
    flashcpp::DecodePlanOptions o;
    o.backend = Backend::kCpu;
    o.num_sms = kSms;
    o.small_plan = small;
    flashcpp::DecodeWorkspaceSize ws;
    Status st = flashcpp::decode_workspace_size(p, o, &ws);
    if (st.ok() && ws.int_bytes > kMaxWorkList) {
      fmt::print("  small_plan {}: not planned here (its work list would take {})\n", name, bytes_str(ws.int_bytes));
      continue;
    }
    flashcpp::DecodePlan plan;
    if (st.ok()) {
      std::vector<std::uint8_t> work_list(std::max<std::size_t>(ws.int_bytes, 1));
      // the partials' workspace is only sized by the plan, never touched: a fake address, as above
      void* partials = ws.float_bytes ? reinterpret_cast<void*>(std::uintptr_t{1} << 20) : nullptr;
      st = flashcpp::decode_plan(p, o, work_list.data(), ws.int_bytes, partials, ws.float_bytes, &plan);
    }
    if (!st.ok()) {
      fmt::print("  refused: {}\n", st.to_string());
      return;
    }
    fmt::print("  small_plan {}: {} split(s) a sequence at most, {} work items, {} CTAs ({} per SM) of {} row block(s){}\n",
               name, plan.max_splits, plan.num_items, plan.ctas, plan.ctas_per_sm, plan.row_blocks,
               plan.needs_merge ? ", partials merged" : "");
  }
}

void print_choice(const char* backend, const Status& st, const KernelChoice& kc) {
  if (!st.ok()) {
    fmt::print("  {:<14} {}\n", backend, st.to_string());
    return;
  }
  fmt::print("  {:<14} {}{}\n  {:<14} ({})\n", backend, flashcpp::kernel_name(kc.id),
             kc.config.empty() ? "" : " config " + kc.config, "", kc.reason);
}

int cmd_info(ShapeOptions s) {
  if (s.seqlen_k < 0) s.seqlen_k = s.seqlen_q;  // not given (the flags' validators refuse negative values)
  if (s.heads_kv < 0) s.heads_kv = s.heads_q;
  if (const std::string why = info_shape_error(s); !why.empty()) {
    std::cerr << "flashcpp info: " << why << "\n";
    return 2;
  }
  fmt::print("flashcpp {} (git {})\n", kVersion, FLASHCPP_GIT_COMMIT);
  fmt::print("build: CUDA {}\n", FLASHCPP_WITH_CUDA ? "yes" : "no");
  {
    // The kernel families CMake's switches left in or out (flashcpp/build.h).
    std::string built, left;
    for (const auto& f : flashcpp::build_families()) {
      if (f.built) built += (built.empty() ? "" : " ") + f.name;
      else left += fmt::format("{}{} ({})", left.empty() ? "" : ", ", f.name, f.left_out_by);
    }
    fmt::print("kernel families: {}; left out: {}\n", built.empty() ? "none" : built, left.empty() ? "none" : left);
  }
#if FLASHCPP_WITH_CUDA
  {
    int driver = 0, runtime = 0;
    // cudaDriverGetVersion reports 0 when no driver is installed: say so rather than "driver 0.0".
    if (cudaDriverGetVersion(&driver) == cudaSuccess && cudaRuntimeGetVersion(&runtime) == cudaSuccess)
      fmt::print("CUDA driver {}, runtime {}.{}\n",
                 driver == 0 ? std::string("none installed") : fmt::format("{}.{}", driver / 1000, (driver % 1000) / 10),
                 runtime / 1000, (runtime % 1000) / 10);
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      fmt::print("devices: no CUDA device{}\n", e != cudaSuccess ? ": " + flashcpp::cuda::error_string(e) : std::string());
    } else {
      fmt::print("devices:\n");
      for (int d = 0; d < n; ++d) {
        cudaDeviceProp prop{};
        if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
          fmt::print("  {}: (properties unavailable)\n", d);
          continue;
        }
        fmt::print("  {}: {} (sm_{}{}, {} SMs, {:.0f} GiB)\n", d, prop.name, prop.major, prop.minor,
                   prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1u << 30));
      }
    }
  }
#else
  fmt::print("devices: no CUDA device (CPU-only build)\n");
#endif
  std::string dims;
  for (int d : flashcpp::kCudaHeadDims) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  fmt::print("supported head dims: any multiple of {} in [{}, {}] for q/k and for v/o (every backend: the CUDA prefill, "
             "backward and decode kernels run a pair in the smallest of the classes {} that holds both, and the sm90 "
             "prefill kernel q/k in (128, {}] with v/o up to {} in its {}/{} class; CUDA decode over an fp8 cache takes "
             "multiples of 16)\n",
             flashcpp::kHeadDimStep, flashcpp::kHeadDimStep, flashcpp::kMaxHeadDim, dims, flashcpp::kCudaSm90HeadDim192,
             flashcpp::kCudaSm90HeadDimV192, flashcpp::kCudaSm90HeadDim192, flashcpp::kCudaSm90HeadDimV192);

  std::string mask = s.causal ? "causal" : "";
  if (s.window_left >= 0 || s.window_right >= 0)
    mask += fmt::format("{}window ({}, {})", mask.empty() ? "" : ", ", s.window_left, s.window_right);
  const std::string dv = s.head_dim_v && s.head_dim_v != s.head_dim ? fmt::format(", head_dim_v {}", s.head_dim_v) : "";
  fmt::print("kernel choice for batch {}, seqlen_q {}, seqlen_k {}, heads_q {}, heads_kv {}, head_dim {}{}, {}{}:\n",
             s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.head_dim, dv, s.dtype,
             mask.empty() ? "" : ", " + mask);
  const InfoLayout lay = info_layout(s);
  if (dv.empty())
    fmt::print("  (q and o {} each, k and v {} each; nothing is allocated: the dispatcher reads no element)\n",
               bytes_str(lay.q_bytes), bytes_str(lay.k_bytes));
  else
    fmt::print("  (q {}, k {}, v {}, o {}; nothing is allocated: the dispatcher reads no element)\n",
               bytes_str(lay.q_bytes), bytes_str(lay.k_bytes), bytes_str(lay.v_bytes), bytes_str(lay.o_bytes));
  const AttnParams p = info_params(s, lay.q, lay.k, lay.v, lay.o);
  // The class this shape's head dims run in on CUDA (prefill, backward, decode), whether or not a
  // device is here.
  if (const int cls = p.head_dim_class(); cls != 0) {
    const bool own = cls == p.head_dim && cls == p.effective_head_dim_v();
    const bool fp8_ok = p.head_dim % 16 == 0 && p.effective_head_dim_v() % 16 == 0;
    const int cls90 = p.sm90_head_dim_class();  // the sm90 prefill kernel's own 192 / 128 class
    const std::string sm90 =
        cls90 == cls ? ""
                     : fmt::format("; the sm90 (Hopper) prefill kernel runs it in its {}/{} class{}", cls90,
                                   flashcpp::kCudaSm90HeadDimV192,
                                   p.head_dim == cls90 && p.effective_head_dim_v() == flashcpp::kCudaSm90HeadDimV192
                                       ? ""
                                       : " (padded likewise)");
    fmt::print("  CUDA head-dim class (prefill, backward, decode): {}{}{}{}\n", cls,
               own ? "" : " (the kernels pad to it inside: zero columns, nothing copied)", sm90,
               fp8_ok ? "" : "; CUDA decode over an fp8 cache refuses it (fp8 head dims are multiples of 16)");
  }
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    RunOptions opt;
    opt.backend = b;
    KernelChoice kc;
    const Status st = flashcpp::select_kernel(p, opt, &kc);
    print_choice(flashcpp::backend_name(b), st, kc);
  }
#if FLASHCPP_WITH_CUDA
  {
    flashcpp::cuda::DeviceInfo dev;
    Status st = flashcpp::cuda::current_device(&dev);
    KernelChoice kc;
    if (st.ok()) {
      RunOptions opt;
      opt.backend = Backend::kCuda;
      st = flashcpp::select_kernel(p, opt, &kc);
    }
    print_choice("cuda", st, kc);
  }
#endif
  // The backward of the same problem (include/flashcpp/backward.h): dout, dq, dk and dv laid out after
  // the forward's tensors and the LSE after them, so the choice sees a problem with no aliasing.
  if (const InfoLayout g = info_layout(s, lay.end); lay.fits && g.fits) {
    const AttnParams gp = info_params(s, g.q, g.k, g.v, g.o);
    flashcpp::AttnBackwardParams bp;
    bp.batch = p.batch;
    bp.seqlen_q = p.seqlen_q;
    bp.seqlen_k = p.seqlen_k;
    bp.heads_q = p.heads_q;
    bp.heads_kv = p.heads_kv;
    bp.head_dim = p.head_dim;
    bp.head_dim_v = p.head_dim_v;
    bp.q = p.q;
    bp.k = p.k;
    bp.v = p.v;
    bp.o = p.o;
    bp.mask = p.mask;
    bp.dq = gp.q;
    bp.dk = gp.k;
    bp.dv = gp.v;
    bp.dout = gp.o;
    bp.lse = reinterpret_cast<const float*>(static_cast<std::uintptr_t>((g.end + 255) / 256 * 256));
    fmt::print("backward (dq, dk, dv) choice for the same problem:\n");
    for (Backend b : {Backend::kCpu, Backend::kCpuReference, Backend::kCuda}) {
      RunOptions opt;
      opt.backend = b;
      KernelChoice kc;
      const Status st = flashcpp::select_backward_kernel(bp, opt, &kc);
      print_choice(flashcpp::backend_name(b), st, kc);
    }
  }
  print_decode_plan(s);
#if FLASHCPP_WITH_CUDA
  // configs(head_dim, head_dim_v) per class: kCudaHeadDims and `pairs` (classes of two head dims), by q/k head dim.
  auto list_configs = [](const char* title, auto configs, bool built, std::vector<std::pair<int, int>> pairs) {
    if (!built) {  // a family left out: its configs list empty, say why instead of "(none compiled)"
      fmt::print("{}: none, left out of this build\n", title);
      return;
    }
    fmt::print("{}:\n", title);
    for (int d : flashcpp::kCudaHeadDims) pairs.emplace_back(d, d);
    std::stable_sort(pairs.begin(), pairs.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    for (const auto& [d, dv] : pairs) {
      std::string names;
      for (const auto& c : configs(d, dv)) names += (names.empty() ? "" : ", ") + c;
      const std::string dims = dv == d ? fmt::format("{:>3}", d) : fmt::format("{}/{}", d, dv);
      fmt::print("  head_dim {}: {}\n", dims, names.empty() ? "(none compiled)" : names);
    }
  };
  list_configs("cuda sm80 prefill configs (mma.sync)", [](int d, int) { return flashcpp::cuda::prefill_sm80_configs(d); },
               FLASHCPP_HAS_SM80, {});
  list_configs("cuda sm90a prefill configs (wgmma + TMA)",
               [](int d, int dv) { return flashcpp::cuda::prefill_sm90_configs(d, dv); }, FLASHCPP_HAS_SM90,
               {{flashcpp::kCudaSm90HeadDim192, flashcpp::kCudaSm90HeadDimV192}});
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flashcpp: attention kernels and the tools that prove them"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("flashcpp ") + kVersion + " (git " FLASHCPP_GIT_COMMIT ")");

  using flashcpp::tools::at_least;
  using flashcpp::tools::non_negative_integer;
  // Shared by the subcommands: the head dims the CUDA kernels compile (bench, tune), every head
  // dim the library takes (info, audit: the CPU backends run any of them), the CPU thread count.
  const CLI::Validator head_dims = flashcpp::tools::one_of(
      std::vector<int>(std::begin(flashcpp::kCudaHeadDims), std::end(flashcpp::kCudaHeadDims)));
  // bench also times the sm90 192 / 128 class: --head-dims 192 is q/k 192 with v/o 128 (DeepSeek).
  std::vector<int> bench_dims(std::begin(flashcpp::kCudaHeadDims), std::end(flashcpp::kCudaHeadDims));
  bench_dims.insert(std::find(bench_dims.begin(), bench_dims.end(), 256), flashcpp::kCudaSm90HeadDim192);
  const CLI::Validator bench_head_dims = flashcpp::tools::one_of(bench_dims);
  const CLI::Validator any_head_dim = flashcpp::tools::multiple_of_upto(flashcpp::kHeadDimStep, flashcpp::kMaxHeadDim);
  const CLI::Validator threads = flashcpp::tools::in_range(0, flashcpp::tools::kMaxThreads);

  ShapeOptions shape;
  auto* info = app.add_subcommand("info", "Build, devices, supported head dims and the kernel chosen for a shape");
  info->add_option("--batch", shape.batch, "batch size")->check(at_least(1))->capture_default_str();
  info->add_option("--seqlen-q", shape.seqlen_q, "query rows per sequence")->check(at_least(1))->capture_default_str();
  info->add_option("--seqlen-k", shape.seqlen_k, "key rows per sequence (default: seqlen-q)")->check(at_least(1));
  info->add_option("--heads-q", shape.heads_q, "query heads")->check(at_least(1))->capture_default_str();
  info->add_option("--heads-kv", shape.heads_kv, "key/value heads (default: heads-q)")->check(at_least(1));
  info->add_option("--head-dim", shape.head_dim, "head dimension of q and k")->check(any_head_dim)->capture_default_str();
  info->add_option("--head-dim-v", shape.head_dim_v, "head dimension of v and o (default: head-dim)")->check(any_head_dim);
  info->add_option("--dtype", shape.dtype, "element type")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  info->add_flag("--causal", shape.causal, "bottom-right aligned causal mask");
  info->add_option("--window-left", shape.window_left, "sliding window, keys to the left (-1: unbounded)")
      ->check(at_least(-1));
  info->add_option("--window-right", shape.window_right, "sliding window, keys to the right (-1: unbounded)")
      ->check(at_least(-1));

  flashcpp::harness::CheckOptions check_opt;
  std::string backend = "auto";
  bool quick = false, full = false;
  std::uint64_t seed = 0;
  std::string check_area = "attention";
  auto* check = app.add_subcommand("check", "Correctness harness: every case against an fp64 reference");
  check->add_option("--backend", backend, "cpu, cpu-reference, cuda, or auto (cuda when a device is present)")
      ->check(CLI::IsMember({"cpu", "cpu-reference", "cuda", "auto"}))
      ->capture_default_str();
  auto* quick_flag = check->add_flag("--quick", quick, "the quick table (default)");
  auto* full_flag = check->add_flag("--full", full, "the full table (larger problems; the course's shapes on cuda)");
  quick_flag->excludes(full_flag);
  check->add_option("--json", check_opt.json_path, "write correctness_report.json here");
  check->add_option("--filter", check_opt.filter, "run only cases whose name contains this");
  auto* seed_opt = check->add_option("--seed", seed, "input seed (default: fresh each run, printed)")
                       ->check(non_negative_integer<std::uint64_t>());
  check->add_option("--threads", check_opt.cpu_threads, "CPU threads (0: all)")->check(threads)->capture_default_str();
  check->add_option("--cuda-config", check_opt.cuda_config,
                    "cuda backend: kernel family (sm80, sm90) or config name; default automatic");
  check->add_flag("--list", check_opt.list_only, "print the selected case names and exit");
  check->add_option("--area", check_area,
                    "what to check: attention (prefill, default), decode (KV cache, paged), fused (norms, SwiGLU, "
                    "rotary), backward (dq, dk, dv) or all")
      ->check(CLI::IsMember({"attention", "decode", "fused", "backward", "all"}))
      ->capture_default_str();

  flashcpp::tools::BenchOptions bench_opt;
  auto* bench = app.add_subcommand("bench", "Time flashcpp's CUDA prefill kernels from C++ (peers: python -m flashcpp.bench)");
  bench->add_option("--head-dims", bench_opt.head_dims, "head dims to time (192: q/k 192 with v/o 128)")
      ->delimiter(',')
      ->check(bench_head_dims)
      ->capture_default_str();
  bench->add_flag("--all-configs", bench_opt.all_configs, "time every compiled config, not just the tuned choice");
  bench->add_flag("--quick", bench_opt.quick, "the course shapes only, fewer iterations");
  bench->add_option("--csv", bench_opt.csv, "write the rows to this CSV file");
  bench->add_option("--warmup", bench_opt.warmup, "warm-up runs per case")->check(at_least(0))->capture_default_str();
  bench->add_option("--iters", bench_opt.iters, "timed runs per case")->check(at_least(1))->capture_default_str();
  flashcpp::tools::TuneOptions tune_opt;
  auto* tune = app.add_subcommand("tune", "Choose the tile config per head dim and shape on this device");
  tune->add_option("--out", tune_opt.out, "JSON cache path (default: the library's cache path)");
  tune->add_flag("--emit-table", tune_opt.emit_table, "also print rows for src/core/sm80_tuned_table.inc");
  tune->add_option("--head-dims", tune_opt.head_dims, "head dims to tune")
      ->delimiter(',')
      ->check(head_dims)
      ->capture_default_str();
  tune->add_option("--warmup", tune_opt.warmup, "warm-up runs per config")->check(at_least(0))->capture_default_str();
  tune->add_option("--iters", tune_opt.iters, "timed runs per config")->check(at_least(1))->capture_default_str();
  flashcpp::audit::AuditOptions audit_opt;
  std::string audit_backend = "auto";
  std::vector<std::string> audit_dtypes, audit_families, audit_masks;
  std::uint64_t audit_seed = 0;
  std::vector<std::string> family_names, mask_names;
  for (auto f : flashcpp::audit::kAllFamilies) family_names.push_back(flashcpp::audit::family_name(f));
  for (auto m : flashcpp::audit::kAllMasks) mask_names.push_back(flashcpp::audit::mask_kind_name(m));
  auto* audit = app.add_subcommand(
      "audit", "Numerics audit: stress inputs vs an fp64 truth, per-row error CDFs, first N over the dtype band");
  audit->add_option("--backend", audit_backend, "cpu, cuda (the sm80 and sm90 kernels), or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  audit->add_flag("--quick", audit_opt.quick, "small N preset (CPU: N 128,512, 2 heads, head_dim 64; seconds)");
  audit->add_option("--n", audit_opt.seqlens, "sequence lengths (default: the backend's preset)")
      ->delimiter(',')
      ->check(at_least(1));
  audit->add_option("--dtypes", audit_dtypes, "bf16, fp16, fp32 (default: bf16,fp16 on cuda, all three on cpu)")
      ->delimiter(',')
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  audit->add_option("--families", audit_families, "input families (default: all; see --list)")
      ->delimiter(',')
      ->check(CLI::IsMember(family_names));
  audit->add_option("--masks", audit_masks, "none, causal, window (default: all)")
      ->delimiter(',')
      ->check(CLI::IsMember(mask_names));
  audit->add_option("--kernels", audit_opt.kernels,
                    "kernels (default: all): cuda sm80, sm90, decode; cpu: cpu (the tiled backend), decode")
      ->delimiter(',')
      ->check(CLI::IsMember({"cpu", "sm80", "sm90", "decode"}));
  audit->add_option("--heads", audit_opt.heads, "heads (default: 4 on cuda, 2 on cpu)")->check(at_least(1));
  audit->add_option("--head-dim", audit_opt.head_dim, "head dim (default: 128; 64 with --quick on cpu)")
      ->check(any_head_dim);
  audit->add_option("--window", audit_opt.window, "window mask: causal with window_left = this")
      ->check(at_least(1));
  audit->add_flag("--rotary", audit_opt.rotary,
                  "also run every problem with rotary fused into attention (CPU and the sm80/sm90 kernels; decode reports unsupported)");
  auto* audit_seed_opt = audit->add_option("--seed", audit_seed, "input seed (default: fresh each run, printed)")
                             ->check(non_negative_integer<std::uint64_t>());
  audit->add_option("--threads", audit_opt.cpu_threads, "CPU threads (0: all)")->check(threads)->capture_default_str();
  audit->add_option("--json", audit_opt.json_path, "write the audit JSON here (e.g. reports/numerics/audit.json)");
  audit->add_option("--dump-inputs", audit_opt.dump_dir,
                    "write each problem's inputs and a manifest here (python -m flashcpp.bench.audit) and exit");
  audit->add_flag("--list", audit_opt.list_only, "print the families and the planned problems and exit");
#if FLASHCPP_HAS_ENGINE
  flashcpp::tools::DecodeCliOptions decode_opt;
  auto* decode = app.add_subcommand("decode", "Llama decode engine: prompts in, tokens out, end-to-end tokens/s");
  flashcpp::tools::add_decode_options(decode, &decode_opt);
#else
  // The engine is left out (FLASHCPP_WITH_ENGINE=OFF): `decode` stays a subcommand that takes any
  // flags, so a script that calls it reads why rather than "unknown subcommand".
  auto* decode = app.add_subcommand("decode", "Llama decode engine (left out of this build: FLASHCPP_WITH_ENGINE=OFF)");
  decode->allow_extras();
#endif

  if (const int rc = flashcpp::tools::parse_args(app, argc, argv); rc >= 0) return rc;

  if (*info) return cmd_info(shape);
  if (*check) {
    check_opt.backend = backend == "cpu"             ? Backend::kCpu
                        : backend == "cpu-reference" ? Backend::kCpuReference
                        : backend == "cuda"          ? Backend::kCuda
                                                     : Backend::kAuto;
    check_opt.table = full ? flashcpp::harness::TableKind::kFull : flashcpp::harness::TableKind::kQuick;
    if (seed_opt->count() > 0) check_opt.seed = seed;
    flashcpp::harness::parse_check_area(check_area, &check_opt.area);  // CLI11 checked the value
    return flashcpp::harness::run_check(check_opt, std::cout, std::cerr);
  }
  if (*bench) return flashcpp::tools::bench_main(bench_opt);
  if (*tune) return flashcpp::tools::tune_main(tune_opt);
  if (*audit) {
    audit_opt.backend = audit_backend == "cpu"    ? Backend::kCpu
                        : audit_backend == "cuda" ? Backend::kCuda
                                                  : Backend::kAuto;
    for (const auto& d : audit_dtypes) audit_opt.dtypes.push_back(parse_dtype(d));
    for (const auto& f : audit_families) flashcpp::audit::parse_family(f, &audit_opt.families.emplace_back());
    for (const auto& m : audit_masks) flashcpp::audit::parse_mask_kind(m, &audit_opt.masks.emplace_back());
    if (audit_seed_opt->count() > 0) audit_opt.seed = audit_seed;
    return flashcpp::audit::run_audit(audit_opt, std::cout, std::cerr);
  }
#if FLASHCPP_HAS_ENGINE
  if (*decode) return flashcpp::tools::decode_main(decode_opt);
#else
  if (*decode) {
    for (const auto& f : flashcpp::build_families())
      if (f.name == "engine") std::cerr << "flashcpp decode: " << f.left_out << "; " << f.remedy << "\n";
    return 2;
  }
#endif
  return 2;
}
