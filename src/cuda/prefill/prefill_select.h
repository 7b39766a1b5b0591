// Mask-aware config choice of both prefill kernel families, for the one dispatch layer
// (src/core/dispatch.cc). Every compiled config runs every mask of MaskParams; the one
// restriction is block-sparse, whose blocks must be whole multiples of the kernel's tiles
// (BlockM divides block_m, BlockN divides block_n: a CTA's rows then lie in one mask row and a
// listed block is whole key tiles). The dispatcher picks a config that fits or says why none does.
#pragma once

#include <string>

#include "flashcpp/attention.h"

namespace flashcpp::cuda {

/// "" when the named sm80 config can run the problem's masks, else one sentence why not.
std::string prefill_sm80_misfit(const AttnParams& p, const std::string& config);
/// The tile shapes of the compiled sm80 configs for a head dim, e.g. "128x32, 64x64" (for sentences).
std::string prefill_sm80_tiles(int head_dim);

#if FLASHCPP_HAS_SM90
/// The automatic sm90 config: the first (table order) that can run the problem, or its persistent
/// twin for a large causal problem (fa3_dispatch.cc, prefer_persistent); "" when none fits.
std::string prefill_sm90_pick(const AttnParams& p, int num_sms);
/// "" when the named sm90 config can run the problem's masks, else one sentence why not.
std::string prefill_sm90_misfit(const AttnParams& p, const std::string& config);
/// The tile shapes of the compiled sm90 configs for a head dim.
std::string prefill_sm90_tiles(int head_dim);
#endif

}  // namespace flashcpp::cuda
