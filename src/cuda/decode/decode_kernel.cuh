// Split-KV decode kernel for sm80+ (mma.sync m16n8k16, ldmatrix, cp.async), contiguous or paged
// KV cache, GQA packed into the rows of one CTA.
//
// One CTA = one (work item, KV head, row block). A work item is (sequence b, split s of n_b) from
// the plan; the split owns a contiguous run of 64-key tiles of the keys its rows can see. All
// heads_q / heads_kv query heads x seqlen_q tokens of the KV head are the rows of the CTA
// (row r = head offset r / seqlen_q, token r % seqlen_q), so every K/V byte is read from DRAM once
// per split. Four warps: warp_rows of them along the rows (16 rows each), the other
// 4 / warp_rows split each tile's four 16-key chunks between them. Per warp and 16-key chunk:
//   S = Q K^T               (mma.sync, fp32)        y = transform(S)  (scale, softcap, ALiBi, mask; exp2 domain)
//   m' = max(m, rowmax y)   P = exp2(y - m')        l = l 2^(m-m') + rowsum P,  O = O 2^(m-m') + P V
// then the warps that shared a row block merge their (m, l, O) through shared memory, and the CTA
// writes either the final O and LSE (n_b = 1) or the normalized partial O and LSE of its split
// (fp32, float workspace) for decode_merge_kernel.
//
// Napkin math (H200, bf16, D = 128), and why mma.sync rather than FMA. Per KV head and key the
// kernel reads 2*D*2 = 512 bytes of K/V and does 4*D*rows FLOPs, rows = group * seqlen_q:
// arithmetic intensity = rows FLOP/byte (GQA 32/8 decode: 4; 8 heads x 16 speculative tokens:
// 128). At the 4.2 TB/s read ceiling that asks for 4.2 * rows TFLOP/s: 17 TFLOP/s at rows = 4,
// ~540 at rows = 128. FP32 FMA tops out near 60 TFLOP/s (and the bf16 -> fp32 conversions cost as
// much again), so FMA would turn compute-bound beyond rows ~ 8; mma.sync reaches ~700 (dense)
// even though rows < 16 wastes most of each m16 tile (rows = 4: 4x waste, still 68 TFLOP/s of
// tensor work, a tenth of what is there). So one code path, tensor cores, memory-bound for every
// rows <= 64 per CTA. The exp2/max work per key is rows * (1 ex2 + 3 FP ops), small next to that.
//
// Bytes in flight (what decides the speed of a memory-bound kernel): a stage is 64 keys of K and
// V (16/32/64 KB for D = 64/128/256). A CTA issues the copy of tile it + S - 1 before it waits for
// tile it, so while it waits (most of its time) all kStages stages are in flight, and
// Config::kCtasPerSm CTAs share an SM: >= 96 KB in flight per SM. Issuing only after the wait
// (S - 1 stages in flight) and a block-table read per row cost 5% at B = 64 (258 -> 245 us, ncu:
// 2.5x the instructions cuDNN's kernel issues for the same bytes; the loop now issues fewer).
// Where it falls off: a split shorter than kStages tiles leaves the pipeline part empty (the
// planner keeps splits >= 4 tiles); rows > 64 (MQA with > 64 heads x tokens) re-read K/V once per
// row block (from L2: the row blocks of a split run side by side).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "common/mask_rules.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/common/rope.cuh"
#include "common/decode_common.h"
#include "cuda/decode/decode_params.h"

namespace flashcpp::cuda::decode_dev {

using flashcpp::decode::Config;
using flashcpp::decode::kLn2;
using flashcpp::decode::kLog2e;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return x;
}
template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return x;
}

/// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] tile
/// (chunk ^ row % 8: the 8 rows of an ldmatrix phase hit 8 distinct bank groups).
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

/// Element offsets of slot `slot` of page (or contiguous sequence) `base` in the K and V cache.
__device__ __forceinline__ void kv_offsets(const DecodeKernelParams& p, std::int64_t base, std::int64_t slot,
                                           std::int64_t* ko, std::int64_t* vo) {
  *ko = base * p.k_batch_stride + slot * p.k_seq_stride;
  *vo = base * p.v_batch_stride + slot * p.v_seq_stride;
}

/// The page of key j of sequence b, clamped to the pool (device values are unchecked).
__device__ __forceinline__ int page_of(const DecodeKernelParams& p, int b, int j) {
  const int page = __ldg(p.block_table + b * p.block_table_stride + (j >> p.page_shift));
  return min(max(page, 0), p.num_pages - 1);
}

