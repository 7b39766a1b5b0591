// The fused ops' public entry points (include/flashcpp/fused.h): validate (fused_validate.cc),
// then the one place that routes a problem to the CPU backend (src/cpu/fused.cc) or to a CUDA
// kernel (src/cuda/fused/).
#include <cstdint>
#include <string>

#include "core/families.h"
#include "core/message.h"
#include "flashcpp/fused.h"
#if FLASHCPP_WITH_CUDA
#include "cuda/cuda_api.h"
#include "cuda/fused/fused_launch.h"
#endif

namespace flashcpp {

// The CPU backend (src/cpu/fused.cc). No header of its own: only this dispatch calls it.
namespace cpu {
Status fused_rms_norm(const RmsNormParams& p, bool with_residual, int threads);
Status fused_silu_and_mul(const SiluMulParams& p, int threads);
Status fused_apply_rotary(const RopeParams& p, int threads);
Status fused_qk_norm_rope(const QkNormRopeParams& p, int threads);
Status fused_rope_append_kv(const RopeAppendParams& p, int threads);
}  // namespace cpu

namespace {

using detail::cat;

// ---- dispatch ----------------------------------------------------------------------------

/// kAuto -> CUDA for device memory, else the CPU backend.
Backend resolve(Backend b, const void* probe) {
  if (b != Backend::kAuto) return b;
#if FLASHCPP_WITH_CUDA
  return cuda::is_device_pointer(probe) ? Backend::kCuda : Backend::kCpu;
#else
  (void)probe;
  return Backend::kCpu;
#endif
}

Status no_reference(const char* op) {
  return Status::Unsupported(cat(op, " has no fp64 reference backend (the fp64 references live in the tests); use the "
                                     "cpu backend"));
}

#if FLASHCPP_HAS_FUSED
/// RunOptions::cuda_config for the fused kernels: "" or a comma-separated list of "scalar",
/// "two_pass", "streaming", "slots1|2|4" (norms), "persistent" (norms), "stream" and "stages2|3|4" (norms, rotary), "heads1|2", "staged" and "shared" (rotary). Also checks that a
/// usable sm_80+ device is current.
Status cuda_prologue(const std::string& config, cuda::FusedForce* force) {
  std::size_t at = 0;
  while (at < config.size()) {
    std::size_t comma = config.find(',', at);
    if (comma == std::string::npos) comma = config.size();
    const std::string tok = config.substr(at, comma - at);
    if (tok == "scalar") force->scalar = true;
    else if (tok == "two_pass") force->two_pass = true;
    else if (tok == "streaming") force->streaming = true;
    else if (tok == "slots1" || tok == "slots2" || tok == "slots4") force->slots = tok.back() - '0';
    else if (tok == "heads1" || tok == "heads2") force->heads = tok.back() - '0';
    else if (tok == "staged") force->staged = true;
    else if (tok == "persistent") force->persistent = true;
    else if (tok == "shared") force->shared = true;
    else if (tok == "stream") force->stream = true;
    else if (tok == "stages2" || tok == "stages3" || tok == "stages4") force->stages = tok.back() - '0';
    else if (!tok.empty())
      return Status::Invalid(cat("cuda_config token '", tok,
                                 "' is not known to the fused kernels (known: scalar, two_pass, streaming, "
                                 "slots1, slots2, slots4, heads1, heads2, staged, shared, persistent, stream, stages2, stages3, stages4)"));
    at = comma + 1;
  }
  cuda::DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(cuda::current_device(&dev));
  if (dev.sm_major < 8)
    return Status::Unsupported(cat("the fused CUDA kernels need compute capability 8.0 or newer; device '", dev.name.c_str(),
                                   "' is ", dev.sm_major, ".", dev.sm_minor));
  return Status::Ok();
}
#else
Status no_cuda(const char* op) {
#if FLASHCPP_WITH_CUDA
  return build::refuse(build::Family::kFused, cat(op, " runs on the CPU backend only"));
#else
  (void)op;
  return build::refuse_no_cuda();
#endif
}
#endif

Status run_norm(const RmsNormParams& p, bool with_residual, const RunOptions& opt) {
  const Backend b = resolve(opt.backend, p.x.data);
  FLASHCPP_RETURN_IF_ERROR(validate(p, with_residual, b));
  if (p.rows == 0 || p.hidden == 0) return Status::Ok();
  switch (b) {
    case Backend::kCpu: return cpu::fused_rms_norm(p, with_residual, opt.cpu_threads);
    case Backend::kCpuReference: return no_reference(with_residual ? "fused_add_rms_norm" : "rms_norm");
    case Backend::kCuda: {
#if FLASHCPP_HAS_FUSED
      cuda::FusedForce force;
      FLASHCPP_RETURN_IF_ERROR(cuda_prologue(opt.cuda_config, &force));
      return cuda::rms_norm(p, with_residual, force, opt.stream);
#else
      return no_cuda(with_residual ? "fused_add_rms_norm" : "rms_norm");
#endif
    }
    case Backend::kAuto: break;
  }
  return Status::Internal("fused backend selection fell through");
}

}  // namespace

Status rms_norm(const RmsNormParams& p, const RunOptions& opt) { return run_norm(p, false, opt); }
Status fused_add_rms_norm(const RmsNormParams& p, const RunOptions& opt) { return run_norm(p, true, opt); }

Status silu_and_mul(const SiluMulParams& p, const RunOptions& opt) {
  const Backend b = resolve(opt.backend, p.gate.data);
  FLASHCPP_RETURN_IF_ERROR(validate(p, b));
  if (p.rows == 0 || p.d == 0) return Status::Ok();
  switch (b) {
    case Backend::kCpu: return cpu::fused_silu_and_mul(p, opt.cpu_threads);
    case Backend::kCpuReference: return no_reference("silu_and_mul");
    case Backend::kCuda: {
#if FLASHCPP_HAS_FUSED
      cuda::FusedForce force;
      FLASHCPP_RETURN_IF_ERROR(cuda_prologue(opt.cuda_config, &force));
      return cuda::silu_and_mul(p, force, opt.stream);
#else
      return no_cuda("silu_and_mul");
#endif
    }
    case Backend::kAuto: break;
  }
  return Status::Internal("fused backend selection fell through");
}

Status apply_rotary(const RopeParams& p, const RunOptions& opt) {
  const Backend b = resolve(opt.backend, p.q.data);
  FLASHCPP_RETURN_IF_ERROR(validate(p, b));
  if (static_cast<std::int64_t>(p.batch) * p.seqlen == 0) return Status::Ok();
  switch (b) {
    case Backend::kCpu: return cpu::fused_apply_rotary(p, opt.cpu_threads);
    case Backend::kCpuReference: return no_reference("apply_rotary");
    case Backend::kCuda: {
#if FLASHCPP_HAS_FUSED
      cuda::FusedForce force;
      FLASHCPP_RETURN_IF_ERROR(cuda_prologue(opt.cuda_config, &force));
      return cuda::apply_rotary(p, force, opt.stream);
#else
      return no_cuda("apply_rotary");
#endif
    }
    case Backend::kAuto: break;
  }
  return Status::Internal("fused backend selection fell through");
}

Status qk_norm_rope(const QkNormRopeParams& p, const RunOptions& opt) {
  const Backend b = resolve(opt.backend, p.q.data);
  FLASHCPP_RETURN_IF_ERROR(validate(p, b));
  if (static_cast<std::int64_t>(p.batch) * p.seqlen == 0) return Status::Ok();
  switch (b) {
    case Backend::kCpu: return cpu::fused_qk_norm_rope(p, opt.cpu_threads);
    case Backend::kCpuReference: return no_reference("qk_norm_rope");
    case Backend::kCuda: {
#if FLASHCPP_HAS_FUSED
      cuda::FusedForce force;
      FLASHCPP_RETURN_IF_ERROR(cuda_prologue(opt.cuda_config, &force));
      return cuda::qk_norm_rope(p, force, opt.stream);
#else
      return no_cuda("qk_norm_rope");
#endif
    }
    case Backend::kAuto: break;
  }
  return Status::Internal("fused backend selection fell through");
}

Status rope_append_kv(const RopeAppendParams& p, const RunOptions& opt) {
  const Backend b = resolve(opt.backend, p.k_new.data);
  FLASHCPP_RETURN_IF_ERROR(validate(p, b));
  if (static_cast<std::int64_t>(p.batch) * p.seqlen == 0) return Status::Ok();
  switch (b) {
    case Backend::kCpu: return cpu::fused_rope_append_kv(p, opt.cpu_threads);
    case Backend::kCpuReference: return no_reference("rope_append_kv");
    case Backend::kCuda: {
#if FLASHCPP_HAS_FUSED
      cuda::FusedForce force;
      FLASHCPP_RETURN_IF_ERROR(cuda_prologue(opt.cuda_config, &force));
      return cuda::rope_append_kv(p, force, opt.stream);
#else
      return no_cuda("rope_append_kv");
#endif
    }
    case Backend::kAuto: break;
  }
  return Status::Internal("fused backend selection fell through");
}

}  // namespace flashcpp
