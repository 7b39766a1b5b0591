// Validation of the fused kernels (RMSNorm +- residual, SwiGLU, rotary): everything that can be
// checked on the host without touching tensor memory, one sentence per failure that names the
// field and its value. The entry points that route a problem to the CPU backend or to a CUDA
// kernel are in fused_api.cc.
//
// Order of the checks (the first failure is reported):
//   1. backend; scalars (sizes, eps, theta, scaling, rotary dims); an empty problem (no rows,
//      no columns, no tokens) writes nothing and is accepted without looking at pointers;
//   2. each tensor: null, element alignment, non-negative strides, strides that keep distinct
//      indices on distinct elements, a byte span that does not wrap; one shared dtype (fp16 or
//      bf16 on CUDA, fp32 too on the CPU backend);
//   3. aliasing: an output may be exactly one of its inputs (same pointer and strides: the
//      in-place forms), anything else that overlaps an output is refused;
//   4. host-memory values (CPU backend only): rotary positions inside the cos/sin tables.
//
// Vector alignment is not a validation rule: the CUDA launchers pick 16-byte accesses when every
// pointer and stride allows them and element-wise accesses otherwise (fused.h).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>

#include "core/kv_cache_checks.h"
#include "core/message.h"
#include "core/rope_checks.h"
#include "flashcpp/fused.h"

