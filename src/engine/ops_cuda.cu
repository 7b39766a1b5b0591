// Ops on CUDA: bf16 device buffers on one stream, cuBLASLt GEMMs, a batch-small GEMV, the engine's
// small kernels (embedding, KV scatter, sampling, counters) and CUDA-graph capture/replay.
//
// GEMV (up to two rows by default: batch-1 and -2 decode; up to 8 when forced): every weight is read exactly once, so the
// step is bound by HBM: 2.47 GB for Llama-3.2-1B -> 0.58 ms at 4.3 TB/s. One warp owns kRows
// consecutive output rows; each lane streams 16-byte chunks of those weight rows (evict-first,
// they are never reused) and dots them with the M input rows (L1-resident); a warp shuffle
// reduction finishes each dot product. cuBLASLt takes everything else (prefill, M > 8).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/common/device.h"
#include "cuda/common/launch.cuh"
#include "cuda/cuda_api.h"
#include "common/fused_math.h"
#include "engine/gemv_plan.h"
#include "engine/ops.h"

namespace flashcpp::engine {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + " failed: " + cuda::error_string(e));
}
#define ENGINE_CUDA(expr) FLASHCPP_RETURN_IF_ERROR(cuda_status((expr), #expr))

Status lt_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status::Cuda(std::string(what) + " failed: cuBLASLt status " + std::to_string(static_cast<int>(s)));
}
#define ENGINE_LT(expr) FLASHCPP_RETURN_IF_ERROR(lt_status((expr), #expr))

using bf16 = __nv_bfloat16;

// ---- GEMV ---------------------------------------------------------------------------------
// y (M, N) = prologue(x) (M, K) * w (N, K)^T for M <= 8. The CTA first builds prologue(x) in
// shared memory (bf16, M_pad rows, zero rows past M), then strides over groups of kGemvRows
// output rows: its 8 warps split K, each lane streams 16-byte weight chunks (evict-first: never
// reused) and dots them with the shared rows, and the warps' partial sums meet in shared memory.
// Splitting K keeps enough loads in flight when N is small and K large (down_proj: N 2048,
// K 8192), where one warp per row left the HBM half idle. The grid is one full wave, so the
// prologue runs once per CTA. On sm_90 the launch is programmatic (PDL): the CTA prefetches
// its first weight rows into L2, only then waits for the kernel that produced x
// (griddepcontrol.wait), and lets the next GEMV launch early.
constexpr int kGemvRows = 4;  // output rows per CTA iteration (the 8 warps split K); 2 where
                              // gemv_grouping says the wave quantizes badly (gemv_plan.h)
constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr std::size_t kGemvMaxSmem = 160 * 1024;
constexpr int kGemvAutoRows = 2;

struct GemvArgs {
  const bf16* x;
  std::int64_t ldx;
  const bf16* w;
  void* y;
  std::int64_t ldy;
  int M, N, K;
  int kind;  // GemvPrologue::Kind
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
  using Kind = GemvPrologue::Kind;
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

/// CTAs of gemv_kernel<M, OutT, R, KS> that fit an SM at this dynamic shared memory, or for KS 2
/// the clusters of two that fit the GPU (cached per instantiation and size).
template <int M, class OutT, int R, int KS>
Status gemv_capacity(std::size_t smem, int* out) {
  auto kernel = gemv_kernel<M, OutT, R, KS>;
  static bool configured = false;  // one attribute call per instantiation (first use is never inside a capture: warm-up runs first)
  if (!configured) {
    FLASHCPP_RETURN_IF_ERROR(cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kGemvMaxSmem)),
        "cudaFuncSetAttribute(gemv)"));
    configured = true;
  }
  static std::map<std::size_t, int> capacity;  // by dynamic smem bytes
  auto it = capacity.find(smem);
  if (it == capacity.end()) {
    int n = 0;
    if constexpr (KS == 1) {
      FLASHCPP_RETURN_IF_ERROR(cuda_status(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kGemvThreads, smem), "gemv occupancy"));
    } else {
      cudaLaunchAttribute attr[2];
      const cudaLaunchConfig_t cfg = cuda::launch_config(dim3(2 * 1024), dim3(kGemvThreads), smem, nullptr, false, 2, attr);
      FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg), "gemv cluster occupancy"));
    }
    it = capacity.emplace(smem, std::max(1, n)).first;
  }
  *out = it->second;
  return Status::Ok();
}

