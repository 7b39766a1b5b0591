// The KV-cache rules that every writer and reader of a decode.h KVCacheView shares: decode
// (decode_validate.cc, where they are defined) and rope_append_kv (fused_validate.cc). The cache
// holds the new keys' dtype, or fp8 e4m3 codes with fp32 per-KV-head scales; the CUDA kernels
// read and write caches with 16-byte accesses. One sentence per failure, as every validator.
#pragma once

#include <cstdint>

#include "core/message.h"
#include "flashcpp/decode.h"
#include "flashcpp/status.h"

namespace flashcpp::detail {

/// The cache's dtypes for new keys (or q) of dtype `dt`, named `owner` in the sentence: K and V
/// both hold dt, or both fp8_e4m3 (which needs the scales); scales on any other cache are refused.
Status check_cache_dtype(const KVCacheView& c, DType dt, const char* owner);

/// The cache's geometry for `batch` sequences: a paged cache's page size (a power of two up to
/// kDecodeMaxPageSize), page counts, int32 slots and block-table stride (its rows may not overlap,
/// and its extent fits in int64); a contiguous cache's capacity, and no block table.
Status check_cache_geometry(const KVCacheView& c, int batch);

/// An fp8 cache's scale arrays: fp32 [heads_kv], non-null and 4-byte aligned; `k_span` / `v_span`
/// get their byte ranges for the aliasing checks (left empty for a cache of another dtype).
Status check_cache_scale_arrays(const KVCacheView& c, int heads_kv, Span* k_span, Span* v_span);

/// An fp8 cache's scale values, which the CPU backends can read: every one positive and finite.
Status check_cache_scale_values(const KVCacheView& c, int heads_kv);

/// The CUDA kernels' 16-byte rule for a (e0, e1, e2, dim) view: data 16-byte aligned and every
/// stride of an extent > 1 a multiple of 16 bytes (8 elements of 16 bits, 16 fp8 codes).
/// `stride0` names e0's stride in the sentence.
Status check_cuda_vector_view(const char* name, const TensorView& t, std::int64_t e0, std::int64_t e1,
                              std::int64_t e2, const char* stride0 = "batch_stride");

}  // namespace flashcpp::detail
