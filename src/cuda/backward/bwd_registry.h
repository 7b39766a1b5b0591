// The compiled configs of the CUDA attention backward: one per head-dim class (bwd_hd<D>.cu), each
// with its bf16 and fp16 instantiation. The selector (core/selector.cc) reads the tile from here;
// the tile's block_m is the workspace's row_pad.
#pragma once

#include "cuda/backward/bwd_params.h"
#include "flashcpp/attention.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

using BwdRunFn = Status (*)(const BwdParams&, Stream, int device);

struct BwdEntry {
  int head_dim = 0;  ///< the class
  TileConfig tile;   ///< block_m (query tile = row_pad), block_n (keys per CTA), warps, min_blocks
  int smem_bytes = 0;
  BwdRunFn run_bf16 = nullptr;
  BwdRunFn run_fp16 = nullptr;
};

const BwdEntry& bwd_entry_hd64();
const BwdEntry& bwd_entry_hd128();
const BwdEntry& bwd_entry_hd256();
/// The entry of a head-dim class (64, 128, 256), or nullptr.
const BwdEntry* bwd_entry(int head_dim_class);

}  // namespace flashcpp::cuda
