// Host mask builders (src/core/masks.cc): ALiBi slopes and block-sparse masks.
//
// Slopes are checked against BLOOM's formula written out again here. Every built block-sparse
// mask is expanded back to a dense mask by a loop over the CSR arrays written here (not the
// library's lookup), compared with the mask function at every (b, h, i, j), and checked for the
// builder's promises: no listed block is empty, full blocks are entirely visible, partial blocks
// are neither, bits past the sequence ends are 0, columns ascend, validate() accepts it. The
// pattern builders (causal, window, global, document) are compared with predicates written here
// from the rules of attention.h. Then attention: the fp64 reference with a built mask equals the
// reference with the equivalent MaskParams flags (or varlen calls, for documents) exactly, since
// the same keys get the same scores in the same order; and the tiled backend with a built mask
// matches the reference within the 1e-6 fp32 bar of test_tiled.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "flashcpp/masks.h"
#include "test_util.h"

namespace flashcpp {
namespace {

using testing::HostBuffer;

// ---- ALiBi -----------------------------------------------------------------------------------

/// BLOOM's build_alibi_tensor, step by step: base^power for the closest power of two, then the
/// odd powers of the base of twice that many heads.
std::vector<double> bloom_slopes(int n) {
  const int closest = static_cast<int>(std::pow(2.0, std::floor(std::log2(static_cast<double>(n)))));
  const double base = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(closest)) - 3)));
  std::vector<double> s;
  for (int power = 1; power <= closest; ++power) s.push_back(std::pow(base, power));
  if (closest != n) {
    const double extra_base = std::pow(2.0, -std::pow(2.0, -(std::log2(2.0 * closest) - 3)));
    const int remaining = std::min(closest, n - closest);
    for (int power = 1; power < 1 + 2 * remaining; power += 2) s.push_back(std::pow(extra_base, power));
  }
  return s;
}

TEST(Alibi, SlopesMatchBloomFormula) {
  for (int n : {8, 12, 16, 20, 32, 40, 64}) {
    SCOPED_TRACE("heads " + std::to_string(n));
    const std::vector<float> got = alibi_slopes(n);
    const std::vector<double> want = bloom_slopes(n);
    ASSERT_EQ(got.size(), want.size());
    for (int h = 0; h < n; ++h)  // fp32 rounding (2^-24) plus pow's few-ulp double error
      EXPECT_NEAR(got[h], want[h], want[h] * 1e-7) << "head " << h;
  }
}

TEST(Alibi, SlopesForEveryHeadCountUpTo128) {
  for (int n = 1; n <= 128; ++n) {
    const std::vector<float> got = alibi_slopes(n);
    const std::vector<double> want = bloom_slopes(n);
    ASSERT_EQ(got.size(), want.size()) << n;
    for (int h = 0; h < n; ++h) ASSERT_NEAR(got[h], want[h], want[h] * 1e-7) << n << " heads, head " << h;
  }
}

TEST(Alibi, KnownValues) {
  // 8 heads: 1/2, 1/4, ..., 1/256, exactly.
  const std::vector<float> s8 = alibi_slopes(8);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(s8[h], std::ldexp(1.f, -(h + 1)));
  // 12 heads: the 8 above, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd slopes of the 16 sequence).
  const std::vector<float> s12 = alibi_slopes(12);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(s12[h], s8[h]);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(s12[8 + k], static_cast<float>(std::pow(2.0, -0.5 - k)));
  // 1 head: 2^-8.
  EXPECT_EQ(alibi_slopes(1), std::vector<float>{1.f / 256});
}

TEST(Alibi, PointerOverloadAndErrors) {
  std::vector<float> out(20, NAN);
  ASSERT_TRUE(alibi_slopes(20, out.data()).ok());
  EXPECT_EQ(out, alibi_slopes(20));
  EXPECT_FALSE(alibi_slopes(0, out.data()).ok());
  EXPECT_FALSE(alibi_slopes(-3, out.data()).ok());
  EXPECT_FALSE(alibi_slopes(4, nullptr).ok());
  EXPECT_TRUE(alibi_slopes(0).empty());
}

// ---- block-sparse: expansion and invariants ---------------------------------------------------

using Fn4 = std::function<bool(int, int, int, int)>;

