// The compiled tile configs of the sm80 prefill kernel: one table per head dim, each row one
// listed instantiation (bf16 and fp16). Adding a config = adding one row in fa2_hd<D>.cu.
#pragma once

#include <span>
#include <string>

#include "cuda/prefill/fa2_params.h"
#include "flashcpp/attention.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

using Fa2RunFn = Status (*)(const Fa2Params&, Stream, int device);

struct Fa2Entry {
  int head_dim;
  TileConfig tile;  ///< its name: select::sm80_config_name
  int smem_bytes;
  Fa2RunFn run_bf16;
  Fa2RunFn run_fp16;
};

std::span<const Fa2Entry> fa2_entries_hd64();
std::span<const Fa2Entry> fa2_entries_hd128();
std::span<const Fa2Entry> fa2_entries_hd256();
std::span<const Fa2Entry> fa2_entries(int head_dim);

}  // namespace flashcpp::cuda
