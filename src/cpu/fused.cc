// CPU backend of the fused kernels: RMSNorm (+ residual), SwiGLU, rotary. fp32 math on host
// memory, the formulas of include/flashcpp/fused.h evaluated in the same order as the CUDA
// kernels (src/cuda/fused/), multithreaded over rows / tokens. Called by the dispatch in
// src/core/fused_api.cc after validation, so every pointer and stride here is known good.
//
// Numerics shared with the GPU: h = round_T(x + residual) is formed first and everything after
// reads the rounded h; the sum of squares is kept in 8 partial sums (the GPU sums per thread,
// then over a tree), so it is far below the 1e-3 tolerance for any hidden size; y is rounded
// once from (h * rstd) * w. Rotary angles and the rotation are common/fused_math.h's
// (cos_sin_angle: fp64 product and reduction, then fp32 cos/sin; rotate_pair), as on the GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "flashcpp/half.h"
#include "common/fused_math.h"
#include "common/kv_append.h"
#include "cpu/parallel.h"
#include "cpu/rotary.h"
#include "flashcpp/fused.h"

namespace flashcpp {

double rotary_inv_freq(int i, int rotary_dim, double theta, const Llama3Scaling& s) noexcept {
  return fused::inv_freq(i, rotary_dim, theta, s.factor, s.low_freq_factor, s.high_freq_factor,
                         s.original_max_position);
}

const double* rotary_inv_freq_table(int rotary_dim, double theta, const Llama3Scaling& s) noexcept {
  if (rotary_dim < 2 || rotary_dim > 2 * kRotaryTableMaxPairs || rotary_dim % 2 != 0) return nullptr;
  struct Entry {
    int rotary_dim = 0;  // 0: empty
    double theta = 0;
    Llama3Scaling llama3;
    double values[kRotaryTableMaxPairs];
  };
  thread_local Entry cache[4];
  thread_local int next = 0;
  auto same = [&](const Entry& e) {  // a NaN theta never matches: computed afresh (validation refuses it)
    return e.rotary_dim == rotary_dim && e.theta == theta && e.llama3.factor == s.factor &&
           e.llama3.low_freq_factor == s.low_freq_factor && e.llama3.high_freq_factor == s.high_freq_factor &&
           e.llama3.original_max_position == s.original_max_position;
  };
  for (const Entry& e : cache)
    if (same(e)) return e.values;
  Entry& e = cache[next];
  next = (next + 1) % 4;
  for (int i = 0; i < rotary_dim / 2; ++i) e.values[i] = rotary_inv_freq(i, rotary_dim, theta, s);
  e.rotary_dim = rotary_dim;
  e.theta = theta;
  e.llama3 = s;
  return e.values;
}

namespace cpu {
namespace {

// ---- element types -----------------------------------------------------------------------

struct Bf16 {
  using S = std::uint16_t;
  static float ld(S v) { return bf16_bits_to_float(v); }
  static S st(float f) { return float_to_bf16_bits(f); }
};
struct F16 {
  using S = std::uint16_t;
  static float ld(S v) { return half_bits_to_float(v); }
  static S st(float f) { return float_to_half_bits(f); }
};
struct F32 {
  using S = float;
  static float ld(S v) { return v; }
  static S st(float f) { return f; }
};

/// Runs f(E{}) with E the element type of dt.
template <class F>
Status with_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::kBF16: return f(Bf16{});
    case DType::kF16: return f(F16{});
    case DType::kF32: return f(F32{});
    case DType::kF64:
    case DType::kF8E4M3: break;  // validation refuses fp64 and fp8 for the fused ops
  }
  return Status::Internal("unknown dtype reached the fused CPU backend");
}

// ---- RMSNorm -----------------------------------------------------------------------------

template <class E>
void norm_row(const typename E::S* x, const typename E::S* r, typename E::S* ro, const typename E::S* w,
              typename E::S* y, std::int64_t hidden, float eps, float inv_hidden, float w_offset = 0.f) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  // Pass 1: h (rounded, written to residual_out when there is a residual) and sum of h^2. Each
  // element is read before it is written, so residual_out may be residual or x itself.
  for (std::int64_t j = 0; j < hidden; ++j) {
    float h = E::ld(x[j]);
    if (r) {
      const typename E::S hs = E::st(h + E::ld(r[j]));
      ro[j] = hs;
      h = E::ld(hs);
    }
    acc[j % kLanes] += h * h;
  }
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
  const float rstd = 1.f / std::sqrt(acc[0] * inv_hidden + eps);
  // Pass 2: y from the rounded h (read back from residual_out, or x).
  const typename E::S* h_src = r ? ro : x;
  // w_offset (qk_norm_rope's weight_offset): 0 takes w itself, so -0 weights keep their sign.
  for (std::int64_t j = 0; j < hidden; ++j) {
    const float wf = w_offset != 0.f ? w_offset + E::ld(w[j]) : E::ld(w[j]);
    y[j] = E::st(E::ld(h_src[j]) * rstd * wf);
  }
}

