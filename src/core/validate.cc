// Parameter validation for attention_forward: everything that can be checked on the host without
// touching q/k/v/o memory and without launching anything. Every failure is one sentence that
// names the field and its value.
//
// Order of the checks (the first failure is reported):
//   1. scalars: backend, shape, dtypes, mask scalars, varlen/block-sparse descriptors, rotary
//      scalars (and rotary.k_rotated's dtype); an empty problem (batch 0 or seqlen_q 0) writes
//      nothing and is accepted here, unless it is varlen with mask.total_q > 0: then it writes
//      O = 0 and LSE = -inf into the total_q packed rows, and only o and lse are checked;
//   2. varlen prefix sums (read on the CPU backends only: host memory);
//   3. each tensor: null, alignment, strides (sign, CUDA vector width, 64-bit span, 32-bit
//      in-sequence offsets, injective index map); with rotary, rotary.k_rotated like k (required
//      on CUDA, optional on the CPU backends);
//   4. lse, ALiBi slopes;
//   5. aliasing: o, lse and rotary.k_rotated (unless it is k itself) must not overlap what the
//      kernel reads (or each other);
//   6. block-sparse arrays (walked on the CPU backends only).
//
// What cannot be checked: device-resident cu_seqlens and block-sparse arrays (the CUDA kernels
// clamp each sequence to seqlen_q / seqlen_k and each block index to the grid), and whether the
// memory behind a pointer is really that large.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "flashcpp/attention.h"

#include "core/head_dim_checks.h"
#include "core/message.h"
#include "core/rope_checks.h"
#include "core/score_checks.h"
#include "core/validate_parts.h"