// One wave, no more: each CTA builds the prologue once and then strides over row groups (KS 2:
// each cluster of two).
template <int M, class OutT, int R, int KS>
Status launch_gemv_mr(const GemvArgs& a, bool pdl, int num_sms, int cap, std::size_t smem, cudaStream_t s) {
  const int groups = (a.N + R - 1) / R;
  if constexpr (KS == 1) {
    return cuda_status(cuda::launch_kernel(gemv_kernel<M, OutT, R, 1>, dim3(static_cast<unsigned>(std::min(groups, num_sms * cap))),
                                           dim3(kGemvThreads), smem, s, pdl, a),
                       "gemv launch");
  } else {
    return cuda_status(cuda::launch_kernel_clustered(gemv_kernel<M, OutT, R, 2>,
                                                     dim3(2 * static_cast<unsigned>(std::min(groups, cap))),
                                                     dim3(kGemvThreads), smem, s, pdl, 2, a),
                       "gemv launch (clusters of 2)");
  }
}

template <int M, class OutT>
Status launch_gemv_m(const GemvArgs& a, bool pdl, int num_sms, int sm_major, cudaStream_t s) {
  const std::size_t smem = static_cast<std::size_t>(M) * a.K * sizeof(bf16);
  int per_sm = 1;
  FLASHCPP_RETURN_IF_ERROR((gemv_capacity<M, OutT, kGemvRows, 1>(smem, &per_sm)));
  if constexpr (M <= 2 && std::is_same_v<OutT, bf16>) {  // the 2-row and K-split instantiations: bf16 out, 1-2 rows only
    using Kind = GemvPrologue::Kind;
    const bool can_split_k = sm_major >= 9 && (a.kind == static_cast<int>(Kind::kNone) || a.kind == static_cast<int>(Kind::kSiluMul));
    const GemvGrouping g = engine::gemv_grouping(a.N, a.K, num_sms * per_sm, can_split_k);
    int cap = 1;
    if (g.ksplit == 2) {
      FLASHCPP_RETURN_IF_ERROR((gemv_capacity<M, OutT, kGemvRows, 2>(smem, &cap)));
      return launch_gemv_mr<M, OutT, kGemvRows, 2>(a, pdl, num_sms, cap, smem, s);
    }
    if (g.rows == 2) {
      FLASHCPP_RETURN_IF_ERROR((gemv_capacity<M, OutT, 2, 1>(smem, &cap)));
      return launch_gemv_mr<M, OutT, 2, 1>(a, pdl, num_sms, cap, smem, s);
    }
  }
  return launch_gemv_mr<M, OutT, kGemvRows, 1>(a, pdl, num_sms, per_sm, smem, s);
}

template <class OutT>
Status launch_gemv(const GemvArgs& a, bool pdl, int num_sms, int sm_major, cudaStream_t s) {
  if (a.M <= 1) return launch_gemv_m<1, OutT>(a, pdl, num_sms, sm_major, s);
  if (a.M <= 2) return launch_gemv_m<2, OutT>(a, pdl, num_sms, sm_major, s);
  if (a.M <= 4) return launch_gemv_m<4, OutT>(a, pdl, num_sms, sm_major, s);
  return launch_gemv_m<8, OutT>(a, pdl, num_sms, sm_major, s);
}

// ---- small kernels ------------------------------------------------------------------------
__global__ void embed_kernel(const std::int32_t* __restrict__ tokens, const bf16* __restrict__ table, int vocab,
                             int hidden, bf16* __restrict__ out) {
  const int i = blockIdx.x;
  const int t = min(max(tokens[i], 0), vocab - 1);
  const bf16* src = table + static_cast<std::int64_t>(t) * hidden;
  bf16* dst = out + static_cast<std::int64_t>(i) * hidden;
  if (hidden % 8 == 0) {
    for (int j = threadIdx.x; j < hidden / 8; j += blockDim.x)
      reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
  } else {
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = src[j];
  }
}

