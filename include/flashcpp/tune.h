// The prefill kernels by config, for `flashcpp tune`, `flashcpp info` and the benchmarks: the
// compiled tile configs of each CUDA prefill kernel, a run with a named config, the tuned table's
// pick, and where the tuner's cache lives. attention_forward needs none of this (it picks the
// config itself). Defined in CUDA builds only: callers guard with FLASHCPP_WITH_CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/device.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

/// Names of the compiled tile configs of the sm80 prefill kernel for a head dim.
std::vector<std::string> prefill_sm80_configs(int head_dim);
/// Runs the sm80 prefill kernel with the named config (empty: the tuned choice).
Status prefill_sm80(const AttnParams& p, const std::string& config, Stream stream);
/// The config the tuned table picks for a problem on the current device.
std::string prefill_sm80_pick(const AttnParams& p, const DeviceInfo& dev);

/// Names of the compiled configs of the sm_90a (wgmma + TMA) prefill kernel for a pair of head
/// dims (head_dim_v 0: head_dim), those of its class (cuda_sm90_head_dim_class).
std::vector<std::string> prefill_sm90_configs(int head_dim, int head_dim_v = 0);
/// Runs the sm_90a prefill kernel with the named config ("" = the selector's sm90 choice).
Status prefill_sm90(const AttnParams& p, const std::string& config, Stream stream);

/// The tuned table's seqlen buckets: upper bounds; a 4th bucket is above.
inline constexpr int kSeqlenBuckets[] = {1024, 4096, 16384};
int seqlen_bucket(int seqlen);               ///< 0..3
std::string seqlen_bucket_name(int bucket);  ///< "le1024", ..., "gt16384"
/// Where `flashcpp tune` writes and the library reads the cache for this device.
std::string tune_cache_path(const DeviceInfo& dev);

/// Fill n elements with pseudo-random ~normal(0, stddev) values on the device (bench/tune inputs).
Status fill_random(void* ptr, DType dt, std::int64_t n, std::uint64_t seed, float stddev, Stream stream);

}  // namespace flashcpp::cuda