namespace flashcpp {
namespace {

// ---- one-sentence messages (src/core/message.h) ----------------------------------------

using detail::cat;

// ---- backends --------------------------------------------------------------------------

/// What a backend implies for validation. kAuto is the most permissive one: fp32 allowed, only
/// element alignment, and the mask arrays are not read (they may live in device memory).
struct BackendRules {
  bool reads_host_arrays = false;  ///< cu_seqlens / block-sparse arrays are host memory
  bool cuda = false;               ///< 16-byte vector loads, no fp32
  bool f64 = false;                ///< takes DType::kF64 (the fp64 reference only)
};

bool backend_rules(Backend b, BackendRules* r) {
  switch (b) {
    case Backend::kAuto: *r = {false, false}; return true;
    case Backend::kCpu: *r = {true, false}; return true;
    case Backend::kCpuReference: *r = {true, false, true}; return true;
    case Backend::kCuda: *r = {false, true}; return true;
  }
  return false;
}

/// The CUDA kernels load 16 bytes at a time: 8 fp16/bf16 elements.
constexpr std::int64_t kCudaVectorBytes = 16;
constexpr std::int64_t kCudaVectorElems = 8;
constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();

bool known_dtype(DType t) { return t == DType::kF16 || t == DType::kBF16 || t == DType::kF32 || t == DType::kF64; }

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

bool is_empty_problem(const AttnParams& p) { return p.batch == 0 || p.seqlen_q == 0; }

/// ceil(a / b) for a >= 0, b > 0, in 64 bits (no int overflow for a near INT_MAX).
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ---- 1. scalars ------------------------------------------------------------------------

Status check_shape(const AttnParams& p) {
  if (p.batch < 0) return Status::Invalid(cat("batch ", p.batch, " is negative (must be >= 0)"));
  if (p.seqlen_q < 0) return Status::Invalid(cat("seqlen_q ", p.seqlen_q, " is negative (must be >= 0)"));
  if (p.seqlen_k < 0) return Status::Invalid(cat("seqlen_k ", p.seqlen_k, " is negative (must be >= 0)"));
  if (p.heads_q < 1) return Status::Invalid(cat("heads_q ", p.heads_q, " must be >= 1"));
  if (p.heads_kv < 1) return Status::Invalid(cat("heads_kv ", p.heads_kv, " must be >= 1"));
  if (p.heads_q % p.heads_kv != 0)
    return Status::Invalid(cat("heads_q ", p.heads_q, " is not a multiple of heads_kv ", p.heads_kv));
  FLASHCPP_RETURN_IF_ERROR(detail::check_head_dim("head_dim", p.head_dim));
  if (p.head_dim_v != 0) FLASHCPP_RETURN_IF_ERROR(detail::check_head_dim("head_dim_v", p.head_dim_v));
  return Status::Ok();
}

Status check_dtypes(const AttnParams& p, const BackendRules& br) {
  const std::array<std::pair<const char*, DType>, 4> ts = {
      {{"q", p.q.dtype}, {"k", p.k.dtype}, {"v", p.v.dtype}, {"o", p.o.dtype}}};
  for (const auto& [name, dt] : ts)
    if (!known_dtype(dt))
      return Status::Invalid(
          cat(name, ".dtype ", static_cast<int>(dt), " is not a known dtype (fp16, bf16, fp32 or fp64)"));
  for (std::size_t i = 1; i < ts.size(); ++i)
    if (ts[i].second != p.q.dtype)
      return Status::Invalid(cat(ts[i].first, ".dtype ", dtype_name(ts[i].second), " differs from q.dtype ",
                                 dtype_name(p.q.dtype), " (q, k, v and o must share one dtype)"));
  if (br.cuda && p.q.dtype == DType::kF32)
    return Status::Unsupported("fp32 runs on the CPU backend only (the CUDA kernels take fp16 or bf16)");
  if (p.q.dtype == DType::kF64 && !br.f64)
    return Status::Unsupported("fp64 runs on the fp64 reference backend only (Backend::kCpuReference, for gradcheck); "
                               "the other backends take fp16, bf16 or fp32");
  if (p.q.dtype == DType::kF64 && p.rotary.enabled())
    return Status::Unsupported("rotary with fp64 inputs is not supported (the rotary rounds to fp16, bf16 or fp32)");
  return Status::Ok();
}

Status check_mask_scalars(const AttnParams& p) {
  const MaskParams& m = p.mask;
  if (!std::isfinite(p.softmax_scale))
    return Status::Invalid(cat("softmax_scale ", static_cast<double>(p.softmax_scale),
                               " is not finite (0 selects 1/sqrt(head_dim))"));
  if (!std::isfinite(m.softcap) || m.softcap < 0.f)
    return Status::Invalid(
        cat("mask.softcap ", static_cast<double>(m.softcap), " must be finite and >= 0 (0 = off)"));
  FLASHCPP_RETURN_IF_ERROR(check_score_units(p.effective_scale(), m.softcap, m.alibi_slopes != nullptr));
  if (m.window_left < -1)
    return Status::Invalid(cat("mask.window_left ", m.window_left, " must be >= -1 (-1 = unbounded)"));
  if (m.window_right < -1)
    return Status::Invalid(cat("mask.window_right ", m.window_right, " must be >= -1 (-1 = unbounded)"));
  if (m.global_tokens < 0)
    return Status::Invalid(cat("mask.global_tokens ", m.global_tokens, " is negative (must be >= 0)"));
  if (m.global_queries && m.global_tokens == 0)
    return Status::Invalid("mask.global_queries needs mask.global_tokens > 0 (got 0)");
  if (m.alibi_slopes && m.alibi_batch_stride != 0 && m.alibi_batch_stride != p.heads_q)
    return Status::Invalid(
        cat("mask.alibi_batch_stride ", m.alibi_batch_stride, " must be 0 or heads_q ", p.heads_q));
  if ((m.cu_seqlens_q == nullptr) != (m.cu_seqlens_k == nullptr))
    return Status::Invalid(
        m.cu_seqlens_q ? "mask.cu_seqlens_k is null but mask.cu_seqlens_q is set (varlen needs both)"
                       : "mask.cu_seqlens_q is null but mask.cu_seqlens_k is set (varlen needs both)");
  // The lse index of a row is computed in 64 bits; with varlen it is heads_q * total_q, both int32.
  std::int64_t lse_count = 0;
  if (p.lse && !m.is_varlen() &&
      (__builtin_mul_overflow(static_cast<std::int64_t>(p.batch), p.heads_q, &lse_count) ||
       __builtin_mul_overflow(lse_count, static_cast<std::int64_t>(p.seqlen_q), &lse_count)))
    return Status::Invalid(cat("the lse element count batch*heads_q*seqlen_q (", p.batch, "*", p.heads_q, "*",
                               p.seqlen_q, ") overflows int64"));
  if (m.is_varlen() && m.block_sparse)
    return Status::Unsupported("varlen (cu_seqlens) together with a block-sparse mask is not supported");
  if (m.total_q < 0) return Status::Invalid(cat("mask.total_q ", m.total_q, " is negative (must be >= 0; 0 = unknown)"));
  if (m.total_q > 0 && !m.is_varlen())
    return Status::Invalid(cat("mask.total_q ", m.total_q,
                               " is set without cu_seqlens (it counts the packed rows of a varlen q)"));
  if (m.total_q > kInt32Max)
    return Status::Invalid(cat("mask.total_q ", m.total_q, " exceeds 2^31-1 (packed rows are int32, as cu_seqlens_q)"));
  return Status::Ok();
}

Status check_block_sparse_scalars(const AttnParams& p) {
  const BlockSparseMask& bs = *p.mask.block_sparse;
  if (bs.block_m <= 0) return Status::Invalid(cat("block_sparse.block_m ", bs.block_m, " must be > 0"));
  if (bs.block_n <= 0) return Status::Invalid(cat("block_sparse.block_n ", bs.block_n, " must be > 0"));
  if (bs.num_batch != 1 && bs.num_batch != p.batch)
    return Status::Invalid(cat("block_sparse.num_batch ", bs.num_batch, " must be 1 or batch ", p.batch));
  if (bs.num_heads != 1 && bs.num_heads != p.heads_q)
    return Status::Invalid(cat("block_sparse.num_heads ", bs.num_heads, " must be 1 or heads_q ", p.heads_q));
  const std::int64_t nq = ceil_div(p.seqlen_q, bs.block_m), nk = ceil_div(p.seqlen_k, bs.block_n);
  if (bs.num_q_blocks != nq)
    return Status::Invalid(cat("block_sparse.num_q_blocks ", bs.num_q_blocks, " must be ceil(seqlen_q ",
                               p.seqlen_q, " / block_m ", bs.block_m, ") = ", nq));
  if (bs.num_k_blocks != nk)
    return Status::Invalid(cat("block_sparse.num_k_blocks ", bs.num_k_blocks, " must be ceil(seqlen_k ",
                               p.seqlen_k, " / block_n ", bs.block_n, ") = ", nk));
  if (bs.num_partial < 0)
    return Status::Invalid(cat("block_sparse.num_partial ", bs.num_partial, " is negative (must be >= 0)"));
  std::int64_t rows = 0;
  if (__builtin_mul_overflow(static_cast<std::int64_t>(bs.num_batch), bs.num_heads, &rows) ||
      __builtin_mul_overflow(rows, static_cast<std::int64_t>(bs.num_q_blocks), &rows))
    return Status::Invalid(cat("block_sparse has too many rows: num_batch ", bs.num_batch, " * num_heads ",
                               bs.num_heads, " * num_q_blocks ", bs.num_q_blocks, " overflows int64"));
  return Status::Ok();
}

// ---- 2. varlen prefix sums ---------------------------------------------------------------

/// Checks cu_seqlens_<which> and returns the packed row count in *rows. Reads the array only
/// when it is host memory; on the device it cannot be read, so *rows is the maximum length
/// `max_len` (the kernel clamps every sequence to it).
Status check_cu_seqlens(const char* which, const std::int32_t* cu, int batch, int max_len,
                        const char* max_name, const BackendRules& br, std::int64_t* rows) {
  if (addr(cu) % alignof(std::int32_t) != 0)
    return Status::Invalid(
        cat("mask.cu_seqlens_", which, " ", static_cast<const void*>(cu), " is not 4-byte aligned (int32)"));
  *rows = max_len;
  if (!br.reads_host_arrays) return Status::Ok();
  if (cu[0] != 0) return Status::Invalid(cat("mask.cu_seqlens_", which, "[0] is ", cu[0], " (must be 0)"));
  for (int b = 0; b < batch; ++b) {
    const std::int64_t len = static_cast<std::int64_t>(cu[b + 1]) - cu[b];
    if (len < 0)
      return Status::Invalid(cat("mask.cu_seqlens_", which, "[", b + 1, "] ", cu[b + 1],
                                 " is less than cu_seqlens_", which, "[", b, "] ", cu[b],
                                 " (must be non-decreasing)"));
    if (len > max_len)
      return Status::Invalid(cat("sequence ", b, " of mask.cu_seqlens_", which, " has length ", len,
                                 ", more than ", max_name, " ", max_len, " (the maximum length)"));
  }
  *rows = cu[batch];
  return Status::Ok();
}

// ---- 3. tensors ------------------------------------------------------------------------

using detail::Span;

/// Extents of one tensor's (batch, seq, head, dim) index map (shared with the backward's validation).
using Extents = detail::ViewExtents;

struct StrideDim {
  const char* name = "";
  std::int64_t stride = 0, extent = 0;
  bool is_dim = false;  ///< the innermost head_dim (stride 1)
  bool always = false;  ///< in use whatever its extent (the packed varlen sequence dim)
};

/// Largest reachable offset + 1 = dim + sum (extent - 1) * stride, with overflow checks.
bool span_elems(const StrideDim* d, int n, std::int64_t* out) {
  std::int64_t end = 1;
  for (int i = 0; i < n; ++i) {
    std::int64_t t;
    if (d[i].extent <= 0) continue;
    if (__builtin_mul_overflow(d[i].extent - 1, d[i].stride, &t)) return false;
    if (__builtin_add_overflow(end, t, &end)) return false;
  }
  *out = end;
  return true;
}

Status check_tensor(const char* name, const TensorView& t, const Extents& e, const BackendRules& br,
                    Span* span) {
  span->name = name;
  if (t.data == nullptr) return Status::Invalid(cat(name, ".data is null"));
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  const std::uintptr_t a = addr(t.data);
  if (a % elem != 0)
    return Status::Invalid(cat(name, ".data ", static_cast<const void*>(t.data), " is not aligned to its ",
                               elem, "-byte ", dtype_name(t.dtype), " elements"));
  if (br.cuda && a % kCudaVectorBytes != 0)
    return Status::Invalid(cat(name, ".data ", static_cast<const void*>(t.data),
                               " is not 16-byte aligned (the CUDA kernels use 16-byte vector loads)"));

  // The dims of the index map. Without varlen the batch dim has extent `batch`; with varlen it
  // does not exist (batch_stride is ignored) and the packed sequence dim is always in use,
  // because sequence b starts at cu_seqlens[b] * seq_stride.
  std::array<StrideDim, 4> dims;
  int n = 0;
  if (!e.varlen) dims[n++] = {"batch_stride", t.batch_stride, e.batch, false, false};
  dims[n++] = {"seq_stride", t.seq_stride, e.seq, false, e.varlen};
  dims[n++] = {"head_stride", t.head_stride, e.heads, false, false};
  const int n_strided = n;
  dims[n++] = {e.dim_name, 1, e.dim, true, false};

  for (int i = 0; i < n_strided; ++i)
    if (dims[i].stride < 0)
      return Status::Invalid(
          cat(name, ".", dims[i].name, " ", dims[i].stride, " is negative (strides must be >= 0)"));
  // A stride only matters when its index can be non-zero (PyTorch gives size-1 dims any stride).
  auto matters = [](const StrideDim& d) { return d.extent > 1 || d.always; };
  if (br.cuda)
    for (int i = 0; i < n_strided; ++i)
      if (matters(dims[i]) && dims[i].stride % kCudaVectorElems != 0)
        return Status::Invalid(cat(name, ".", dims[i].name, " ", dims[i].stride,
                                   " is not a multiple of 8 elements (the CUDA kernels use 16-byte "
                                   "vector loads)"));

  std::int64_t end = 0;
  if (!span_elems(dims.data(), n, &end)) {
    std::string strides;
    for (int i = 0; i < n_strided; ++i) strides += cat(i ? ", " : "", dims[i].name, " ", dims[i].stride);
    return Status::Invalid(cat(name, "'s largest element offset overflows int64 (", strides, ")"));
  }
  // Kernels address one sequence with 32-bit offsets from its start.
  const StrideDim in_seq[3] = {{"seq_stride", t.seq_stride, e.seq_max, false, false},
                               {"head_stride", t.head_stride, e.heads, false, false},
                               {e.dim_name, 1, e.dim, true, false}};
  std::int64_t seq_end = 0;  // (seq_max-1)*seq_stride + (heads-1)*head_stride + head_dim
  const bool seq_end_ok = span_elems(in_seq, 3, &seq_end);
  if (!seq_end_ok || seq_end > kInt32Max) {
    const std::string v = seq_end_ok ? cat(seq_end) : std::string("more than 2^63");
    return Status::Invalid(cat(name, "'s offset inside one sequence, (", e.seqlen_name, "-1)*seq_stride + (",
                               e.heads_name, "-1)*head_stride + ", e.dim_name, " = ", v,
                               ", does not fit in int32 (the kernels use 32-bit offsets inside a sequence)"));
  }
  std::int64_t bytes = 0;
  std::uintptr_t hi = 0;
  if (__builtin_mul_overflow(end, elem, &bytes) ||
      __builtin_add_overflow(a, static_cast<std::uintptr_t>(bytes), &hi))
    return Status::Invalid(cat(name, "'s byte span (", end, " elements from ",
                               static_cast<const void*>(t.data), ") wraps around the address space"));

  // Injectivity: sort the dims that matter by stride (head_dim first among equals); each must step
  // past everything the smaller strides reach, else two indices land on one element. The sum
  // cannot overflow: it is bounded by `end`, computed above. The test is sufficient, not
  // necessary: every slice or permutation of a dense tensor passes, but a few exotic layouts
  // whose dims interleave without colliding are rejected too (head_dim 64 with strides 128 and
  // 192 over extents 3 and 2).
  std::array<StrideDim, 4> used;
  int nu = 0;
  for (int i = 0; i < n; ++i)
    if (dims[i].is_dim || matters(dims[i])) used[nu++] = dims[i];
  auto before = [](const StrideDim& x, const StrideDim& y) {
    return x.stride != y.stride ? x.stride < y.stride : (x.is_dim && !y.is_dim);
  };
  for (int i = 1; i < nu; ++i)  // insertion sort of at most 4 dims
    for (int j = i; j > 0 && before(used[j], used[j - 1]); --j) std::swap(used[j], used[j - 1]);
  std::int64_t reach = 0;  // largest offset reachable with the dims seen so far
  for (int i = 0; i < nu; ++i) {
    if (used[i].stride <= reach)
      return Status::Invalid(cat(name, ".", used[i].name, " ", used[i].stride,
                                 " makes two (batch, seq, head, dim) indices share one element: it "
                                 "must be at least ",
                                 reach + 1, ", the elements spanned by the dims with smaller strides"));
    reach += (std::max<std::int64_t>(used[i].extent, 1) - 1) * used[i].stride;
  }
  span->lo = a;
  span->hi = hi;
  return Status::Ok();
}

/// Whether rotary.k_rotated is k itself (its keys rotated in place): the same data and the same
/// index map. A stride whose index is always 0 (an extent-1 dim, which PyTorch gives any stride)
/// does not take part; the packed varlen sequence dim always does, and batch_stride never does
/// with varlen (it is ignored).
bool same_index_map(const TensorView& a, const TensorView& b, const Extents& e) {
  auto same = [](std::int64_t x, std::int64_t y, std::int64_t extent) { return extent <= 1 || x == y; };
  return a.data == b.data && (e.varlen || same(a.batch_stride, b.batch_stride, e.batch)) &&
         (e.varlen ? a.seq_stride == b.seq_stride : same(a.seq_stride, b.seq_stride, e.seq)) &&
         same(a.head_stride, b.head_stride, e.heads);
}

// ---- 6. block-sparse arrays --------------------------------------------------------------

Status check_block_sparse_arrays(const BlockSparseMask& bs, const BackendRules& br) {
  const std::array<std::pair<const char*, const std::int32_t*>, 3> arrays = {
      {{"row_ptr", bs.row_ptr}, {"col_idx", bs.col_idx}, {"partial", bs.partial}}};
  for (const auto& [nm, ptr] : arrays) {
    if (ptr == nullptr) return Status::Invalid(cat("block_sparse.", nm, " is null"));
    if (addr(ptr) % alignof(std::int32_t) != 0)
      return Status::Invalid(
          cat("block_sparse.", nm, " ", static_cast<const void*>(ptr), " is not 4-byte aligned (int32)"));
  }
  if (bs.element_masks == nullptr && bs.num_partial > 0)
    return Status::Invalid(cat("block_sparse.element_masks is null but num_partial is ", bs.num_partial,
                               " (it may be null only when num_partial == 0)"));
  if (addr(bs.element_masks) % alignof(std::uint64_t) != 0)
    return Status::Invalid(cat("block_sparse.element_masks ", static_cast<const void*>(bs.element_masks),
                               " is not 8-byte aligned (uint64)"));
  // Fits int64: checked with the scalars.
  const std::int64_t rows = static_cast<std::int64_t>(bs.num_batch) * bs.num_heads * bs.num_q_blocks;
  // Device arrays cannot be read here; the kernels clamp block indices to the grid.
  if (!br.reads_host_arrays) return Status::Ok();
  if (bs.row_ptr[0] != 0)
    return Status::Invalid(cat("block_sparse.row_ptr[0] is ", bs.row_ptr[0], " (must be 0)"));
  for (std::int64_t r = 0; r < rows; ++r)
    if (bs.row_ptr[r + 1] < bs.row_ptr[r])
      return Status::Invalid(cat("block_sparse.row_ptr[", r + 1, "] ", bs.row_ptr[r + 1],
                                 " is less than row_ptr[", r, "] ", bs.row_ptr[r],
                                 " (must be non-decreasing)"));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = bs.row_ptr[r]; i < bs.row_ptr[r + 1]; ++i) {
      const std::int32_t c = bs.col_idx[i];
      if (c < 0 || c >= bs.num_k_blocks)
        return Status::Invalid(
            cat("block_sparse.col_idx[", i, "] ", c, " is outside [0, num_k_blocks ", bs.num_k_blocks, ")"));
      if (i > bs.row_ptr[r] && c <= bs.col_idx[i - 1])
        return Status::Invalid(cat("block_sparse.col_idx[", i, "] ", c, " is not greater than col_idx[",
                                   i - 1, "] ", bs.col_idx[i - 1],
                                   " (must be strictly ascending within a row)"));
      const std::int32_t pm = bs.partial[i];
      if (pm < -1 || pm >= bs.num_partial)
        return Status::Invalid(
            cat("block_sparse.partial[", i, "] ", pm, " is outside [-1, num_partial ", bs.num_partial, ")"));
    }
  }
  return Status::Ok();
}

}  // namespace

