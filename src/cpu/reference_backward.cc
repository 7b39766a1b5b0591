// fp64 naive attention backward: the ground truth the tiled backward (and later the GPU kernels) are
// measured against, and the backward of DType::kF64 problems (torch.autograd.gradcheck).
//
// The textbook gradient, one (sequence, query head, query row) at a time, with the visibility rules
// of attention.h evaluated per (query, key) pair (cpu/reference_rules.h, shared with the fp64
// forward and independent of MaskRules and of the tile walk):
//
//   s(j)   = scale q.k(j), then softcap (cap tanh(s / cap)), then ALiBi (+ slope (j - ia))
//   P(j)   = softmax over the visible keys j of s(j), in double (the row's max, exp, sum)
//   dP(j)  = dO . V(j)
//   D      = sum_j P(j) dP(j) - dLSE          (= dO . O for the exact O; o is not read, unless
//                                               asked: D = dO . o - dLSE from the given o)
//   dS(j)  = P(j) (dP(j) - D)
//   dU(j)  = dS(j) scale (1 - tanh^2(scale q.k(j) / cap))   (the last factor only with softcap)
//   dQ    += dU(j) K(j),  dK(j) += dU(j) q,  dV(j) += P(j) dO
//
// P and D are recomputed from q, k, v and dout rather than taken from the forward's lse and o, so
// the result is the exact gradient of the forward's function at these inputs, whatever rounding
// the forward's outputs carry. With `delta_from_o`, D is dO . o of the given (rounded) o instead,
// as every FlashAttention-style backward computes it: the difference between the two is the part
// of a kernel's error that it inherits from o's rounding (check_backward.cc's band). A NaN score
// at a visible key makes the row's P NaN (attention.h), and the NaN then reaches dQ of the row and
// dK, dV of the keys it sees, nothing else.
//
// Work items are (batch, KV head): dK and dV of a key sum over the group's query heads inside one
// item, so no two threads add to the same element. Cost: about three times the fp64 forward.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "flashcpp/half.h"
#include "cpu/backward_backend.h"
#include "cpu/cpu_backend.h"
#include "cpu/parallel.h"
#include "cpu/reference_rules.h"

