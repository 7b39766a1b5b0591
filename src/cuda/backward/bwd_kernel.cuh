// The attention backward on tensor cores (mma.sync m16n8k16, ldmatrix, cp.async; sm80 and newer):
// the three passes of docs/backward.md as three kernels, and one that zeroes uncovered varlen rows.
//
//   bwd_preprocess: per query row, D = rowsum(dO * O) - dLSE and LSE log2(e) into the workspace
//                   (algebra::row_delta, algebra::lse_log2).
//   bwd_main:       one CTA per (key tile n, KV head, sequence). K and V of the tile stay in shared
//                   memory; the CTA walks the (query head of the group, query tile m) pairs that
//                   walk::backward_visit keeps, Q, dO, D and the LSE of the next pair streaming in
//                   (cp.async, two stages) while the current one computes. Per pair, each warp owns
//                   16 keys (and, with kDSplit = 2, half of the head-dim columns of dK and dV):
//                     dP^T = V dO^T,  S^T = K Q^T                 (keys x queries, fp32)
//                     P = exp2(t c - LSE log2 e), dS = P (dP - D) softcap'(u)   (algebra::backward_*)
//                     dV += P^T dO,   dK += dS^T Q               (P and dS packed to 16 bits in registers)
//                     dS^T -> shared memory, then dQ_accum[m] += dS K   (staged, 16-byte fp32
//                                                                reductions; in key order behind a
//                                                                semaphore when deterministic)
//                   and finally writes dK = scale dK and dV. Scores are transposed (keys are the rows)
//                   so that P and dS are the A operands of the dV and dK products straight from the
//                   accumulators, as the forward reuses S for P V.
//   bwd_postprocess: dQ = scale dQ_accum in the output dtype.
//
// Where speed falls off: every warp recomputes its 16 keys' scores against the whole query tile, so
// with kDSplit = 2 (head dim 256, whose dK and dV accumulators do not fit one warp's registers) the
// two warps of a key slice both compute S^T and dP^T: 7 products per pair instead of 5. dQ costs one
// fp32 reduction per element per (query tile, key tile) pair. With 4 warps per CTA and ~255 registers
// per thread an SM holds 8 warps (12.5% occupancy): the kernel is latency-bound (reports/backward).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/attention_algebra.h"
#include "common/attention_walk.h"
#include "common/backward_algebra.h"
#include "common/mask_rules.h"
#include "cuda/backward/bwd_params.h"
#include "cuda/common/ptx.cuh"
#include "cuda/prefill/fa2_kernel.cuh"  // load_tile: cp.async copies into swizzled tiles
#include "cuda/prefill/prefill_mask.cuh"

namespace flashcpp::cuda {

/// A tile config of the backward main kernel. Warps own 16 keys each (kDSplit warps per key slice).
template <int HeadDim, int BlockM, int Warps, int DSplit, int MinBlocks>
struct BwdConfig {
  static constexpr int kHeadDim = HeadDim;  ///< the class D (q/k and v/o padded to it)
  static constexpr int kBlockM = BlockM;    ///< query rows per pair (the workspace's row_pad)
  static constexpr int kWarps = Warps;
  static constexpr int kDSplit = DSplit;    ///< warps sharing a 16-key slice, each with D / kDSplit columns
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr bool kSm90 = false;  ///< the mma.sync kernel (bwd_sm90.cuh has the wgmma one)
  static constexpr bool kWs = false;
  static constexpr int kBlockN = 16 * Warps / DSplit;  ///< keys per CTA
  static constexpr int kThreads = 32 * Warps;
  static constexpr int kChunks = HeadDim / 8;     ///< 16-byte chunks per row (load_tile)
  static constexpr int kNQ = BlockM / 8;          ///< n8 tiles of query columns in S^T
  static constexpr int kKT = HeadDim / 16;        ///< k16 steps over the head dim
  static constexpr int kDPart = HeadDim / DSplit; ///< dK / dV columns a warp accumulates
  static constexpr int kDT = kDPart / 8;          ///< their n8 tiles
  static constexpr int kDsStride = BlockM + 8;    ///< dS^T rows in shared memory (padding: no bank conflicts)
  static constexpr int kRowBytes = HeadDim * 2;
  static constexpr int kSmemKV = kBlockN * kRowBytes;        ///< K or V tile
  static constexpr int kSmemQ = BlockM * kRowBytes;          ///< one stage of Q or dO
  static constexpr int kSmemRows = 2 * BlockM * 4;           ///< one stage of LSE log2 e and D
  static constexpr int kSmemDs = kBlockN * kDsStride * 2;
  static constexpr int kSmemBytes = 2 * kSmemKV + 4 * kSmemQ + 2 * kSmemRows + kSmemDs;
  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256);
  static_assert(BlockM % 16 == 0 && kDT % 2 == 0 && (DSplit == 1 || DSplit == 2));
  static_assert(Warps % DSplit == 0 && HeadDim % 64 == 0);
};

