// FA2-style attention forward for sm80+ (mma.sync m16n8k16, ldmatrix, cp.async).
//
// One CTA computes kBlockM query rows of one (batch, head). Each warp owns kRowsPerWarp rows
// (kMT m16 tiles). K/V tiles stream through a kStages-deep ring of XOR-swizzled shared memory
// filled by cp.async; Q is loaded once. Per key block, in registers:
//   S  = Q K^T                        (mma.sync, fp32 accumulators, raw q.k units)
//   S  = transform(S), masked         (softcap, ALiBi; -inf where a row does not see the key)
//   P, (m, l), corr = online softmax  (common/attention_algebra.h: one FFMA + ex2 per score)
//   O  = O * corr + P V               (P reused from the S registers as the A operand)
// then O / l and the LSE. Key blocks are walked from the last visible one down
// (MaskRules::key_range), then the attention-sink blocks below the window, or the listed blocks of
// a block-sparse mask (CtaWork, prefill_mask.cuh), so a CTA does only the blocks its rows can see
// and only boundary or partial blocks pay for the element mask.
//
// Roles. Every thread is a producer (cp.async copies of its share of each tile, Fa2Loads) and a
// consumer of its warp's rows (Fa2Mma for the two products, common/softmax.cuh for the softmax),
// and writes its rows in the epilogue (fa2_epilogue: through shared memory, 16-byte stores).
//
// Optional features are runtime flags (p.mask.flags, uniform over the launch): softcap and ALiBi
// rewrite S right after Q K^T (before the mask, as attention.h orders them), varlen reads each
// sequence's rows from cu_seqlens, block-sparse changes the walk. With every flag off the loop
// body is the plain kernel's plus three not-taken uniform branches. Rotary (kRotary) rotates the Q
// tile once it lands, in shared memory, behind one more barrier in the first key block; the keys
// were rotated by a pre-pass (prefill_rope.cuh).
//
// Napkin math (H200): 4*Nq*Nk*D FLOPs per (batch, head) at ~700 TFLOP/s of mma.sync-reachable
// peak vs reading Q,K,V,O once: at N=4096, D=128 the intensity is ~1000 FLOP/byte, far above
// the ~190 ridge, so the kernel is compute- (really shared-memory- and issue-) bound.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/attention_algebra.h"
#include "common/mask_rules.h"
#include "cuda/common/ptx.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/prefill/fa2_config.h"
#include "cuda/prefill/fa2_params.h"
#include "cuda/prefill/prefill_mask.cuh"
#include "cuda/prefill/prefill_rope.cuh"

namespace flashcpp::cuda {

/// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] tile.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return algebra::swizzled_offset<D>(row, chunk);
}

/// The CTA's shared memory: the Q tile, the K/V ring and the CtaWork record.
template <class Cfg, typename T>
struct Fa2Smem {
  T* q;
  T* k;
  T* v;
  CtaWork* work;
  __device__ __forceinline__ explicit Fa2Smem(unsigned char* raw)
      : q(reinterpret_cast<T*>(raw)), k(q + Cfg::kBlockM * Cfg::kHeadDim), v(k + Cfg::kStages * Cfg::kBlockN * Cfg::kHeadDim),
        work(reinterpret_cast<CtaWork*>(raw + Cfg::kSmemQ + 2 * Cfg::kStages * Cfg::kSmemKV)) {}
};

// ---- producer: cp.async copies of Q and of K/V stages --------------------------------------------
/// Copy `Rows` rows [row0, row0+Rows) of a (seq, D) slab into a swizzled tile; rows at or past
/// `limit`, and the 16-byte chunks at or past `cols` (a head dim padded to the class D), are
/// zero-filled (src-size 0: nothing is read; the address stays the slab's row 0).
/// Each thread owns one 16-byte column chunk and every kRowsPerPass-th row, so its source
/// pointer advances by a constant stride and its destination by an immediate: few registers.
template <class Cfg, int Rows, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, std::int32_t seq_stride, int row0,
                                          int limit, int cols, int tid) {
  constexpr int kRowsPerPass = Cfg::kThreads / Cfg::kChunks;
  static_assert(Cfg::kThreads % Cfg::kChunks == 0 && Rows % kRowsPerPass == 0, "rows divide over the threads");
  const int tr = tid / Cfg::kChunks, c = tid % Cfg::kChunks;
  const T* src = gmem + static_cast<std::int64_t>(row0 + tr) * seq_stride + c * 8;
  const std::int64_t step = static_cast<std::int64_t>(kRowsPerPass) * seq_stride;
  const bool col_ok = c * 8 < cols;
#pragma unroll
  for (int it = 0; it < Rows / kRowsPerPass; ++it) {
    const int r = tr + it * kRowsPerPass;
    const bool ok = col_ok && row0 + r < limit;
    ptx::cp_async_16(ptx::smem_u32(smem + swz<Cfg::kHeadDim>(r, c)), ok ? src : gmem, ok ? 16 : 0);
    src += step;
  }
}

