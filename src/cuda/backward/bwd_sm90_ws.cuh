// The warp-specialized wgmma backward (sm_90a): bwd_sm90.cuh's products in roles, as FA3's hopper/
// backward splits them. Three warpgroups:
//   warpgroup 0, warp 0   producer (one thread): walks the CTA's (query head, query tile) pairs and
//                         loads each pair's Q and dO (TMA) and its LSE and D rows (bulk copies)
//                         into a two-stage ring, with a small record (tile, head, mask flag) per
//                         stage; completion on the stage's mbarrier;
//   warpgroup 0, warp 1   dQ writer: adds each consumer's staged 64 x 64 dQ piece to the fp32
//                         accumulator (TMA reduce-adds), and in deterministic mode takes the query
//                         tile's turn for the CTA;
//   warpgroups 1 and 2    consumers (setmaxnreg 240): 64 keys each, dK and dV in registers; per pair
//                         S^T, dP^T (SS wgmma), P while dP^T runs, dV += P^T dO (RS) while dS is
//                         formed, dS^T to shared memory (two buffers), dQ = dS K (SS, both
//                         MN-major) after the two consumers' barrier, dK += dS^T Q (RS) while dQ's
//                         piece is staged; at the class 128 dK runs on into the next pair's S^T.
// With the loads, the walk and the reductions off the consumers, their registers hold the
// accumulators and little else, so the wgmmas stay pipelined (bwd_sm90.cuh's single-role kernel
// needs 255 registers and ptxas serializes them).
//
// Problems with softcap, ALiBi or block-sparse masks run the single-role kernel (the selector's
// rule): the element mask here is MaskRules' window.
#pragma once

#include "cuda/backward/bwd_sm90.cuh"

namespace flashcpp::cuda {

/// The single-role config's tiles and buffers (BwdSm90Config), in three warpgroups, with a second
/// dS^T buffer and room for the stage records and barriers.
template <int HeadDim, int BlockM>
struct BwdWsConfig : BwdSm90Config<HeadDim, BlockM> {
  using Base = BwdSm90Config<HeadDim, BlockM>;
  static constexpr int kWarps = 12;
  static constexpr int kThreads = 384;
  static constexpr bool kWs = true;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // A pair's dK runs on into the next pair's S^T and dP^T (its stage is released after they are
  // queued). At the class 64 the S^T and dP^T accumulators are twice as large (64 keys x 128
  // queries) and ptxas serializes the wgmmas for want of registers, so there each pair ends with
  // its dK done.
  static constexpr bool kOverlapPairs = HeadDim == 128;
  // setmaxnreg moves registers within the launch allocation (384 threads x 168): the total must not
  // exceed it, or the consumers' setmaxnreg.inc waits forever (32 + 2 x 240 hung on the H200).
  static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= 168 * 384, "register file");
  // One staged 64 x 64 fp32 dQ piece per consumer, added by the writer's TMA. Adding it from the
  // consumers' registers (eight-byte reductions) ran slower, and so did a second staging per
  // consumer (225 KB of shared memory; likely cause, not yet profiled: less L1 left for the
  // producer's spills). reports/backward/README.md has the figures.
  static constexpr int kSmemDqPiece = Base::kSmemDq / 2;  ///< one consumer's staged 64 x 64 fp32 dQ piece
  static constexpr int kSmemBytes = 2 * Base::kSmemKV + 4 * Base::kSmemQ + 2 * Base::kSmemDs + Base::kSmemDq +
                                    2 * Base::kSmemRows + 1024;  // + records, barriers
};

/// What the producer tells the consumers about a stage. m < 0: no more pairs.
struct BwdWsRecord {
  int m, gi, need_mask, pad;
};
/// What a consumer tells the dQ writer about its staged piece. m < 0: that consumer is done.
struct BwdWsPiece {
  int m, gi, pad0, pad1;
};

