// The one dispatch layer: runtime values (backend, device, head_dim, dtype) become a named
// KernelChoice here, and nowhere else.
#include <algorithm>
#include <cmath>
#include <string>

#include "cpu/cpu_backend.h"
#include "flashcpp/attention.h"

#include "core/attn_rotary.h"
#if FLASHCPP_WITH_CUDA
#include "cuda/cuda_api.h"
#include "cuda/prefill/prefill_select.h"
#endif

namespace flashcpp {

namespace {

bool empty_problem(const AttnParams& p) { return p.batch == 0 || p.seqlen_q == 0; }

#if FLASHCPP_WITH_CUDA
/// The optional masks a problem uses, for KernelChoice::reason ("" when none).
std::string fused_masks(const AttnParams& p) {
  const MaskParams& m = p.mask;
  std::string s;
  auto add = [&](const std::string& x) { s += (s.empty() ? "" : ", ") + x; };
  if (m.causal) add("causal");
  if (m.has_window()) add("window");
  if (m.global_tokens > 0) add(m.global_queries ? "global tokens and queries" : "global tokens");
  if (m.softcap > 0.f) add("softcap");
  if (m.alibi_slopes) add("ALiBi");
  if (m.is_varlen()) add("varlen");
  if (m.block_sparse)
    add("block-sparse " + std::to_string(m.block_sparse->block_m) + "x" + std::to_string(m.block_sparse->block_n));
  return s.empty() ? s : "; masks fused in the kernel: " + s;
}

Status select_cuda(const AttnParams& p, const RunOptions& opt, KernelChoice* out) {
  cuda::DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(cuda::current_device(&dev));
  if (dev.sm_major < 8)
    return Status::Unsupported("the CUDA kernels need compute capability 8.0 or newer; device '" +
                               dev.name + "' is " + std::to_string(dev.sm_major) + "." +
                               std::to_string(dev.sm_minor));
  if (p.q.dtype == DType::kF32)
    return Status::Unsupported("fp32 inputs run on the CPU backend only; the CUDA kernels take fp16 or bf16");
  const float scale = p.effective_scale();
  if (scale < 0.f)
    return Status::Unsupported("a negative softmax_scale runs on the CPU backends only (the CUDA kernels fold a positive scale into exp2)");
  // The kernels keep softcap and ALiBi in raw q.k units (cap / scale, slope / scale).
  if ((p.mask.softcap > 0.f || p.mask.alibi_slopes) && !(scale > 0.f && std::isfinite(1.f / scale) &&
                                                         std::isfinite(p.mask.softcap / scale)))
    return Status::Unsupported("softcap or ALiBi with softmax_scale " + std::to_string(scale) +
                               " runs on the CPU backends only (the CUDA kernels divide the cap and the slopes by the scale)");
  const std::string masks = fused_masks(p);
  const BlockSparseMask* bs = p.mask.block_sparse;
  const std::string bs_blocks = bs ? std::to_string(bs->block_m) + "x" + std::to_string(bs->block_n) : "";
  // opt.cuda_config: "" = automatic, "sm80" / "sm90" = that kernel family with its tuned choice,
  // anything else = an exact config name of either family.
  const std::string& want = opt.cuda_config;
  std::string sm90_note;  // why an automatic choice on Hopper fell back to the sm80 kernel
#if FLASHCPP_HAS_SM90
  const auto sm90 = cuda::prefill_sm90_configs(p.head_dim);
  const bool named_sm90 = std::find(sm90.begin(), sm90.end(), want) != sm90.end();
  if ((want == "sm90" || named_sm90) && dev.sm_major != 9)
    return Status::Unsupported("the sm90 kernel family needs a Hopper (sm_90) device; '" + dev.name + "' is not one");
  if (dev.sm_major == 9 && !sm90.empty() && (want.empty() || want == "sm90" || named_sm90)) {
    std::string config;
    if (named_sm90) {
      const std::string misfit = cuda::prefill_sm90_misfit(p, want);
      if (!misfit.empty()) return Status::Unsupported(misfit);
      config = want;
    } else {
      config = cuda::prefill_sm90_pick(p, dev.num_sms);
      if (config.empty() && want == "sm90")
        return Status::Unsupported("no sm90 config has tiles (" + cuda::prefill_sm90_tiles(p.head_dim) +
                                   ") that divide the " + bs_blocks +
                                   " block-sparse blocks; build the mask with multiples of them (e.g. 128x128), "
                                   "or run it on the sm80 kernel (cuda_config \"sm80\")");
      if (config.empty())
        sm90_note = "; the sm90 tiles (" + cuda::prefill_sm90_tiles(p.head_dim) + ") do not divide the " + bs_blocks +
                    " block-sparse blocks, so this mask runs on the sm80 kernel";
    }
    if (!config.empty()) {
      out->id = KernelId::kCudaSm90;
      out->config = config;
      out->reason = "wgmma/TMA warp-specialized kernel on " + dev.name + (named_sm90 ? " (config forced)" : "") + masks;
      return Status::Ok();
    }
  }
#else
  if (want == "sm90") return Status::Unsupported("this build has no sm_90a kernels (FLASHCPP_CUDA_ARCHS lacks 90a)");
#endif
  out->id = KernelId::kCudaSm80;
  if (!want.empty() && want != "sm80" && want != "sm90") {
    bool known = false;
    std::string names;
    for (const auto& c : cuda::prefill_sm80_configs(p.head_dim)) {
      known |= (c == opt.cuda_config);
      names += (names.empty() ? "" : ", ") + c;
    }
    if (!known)
      return Status::Invalid("unknown config '" + opt.cuda_config + "' for head_dim " +
                             std::to_string(p.head_dim) + " (compiled: " + names + ")");
    const std::string misfit = cuda::prefill_sm80_misfit(p, want);
    if (!misfit.empty()) return Status::Unsupported(misfit);
    out->config = opt.cuda_config;
    out->reason = "config forced by the caller" + masks;
  } else {
    out->config = cuda::prefill_sm80_pick(p, dev);
    if (out->config.empty())
      return Status::Unsupported(
          bs ? "no sm80 config for head_dim " + std::to_string(p.head_dim) + " has tiles (" +
                   cuda::prefill_sm80_tiles(p.head_dim) + ") that divide the " + bs_blocks +
                   " block-sparse blocks and fit this device's shared memory; build the mask with multiples of "
                   "128x128 (FlexAttention's default), or run it on the CPU backend"
             : "no sm80 config for head_dim " + std::to_string(p.head_dim) + " fits the shared memory of " + dev.name);
    out->reason = "FA2-style mma.sync kernel on " + dev.name + " (sm_" +
                  std::to_string(dev.sm_major * 10 + dev.sm_minor) + "), config from the tuned table" +
                  (bs ? " (first config whose tiles divide the block-sparse blocks if the tuned one does not)" : "") +
                  masks + sm90_note;
  }
  return Status::Ok();
}
#endif

}  // namespace

Status select_kernel(const AttnParams& p, const RunOptions& opt, KernelChoice* out) {
  Backend b = opt.backend;
  if (b == Backend::kAuto) {
#if FLASHCPP_WITH_CUDA
    b = cuda::is_device_pointer(p.q.data) ? Backend::kCuda : Backend::kCpu;
#else
    b = Backend::kCpu;
#endif
  }
  FLASHCPP_RETURN_IF_ERROR(validate(p, b));
  *out = KernelChoice{};
  switch (b) {
    case Backend::kCpuReference:
      out->id = KernelId::kCpuReference;
      out->reason = "fp64 reference requested";
      return Status::Ok();
    case Backend::kCpu:
      out->id = KernelId::kCpuTiled;
      out->reason = "CPU backend (host pointers)";
      return Status::Ok();
    case Backend::kCuda:
#if FLASHCPP_WITH_CUDA
      return select_cuda(p, opt, out);
#else
      return Status::Unsupported("this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)");
#endif
    case Backend::kAuto: break;
  }
  return Status::Internal("backend selection fell through");
}

Status attention_forward(const AttnParams& p, const RunOptions& opt) {
  KernelChoice choice;
  FLASHCPP_RETURN_IF_ERROR(select_kernel(p, opt, &choice));
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
#if FLASHCPP_WITH_CUDA
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
      if (choice.id == KernelId::kCudaSm90) return cuda::prefill_sm90(r, choice.config, opt.stream);
#endif
      if (choice.id == KernelId::kCudaSm80) return cuda::prefill_sm80(r, choice.config, opt.stream);
      break;
    }
#endif
    default: break;
  }
  return Status::Unsupported(std::string("kernel ") + kernel_name(choice.id) + " is not available in this build");
}

}  // namespace flashcpp
