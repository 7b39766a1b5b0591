// The kernel families of this build (CMake's FLASHCPP_WITH_* switches, as the FLASHCPP_HAS_*
// definitions) and the one refusal each entry point answers for a family the build leaves out,
// so the sentence names the switch the same way everywhere (flashcpp/build.h lists them).
#pragma once

#include <string>

#include "flashcpp/build.h"
#include "flashcpp/status.h"

namespace flashcpp::build {

enum class Family { kSm80, kSm90, kDecode, kFused, kEngine };

/// The family's entry of build_families().
BuildFamily family(Family f);

/// Status::Unsupported("<left_out>: <context>; <remedy>"), e.g. "this build leaves out the CUDA
/// decode kernels (FLASHCPP_WITH_DECODE=OFF): decode_run runs on the CPU backend only; reconfigure
/// with -DFLASHCPP_WITH_DECODE=ON". The same sentence whether or not this build holds the family
/// (the tests read it in any build).
Status refuse(Family f, const std::string& context);

/// CUDA attention with neither prefill family in the build.
Status refuse_cuda_prefill();

/// Backend::kCuda in a build without CUDA at all (-DFLASHCPP_CUDA=OFF): one sentence for every door.
Status refuse_no_cuda();

}  // namespace flashcpp::build