/// Dense (num_batch, num_heads, seqlen_q, seqlen_k) expansion of a built mask, straight from the
/// CSR arrays, with the builder's invariants checked on the way.
std::vector<char> expand_and_check(const BlockMask& bm) {
  const BlockSparseMask& v = bm.view();
  const int nq = bm.seqlen_q(), nk = bm.seqlen_k();
  const int words = (v.block_n + 63) / 64;
  EXPECT_EQ(v.num_q_blocks, (nq + v.block_m - 1) / v.block_m);
  EXPECT_EQ(v.num_k_blocks, (nk + v.block_n - 1) / v.block_n);
  const std::int64_t rows = std::int64_t{v.num_batch} * v.num_heads * v.num_q_blocks;
  EXPECT_EQ(bm.num_rows(), rows);
  EXPECT_EQ(v.row_ptr[0], 0);
  EXPECT_EQ(v.row_ptr[rows], bm.num_blocks());
  EXPECT_EQ(static_cast<std::int64_t>(bm.element_masks().size()),
            v.num_partial * v.block_m * words);
  std::vector<char> dense(static_cast<std::size_t>(v.num_batch) * v.num_heads * nq * nk, 0);
  std::int64_t full = 0, pairs = 0;
  for (int b = 0; b < v.num_batch; ++b)
    for (int h = 0; h < v.num_heads; ++h)
      for (int qb = 0; qb < v.num_q_blocks; ++qb) {
        const std::int64_t r = (std::int64_t{b} * v.num_heads + h) * v.num_q_blocks + qb;
        for (std::int32_t e = v.row_ptr[r]; e < v.row_ptr[r + 1]; ++e) {
          const int kb = v.col_idx[e];
          EXPECT_TRUE(kb >= 0 && kb < v.num_k_blocks);
          if (e > v.row_ptr[r]) EXPECT_GT(kb, v.col_idx[e - 1]);
          const std::int32_t p = v.partial[e];
          EXPECT_TRUE(p >= -1 && p < v.num_partial);
          if (p < 0) ++full;
          std::int64_t seen = 0, in_range = 0;
          for (int rr = 0; rr < v.block_m; ++rr)
            for (int c = 0; c < v.block_n; ++c) {
              const int i = qb * v.block_m + rr, j = kb * v.block_n + c;
              bool vis = true;
              if (p >= 0) {
                const std::uint64_t w =
                    v.element_masks[(static_cast<std::int64_t>(p) * v.block_m + rr) * words + c / 64];
                vis = (w >> (c % 64)) & 1u;
              }
              if (i >= nq || j >= nk) {
                EXPECT_FALSE(p >= 0 && vis) << "bit set past the sequence end";
                continue;
              }
              ++in_range;
              if (!vis) continue;
              ++seen;
              dense[((static_cast<std::size_t>(b) * v.num_heads + h) * nq + i) * nk + j] = 1;
            }
          EXPECT_GT(seen, 0) << "listed block with no visible pair";
          if (p >= 0) EXPECT_LT(seen, in_range) << "partial block that is in fact full";
          pairs += seen;
        }
      }
  EXPECT_EQ(bm.num_full_blocks(), full);
  EXPECT_EQ(bm.visible_pairs(), pairs);
  return dense;
}

/// Expands `bm` and compares with fn at every (b, h, i, j); also checks the library lookup.
void expect_round_trip(const BlockMask& bm, const Fn4& fn, const std::string& what) {
  SCOPED_TRACE(what);
  const BlockSparseMask& v = bm.view();
  const std::vector<char> dense = expand_and_check(bm);
  const int nq = bm.seqlen_q(), nk = bm.seqlen_k();
  int mismatches = 0;
  for (int b = 0; b < v.num_batch; ++b)
    for (int h = 0; h < v.num_heads; ++h)
      for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j) {
          const bool want = fn(b, h, i, j);
          const bool got = dense[((static_cast<std::size_t>(b) * v.num_heads + h) * nq + i) * nk + j];
          if (got != want || block_sparse_visible(v, b, h, i, j) != want) {
            if (++mismatches <= 5)
              ADD_FAILURE() << "(b " << b << ", h " << h << ", i " << i << ", j " << j << "): mask "
                            << want << ", expanded " << got;
          }
        }
  EXPECT_EQ(mismatches, 0);
}

/// validate() of an attention problem of this mask's shape with it attached. q/k/v/o are fake
/// addresses, 256 MiB apart: validate() never reads them.
Status validate_with(const BlockMask& bm, int batch, int heads) {
  const auto fake = [](std::uintptr_t a) { return reinterpret_cast<void*>(a); };
  AttnParams p;
  p.batch = batch;
  p.seqlen_q = bm.seqlen_q();
  p.seqlen_k = bm.seqlen_k();
  p.heads_q = p.heads_kv = heads;
  p.head_dim = 64;
  p.q = bshd_view(fake(0x10000000), DType::kF32, p.seqlen_q, heads, 64);
  p.k = bshd_view(fake(0x20000000), DType::kF32, p.seqlen_k, heads, 64);
  p.v = bshd_view(fake(0x30000000), DType::kF32, p.seqlen_k, heads, 64);
  p.o = bshd_view(fake(0x40000000), DType::kF32, p.seqlen_q, heads, 64);
  p.mask.block_sparse = bm.get();
  return validate(p, Backend::kCpuReference);
}

