// The head-dim rules every validator shares (attention, backward, decode), one sentence each:
// any multiple of 8 in [8, 256] on the CPU backends, and the compiled set kCudaHeadDims with
// head_dim_v == head_dim on CUDA (attention.h).
#pragma once

#include <iterator>
#include <string>

#include "core/message.h"
#include "flashcpp/attention.h"
#include "flashcpp/status.h"

namespace flashcpp::detail {

/// `name` (head_dim or head_dim_v) is a multiple of kHeadDimStep in [kHeadDimStep, kMaxHeadDim].
inline Status check_head_dim(const char* name, int d) {
  if (is_supported_head_dim(d)) return Status::Ok();
  return Status::Invalid(cat(name, " ", d, " is not supported (it must be a multiple of ", kHeadDimStep, " in [",
                             kHeadDimStep, ", ", kMaxHeadDim, "])"));
}

/// The CUDA kernels' set, "64, 128 or 256".
inline std::string cuda_head_dim_list() {
  std::string s;
  constexpr int n = static_cast<int>(std::size(kCudaHeadDims));
  for (int i = 0; i < n; ++i) s += cat(i == 0 ? "" : i + 1 == n ? " or " : ", ", kCudaHeadDims[i]);
  return s;
}

/// What the CUDA kernels of `what` ("attention", "the backward", "decode") are compiled for.
inline Status check_cuda_head_dims(int head_dim, int head_dim_v, const char* what) {
  if (head_dim_v != head_dim)
    return Status::Unsupported(cat("head_dim ", head_dim, " with head_dim_v ", head_dim_v, " runs on the CPU backends only (",
                                   "the CUDA kernels of ", what, " take head_dim_v == head_dim)"));
  if (!is_cuda_head_dim(head_dim))
    return Status::Unsupported(cat("head_dim ", head_dim, " runs on the CPU backends only (the CUDA kernels of ", what,
                                   " are built for head_dim ", cuda_head_dim_list(), ")"));
  return Status::Ok();
}

}  // namespace flashcpp::detail
