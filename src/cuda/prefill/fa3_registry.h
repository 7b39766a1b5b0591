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
  int head_dim;
  TileConfig tile;  ///< block_m 64 per consumer warpgroup; its name: select::sm90_config_name
  int smem_bytes;
  int q_bufs;  ///< Q buffers (persistent configs: 2 where shared memory allows; Fa3Config::kQBufs)
  Fa3RunFn run_bf16;
  Fa3RunFn run_fp16;
};
std::span<const Fa3Entry> fa3_entries(int head_dim);

}  // namespace flashcpp::cuda
