// Helpers for the GPU tests: device buffers, random inputs, fp64-reference comparison.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "flashcpp/half.h"
#include "cuda/cuda_api.h"
#include "flashcpp/attention.h"
#include "flashcpp/build.h"

namespace flashcpp::testing {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

/// The sentences of the named kernel families this build leaves out (CMake's FLASHCPP_WITH_*
/// switches, flashcpp/build.h), joined; "" when it holds them all.
inline std::string left_out_families(std::initializer_list<std::string_view> names) {
  std::string out;
  for (const BuildFamily& f : build_families())
    for (std::string_view n : names)
      if (!f.built && f.name == n) out += (out.empty() ? "" : "; ") + f.left_out;
  return out;
}

/// Whether `st` refuses a request because this build leaves its kernel family out (the sentence
/// of core/families.cc): the test of that family skips with it instead of failing.
inline bool left_out_of_build(const Status& st) {
  return st.code() == StatusCode::kUnsupported && st.message().rfind("this build leaves out", 0) == 0;
}

/// True when this build holds the sm90 kernels and the current device is an sm_90 one (no usable
/// device: false).
inline bool sm90_device() {
  cuda::DeviceInfo dev;
  return FLASHCPP_HAS_SM90 && cuda::current_device(&dev).ok() && dev.sm_major == 9;
}

/// What a test file of a family this build leaves out compiles to: one test, skipped with the reason.
#define FLASHCPP_GPU_TESTS_LEFT_OUT(Suite, ...) \
  TEST(Suite, LeftOutOfThisBuild) { GTEST_SKIP() << ::flashcpp::testing::left_out_families({__VA_ARGS__}); }

inline std::uint64_t gpu_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s = std::random_device{}();
    if (const char* env = std::getenv("FLASHCPP_SEED")) s = std::strtoull(env, nullptr, 10);
    std::fprintf(stderr, "[flashcpp gpu tests] FLASHCPP_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, std::max<std::size_t>(n, 16)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

/// Host copy of a 16-bit tensor with random normal values; uploaded to `dev`.
inline std::vector<std::uint16_t> random_half_bits(std::int64_t n, DType dt, std::mt19937_64& g) {
  std::vector<std::uint16_t> h(static_cast<std::size_t>(n));
  std::normal_distribution<float> d(0.f, 1.f);
  for (auto& x : h) x = dt == DType::kBF16 ? float_to_bf16_bits(d(g)) : float_to_half_bits(d(g));
  return h;
}

inline float bits_to_float(std::uint16_t b, DType dt) {
  return dt == DType::kBF16 ? bf16_bits_to_float(b) : half_bits_to_float(b);
}

/// The sequences of a test problem: dense (batch x seqlen) or packed varlen (lengths lq, and lk
/// for the keys, empty = lq). cu_q / cu_k are the prefix sums (varlen), max_q / max_k the lengths
/// the grid is sized by (the true maxima + pad), rows_q / rows_k the packed row counts.
struct SeqLayout {
  bool varlen = false;
  int batch = 0, max_q = 0, max_k = 0;
  std::int64_t rows_q = 0, rows_k = 0;
  std::vector<std::int32_t> cu_q, cu_k;
};
inline SeqLayout seq_layout(const std::vector<int>& lq, const std::vector<int>& lk_in, int batch, int seqlen_q,
                            int seqlen_k, int pad = 0) {
  SeqLayout s;
  s.varlen = !lq.empty();
  const std::vector<int>& lk = lk_in.empty() ? lq : lk_in;
  s.batch = s.varlen ? static_cast<int>(lq.size()) : batch;
  s.cu_q.assign(s.batch + 1, 0);
  s.cu_k.assign(s.batch + 1, 0);
  s.max_q = seqlen_q;
  s.max_k = seqlen_k;
  if (s.varlen) {
    for (int i = 0; i < s.batch; ++i) s.cu_q[i + 1] = s.cu_q[i] + lq[i], s.cu_k[i + 1] = s.cu_k[i] + lk[i];
    s.max_q = *std::max_element(lq.begin(), lq.end()) + pad;
    s.max_k = *std::max_element(lk.begin(), lk.end()) + pad;
  }
  s.rows_q = s.varlen ? s.cu_q[s.batch] : static_cast<std::int64_t>(s.batch) * seqlen_q;
  s.rows_k = s.varlen ? s.cu_k[s.batch] : static_cast<std::int64_t>(s.batch) * seqlen_k;
  return s;
}

#if FLASHCPP_HAS_SM90
/// Whether sm90 config `cfg` takes q/k head dim d: a "_k<N>" twin (Q K^T over the first N dims of
/// its class) takes the head dims up to N, every other config those of its class.
inline bool sm90_config_takes(const std::string& cfg, int d) {
  const std::size_t at = cfg.find("_k");
  return at == std::string::npos || d <= std::stoi(cfg.substr(at + 2));
}
/// A compiled sm90 config named <twin><suffix> (e.g. suffix "_persist") and its twin's name.
struct Sm90Twin {
  std::string config, twin;
};
/// The configs of a head dim (or a pair: head_dim_v 0 = head_dim) that carry `suffix`, each with its
/// twin: the name without the suffix, or, for a lean-mask config whose lean twin is not built (d256
/// builds only a lean persistent config), the general one without "_lean" too (the same bits).
inline std::vector<Sm90Twin> sm90_twins(int head_dim, const std::string& suffix, int head_dim_v = 0) {
  const std::vector<std::string> names = cuda::prefill_sm90_configs(head_dim, head_dim_v);
  std::vector<Sm90Twin> out;
  for (const auto& cfg : names)
    if (cfg.size() > suffix.size() && cfg.compare(cfg.size() - suffix.size(), suffix.size(), suffix) == 0) {
      std::string twin = cfg.substr(0, cfg.size() - suffix.size());
      if (const std::size_t at = twin.find("_lean");
          at != std::string::npos && std::find(names.begin(), names.end(), twin) == names.end())
        twin.erase(at, 5);
      out.push_back({cfg, twin});
    }
  return out;
}
#endif

/// The sizes and q/k/v/o views of an attention problem over device buffers: (batch, seqlen,
/// heads, d) views, or with `packed` (varlen) (total rows, heads, d) views without a batch stride;
/// seqlens are the maxima then.
inline AttnParams attn_params(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int d, DType dt,
                              bool packed, void* q, void* k, void* v, void* o) {
  auto view = [&](void* ptr, int seqlen, int heads) {
    return packed ? TensorView{ptr, dt, 0, static_cast<std::int64_t>(heads) * d, d} : bshd_view(ptr, dt, seqlen, heads, d);
  };
  AttnParams p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = d;
  p.q = view(q, seqlen_q, heads_q);
  p.k = view(k, seqlen_k, heads_kv);
  p.v = view(v, seqlen_k, heads_kv);
  p.o = view(o, seqlen_q, heads_q);
  return p;
}

struct ErrStats {
  double max_abs = 0, max_viol = 0, lse_max_abs = 0;  // max_viol: max of |err| - (atol + rtol|ref|)
  std::int64_t nan = 0, unwritten = 0;
};

}  // namespace flashcpp::testing