namespace flashcpp {

namespace {

// ---- one-sentence messages (src/core/message.h) ----------------------------------------

using detail::cat;
using detail::check_rotary_spec;
using detail::rotary_table_elems;

constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
constexpr int kMaxHeadDim = 1024;  // rotary: the per-token cos/sin table lives in shared memory

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

bool known_dtype(DType t) { return t == DType::kF16 || t == DType::kBF16 || t == DType::kF32; }

/// cuda: the backend runs CUDA kernels (no fp32). Fails for an unknown backend value.
Status check_backend(Backend b, bool* cuda) {
  switch (b) {
    case Backend::kAuto:
    case Backend::kCpu:
    case Backend::kCpuReference: *cuda = false; return Status::Ok();
    case Backend::kCuda: *cuda = true; return Status::Ok();
  }
  return Status::Invalid(cat("backend ", static_cast<int>(b), " is not a known backend"));
}

Status check_dtype(const char* name, DType t, DType want, const char* want_name, const char* op, bool cuda) {
  if (!known_dtype(t))
    return Status::Invalid(cat(name, ".dtype ", static_cast<int>(t), " is not a known dtype (fp16, bf16 or fp32)"));
  if (t != want)
    return Status::Invalid(cat(name, ".dtype ", dtype_name(t), " differs from ", want_name, ".dtype ", dtype_name(want),
                               " (the tensors of ", op, " share one dtype)"));
  if (cuda && t == DType::kF32)
    return Status::Unsupported(
        cat("fp32 ", op, " runs on the CPU backend only (the CUDA kernels take fp16 or bf16)"));
  return Status::Ok();
}

// ---- byte spans and aliasing -------------------------------------------------------------

using detail::Span;

Status overlap_error(const Span& out, const Span& other) {
  return Status::Invalid(cat(out.name, " overlaps ", other.name, ": bytes [", reinterpret_cast<const void*>(out.lo), ", ",
                             reinterpret_cast<const void*>(out.hi), ") meet [", reinterpret_cast<const void*>(other.lo),
                             ", ", reinterpret_cast<const void*>(other.hi),
                             ") (an output may only be exactly its input, for the in-place form)"));
}

Status span_of(const char* name, const void* data, std::int64_t elems, std::int64_t elem_bytes, Span* span) {
  std::int64_t bytes = 0;
  std::uintptr_t hi = 0;
  if (__builtin_mul_overflow(elems, elem_bytes, &bytes) ||
      __builtin_add_overflow(addr(data), static_cast<std::uintptr_t>(bytes), &hi))
    return Status::Invalid(cat(name, "'s byte span (", elems, " elements from ", data, ") wraps around the address space"));
  span->name = name;
  span->lo = addr(data);
  span->hi = hi;
  return Status::Ok();
}

Status check_pointer(const char* name, const void* data, std::int64_t elem_bytes, const char* what) {
  if (data == nullptr) return Status::Invalid(cat(name, " is null"));
  if (addr(data) % static_cast<std::uintptr_t>(elem_bytes) != 0)
    return Status::Invalid(cat(name, " ", data, " is not aligned to its ", elem_bytes, "-byte ", what, " elements"));
  return Status::Ok();
}

// ---- matrices (norms, SwiGLU) ------------------------------------------------------------

/// A (rows, cols) matrix view: pointer, alignment, row stride, byte span.
Status check_matrix(const char* name, const MatrixView& m, std::int64_t rows, std::int64_t cols,
                    const char* cols_name, Span* span) {
  const std::string data_name = cat(name, ".data");
  FLASHCPP_RETURN_IF_ERROR(check_pointer(data_name.c_str(), m.data, dtype_size(m.dtype), dtype_name(m.dtype)));
  if (m.row_stride < 0)
    return Status::Invalid(cat(name, ".row_stride ", m.row_stride, " is negative (must be >= 0)"));
  if (rows > 1 && m.row_stride < cols)
    return Status::Invalid(cat(name, ".row_stride ", m.row_stride, " is less than ", cols_name, " ", cols,
                               " (consecutive rows would share elements)"));
  std::int64_t end = 0;  // (rows-1)*row_stride + cols
  if (__builtin_mul_overflow(rows - 1, m.row_stride, &end) || __builtin_add_overflow(end, cols, &end))
    return Status::Invalid(cat(name, "'s extent (rows-1)*row_stride + ", cols_name, " = (", rows, "-1)*", m.row_stride,
                               " + ", cols, " overflows int64"));
  return span_of(name, m.data, end, static_cast<std::int64_t>(dtype_size(m.dtype)), span);
}

bool same_matrix(const MatrixView& a, const MatrixView& b, std::int64_t rows) {
  return a.data == b.data && a.dtype == b.dtype && (rows <= 1 || a.row_stride == b.row_stride);
}

Status check_rows_cols(const char* rows_name, std::int64_t rows, const char* cols_name, std::int64_t cols) {
  if (rows < 0) return Status::Invalid(cat(rows_name, " ", rows, " is negative (must be >= 0)"));
  if (cols < 0) return Status::Invalid(cat(cols_name, " ", cols, " is negative (must be >= 0)"));
  if (rows > kInt32Max)
    return Status::Invalid(cat(rows_name, " ", rows, " is more than 2^31-1"));
  if (cols > kInt32Max) return Status::Invalid(cat(cols_name, " ", cols, " is more than 2^31-1"));
  return Status::Ok();
}

// ---- strided (batch, seq, heads, dim) views (rotary) ------------------------------------

struct Dim {
  const char* name;
  std::int64_t stride, extent;
};

/// Null, alignment, strides and span of a (batch, seqlen, heads, dim) view with unit dim stride.
/// Injectivity: sorted by stride, each used dim must step past everything the smaller ones
/// reach (sufficient: every slice or permutation of a dense tensor passes).
Status check_view(const char* name, const TensorView& t, std::int64_t batch, std::int64_t seqlen, std::int64_t heads,
                  std::int64_t dim, Span* span) {
  const std::string data_name = cat(name, ".data");
  FLASHCPP_RETURN_IF_ERROR(check_pointer(data_name.c_str(), t.data, dtype_size(t.dtype), dtype_name(t.dtype)));
  // head_dim first: among equal strides the outer dim is the one reported.
  std::array<Dim, 4> dims = {{{"head_dim", 1, dim},
                              {"batch_stride", t.batch_stride, batch},
                              {"seq_stride", t.seq_stride, seqlen},
                              {"head_stride", t.head_stride, heads}}};
  std::int64_t end = 1;  // largest reachable offset + 1
  for (const Dim& d : dims) {
    if (d.extent <= 1) continue;
    if (d.stride < 0) return Status::Invalid(cat(name, ".", d.name, " ", d.stride, " is negative (must be >= 0)"));
    std::int64_t step = 0;
    if (__builtin_mul_overflow(d.extent - 1, d.stride, &step) || __builtin_add_overflow(end, step, &end))
      return Status::Invalid(cat(name, "'s extent overflows int64 (", d.name, " ", d.stride, " over ", d.extent, ")"));
  }
  std::array<Dim, 4> used;
  int n = 0;
  for (const Dim& d : dims)
    if (d.extent > 1) used[n++] = d;
  std::stable_sort(used.begin(), used.begin() + n, [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  std::int64_t reach = 0;
  for (int i = 0; i < n; ++i) {
    if (used[i].stride <= reach)
      return Status::Invalid(cat(name, ".", used[i].name, " ", used[i].stride,
                                 " makes two (batch, seq, head, dim) indices share one element: it must be at least ",
                                 reach + 1, ", the elements spanned by the dims with smaller strides"));
    reach += (used[i].extent - 1) * used[i].stride;
  }
  return span_of(name, t.data, end, static_cast<std::int64_t>(dtype_size(t.dtype)), span);
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.batch_stride == b.batch_stride &&
         a.seq_stride == b.seq_stride && a.head_stride == b.head_stride;
}

/// Whether two strided regions whose byte spans overlap still touch disjoint elements because
/// they interleave row by row (the gate and up halves of a fused projection, q and k of a packed
/// qkv buffer). Both step by the same `step` elements; each step's footprint is [0, ext_a) and
/// [0, ext_b) from its base. Disjoint when, modulo step, b's footprint starts after a's ends and
/// ends before the next row's begins. Sufficient, not necessary.
bool interleaved_disjoint(const void* a, std::int64_t ext_a, const void* b, std::int64_t ext_b, std::int64_t step,
                          std::int64_t elem) {
  if (step <= 0 || ext_a > step || ext_b > step) return false;
  const std::int64_t delta_bytes = static_cast<std::int64_t>(addr(b) - addr(a));
  if (delta_bytes % elem != 0) return false;
  std::int64_t r = (delta_bytes / elem) % step;  // in (-step, step)
  if (r < 0) r += step;
  return ext_a <= r && ext_b <= step - r;  // (r + ext_b <= step without its overflow near 2^63)
}

/// Row-interleaved matrices: same row stride, each row's columns inside it.
bool matrices_disjoint(const MatrixView& a, const MatrixView& b, std::int64_t cols) {
  return a.dtype == b.dtype && a.row_stride == b.row_stride &&
         (interleaved_disjoint(a.data, cols, b.data, cols, a.row_stride, dtype_size(a.dtype)) ||
          interleaved_disjoint(b.data, cols, a.data, cols, a.row_stride, dtype_size(a.dtype)));
}

/// Token-interleaved views: both step tokens by one seq_stride s (and batches by seqlen * s), and
/// each token's heads fit inside s.
bool views_disjoint(const TensorView& a, int heads_a, const TensorView& b, int heads_b, std::int64_t batch,
                    std::int64_t seqlen, std::int64_t dim) {
  if (a.dtype != b.dtype) return false;
  const std::int64_t s = a.seq_stride;
  if (s <= 0 || b.seq_stride != s) return false;
  // In 128 bits: the views passed their own checks, but these products of their strides are not
  // bounded there (fuzz_fused_validate found a sum past 2^63).
  using i128 = __int128;
  if (batch > 1 && (a.batch_stride != i128{seqlen} * s || b.batch_stride != i128{seqlen} * s)) return false;
  const i128 wide_a = i128{heads_a - 1} * a.head_stride + dim, wide_b = i128{heads_b - 1} * b.head_stride + dim;
  if (wide_a > s || wide_b > s) return false;  // interleaved_disjoint would say so too
  const std::int64_t ext_a = static_cast<std::int64_t>(wide_a), ext_b = static_cast<std::int64_t>(wide_b);
  const auto elem = static_cast<std::int64_t>(dtype_size(a.dtype));
  return interleaved_disjoint(a.data, ext_a, b.data, ext_b, s, elem) ||
         interleaved_disjoint(b.data, ext_b, a.data, ext_a, s, elem);
}

// ---- RMSNorm -----------------------------------------------------------------------------

Status validate_norm(const RmsNormParams& p, bool with_residual, Backend backend) {
  bool cuda = false;
  FLASHCPP_RETURN_IF_ERROR(check_backend(backend, &cuda));
  FLASHCPP_RETURN_IF_ERROR(check_rows_cols("rows", p.rows, "hidden", p.hidden));
  if (!std::isfinite(p.eps) || p.eps < 0.f)
    return Status::Invalid(cat("eps ", static_cast<double>(p.eps), " must be finite and >= 0"));
  const char* op = with_residual ? "fused_add_rms_norm" : "rms_norm";
  if (!with_residual && (p.residual.data || p.residual_out.data))
    return Status::Invalid(cat(p.residual.data ? "residual" : "residual_out",
                               ".data is set, but rms_norm has no residual (call fused_add_rms_norm)"));
  if (p.rows == 0 || p.hidden == 0) return Status::Ok();  // writes nothing

  Span sx, sr, sro, sw, sy;
  FLASHCPP_RETURN_IF_ERROR(check_dtype("x", p.x.dtype, p.x.dtype, "x", op, cuda));
  FLASHCPP_RETURN_IF_ERROR(check_matrix("x", p.x, p.rows, p.hidden, "hidden", &sx));
  FLASHCPP_RETURN_IF_ERROR(check_dtype("y", p.y.dtype, p.x.dtype, "x", op, cuda));
  FLASHCPP_RETURN_IF_ERROR(check_matrix("y", p.y, p.rows, p.hidden, "hidden", &sy));
  FLASHCPP_RETURN_IF_ERROR(check_pointer("weight", p.weight, dtype_size(p.x.dtype), dtype_name(p.x.dtype)));
  FLASHCPP_RETURN_IF_ERROR(span_of("weight", p.weight, p.hidden, dtype_size(p.x.dtype), &sw));
  if (with_residual) {
    FLASHCPP_RETURN_IF_ERROR(check_dtype("residual", p.residual.dtype, p.x.dtype, "x", op, cuda));
    FLASHCPP_RETURN_IF_ERROR(check_matrix("residual", p.residual, p.rows, p.hidden, "hidden", &sr));
    FLASHCPP_RETURN_IF_ERROR(check_dtype("residual_out", p.residual_out.dtype, p.x.dtype, "x", op, cuda));
    FLASHCPP_RETURN_IF_ERROR(check_matrix("residual_out", p.residual_out, p.rows, p.hidden, "hidden", &sro));
  }
  // Outputs vs inputs: exactly equal is the in-place form (each element is read before it is
  // written, by the same thread); any other overlap is refused. The outputs never meet each
  // other, and nothing may write the weight, which every row reads.
  struct In {
    const Span* span;
    const MatrixView* view;
  };
  const In inputs[] = {{&sx, &p.x}, {&sr, &p.residual}, {&sw, nullptr}};
  const In outputs[] = {{&sy, &p.y}, {&sro, &p.residual_out}};
  for (const In& o : outputs)
    for (const In& i : inputs)
      if (o.span->overlaps(*i.span) && !(i.view && (same_matrix(*o.view, *i.view, p.rows) ||
                                                    matrices_disjoint(*o.view, *i.view, p.hidden))))
        return overlap_error(*o.span, *i.span);
  if (sy.overlaps(sro) && !matrices_disjoint(p.y, p.residual_out, p.hidden)) return overlap_error(sy, sro);
  return Status::Ok();
}

// ---- SwiGLU ------------------------------------------------------------------------------

Status validate_silu(const SiluMulParams& p, Backend backend) {
  bool cuda = false;
  FLASHCPP_RETURN_IF_ERROR(check_backend(backend, &cuda));
  FLASHCPP_RETURN_IF_ERROR(check_rows_cols("rows", p.rows, "d", p.d));
  if (p.rows == 0 || p.d == 0) return Status::Ok();
  Span sg, su, so;
  FLASHCPP_RETURN_IF_ERROR(check_dtype("gate", p.gate.dtype, p.gate.dtype, "gate", "silu_and_mul", cuda));
  FLASHCPP_RETURN_IF_ERROR(check_matrix("gate", p.gate, p.rows, p.d, "d", &sg));
  FLASHCPP_RETURN_IF_ERROR(check_dtype("up", p.up.dtype, p.gate.dtype, "gate", "silu_and_mul", cuda));
  FLASHCPP_RETURN_IF_ERROR(check_matrix("up", p.up, p.rows, p.d, "d", &su));
  FLASHCPP_RETURN_IF_ERROR(check_dtype("out", p.out.dtype, p.gate.dtype, "gate", "silu_and_mul", cuda));
  FLASHCPP_RETURN_IF_ERROR(check_matrix("out", p.out, p.rows, p.d, "d", &so));
  // out may be exactly gate or up, or interleave with them row by row (in place into one half
  // of a fused [gate | up] buffer): the other half is then untouched.
  if (so.overlaps(sg) && !same_matrix(p.out, p.gate, p.rows) && !matrices_disjoint(p.out, p.gate, p.d))
    return overlap_error(so, sg);
  if (so.overlaps(su) && !same_matrix(p.out, p.up, p.rows) && !matrices_disjoint(p.out, p.up, p.d))
    return overlap_error(so, su);
  return Status::Ok();
}

// ---- rotary ------------------------------------------------------------------------------

/// The (batch, seqlen, heads, head_dim) tensors of a q/k op (apply_rotary, qk_norm_rope): q (when
/// heads_q > 0) and k (when heads_k > 0) with their optional outputs, positions and the rotary
/// tables; aliasing among them. Spans of the outputs come back in *q_out_span / *k_out_span.
struct QkTensors {
  int batch = 0, seqlen = 0, heads_q = 0, heads_k = 0, head_dim = 0;
  TensorView q, k, q_out, k_out;
  const std::int32_t* positions = nullptr;
  RotarySpec rotary;
};

Status check_qk_tensors(const char* op, const QkTensors& p, bool cuda, Span* q_out_span, Span* k_out_span) {
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  const RotarySpec& r = p.rotary;
  const bool has_k = p.heads_k > 0;
  const TensorView q_out = p.q_out.data ? p.q_out : p.q;
  const TensorView k_out = p.k_out.data ? p.k_out : p.k;
  Span sq, sk, sqo, sko, spos, scos, ssin;
  FLASHCPP_RETURN_IF_ERROR(check_dtype("q", p.q.dtype, p.q.dtype, "q", op, cuda));
  FLASHCPP_RETURN_IF_ERROR(check_view("q", p.q, p.batch, p.seqlen, p.heads_q, p.head_dim, &sq));
  if (p.q_out.data) {
    FLASHCPP_RETURN_IF_ERROR(check_dtype("q_out", p.q_out.dtype, p.q.dtype, "q", op, cuda));
    FLASHCPP_RETURN_IF_ERROR(check_view("q_out", p.q_out, p.batch, p.seqlen, p.heads_q, p.head_dim, &sqo));
  } else {
    sqo = sq;
    sqo.name = "q (rotated in place)";
  }
  if (has_k) {
    FLASHCPP_RETURN_IF_ERROR(check_dtype("k", p.k.dtype, p.q.dtype, "q", op, cuda));
    FLASHCPP_RETURN_IF_ERROR(check_view("k", p.k, p.batch, p.seqlen, p.heads_k, p.head_dim, &sk));
    if (p.k_out.data) {
      FLASHCPP_RETURN_IF_ERROR(check_dtype("k_out", p.k_out.dtype, p.q.dtype, "q", op, cuda));
      FLASHCPP_RETURN_IF_ERROR(check_view("k_out", p.k_out, p.batch, p.seqlen, p.heads_k, p.head_dim, &sko));
    } else {
      sko = sk;
      sko.name = "k (rotated in place)";
    }
  } else if (p.k_out.data) {
    return Status::Invalid("k_out.data is set but heads_k is 0 (no k to rotate)");
  }
  if (p.positions) FLASHCPP_RETURN_IF_ERROR(span_of("positions", p.positions, tokens, 4, &spos));
  if (r.has_tables()) {  // each table's rows, from its pointer (one cos_sin_cache: two interleaved spans)
    const std::int64_t n = rotary_table_elems(r, p.head_dim);
    FLASHCPP_RETURN_IF_ERROR(span_of("rotary.cos", r.cos, n, 4, &scos));
    FLASHCPP_RETURN_IF_ERROR(span_of("rotary.sin", r.sin, n, 4, &ssin));
  }

  // Aliasing. Each output may be exactly its own input. q's and k's outputs are written by
  // different threads, so they must be element-disjoint from each other and from the other
  // input; a packed qkv buffer (q and k interleaved token by token) is recognized as disjoint.
  auto disjoint = [&](const Span& a, const TensorView& va, int ha, const Span& b, const TensorView& vb, int hb) {
    return !a.overlaps(b) || views_disjoint(va, ha, vb, hb, p.batch, p.seqlen, p.head_dim);
  };
  if (p.q_out.data && sqo.overlaps(sq) && !same_view(p.q_out, p.q)) return overlap_error(sqo, sq);
  if (has_k) {
    if (p.k_out.data && sko.overlaps(sk) && !same_view(p.k_out, p.k)) return overlap_error(sko, sk);
    if (!disjoint(sqo, q_out, p.heads_q, sk, p.k, p.heads_k)) return overlap_error(sqo, sk);
    if (!disjoint(sko, k_out, p.heads_k, sq, p.q, p.heads_q)) return overlap_error(sko, sq);
    if (!disjoint(sqo, q_out, p.heads_q, sko, k_out, p.heads_k)) return overlap_error(sqo, sko);
  }
  for (const Span* out : {&sqo, &sko})
    for (const Span* arr : {&spos, &scos, &ssin})
      if (out->overlaps(*arr)) return overlap_error(*out, *arr);
  *q_out_span = sqo;
  *k_out_span = sko;
  return Status::Ok();
}


/// The (batch, seqlen) grid of the token-wise ops: non-negative, at most 2^31-1 tokens.
Status check_tokens(int batch, int seqlen) {
  if (batch < 0) return Status::Invalid(cat("batch ", batch, " is negative (must be >= 0)"));
  if (seqlen < 0) return Status::Invalid(cat("seqlen ", seqlen, " is negative (must be >= 0)"));
  if (static_cast<std::int64_t>(batch) * seqlen > kInt32Max)
    return Status::Invalid(cat("batch*seqlen = ", batch, "*", seqlen, " tokens is more than 2^31-1"));
  return Status::Ok();
}

Status validate_rotary(const RopeParams& p, Backend backend) {
  bool cuda = false;
  FLASHCPP_RETURN_IF_ERROR(check_backend(backend, &cuda));
  FLASHCPP_RETURN_IF_ERROR(check_tokens(p.batch, p.seqlen));
  if (p.heads_q < 1) return Status::Invalid(cat("heads_q ", p.heads_q, " must be >= 1"));
  if (p.heads_k < 0) return Status::Invalid(cat("heads_k ", p.heads_k, " is negative (must be >= 0; 0 = no k)"));
  if (p.head_dim < 2 || p.head_dim % 2 != 0 || p.head_dim > kMaxHeadDim)
    return Status::Invalid(cat("head_dim ", p.head_dim, " must be even and in [2, ", kMaxHeadDim, "]"));
  const RotarySpec& r = p.rotary;
  if (r.style == RopeStyle::kNone)
    return Status::Invalid("rotary.style is none: apply_rotary rotates neox or interleaved pairs (set rotary.style)");
  FLASHCPP_RETURN_IF_ERROR(check_rotary_spec("rotary.", p.head_dim, r));
  if (p.positions && addr(p.positions) % alignof(std::int32_t) != 0)
    return Status::Invalid(cat("positions ", static_cast<const void*>(p.positions), " is not 4-byte aligned (int32)"));
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  if (tokens == 0) return Status::Ok();

  QkTensors t;
  t.batch = p.batch, t.seqlen = p.seqlen, t.heads_q = p.heads_q, t.heads_k = p.heads_k, t.head_dim = p.head_dim;
  t.q = p.q, t.k = p.k, t.q_out = p.q_out, t.k_out = p.k_out;
  t.positions = p.positions;
  t.rotary = r;
  Span sqo, sko;
  return check_qk_tensors("apply_rotary", t, cuda, &sqo, &sko);
}

/// Host-memory checks of the CPU backend: positions must index the tables.
Status check_positions_host(const RopeParams& p) {
  if (!p.rotary.has_tables()) return Status::Ok();
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  if (p.positions == nullptr) {
    // Positions 0 .. seqlen - 1 in every sequence: the first one past the tables is token
    // max(max_position, 0) of sequence 0. (Looping over the tokens, as for an array, took seconds
    // for a problem with billions of them: found by fuzz_fused_validate.)
    if (tokens <= 0 || p.seqlen <= p.rotary.max_position) return Status::Ok();
    const std::int64_t t = std::max(p.rotary.max_position, 0);
    return Status::Invalid(cat("position ", t, " of token ", t, " is outside the cos/sin tables' rows [0, max_position ",
                               p.rotary.max_position, ")"));
  }
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t pos = p.positions[t];
    if (pos < 0 || pos >= p.rotary.max_position)
      return Status::Invalid(cat("position ", pos, " of token ", t, " is outside the cos/sin tables' rows [0, max_position ",
                                 p.rotary.max_position, ")"));
  }
  return Status::Ok();
}

// ---- QK-RMSNorm + rotary ----------------------------------------------------------------

constexpr int kRowMaxHeadDim = kFusedRowMaxHeadDim;

Status validate_qk_norm(const QkNormRopeParams& p, Backend backend) {
  bool cuda = false;
  FLASHCPP_RETURN_IF_ERROR(check_backend(backend, &cuda));
  FLASHCPP_RETURN_IF_ERROR(check_tokens(p.batch, p.seqlen));
  if (p.heads_q < 1) return Status::Invalid(cat("heads_q ", p.heads_q, " must be >= 1"));
  if (p.heads_k < 0) return Status::Invalid(cat("heads_k ", p.heads_k, " is negative (must be >= 0; 0 = no k)"));
  if (p.head_dim < 2 || p.head_dim % 2 != 0 || p.head_dim > kRowMaxHeadDim)
    return Status::Invalid(cat("head_dim ", p.head_dim, " must be even and in [2, ", kRowMaxHeadDim,
                               "] (qk_norm_rope keeps a head in one warp's registers; apply_rotary alone takes up to ",
                               kMaxHeadDim, ")"));
  if (!std::isfinite(p.eps) || p.eps < 0.f)
    return Status::Invalid(cat("eps ", static_cast<double>(p.eps), " must be finite and >= 0"));
  if (p.weight_offset != 0.f && p.weight_offset != 1.f)
    return Status::Invalid(cat("weight_offset ", static_cast<double>(p.weight_offset),
                               " must be 0 (y = n * weight, Qwen3) or 1 (y = n * (1 + weight), Gemma3)"));
  const RotarySpec& r = p.rotary;
  if (r.style != RopeStyle::kNone) FLASHCPP_RETURN_IF_ERROR(check_rotary_spec("rotary.", p.head_dim, r));
  if (p.positions && addr(p.positions) % alignof(std::int32_t) != 0)
    return Status::Invalid(cat("positions ", static_cast<const void*>(p.positions), " is not 4-byte aligned (int32)"));
  if (static_cast<std::int64_t>(p.batch) * p.seqlen == 0) return Status::Ok();

  QkTensors t;
  t.batch = p.batch, t.seqlen = p.seqlen, t.heads_q = p.heads_q, t.heads_k = p.heads_k, t.head_dim = p.head_dim;
  t.q = p.q, t.k = p.k, t.q_out = p.q_out, t.k_out = p.k_out;
  t.positions = p.positions;
  t.rotary = r.enabled() ? r : RotarySpec{};  // style none: the norm only, no tables read
  Span sqo, sko, sqw, skw;
  FLASHCPP_RETURN_IF_ERROR(check_qk_tensors("qk_norm_rope", t, cuda, &sqo, &sko));
  const std::int64_t elem = dtype_size(p.q.dtype);
  FLASHCPP_RETURN_IF_ERROR(check_pointer("q_weight", p.q_weight, elem, dtype_name(p.q.dtype)));
  FLASHCPP_RETURN_IF_ERROR(span_of("q_weight", p.q_weight, p.head_dim, elem, &sqw));
  if (p.heads_k > 0) {
    FLASHCPP_RETURN_IF_ERROR(check_pointer("k_weight", p.k_weight, elem, dtype_name(p.q.dtype)));
    FLASHCPP_RETURN_IF_ERROR(span_of("k_weight", p.k_weight, p.head_dim, elem, &skw));
  } else if (p.k_weight) {
    return Status::Invalid("k_weight is set but heads_k is 0 (no k to norm)");
  }
  // Every row reads its weights: no output may write them.
  for (const Span* out : {&sqo, &sko})
    for (const Span* w : {&sqw, &skw})
      if (out->overlaps(*w)) return overlap_error(*out, *w);
  return Status::Ok();
}

// ---- rotary + KV-cache append ------------------------------------------------------------

/// A (e0, e1, e2, dim) view with unit dim stride as check_view, naming e0's stride `outer`.
Status check_append_view(const char* name, const TensorView& t, std::int64_t e0, std::int64_t e1, std::int64_t e2,
                         std::int64_t dim, DType want, bool cuda, Span* span) {
  FLASHCPP_RETURN_IF_ERROR(check_dtype(name, t.dtype, want, "k_new", "rope_append_kv", cuda));
  return check_view(name, t, e0, e1, e2, dim, span);
}

Status validate_append(const RopeAppendParams& p, Backend backend) {
  bool cuda = false;
  FLASHCPP_RETURN_IF_ERROR(check_backend(backend, &cuda));
  FLASHCPP_RETURN_IF_ERROR(check_tokens(p.batch, p.seqlen));
  if (p.heads_q < 0) return Status::Invalid(cat("heads_q ", p.heads_q, " is negative (must be >= 0; 0 = no q)"));
  if (p.heads_kv < 1) return Status::Invalid(cat("heads_kv ", p.heads_kv, " must be >= 1"));
  if (p.head_dim < 2 || p.head_dim % 2 != 0 || p.head_dim > kRowMaxHeadDim)
    return Status::Invalid(cat("head_dim ", p.head_dim, " must be even and in [2, ", kRowMaxHeadDim,
                               "] (rope_append_kv keeps a head in one warp's registers)"));
  if (p.head_dim_v < 0 || p.head_dim_v > kRowMaxHeadDim)
    return Status::Invalid(cat("head_dim_v ", p.head_dim_v, " must be in [1, ", kRowMaxHeadDim, "] (0 = head_dim)"));
  const RotarySpec& r = p.rotary;
  if (r.style != RopeStyle::kNone) FLASHCPP_RETURN_IF_ERROR(check_rotary_spec("rotary.", p.head_dim, r));
  const KVCacheView& c = p.cache;
  // The cache holds k_new's dtype, or fp8 e4m3 with per-head scales: decode's rules (kv_cache_checks.h).
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_dtype(c, p.k_new.dtype, "k_new"));
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_geometry(c, p.batch));  // decode's rules
  if (c.slots() < p.seqlen)
    return Status::Invalid(cat("the cache has ", c.slots(), " key slots per sequence, fewer than the seqlen ", p.seqlen,
                               " new tokens"));
  for (const std::int32_t* a : {p.cache_seqlens, p.positions, c.block_table})
    if (a && addr(a) % alignof(std::int32_t) != 0)
      return Status::Invalid(cat(a == p.cache_seqlens ? "cache_seqlens " : a == p.positions ? "positions " : "cache.block_table ",
                                 static_cast<const void*>(a), " is not 4-byte aligned (int32)"));
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  if (tokens == 0) return Status::Ok();

