// Validation of decode (DecodeParams) and of merge_attention_states (MergeStatesParams):
// everything that can be checked on the host without touching device memory. Every failure is
// one sentence that names the field and its value, as in validate.cc.
//
// Order (the first failure is reported):
//   1. scalars (validate_decode_shape, all that decode_plan needs): backend, shape, dtypes, cache
//      geometry, append, rotary, mask;
//   2. each tensor: null, alignment, strides (sign, CUDA vector width, 64-bit span, injective map);
//   3. the small arrays: cache_seqlens, block table, rotary tables, lse, ALiBi slopes;
//   4. aliasing: what the step writes (o, lse and, with append, the cache) must not overlap what
//      it reads;
//   5. CPU backends only (host memory): the values of cache_seqlens, of the block-table entries
//      in use and the rotary positions.
// On the CUDA backend the values of step 5 live on the device; the kernels clamp them instead
// (decode.h, "Safety").
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "core/decode_backends.h"
#include "core/head_dim_checks.h"
#include "core/kv_cache_checks.h"
#include "flashcpp/decode.h"

#include "core/message.h"
#include "core/rope_checks.h"
#include "core/score_checks.h"

namespace flashcpp {
namespace {

// ---- one-sentence messages (src/core/message.h) ----------------------------------------

using detail::cat;

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
bool known_dtype(DType t) { return t == DType::kF16 || t == DType::kBF16 || t == DType::kF32; }
bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

constexpr std::int64_t kCudaVectorBytes = 16;

/// Decode runs on the CPU backend or CUDA; kAuto is checked permissively (no host arrays read).
struct Rules {
  bool cuda = false;        ///< 16-byte vector loads, no fp32
  bool host_arrays = false;  ///< cache_seqlens / block table / positions are host memory
};
Status decode_rules(Backend b, Rules* r) {
  switch (b) {
    case Backend::kAuto: *r = {false, false}; return Status::Ok();
    case Backend::kCpu: *r = {false, true}; return Status::Ok();
    case Backend::kCuda: *r = {true, false}; return Status::Ok();
    case Backend::kCpuReference:
      return Status::Unsupported(
          "decode has no fp64 reference backend (use Backend::kCpu; tests compare against "
          "cpu::reference_attention on a dense copy of the cache)");
  }
  return Status::Invalid(cat("backend ", static_cast<int>(b), " is not a known backend"));
}

// ---- tensors ------------------------------------------------------------------------------

using detail::Span;

struct Dim {
  const char* name = "";
  std::int64_t stride = 0, extent = 0;
  bool is_dim = false;
};

/// Checks a strided view of (e0, e1, e2, head_dim) with strides (batch, seq, head, 1): null,
/// alignment, strides, span, injectivity. `names` name the three strided dims.
Status check_view(const char* name, const TensorView& t, std::int64_t e0, std::int64_t e1, std::int64_t e2,
                  std::int64_t dim, const Rules& r, Span* span, const char* stride0 = "batch_stride") {
  span->name = name;
  if (t.data == nullptr) return Status::Invalid(cat(name, ".data is null"));
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  if (addr(t.data) % elem != 0)
    return Status::Invalid(cat(name, ".data ", static_cast<const void*>(t.data), " is not aligned to its ", elem,
                               "-byte ", dtype_name(t.dtype), " elements"));
  std::array<Dim, 4> d = {{{stride0, t.batch_stride, e0, false},
                           {"seq_stride", t.seq_stride, e1, false},
                           {"head_stride", t.head_stride, e2, false},
                           {"head_dim", 1, dim, true}}};
  for (int i = 0; i < 3; ++i)
    if (d[i].stride < 0)
      return Status::Invalid(cat(name, ".", d[i].name, " ", d[i].stride, " is negative (strides must be >= 0)"));
  if (r.cuda) FLASHCPP_RETURN_IF_ERROR(detail::check_cuda_vector_view(name, t, e0, e1, e2, stride0));
  std::int64_t end = 1;  // largest offset + 1
  for (const Dim& x : d) {
    std::int64_t step = 0;
    if (x.extent <= 0) continue;
    if (__builtin_mul_overflow(x.extent - 1, x.stride, &step) || __builtin_add_overflow(end, step, &end))
      return Status::Invalid(cat(name, "'s largest element offset overflows int64"));
  }
  std::int64_t bytes = 0;
  std::uintptr_t hi = 0;
  if (__builtin_mul_overflow(end, elem, &bytes) ||
      __builtin_add_overflow(addr(t.data), static_cast<std::uintptr_t>(bytes), &hi))
    return Status::Invalid(cat(name, "'s byte span (", end, " elements from ", static_cast<const void*>(t.data),
                               ") wraps around the address space"));
  // Injective index map: sorted by stride, each dim in use must step past all smaller ones.
  std::array<Dim, 4> used;
  int n = 0;
  for (const Dim& x : d)
    if (x.is_dim || x.extent > 1) used[n++] = x;
  auto before = [](const Dim& a, const Dim& b) {
    return a.stride != b.stride ? a.stride < b.stride : (a.is_dim && !b.is_dim);
  };
  for (int i = 1; i < n; ++i)  // insertion sort of at most 4 dims
    for (int j = i; j > 0 && before(used[j], used[j - 1]); --j) std::swap(used[j], used[j - 1]);
  std::int64_t reach = 0;
  for (int i = 0; i < n; ++i) {
    if (used[i].stride <= reach)
      return Status::Invalid(cat(name, ".", used[i].name, " ", used[i].stride,
                                 " makes two indices share one element: it must be at least ", reach + 1,
                                 ", the elements spanned by the dims with smaller strides"));
    reach += (std::max<std::int64_t>(used[i].extent, 1) - 1) * used[i].stride;
  }
  span->lo = addr(t.data);
  span->hi = hi;
  return Status::Ok();
}

/// A small contiguous array of `count` elements of `elem` bytes.
Status check_array(const char* name, const void* p, std::int64_t count, std::size_t elem, const char* type,
                   Span* span) {
  span->name = name;
  if (p == nullptr) return Status::Invalid(cat(name, " is null"));
  if (addr(p) % elem != 0)
    return Status::Invalid(cat(name, " ", p, " is not ", static_cast<std::int64_t>(elem), "-byte aligned (", type, ")"));
  span->lo = addr(p);
  span->hi = addr(p) + static_cast<std::uintptr_t>(count) * elem;
  return Status::Ok();
}

}  // namespace

// ---- the KV-cache rules rope_append_kv shares (core/kv_cache_checks.h) ----------------------

namespace detail {

Status check_cache_dtype(const KVCacheView& c, DType dt, const char* owner) {
  for (const auto& [name, t] : {std::pair{"cache.k", c.k.dtype}, std::pair{"cache.v", c.v.dtype}})
    if (!known_dtype(t) && t != DType::kF8E4M3)
      return Status::Invalid(cat(name, ".dtype ", static_cast<int>(t),
                                 " is not a known cache dtype (fp16, bf16, fp32, or fp8_e4m3 with scales)"));
  if (c.k.dtype == DType::kF8E4M3 || c.v.dtype == DType::kF8E4M3) {
    if (c.k.dtype != c.v.dtype)
      return Status::Invalid(cat("cache.k.dtype ", dtype_name(c.k.dtype), " differs from cache.v.dtype ",
                                 dtype_name(c.v.dtype), " (an fp8 cache quantizes both K and V)"));
    return Status::Ok();
  }
  for (const auto& [name, t] : {std::pair{"cache.k", c.k.dtype}, std::pair{"cache.v", c.v.dtype}})
    if (t != dt)
      return Status::Invalid(cat(name, ".dtype ", dtype_name(t), " differs from ", owner, ".dtype ", dtype_name(dt),
                                 " (the cache holds ", owner, "'s dtype, or fp8_e4m3 with scales)"));
  if (c.k_scale != nullptr || c.v_scale != nullptr)
    return Status::Invalid(cat(c.k_scale ? "cache.k_scale" : "cache.v_scale", " is set but the cache is ",
                               dtype_name(c.k.dtype), " (the scales belong to an fp8_e4m3 cache)"));
  return Status::Ok();
}

Status check_cache_scale_arrays(const KVCacheView& c, int heads_kv, Span* k_span, Span* v_span) {
  if (!c.fp8()) return Status::Ok();
  FLASHCPP_RETURN_IF_ERROR(check_array("cache.k_scale", c.k_scale, heads_kv, 4, "fp32", k_span));
  return check_array("cache.v_scale", c.v_scale, heads_kv, 4, "fp32", v_span);
}

Status check_cache_scale_values(const KVCacheView& c, int heads_kv) {
  if (!c.fp8()) return Status::Ok();
  for (int h = 0; h < heads_kv; ++h)
    for (const auto& [name, sc] : {std::pair{"cache.k_scale", c.k_scale}, std::pair{"cache.v_scale", c.v_scale}})
      if (!(std::isfinite(sc[h]) && sc[h] > 0.f))
        return Status::Invalid(cat(name, "[", h, "] ", static_cast<double>(sc[h]), " must be positive and finite"));
  return Status::Ok();
}

Status check_cuda_vector_view(const char* name, const TensorView& t, std::int64_t e0, std::int64_t e1,
                              std::int64_t e2, const char* stride0) {
  if (addr(t.data) % kCudaVectorBytes != 0)
    return Status::Invalid(cat(name, ".data ", static_cast<const void*>(t.data),
                               " is not 16-byte aligned (the CUDA kernels use 16-byte vector loads)"));
  // 16 bytes: 8 elements of 16 bits, 16 fp8 codes.
  const std::int64_t vec = kCudaVectorBytes / static_cast<std::int64_t>(dtype_size(t.dtype));
  const std::array<Dim, 3> d = {{{stride0, t.batch_stride, e0, false},
                                 {"seq_stride", t.seq_stride, e1, false},
                                 {"head_stride", t.head_stride, e2, false}}};
  for (const Dim& x : d)
    if (x.extent > 1 && x.stride % vec != 0)
      return Status::Invalid(cat(name, ".", x.name, " ", x.stride, " is not a multiple of ", vec,
                                 " elements (the CUDA kernels use 16-byte vector loads)"));
  return Status::Ok();
}

Status check_cache_geometry(const KVCacheView& c, int batch) {
  if (c.paged()) {
    if (!is_pow2(c.page_size) || c.page_size > kDecodeMaxPageSize)
      return Status::Invalid(cat("cache.page_size ", c.page_size, " is not a power of two in [1, ",
                                 kDecodeMaxPageSize, "] (0 = contiguous cache)"));
    if (c.num_pages < 1) return Status::Invalid(cat("cache.num_pages ", c.num_pages, " must be >= 1 for a paged cache"));
    if (c.pages_per_seq < 1)
      return Status::Invalid(cat("cache.pages_per_seq ", c.pages_per_seq, " must be >= 1 for a paged cache"));
    if (c.slots() > std::numeric_limits<std::int32_t>::max())
      return Status::Invalid(cat("cache.pages_per_seq ", c.pages_per_seq, " * page_size ", c.page_size,
                                 " slots do not fit in int32"));
    if (batch > 1 && c.block_table_stride < c.pages_per_seq)
      return Status::Invalid(cat("cache.block_table_stride ", c.block_table_stride,
                                 " is less than cache.pages_per_seq ", c.pages_per_seq,
                                 " (rows of the block table would overlap)"));
    // The block table's extent, (batch - 1) * stride + pages_per_seq entries, in int64 (the
    // kernels index it so); found by fuzz_decode_validate: a huge stride overflowed it.
    if (batch > 1 && c.block_table_stride > (std::numeric_limits<std::int64_t>::max() / 4 - c.pages_per_seq) /
                                                  (batch - 1))
      return Status::Invalid(cat("cache.block_table_stride ", c.block_table_stride, " is too large: ", batch,
                                 " rows of it do not fit in a byte span of 2^63"));
  } else {
    if (c.page_size < 0)
      return Status::Invalid(cat("cache.page_size ", c.page_size, " is negative (0 = contiguous cache)"));
    if (c.capacity < 0) return Status::Invalid(cat("cache.capacity ", c.capacity, " is negative (must be >= 0)"));
    if (c.block_table != nullptr)
      return Status::Invalid("cache.block_table is set but cache.page_size is 0 (set page_size for a paged cache)");
  }
  return Status::Ok();
}

}  // namespace detail

float DecodeParams::effective_scale() const noexcept {
  if (softmax_scale != 0.f) return softmax_scale;
  return head_dim > 0 ? 1.f / std::sqrt(static_cast<float>(head_dim)) : 0.f;
}

namespace decode {

Status validate_decode_shape(const DecodeParams& p, Backend backend) {
  Rules r;
  FLASHCPP_RETURN_IF_ERROR(decode_rules(backend, &r));
  // shape
  if (p.batch < 0) return Status::Invalid(cat("batch ", p.batch, " is negative (must be >= 0)"));
  if (p.seqlen_q < 1 || p.seqlen_q > kDecodeMaxSeqlenQ)
    return Status::Invalid(cat("seqlen_q ", p.seqlen_q, " is outside the decode range 1..", kDecodeMaxSeqlenQ,
                               " (longer query blocks are prefill: attention_forward in C++, flash_attn_func in Python)"));
  if (p.heads_q < 1) return Status::Invalid(cat("heads_q ", p.heads_q, " must be >= 1"));
  if (p.heads_kv < 1) return Status::Invalid(cat("heads_kv ", p.heads_kv, " must be >= 1"));
  if (p.heads_q % p.heads_kv != 0)
    return Status::Invalid(cat("heads_q ", p.heads_q, " is not a multiple of heads_kv ", p.heads_kv));
  FLASHCPP_RETURN_IF_ERROR(detail::check_head_dim("head_dim", p.head_dim));
  if (p.head_dim_v != 0) FLASHCPP_RETURN_IF_ERROR(detail::check_head_dim("head_dim_v", p.head_dim_v));
  // dtypes
  const bool append = p.has_append();
  // q, o and the new K/V share one dtype; the cache holds it too, or fp8 e4m3 with per-head scales
  // (kv_cache_checks.h, the rules rope_append_kv's cache follows too).
  std::array<std::pair<const char*, DType>, 4> ts = {
      {{"q", p.q.dtype}, {"o", p.o.dtype}, {"k_new", p.k_new.dtype}, {"v_new", p.v_new.dtype}}};
  for (std::size_t i = 0; i < ts.size(); ++i) {
    if (!append && (i == 2 || i == 3)) continue;
    if (!known_dtype(ts[i].second))
      return Status::Invalid(cat(ts[i].first, ".dtype ", static_cast<int>(ts[i].second),
                                 " is not a known dtype (fp16, bf16 or fp32)"));
  }
  for (std::size_t i = 1; i < 4; ++i)
    if ((append || i < 2) && ts[i].second != p.q.dtype)
      return Status::Invalid(cat(ts[i].first, ".dtype ", dtype_name(ts[i].second), " differs from q.dtype ",
                                 dtype_name(p.q.dtype), " (q, o and k_new/v_new share one dtype)"));
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_dtype(p.cache, p.q.dtype, "q"));
  if (r.cuda && p.cache.k.dtype == DType::kF8E4M3)
    FLASHCPP_RETURN_IF_ERROR(detail::check_cuda_fp8_head_dims(p.head_dim, p.effective_head_dim_v()));
  if (r.cuda && p.q.dtype == DType::kF32)
    return Status::Unsupported("fp32 decode runs on the CPU backend only (the CUDA kernels take fp16 or bf16)");
  // cache geometry
  const KVCacheView& c = p.cache;
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_geometry(c, p.batch));
  if (append && (p.k_new.data == nullptr || p.v_new.data == nullptr))
    return Status::Invalid(p.k_new.data ? "v_new is null but k_new is set (append needs both)"
                                        : "k_new is null but v_new is set (append needs both)");
  if (append && c.slots() < p.seqlen_q)
    return Status::Invalid(cat("the cache has ", c.slots(), " key slots per sequence, fewer than the seqlen_q ",
                               p.seqlen_q, " tokens an append writes"));
  // rotary
  // rotary: the spec as every rotary path checks it (rope_checks.h); decode's kernels read tables
  // of any stride, so there is no layout rule here.
  if (p.rotary.enabled()) FLASHCPP_RETURN_IF_ERROR(detail::check_rotary_spec("rotary.", p.head_dim, p.rotary));
  // mask
  const MaskParams& m = p.mask;
  if (!std::isfinite(p.softmax_scale))
    return Status::Invalid(cat("softmax_scale ", static_cast<double>(p.softmax_scale),
                               " is not finite (0 selects 1/sqrt(head_dim))"));
  if (!std::isfinite(m.softcap) || m.softcap < 0.f)
    return Status::Invalid(cat("mask.softcap ", static_cast<double>(m.softcap), " must be finite and >= 0 (0 = off)"));
  FLASHCPP_RETURN_IF_ERROR(check_score_units(p.effective_scale(), m.softcap, m.alibi_slopes != nullptr));
  if (m.window_left < -1)
    return Status::Invalid(cat("mask.window_left ", m.window_left, " must be >= -1 (-1 = unbounded)"));
  if (m.window_right < -1)
    return Status::Invalid(cat("mask.window_right ", m.window_right, " must be >= -1 (-1 = unbounded)"));
  if (m.alibi_slopes && m.alibi_batch_stride != 0 && m.alibi_batch_stride != p.heads_q)
    return Status::Invalid(cat("mask.alibi_batch_stride ", m.alibi_batch_stride, " must be 0 or heads_q ", p.heads_q));
  if (m.is_varlen())
    return Status::Unsupported("decode takes per-sequence lengths in cache_seqlens, not mask.cu_seqlens_q/k");
  if (m.global_tokens != 0 || m.global_queries)
    return Status::Unsupported("global tokens are not supported by decode (mask.global_tokens must be 0)");
  if (m.block_sparse) return Status::Unsupported("block-sparse masks are not supported by decode");
  return Status::Ok();
}

}  // namespace decode

