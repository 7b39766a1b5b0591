// The head-dim rules every validator shares (attention, backward, decode), one sentence each: any
// multiple of 8 in [8, 256] on every backend (the CUDA kernels run a head dim in the compiled class
// that holds it, attention.h's cuda_head_dim_class), and the fp8 cache's rule of CUDA decode.
#pragma once

#include <string>
#include <utility>

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

/// An fp8 e4m3 KV cache on CUDA: the decode kernels copy 16 codes per 16-byte load from rows that
/// start on 16-byte boundaries, and at a head dim 8 past a multiple of 16 a dense cache's rows start
/// on 8-byte ones. Such head dims run on the CPU backend, or on CUDA with a 16-bit cache.
inline Status check_cuda_fp8_head_dims(int head_dim, int head_dim_v) {
  for (auto [name, d] : {std::pair<const char*, int>{"head_dim", head_dim}, {"head_dim_v", head_dim_v}})
    if (d % 16 != 0)
      return Status::Unsupported(cat("an fp8_e4m3 cache with ", name, " ", d,
                                     " runs on the CPU backend only (the CUDA decode kernels copy 16 fp8 codes per "
                                     "16-byte load and take fp8 head dims that are multiples of 16; a 16-bit cache "
                                     "takes every multiple of 8)"));
  return Status::Ok();
}

}  // namespace flashcpp::detail