  // Tensors.
  const int dv = p.effective_head_dim_v();
  const DType dt = p.k_new.dtype;
  Span skn, svn, sq, sqo, skc, svc, scl, sbt, spos, scos, ssin;
  FLASHCPP_RETURN_IF_ERROR(check_dtype("k_new", dt, dt, "k_new", "rope_append_kv", cuda));
  FLASHCPP_RETURN_IF_ERROR(check_view("k_new", p.k_new, p.batch, p.seqlen, p.heads_kv, p.head_dim, &skn));
  FLASHCPP_RETURN_IF_ERROR(check_append_view("v_new", p.v_new, p.batch, p.seqlen, p.heads_kv, dv, dt, cuda, &svn));
  const std::int64_t blocks = c.paged() ? c.num_pages : p.batch;
  const std::int64_t rows = c.paged() ? c.page_size : c.capacity;
  // The cache's dtypes passed check_cache_dtype above; an fp8 cache keeps decode's CUDA rule (16-byte
  // aligned, strides in 16 codes) so that decode reads what this writes.
  FLASHCPP_RETURN_IF_ERROR(check_view("cache.k", c.k, blocks, rows, p.heads_kv, p.head_dim, &skc));
  FLASHCPP_RETURN_IF_ERROR(check_view("cache.v", c.v, blocks, rows, p.heads_kv, dv, &svc));
  if (cuda && c.fp8()) {
    const char* stride0 = c.paged() ? "batch_stride (page stride)" : "batch_stride";
    FLASHCPP_RETURN_IF_ERROR(detail::check_cuda_vector_view("cache.k", c.k, blocks, rows, p.heads_kv, stride0));
    FLASHCPP_RETURN_IF_ERROR(detail::check_cuda_vector_view("cache.v", c.v, blocks, rows, p.heads_kv, stride0));
  }
  Span sks, svs;
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_scale_arrays(c, p.heads_kv, &sks, &svs));
  if (p.heads_q > 0) {
    FLASHCPP_RETURN_IF_ERROR(check_append_view("q", p.q, p.batch, p.seqlen, p.heads_q, p.head_dim, dt, cuda, &sq));
    if (p.q_out.data) {
      FLASHCPP_RETURN_IF_ERROR(check_append_view("q_out", p.q_out, p.batch, p.seqlen, p.heads_q, p.head_dim, dt, cuda, &sqo));
    } else {
      sqo = sq;
      sqo.name = "q (rotated in place)";
    }
  } else if (p.q.data || p.q_out.data) {
    return Status::Invalid(cat(p.q.data ? "q" : "q_out", ".data is set but heads_q is 0 (no q to rotate)"));
  }
  if (p.cache_seqlens == nullptr)
    return Status::Invalid("cache_seqlens is null (int32 [batch]: keys already in each sequence)");
  FLASHCPP_RETURN_IF_ERROR(span_of("cache_seqlens", p.cache_seqlens, p.batch, 4, &scl));
  if (c.paged()) {
    if (c.block_table == nullptr) return Status::Invalid("cache.block_table is null for a paged cache");
    const std::int64_t entries = static_cast<std::int64_t>(p.batch - 1) * c.block_table_stride + c.pages_per_seq;
    FLASHCPP_RETURN_IF_ERROR(span_of("cache.block_table", c.block_table, entries, 4, &sbt));
  }
  if (p.positions) FLASHCPP_RETURN_IF_ERROR(span_of("positions", p.positions, tokens, 4, &spos));
  if (r.enabled() && r.has_tables()) {
    const std::int64_t n = rotary_table_elems(r, p.head_dim);
    FLASHCPP_RETURN_IF_ERROR(span_of("rotary.cos", r.cos, n, 4, &scos));
    FLASHCPP_RETURN_IF_ERROR(span_of("rotary.sin", r.sin, n, 4, &ssin));
  }
  // Aliasing: q_out may be exactly q; the cache's K and V may share one buffer page by page
  // (FlashInfer's (pages, 2, page_size, heads, dim) layout); nothing written meets anything read.
  if (p.heads_q > 0 && p.q_out.data && sqo.overlaps(sq) && !same_view(p.q_out, p.q)) return overlap_error(sqo, sq);
  if (skc.overlaps(svc)) {
    const std::int64_t step = c.k.batch_stride, e = static_cast<std::int64_t>(dtype_size(c.k.dtype));
    const std::int64_t ext_k = (rows - 1) * c.k.seq_stride + (p.heads_kv - 1) * c.k.head_stride + p.head_dim;
    const std::int64_t ext_v = (rows - 1) * c.v.seq_stride + (p.heads_kv - 1) * c.v.head_stride + dv;
    const bool paired = blocks <= 1 ? false
                                    : c.v.batch_stride == step && (interleaved_disjoint(c.k.data, ext_k, c.v.data, ext_v, step, e) ||
                                                                   interleaved_disjoint(c.v.data, ext_v, c.k.data, ext_k, step, e));
    if (!paired) return overlap_error(skc, svc);
  }
  for (const Span* out : {&skc, &svc, &sqo})
    for (const Span* in : {&skn, &svn, &sq, &scl, &sbt, &spos, &scos, &ssin, &sks, &svs})
      if (out != &sqo || in != &sq)
        if (out->overlaps(*in)) return overlap_error(*out, *in);
  if (sqo.overlaps(skc)) return overlap_error(sqo, skc);
  if (sqo.overlaps(svc)) return overlap_error(sqo, svc);
  return Status::Ok();
}