Status validate(const DecodeParams& p, Backend backend) {
  FLASHCPP_RETURN_IF_ERROR(decode::validate_decode_shape(p, backend));
  Rules r;
  FLASHCPP_RETURN_IF_ERROR(decode_rules(backend, &r));
  if (p.batch == 0) return Status::Ok();  // writes nothing, so needs no pointers
  const bool append = p.has_append();
  const KVCacheView& c = p.cache;

  // 2. tensors
  Span sq, so, sk, sv, skn, svn;
  FLASHCPP_RETURN_IF_ERROR(check_view("q", p.q, p.batch, p.seqlen_q, p.heads_q, p.head_dim, r, &sq));
  const int dv = p.effective_head_dim_v();
  FLASHCPP_RETURN_IF_ERROR(check_view("o", p.o, p.batch, p.seqlen_q, p.heads_q, dv, r, &so));
  const std::int64_t c0 = c.paged() ? c.num_pages : p.batch, c1 = c.paged() ? c.page_size : c.capacity;
  const char* s0 = c.paged() ? "batch_stride (page stride)" : "batch_stride";
  if (c.slots() > 0) {
    FLASHCPP_RETURN_IF_ERROR(check_view("cache.k", c.k, c0, c1, p.heads_kv, p.head_dim, r, &sk, s0));
    FLASHCPP_RETURN_IF_ERROR(check_view("cache.v", c.v, c0, c1, p.heads_kv, dv, r, &sv, s0));
  }
  if (append) {
    FLASHCPP_RETURN_IF_ERROR(check_view("k_new", p.k_new, p.batch, p.seqlen_q, p.heads_kv, p.head_dim, r, &skn));
    FLASHCPP_RETURN_IF_ERROR(check_view("v_new", p.v_new, p.batch, p.seqlen_q, p.heads_kv, dv, r, &svn));
  }

  // 3. small arrays
  Span sl, sbt, slse, sal, scos, ssin;
  FLASHCPP_RETURN_IF_ERROR(check_array("cache_seqlens", p.cache_seqlens, p.batch, 4, "int32", &sl));
  if (c.paged()) {
    if (c.block_table == nullptr)
      return Status::Invalid(cat("cache.block_table is null but cache.page_size is ", c.page_size,
                                 " (a paged cache needs a block table)"));
    const std::int64_t n = (p.batch - 1) * c.block_table_stride + c.pages_per_seq;
    FLASHCPP_RETURN_IF_ERROR(check_array("cache.block_table", c.block_table, n, 4, "int32", &sbt));
  }
  if (p.lse)
    FLASHCPP_RETURN_IF_ERROR(check_array("lse", p.lse, static_cast<std::int64_t>(p.batch) * p.heads_q * p.seqlen_q,
                                         4, "fp32", &slse));
  Span sks, svs;
  FLASHCPP_RETURN_IF_ERROR(detail::check_cache_scale_arrays(c, p.heads_kv, &sks, &svs));
  if (p.mask.alibi_slopes)
    FLASHCPP_RETURN_IF_ERROR(check_array("mask.alibi_slopes", p.mask.alibi_slopes,
                                         p.mask.alibi_batch_stride ? static_cast<std::int64_t>(p.batch) * p.heads_q
                                                                   : p.heads_q,
                                         4, "fp32", &sal));
  const RotarySpec& ro = p.rotary;
  if (ro.enabled() && ro.has_tables()) {
    const std::int64_t n = detail::rotary_table_elems(ro, p.head_dim);
    FLASHCPP_RETURN_IF_ERROR(check_array("rotary.cos", ro.cos, n, 4, "fp32", &scos));
    FLASHCPP_RETURN_IF_ERROR(check_array("rotary.sin", ro.sin, n, 4, "fp32", &ssin));
  }

  // 4. aliasing. Written: o, lse, and with append the cache. cache.k and cache.v may share one
  // buffer (FlashInfer's (pages, 2, page_size, heads, dim) layout interleaves them), so the pair
  // is not compared; every other pair is, conservatively by byte range.
  std::array<const Span*, 14> all = {&sq, &so, &sk, &sv, &skn, &svn, &sl, &sbt, &slse, &sal, &scos, &ssin, &sks, &svs};
  std::array<const Span*, 4> written = {&so, &slse, append ? &sk : nullptr, append ? &sv : nullptr};
  for (const Span* w : written) {
    if (w == nullptr) continue;
    for (const Span* x : all) {
      if (x == w || ((w == &sk && x == &sv) || (w == &sv && x == &sk))) continue;
      if (w->overlaps(*x))
        return Status::Invalid(cat(w->name, " overlaps ", x->name, ": bytes [", reinterpret_cast<const void*>(w->lo), ", ",
                                   reinterpret_cast<const void*>(w->hi), ") meet [",
                                   reinterpret_cast<const void*>(x->lo), ", ", reinterpret_cast<const void*>(x->hi),
                                   ") (what a decode step writes must not alias what it reads)"));
    }
  }

  // 5. host values (CPU backend)
  if (!r.host_arrays) return Status::Ok();
  if (c.fp8()) {
    FLASHCPP_RETURN_IF_ERROR(detail::check_cache_scale_values(c, p.heads_kv));
    for (int h = 0; h < p.heads_kv; ++h)  // the score's units: softmax_scale * k_scale (score_checks.h)
      FLASHCPP_RETURN_IF_ERROR(
          check_score_units(p.effective_scale() * c.k_scale[h], p.mask.softcap, p.mask.alibi_slopes != nullptr));
  }
  const std::int64_t slots = c.slots();
  for (int b = 0; b < p.batch; ++b) {
    const std::int64_t cl = p.cache_seqlens[b];
    if (cl < 0) return Status::Invalid(cat("cache_seqlens[", b, "] ", cl, " is negative"));
    const std::int64_t total = cl + (append ? p.seqlen_q : 0);
    if (total > slots)
      return Status::Invalid(cat("cache_seqlens[", b, "] ", cl, append ? cat(" + seqlen_q ", p.seqlen_q) : std::string(),
                                 " = ", total, " keys exceed the cache's ", slots, " slots per sequence"));
    if (c.paged()) {
      const std::int64_t pages = (total + c.page_size - 1) / c.page_size;
      for (std::int64_t i = 0; i < pages; ++i) {
        const std::int32_t pg = c.block_table[b * c.block_table_stride + i];
        if (pg < 0 || pg >= c.num_pages)
          return Status::Invalid(cat("cache.block_table[", b, "][", i, "] ", pg, " is outside [0, num_pages ",
                                     c.num_pages, ")"));
      }
    }
    if (ro.enabled() && ro.has_tables()) {
      const std::int64_t first = total - p.seqlen_q, last = total - 1;  // positions of rows 0 and seqlen_q-1
      if (first < 0 || last >= ro.max_position)
        return Status::Invalid(cat("rotary positions [", first, ", ", last, "] of sequence ", b,
                                   " are outside the cos/sin tables' rows [0, ", ro.max_position, ")"));
    }
  }
  return Status::Ok();
}