// ---- rotary ------------------------------------------------------------------------------

/// Every q head, then every k head, of token (b, s) of apply_rotary's or qk_norm_rope's params:
/// f(which, src, dst) with which 0 for q and 1 for k, dst the head in q_out / k_out, or src itself
/// (in place) when that output is not set.
template <class S, class Params, class F>
void for_each_qk_head(const Params& p, std::int64_t b, std::int64_t s, F&& f) {
  for (int which = 0; which < 2; ++which) {
    const TensorView& in = which == 0 ? p.q : p.k;
    const TensorView& out_v = which == 0 ? p.q_out : p.k_out;
    const TensorView& out = out_v.data ? out_v : in;
    const int nh = which == 0 ? p.heads_q : p.heads_k;
    for (int h = 0; h < nh; ++h) {
      const S* src = static_cast<const S*>(in.data) + b * in.batch_stride + s * in.seq_stride + h * in.head_stride;
      S* dst = static_cast<S*>(out.data) + b * out.batch_stride + s * out.seq_stride + h * out.head_stride;
      f(which, src, dst);
    }
  }
}

/// Rotates (or copies) one head of one token: in -> out (out may be in).
template <class E>
void rotate_head(const typename E::S* in, typename E::S* out, const float* cs, const float* sn, int half,
                 int head_dim, RopeStyle style, bool copy_tail) {
  for (int i = 0; i < half; ++i) {
    const int ia = style == RopeStyle::kNeox ? i : 2 * i;
    const int ib = style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    float a = E::ld(in[ia]), b = E::ld(in[ib]);
    fused::rotate_pair(a, b, cs[i], sn[i]);  // the kernels' expression, FMAs included
    out[ia] = E::st(a);
    out[ib] = E::st(b);
  }
  if (copy_tail)
    for (int j = 2 * half; j < head_dim; ++j) out[j] = in[j];
}

/// One head rotated into fp32, unrounded (rotate_head's pairs; dims past them as they are): the
/// key an fp8 cache quantizes (fused.h: K is not rounded to the dtype before its division by the scale).
template <class E>
void rotate_head_f32(const typename E::S* in, float* out, const float* cs, const float* sn, int half, int head_dim,
                     RopeStyle style) {
  for (int j = 0; j < head_dim; ++j) out[j] = E::ld(in[j]);
  for (int i = 0; i < half; ++i) {
    const int ia = style == RopeStyle::kNeox ? i : 2 * i;
    const int ib = style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    fused::rotate_pair(out[ia], out[ib], cs[i], sn[i]);
  }
}

/// The fp8 e4m3 codes of n fp32 values divided by the head's scale (decode.h's rule, as decode's
/// append stores them): round to nearest even, saturating at +-448, NaN stays NaN.
void quantize_fp8(const float* x, int n, float scale, std::uint8_t* dst) {
  for (int j = 0; j < n; ++j) dst[j] = float_to_fp8e4m3_bits(x[j] / scale);
}

}  // namespace

Status fused_rms_norm(const RmsNormParams& p, bool with_residual, int threads) {
  return with_dtype(p.x.dtype, [&](auto e) {
    using E = decltype(e);
    using S = typename E::S;
    const float inv_hidden = static_cast<float>(1.0 / static_cast<double>(p.hidden));
    parallel_chunks(p.rows, threads_for(threads, p.rows, p.hidden), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const S* x = static_cast<const S*>(p.x.data) + r * p.x.row_stride;
        const S* res = with_residual ? static_cast<const S*>(p.residual.data) + r * p.residual.row_stride : nullptr;
        S* ro = with_residual ? static_cast<S*>(p.residual_out.data) + r * p.residual_out.row_stride : nullptr;
        S* y = static_cast<S*>(p.y.data) + r * p.y.row_stride;
        norm_row<E>(x, res, ro, static_cast<const S*>(p.weight), y, p.hidden, p.eps, inv_hidden);
      }
    });
    return Status::Ok();
  });
}

