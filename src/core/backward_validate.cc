// Validation of attention_backward (include/flashcpp/backward.h): everything that can be checked on
// the host without touching tensor memory. One sentence per error, naming the field and its value.
//
// Order (the first failure is reported):
//   1. the shared fields, by attention's own validate() on the forward problem (o as its output,
//      lse as its LSE): backend, shape, dtypes, mask, varlen and block-sparse descriptors, q, k, v,
//      o, lse, their aliasing; lse must be given whenever a gradient is computed;
//   2. the backward's scalars: rotary is not part of the backward, total_k, the dtypes of dout, dq,
//      dk and dv, dlse's alignment;
//   3. the backward's views: dout (read), dq, dk, dv (written), each only where the backward reads
//      or writes it (an empty side writes zeros into the other: backward.h's header comment);
//   4. the workspace (attention_backward only: its size depends on the backend's tiles): given,
//      256-byte aligned, large enough;
//   5. aliasing: dq, dk, dv and the workspace must not overlap each other or anything read.
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "common/attention_walk.h"
#include "core/backward_internal.h"
#include "core/message.h"
#include "core/validate_parts.h"
#include "flashcpp/attention.h"
#include "flashcpp/backward.h"

namespace flashcpp {
namespace detail {
namespace {

constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

bool reads_host_arrays(Backend b) { return b == Backend::kCpu || b == Backend::kCpuReference; }

/// The byte span of an LSE-shaped fp32 array (lse, dlse): count floats from p.
Status lse_span(const char* name, const float* p, std::int64_t count, Span* span) {
  span->name = name;
  if (p == nullptr) return Status::Ok();
  if (addr(p) % alignof(float) != 0)
    return Status::Invalid(cat(name, " ", static_cast<const void*>(p), " is not 4-byte aligned (fp32)"));
  std::int64_t bytes = 0;
  std::uintptr_t hi = 0;
  if (__builtin_mul_overflow(count, static_cast<std::int64_t>(sizeof(float)), &bytes) ||
      __builtin_add_overflow(addr(p), static_cast<std::uintptr_t>(bytes), &hi))
    return Status::Invalid(cat(name, "'s byte span (", count, " fp32 from ", static_cast<const void*>(p),
                               ") wraps around the address space"));
  span->lo = addr(p);
  span->hi = hi;
  return Status::Ok();
}

}  // namespace

Status validate_backward(const AttnBackwardParams& p, Backend backend, const std::size_t* workspace_bytes) {
  // 1. The shared fields, exactly as the forward checks them.
  const AttnParams f = p.forward();
  const bool empty_q = p.batch == 0 || p.seqlen_q == 0;
  const bool computes = !empty_q && p.seqlen_k > 0;  // some pair may exist: P, D and lse are needed
  if (computes && p.lse == nullptr)
    return Status::Invalid("lse is null: the backward recomputes P from the forward's LSE (pass the forward's "
                           "AttnParams::lse)");
  FLASHCPP_RETURN_IF_ERROR(validate(f, backend));

  // 2. Scalars.
  const MaskParams& m = p.mask;
  const bool varlen = m.is_varlen();
  if (p.total_k < 0) return Status::Invalid(cat("total_k ", p.total_k, " is negative (must be >= 0; 0 = unknown)"));
  if (p.total_k > 0 && !varlen)
    return Status::Invalid(cat("total_k ", p.total_k, " is set without cu_seqlens (it counts the packed rows of a varlen k)"));
  if (p.total_k > kInt32Max)
    return Status::Invalid(cat("total_k ", p.total_k, " exceeds 2^31-1 (packed rows are int32, as cu_seqlens_k)"));
  const std::array<std::pair<const char*, DType>, 4> ts = {
      {{"dout", p.dout.dtype}, {"dq", p.dq.dtype}, {"dk", p.dk.dtype}, {"dv", p.dv.dtype}}};
  for (const auto& [name, dt] : ts)
    if (dt != p.q.dtype)
      return Status::Invalid(cat(name, ".dtype ", dtype_name(dt), " differs from q.dtype ", dtype_name(p.q.dtype),
                                 " (q, k, v, o, dout, dq, dk and dv share one dtype)"));

  // Packed row counts (validate() checked cu_seqlens; on the device they cannot be read, and the
  // maximum lengths stand in, as for the forward).
  const bool host = reads_host_arrays(backend);
  if (varlen && host && empty_q && p.batch > 0) {
    // validate() returns before reading cu_seqlens when there is no query row, but the backward still
    // walks the sequences to zero dk and dv: check them here with the same rules.
    for (const auto& [which, cu, max_len] : {std::tuple{"q", m.cu_seqlens_q, p.seqlen_q},
                                             std::tuple{"k", m.cu_seqlens_k, p.seqlen_k}}) {
      if (addr(cu) % alignof(std::int32_t) != 0)
        return Status::Invalid(cat("mask.cu_seqlens_", which, " ", static_cast<const void*>(cu), " is not 4-byte aligned (int32)"));
      if (cu[0] != 0) return Status::Invalid(cat("mask.cu_seqlens_", which, "[0] is ", cu[0], " (must be 0)"));
      for (int b = 0; b < p.batch; ++b) {
        const std::int64_t len = static_cast<std::int64_t>(cu[b + 1]) - cu[b];
        if (len < 0 || len > max_len)
          return Status::Invalid(cat("sequence ", b, " of mask.cu_seqlens_", which, " has length ", len,
                                     ", outside [0, seqlen_", which, " ", max_len, "]"));
      }
    }
  }
  std::int64_t rows_q = p.seqlen_q, rows_k = p.seqlen_k;
  if (varlen) {
    if (host && p.batch >= 0) {
      rows_q = m.cu_seqlens_q[p.batch];
      rows_k = m.cu_seqlens_k[p.batch];
    }
    if (m.total_q > 0) rows_q = m.total_q;
    if (p.total_k > 0) {
      if (host && p.total_k < rows_k)
        return Status::Invalid(cat("total_k ", p.total_k, " is less than cu_seqlens_k[batch] ", rows_k,
                                   " (it counts every packed row of k, v, dk and dv)"));
      rows_k = p.total_k;
    }
  }
  const std::int64_t lse_count = static_cast<std::int64_t>(p.heads_q) * rows_q * (varlen ? 1 : p.batch);
  Span s_dlse;
  FLASHCPP_RETURN_IF_ERROR(lse_span("dlse", p.dlse, lse_count, &s_dlse));

  // 3. Views. What is read or written: dq wherever query rows exist (zeros without keys), dk and dv
  // wherever key rows exist (zeros without queries), dout and the inputs where pairs may exist.
  const bool writes_q = (p.batch > 0 && p.seqlen_q > 0) || (varlen && m.total_q > 0);
  const bool writes_k = (p.batch > 0 && p.seqlen_k > 0) || (varlen && p.total_k > 0);
  const ViewExtents eq{p.batch, rows_q, p.seqlen_q, p.heads_q, p.head_dim, varlen, "seqlen_q", "heads_q"};
  const ViewExtents ek{p.batch, rows_k, p.seqlen_k, p.heads_kv, p.head_dim, varlen, "seqlen_k", "heads_kv"};
  ViewExtents eo = eq, ev = ek;  // o, dout, v and dv: head_dim_v
  eo.dim = ev.dim = p.effective_head_dim_v();
  eo.dim_name = ev.dim_name = "head_dim_v";
  Span sq, sk, sv, so, sdo, sdq, sdk, sdv, slse, sws;
  if (computes) {
    // Already checked by validate(); their spans are needed for the aliasing below.
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("q", p.q, eq, backend, &sq));
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("k", p.k, ek, backend, &sk));
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("v", p.v, ev, backend, &sv));
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("o", p.o, eo, backend, &so));
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("dout", p.dout, eo, backend, &sdo));
    FLASHCPP_RETURN_IF_ERROR(lse_span("lse", p.lse, lse_count, &slse));
  }
  if (writes_q) FLASHCPP_RETURN_IF_ERROR(check_attention_view("dq", p.dq, eq, backend, &sdq));
  if (writes_k) {
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("dk", p.dk, ek, backend, &sdk));
    FLASHCPP_RETURN_IF_ERROR(check_attention_view("dv", p.dv, ev, backend, &sdv));
  }

  // 4. The workspace.
  sws.name = "workspace";
  if (workspace_bytes && *workspace_bytes > 0) {
    const std::size_t need = *workspace_bytes;
    if (p.workspace == nullptr)
      return Status::Invalid(cat("workspace is null, but this problem needs ", need,
                                 " bytes of it (attention_backward_workspace_size)"));
    if (addr(p.workspace) % walk::kWorkspaceAlign != 0)
      return Status::Invalid(cat("workspace ", static_cast<const void*>(p.workspace), " is not ",
                                 walk::kWorkspaceAlign, "-byte aligned"));
    if (p.workspace_bytes < need)
      return Status::Invalid(cat("workspace_bytes ", p.workspace_bytes, " is less than the ", need,
                                 " bytes this problem needs (attention_backward_workspace_size)"));
    std::uintptr_t hi = 0;
    if (__builtin_add_overflow(addr(p.workspace), need, &hi))
      return Status::Invalid(cat("workspace's byte span (", need, " bytes from ", static_cast<const void*>(p.workspace),
                                 ") wraps around the address space"));
    sws.lo = addr(p.workspace);
    sws.hi = hi;
  }

  // 5. Aliasing: what is written must not overlap what is read, nor each other. Inputs may alias each
  // other (one packed qkv buffer).
  const std::array<const Span*, 4> outs = {&sdq, &sdk, &sdv, &sws};
  for (std::size_t i = 0; i < outs.size(); ++i)
    for (const Span* other : {&sq, &sk, &sv, &so, &sdo, &slse, &s_dlse, &sdq, &sdk, &sdv, &sws}) {
      const Span* out = outs[i];
      if (other == out) continue;
      if (out->overlaps(*other))
        return Status::Invalid(cat(out->name, " overlaps ", other->name, ": bytes [", reinterpret_cast<const void*>(out->lo),
                                   ", ", reinterpret_cast<const void*>(out->hi), ") meet [",
                                   reinterpret_cast<const void*>(other->lo), ", ", reinterpret_cast<const void*>(other->hi),
                                   ") (the gradients and the workspace must not alias the inputs or each other)"));
    }
  return Status::Ok();
}

}  // namespace detail

Status validate_backward(const AttnBackwardParams& p, Backend backend) {
  return detail::validate_backward(p, backend, nullptr);
}

}  // namespace flashcpp