/// Element offsets of key j of sequence b in the K and the V cache: contiguous, or through the
/// block table. One load for both.
__device__ __forceinline__ void kv_rows(const DecodeKernelParams& p, int b, int j, std::int64_t* ko, std::int64_t* vo) {
  if (p.paged) kv_offsets(p, page_of(p, b, j), j & p.page_mask, ko, vo);
  else kv_offsets(p, b, j, ko, vo);
}

/// (cos, sin) of rotary pair i at position pos (decode.h). Tables: row clamped to the table.
/// Theta: the fp32 angle of decode.h (inv_freq from the host), reduced to [-pi, pi] with a three-part 2*pi (Cody-Waite,
/// exact products in the FMAs) and evaluated with MUFU sin/cos (abs error ~4e-7 there). sincosf
/// itself would pull in the Payne-Hanek path and a local-memory stack frame.
__device__ __forceinline__ void rotary_cos_sin(const DecodeKernelParams& p, int pos, int i, float* c, float* s) {
  if (p.rot_cos != nullptr) {
    pos = min(max(pos, 0), p.rot_max_pos - 1);
    const std::int64_t at = static_cast<std::int64_t>(pos) * (p.rot_dim / 2) + i;
    *c = __ldg(p.rot_cos + at);
    *s = __ldg(p.rot_sin + at);
    return;
  }
  const float angle = static_cast<float>(pos) * p.rot_inv_freq[i];
  constexpr float kInv2Pi = 0.15915494309189535f;
  constexpr float k2PiHi = 6.2831854820251465f;         // float(2 pi)
  constexpr float k2PiMid = -1.7484555314695172e-07f;   // float(2 pi - k2PiHi)
  constexpr float k2PiLo = -6.8604980400235275e-15f;    // float(2 pi - k2PiHi - k2PiMid)
  const float k = rintf(angle * kInv2Pi);
  float r = fmaf(-k, k2PiHi, angle);
  r = fmaf(-k, k2PiMid, r);
  r = fmaf(-k, k2PiLo, r);
  __sincosf(r, s, c);
}

/// Rotates the pair (src_a, src_b) in fp32 (rope::rotate_pair, the expression every rotary path
/// shares) and stores the rounded results to (dst_a, dst_b) (decode.h's rule); in place when equal.
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* src_a, const T* src_b, T* dst_a, T* dst_b, float c, float s) {
  float x1 = to_float(*src_a), x2 = to_float(*src_b);
  rope::rotate_pair(x1, x2, c, s);
  *dst_a = from_float<T>(x1);
  *dst_b = from_float<T>(x2);
}

/// Appends token t of sequence b, KV head hk, at cache slot `pos`, by one warp: V copied, K
/// rotated (dims past rotary_dim copied). The append kernel and the fused append of the split-KV
/// kernel both call this, so the cache bytes are the same either way.
template <typename T>
__device__ __forceinline__ void append_row(const DecodeKernelParams& p, int b, int t, int hk, int pos, int lane) {
  const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_batch_stride + t * p.kn_seq_stride + hk * p.kn_head_stride;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_batch_stride + t * p.vn_seq_stride + hk * p.vn_head_stride;
  std::int64_t ko, vo;
  kv_rows(p, b, pos, &ko, &vo);
  T* kc = static_cast<T*>(p.k_cache_w) + ko + hk * p.k_head_stride;
  T* vc = static_cast<T*>(p.v_cache_w) + vo + hk * p.v_head_stride;
  const int D = p.head_dim, rd = p.rot_style != 0 ? p.rot_dim : 0;
  for (int e = lane; e < D; e += 32) {
    vc[e] = vn[e];
    if (e >= rd) kc[e] = kn[e];  // dims past rotary_dim pass through
  }
  if (rd > 0) {
    const RotaryStyle style = p.rot_style == 2 ? RotaryStyle::kInterleaved : RotaryStyle::kNeox;
    for (int i = lane; i < rd / 2; i += 32) {
      float c, s;
      rotary_cos_sin(p, pos, i, &c, &s);
      int ea, eb;
      flashcpp::decode::rotary_pair(style, i, rd, &ea, &eb);
      rotate_pair(kn + ea, kn + eb, kc + ea, kc + eb, c, s);
    }
  }
}

