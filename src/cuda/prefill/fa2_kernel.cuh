// FA2-style attention forward for sm80+ (mma.sync m16n8k16, ldmatrix, cp.async).
//
// One CTA computes kBlockM query rows of one (batch, head). Each warp owns kRowsPerWarp rows
// (kMT m16 tiles). K/V tiles stream through a kStages-deep ring of XOR-swizzled shared memory
// filled by cp.async; Q is loaded once. Per key block, in registers:
//   S  = Q K^T                        (mma.sync, fp32 accumulators)
//   m' = max(m, rowmax(S))            raw scores; c = softmax_scale * log2(e) > 0
//   P  = exp2(S * c - m' * c)         (one FFMA + ex2.approx per element: scale folded in)
//   l  = l * exp2((m - m') c) + rowsum(P);  O = O * exp2((m - m') c) + P V   (P reused as A operand)
// then O / l and LSE = (m + log2 l) * ln 2. Key blocks are walked from the last visible one
// down (MaskRules::key_range), then the attention-sink blocks below the window, or the listed
// blocks of a block-sparse mask (CtaWork, prefill_mask.cuh), so a CTA does only the blocks its
// rows can see and only boundary or partial blocks pay for the element mask.
//
// Optional features are runtime flags (p.mask.flags, uniform over the launch): softcap and ALiBi
// rewrite S in raw q.k units right after Q K^T (before the mask, as attention.h orders them),
// varlen reads each sequence's rows from cu_seqlens, block-sparse changes the walk. With every
// flag off the loop body is the plain kernel's plus three not-taken uniform branches. Rotary
// (kRotary) rotates the Q tile once it lands, in shared memory, behind one more barrier in the
// first key block; the keys were rotated by a pre-pass (prefill_rope.cuh).
//
// Napkin math (H200): 4*Nq*Nk*D FLOPs per (batch, head) at ~700 TFLOP/s of mma.sync-reachable
// peak vs reading Q,K,V,O once: at N=4096, D=128 the intensity is ~1000 FLOP/byte, far above
// the ~190 ridge, so the kernel is compute- (really shared-memory- and issue-) bound.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/mask_rules.h"
#include "cuda/common/ptx.cuh"
#include "cuda/prefill/fa2_config.h"
#include "cuda/prefill/fa2_params.h"
#include "cuda/prefill/prefill_mask.cuh"
#include "cuda/prefill/prefill_rope.cuh"

