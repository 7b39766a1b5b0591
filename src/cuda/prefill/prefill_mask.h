// The optional mask features of both prefill kernels, as one plain block of kernel parameters.
//
// Causal, sliding window and global tokens live in MaskRules (src/common/mask_rules.h); this
// struct adds what MaskRules cannot say: the two score modifiers, packed variable-length
// sequences and block-sparse masks. `flags` tells the kernel which are on. It is a runtime
// value, uniform over the launch, so a feature that is off costs one predicated-off branch per
// key block and no template instantiation (docs/masks.md, "CUDA kernels").
//
// The softcap and the ALiBi slope unit live in the kernels' ScoreTransform (raw q.k units,
// common/attention_algebra.h); this struct says which modifiers are on and where the slopes are.
#pragma once

#include <cstdint>

namespace flashcpp::cuda {

/// Shared-memory bytes each prefill CTA keeps for its CtaWork (prefill_mask.cuh): part of the
/// kernels' dynamic shared memory, so the static shared size stays 0.
inline constexpr int kCtaWorkBytes = 128;

struct PrefillMask {
  enum Flag : std::uint32_t {
    kSoftcap = 1u << 0,  ///< u = ScoreTransform::softcap(u)
    kAlibi = 1u << 1,    ///< u += ScoreTransform::slope_raw(slope) * (j - ia)
    kVarlen = 1u << 2,   ///< cu_seqlens_q / cu_seqlens_k give each sequence's rows
    kSparse = 1u << 3,   ///< walk the listed key blocks of bs_* instead of the window range
    kRotary = 1u << 4,   ///< rotate q and k tiles in shared memory (the params' PrefillRope)
  };
  std::uint32_t flags = 0;

  const float* alibi_slopes = nullptr;  ///< [b * alibi_batch_stride + h]
  std::int64_t alibi_batch_stride = 0;

  /// int32 [batch + 1] prefix sums (device memory). Each sequence's length is clamped to
  /// [0, seqlen_q] / [0, seqlen_k] (the maxima the grid is sized by).
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  /// Varlen: the LSE's row count, (heads_q, lse_rows) (MaskParams::total_q); 0 = read
  /// cu_seqlens_q[batch] on the device.
  std::int64_t lse_rows = 0;

  /// Block-sparse CSR (BlockSparseMask of attention.h; device arrays). The kernel's BlockM divides
  /// bs_block_m and its BlockN divides bs_block_n (dispatch picks such a config), so one CTA's
  /// rows lie in one mask row and each listed mask block is a whole number of key tiles.
  const std::int32_t* bs_row_ptr = nullptr;
  const std::int32_t* bs_col_idx = nullptr;
  const std::int32_t* bs_partial = nullptr;
  const std::uint64_t* bs_bits = nullptr;
  int bs_num_partial = 0;  ///< element masks (partial entries are int32, so at most 2^31-1 count)
  int bs_block_m = 0, bs_block_n = 0;
  int bs_per_batch = 0;  ///< 1: one mask per sequence (num_batch == batch), 0: shared
  int bs_num_heads = 1;  ///< 1 (shared) or heads_q
  int bs_num_q_blocks = 0, bs_num_k_blocks = 0;
  int bs_words = 1;      ///< uint64 words per element-mask row: ceil(bs_block_n / 64)
};

}  // namespace flashcpp::cuda