/// The work list (decode_common.h) read where it must be: when every sequence has the same split
/// count n (p.uniform_splits), items are numbered sequence by sequence, so item i is split i % n of
/// sequence i / n and sequence b's first item is b * n, with no load before a CTA's first copy.
/// Sequence b's split count.
__device__ __forceinline__ int num_splits_of(const DecodeKernelParams& p, int b) {
  return p.uniform_splits > 0 ? p.uniform_splits : p.num_splits[b];
}
/// Sequence b's first work item.
__device__ __forceinline__ int first_item_of(const DecodeKernelParams& p, int b) {
  return p.uniform_splits > 0 ? b * p.uniform_splits : p.first_item[b];
}
/// The sequence, split and split count of work item `item`.
__device__ __forceinline__ void item_of(const DecodeKernelParams& p, int item, int* b, int* split, int* nsplit) {
  if (p.uniform_splits > 0) {
    *nsplit = p.uniform_splits;
    *b = item / *nsplit;
    *split = item - *b * *nsplit;
  } else {
    *b = p.item_batch[item];
    *split = p.item_split[item];
    *nsplit = p.num_splits[*b];
  }
}

/// Warps that merge one output row together (the merge kernel's CTA; the fused merge's CTA).
constexpr int kMergeWarps = 4;

/// The merge of one output row (sequence b, token t, query head h) of a sequence with n_b > 1
/// splits:  w_i = exp(lse_i - max lse),  O = sum_i w_i O_i / sum_i w_i,  LSE = max lse + log(sum_i w_i).
/// Empty splits (LSE = -inf) contribute nothing; all empty (sum 0): O = 0, LSE = -inf. A NaN LSE
/// (a split that saw a NaN score) never wins fmaxf, but its weight, the sum, O and LSE are NaN. The partials are
/// read through L2 (ld.global.cg): in the fused merge other CTAs wrote them during this launch.
///
/// Latency, not bandwidth, sets its time (a B = 1 merge reads ~130 KB for a few dozen rows): the
/// LSEs are loaded at once (lane j holds splits j, j + 32, ...) and every lane computes the same
/// weights; the splits are cut into kMergeWarps quarters, each summed in split order with its
/// partial rows loaded 8 at a time (4 on sm_8x) before any is used, and the quarters' sums are
/// added in quarter order. A merge of n splits waits for ~2 + n / 32 round trips to L2 (ncu,
/// B = 1, 32 heads, 8 splits: 8.7 us when each split was loaded when needed). Two schedules do
/// exactly these operations in this order, so they agree bit for bit with each other and across
/// runs: merge_row (the merge kernel; the fused merge of one row) gives each quarter to a warp of
/// the CTA; merge_row_warp (the fused merge of several rows, one per warp) sums the quarters in
/// one warp.
struct MergeRow {
  static constexpr int kRounds = kDecodeMaxSplits / 32;  // LSEs per lane
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static constexpr int kBatch = 4;  // partial rows in flight per lane (sm_80's ptxas spills 4 bytes at 8)
#else
  static constexpr int kBatch = 8;  // partial rows in flight per lane (measured on the H200)
#endif
  int n, first, hk, r, D;
  float w[kRounds];  // lane's weights exp(lse - max): splits lane, lane + 32, ...
  float mx, sum, inv;

