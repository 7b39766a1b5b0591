// The consumer role of the sm90 prefill kernel: each consumer warpgroup owns 64 query rows of the
// tile and runs, per key block,
//   wait K full -> S = Q K^T (wgmma.ss, D/16 k-steps) -> release K -> transform + mask (boundary
//   tiles only) -> online softmax (common/softmax.cuh, lazy rescale) -> P to 16-bit A fragments ->
//   wait V full -> O = O * corr + P V (wgmma.rs, BlockN/16 k-steps) -> release V.
// Two schedules of that recurrence:
//   plain (fa3_mainloop_plain): the steps in sequence. The only consumer that reads block-sparse
//     element bits (the pipelined one has no registers left for them; dispatch knows).
//   pipelined (fa3_mainloop_pingpong): Q K^T of block j is issued together with P V of block j-1,
//     so the softmax of j runs while P V of j-1 occupies the tensor cores; with kSched the
//     warpgroups also take turns issuing (named barriers), so one warpgroup's softmax runs under
//     the other's products (the default: it beats plain on every shape measured, reports/hopper).
// K and V of a stage are released apart: K as soon as Q K^T has read it, V after P V. With one
// release for both, the pipelined consumer (P V of j-1 still reading its stage while the softmax
// of j runs) freed the stage of block j+1's keys only after that softmax, and with two stages the
// Q K^T of j+1 then waited for a fresh load every block.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"
#include "cuda/common/hopper.cuh"
#include "cuda/common/pipeline.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/prefill/fa3_config.cuh"
#include "cuda/prefill/prefill_mask.cuh"

namespace flashcpp::cuda {

/// One consumer warpgroup: where its operands live and the steps of one key block.
template <class Cfg, typename T>
struct Fa3Consumer {
  static constexpr int D = Cfg::kHeadDim, DV = Cfg::kHeadDimV, BN = Cfg::kBlockN;
  static constexpr int NC = BN / 8;  ///< n8 column chunks of S per row
  static constexpr int DC = DV / 8;  ///< n8 column chunks of O per row
  Fa3Smem<Cfg, T> sm;  // empty: its accessors read the shared-memory symbol
  int c;        ///< consumer warpgroup: rows [64c, 64c + 64) of the tile
  int ct;       ///< thread inside the warpgroup
  int warp, lane, g, t;
  /// wgmma descriptors of this warpgroup's Q rows and of stage 0's K and V, first k-step. A
  /// descriptor's address field is (addr >> 4) in 14 bits and every operand lies below 2^18 bytes,
  /// so a descriptor advances by adding (bytes >> 4): each k-step and stage below is a compile-time
  /// offset and one 64-bit add. The warpgroup index is broadcast (shfl) so that the compiler sees
  /// it as warp-uniform and keeps the descriptors in uniform registers; building each descriptor
  /// from a per-thread address instead cost ~120 instructions per key block inside the ping-pong
  /// issue window (ncu, d128: 184 instructions from turn to hand-over, now 80).
  std::uint64_t q_desc, k_desc, v_desc;
  /// The Q buffer of the current tile (persistent configs with two: it alternates per tile).
  int qb = 0;

  __device__ __forceinline__ Fa3Consumer(const Fa3Smem<Cfg, T>& sm_, int c_, int ct_)
      : sm(sm_), c(c_), ct(ct_), warp(ct_ / 32), lane(ct_ % 32), g(ct_ % 32 / 4), t(ct_ % 4) {
    const int cu = __shfl_sync(0xffffffffu, c_, 0);
    q_desc = sm90::make_desc(ptx::smem_u32(sm_.q()) + 64 * cu * 128, 16, 1024);
    k_desc = sm90::make_desc(ptx::smem_u32(sm_.k()), 16, 1024);
    v_desc = sm90::make_desc(ptx::smem_u32(sm_.v()), BN * 128, 1024);
  }
  /// Descriptor d advanced by `bytes`.
  __device__ __forceinline__ static std::uint64_t advance(std::uint64_t d, int bytes) {
    return d + static_cast<std::uint64_t>(bytes >> 4);
  }
  /// The current Q buffer (a constant 0 with one buffer), its tile's CtaWork record and its base.
  __device__ __forceinline__ int q_buf() const {
    if constexpr (Cfg::kQBufs == 1) return 0;
    else return qb;
  }
  __device__ __forceinline__ const CtaWork& work() const { return sm.work(q_buf()); }
  __device__ __forceinline__ unsigned char* q_base() const { return sm.base(q_buf()); }
  /// Moves to Q buffer b (a no-op with one buffer): q_desc moves by one buffer, forward or back.
  __device__ __forceinline__ void use_q_buf(int b) {
    if constexpr (Cfg::kQBufs > 1) {
      if (b != qb) q_desc = b > qb ? advance(q_desc, Cfg::kQBytes) : q_desc - static_cast<std::uint64_t>(Cfg::kQBytes >> 4);
      qb = b;
    }
  }

