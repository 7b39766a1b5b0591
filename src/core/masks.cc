// Host mask builders (include/flashcpp/masks.h): ALiBi slopes and block-sparse masks.
//
// Every block-sparse builder is one loop, BlockMaskBuilder::build, parameterized by two
// callables:
//   classify(b, h, i0, i1, j0, j1) -> kEmpty | kFull | kEvaluate   a cheap verdict on a block,
//   visible(b, h, i, j) -> bool                                     the per-pair rule.
// A block judged kEvaluate has every in-range pair evaluated; its verdict then comes from the
// count of visible pairs (0: dropped, all: full, else partial with bits). So a classify that
// answers kEvaluate everywhere (mask functions, dense masks) is always exact, and the pattern
// builders (causal, window, document) only answer kEmpty/kFull where the window arithmetic of
// src/common/mask_rules.h proves it: the very rules the tiled CPU backend and the CUDA kernels
// use to skip and to leave unmasked whole tiles.
//
// Cost: classify once per (row, key block), plus block_m * block_n visible() calls per block
// that is evaluated; memory is the output plus one block of bits.
#include "flashcpp/masks.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/mask_rules.h"

namespace flashcpp {
namespace {

constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
/// What an empty int32 array of the view points at: validate() wants non-null row arrays.
alignas(8) constexpr std::int32_t kNoEntries[2] = {0, 0};

enum class BlockKind { kEmpty, kFull, kEvaluate };

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

std::string shape_error(const BlockSparseShape& s) {
  if (s.seqlen_q < 0 || s.seqlen_k < 0)
    return "block-sparse shape: seqlen_q " + std::to_string(s.seqlen_q) + " and seqlen_k " +
           std::to_string(s.seqlen_k) + " must be >= 0";
  if (s.block_m <= 0 || s.block_n <= 0)
    return "block-sparse shape: block_m " + std::to_string(s.block_m) + " and block_n " +
           std::to_string(s.block_n) + " must be > 0";
  if (s.num_batch < 1 || s.num_heads < 1)
    return "block-sparse shape: num_batch " + std::to_string(s.num_batch) + " and num_heads " +
           std::to_string(s.num_heads) + " must be >= 1 (1 = shared by every batch / head)";
  return {};
}

/// The block classification of the causal/window/global rules of one (sub)sequence, in its
/// local coordinates: empty when no row of [i0, i1) reaches [j0, j1) through its window or the
/// sinks (MaskRules::key_range / sink_hi, as the kernels skip tiles), full when
/// MaskRules::tile_fully_visible proves it (conservative: may say kEvaluate for a full block).
BlockKind classify_by_rules(const MaskRules& r, int i0, int i1, int j0, int j1) {
  int lo = 0, hi = 0;
  r.key_range(i0, i1, &lo, &hi);
  const bool in_window = j0 < hi && j1 > lo;
  const bool in_sinks = j0 < r.sink_hi(i0, i1, lo);
  if (!in_window && !in_sinks) return BlockKind::kEmpty;
  if (r.tile_fully_visible(i0, i1, j0, j1)) return BlockKind::kFull;
  return BlockKind::kEvaluate;
}

Status check_rules(const MaskParams& m, const char* who) {
  if (m.is_varlen() || m.block_sparse)
    return Status::Invalid(std::string(who) +
                           ": the rules may not set cu_seqlens or block_sparse (only causal, window_left, "
                           "window_right, global_tokens, global_queries are read)");
  if (m.window_left < -1 || m.window_right < -1)
    return Status::Invalid(std::string(who) + ": window_left " + std::to_string(m.window_left) +
                           " and window_right " + std::to_string(m.window_right) +
                           " must be >= -1 (-1 = unbounded)");
  if (m.global_tokens < 0)
    return Status::Invalid(std::string(who) + ": global_tokens " + std::to_string(m.global_tokens) +
                           " must be >= 0");
  return Status::Ok();
}

MaskRules rules_for(const MaskParams& m, int seqlen_q, int seqlen_k) {
  return MaskRules::make(seqlen_q, seqlen_k, m.causal, m.window_left, m.window_right, m.global_tokens,
                         m.global_queries);
}

}  // namespace

// ---- ALiBi ---------------------------------------------------------------------------------

Status alibi_slopes(int num_heads, float* slopes) {
  if (num_heads <= 0)
    return Status::Invalid("alibi_slopes: num_heads " + std::to_string(num_heads) + " must be > 0");
  if (!slopes) return Status::Invalid("alibi_slopes: the output pointer is null");
  // n: the largest power of two <= num_heads. Its heads take 2^(-8/n)^(h+1); the remaining
  // num_heads - n (< n) heads take the odd-numbered slopes of the 2n-head sequence.
  const int n = static_cast<int>(std::bit_floor(static_cast<unsigned>(num_heads)));
  for (int h = 0; h < n; ++h) slopes[h] = static_cast<float>(std::exp2(-8.0 * (h + 1) / n));
  for (int k = 0; n + k < num_heads; ++k)
    slopes[n + k] = static_cast<float>(std::exp2(-8.0 * (2 * k + 1) / (2.0 * n)));
  return Status::Ok();
}

std::vector<float> alibi_slopes(int num_heads) {
  if (num_heads <= 0) return {};
  std::vector<float> s(static_cast<std::size_t>(num_heads));
  (void)alibi_slopes(num_heads, s.data());  // cannot fail: num_heads > 0, non-null output
  return s;
}

// ---- BlockMask -------------------------------------------------------------------------------

BlockMask::BlockMask(const BlockMask& o)
    : seqlen_q_(o.seqlen_q_),
      seqlen_k_(o.seqlen_k_),
      row_ptr_(o.row_ptr_),
      col_idx_(o.col_idx_),
      partial_(o.partial_),
      element_masks_(o.element_masks_),
      num_full_(o.num_full_),
      visible_pairs_(o.visible_pairs_),
      view_(o.view_) {
  rebind();
}

BlockMask::BlockMask(BlockMask&& o) noexcept
    : seqlen_q_(o.seqlen_q_),
      seqlen_k_(o.seqlen_k_),
      row_ptr_(std::move(o.row_ptr_)),
      col_idx_(std::move(o.col_idx_)),
      partial_(std::move(o.partial_)),
      element_masks_(std::move(o.element_masks_)),
      num_full_(o.num_full_),
      visible_pairs_(o.visible_pairs_),
      view_(o.view_) {
  rebind();
  o.view_ = BlockSparseMask{};
  o.rebind();
}

BlockMask& BlockMask::operator=(const BlockMask& o) {
  if (this != &o) {
    BlockMask copy(o);
    *this = std::move(copy);
  }
  return *this;
}

BlockMask& BlockMask::operator=(BlockMask&& o) noexcept {
  if (this != &o) {
    seqlen_q_ = o.seqlen_q_;
    seqlen_k_ = o.seqlen_k_;
    row_ptr_ = std::move(o.row_ptr_);
    col_idx_ = std::move(o.col_idx_);
    partial_ = std::move(o.partial_);
    element_masks_ = std::move(o.element_masks_);
    num_full_ = o.num_full_;
    visible_pairs_ = o.visible_pairs_;
    view_ = o.view_;
    rebind();
    o.view_ = BlockSparseMask{};
    o.rebind();
  }
  return *this;
}

void BlockMask::rebind() noexcept {
  // A moved-from object has an empty row_ptr_; it then reads as a mask with no rows.
  view_.row_ptr = row_ptr_.empty() ? kNoEntries : row_ptr_.data();
  view_.col_idx = col_idx_.empty() ? kNoEntries : col_idx_.data();
  view_.partial = partial_.empty() ? kNoEntries : partial_.data();
  view_.element_masks = element_masks_.empty() ? nullptr : element_masks_.data();
}

double BlockMask::block_density() const noexcept {
  const double grid = static_cast<double>(std::max<std::int64_t>(num_rows(), 0)) * view_.num_k_blocks;
  return grid > 0 ? static_cast<double>(num_blocks()) / grid : 0.0;
}

// ---- the one builder loop --------------------------------------------------------------------

struct BlockMaskBuilder {
  template <class Classify, class Visible>
  static Status build(const BlockSparseShape& s, const BlockSparseOptions& opt, Classify&& classify,
                      Visible&& visible, BlockMask* out) {
    if (!out) return Status::Invalid("block-sparse builder: the output BlockMask pointer is null");
    if (std::string err = shape_error(s); !err.empty()) return Status::Invalid(err);
    const std::int64_t nqb = ceil_div(s.seqlen_q, s.block_m), nkb = ceil_div(s.seqlen_k, s.block_n);
    const std::int64_t rows = static_cast<std::int64_t>(s.num_batch) * s.num_heads * nqb;
    if (rows > kInt32Max)
      return Status::Invalid("block-sparse mask has " + std::to_string(rows) +
                             " rows (num_batch * num_heads * num_q_blocks), more than 2^31-1");
    const int words = (s.block_n + 63) / 64;
    const std::size_t mask_words = static_cast<std::size_t>(s.block_m) * words;

    BlockMask m;
    m.seqlen_q_ = s.seqlen_q;
    m.seqlen_k_ = s.seqlen_k;
    m.row_ptr_.reserve(static_cast<std::size_t>(rows) + 1);
    std::vector<std::uint64_t> bits(mask_words);
    // Distinct element masks by content (only when sharing): hash -> indices with that hash.
    std::unordered_multimap<std::size_t, std::int32_t> by_hash;
    const auto mask_at = [&](std::int32_t p) { return m.element_masks_.data() + p * mask_words; };

    for (int b = 0; b < s.num_batch; ++b) {
      for (int h = 0; h < s.num_heads; ++h) {
        for (std::int64_t qb = 0; qb < nqb; ++qb) {
          const int i0 = static_cast<int>(qb * s.block_m);
          const int i1 = static_cast<int>(std::min<std::int64_t>(i0 + std::int64_t{s.block_m}, s.seqlen_q));
          for (std::int64_t kb = 0; kb < nkb; ++kb) {
            const int j0 = static_cast<int>(kb * s.block_n);
            const int j1 = static_cast<int>(std::min<std::int64_t>(j0 + std::int64_t{s.block_n}, s.seqlen_k));
            const std::int64_t in_range = static_cast<std::int64_t>(i1 - i0) * (j1 - j0);
            const BlockKind kind = classify(b, h, i0, i1, j0, j1);
            if (kind == BlockKind::kEmpty) continue;
            std::int64_t count = in_range;
            if (kind == BlockKind::kEvaluate) {
              std::fill(bits.begin(), bits.end(), 0);
              count = 0;
              for (int i = i0; i < i1; ++i) {
                std::uint64_t* row = &bits[static_cast<std::size_t>(i - i0) * words];
                for (int j = j0; j < j1; ++j) {
                  if (!visible(b, h, i, j)) continue;
                  const int c = j - j0;
                  row[c / 64] |= std::uint64_t{1} << (c % 64);
                  ++count;
                }
              }
              if (count == 0) continue;
            }
            if (static_cast<std::int64_t>(m.col_idx_.size()) >= kInt32Max)
              return Status::Invalid("block-sparse mask lists more than 2^31-1 blocks (row_ptr is int32)");
            m.col_idx_.push_back(static_cast<std::int32_t>(kb));
            m.visible_pairs_ += count;
            if (count == in_range) {
              m.partial_.push_back(-1);
              ++m.num_full_;
              continue;
            }
            m.partial_.push_back(store_bits(m, bits, opt.share_identical_partials, by_hash, mask_at));
            if (m.partial_.back() < 0)
              return Status::Invalid("block-sparse mask needs more than 2^31-1 element masks");
          }
          m.row_ptr_.push_back(static_cast<std::int32_t>(m.col_idx_.size()));
        }
      }
    }
    m.view_.block_m = s.block_m;
    m.view_.block_n = s.block_n;
    m.view_.num_batch = s.num_batch;
    m.view_.num_heads = s.num_heads;
    m.view_.num_q_blocks = static_cast<int>(nqb);
    m.view_.num_k_blocks = static_cast<int>(nkb);
    m.view_.num_partial = static_cast<std::int64_t>(m.element_masks_.size() / mask_words);
    m.rebind();
    *out = std::move(m);
    return Status::Ok();
  }

