// Device queries for the dispatcher (cached per device; cudaGetDeviceProperties is slow).
#include <cuda_runtime_api.h>

#include <array>
#include <mutex>
#include <string>

#include "cuda/cuda_api.h"

namespace flashcpp::cuda {

Status current_device(DeviceInfo* info) {
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return Status::Unsupported(std::string("no usable CUDA device: ") + cudaGetErrorString(e));
  }
  static std::mutex mu;
  static std::array<DeviceInfo, 64> cache{};
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& c = cache[static_cast<std::size_t>(dev) & 63];
  if (c.device != dev) {
    cudaDeviceProp prop{};
    e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) return Status::Cuda(std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(e));
    c.device = dev;
    c.sm_major = prop.major;
    c.sm_minor = prop.minor;
    c.num_sms = prop.multiProcessorCount;
    c.smem_optin = prop.sharedMemPerBlockOptin;
    c.name = prop.name;
  }
  *info = c;
  return Status::Ok();
}

bool is_device_pointer(const void* ptr) {
  if (ptr == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

}  // namespace flashcpp::cuda