// ---- per-sequence geometry ---------------------------------------------------------------------------
struct BwdSeq {
  int len_q = 0, len_k = 0;
  std::int64_t first_q = 0, first_k = 0;  ///< first packed rows (varlen), or b * seqlen (dense)
  std::int64_t lse_row0 = 0;              ///< index in lse of row 0 of head 0 (add h * lse_head)
  std::int64_t lse_head = 0;              ///< lse elements between heads
  std::int64_t ws_row0 = 0;               ///< padded workspace row of the sequence's row 0
  MaskRules rules;                        ///< with this sequence's lengths
};

__device__ __forceinline__ BwdSeq bwd_seq(const BwdParams& p, int b) {
  BwdSeq s;
  s.rules = p.rules;
  if (p.mask.flags & PrefillMask::kVarlen) {
    const int q0 = __ldg(p.mask.cu_seqlens_q + b), q1 = __ldg(p.mask.cu_seqlens_q + b + 1);
    const int k0 = __ldg(p.mask.cu_seqlens_k + b), k1 = __ldg(p.mask.cu_seqlens_k + b + 1);
    s.len_q = min(max(q1 - q0, 0), p.seqlen_q);
    s.len_k = min(max(k1 - k0, 0), p.seqlen_k);
    s.first_q = q0;
    s.first_k = k0;
    s.lse_head = p.total_q > 0 ? p.total_q : __ldg(p.mask.cu_seqlens_q + p.batch);
    s.lse_row0 = q0;
  } else {
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
    s.first_q = static_cast<std::int64_t>(b) * p.seqlen_q;  // the workspace's row numbering (bwd_row reads
    s.first_k = static_cast<std::int64_t>(b) * p.seqlen_k;  // dense rows through the batch strides)
    s.lse_head = p.seqlen_q;
    s.lse_row0 = static_cast<std::int64_t>(b) * p.heads_q * p.seqlen_q;
  }
  s.rules.seqlen_q = s.len_q;
  s.rules.seqlen_k = s.len_k;
  s.ws_row0 = walk::padded_row_start(s.first_q, b, p.row_pad);
  return s;
}

/// Row `row` of head `h` of sequence b in a (batch, seq, head, dim) view, or a varlen packed one.
template <typename T>
__device__ __forceinline__ T* bwd_row(T* base, bool varlen, std::int64_t first, std::int64_t batch_stride,
                                      std::int32_t seq_stride, std::int32_t head_stride, int b, std::int64_t row, int h) {
  return base + (varlen ? first * seq_stride : b * batch_stride) + row * seq_stride +
         static_cast<std::int64_t>(h) * head_stride;
}

// ---- 1. preprocess ------------------------------------------------------------------------------------
/// Grid (ceil(seqlen_q / 32), heads_q, batch), 128 threads: one warp per row, 8 rows per warp; each
/// lane takes 8 columns (head_dim_v <= 256).
template <typename T>
__global__ void __launch_bounds__(128) bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
  const int h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BwdSeq s = bwd_seq(p, b);
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  for (int r = 0; r < 8; ++r) {
    const int i = blockIdx.x * 32 + warp * 8 + r;
    if (i >= s.len_q) return;
    float dot = 0.f;
    const int c = lane * 8;
    if (c < p.head_dim_v) {
      const T* o = bwd_row(static_cast<const T*>(p.o), varlen, s.first_q, p.o_batch_stride, p.o_seq_stride,
                           p.o_head_stride, b, i, h) + c;
      const T* d = bwd_row(static_cast<const T*>(p.dout), varlen, s.first_q, p.do_batch_stride, p.do_seq_stride,
                           p.do_head_stride, b, i, h) + c;
      const uint4 ov = __ldg(reinterpret_cast<const uint4*>(o)), dv = __ldg(reinterpret_cast<const uint4*>(d));
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = fmaf(ptx::to_float(oe[e]), ptx::to_float(de[e]), dot);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) {
      const std::int64_t at = s.lse_row0 + static_cast<std::int64_t>(h) * s.lse_head + i;
      const float lse = p.lse[at];
      const std::int64_t row = static_cast<std::int64_t>(h) * p.ws_rows + s.ws_row0 + i;
      p.delta[row] = algebra::row_delta(dot, p.dlse ? p.dlse[at] : 0.f, lse);
      p.lse2[row] = algebra::lse_log2(lse);
    }
  }
}

