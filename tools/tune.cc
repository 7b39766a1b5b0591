#include "tune.h"

#include "cli_checks.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "flashcpp/device.h"
#include "flashcpp/tune.h"
#endif

namespace flashcpp::tools {

double prefill_flops(int batch, int heads_q, int seqlen_q, int seqlen_k, int head_dim, bool causal, int head_dim_v) {
  const int dv = head_dim_v == 0 ? head_dim : head_dim_v;
  const double f = 2.0 * batch * heads_q * static_cast<double>(seqlen_q) * seqlen_k * (head_dim + dv);
  return causal ? f / 2 : f;
}

#if !FLASHCPP_WITH_CUDA
int bench_main(const BenchOptions&) {
  std::fprintf(stderr, "flashcpp bench: this build has no CUDA kernels to time\n");
  return 2;
}
int tune_main(const TuneOptions&) {
  std::fprintf(stderr, "flashcpp tune: this build has no CUDA kernels to tune\n");
  return 2;
}
#else

namespace {

struct Shape {
  int b, h, hkv, sq, sk, d;
  bool causal;
  DType dt;
  int dv = 0;  ///< head_dim_v, 0: d
  int vd() const { return dv == 0 ? d : dv; }
  std::string id() const {
    return "b" + std::to_string(b) + "_h" + std::to_string(h) + (hkv != h ? "kv" + std::to_string(hkv) : "") + "_n" +
           std::to_string(sq) + (sk != sq ? "k" + std::to_string(sk) : "") + "_d" + std::to_string(d) +
           (vd() != d ? "v" + std::to_string(vd()) : "") +
           (causal ? "_causal" : "") + "_" + dtype_name(dt);
  }
};

/// Device inputs for one shape, replicated so that successive timed runs rotate through more
/// than 2x the L2 cache (60 MB on an H200) and every run reads from DRAM.
struct Inputs {
  std::vector<void*> bufs;
  std::vector<AttnParams> sets;
  ~Inputs() {
    for (void* p : bufs) cudaFree(p);
  }
};

Status make_inputs(const Shape& s, Inputs* in, std::uint64_t seed) {
  const std::int64_t nq = static_cast<std::int64_t>(s.b) * s.sq * s.h * s.d;
  const std::int64_t nk = static_cast<std::int64_t>(s.b) * s.sk * s.hkv * s.d;
  const std::int64_t nv = static_cast<std::int64_t>(s.b) * s.sk * s.hkv * s.vd();
  const std::int64_t no = static_cast<std::int64_t>(s.b) * s.sq * s.h * s.vd();
  const std::int64_t bytes = (nq + nk + nv + no) * 2;
  const int copies = static_cast<int>(std::clamp<std::int64_t>((160ll << 20) / std::max<std::int64_t>(bytes, 1) + 1, 1, 8));
  for (int c = 0; c < copies; ++c) {
    void *q, *k, *v, *o;
    for (auto [pp, n] : {std::pair{&q, nq}, {&k, nk}, {&v, nv}, {&o, no}}) {
      if (cudaMalloc(pp, n * 2) != cudaSuccess) return Status::Cuda("bench: out of device memory");
      in->bufs.push_back(*pp);
    }
    FLASHCPP_RETURN_IF_ERROR(cuda::fill_random(q, s.dt, nq, seed + 3 * c, 1.f, nullptr));
    FLASHCPP_RETURN_IF_ERROR(cuda::fill_random(k, s.dt, nk, seed + 3 * c + 1, 1.f, nullptr));
    FLASHCPP_RETURN_IF_ERROR(cuda::fill_random(v, s.dt, nv, seed + 3 * c + 2, 1.f, nullptr));
    AttnParams p;
    p.batch = s.b; p.seqlen_q = s.sq; p.seqlen_k = s.sk; p.heads_q = s.h; p.heads_kv = s.hkv; p.head_dim = s.d;
    p.head_dim_v = s.dv;
    p.q = bshd_view(q, s.dt, s.sq, s.h, s.d);
    p.k = bshd_view(k, s.dt, s.sk, s.hkv, s.d);
    p.v = bshd_view(v, s.dt, s.sk, s.hkv, s.vd());
    p.o = bshd_view(o, s.dt, s.sq, s.h, s.vd());
    p.mask.causal = s.causal;
    in->sets.push_back(p);
  }
  return cudaDeviceSynchronize() == cudaSuccess ? Status::Ok() : Status::Cuda("bench: input fill failed");
}

/// Median time (us) of `iters` runs after `warmup`, each run timed by its own event pair.
Status time_config(const Inputs& in, const std::string& config, int warmup, int iters, double* median_us) {
  RunOptions opt;
  opt.backend = Backend::kCuda;
  opt.cuda_config = config;
  for (int i = 0; i < warmup; ++i) FLASHCPP_RETURN_IF_ERROR(attention_forward(in.sets[i % in.sets.size()], opt));
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) cudaEventCreate(&e);
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(ev[2 * i]);
    FLASHCPP_RETURN_IF_ERROR(attention_forward(in.sets[i % in.sets.size()], opt));
    cudaEventRecord(ev[2 * i + 1]);
  }
  if (cudaDeviceSynchronize() != cudaSuccess) return Status::Cuda("bench: kernel failed");
  std::vector<double> t(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]);
    t[i] = ms * 1e3;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(t.begin(), t.begin() + iters / 2, t.end());
  *median_us = t[iters / 2];
  return Status::Ok();
}

