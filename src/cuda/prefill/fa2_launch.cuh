// Launch of one instantiation of the sm80 prefill kernel. Included only by fa2_hd<D>.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "cuda/prefill/fa2_kernel.cuh"
#include "cuda/prefill/fa2_registry.h"

namespace flashcpp::cuda {

template <class Cfg, typename T>
Status fa2_run(const Fa2Params& p, Stream stream, int device) {
  auto* kernel = &fa2_forward_kernel<Cfg, T>;
  // Opt in to > 48 KB of dynamic shared memory once per device (not a stream operation, so
  // safe while a graph is being captured).
  static std::atomic<unsigned long long> opted_in{0};
  const unsigned long long bit = 1ull << (device & 63);
  if (!(opted_in.load(std::memory_order_acquire) & bit)) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
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
  if (e != cudaSuccess) return Status::Cuda(std::string("prefill kernel launch failed: ") + cudaGetErrorString(e));
  return Status::Ok();
}

template <class Cfg>
constexpr Fa2Entry fa2_entry() {
  return Fa2Entry{Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kWarps, Cfg::kStages, Cfg::kQInRegs,
                  Cfg::kMinBlocks, Cfg::kSmemBytes, &fa2_run<Cfg, __nv_bfloat16>, &fa2_run<Cfg, __half>};
}

}  // namespace flashcpp::cuda
