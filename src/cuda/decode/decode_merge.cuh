// The merge role of decode: a split sequence's partial results combined by their LSEs (the rule
// of common/attention_algebra.h: weights exp(lse - max lse), LSE = max + ln(sum)). Run by the
// merge kernel (decode_aux.cu) or, with DecodePlan::fused_merge, by the last split-KV CTA of a
// (sequence, KV head, row block) to finish.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/decode_device.cuh"

namespace flashcpp::cuda::decode_dev {

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
/// added in quarter order. A merge of n splits waits for ~2 + n / 32 round trips to L2 (loading
/// each split when needed waited for n of them: reports/decode). Two schedules do
/// exactly these operations in this order, so they agree bit for bit with each other and across
/// runs: merge_row (the merge kernel; the fused merge of one row) gives each quarter to a warp of
/// the CTA; merge_row_warp (the fused merge of several rows, one per warp) sums the quarters in
/// one warp.
struct MergeRow {
  static constexpr int kRounds = kDecodeMaxSplits / 32;  // LSEs per lane
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static constexpr int kBatch = 4;  // partial rows in flight per lane (sm_80's ptxas spills 4 bytes at 8)
#else
  static constexpr int kBatch = 8;  // partial rows in flight per lane (the H200's best: reports/decode)
#endif
  int n, first, hk, r, D;  ///< D: head_dim_v, the partial rows' width and the columns stored
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
    D = p.head_dim_v;
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
      w[k] = algebra::lse_weight(w[k], mx);
      sum += w[k];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    inv = sum != 0.f ? 1.f / sum : 0.f;
  }
  /// acc = sum over quarter q's splits of w_i O_i, in split order. Lane l owns columns 4l .. 4l + 3
  /// and, for D > 128, 128 + 4l .. (those below D: D is a multiple of 8); the weights are broadcast from their lanes by every lane
  /// (shuffles outside the column test).
  __device__ __forceinline__ void quarter(const DecodeKernelParams& p, int q, int lane, float4 acc[2]) const {
    const int per = (n + kMergeWarps - 1) / kMergeWarps, lo = min(n, q * per), hi = min(n, lo + per);
    acc[0] = acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    // The rounds are a loop, not unrolled: unrolled, each of the three inlined copies held the
    // batch's loads and FMAs once per round, 8 times over (two thirds of the decode kernels' PTX and
    // of their compile time). The round's weight register is picked by a select chain instead of an
    // index, so w stays in registers.
#pragma unroll 1
    for (int k = 0; k < kRounds; ++k) {
      if (32 * k >= hi) break;
      if (32 * k + 32 <= lo) continue;
      float wk = w[0];
#pragma unroll
      for (int kk = 1; kk < kRounds; ++kk) wk = k == kk ? w[kk] : wk;
      for (int j0 = max(lo, 32 * k); j0 < min(hi, 32 * k + 32); j0 += kBatch) {
        float wb[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const float x = __shfl_sync(0xffffffffu, wk, (j0 + u) & 31);
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
      p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q + t] = algebra::merged_lse(mx, sum);
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

}  // namespace flashcpp::cuda::decode_dev
