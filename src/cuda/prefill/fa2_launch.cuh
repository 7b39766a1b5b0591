// Launch of one instantiation of the sm80 prefill kernel. Included only by fa2_hd<D>.cu.
#pragma once

#include <atomic>

#include "cuda/prefill/fa2_kernel.cuh"
#include "cuda/prefill/fa2_registry.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

template <class Cfg, typename T>
Status fa2_run(const Fa2Params& p, Stream stream, int device) {
  static std::atomic<unsigned long long> opted_in{0};  // per instantiation, one bit per device
  return launch_prefill(&fa2_forward_kernel<Cfg, T>, p, Cfg::kBlockM, Cfg::kThreads, Cfg::kSmemBytes, stream, device, opted_in,
                        "sm80 prefill kernel");
}

template <class Cfg>
constexpr Fa2Entry fa2_entry() {
  TileConfig t;
  t.block_m = Cfg::kBlockM;
  t.block_n = Cfg::kBlockN;
  t.stages = Cfg::kStages;
  t.warps = Cfg::kWarps;
  t.q_in_regs = Cfg::kQInRegs;
  t.min_blocks = Cfg::kMinBlocks;
  return Fa2Entry{Cfg::kHeadDim, t, Cfg::kSmemBytes, &fa2_run<Cfg, __nv_bfloat16>, &fa2_run<Cfg, __half>};
}

}  // namespace flashcpp::cuda
