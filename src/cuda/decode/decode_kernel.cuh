// Split-KV decode kernel for sm80+ (mma.sync m16n8k16, ldmatrix, cp.async), contiguous or paged
// KV cache, GQA packed into the rows of one CTA. In roles, each in its own header:
//   decode_device.cuh    cache addressing (contiguous / paged) and the plan's work list
//   decode_append.cuh    new K (rotated) and V into the cache (its own kernel, or fused here)
//   decode_mainloop.cuh  the CTA's work, K/V tile copies, Q rows, the per-warp recurrence
//   decode_epilogue.cuh  the in-CTA merge of warps, O and LSE or the split's partial, fused merge
//   decode_merge.cuh     the merge of a sequence's split partials by their LSEs
//
// One CTA = one (work item, KV head, row block). A work item is (sequence b, split s of n_b) from
// the plan; the split owns a contiguous run of 64-key tiles of the keys its rows can see. All
// heads_q / heads_kv query heads x seqlen_q tokens of the KV head are the rows of the CTA
// (row r = head offset r / seqlen_q, token r % seqlen_q), so every K/V byte is read from DRAM once
// per split. Four warps: warp_rows of them along the rows (16 rows each), the other
// 4 / warp_rows split each tile's four 16-key chunks between them. Per warp and 16-key chunk:
//   S = Q K^T               (mma.sync, fp32, raw q.k units)      u = softcap, ALiBi, mask of S
//   P, (m, l), corr = online softmax of u (common/attention_algebra.h)      O = O corr + P V
// then the warps that shared a row block merge their (m, l, O) through shared memory, and the CTA
// writes either the final O and LSE (n_b = 1) or the normalized partial O and LSE of its split
// (fp32, float workspace) for decode_merge_kernel. Over an fp8 e4m3 cache (C = Fp8Code) the ring
// holds codes and DecodeWarp8 runs the same recurrence in fp16 on fragments converted in registers
// (decode_mainloop.cuh says why and how); without a shared converted copy the fp8 step is still
// bound by this per-chunk work more than by its halved bytes (reports/decode, "FP8").
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
// (S - 1 stages in flight), or a block-table read per row, leaves bytes off the bus (reports/decode
// has the measurements).
// Where it falls off: a split shorter than kStages tiles leaves the pipeline part empty (the
// planner keeps splits >= 4 tiles); rows > 64 (MQA with > 64 heads x tokens) re-read K/V once per
// row block (from L2: the row blocks of a split run side by side).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/decode_common.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/decode_append.cuh"
#include "cuda/decode/decode_device.cuh"
#include "cuda/decode/decode_epilogue.cuh"
#include "cuda/decode/decode_mainloop.cuh"
#include "cuda/decode/decode_merge.cuh"
#include "cuda/decode/decode_params.h"