namespace flashcpp::cpu {
namespace {

using ref::row_offset;
using ref::Sequence;
using ref::sequence;
using ref::Visibility;

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();
constexpr double kNaND = std::numeric_limits<double>::quiet_NaN();

double dot(const double* a, const double* b, int n) {
  double s = 0;
  for (int d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

void load_rows(const TensorView& t, std::int64_t offset, std::int64_t rows, int dim, double* dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d) dst[r * dim + d] = load_as_double(t.data, t.dtype, offset + r * t.seq_stride + d);
}

/// Index of row (b, i) of head h in an LSE-shaped array (attention.h's layout).
std::int64_t lse_index(const AttnParams& p, std::int64_t lse_rows, int b, std::int64_t first_q, int i, int h) {
  return p.mask.is_varlen() ? h * lse_rows + first_q + i
                            : (static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q + i;
}

/// One (sequence b, KV head hk): every query head of the group, every row.
void reference_group(const AttnBackwardParams& bp, const AttnParams& p, int b, int hk, bool delta_from_o,
                     RefGrads* out) {
  const MaskParams& m = p.mask;
  const bool varlen = m.is_varlen();
  const Sequence s = sequence(p, b);
  const int len_q = std::max(s.len_q, 0), len_k = std::max(s.len_k, 0);
  if (len_q == 0 || len_k == 0) return;  // no pair: the gradients stay 0
  const int dim = p.head_dim, dim_v = p.effective_head_dim_v(), group = p.heads_q / p.heads_kv;
  const double scale = p.effective_scale();
  const double softcap = m.softcap;
  const std::int64_t lse_rows = varlen ? varlen_lse_rows(p) : 0;

  std::vector<double> kd(static_cast<std::size_t>(len_k) * dim), vd(static_cast<std::size_t>(len_k) * dim_v);
  load_rows(p.k, row_offset(p.k, varlen, b, s.first_k, 0, hk), len_k, dim, kd.data());
  load_rows(p.v, row_offset(p.v, varlen, b, s.first_k, 0, hk), len_k, dim_v, vd.data());
  std::vector<double> dk(kd.size(), 0.0), dv(vd.size(), 0.0);
  std::vector<double> qd(dim), dod(dim_v), od(dim_v), dq(dim);
  std::vector<double> score(static_cast<std::size_t>(len_k)), capgrad(score.size()), prob(score.size()),
      dp(score.size());
  std::vector<char> seen(score.size());

  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const double slope = m.alibi_slopes ? m.alibi_slopes[b * m.alibi_batch_stride + h] : 0.0;
    Visibility vis(m, s, b, h);
    for (int i = 0; i < len_q; ++i) {
      load_rows(p.q, row_offset(p.q, varlen, b, s.first_q, i, h), 1, dim, qd.data());
      load_rows(bp.dout, row_offset(bp.dout, varlen, b, s.first_q, i, h), 1, dim_v, dod.data());
      vis.begin_row(i);
      const double ia = static_cast<double>(i) + len_k - len_q;
      double mx = kNegInfD;
      bool nan_score = false, any = false;
      for (int j = 0; j < len_k; ++j) {
        seen[j] = vis.visible(i, j);
        if (!seen[j]) continue;
        any = true;
        double x = scale * dot(qd.data(), &kd[static_cast<std::size_t>(j) * dim], dim);
        capgrad[j] = 1.0;
        if (softcap > 0) {
          const double th = std::tanh(x / softcap);
          x = softcap * th;
          capgrad[j] = 1.0 - th * th;
        }
        if (m.alibi_slopes) x += slope * (j - ia);
        score[j] = x;
        nan_score |= std::isnan(x);
        mx = std::max(mx, x);
      }
      std::fill(dq.begin(), dq.end(), 0.0);
      if (any) {
        // The softmax of the visible scores (a NaN score makes the whole row NaN, attention.h).
        double sum = 0;
        for (int j = 0; j < len_k; ++j)
          if (seen[j]) sum += (prob[j] = nan_score ? kNaND : std::exp(score[j] - mx));
        double delta = 0;
        for (int j = 0; j < len_k; ++j) {
          if (!seen[j]) continue;
          prob[j] /= sum;
          dp[j] = dot(dod.data(), &vd[static_cast<std::size_t>(j) * dim_v], dim_v);
          if (!delta_from_o) delta += prob[j] * dp[j];
        }
        if (delta_from_o) {
          load_rows(bp.o, row_offset(bp.o, varlen, b, s.first_q, i, h), 1, dim_v, od.data());
          delta = dot(dod.data(), od.data(), dim_v);
        }
        if (bp.dlse) delta -= bp.dlse[lse_index(p, lse_rows, b, s.first_q, i, h)];
        for (int j = 0; j < len_k; ++j) {
          if (!seen[j]) continue;
          const double du = prob[j] * (dp[j] - delta) * scale * capgrad[j];
          const double* kj = &kd[static_cast<std::size_t>(j) * dim];
          double* dkj = &dk[static_cast<std::size_t>(j) * dim];
          double* dvj = &dv[static_cast<std::size_t>(j) * dim_v];
          for (int d = 0; d < dim; ++d) {
            dq[d] += du * kj[d];
            dkj[d] += du * qd[d];
          }
          for (int d = 0; d < dim_v; ++d) dvj[d] += prob[j] * dod[d];
        }
      }
      std::copy(dq.begin(), dq.end(), out->dq.begin() + ((s.first_q + i) * p.heads_q + h) * dim);
    }
  }
  for (int j = 0; j < len_k; ++j) {
    const std::size_t row = static_cast<std::size_t>((s.first_k + j) * p.heads_kv + hk);
    std::copy_n(&dk[static_cast<std::size_t>(j) * dim], dim, out->dk.begin() + row * dim);
    std::copy_n(&dv[static_cast<std::size_t>(j) * dim_v], dim_v, out->dv.begin() + row * dim_v);
  }
}

void zero_rows(const TensorView& t, std::int64_t first, std::int64_t end, int heads, int dim) {
  if (t.data == nullptr) return;
  for (std::int64_t row = first; row < end; ++row)
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < dim; ++d) store_from_float(t.data, t.dtype, row * t.seq_stride + h * t.head_stride + d, 0.f);
}

}  // namespace

void zero_uncovered_grads(const AttnBackwardParams& p) {
  const MaskParams& m = p.mask;
  if (!m.is_varlen() || p.batch < 0) return;
  if (m.total_q > 0) zero_rows(p.dq, p.batch == 0 ? 0 : m.cu_seqlens_q[p.batch], m.total_q, p.heads_q, p.head_dim);
  if (p.total_k > 0) zero_rows(p.dk, p.batch == 0 ? 0 : m.cu_seqlens_k[p.batch], p.total_k, p.heads_kv, p.head_dim);
  if (p.total_k > 0)
    zero_rows(p.dv, p.batch == 0 ? 0 : m.cu_seqlens_k[p.batch], p.total_k, p.heads_kv, p.effective_head_dim_v());
}

Status reference_attention_backward(const AttnBackwardParams& bp, RefGrads* out, int threads, bool delta_from_o) {
  *out = RefGrads{};
  const AttnParams p = bp.forward();
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0 || p.head_dim <= 0)
    return Status::Ok();  // nothing to compute (validation refuses the malformed shapes)
  out->total_q = ref::total_q_rows(p);
  out->total_k = ref::total_k_rows(p);
  out->dq.assign(static_cast<std::size_t>(out->total_q * p.heads_q * p.head_dim), 0.0);
  out->dk.assign(static_cast<std::size_t>(out->total_k * p.heads_kv * p.head_dim), 0.0);
  out->dv.assign(static_cast<std::size_t>(out->total_k * p.heads_kv * p.effective_head_dim_v()), 0.0);
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return Status::Ok();
  const std::int64_t groups = static_cast<std::int64_t>(p.batch) * p.heads_kv;
  const double per_group = 3.0 * (p.heads_q / p.heads_kv) * p.seqlen_q * p.seqlen_k * (p.head_dim + p.effective_head_dim_v());
  parallel_for(groups, threads_for(threads, groups, per_group), [&](std::int64_t item) {
    reference_group(bp, p, static_cast<int>(item / p.heads_kv), static_cast<int>(item % p.heads_kv), delta_from_o,
                    out);
  });
  return Status::Ok();
}

