// attention_forward: validate, let the selector (core/selector.cc) choose the kernel and its tile
// config, run that choice. No heuristic lives here.
#include <string>

#include "cpu/cpu_backend.h"
#include "flashcpp/attention.h"

#include "core/attn_rotary.h"
#include "core/selector.h"
#if FLASHCPP_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace flashcpp {

namespace {

bool empty_problem(const AttnParams& p) { return p.batch == 0 || p.seqlen_q == 0; }

/// select_kernel, with or without the choice's config name and reason (select::prefill's `explain`).
Status choose(const AttnParams& p, const RunOptions& opt, KernelChoice* out, bool explain) {
  Backend b = opt.backend;
  if (b == Backend::kAuto) {
#if FLASHCPP_WITH_CUDA
    b = cuda::is_device_pointer(p.q.data) ? Backend::kCuda : Backend::kCpu;
#else
    b = Backend::kCpu;
#endif
  }
  FLASHCPP_RETURN_IF_ERROR(validate(p, b));
  return select::prefill(p, opt, b, out, explain);
}

}  // namespace

Status select_kernel(const AttnParams& p, const RunOptions& opt, KernelChoice* out) { return choose(p, opt, out, true); }

Status attention_forward(const AttnParams& p, const RunOptions& opt) {
  KernelChoice choice;  // id and tile: the run needs no config name or reason
  FLASHCPP_RETURN_IF_ERROR(choose(p, opt, &choice, false));
  if (empty_problem(p)) {
    // Varlen with the packed row count: every row is uncovered, O = 0 and LSE = -inf
    // (attention.h), whatever the backend; without it there is nothing to write.
    if (!(p.mask.is_varlen() && p.mask.total_q > 0)) return Status::Ok();
    switch (choice.id) {
      case KernelId::kCpuReference:
      case KernelId::kCpuTiled: cpu::fill_uncovered_rows(p); return Status::Ok();
#if FLASHCPP_WITH_CUDA
      case KernelId::kCudaSm80:
      case KernelId::kCudaSm90: return cuda::fill_uncovered_rows(p, opt.stream);
#endif
      default: break;
    }
    return Status::Unsupported(std::string("kernel ") + kernel_name(choice.id) + " is not available in this build");
  }
  switch (choice.id) {
    case KernelId::kCpuReference:
      return detail::run_with_rotary(p, opt, [&](const AttnParams& r) { return cpu::reference_forward(r, opt); });
    case KernelId::kCpuTiled:
      return detail::run_with_rotary(p, opt, [&](const AttnParams& r) { return cpu::tiled_forward(r, opt); });
#if FLASHCPP_HAS_SM80 || FLASHCPP_HAS_SM90  // the selector chooses only a family this build holds
    case KernelId::kCudaSm80:
    case KernelId::kCudaSm90: {
      // Rotary: the keys are rotated once into rotary.k_rotated (one pre-pass on the stream), and
      // the kernel reads them from there while it rotates its q tiles (attention.h).
      AttnParams r = p;
      if (p.rotary.enabled() && p.seqlen_k > 0) {
        FLASHCPP_RETURN_IF_ERROR(cuda::rotate_keys(p, opt.stream));
        r.k = p.rotary.k_rotated;
      }
#if FLASHCPP_HAS_SM90
      if (choice.id == KernelId::kCudaSm90) return cuda::prefill_sm90(r, choice.tile, opt.stream);
#endif
#if FLASHCPP_HAS_SM80
      if (choice.id == KernelId::kCudaSm80) return cuda::prefill_sm80(r, choice.tile, opt.stream);
#endif
      break;
    }
#endif
    default: break;
  }
  return Status::Unsupported(std::string("kernel ") + kernel_name(choice.id) + " is not available in this build");
}

}  // namespace flashcpp
