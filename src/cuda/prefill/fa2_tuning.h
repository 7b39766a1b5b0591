// Tuned choice of sm80-kernel tile config per (device, head_dim, causal, dtype, seqlen bucket).
// Lookup order: the JSON cache written by `flashcpp tune` (FLASHCPP_TUNE_CACHE, else
// ~/.cache/flashcpp/prefill_sm80_<device>.json), then the table shipped in
// fa2_tuned_table.inc (measured on an H200, applied to sm_90 devices), then the caller's
// fallback. Ordinary calls never time anything.
#pragma once

#include <string>

#include "cuda/cuda_api.h"
#include "flashcpp/tune.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

// kSeqlenBuckets, seqlen_bucket, seqlen_bucket_name and tune_cache_path: flashcpp/tune.h.

/// Tuned config name, or "" when neither the cache nor the shipped table has the key.
std::string tuned_config(const DeviceInfo& dev, int head_dim, bool causal, DType dtype, int seqlen);

}  // namespace flashcpp::cuda
