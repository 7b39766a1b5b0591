// Device-side random fill (counter-based hash -> approx. normal), for benchmarks and the tuner,
// so multi-GB inputs do not cross PCIe.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

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

}  // namespace

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