  /// Issue S = Q K^T for stage s (Cfg::kQkDims / 16 k-steps, D / 16 but in a twin for smaller head
  /// dims; the first overwrites S).
  __device__ __forceinline__ void issue_qk(float (&s_acc)[BN / 2], int s) const {
    const std::uint64_t kd = advance(k_desc, s * Cfg::kKBytes);
#pragma unroll
    for (int kk = 0; kk < Cfg::kQkDims / 16; ++kk) {
      const int pn = kk / 4, off = (kk % 4) * 32;  // 64-column panel, then 32 bytes per k16 step
      sm90::wgmma_ss<BN, T>(s_acc, advance(q_desc, pn * Cfg::kBlockM * 128 + off), advance(kd, pn * BN * 128 + off),
                            kk > 0 ? 1 : 0);
    }
  }
  /// Issue O += P V for stage s (N = the v/o class DV): 16 keys = 2 K-groups of 8 rows x 128 B per
  /// k-step; panels of 64 head-dim columns are BN*128 B apart (the MN-major leading byte offset).
  __device__ __forceinline__ void issue_pv(float (&o)[DV / 2], const std::uint32_t (&pa)[BN / 16][4], int s) const {
    const std::uint64_t vd = advance(v_desc, s * Cfg::kVBytes);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) sm90::wgmma_rs<DV, T>(o, pa[kk], advance(vd, kk * 16 * 128), 1);
  }
  /// P as wgmma A fragments: k16 step kk covers S chunks 2kk (a0, a1) and 2kk+1 (a2, a3).
  __device__ __forceinline__ void pack_p(const float (&s_acc)[BN / 2], std::uint32_t (&pa)[BN / 16][4]) const {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = ptx::pack2<T>(s_acc[8 * kk + 2 * e], s_acc[8 * kk + 2 * e + 1]);
  }
  __device__ __forceinline__ void release_k(int s) const {
    if (lane == 0) sm90::mbar_arrive(sm.k_empty(s));
  }
  __device__ __forceinline__ void release_v(int s) const {
    if (lane == 0) sm90::mbar_arrive(sm.v_empty(s));
  }
  /// The online softmax of a block (lazy rescale): S becomes P, corr[r] is row r's O factor.
  __device__ __forceinline__ void softmax(float (&s_acc)[BN / 2], RowSoftmax (&row)[2], float c_fold, float (&corr)[2]) const {
    softmax_block<NC, true>([&](int j, int k) -> float& { return s_acc[4 * j + k]; }, row, c_fold, corr);
  }
  /// O *= corr, skipped for a warp none of whose rows moved its reference max (most blocks).
  __device__ __forceinline__ void rescale_o(float (&o)[DV / 2], const float (&corr)[2]) const {
    rescale_rows_if_moved<DC>([&](int j, int k) -> float& { return o[4 * j + k]; }, corr);
  }
};

/// What a consumer warpgroup needs of the current tile.
struct Fa3TileRows {
  int h, b, m0;
  int row_base;   ///< query row of this thread's r = 0 values (r = 1: + 8)
  int alibi_ref;  ///< ALiBi reference key position: the tile's first query row, bottom-right aligned
  PlainIters plain;  ///< iterations that skip scores() outright (two register compares)
};

