// The kernel families this build holds (families.h, flashcpp/build.h), their refusal sentences,
// and, for a family left out of a CUDA build, the public entry points of flashcpp/tune.h that
// would have run it: they stay defined (no config, a refusal) so a caller links in every build.
#include "core/families.h"

#include <string>
#include <vector>

#include "flashcpp/tune.h"

namespace flashcpp::build {
namespace {

struct Row {
  Family f;
  const char* name;
  const char* what;
  const char* option;
  bool built;
  bool needs_cuda;  ///< a kernel family: FLASHCPP_CUDA=OFF leaves it out whatever its switch says
};

constexpr Row kRows[] = {
    {Family::kSm80, "sm80", "sm80 prefill kernels", "FLASHCPP_WITH_SM80", FLASHCPP_HAS_SM80 != 0, true},
    {Family::kSm90, "sm90", "sm90 prefill kernels", "FLASHCPP_WITH_SM90", FLASHCPP_HAS_SM90 != 0, true},
    {Family::kDecode, "decode", "CUDA decode kernels", "FLASHCPP_WITH_DECODE", FLASHCPP_HAS_DECODE != 0, true},
    {Family::kFused, "fused", "fused CUDA ops", "FLASHCPP_WITH_FUSED",
     FLASHCPP_HAS_FUSED != 0, true},
    {Family::kEngine, "engine", "Llama decode engine", "FLASHCPP_WITH_ENGINE", FLASHCPP_HAS_ENGINE != 0, false},
};

const Row& row(Family f) { return kRows[static_cast<int>(f)]; }

/// What leaves the family out of a build like this one; for a family it holds, its switch (the
/// sentence a build without it would give).
std::string cause(const Row& r) {
  if (r.needs_cuda && !FLASHCPP_WITH_CUDA) return "FLASHCPP_CUDA=OFF";
  if (r.f == Family::kSm90 && FLASHCPP_SM90_NO_ARCH) return "FLASHCPP_CUDA_ARCHS lacks 90a";
  return std::string(r.option) + "=OFF";
}

std::string remedy(const Row& r) {
  if (r.needs_cuda && !FLASHCPP_WITH_CUDA) return "reconfigure with -DFLASHCPP_CUDA=ON";
  if (r.f == Family::kSm90 && FLASHCPP_SM90_NO_ARCH) return "reconfigure with 90a in FLASHCPP_CUDA_ARCHS";
  return "reconfigure with -D" + std::string(r.option) + "=ON";
}

std::string sentence(const Row& r) { return "this build leaves out the " + std::string(r.what) + " (" + cause(r) + ")"; }

}  // namespace

BuildFamily family(Family f) {
  const Row& r = row(f);
  BuildFamily b;
  b.name = r.name;
  b.what = r.what;
  b.option = r.option;
  b.built = r.built;
  if (!r.built) {
    b.left_out_by = cause(r);
    b.left_out = sentence(r);
    b.remedy = remedy(r);
  }
  return b;
}

Status refuse(Family f, const std::string& context) {
  const Row& r = row(f);
  return Status::Unsupported(sentence(r) + ": " + context + "; " + remedy(r));
}

Status refuse_cuda_prefill() {
  const Row &a = row(Family::kSm80), &b = row(Family::kSm90);
  return Status::Unsupported("this build leaves out both CUDA prefill kernel families (sm80: " + cause(a) +
                             "; sm90: " + cause(b) + "): attention runs on the CPU backends only; " + remedy(a) +
                             " or " + remedy(b).substr(std::string("reconfigure ").size()));
}

Status refuse_no_cuda() {
  return Status::Unsupported("this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)");
}

}  // namespace flashcpp::build

namespace flashcpp {

std::vector<BuildFamily> build_families() {
  std::vector<BuildFamily> out;
  for (const auto& r : build::kRows) out.push_back(build::family(r.f));
  return out;
}

}  // namespace flashcpp

// flashcpp/tune.h for a prefill family left out of a CUDA build: no configs, and a run refused.
namespace flashcpp::cuda {
#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_SM80
std::vector<std::string> prefill_sm80_configs(int) { return {}; }
std::string prefill_sm80_pick(const AttnParams&, const DeviceInfo&) { return {}; }
Status prefill_sm80(const AttnParams&, const std::string& config, Stream) {
  return build::refuse(build::Family::kSm80, "prefill_sm80('" + config + "') cannot run");
}
#endif
#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_SM90
std::vector<std::string> prefill_sm90_configs(int, int) { return {}; }
Status prefill_sm90(const AttnParams&, const std::string& config, Stream) {
  return build::refuse(build::Family::kSm90, "prefill_sm90('" + config + "') cannot run");
}
#endif
}  // namespace flashcpp::cuda