// ---- 2. main -----------------------------------------------------------------------------------------
/// The CTA's shared memory (each tile starts on a multiple of 1024 bytes: the swizzle's XOR trick).
template <class Cfg, typename T>
struct BwdSmem {
  T* k;
  T* v;
  T* q;      ///< [2][BM][D]
  T* dout;   ///< [2][BM][D]
  float* rows;  ///< [2][2][BM]: LSE log2 e, then D, per stage
  T* ds;     ///< [BN][kDsStride] dS^T
  __device__ __forceinline__ explicit BwdSmem(unsigned char* raw)
      : k(reinterpret_cast<T*>(raw)),
        v(reinterpret_cast<T*>(raw + Cfg::kSmemKV)),
        q(reinterpret_cast<T*>(raw + 2 * Cfg::kSmemKV)),
        dout(reinterpret_cast<T*>(raw + 2 * Cfg::kSmemKV + 2 * Cfg::kSmemQ)),
        rows(reinterpret_cast<float*>(raw + 2 * Cfg::kSmemKV + 4 * Cfg::kSmemQ)),
        ds(reinterpret_cast<T*>(raw + 2 * Cfg::kSmemKV + 4 * Cfg::kSmemQ + 2 * Cfg::kSmemRows)) {}
};

/// One (query head, query tile) pair a CTA visits.
struct BwdPair {
  int gi = 0;  ///< query head within the group
  int m = 0;   ///< query tile
  walk::TileVisit v;
};

/// Everything a CTA knows about its key tile.
struct BwdCta {
  int b, hk, n, j0;
  int m_lo, m_hi;
  BwdSeq s;
  walk::Tiles tiles;
  const BlockSparseMask* bs;
};

/// The CTA's key tile, KV head and sequence with tiles of BM x BN (the grid of bwd_run); false when
/// the sequence has no such key tile (varlen, or past the last group's end), so the whole CTA returns.
template <int BM, int BN>
__device__ __forceinline__ bool bwd_make_cta(const BwdParams& p, BwdCta* c) {
  const int group = static_cast<int>(blockIdx.z) / p.batch;
  c->n = group * p.key_group + static_cast<int>(blockIdx.x);
  c->hk = blockIdx.y;
  c->b = static_cast<int>(blockIdx.z) - group * p.batch;
  c->s = bwd_seq(p, c->b);
  c->bs = (p.mask.flags & PrefillMask::kSparse) ? &p.bs : nullptr;
  c->tiles = walk::Tiles::make(c->s.len_q, c->s.len_k, BM, BN, c->bs);
  if (c->n >= c->tiles.num_k_tiles()) return false;
  c->j0 = c->n * BN;  // tiles divide the block-sparse blocks: tile n starts at n * BN
  walk::query_tiles(c->s.rules, c->tiles, c->n, &c->m_lo, &c->m_hi);
  return true;
}

/// The first rows of the CTA's KV head in k and v (bwd_row at row 0).
template <typename T>
struct BwdKvRows {
  const T* k;
  const T* v;
  __device__ __forceinline__ BwdKvRows(const BwdParams& p, const BwdCta& c) {
    const bool varlen = p.mask.flags & PrefillMask::kVarlen;
    k = bwd_row(static_cast<const T*>(p.k), varlen, c.s.first_k, p.k_batch_stride, p.k_seq_stride, p.k_head_stride,
                c.b, 0, c.hk);
    v = bwd_row(static_cast<const T*>(p.v), varlen, c.s.first_k, p.v_batch_stride, p.v_seq_stride, p.v_head_stride,
                c.b, 0, c.hk);
  }
};

/// The order a CTA walks its query tiles in, per query head. Deterministic mode walks them downwards:
/// key tile n adds to query tile m after the key tiles before it, and with causal masks or windows the
/// tiles a key tile visits end at the same or a later query tile than its predecessors', so walking
/// down, every key tile reaches each query tile after the ones before it did and waits about one
/// hand-over per key tile. Walking up, key tile n starts at its first query tile, which key tile n - 1
/// reaches only after its own earlier tiles: the waits add up along the key tiles and the SMs idle.
/// The default mode walks up (no waits; the same pairs).
__device__ __forceinline__ bool bwd_walks_down(const BwdParams& p) { return p.sem != nullptr; }

/// The query tile each query head's walk starts at (down: bwd_walks_down).
__device__ __forceinline__ int bwd_walk_start(bool down, const BwdCta& c) { return down ? c.m_hi - 1 : c.m_lo; }

/// The first visited pair at or after (gi, m) in the walk's (head, tile) order; false when none is left.
__device__ __forceinline__ bool bwd_find_pair(const BwdParams& p, const BwdCta& c, int gi, int m, BwdPair* out) {
  const bool down = bwd_walks_down(p);
  const int step = down ? -1 : 1, start = bwd_walk_start(down, c);
  for (; gi < p.group; ++gi, m = start) {
    const int h = c.hk * p.group + gi;
    for (; down ? m >= c.m_lo : m < c.m_hi; m += step) {
      walk::TileVisit v = walk::visit(c.s.rules, c.tiles, c.bs, c.b, h, m, c.n);
      if (v.visit) {
        // A device CSR is not validated on the host: an element-mask index past the masks reads the
        // last one, as the forward kernels clamp it, never past the array.
        if (v.partial != walk::kFullBlock) v.partial = min(max(v.partial, 0), p.mask.bs_num_partial - 1);
        out->gi = gi;
        out->m = m;
        out->v = v;
        return true;
      }
    }
  }
  return false;
}

