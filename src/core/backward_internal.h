// The backward's entry points inside src/core: validation with the workspace the chosen backend
// needs (backward_validate.cc), for backward_api.cc.
#pragma once

#include <cstddef>

#include "flashcpp/backward.h"

namespace flashcpp::detail {

/// validate_backward, and with workspace_bytes (the bytes the chosen backend needs; 0 = none) also
/// the workspace: given, 256-byte aligned, large enough, not overlapping anything. nullptr leaves the
/// workspace unchecked (validate_backward, attention_backward_workspace_size).
Status validate_backward(const AttnBackwardParams& p, Backend backend, const std::size_t* workspace_bytes);

}  // namespace flashcpp::detail