 private:
  /// Appends `bits` as a new element mask, or finds an identical stored one when sharing.
  /// Returns its index, or -1 when the count would pass int32.
  template <class MaskAt>
  static std::int32_t store_bits(BlockMask& m, const std::vector<std::uint64_t>& bits, bool share,
                                 std::unordered_multimap<std::size_t, std::int32_t>& by_hash,
                                 const MaskAt& mask_at) {
    const std::size_t n = bits.size();
    std::size_t key = 0;
    if (share) {
      key = std::hash<std::string_view>{}(
          std::string_view(reinterpret_cast<const char*>(bits.data()), n * sizeof(std::uint64_t)));
      for (auto [it, end] = by_hash.equal_range(key); it != end; ++it)
        if (std::equal(bits.begin(), bits.end(), mask_at(it->second))) return it->second;
    }
    const std::int64_t index = static_cast<std::int64_t>(m.element_masks_.size() / n);
    if (index >= kInt32Max) return -1;
    m.element_masks_.insert(m.element_masks_.end(), bits.begin(), bits.end());
    if (share) by_hash.emplace(key, static_cast<std::int32_t>(index));
    return static_cast<std::int32_t>(index);
  }
};

namespace {
constexpr auto kAlwaysEvaluate = [](int, int, int, int, int, int) { return BlockKind::kEvaluate; };
}  // namespace

Status build_block_sparse(const BlockSparseShape& shape, const MaskFn& fn, BlockMask* out,
                          const BlockSparseOptions& opt) {
  if (!fn) return Status::Invalid("build_block_sparse: the mask function is empty");
  return BlockMaskBuilder::build(shape, opt, kAlwaysEvaluate, fn, out);
}

Status build_block_sparse(const BlockSparseShape& shape, const PairMaskFn& fn, BlockMask* out,
                          const BlockSparseOptions& opt) {
  if (!fn) return Status::Invalid("build_block_sparse: the mask function is empty");
  if (shape.num_batch != 1 || shape.num_heads != 1)
    return Status::Invalid("build_block_sparse: a per-(i, j) mask function is shared by every batch and "
                           "head, so shape.num_batch (" + std::to_string(shape.num_batch) +
                           ") and num_heads (" + std::to_string(shape.num_heads) +
                           ") must be 1; pass a (b, h, i, j) function for per-batch/head masks");
  return BlockMaskBuilder::build(shape, opt, kAlwaysEvaluate,
                                 [&](int, int, int i, int j) { return fn(i, j); }, out);
}

Status build_block_sparse_from_dense(const BlockSparseShape& shape, const std::uint8_t* dense,
                                     BlockMask* out, const BlockSparseOptions& opt) {
  if (std::string err = shape_error(shape); !err.empty()) return Status::Invalid(err);
  const bool empty = shape.seqlen_q == 0 || shape.seqlen_k == 0;
  if (!dense && !empty) return Status::Invalid("build_block_sparse_from_dense: the dense mask is null");
  const std::int64_t nq = shape.seqlen_q, nk = shape.seqlen_k;
  return BlockMaskBuilder::build(
      shape, opt, kAlwaysEvaluate,
      [&](int b, int h, int i, int j) {
        const std::int64_t plane = static_cast<std::int64_t>(b) * shape.num_heads + h;
        return dense[(plane * nq + i) * nk + j] != 0;
      },
      out);
}

// ---- the common masks ------------------------------------------------------------------------

Status block_mask_from_rules(const BlockSparseShape& shape, const MaskParams& rules, BlockMask* out,
                             const BlockSparseOptions& opt) {
  FLASHCPP_RETURN_IF_ERROR(check_rules(rules, "block_mask_from_rules"));
  if (std::string err = shape_error(shape); !err.empty()) return Status::Invalid(err);
  const MaskRules r = rules_for(rules, shape.seqlen_q, shape.seqlen_k);
  return BlockMaskBuilder::build(
      shape, opt,
      [&](int, int, int i0, int i1, int j0, int j1) { return classify_by_rules(r, i0, i1, j0, j1); },
      [&](int, int, int i, int j) { return r.visible(i, j); }, out);
}

Status causal_block_mask(const BlockSparseShape& shape, BlockMask* out, const BlockSparseOptions& opt) {
  MaskParams m;
  m.causal = true;
  return block_mask_from_rules(shape, m, out, opt);
}

Status sliding_window_block_mask(const BlockSparseShape& shape, int window_left, int window_right,
                                 bool causal, BlockMask* out, const BlockSparseOptions& opt) {
  return window_global_block_mask(shape, window_left, window_right, causal, 0, false, out, opt);
}

Status window_global_block_mask(const BlockSparseShape& shape, int window_left, int window_right,
                                bool causal, int global_tokens, bool global_queries, BlockMask* out,
                                const BlockSparseOptions& opt) {
  MaskParams m;
  m.causal = causal;
  m.window_left = window_left;
  m.window_right = window_right;
  m.global_tokens = global_tokens;
  m.global_queries = global_queries;
  return block_mask_from_rules(shape, m, out, opt);
}

Status document_block_mask(const BlockSparseShape& shape, std::span<const std::int32_t> cu_q,
                           std::span<const std::int32_t> cu_k, const MaskParams& within, BlockMask* out,
                           const BlockSparseOptions& opt) {
  FLASHCPP_RETURN_IF_ERROR(check_rules(within, "document_block_mask"));
  if (cu_q.empty() || cu_q.size() != cu_k.size())
    return Status::Invalid("document_block_mask: cu_seqlens_q and cu_seqlens_k must both hold batch + 1 >= 1 "
                           "entries (got " + std::to_string(cu_q.size()) + " and " +
                           std::to_string(cu_k.size()) + ")");
  for (auto [cu, name] : {std::pair{cu_q, "cu_seqlens_q"}, std::pair{cu_k, "cu_seqlens_k"}}) {
    if (cu[0] != 0)
      return Status::Invalid(std::string("document_block_mask: ") + name + "[0] is " + std::to_string(cu[0]) +
                             " (must be 0)");
    for (std::size_t d = 1; d < cu.size(); ++d)
      if (cu[d] < cu[d - 1])
        return Status::Invalid(std::string("document_block_mask: ") + name + "[" + std::to_string(d) + "] " +
                               std::to_string(cu[d]) + " is less than " + name + "[" +
                               std::to_string(d - 1) + "] " + std::to_string(cu[d - 1]) +
                               " (must be non-decreasing)");
  }
  BlockSparseShape s = shape;
  s.seqlen_q = cu_q.back();
  s.seqlen_k = cu_k.back();
  if (std::string err = shape_error(s); !err.empty()) return Status::Invalid(err);
  const int docs = static_cast<int>(cu_q.size()) - 1;
  std::vector<MaskRules> rules(static_cast<std::size_t>(docs));
  for (int d = 0; d < docs; ++d) rules[d] = rules_for(within, cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]);
  // Document of a token: the last d with cu[d] <= t (skips empty documents). t < cu.back().
  auto doc_of = [docs](std::span<const std::int32_t> cu, int t) {
    const auto it = std::upper_bound(cu.begin(), cu.begin() + docs, t);
    return static_cast<int>(it - cu.begin()) - 1;
  };
  auto classify = [&](int, int, int i0, int i1, int j0, int j1) {
    const int dq0 = doc_of(cu_q, i0), dq1 = doc_of(cu_q, i1 - 1);
    const int dk0 = doc_of(cu_k, j0), dk1 = doc_of(cu_k, j1 - 1);
    if (dq1 < dk0 || dk1 < dq0) return BlockKind::kEmpty;  // no document in common
    if (dq0 == dq1 && dk0 == dk1 && dq0 == dk0)            // inside one document: its rules
      return classify_by_rules(rules[dq0], i0 - cu_q[dq0], i1 - cu_q[dq0], j0 - cu_k[dq0], j1 - cu_k[dq0]);
    return BlockKind::kEvaluate;
  };
  auto visible = [&](int, int, int i, int j) {
    const int d = doc_of(cu_q, i);
    return d == doc_of(cu_k, j) && rules[d].visible(i - cu_q[d], j - cu_k[d]);
  };
  return BlockMaskBuilder::build(s, opt, classify, visible, out);
}

bool block_sparse_visible(const BlockSparseMask& m, int b, int h, int i, int j) {
  if (m.block_m <= 0 || m.block_n <= 0 || i < 0 || j < 0 || !m.row_ptr) return false;
  const int qb = i / m.block_m, kb = j / m.block_n;
  if (qb >= m.num_q_blocks || kb >= m.num_k_blocks) return false;
  const std::int64_t row = (static_cast<std::int64_t>(m.num_batch == 1 ? 0 : b) * m.num_heads +
                            (m.num_heads == 1 ? 0 : h)) * m.num_q_blocks + qb;
  const std::int32_t* first = m.col_idx + m.row_ptr[row];
  const std::int32_t* last = m.col_idx + m.row_ptr[row + 1];
  const std::int32_t* it = std::lower_bound(first, last, kb);
  if (it == last || *it != kb) return false;
  const std::int32_t p = m.partial[it - m.col_idx];
  if (p < 0) return true;
  const int words = (m.block_n + 63) / 64, r = i % m.block_m, c = j % m.block_n;
  const std::uint64_t w = m.element_masks[(static_cast<std::int64_t>(p) * m.block_m + r) * words + c / 64];
  return ((w >> (c % 64)) & 1u) != 0;
}

}  // namespace flashcpp