/// The sequence's K and V slabs (batch strides, or the packed rows of cu_seqlens) and the copy of a
/// key tile into ring stage `st`.
template <class Cfg, typename T>
struct Fa2Loads {
  const T* k;
  const T* v;
  __device__ __forceinline__ Fa2Loads(const Fa2Params& p, const CtaWork& w, bool varlen, int b, int hk)
      : k(static_cast<const T*>(p.k) + (varlen ? w.k_row0 * p.k_seq_stride : b * p.k_batch_stride) + hk * p.k_head_stride),
        v(static_cast<const T*>(p.v) + (varlen ? w.k_row0 * p.v_seq_stride : b * p.v_batch_stride) + hk * p.v_head_stride) {}
  __device__ __forceinline__ void kv(const Fa2Params& p, const Fa2Smem<Cfg, T>& sm, int st, int n0, int seqlen_k,
                                     int tid) const {
    constexpr int BN = Cfg::kBlockN, D = Cfg::kHeadDim;
    load_tile<Cfg, BN>(sm.k + st * BN * D, k, p.k_seq_stride, n0, seqlen_k, p.head_dim, tid);
    load_tile<Cfg, BN>(sm.v + st * BN * D, v, p.v_seq_stride, n0, seqlen_k, p.head_dim_v, tid);
  }
};

// ---- consumer: the two products of a warp's rows -------------------------------------------------
/// ldmatrix row addresses and the two mma.sync products of one warp. Every tile starts on a
/// multiple of its row size (>= 128 B) and rows are swizzled by chunk ^ (row % 8), so the address
/// of 16-byte chunk 2*kk + c of a lane's row is (row_base | ((c ^ row%8) << 4)) ^ (kk << 5): one
/// base register per operand, and each k-step costs a single XOR with an immediate.
template <class Cfg, typename T>
struct Fa2Mma {
  static constexpr int MT = Cfg::kMT, NT = Cfg::kNT, DT = Cfg::kDT, KT = Cfg::kKT, PT = Cfg::kPT;
  static constexpr std::uint32_t kRowBytes = Cfg::kHeadDim * 2;
  std::uint32_t q_base, k_base, v_base;
  std::uint32_t q_frag[Cfg::kQInRegs ? MT : 1][Cfg::kQInRegs ? KT : 1][4];

