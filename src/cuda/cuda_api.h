// Internal CUDA-side entry points used by the dispatcher and the GPU tests; the ones the CLI and
// the harness call too are declared in the public flashcpp/device.h, reference.h and tune.h.
// Only defined when FLASHCPP_WITH_CUDA=1; callers guard with that macro.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/device.h"     // DeviceInfo, current_device
#include "flashcpp/reference.h"  // reference_attention_f64
#include "flashcpp/tune.h"       // prefill_sm80/sm90 by config, fill_random

namespace flashcpp::cuda {

/// True when `ptr` is device (or managed) memory according to the CUDA runtime.
bool is_device_pointer(const void* ptr);

/// The prefill kernels with the tile config the selector chose (KernelChoice::tile); the named
/// forms of flashcpp/tune.h look the name up and call these. Defined only when the build holds the
/// family (FLASHCPP_HAS_SM80 / FLASHCPP_HAS_SM90; core/families.cc answers the named forms otherwise).
Status prefill_sm80(const AttnParams& p, const TileConfig& tile, Stream stream);
Status prefill_sm90(const AttnParams& p, const TileConfig& tile, Stream stream);

/// The attention backward (src/cuda/backward: preprocess, main kernel, postprocess) with the
/// selector's tile, which names the main kernel (mma.sync, or wgmma on sm_90), and the workspace
/// layout made for it. Defined only when the build holds the sm80 family (FLASHCPP_HAS_SM80);
/// asynchronous on `stream`, allocates nothing. key_group > 0: key tiles per group of the grid
/// (cuda_config "+g<N>"; select::backward_key_group), 0 the selector's rule.
Status backward_cuda(const AttnBackwardParams& p, const TileConfig& tile, const BackwardWorkspaceLayout& layout,
                     Stream stream, int key_group = 0);

/// Varlen batch 0 (or seqlen_q 0) with mask.total_q > 0: O = 0 and LSE = -inf in all total_q
/// packed rows (attention.h), by one small kernel on `stream`: no allocation, no synchronization.
Status fill_uncovered_rows(const AttnParams& p, Stream stream);

/// The rotary fused into attention, key side: rotates p.k into p.rotary.k_rotated once (apply_rotary's
/// kernel), before a prefill kernel that rotates only its q tiles reads its keys from there. Built
/// with either prefill family (FLASHCPP_HAS_SM80 || FLASHCPP_HAS_SM90), the rotary kernel with it.
Status rotate_keys(const AttnParams& p, Stream stream);

}  // namespace flashcpp::cuda
