// The engine's small kernels: embedding lookup, the KV scatter of a prompt, the per-step counters
// and a spin (so the host can queue work ahead of the device). Each is tiny next to a GEMV.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/engine/engine_common.cuh"
#include "cuda/engine/engine_launch.h"

namespace flashcpp::cuda::engine {
namespace {

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

/// Element offset of key slot `slot` of sequence `seq` in a paged pool of `row`-element slots; the
/// block-table entry clamped to the pool (device values are unchecked).
__device__ __forceinline__ std::int64_t slot_offset(const std::int32_t* table, int pages_per_seq, int num_pages,
                                                    int page_size, int seq, int slot, int row) {
  const int page = min(max(table[static_cast<std::int64_t>(seq) * pages_per_seq + slot / page_size], 0), num_pages - 1);
  return (static_cast<std::int64_t>(page) * page_size + slot % page_size) * row;
}

__global__ void write_kv_kernel(bf16* __restrict__ kc, bf16* __restrict__ vc, const std::int32_t* __restrict__ table,
                                int pages_per_seq, int num_pages, int page_size, int seq, int start, int n, int row,
                                const bf16* __restrict__ k, const bf16* __restrict__ v, std::int64_t ld) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int per_token = row / 8;
  if (idx >= static_cast<std::int64_t>(n) * per_token) return;
  const int t = static_cast<int>(idx / per_token), c = static_cast<int>(idx % per_token);
  const std::int64_t dst = slot_offset(table, pages_per_seq, num_pages, page_size, seq, start + t, row) + c * 8;
  reinterpret_cast<uint4*>(kc + dst)[0] = reinterpret_cast<const uint4*>(k + t * ld + c * 8)[0];
  reinterpret_cast<uint4*>(vc + dst)[0] = reinterpret_cast<const uint4*>(v + t * ld + c * 8)[0];
}

/// write_kv into an fp8 pool: 8 elements per thread, each the code of x / scale[head]
/// (decode_dev::fp8_code's rule: nearest even, saturating at +-448).
__global__ void write_kv_fp8_kernel(std::uint8_t* __restrict__ kc, std::uint8_t* __restrict__ vc,
                                    const std::int32_t* __restrict__ table, int pages_per_seq, int num_pages,
                                    int page_size, int seq, int start, int n, int row, int head_dim,
                                    const bf16* __restrict__ k, const bf16* __restrict__ v, std::int64_t ld,
                                    const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int per_token = row / 8;
  if (idx >= static_cast<std::int64_t>(n) * per_token) return;
  const int t = static_cast<int>(idx / per_token), c = static_cast<int>(idx % per_token);
  const std::int64_t dst = slot_offset(table, pages_per_seq, num_pages, page_size, seq, start + t, row) + c * 8;
  const int h = c * 8 / head_dim;  // head_dim is a multiple of 8: the 8 elements share a head
  const float ks = k_scale[h], vs = v_scale[h];
  const uint4 kx = reinterpret_cast<const uint4*>(k + t * ld + c * 8)[0];
  const uint4 vx = reinterpret_cast<const uint4*>(v + t * ld + c * 8)[0];
  const bf16* ke = reinterpret_cast<const bf16*>(&kx);
  const bf16* ve = reinterpret_cast<const bf16*>(&vx);
  std::uint8_t kq[8], vq[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    kq[i] = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(__bfloat162float(ke[i]) / ks, __NV_SATFINITE, __NV_E4M3));
    vq[i] = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(__bfloat162float(ve[i]) / vs, __NV_SATFINITE, __NV_E4M3));
  }
  *reinterpret_cast<uint2*>(kc + dst) = *reinterpret_cast<const uint2*>(kq);
  *reinterpret_cast<uint2*>(vc + dst) = *reinterpret_cast<const uint2*>(vq);
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

}  // namespace

Status embed(const std::int32_t* tokens, int n, const void* table, int vocab, int hidden, void* out, Stream stream) {
  if (n == 0) return Status::Ok();
  embed_kernel<<<n, 256, 0, stream>>>(tokens, static_cast<const bf16*>(table), vocab, hidden, static_cast<bf16*>(out));
  return cuda_status(cudaGetLastError(), "embed launch");
}

Status write_kv(const WriteKvParams& p, Stream stream) {
  if (p.row % 8 != 0 || p.ld % 8 != 0) return Status::Internal("write_kv needs 16-byte rows");
  const std::int64_t total = static_cast<std::int64_t>(p.n) * (p.row / 8);
  if (total == 0) return Status::Ok();
  if (p.k_scale != nullptr) {
    if (p.head_dim % 8 != 0 || p.row % p.head_dim != 0) return Status::Internal("write_kv: fp8 rows of whole heads");
    write_kv_fp8_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
        static_cast<std::uint8_t*>(p.k_cache), static_cast<std::uint8_t*>(p.v_cache), p.block_table, p.pages_per_seq,
        p.num_pages, p.page_size, p.seq, p.start, p.n, p.row, p.head_dim, static_cast<const bf16*>(p.k),
        static_cast<const bf16*>(p.v), p.ld, p.k_scale, p.v_scale);
    return cuda_status(cudaGetLastError(), "write_kv launch");
  }
  write_kv_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
      static_cast<bf16*>(p.k_cache), static_cast<bf16*>(p.v_cache), p.block_table, p.pages_per_seq, p.num_pages,
      p.page_size, p.seq, p.start, p.n, p.row, static_cast<const bf16*>(p.k), static_cast<const bf16*>(p.v), p.ld);
  return cuda_status(cudaGetLastError(), "write_kv launch");
}

Status advance(std::int32_t* seqlens, int n, std::int32_t* step_counter, Stream stream) {
  advance_kernel<<<1, 256, 0, stream>>>(seqlens, n, step_counter);
  return cuda_status(cudaGetLastError(), "advance launch");
}

Status spin(std::uint64_t ns, Stream stream) {
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return cuda_status(cudaGetLastError(), "spin launch");
}

}  // namespace flashcpp::cuda::engine