  __device__ __forceinline__ Fa2Mma(const Fa2Smem<Cfg, T>& sm, int warp_row0, int lane) {
    const std::uint32_t r7 = lane & 7;
    q_base = ptx::smem_u32(sm.q) + (warp_row0 + (lane & 15)) * kRowBytes + (((lane >> 4) ^ r7) << 4);
    k_base = ptx::smem_u32(sm.k) + ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((((lane >> 3) & 1) ^ r7) << 4);
    v_base = ptx::smem_u32(sm.v) + (lane & 15) * kRowBytes + (((lane >> 4) ^ r7) << 4);
  }
  __device__ __forceinline__ void load_q(int mt, int kk, std::uint32_t (&a)[4]) const {
    ptx::ldmatrix_x4(a, (q_base ^ (kk << 5)) + mt * 16 * kRowBytes);
  }
  /// Q in registers (kQInRegs), once the tile (and its rotation) is in shared memory.
  __device__ __forceinline__ void hold_q() {
    if constexpr (Cfg::kQInRegs) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) load_q(mt, kk, q_frag[mt][kk]);
    }
  }
  /// S = Q K^T over the key stage at byte offset stage_off.
  __device__ __forceinline__ void qk(float (&s)[MT][NT][4], std::uint32_t stage_off) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
        } else {
          load_q(mt, kk, a[mt]);
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        std::uint32_t bk[4];
        ptx::ldmatrix_x4(bk, ((k_base + stage_off) ^ (kk << 5)) + np * 16 * kRowBytes);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_16816<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
          ptx::mma_16816<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
  }
  /// O += P V over the value stage at byte offset stage_off; P is S's registers, packed to 16 bits
  /// (two adjacent n8 chunks of S are one k16 A fragment: ptx.cuh).
  __device__ __forceinline__ void pv(const float (&s)[MT][NT][4], float (&o)[MT][DT][4], std::uint32_t stage_off) const {
#pragma unroll
    for (int kk = 0; kk < PT; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = ptx::pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = ptx::pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = ptx::pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = ptx::pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        std::uint32_t bv[4];
        ptx::ldmatrix_x4_trans(bv, ((v_base + stage_off) ^ (dp << 5)) + kk * 16 * kRowBytes);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_16816<T>(o[mt][2 * dp], a[mt], bv[0], bv[1]);
          ptx::mma_16816<T>(o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }
};

// ---- consumer: scores -> P -------------------------------------------------------------------------
/// Softcap and ALiBi (raw units, before the mask), then the element mask of a boundary or partial
/// tile. Row (mt, r) of the warp is tile row row0 + 16 mt + g + 8 r; its key n0 + 8 nt + 2t + e.
template <class Cfg>
__device__ __forceinline__ void fa2_scores(float (&s)[Cfg::kMT][Cfg::kNT][4], const Fa2Params& p, const CtaWork& cta,
                                           const KeyTile& kt, bool need_mask, int b, int h, int row0, int g, int t) {
  constexpr int MT = Cfg::kMT, NT = Cfg::kNT;
  const MaskRules& rules = cta.rules;
  if (p.mask.flags & (PrefillMask::kSoftcap | PrefillMask::kAlibi)) {
    const bool softcap = p.mask.flags & PrefillMask::kSoftcap;
    const float slope = alibi_slope_raw(p, b, h);  // 0 when ALiBi is off
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // j - ia = (n0 + nt*8 + 2t + e) - ia: an exact small integer in fp32.
        const float dist0 = static_cast<float>(kt.n0 + 2 * t - (row0 + mt * 16 + g + 8 * r + rules.offset()));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& u = s[mt][nt][2 * r + e];
            if (softcap) u = p.score.softcap(u);
            u = algebra::alibi(u, slope, dist0 + static_cast<float>(nt * 8 + e));
          }
      }
  }
  if (!need_mask) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      mask_row<NT, true>([&](int j, int k) -> float& { return s[mt][j][k]; }, r, row0 + mt * 16 + g + 8 * r, t, kt, rules,
                         p.mask, cta.bs_q0);
}

// ---- epilogue: O / l through this warp's rows of sQ, 16-byte coalesced stores; the LSE ------------
template <class Cfg, typename T>
__device__ __forceinline__ void fa2_epilogue(const Fa2Params& p, const Fa2Smem<Cfg, T>& sm, const CtaWork& cta,
                                             const float (&o)[Cfg::kMT][Cfg::kDT][4],
                                             const RowSoftmax (&row)[Cfg::kMT][2], bool varlen, int b, int h, int m0,
                                             int warp_row0, int lane) {
  constexpr int D = Cfg::kHeadDim;
  const int g = lane / 4, t = lane % 4;
  const int m_end = cta.m_end;
  T* gO = static_cast<T*>(p.o) + (varlen ? cta.q_row0 * p.o_seq_stride : b * p.o_batch_stride) + h * p.o_head_stride;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const algebra::RowResult res = row[mt][r].finalize(quad_sum(row[mt][r].l), p.score.c);
      const int tr = warp_row0 + mt * 16 + g + 8 * r;
#pragma unroll
      for (int dt = 0; dt < Cfg::kDT; ++dt)
        *reinterpret_cast<std::uint32_t*>(sm.q + swz<D>(tr, dt) + 2 * t) =
            ptx::pack2<T>(o[mt][dt][2 * r] * res.inv, o[mt][dt][2 * r + 1] * res.inv);
      if (p.lse != nullptr && t == 0 && m0 + tr < m_end) p.lse[cta.lse_row0 + m0 + tr] = res.lse;
    }
  }
  __syncwarp();
  constexpr int kWarpChunks = Cfg::kRowsPerWarp * Cfg::kChunks;
#pragma unroll
  for (int it = 0; it < kWarpChunks / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = warp_row0 + idx / Cfg::kChunks, c = idx % Cfg::kChunks;
    if (m0 + r < m_end && c * 8 < p.head_dim_v) {  // the class's padding columns are not stored
      const uint4 val = *reinterpret_cast<const uint4*>(sm.q + swz<D>(r, c));
      *reinterpret_cast<uint4*>(gO + static_cast<std::int64_t>(m0 + r) * p.o_seq_stride + c * 8) = val;
    }
  }
}

