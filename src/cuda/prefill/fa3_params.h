// Kernel parameters of the sm_90a (wgmma + TMA) prefill kernel.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/attention_algebra.h"
#include "common/mask_rules.h"
#include "cuda/prefill/prefill_mask.h"
#include "cuda/prefill/prefill_rope.h"

namespace flashcpp::cuda {

struct Fa3Params {
  CUtensorMap tmap_q;  ///< rank 4 (D, seqlen_q, heads_q, batch), box (64, 128, 1, 1), 128B swizzle
  CUtensorMap tmap_k;  ///< rank 4 (D, seqlen_k, heads_kv, batch), box (64, BlockN, 1, 1)
  CUtensorMap tmap_v;
  CUtensorMap tmap_o;  ///< TMA-store configs: like tmap_q over o, box (64, 64, 1, 1) (one consumer warpgroup's rows)
  void* o;
  float* lse;  ///< (batch, heads_q, seqlen_q), (heads_q, total_q) when varlen, or nullptr
  std::int64_t o_batch_stride;
  std::int32_t o_seq_stride, o_head_stride;
  int batch, seqlen_q, seqlen_k, heads_q, group;
  /// The tensors' own head dims (q/k and v/o), multiples of 8 up to the class D the kernel is
  /// compiled for: the maps read zeros past them (TMA out-of-bounds fill) and the stores skip them.
  int head_dim, head_dim_v;
  algebra::ScoreTransform score;                  ///< scale, softcap and ALiBi units (raw q.k units)
  /// Persistent configs: n_units work units of two row blocks (common/tile_order.h) over
  /// m_blocks row blocks, in groups of tile_heads (head, batch) pairs.
  int m_blocks, tile_heads, n_units;
  MaskRules rules;
  PrefillMask mask;  ///< softcap, ALiBi, varlen, block-sparse (prefill_mask.h)
  PrefillRope rope;  ///< rotary fused into the q/k loads (prefill_rope.h); on iff mask.flags has kRotary
};

}  // namespace flashcpp::cuda