  __device__ __forceinline__ std::int64_t at(const DecodeKernelParams& p, int i) const {
    return (static_cast<std::int64_t>(first + i) * p.heads_kv + hk) * p.rows + r;
  }
  __device__ __forceinline__ MergeRow(const DecodeKernelParams& p, int b, int t, int h) {
    n = num_splits_of(p, b);
    first = first_item_of(p, b);
    hk = h / p.group;
    r = (h % p.group) * p.seqlen_q + t;
    D = p.head_dim;
  }
  /// Loads the LSEs and computes the weights (the whole warp).
  __device__ __forceinline__ void weights(const DecodeKernelParams& p, int lane) {
    mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      const int i = 32 * k + lane;
      w[k] = i < n ? __ldcg(p.part_lse + at(p, i)) : -INFINITY;
      mx = fmaxf(mx, w[k]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    sum = 0.f;
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      w[k] = w[k] == -INFINITY ? 0.f : exp2f((w[k] - (mx == -INFINITY ? 0.f : mx)) * kLog2e);
      sum += w[k];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    inv = sum != 0.f ? 1.f / sum : 0.f;
  }
  /// acc = sum over quarter q's splits of w_i O_i, in split order. Lane l owns columns 4l .. 4l + 3
  /// and, for D = 256, 128 + 4l ..; the weights are broadcast from their lanes by every lane
  /// (shuffles outside the column test).
  __device__ __forceinline__ void quarter(const DecodeKernelParams& p, int q, int lane, float4 acc[2]) const {
    const int per = (n + kMergeWarps - 1) / kMergeWarps, lo = min(n, q * per), hi = min(n, lo + per);
    acc[0] = acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      if (32 * k >= hi) break;
      if (32 * k + 32 <= lo) continue;
      for (int j0 = max(lo, 32 * k); j0 < min(hi, 32 * k + 32); j0 += kBatch) {
        float wb[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const float x = __shfl_sync(0xffffffffu, w[k], (j0 + u) & 31);
          wb[u] = j0 + u < min(hi, 32 * k + 32) ? x : 0.f;
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int d = lane * 4 + 128 * c;
          if (d >= D) continue;
          float4 v[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; ++u)
            v[u] = wb[u] != 0.f ? __ldcg(reinterpret_cast<const float4*>(p.part_o + at(p, j0 + u) * D + d))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            acc[c].x = fmaf(wb[u], v[u].x, acc[c].x);
            acc[c].y = fmaf(wb[u], v[u].y, acc[c].y);
            acc[c].z = fmaf(wb[u], v[u].z, acc[c].z);
            acc[c].w = fmaf(wb[u], v[u].w, acc[c].w);
          }
        }
      }
    }
  }
  /// Writes O = acc / sum (and the LSE) of the row (one warp).
  template <typename T>
  __device__ __forceinline__ void store(const DecodeKernelParams& p, int b, int t, int h, int lane, const float4 acc[2]) const {
    T* dst = static_cast<T*>(p.o) + b * p.o_batch_stride + t * p.o_seq_stride + h * p.o_head_stride;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int d = lane * 4 + 128 * c;
      if (d >= D) continue;
      uint2 packed;
      packed.x = ptx::pack2<T>(acc[c].x * inv, acc[c].y * inv);
      packed.y = ptx::pack2<T>(acc[c].z * inv, acc[c].w * inv);
      *reinterpret_cast<uint2*>(dst + d) = packed;
    }
    if (lane == 0 && p.lse != nullptr)
      p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q + t] = sum == 0.f ? -INFINITY : mx + logf(sum);
  }
};

/// One row by the kMergeWarps warps of a CTA (every thread calls it; it synchronizes): warp w sums
/// quarter w, warp 0 adds the others' sums in warp order through `scratch` (float4
/// [kMergeWarps - 1][2][32] in shared memory).
template <typename T>
__device__ __forceinline__ void merge_row(const DecodeKernelParams& p, int b, int t, int h, int warp, int lane,
                                          float4* scratch) {
  MergeRow m(p, b, t, h);
  m.weights(p, lane);
  float4 acc[2];
  m.quarter(p, warp, lane, acc);
  if (warp > 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) scratch[((warp - 1) * 2 + c) * 32 + lane] = acc[c];
  }
  __syncthreads();
  if (warp == 0) {
    for (int o = 1; o < kMergeWarps; ++o)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float4 x = scratch[((o - 1) * 2 + c) * 32 + lane];
        acc[c].x += x.x;
        acc[c].y += x.y;
        acc[c].z += x.z;
        acc[c].w += x.w;
      }
    m.store<T>(p, b, t, h, lane, acc);
  }
  __syncthreads();  // scratch is free again (the fused merge calls this row after row)
}

/// One row by one warp (no synchronization): the quarters one after another, added in order.
template <typename T>
__device__ __forceinline__ void merge_row_warp(const DecodeKernelParams& p, int b, int t, int h, int lane) {
  MergeRow m(p, b, t, h);
  m.weights(p, lane);
  float4 acc[2];
  m.quarter(p, 0, lane, acc);
  for (int q = 1; q < kMergeWarps; ++q) {
    float4 x[2];
    m.quarter(p, q, lane, x);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      acc[c].x += x[c].x;
      acc[c].y += x[c].y;
      acc[c].z += x[c].z;
      acc[c].w += x[c].w;
    }
  }
  m.store<T>(p, b, t, h, lane, acc);
}

