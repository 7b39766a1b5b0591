// Kernel parameters of the decode kernels (split-KV, merge, append+rotary): one plain struct,
// passed as __grid_constant__. Filled on the host by decode_dispatch.cc from DecodeParams and
// the plan; nothing here is a framework type.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"

namespace flashcpp::cuda {

struct DecodeKernelParams {
  // query and output (batch, seqlen_q, heads_q, D); strides in elements
  const void* q;
  void* o;
  float* lse;  ///< (batch, heads_q, seqlen_q) or nullptr
  std::int64_t q_batch_stride, q_seq_stride, q_head_stride;
  std::int64_t o_batch_stride, o_seq_stride, o_head_stride;

  // KV cache: contiguous (batch_stride per sequence) or paged (batch_stride per page)
  const void* k_cache;
  const void* v_cache;
  void* k_cache_w;  ///< same as k_cache, writable (append)
  void* v_cache_w;
  std::int64_t k_batch_stride, k_seq_stride, k_head_stride;
  std::int64_t v_batch_stride, v_seq_stride, v_head_stride;
  const std::int32_t* block_table;  ///< paged only
  std::int64_t block_table_stride;
  int paged;       ///< 0 / 1
  int page_shift;  ///< log2(page_size)
  int page_mask;   ///< page_size - 1
  int num_pages;
  int slots;       ///< key slots per sequence (capacity, or pages_per_seq * page_size)
  const std::int32_t* cache_seqlens;
  /// 1: the cache holds fp8 e4m3 codes with per-KV-head scales (decode.h): scores use
  /// softmax_scale * k_scale[hk], O is v_scale[hk] times the weighted sum of the codes.
  int kv_fp8;
  const float* k_scale;
  const float* v_scale;

  // append: new K/V (batch, seqlen_q, heads_kv, D)
  int append;
  const void* k_new;
  const void* v_new;
  std::int64_t kn_batch_stride, kn_seq_stride, kn_head_stride;
  std::int64_t vn_batch_stride, vn_seq_stride, vn_head_stride;

  // rotary (style 0 = off, 1 = neox, 2 = interleaved: RopeStyle's codes; see decode.h, rope.h)
  int rot_style, rot_dim;
  const float* rot_cos;
  const float* rot_sin;
  std::int64_t rot_table_stride;  ///< elements between the tables' rows (RotarySpec::table_stride resolved)
  int rot_max_pos;
  /// Without tables: inv_freq[i] of rotary_inv_freq (rope.h: theta and the Llama-3 scaling, fp64,
  /// on the host), the angles then reduced and rotated by the rule every rotary path shares
  /// (fused_math.h).
  double rot_inv_freq[128];

  // shape. head_dim (q, k) and head_dim_v (v, o) are the tensors' own; the kernel's D is the class
  // that holds both (cuda_head_dim_class): columns past a tensor's head dim load as zeros and are
  // never stored, so zero q.k terms and zero O columns are all the padding adds.
  int batch, seqlen_q, heads_q, heads_kv, head_dim, head_dim_v, group;
  int rows;        ///< group * seqlen_q: query rows per KV head
  int row_blocks;  ///< CTAs along the rows
  int warp_rows;   ///< warps along the rows in a CTA (1, 2, 4); 4 / warp_rows split the keys

  // scores (raw q.k units, common/attention_algebra.h) and mask
  algebra::ScoreTransform score;
  float softmax_scale, softcap;  ///< what `score` was made from (an fp8 cache remakes it per KV head)
  const float* alibi;  ///< slopes or nullptr
  std::int64_t alibi_batch_stride;
  int causal, window_left, window_right;  ///< windows pre-clamped (decode::clamp_window)

  // plan: work list (int workspace) and partials (float workspace)
  const std::int32_t* first_item;
  const std::int32_t* num_splits;
  const std::int32_t* item_batch;
  const std::int32_t* item_split;
  float* part_o;    ///< [items][heads_kv][rows][head_dim_v], normalized
  float* part_lse;  ///< [items][heads_kv][rows], natural log
  /// Fused merge (DecodePlan::fused_merge): arrival counters [batch][heads_kv][row_blocks] after
  /// the work list; null = the merge kernel merges.
  int* merge_counters;
  /// Fused append (DecodePlan::fused_append, with append): the split-KV kernel writes the new K/V
  /// of the tokens in each split's tiles before loading them; no append launch.
  int fused_append;
  /// > 0: every sequence has this many splits (the plan's num_items == batch * max_splits), so a
  /// CTA derives (sequence, split) from its item index instead of reading the work list first.
  int uniform_splits;
  /// 1: the split-KV kernel is launched programmatically right after this step's own append kernel
  /// (sm_90+). That kernel waited for every grid before it before releasing its dependents, so all
  /// the split kernel reads is final except the appended slots: it reads lengths, block table, Q
  /// and the tiles without an appended key before its own griddepcontrol.wait, overlapping the
  /// append (decode_kernel.cuh).
  int after_own_append;

  /// Host side only: launch programmatically (RunOptions::programmatic_launch on sm_90+). Every
  /// decode kernel starts with griddepcontrol.wait, a no-op for an ordinary launch.
  int pdl;
};

/// merge_attention_states: (batch, seqlen, heads, D) views, LSE (batch, heads, seqlen).
struct MergeStatesKernelParams {
  const void* o_a;
  const void* o_b;
  void* o;
  const float* lse_a;
  const float* lse_b;
  float* lse;
  std::int64_t a_batch_stride, a_seq_stride, a_head_stride;
  std::int64_t b_batch_stride, b_seq_stride, b_head_stride;
  std::int64_t o_batch_stride, o_seq_stride, o_head_stride;
  int batch, seqlen, heads, head_dim;
};

}  // namespace flashcpp::cuda
