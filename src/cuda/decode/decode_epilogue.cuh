// The epilogue of the split-KV decode kernel: the warps that split a row block's keys merge their
// (m, l, O) through shared memory (the partial-state rule of common/attention_algebra.h), then the
// CTA writes the final O and LSE (a sequence of one split) or its split's normalized partial O and
// LSE (fp32 workspace, for the merge); with the fused merge, the split that finishes a (sequence,
// KV head, row block) last merges all of them.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/decode_mainloop.cuh"
#include "cuda/decode/decode_merge.cuh"

namespace flashcpp::cuda::decode_dev {

/// W is the warp of the main loop (DecodeWarp, or DecodeWarp8 over an fp8 cache): its store_o
/// knows which dims each lane holds.
template <int D, typename T, class W>
__device__ __forceinline__ void decode_epilogue(const DecodeKernelParams& p, const DecodeCta& cta, const W& w,
                                                unsigned char* smem_raw, int row0, int cta_rows, int WK, int tid) {
  using Cfg = Config<D>;
  constexpr int kORowStride = D + 4;  // fp32 rows, padded against bank conflicts
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4, Sq = p.seqlen_q;
  // 1: each warp's (m, l, O) of its 16 rows into shared memory (the K/V stages, free now)
  float* sO = reinterpret_cast<float*>(smem_raw + Cfg::kQBytes);
  float* sM = sO + Cfg::kWarps * 16 * kORowStride;
  float* sL = sM + Cfg::kWarps * 16;
  static_assert(Cfg::kMergeBytes == Cfg::kWarps * 16 * (kORowStride + 2) * 4, "Config::kMergeBytes is this scratch");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(w.row[r].l);
    const int row16 = g + 8 * r;
    w.store_o(sO + (warp * 16 + row16) * kORowStride, r, t4);
    if (t4 == 0) {
      sM[warp * 16 + row16] = w.row[r].m;
      sL[warp * 16 + row16] = l;
    }
  }
  __syncthreads();

  // 2: merge the key-splitting warps of each row; write O and the LSE, or the split's partial. Only
  // the columns of head_dim_v (a multiple of 8) are stored: the class's padding columns are zero.
  const int Dq = D / 4, Dv = p.head_dim_v;
  for (int idx = tid; idx < cta_rows * Dq; idx += Cfg::kThreads) {
    const int rr = idx / Dq, d = (idx % Dq) * 4, gr = row0 + rr;
    if (gr >= p.rows || d >= Dv) continue;
    const int w0 = (rr / 16) * WK, r16 = rr % 16;
    RowSoftmax row;  // the row's merged state: the largest m, then l summed against it
    for (int k = 0; k < WK; ++k) row.m = fmaxf(row.m, sM[(w0 + k) * 16 + r16]);
    // A warp that saw no key has m = -inf, l = 0 and O = 0 and weighs 0; one whose scores were all
    // NaN kept m = -inf (fmaxf drops NaN) with l = NaN, and that NaN reaches O and the LSE.
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < WK; ++k) {
      const float wt = algebra::partial_weight(sM[(w0 + k) * 16 + r16], row.m, cta.score.c);
      const float4 v = *reinterpret_cast<const float4*>(sO + ((w0 + k) * 16 + r16) * kORowStride + d);
      row.l = fmaf(sL[(w0 + k) * 16 + r16], wt, row.l);
      o.x = fmaf(wt, v.x, o.x);
      o.y = fmaf(wt, v.y, o.y);
      o.z = fmaf(wt, v.z, o.z);
      o.w = fmaf(wt, v.w, o.w);
    }
    algebra::RowResult res = row.finalize(row.l, cta.score.c);  // l == 0 (no visible key): O = 0, LSE = -inf
    res.inv *= cta.v_scale;  // an fp8 cache: O = v_scale * (sum of P * codes) / l (1 otherwise)
    const int h = cta.hk * p.group + gr / Sq, t = gr % Sq;
    if (cta.nsplit == 1) {
      T* dst = static_cast<T*>(p.o) + cta.b * p.o_batch_stride + t * p.o_seq_stride + h * p.o_head_stride + d;
      uint2 packed;
      packed.x = ptx::pack2<T>(o.x * res.inv, o.y * res.inv);
      packed.y = ptx::pack2<T>(o.z * res.inv, o.w * res.inv);
      *reinterpret_cast<uint2*>(dst) = packed;
      if (d == 0 && p.lse != nullptr) p.lse[(static_cast<std::int64_t>(cta.b) * p.heads_q + h) * Sq + t] = res.lse;
    } else {
      const std::int64_t pi = (static_cast<std::int64_t>(cta.item) * p.heads_kv + cta.hk) * p.rows + gr;
      *reinterpret_cast<float4*>(p.part_o + pi * Dv + d) =
          make_float4(o.x * res.inv, o.y * res.inv, o.z * res.inv, o.w * res.inv);
      if (d == 0) p.part_lse[pi] = res.lse;
    }
  }
}

/// The fused merge (DecodePlan::fused_merge): the last of a sequence's splits to finish these rows
/// merges them. Each thread's partial stores are fenced device-wide before thread 0 counts the CTA
/// in; the CTA that brings the count to nsplit fences again and reads the partials through L2, then
/// resets the counter for the next run (the plan zeroed it), so a graph replays unchanged.
template <int D, typename T>
__device__ __forceinline__ void decode_fused_merge(const DecodeKernelParams& p, const DecodeCta& cta,
                                                   unsigned char* smem_raw, int row0, int cta_rows, int tid) {
  using Cfg = Config<D>;
  const int warp = tid / 32, lane = tid % 32, Sq = p.seqlen_q;
  int& s_last = *reinterpret_cast<int*>(smem_raw);  // the Q tile's first word: Q is no longer read
  __threadfence();
  __syncthreads();
  int* counter = p.merge_counters + (static_cast<std::int64_t>(cta.b) * p.heads_kv + cta.hk) * p.row_blocks + cta.rb;
  if (tid == 0) s_last = atomicAdd(counter, 1) == cta.nsplit - 1;
  __syncthreads();
  if (!s_last) return;
  static_assert(Cfg::kWarps == kMergeWarps, "the fused merge's CTA merges a row with all its warps");
  __threadfence();
  float4* scratch = reinterpret_cast<float4*>(smem_raw + Cfg::kQBytes);  // the stages: free since the epilogue
  const int rows_here = min(cta_rows, p.rows - row0);
  if (rows_here == 1) {  // one row (MHA decode): all warps on its splits
    merge_row<T>(p, cta.b, row0 % Sq, cta.hk * p.group + row0 / Sq, warp, lane, scratch);
  } else {  // several rows: one per warp, in parallel (the same sums, bit for bit)
    for (int rr = warp; rr < rows_here; rr += Cfg::kWarps) {
      const int gr = row0 + rr;
      merge_row_warp<T>(p, cta.b, gr % Sq, cta.hk * p.group + gr / Sq, lane);
    }
  }
  if (tid == 0) *counter = 0;
}

}  // namespace flashcpp::cuda::decode_dev