struct Size {
  int nq, nk;
};
struct Blocks {
  int m, n;
};
const Size kSizes[] = {{1, 1}, {7, 5}, {64, 64}, {100, 130}, {129, 65}, {33, 200}};
const Blocks kBlocks[] = {{1, 1}, {7, 3}, {16, 16}, {64, 64}, {32, 100}, {128, 128}, {48, 130}};

std::string label(const Size& s, const Blocks& bl, const char* kind) {
  return std::string(kind) + " " + std::to_string(s.nq) + "x" + std::to_string(s.nk) + " blocks " +
         std::to_string(bl.m) + "x" + std::to_string(bl.n);
}

/// A random mask table with a block structure of its own (regions of 16 x 16 that are all
/// visible, all hidden, or random at density p), so builds see full, empty and partial blocks.
struct RandomMask {
  int nb, nh, nq, nk;
  std::vector<char> bits;
  RandomMask(int b, int h, int q, int k, double p, std::uint64_t salt) : nb(b), nh(h), nq(q), nk(k) {
    auto g = testing::rng(salt);
    std::uniform_real_distribution<double> u(0, 1);
    bits.resize(static_cast<std::size_t>(b) * h * q * k);
    const int rq = (q + 15) / 16, rk = (k + 15) / 16;
    std::vector<int> region(static_cast<std::size_t>(b) * h * rq * rk);
    for (int& r : region) r = u(g) < 0.3 ? 0 : u(g) < 0.5 ? 1 : 2;  // hidden / visible / random
    for (int bb = 0; bb < b; ++bb)
      for (int hh = 0; hh < h; ++hh)
        for (int i = 0; i < q; ++i)
          for (int j = 0; j < k; ++j) {
            const int r = region[((static_cast<std::size_t>(bb) * h + hh) * rq + i / 16) * rk + j / 16];
            at(bb, hh, i, j) = r == 1 || (r == 2 && u(g) < p);
          }
  }
  char& at(int b, int h, int i, int j) { return bits[((static_cast<std::size_t>(b) * nh + h) * nq + i) * nk + j]; }
  bool operator()(int b, int h, int i, int j) const {
    return bits[((static_cast<std::size_t>(b) * nh + h) * nq + i) * nk + j];
  }
};

TEST(BlockSparseBuild, RandomMasksRoundTrip) {
  std::uint64_t salt = 100;
  for (const Size& s : kSizes)
    for (const Blocks& bl : kBlocks)
      for (double p : {0.1, 0.5, 0.97}) {
        const RandomMask rm(2, 3, s.nq, s.nk, p, ++salt);
        BlockMask bm;
        const BlockSparseShape shape{s.nq, s.nk, bl.m, bl.n, 2, 3};
        ASSERT_TRUE(build_block_sparse(shape, Fn4(std::cref(rm)), &bm).ok());
        expect_round_trip(bm, std::cref(rm), label(s, bl, "random"));
        EXPECT_TRUE(validate_with(bm, 2, 3).ok()) << validate_with(bm, 2, 3).to_string();
        // The dense route builds the very same arrays.
        std::vector<std::uint8_t> dense(rm.bits.begin(), rm.bits.end());
        BlockMask from_dense;
        ASSERT_TRUE(build_block_sparse_from_dense(shape, dense.data(), &from_dense).ok());
        EXPECT_TRUE(std::ranges::equal(bm.row_ptr(), from_dense.row_ptr()));
        EXPECT_TRUE(std::ranges::equal(bm.col_idx(), from_dense.col_idx()));
        EXPECT_TRUE(std::ranges::equal(bm.partial(), from_dense.partial()));
        EXPECT_TRUE(std::ranges::equal(bm.element_masks(), from_dense.element_masks()));
      }
}

TEST(BlockSparseBuild, StructuredMasksRoundTrip) {
  const std::vector<std::pair<const char*, std::function<bool(int, int)>>> fns = {
      {"all-visible", [](int, int) { return true; }},
      {"all-hidden", [](int, int) { return false; }},
      {"empty-rows", [](int i, int j) { return i % 3 != 0 && (i + j) % 5 != 0; }},
      {"checkerboard", [](int i, int j) { return (i + j) % 2 == 0; }},
      {"top-left-causal", [](int i, int j) { return j <= i; }},
      {"stripes", [](int, int j) { return (j / 8) % 3 == 0; }},
  };
  for (const Size& s : kSizes)
    for (const Blocks& bl : kBlocks)
      for (const auto& [name, fn] : fns) {
        BlockMask bm;
        ASSERT_TRUE(build_block_sparse(BlockSparseShape{s.nq, s.nk, bl.m, bl.n}, fn, &bm).ok());
        expect_round_trip(bm, [&](int, int, int i, int j) { return fn(i, j); }, label(s, bl, name));
        EXPECT_TRUE(validate_with(bm, 3, 2).ok());  // (1, 1) masks broadcast over batch and heads
        const std::int64_t grid = bm.num_rows() * bm.view().num_k_blocks;
        if (std::string(name) == "all-visible") {
          EXPECT_EQ(bm.num_blocks(), grid);
          EXPECT_EQ(bm.num_full_blocks(), grid);
          EXPECT_EQ(bm.view().num_partial, 0);
          EXPECT_EQ(bm.view().element_masks, nullptr);
          EXPECT_EQ(bm.visible_pairs(), std::int64_t{s.nq} * s.nk);
          EXPECT_DOUBLE_EQ(bm.block_density(), 1.0);
        }
        if (std::string(name) == "all-hidden") {
          EXPECT_EQ(bm.num_blocks(), 0);
          EXPECT_EQ(bm.visible_pairs(), 0);
          EXPECT_EQ(bm.block_density(), 0.0);
          EXPECT_NE(bm.view().col_idx, nullptr);  // validate() wants non-null arrays
        }
      }
}

