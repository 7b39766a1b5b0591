// What the engine's kernel files share: the bf16 type and the sentence of a failed CUDA call.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/device.h"
#include "flashcpp/status.h"

namespace flashcpp::cuda::engine {

using bf16 = __nv_bfloat16;

/// "<what> failed: <error>" (cuda::error_string: no driver, no device, or cudaGetErrorString).
inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + " failed: " + cuda::error_string(e));
}

}  // namespace flashcpp::cuda::engine
