// Device queries for the dispatcher (cached per device; cudaGetDeviceProperties is slow) and the
// sentence every CUDA path reports for a device or driver failure (device.h).
#include "cuda/common/device.h"

#include <cuda_runtime_api.h>

#include <array>
#include <mutex>
#include <string>

#include "cuda/cuda_api.h"
#include "flashcpp/device.h"

namespace flashcpp::cuda {

namespace {
std::string cuda_version(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }
}  // namespace

std::string error_string(cudaError_t e, int driver_version, int runtime_version) {
  constexpr const char* kUseCpu = "use the CPU backend (--backend cpu)";
  if (e == cudaErrorInsufficientDriver) {
    // The runtime says this both when no driver is installed (version 0) and when it is too old.
    if (driver_version <= 0) return std::string("no NVIDIA driver or GPU was found on this machine; ") + kUseCpu;
    return "the NVIDIA driver supports CUDA " + cuda_version(driver_version) + ", older than the CUDA " +
           cuda_version(runtime_version) + " runtime of this build: update the driver, or " + kUseCpu;
  }
  if (e == cudaErrorNoDevice)
    return std::string("no NVIDIA GPU was found (the driver sees none, or CUDA_VISIBLE_DEVICES hides them); ") +
           kUseCpu;
  return cudaGetErrorString(e);
}

std::string error_string(cudaError_t e) {
  int driver = 0, runtime = 0;
  if (e == cudaErrorInsufficientDriver) {
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = CUDART_VERSION;
  }
  return error_string(e, driver, runtime);
}

std::string error_string(int cuda_error) { return error_string(static_cast<cudaError_t>(cuda_error)); }

Status current_device(DeviceInfo* info) {
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return Status::Unsupported("no usable CUDA device: " + error_string(e));
  }
  static std::mutex mu;
  static std::array<DeviceInfo, 64> cache{};
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& c = cache[static_cast<std::size_t>(dev) & 63];
  if (c.device != dev) {
    cudaDeviceProp prop{};
    e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) return Status::Cuda("cudaGetDeviceProperties failed: " + error_string(e));
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
