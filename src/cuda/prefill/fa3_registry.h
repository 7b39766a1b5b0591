// The compiled configs of the sm_90a prefill kernel (one row per listed instantiation).
#pragma once

#include <span>
#include <string>

#include "cuda/prefill/fa3_params.h"
#include "flashcpp/attention.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

using Fa3RunFn = Status (*)(const Fa3Params&, Stream, int device);

struct Fa3Entry {
  int head_dim, head_dim_v;  ///< the class (Fa3Config::kHeadDim, kHeadDimV)
  TileConfig tile;  ///< block_m 64 per consumer warpgroup; its name: select::sm90_config_name
  int smem_bytes;
  int q_bufs;  ///< Q buffers (persistent configs: 2 where shared memory allows; Fa3Config::kQBufs)
  Fa3RunFn run_bf16;
  Fa3RunFn run_fp16;
};
/// The configs of the class a pair of head dims runs in (cuda_sm90_head_dim_class: 64, 128, the
/// 192 / 128 class or 256).
std::span<const Fa3Entry> fa3_entries(int head_dim, int head_dim_v);

}  // namespace flashcpp::cuda
