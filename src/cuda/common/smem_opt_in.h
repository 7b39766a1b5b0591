// A kernel's opt-in to more than 48 KB of dynamic shared memory, once per device and kernel: the
// launchers of the prefill, decode and backward kernels share it. Host-only (plain C++ files include it).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "flashcpp/status.h"

namespace flashcpp::cuda {

/// Sets cudaFuncAttributeMaxDynamicSharedMemorySize of `kernel` (on the current device) to `bytes`,
/// for callers that cache their own per-device setup. `what` prefixes the error sentence.
template <class Kernel>
Status set_dynamic_smem(Kernel* kernel, int bytes, const char* what = "") {
  const cudaError_t e =
      cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // the runtime records the failure as the last error: a later launch check would report it
  return Status::Cuda(std::string(what) + "cudaFuncSetAttribute(max dynamic smem) failed: " + cudaGetErrorString(e));
}

/// Sets cudaFuncAttributeMaxDynamicSharedMemorySize of `kernel` to `bytes` unless bit `device` of
/// `opted_in` (one static per kernel instantiation) says it was done. Not a stream operation, so safe
/// while a graph is captured. `what` prefixes the error sentence.
template <class Kernel>
Status opt_in_dynamic_smem(Kernel* kernel, int bytes, int device, std::atomic<unsigned long long>& opted_in,
                           const char* what = "") {
  const unsigned long long bit = 1ull << (device & 63);
  if (opted_in.load(std::memory_order_acquire) & bit) return Status::Ok();
  if (Status st = set_dynamic_smem(kernel, bytes, what); !st.ok()) return st;
  opted_in.fetch_or(bit, std::memory_order_acq_rel);
  return Status::Ok();
}

}  // namespace flashcpp::cuda
