// FA3-style attention forward for sm_90a, in roles (each in its own header):
//   fa3_config.cuh     the tile configs and the CTA's shared memory
//   fa3_scheduler.cuh  which tiles a CTA computes (one, or a persistent walk over work units)
//   fa3_producer.cuh   one thread issues the TMA loads of Q and of the K/V ring (mbarriers)
//   fa3_mainloop.cuh   consumer warpgroups (setmaxnreg) run Q K^T, softmax, P V with wgmma:
//                      plain, or pipelined with ping-pong turns
//   fa3_epilogue.cuh   O / l and the LSE out (TMA store or coalesced stores)
// A CTA is one producer warpgroup and 2 or 3 consumer warpgroups of 64 query rows each.
//
// Masks: the same CtaWork as the sm80 kernel (prefill_mask.cuh): the producer and the consumers
// walk the same key tiles (window range, then attention sinks, or the listed blocks of a
// block-sparse mask); softcap and ALiBi rewrite S in raw units before the element mask (runtime
// flags, uniform branches). Rotary (kRotary, prefill_rope.cuh): each consumer warpgroup rotates
// its 64 rows of the Q tile in shared memory after q_full, fences them for wgmma and syncs its 128
// threads; the K/V loads of the first stages proceed meanwhile. The keys were rotated by a pre-pass.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/hopper.cuh"
#include "cuda/common/pipeline.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/prefill/fa3_config.cuh"
#include "cuda/prefill/fa3_epilogue.cuh"
#include "cuda/prefill/fa3_mainloop.cuh"
#include "cuda/prefill/fa3_params.h"
#include "cuda/prefill/fa3_producer.cuh"
#include "cuda/prefill/fa3_scheduler.cuh"
#include "cuda/prefill/prefill_mask.cuh"
#include "cuda/prefill/prefill_rope.cuh"

