// fp64 naive attention: the ground truth every other backend is measured against.
//
// Deliberately simple and deliberately independent of src/common/mask_rules.h: visibility is
// decided per (query, key) pair straight from the rules written in the header comment of
// include/flashcpp/attention.h (cpu/reference_rules.h, which the fp64 backward shares), so that a
// slip in MaskRules (which the CUDA kernels and the tiled CPU backend share) shows up as a
// mismatch against this file instead of being copied. Inputs are read as double (fp64 inputs
// exactly, DType::kF64) and fp64 outputs are stored without rounding.
//
// Cost: O(batch * heads_q * seqlen_q * seqlen_k * head_dim) double FMAs, ~2 GFMA for one head
// of 4097 x 4097 x 64; fine for tests, far too slow for anything long (use the GPU reference).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "flashcpp/half.h"
#include "cpu/cpu_backend.h"
#include "cpu/parallel.h"
#include "cpu/reference_rules.h"

namespace flashcpp::cpu {
namespace {

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

using ref::row_offset;
using ref::Sequence;
using ref::sequence;
using ref::total_q_rows;
using ref::Visibility;

double dot(const double* a, const double* b, int n) {
  // Four partial sums only to break the FMA dependency chain; in double the order is immaterial.
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int d = 0;
  for (; d + 4 <= n; d += 4) {
    s0 += a[d] * b[d];
    s1 += a[d + 1] * b[d + 1];
    s2 += a[d + 2] * b[d + 2];
    s3 += a[d + 3] * b[d + 3];
  }
  for (; d < n; ++d) s0 += a[d] * b[d];
  return (s0 + s1) + (s2 + s3);
}

void load_rows(const TensorView& t, std::int64_t offset, std::int64_t rows, int dim, double* dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d)
      dst[r * dim + d] = load_as_double(t.data, t.dtype, offset + r * t.seq_stride + d);  // exact, fp64 too
}

/// One (batch, head) problem, every query row of it.
void reference_head(const AttnParams& p, int b, int h, RefOutput* out) {
  const MaskParams& m = p.mask;
  const bool varlen = m.is_varlen();
  const Sequence s = sequence(p, b);
  if (s.len_q <= 0) return;
  const int dim = p.head_dim, dim_v = p.effective_head_dim_v();
  const int hk = h / (p.heads_q / p.heads_kv);
  const double scale = p.effective_scale();
  const double softcap = m.softcap;
  const double slope = m.alibi_slopes ? m.alibi_slopes[b * m.alibi_batch_stride + h] : 0.0;
  const std::int64_t total_q = out->total_q;

  const int len_k = std::max(s.len_k, 0);
  std::vector<double> kd(static_cast<std::size_t>(len_k) * dim), vd(static_cast<std::size_t>(len_k) * dim_v), qd(dim);
  load_rows(p.k, row_offset(p.k, varlen, b, s.first_k, 0, hk), len_k, dim, kd.data());
  load_rows(p.v, row_offset(p.v, varlen, b, s.first_k, 0, hk), len_k, dim_v, vd.data());
  std::vector<double> score(static_cast<std::size_t>(len_k));
  std::vector<char> seen(static_cast<std::size_t>(len_k));
  std::vector<double> o(dim_v);

  Visibility vis(m, s, b, h);
  for (int i = 0; i < s.len_q; ++i) {
    const std::int64_t row = s.first_q + i;
    load_rows(p.q, row_offset(p.q, varlen, b, s.first_q, i, h), 1, dim, qd.data());
    vis.begin_row(i);
    const double ia = static_cast<double>(i) + len_k - s.len_q;
    double mx = kNegInfD;
    bool nan_score = false;  // a NaN score at a visible key: the row is NaN (attention.h)
    for (int j = 0; j < len_k; ++j) {
      seen[j] = vis.visible(i, j);
      if (!seen[j]) continue;
      double x = scale * dot(qd.data(), &kd[static_cast<std::size_t>(j) * dim], dim);
      if (softcap > 0) x = softcap * std::tanh(x / softcap);
      if (m.alibi_slopes) x += slope * (j - ia);
      score[j] = x;
      nan_score |= std::isnan(x);
      mx = std::max(mx, x);
    }
    std::fill(o.begin(), o.end(), 0.0);
    double lse = kNegInfD;
    if (nan_score) {
      std::fill(o.begin(), o.end(), std::numeric_limits<double>::quiet_NaN());
      lse = std::numeric_limits<double>::quiet_NaN();
    } else if (mx != kNegInfD) {  // at least one visible key with weight
      double sum = 0;
      for (int j = 0; j < len_k; ++j) {
        if (!seen[j]) continue;
        const double w = std::exp(score[j] - mx);
        sum += w;
        const double* vj = &vd[static_cast<std::size_t>(j) * dim_v];
        for (int d = 0; d < dim_v; ++d) o[d] += w * vj[d];
      }
      for (int d = 0; d < dim_v; ++d) o[d] /= sum;
      lse = mx + std::log(sum);
    }
    std::copy(o.begin(), o.end(), out->o.begin() + (row * p.heads_q + h) * dim_v);
    out->lse[static_cast<std::size_t>(h * total_q + row)] = lse;
  }
}

Status check_reference_params(const AttnParams& p) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0)
    return Status::Invalid("batch and sequence lengths must be >= 0");
  if (p.batch == 0 || p.seqlen_q == 0) return Status::Ok();
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0)
    return Status::Invalid("heads_q (" + std::to_string(p.heads_q) +
                           ") must be a positive multiple of heads_kv (" +
                           std::to_string(p.heads_kv) + ")");
  if (p.head_dim <= 0 || p.effective_head_dim_v() <= 0) return Status::Invalid("head_dim and head_dim_v must be > 0");
  if (!p.q.data || !p.k.data || !p.v.data) return Status::Invalid("q, k and v must not be null");
  return Status::Ok();
}

}  // namespace

