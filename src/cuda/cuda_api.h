// Internal CUDA-side entry points used by the dispatcher, the CLI and the GPU tests.
// Only defined when FLASHCPP_WITH_CUDA=1; callers guard with that macro.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashcpp/attention.h"

namespace flashcpp::cuda {

/// Properties of the current device, read once per device and cached.
struct DeviceInfo {
  int device = -1;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  std::size_t smem_optin = 0;  ///< max dynamic shared memory per block (bytes)
  std::string name;
};
/// Fails with a sentence when no CUDA device is usable.
Status current_device(DeviceInfo* info);

/// True when `ptr` is device (or managed) memory according to the CUDA runtime.
bool is_device_pointer(const void* ptr);

/// fp64 ground truth on the GPU: per (sequence, head) fp64 DGEMMs around an fp64 masked softmax
/// kernel; every mask of MaskParams except block_sparse. Outputs (device memory) in packed order
/// like cpu::RefOutput: o_f64 (total_q, heads_q, head_dim), lse_f64 (heads_q, total_q).
/// Allocates scratch and synchronizes `stream`: a test utility, not for graph capture.
Status reference_attention_f64(const AttnParams& p, double* o_f64, double* lse_f64, Stream stream);

/// Fill n elements with pseudo-random ~normal(0, stddev) values on the device (bench/tune inputs).
Status fill_random(void* ptr, DType dt, std::int64_t n, std::uint64_t seed, float stddev, Stream stream);

/// Varlen batch 0 (or seqlen_q 0) with mask.total_q > 0: O = 0 and LSE = -inf in all total_q
/// packed rows (attention.h), by one small kernel on `stream`: no allocation, no synchronization.
Status fill_uncovered_rows(const AttnParams& p, Stream stream);

/// Names of the compiled tile configs of the sm80 prefill kernel for a head dim.
std::vector<std::string> prefill_sm80_configs(int head_dim);
/// Runs the sm80 prefill kernel with the named config (empty: the tuned choice).
Status prefill_sm80(const AttnParams& p, const std::string& config, Stream stream);
/// The config the tuned table picks for a problem on the current device.
std::string prefill_sm80_pick(const AttnParams& p, const DeviceInfo& dev);

/// The rotary fused into attention, key side: rotates p.k into p.rotary.k_rotated once (apply_rotary's
/// kernel), before a prefill kernel that rotates only its q tiles reads its keys from there.
Status rotate_keys(const AttnParams& p, Stream stream);

/// Names of the compiled configs of the sm_90a (wgmma + TMA) prefill kernel for a head dim.
std::vector<std::string> prefill_sm90_configs(int head_dim);
/// Runs the sm_90a prefill kernel (config "" = the first listed for the head dim).
Status prefill_sm90(const AttnParams& p, const std::string& config, Stream stream);

}  // namespace flashcpp::cuda
