// Kernel parameters of the sm80 prefill kernel: one plain struct, passed as __grid_constant__.
#pragma once

#include <cstdint>

#include "common/mask_rules.h"

namespace flashcpp::cuda {

struct Fa2Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  ///< (batch, heads_q, seqlen_q) or nullptr
  std::int64_t q_batch_stride, k_batch_stride, v_batch_stride, o_batch_stride;  ///< elements
  std::int32_t q_seq_stride, k_seq_stride, v_seq_stride, o_seq_stride;          ///< elements
  std::int32_t q_head_stride, k_head_stride, v_head_stride, o_head_stride;      ///< elements
  int batch, seqlen_q, seqlen_k, heads_q, group;  ///< group = heads_q / heads_kv
  float scale_log2;                               ///< softmax_scale * log2(e)
  MaskRules rules;                                ///< causal / window, seqlens filled in
};

}  // namespace flashcpp::cuda
