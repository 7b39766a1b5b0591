// Launch of one instantiation of the backward main kernel (mma.sync, or wgmma when Cfg::kSm90).
// Included only by bwd_hd<D>.cu and bwd_sm90_hd<D>.cu.
#pragma once

#include <atomic>

#include "cuda/backward/bwd_kernel.cuh"
#include "cuda/backward/bwd_registry.h"
#include "cuda/backward/bwd_sm90.cuh"
#include "cuda/backward/bwd_sm90_ws.cuh"
#include "cuda/common/smem_opt_in.h"

namespace flashcpp::cuda {

/// Grid (key_group, heads_kv, groups x batch): CTAs start group by group (select::backward_key_group),
/// and within a group, (sequence, KV head) by (sequence, KV head) with its key tiles fastest. So the
/// CTAs of one (sequence, KV head) start in ascending key order, and deterministic mode, which waits
/// only for smaller key tiles of its own, waits only for CTAs that started before it.
template <class Cfg, typename T>
Status bwd_run(const BwdParams& p, int key_tiles, Stream stream, int device) {
  static std::atomic<unsigned long long> opted_in{0};  // per instantiation, one bit per device
  auto* kernel = [] {
    if constexpr (Cfg::kWs) return &bwd_sm90_ws_kernel<Cfg, T>;
    else if constexpr (Cfg::kSm90) return &bwd_sm90_kernel<Cfg, T>;
    else return &bwd_main_kernel<Cfg, T>;
  }();
  FLASHCPP_RETURN_IF_ERROR(opt_in_dynamic_smem(kernel, Cfg::kSmemBytes, device, opted_in, "backward: "));
  if (key_tiles == 0) return Status::Ok();
  const int groups = (key_tiles + p.key_group - 1) / p.key_group;
  const dim3 grid(static_cast<unsigned>(p.key_group), static_cast<unsigned>(p.heads_kv),
                  static_cast<unsigned>(p.batch) * static_cast<unsigned>(groups));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::Cuda(std::string("backward kernel launch failed: ") + cudaGetErrorString(e));
  return Status::Ok();
}

template <class Cfg>
BwdEntry bwd_entry_of() {
  BwdEntry e;
  e.head_dim = Cfg::kHeadDim;
  e.tile.block_m = Cfg::kBlockM;
  e.tile.block_n = Cfg::kBlockN;
  e.tile.warps = Cfg::kWarps;
  e.tile.stages = 2;
  e.tile.min_blocks = Cfg::kMinBlocks;
  e.smem_bytes = Cfg::kSmemBytes;
  e.sm90 = Cfg::kSm90;
  e.ws = Cfg::kWs;
  e.run_bf16 = &bwd_run<Cfg, __nv_bfloat16>;
  e.run_fp16 = &bwd_run<Cfg, __half>;
  return e;
}

}  // namespace flashcpp::cuda