/// Softcap and ALiBi (raw units), then the element mask of a boundary or partial tile (interior
/// tiles skip it). s_acc[4j + 2r + e] is row row_base + 8r, key n0 + 8j + 2t + e.
/// ALiBi adds only its column term slope * (key - ref): the row term -slope * (row - ref) is a
/// per-row constant, which the softmax ignores, and the epilogue adds it to the LSE
/// (RowSoftmax::finalize's shift). One FFMA per column pair (shared by both rows) and one FADD per
/// score, instead of an FADD and an FFMA per score.
template <class Cfg, typename T>
__device__ __forceinline__ void fa3_scores(const Fa3Params& p, const Fa3Consumer<Cfg, T>& cs, const Fa3TileRows& tr,
                                           float (&s_acc)[Cfg::kBlockN / 2], int it) {
  constexpr int BN = Cfg::kBlockN, NC = BN / 8;
  if (tr.plain.contains(it)) return;  // no record lookup on the hot path
  const CtaWork& cta = cs.work();
  if constexpr (Cfg::kLeanMask) {
    // A window walk without sinks: tile it is n_last - it (make_cta_work). Two rule registers.
#pragma unroll
    for (int r = 0; r < 2; ++r)
      mask_row_lean<NC>([&](int j, int k) -> float& { return s_acc[4 * j + k]; }, r, tr.row_base + 8 * r, cs.t,
                        (cta.n_last - it) * BN, cta.rules);
    return;
  }
  const KeyTile kt = cta.key_tile<BN>(it);
  const int n0 = kt.n0, t = cs.t;
  const MaskRules& rules = cta.rules;
  if (p.mask.flags & (PrefillMask::kSoftcap | PrefillMask::kAlibi)) {
    if (p.mask.flags & PrefillMask::kSoftcap) {
#pragma unroll
      for (int e = 0; e < BN / 2; ++e) s_acc[e] = p.score.softcap(s_acc[e]);
    }
    if (p.mask.flags & PrefillMask::kAlibi) {
      const float slope = alibi_slope_raw(p, tr.b, tr.h);
      const float base = slope * static_cast<float>(n0 + 2 * t - tr.alibi_ref);  // |n0 + 2t - ref| < 2^24: exact
#pragma unroll
      for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float bias = fmaf(slope, static_cast<float>(8 * j + e), base);
          s_acc[4 * j + e] += bias;
          s_acc[4 * j + 2 + e] += bias;
        }
    }
  }
  if (kt.partial < 0 && rules.tile_fully_visible(tr.m0, cta.m_end, n0, n0 + BN)) return;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    mask_row<NC, !Cfg::kPingPong>([&](int j, int k) -> float& { return s_acc[4 * j + k]; }, r, tr.row_base + 8 * r, t, kt,
                                  rules, p.mask, cta.bs_q0);
}

/// The plain schedule over one tile's n_iters key blocks; kv = the ring position of block 0.
/// after_first_qk runs once block 0's Q K^T is queued (the previous tile's deferred epilogue work).
template <class Cfg, typename T, class F>
__device__ __forceinline__ void fa3_mainloop_plain(const Fa3Params& p, const Fa3Consumer<Cfg, T>& cs, const Fa3TileRows& tr,
                                                   float (&acc_o)[Cfg::kHeadDimV / 2], RowSoftmax (&row)[2],
                                                   PipelineState<Cfg::kStages> kv, int n_iters, F&& after_first_qk) {
  float s_acc[Cfg::kBlockN / 2];
  std::uint32_t pa[Cfg::kBlockN / 16][4];
  float corr[2];
  if (n_iters <= 0) after_first_qk();
  for (int it = 0; it < n_iters; ++it) {
    const PipelineState<Cfg::kStages> u = kv + it;
    const int s = u.stage();
    sm90::mbar_wait(cs.sm.k_full(s), u.phase());
    sm90::wgmma_fence();
    cs.issue_qk(s_acc, s);  // S = Q K^T
    sm90::wgmma_commit();
    if (it == 0) after_first_qk();
    sm90::wgmma_wait<0>();
    cs.release_k(s);
    fa3_scores(p, cs, tr, s_acc, it);  // transform, mask
    cs.softmax(s_acc, row, p.score.c, corr);   // P, (m, l)
    cs.rescale_o(acc_o, corr);      // O *= corr
    cs.pack_p(s_acc, pa);
    sm90::mbar_wait(cs.sm.v_full(s), u.phase());
    sm90::wgmma_fence();
    cs.issue_pv(acc_o, pa, s);  // O += P V
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    cs.release_v(s);
  }
}