/// The CTA's first pair, into *out; false when it visits none.
__device__ __forceinline__ bool bwd_first_pair(const BwdParams& p, const BwdCta& c, BwdPair* out) {
  return bwd_find_pair(p, c, 0, bwd_walk_start(bwd_walks_down(p), c), out);
}

/// The pair after `cur` in the walk's order, into *next; false when none is left.
__device__ __forceinline__ bool bwd_next_pair(const BwdParams& p, const BwdCta& c, const BwdPair& cur, BwdPair* next) {
  const bool down = bwd_walks_down(p);
  const int m = down ? cur.m - 1 : cur.m + 1;
  const bool same_head = down ? m >= c.m_lo : m < c.m_hi;
  return bwd_find_pair(p, c, same_head ? cur.gi : cur.gi + 1, same_head ? m : bwd_walk_start(down, c), next);
}

/// The first rows of a pair's query head in q and dO (bwd_row at row 0).
template <typename T>
struct BwdPairRows {
  const T* q;
  const T* dout;
  __device__ __forceinline__ BwdPairRows(const BwdParams& p, const BwdCta& c, int h) {
    const bool varlen = p.mask.flags & PrefillMask::kVarlen;
    q = bwd_row(static_cast<const T*>(p.q), varlen, c.s.first_q, p.q_batch_stride, p.q_seq_stride, p.q_head_stride, c.b,
                0, h);
    dout = bwd_row(static_cast<const T*>(p.dout), varlen, c.s.first_q, p.do_batch_stride, p.do_seq_stride,
                   p.do_head_stride, c.b, 0, h);
  }
};

/// cp.async copy of a pair's LSE log2 e and D (whole padded workspace tiles of BM rows) into
/// `rows` ([LSE log2 e][BM], then [D][BM]); threads [0, BM / 2) each copy 16 bytes.
template <int BM>
__device__ __forceinline__ void bwd_load_rows(const BwdParams& p, float* rows, const BwdCta& c, int h, int m, int tid) {
  constexpr int kVec = BM / 4;  // 16-byte chunks of one row vector
  if (tid < 2 * kVec) {
    const std::int64_t row = static_cast<std::int64_t>(h) * p.ws_rows + c.s.ws_row0 + m * BM + (tid % kVec) * 4;
    const float* src = (tid < kVec ? p.lse2 : p.delta) + row;
    ptx::cp_async_16(ptx::smem_u32(rows + (tid / kVec) * BM + (tid % kVec) * 4), src, 16);
  }
}

/// cp.async copies of one pair's Q, dO (rows [i0, i0 + BM), zero past the sequence and past the
/// tensors' head dims) and its LSE log2 e and D into stage `st`.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_load_pair(const BwdParams& p, const BwdSmem<Cfg, T>& sm, const BwdCta& c,
                                              const BwdPair& pr, int st, int tid) {
  constexpr int BM = Cfg::kBlockM, D = Cfg::kHeadDim;
  const int h = c.hk * p.group + pr.gi;
  const int i0 = pr.m * BM;  // tiles divide the block-sparse blocks: tile m starts at m * BM
  const BwdPairRows<T> g(p, c, h);
  load_tile<Cfg, BM>(sm.q + st * BM * D, g.q, p.q_seq_stride, i0, c.s.len_q, p.head_dim, tid);
  load_tile<Cfg, BM>(sm.dout + st * BM * D, g.dout, p.do_seq_stride, i0, c.s.len_q, p.head_dim_v, tid);
  bwd_load_rows<BM>(p, sm.rows + st * 2 * BM, c, h, pr.m, tid);
}

/// acc[NQ][4] = A B^T over the head dim: A = 16 rows of a [rows][D] tile (the warp's keys), B = the
/// BM rows of a [BM][D] tile (the queries). Fragment row g + 8r is key g + 8r of the warp's slice,
/// column 8 nt + 2t + e is query 8 nt + 2t + e of the tile.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_product_t(float (&acc)[Cfg::kNQ][4], std::uint32_t a_base, std::uint32_t b_base) {
#pragma unroll
  for (int nt = 0; nt < Cfg::kNQ; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Cfg::kKT; ++kk) {
    std::uint32_t a[4];
    ptx::ldmatrix_x4(a, a_base ^ (kk << 5));
#pragma unroll
    for (int np = 0; np < Cfg::kNQ / 2; ++np) {
      std::uint32_t bq[4];
      ptx::ldmatrix_x4(bq, (b_base ^ (kk << 5)) + np * 16 * Cfg::kRowBytes);
      ptx::mma_16816<T>(acc[2 * np], a, bq[0], bq[1]);
      ptx::mma_16816<T>(acc[2 * np + 1], a, bq[2], bq[3]);
    }
  }
}