// ---- the kernel --------------------------------------------------------------------------------
template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    fa2_forward_kernel(const __grid_constant__ Fa2Params p) {
  constexpr int D = Cfg::kHeadDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN, S = Cfg::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Fa2Smem<Cfg, T> sm(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // row blocks of one head together (K/V in L2), heaviest causal first
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  // The CTA's work (sequence, key walk) lives in shared memory: the loop re-reads the few fields it
  // needs after each barrier instead of holding ~15 registers that the 255-register configs do not
  // have. Every thread computes it (the exit must be uniform), thread 0 stores it, the loop's first
  // __syncthreads (or the epilogue's, without key tiles) publishes it.
  CtaWork w;
  if (!make_cta_work<BM, BN>(p, b, h, m0, &w)) return;  // varlen: past this sequence's end (whole CTA)
  if (tid == 0) *sm.work = w;
  const int n_iters = w.n_iters;
  const PlainIters plain = plain_iters<BN>(p, w, m0);  // tiles that skip modifiers and mask (two compares)
  const RegWalk walk = reg_walk(w);                    // tile of iteration it from a register when it can
  const Fa2Loads<Cfg, T> loads(p, w, varlen, b, hk);
  {  // prologue: Q and the first S-1 K/V stages
    const T* gQ = static_cast<const T*>(p.q) + (varlen ? w.q_row0 * p.q_seq_stride : b * p.q_batch_stride) + h * p.q_head_stride;
    load_tile<Cfg, BM>(sm.q, gQ, p.q_seq_stride, m0, w.rules.seqlen_q, p.head_dim, tid);
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < n_iters) loads.kv(p, sm, s, w.key_n0<BN>(s), w.rules.seqlen_k, tid);
      ptx::cp_async_commit();
    }
  }
  const CtaWork& cta = *sm.work;  // read only after a __syncthreads
  const int warp_row0 = warp * Cfg::kRowsPerWarp;
  Fa2Mma<Cfg, T> mma(sm, warp_row0, lane);
  float acc_o[Cfg::kMT][Cfg::kDT][4] = {};
  RowSoftmax row[Cfg::kMT][2];

  for (int it = 0; it < n_iters; ++it) {
    ptx::cp_async_wait<S - 2>();
    __syncthreads();
    if (it + S - 1 < n_iters) loads.kv(p, sm, (it + S - 1) % S, walk.key_n0<BN>(cta, it + S - 1), cta.rules.seqlen_k, tid);
    ptx::cp_async_commit();  // refill the stage consumed in iteration it-1
    if (it == 0) {
      if (p.mask.flags & PrefillMask::kRotary) {  // the landed Q tile rotated in place, then a barrier
        rope_tile<T, 1>(p.rope, p.rope.inv_freq, rope_seq_positions(p.rope.positions_q, varlen, cta.q_row0, b, p.seqlen_q),
                        m0, cta.rules.seqlen_k - cta.rules.seqlen_q, cta.m_end - m0, tid, Cfg::kThreads,
                        [&](int r, int col) { return ptx::smem_u32(sm.q + swz<D>(r, col >> 3) + (col & 7)); });
        __syncthreads();
      }
      mma.hold_q();
    }
    const std::uint32_t stage_off = (it % S) * BN * Fa2Mma<Cfg, T>::kRowBytes;
    const KeyTile kt = walk.key_tile<BN>(cta, it);  // issued here, used after the products

    float acc_s[Cfg::kMT][Cfg::kNT][4];
    mma.qk(acc_s, stage_off);                                                          // S = Q K^T
    const bool need_mask = !plain.contains(it) && (kt.partial >= 0 || !cta.rules.tile_fully_visible(m0, cta.m_end, kt.n0, kt.n0 + BN));
    fa2_scores<Cfg>(acc_s, p, cta, kt, need_mask, b, h, m0 + warp_row0, lane / 4, lane % 4);  // transform, mask
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {                                           // P, (m, l), O *= corr
      float corr[2];
      softmax_block<Cfg::kNT>([&](int j, int k) -> float& { return acc_s[mt][j][k]; }, row[mt], p.score.c, corr);
      rescale_rows<Cfg::kDT>([&](int j, int k) -> float& { return acc_o[mt][j][k]; }, corr);
    }
    mma.pv(acc_s, acc_o, stage_off);                                                   // O += P V
  }
  ptx::cp_async_wait<0>();  // drain (possibly empty) groups before shared memory is reused

  if constexpr (!Cfg::kQInRegs) __syncwarp();  // this warp's Q rows are no longer read
  if (n_iters == 0) __syncthreads();           // the prologue's Q copy lands before it is overwritten (and cta is published)
  fa2_epilogue<Cfg, T>(p, sm, cta, acc_o, row, varlen, b, h, m0, warp_row0, lane);
}

}  // namespace flashcpp::cuda