Status validate(const MergeStatesParams& p, Backend backend) {
  if (backend == Backend::kCpuReference)
    return Status::Unsupported("merge_attention_states has no fp64 reference backend (use Backend::kCpu)");
  Rules r;
  FLASHCPP_RETURN_IF_ERROR(decode_rules(backend, &r));
  r.cuda = false;  // the merge kernel reads element by element: no 16-byte rule
  if (p.batch < 0) return Status::Invalid(cat("batch ", p.batch, " is negative (must be >= 0)"));
  if (p.seqlen < 0) return Status::Invalid(cat("seqlen ", p.seqlen, " is negative (must be >= 0)"));
  if (p.heads < 1) return Status::Invalid(cat("heads ", p.heads, " must be >= 1"));
  if (p.head_dim < 1) return Status::Invalid(cat("head_dim ", p.head_dim, " must be >= 1"));
  for (const auto& [name, t] : {std::pair<const char*, const TensorView&>{"o_a", p.o_a}, {"o_b", p.o_b}, {"o", p.o}}) {
    if (!known_dtype(t.dtype))
      return Status::Invalid(cat(name, ".dtype ", static_cast<int>(t.dtype), " is not a known dtype (fp16, bf16 or fp32)"));
    if (t.dtype != p.o_a.dtype)
      return Status::Invalid(cat(name, ".dtype ", dtype_name(t.dtype), " differs from o_a.dtype ",
                                 dtype_name(p.o_a.dtype), " (o_a, o_b and o share one dtype)"));
  }
  if (p.batch == 0 || p.seqlen == 0) return Status::Ok();
  Span sa, sb, so, sla, slb, sl;
  FLASHCPP_RETURN_IF_ERROR(check_view("o_a", p.o_a, p.batch, p.seqlen, p.heads, p.head_dim, r, &sa));
  FLASHCPP_RETURN_IF_ERROR(check_view("o_b", p.o_b, p.batch, p.seqlen, p.heads, p.head_dim, r, &sb));
  FLASHCPP_RETURN_IF_ERROR(check_view("o", p.o, p.batch, p.seqlen, p.heads, p.head_dim, r, &so));
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads * p.seqlen;
  FLASHCPP_RETURN_IF_ERROR(check_array("lse_a", p.lse_a, rows, 4, "fp32", &sla));
  FLASHCPP_RETURN_IF_ERROR(check_array("lse_b", p.lse_b, rows, 4, "fp32", &slb));
  if (p.lse) FLASHCPP_RETURN_IF_ERROR(check_array("lse", p.lse, rows, 4, "fp32", &sl));
  auto same_view = [](const TensorView& x, const TensorView& y) {
    return x.data == y.data && x.batch_stride == y.batch_stride && x.seq_stride == y.seq_stride &&
           x.head_stride == y.head_stride;
  };
  // In place is fine (each element is read before it is written, by the same thread); any other
  // overlap of an output with an input is refused.
  for (const Span* x : {&sa, &sb, &sla, &slb, &sl}) {
    if (x == &sa && same_view(p.o, p.o_a)) continue;
    if (x == &sb && same_view(p.o, p.o_b)) continue;
    if (so.overlaps(*x))
      return Status::Invalid(cat("o overlaps ", x->name, " (the output may be exactly o_a or o_b, or disjoint)"));
  }
  if (p.lse)
    for (const Span* x : {&sa, &sb, &so, &sla, &slb}) {
      if ((x == &sla || x == &slb) && x->same(sl)) continue;
      if (sl.overlaps(*x))
        return Status::Invalid(cat("lse overlaps ", x->name, " (the merged lse may be exactly lse_a or lse_b, or disjoint)"));
    }
  return Status::Ok();
}

}  // namespace flashcpp