namespace flashcpp::cuda::decode_dev {

template <int D, typename T, typename C>
__global__ void __launch_bounds__(Config<D>::kThreads, kFp8Cache<C> ? Config<D>::kCtasPerSm8 : Config<D>::kCtasPerSm)
    decode_split_kernel(const __grid_constant__ DecodeKernelParams p) {
  // The kernel before it on the stream (RunOptions::programmatic_launch): waited for here, or,
  // after this step's own append kernel, once everything but the appended keys is in flight.
  const bool early = p.after_own_append != 0;
  if (!early) pdl_wait_then_release();
  using Cfg = Config<D>;
  constexpr bool kFp8 = kFp8Cache<C>;
  constexpr int BN = Cfg::kBlockN, S = kFp8 ? Cfg::kStages8 : Cfg::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Shared memory: Q rows, the ring of S stages (K then V) in the cache's element type, and for an
  // fp8 cache the query rows' fp16 scales (Config::kSmemBytes8).
  T* sQ = reinterpret_cast<T*>(smem_raw);
  C* rK = reinterpret_cast<C*>(smem_raw + Cfg::kQBytes);
  C* rV = rK + S * BN * D;
  float* q_inv = reinterpret_cast<float*>(rV + S * BN * D);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const DecodeCta cta(p, BN);
  const int n_iters = cta.n_iters(), Sq = p.seqlen_q;

  // Fused append (DecodePlan::fused_append): the appended tokens are the last Sq keys; each lies in
  // exactly one split's tiles, and that split's CTAs write it (one warp per token; every row block
  // writes the same bytes) before any tile is loaded. The barrier makes the writes visible to this
  // CTA's cp.async reads; no other split reads these slots.
  if (p.fused_append) {
    for (int t = warp; t < Sq; t += Cfg::kWarps) {
      const int pos = cta.len - Sq + t;
      if (pos >= cta.tile_begin * BN && pos < cta.tile_end * BN) append_row<T, C>(p, cta.b, t, cta.hk, pos, lane);
    }
    __syncthreads();
  }
  const int WR = p.warp_rows, WK = Cfg::kWarps / WR;  // warps along the rows, and along each tile's keys
  const int wr = warp / WK, wk = warp % WK;
  const int cta_rows = 16 * WR, row0 = cta.rb * cta_rows;

  // The first S - 1 stages. After the append kernel (early), the stages before the first tile that
  // holds an appended key ([len - Sq, len): the last tiles of the sequence, so a suffix of the
  // stages) are issued now and the rest after the wait below; the commit order is the same.
  const DecodeKvLoads<D, C> loads(p, cta.hk, tid);
  const int first_new_tile = early ? (cta.len - Sq) / BN : INT_MAX;
  int s_early = 0;
#pragma unroll
  for (; s_early < S - 1; ++s_early) {
    if (s_early < n_iters && cta.tile_begin + s_early >= first_new_tile) break;
    if (s_early < n_iters) loads.load(p, rK, rV, cta.b, cta.key_hi, s_early, cta.tile_begin + s_early);
    ptx::cp_async_commit();
  }
  decode_load_q<D, T>(p, cta, sQ, row0, cta_rows, tid);
  if (early) {
    pdl_wait_then_release();  // the append kernel: the appended keys are in the cache now
    for (int s = s_early; s < S - 1; ++s) {
      if (s < n_iters) loads.load(p, rK, rV, cta.b, cta.key_hi, s, cta.tile_begin + s);
      ptx::cp_async_commit();
    }
  }

  using Warp = std::conditional_t<kFp8, DecodeWarp8<D, T>, DecodeWarp<D, T>>;
  Warp wp = [&] {
    if constexpr (kFp8) {
      __syncthreads();  // decode_load_q's rows
      prepare_q_fp16<D, T>(sQ, q_inv, cta_rows, tid);
      __syncthreads();
      return Warp(p, cta, sQ, q_inv, rK, rV, row0, wr, lane);
    } else {
      return Warp(p, cta, sQ, rK, rV, row0, wr, lane);
    }
  }();
  // The stage of tile it + S - 1 is the one tile it - 1 was read from; once every warp is past that
  // tile (first barrier) its copy is issued, and only then does the CTA wait for tile it (S - 1
  // newer groups may stay in flight) and make it visible (second barrier). So all S stages are in
  // flight while a CTA waits, not S - 1 (a memory-bound kernel is mostly waiting).
  for (int it = 0; it < n_iters; ++it) {
    __syncthreads();
    if (it + S - 1 < n_iters) loads.load(p, rK, rV, cta.b, cta.key_hi, (it + S - 1) % S, cta.tile_begin + it + S - 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<S - 1>();
    __syncthreads();
    const std::uint32_t stage_off = (it % S) * BN * Warp::kRowBytes;
    const int j_tile = (cta.tile_begin + it) * BN;
    const bool full = cta.rules.tile_fully_visible(0, Sq, j_tile, j_tile + BN);
    for (int ch = wk; ch < Cfg::kChunks; ch += WK)
      wp.chunk(p, cta, stage_off + ch * 16 * Warp::kRowBytes, j_tile + ch * 16, full, lane % 4);
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: they become the epilogue scratch

  decode_epilogue<D, T>(p, cta, wp, smem_raw, row0, cta_rows, WK, tid);
  if (p.merge_counters != nullptr && cta.nsplit > 1) decode_fused_merge<D, T>(p, cta, smem_raw, row0, cta_rows, tid);
}

}  // namespace flashcpp::cuda::decode_dev