/// Host-memory checks of the CPU backend for rope_append_kv: an fp8 cache's scales, lengths, pages
/// in use, positions.
Status check_append_host(const RopeAppendParams& p) {
  const KVCacheView& c = p.cache;
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_scale_values(c, p.heads_kv));
  const std::int64_t room = c.slots() - p.seqlen;
  for (int b = 0; b < p.batch; ++b) {
    const std::int64_t len = p.cache_seqlens[b];
    if (len < 0 || len > room)
      return Status::Invalid(cat("cache_seqlens[", b, "] = ", len, " leaves no room for the ", p.seqlen,
                                 " new tokens (must be in [0, ", room, "] with ", c.slots(), " slots a sequence)"));
    if (c.paged())  // one check per page the step touches (not per token: seqlen may be large)
      for (std::int64_t pg = len / c.page_size; pg <= (len + p.seqlen - 1) / c.page_size; ++pg) {
        const std::int64_t page = c.block_table[static_cast<std::int64_t>(b) * c.block_table_stride + pg];
        if (page < 0 || page >= c.num_pages)
          return Status::Invalid(cat("cache.block_table[", b, "][", pg, "] = ", page,
                                     " is outside the pool's pages [0, num_pages ", c.num_pages, ")"));
      }
    if (p.rotary.enabled() && p.rotary.has_tables() && p.positions == nullptr && len + p.seqlen > p.rotary.max_position) {
      // Positions are the slots len .. len + seqlen - 1: the first one past the tables, at once.
      const std::int64_t pos = std::max<std::int64_t>(len, p.rotary.max_position);
      return Status::Invalid(cat("position ", pos, " of token ", static_cast<std::int64_t>(b) * p.seqlen + (pos - len),
                                 " is outside the cos/sin tables' rows [0, max_position ", p.rotary.max_position, ")"));
    }
  }
  if (p.rotary.enabled() && p.rotary.has_tables() && p.positions != nullptr) {
    const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t pos = p.positions[t];
      if (pos < 0 || pos >= p.rotary.max_position)
        return Status::Invalid(cat("position ", pos, " of token ", t, " is outside the cos/sin tables' rows [0, max_position ",
                                   p.rotary.max_position, ")"));
    }
  }
  return Status::Ok();
}