Status reference_backward(const AttnBackwardParams& p, const RunOptions& opt) {
  RefGrads g;
  FLASHCPP_RETURN_IF_ERROR(reference_attention_backward(p, &g, opt.cpu_threads));
  const AttnParams f = p.forward();
  const bool varlen = f.mask.is_varlen();
  const int dim = p.head_dim, dim_v = p.effective_head_dim_v();
  for (int b = 0; b < p.batch; ++b) {
    const Sequence s = sequence(f, b);
    for (int i = 0; i < s.len_q; ++i)
      for (int h = 0; h < p.heads_q; ++h) {
        const double* src = &g.dq[static_cast<std::size_t>(((s.first_q + i) * p.heads_q + h) * dim)];
        const std::int64_t dst = row_offset(p.dq, varlen, b, s.first_q, i, h);
        for (int d = 0; d < dim; ++d) store_from_double(p.dq.data, p.dq.dtype, dst + d, src[d]);
      }
    for (int j = 0; j < s.len_k; ++j)
      for (int h = 0; h < p.heads_kv; ++h) {
        const std::size_t row = static_cast<std::size_t>((s.first_k + j) * p.heads_kv + h);
        const std::int64_t dk = row_offset(p.dk, varlen, b, s.first_k, j, h);
        const std::int64_t dv = row_offset(p.dv, varlen, b, s.first_k, j, h);
        for (int d = 0; d < dim; ++d) store_from_double(p.dk.data, p.dk.dtype, dk + d, g.dk[row * dim + d]);
        for (int d = 0; d < dim_v; ++d) store_from_double(p.dv.data, p.dv.dtype, dv + d, g.dv[row * dim_v + d]);
      }
  }
  zero_uncovered_grads(p);
  return Status::Ok();
}

}  // namespace flashcpp::cpu