template <int D, typename T>
__global__ void __launch_bounds__(Config<D>::kThreads, Config<D>::kCtasPerSm)
    decode_split_kernel(const __grid_constant__ DecodeKernelParams p) {
  // The kernel before it on the stream (RunOptions::programmatic_launch): waited for here, or,
  // after this step's own append kernel, once everything but the appended keys is in flight.
  const bool early = p.after_own_append != 0;
  if (!early) pdl_wait_then_release();
  using Cfg = Config<D>;
  constexpr int BN = Cfg::kBlockN, S = Cfg::kStages, DT = D / 8, KT = D / 16;
  constexpr int kRowChunks = D / 8;  // 16-byte chunks per row
  constexpr std::uint32_t kRowBytes = D * 2;
  constexpr int kORowStride = D + 4;  // epilogue fp32 rows, padded against bank conflicts

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw + Cfg::kQBytes);
  T* sV = sK + S * BN * D;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;

  // ---- which work: (item, KV head, row block) ------------------------------------------------
  int bid = blockIdx.x;
  const int rb = bid % p.row_blocks;
  bid /= p.row_blocks;
  const int hk = bid % p.heads_kv;
  const int item = bid / p.heads_kv;
  int b, split, nsplit;
  item_of(p, item, &b, &split, &nsplit);
  const int Sq = p.seqlen_q;
  const int len = flashcpp::decode::total_len(p.cache_seqlens[b], p.slots, Sq, p.append != 0);
  const MaskRules rules = flashcpp::decode::sequence_rules(Sq, len, p.causal != 0, p.window_left, p.window_right);
  int key_lo, key_hi, tile_begin, tile_end;
  rules.key_range(0, Sq, &key_lo, &key_hi);
  flashcpp::decode::split_tiles(key_lo, key_hi, split, nsplit, BN, &tile_begin, &tile_end);
  const int n_iters = tile_end - tile_begin;

  // ---- fused append (DecodePlan::fused_append): this split's share of the step's new K/V ------
  // The appended tokens are the last Sq keys; each lies in exactly one split's tiles, and that
  // split's CTAs write it (one warp per token; every row block writes the same bytes) before any
  // tile is loaded. The barrier makes the writes visible to this CTA's cp.async reads; no other
  // split reads these slots.
  if (p.fused_append) {
    for (int t = threadIdx.x / 32; t < Sq; t += Cfg::kWarps) {
      const int pos = len - Sq + t;
      if (pos >= tile_begin * BN && pos < tile_end * BN) append_row<T>(p, b, t, hk, pos, threadIdx.x % 32);
    }
    __syncthreads();
  }

  const int WR = p.warp_rows, WK = Cfg::kWarps / WR;
  const int wr = warp / WK, wk = warp % WK;
  const int cta_rows = 16 * WR, row0 = rb * cta_rows;

  // ---- K/V tiles: cp.async, 16 bytes per thread and row ---------------------------------------
  // A thread copies chunk c of rows r0, r0 + kRowsPerPass, ... of each tile. Contiguous cache: one
  // row offset per tile, the rest by a constant stride. Paged: one block-table read per tile when
  // a page holds whole tiles (page_size >= BN; tiles start on multiples of BN), else one per row,
  // all loaded before the first copy is issued.
  constexpr int kRowsPerPass = Cfg::kThreads / kRowChunks;
  const int c = tid % kRowChunks, r0 = tid / kRowChunks;
  const T* gK = static_cast<const T*>(p.k_cache) + hk * p.k_head_stride + c * 8;
  const T* gV = static_cast<const T*>(p.v_cache) + hk * p.v_head_stride + c * 8;
  const bool page_holds_tile = p.paged && p.page_mask + 1 >= BN;
  auto load_tile = [&](int stage, int tile) {
    constexpr int kIt = BN / kRowsPerPass;
    T* dK = sK + stage * BN * D;
    T* dV = sV + stage * BN * D;
    const int j0 = tile * BN + r0;
    std::int64_t ko[kIt], vo[kIt];
    if (!p.paged || page_holds_tile) {
      kv_rows(p, b, j0, &ko[0], &vo[0]);
#pragma unroll
      for (int it = 1; it < kIt; ++it) {
        ko[it] = ko[0] + static_cast<std::int64_t>(it * kRowsPerPass) * p.k_seq_stride;
        vo[it] = vo[0] + static_cast<std::int64_t>(it * kRowsPerPass) * p.v_seq_stride;
      }
    } else {
      // Small pages: one block-table read per row, all issued before any is used (one round
      // trip per tile, not kIt in a row). Rows past the visible end read the last visible key's
      // entry and copy nothing.
      int page[kIt];
#pragma unroll
      for (int it = 0; it < kIt; ++it) page[it] = page_of(p, b, min(j0 + it * kRowsPerPass, key_hi - 1));
#pragma unroll
      for (int it = 0; it < kIt; ++it) kv_offsets(p, page[it], (j0 + it * kRowsPerPass) & p.page_mask, &ko[it], &vo[it]);
    }
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int r = r0 + it * kRowsPerPass;
      const bool ok = j0 + it * kRowsPerPass < key_hi;  // keys at or past the visible end are zero-filled, never read
      ptx::cp_async_16(ptx::smem_u32(dK + swz<D>(r, c)), gK + (ok ? ko[it] : 0), ok ? 16 : 0);
      ptx::cp_async_16(ptx::smem_u32(dV + swz<D>(r, c)), gV + (ok ? vo[it] : 0), ok ? 16 : 0);
    }
  };
  // The first S - 1 stages. After the append kernel (early), the stages before the first tile that
  // holds an appended key ([len - Sq, len): the last tiles of the sequence, so a suffix of the
  // stages) are issued now and the rest after the wait below; the commit order is the same.
  const int first_new_tile = early ? (len - Sq) / BN : INT_MAX;
  int s_early = 0;
