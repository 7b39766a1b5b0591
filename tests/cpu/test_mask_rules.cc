// MaskRules (src/common/mask_rules.h), which the CUDA kernels and the tiled CPU backend use to
// choose the key blocks they visit, checked by brute force on random small configurations:
// - visible(i, j) equals the rules of attention.h evaluated independently here;
// - key_range / sink_hi cover every visible (i, j) of a query tile (a kernel that walks only
//   those blocks misses nothing), and the bounds are tight where they claim to be;
// - tile_fully_visible is never true for a tile with a hidden element (it may skip masking);
// - plain_window_iters, the kernels' register shortcut past the mask, names only such tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>

#include "common/mask_rules.h"
#include "test_util.h"

namespace flashcpp {
namespace {

/// The visibility rules of attention.h's header comment, written out once more for the test.
bool visible_by_definition(const MaskRules& r, int i, int j) {
  if (j < 0 || j >= r.seqlen_k) return false;
  const long long ia = static_cast<long long>(i) + r.seqlen_k - r.seqlen_q;
  const bool global_query = r.global_queries && ia < r.global_tokens;
  if (r.causal && j > ia) return false;
  if (r.window_right >= 0 && !global_query && j > ia + r.window_right) return false;
  if (r.window_left >= 0 && !global_query && j >= r.global_tokens && j < ia - r.window_left)
    return false;
  return true;
}

std::string describe(const MaskRules& r) {
  return "Lq=" + std::to_string(r.seqlen_q) + " Lk=" + std::to_string(r.seqlen_k) +
         " causal=" + std::to_string(r.causal) + " wl=" + std::to_string(r.window_left) +
         " wr=" + std::to_string(r.window_right) + " G=" + std::to_string(r.global_tokens) +
         " gq=" + std::to_string(r.global_queries);
}

MaskRules random_rules(std::mt19937_64& g) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
  auto window = [&] {  // off, small (incl. 0), or larger than any sequence here
    const int k = pick(0, 5);
    return k == 0 ? -1 : k == 1 ? 1000 : pick(0, 12);
  };
  MaskRules r;
  r.seqlen_q = pick(1, 40);
  r.seqlen_k = pick(0, 40);
  r.causal = pick(0, 1);
  r.window_left = window();
  r.window_right = window();
  r.global_tokens = pick(0, 3) == 0 ? 0 : pick(0, 1) ? pick(1, 8) : pick(20, 60);
  r.global_queries = pick(0, 1);
  return r;
}

constexpr int kConfigs = 3000;

/// Calls f(rules, i0, i1, block_n) for every query tile of kConfigs random rule sets, each with a
/// random tile shape (1..16 rows, 1..16 keys).
template <class F>
void for_random_query_tiles(std::uint64_t seed, F&& f) {
  auto g = testing::rng(seed);
  std::uniform_int_distribution<int> tile(1, 16);
  for (int n = 0; n < kConfigs; ++n) {
    const MaskRules r = random_rules(g);
    const int br = tile(g), bc = tile(g);
    for (int i0 = 0; i0 < r.seqlen_q; i0 += br) f(r, i0, std::min(i0 + br, r.seqlen_q), bc);
  }
}

/// The first (i, j) of rows [i0, i1) x keys [j0, j1) hidden by the definition, or (-1, -1).
std::pair<int, int> first_hidden(const MaskRules& r, int i0, int i1, int j0, int j1) {
  for (int i = i0; i < i1; ++i)
    for (int j = j0; j < j1; ++j)
      if (!visible_by_definition(r, i, j)) return {i, j};
  return {-1, -1};
}

TEST(MaskRules, VisibleMatchesDefinition) {
  auto g = testing::rng(201);
  for (int n = 0; n < kConfigs; ++n) {
    const MaskRules r = random_rules(g);
    for (int i = 0; i < r.seqlen_q; ++i)
      for (int j = -1; j <= r.seqlen_k; ++j)
        ASSERT_EQ(r.visible(i, j), visible_by_definition(r, i, j))
            << describe(r) << " i=" << i << " j=" << j;
  }
}

// The lean-mask configs' element mask (sm90 TileConfig::lean_mask, prefill_mask.cuh mask_row_lean):
// without a window or sinks, a key j >= 0 is visible to row i exactly when j < causal_key_hi(i),
// for every row of a tile, those past the sequence's end included (they are computed, not stored),
// with seqlen_q above and below seqlen_k.
TEST(MaskRules, CausalKeyHiIsTheLeanMask) {
  auto g = testing::rng(209);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
  for (int n = 0; n < kConfigs; ++n) {
    MaskRules r;
    r.seqlen_q = pick(1, 60);
    r.seqlen_k = pick(0, 60);
    r.causal = pick(0, 1);
    for (int i = 0; i < r.seqlen_q + 20; ++i)
      for (int j = 0; j < r.seqlen_k + 20; ++j) {
        const bool lean = j < r.causal_key_hi(i);
        const bool by_definition = i < r.seqlen_q ? visible_by_definition(r, i, j) : j < r.key_hi(i) && r.visible(i, j);
        ASSERT_EQ(lean, by_definition) << describe(r) << " i=" << i << " j=" << j;
      }
  }
}

TEST(MaskRules, RowBoundsAreTight) {
  auto g = testing::rng(202);
  for (int n = 0; n < kConfigs; ++n) {
    const MaskRules r = random_rules(g);
    for (int i = 0; i < r.seqlen_q; ++i) {
      const int hi = r.key_hi(i), lo = r.key_lo(i);
      SCOPED_TRACE(describe(r) + " i=" + std::to_string(i));
      for (int j = hi; j < r.seqlen_k; ++j) ASSERT_FALSE(visible_by_definition(r, i, j)) << j;
      if (hi > 0) {
        ASSERT_TRUE(visible_by_definition(r, i, hi - 1));
      }
      for (int j = 0; j < std::min(lo, hi); ++j)
        ASSERT_EQ(visible_by_definition(r, i, j), j < r.global_tokens) << j;
      if (lo < hi) {
        ASSERT_TRUE(visible_by_definition(r, i, lo));
      }
    }
  }
}

TEST(MaskRules, TileRangesCoverEveryVisibleKey) {
  auto g = testing::rng(203);
  std::uniform_int_distribution<int> tile(1, 20);
  for (int n = 0; n < kConfigs; ++n) {
    const MaskRules r = random_rules(g);
    const int br = tile(g);
    for (int i0 = 0; i0 < r.seqlen_q; i0 += br) {
      const int i1 = std::min(i0 + br, r.seqlen_q);
      int lo = -1, hi = -1;
      r.key_range(i0, i1, &lo, &hi);
      const int sink = r.sink_hi(i0, i1, lo);
      SCOPED_TRACE(describe(r) + " rows [" + std::to_string(i0) + "," + std::to_string(i1) +
                   ") lo=" + std::to_string(lo) + " hi=" + std::to_string(hi) +
                   " sink_hi=" + std::to_string(sink));
      ASSERT_LE(0, lo);
      ASSERT_LE(lo, hi);
      ASSERT_LE(hi, r.seqlen_k);
      ASSERT_LE(sink, lo);
      int max_visible = -1;
      for (int i = i0; i < i1; ++i)
        for (int j = 0; j < r.seqlen_k; ++j) {
          if (!visible_by_definition(r, i, j)) continue;
          max_visible = std::max(max_visible, j);
          ASSERT_TRUE((j >= lo && j < hi) || j < sink) << "i=" << i << " j=" << j;
        }
      ASSERT_EQ(hi, max_visible + 1) << "hi is the tile's last visible key + 1";
    }
  }
}

TEST(MaskRules, FullyVisibleTilesHaveNoHiddenElement) {
  long long claimed = 0;
  for_random_query_tiles(204, [&](const MaskRules& r, int i0, int i1, int bc) {
    for (int j0 = 0; j0 < r.seqlen_k; j0 += bc) {
      const int j1 = std::min(j0 + bc, r.seqlen_k);
      if (!r.tile_fully_visible(i0, i1, j0, j1)) continue;
      ++claimed;
      const auto [i, j] = first_hidden(r, i0, i1, j0, j1);
      ASSERT_LT(i, 0) << describe(r) << " tile [" << i0 << "," << i1 << ")x[" << j0 << "," << j1
                      << ") claims full visibility but hides i=" << i << " j=" << j;
    }
  });
  EXPECT_GT(claimed, 0) << "no tile was ever proven fully visible: the fast path is dead";
}

// Found by FullyVisibleTilesHaveNoHiddenElement. With global_queries and G = 0, rows with
// ia < 0 (seqlen_q > seqlen_k) satisfy "ia < G" and are global queries, so a query tile can
// start with global rows and end with ordinary ones even though G == 0; tile_fully_visible only
// looks for that mix when global_tokens > 0.
TEST(MaskRules, GlobalQueryRowsWithZeroGlobalTokens) {
  MaskRules r;
  r.seqlen_q = 20;
  r.seqlen_k = 6;
  r.window_left = 9;
  r.window_right = 0;
  r.global_tokens = 0;
  r.global_queries = true;
  ASSERT_TRUE(visible_by_definition(r, 13, 1));   // ia = -1 < G: a global query
  ASSERT_FALSE(visible_by_definition(r, 14, 1));  // ia = 0: window_right 0 hides key 1
  EXPECT_FALSE(r.tile_fully_visible(13, 20, 1, 2));
}

TEST(MaskRules, InteriorCausalTilesSkipMasking) {
  MaskRules r;
  r.seqlen_q = r.seqlen_k = 256;
  r.causal = true;
  EXPECT_TRUE(r.tile_fully_visible(64, 128, 0, 64));     // strictly below the diagonal
  EXPECT_FALSE(r.tile_fully_visible(64, 128, 64, 128));  // on the diagonal
  r.window_left = 100;
  EXPECT_FALSE(r.tile_fully_visible(192, 256, 0, 64));   // left of the window
  r.global_tokens = 64;
  EXPECT_TRUE(r.tile_fully_visible(192, 256, 0, 64));    // ... but those keys are sinks
}

/// The window walk of make_cta_work (prefill_mask.cuh) for rows [i0, i1) and key tiles of bc.
struct Walk {
  int n_last, n_window;
};
Walk window_walk(const MaskRules& r, int i0, int i1, int bc) {
  int lo, hi;
  r.key_range(i0, i1, &lo, &hi);
  const int first = lo / bc;
  const int n_window = hi > lo ? (hi + bc - 1) / bc - first : 0;
  return Walk{first + n_window - 1, n_window};
}

TEST(MaskRules, PlainWindowItersHaveNoHiddenElement) {
  long long claimed = 0;
  for_random_query_tiles(205, [&](const MaskRules& r, int i0, int i1, int bc) {
    const Walk w = window_walk(r, i0, i1, bc);
    int lo = -7, hi = -7;
    r.plain_window_iters(i0, i1, bc, w.n_last, w.n_window, &lo, &hi);
    ASSERT_TRUE(0 <= lo && lo <= hi && hi <= std::max(w.n_window, 0))
        << describe(r) << " rows [" << i0 << "," << i1 << ") tile " << bc << ": [" << lo << "," << hi
        << ") outside the " << w.n_window << " window iterations";
    for (int it = lo; it < hi; ++it) {
      ++claimed;
      const int j0 = (w.n_last - it) * bc, j1 = j0 + bc;
      ASSERT_LE(j1, r.seqlen_k) << describe(r);
      const auto [i, j] = first_hidden(r, i0, i1, j0, j1);
      ASSERT_LT(i, 0) << describe(r) << " rows [" << i0 << "," << i1 << ") iteration " << it << " keys [" << j0
                      << "," << j1 << ") skip the mask but hide i=" << i << " j=" << j;
    }
  });
  EXPECT_GT(claimed, 0) << "plain_window_iters never named a tile: the shortcut is dead";
}

TEST(MaskRules, PlainWindowItersExactOnCommonShapes) {
  auto range = [](const MaskRules& r, int i0, int i1, int bc) {
    const Walk w = window_walk(r, i0, i1, bc);
    int lo, hi;
    r.plain_window_iters(i0, i1, bc, w.n_last, w.n_window, &lo, &hi);
    return std::pair<int, int>{lo, hi};
  };
  MaskRules r;
  r.seqlen_q = r.seqlen_k = 256;
  r.causal = true;
  // Rows [128, 192) walk tiles 2 (the diagonal, masked), 1 and 0.
  EXPECT_EQ(range(r, 128, 192, 64), (std::pair<int, int>{1, 3}));
  // Without causal and with 200 keys: tile 3 (keys 192..255, partial) is masked, 2..0 are not.
  r.causal = false;
  r.seqlen_k = 200;
  EXPECT_EQ(range(r, 0, 64, 64), (std::pair<int, int>{1, 4}));
  // A window of 100 on the left: row 192 sees keys from 92 on, row 255 from 155 on, so only
  // tile 3 (keys 192..255) is whole for every row; tiles 2 and 1 hold window edges.
  r.seqlen_k = 256;
  r.window_left = 100;
  EXPECT_EQ(range(r, 192, 256, 64), (std::pair<int, int>{0, 1}));
}

}  // namespace
}  // namespace flashcpp
