// The rotary fused into attention on the CPU backends (attn_rotary.cc).
#pragma once

#include <functional>

#include "flashcpp/attention.h"

namespace flashcpp::detail {

/// Runs `run` on p, or with p.rotary on, on a copy of p whose q and k are rotated host copies
/// (input dtype, rotated by the CPU apply_rotary) and whose rotary is off. Host memory only.
Status run_with_rotary(const AttnParams& p, const RunOptions& opt, const std::function<Status(const AttnParams&)>& run);

}  // namespace flashcpp::detail