template <class Cfg>
struct BwdWsSmem {
  unsigned char* base;
  static constexpr int kV = Cfg::kSmemKV, kQ = 2 * Cfg::kSmemKV, kDo = kQ + 2 * Cfg::kSmemQ,
                       kDs = kDo + 2 * Cfg::kSmemQ, kDq = kDs + 2 * Cfg::kSmemDs, kRows = kDq + Cfg::kSmemDq,
                       kMisc = kRows + 2 * Cfg::kSmemRows;
  __device__ __forceinline__ unsigned char* k_ptr() const { return base; }
  __device__ __forceinline__ unsigned char* v_ptr() const { return base + kV; }
  __device__ __forceinline__ unsigned char* q_ptr(int st) const { return base + kQ + st * Cfg::kSmemQ; }
  __device__ __forceinline__ unsigned char* dout_ptr(int st) const { return base + kDo + st * Cfg::kSmemQ; }
  __device__ __forceinline__ std::uint32_t k() const { return ptx::smem_u32(base); }
  __device__ __forceinline__ std::uint32_t v() const { return ptx::smem_u32(base + kV); }
  __device__ __forceinline__ std::uint32_t q(int st) const { return ptx::smem_u32(base + kQ + st * Cfg::kSmemQ); }
  __device__ __forceinline__ std::uint32_t dout(int st) const { return ptx::smem_u32(base + kDo + st * Cfg::kSmemQ); }
  __device__ __forceinline__ unsigned char* ds(int b) const { return base + kDs + b * Cfg::kSmemDs; }
  __device__ __forceinline__ unsigned char* dq_stage(int wg) const { return base + kDq + wg * Cfg::kSmemDqPiece; }
  __device__ __forceinline__ float* rows(int st) const {
    return reinterpret_cast<float*>(base + kRows) + st * 2 * Cfg::kBlockM;
  }
  __device__ __forceinline__ BwdWsRecord* record(int st) const {
    return reinterpret_cast<BwdWsRecord*>(base + kMisc) + st;
  }
  __device__ __forceinline__ BwdWsPiece* piece(int wg) const {
    return reinterpret_cast<BwdWsPiece*>(base + kMisc + 64) + wg;
  }
  __device__ __forceinline__ std::uint64_t* full(int st) const {
    return reinterpret_cast<std::uint64_t*>(base + kMisc + 128) + st;
  }
  __device__ __forceinline__ std::uint64_t* empty(int st) const {
    return reinterpret_cast<std::uint64_t*>(base + kMisc + 128) + 2 + st;
  }
  __device__ __forceinline__ std::uint64_t* kv_full() const {
    return reinterpret_cast<std::uint64_t*>(base + kMisc + 128) + 4;
  }
};

// Named barriers (0 is __syncthreads): the consumers' dS^T barrier, and per consumer the dQ
// staging's full and empty hand-overs with the writer warp (128 + 32 threads).
inline constexpr int kBwdBarDs = 1, kBwdBarDqFull = 2, kBwdBarDqEmpty = 4;

/// Byte offset of fp32 (row, col) of a staged 64 x 64 dQ piece: two boxes of 32 columns, each 64
/// rows of 128 bytes in the TMA 128-byte swizzle (16-byte chunk index XOR row % 8).
__device__ __forceinline__ int bwd_ws_dq_offset(int row, int col) {
  return (col >> 5) * 8192 + row * 128 + ((((col & 31) >> 2) ^ (row & 7)) << 4) + (col & 3) * 4;
}

/// P in place (s = S^T becomes P), in the wgmma accumulator layout: s[4j + 2r + e] is key
/// key0 + g + 8r, query column 8j + 2t + e. The wgmma kernel runs problems without softcap, ALiBi
/// and block-sparse masks (the selector sends those to the mma.sync kernel), so a pair's element
/// mask is MaskRules' window alone: two compares per score, where bwd_p_ds's general path
/// (softcap's tanh and chain rule, the block-sparse bit) raised the kernel's register demand past
/// what keeps its wgmmas pipelined (ptxas serialized them). A pair without a mask takes a loop of
/// one FFMA and one MUFU.EX2 per score: with the compares inlined per element (hi = 2^30 and lo = 0
/// when no mask applies), ptxas kept per-element branches and P cost about 11 instructions a score,
/// more than dP's wgmma takes to run beside it.
template <class Cfg>
__device__ __forceinline__ void bwd90_p(float (&s)[Cfg::kBlockM / 2], const BwdParams& p, const BwdCta& c,
                                        const BwdPair& pr, const float* lse2, bool need_mask, int key0, int g, int t) {
  const float sc = p.score.c;
  if (!need_mask) {
#pragma unroll
    for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s[4 * j + 2 * r] = algebra::backward_p(s[4 * j + 2 * r], sc, l2.x);
        s[4 * j + 2 * r + 1] = algebra::backward_p(s[4 * j + 2 * r + 1], sc, l2.y);
      }
    }
    return;
  }
  const int i0 = pr.m * Cfg::kBlockM;
  const MaskRules& rules = c.s.rules;
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int qc = 8 * j + 2 * t + e;
      const float l2 = lse2[qc];
      const int hi = rules.key_hi(i0 + qc), lo = rules.key_lo(i0 + qc), gl = rules.global_tokens;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int k = key0 + g + 8 * r;
        const bool vis = k < hi && (k >= lo || k < gl);
        s[4 * j + 2 * r + e] = vis ? algebra::backward_p(s[4 * j + 2 * r + e], sc, l2) : 0.f;
      }
    }
}

