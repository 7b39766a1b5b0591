// The epilogue of the sm90 prefill kernel, per consumer warpgroup: O / l into the warpgroup's own
// rows of the Q buffer (the same 128B-swizzled panels; every Q K^T of the tile is done), then out
// by one TMA store per 64-column panel (persistent configs, which then hand the Q buffer back to
// the producer) or by 16-byte coalesced stores; the LSE from each row's quad leader. Columns past
// head_dim_v (a head dim padded to the kernel's class) are outside the O map and skipped by the
// coalesced stores.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"
#include "cuda/common/hopper.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/prefill/fa3_mainloop.cuh"

namespace flashcpp::cuda {

/// Persistent, thread 0 of a consumer warpgroup: once the TMA store of its O rows has read shared
/// memory, hands Q buffer b back to the producer.
template <class Cfg, typename T>
__device__ __forceinline__ void fa3_release_q(const Fa3Consumer<Cfg, T>& cs, int b) {
  sm90::bulk_wait_read<0>();
  sm90::mbar_arrive(cs.sm.q_empty(b));
}

template <class Cfg, typename T>
__device__ __forceinline__ void fa3_epilogue(const Fa3Params& p, const Fa3Consumer<Cfg, T>& cs, const Fa3TileRows& tr,
                                             const float (&acc_o)[Cfg::kHeadDimV / 2], const RowSoftmax (&row)[2]) {
  constexpr int BM = Cfg::kBlockM, DC = Cfg::kHeadDimV / 8;
  const CtaWork& cta = cs.work();
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  const int c = cs.c, t = cs.t;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(row[r].l);
    inv[r] = row[r].finalize(l, p.score.c).inv;
    const int i = tr.row_base + 8 * r;
    if (p.lse != nullptr && t == 0 && i < cta.m_end) {
      // The ALiBi row term left out of the scores (fa3_scores): -slope * (row - ref), raw units.
      const float row_term = -alibi_slope_raw(p, tr.b, tr.h) * static_cast<float>(i + cta.rules.offset() - tr.alibi_ref);
      p.lse[cta.lse_row0 + i] = row[r].finalize(l, p.score.c, row_term).lse;
    }
  }
  unsigned char* sO = cs.q_base();  // this warpgroup's own rows of the tile's Q buffer
#pragma unroll
  for (int j = 0; j < DC; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tile_row = 64 * c + 16 * cs.warp + cs.g + 8 * r;
      *reinterpret_cast<std::uint32_t*>(sO + algebra::panel_offset<BM>(tile_row, j) + 4 * t) =
          ptx::pack2<T>(acc_o[4 * j + 2 * r] * inv[r], acc_o[4 * j + 2 * r + 1] * inv[r]);
    }
  if constexpr (Cfg::kPersistent) {
    // Every writer fences its generic-proxy writes for the TMA (async proxy) read; one thread
    // stores the warpgroup's 64 rows per panel (rows past the sequence's end are out of the map's
    // bounds and not written), waits until the copy has read shared memory, and hands the Q
    // buffer back to the producer.
    sm90::fence_proxy_async_smem();
    sm90::named_barrier_sync(1 + c, 128);
    if (cs.ct == 0) {
      const int q_x0 = varlen ? p.seqlen_q - cta.rules.seqlen_q : 0;
      const int q_c3 = varlen ? static_cast<int>(cta.q_row0) + cta.rules.seqlen_q : tr.b;
#pragma unroll
      for (int pn = 0; pn < Cfg::kPanelsV; ++pn)
        sm90::tma_store_4d(&p.tmap_o, pn * 64, q_x0 + tr.m0 + 64 * c, tr.h, q_c3, sO + pn * BM * 128 + 64 * c * 128);
      sm90::bulk_commit();
      if constexpr (!Cfg::kOverlapQ) fa3_release_q(cs, cs.q_buf());  // else after the next tile's first Q K^T
    }
  } else {
    sm90::named_barrier_sync(1 + c, 128);
    T* gO = static_cast<T*>(p.o) + (varlen ? cta.q_row0 * p.o_seq_stride : tr.b * p.o_batch_stride) + tr.h * p.o_head_stride;
    const int m_end = cta.m_end;
#pragma unroll
    for (int it = 0; it < 64 * DC / 128; ++it) {
      const int idx = cs.ct + it * 128;
      const int tile_row = 64 * c + idx / DC, j = idx % DC;
      if (tr.m0 + tile_row < m_end && j * 8 < p.head_dim_v) {  // the class's padding columns are not stored
        const uint4 val = *reinterpret_cast<const uint4*>(sO + algebra::panel_offset<BM>(tile_row, j));
        *reinterpret_cast<uint4*>(gO + static_cast<std::int64_t>(tr.m0 + tile_row) * p.o_seq_stride + j * 8) = val;
      }
    }
  }
}

}  // namespace flashcpp::cuda
