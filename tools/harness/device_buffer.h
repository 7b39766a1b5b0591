// One owned cudaMalloc allocation and the CUDA-call check the harness's CUDA paths share
// (check, audit). Only included when FLASHCPP_WITH_CUDA.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

#include "flashcpp/device.h"
#include "flashcpp/status.h"

/// Returns Status::Cuda with the call and the error's name and sentence when `call` fails.
#define HARNESS_CUDA_TRY(call)                                                                                     \
  do {                                                                                                             \
    const cudaError_t e_ = (call);                                                                                 \
    if (e_ != cudaSuccess)                                                                                         \
      return ::flashcpp::Status::Cuda(                                                                             \
          fmt::format("{} failed: {} ({})", #call, cudaGetErrorName(e_), ::flashcpp::cuda::error_string(e_)));     \
  } while (0)

namespace flashcpp::harness {

/// Owns one cudaMalloc allocation; alloc() again frees the previous one first.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);  // nothing useful to do with an error here
  }
  Status alloc(std::size_t bytes) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = bytes;
    if (bytes) HARNESS_CUDA_TRY(cudaMalloc(&ptr_, bytes));
    return Status::Ok();
  }
  Status upload(const void* host, std::size_t bytes) {
    FLASHCPP_RETURN_IF_ERROR(alloc(bytes));
    if (bytes) HARNESS_CUDA_TRY(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
    return Status::Ok();
  }
  Status download(void* host, std::size_t bytes) const {
    if (bytes) HARNESS_CUDA_TRY(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost));
    return Status::Ok();
  }
  Status poison() {  // 0xFF bytes: NaN in fp16, bf16 and fp32
    if (bytes_) HARNESS_CUDA_TRY(cudaMemset(ptr_, 0xFF, bytes_));
    return Status::Ok();
  }
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  template <class T>
  T* as(std::size_t byte_offset = 0) const {
    return ptr_ ? reinterpret_cast<T*>(static_cast<std::uint8_t*>(ptr_) + byte_offset) : nullptr;
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace flashcpp::harness