/// acc[DT][4] += X^T Y over the BM queries: X^T = the warp's [16 keys][BM] fragment `x` (packed to
/// 16 bits as an A operand), Y = a [BM][D] tile read transposed (k = query), columns from the
/// warp's part. `y_base` addresses row (lane & 15), chunk (lane >> 4) of the tile, swizzled.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_accumulate(float (&acc)[Cfg::kDT][4], const float (&x)[Cfg::kNQ][4],
                                               std::uint32_t y_base, int chunk_pair0) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kNQ / 2; ++kk) {
    std::uint32_t a[4];
    a[0] = ptx::pack2<T>(x[2 * kk][0], x[2 * kk][1]);
    a[1] = ptx::pack2<T>(x[2 * kk][2], x[2 * kk][3]);
    a[2] = ptx::pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
    a[3] = ptx::pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
#pragma unroll
    for (int dp = 0; dp < Cfg::kDT / 2; ++dp) {
      std::uint32_t by[4];
      ptx::ldmatrix_x4_trans(by, (y_base ^ ((chunk_pair0 + dp) << 5)) + kk * 16 * Cfg::kRowBytes);
      ptx::mma_16816<T>(acc[2 * dp], a, by[0], by[1]);
      ptx::mma_16816<T>(acc[2 * dp + 1], a, by[2], by[3]);
    }
  }
}

/// bwd_p_ds for pairs with an element mask, softcap or ALiBi.
template <class Cfg>
__device__ __forceinline__ void bwd_p_ds_general(float (&s)[Cfg::kNQ][4], float (&dp)[Cfg::kNQ][4], const BwdParams& p,
                                         const BwdCta& c, const BwdPair& pr, const float* lse2, const float* delta,
                                         bool need_mask, int key0, int g, int t) {
  const MaskRules& rules = c.s.rules;
  const bool softcap = p.mask.flags & PrefillMask::kSoftcap;
  const int h = c.hk * p.group + pr.gi;
  const float slope = alibi_slope_raw(p, c.b, h);  // 0 when ALiBi is off
  const int i0 = pr.m * Cfg::kBlockM, off = rules.offset();
  const BlockSparseMask* bs = c.bs;
#pragma unroll
  for (int nt = 0; nt < Cfg::kNQ; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int qc = 8 * nt + 2 * t + e, i = i0 + qc;
      const float l2 = lse2[qc], d = delta[qc];
      int hi = 0, lo = 0;
      if (need_mask) {
        hi = rules.key_hi(i);
        lo = rules.key_lo(i);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = key0 + g + 8 * r;
        const float u = s[nt][2 * r + e];
        float tr = softcap ? p.score.softcap(u) : u;
        tr = algebra::alibi(tr, slope, static_cast<float>(j - (i + off)));
        if (need_mask) {
          bool vis = j < hi && (j >= lo || j < rules.global_tokens);
          if (vis && pr.v.partial != walk::kFullBlock)
            vis = walk::sparse_bit(*bs, pr.v.partial, i % bs->block_m, j % bs->block_n);
          if (!vis) tr = -INFINITY;
        }
        const float pij = algebra::backward_p(tr, p.score.c, l2);
        float ds = algebra::backward_ds(pij, dp[nt][2 * r + e], d);
        if (softcap) ds *= algebra::softcap_grad(p.score, u);
        s[nt][2 * r + e] = pij;
        dp[nt][2 * r + e] = ds;
      }
    }
}

/// Score transform, element mask, P and dS in place: s (S^T) becomes P, dp (dP^T) becomes dS.
/// Pairs without an element mask, softcap or ALiBi (most pairs) take a short path: three
/// instructions and one exp2 per score. The general path, unrolled over every score with its mask
/// rules, block-sparse bit and softcap, is ~15k instructions at 64 scores per thread: run for every
/// pair (it was, as one inline body), it streamed the hot loop through more code than the
/// instruction caches hold.
template <class Cfg>
__device__ __forceinline__ void bwd_p_ds(float (&s)[Cfg::kNQ][4], float (&dp)[Cfg::kNQ][4], const BwdParams& p,
                                         const BwdCta& c, const BwdPair& pr, const float* lse2, const float* delta,
                                         bool need_mask, int key0, int g, int t) {
  if (!need_mask && !(p.mask.flags & (PrefillMask::kSoftcap | PrefillMask::kAlibi))) {
    const float sc = p.score.c;
#pragma unroll
    for (int nt = 0; nt < Cfg::kNQ; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int qc = 8 * nt + 2 * t + e;
        const float l2 = lse2[qc], d = delta[qc];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float pij = algebra::backward_p(s[nt][2 * r + e], sc, l2);
          dp[nt][2 * r + e] = algebra::backward_ds(pij, dp[nt][2 * r + e], d);
          s[nt][2 * r + e] = pij;
        }
      }
    return;
  }
  bwd_p_ds_general<Cfg>(s, dp, p, c, pr, lse2, delta, need_mask, key0, g, t);
}