#pragma unroll
  for (; s_early < S - 1; ++s_early) {
    if (s_early < n_iters && tile_begin + s_early >= first_new_tile) break;
    if (s_early < n_iters) load_tile(s_early, tile_begin + s_early);
    ptx::cp_async_commit();
  }

  // ---- Q: the CTA's rows, rotated at their positions, into swizzled shared memory -------------
  const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride;
  for (int idx = tid; idx < cta_rows * kRowChunks; idx += Cfg::kThreads) {
    const int rr = idx / kRowChunks, c = idx % kRowChunks, gr = row0 + rr;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (gr < p.rows) {
      const int h = hk * p.group + gr / Sq, t = gr % Sq;
      val = __ldg(reinterpret_cast<const uint4*>(gQ + t * p.q_seq_stride + h * p.q_head_stride + c * 8));
    }
    *reinterpret_cast<uint4*>(sQ + swz<D>(rr, c)) = val;
  }
  if (p.rot_style != 0) {
    __syncthreads();
    const int half = p.rot_dim / 2;
    const RotaryStyle style = p.rot_style == 2 ? RotaryStyle::kInterleaved : RotaryStyle::kNeox;
    for (int idx = tid; idx < cta_rows * half; idx += Cfg::kThreads) {
      const int rr = idx / half, i = idx % half, gr = row0 + rr;
      if (gr >= p.rows) continue;
      float c, s;
      rotary_cos_sin(p, len - Sq + gr % Sq, i, &c, &s);
      int ea, eb;
      flashcpp::decode::rotary_pair(style, i, p.rot_dim, &ea, &eb);
      T* qa = sQ + swz<D>(rr, ea >> 3) + (ea & 7);
      T* qb = sQ + swz<D>(rr, eb >> 3) + (eb & 7);
      rotate_pair(qa, qb, qa, qb, c, s);
    }
  }

  if (early) {
    pdl_wait_then_release();  // the append kernel: the appended keys are in the cache now
    for (int s = s_early; s < S - 1; ++s) {
      if (s < n_iters) load_tile(s, tile_begin + s);
      ptx::cp_async_commit();
    }
  }

  // ---- per-lane row constants: rows g and g + 8 of this warp's m16 tile ------------------------
  int row_t[2], row_ia[2];
  float row_slope[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gr = min(row0 + wr * 16 + g + 8 * r, p.rows - 1);  // padding rows borrow a real row's constants
    row_t[r] = gr % Sq;
    row_ia[r] = row_t[r] + len - Sq;
    row_slope[r] = p.alibi != nullptr
                       ? __ldg(p.alibi + b * p.alibi_batch_stride + hk * p.group + gr / Sq) * kLog2e
                       : 0.f;
  }

  float acc_o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  // ldmatrix row addresses (see fa2_kernel.cuh): chunk 2*kk + c of a lane's row sits at
  // (row_base | ((c ^ row%8) << 4)) ^ (kk << 5); tiles and stages start on multiples of a row.
  const std::uint32_t r7 = lane & 7;
  const std::uint32_t q_base =
      ptx::smem_u32(sQ) + (wr * 16 + (lane & 15)) * kRowBytes + (((lane >> 4) ^ r7) << 4);
  const std::uint32_t k_base =
      ptx::smem_u32(sK) + ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((((lane >> 3) & 1) ^ r7) << 4);
  const std::uint32_t v_base = ptx::smem_u32(sV) + (lane & 15) * kRowBytes + (((lane >> 4) ^ r7) << 4);

  // Pipeline: the stage of tile it + S - 1 is the one tile it - 1 was read from; once every warp
  // is past that tile (first barrier) its copy is issued, and only then does the CTA wait for
  // tile it (S - 1 newer groups may stay in flight) and make it visible (second barrier). So all
  // S stages are in flight while a CTA waits, not S - 1 (a memory-bound kernel is mostly waiting).
  for (int it = 0; it < n_iters; ++it) {
    __syncthreads();
    if (it + S - 1 < n_iters) load_tile((it + S - 1) % S, tile_begin + it + S - 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<S - 1>();
    __syncthreads();
    const std::uint32_t stage_off = (it % S) * BN * kRowBytes;
    const int j_tile = (tile_begin + it) * BN;
    const bool full = rules.tile_fully_visible(0, Sq, j_tile, j_tile + BN);

    for (int ch = wk; ch < Cfg::kChunks; ch += WK) {
      const std::uint32_t chunk_off = stage_off + ch * 16 * kRowBytes;
      // ---- S = Q K^T for 16 rows x 16 keys ----
      float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        std::uint32_t a[4], bk[4];
        ptx::ldmatrix_x4(a, q_base ^ (kk << 5));
        ptx::ldmatrix_x4(bk, (k_base + chunk_off) ^ (kk << 5));
        ptx::mma_16816<T>(s_acc[0], a, bk[0], bk[1]);
        ptx::mma_16816<T>(s_acc[1], a, bk[2], bk[3]);
      }
      // ---- scores in the exp2 domain, mask ----
      const int j_chunk = j_tile + ch * 16;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, j = j_chunk + nt * 8 + 2 * t4 + (e & 1);
          const float x = s_acc[nt][e];
          float y = p.cap_log2 > 0.f ? p.cap_log2 * tanhf(x * p.scale_over_cap) : x * p.scale_log2;
          if (p.alibi != nullptr) y = fmaf(row_slope[r], static_cast<float>(j - row_ia[r]), y);
          if (!full && !rules.visible(row_t[r], j)) y = -INFINITY;
          s_acc[nt][e] = y;
        }
      // ---- online softmax ----
      float corr_r[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(fmaxf(s_acc[0][2 * r], s_acc[0][2 * r + 1]), fmaxf(s_acc[1][2 * r], s_acc[1][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[r], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: exp2(-inf - 0) = 0
        const float corr = m_run[r] == m_use ? 1.f : ptx::exp2_approx(m_run[r] - m_use);
        m_run[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s_acc[nt][2 * r] = ptx::exp2_approx(s_acc[nt][2 * r] - m_use);
          s_acc[nt][2 * r + 1] = ptx::exp2_approx(s_acc[nt][2 * r + 1] - m_use);
          sum += s_acc[nt][2 * r] + s_acc[nt][2 * r + 1];
        }
        l_run[r] = l_run[r] * corr + sum;  // per-thread partial; quad-reduced in the epilogue
        corr_r[r] = corr;
      }
      // O's rescale only when some row's max moved (exp2(0) is exactly 1: skipping it is exact);
      // past the first tiles of a split the max rarely moves, and this is most of the per-chunk math.
      if (__any_sync(0xffffffffu, corr_r[0] != 1.f || corr_r[1] != 1.f)) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc_o[dt][0] *= corr_r[0];
          acc_o[dt][1] *= corr_r[0];
          acc_o[dt][2] *= corr_r[1];
          acc_o[dt][3] *= corr_r[1];
        }
      }
      // ---- O += P V (P straight from the S fragments) ----
      std::uint32_t a[4];
      a[0] = ptx::pack2<T>(s_acc[0][0], s_acc[0][1]);
      a[1] = ptx::pack2<T>(s_acc[0][2], s_acc[0][3]);
      a[2] = ptx::pack2<T>(s_acc[1][0], s_acc[1][1]);
      a[3] = ptx::pack2<T>(s_acc[1][2], s_acc[1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        std::uint32_t bv[4];
        ptx::ldmatrix_x4_trans(bv, (v_base + chunk_off) ^ (dp << 5));
        ptx::mma_16816<T>(acc_o[2 * dp], a, bv[0], bv[1]);
        ptx::mma_16816<T>(acc_o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: they become the epilogue scratch

  // ---- epilogue 1: each warp's (m, l, O) of its 16 rows into shared memory ---------------------
  float* sO = reinterpret_cast<float*>(smem_raw + Cfg::kQBytes);
  float* sM = sO + Cfg::kWarps * 16 * kORowStride;
  float* sL = sM + Cfg::kWarps * 16;
  static_assert(Cfg::kWarps * 16 * (kORowStride + 2) * 4 <= S * Cfg::kStageBytes, "epilogue scratch fits");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row16 = g + 8 * r;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(sO + (warp * 16 + row16) * kORowStride + dt * 8 + 2 * t4) =
          make_float2(acc_o[dt][2 * r], acc_o[dt][2 * r + 1]);
    if (t4 == 0) {
      sM[warp * 16 + row16] = m_run[r];
      sL[warp * 16 + row16] = l;
    }
  }
  __syncthreads();

  // ---- epilogue 2: merge the key-splitting warps of each row, write O/LSE or the partial -------
  const int Dq = D / 4;
  for (int idx = tid; idx < cta_rows * Dq; idx += Cfg::kThreads) {
    const int rr = idx / Dq, d = (idx % Dq) * 4, gr = row0 + rr;
    if (gr >= p.rows) continue;
    const int w0 = (rr / 16) * WK, r16 = rr % 16;
    float m = -INFINITY;
    for (int k = 0; k < WK; ++k) m = fmaxf(m, sM[(w0 + k) * 16 + r16]);
    // Against 0 while every warp's max is -inf (-inf - (-inf) would be NaN): a warp that saw no
    // key has l = 0 and O = 0 and adds 0; one whose scores were all NaN kept m = -inf (fmaxf
    // drops NaN) with l = NaN, and that NaN must reach O and the LSE (attention.h).
    const float m_use = m == -INFINITY ? 0.f : m;
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < WK; ++k) {
      const float w = ptx::exp2_approx(sM[(w0 + k) * 16 + r16] - m_use);
      const float4 v = *reinterpret_cast<const float4*>(sO + ((w0 + k) * 16 + r16) * kORowStride + d);
      l = fmaf(sL[(w0 + k) * 16 + r16], w, l);
      o.x = fmaf(w, v.x, o.x);
      o.y = fmaf(w, v.y, o.y);
      o.z = fmaf(w, v.z, o.z);
      o.w = fmaf(w, v.w, o.w);
    }
    const float inv = l != 0.f ? 1.f / l : 0.f;  // a row with no visible key: O = 0, LSE = -inf
    const float lse = l != 0.f ? (m + __log2f(l)) * kLn2 : -INFINITY;
    const int h = hk * p.group + gr / Sq, t = gr % Sq;
    if (nsplit == 1) {
      T* dst = static_cast<T*>(p.o) + b * p.o_batch_stride + t * p.o_seq_stride + h * p.o_head_stride + d;
      uint2 packed;
      packed.x = ptx::pack2<T>(o.x * inv, o.y * inv);
      packed.y = ptx::pack2<T>(o.z * inv, o.w * inv);
      *reinterpret_cast<uint2*>(dst) = packed;
      if (d == 0 && p.lse != nullptr) p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * Sq + t] = lse;
    } else {
      const std::int64_t pi = (static_cast<std::int64_t>(item) * p.heads_kv + hk) * p.rows + gr;
      *reinterpret_cast<float4*>(p.part_o + pi * D + d) = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
      if (d == 0) p.part_lse[pi] = lse;
    }
  }

  // ---- fused merge: the last of the sequence's splits to finish these rows merges them --------
  // Each thread's partial stores are fenced device-wide before thread 0 counts the CTA in; the
  // CTA that brings the count to nsplit fences again and reads the partials through L2, then
  // resets the counter for the next run (the plan zeroed it), so a graph replays unchanged.
  if (p.merge_counters != nullptr && nsplit > 1) {
    int& s_last = *reinterpret_cast<int*>(smem_raw);  // the Q tile's first word: Q is no longer read
    __threadfence();
    __syncthreads();
    int* counter = p.merge_counters + (static_cast<std::int64_t>(b) * p.heads_kv + hk) * p.row_blocks + rb;
    if (tid == 0) s_last = atomicAdd(counter, 1) == nsplit - 1;
    __syncthreads();
    if (s_last) {
      static_assert(Cfg::kWarps == kMergeWarps, "the fused merge's CTA merges a row with all its warps");
      __threadfence();
      float4* scratch = reinterpret_cast<float4*>(smem_raw + Cfg::kQBytes);  // the stages: free since epilogue 2
      const int rows_here = min(cta_rows, p.rows - row0);
      if (rows_here == 1) {  // one row (MHA decode): all warps on its splits
        merge_row<T>(p, b, row0 % Sq, hk * p.group + row0 / Sq, warp, lane, scratch);
      } else {  // several rows: one per warp, in parallel (the same sums, bit for bit)
        for (int rr = warp; rr < rows_here; rr += Cfg::kWarps) {
          const int gr = row0 + rr;
          merge_row_warp<T>(p, b, gr % Sq, hk * p.group + gr / Sq, lane);
        }
      }
      if (tid == 0) *counter = 0;
    }
  }
}

}  // namespace flashcpp::cuda::decode_dev
