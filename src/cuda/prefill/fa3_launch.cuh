// Launch of one instantiation of the sm_90a prefill kernel. Included only by fa3_hd<D>.cu.
#pragma once

#include <algorithm>
#include <atomic>

#include "cuda/prefill/fa3_kernel.cuh"
#include "cuda/prefill/fa3_registry.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

template <class Cfg, typename T>
Status fa3_run(const Fa3Params& p, Stream stream, int device) {
  static std::atomic<unsigned long long> opted_in{0};  // per instantiation, one bit per device
  int ctas = 0;  // persistent: one CTA per SM (one fits: ~160-200 KB of shared memory), at most one per unit
  if constexpr (Cfg::kPersistent) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1)
      return Status::Cuda("cudaDeviceGetAttribute(multiprocessor count) failed");
    ctas = std::max(1, std::min(p.n_units, sms));
  }
  return launch_prefill(&fa3_forward_kernel<Cfg, T>, p, Cfg::kBlockM, Cfg::kThreads, Cfg::kSmemBytes, stream, device,
                        opted_in, "sm90 prefill kernel", ctas);
}

template <class Cfg>
constexpr Fa3Entry fa3_entry() {
  TileConfig t;
  t.block_m = Cfg::kBlockM;
  t.block_n = Cfg::kBlockN;
  t.stages = Cfg::kStages;
  t.warps = Cfg::kThreads / 32;
  t.ping_pong = Cfg::kPingPong;
  t.sched = Cfg::kSched;
  t.persistent = Cfg::kPersistent;
  t.lean_mask = Cfg::kLeanMask;
  t.qk_dims = Cfg::kQkDims < Cfg::kHeadDim ? Cfg::kQkDims : 0;
  return Fa3Entry{Cfg::kHeadDim, Cfg::kHeadDimV, t, Cfg::kSmemBytes, Cfg::kQBufs, &fa3_run<Cfg, __nv_bfloat16>,
                  &fa3_run<Cfg, __half>};
}

}  // namespace flashcpp::cuda
