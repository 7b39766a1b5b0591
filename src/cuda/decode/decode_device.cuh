// Device helpers of the decode kernels (split-KV, append, merge): where a key lives in the cache
// (contiguous, or paged through the block table) and which (sequence, split) a work item is.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/decode_common.h"
#include "cuda/decode/decode_params.h"

namespace flashcpp::cuda::decode_dev {

/// The element of an fp8 e4m3 cache (decode.h): one code byte. A cache of q's dtype uses T itself.
struct Fp8Code {
  std::uint8_t bits;
};
template <typename C>
inline constexpr bool kFp8Cache = std::is_same_v<C, Fp8Code>;

/// The e4m3 code of x (already divided by its scale): round to nearest even, +-448 beyond the
/// range (infinity included), NaN stays NaN; the CPU backend's float_to_fp8e4m3_bits (half.h).
__device__ __forceinline__ std::uint8_t fp8_code(float x) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
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

}  // namespace flashcpp::cuda::decode_dev