namespace flashcpp::cuda {

inline constexpr float kLn2 = 0.6931471805599453f;

/// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] tile:
/// chunk' = chunk ^ (row % 8) puts the 8 rows an ldmatrix phase reads into 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

/// Copy `Rows` rows [row0, row0+Rows) of a (seq, D) slab into a swizzled tile; rows at or past
/// `limit` are zero-filled (src-size 0: nothing is read; the address stays the slab's row 0).
/// Each thread owns one 16-byte column chunk and every kRowsPerPass-th row, so its source
/// pointer advances by a constant stride and its destination by an immediate: few registers.
template <class Cfg, int Rows, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, std::int32_t seq_stride, int row0,
                                          int limit, int tid) {
  constexpr int kRowsPerPass = Cfg::kThreads / Cfg::kChunks;
  static_assert(Cfg::kThreads % Cfg::kChunks == 0 && Rows % kRowsPerPass == 0, "rows divide over the threads");
  const int tr = tid / Cfg::kChunks, c = tid % Cfg::kChunks;
  const T* src = gmem + static_cast<std::int64_t>(row0 + tr) * seq_stride + c * 8;
  const std::int64_t step = static_cast<std::int64_t>(kRowsPerPass) * seq_stride;
#pragma unroll
  for (int it = 0; it < Rows / kRowsPerPass; ++it) {
    const int r = tr + it * kRowsPerPass;
    const bool ok = row0 + r < limit;
    ptx::cp_async_16(ptx::smem_u32(smem + swz<Cfg::kHeadDim>(r, c)), ok ? src : gmem, ok ? 16 : 0);
    src += step;
  }
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    fa2_forward_kernel(const __grid_constant__ Fa2Params p) {
  constexpr int D = Cfg::kHeadDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN, S = Cfg::kStages;
  constexpr int MT = Cfg::kMT, NT = Cfg::kNT, DT = Cfg::kDT, KT = Cfg::kKT, PT = Cfg::kPT;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * D;
  T* sV = sK + S * BN * D;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // row blocks of one head run together (K/V stay in L2); heaviest causal first
  const int m0 = m_block * BM;
  // The CTA's work (sequence, key walk) lives in shared memory (after the K/V ring): the main loop
  // re-reads the few fields it needs after each barrier instead of holding ~15 registers that the
  // 255-register configs do not have. Every thread computes it (the exit must be uniform); thread
  // 0 stores it, and the loop's first __syncthreads (or the epilogue's, when there is no key tile)
  // publishes it.
  CtaWork& cta = *reinterpret_cast<CtaWork*>(smem_raw + Cfg::kSmemQ + 2 * S * Cfg::kSmemKV);
  const T* gK;
  const T* gV;
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  int n_iters;
  PlainIters plain;  // tiles that skip the modifiers and the element mask outright (two compares)
  RegWalk walk;      // the key tile of iteration it from a register when the walk allows
  {
    CtaWork w;
    if (!make_cta_work<BM, BN>(p, b, h, m0, &w)) return;  // varlen: past this sequence's end (whole CTA)
    if (tid == 0) cta = w;
    n_iters = w.n_iters;
    plain = plain_iters<BN>(p, w, m0);
    walk = reg_walk(w);
    // Sequence starts: batch strides, or the packed rows of cu_seqlens (varlen).
    const T* gQ = static_cast<const T*>(p.q) + (varlen ? w.q_row0 * p.q_seq_stride : b * p.q_batch_stride) +
                  h * p.q_head_stride;
    gK = static_cast<const T*>(p.k) + (varlen ? w.k_row0 * p.k_seq_stride : b * p.k_batch_stride) +
         hk * p.k_head_stride;
    gV = static_cast<const T*>(p.v) + (varlen ? w.k_row0 * p.v_seq_stride : b * p.v_batch_stride) +
         hk * p.v_head_stride;

    // ---- prologue: Q and the first S-1 K/V stages ----------------------------------------
    load_tile<Cfg, BM>(sQ, gQ, p.q_seq_stride, m0, w.rules.seqlen_q, tid);
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < n_iters) {
        const int n0 = w.key_n0<BN>(s);
        load_tile<Cfg, BN>(sK + s * BN * D, gK, p.k_seq_stride, n0, w.rules.seqlen_k, tid);
        load_tile<Cfg, BN>(sV + s * BN * D, gV, p.v_seq_stride, n0, w.rules.seqlen_k, tid);
      }
      ptx::cp_async_commit();
    }
  }
  const MaskRules& rules = cta.rules;  // read only after a __syncthreads

  const int warp_row0 = warp * Cfg::kRowsPerWarp;  // first row of this warp inside the tile
  float acc_o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[mt][r] = -INFINITY, row_sum[mt][r] = 0.f;

  std::uint32_t q_frag[Cfg::kQInRegs ? MT : 1][Cfg::kQInRegs ? KT : 1][4];
  // ldmatrix row addresses. Every tile starts on a multiple of its row size (>= 128 B) and rows
  // are swizzled by chunk ^ (row % 8), so the address of 16-byte chunk 2*kk + c of a lane's row
  // is (row_base | ((c ^ row%8) << 4)) ^ (kk << 5): one base register per operand, and each
  // k-step costs a single XOR with an immediate instead of a hoisted address register.
  constexpr std::uint32_t kRowBytes = D * 2;
  const std::uint32_t r7 = lane & 7;
  const std::uint32_t q_base = ptx::smem_u32(sQ) + (warp_row0 + (lane & 15)) * kRowBytes + (((lane >> 4) ^ r7) << 4);
  const std::uint32_t k_base = ptx::smem_u32(sK) + ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes +
                               ((((lane >> 3) & 1) ^ r7) << 4);
  const std::uint32_t v_base = ptx::smem_u32(sV) + (lane & 15) * kRowBytes + (((lane >> 4) ^ r7) << 4);
  auto load_q_frag = [&](int mt, int kk, std::uint32_t(&a)[4]) {
    ptx::ldmatrix_x4(a, (q_base ^ (kk << 5)) + mt * 16 * kRowBytes);
  };

  for (int it = 0; it < n_iters; ++it) {
    ptx::cp_async_wait<S - 2>();
    __syncthreads();
    if (it + S - 1 < n_iters) {  // refill the stage consumed in iteration it-1
      const int st = (it + S - 1) % S;
      const int n0 = walk.key_n0<BN>(cta, it + S - 1);
      load_tile<Cfg, BN>(sK + st * BN * D, gK, p.k_seq_stride, n0, rules.seqlen_k, tid);
      load_tile<Cfg, BN>(sV + st * BN * D, gV, p.v_seq_stride, n0, rules.seqlen_k, tid);
    }
    ptx::cp_async_commit();
    if ((p.mask.flags & PrefillMask::kRotary) && it == 0) {
      // Rotary: the Q tile rotated in place once it has landed (the keys arrive rotated), then a
      // barrier before any ldmatrix reads it (prefill_rope.cuh).
      rope_tile<T, 1>(p.rope, p.rope.inv_freq, rope_seq_positions(p.rope.positions_q, varlen, cta.q_row0, b, p.seqlen_q), m0,
                      rules.seqlen_k - rules.seqlen_q, cta.m_end - m0, tid, Cfg::kThreads,
                      [&](int r, int col) { return ptx::smem_u32(sQ + swz<D>(r, col >> 3) + (col & 7)); });
      __syncthreads();
    }
    if constexpr (Cfg::kQInRegs) {
      if (it == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int kk = 0; kk < KT; ++kk) load_q_frag(mt, kk, q_frag[mt][kk]);
      }
    }
    const std::uint32_t stage_off = (it % S) * BN * kRowBytes;
    const KeyTile kt = walk.key_tile<BN>(cta, it);  // issued here, used after the MMAs
    const int n0 = kt.n0;

    // ---- S = Q K^T ----------------------------------------------------------------------
    float acc_s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
        } else {
          load_q_frag(mt, kk, a[mt]);
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        std::uint32_t bk[4];
        ptx::ldmatrix_x4(bk, ((k_base + stage_off) ^ (kk << 5)) + np * 16 * kRowBytes);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_16816<T>(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
          ptx::mma_16816<T>(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    // ---- score modifiers (raw units): softcap, then ALiBi slope' * (j - ia) -----------------
    if (p.mask.flags & (PrefillMask::kSoftcap | PrefillMask::kAlibi)) {
      const bool softcap = p.mask.flags & PrefillMask::kSoftcap;
      const float slope = alibi_slope_raw(p, b, h);  // 0 when ALiBi is off
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // j - ia = (n0 + nt*8 + 2t + e1) - ia: an exact small integer in fp32.
          const int ia = m0 + warp_row0 + mt * 16 + g + 8 * r + rules.offset();
          const float dist0 = static_cast<float>(n0 + 2 * t - ia);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
              float& s = acc_s[mt][nt][2 * r + e1];
              if (softcap) s = softcap_raw(s, p.mask.softcap_raw, p.mask.softcap_k);
              s = fmaf(slope, dist0 + static_cast<float>(nt * 8 + e1), s);
            }
        }
    }

    // ---- mask boundary and partial tiles ---------------------------------------------------
    if (!plain.contains(it) && (kt.partial >= 0 || !rules.tile_fully_visible(m0, cta.m_end, n0, n0 + BN))) {
      constexpr int kWords = BN >= 64 ? BN / 64 : 1;  // element-mask words a tile row spans
      static_assert(BN % 64 == 0 || 64 % BN == 0, "a key tile covers whole 64-bit words or lies in one");
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = m0 + warp_row0 + mt * 16 + g + 8 * r;
          const int hi = rules.key_hi(i), lo = rules.key_lo(i);
          std::uint64_t bits[kWords];
#pragma unroll
          for (int wd = 0; wd < kWords; ++wd) bits[wd] = ~0ull;
          if (kt.partial >= 0) {
            const std::uint64_t* rb = sparse_row_bits(p.mask, kt.partial, i - cta.bs_q0, kt.c0);
#pragma unroll
            for (int wd = 0; wd < kWords; ++wd) bits[wd] = __ldg(rb + wd);
          }
          const int bit0 = (kt.c0 & 63) + 2 * t;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
              const int j = n0 + nt * 8 + 2 * t + e1;
              const bool bit = (bits[nt * 8 / 64] >> (bit0 + (nt * 8) % 64 + e1)) & 1u;
              if (!(j < hi && (j >= lo || j < rules.global_tokens) && bit)) acc_s[mt][nt][2 * r + e1] = -INFINITY;
            }
        }
    }

    // ---- online softmax ------------------------------------------------------------------
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * r], acc_s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Max on raw scores (the scale is positive, dispatch guarantees it), then one FFMA per
        // exponent: p = exp2(s * c - m * c). A row that has seen no key yet keeps m = -inf; use 0
        // so exp2(-inf - 0) = 0, not NaN.
        // m * c is rounded once (__fmul_rn: never contracted into an FMA), and the old max is
        // folded the same way, so while the max stays put corr is exp2(0) = 1 exactly. Written as
        // m_old * c - m_use, the compiler contracted it into one FFMA whose result was the
        // rounding residual of m * c (up to 1.5e-5 at |m * c| ~ 500): O and l were scaled by
        // exp2(residual) on every key tile, a drift linear in the number of tiles, which is the
        // size of the LSE errors the numerics audit found at 32k-64k keys (reports/numerics).
        const float m_use = mx == -INFINITY ? 0.f : __fmul_rn(mx, p.scale_log2);
        const float corr = ptx::exp2_approx(__fmul_rn(row_max[mt][r], p.scale_log2) - m_use);
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float p0 = ptx::exp2_approx(fmaf(acc_s[mt][nt][2 * r], p.scale_log2, -m_use));
          const float p1 = ptx::exp2_approx(fmaf(acc_s[mt][nt][2 * r + 1], p.scale_log2, -m_use));
          acc_s[mt][nt][2 * r] = p0;
          acc_s[mt][nt][2 * r + 1] = p1;
          sum += p0 + p1;
        }
        row_sum[mt][r] = row_sum[mt][r] * corr + sum;  // per-thread partial; quad-reduced at the end
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc_o[mt][dt][2 * r] *= corr;
          acc_o[mt][dt][2 * r + 1] *= corr;
        }
      }
    }

    // ---- O += P V (P from registers) -----------------------------------------------------