/// dS = P (dP - D) in place (dp = dP^T becomes dS^T).
template <class Cfg>
__device__ __forceinline__ void bwd90_ds(const float (&s)[Cfg::kBlockM / 2], float (&dp)[Cfg::kBlockM / 2],
                                         const float* delta, int t) {
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d = delta[8 * j + 2 * t + e];
#pragma unroll
      for (int r = 0; r < 2; ++r) dp[4 * j + 2 * r + e] = algebra::backward_ds(s[4 * j + 2 * r + e], dp[4 * j + 2 * r + e], d);
    }
}

/// The producer (one thread): K and V once, then every pair's Q, dO (TMA, zero past the sequence and
/// past the tensors' head dims) and its LSE log2 e and D rows (bulk copies) into the stage, with the
/// record; the stage's full barrier completes when the bytes land.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_ws_producer(const BwdParams& p, const BwdWsSmem<Cfg>& sm, const BwdCta& c) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, D = Cfg::kHeadDim, kPanels = D / 64;
  // Tensor-map coordinates (row, outer) of the sequence's first row: (0, b), or with varlen
  // (max_len - len, first_row + len) of the shifted maps (tma_map.h).
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  const int q_x0 = varlen ? p.seqlen_q - c.s.len_q : 0;
  const int q_c3 = varlen ? static_cast<int>(c.s.first_q) + c.s.len_q : c.b;
  const int k_x0 = varlen ? p.seqlen_k - c.s.len_k : 0;
  const int k_c3 = varlen ? static_cast<int>(c.s.first_k) + c.s.len_k : c.b;
  sm90::mbar_expect_tx(sm.kv_full(), 2 * Cfg::kSmemKV);
#pragma unroll
  for (int pn = 0; pn < kPanels; ++pn) {
    sm90::tma_load_4d(sm.k_ptr() + pn * BN * 128, &p.tmap_k, pn * 64, k_x0 + c.j0, c.hk, k_c3, sm.kv_full());
    sm90::tma_load_4d(sm.v_ptr() + pn * BN * 128, &p.tmap_v, pn * 64, k_x0 + c.j0, c.hk, k_c3, sm.kv_full());
  }
  const bool key_tail = c.j0 + BN > c.s.len_k;
  BwdPair cur;
  bool have = bwd_first_pair(p, c, &cur);
  for (int it = 0;; ++it) {
    const int st = it & 1;
    sm90::mbar_wait_sleep(sm.empty(st), ((it >> 1) & 1) ^ 1);
    *sm.record(st) = BwdWsRecord{have ? cur.m : -1, cur.gi, (cur.v.need_mask || key_tail) ? 1 : 0, 0};
    if (!have) {  // the end: the record alone completes the stage
      sm90::mbar_arrive(sm.full(st));
      break;
    }
    const int h = c.hk * p.group + cur.gi;
    sm90::mbar_expect_tx(sm.full(st), 2 * Cfg::kSmemQ + Cfg::kSmemRows);  // publishes the record too
#pragma unroll
    for (int pn = 0; pn < kPanels; ++pn) {
      sm90::tma_load_4d(sm.q_ptr(st) + pn * BM * 128, &p.tmap_q, pn * 64, q_x0 + cur.m * BM, h, q_c3, sm.full(st));
      sm90::tma_load_4d(sm.dout_ptr(st) + pn * BM * 128, &p.tmap_do, pn * 64, q_x0 + cur.m * BM, h, q_c3, sm.full(st));
    }
    const std::int64_t row = static_cast<std::int64_t>(h) * p.ws_rows + c.s.ws_row0 + cur.m * BM;
    sm90::bulk_load(sm.rows(st), p.lse2 + row, BM * 4, sm.full(st));
    sm90::bulk_load(sm.rows(st) + BM, p.delta + row, BM * 4, sm.full(st));
    BwdPair nxt;
    have = bwd_next_pair(p, c, cur, &nxt);
    cur = nxt;
  }
}

