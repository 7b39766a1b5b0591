// Names of enums, Status formatting and small AttnParams helpers.
#include <cmath>
#include <string>

#include "flashcpp/attention.h"
#include "flashcpp/rope.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp {

const char* status_code_name(StatusCode code) noexcept {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kCudaError: return "cuda_error";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kF32: return "fp32";
    case DType::kF64: return "fp64";
    case DType::kF8E4M3: return "fp8_e4m3";
  }
  return "unknown";
}

const char* backend_name(Backend b) noexcept {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kCpu: return "cpu";
    case Backend::kCpuReference: return "cpu-reference";
    case Backend::kCuda: return "cuda";
  }
  return "unknown";
}

const char* kernel_name(KernelId k) noexcept {
  switch (k) {
    case KernelId::kNone: return "none";
    case KernelId::kCpuReference: return "cpu_reference_fp64";
    case KernelId::kCpuTiled: return "cpu_tiled_online_softmax";
    case KernelId::kCudaSm80: return "cuda_sm80_fa2";
    case KernelId::kCudaSm90: return "cuda_sm90_wgmma";
  }
  return "unknown";
}

const char* rope_style_name(RopeStyle s) noexcept {
  switch (s) {
    case RopeStyle::kNone: return "none";
    case RopeStyle::kNeox: return "neox";
    case RopeStyle::kInterleaved: return "interleaved";
  }
  return "unknown";
}

float AttnParams::effective_scale() const noexcept {
  if (softmax_scale != 0.f) return softmax_scale;
  return head_dim > 0 ? 1.f / std::sqrt(static_cast<float>(head_dim)) : 0.f;
}

}  // namespace flashcpp