__global__ void write_kv_kernel(bf16* __restrict__ kc, bf16* __restrict__ vc, const std::int32_t* __restrict__ table,
                                int pages_per_seq, int num_pages, int page_size, int seq, int start, int n, int row,
                                const bf16* __restrict__ k, const bf16* __restrict__ v, std::int64_t ld) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int per_token = row / 8;
  if (idx >= static_cast<std::int64_t>(n) * per_token) return;
  const int t = static_cast<int>(idx / per_token), c = static_cast<int>(idx % per_token);
  const int slot = start + t;
  const int page = min(max(table[static_cast<std::int64_t>(seq) * pages_per_seq + slot / page_size], 0), num_pages - 1);
  const std::int64_t dst = (static_cast<std::int64_t>(page) * page_size + slot % page_size) * row + c * 8;
  reinterpret_cast<uint4*>(kc + dst)[0] = reinterpret_cast<const uint4*>(k + t * ld + c * 8)[0];
  reinterpret_cast<uint4*>(vc + dst)[0] = reinterpret_cast<const uint4*>(v + t * ld + c * 8)[0];
}

__global__ void advance_kernel(std::int32_t* seqlens, int n, std::int32_t* step) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) seqlens[i] += 1;
  if (threadIdx.x == 0 && step) *step += 1;
}

__global__ void spin_kernel(std::uint64_t ns) {
  std::uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// ---- sampling (one block per row; the rule of ops.h / sampling.h) ------------------------
constexpr int kSampleThreads = 1024;
static_assert(kSampleThreads == 32 * 32, "block_reduce reduces 32 warp partials in one warp");

struct ArgMax { float v; int i; };
__device__ __forceinline__ bool better(const ArgMax& a, const ArgMax& b) {
  const bool an = isnan(a.v), bn = isnan(b.v);
  if (an != bn) return an;
  if (a.v != b.v && !an) return a.v > b.v;
  return a.i < b.i;
}

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ ArgMax shfl_xor(const ArgMax& v, int o) { return {shfl_xor(v.v, o), shfl_xor(v.i, o)}; }

/// op-reduction over the CTA (kSampleThreads); every thread gets the result.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* smem) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  auto warp_reduce = [&](T x) {
    for (int o = 16; o > 0; o >>= 1) x = op(x, shfl_xor(x, o));
    return x;
  };
  __syncthreads();  // smem may still be read by the previous call
  v = warp_reduce(v);
  if (lane == 0) smem[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = warp_reduce(smem[lane]);  // kSampleThreads / 32 == 32 partials
    if (lane == 0) smem[0] = v;
  }
  __syncthreads();
  return smem[0];
}

