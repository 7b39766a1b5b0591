// The engine's batch-small GEMV (launcher: gemv.cu; row grouping: gemv_plan.h). Every weight is
// read exactly once, so a decode step at batch 1-2 is bound by HBM: 2.47 GB for Llama-3.2-1B ->
// 0.58 ms at 4.3 TB/s. cuBLASLt takes everything else (prefill, more than 8 rows).
//
// y (M, N) = prologue(x) (M, K) * w (N, K)^T for M <= 8. The CTA first builds prologue(x) in
// shared memory (bf16, M_pad rows, zero rows past M), then strides over groups of kGemvRows
// output rows: its 8 warps split K, each lane streams 16-byte weight chunks (evict-first: never
// reused) and dots them with the shared rows, and the warps' partial sums meet in shared memory.
// Splitting K keeps enough loads in flight when N is small and K large (down_proj: N 2048,
// K 8192), where one warp per row left the HBM half idle. The grid is one full wave, so the
// prologue runs once per CTA. On sm_90 the launch is programmatic (PDL): the CTA prefetches
// its first weight rows into L2, only then waits for the kernel that produced x
// (griddepcontrol.wait), and lets the next GEMV launch early.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fused_math.h"
#include "cuda/engine/engine_common.cuh"
#include "cuda/engine/engine_launch.h"

namespace flashcpp::cuda::engine {

constexpr int kGemvRows = 4;  // output rows per CTA iteration (the 8 warps split K); 2 where
                              // gemv_grouping says the wave quantizes badly (gemv_plan.h)
constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;

struct GemvArgs {
  const bf16* x;
  std::int64_t ldx;
  const bf16* w;
  void* y;
  std::int64_t ldy;
  int M, N, K;
  int kind;  // GemvPrologueKind
  const bf16* norm_w;
  float eps;
  const bf16* residual;
  bf16* residual_out;
};

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

template <class T> __device__ __forceinline__ void store_out(T* p, float v);
template <> __device__ __forceinline__ void store_out<float>(float* p, float v) { *p = v; }
template <> __device__ __forceinline__ void store_out<bf16>(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

__device__ float gemv_block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < kGemvWarps; ++i) t += red[i];
  return t;
}

union Bf16x8 {
  uint4 u;
  __nv_bfloat16 h[8];
};

/// Row m of prologue(x) into xs (K bf16), 8 elements (16 bytes) per access; K % 8 == 0 and
/// every row start is 16-byte aligned (gemv_ok checks). Every thread of the CTA takes part. Only
/// the 16-byte chunks [v0, v1) are built (half of K for a K-split CTA; all of it for the norms,
/// whose sum of squares needs the whole row).
__device__ void gemv_prologue_row(const GemvArgs& a, int m, bf16* xs, float* red, int v0, int v1) {
  using Kind = GemvPrologueKind;
  const Kind kind = static_cast<Kind>(a.kind);
  const int K = a.K, kvec = K / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(a.x + m * a.ldx);
  const uint4* rr = reinterpret_cast<const uint4*>(a.residual + static_cast<std::int64_t>(m) * K);
  uint4* ro = reinterpret_cast<uint4*>(a.residual_out + static_cast<std::int64_t>(m) * K);
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  float ss = 0.f;
  for (int v = v0 + threadIdx.x; v < v1; v += kGemvThreads) {
    Bf16x8 in, out;
    in.u = xr[v];
    if (kind == Kind::kSiluMul) {
      Bf16x8 up;
      up.u = xr[kvec + v];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        out.h[i] = __float2bfloat16_rn(flashcpp::fused::silu_mul(__bfloat162float(in.h[i]), __bfloat162float(up.h[i])));
    } else if (kind == Kind::kAddRmsNorm) {
      Bf16x8 res;
      res.u = rr[v];
#pragma unroll
      for (int i = 0; i < 8; ++i) out.h[i] = __float2bfloat16_rn(__bfloat162float(in.h[i]) + __bfloat162float(res.h[i]));
      if (blockIdx.x == 0) ro[v] = out.u;
    } else {
      out.u = in.u;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float f = __bfloat162float(out.h[i]);
      ss = fmaf(f, f, ss);
    }
    xs4[v] = out.u;
  }
  if (kind != Kind::kRmsNorm && kind != Kind::kAddRmsNorm) return;
  const float rstd = rsqrtf(gemv_block_sum(ss, red) / static_cast<float>(K) + a.eps);
  const uint4* w4 = reinterpret_cast<const uint4*>(a.norm_w);
  for (int v = v0 + threadIdx.x; v < v1; v += kGemvThreads) {
    Bf16x8 h, g;
    h.u = xs4[v];
    g.u = w4[v];
#pragma unroll
    for (int i = 0; i < 8; ++i) h.h[i] = __float2bfloat16_rn(__bfloat162float(h.h[i]) * rstd * __bfloat162float(g.h[i]));
    xs4[v] = h.u;
  }
}

