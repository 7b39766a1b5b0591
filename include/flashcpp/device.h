// The CUDA device as a program sees it, without CUDA types: the current device's properties and
// the sentence flashcpp reports for a CUDA runtime error. What the CLI, the harness and the Python
// binding need to know about the machine. In a build without CUDA (FLASHCPP_WITH_CUDA=0) the same
// calls exist: current_device fails with a sentence and error_string names the code.
#pragma once

#include <cstddef>
#include <string>

#include "flashcpp/status.h"

namespace flashcpp::cuda {

/// Properties of the current device, read once per device and cached.
struct DeviceInfo {
  int device = -1;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  std::size_t smem_optin = 0;  ///< max dynamic shared memory per block (bytes)
  std::string name;
};

/// Fills `info` for the current device; fails with a sentence when no CUDA device is usable (no
/// driver, no GPU, or a build without CUDA).
Status current_device(DeviceInfo* info);

/// The sentence for a CUDA runtime error code (a cudaError_t value): for a missing driver or GPU,
/// what was not found and what to use instead (the CPU backend); otherwise the runtime's own text.
std::string error_string(int cuda_error);

}  // namespace flashcpp::cuda
