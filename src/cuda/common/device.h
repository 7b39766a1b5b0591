// The sentence a CUDA path reports for a CUDA runtime error. Defined in device.cc.
//
// Without an NVIDIA driver the runtime answers cudaErrorInsufficientDriver, whose own text ("CUDA
// driver version is insufficient for CUDA runtime version") sends a user to upgrade a driver that
// is not there. Every CUDA path that reports a device or driver failure (current_device, the
// engine, the CLI) says instead what was found and what to do.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace flashcpp::cuda {

/// cudaErrorInsufficientDriver and cudaErrorNoDevice: what was not found (no driver, an old
/// driver, no GPU) and what to use instead (the CPU backend); any other error: cudaGetErrorString.
std::string error_string(cudaError_t e);

/// error_string with the driver's version given (cudaDriverGetVersion: 0 = no driver installed,
/// 12020 = CUDA 12.2) and the runtime's: pure, so tests cover each branch without a machine to match.
std::string error_string(cudaError_t e, int driver_version, int runtime_version);

}  // namespace flashcpp::cuda
