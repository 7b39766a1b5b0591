// What this build of flashcpp holds: the kernel families that CMake's switches left in or out
// (FLASHCPP_WITH_SM80, _SM90, _DECODE, _FUSED, _ENGINE; README "Build"). A request that needs a
// family the build leaves out is answered with Status::Unsupported and the family's sentence
// (`left_out`), never a link error; the CPU backends are in every build. `flashcpp info` prints
// this list.
#pragma once

#include <string>
#include <vector>

namespace flashcpp {

struct BuildFamily {
  std::string name;    ///< "sm80", "sm90", "decode", "fused", "engine"
  std::string what;    ///< "sm80 prefill kernels", "sm90 prefill kernels", "CUDA decode kernels", ...
  std::string option;  ///< its CMake switch, "FLASHCPP_WITH_SM80"
  bool built = false;
  /// Empty when built; else what left it out ("FLASHCPP_WITH_SM80=OFF", "FLASHCPP_CUDA=OFF",
  /// "FLASHCPP_CUDA_ARCHS lacks 90a"), ...
  std::string left_out_by;
  /// ... the sentence its entry points begin with ("this build leaves out the sm80 prefill
  /// kernels (FLASHCPP_WITH_SM80=OFF)") and how to get it ("reconfigure with -DFLASHCPP_WITH_SM80=ON").
  std::string left_out, remedy;
};

/// The five families in the order above.
std::vector<BuildFamily> build_families();

}  // namespace flashcpp