TEST(BlockSparseBuild, EmptyShapes) {
  for (auto [nq, nk] : {std::pair{0, 10}, std::pair{10, 0}, std::pair{0, 0}}) {
    BlockMask bm;
    ASSERT_TRUE(build_block_sparse(BlockSparseShape{nq, nk, 16, 16}, [](int, int) { return true; }, &bm).ok());
    EXPECT_EQ(bm.num_blocks(), 0);
    EXPECT_EQ(bm.view().num_q_blocks, (nq + 15) / 16);
    EXPECT_EQ(bm.num_rows(), (nq + 15) / 16);
    ASSERT_TRUE(build_block_sparse_from_dense(BlockSparseShape{nq, nk, 16, 16}, nullptr, &bm).ok());
  }
}

TEST(BlockSparseBuild, IdenticalPartialsAreShared) {
  // Causal, 64 x 64 in 16 x 16 blocks: the 4 diagonal blocks carry the same lower triangle.
  const auto causal = [](int i, int j) { return j <= i; };
  const BlockSparseShape s{64, 64, 16, 16};
  BlockMask shared, separate;
  ASSERT_TRUE(build_block_sparse(s, causal, &shared).ok());
  ASSERT_TRUE(build_block_sparse(s, causal, &separate, BlockSparseOptions{.share_identical_partials = false}).ok());
  EXPECT_EQ(shared.num_partial_blocks(), 4);
  EXPECT_EQ(shared.view().num_partial, 1);
  EXPECT_EQ(separate.view().num_partial, 4);
  EXPECT_EQ(shared.num_full_blocks(), 6);
  const Fn4 fn = [&](int, int, int i, int j) { return causal(i, j); };
  expect_round_trip(shared, fn, "shared");
  expect_round_trip(separate, fn, "separate");
}

TEST(BlockSparseBuild, CopiesAndMovesKeepTheirOwnView) {
  const RandomMask rm(1, 2, 50, 70, 0.5, 7);
  BlockMask a;
  ASSERT_TRUE(build_block_sparse(BlockSparseShape{50, 70, 16, 32, 1, 2}, Fn4(std::cref(rm)), &a).ok());
  BlockMask b = a;
  EXPECT_NE(b.view().col_idx, a.view().col_idx);
  BlockMask c = std::move(a);
  a = BlockMask{};
  BlockMask d;
  d = c;
  BlockMask e;
  e = std::move(d);
  for (const BlockMask* m : {&b, &c, &e}) {
    EXPECT_EQ(m->view().row_ptr, m->row_ptr().data());
    EXPECT_EQ(m->view().col_idx, m->col_idx().data());
    expect_round_trip(*m, std::cref(rm), "copy/move");
  }
}

TEST(BlockSparseBuild, Errors) {
  BlockMask bm;
  const auto yes = [](int, int) { return true; };
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{-1, 4, 16, 16}, yes, &bm).ok());
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{4, 4, 0, 16}, yes, &bm).ok());
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{4, 4, 16, -2}, yes, &bm).ok());
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{4, 4, 16, 16}, yes, nullptr).ok());
  const Status pair_with_heads = build_block_sparse(BlockSparseShape{4, 4, 16, 16, 1, 8}, yes, &bm);
  EXPECT_FALSE(pair_with_heads.ok());
  EXPECT_NE(pair_with_heads.message().find("num_heads (8)"), std::string::npos) << pair_with_heads.message();
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{4, 4, 16, 16, 0, 1}, Fn4([](int, int, int, int) { return true; }), &bm).ok());
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{4, 4, 16, 16}, Fn4{}, &bm).ok());
  EXPECT_FALSE(build_block_sparse_from_dense(BlockSparseShape{4, 4, 16, 16}, nullptr, &bm).ok());
  MaskParams varlen;
  const std::int32_t cu[] = {0, 4};
  varlen.cu_seqlens_q = varlen.cu_seqlens_k = cu;
  EXPECT_FALSE(block_mask_from_rules(BlockSparseShape{4, 4, 16, 16}, varlen, &bm).ok());
  EXPECT_FALSE(sliding_window_block_mask(BlockSparseShape{4, 4, 16, 16}, -2, 0, false, &bm).ok());
  const std::vector<std::int32_t> good{0, 3, 5}, bad_start{1, 3, 5}, decreasing{0, 3, 2}, short_cu{0, 5};
  EXPECT_FALSE(document_block_mask(BlockSparseShape{0, 0, 16, 16}, bad_start, good, {}, &bm).ok());
  EXPECT_FALSE(document_block_mask(BlockSparseShape{0, 0, 16, 16}, good, decreasing, {}, &bm).ok());
  EXPECT_FALSE(document_block_mask(BlockSparseShape{0, 0, 16, 16}, good, short_cu, {}, &bm).ok());
  // A failed build leaves the output as it was.
  ASSERT_TRUE(build_block_sparse(BlockSparseShape{5, 5, 2, 2}, yes, &bm).ok());
  EXPECT_FALSE(build_block_sparse(BlockSparseShape{5, 5, 0, 2}, yes, &bm).ok());
  EXPECT_EQ(bm.seqlen_q(), 5);
  EXPECT_EQ(bm.num_blocks(), 9);
}