std::int64_t varlen_lse_rows(const AttnParams& p) {
  return p.mask.total_q > 0 ? p.mask.total_q : p.mask.cu_seqlens_q[p.batch];
}

void fill_uncovered_rows(const AttnParams& p) {
  const MaskParams& m = p.mask;
  if (m.cu_seqlens_q == nullptr || m.total_q <= 0 || p.o.data == nullptr) return;
  const std::int64_t first = p.batch == 0 || p.seqlen_q == 0 ? 0 : m.cu_seqlens_q[p.batch];
  for (std::int64_t row = first; row < m.total_q; ++row)
    for (int h = 0; h < p.heads_q; ++h) {
      const std::int64_t at = row * p.o.seq_stride + h * p.o.head_stride;
      for (int d = 0; d < p.effective_head_dim_v(); ++d) store_from_float(p.o.data, p.o.dtype, at + d, 0.f);
      if (p.lse) p.lse[h * m.total_q + row] = -std::numeric_limits<float>::infinity();
    }
}

Status reference_attention(const AttnParams& p, RefOutput* out, int threads) {
  FLASHCPP_RETURN_IF_ERROR(check_reference_params(p));
  *out = RefOutput{};
  if (p.batch == 0 || p.seqlen_q == 0) return Status::Ok();
  out->total_q = total_q_rows(p);
  out->o.assign(static_cast<std::size_t>(out->total_q * p.heads_q * p.effective_head_dim_v()), 0.0);
  out->lse.assign(static_cast<std::size_t>(out->total_q * p.heads_q), kNegInfD);
  const std::int64_t heads = static_cast<std::int64_t>(p.batch) * p.heads_q;
  const double per_head = static_cast<double>(p.seqlen_q) * p.seqlen_k * (p.head_dim + p.effective_head_dim_v());
  parallel_for(heads, threads_for(threads, heads, per_head), [&](std::int64_t item) {
    reference_head(p, static_cast<int>(item / p.heads_q), static_cast<int>(item % p.heads_q), out);
  });
  return Status::Ok();
}

Status reference_forward(const AttnParams& p, const RunOptions& opt) {
  RefOutput ref;
  FLASHCPP_RETURN_IF_ERROR(reference_attention(p, &ref, opt.cpu_threads));
  if (p.batch == 0 || p.seqlen_q == 0) {
    fill_uncovered_rows(p);  // varlen with total_q: every packed row is uncovered
    return Status::Ok();
  }
  if (!p.o.data) return Status::Invalid("o must not be null");
  const bool varlen = p.mask.is_varlen();
  const int dim = p.effective_head_dim_v();
  const std::int64_t lse_rows = varlen ? varlen_lse_rows(p) : 0;
  fill_uncovered_rows(p);  // varlen rows past cu_seqlens_q[batch], when total_q says how many
  for (int b = 0; b < p.batch; ++b) {
    const Sequence s = sequence(p, b);
    for (int i = 0; i < s.len_q; ++i) {
      const std::int64_t row = s.first_q + i;
      for (int h = 0; h < p.heads_q; ++h) {
        const std::int64_t dst = row_offset(p.o, varlen, b, s.first_q, i, h);
        const double* src = &ref.o[static_cast<std::size_t>((row * p.heads_q + h) * dim)];
        for (int d = 0; d < dim; ++d)
          store_from_double(p.o.data, p.o.dtype, dst + d, src[d]);
        if (p.lse) {
          // LSE layout: (heads_q, total_q) when varlen (mask.total_q, or cu_seqlens_q[batch]),
          // else (batch, heads_q, seqlen_q).
          const std::int64_t at = varlen ? h * lse_rows + row
                                         : (static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q + i;
          p.lse[at] = static_cast<float>(ref.lse[static_cast<std::size_t>(h * ref.total_q + row)]);
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace flashcpp::cpu