std::vector<Shape> course_shapes(const std::vector<int>& dims, bool quick) {
  std::vector<Shape> out;
  // batch, heads, seqlen, head_dim, head_dim_v (0: head_dim); 192 / 128 is DeepSeek-V2/V3's prefill
  // (the first such shape is python -m flashcpp.bench headdims' 192 / 128 shape).
  const int base[][5] = {{1, 8, 512, 64, 0},   {1, 8, 2048, 64, 0},   {2, 16, 4096, 64, 0},   {2, 16, 16384, 64, 0},
                         {4, 32, 4096, 128, 0}, {1, 8, 8192, 128, 0}, {1, 16, 16384, 128, 0}, {1, 16, 4096, 192, 128},
                         {1, 16, 16384, 192, 128}, {1, 16, 4096, 256, 0}};
  for (auto& s : base) {
    if (std::find(dims.begin(), dims.end(), s[3]) == dims.end()) continue;
    for (bool causal : {false, true}) {
      out.push_back({s[0], s[1], s[1], s[2], s[2], s[3], causal, DType::kBF16, s[4]});
      if (!quick) out.push_back({s[0], s[1], s[1], s[2], s[2], s[3], causal, DType::kF16, s[4]});
    }
  }
  return out;
}

/// Why bench and tune cannot run, without the device layer's "use the CPU backend (--backend cpu)":
/// neither has a --backend, since both time CUDA kernels only.
std::string no_device(const char* cmd, const Status& st) {
  std::string why = st.message();
  if (const auto pos = why.find("; use the CPU backend"); pos != std::string::npos) why.erase(pos);
  return std::string("flashcpp ") + cmd + ": " + why + "; " + cmd +
         " times the CUDA kernels only (on the CPU, flashcpp check --backend cpu and flashcpp audit --backend cpu run)";
}

}  // namespace

int bench_main(const BenchOptions& opt) {
  // The rows are written as they are timed: a path that cannot be written fails before any work.
  if (!opt.csv.empty())
    if (const std::string why = unwritable("--csv", opt.csv); !why.empty()) {
      std::fprintf(stderr, "flashcpp bench: %s\n", why.c_str());
      return 2;
    }
  cuda::DeviceInfo dev;
  if (Status st = cuda::current_device(&dev); !st.ok()) {
    std::fprintf(stderr, "%s\n", no_device("bench", st).c_str());
    return 2;
  }
  std::ofstream csv;
  if (!opt.csv.empty()) {
    csv.open(opt.csv);
    if (!csv) {
      std::fprintf(stderr, "flashcpp bench: cannot write --csv %s\n", opt.csv.c_str());
      return 2;
    }
    csv << "case,batch,heads_q,heads_kv,seqlen_q,seqlen_k,head_dim,causal,dtype,config,tuned,ours_us,ours_tflops,gpu\n";
  }
  std::printf("%-34s %-14s %6s %10s %9s\n", "case", "config", "tuned", "us", "TFLOP/s");
  int failures = 0;
  for (const Shape& s : course_shapes(opt.head_dims, opt.quick)) {
    Inputs in;
    if (Status st = make_inputs(s, &in, 1234); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", s.id().c_str(), st.to_string().c_str());
      ++failures;
      continue;
    }
    const std::string tuned = cuda::prefill_sm80_pick(in.sets[0], dev);
    std::vector<std::string> cfgs = opt.all_configs ? cuda::prefill_sm80_configs(s.d) : std::vector<std::string>{tuned};
#if FLASHCPP_HAS_SM90
    if (dev.sm_major == 9)
      for (const auto& c : cuda::prefill_sm90_configs(s.d, s.vd())) cfgs.push_back(c);
#endif
    for (const auto& cfg : cfgs) {
      double us = 0;
      if (Status st = time_config(in, cfg, opt.warmup, opt.quick ? 10 : opt.iters, &us); !st.ok()) {
        std::printf("%-34s %-14s %s\n", s.id().c_str(), cfg.c_str(), st.to_string().c_str());
        continue;
      }
      const double tf = prefill_flops(s.b, s.h, s.sq, s.sk, s.d, s.causal, s.vd()) / (us * 1e-6) / 1e12;
      std::printf("%-34s %-14s %6s %10.1f %9.1f\n", s.id().c_str(), cfg.c_str(), cfg == tuned ? "*" : "", us, tf);
      if (csv)
        csv << s.id() << ',' << s.b << ',' << s.h << ',' << s.hkv << ',' << s.sq << ',' << s.sk << ',' << s.d << ','
            << (s.causal ? 1 : 0) << ',' << dtype_name(s.dt) << ',' << cfg << ',' << (cfg == tuned ? 1 : 0) << ','
            << us << ',' << tf << ',' << '"' << dev.name << '"' << '\n';
    }
  }
  return failures ? 1 : 0;
}

