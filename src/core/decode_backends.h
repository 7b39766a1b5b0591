// Internal entry points of decode, shared by the public API (src/core/decode_api.cc), the CPU
// backend (src/cpu/decode.cc) and the CUDA backend (src/cuda/decode/). Host-only, no CUDA types.
#pragma once

#include <cstdint>
#include <vector>

#include "flashcpp/decode.h"

namespace flashcpp::decode {

/// Only the scalar checks of validate(DecodeParams) (what plan needs: no pointer is read).
Status validate_decode_shape(const DecodeParams& p, Backend backend);

}  // namespace flashcpp::decode

namespace flashcpp::cpu {
/// CPU backend of decode_run (host memory; validated by the caller).
Status decode_run(const DecodeParams& p, const DecodePlan& plan, const RunOptions& opt);
/// CPU backend of merge_attention_states (validated by the caller).
Status merge_attention_states(const MergeStatesParams& p);
}  // namespace flashcpp::cpu

#if FLASHCPP_WITH_CUDA
namespace flashcpp::cuda {
/// Uploads the work list (stream-ordered; the host buffer may be freed on return).
Status decode_upload_worklist(void* dst, const std::int32_t* host, std::size_t count, Stream stream);
/// SM count of the current device, and its shared memory per SM (the opt-in per-block maximum plus
/// the 1 KB a CTA's reservation takes: 228 KB on an H100/H200, 164 KB on an A100).
Status decode_device_limits(int* num_sms, int* smem_per_sm);
/// CUDA backend of decode_run: append (+ rotary), split-KV kernel, merge. Asynchronous.
Status decode_run(const DecodeParams& p, const DecodePlan& plan, Stream stream, bool programmatic = false);
/// CUDA backend of merge_attention_states. Asynchronous.
Status merge_attention_states(const MergeStatesParams& p, Stream stream);
}  // namespace flashcpp::cuda
#endif
