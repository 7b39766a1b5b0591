// flashcpp/device.h in a build without CUDA: no device, and a CUDA error code named as such. The
// CUDA build defines these in src/cuda/common/device.cc.
#include <string>

#include "core/families.h"
#include "flashcpp/device.h"

#if !FLASHCPP_WITH_CUDA
namespace flashcpp::cuda {

Status current_device(DeviceInfo*) {
  return Status::Unsupported("no usable CUDA device: " + build::refuse_no_cuda().message());
}

std::string error_string(int cuda_error) {
  return "CUDA error " + std::to_string(cuda_error) + " (this build of flashcpp has no CUDA)";
}

}  // namespace flashcpp::cuda
#endif
