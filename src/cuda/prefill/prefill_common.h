// Pieces both prefill kernels share on the host: filling the parameter fields they have in common,
// and launching a kernel on the (row block, head, batch) grid with its dynamic shared memory.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "common/mask_rules.h"
#include "flashcpp/attention.h"

namespace flashcpp::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;

/// Output, LSE, sizes, scale and mask rules: the fields Fa2Params and Fa3Params share by name.
template <class P>
void fill_prefill_common(P& p, const AttnParams& a) {
  p.o = a.o.data;
  p.lse = a.lse;
  p.o_batch_stride = a.o.batch_stride;
  // validate() guarantees in-sequence offsets fit in int32.
  p.o_seq_stride = static_cast<std::int32_t>(a.o.seq_stride);
  p.o_head_stride = static_cast<std::int32_t>(a.o.head_stride);
  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.heads_q = a.heads_q;
  p.group = a.heads_q / a.heads_kv;
  p.scale_log2 = a.effective_scale() * kLog2e;
  p.rules = MaskRules::make(a.seqlen_q, a.seqlen_k, a.mask.causal, a.mask.window_left, a.mask.window_right,
                            a.mask.global_tokens, a.mask.global_queries);
}

/// Launches `kernel` on grid (ceil(seqlen_q / block_m), heads_q, batch): the row blocks of one
/// head are adjacent, so the CTAs resident together share that head's K/V in L2. Opts in to
/// `smem_bytes` of dynamic shared memory once per device (not a stream operation, so safe while
/// a graph is captured). `what` names the kernel in error sentences.
template <class Params>
Status launch_prefill(void (*kernel)(Params), const Params& p, int block_m, int threads, int smem_bytes,
                      Stream stream, int device, std::atomic<unsigned long long>& opted_in, const char* what) {
  const unsigned long long bit = 1ull << (device & 63);
  if (!(opted_in.load(std::memory_order_acquire) & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (e != cudaSuccess)
      return Status::Cuda(std::string("cudaFuncSetAttribute(max dynamic smem) failed: ") + cudaGetErrorString(e));
    opted_in.fetch_or(bit, std::memory_order_acq_rel);
  }
  if (p.batch > 65535 || p.heads_q > 65535)
    return Status::Unsupported("batch " + std::to_string(p.batch) + " or heads_q " + std::to_string(p.heads_q) +
                               " exceeds the 65535 limit of a grid dimension");
  const int m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  void* args[] = {const_cast<Params*>(&p)};  // runtime launch: this header also serves plain C++ files
  const cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, dim3(threads), args,
                                         static_cast<std::size_t>(smem_bytes), stream);
  if (e != cudaSuccess) return Status::Cuda(std::string(what) + " launch failed: " + cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace flashcpp::cuda
