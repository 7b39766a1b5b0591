// Decode plan/run: the work list and the public entry points that route a step to the CPU or the
// CUDA backend. Host code shared by both backends, built with or without CUDA; it is the one
// dispatch point of decode, as src/core/dispatch.cc is for attention_forward. How many splits each
// sequence gets is the selector's rule (core/selector.cc, decode_splits).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/decode_backends.h"
#include "core/families.h"
#include "core/selector.h"
#include "common/decode_common.h"
#include "flashcpp/decode.h"
#if FLASHCPP_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace flashcpp {
namespace {
constexpr std::size_t kWorkspaceAlign = 16;
}  // namespace

namespace {

using decode::RowLayout;
using select::SplitDecision;

bool on_device(const void* ptr) {
#if FLASHCPP_WITH_CUDA
  return ptr != nullptr && cuda::is_device_pointer(ptr);
#else
  (void)ptr;
  return false;
#endif
}

/// kAuto becomes kCuda when the data (or, at plan time, the workspace) is device memory.
Backend resolve(Backend b, const void* data, const void* fallback) {
  if (b != Backend::kAuto) return b;
  return on_device(data ? data : fallback) ? Backend::kCuda : Backend::kCpu;
}

Status check_backend_built(Backend b) {
#if !FLASHCPP_WITH_CUDA
  if (b == Backend::kCuda)
    return build::refuse_no_cuda();
#elif !FLASHCPP_HAS_DECODE  // every CUDA call below is then unreachable
  if (b == Backend::kCuda)
    return build::refuse(build::Family::kDecode,
                         "decode_plan, decode_run and merge_attention_states run on the CPU backend only");
#endif
  (void)b;
  return Status::Ok();
}

struct PlanSizes {
  SplitDecision split;
  RowLayout rows;
  std::size_t int_bytes = 0, float_bytes = 0;
  int num_sms = 0;
  bool fused_merge = false;  ///< CUDA plan with splits and DecodePlanOptions::fused_merge
  bool fused_append = false; ///< CUDA plan of an appending step and DecodePlanOptions::fused_append
};

Status plan_sizes(const DecodeParams& p, const DecodePlanOptions& opt, Backend backend, PlanSizes* out) {
  FLASHCPP_RETURN_IF_ERROR(check_backend_built(backend));
  FLASHCPP_RETURN_IF_ERROR(decode::validate_decode_shape(p, backend));
  if (opt.num_splits < 0 || opt.num_splits > kDecodeMaxSplits)
    return Status::Invalid("num_splits " + std::to_string(opt.num_splits) + " is outside [0, " +
                           std::to_string(kDecodeMaxSplits) + "] (0 = heuristic)");
  if (opt.max_splits < 0 || opt.max_splits > kDecodeMaxSplits)
    return Status::Invalid("max_splits " + std::to_string(opt.max_splits) + " is outside [0, " +
                           std::to_string(kDecodeMaxSplits) + "] (0 = " + std::to_string(kDecodeMaxSplits) +
                           ", the most splits a plan makes)");
  if (opt.num_sms < 0) return Status::Invalid("num_sms " + std::to_string(opt.num_sms) + " is negative (0 = the device's)");
  out->num_sms = opt.num_sms;
  int smem_per_sm = 0;  // the CPU backend plans for an H200's SMs
#if FLASHCPP_HAS_DECODE
  if (backend == Backend::kCuda) {
    int device_sms = 0;
    FLASHCPP_RETURN_IF_ERROR(cuda::decode_device_limits(&device_sms, &smem_per_sm));
    if (out->num_sms == 0) out->num_sms = device_sms;
  }
#endif
  if (out->num_sms == 0) out->num_sms = select::kCpuPlanSms;
  FLASHCPP_RETURN_IF_ERROR(
      select::decode_splits(p, opt.host_cache_seqlens, opt.num_splits, opt.max_splits, out->num_sms, &out->split,
                            opt.small_plan, smem_per_sm));
  out->rows = decode::row_layout(p.heads_q, p.heads_kv, p.seqlen_q);
  out->fused_merge = opt.fused_merge && backend == Backend::kCuda && out->split.needs_merge;
  out->fused_append = opt.fused_append && backend == Backend::kCuda && p.has_append();
  out->int_bytes = (decode::worklist_int_count(p.batch, out->split.num_items) +
                    (out->fused_merge ? decode::merge_counter_count(p.batch, p.heads_kv, out->rows.row_blocks) : 0)) *
                   sizeof(std::int32_t);
  out->float_bytes = out->split.needs_merge ? decode::partial_float_bytes(out->split.num_items, p.heads_kv,
                                                                          out->rows.rows, p.effective_head_dim_v())
                                            : 0;
  return Status::Ok();
}

Status check_workspace(const char* which, const void* ptr, std::size_t have, std::size_t need) {
  if (need == 0) return Status::Ok();
  if (ptr == nullptr)
    return Status::Invalid(std::string(which) + " workspace is null; this plan needs " + std::to_string(need) +
                           " bytes (see decode_workspace_size)");
  if (reinterpret_cast<std::uintptr_t>(ptr) % kWorkspaceAlign != 0)
    return Status::Invalid(std::string(which) + " workspace is not 16-byte aligned");
  if (have < need)
    return Status::Invalid(std::string(which) + " workspace has " + std::to_string(have) + " bytes; this plan needs " +
                           std::to_string(need) + " (see decode_workspace_size)");
  return Status::Ok();
}

std::string mismatch(const char* field, long long got, long long planned) {
  return std::string("decode_run: ") + field + " " + std::to_string(got) + " differs from the plan's " +
         std::to_string(planned) + " (run decode_plan again for this shape)";
}

}  // namespace