/// Host-memory checks of the CPU backend for qk_norm_rope: positions inside the tables.
Status check_qk_positions_host(const QkNormRopeParams& p) {
  if (!p.rotary.enabled() || !p.rotary.has_tables()) return Status::Ok();
  RopeParams rp;
  rp.batch = p.batch, rp.seqlen = p.seqlen, rp.positions = p.positions, rp.rotary = p.rotary;
  return check_positions_host(rp);
}

}  // namespace

Status validate(const RmsNormParams& p, bool with_residual, Backend backend) {
  return validate_norm(p, with_residual, backend);
}
Status validate(const SiluMulParams& p, Backend backend) { return validate_silu(p, backend); }
Status validate(const QkNormRopeParams& p, Backend backend) {
  FLASHCPP_RETURN_IF_ERROR(validate_qk_norm(p, backend));
  if (backend == Backend::kCpu || backend == Backend::kCpuReference) return check_qk_positions_host(p);
  return Status::Ok();
}
Status validate(const RopeAppendParams& p, Backend backend) {
  FLASHCPP_RETURN_IF_ERROR(validate_append(p, backend));
  if ((backend == Backend::kCpu || backend == Backend::kCpuReference) && static_cast<std::int64_t>(p.batch) * p.seqlen > 0)
    return check_append_host(p);
  return Status::Ok();
}
Status validate(const RopeParams& p, Backend backend) {
  FLASHCPP_RETURN_IF_ERROR(validate_rotary(p, backend));
  if (backend == Backend::kCpu || backend == Backend::kCpuReference) return check_positions_host(p);
  return Status::Ok();
}

}  // namespace flashcpp