/// The rotary fused into attention: the spec (rope_checks.h, as for apply_rotary and decode),
/// the arrays' alignment and k_rotated's dtype (the view itself is checked with the tensors,
/// after the empty-problem return). The position values are checked where they are read (the
/// CPU backends, against the tables).
Status check_rotary(const AttnParams& p, const BackendRules& br) {
  const AttnRotary& r = p.rotary;
  const RotarySpec& spec = r.spec;
  FLASHCPP_RETURN_IF_ERROR(detail::check_rotary_spec("rotary.spec.", p.head_dim, spec));
  if (r.k_rotated.data && r.k_rotated.dtype != p.k.dtype)
    return Status::Invalid(cat("rotary.k_rotated.dtype ", dtype_name(r.k_rotated.dtype), " differs from k.dtype ",
                               dtype_name(p.k.dtype), " (the rotated keys are stored in k's dtype)"));
  for (auto [name, ptr] : {std::pair{"rotary.positions_q", r.positions_q}, std::pair{"rotary.positions_k", r.positions_k}})
    if (ptr && addr(ptr) % alignof(std::int32_t) != 0)
      return Status::Invalid(cat(name, " ", static_cast<const void*>(ptr), " is not 4-byte aligned (int32)"));
  // The CUDA kernels rotate 8-byte pieces in shared memory (src/cuda/prefill/prefill_rope.h).
  const int chunk = spec.style == RopeStyle::kNeox ? 8 : 4;
  if (br.cuda && spec.effective_rotary_dim(p.head_dim) % chunk != 0)
    return Status::Unsupported(cat("rotary.spec.rotary_dim ", spec.rotary_dim, " is not a multiple of ", chunk,
                                   ", which the CUDA kernels need for ", rope_style_name(spec.style),
                                   " rotary (they rotate 8-byte pieces): rotate q and k with "
                                   "flashcpp::apply_rotary (fused.h) first, or use the CPU backend"));
  return Status::Ok();
}

