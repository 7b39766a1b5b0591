// The launch order of the persistent sm90 prefill kernel's tiles (fa3_kernel.cuh, fa3_tile), as
// plain host/device arithmetic so that CPU tests check it: every tile exactly once, in units of
// equal causal cost, L2-sized head groups one after the other.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/hd.h"

namespace flashcpp {

struct TileCoord {
  int m_block, h, b;  ///< row block (-1: no such tile), query head, batch
};

/// Work units of the persistent kernel: unit = row blocks (M-1-p, p) of one (head, batch), M =
/// m_blocks. Under a causal mask a row block's cost grows with its index, so every unit costs the
/// same M+1 key tiles (the middle block of an odd M is a unit alone, at half that): static
/// round-robin over units balances CTAs to ceil(units / CTAs), where round-robin over tiles
/// ordered heaviest first left up to 1.5x imbalance. Units come in groups of tile_heads
/// (head, batch) pairs hb = b * heads_q + h (the last group may be smaller); inside a group p
/// ascends over all of the group's pairs. Consecutive query heads share K/V under GQA, so a group
/// is the K/V the CTAs working on it keep in L2, and a unit's two tiles read the same K/V.
FC_HD int persistent_units(int m_blocks, int heads_q, int batch) { return (m_blocks + 1) / 2 * heads_q * batch; }

/// Tile `half` (0: the heavy row block, 1: the light one) of unit u.
FC_HD TileCoord persistent_tile(int u, int half, int m_blocks, int heads_q, int batch, int tile_heads) {
  const int pairs_per_head = (m_blocks + 1) / 2;
  const int per_group = tile_heads * pairs_per_head;
  const int grp = u / per_group, in = u - grp * per_group;
  const int all = heads_q * batch;
  const int here = all - grp * tile_heads < tile_heads ? all - grp * tile_heads : tile_heads;
  const int pi = in / here, hb = grp * tile_heads + (in - pi * here);
  const int heavy = m_blocks - 1 - pi;
  const int mb = half == 0 ? heavy : (heavy == pi ? -1 : pi);
  return TileCoord{mb, hb % heads_q, hb / heads_q};
}

/// (head, batch) pairs per L2 group: as many as have their K/V (seqlen_k x head_dim x 2 tensors x
/// 2 bytes per kv head, shared by heads_q / heads_kv query heads) within `l2_budget` bytes, at
/// least one kv head's worth, at most all pairs.
inline int persistent_tile_heads(std::int64_t seqlen_k, int head_dim, int heads_q, int heads_kv, int batch,
                                 std::int64_t l2_budget = std::int64_t{24} << 20) {
  const std::int64_t kv_bytes = std::max<std::int64_t>(1, seqlen_k * head_dim * 4);
  const std::int64_t per_group = std::max<std::int64_t>(1, l2_budget / kv_bytes) * (heads_q / heads_kv);
  return static_cast<int>(std::min<std::int64_t>(per_group, static_cast<std::int64_t>(heads_q) * batch));
}

}  // namespace flashcpp
