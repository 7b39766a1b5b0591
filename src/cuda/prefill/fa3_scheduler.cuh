// The tile scheduler of the sm90 prefill kernel: which (row block, head, batch) tiles a CTA
// computes, in which order. Every role of the CTA (the producer thread and each consumer
// warpgroup) walks the same sequence of tiles through for_each_fa3_tile, so their pipeline
// positions agree without communicating.
//
// Non-persistent configs: one tile per CTA, from blockIdx (row blocks of one head adjacent in the
// grid, so the CTAs resident together share that head's K/V in L2; the heaviest causal block first).
// Persistent configs (Fa3Config::kPersistent): min(units, SMs) CTAs, CTA x walking work units
// x, x + gridDim.x, ...; a unit is two row blocks of equal total causal cost, and units come in
// L2-sized head groups (common/tile_order.h, which the CPU tests check).
#pragma once

#include "common/tile_order.h"
#include "cuda/prefill/fa3_params.h"

namespace flashcpp::cuda {

/// One (row block, head, batch) tile of the launch.
struct Fa3Tile {
  int m_block, h, b;
};

/// %ctaid / %nctaid read anew where a role needs them (volatile: not merged with the kernel entry's
/// reads). A value computed before the producer / consumer split stays live into the producer's
/// small register budget, and ptxas then spills it for the whole kernel, consumers' hot loop included.
__device__ __forceinline__ int fresh_sreg_ctaid(int dim) {
  unsigned v;
  if (dim == 0)
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  else if (dim == 1)
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(v));
  else
    asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(v));
  return static_cast<int>(v);
}
__device__ __forceinline__ int fresh_sreg_nctaid_x() {
  unsigned v;
  asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(v));
  return static_cast<int>(v);
}

/// Tile `half` of work unit `i` (persistent: 0 the heavy row block, 1 the light one; m_block is -1
/// for the missing second tile of a one-tile unit). Non-persistent: the CTA's own tile.
template <class Cfg>
__device__ __forceinline__ Fa3Tile fa3_tile(const Fa3Params& p, int i, int half) {
  if constexpr (!Cfg::kPersistent) {
    return Fa3Tile{fresh_sreg_nctaid_x() - 1 - fresh_sreg_ctaid(0), fresh_sreg_ctaid(1), fresh_sreg_ctaid(2)};
  } else {
    const TileCoord c = persistent_tile(i, half, p.m_blocks, p.heads_q, p.batch, p.tile_heads);
    return Fa3Tile{c.m_block, c.h, c.b};
  }
}

/// Calls f(tile) for each tile of this CTA, in order (the same order in every role).
template <class Cfg, class F>
__device__ __forceinline__ void for_each_fa3_tile(const Fa3Params& p, F&& f) {
  constexpr int kHalves = Cfg::kPersistent ? 2 : 1;  // tiles per unit (persistent: heavy, then light)
  const int end = Cfg::kPersistent ? p.n_units : 1;
  for (int ti = Cfg::kPersistent ? fresh_sreg_ctaid(0) : 0, step = Cfg::kPersistent ? fresh_sreg_nctaid_x() : 1;
       ti < end; ti += step)
    for (int half = 0; half < kHalves; ++half) {
      const Fa3Tile tl = fa3_tile<Cfg>(p, ti, half);
      if (tl.m_block >= 0) f(tl);  // m_block < 0: a unit of one tile
    }
}

}  // namespace flashcpp::cuda
