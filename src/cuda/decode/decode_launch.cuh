// Launch of one instantiation of the split-KV decode kernel. Included only by decode_hd<D>.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "cuda/common/launch.cuh"
#include "cuda/common/smem_opt_in.h"
#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_launch.h"

namespace flashcpp::cuda {

/// smem_pad: bytes of dynamic shared memory to launch with when more than the kernel needs (fewer
/// CTAs per SM than it could hold: DecodePlan::ctas_per_sm); 0 = what it needs.
template <int D, typename T, typename C>
Status decode_split_run(const DecodeKernelParams& p, int ctas, int smem_pad, Stream stream, int device) {
  using Cfg = flashcpp::decode::Config<D>;
  constexpr int kSmem = decode_dev::kFp8Cache<C> ? Cfg::kSmemBytes8 : Cfg::kSmemBytes;
  const int smem = smem_pad > kSmem ? smem_pad : kSmem;
  auto* kernel = &decode_dev::decode_split_kernel<D, T, C>;
  // Opt in to > 48 KB of dynamic shared memory once per device (not a stream operation: safe
  // while a graph is being captured). A padded launch (one size per device: decode_run) opts in
  // to its size once.
  static std::atomic<unsigned long long> opted_in{0}, opted_in_pad{0};
  if (smem > kSmem) {
    FLASHCPP_RETURN_IF_ERROR(opt_in_dynamic_smem(kernel, smem, device, opted_in_pad, "decode: "));
  } else {
    FLASHCPP_RETURN_IF_ERROR(opt_in_dynamic_smem(kernel, kSmem, device, opted_in, "decode: "));
  }
  if (ctas <= 0) return Status::Ok();
  (void)launch_kernel(kernel, static_cast<unsigned>(ctas), Cfg::kThreads, smem, stream, p.pdl != 0, p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::Cuda(std::string("decode split-KV kernel launch failed: ") + cudaGetErrorString(e));
  return Status::Ok();
}

/// q's dtype picks T; p.kv_fp8 picks the cache's element type (T itself, or fp8 e4m3 codes).
template <int D, typename T>
Status decode_split_cache(const DecodeKernelParams& p, int ctas, int smem_pad, Stream stream, int device) {
  if (p.kv_fp8) return decode_split_run<D, T, decode_dev::Fp8Code>(p, ctas, smem_pad, stream, device);
  return decode_split_run<D, T, T>(p, ctas, smem_pad, stream, device);
}

template <int D>
Status decode_split_dispatch(const DecodeKernelParams& p, DType dt, int ctas, int smem_pad, Stream stream, int device) {
  if (dt == DType::kBF16) return decode_split_cache<D, __nv_bfloat16>(p, ctas, smem_pad, stream, device);
  if (dt == DType::kF16) return decode_split_cache<D, __half>(p, ctas, smem_pad, stream, device);
  return Status::Unsupported("the CUDA decode kernels take fp16 or bf16");
}

}  // namespace flashcpp::cuda