Status decode_workspace_size(const DecodeParams& p, const DecodePlanOptions& opt, DecodeWorkspaceSize* out) {
  *out = DecodeWorkspaceSize{};
  PlanSizes s;
  FLASHCPP_RETURN_IF_ERROR(plan_sizes(p, opt, resolve(opt.backend, p.q.data, nullptr), &s));
  out->int_bytes = s.int_bytes;
  out->float_bytes = s.float_bytes;
  return Status::Ok();
}

Status decode_plan(const DecodeParams& p, const DecodePlanOptions& opt, void* int_workspace, std::size_t int_bytes,
                   void* float_workspace, std::size_t float_bytes, DecodePlan* plan) {
  *plan = DecodePlan{};
  const Backend backend = resolve(opt.backend, p.q.data, int_workspace);
  PlanSizes s;
  FLASHCPP_RETURN_IF_ERROR(plan_sizes(p, opt, backend, &s));
  FLASHCPP_RETURN_IF_ERROR(check_workspace("int", int_workspace, int_bytes, s.int_bytes));
  FLASHCPP_RETURN_IF_ERROR(check_workspace("float", float_workspace, float_bytes, s.float_bytes));

  // The work list: per-sequence (first item, split count), then per-item (sequence, split); then
  // the fused merge's arrival counters, zero.
  const int items = s.split.num_items;
  std::vector<std::int32_t> host(s.int_bytes / sizeof(std::int32_t), 0);
  std::int32_t next = 0;
  for (int b = 0; b < p.batch; ++b) {
    host[b] = next;
    host[p.batch + b] = s.split.splits[b];
    for (int i = 0; i < s.split.splits[b]; ++i, ++next) {
      host[2 * p.batch + next] = b;
      host[2 * p.batch + items + next] = i;
    }
  }
  if (!host.empty()) {
    if (backend == Backend::kCuda) {
#if FLASHCPP_HAS_DECODE
      FLASHCPP_RETURN_IF_ERROR(cuda::decode_upload_worklist(int_workspace, host.data(), host.size(), opt.stream));
#endif
    } else {
      std::memcpy(int_workspace, host.data(), host.size() * sizeof(std::int32_t));
    }
  }
  plan->planned = true;
  plan->backend = backend;
  plan->batch = p.batch;
  plan->seqlen_q = p.seqlen_q;
  plan->heads_q = p.heads_q;
  plan->heads_kv = p.heads_kv;
  plan->head_dim = p.head_dim;
  plan->head_dim_v = p.effective_head_dim_v();
  plan->dtype = p.q.dtype;
  plan->paged = p.cache.paged();
  plan->append = p.has_append();
  plan->rows_per_kv = s.rows.rows;
  plan->row_blocks = s.rows.row_blocks;
  plan->warp_rows = s.rows.warp_rows;
  plan->num_items = items;
  plan->max_splits = s.split.max_splits;
  plan->num_sms = s.num_sms;
  plan->needs_merge = s.split.needs_merge;
  plan->fused_merge = s.fused_merge;
  plan->fused_append = s.fused_append;
  plan->ctas = items * p.heads_kv * s.rows.row_blocks;
  plan->ctas_per_sm = s.split.ctas_per_sm;
  plan->int_workspace = int_workspace;
  plan->int_bytes = s.int_bytes;
  plan->float_workspace = float_workspace;
  plan->float_bytes = s.float_bytes;
  return Status::Ok();
}

