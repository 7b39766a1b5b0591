// The small decode kernels: append (+ rotary) into the cache, the merge of split partials, and
// merge_attention_states; plus the work-list upload. Append and merge_attention_states are one warp
// per row (token-head), the merge one CTA of decode_dev::kMergeWarps warps per output row; all are
// memory- or latency-bound and tiny next to the split-KV kernel: append moves
// batch*seqlen_q*heads_kv*D*2 elements, the merge reads n_b partial rows per output row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/common/launch.cuh"
#include "cuda/cuda_api.h"
#include "core/decode_backends.h"
#include "cuda/decode/decode_append.cuh"
#include "cuda/decode/decode_merge.cuh"
#include "cuda/decode/decode_launch.h"

namespace flashcpp::cuda {
namespace {

using ptx::from_float;
using ptx::to_float;

constexpr int kWarpsPerBlock = 4;


/// One warp per (sequence b, token t, KV head hk): decode_dev::append_row at slot c_b + t
/// (lengths and pages clamped as in decode.h); C is the cache's element (T, or fp8 codes).
template <typename T, typename C>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) decode_append_kernel(const __grid_constant__ DecodeKernelParams p) {
  pdl_wait_then_release();  // the kernel before it on the stream (RunOptions::programmatic_launch)
  const int w = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (w >= p.batch * p.seqlen_q * p.heads_kv) return;
  const int hk = w % p.heads_kv, t = (w / p.heads_kv) % p.seqlen_q, b = w / (p.heads_kv * p.seqlen_q);
  const int pos = flashcpp::decode::total_len(p.cache_seqlens[b], p.slots, p.seqlen_q, true) - p.seqlen_q + t;
  decode_dev::append_row<T, C>(p, b, t, hk, pos, lane);
}

/// One CTA of kMergeWarps warps per (sequence b, token t, query head h) of a sequence with n_b > 1
/// splits (decode_dev::merge_row has the rule).
template <typename T>
__global__ void __launch_bounds__(32 * decode_dev::kMergeWarps) decode_merge_kernel(const __grid_constant__ DecodeKernelParams p) {
  pdl_wait_then_release();  // the kernel before it on the stream (RunOptions::programmatic_launch)
  __shared__ float4 scratch[(decode_dev::kMergeWarps - 1) * 2 * 32];
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = row % p.heads_q, t = (row / p.heads_q) % p.seqlen_q, b = row / (p.heads_q * p.seqlen_q);
  if (decode_dev::num_splits_of(p, b) <= 1) return;  // written by the split-KV kernel directly (the whole CTA returns)
  decode_dev::merge_row<T>(p, b, t, h, warp, lane, scratch);
}

/// merge_attention_states: one warp per (batch, position, head); algebra::merge_two, as on the CPU.
template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) merge_states_kernel(const __grid_constant__ MergeStatesKernelParams p) {
  const std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (w >= static_cast<std::int64_t>(p.batch) * p.seqlen * p.heads) return;
  const int h = static_cast<int>(w % p.heads), s = static_cast<int>((w / p.heads) % p.seqlen);
  const int b = static_cast<int>(w / (static_cast<std::int64_t>(p.heads) * p.seqlen));
  const std::int64_t li = (static_cast<std::int64_t>(b) * p.heads + h) * p.seqlen + s;
  const float la = p.lse_a[li], lb = p.lse_b[li];
  const T* a = static_cast<const T*>(p.o_a) + b * p.a_batch_stride + s * p.a_seq_stride + h * p.a_head_stride;
  const T* bb = static_cast<const T*>(p.o_b) + b * p.b_batch_stride + s * p.b_seq_stride + h * p.b_head_stride;
  T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + s * p.o_seq_stride + h * p.o_head_stride;
  float wa, wb, merged;
  algebra::merge_two(la, lb, &wa, &wb, &merged);  // an empty side weighs 0 and is skipped below
  for (int d = lane; d < p.head_dim; d += 32) {
    float v = 0.f;
    if (wa != 0.f) v = to_float(a[d]) * wa;
    if (wb != 0.f) v = fmaf(to_float(bb[d]), wb, v);
    o[d] = from_float<T>(v);  // in place is fine: this lane read a[d] / bb[d] just above
  }
  if (lane == 0 && p.lse != nullptr) p.lse[li] = merged;
}

Status check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::Cuda(std::string(what) + " launch failed: " + cudaGetErrorString(e));
  return Status::Ok();
}

unsigned blocks_for(std::int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

Status decode_append_launch(const DecodeKernelParams& p, DType dt, Stream stream) {
  const std::int64_t warps = static_cast<std::int64_t>(p.batch) * p.seqlen_q * p.heads_kv;
  if (warps == 0) return Status::Ok();
  using decode_dev::Fp8Code;
  auto* kernel = dt == DType::kBF16 ? (p.kv_fp8 ? &decode_append_kernel<__nv_bfloat16, Fp8Code>
                                                : &decode_append_kernel<__nv_bfloat16, __nv_bfloat16>)
                                    : (p.kv_fp8 ? &decode_append_kernel<__half, Fp8Code> : &decode_append_kernel<__half, __half>);
  (void)launch_kernel(kernel, blocks_for(warps), 32 * kWarpsPerBlock, 0, stream, p.pdl != 0, p);
  return check_launch("decode append kernel");
}

Status decode_merge_launch(const DecodeKernelParams& p, DType dt, Stream stream) {
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.seqlen_q * p.heads_q;
  if (rows == 0) return Status::Ok();
  if (rows > 0x7fffffff) return Status::Unsupported("decode merge: more output rows than one grid holds (2^31 - 1)");
  auto* kernel = dt == DType::kBF16 ? &decode_merge_kernel<__nv_bfloat16> : &decode_merge_kernel<__half>;
  (void)launch_kernel(kernel, static_cast<unsigned>(rows), 32 * decode_dev::kMergeWarps, 0, stream, p.pdl != 0, p);
  return check_launch("decode merge kernel");
}

Status merge_states_launch(const MergeStatesKernelParams& p, DType dt, Stream stream) {
  const std::int64_t warps = static_cast<std::int64_t>(p.batch) * p.seqlen * p.heads;
  if (warps == 0) return Status::Ok();
  if (blocks_for(warps) > 0x7fffffffu) return Status::Unsupported("merge_attention_states: too many rows for one grid");
  switch (dt) {
    case DType::kBF16: merge_states_kernel<__nv_bfloat16><<<blocks_for(warps), 32 * kWarpsPerBlock, 0, stream>>>(p); break;
    case DType::kF16: merge_states_kernel<__half><<<blocks_for(warps), 32 * kWarpsPerBlock, 0, stream>>>(p); break;
    case DType::kF32: merge_states_kernel<float><<<blocks_for(warps), 32 * kWarpsPerBlock, 0, stream>>>(p); break;
  }
  return check_launch("merge_attention_states kernel");
}

Status decode_upload_worklist(void* dst, const std::int32_t* host, std::size_t count, Stream stream) {
  // From pageable memory cudaMemcpyAsync returns once the source is staged, so the caller may
  // free `host` right away; the copy is ordered before later work on `stream`.
  const cudaError_t e = cudaMemcpyAsync(dst, host, count * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return Status::Cuda(std::string("decode_plan: work-list upload failed: ") + cudaGetErrorString(e));
  return Status::Ok();
}

Status decode_device_limits(int* num_sms, int* smem_per_sm) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
  *num_sms = dev.num_sms;
  *smem_per_sm = static_cast<int>(dev.smem_optin) + 1024;
  return Status::Ok();
}

}  // namespace flashcpp::cuda