__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const float* __restrict__ logits, int rows, int vocab,
                                                                SampleArgs args, std::int32_t* tokens_out,
                                                                std::int32_t* history, const std::int32_t* step_counter) {
  __shared__ ArgMax s_am[32];
  __shared__ float s_f[32];
  const int r = blockIdx.x;
  const float* l = logits + static_cast<std::int64_t>(r) * vocab;
  ArgMax best{-INFINITY, vocab};
  // 16-byte loads, eight in flight per thread: one CTA reads the 0.5 MB row of a 128k vocabulary
  // in a few L2 round trips instead of one per element. `better` is a strict total order on
  // (value, index), so the result does not depend on the order the elements are visited in.
  auto take4 = [&best](const float4& c, int i) {  // elements i .. i + 3, in index order
    if (better({c.x, i}, best)) best = {c.x, i};
    if (better({c.y, i + 1}, best)) best = {c.y, i + 1};
    if (better({c.z, i + 2}, best)) best = {c.z, i + 2};
    if (better({c.w, i + 3}, best)) best = {c.w, i + 3};
  };
  int tail = 0;
  if (vocab % 4 == 0 && (reinterpret_cast<std::uintptr_t>(l) & 15) == 0) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int n4 = vocab / 4;
    constexpr int kUnroll = 8;
    int v = threadIdx.x;
    for (; v + (kUnroll - 1) * kSampleThreads < n4; v += kUnroll * kSampleThreads) {
      float4 c[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) c[u] = __ldg(l4 + v + u * kSampleThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) take4(c[u], 4 * (v + u * kSampleThreads));
    }
    for (; v < n4; v += kSampleThreads) take4(__ldg(l4 + v), 4 * v);
    tail = vocab;
  }
  for (int i = tail + threadIdx.x; i < vocab; i += kSampleThreads) {
    const ArgMax c{l[i], i};
    if (better(c, best)) best = c;
  }
  best = block_reduce(best, [](const ArgMax& a, const ArgMax& b) { return better(a, b) ? a : b; }, s_am);
  int token = min(best.i, vocab - 1);
  const int step = step_counter ? *step_counter : 0;
  if (args.temperature > 0.f && !isnan(best.v)) {
    const float inv_t = 1.f / args.temperature, mx = best.v;
    auto plus = [](float a, float b) { return a + b; };
    float part = 0.f;
    for (int i = threadIdx.x; i < vocab; i += kSampleThreads) part += __expf((l[i] - mx) * inv_t);
    const float inv_total = 1.f / block_reduce(part, plus, s_f);
    auto prob = [&](int i) { return __expf((l[i] - mx) * inv_t) * inv_total; };
    auto mass_at_least = [&](float t) {
      float m = 0.f;
      for (int i = threadIdx.x; i < vocab; i += kSampleThreads) {
        const float p = prob(i);
        if (p >= t) m += p;
      }
      return block_reduce(m, plus, s_f);
    };
    // t*: the largest probability value whose kept set {p >= t*} reaches top_p (bisection on
    // the bits of a positive float, which order like the values).
    float thresh = 0.f;
    if (args.top_p < 1.f) {
      unsigned lo = 0, hi = __float_as_uint(inv_total);  // p_max = exp(0) * inv_total
      while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        if (mass_at_least(__uint_as_float(mid)) >= args.top_p) lo = mid; else hi = mid - 1;
      }
      thresh = __uint_as_float(lo);
    }
    // Each thread owns a contiguous chunk; the chunk whose kept mass crosses u * kept picks.
    const int chunk = (vocab + kSampleThreads - 1) / kSampleThreads;
    const int b0 = threadIdx.x * chunk, b1 = min(vocab, b0 + chunk);
    float mine = 0.f;
    int last_kept = -1;
    for (int i = b0; i < b1; ++i) {
      const float p = prob(i);
      if (p >= thresh) { mine += p; last_kept = i; }
    }
    __shared__ float s_scan[kSampleThreads];
    __shared__ int s_pick;
    s_scan[threadIdx.x] = mine;
    if (threadIdx.x == 0) s_pick = INT32_MAX;
    __syncthreads();
    for (int o = 1; o < kSampleThreads; o <<= 1) {  // inclusive Hillis-Steele scan
      const float add = threadIdx.x >= o ? s_scan[threadIdx.x - o] : 0.f;
      __syncthreads();
      s_scan[threadIdx.x] += add;
      __syncthreads();
    }
    const float kept = s_scan[kSampleThreads - 1];
    const float target = sample_uniform(args.seed, static_cast<std::uint32_t>(step), args.row_offset + r) * kept;
    const float before = s_scan[threadIdx.x] - mine;
    if (mine > 0.f && before <= target && target < s_scan[threadIdx.x]) {
      float acc = before;
      int pick = last_kept;
      for (int i = b0; i < b1; ++i) {
        const float p = prob(i);
        if (p < thresh) continue;
        acc += p;
        if (acc > target) { pick = i; break; }
      }
      atomicMin(&s_pick, pick);
    }
    // Rounding can leave the target past every chunk: take the last kept token then.
    __shared__ int s_i[32];
    const int fallback = block_reduce(last_kept, [](int a, int b) { return max(a, b); }, s_i);  // its barriers publish s_pick
    if (s_pick != INT32_MAX) token = s_pick; else if (fallback >= 0) token = fallback;
  }
  if (threadIdx.x == 0) {
    tokens_out[r] = token;
    if (history) history[static_cast<std::int64_t>(step) * rows + r] = token;
  }
}