Status fused_silu_and_mul(const SiluMulParams& p, int threads) {
  return with_dtype(p.gate.dtype, [&](auto e) {
    using E = decltype(e);
    using S = typename E::S;
    parallel_chunks(p.rows, threads_for(threads, p.rows, p.d), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const S* g = static_cast<const S*>(p.gate.data) + r * p.gate.row_stride;
        const S* u = static_cast<const S*>(p.up.data) + r * p.up.row_stride;
        S* o = static_cast<S*>(p.out.data) + r * p.out.row_stride;
        for (std::int64_t j = 0; j < p.d; ++j) o[j] = E::st(fused::silu_mul(E::ld(g[j]), E::ld(u[j])));
      }
    });
    return Status::Ok();
  });
}

Status fused_apply_rotary(const RopeParams& p, int threads) {
  const int rot = p.effective_rotary_dim();
  const RotaryAngles angles(p.rotary, p.head_dim);
  const int half = angles.half();
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  const int heads = p.heads_q + p.heads_k;
  return with_dtype(p.q.dtype, [&](auto e) {
    using E = decltype(e);
    using S = typename E::S;
    parallel_chunks(tokens, threads_for(threads, tokens, static_cast<double>(heads) * p.head_dim),
                    [&](std::int64_t t0, std::int64_t t1) {
      std::vector<float> cs(static_cast<std::size_t>(half)), sn(static_cast<std::size_t>(half));
      for (std::int64_t t = t0; t < t1; ++t) {
        const std::int64_t b = t / p.seqlen, s = t % p.seqlen;
        const std::int32_t pos = p.positions ? p.positions[t] : static_cast<std::int32_t>(s);
        for (int i = 0; i < half; ++i) angles.at(pos, i, &cs[i], &sn[i]);  // validated: pos inside the tables
        for_each_qk_head<S>(p, b, s, [&](int which, const S* src, S* dst) {
          // The dims past the rotary part: left as they are in place, copied into a separate output.
          const bool copy_tail = (which == 0 ? p.q_out : p.k_out).data != nullptr && rot < p.head_dim;
          rotate_head<E>(src, dst, cs.data(), sn.data(), half, p.head_dim, p.rotary.style, copy_tail);
        });
      }
    });
    return Status::Ok();
  });
}

Status fused_qk_norm_rope(const QkNormRopeParams& p, int threads) {
  const bool rotate = p.rotary.enabled();
  const int half = rotate ? p.effective_rotary_dim() / 2 : 0;
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  const int heads = p.heads_q + p.heads_k;
  const float inv_hidden = static_cast<float>(1.0 / static_cast<double>(p.head_dim));  // rms_norm's, hidden = head_dim
  return with_dtype(p.q.dtype, [&](auto e) {
    using E = decltype(e);
    using S = typename E::S;
    parallel_chunks(tokens, threads_for(threads, tokens, static_cast<double>(heads) * p.head_dim), [&](std::int64_t t0, std::int64_t t1) {
      std::vector<float> cs(static_cast<std::size_t>(half)), sn(static_cast<std::size_t>(half));
      std::vector<S> normed(static_cast<std::size_t>(p.head_dim));
      const RotarySpec spec = rotate ? p.rotary : RotarySpec::of_style(RopeStyle::kNeox);
      const RotaryAngles angles(spec, p.head_dim);
      for (std::int64_t t = t0; t < t1; ++t) {
        const std::int64_t b = t / p.seqlen, s = t % p.seqlen;
        const std::int32_t pos = p.positions ? p.positions[t] : static_cast<std::int32_t>(s);
        for (int i = 0; i < half; ++i) angles.at(pos, i, &cs[i], &sn[i]);  // validated: pos inside the tables
        for_each_qk_head<S>(p, b, s, [&](int which, const S* src, S* dst) {
          const S* w = static_cast<const S*>(which == 0 ? p.q_weight : p.k_weight);
          // rms_norm of the head (the same row function), rounded; then apply_rotary's rotation of it.
          norm_row<E>(src, nullptr, nullptr, w, normed.data(), p.head_dim, p.eps, inv_hidden, p.weight_offset);
          if (rotate)
            rotate_head<E>(normed.data(), dst, cs.data(), sn.data(), half, p.head_dim, p.rotary.style, true);
          else
            std::copy(normed.begin(), normed.end(), dst);
        });
      }
    });
    return Status::Ok();
  });
}

