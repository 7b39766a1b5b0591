// The producer role of the sm90 prefill kernel: one thread of the producer warpgroup issues every
// TMA load of the CTA, and sleeps in its barrier waits (mbar_wait_sleep) rather than spinning on
// the scheduler it shares with consumer warps. Per tile: the Q tile (one box per 64-column panel) on q_full, then each key
// tile's K and V into the next ring stage, each on its own barrier and released by the consumers
// apart (k_empty after Q K^T has read the keys, v_empty after P V has read the values), so the
// keys of block j+S can land while the values of block j are still in use.
//
// Persistent configs overlap tiles. With two Q buffers (d64, d128) the next tile's Q (and its
// CtaWork record, which the consumers read after the Q barrier) loads as soon as the tile before
// the current one has released its buffer (q_empty), then its K/V follow the current tile's into
// the ring. With one (d256) the first S key tiles of the next tile load while the consumers finish
// the current one, and its Q waits until every consumer warpgroup has stored O out of the buffer.
//
// Varlen: each sequence is loaded through the same rank-4 tensor maps with a shifted origin
// (fa3_dispatch.cc, encode_map): coordinate (x, seq_end) addresses packed row x + seq_end - max_len,
// and x >= max_len is out of bounds, so TMA zero-fills exactly the rows past the sequence's end.
#pragma once

#include <cstdint>

#include "cuda/common/hopper.cuh"
#include "cuda/common/pipeline.cuh"
#include "cuda/prefill/fa3_config.cuh"
#include "cuda/prefill/fa3_scheduler.cuh"

namespace flashcpp::cuda {

template <class Cfg, typename T>
__device__ __forceinline__ void fa3_producer(const Fa3Params& p, const Fa3Smem<Cfg, T>& sm) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, S = Cfg::kStages;
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  PipelineState<S> kv;  // K/V stage uses, across tiles
  PipelineState<Cfg::kQBufs> q;  // tiles (the Q buffer and its barriers' phases)
  for_each_fa3_tile<Cfg>(p, [&](const Fa3Tile& tl) {
    const int m0 = tl.m_block * BM, hk = tl.h / p.group;
    CtaWork own;  // persistent: this tile's record, computed here (the shared one may still be in use)
    if constexpr (Cfg::kPersistent)
      if (!make_cta_work<BM, BN>(p, tl.b, tl.h, m0, &own)) return;
    const CtaWork& w = Cfg::kPersistent ? own : sm.work();
    // Tensor-map coordinates (row, outer) of this sequence's first row: (0, b), or with varlen
    // (max_len - len, first_row + len) of the shifted maps.
    const int q_x0 = varlen ? p.seqlen_q - w.rules.seqlen_q : 0;
    const int q_c3 = varlen ? static_cast<int>(w.q_row0) + w.rules.seqlen_q : tl.b;
    const int k_x0 = varlen ? p.seqlen_k - w.rules.seqlen_k : 0;
    const int k_c3 = varlen ? static_cast<int>(w.k_row0) + w.rules.seqlen_k : tl.b;
    auto load_kv = [&](int it) {
      const int s = kv.stage();
      const int n0 = w.key_n0<BN>(it);
      sm90::mbar_wait_sleep(sm.k_empty(s), kv.empty_phase());
      sm90::mbar_expect_tx(sm.k_full(s), Cfg::kKBytes);
#pragma unroll
      for (int pn = 0; pn < Cfg::kPanels; ++pn)
        sm90::tma_load_4d(sm.k() + (s * Cfg::kPanels + pn) * BN * 64, &p.tmap_k, pn * 64, k_x0 + n0, hk, k_c3, sm.k_full(s));
      sm90::mbar_wait_sleep(sm.v_empty(s), kv.empty_phase());
      sm90::mbar_expect_tx(sm.v_full(s), Cfg::kVBytes);
#pragma unroll
      for (int pn = 0; pn < Cfg::kPanelsV; ++pn)
        sm90::tma_load_4d(sm.v() + (s * Cfg::kPanelsV + pn) * BN * 64, &p.tmap_v, pn * 64, k_x0 + n0, hk, k_c3, sm.v_full(s));
      ++kv;
    };
    const int qs = q.stage();
    auto load_q = [&] {
      if constexpr (Cfg::kPersistent) {
        if (q.count > 0) sm90::mbar_wait_sleep(sm.q_empty(qs), q.empty_phase());
        sm.work(qs) = w;  // published by the Q barrier (this thread's arrive.expect_tx releases it)
      }
      sm90::mbar_expect_tx(sm.q_full(qs), Cfg::kQBytes);
#pragma unroll
      for (int pn = 0; pn < Cfg::kPanels; ++pn)
        sm90::tma_load_4d(sm.q(qs) + pn * BM * 64, &p.tmap_q, pn * 64, q_x0 + m0, tl.h, q_c3, sm.q_full(qs));
    };
    // Persistent: the next tile's first S key tiles load while the consumers finish this one. With
    // two Q buffers (kOverlapQ) its Q goes first (its buffer was freed a tile ago); with one, Q waits
    // for the current tile's epilogue, so the keys go first.
    const int early = Cfg::kPersistent && !Cfg::kOverlapQ ? min(S, w.n_iters) : 0;
    if constexpr (Cfg::kOverlapQ) load_q();
    for (int it = 0; it < early; ++it) load_kv(it);
    if constexpr (!Cfg::kOverlapQ) load_q();
    for (int it = early; it < w.n_iters; ++it) load_kv(it);
    ++q;
  });
}

}  // namespace flashcpp::cuda
