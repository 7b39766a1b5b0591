// Launch of one instantiation of the sm_90a prefill kernel. Included only by fa3_hd<D>.cu.
#pragma once

#include <atomic>

#include "cuda/prefill/fa3_kernel.cuh"
#include "cuda/prefill/fa3_registry.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

template <class Cfg, typename T>
Status fa3_run(const Fa3Params& p, Stream stream, int device) {
  static std::atomic<unsigned long long> opted_in{0};  // per instantiation, one bit per device
  return launch_prefill(&fa3_forward_kernel<Cfg, T>, p, Cfg::kBlockM, Cfg::kThreads, Cfg::kSmemBytes, stream, device, opted_in,
                        "sm90 prefill kernel");
}

template <class Cfg>
constexpr Fa3Entry fa3_entry() {
  return Fa3Entry{Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kSmemBytes, Cfg::kPingPong, Cfg::kSched,
                  &fa3_run<Cfg, __nv_bfloat16>, &fa3_run<Cfg, __half>};
}

}  // namespace flashcpp::cuda