/// The dQ writer warp: each consumer's staged piece in pair order (consumer 0, then 1), added to the
/// fp32 accumulator by two TMA reduce-adds (32 columns each) from lane 0; the staging is handed back
/// once they have read it. In deterministic mode it takes the query
/// tile's turn for the CTA and passes it on once its adds have landed.
template <class Cfg>
__device__ __forceinline__ void bwd_ws_writer(const BwdParams& p, const BwdWsSmem<Cfg>& sm, const BwdCta& c,
                                              int lane) {
  constexpr int BM = Cfg::kBlockM;
  sm90::named_barrier_arrive(kBwdBarDqEmpty + 0, 160);  // both stagings start empty
  sm90::named_barrier_arrive(kBwdBarDqEmpty + 1, 160);
  std::int32_t* sem = nullptr;
  int rank = 0;
  for (;;) {
    bool done = false;  // both consumers walk the same pairs, so both end at the same turn
    for (int wg = 0; wg < 2; ++wg) {
      sm90::named_barrier_sync(kBwdBarDqFull + wg, 160);
      const BwdWsPiece pc = *sm.piece(wg);
      if (pc.m < 0) {
        done = true;
        continue;
      }
      const int h = c.hk * p.group + pc.gi;
      if (wg == 0 && p.sem != nullptr) {  // deterministic: wait for the key tiles before this one
        rank = bwd_rank<32>(c, h, pc.m, lane);  // the turn, taken for the whole CTA
        sem = p.sem + static_cast<std::int64_t>(h) * (p.ws_rows / BM) + (c.s.ws_row0 + pc.m * BM) / BM;
        if (lane == 0)
          while (ld_acquire(sem) != rank) __nanosleep(64);
        __syncwarp();
      }
      const int row0 = pc.m * BM + (BM == 128 ? wg * 64 : 0), col0 = BM == 64 ? wg * 64 : 0;
      if (lane == 0) {
#pragma unroll
        for (int bx = 0; bx < 2; ++bx)  // boxes past the tensor's head dim add nothing (TMA bounds)
          if (col0 + 32 * bx < p.head_dim)
            sm90::tma_reduce_add_3d(&p.tmap_dq, col0 + 32 * bx, static_cast<int>(c.s.ws_row0) + row0, h,
                              sm.dq_stage(wg) + bx * 8192);
        sm90::bulk_commit();
        sm90::bulk_wait_read<0>();
      }
      __syncwarp();
      sm90::named_barrier_arrive(kBwdBarDqEmpty + wg, 160);
      if (wg == 1 && sem != nullptr && lane == 0) {  // both pieces added: the next key tile's turn
        sm90::bulk_wait_done<0>();  // the adds are done, not just read
        __threadfence();
        st_release(sem, rank + 1);
      }
    }
    if (done) break;
  }
}