// ---- the pattern builders against the rules of attention.h -----------------------------------

/// Visibility of MaskParams' causal/window/global fields for one sequence, written from the
/// header comment of attention.h.
struct Rules {
  bool causal = false;
  int wl = -1, wr = -1, g = 0;
  bool gq = false;
  bool operator()(int nq, int nk, int i, int j) const {
    const long ia = static_cast<long>(i) + nk - nq;
    const bool global_key = j < g, global_query = gq && ia < g;
    if (causal && j > ia) return false;
    if (wr >= 0 && !global_query && j > ia + wr) return false;
    if (wl >= 0 && !global_query && !global_key && j < ia - wl) return false;
    return true;
  }
  MaskParams params() const {
    MaskParams m;
    m.causal = causal;
    m.window_left = wl;
    m.window_right = wr;
    m.global_tokens = g;
    m.global_queries = gq;
    return m;
  }
};

const Rules kRuleCases[] = {
    {true},                       // causal
    {false, 16, 0},               // left window (+ diagonal)
    {true, 10},                   // causal sliding window
    {false, 5, 9},                // two-sided window
    {false, 0, 0},                // diagonal only
    {true, 7, -1, 3},             // causal window with 3 sinks
    {false, 4, 2, 5, true},       // two-sided window, global keys and queries
    {true, 20, -1, 64, false},    // sinks wider than a block
    {false, 1000, 1000},          // window wider than the sequence
    {false, -1, 3, 2, true},      // right bound only
};

TEST(BlockSparseRules, CommonMasksMatchTheRules) {
  for (const Size& s : kSizes)
    for (const Blocks& bl : kBlocks)
      for (const Rules& r : kRuleCases) {
        const std::string what = label(s, bl, "rules") + " causal " + std::to_string(r.causal) + " w(" +
                                 std::to_string(r.wl) + "," + std::to_string(r.wr) + ") g " +
                                 std::to_string(r.g) + (r.gq ? " gq" : "");
        BlockMask bm;
        ASSERT_TRUE(block_mask_from_rules(BlockSparseShape{s.nq, s.nk, bl.m, bl.n}, r.params(), &bm).ok());
        expect_round_trip(bm, [&](int, int, int i, int j) { return r(s.nq, s.nk, i, j); }, what);
        EXPECT_TRUE(validate_with(bm, 2, 2).ok());
        // The same mask from its per-pair function: identical arrays (the shortcuts are exact).
        BlockMask slow;
        ASSERT_TRUE(build_block_sparse(BlockSparseShape{s.nq, s.nk, bl.m, bl.n},
                                       [&](int i, int j) { return r(s.nq, s.nk, i, j); }, &slow).ok());
        EXPECT_TRUE(std::ranges::equal(bm.col_idx(), slow.col_idx())) << what;
        EXPECT_TRUE(std::ranges::equal(bm.partial(), slow.partial())) << what;
        EXPECT_TRUE(std::ranges::equal(bm.element_masks(), slow.element_masks())) << what;
      }
}

TEST(BlockSparseRules, NamedHelpersAndBroadcastShape) {
  const BlockSparseShape s{90, 130, 32, 48, 2, 3};
  BlockMask a, b, c;
  ASSERT_TRUE(causal_block_mask(s, &a).ok());
  expect_round_trip(a, [](int, int, int i, int j) { return j <= i + 40; }, "causal");
  ASSERT_TRUE(sliding_window_block_mask(s, 8, 4, false, &b).ok());
  expect_round_trip(b, [](int, int, int i, int j) { return j >= i + 40 - 8 && j <= i + 40 + 4; }, "window");
  ASSERT_TRUE(window_global_block_mask(s, 8, -1, true, 4, false, &c).ok());
  expect_round_trip(c, [](int, int, int i, int j) { return j <= i + 40 && (j >= i + 32 || j < 4); },
                    "window+global");
  EXPECT_EQ(a.view().num_batch, 2);
  EXPECT_EQ(a.view().num_heads, 3);
  EXPECT_TRUE(validate_with(a, 2, 3).ok());
}

