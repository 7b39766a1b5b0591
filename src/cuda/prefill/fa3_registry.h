// The compiled configs of the sm_90a prefill kernel (one row per listed instantiation).
#pragma once

#include <span>
#include <string>

#include "cuda/prefill/fa3_params.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

using Fa3RunFn = Status (*)(const Fa3Params&, Stream, int device);

struct Fa3Entry {
  int head_dim, block_m, block_n, stages, smem_bytes;
  bool ping_pong;  ///< pipelined consumers (Q K^T of block j overlaps P V of j-1)
  bool sched;      ///< with ping_pong: the two warpgroups take turns (named barriers)
  bool persistent; ///< persistent CTAs with the tile scheduler and the TMA-store epilogue
  Fa3RunFn run_bf16;
  Fa3RunFn run_fp16;
};

/// "sm90_m128n128s2": BlockM 128 (2 consumer warpgroups), BlockN 128, 2 K/V stages; suffix "p" =
/// pipelined consumers with ping-pong scheduling, "o" = pipelined consumers without it; a trailing
/// "_persist" = persistent CTAs (tile scheduler, TMA-store epilogue). BlockM 192 = three consumer
/// warpgroups.
std::string fa3_config_name(const Fa3Entry& e);
std::span<const Fa3Entry> fa3_entries(int head_dim);

}  // namespace flashcpp::cuda
