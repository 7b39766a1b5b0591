// Host-side mask builders: ALiBi slopes and block-sparse masks (the CSR BlockSparseMask of
// attention.h) built from a mask function, a dense boolean mask or one of the common patterns.
//
// Block-sparse masks follow FlexAttention's BlockMask idea: evaluate the mask once on the host,
// cut it into block_m x block_n blocks, drop the blocks no pair of which is visible, list the
// rest per query block, and keep element bits only for the blocks that are neither empty nor
// full. A kernel then walks only the listed blocks and applies bits only in the partial ones, so
// its work is proportional to the number of listed blocks (docs/masks.md has the cost model).
//
//   flashcpp::BlockMask bm;
//   flashcpp::BlockSparseShape s{.seqlen_q = n, .seqlen_k = n, .block_m = 128, .block_n = 128};
//   auto st = flashcpp::build_block_sparse(s, [&](int i, int j) { return doc[i] == doc[j]; }, &bm);
//   p.mask.block_sparse = bm.get();   // bm must outlive the call; the arrays are host memory
//
// Everything here runs on the host and allocates; nothing launches. For the CUDA backend the
// caller copies the arrays (row_ptr(), col_idx(), partial(), element_masks()) to the device and
// points a BlockSparseMask at the copies.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/status.h"

namespace flashcpp {

// ---- ALiBi ---------------------------------------------------------------------------------

/// The standard ALiBi slopes for `num_heads` heads (Press et al.; BLOOM's build_alibi_tensor),
/// for MaskParams::alibi_slopes. With n the largest power of two <= num_heads:
///   heads 0 .. n-1 get 2^(-8 (h+1) / n)                     (a geometric sequence from 2^(-8/n))
///   heads n .. num_heads-1 get 2^(-8 (2k+1) / (2n)), k = 0, 1, ...   (every other slope of the
///                                                            2n sequence, starting with its first)
/// Computed in double, rounded once to float. Writes slopes[0 .. num_heads).
Status alibi_slopes(int num_heads, float* slopes);
/// Same, as a vector; empty when num_heads <= 0.
std::vector<float> alibi_slopes(int num_heads);

// ---- block-sparse masks ----------------------------------------------------------------------

/// The problem a block-sparse mask is built for.
struct BlockSparseShape {
  int seqlen_q = 0;   ///< query rows (>= 0)
  int seqlen_k = 0;   ///< key columns (>= 0)
  int block_m = 0;    ///< query rows per block (> 0); the last block may be ragged
  int block_n = 0;    ///< key columns per block (> 0); the last block may be ragged
  int num_batch = 1;  ///< 1: one mask for every sequence; or batch: one per sequence
  int num_heads = 1;  ///< 1: one mask for every head; or heads_q: one per head
};

struct BlockSparseOptions {
  /// Store each distinct element mask once: partial blocks with identical bits (e.g. the
  /// diagonal blocks of a causal mask) share one entry of element_masks. Off: one per block.
  bool share_identical_partials = true;
};

/// true when key j is visible to query i, for mask batch b in [0, num_batch) and mask head h in
/// [0, num_heads). Called for every (b, h, i, j) of the shape, so it should be cheap and pure.
using MaskFn = std::function<bool(int b, int h, int i, int j)>;
/// A mask shared by every batch and head: true when key j is visible to query i.
using PairMaskFn = std::function<bool(int i, int j)>;

/// A block-sparse mask that owns its arrays, with a BlockSparseMask view pointing into them.
/// The view stays valid while the object lives (copies and moves re-point it at their own
/// arrays). Empty arrays are never null in the view, except element_masks when num_partial is 0
/// (which validate() accepts), so a mask with no listed block passes validate() as well.
class BlockMask {
 public:
  BlockMask() { rebind(); }
  BlockMask(const BlockMask& o);
  BlockMask(BlockMask&& o) noexcept;
  BlockMask& operator=(const BlockMask& o);
  BlockMask& operator=(BlockMask&& o) noexcept;
  ~BlockMask() = default;

  /// The CSR view (host pointers into this object).
  const BlockSparseMask& view() const noexcept { return view_; }
  /// For MaskParams::block_sparse.
  const BlockSparseMask* get() const noexcept { return &view_; }

  int seqlen_q() const noexcept { return seqlen_q_; }
  int seqlen_k() const noexcept { return seqlen_k_; }
  /// [num_batch * num_heads * num_q_blocks + 1]
  std::span<const std::int32_t> row_ptr() const noexcept { return row_ptr_; }
  /// [num_blocks()] key-block index, ascending within a row
  std::span<const std::int32_t> col_idx() const noexcept { return col_idx_; }
  /// [num_blocks()] -1 = full block, p >= 0 = element mask p
  std::span<const std::int32_t> partial() const noexcept { return partial_; }
  /// [num_partial][block_m][ceil(block_n / 64)] bits; bits of rows/columns past the sequence
  /// ends are 0
  std::span<const std::uint64_t> element_masks() const noexcept { return element_masks_; }

  /// Rows of the CSR: num_batch * num_heads * num_q_blocks.
  std::int64_t num_rows() const noexcept { return static_cast<std::int64_t>(row_ptr_.size()) - 1; }
  /// Listed (visited) blocks, over all rows: the kernels' work.
  std::int64_t num_blocks() const noexcept { return static_cast<std::int64_t>(col_idx_.size()); }
  /// Listed blocks that need no element mask.
  std::int64_t num_full_blocks() const noexcept { return num_full_; }
  /// Listed blocks that apply element bits (>= view().num_partial when bits are shared).
  std::int64_t num_partial_blocks() const noexcept { return num_blocks() - num_full_; }
  /// Visible (query, key) pairs over all rows: the FLOP count of the masked problem, per
  /// (num_batch, num_heads) mask (multiply by batch/num_batch * heads/num_heads for the problem).
  std::int64_t visible_pairs() const noexcept { return visible_pairs_; }
  /// Listed blocks / (num_rows * num_k_blocks); 0 for an empty grid.
  double block_density() const noexcept;