Status fused_rope_append_kv(const RopeAppendParams& p, int threads) {
  const bool rotate = p.rotary.enabled();
  const int half = rotate ? p.effective_rotary_dim() / 2 : 0;
  const int dv = p.effective_head_dim_v();
  const KVCacheView& c = p.cache;
  const bool fp8 = c.fp8();  // codes of x / scale (fused.h), else the dtype of k_new
  int page_shift = 0;
  while (c.paged() && (1 << page_shift) < c.page_size) ++page_shift;
  const std::int64_t tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  return with_dtype(p.k_new.dtype, [&](auto e) {
    using E = decltype(e);
    using S = typename E::S;
    const std::int64_t per_token = static_cast<std::int64_t>(p.heads_q + p.heads_kv) * p.head_dim + p.heads_kv * dv;
    parallel_chunks(tokens, threads_for(threads, tokens, per_token), [&](std::int64_t t0, std::int64_t t1) {
      std::vector<float> cs(static_cast<std::size_t>(half)), sn(static_cast<std::size_t>(half));
      std::vector<float> row(static_cast<std::size_t>(fp8 ? std::max(p.head_dim, dv) : 0));
      const RotarySpec spec = rotate ? p.rotary : RotarySpec::of_style(RopeStyle::kNeox);
      const RotaryAngles angles(spec, p.head_dim);
      for (std::int64_t t = t0; t < t1; ++t) {
        const int b = static_cast<int>(t / p.seqlen), s = static_cast<int>(t % p.seqlen);
        // Validated on the host: the length leaves room, the pages exist, the position is in the tables.
        const int j = fused::append_base(p.cache_seqlens[b], c.slots(), p.seqlen) + s;
        const std::int32_t pos = p.positions ? p.positions[t] : j;
        for (int i = 0; i < half; ++i) angles.at(pos, i, &cs[i], &sn[i]);
        std::int64_t block = 0, slot = 0;
        fused::slot_place(c.block_table, c.block_table_stride, page_shift, c.num_pages, c.paged(), b, j, &block, &slot);
        auto rotate_or_copy = [&](const S* src, S* dst, bool copy_tail) {
          if (rotate)
            rotate_head<E>(src, dst, cs.data(), sn.data(), half, p.head_dim, p.rotary.style, copy_tail);
          else if (dst != src)
            std::copy(src, src + p.head_dim, dst);
        };
        for (int h = 0; h < p.heads_kv; ++h) {
          const S* kn = static_cast<const S*>(p.k_new.data) + b * p.k_new.batch_stride + s * p.k_new.seq_stride +
                        h * p.k_new.head_stride;
          const S* vn = static_cast<const S*>(p.v_new.data) + b * p.v_new.batch_stride + s * p.v_new.seq_stride +
                        h * p.v_new.head_stride;
          const std::int64_t ko = block * c.k.batch_stride + slot * c.k.seq_stride + h * c.k.head_stride;
          const std::int64_t vo = block * c.v.batch_stride + slot * c.v.seq_stride + h * c.v.head_stride;
          if (fp8) {  // K rotated in fp32, V as it is, each divided by its head's scale and quantized
            rotate_head_f32<E>(kn, row.data(), cs.data(), sn.data(), half, p.head_dim, p.rotary.style);
            quantize_fp8(row.data(), p.head_dim, c.k_scale[h], static_cast<std::uint8_t*>(c.k.data) + ko);
            for (int d = 0; d < dv; ++d) row[d] = E::ld(vn[d]);
            quantize_fp8(row.data(), dv, c.v_scale[h], static_cast<std::uint8_t*>(c.v.data) + vo);
            continue;
          }
          rotate_or_copy(kn, static_cast<S*>(c.k.data) + ko, true);
          std::copy(vn, vn + dv, static_cast<S*>(c.v.data) + vo);
        }
        const TensorView& qo = p.q_out.data ? p.q_out : p.q;
        for (int h = 0; h < p.heads_q; ++h) {
          const S* src = static_cast<const S*>(p.q.data) + b * p.q.batch_stride + s * p.q.seq_stride + h * p.q.head_stride;
          S* dst = static_cast<S*>(qo.data) + b * qo.batch_stride + s * qo.seq_stride + h * qo.head_stride;
          rotate_or_copy(src, dst, p.q_out.data != nullptr);
        }
      }
    });
    return Status::Ok();
  });
}

}  // namespace cpu
}  // namespace flashcpp