/// The pipelined schedule (Q K^T of block it with P V of block it-1), with ping-pong turns when
/// Cfg::kSched: warpgroup c waits on its scheduler barrier before issuing, then hands the turn to
/// the next (round robin). Warpgroup 0 goes first; the last warpgroup skips its last hand-over so
/// that every barrier sees exactly as many arrivals as waits (n_iters + 1 issue windows each).
/// after_first_qk as in the plain schedule (outside the issue window).
template <class Cfg, typename T, class F>
__device__ __forceinline__ void fa3_mainloop_pingpong(const Fa3Params& p, const Fa3Consumer<Cfg, T>& cs, const Fa3TileRows& tr,
                                                      float (&acc_o)[Cfg::kHeadDimV / 2], RowSoftmax (&row)[2],
                                                      PipelineState<Cfg::kStages> kv, int n_iters, F&& after_first_qk) {
  if (n_iters <= 0) return after_first_qk();
  const int c = cs.c;
  // Scheduler barrier ids: after the per-warpgroup ones (1 .. kConsumers).
  constexpr int kSched = 1 + Cfg::kConsumers, kLast = Cfg::kConsumers - 1;
  auto window_begin = [&] {
    if constexpr (Cfg::kSched) sm90::named_barrier_sync(kSched + c, 256);
  };
  auto window_end = [&](bool last) {
    if constexpr (Cfg::kSched)
      // The next warpgroup, round robin. Spelled 1 - c for two: (c + 1) % kConsumers measured
      // other ptxas spills in the two-warpgroup configs (d128 persistent 8 -> 12 bytes).
      if (c != kLast || !last)
        sm90::named_barrier_arrive(kSched + (Cfg::kConsumers == 2 ? 1 - c : c == kLast ? 0 : c + 1), 256);
  };
  float s_acc[Cfg::kBlockN / 2];
  std::uint32_t pa[Cfg::kBlockN / 16][4];
  float corr[2];
  if constexpr (Cfg::kSched)
    if (c == kLast) sm90::named_barrier_arrive(kSched + 0, 256);
  // Block 0: Q K^T alone.
  sm90::mbar_wait(cs.sm.k_full(kv.stage()), kv.phase());
  window_begin();
  sm90::wgmma_fence();
  cs.issue_qk(s_acc, kv.stage());
  sm90::wgmma_commit();
  window_end(false);
  after_first_qk();
  sm90::wgmma_wait<0>();
  cs.release_k(kv.stage());
  fa3_scores(p, cs, tr, s_acc, 0);
  cs.softmax(s_acc, row, p.score.c, corr);
  cs.pack_p(s_acc, pa);
  // Steady state: Q K^T of block it and P V of block it-1 in flight together.
  for (int it = 1; it < n_iters; ++it) {
    const PipelineState<Cfg::kStages> u = kv + it, up = kv + (it - 1);
    const int s = u.stage(), sp = up.stage();
    sm90::mbar_wait(cs.sm.k_full(s), u.phase());
    window_begin();
    sm90::wgmma_fence();
    cs.issue_qk(s_acc, s);
    sm90::wgmma_commit();
    // V of block it-1 is awaited inside the window, once Q K^T is queued: the values usually landed
    // long ago, and waiting for them before the turn measured 1-2% slower (reports/hopper).
    sm90::mbar_wait(cs.sm.v_full(sp), up.phase());
    cs.issue_pv(acc_o, pa, sp);
    sm90::wgmma_commit();
    window_end(false);
    sm90::wgmma_wait<1>();  // S of block it is ready; P V of it-1 may still run
    cs.release_k(s);        // the producer may load block it+S's keys while the softmax runs
    // Softmax of block it overlaps P V of block it-1 only if the wait below stays below it.
    sm90::in_own_block(it > n_iters /*never*/, [&] {
      fa3_scores(p, cs, tr, s_acc, it);
      cs.softmax(s_acc, row, p.score.c, corr);
    });
    sm90::wgmma_wait<0>();  // P V of it-1 done: its values are free, O can be rescaled
    cs.release_v(sp);
    cs.rescale_o(acc_o, corr);
    cs.pack_p(s_acc, pa);
  }
  // Last block: P V alone.
  const PipelineState<Cfg::kStages> ul = kv + (n_iters - 1);
  sm90::mbar_wait(cs.sm.v_full(ul.stage()), ul.phase());
  window_begin();
  sm90::wgmma_fence();
  cs.issue_pv(acc_o, pa, ul.stage());
  sm90::wgmma_commit();
  window_end(true);
  sm90::wgmma_wait<0>();
  cs.release_v(ul.stage());
}

}  // namespace flashcpp::cuda