/// One consumer warpgroup (wg 0 or 1 of the two; 128 threads, ct its thread).
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_ws_consumer(const BwdParams& p, const BwdWsSmem<Cfg>& sm, const BwdCta& c,
                                                int wg, int ct) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, D = Cfg::kHeadDim;
  const int lane = ct % 32, wi = ct / 32, g = lane / 4, t = lane % 4;
  const auto [k_a, v_a, q_b, do_b, q_mn, do_mn, ds_a, k_b] = Bwd90Descs<Cfg>(sm, ptx::smem_u32(sm.ds(0)), wg);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const int key0 = c.j0 + wg * 64 + wi * 16;
  sm90::mbar_wait(sm.kv_full(), 0);
  for (int it = 0;; ++it) {
    const int st = it & 1;
    sm90::mbar_wait(sm.full(st), (it >> 1) & 1);
    const BwdWsRecord rec = *sm.record(st);
    if (rec.m < 0) break;
    const int qoff = st * Cfg::kSmemQ;
    float s[BM / 2], dp[BM / 2];
    sm90::wgmma_fence();
    bwd90_product_t<Cfg, T>(s, k_a, q_b, qoff);  // S^T = K_w Q^T
    sm90::wgmma_commit();
    bwd90_product_t<Cfg, T>(dp, v_a, do_b, qoff);  // dP^T = V_w dO^T
    sm90::wgmma_commit();
    // The last pair's dK (its B operand is that pair's Q) ran on into these products: release its
    // stage once dK is done, after S^T and dP^T are queued behind it, so that the tensor cores go
    // from one pair's dK to the next pair's S^T without waiting for an issue.
    if (Cfg::kOverlapPairs && it > 0) {
      sm90::wgmma_wait<2>();
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(sm.empty(st ^ 1));  // this warp is done with the last stage
    }
    const float* rows = sm.rows(st);
    BwdPair pr;
    pr.m = rec.m;
    pr.gi = rec.gi;
    sm90::wgmma_wait<1>();  // S^T: P while dP^T is still on the tensor cores
    bwd90_p<Cfg>(s, p, c, pr, rows, rec.need_mask != 0, key0, g, t);
    // dV += P^T dO goes to the tensor cores before dS is formed, so that it runs while dS is
    // computed and stored (dV needs P alone; the other products need dS).
    std::uint32_t pa[BM / 16][4], da[BM / 16][4];
    bwd90_fragment<Cfg, T>(s, pa);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) sm90::wgmma_rs<D, T>(dv, pa[kk], bwd90_adv(do_mn, qoff + kk * 16 * 128), 1);
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();  // dP^T (dV may still run)
    bwd90_ds<Cfg>(s, dp, rows + BM, t);
    bwd90_fragment<Cfg, T>(dp, da);
    // dS^T into buffer st (the other consumer may still read buffer st ^ 1 for the last pair).
    unsigned char* dsb = sm.ds(st);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = wg * 64 + wi * 16 + g + 8 * (e % 2);
        *reinterpret_cast<std::uint32_t*>(dsb + algebra::panel_offset<BN>(key, 2 * kk + e / 2) + 4 * t) = da[kk][e];
      }
    sm90::fence_proxy_async_smem();
    sm90::named_barrier_sync(kBwdBarDs, 256);  // both consumers' dS^T are in buffer st
    float dq[32];
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      sm90::wgmma_tt<64, T>(dq, bwd90_adv(ds_a, st * Cfg::kSmemDs + kk * 16 * 128), bwd90_adv(k_b, kk * 16 * 128), kk > 0);
    sm90::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) sm90::wgmma_rs<D, T>(dk, da[kk], bwd90_adv(q_mn, qoff + kk * 16 * 128), 1);
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();  // dV and dQ done; dK runs while the piece is staged
    sm90::named_barrier_sync(kBwdBarDqEmpty + wg, 160);  // the writer has read the last piece
    // The staged piece's rows wi * 16 + g + 8r and columns 8j + 2t: bwd_ws_dq_offset with the row's
    // 8-row step, the 32-column box and the 16-byte chunk's XOR folded into four per-thread bases.
    unsigned char* stage = sm.dq_stage(wg);
    int dq_base[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) dq_base[jj] = bwd_ws_dq_offset(wi * 16 + g, 8 * jj + 2 * t);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<float2*>(stage + dq_base[j % 4] + (j / 4) * 8192 + r * 1024) =
            make_float2(dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
    if (ct == 0) *sm.piece(wg) = BwdWsPiece{rec.m, rec.gi, 0, 0};
    sm90::fence_proxy_async_smem();  // the staged piece before the writer's bulk copies read it
    sm90::named_barrier_arrive(kBwdBarDqFull + wg, 160);
    if (!Cfg::kOverlapPairs) {
      sm90::wgmma_wait<0>();
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(sm.empty(st));  // this warp is done with stage st
    }
  }
  sm90::wgmma_wait<0>();  // the last pair's dK
  // No more pairs: tell the writer (after it has read the last piece), then store dK and dV.
  sm90::named_barrier_sync(kBwdBarDqEmpty + wg, 160);
  if (ct == 0) *sm.piece(wg) = BwdWsPiece{-1, 0, 0, 0};
  sm90::named_barrier_arrive(kBwdBarDqFull + wg, 160);
  bwd_store_kv<Cfg, T>(p, c, reinterpret_cast<const float(&)[Cfg::kDT][4]>(dk),
                       reinterpret_cast<const float(&)[Cfg::kDT][4]>(dv), key0, 0, g, t);
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_sm90_ws_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const BwdWsSmem<Cfg> sm{smem_raw};
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  __shared__ alignas(16) unsigned char cta_raw[sizeof(BwdCta)];
  BwdCta& c = *reinterpret_cast<BwdCta*>(cta_raw);
  {
    BwdCta mine;
    if (!bwd_make_cta<BM, BN>(p, &mine)) return;  // uniform: every thread computes it
    if (tid == 0) {
      c = mine;
      for (int s = 0; s < 2; ++s) {
        sm90::mbar_init(sm.full(s), 1);   // the producer's arrival (with the stage's TMA bytes)
        sm90::mbar_init(sm.empty(s), 8);  // one arrival per consumer warp
      }
      sm90::mbar_init(sm.kv_full(), 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  if (wg == 0) {
    sm90::setmaxnreg_dec<Cfg::kProducerRegs>();
    const int warp = tid / 32, lane = tid % 32;
    if (warp == 0) {
      if (lane == 0) bwd_ws_producer<Cfg, T>(p, sm, c);
    } else if (warp == 1) {
      bwd_ws_writer<Cfg>(p, sm, c, lane);
    }
    return;
  }
  sm90::setmaxnreg_inc<Cfg::kConsumerRegs>();
  bwd_ws_consumer<Cfg, T>(p, sm, c, wg - 1, tid - 128 * wg);
#endif
}

}  // namespace flashcpp::cuda