int tune_main(const TuneOptions& opt) {
  // The cache is written after minutes of timing: a path that cannot be written fails first.
  if (!opt.out.empty())
    if (const std::string why = unwritable("--out", opt.out); !why.empty()) {
      std::fprintf(stderr, "flashcpp tune: %s\n", why.c_str());
      return 2;
    }
  cuda::DeviceInfo dev;
  if (Status st = cuda::current_device(&dev); !st.ok()) {
    std::fprintf(stderr, "%s\n", no_device("tune", st).c_str());
    return 2;
  }
  const std::string path = opt.out.empty() ? cuda::tune_cache_path(dev) : opt.out;
  if (opt.out.empty()) {
    std::error_code ec;
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (const std::string why = unwritable("the tuning cache", path); !why.empty()) {
      std::fprintf(stderr, "flashcpp tune: %s; give --out\n", why.c_str());
      return 2;
    }
  }
  // One representative shape per seqlen bucket, sized to fill the GPU.
  const int reps[][3] = {{16, 16, 1024}, {4, 16, 4096}, {1, 16, 16384}, {1, 16, 32768}};  // batch, heads, seqlen
  nlohmann::json cache = {{"device", dev.name}, {"sm", dev.sm_major * 10 + dev.sm_minor}, {"entries", nlohmann::json::array()}};
  std::vector<std::string> table;
  std::printf("%-8s %-6s %-5s %-8s %-14s %10s %9s   (all configs, us)\n", "head_dim", "causal", "dtype", "bucket", "winner", "us", "TFLOP/s");
  for (int d : opt.head_dims)
    for (bool causal : {false, true})
      for (DType dt : {DType::kBF16, DType::kF16})
        for (int bucket = 0; bucket < 4; ++bucket) {
          Shape s{reps[bucket][0], reps[bucket][1], reps[bucket][1], reps[bucket][2], reps[bucket][2], d, causal, dt};
          if (d == 256) s.b = std::max(1, s.b / 2);
          Inputs in;
          if (Status st = make_inputs(s, &in, 99); !st.ok()) {
            std::fprintf(stderr, "tune %s: %s\n", s.id().c_str(), st.to_string().c_str());
            return 1;
          }
          std::string best;
          double best_us = 1e30;
          std::string all;
          for (const auto& cfg : cuda::prefill_sm80_configs(d)) {
            double us = 0;
            if (!time_config(in, cfg, opt.warmup, opt.iters, &us).ok()) continue;  // e.g. smem too large here
            all += " " + cfg + "=" + std::to_string(static_cast<int>(us));
            if (us < best_us) best_us = us, best = cfg;
          }
          if (best.empty()) continue;
          const double tf = prefill_flops(s.b, s.h, s.sq, s.sk, s.d, s.causal) / (best_us * 1e-6) / 1e12;
          std::printf("%-8d %-6s %-5s %-8s %-14s %10.1f %9.1f  %s\n", d, causal ? "yes" : "no", dtype_name(dt),
                      cuda::seqlen_bucket_name(bucket).c_str(), best.c_str(), best_us, tf, all.c_str());
          cache["entries"].push_back({{"head_dim", d}, {"causal", causal}, {"dtype", dtype_name(dt)}, {"bucket", bucket},
                                      {"config", best}, {"us", best_us}, {"tflops", tf}, {"shape", s.id()}});
          table.push_back("    {" + std::to_string(dev.sm_major * 10 + dev.sm_minor) + ", " + std::to_string(d) + ", " +
                          (causal ? "true" : "false") + ", " + dtype_name(dt) + ", " + std::to_string(bucket) + ", \"" +
                          best + "\"},");
        }
  {
    std::ofstream f(path);
    if (!(f << cache.dump(1) << '\n') || !(f.close(), f)) {
      std::fprintf(stderr, "flashcpp tune: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("wrote %s\n", path.c_str());
  }
  if (opt.emit_table)
    for (const auto& row : table) std::printf("%s\n", row.c_str());
  return 0;
}

#endif

}  // namespace flashcpp::tools