/// Document of token t: the d with cu[d] <= t < cu[d + 1].
int doc_of(const std::vector<std::int32_t>& cu, int t) {
  for (std::size_t d = 0; d + 1 < cu.size(); ++d)
    if (t >= cu[d] && t < cu[d + 1]) return static_cast<int>(d);
  return -1;
}

std::vector<std::int32_t> prefix(const std::vector<int>& lens) {
  std::vector<std::int32_t> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  return cu;
}

struct DocCase {
  std::vector<int> len_q, len_k;
};
const DocCase kDocCases[] = {
    {{30, 1, 50, 19}, {30, 1, 50, 19}},   // equal lengths
    {{10, 40, 0, 25}, {20, 40, 5, 25}},   // an empty query document, len_q != len_k
    {{64, 64}, {64, 64}},                 // block-aligned documents
    {{3, 0, 7}, {0, 4, 9}},               // a document with no keys
    {{100}, {130}},                       // one document
};

TEST(BlockSparseDocument, MatchesPerDocumentRules) {
  for (const DocCase& dc : kDocCases)
    for (const Blocks& bl : kBlocks)
      for (const Rules& r : {Rules{}, Rules{true}, Rules{true, 6, -1, 2}, Rules{false, 3, 5}}) {
        const auto cu_q = prefix(dc.len_q), cu_k = prefix(dc.len_k);
        BlockMask bm;
        ASSERT_TRUE(document_block_mask(BlockSparseShape{0, 0, bl.m, bl.n}, cu_q, cu_k, r.params(), &bm).ok());
        EXPECT_EQ(bm.seqlen_q(), cu_q.back());
        EXPECT_EQ(bm.seqlen_k(), cu_k.back());
        const auto fn = [&](int, int, int i, int j) {
          const int d = doc_of(cu_q, i);
          if (d != doc_of(cu_k, j)) return false;
          return r(dc.len_q[d], dc.len_k[d], i - cu_q[d], j - cu_k[d]);
        };
        expect_round_trip(bm, fn, "document " + std::to_string(bl.m) + "x" + std::to_string(bl.n) +
                                      " causal " + std::to_string(r.causal));
        EXPECT_TRUE(validate_with(bm, 1, 2).ok()) << validate_with(bm, 1, 2).to_string();
      }
}

// ---- attention through the built masks ----------------------------------------------------------

constexpr int kDim = 64;

/// Random fp32 q, k, v, contiguous (batch, seqlen, heads, dim).
struct Attn {
  AttnParams p;
  HostBuffer q, k, v, o;
  std::vector<float> lse;
  Attn(const Attn&) = delete;
  Attn& operator=(const Attn&) = delete;
  Attn(int batch, int nq, int nk, int hq, int hkv, std::uint64_t salt) {
    auto g = testing::rng(salt);
    p.batch = batch;
    p.seqlen_q = nq;
    p.seqlen_k = nk;
    p.heads_q = hq;
    p.heads_kv = hkv;
    p.head_dim = kDim;
    q = HostBuffer(DType::kF32, std::int64_t{batch} * nq * hq * kDim);
    k = HostBuffer(DType::kF32, std::int64_t{batch} * nk * hkv * kDim);
    v = HostBuffer(DType::kF32, std::int64_t{batch} * nk * hkv * kDim);
    o = HostBuffer(DType::kF32, std::int64_t{batch} * nq * hq * kDim);
    q.fill_normal(g);
    k.fill_normal(g);
    v.fill_normal(g);
    o.poison();
    lse.assign(static_cast<std::size_t>(batch) * hq * nq, NAN);
    p.q = bshd_view(q.data(), DType::kF32, nq, hq, kDim);
    p.k = bshd_view(k.data(), DType::kF32, nk, hkv, kDim);
    p.v = bshd_view(v.data(), DType::kF32, nk, hkv, kDim);
    p.o = bshd_view(o.data(), DType::kF32, nq, hq, kDim);
    p.lse = lse.data();
  }
  cpu::RefOutput reference() const {
    cpu::RefOutput r;
    const Status st = cpu::reference_attention(p, &r);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return r;
  }
};

void expect_identical(const cpu::RefOutput& a, const cpu::RefOutput& b) {
  ASSERT_EQ(a.o.size(), b.o.size());
  ASSERT_EQ(a.lse.size(), b.lse.size());
  std::size_t bad_o = 0, bad_lse = 0;
  for (std::size_t x = 0; x < a.o.size(); ++x) bad_o += a.o[x] != b.o[x];
  for (std::size_t x = 0; x < a.lse.size(); ++x) bad_lse += a.lse[x] != b.lse[x];
  EXPECT_EQ(bad_o, 0u) << "O elements that differ";
  EXPECT_EQ(bad_lse, 0u) << "LSE rows that differ";
}