Status validate(const AttnParams& p, Backend backend) {
  BackendRules br;
  if (!backend_rules(backend, &br))
    return Status::Invalid(cat("backend ", static_cast<int>(backend), " is not a known backend"));

  // 1. Scalars. Nothing below reads a pointer until the empty-problem return.
  FLASHCPP_RETURN_IF_ERROR(check_shape(p));
  FLASHCPP_RETURN_IF_ERROR(check_dtypes(p, br));
  // Every supported pair of head dims runs on CUDA too: the prefill kernels pad to their class
  // inside (attention.h, cuda_head_dim_class).
  FLASHCPP_RETURN_IF_ERROR(check_mask_scalars(p));
  if (p.mask.block_sparse) FLASHCPP_RETURN_IF_ERROR(check_block_sparse_scalars(p));
  if (p.rotary.enabled()) FLASHCPP_RETURN_IF_ERROR(check_rotary(p, br));
  const bool varlen = p.mask.is_varlen();
  // An empty problem writes nothing, so needs no pointers; varlen with total_q fills the packed
  // rows (O = 0, LSE = -inf) and reads nothing: only o and lse are checked below.
  const bool fill_only = is_empty_problem(p);
  if (fill_only && !(varlen && p.mask.total_q > 0)) return Status::Ok();

  // 2. Varlen: the packed row counts. On the device they are unknown and the maximum lengths
  // stand in (the kernels clamp every sequence to them), or mask.total_q for q when given.
  std::int64_t rows_q = p.seqlen_q, rows_k = p.seqlen_k;
  if (varlen) {
    FLASHCPP_RETURN_IF_ERROR(
        check_cu_seqlens("q", p.mask.cu_seqlens_q, p.batch, p.seqlen_q, "seqlen_q", br, &rows_q));
    if (!fill_only)
      FLASHCPP_RETURN_IF_ERROR(
          check_cu_seqlens("k", p.mask.cu_seqlens_k, p.batch, p.seqlen_k, "seqlen_k", br, &rows_k));
    if (p.mask.total_q > 0) {
      if (br.reads_host_arrays && p.mask.total_q < rows_q)
        return Status::Invalid(cat("mask.total_q ", p.mask.total_q, " is less than cu_seqlens_q[batch] ", rows_q,
                                   " (it counts every packed row of q and o)"));
      rows_q = p.mask.total_q;
    }
  }

  // 3. Tensors. With seqlen_k == 0 every row sees no key: k and v are never read (may be null).
  const Extents eq{p.batch, rows_q, p.seqlen_q, p.heads_q, p.head_dim, varlen, "seqlen_q", "heads_q"};
  const Extents ek{p.batch, rows_k, p.seqlen_k, p.heads_kv, p.head_dim, varlen, "seqlen_k", "heads_kv"};
  Extents eo = eq, ev = ek;  // v and o: head_dim_v
  eo.dim = ev.dim = p.effective_head_dim_v();
  eo.dim_name = ev.dim_name = "head_dim_v";
  Span sq, sk, sv, so, slse;
  if (!fill_only) FLASHCPP_RETURN_IF_ERROR(check_tensor("q", p.q, eq, br, &sq));
  if (!fill_only && p.seqlen_k > 0) {
    FLASHCPP_RETURN_IF_ERROR(check_tensor("k", p.k, ek, br, &sk));
    FLASHCPP_RETURN_IF_ERROR(check_tensor("v", p.v, ev, br, &sv));
  }
  FLASHCPP_RETURN_IF_ERROR(check_tensor("o", p.o, eo, br, &so));
  // Rotary: where the rotated keys go. The CUDA kernels read their keys from it (a pre-pass
  // rotates k into it once), so CUDA needs it; the CPU backends fill it when it is given. k
  // itself (same data and index map) rotates k in place: its span is then k's, checked as k.
  Span skr;
  skr.name = "rotary.k_rotated";
  if (!fill_only && p.rotary.enabled() && p.seqlen_k > 0) {
    const TensorView& kr = p.rotary.k_rotated;
    if (kr.data == nullptr) {
      if (br.cuda)
        return Status::Unsupported(
            "rotary on CUDA needs rotary.k_rotated: a buffer shaped like k where the keys are rotated once "
            "before the kernel reads them (pass k itself to rotate in place)");
    } else {
      FLASHCPP_RETURN_IF_ERROR(check_tensor("rotary.k_rotated", kr, ek, br, &skr));
      if (same_index_map(kr, p.k, ek)) {
        // In place, q or v starting on k's first element would be rotated under the kernel's feet
        // (the CUDA pre-pass writes k before the kernel reads q and v).
        for (const auto& [name, t] : {std::pair{"q", &p.q}, std::pair{"v", &p.v}})
          if (t->data == kr.data)
            return Status::Invalid(cat("rotary.k_rotated is k (rotated in place), but ", name,
                                       " starts at k's first element ", static_cast<const void*>(kr.data), ": ",
                                       name, " would be read rotated (pass a separate rotary.k_rotated)"));
        skr.lo = skr.hi = 0;  // k's span: o and lse are checked against k below
      }
    }
  }

  // 4. lse: contiguous fp32 (batch, heads_q, seqlen_q), or (heads_q, total_q) when varlen. Its
  // per-head extent (seqlen_q, mask.total_q or the int32 cu_seqlens_q[batch]) fits int32.
  slse.name = "lse";
  if (p.lse) {
    if (addr(p.lse) % alignof(float) != 0)
      return Status::Invalid(cat("lse ", static_cast<const void*>(p.lse), " is not 4-byte aligned (fp32)"));
    // No overflow: int32 * int32 with varlen, checked with the scalars otherwise.
    const std::int64_t count = static_cast<std::int64_t>(p.heads_q) * rows_q * (varlen ? 1 : p.batch);
    std::int64_t bytes = 0;
    std::uintptr_t hi = 0;
    if (__builtin_mul_overflow(count, static_cast<std::int64_t>(sizeof(float)), &bytes) ||
        __builtin_add_overflow(addr(p.lse), static_cast<std::uintptr_t>(bytes), &hi))
      return Status::Invalid(cat("lse's byte span (", count, " fp32 from ", static_cast<const void*>(p.lse),
                                 ") wraps around the address space"));
    slse.lo = addr(p.lse);
    slse.hi = hi;
  }
  if (p.mask.alibi_slopes && addr(p.mask.alibi_slopes) % alignof(float) != 0)
    return Status::Invalid(cat("mask.alibi_slopes ", static_cast<const void*>(p.mask.alibi_slopes),
                               " is not 4-byte aligned (fp32)"));

  // 5. Aliasing: outputs (o, lse, and rotary.k_rotated unless it is k) must not overlap what the
  // kernel reads, nor each other. Inputs may alias each other (one packed qkv buffer). Spans are
  // conservative: an output interleaved with an input (disjoint elements inside overlapping
  // ranges) is rejected too.
  const std::array<const Span*, 3> outs = {&so, &slse, &skr};
  for (std::size_t i = 0; i < outs.size(); ++i)
    for (const Span* other : {&sq, &sk, &sv, &so, &slse, &skr}) {
      const Span* out = outs[i];
      // Each pair of outputs once: the earlier output's pass checked it.
      if (other == out || std::find(outs.begin(), outs.begin() + i, other) != outs.begin() + i) continue;
      if (out->overlaps(*other))
        return Status::Invalid(
            cat(out->name, " overlaps ", other->name, ": bytes [", reinterpret_cast<const void*>(out->lo),
                ", ", reinterpret_cast<const void*>(out->hi), ") meet [",
                reinterpret_cast<const void*>(other->lo), ", ", reinterpret_cast<const void*>(other->hi),
                out == &skr && other == &sk
                    ? ") (rotary.k_rotated must be k itself, with k's data and strides, or not overlap it)"
                    : ") (outputs must not alias the inputs or each other)"));
    }

  // 6. Block-sparse arrays.
  if (p.mask.block_sparse) FLASHCPP_RETURN_IF_ERROR(check_block_sparse_arrays(*p.mask.block_sparse, br));
  return Status::Ok();
}

Status detail::check_attention_view(const char* name, const TensorView& t, const ViewExtents& e, Backend backend,
                                    Span* span) {
  BackendRules br;
  if (!backend_rules(backend, &br))
    return Status::Invalid(cat("backend ", static_cast<int>(backend), " is not a known backend"));
  return check_tensor(name, t, e, br, span);
}

}  // namespace flashcpp
