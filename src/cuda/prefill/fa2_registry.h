// The compiled tile configs of the sm80 prefill kernel: one table per head dim, each row one
// listed instantiation (bf16 and fp16). Adding a config = adding one row in fa2_hd<D>.cu.
#pragma once

#include <span>
#include <string>

#include "cuda/prefill/fa2_params.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

using Fa2RunFn = Status (*)(const Fa2Params&, Stream, int device);

struct Fa2Entry {
  int head_dim, block_m, block_n, warps, stages;
  bool q_in_regs;
  int min_blocks;
  int smem_bytes;
  Fa2RunFn run_bf16;
  Fa2RunFn run_fp16;
};

/// "m128n64w4s2q" -> BlockM 128, BlockN 64, 4 warps, 2 stages, Q re-read from shared memory
/// (suffix 'r' = Q held in registers); a trailing "b3" = registers capped for 3 CTAs per SM.
std::string fa2_config_name(const Fa2Entry& e);

std::span<const Fa2Entry> fa2_entries_hd64();
std::span<const Fa2Entry> fa2_entries_hd128();
std::span<const Fa2Entry> fa2_entries_hd256();
std::span<const Fa2Entry> fa2_entries(int head_dim);

}  // namespace flashcpp::cuda