Status decode_run(const DecodeParams& p, const DecodePlan& plan, const RunOptions& opt) {
  if (!plan.planned) return Status::Invalid("decode_run: the plan is empty (call decode_plan first)");
  if (opt.backend != Backend::kAuto && opt.backend != plan.backend)
    return Status::Invalid(std::string("decode_run: backend ") + backend_name(opt.backend) +
                           " differs from the plan's " + backend_name(plan.backend));
  FLASHCPP_RETURN_IF_ERROR(check_backend_built(plan.backend));
  FLASHCPP_RETURN_IF_ERROR(validate(p, plan.backend));
  if (p.batch != plan.batch) return Status::Invalid(mismatch("batch", p.batch, plan.batch));
  if (p.seqlen_q != plan.seqlen_q) return Status::Invalid(mismatch("seqlen_q", p.seqlen_q, plan.seqlen_q));
  if (p.heads_q != plan.heads_q) return Status::Invalid(mismatch("heads_q", p.heads_q, plan.heads_q));
  if (p.heads_kv != plan.heads_kv) return Status::Invalid(mismatch("heads_kv", p.heads_kv, plan.heads_kv));
  if (p.head_dim != plan.head_dim) return Status::Invalid(mismatch("head_dim", p.head_dim, plan.head_dim));
  if (p.effective_head_dim_v() != plan.head_dim_v)
    return Status::Invalid(mismatch("head_dim_v", p.effective_head_dim_v(), plan.head_dim_v));
  if (p.q.dtype != plan.dtype)
    return Status::Invalid(std::string("decode_run: dtype ") + dtype_name(p.q.dtype) + " differs from the plan's " +
                           dtype_name(plan.dtype) + " (run decode_plan again for this shape)");
  if (p.cache.paged() != plan.paged)
    return Status::Invalid(std::string("decode_run: the cache is ") + (p.cache.paged() ? "paged" : "contiguous") +
                           " but the plan was made for a " + (plan.paged ? "paged" : "contiguous") + " cache");
  if (p.has_append() != plan.append)
    return Status::Invalid(std::string("decode_run: the step ") + (p.has_append() ? "appends" : "does not append") +
                           " but the plan was made for a step that " + (plan.append ? "appends" : "does not"));
  if (p.batch == 0) return Status::Ok();
  if (plan.backend == Backend::kCuda) {
#if FLASHCPP_HAS_DECODE
    return cuda::decode_run(p, plan, opt.stream, opt.programmatic_launch);
#endif
  }
  return cpu::decode_run(p, plan, opt);
}

Status merge_attention_states(const MergeStatesParams& p, const RunOptions& opt) {
  const Backend backend = resolve(opt.backend, p.o_a.data, nullptr);
  FLASHCPP_RETURN_IF_ERROR(check_backend_built(backend));
  FLASHCPP_RETURN_IF_ERROR(validate(p, backend));
  if (p.batch == 0 || p.seqlen == 0) return Status::Ok();
  if (backend == Backend::kCuda) {
#if FLASHCPP_HAS_DECODE
    return cuda::merge_attention_states(p, opt.stream);
#endif
  }
  return cpu::merge_attention_states(p);
}

}  // namespace flashcpp
