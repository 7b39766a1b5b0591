// Helpers for the GPU tests: device buffers, random inputs, fp64-reference comparison.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "cuda/cuda_api.h"
#include "flashcpp/attention.h"

namespace flashcpp::testing {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

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