/// Float offset of 16-byte chunk c4 of row `row` in a dQ staging tile of 64 fp32 per row, the chunk
/// swizzled by the row (fragment writes of 8 rows land in distinct banks).
__device__ __forceinline__ int bwd_stage_offset(int row, int c4) { return row * 64 + ((c4 ^ (row & 7)) << 2); }

/// 16 fp32 added to global memory at once where the device has the vector reduction (sm_90), else
/// four scalar reductions. dst is 16-byte aligned.
__device__ __forceinline__ void red_add_v4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

/// dQ_accum[tile] += dS K for this pair: dS^T is in shared memory; warp tasks of 16 query rows x 64
/// columns. Deterministic mode orders the CTAs' additions to the tile (ascending key tiles).
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_dq(const BwdParams& p, const BwdSmem<Cfg, T>& sm, const BwdCta& c,
                                       const BwdPair& pr, int st, int warp, int lane) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, D = Cfg::kHeadDim;
  // Each warp's 16 x 64 fp32 task result is staged in the current stage's Q / dO tiles (no longer read
  // once dK is done) as 16-byte chunks swizzled by row, then added with 16-byte reductions: a warp's
  // reduction covers two whole 256-byte row segments instead of eight rows' scattered pairs.
  constexpr int kWarpStage = 16 * 64 * 4;
  static_assert(kWarpStage * Cfg::kWarps <= 2 * Cfg::kSmemQ, "the staging fits the stage's Q and dO tiles");
  float* stage;
  {
    const int off = warp * kWarpStage;
    unsigned char* q = reinterpret_cast<unsigned char*>(sm.q) + st * Cfg::kSmemQ;
    unsigned char* d = reinterpret_cast<unsigned char*>(sm.dout) + st * Cfg::kSmemQ;
    stage = reinterpret_cast<float*>(off < Cfg::kSmemQ ? q + off : d + (off - Cfg::kSmemQ));
  }
  constexpr int kColChunks = D / 64, kTasks = (BM / 16) * kColChunks;
  const int g = lane / 4, t = lane % 4, r7 = lane & 7;
  const int h = c.hk * p.group + pr.gi;
  float* acc_rows = p.dq_accum + (static_cast<std::int64_t>(h) * p.ws_rows + c.s.ws_row0 + pr.m * BM) * p.head_dim;
  // ldmatrix.trans of dS^T [key][query]: matrix lane/8 = (keys +8 if bit 1, queries +8 if bit 0).
  const std::uint32_t ds_base = ptx::smem_u32(sm.ds) +
                                (((lane & 7) + ((lane >> 4) << 3)) * Cfg::kDsStride + ((lane >> 3) & 1) * 8) * 2;
  const std::uint32_t k_base = ptx::smem_u32(sm.k) + (lane & 15) * Cfg::kRowBytes + (((lane >> 4) ^ r7) << 4);
  for (int task = warp; task < kTasks; task += Cfg::kWarps) {
    const int qg = task / kColChunks, cc = task % kColChunks;
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      std::uint32_t a[4];
      ptx::ldmatrix_x4_trans(a, ds_base + (kk * 16 * Cfg::kDsStride + qg * 16) * 2);
#pragma unroll
      for (int dp = 0; dp < 4; ++dp) {
        std::uint32_t bk[4];
        ptx::ldmatrix_x4_trans(bk, (k_base ^ ((cc * 4 + dp) << 5)) + kk * 16 * Cfg::kRowBytes);
        ptx::mma_16816<T>(acc[2 * dp], a, bk[0], bk[1]);
        ptx::mma_16816<T>(acc[2 * dp + 1], a, bk[2], bk[3]);
      }
    }
    __syncwarp();  // the previous task's reads of the staging are done
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r, c4 = 2 * nt + (t >> 1);
        *reinterpret_cast<float2*>(stage + bwd_stage_offset(row, c4) + ((2 * t) & 3)) =
            make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
      }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int row = 2 * i + (lane >> 4), c4 = lane & 15, col = cc * 64 + 4 * c4;
      if (col < p.head_dim)  // the class's padding columns (zero) are not accumulated
        red_add_v4(acc_rows + static_cast<std::int64_t>(qg * 16 + row) * p.head_dim + col,
                   *reinterpret_cast<const float4*>(stage + bwd_stage_offset(row, c4)));
    }
  }
}

/// Deterministic mode: the number of key tiles before n that add to query tile m (walk::key_tile_rank),
/// counted by Threads threads, a tile each per step: the whole CTA (__syncthreads_count) or one warp
/// (Threads 32, the warp-specialized kernel's writer: ballot). Every counting thread gets the count.
template <int Threads>
__device__ __forceinline__ int bwd_rank(const BwdCta& c, int h, int m, int tid) {
  int rank = 0;
  for (int n0 = 0; n0 < c.n; n0 += Threads) {
    const int n = n0 + tid;
    const bool before = n < c.n && walk::backward_visit(c.s.rules, c.tiles, c.bs, c.b, h, m, n).visit;
    if constexpr (Threads == 32) rank += __popc(__ballot_sync(0xffffffffu, before));
    else rank += __syncthreads_count(before);
  }
  return rank;
}

