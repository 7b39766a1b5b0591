// The persistent sm90 prefill kernel's work order (src/common/tile_order.h), checked on the CPU:
// every tile exactly once, each unit's tiles of one (head, batch), equal causal cost per unit,
// L2 groups one after the other, and the CTA balance that motivated the units.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>
#include <vector>

#include "common/tile_order.h"
#include "core/selector.h"

namespace flashcpp::testing {
namespace {

struct Shape {
  int m_blocks, heads_q, batch, tile_heads;
};

TEST(TileOrder, EveryTileOnceAndUnitsOfEqualCausalCost) {
  for (const Shape s : {Shape{1, 1, 1, 1}, Shape{2, 3, 1, 3}, Shape{7, 5, 3, 4}, Shape{32, 32, 4, 12}, Shape{64, 8, 1, 6},
                        Shape{9, 16, 2, 32}, Shape{128, 16, 1, 3}, Shape{5, 7, 3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "m_blocks " << s.m_blocks << " heads " << s.heads_q << " batch " << s.batch
                                      << " group " << s.tile_heads);
    const int units = persistent_units(s.m_blocks, s.heads_q, s.batch);
    std::set<std::tuple<int, int, int>> seen;
    int prev_group = -1;
    for (int u = 0; u < units; ++u) {
      const TileCoord a = persistent_tile(u, 0, s.m_blocks, s.heads_q, s.batch, s.tile_heads);
      const TileCoord b = persistent_tile(u, 1, s.m_blocks, s.heads_q, s.batch, s.tile_heads);
      ASSERT_GE(a.m_block, 0);
      ASSERT_LT(a.m_block, s.m_blocks);
      ASSERT_TRUE(a.h >= 0 && a.h < s.heads_q && a.b >= 0 && a.b < s.batch);
      ASSERT_TRUE(seen.insert({a.m_block, a.h, a.b}).second) << "tile repeated at unit " << u;
      int cost = a.m_block + 1;  // key tiles a bottom-right causal row block sees (seqlen_q == seqlen_k)
      if (b.m_block >= 0) {
        EXPECT_EQ(std::make_tuple(b.h, b.b), std::make_tuple(a.h, a.b)) << "a unit's tiles share their K/V";
        EXPECT_LT(b.m_block, a.m_block) << "heavy tile first";
        ASSERT_TRUE(seen.insert({b.m_block, b.h, b.b}).second) << "tile repeated at unit " << u;
        cost += b.m_block + 1;
        EXPECT_EQ(cost, s.m_blocks + 1);
      } else {
        EXPECT_EQ(2 * a.m_block + 1, s.m_blocks) << "only the middle block of an odd count is alone";
      }
      // Groups of tile_heads (head, batch) pairs, in order.
      const int group = (a.b * s.heads_q + a.h) / s.tile_heads;
      EXPECT_GE(group, prev_group);
      prev_group = group;
    }
    EXPECT_EQ(static_cast<long>(seen.size()), static_cast<long>(s.m_blocks) * s.heads_q * s.batch);
  }
}

TEST(TileOrder, GroupSizeFromKvBytes) {
  // 24 MB of K/V: (4096 keys x 128 dims x 4 bytes) = 2 MB per kv head -> 12 heads; GQA 4 -> 48.
  EXPECT_EQ(persistent_tile_heads(4096, 128, 32, 32, 4), 12);
  EXPECT_EQ(persistent_tile_heads(4096, 128, 32, 8, 4), 48);
  EXPECT_EQ(persistent_tile_heads(1 << 20, 256, 8, 8, 1), 1);  // at least one head
  EXPECT_EQ(persistent_tile_heads(16, 64, 8, 2, 3), 24);        // at most every (head, batch) pair
  EXPECT_EQ(persistent_tile_heads(0, 64, 4, 4, 1), 4);          // no keys: one group
}

TEST(TileOrder, RoundRobinOverUnitsBalancesCausalWork) {
  // Static round-robin of units over 132 CTAs: the busiest CTA's causal work stays within
  // ceil(units / CTAs) / (units / CTAs) of the mean (tiles ordered heaviest first gave up to 1.46x
  // at (1, 8, 8192, 128)).
  for (const auto& [batch, heads, kv_heads, n, d] : std::vector<std::tuple<int, int, int, int, int>>{
           {4, 32, 32, 4096, 128}, {1, 8, 8, 8192, 128}, {1, 16, 16, 16384, 128}, {2, 16, 16, 4096, 64},
           {1, 16, 16, 4096, 256}, {4, 32, 8, 4096, 128}}) {
    const int m_blocks = (n + 127) / 128, group = persistent_tile_heads(n, d, heads, kv_heads, batch);
    const int units = persistent_units(m_blocks, heads, batch), ctas = std::min(units, 132);
    std::vector<long> work(ctas, 0);
    long total = 0;
    for (int u = 0; u < units; ++u)
      for (int half = 0; half < 2; ++half) {
        const TileCoord t = persistent_tile(u, half, m_blocks, heads, batch, group);
        if (t.m_block < 0) continue;
        work[u % ctas] += t.m_block + 1;
        total += t.m_block + 1;
      }
    const double mean = static_cast<double>(total) / ctas;
    const double bound = static_cast<double>((units + ctas - 1) / ctas) / (static_cast<double>(units) / ctas);
    EXPECT_LE(*std::max_element(work.begin(), work.end()), mean * bound + 1e-9) << "shape n " << n << " d " << d;
  }
}

// The sm90 dispatch rules on the H200 shapes they were measured on (132 SMs; the faster config of
// each pair is in reports/hopper/raw/persist_a367a06_2026-11-30.txt and d64_m192_275afeb_2026-11-30.txt).
TEST(Sm90Rules, PersistentTwinWhereItsUnitsFillTheirWaves) {
  auto units = [](int n, int heads, int batch) { return persistent_units((n + 127) / 128, heads, batch); };
  EXPECT_TRUE(select::persistent_units_fill_waves(units(2048, 16, 1), 132));   // d64 (1,16,2048) causal: 251.9 vs 191.4
  EXPECT_TRUE(select::persistent_units_fill_waves(units(2048, 16, 2), 132));   // (2,16,2048): 266.7 vs 231.3
  EXPECT_TRUE(select::persistent_units_fill_waves(units(4096, 16, 2), 132));   // (2,16,4096): 339.0 vs 312.0
  EXPECT_TRUE(select::persistent_units_fill_waves(units(8192, 8, 1), 132));    // (1,8,8192): 385.3 vs 325.3
  EXPECT_TRUE(select::persistent_units_fill_waves(units(4096, 32, 4), 132));   // d128 (4,32,4096): many waves
  EXPECT_FALSE(select::persistent_units_fill_waves(units(2048, 8, 1), 132));   // 64 units: 132.1 vs 166.3
  EXPECT_FALSE(select::persistent_units_fill_waves(units(3072, 12, 1), 132));  // 144 units, a second wave of 12: 175.9 vs 225.3
  EXPECT_TRUE(select::persistent_units_fill_waves(99, 132));                   // one wave: 1.5 tiles per SM
  EXPECT_FALSE(select::persistent_units_fill_waves(98, 132));
  EXPECT_FALSE(select::persistent_units_fill_waves(0, 132));
  EXPECT_FALSE(select::persistent_units_fill_waves(100, 0));
}

// Two Q buffers (d64, d128): persistent while tiles walk <= 32 key tiles on average (causal) or <= 4
// (non-causal); one (d256): causal from 16. H200, reports/raw_prefill_527a834_2026-12-04/probe.txt (twin vs base).
TEST(Sm90Rules, PersistentTwinWhereItsTilesAreShort) {
  auto u = [](int n, int heads, int batch) { return persistent_units((n + 127) / 128, heads, batch); };
  auto kb = [](int n, int bn) { return (n + bn - 1) / bn; };
  EXPECT_TRUE(select::sm90_persistent_pays(u(512, 32, 16), 132, true, kb(512, 128), 2));      // 1.15x
  EXPECT_TRUE(select::sm90_persistent_pays(u(512, 32, 16), 132, false, kb(512, 128), 2));     // 1.12x
  EXPECT_TRUE(select::sm90_persistent_pays(u(4096, 32, 4), 132, true, kb(4096, 128), 2));     // 1.03x
  EXPECT_FALSE(select::sm90_persistent_pays(u(4096, 32, 4), 132, false, kb(4096, 128), 2));   // probe 1.01x, bench 0.96x
  EXPECT_FALSE(select::sm90_persistent_pays(u(1024, 16, 8), 132, false, kb(1024, 128), 2));   // probe 1.01x, bench 0.97x
  EXPECT_FALSE(select::sm90_persistent_pays(u(16384, 16, 1), 132, true, kb(16384, 128), 2));  // 0.98x
  EXPECT_FALSE(select::sm90_persistent_pays(u(16384, 16, 1), 132, false, kb(16384, 128), 2)); // 0.99x
  EXPECT_TRUE(select::sm90_persistent_pays(u(4096, 16, 1), 132, true, kb(4096, 64), 1));      // d256: 1.17x
  EXPECT_FALSE(select::sm90_persistent_pays(u(512, 32, 16), 132, true, kb(512, 64), 1));      // d256: 0.93x
  EXPECT_FALSE(select::sm90_persistent_pays(u(512, 32, 16), 132, false, kb(512, 64), 1));     // d256: 0.89x
  EXPECT_FALSE(select::sm90_persistent_pays(u(2048, 8, 1), 132, true, kb(2048, 128), 2));     // 64 units: the waves rule
  EXPECT_FALSE(select::sm90_persistent_pays(u(512, 32, 16), 132, true, 0, 2));                // no keys
}

TEST(Sm90Rules, ShortProblemsKeepTheTwinOverTheWideTile) {
  EXPECT_TRUE(select::sm90_short_for_wide_tile(512, false));     // (16,32,512,64): twin 1.13x the wide tile
  EXPECT_FALSE(select::sm90_short_for_wide_tile(4096, false));   // (2,16,4096,64): twin 0.98x
  EXPECT_TRUE(select::sm90_short_for_wide_tile(1024, true));     // (16,32,1024,64) causal: 1.29x
  EXPECT_TRUE(select::sm90_short_for_wide_tile(2048, true));     // (4,32,2048,64) causal: 1.11x
  EXPECT_FALSE(select::sm90_short_for_wide_tile(16384, true));   // (2,16,16384,64) causal: 0.87x
}

TEST(Sm90Rules, WideD64TileWhereItsRowGainBeatsItsWaves) {
  // Non-causal: the measured winner of each pair (192-row vs 128-row tile, TFLOP/s).
  EXPECT_FALSE(select::wide_tile_pays(2048, 8, false, 192, 132));     // (1,8,2048): 298.5 vs 357.8
  EXPECT_FALSE(select::wide_tile_pays(2048, 16, false, 192, 132));    // (1,16,2048): 305.2 vs 370.3
  EXPECT_TRUE(select::wide_tile_pays(3072, 12, false, 192, 132));     // (1,12,3072): 361.8 vs 295.1
  EXPECT_TRUE(select::wide_tile_pays(2048, 32, false, 192, 132));     // (2,16,2048): 397.1 vs 373.9
  EXPECT_TRUE(select::wide_tile_pays(8192, 8, false, 192, 132));      // (1,8,8192): 438.4 vs 418.6
  EXPECT_TRUE(select::wide_tile_pays(4096, 32, false, 192, 132));     // (2,16,4096): 416.0 vs 402.5
  EXPECT_TRUE(select::wide_tile_pays(16384, 32, false, 192, 132));    // (2,16,16384): 476.5 vs 419.1
  // Causal: the 128-row persistent twin below 10 wide tiles per SM, the wide tile above.
  EXPECT_FALSE(select::wide_tile_pays(4096, 32, true, 192, 132));     // 5.3 per SM: 318.0 vs 339.0 (twin)
  EXPECT_TRUE(select::wide_tile_pays(16384, 32, true, 192, 132));     // 20.9 per SM: 438.5 vs 403.8 (twin)
  EXPECT_FALSE(select::wide_tile_pays(0, 32, false, 192, 132));
  EXPECT_FALSE(select::wide_tile_pays(4096, 32, false, 192, 0));
}

}  // namespace
}  // namespace flashcpp::testing
