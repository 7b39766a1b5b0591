// Device helpers of the fused kernels: element conversion, N-element register vectors loaded
// and stored with one instruction (16 bytes for N = 8), masked tails, reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda/common/ptx.cuh"
#include "cuda/common/smem_opt_in.h"
#include "flashcpp/device.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda::fused {

/// Elements per 16-byte access of a 2-byte type, and the scalar width.
constexpr int kVec16 = 8;
constexpr int kScalar = 1;

using ptx::from_float;
using ptx::to_float;

/// N consecutive elements in registers; N * sizeof(T) bytes, one load/store instruction when the
/// address is aligned to that size (ld.global.v4.b32 for N = 8).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

/// Loads the n valid elements of a vector at p (n <= N), zero-filling the rest. Full vectors
/// (n == N) take one aligned access; a row's tail is read element by element, so nothing past
/// the last element is ever touched. `streaming` marks full 16-byte loads ld.global.cs (evict
/// first: data read once), a tuning switch (RunOptions::cuda_config "streaming").
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p, int n, bool streaming = false) {
  Vec<T, N> r;
  if (n >= N) {
    if constexpr (sizeof(Vec<T, N>) == 16) {
      if (streaming) {
        const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
        *reinterpret_cast<uint4*>(&r) = u;
        return r;
      }
    }
    r = *reinterpret_cast<const Vec<T, N>*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = i < n ? p[i] : from_float<T>(0.f);
  }
  return r;
}

/// Stores the first n elements of v at p (n <= N); `streaming`: st.global.cs for full vectors.
template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v, int n, bool streaming = false) {
  if (n >= N) {
    if constexpr (sizeof(Vec<T, N>) == 16) {
      if (streaming) {
        __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
        return;
      }
    }
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < n) p[i] = v.v[i];
  }
}

/// x / d for x >= 0 and d > 0: a 32-bit division whenever x fits (always, in practice; a 64-bit
/// division is a ~70-instruction call), else 64-bit.
__device__ __forceinline__ std::int64_t div_i64(std::int64_t x, int d) {
  if (x <= 0x7fffffff) return static_cast<std::uint32_t>(x) / static_cast<std::uint32_t>(d);
  return x / d;
}

/// Sum over groups of `width` consecutive lanes (a power of two <= 32); every lane gets its
/// group's sum. All 32 lanes of the warp must call it.
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int off = width >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

/// Sum over the whole block; every thread gets the result. `scratch` holds 32 floats; the
/// function ends with the scratch still being read, so a caller that reuses it must sync first.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = group_sum(v, 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? scratch[lane] : 0.f;
  return group_sum(v, 32);  // every warp reduces the partials itself: no broadcast barrier
}

/// Type tag for the dispatch below.
template <class T>
struct TypeTag {
  using type = T;
};

/// Runs f(TypeTag<T>{}) with T the CUDA type of a 16-bit dtype: the one place where the runtime
/// dtype becomes a template argument of the fused kernels. fp32 never gets here (validation).
template <class F>
Status with_half_type(DType dt, F&& f) {
  switch (dt) {
    case DType::kBF16: return f(TypeTag<__nv_bfloat16>{});
    case DType::kF16: return f(TypeTag<__half>{});
    case DType::kF32: break;
  }
  return Status::Internal("the fused CUDA kernels got a dtype other than fp16/bf16");
}

/// q (index 0) and k (1) into kernel arguments that hold in[2], out[2] and their batch / seq / head
/// strides (apply_rotary, qk_norm_rope): an output without data is its input (in place).
template <class Args>
void set_qk_views(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out, Args* a) {
  const TensorView* in[2] = {&q, &k};
  const TensorView* out[2] = {q_out.data ? &q_out : &q, k_out.data ? &k_out : &k};
  for (int w = 0; w < 2; ++w) {
    a->in[w] = in[w]->data;
    a->out[w] = out[w]->data;
    a->in_bs[w] = in[w]->batch_stride;
    a->in_ss[w] = in[w]->seq_stride;
    a->in_hs[w] = in[w]->head_stride;
    a->out_bs[w] = out[w]->batch_stride;
    a->out_ss[w] = out[w]->seq_stride;
    a->out_hs[w] = out[w]->head_stride;
  }
}

/// True when p is aligned to `bytes`.
inline bool aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

/// Status of the launch just made (cudaGetLastError: no synchronization).
inline Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + " launch failed: " + cudaGetErrorString(e));
}

/// The stream kernels' depth (rms_norm, apply_rotary): rows (tokens) a block keeps in shared memory,
/// `forced` (cuda_config stages2..4) or as many stages of `stage_bytes` as kStreamStageBudget holds,
/// 2..kStreamStagesMax (cuda_config stages4 asks for a fourth).
inline constexpr int kStreamStagesMax = 3;
inline constexpr int kStreamStageBudget = 112 * 1024;
inline int stream_stages(int forced, int stage_bytes) {
  return forced > 0 ? forced : std::clamp(kStreamStageBudget / stage_bytes, 2, kStreamStagesMax);
}

/// Launches a resident-grid kernel (the stream kernels: each block walks work items blockIdx.x,
/// + gridDim.x, ...) with as many blocks as the SMs hold at once, at most one per item. The first
/// launch of a (kernel, device, block size, shared memory) opts the kernel in to the dynamic shared
/// memory beside its static part and asks the occupancy; later ones read a small table (the device
/// from cudaGetDevice alone: the caller has checked it). `what` names the op in error sentences.
template <class Kernel, class Args>
Status launch_resident(Kernel* kernel, const Args& a, int threads, int smem, std::int64_t items, Stream stream,
                       const char* what) {
  static std::mutex mu;
  static std::array<std::array<std::intptr_t, 5>, 32> fits{};  // {kernel, device + 1, threads, smem, resident blocks}
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return Status::Cuda(std::string(what) + ": cudaGetDevice failed");
  }
  const auto key = reinterpret_cast<std::intptr_t>(kernel);
  std::int64_t resident = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& f : fits)
      if (f[0] == key && f[1] == device + 1 && f[2] == threads && f[3] == smem) {
        resident = f[4];
        break;
      }
    if (resident == 0) {
      DeviceInfo dev;
      FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
      cudaFuncAttributes attr{};
      if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
        cudaGetLastError();
        return Status::Cuda(std::string(what) + ": cudaFuncGetAttributes failed for the stream kernel");
      }
      const int dyn_max = static_cast<int>(dev.smem_optin - attr.sharedSizeBytes);
      if (smem > dyn_max)
        return Status::Internal(std::string(what) + ": the stream kernel's stages exceed the device's shared memory");
      FLASHCPP_RETURN_IF_ERROR(set_dynamic_smem(kernel, dyn_max, what));
      int per_sm = 0;
      const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return Status::Cuda(std::string(what) + ": occupancy query failed: " + cudaGetErrorString(e));
      }
      resident = static_cast<std::int64_t>(std::max(1, per_sm)) * dev.num_sms;
      std::rotate(fits.rbegin(), fits.rbegin() + 1, fits.rend());  // shift down, the oldest drops out
      fits[0] = {key, device + 1, threads, smem, static_cast<std::intptr_t>(resident)};
    }
  }
  const std::int64_t blocks = std::min<std::int64_t>(items, resident);
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(a);
  return launch_status(what);
}

}  // namespace flashcpp::cuda::fused
