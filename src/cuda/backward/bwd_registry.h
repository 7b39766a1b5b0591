// The compiled configs of the CUDA attention backward: the mma.sync kernel's, one per head-dim class
// (bwd_hd<D>.cu), and the wgmma kernels' for the classes 64 and 128 (bwd_sm90_hd<D>.cu and the
// warp-specialized bwd_sm90ws_hd<D>.cu, sm_90a), each with its bf16 and fp16 instantiation. The selector (core/selector.cc) reads the tile from here;
// the tile's block_m is the workspace's row_pad.
#pragma once

#include "cuda/backward/bwd_params.h"
#include "flashcpp/attention.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

/// Launches the main kernel over key_tiles key tiles (the longest sequence's) in groups of
/// BwdParams::key_group.
using BwdRunFn = Status (*)(const BwdParams&, int key_tiles, Stream, int device);

struct BwdEntry {
  int head_dim = 0;  ///< the class
  TileConfig tile;   ///< block_m (query tile = row_pad), block_n (keys per CTA), warps, min_blocks
  int smem_bytes = 0;
  bool sm90 = false;  ///< the wgmma kernel (sm_90a only)
  bool ws = false;    ///< its warp-specialized twin (TMA maps in BwdParams)
  BwdRunFn run_bf16 = nullptr;
  BwdRunFn run_fp16 = nullptr;
};

const BwdEntry& bwd_entry_hd64();
const BwdEntry& bwd_entry_hd128();
const BwdEntry& bwd_entry_hd256();
const BwdEntry& bwd_entry_sm90_hd64();
const BwdEntry& bwd_entry_sm90_hd128();
const BwdEntry& bwd_entry_sm90ws_hd64();
const BwdEntry& bwd_entry_sm90ws_hd128();
/// The mma.sync entry of a head-dim class (64, 128, 256), or nullptr.
const BwdEntry* bwd_entry(int head_dim_class);
/// The wgmma entry of a head-dim class (64, 128): the single-role kernel, or its warp-specialized
/// twin (bwd_sm90_ws.cuh); nullptr for other classes, or a build without the sm90 family.
const BwdEntry* bwd_entry_sm90(int head_dim_class, bool warp_specialized = false);

}  // namespace flashcpp::cuda