__device__ __forceinline__ int ld_acquire(const std::int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(std::int32_t* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/// Deterministic mode's turn at a query tile's dQ accumulator: the constructor waits until the key
/// tiles before this one have added theirs (whole CTA), done() hands the tile to the next. Without
/// semaphores (the default) both are no-ops.
template <class Cfg>
struct BwdDqTurn {
  std::int32_t* sem = nullptr;
  int rank = 0;
  __device__ __forceinline__ BwdDqTurn(const BwdParams& p, const BwdCta& c, const BwdPair& pr, int tid) {
    if (p.sem == nullptr) return;
    constexpr int BM = Cfg::kBlockM;
    const int h = c.hk * p.group + pr.gi;
    rank = bwd_rank<Cfg::kThreads>(c, h, pr.m, tid);
    sem = p.sem + static_cast<std::int64_t>(h) * (p.ws_rows / BM) + (c.s.ws_row0 + pr.m * BM) / BM;
    if (tid == 0)
      while (ld_acquire(sem) != rank) __nanosleep(64);
  }
  __device__ __forceinline__ void done(int tid) const {
    if (sem == nullptr) return;
    __threadfence();
    __syncthreads();
    if (tid == 0) st_release(sem, rank + 1);
  }
};

/// dK = scale dK and dV of the warp's keys and columns, straight from the accumulators.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd_store_kv(const BwdParams& p, const BwdCta& c, const float (&dk)[Cfg::kDT][4],
                                             const float (&dv)[Cfg::kDT][4], int key0, int col0, int g, int t) {
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  T* gdk = bwd_row(static_cast<T*>(p.dk), varlen, c.s.first_k, p.dk_batch_stride, p.dk_seq_stride, p.dk_head_stride,
                   c.b, 0, c.hk);
  T* gdv = bwd_row(static_cast<T*>(p.dv), varlen, c.s.first_k, p.dv_batch_stride, p.dv_seq_stride, p.dv_head_stride,
                   c.b, 0, c.hk);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key0 + g + 8 * r;
    if (j >= c.s.len_k) continue;
#pragma unroll
    for (int dt = 0; dt < Cfg::kDT; ++dt) {
      const int col = col0 + dt * 8 + 2 * t;
      if (col < p.head_dim)
        *reinterpret_cast<std::uint32_t*>(gdk + static_cast<std::int64_t>(j) * p.dk_seq_stride + col) =
            ptx::pack2<T>(p.scale * dk[dt][2 * r], p.scale * dk[dt][2 * r + 1]);
      if (col < p.head_dim_v)
        *reinterpret_cast<std::uint32_t*>(gdv + static_cast<std::int64_t>(j) * p.dv_seq_stride + col) =
            ptx::pack2<T>(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) bwd_main_kernel(const __grid_constant__ BwdParams p) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, RB = Cfg::kRowBytes;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const BwdSmem<Cfg, T> sm(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, r7 = lane & 7;
  BwdCta c;
  if (!bwd_make_cta<BM, BN>(p, &c)) return;  // varlen: this sequence has fewer key tiles (whole CTA)
  {  // K and V of the tile (the first cp.async group, with the first pair)
    const BwdKvRows<T> g(p, c);
    load_tile<Cfg, BN>(sm.k, g.k, p.k_seq_stride, c.j0, c.s.len_k, p.head_dim, tid);
    load_tile<Cfg, BN>(sm.v, g.v, p.v_seq_stride, c.j0, c.s.len_k, p.head_dim_v, tid);
  }
  BwdPair cur;
  bool have = bwd_first_pair(p, c, &cur);
  if (have) bwd_load_pair<Cfg, T>(p, sm, c, cur, 0, tid);
  ptx::cp_async_commit();

  // The warp's keys and columns, and its ldmatrix base addresses (docs in fa2_kernel.cuh's Fa2Mma).
  const int slice = warp / Cfg::kDSplit, part = warp % Cfg::kDSplit;
  const int key_local0 = slice * 16;
  const std::uint32_t kv_row = (key_local0 + (lane & 15)) * RB + (((lane >> 4) ^ r7) << 4);
  const std::uint32_t k_a = ptx::smem_u32(sm.k) + kv_row, v_a = ptx::smem_u32(sm.v) + kv_row;
  const std::uint32_t qb_row = ((lane & 7) + ((lane >> 4) << 3)) * RB + ((((lane >> 3) & 1) ^ r7) << 4);
  const std::uint32_t qt_row = (lane & 15) * RB + (((lane >> 4) ^ r7) << 4);
  const int chunk_pair0 = part * Cfg::kDT / 2;
  float dk[Cfg::kDT][4] = {}, dv[Cfg::kDT][4] = {};
  const bool key_tail = c.j0 + BN > c.s.len_k;  // keys past the sequence must be masked in every pair

  for (int it = 0; have; ++it) {
    const int st = it & 1;
    BwdPair nxt;
    const bool have_next = bwd_next_pair(p, c, cur, &nxt);
    if (have_next) bwd_load_pair<Cfg, T>(p, sm, c, nxt, st ^ 1, tid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    __syncthreads();

    const std::uint32_t q_s = ptx::smem_u32(sm.q) + st * BM * RB, do_s = ptx::smem_u32(sm.dout) + st * BM * RB;
    const float* lse2 = sm.rows + st * 2 * BM;
    float s[Cfg::kNQ][4], dp[Cfg::kNQ][4];
    bwd_product_t<Cfg, T>(dp, v_a, do_s + qb_row);  // dP^T = V dO^T
    bwd_product_t<Cfg, T>(s, k_a, q_s + qb_row);    // S^T = K Q^T
    bwd_p_ds<Cfg>(s, dp, p, c, cur, lse2, lse2 + BM, cur.v.need_mask || key_tail, c.j0 + key_local0, g, t);
    bwd_accumulate<Cfg, T>(dv, s, do_s + qt_row, chunk_pair0);  // dV += P^T dO
    bwd_accumulate<Cfg, T>(dk, dp, q_s + qt_row, chunk_pair0);  // dK += dS^T Q
    if (part == 0) {  // dS^T to shared memory for dQ (both warps of a split slice hold the same values)
#pragma unroll
      for (int nt = 0; nt < Cfg::kNQ; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<std::uint32_t*>(sm.ds + (key_local0 + g + 8 * r) * Cfg::kDsStride + 8 * nt + 2 * t) =
              ptx::pack2<T>(dp[nt][2 * r], dp[nt][2 * r + 1]);
    }
    const BwdDqTurn<Cfg> turn(p, c, cur, tid);  // (deterministic: its barriers also publish dS^T)
    __syncthreads();
    bwd_dq<Cfg, T>(p, sm, c, cur, st, warp, lane);  // dQ_accum[m] += dS K
    turn.done(tid);
    __syncthreads();  // stage st and dS^T are free for the next pair
    cur = nxt;
    have = have_next;
  }
  ptx::cp_async_wait<0>();
  bwd_store_kv<Cfg, T>(p, c, dk, dv, c.j0 + key_local0, part * Cfg::kDPart, g, t);
}

// ---- 3. postprocess -----------------------------------------------------------------------------------
/// dQ = scale dQ_accum. Grid (ceil(seqlen_q / 32), heads_q, batch), 128 threads, a warp per row.
template <typename T>
__global__ void __launch_bounds__(128) bwd_postprocess_kernel(const __grid_constant__ BwdParams p) {
  const int h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BwdSeq s = bwd_seq(p, b);
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  const int c = lane * 8;
  if (c >= p.head_dim) return;
  for (int r = 0; r < 8; ++r) {
    const int i = blockIdx.x * 32 + warp * 8 + r;
    if (i >= s.len_q) return;
    const float* acc = p.dq_accum + (static_cast<std::int64_t>(h) * p.ws_rows + s.ws_row0 + i) * p.head_dim + c;
    const float4 a0 = __ldcg(reinterpret_cast<const float4*>(acc)), a1 = __ldcg(reinterpret_cast<const float4*>(acc + 4));
    uint4 out;
    out.x = ptx::pack2<T>(p.scale * a0.x, p.scale * a0.y);
    out.y = ptx::pack2<T>(p.scale * a0.z, p.scale * a0.w);
    out.z = ptx::pack2<T>(p.scale * a1.x, p.scale * a1.y);
    out.w = ptx::pack2<T>(p.scale * a1.z, p.scale * a1.w);
    T* dst = bwd_row(static_cast<T*>(p.dq), varlen, s.first_q, p.dq_batch_stride, p.dq_seq_stride, p.dq_head_stride, b,
                     i, h) + c;
    *reinterpret_cast<uint4*>(dst) = out;
  }
}

// ---- varlen rows no sequence covers ------------------------------------------------------------------
/// Zeroes rows [cu[batch], total) of a packed (total, heads, dim) view, all heads: dq (cu_seqlens_q,
/// total_q) or dk and dv (cu_seqlens_k, total_k). Grid (ceil(total / 4), heads), 128 threads.
template <typename T>
__global__ void __launch_bounds__(128) bwd_zero_rows_kernel(T* x, std::int32_t seq_stride, std::int32_t head_stride,
                                                            int dim, const std::int32_t* cu, int batch, std::int64_t total) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= total || row < __ldg(cu + batch)) return;
  T* dst = x + row * seq_stride + static_cast<std::int64_t>(blockIdx.y) * head_stride;
  for (int c = lane * 8; c < dim; c += 256) *reinterpret_cast<uint4*>(dst + c) = make_uint4(0, 0, 0, 0);
}

}  // namespace flashcpp::cuda