TEST(BlockSparseAttention, CausalAndWindowsEqualTheirFlags) {
  // Ragged blocks, seqlen_q != seqlen_k (bottom-right), GQA.
  for (const Rules& r : kRuleCases) {
    for (auto [nq, nk] : {std::pair{70, 100}, std::pair{100, 70}, std::pair{65, 65}}) {
      Attn t(2, nq, nk, 4, 2, 300 + nq);
      t.p.mask = r.params();
      const cpu::RefOutput flags = t.reference();
      BlockMask bm;
      ASSERT_TRUE(block_mask_from_rules(BlockSparseShape{nq, nk, 32, 48}, r.params(), &bm).ok());
      t.p.mask = MaskParams{};
      t.p.mask.block_sparse = bm.get();
      ASSERT_TRUE(validate(t.p, Backend::kCpu).ok());
      SCOPED_TRACE("causal " + std::to_string(r.causal) + " w(" + std::to_string(r.wl) + "," +
                   std::to_string(r.wr) + ") g " + std::to_string(r.g) + " " + std::to_string(nq) + "x" +
                   std::to_string(nk));
      expect_identical(t.reference(), flags);
    }
  }
}

TEST(BlockSparseAttention, DocumentMaskEqualsVarlen) {
  for (const DocCase& dc : kDocCases)
    for (const Rules& r : {Rules{}, Rules{true}, Rules{true, 6, -1, 2}}) {
      const auto cu_q = prefix(dc.len_q), cu_k = prefix(dc.len_k);
      const int total_q = cu_q.back(), total_k = cu_k.back();
      if (total_q == 0 || total_k == 0) continue;
      // One packed problem (batch 1, total tokens) with the document mask ...
      Attn t(1, total_q, total_k, 2, 1, 400 + total_q);
      BlockMask bm;
      ASSERT_TRUE(document_block_mask(BlockSparseShape{0, 0, 32, 16}, cu_q, cu_k, r.params(), &bm).ok());
      t.p.mask.block_sparse = bm.get();
      ASSERT_TRUE(validate(t.p, Backend::kCpuReference).ok());
      const cpu::RefOutput packed = t.reference();
      // ... equals the varlen call over the same tensors, one problem per document.
      t.p.mask = r.params();
      t.p.mask.cu_seqlens_q = cu_q.data();
      t.p.mask.cu_seqlens_k = cu_k.data();
      t.p.batch = static_cast<int>(dc.len_q.size());
      t.p.seqlen_q = *std::max_element(dc.len_q.begin(), dc.len_q.end());
      t.p.seqlen_k = *std::max_element(dc.len_k.begin(), dc.len_k.end());
      ASSERT_TRUE(validate(t.p, Backend::kCpuReference).ok());
      SCOPED_TRACE("documents of " + std::to_string(total_q) + " queries, causal " + std::to_string(r.causal));
      expect_identical(t.reference(), packed);
    }
}

TEST(BlockSparseAttention, BroadcastMasksEqualRepeatedMasks) {
  // A (1, 1) mask and the same pattern stored per batch and head give the same attention.
  const auto fn = [](int i, int j) { return (i * 7 + j * 3) % 5 != 0 && j <= i + 20; };
  Attn t(2, 50, 60, 3, 3, 501);
  BlockMask shared, repeated;
  ASSERT_TRUE(build_block_sparse(BlockSparseShape{50, 60, 16, 24}, fn, &shared).ok());
  ASSERT_TRUE(build_block_sparse(BlockSparseShape{50, 60, 16, 24, 2, 3},
                                 [&](int, int, int i, int j) { return fn(i, j); }, &repeated).ok());
  t.p.mask.block_sparse = shared.get();
  const cpu::RefOutput a = t.reference();
  t.p.mask.block_sparse = repeated.get();
  expect_identical(t.reference(), a);

  // A per-head mask (1, H): head h of the result equals a run with head h's pattern for all heads.
  const RandomMask rm(1, 3, 50, 60, 0.6, 502);
  BlockMask per_head;
  ASSERT_TRUE(build_block_sparse(BlockSparseShape{50, 60, 16, 24, 1, 3}, Fn4(std::cref(rm)), &per_head).ok());
  t.p.mask.block_sparse = per_head.get();
  ASSERT_TRUE(validate(t.p, Backend::kCpu).ok());
  const cpu::RefOutput all = t.reference();
  for (int h = 0; h < 3; ++h) {
    BlockMask one;
    ASSERT_TRUE(build_block_sparse(BlockSparseShape{50, 60, 16, 24},
                                   [&](int i, int j) { return rm(0, h, i, j); }, &one).ok());
    t.p.mask.block_sparse = one.get();
    const cpu::RefOutput single = t.reference();
    for (std::int64_t row = 0; row < all.total_q; ++row) {
      EXPECT_EQ(all.lse[h * all.total_q + row], single.lse[h * single.total_q + row]);
      for (int d = 0; d < kDim; ++d) {
        const std::size_t at = static_cast<std::size_t>((row * 3 + h) * kDim + d);
        ASSERT_EQ(all.o[at], single.o[at]) << "head " << h << " row " << row;
      }
    }
  }
}

