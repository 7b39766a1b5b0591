// Device-side random fill (counter-based hash -> approx. normal), for benchmarks and the tuner,
// so multi-GB inputs do not cross PCIe; and the fill of the varlen rows that no sequence covers
// (attention.h: O = 0, LSE = -inf), for a problem whose batch is 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/cuda_api.h"

namespace flashcpp::cuda {
namespace {

__device__ __forceinline__ std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename T>
__global__ void fill_kernel(T* out, std::int64_t n, std::uint64_t seed, float stddev) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t r = splitmix(seed ^ static_cast<std::uint64_t>(i));
    // Sum of 4 uniforms (Irwin-Hall), centred and scaled to unit variance: close enough to normal.
    float s = 0.f;
    for (int k = 0; k < 4; ++k) s += static_cast<float>((r >> (16 * k)) & 0xFFFF) * (1.f / 65536.f);
    const float v = (s - 2.f) * 1.7320508f * stddev;
    if constexpr (std::is_same_v<T, float>) out[i] = v;
    else if constexpr (std::is_same_v<T, __half>) out[i] = __float2half_rn(v);
    else out[i] = __float2bfloat16_rn(v);
  }
}

/// O = 0 in `rows` packed rows (16-byte stores: the data is 16-byte aligned and every stride
/// that matters is a multiple of 8 elements, validate.cc), and LSE = -inf in its heads * rows
/// contiguous entries. Zero bits are 0.0 in fp16 and bf16.
__global__ void fill_uncovered_kernel(std::uint16_t* o, std::int64_t seq_stride, std::int64_t head_stride, int heads,
                                      int chunks, std::int64_t rows, float* lse) {
  const std::int64_t n = rows * heads * chunks, step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  for (std::int64_t i = first; i < n; i += step) {
    const std::int64_t c = i % chunks, rest = i / chunks, h = rest % heads, r = rest / heads;
    *reinterpret_cast<uint4*>(o + r * seq_stride + h * head_stride + c * 8) = make_uint4(0, 0, 0, 0);
  }
  if (lse != nullptr)
    for (std::int64_t i = first; i < rows * heads; i += step) lse[i] = -INFINITY;
}

}  // namespace

Status fill_uncovered_rows(const AttnParams& p, Stream stream) {
  const std::int64_t rows = p.mask.total_q;
  if (rows <= 0 || p.o.data == nullptr) return Status::Ok();
  const int chunks = p.effective_head_dim_v() / 8;  // o has head_dim_v columns, a multiple of 8
  const std::int64_t n = rows * p.heads_q * chunks;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + threads - 1) / threads, 1024));
  fill_uncovered_kernel<<<blocks, threads, 0, stream>>>(static_cast<std::uint16_t*>(p.o.data), p.o.seq_stride,
                                                        p.o.head_stride, p.heads_q, chunks, rows, p.lse);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok()
                          : Status::Cuda(std::string("fill of the uncovered varlen rows: ") + cudaGetErrorString(e));
}

Status fill_random(void* ptr, DType dt, std::int64_t n, std::uint64_t seed, float stddev, Stream stream) {
  const int blocks = 1024, threads = 256;
  switch (dt) {
    case DType::kBF16: fill_kernel<<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(ptr), n, seed, stddev); break;
    case DType::kF16: fill_kernel<<<blocks, threads, 0, stream>>>(static_cast<__half*>(ptr), n, seed, stddev); break;
    case DType::kF32: fill_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(ptr), n, seed, stddev); break;
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : Status::Cuda(std::string("fill_random: ") + cudaGetErrorString(e));
}

}  // namespace flashcpp::cuda