namespace flashcpp::cuda {

/// One consumer warpgroup over its tiles: per tile wait for Q (and its CtaWork record), rotate its
/// rows of Q when rotary is on, run the mainloop, write the epilogue. Across tiles it counts its
/// K/V ring uses and its Q barrier phases as the producer does.
template <class Cfg, typename T>
__device__ __forceinline__ void fa3_consumer(const Fa3Params& p, const Fa3Smem<Cfg, T>& sm, int c, int ct) {
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kHeadDimV, BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  Fa3Consumer<Cfg, T> cs(sm, c, ct);
  const bool rotary = !Cfg::kLeanMask && (p.mask.flags & PrefillMask::kRotary);  // lean configs take no rotary
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  // Rotary without a cache: this warpgroup's copy of inv_freq in shared memory (a warp reads 16
  // different pairs at once: one shared-memory access, but 16 serialized kernel-parameter reads).
  double* inv_freq = sm.inv_freq(c);
  if (rotary && p.rope.tables.cos == nullptr) {
    for (int i = ct; i < p.rope.half; i += 128) inv_freq[i] = p.rope.inv_freq[i];
    sm90::named_barrier_sync(1 + c, 128);
  }
  PipelineState<Cfg::kStages> kv;
  PipelineState<Cfg::kQBufs> q;  // tiles: the Q buffer and its barriers' phases
  // Cfg::kOverlapQ: the previous tile's buffer is released (after the O store has read it) only once
  // this tile's first Q K^T is queued, so thread 0 does not hold up its warpgroup's first issue
  // window; the producer needs that buffer a tile later. -1 when no release is pending.
  int pending = -1;
  auto release_pending = [&] {
    if constexpr (Cfg::kOverlapQ)
      if (pending >= 0) {
        if (ct == 0) fa3_release_q(cs, pending);
        pending = -1;
      }
  };
  constexpr int kHalves = Cfg::kPersistent ? 2 : 1;
  const int tile_end = Cfg::kPersistent ? p.n_units : 1;
  for (int ti = Cfg::kPersistent ? fresh_sreg_ctaid(0) : 0, step = Cfg::kPersistent ? fresh_sreg_nctaid_x() : 1; ti < tile_end; ti += step)
  for (int half = 0; half < kHalves; ++half) {
    const Fa3Tile tl = fa3_tile<Cfg>(p, ti, half);
    if (tl.m_block < 0) continue;
    const int m0 = tl.m_block * BM;
    if constexpr (Cfg::kPersistent)
      if (!tile_exists(p, tl.b, m0)) continue;
    const int row_base = m0 + 64 * c + 16 * cs.warp + cs.g;  // query row of this thread's r = 0 values
    float acc_o[DV / 2];
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) acc_o[i] = 0.f;
    RowSoftmax row[2];

    cs.use_q_buf(q.stage());
    sm90::mbar_wait(sm.q_full(q.stage()), q.phase());
    const CtaWork& cta = cs.work();  // this tile's until this warpgroup arrives on q_empty
    const int n_iters = cta.n_iters;
    const PlainIters plain = plain_iters<BN>(p, cta, m0);
    if (rotary) {
      // This warpgroup's 64 rows of Q, rotated in place (generic-proxy writes, fenced for the wgmma
      // reads of the async proxy), then its 128 threads meet before the first Q K^T. Items per
      // round: 4, or fewer where the persistent consumers' registers are short.
      const int r0 = m0 + 64 * c;
      rope_tile<T, Cfg::kPersistent ? (D > 128 ? 1 : 2) : 4>(
          p.rope, inv_freq, rope_seq_positions(p.rope.positions_q, varlen, cta.q_row0, tl.b, p.seqlen_q), r0,
          cta.rules.seqlen_k - cta.rules.seqlen_q, max(0, min(64, cta.m_end - r0)), ct, 128,
          [sq = ptx::smem_u32(cs.q_base()), c](int r, int col) {
            return sq + algebra::panel_offset<BM>(64 * c + r, col >> 3) + (col & 7) * 2;
          });
      sm90::fence_proxy_async_smem();
      sm90::named_barrier_sync(1 + c, 128);
    }
    const Fa3TileRows tr{tl.h, tl.b, m0, row_base, m0 + cta.rules.offset(), plain};
    if constexpr (Cfg::kPingPong)
      fa3_mainloop_pingpong(p, cs, tr, acc_o, row, kv, n_iters, release_pending);
    else
      fa3_mainloop_plain(p, cs, tr, acc_o, row, kv, n_iters, release_pending);
    kv += n_iters;
    fa3_epilogue(p, cs, tr, acc_o, row);
    if constexpr (Cfg::kOverlapQ) pending = cs.q_buf();
    ++q;
  }
  release_pending();
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fa3_forward_kernel(const __grid_constant__ Fa3Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a pass
  const Fa3Smem<Cfg, T> sm;
  const int tid = threadIdx.x, wg = tid / 128;
  // The tile's CtaWork record in shared memory. Non-persistent: every thread computes it (the exit
  // must be uniform), thread 0 stores it, the barrier-init __syncthreads publishes it. Persistent:
  // the producer stores each tile's record before its Q load, the consumers read it after q_full.
  if constexpr (!Cfg::kPersistent) {
    const Fa3Tile tl = fa3_tile<Cfg>(p, 0, 0);
    CtaWork w;
    if (!make_cta_work<Cfg::kBlockM, Cfg::kBlockN>(p, tl.b, tl.h, tl.m_block * Cfg::kBlockM, &w)) return;
    if (tid == 0) sm.work() = w;
  }
  if (tid == 0) {
    for (int b = 0; b < Cfg::kQBufs; ++b) {
      sm90::mbar_init(sm.q_full(b), 1);
      sm90::mbar_init(sm.q_empty(b), Cfg::kConsumers);
    }
    for (int s = 0; s < Cfg::kStages; ++s) {
      sm90::mbar_init(sm.k_full(s), 1);
      sm90::mbar_init(sm.v_full(s), 1);
      sm90::mbar_init(sm.k_empty(s), 4 * Cfg::kConsumers);  // one arrival per consumer warp
      sm90::mbar_init(sm.v_empty(s), 4 * Cfg::kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {
    sm90::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid == 0) fa3_producer<Cfg, T>(p, sm);
    return;
  }
  sm90::setmaxnreg_inc<Cfg::kConsumerRegs>();
  fa3_consumer<Cfg, T>(p, sm, wg - 1, tid - 128 * wg);
#else
  __trap();  // never launched: dispatch picks this kernel only on sm_90 devices
#endif
}

}  // namespace flashcpp::cuda