// ---- the Ops ------------------------------------------------------------------------------
class CudaOps final : public Ops {
 public:
  ~CudaOps() override {
    for (auto& [k, g] : graphs_) cudaGraphExecDestroy(g);
    for (auto& [k, e] : lt_cache_) {
      cublasLtMatmulDescDestroy(e.desc);
      cublasLtMatrixLayoutDestroy(e.a);
      cublasLtMatrixLayoutDestroy(e.b);
      cublasLtMatrixLayoutDestroy(e.c);
    }
    for (cudaEvent_t e : events_) if (e) cudaEventDestroy(e);
    if (workspace_) cudaFree(workspace_);
    if (lt_) cublasLtDestroy(lt_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  Status init() {
    cuda::DeviceInfo dev;
    FLASHCPP_RETURN_IF_ERROR(cuda::current_device(&dev));
    sm_major_ = dev.sm_major;
    num_sms_ = dev.num_sms;
    pdl_ = sm_major_ >= 9;  // programmatic dependent launch: Hopper and newer
    name_ = dev.name + " (" + std::to_string(dev.num_sms) + " SMs, bf16)";
    ENGINE_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ENGINE_LT(cublasLtCreate(&lt_));
    ENGINE_CUDA(cudaMalloc(&workspace_, kWorkspace));
    events_.assign(kMaxEvents, nullptr);
    return Status::Ok();
  }
  bool cuda() const override { return true; }
  DType dtype() const override { return DType::kBF16; }
  Stream stream() const override { return reinterpret_cast<Stream>(stream_); }
  bool programmatic() const override { return pdl_; }
  std::string describe() const override { return name_; }

  Status alloc(std::size_t bytes, void** out) override {
    ENGINE_CUDA(cudaMalloc(out, bytes));
    return cuda_status(cudaMemset(*out, 0, bytes), "cudaMemset");
  }
  void release(void* p) noexcept override { cudaFree(p); }
  Status upload(void* dst, const void* src, std::size_t bytes) override {
    ENGINE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return sync();
  }
  Status download(void* dst, const void* src, std::size_t bytes) override {
    ENGINE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    return sync();
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
  }
  Status sync() override { return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  Status fill_random(void* p, std::int64_t n, std::uint64_t seed, float stddev) override {
    return cuda::fill_random(p, DType::kBF16, n, seed, stddev, stream());
  }

  Status set_gemm_mode(const std::string& mode) override {
    if (mode != "auto" && mode != "cublaslt" && mode != "gemv" && mode != "gemv-nopdl")
      return Status::Invalid("gemm mode '" + mode + "' is not one of auto, cublaslt, gemv, gemv-nopdl");
    // Decided here once, so gemm() compares integers, not strings.
    gemv_max_rows_ = mode == "auto" ? kGemvAutoRows : mode == "cublaslt" ? 0 : 8;
    pdl_ = sm_major_ >= 9 && mode != "gemv-nopdl";
    return Status::Ok();
  }

  Status gemm(int M, int N, int K, const void* x, std::int64_t ldx, const void* w, void* y, std::int64_t ldy,
              DType y_dtype) override {
    if (M == 0 || N == 0) return Status::Ok();
    if (gemv_ok(M, K, x, ldx, w)) return gemv(M, N, K, x, ldx, GemvPrologue{}, w, y, ldy, y_dtype);
    return lt_gemm(M, N, K, x, ldx, w, y, ldy, y_dtype);
  }
  Status gemv_fused(int M, int N, int K, const void* x, std::int64_t ldx, const GemvPrologue& pro, const void* w, void* y,
                    std::int64_t ldy, DType y_dtype) override {
    const bool aligned = pro.kind != GemvPrologue::Kind::kSiluMul || (ldx % 8 == 0);
    if (M > 0 && N > 0 && aligned && gemv_ok(M, K, x, ldx, w)) return gemv(M, N, K, x, ldx, pro, w, y, ldy, y_dtype);
    return Ops::gemv_fused(M, N, K, x, ldx, pro, w, y, ldy, y_dtype);
  }

  Status embed(const std::int32_t* tokens, int n, const void* table, int vocab, int hidden, void* out) override {
    if (n == 0) return Status::Ok();
    embed_kernel<<<n, 256, 0, stream_>>>(tokens, static_cast<const bf16*>(table), vocab, hidden, static_cast<bf16*>(out));
    return cuda_status(cudaGetLastError(), "embed launch");
  }
  Status write_kv(const KvPool& pool, const std::int32_t* block_table, int pages_per_seq, int seq, int start, int n,
                  const void* k, const void* v, std::int64_t ld) override {
    const int row = pool.heads_kv * pool.head_dim;
    if (row % 8 != 0 || ld % 8 != 0) return Status::Internal("write_kv needs 16-byte rows");
    const std::int64_t total = static_cast<std::int64_t>(n) * (row / 8);
    if (total == 0) return Status::Ok();
    write_kv_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream_>>>(
        static_cast<bf16*>(pool.k), static_cast<bf16*>(pool.v), block_table, pages_per_seq, pool.num_pages,
        pool.page_size, seq, start, n, row, static_cast<const bf16*>(k), static_cast<const bf16*>(v), ld);
    return cuda_status(cudaGetLastError(), "write_kv launch");
  }
  Status sample(const float* logits, int rows, int vocab, const SampleArgs& args, std::int32_t* tokens_out,
                std::int32_t* history, const std::int32_t* step_counter) override {
    sample_kernel<<<rows, kSampleThreads, 0, stream_>>>(logits, rows, vocab, args, tokens_out, history, step_counter);
    return cuda_status(cudaGetLastError(), "sample launch");
  }
  Status advance(std::int32_t* seqlens, int n, std::int32_t* step_counter) override {
    advance_kernel<<<1, 256, 0, stream_>>>(seqlens, n, step_counter);
    return cuda_status(cudaGetLastError(), "advance launch");
  }
  Status spin(int us) override {
    spin_kernel<<<1, 1, 0, stream_>>>(static_cast<std::uint64_t>(us) * 1000u);
    return cuda_status(cudaGetLastError(), "spin launch");
  }
  Status record_event(int slot) override {
    if (slot < 0 || slot >= kMaxEvents) return Status::Internal("event slot out of range");
    if (!events_[slot]) ENGINE_CUDA(cudaEventCreate(&events_[slot]));
    return cuda_status(cudaEventRecord(events_[slot], stream_), "cudaEventRecord");
  }
  float event_ms(int from, int to) override {
    float ms = 0.f;
    if (from < 0 || to < 0 || from >= kMaxEvents || to >= kMaxEvents || !events_[from] || !events_[to]) return 0.f;
    if (cudaEventElapsedTime(&ms, events_[from], events_[to]) != cudaSuccess) return 0.f;
    return ms;
  }
  Status begin_capture() override {
    return cuda_status(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  }
  Status end_capture(int id) override {
    cudaGraph_t g = nullptr;
    ENGINE_CUDA(cudaStreamEndCapture(stream_, &g));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    ENGINE_CUDA(e);
    auto it = graphs_.find(id);
    if (it != graphs_.end()) cudaGraphExecDestroy(it->second);
    graphs_[id] = exec;
    return Status::Ok();
  }
  Status replay(int id) override {
    auto it = graphs_.find(id);
    if (it == graphs_.end()) return Status::Internal("no graph captured for id " + std::to_string(id));
    return cuda_status(cudaGraphLaunch(it->second, stream_), "cudaGraphLaunch");
  }

 private:
  struct LtEntry {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  bool gemv_ok(int M, int K, const void* x, std::int64_t ldx, const void* w) const {
    const int m_pad = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8;
    // auto: the GEMV up to two rows, where it beats cuBLASLt (H200, Llama-3.2-1B step: 1078 vs
    // 1234 us at 1 row, 1260 vs 1321 at 2); at 4 rows cuBLASLt wins (1321 vs 1658 us), at 8 by 2x.
    return M <= gemv_max_rows_ && K % 8 == 0 && ldx % 8 == 0 &&
           static_cast<std::size_t>(m_pad) * K * 2 <= kGemvMaxSmem && reinterpret_cast<std::uintptr_t>(x) % 16 == 0 &&
           reinterpret_cast<std::uintptr_t>(w) % 16 == 0;
  }
  Status gemv(int M, int N, int K, const void* x, std::int64_t ldx, const GemvPrologue& pro, const void* w, void* y,
              std::int64_t ldy, DType y_dtype) {
    GemvArgs a{static_cast<const bf16*>(x), ldx, static_cast<const bf16*>(w), y, ldy, M, N, K,
               static_cast<int>(pro.kind), static_cast<const bf16*>(pro.weight), pro.eps,
               static_cast<const bf16*>(pro.residual), static_cast<bf16*>(pro.residual_out)};
    return y_dtype == DType::kF32 ? launch_gemv<float>(a, pdl_, num_sms_, sm_major_, stream_)
                                   : launch_gemv<bf16>(a, pdl_, num_sms_, sm_major_, stream_);
  }
  Status lt_gemm(int M, int N, int K, const void* x, std::int64_t ldx, const void* w, void* y, std::int64_t ldy,
                 DType y_dtype) {
    const auto key = std::make_tuple(M, N, K, ldx, ldy, static_cast<int>(y_dtype));
    auto it = lt_cache_.find(key);
    if (it == lt_cache_.end()) {
      LtEntry e;
      const cudaDataType_t ct = y_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
      ENGINE_LT(cublasLtMatmulDescCreate(&e.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      ENGINE_LT(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      ENGINE_LT(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      // Column-major view: W (N, K) row-major is (K, N) col-major, used transposed; x is (K, M);
      // y (M, N) row-major is (N, M) col-major.
      ENGINE_LT(cublasLtMatrixLayoutCreate(&e.a, CUDA_R_16BF, K, N, K));
      ENGINE_LT(cublasLtMatrixLayoutCreate(&e.b, CUDA_R_16BF, K, M, ldx));
      ENGINE_LT(cublasLtMatrixLayoutCreate(&e.c, ct, N, M, ldy));
      cublasLtMatmulPreference_t pref = nullptr;
      ENGINE_LT(cublasLtMatmulPreferenceCreate(&pref));
      const std::size_t ws = kWorkspace;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt_, e.desc, e.a, e.b, e.c, e.c, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if (hs != CUBLAS_STATUS_SUCCESS || found == 0)
        return Status::Cuda("cuBLASLt found no algorithm for a " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                            std::to_string(K) + " GEMM");
      e.algo = res.algo;
      it = lt_cache_.emplace(key, e).first;
    }
    const float alpha = 1.f, beta = 0.f;
    const LtEntry& e = it->second;
    return lt_status(cublasLtMatmul(lt_, e.desc, &alpha, w, e.a, x, e.b, &beta, y, e.c, y, e.c, &e.algo, workspace_,
                                    kWorkspace, stream_),
                     "cublasLtMatmul");
  }

  static constexpr std::size_t kWorkspace = 32u << 20;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  std::string name_;
  int gemv_max_rows_ = kGemvAutoRows;  ///< rows up to which gemm() takes the GEMV (0: never)
  bool pdl_ = true;
  int sm_major_ = 0, num_sms_ = 1;
  std::vector<cudaEvent_t> events_;
  std::map<int, cudaGraphExec_t> graphs_;
  std::map<std::tuple<int, int, int, std::int64_t, std::int64_t, int>, LtEntry> lt_cache_;
};

}  // namespace

Status make_cuda_ops(std::unique_ptr<Ops>* out) {
  auto ops = std::make_unique<CudaOps>();
  FLASHCPP_RETURN_IF_ERROR(ops->init());
  *out = std::move(ops);
  return Status::Ok();
}

}  // namespace flashcpp::engine
