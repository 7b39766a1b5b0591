// What the fp64 references (reference.cc, the forward; reference_backward.cc, the backward) share:
// where a sequence lives in the packed tensors and the visibility rules of attention.h, evaluated
// one (query, key) pair at a time.
//
// Deliberately independent of src/common/mask_rules.h and src/common/attention_walk.h: visibility
// is decided per pair straight from the rules written in the header comment of
// include/flashcpp/attention.h, so that a slip in MaskRules or in the tile walk (which the CUDA
// kernels and the tiled CPU backends share) shows up as a mismatch against the references instead
// of being copied into them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashcpp/attention.h"

namespace flashcpp::cpu::ref {

/// Where sequence b lives. With varlen the tensors are packed (total_tokens, heads, dim) and
/// `first_*` are token indices; otherwise first_q is b * seqlen_q (the packed output row).
struct Sequence {
  int len_q = 0, len_k = 0;
  std::int64_t first_q = 0, first_k = 0;
};

inline Sequence sequence(const AttnParams& p, int b) {
  const MaskParams& m = p.mask;
  Sequence s;
  if (m.cu_seqlens_q) {
    s.first_q = m.cu_seqlens_q[b];
    s.len_q = m.cu_seqlens_q[b + 1] - m.cu_seqlens_q[b];
  } else {
    s.first_q = static_cast<std::int64_t>(b) * p.seqlen_q;
    s.len_q = p.seqlen_q;
  }
  if (m.cu_seqlens_k) {
    s.first_k = m.cu_seqlens_k[b];
    s.len_k = m.cu_seqlens_k[b + 1] - m.cu_seqlens_k[b];
  } else {
    s.first_k = static_cast<std::int64_t>(b) * p.seqlen_k;
    s.len_k = p.seqlen_k;
  }
  return s;
}

/// Element offset of (sequence b, row `row`, head h, dim 0) in tensor t. Varlen tensors ignore
/// batch_stride and start sequence b at token `first`.
inline std::int64_t row_offset(const TensorView& t, bool varlen, int b, std::int64_t first, std::int64_t row, int h) {
  const std::int64_t seq_base = varlen ? first * t.seq_stride : b * t.batch_stride;
  return seq_base + row * t.seq_stride + h * t.head_stride;
}

/// Query rows in the packed order: batch * seqlen_q, or cu_seqlens_q[batch] when varlen.
inline std::int64_t total_q_rows(const AttnParams& p) {
  return p.mask.cu_seqlens_q ? p.mask.cu_seqlens_q[p.batch] : static_cast<std::int64_t>(p.batch) * p.seqlen_q;
}
/// Key rows in the packed order: batch * seqlen_k, or cu_seqlens_k[batch] when varlen.
inline std::int64_t total_k_rows(const AttnParams& p) {
  return p.mask.cu_seqlens_k ? p.mask.cu_seqlens_k[p.batch] : static_cast<std::int64_t>(p.batch) * p.seqlen_k;
}

/// The visibility rules of attention.h for one (sequence, head), one pair at a time.
class Visibility {
 public:
  Visibility(const MaskParams& m, const Sequence& s, int b, int h) : m_(m), s_(s) {
    if (m.block_sparse) {
      bs_ = m.block_sparse;
      bs_row_base_ = (static_cast<std::int64_t>(bs_->num_batch == 1 ? 0 : b) * bs_->num_heads +
                      (bs_->num_heads == 1 ? 0 : h)) *
                     bs_->num_q_blocks;
      block_of_key_.assign(static_cast<std::size_t>(std::max(bs_->num_k_blocks, 0)), kAbsent);
    }
  }

  /// Call once per query row before visible(i, j): loads the row's block-sparse entries.
  void begin_row(int i) {
    if (!bs_) return;
    const int qb = i / bs_->block_m;
    if (qb == loaded_qb_) return;
    std::fill(block_of_key_.begin(), block_of_key_.end(), kAbsent);
    loaded_qb_ = qb;
    if (qb >= bs_->num_q_blocks) return;  // beyond the mask: nothing listed
    const std::int64_t r = bs_row_base_ + qb;
    for (std::int32_t e = bs_->row_ptr[r]; e < bs_->row_ptr[r + 1]; ++e) {
      const int kb = bs_->col_idx[e];
      if (kb >= 0 && kb < bs_->num_k_blocks) block_of_key_[kb] = bs_->partial[e];
    }
  }

  bool visible(int i, int j) const {
    const std::int64_t ia = static_cast<std::int64_t>(i) + s_.len_k - s_.len_q;  // bottom-right
    const bool global_key = j < m_.global_tokens;
    const bool global_query = m_.global_queries && ia < m_.global_tokens;
    if (m_.causal && j > ia) return false;
    if (m_.window_right >= 0 && !global_query && j > ia + m_.window_right) return false;
    if (m_.window_left >= 0 && !global_query && !global_key && j < ia - m_.window_left) return false;
    if (bs_) {
      const int kb = j / bs_->block_n;
      if (kb >= bs_->num_k_blocks) return false;
      const std::int32_t state = block_of_key_[kb];
      if (state == kAbsent) return false;
      if (state >= 0) {  // partial block: its element bit decides
        const int words_per_row = (bs_->block_n + 63) / 64;
        const int r = i % bs_->block_m, c = j % bs_->block_n;
        const std::uint64_t word =
            bs_->element_masks[(static_cast<std::int64_t>(state) * bs_->block_m + r) * words_per_row + c / 64];
        if (((word >> (c % 64)) & 1u) == 0) return false;
      }
    }
    return true;
  }

 private:
  static constexpr std::int32_t kAbsent = -2;  // -1 = full block, >= 0 = element mask index
  const MaskParams& m_;
  Sequence s_;
  const BlockSparseMask* bs_ = nullptr;
  std::int64_t bs_row_base_ = 0;
  int loaded_qb_ = -1;
  std::vector<std::int32_t> block_of_key_;
};

}  // namespace flashcpp::cpu::ref