 private:
  friend struct BlockMaskBuilder;  // masks.cc fills the arrays
  void rebind() noexcept;

  int seqlen_q_ = 0, seqlen_k_ = 0;
  std::vector<std::int32_t> row_ptr_{0};
  std::vector<std::int32_t> col_idx_, partial_;
  std::vector<std::uint64_t> element_masks_;
  std::int64_t num_full_ = 0;
  std::int64_t visible_pairs_ = 0;
  BlockSparseMask view_;
};

/// Builds the block-sparse form of `fn` over `shape`: every (b, h, i, j) is evaluated once
/// (num_batch * num_heads * seqlen_q * seqlen_k calls), blocks with no visible pair are dropped,
/// blocks whose in-range pairs are all visible are listed as full, the rest as partial with
/// element bits. The result expands back to exactly `fn`. On error *out is left unchanged.
/// Errors (kInvalidArgument): negative lengths, block sizes <= 0, num_batch/num_heads < 1,
/// more than 2^31-1 listed blocks or element masks.
Status build_block_sparse(const BlockSparseShape& shape, const MaskFn& fn, BlockMask* out,
                          const BlockSparseOptions& opt = {});
/// Same, for a mask shared by every batch and head: shape.num_batch and num_heads must be 1.
Status build_block_sparse(const BlockSparseShape& shape, const PairMaskFn& fn, BlockMask* out,
                          const BlockSparseOptions& opt = {});
/// From a dense mask: `dense` holds num_batch * num_heads * seqlen_q * seqlen_k bytes, C order
/// (b, h, i, j), nonzero = visible (a numpy/torch bool array's memory as it is).
Status build_block_sparse_from_dense(const BlockSparseShape& shape, const std::uint8_t* dense,
                                     BlockMask* out, const BlockSparseOptions& opt = {});

// ---- the common masks as block-sparse --------------------------------------------------------
// Each gives exactly the visibility of the corresponding MaskParams fields (attention.h), so a
// kernel can run the same mask by either route and the two outputs must agree. These builders
// classify most blocks from the window bounds and evaluate elements only in blocks that straddle
// a boundary, so they cost O(listed blocks) plus O(block_m * block_n) per boundary block, not
// O(seqlen_q * seqlen_k). The mask is the same for every batch and head; shape.num_batch /
// num_heads > 1 repeat it (useful to exercise per-head indexing).

/// The visibility fields of `rules` (causal, window_left, window_right, global_tokens,
/// global_queries; bottom-right alignment) as a block-sparse mask. softcap and alibi_slopes are
/// score modifiers, not visibility, and are ignored; varlen (cu_seqlens) or block_sparse set in
/// `rules` is an error (use document_block_mask for packed sequences).
Status block_mask_from_rules(const BlockSparseShape& shape, const MaskParams& rules, BlockMask* out,
                             const BlockSparseOptions& opt = {});
/// Causal, bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q.
Status causal_block_mask(const BlockSparseShape& shape, BlockMask* out, const BlockSparseOptions& opt = {});
/// Sliding window: keys in [ia - window_left, ia + window_right] (-1 = unbounded on that side),
/// optionally also causal; ia = i + seqlen_k - seqlen_q.
Status sliding_window_block_mask(const BlockSparseShape& shape, int window_left, int window_right,
                                 bool causal, BlockMask* out, const BlockSparseOptions& opt = {});
/// Sliding window plus global tokens: the first `global_tokens` keys are exempt from
/// window_left (attention sinks); with global_queries the query rows with ia < global_tokens are
/// exempt from both window bounds.
Status window_global_block_mask(const BlockSparseShape& shape, int window_left, int window_right,
                                bool causal, int global_tokens, bool global_queries, BlockMask* out,
                                const BlockSparseOptions& opt = {});
/// Document (packed varlen) mask over one packed problem of cu_seqlens_q.back() queries and
/// cu_seqlens_k.back() keys: query i of document d sees key j only when j is in document d too,
/// and then by `within` (causal / window / global tokens, aligned per document as varlen is:
/// local ia = i_local + len_k(d) - len_q(d)). Attention over the packed tensors with this mask
/// and no other mask equals flash_attn_varlen over the same cu_seqlens. Both arrays: batch + 1
/// non-decreasing prefix sums starting at 0. shape.seqlen_q / seqlen_k are ignored (taken from
/// the arrays); block sizes, num_batch and num_heads are used.
Status document_block_mask(const BlockSparseShape& shape, std::span<const std::int32_t> cu_seqlens_q,
                           std::span<const std::int32_t> cu_seqlens_k, const MaskParams& within,
                           BlockMask* out, const BlockSparseOptions& opt = {});

/// Looks up one pair in a host BlockSparseMask (binary search in the row): true when key j is
/// visible to query i of batch b and head h (b and h are folded to 0 where the mask
/// broadcasts). For tests and debugging of GPU work; kernels walk the rows instead.
bool block_sparse_visible(const BlockSparseMask& m, int b, int h, int i, int j);

}  // namespace flashcpp
