// Launch of one instantiation of the sm_90a prefill kernel. Included only by fa3_hd<D>.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "cuda/prefill/fa3_kernel.cuh"
#include "cuda/prefill/fa3_registry.h"

namespace flashcpp::cuda {

template <class Cfg, typename T>
Status fa3_run(const Fa3Params& p, Stream stream, int device) {
  auto* kernel = &fa3_forward_kernel<Cfg, T>;
  static std::atomic<unsigned long long> opted_in{0};
  const unsigned long long bit = 1ull << (device & 63);
  if (!(opted_in.load(std::memory_order_acquire) & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (e != cudaSuccess)
      return Status::Cuda(std::string("cudaFuncSetAttribute(max dynamic smem) failed: ") + cudaGetErrorString(e));
    opted_in.fetch_or(bit, std::memory_order_acq_rel);
  }
  const int m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (p.batch > 65535 || p.heads_q > 65535)
    return Status::Unsupported("batch " + std::to_string(p.batch) + " or heads_q " + std::to_string(p.heads_q) +
                               " exceeds the 65535 limit of a grid dimension");
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::Cuda(std::string("sm90 prefill kernel launch failed: ") + cudaGetErrorString(e));
  return Status::Ok();
}

template <class Cfg>
constexpr Fa3Entry fa3_entry() {
  return Fa3Entry{Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kSmemBytes, Cfg::kPingPong,
                  &fa3_run<Cfg, __nv_bfloat16>, &fa3_run<Cfg, __half>};
}

}  // namespace flashcpp::cuda
