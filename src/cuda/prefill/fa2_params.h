// Kernel parameters of the sm80 prefill kernel: one plain struct, passed as __grid_constant__.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"
#include "common/mask_rules.h"
#include "cuda/prefill/prefill_mask.h"
#include "cuda/prefill/prefill_rope.h"

namespace flashcpp::cuda {

struct Fa2Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  ///< (batch, heads_q, seqlen_q), (heads_q, total_q) when varlen, or nullptr
  std::int64_t q_batch_stride, k_batch_stride, v_batch_stride, o_batch_stride;  ///< elements (unused when varlen)
  std::int32_t q_seq_stride, k_seq_stride, v_seq_stride, o_seq_stride;          ///< elements
  std::int32_t q_head_stride, k_head_stride, v_head_stride, o_head_stride;      ///< elements
  int batch, seqlen_q, seqlen_k, heads_q, group;  ///< group = heads_q / heads_kv; seqlens: maxima when varlen
  /// The tensors' own head dims (q/k and v/o), multiples of 8 up to the class D the kernel is
  /// compiled for: the copies zero-fill the 16-byte chunks past them and the stores skip them.
  int head_dim, head_dim_v;
  algebra::ScoreTransform score;                  ///< scale, softcap and ALiBi units (raw q.k units)
  MaskRules rules;                                ///< causal / window / global tokens (max seqlens)
  PrefillMask mask;                               ///< softcap, ALiBi, varlen, block-sparse (prefill_mask.h)
  PrefillRope rope;  ///< rotary fused into the q/k loads (prefill_rope.h); on iff mask.flags has kRotary
};

}  // namespace flashcpp::cuda