#pragma unroll
    for (int kk = 0; kk < PT; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = ptx::pack2<T>(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
        a[mt][1] = ptx::pack2<T>(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
        a[mt][2] = ptx::pack2<T>(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
        a[mt][3] = ptx::pack2<T>(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        std::uint32_t bv[4];
        ptx::ldmatrix_x4_trans(bv, ((v_base + stage_off) ^ (dp << 5)) + kk * 16 * kRowBytes);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_16816<T>(acc_o[mt][2 * dp], a[mt], bv[0], bv[1]);
          ptx::mma_16816<T>(acc_o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();  // drain (possibly empty) groups before smem is reused

  // ---- epilogue: O / l through this warp's rows of sQ, 16-byte coalesced stores ---------------
  if constexpr (!Cfg::kQInRegs) __syncwarp();  // this warp's Q rows are no longer read
  if (n_iters == 0) __syncthreads();           // prologue Q copy must land before we overwrite (and cta is published)
  const int m_end = cta.m_end;
  T* gO = static_cast<T*>(p.o) + (varlen ? cta.q_row0 * p.o_seq_stride : b * p.o_batch_stride) + h * p.o_head_stride;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      // l == 0: the row saw no key, O = 0 and LSE = -inf. Tested on l, not on the max: fmaxf drops
      // a NaN score, so a row of NaN scores keeps m = -inf, but its P and hence l are NaN, and
      // 1 / l and log2(l) carry that NaN into O and the LSE (attention.h).
      const float inv = l != 0.f ? 1.f / l : 0.f;
      const int row = warp_row0 + mt * 16 + g + 8 * r;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<std::uint32_t*>(sQ + swz<D>(row, dt) + 2 * t) =
            ptx::pack2<T>(acc_o[mt][dt][2 * r] * inv, acc_o[mt][dt][2 * r + 1] * inv);
      }
      if (p.lse != nullptr && t == 0 && m0 + row < m_end) {
        // The same rounded m * c as every exponent of the row: the rounding cancels in the LSE.
        const float lse = l != 0.f ? (__fmul_rn(row_max[mt][r], p.scale_log2) + __log2f(l)) * kLn2 : -INFINITY;
        p.lse[cta.lse_row0 + m0 + row] = lse;
      }
    }
  }
  __syncwarp();
  constexpr int kWarpChunks = Cfg::kRowsPerWarp * Cfg::kChunks;
#pragma unroll
  for (int it = 0; it < kWarpChunks / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = warp_row0 + idx / Cfg::kChunks, c = idx % Cfg::kChunks;
    if (m0 + r < m_end) {
      const uint4 val = *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
      *reinterpret_cast<uint4*>(gO + static_cast<std::int64_t>(m0 + r) * p.o_seq_stride + c * 8) = val;
    }
  }
}

}  // namespace flashcpp::cuda
