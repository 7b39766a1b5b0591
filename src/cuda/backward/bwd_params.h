// Kernel parameters of the CUDA attention backward (bwd_kernel.cuh): one plain struct, passed as
// __grid_constant__ to its four kernels (preprocess, main, postprocess, uncovered rows).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/attention_algebra.h"
#include "common/mask_rules.h"
#include "cuda/prefill/prefill_mask.h"
#include "flashcpp/attention.h"

namespace flashcpp::cuda {

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  const float* lse;   ///< the forward's LSE, AttnParams::lse's layout
  const float* dlse;  ///< optional dL/dLSE in the same layout (nullptr = 0)
  /// Element strides. Batch strides are unused when varlen; in-sequence offsets fit int32 (validate).
  std::int64_t q_batch_stride, k_batch_stride, v_batch_stride, o_batch_stride;
  std::int64_t do_batch_stride, dq_batch_stride, dk_batch_stride, dv_batch_stride;
  std::int32_t q_seq_stride, k_seq_stride, v_seq_stride, o_seq_stride;
  std::int32_t do_seq_stride, dq_seq_stride, dk_seq_stride, dv_seq_stride;
  std::int32_t q_head_stride, k_head_stride, v_head_stride, o_head_stride;
  std::int32_t do_head_stride, dq_head_stride, dk_head_stride, dv_head_stride;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, group;  ///< seqlens: maxima when varlen
  int head_dim, head_dim_v;  ///< the tensors' own dims, multiples of 8 up to the class D compiled
  float scale;               ///< effective softmax scale (> 0 on CUDA)
  algebra::ScoreTransform score;
  MaskRules rules;           ///< causal / window / global tokens at the maximum lengths
  PrefillMask mask;          ///< softcap, ALiBi, varlen, block-sparse flags (no rotary)
  BlockSparseMask bs;        ///< the block-sparse mask (device arrays) when mask.flags has kSparse
  // The workspace (BackwardWorkspaceLayout): rows padded per sequence to whole tiles of row_pad.
  float* delta;              ///< [heads_q][ws_rows] D = rowsum(dO * O) - dLSE
  float* lse2;               ///< [heads_q][ws_rows] LSE log2(e); padded rows hold a huge value (P = 0)
  float* dq_accum;           ///< [heads_q][ws_rows][head_dim] sum of dS K, unscaled
  std::int32_t* sem;         ///< [heads_q][ws_rows / row_pad] deterministic mode, else nullptr
  std::int64_t ws_rows;
  int row_pad;
  /// Key tiles per group of the grid (select::backward_key_group): blockIdx.x is the tile within
  /// its group, blockIdx.z = group x batch + sequence.
  int key_group;
  /// Varlen: the packed rows of q (mask.total_q) and of k (total_k); 0 = unknown. Rows past
  /// cu_seqlens[batch] get zero gradients when known. Also the LSE's row count when total_q > 0.
  std::int64_t total_q, total_k;
  /// The warp-specialized wgmma kernel's TMA maps (tma_map.h; box rows block_m for Q and dO,
  /// block_n for K and V; dq_accum's box 32 columns x 64 rows); unset for the other kernels.
  CUtensorMap tmap_q, tmap_do, tmap_k, tmap_v, tmap_dq;
};

}  // namespace flashcpp::cuda
