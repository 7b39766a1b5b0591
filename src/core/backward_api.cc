// attention_backward (include/flashcpp/backward.h): resolve the backend, validate, let the selector
// (core/selector.cc) choose, size and check the workspace, run the choice. No heuristic lives here.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/attention_walk.h"
#include "core/backward_internal.h"
#include "core/message.h"
#include "core/selector.h"
#include "cpu/backward_backend.h"
#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#if FLASHCPP_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace flashcpp {

AttnParams AttnBackwardParams::forward() const {
  AttnParams f;
  f.batch = batch;
  f.seqlen_q = seqlen_q;
  f.seqlen_k = seqlen_k;
  f.heads_q = heads_q;
  f.heads_kv = heads_kv;
  f.head_dim = head_dim;
  f.head_dim_v = head_dim_v;
  f.q = q;
  f.k = k;
  f.v = v;
  f.o = o;
  // The forward's LSE; the backward only reads it (AttnParams names its output pointer non-const).
  f.lse = const_cast<float*>(lse);
  f.softmax_scale = softmax_scale;
  f.mask = mask;
  return f;
}

float AttnBackwardParams::effective_scale() const noexcept { return forward().effective_scale(); }

namespace {

/// kAuto: CUDA when q is device memory, else the tiled CPU backend (as attention_forward decides).
Backend resolve(const AttnBackwardParams& p, Backend b) {
  if (b != Backend::kAuto) return b;
#if FLASHCPP_WITH_CUDA
  return cuda::is_device_pointer(p.q.data) ? Backend::kCuda : Backend::kCpu;
#else
  (void)p;
  return Backend::kCpu;
#endif
}

/// The layout the choice needs (bytes 0 for the fp64 reference). Sizes that overflow are refused.
Status layout_for(const AttnBackwardParams& p, const RunOptions& opt, const KernelChoice& choice,
                  BackwardWorkspaceLayout* out) {
  *out = BackwardWorkspaceLayout{};
  const bool cuda = choice.id == KernelId::kCudaSm80 || choice.id == KernelId::kCudaSm90;
  if (choice.id != KernelId::kCpuTiled && !cuda) return Status::Ok();
  // The packed query rows the padding covers: mask.total_q, else cu_seqlens_q[batch] (host arrays:
  // validated; device arrays are not read: batch * seqlen_q bounds them), else batch * seqlen_q.
  std::int64_t total_q = static_cast<std::int64_t>(p.batch) * p.seqlen_q;
  if (p.mask.is_varlen() && p.mask.total_q > 0) total_q = p.mask.total_q;
  else if (p.mask.is_varlen() && !cuda && p.batch >= 0) total_q = p.mask.cu_seqlens_q[p.batch];
  const int row_pad = cuda ? choice.tile.block_m : cpu::tiled_backward_block_m(p, opt);
  // The largest part is heads_q * rows * head_dim floats, rows < total_q + (batch + 1) * row_pad.
  std::int64_t rows = 0, elems = 0;
  if (__builtin_mul_overflow(static_cast<std::int64_t>(p.batch) + 1, static_cast<std::int64_t>(row_pad), &rows) ||
      __builtin_add_overflow(rows, total_q, &rows) ||
      __builtin_mul_overflow(rows, static_cast<std::int64_t>(p.heads_q) * p.head_dim, &elems) ||
      elems > (std::int64_t{1} << 60) / 4)
    return Status::Invalid(detail::cat("the backward's workspace for ", p.heads_q, " heads of ", total_q,
                                       " query rows and head_dim ", p.head_dim, " overflows 64-bit sizes"));
  *out = walk::workspace_layout(p.batch, total_q, p.heads_q, p.head_dim, row_pad, p.deterministic);
  return Status::Ok();
}

Status select_resolved(const AttnBackwardParams& p, const RunOptions& opt, Backend b, KernelChoice* out) {
  FLASHCPP_RETURN_IF_ERROR(detail::validate_backward(p, b, nullptr));
  return select::backward(p, opt, b, out);
}

}  // namespace

Status select_backward_kernel(const AttnBackwardParams& p, const RunOptions& opt, KernelChoice* out) {
  return select_resolved(p, opt, resolve(p, opt.backend), out);
}

Status attention_backward_workspace_size(const AttnBackwardParams& p, const RunOptions& opt, std::size_t* bytes,
                                         BackwardWorkspaceLayout* layout) {
  if (bytes == nullptr) return Status::Invalid("attention_backward_workspace_size: bytes is null");
  *bytes = 0;
  if (opt.cpu_block_m < 0 || opt.cpu_block_n < 0)
    return Status::Invalid(detail::cat("cpu_block_m ", opt.cpu_block_m, " and cpu_block_n ", opt.cpu_block_n,
                                       " must be >= 0 (0 = default 64)"));
  KernelChoice choice;
  FLASHCPP_RETURN_IF_ERROR(select_backward_kernel(p, opt, &choice));
  BackwardWorkspaceLayout l;
  FLASHCPP_RETURN_IF_ERROR(layout_for(p, opt, choice, &l));
  *bytes = l.bytes;
  if (layout) *layout = l;
  return Status::Ok();
}

Status attention_backward(const AttnBackwardParams& p, const RunOptions& opt) {
  if (opt.cpu_block_m < 0 || opt.cpu_block_n < 0)
    return Status::Invalid(detail::cat("cpu_block_m ", opt.cpu_block_m, " and cpu_block_n ", opt.cpu_block_n,
                                       " must be >= 0 (0 = default 64)"));
  const Backend b = resolve(p, opt.backend);
  KernelChoice choice;
  FLASHCPP_RETURN_IF_ERROR(select_resolved(p, opt, b, &choice));
  BackwardWorkspaceLayout layout;
  FLASHCPP_RETURN_IF_ERROR(layout_for(p, opt, choice, &layout));
  FLASHCPP_RETURN_IF_ERROR(detail::validate_backward(p, b, &layout.bytes));
  if (p.batch == 0 && b != Backend::kCuda) {  // no sequence: only the uncovered varlen rows, when counted, get 0
    cpu::zero_uncovered_grads(p);
    return Status::Ok();
  }
  switch (choice.id) {
    case KernelId::kCpuReference: return cpu::reference_backward(p, opt);
    case KernelId::kCpuTiled: return cpu::tiled_backward(p, opt, layout);
#if FLASHCPP_HAS_SM80
    case KernelId::kCudaSm80:
    case KernelId::kCudaSm90: {
      std::string family, why;
      int key_group = 0;  // cuda_config's "+g<N>" (select::backward_config; checked by the selection above)
      if (!select::backward_config(opt.cuda_config, &family, &key_group, &why)) return Status::Invalid(why);
      return cuda::backward_cuda(p, choice.tile, layout, opt.stream, key_group);
    }
#endif
    default: break;
  }
  return Status::Unsupported(std::string("kernel ") + kernel_name(choice.id) + " has no backward in this build");
}

}  // namespace flashcpp