template <int M, class OutT, int R = kGemvRows, int KS = 1>
__global__ void __launch_bounds__(kGemvThreads, M <= 2 ? 3 : 1) gemv_kernel(const __grid_constant__ GemvArgs a) {
  static_assert(R == 2 || R == 4, "row groups of 2 or 4");
  static_assert(KS == 1 || KS == 2, "K whole, or in halves over a cluster of two CTAs");
  extern __shared__ uint4 gemv_smem[];
  bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
  __shared__ float red[kGemvWarps];
  __shared__ float part[kGemvWarps][R][M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int N = a.N, K = a.K, kvec = K / 8;
  const int groups = (N + R - 1) / R;
  // KS 2 (sm_90): CTAs 2u and 2u + 1 form a cluster that takes unit u's row groups, CTA rank r
  // streaming K half r (gemv_grouping: K % 16 == 0, no norm prologue).
  int krank = 0, unit = blockIdx.x, units = gridDim.x;
  if constexpr (KS == 2) {
    krank = blockIdx.x & 1;  // a cluster's CTAs are consecutive along x: its rank
    unit = blockIdx.x >> 1;
    units = gridDim.x >> 1;
  }
  const int khalf = kvec / KS, kbase = krank * khalf;
  // The warps of a CTA split its K range: warp w owns 16-byte chunks [kv0, kv1) of every row.
  const int per_warp = (khalf + kGemvWarps - 1) / kGemvWarps;
  const int kv0 = kbase + min(khalf, warp * per_warp), kv1 = kbase + min(khalf, warp * per_warp + per_warp);
  const uint4* w4 = reinterpret_cast<const uint4*>(a.w);
  // A lane's first chunk of each row of group g (zero past the warp's K range): loaded one group
  // ahead, so it is in flight while the current group is reduced, and for the CTA's first group
  // before the wait below, while the previous kernel finishes.
  auto first_chunks = [&](int g, uint4 (&dst)[R]) {
    const int n0 = g * R, kv = kv0 + lane;
#pragma unroll
    for (int r = 0; r < R; ++r)
      dst[r] = kv < kv1 ? __ldcs(w4 + static_cast<std::int64_t>(min(n0 + r, N - 1)) * kvec + kv) : make_uint4(0, 0, 0, 0);
  };
  uint4 head[R];
  if (unit < groups) first_chunks(unit, head);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The weights do not depend on the previous kernel: pull the rest of the first group's slice
  // toward L2 while that kernel finishes, then wait for it (programmatic dependent launch).
  if (unit < groups) {
    const int n0 = unit * R;
    for (int r = 0; r < R; ++r) {
      const char* row = reinterpret_cast<const char*>(w4 + static_cast<std::int64_t>(min(n0 + r, N - 1)) * kvec + kv0);
      for (int i = 32 * 16 + lane * 128; i < (kv1 - kv0) * 16; i += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + i));
    }
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  for (int m = 0; m < M; ++m) {
    if (m < a.M) {
      gemv_prologue_row(a, m, xs + static_cast<std::int64_t>(m) * K, red, kbase, kbase + khalf);
    } else {
      for (int k = kbase * 8 + threadIdx.x; k < (kbase + khalf) * 8; k += kGemvThreads)
        xs[static_cast<std::int64_t>(m) * K + k] = __float2bfloat16_rn(0.f);
    }
  }
  __syncthreads();
  const uint4* xv = reinterpret_cast<const uint4*>(xs);
  OutT* y = static_cast<OutT*>(a.y);
  for (int g = unit; g < groups; g += units) {
    const int n0 = g * R;
    // Rows n0 .. n0 + R - 1 (clamped to the last row) as 32-bit offsets from row n0 (a
    // group spans R * K / 8 chunks; K fits the shared-memory row, gemv_ok).
    const uint4* w0 = w4 + static_cast<std::int64_t>(n0) * kvec;
    int roff[R];
#pragma unroll
    for (int r = 0; r < R; ++r) roff[r] = (min(n0 + r, N - 1) - n0) * kvec;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    auto fma_chunk = [&](const uint4 (&wv)[R], int kv) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 x8 = xv[m * kvec + kv];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] += dot8(wv[r], x8);
      }
    };
    if (kv0 + lane < kv1) fma_chunk(head, kv0 + lane);
    if (g + units < groups) first_chunks(g + units, head);  // the next group's, now
#pragma unroll (8 / R)  // 8 chunks of a lane in flight per iteration
    for (int kv = kv0 + lane + 32; kv < kv1; kv += 32) {
      uint4 wv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) wv[r] = __ldcs(w0 + roff[r] + kv);
      fma_chunk(wv, kv);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = acc[r][m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) part[warp][r][m] = v;
      }
    __syncthreads();
    if constexpr (KS == 1) {
      if (threadIdx.x < R * M) {
        const int r = threadIdx.x / M, m = threadIdx.x % M;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kGemvWarps; ++w) v += part[w][r][m];
        if (m < a.M && n0 + r < N) store_out(y + m * a.ldy + n0 + r, v);
      }
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // The second CTA's sums go into the first's shared memory, in a buffer per group parity (the
      // first reads this group's buffer before it arrives at the next group's barrier, so the
      // second cannot overwrite it early), then both wait at the cluster barrier.
      namespace cg = cooperative_groups;
      __shared__ float peer[2][R][M];
      const int parity = ((g - unit) / units) & 1;
      cg::cluster_group cluster = cg::this_cluster();
      const int r = threadIdx.x / M, m = threadIdx.x % M;
      float v = 0.f;
      if (threadIdx.x < R * M) {
#pragma unroll
        for (int w = 0; w < kGemvWarps; ++w) v += part[w][r][m];
        if (krank == 1) *cluster.map_shared_rank(&peer[parity][r][m], 0) = v;
      }
      cluster.sync();
      if (krank == 0 && threadIdx.x < R * M && m < a.M && n0 + r < N) store_out(y + m * a.ldy + n0 + r, v + peer[parity][r][m]);
#else
      __trap();  // launched only on sm_90+ (gemv_grouping's can_split_k)
#endif
    }
    __syncthreads();
  }
}

}  // namespace flashcpp::cuda::engine