/// The tiled backend with `mask` against the fp64 reference: |dO| <= 1e-6 and
/// |dLSE| <= 1e-6 + 2^-24 |LSE| (the fp32 bar of test_tiled.cc), -inf exactly where the
/// reference has it.
void expect_tiled_matches_reference(Attn& t, const BlockMask& mask, int cpu_block_m, int cpu_block_n) {
  t.p.mask = MaskParams{};
  t.p.mask.block_sparse = mask.get();
  ASSERT_TRUE(validate(t.p, Backend::kCpu).ok());
  const cpu::RefOutput ref = t.reference();
  t.o.poison();
  RunOptions opt;
  opt.backend = Backend::kCpu;
  opt.cpu_block_m = cpu_block_m;
  opt.cpu_block_n = cpu_block_n;
  ASSERT_TRUE(attention_forward(t.p, opt).ok());
  const AttnParams& p = t.p;
  double worst_o = 0, worst_lse = 0;
  for (int b = 0; b < p.batch; ++b)
    for (int i = 0; i < p.seqlen_q; ++i)
      for (int h = 0; h < p.heads_q; ++h) {
        const std::int64_t row = std::int64_t{b} * p.seqlen_q + i;
        const double want_lse = ref.lse[static_cast<std::size_t>(h * ref.total_q + row)];
        const double got_lse = t.lse[static_cast<std::size_t>((std::int64_t{b} * p.heads_q + h) * p.seqlen_q + i)];
        if (std::isinf(want_lse)) {
          EXPECT_EQ(got_lse, want_lse) << "row " << row << " head " << h;
        } else {
          EXPECT_NEAR(got_lse, want_lse, 1e-6 + std::ldexp(std::abs(want_lse), -24));
          worst_lse = std::max(worst_lse, std::abs(got_lse - want_lse));
        }
        for (int d = 0; d < kDim; ++d) {
          const double want = ref.o[static_cast<std::size_t>((row * p.heads_q + h) * kDim + d)];
          const double got = t.o.get((row * p.heads_q + h) * kDim + d);
          ASSERT_FALSE(std::isnan(got)) << "unwritten O at row " << row << " head " << h;
          worst_o = std::max(worst_o, std::abs(got - want));
        }
      }
  EXPECT_LE(worst_o, 1e-6);
  ::testing::Test::RecordProperty("worst_abs_err_o", std::to_string(worst_o));
}

TEST(BlockSparseAttention, TiledBackendMatchesReference) {
  {  // random per-batch, per-head mask; blocks wider than 64 keys (two words per row)
    Attn t(2, 77, 150, 4, 2, 601);
    const RandomMask rm(2, 4, 77, 150, 0.5, 602);
    BlockMask bm;
    ASSERT_TRUE(build_block_sparse(BlockSparseShape{77, 150, 24, 80, 2, 4}, Fn4(std::cref(rm)), &bm).ok());
    SCOPED_TRACE("random 24x80");
    expect_tiled_matches_reference(t, bm, 0, 0);
    expect_tiled_matches_reference(t, bm, 16, 32);  // CPU tiles smaller than the sparse blocks
  }
  {  // causal and window+global from the pattern builders, 128 x 128 blocks over ragged lengths
    Attn t(1, 200, 260, 2, 2, 603);
    BlockMask causal, window;
    ASSERT_TRUE(causal_block_mask(BlockSparseShape{200, 260, 128, 128}, &causal).ok());
    ASSERT_TRUE(window_global_block_mask(BlockSparseShape{200, 260, 64, 32}, 40, 8, false, 8, true, &window).ok());
    SCOPED_TRACE("causal / window+global");
    expect_tiled_matches_reference(t, causal, 0, 0);
    expect_tiled_matches_reference(t, window, 0, 0);
  }
  {  // documents
    const auto cu_q = prefix({40, 3, 90, 0, 27}), cu_k = prefix({40, 10, 90, 6, 27});
    Attn t(1, cu_q.back(), cu_k.back(), 2, 1, 604);
    MaskParams within;
    within.causal = true;
    BlockMask doc;
    ASSERT_TRUE(document_block_mask(BlockSparseShape{0, 0, 32, 32}, cu_q, cu_k, within, &doc).ok());
    SCOPED_TRACE("documents");
    expect_tiled_matches_reference(t, doc, 0, 0);
  }
}

}  // namespace
}  // namespace flashcpp
