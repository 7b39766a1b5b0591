// `flashcpp check --area backward`: attention_backward (include/flashcpp/backward.h) on the chosen
// backend against the fp64 reference backward, on fresh random inputs.
//
// A case: q, k, v, dout ~ normal(0, 1) rounded to the dtype (dL/dLSE too in the _dlse cases), the
// forward run on the same backend (its o and LSE are what the backward reads, as in training), then
// the backward into poisoned outputs and a poisoned workspace inside NaN guard zones. The truth is
// cpu::reference_attention_backward in fp64 (P and D recomputed exactly from the same inputs).
//
// Tolerance: the rule. A "plain" same-dtype implementation (plain_backward below: what a
// framework's math path computes in the dtype: every matrix product accumulated in fp32 and rounded
// to the dtype, the softmax in fp32 rounded to the dtype, every elementwise step rounded) sets the
// band: per gradient tensor t (dq, dk, dv), every element must satisfy
//     |out - ref| <= atol_t + 2 * max|plain_t - ref_t|,   atol_t = 1e-7 + a * max|ref_t|
// with a = 2e-6 (fp32) or 1e-3 (bf16, fp16): small, and scaled to the tensor (gradients shrink as
// sequences grow). In fp32 the atol is about half of the band: the backward recomputes P from the
// forward's fp32 LSE, whose rounding (half an ulp of |LSE|, 2e-6 at |LSE| ~ 40 with ALiBi) is a
// relative error of P that a plain implementation, which never stores an LSE, does not have; a GPU
// kernel has it too (measured: up to 1.1e-6 of max|ref| with ALiBi, 1e-7 to 4e-7 otherwise). An LSE
// off by d scales its row of P by exp(d), so a dq row moves by d of itself and a dk or dv row by at most
// d of the sum it is made of: in fp32, a = max(2e-6, 2 ulp of the largest |LSE| the forward stored),
// since the forward's LSE is itself a rounded sum (the CPU forward with ALiBi, |LSE| in [32, 64): an
// error of 0.87 ulp = 3.3e-6 of a dq element, over the flat 2e-6 on one seed in fourteen). The plain
// implementation must itself agree with the truth within a sanity bound (1e-3 of the largest
// gradient for fp32, 1/4 for 16-bit), else the case fails as a harness or mask bug.
//
// What o's rounding alone moves, per element. The backward reads the forward's o in the dtype and
// takes D = dO . o, as FA2/FA3/FA4 and cuDNN do (so torch's own fused bf16 SDPA backward, the
// issue's yardstick, carries this error too); the plain implementation never reads o (its D is
// sum_j P dP). In a row whose P is nearly one-hot and whose |dP| is large, dS = P (dP - D) is a
// small difference of large terms, so o's half-ulp rounding (2^-9 of |o| in bf16) becomes a large
// relative error of that row's dq and of the dk, dv it reaches. The softcap-5 bf16 case failed so
// on the CPU backend in 3 of 126 seeds (at seed 2114 a dq row came out 1.6x its true value: dP ~
// -24, P ~ (0.997, 0.003), D off by 0.05), and a GPU kernel inherits the same. So each element's
// band adds |truth_o - truth|, where truth_o is the fp64 reference with D = dO . o from the stored
// o (reference_attention_backward's delta_from_o): exactly what that input's rounding moves, no
// more; a wrong kernel does not track truth_o.
//
// Per-row statistics: a row is one head_dim vector of dq (a query row of a head), dk or dv (a key row
// of a KV head); p50/p99/max over all of them. NaN cases put a NaN in q and dout of the last query
// row of every sequence under masks where that row sees every key (none, causal with seqlen_q <=
// seqlen_k): the truth is NaN exactly in that row's dq and in every dk and dv of its KV head, and
// that is the only passing value there (backward.h's NaN rule); every other element as usual.
//
// CUDA: the library answers (select_backward_kernel through attention_backward_workspace_size);
// until the backward kernels land every CUDA case is UNSUPPORTED with its sentence, never PASS.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/half.h"
#include "flashcpp/masks.h"
#include "harness/harness.h"

namespace flashcpp::harness {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// One backward case: a Case of the prefill table's kind, plus the backward's own switches.
struct BwdCase {
  Case c;
  bool dlse = false;           ///< a random dL/dLSE as well
  bool deterministic = false;  ///< AttnBackwardParams::deterministic
  std::string name() const {
    return "bwd_" + c.name() + (dlse ? "_dlse" : "") + (deterministic ? "_det" : "");
  }
};

constexpr double kAtolFloor = 1e-7, kAtolRelF32 = 2e-6, kAtolRel16 = 1e-3;
/// fp32: the relative atol is at least this many ulps of the largest |LSE| (see the header).
constexpr double kLseUlpsF32 = 2.0;
/// The workspace's alignment (backward.h: 256 bytes).
constexpr std::uintptr_t kWorkspaceAlign = 256;
constexpr double kPlainFactor = 2.0;
constexpr double kPlainSanityF32 = 1e-3, kPlainSanity16 = 0.25;

float round_t(DType t, float x) { return round_to_dtype(t, x); }

// ---- inputs ----------------------------------------------------------------------------------------

/// Host inputs of a case, in the case's layout (varlen: packed).
struct Inputs {
  std::vector<std::uint8_t> q, k, v, dout;
  std::vector<float> dlse, alibi;
  std::vector<std::int32_t> cu_q, cu_k;
  BlockMask sparse;
  std::int64_t rows_q = 0, rows_k = 0;
};

void fill(std::vector<std::uint8_t>& buf, DType dt, std::int64_t n, std::mt19937_64& rng) {
  buf.assign(static_cast<std::size_t>(n) * dtype_size(dt), 0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int64_t i = 0; i < n; ++i) store_from_float(buf.data(), dt, i, nd(rng));
}

TensorView view_of(const Case& c, void* data, int heads, int seqlen) {
  const std::int64_t d = c.head_dim;
  if (c.mask.is_varlen()) return TensorView{data, c.dtype, 0, heads * d, d};
  return c.layout == Layout::kBhsd ? bhsd_view(data, c.dtype, seqlen, heads, d) : bshd_view(data, c.dtype, seqlen, heads, d);
}

Status build_inputs(const BwdCase& bc, std::uint64_t seed, Inputs* in) {
  const Case& c = bc.c;
  std::mt19937_64 rng(seed);
  in->rows_q = c.total_q();
  in->rows_k = c.total_k();
  const std::int64_t nq = in->rows_q * c.heads_q * c.head_dim, nk = in->rows_k * c.heads_kv * c.head_dim;
  fill(in->q, c.dtype, nq, rng);
  fill(in->k, c.dtype, nk, rng);
  fill(in->v, c.dtype, nk, rng);
  fill(in->dout, c.dtype, nq, rng);
  if (bc.dlse) {
    in->dlse.resize(static_cast<std::size_t>(in->rows_q * c.heads_q));
    std::normal_distribution<float> nd(0.f, 1.f);
    for (float& x : in->dlse) x = nd(rng);
  }
  if (c.mask.alibi) {
    const int nb = c.mask.alibi_per_batch ? c.batch : 1;
    in->alibi.resize(static_cast<std::size_t>(nb) * c.heads_q);
    for (int b = 0; b < nb; ++b)
      for (int h = 0; h < c.heads_q; ++h)
        in->alibi[static_cast<std::size_t>(b) * c.heads_q + h] = std::exp2(-8.f * (h + 1) / c.heads_q) * (1.f + 0.25f * b);
  }
  if (c.mask.is_varlen()) {
    const auto& lk = c.mask.varlen_k.empty() ? c.mask.varlen_q : c.mask.varlen_k;
    in->cu_q.assign(1, 0);
    in->cu_k.assign(1, 0);
    for (std::size_t b = 0; b < c.mask.varlen_q.size(); ++b) {
      in->cu_q.push_back(in->cu_q.back() + c.mask.varlen_q[b]);
      in->cu_k.push_back(in->cu_k.back() + lk[b]);
    }
  }
  if (c.mask.is_block_sparse()) {
    // Random blocks: absent, full or partial (random element bits), per head when asked.
    const int nb = c.mask.sparse_per_head ? c.batch : 1, nh = c.mask.sparse_per_head ? c.heads_q : 1;
    const int bm = c.mask.sparse_block_m, bn = c.mask.sparse_block_n;
    const int qb = (c.seqlen_q + bm - 1) / bm, kb = (c.seqlen_k + bn - 1) / bn;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<double> kind(static_cast<std::size_t>(nb) * nh * qb * kb);
    for (double& x : kind) x = u(rng);
    std::vector<std::uint8_t> dense(static_cast<std::size_t>(nb) * nh * c.seqlen_q * c.seqlen_k);
    std::bernoulli_distribution bit(0.5);
    for (int b = 0; b < nb; ++b)
      for (int h = 0; h < nh; ++h)
        for (int i = 0; i < c.seqlen_q; ++i)
          for (int j = 0; j < c.seqlen_k; ++j) {
            const double x = kind[((static_cast<std::size_t>(b) * nh + h) * qb + i / bm) * kb + j / bn];
            dense[((static_cast<std::size_t>(b) * nh + h) * c.seqlen_q + i) * c.seqlen_k + j] =
                x < 0.35 ? 0 : x < 0.7 ? 1 : bit(rng);
          }
    FLASHCPP_RETURN_IF_ERROR(
        build_block_sparse_from_dense({c.seqlen_q, c.seqlen_k, bm, bn, nb, nh}, dense.data(), &in->sparse));
  }
  if (c.mask.nan_inputs) {
    // The last row of every sequence, head b % heads_q: NaN in q and in dout (backward.h: that row
    // sees every key under the masks the NaN cases use, so the truth is fully specified).
    const int nseq = c.batch;
    for (int b = 0; b < nseq; ++b) {
      const std::int64_t first = c.mask.is_varlen() ? in->cu_q[b] : static_cast<std::int64_t>(b) * c.seqlen_q;
      const int len = c.mask.is_varlen() ? in->cu_q[b + 1] - in->cu_q[b] : c.seqlen_q;
      if (len == 0) continue;
      const int h = b % c.heads_q;
      const TensorView tq = view_of(c, nullptr, c.heads_q, c.seqlen_q);
      const std::int64_t off = (c.mask.is_varlen() ? (first + len - 1) * tq.seq_stride
                                                   : b * tq.batch_stride + (len - 1) * tq.seq_stride) +
                               h * tq.head_stride;
      store_from_float(in->q.data(), c.dtype, off + 5, NAN);
      store_from_float(in->dout.data(), c.dtype, off + 9, NAN);
    }
  }
  return Status::Ok();
}

// ---- the plain same-dtype backward --------------------------------------------------------------------

struct Grads {
  std::vector<double> dq, dk, dv;  // packed (rows, heads, head_dim), as cpu::RefGrads
};

/// The rules of attention.h once more, element by element (a fourth writing, after the reference,
/// MaskRules and plain.cc: a slip in any of them shows as a disagreement with the truth).
bool visible(const MaskParams& m, int len_q, int len_k, int b, int h, int i, int j) {
  const int ia = i + len_k - len_q;
  const bool global_query = m.global_queries && ia < m.global_tokens;
  if (m.causal && j > ia) return false;
  if (m.window_right >= 0 && !global_query && j > ia + m.window_right) return false;
  if (m.window_left >= 0 && !global_query && j >= m.global_tokens && j < ia - m.window_left) return false;
  if (m.block_sparse && !block_sparse_visible(*m.block_sparse, b, h, i, j)) return false;
  return true;
}

void plain_backward(const BwdCase& bc, const AttnBackwardParams& p, Grads* g) {
  const Case& c = bc.c;
  const DType t = c.dtype;
  const MaskParams& m = p.mask;
  const bool varlen = m.is_varlen();
  const int d = c.head_dim, group = c.heads_q / c.heads_kv;
  const std::int64_t rows_q = c.total_q(), rows_k = c.total_k();
  g->dq.assign(static_cast<std::size_t>(rows_q * c.heads_q * d), 0.0);
  g->dk.assign(static_cast<std::size_t>(rows_k * c.heads_kv * d), 0.0);
  g->dv.assign(g->dk.size(), 0.0);
  const float scale = p.effective_scale(), cap = m.softcap;
  auto at = [&](const TensorView& v, int b, std::int64_t first, int row, int h) {
    return (varlen ? (first + row) * v.seq_stride : b * v.batch_stride + row * v.seq_stride) + h * v.head_stride;
  };
  for (int b = 0; b < c.batch; ++b) {
    const std::int64_t q0 = varlen ? m.cu_seqlens_q[b] : static_cast<std::int64_t>(b) * c.seqlen_q;
    const std::int64_t k0 = varlen ? m.cu_seqlens_k[b] : static_cast<std::int64_t>(b) * c.seqlen_k;
    const int lq = varlen ? m.cu_seqlens_q[b + 1] - m.cu_seqlens_q[b] : c.seqlen_q;
    const int lk = varlen ? m.cu_seqlens_k[b + 1] - m.cu_seqlens_k[b] : c.seqlen_k;
    for (int hk = 0; hk < c.heads_kv; ++hk) {
      std::vector<float> K(static_cast<std::size_t>(lk) * d), V(K.size()), dk_sum(K.size(), 0.f), dv_sum(K.size(), 0.f);
      for (int j = 0; j < lk; ++j)
        for (int e = 0; e < d; ++e) {
          K[static_cast<std::size_t>(j) * d + e] = load_as_float(p.k.data, t, at(p.k, b, k0, j, hk) + e);
          V[static_cast<std::size_t>(j) * d + e] = load_as_float(p.v.data, t, at(p.v, b, k0, j, hk) + e);
        }
      for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const float slope = m.alibi_slopes ? m.alibi_slopes[b * m.alibi_batch_stride + h] : 0.f;
        std::vector<float> dk_h(K.size(), 0.f), dv_h(K.size(), 0.f);
        std::vector<float> s(static_cast<std::size_t>(std::max(lk, 1))), pr(s.size()), dp(s.size()), th(s.size());
        std::vector<char> vis(s.size());
        std::vector<float> q(d), dout(d), o(d), dq(d);
        for (int i = 0; i < lq; ++i) {
          for (int e = 0; e < d; ++e) {
            q[e] = load_as_float(p.q.data, t, at(p.q, b, q0, i, h) + e);
            dout[e] = load_as_float(p.dout.data, t, at(p.dout, b, q0, i, h) + e);
          }
          // Forward: S = round(q.k scale), softcap and ALiBi rounded, P = round(softmax in fp32).
          float mx = -INFINITY;
          bool any = false;
          for (int j = 0; j < lk; ++j) {
            vis[j] = visible(m, lq, lk, b, h, i, j);
            if (!vis[j]) continue;
            any = true;
            float dot = 0.f;
            for (int e = 0; e < d; ++e) dot += q[e] * K[static_cast<std::size_t>(j) * d + e];
            float x = round_t(t, dot * scale);
            th[j] = 0.f;
            if (cap > 0.f) {
              th[j] = std::tanh(x / cap);
              x = round_t(t, cap * th[j]);
            }
            if (m.alibi_slopes) x = round_t(t, x + slope * static_cast<float>(j - (i + lk - lq)));
            s[j] = x;
            mx = std::max(mx, x);
          }
          if (!any) continue;  // dq = 0, nothing reaches dk, dv
          float sum = 0.f;
          for (int j = 0; j < lk; ++j)
            if (vis[j]) sum += (pr[j] = std::exp(s[j] - mx));
          std::fill(o.begin(), o.end(), 0.f);
          for (int j = 0; j < lk; ++j) {
            if (!vis[j]) continue;
            pr[j] = round_t(t, pr[j] / sum);
            for (int e = 0; e < d; ++e) o[e] += pr[j] * V[static_cast<std::size_t>(j) * d + e];
          }
          // Backward: dP = round(dO V^T); softmax's backward in fp32, rounded; softcap's and the
          // scale's chain rules rounded; the products accumulated in fp32 and rounded.
          float delta = 0.f;
          for (int j = 0; j < lk; ++j) {
            if (!vis[j]) continue;
            float acc = 0.f;
            for (int e = 0; e < d; ++e) acc += dout[e] * V[static_cast<std::size_t>(j) * d + e];
            dp[j] = round_t(t, acc);
            delta += pr[j] * dp[j];
          }
          const float dl = p.dlse ? p.dlse[varlen ? h * rows_q + q0 + i : (static_cast<std::int64_t>(b) * c.heads_q + h) * c.seqlen_q + i] : 0.f;
          std::fill(dq.begin(), dq.end(), 0.f);
          for (int j = 0; j < lk; ++j) {
            if (!vis[j]) continue;
            float ds = round_t(t, pr[j] * (dp[j] - delta + dl));
            if (cap > 0.f) ds = round_t(t, ds * (1.f - th[j] * th[j]));
            const float du = round_t(t, ds * scale);
            for (int e = 0; e < d; ++e) {
              dq[e] += du * K[static_cast<std::size_t>(j) * d + e];
              dk_h[static_cast<std::size_t>(j) * d + e] += du * q[e];
              dv_h[static_cast<std::size_t>(j) * d + e] += pr[j] * dout[e];
            }
          }
          double* dst = &g->dq[static_cast<std::size_t>(((q0 + i) * c.heads_q + h) * d)];
          for (int e = 0; e < d; ++e) dst[e] = round_t(t, dq[e]);
        }
        // GQA: each head's dK and dV in the dtype, summed over the group (repeat_interleave's backward).
        for (std::size_t e = 0; e < K.size(); ++e) {
          dk_sum[e] += round_t(t, dk_h[e]);
          dv_sum[e] += round_t(t, dv_h[e]);
        }
      }
      for (int j = 0; j < lk; ++j)
        for (int e = 0; e < d; ++e) {
          const std::size_t at_out = static_cast<std::size_t>(((k0 + j) * c.heads_kv + hk) * d + e);
          g->dk[at_out] = round_t(t, dk_sum[static_cast<std::size_t>(j) * d + e]);
          g->dv[at_out] = round_t(t, dv_sum[static_cast<std::size_t>(j) * d + e]);
        }
    }
  }
}

// ---- one case ----------------------------------------------------------------------------------------

void run_backward_case(const BwdCase& bc, const RunConfig& cfg, CaseResult* r) {
  const Case& c = bc.c;
  Inputs in;
  if (const Status st = build_inputs(bc, r->seed, &in); !st.ok()) {
    r->status = CaseStatus::kFail;
    r->message = "building the inputs failed: " + st.to_string();
    return;
  }
  const std::size_t es = dtype_size(c.dtype);
  BufferSpace sp;
  auto add_bytes = [&](const void* src, std::size_t n, bool output) {
    const int id = sp.add(n, output);
    if (src) std::memcpy(sp.host(id), src, n);
    return id;
  };
  const int iq = add_bytes(in.q.data(), in.q.size(), false), ik = add_bytes(in.k.data(), in.k.size(), false);
  const int iv = add_bytes(in.v.data(), in.v.size(), false), ido = add_bytes(in.dout.data(), in.dout.size(), false);
  const std::int64_t nq = in.rows_q * c.heads_q * c.head_dim, nk = in.rows_k * c.heads_kv * c.head_dim;
  // The forward's o and LSE: fetched after the run (the band below reads their host copies).
  const int io = sp.add(static_cast<std::size_t>(nq) * es, true);
  const int ilse = sp.add(static_cast<std::size_t>(in.rows_q * c.heads_q) * sizeof(float), true);
  const int idlse = in.dlse.empty() ? -1 : add_bytes(in.dlse.data(), in.dlse.size() * sizeof(float), false);
  const int ial = in.alibi.empty() ? -1 : add_bytes(in.alibi.data(), in.alibi.size() * sizeof(float), false);
  const int icq = in.cu_q.empty() ? -1 : add_bytes(in.cu_q.data(), in.cu_q.size() * 4, false);
  const int ick = in.cu_k.empty() ? -1 : add_bytes(in.cu_k.data(), in.cu_k.size() * 4, false);
  const BlockSparseMask& hbs = in.sparse.view();
  int irp = -1, ici = -1, ipa = -1, iem = -1;
  if (c.mask.is_block_sparse()) {
    irp = add_bytes(hbs.row_ptr, in.sparse.row_ptr().size() * 4, false);
    ici = add_bytes(hbs.col_idx, std::max<std::size_t>(1, in.sparse.col_idx().size()) * 4, false);
    ipa = add_bytes(hbs.partial, std::max<std::size_t>(1, in.sparse.partial().size()) * 4, false);
    iem = add_bytes(hbs.element_masks, std::max<std::size_t>(1, in.sparse.element_masks().size()) * 8, false);
  }
  const int idq = sp.add(static_cast<std::size_t>(nq) * es, true);
  const int idk = sp.add(static_cast<std::size_t>(nk) * es, true), idv = sp.add(static_cast<std::size_t>(nk) * es, true);

  // Params over the buffers as they are now (host) or after materialize (device).
  BlockSparseMask bs = hbs;
  auto params = [&]() {
    AttnBackwardParams p;
    p.batch = c.batch;
    p.seqlen_q = c.seqlen_q;
    p.seqlen_k = c.seqlen_k;
    p.heads_q = c.heads_q;
    p.heads_kv = c.heads_kv;
    p.head_dim = c.head_dim;
    p.q = view_of(c, sp.ptr(iq), c.heads_q, c.seqlen_q);
    p.k = view_of(c, sp.ptr(ik), c.heads_kv, c.seqlen_k);
    p.v = view_of(c, sp.ptr(iv), c.heads_kv, c.seqlen_k);
    p.o = view_of(c, sp.ptr(io), c.heads_q, c.seqlen_q);
    p.dout = view_of(c, sp.ptr(ido), c.heads_q, c.seqlen_q);
    p.dq = view_of(c, sp.ptr(idq), c.heads_q, c.seqlen_q);
    p.dk = view_of(c, sp.ptr(idk), c.heads_kv, c.seqlen_k);
    p.dv = view_of(c, sp.ptr(idv), c.heads_kv, c.seqlen_k);
    p.lse = static_cast<const float*>(sp.ptr(ilse));
    p.dlse = idlse >= 0 ? static_cast<const float*>(sp.ptr(idlse)) : nullptr;
    p.softmax_scale = c.softmax_scale;
    p.deterministic = bc.deterministic;
    MaskParams& m = p.mask;
    m.causal = c.mask.causal;
    m.window_left = c.mask.window_left;
    m.window_right = c.mask.window_right;
    m.global_tokens = c.mask.global_tokens;
    m.global_queries = c.mask.global_queries;
    m.softcap = c.mask.softcap;
    if (ial >= 0) {
      m.alibi_slopes = static_cast<const float*>(sp.ptr(ial));
      m.alibi_batch_stride = c.mask.alibi_per_batch ? c.heads_q : 0;
    }
    if (icq >= 0) {
      m.cu_seqlens_q = static_cast<const std::int32_t*>(sp.ptr(icq));
      m.cu_seqlens_k = static_cast<const std::int32_t*>(sp.ptr(ick));
      m.total_q = in.rows_q;
      p.total_k = in.rows_k;
    }
    if (irp >= 0) {
      bs.row_ptr = static_cast<const std::int32_t*>(sp.ptr(irp));
      bs.col_idx = static_cast<const std::int32_t*>(sp.ptr(ici));
      bs.partial = static_cast<const std::int32_t*>(sp.ptr(ipa));
      bs.element_masks = in.sparse.element_masks().empty() ? nullptr : static_cast<const std::uint64_t*>(sp.ptr(iem));
      m.block_sparse = &bs;
    }
    return p;
  };
  RunOptions ro;
  ro.backend = cfg.backend;
  ro.cpu_threads = cfg.cpu_threads;
  // The backward takes a kernel family ("sm80", "sm90", "sm90ws"); a prefill config name (--cuda-config
  // with --area all) names no backward kernel, so the backward's own choice runs (its name is reported).
  const std::string& fam = cfg.cuda_config;
  if (fam == "sm80" || fam == "sm90" || fam == "sm90ws") ro.cuda_config = fam;

  // What the library chooses, and the workspace it needs (on CUDA today: Unsupported, reported).
  KernelChoice choice;
  std::size_t ws_bytes = 0;
  Status st = select_backward_kernel(params(), ro, &choice);
  if (st.ok()) st = attention_backward_workspace_size(params(), ro, &ws_bytes);
  r->kernel = choice.id == KernelId::kCpuTiled       ? "cpu_tiled_backward"
              : choice.id == KernelId::kCpuReference ? "cpu_reference_fp64_backward"
              : choice.id == KernelId::kNone         ? "backward"
                                                     : std::string(kernel_name(choice.id)) + "_backward";
  r->kernel_reason = choice.reason;
  int iws = -1;
  if (st.ok() && ws_bytes > 0) iws = sp.add(ws_bytes + kWorkspaceAlign, true);
  if (st.ok()) st = sp.materialize(cfg.backend);
  double ms = NAN;
  if (st.ok()) {
    // The forward on the same backend: its o and LSE are the backward's inputs.
    AttnParams f = params().forward();
    f.lse = static_cast<float*>(sp.ptr(ilse));
    st = attention_forward(f, ro);
  }
  if (st.ok()) {
    AttnBackwardParams p = params();
    if (iws >= 0) {
      const auto base = reinterpret_cast<std::uintptr_t>(sp.ptr(iws));
      p.workspace = reinterpret_cast<void*>((base + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign);
      p.workspace_bytes = ws_bytes;
    }
    const auto t0 = Clock::now();
    st = attention_backward(p, ro);
    if (st.ok()) st = sp.fetch();
    ms = ms_since(t0);
  }
  r->ms = ms;
  if (st.code() == StatusCode::kUnsupported) {
    r->status = CaseStatus::kUnsupported;
    r->message = st.message();
    return;
  }
  if (!st.ok()) {
    r->status = CaseStatus::kFail;
    r->message = st.to_string();
    return;
  }

  // The truth and the plain implementation, on the host copies of the inputs.
  AttnBackwardParams hp;
  hp.batch = c.batch;
  hp.seqlen_q = c.seqlen_q;
  hp.seqlen_k = c.seqlen_k;
  hp.heads_q = c.heads_q;
  hp.heads_kv = c.heads_kv;
  hp.head_dim = c.head_dim;
  hp.q = view_of(c, in.q.data(), c.heads_q, c.seqlen_q);
  hp.k = view_of(c, in.k.data(), c.heads_kv, c.seqlen_k);
  hp.v = view_of(c, in.v.data(), c.heads_kv, c.seqlen_k);
  hp.dout = view_of(c, in.dout.data(), c.heads_q, c.seqlen_q);
  hp.dlse = in.dlse.empty() ? nullptr : in.dlse.data();
  hp.softmax_scale = c.softmax_scale;
  hp.mask = params().mask;
  if (ial >= 0) hp.mask.alibi_slopes = in.alibi.data();
  if (icq >= 0) {
    hp.mask.cu_seqlens_q = in.cu_q.data();
    hp.mask.cu_seqlens_k = in.cu_k.data();
  }
  if (irp >= 0) hp.mask.block_sparse = in.sparse.get();
  cpu::RefGrads truth, truth_o;
  const auto t0 = Clock::now();
  st = cpu::reference_attention_backward(hp, &truth, cfg.cpu_threads);
  // The same with D = dO . o from the forward's stored o: what o's rounding alone does (header).
  hp.o = view_of(c, sp.host(io), c.heads_q, c.seqlen_q);
  if (st.ok()) st = cpu::reference_attention_backward(hp, &truth_o, cfg.cpu_threads, /*delta_from_o=*/true);
  r->ref_ms = ms_since(t0);
  r->reference = "cpu_fp64";
  if (!st.ok()) {
    r->status = CaseStatus::kFail;
    r->message = "ground truth failed: " + st.to_string();
    return;
  }
  Grads plain;
  plain_backward(bc, hp, &plain);

  // The band per tensor, from the plain implementation's error (NaN against NaN agrees).
  const bool f32 = c.dtype == DType::kF32;
  double atol_rel = f32 ? kAtolRelF32 : kAtolRel16;
  const double sanity = f32 ? kPlainSanityF32 : kPlainSanity16;
  if (f32) {
    const auto* lse = reinterpret_cast<const float*>(sp.host(ilse));
    float top_lse = 0.f;
    for (std::int64_t i = 0; i < in.rows_q * c.heads_q; ++i)
      if (std::isfinite(lse[i])) top_lse = std::max(top_lse, std::fabs(lse[i]));
    atol_rel = std::max(atol_rel, kLseUlpsF32 * fp32_ulp(top_lse));
  }
  struct Part {
    const char* name;
    int id;
    const std::vector<double>* truth;
    const std::vector<double>* truth_o;
    const std::vector<double>* plain;
    int heads;
  };
  const Part parts[3] = {{"dq", idq, &truth.dq, &truth_o.dq, &plain.dq, c.heads_q},
                         {"dk", idk, &truth.dk, &truth_o.dk, &plain.dk, c.heads_kv},
                         {"dv", idv, &truth.dv, &truth_o.dv, &plain.dv, c.heads_kv}};
  double band[3], plain_err = 0, max_band = 0, max_atol = 0;
  for (int t = 0; t < 3; ++t) {
    double e = 0, top = 0;
    for (std::size_t i = 0; i < parts[t].truth->size(); ++i) {
      const double want = (*parts[t].truth)[i], got = (*parts[t].plain)[i];
      if (std::isnan(want)) continue;
      e = std::max(e, std::isnan(got) ? INFINITY : std::fabs(got - want));
      top = std::max(top, std::fabs(want));
    }
    const double atol = kAtolFloor + atol_rel * top;
    if (!(e <= atol + sanity * top)) {
      r->status = CaseStatus::kFail;
      r->message = fmt::format("the harness's plain {} backward and the fp64 reference disagree on {} ({:.3g} > {:.3g} + {:g} "
                               "x max|{}| {:.3g}): a mask bug in one of them",
                               dtype_name(c.dtype), parts[t].name, e, atol, sanity, parts[t].name, top);
      return;
    }
    band[t] = atol + kPlainFactor * e;
    plain_err = std::max(plain_err, e);
    max_band = std::max(max_band, band[t]);
    max_atol = std::max(max_atol, atol);
  }
  // The JSON's tolerance: the largest atol_t and the largest band over dq, dk, dv (each tensor is
  // held to its own; the message of a failure names the element and its band).
  r->plain_max_abs_err = plain_err;
  r->tol.atol = max_atol;
  r->tol.rtol = 0;
  r->tol.plain_factor = kPlainFactor;
  r->effective_atol = max_band;

  // Guards, the test hook, then the comparison row by row (a row: one head_dim vector).
  for (int id : {idq, idk, idv}) r->guard_violations += sp.guard_violations(id);
  if (iws >= 0) r->guard_violations += sp.guard_violations(iws);
  if (r->guard_violations) r->message = fmt::format("{} byte(s) written outside the outputs and the workspace", r->guard_violations);
  ErrorStats stats{c.dtype, 0.0, 0.0};
  for (int t = 0; t < 3; ++t) {
    const Part& pt = parts[t];
    const std::int64_t n = static_cast<std::int64_t>(pt.truth->size());
    HostTensor out(c.dtype, n);
    // Gather the output into the packed order of the truth (the case's layout may be bhsd).
    const bool is_q = t == 0;
    const TensorView v = view_of(c, nullptr, pt.heads, is_q ? c.seqlen_q : c.seqlen_k);
    const std::int64_t rows = is_q ? in.rows_q : in.rows_k, seqlen = is_q ? c.seqlen_q : c.seqlen_k;
    for (std::int64_t row = 0; row < rows; ++row)
      for (int h = 0; h < pt.heads; ++h) {
        const std::int64_t src = c.mask.is_varlen() ? row * v.seq_stride + h * v.head_stride
                                                    : (row / seqlen) * v.batch_stride + (row % seqlen) * v.seq_stride +
                                                          h * v.head_stride;
        for (int e = 0; e < c.head_dim; ++e)
          out.set((row * pt.heads + h) * c.head_dim + e, load_as_float(sp.host(pt.id), c.dtype, src + e));
      }
    if (cfg.perturb_output) {
      std::vector<float> no_lse;
      Case pc = c;
      pc.return_lse = false;
      cfg.perturb_output(pc, out, no_lse);
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const double inherited = std::fabs((*pt.truth_o)[k] - (*pt.truth)[k]);  // o's rounding (header)
      stats.atol = band[t] + (std::isfinite(inherited) ? inherited : 0.0);
      stats.add(r, out.get(i), (*pt.truth)[k], [&] {
        const std::int64_t row = i / c.head_dim;
        return fmt::format("{}[row={},h={},d={}]", pt.name, row / pt.heads, row % pt.heads, i % c.head_dim);
      });
      if ((i + 1) % c.head_dim == 0) stats.end_row();
    }
  }
  stats.finish(r);
  if (c.mask.nan_inputs && r->nan_expected == 0 && r->message.empty())
    r->message = "a NaN-input case whose truth has no NaN tests nothing";
  const bool ok = r->nan_count == 0 && r->guard_violations == 0 && r->violations == 0 &&
                  (!c.mask.nan_inputs || r->nan_expected > 0);
  r->status = ok ? CaseStatus::kPass : CaseStatus::kFail;
}

// ---- the tables ------------------------------------------------------------------------------------

constexpr DType kBf16 = DType::kBF16, kF16 = DType::kF16, kF32 = DType::kF32;

BwdCase shape(int b, int sq, int sk, int hq, int hkv, int d, DType dt, bool causal = false) {
  BwdCase bc;
  Case& c = bc.c;
  c.batch = b;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = hq;
  c.heads_kv = hkv;
  c.head_dim = d;
  c.dtype = dt;
  c.mask.causal = causal;
  return bc;
}
BwdCase varlen(std::vector<int> lq, std::vector<int> lk, int hq, int hkv, int d, DType dt, bool causal) {
  const std::vector<int>& kk = lk.empty() ? lq : lk;
  BwdCase bc = shape(static_cast<int>(lq.size()), *std::max_element(lq.begin(), lq.end()),
                     *std::max_element(kk.begin(), kk.end()), hq, hkv, d, dt, causal);
  bc.c.mask.varlen_q = std::move(lq);
  bc.c.mask.varlen_k = std::move(lk);
  return bc;
}
BwdCase with(BwdCase bc, auto&& f) {
  f(bc);
  return bc;
}

std::vector<BwdCase> backward_cases(TableKind kind) {
  std::vector<BwdCase> v;
  // Odd sizes, causal and not, every dtype.
  for (int n : {1, 7, 127, 1000})
    for (bool causal : {false, true}) v.push_back(shape(n < 1000 ? 2 : 1, n, n, 2, 2, 64, n == 1000 ? kBf16 : kF32, causal));
  for (DType dt : {kBf16, kF16, kF32})
    for (int d : {64, 128, 256}) v.push_back(shape(1, 130, 127, 2, 1, d, dt, true));
  // GQA and MQA, q shorter and longer than k.
  v.push_back(shape(2, 127, 127, 4, 2, 64, kBf16, true));
  v.push_back(shape(1, 127, 127, 4, 1, 128, kF32, false));
  v.push_back(shape(1, 7, 300, 2, 2, 64, kF16, true));
  v.push_back(shape(1, 300, 7, 2, 2, 64, kF32, true));  // the first rows see no key: dq = 0
  // Every mask kind, in bf16 and fp32.
  for (DType dt : {kBf16, kF32}) {
    v.push_back(with(shape(1, 300, 300, 2, 2, 64, dt, true), [](BwdCase& b) { b.c.mask.window_left = 64; b.c.mask.window_right = 0; }));
    v.push_back(with(shape(1, 300, 300, 2, 1, 64, dt, false), [](BwdCase& b) {
      b.c.mask.window_left = 16;
      b.c.mask.window_right = 16;
      b.c.mask.global_tokens = 8;
      b.c.mask.global_queries = true;
    }));
    v.push_back(with(shape(1, 300, 300, 2, 2, 64, dt, true), [](BwdCase& b) {
      b.c.mask.window_left = 32;
      b.c.mask.global_tokens = 4;
    }));
    v.push_back(with(shape(1, 127, 127, 2, 2, 128, dt, true), [](BwdCase& b) {
      b.c.mask.softcap = 5.f;
      b.c.softmax_scale = 0.5f;  // scores of spread ~6: the cap bends them
    }));
    v.push_back(with(shape(2, 127, 127, 4, 2, 64, dt, false), [](BwdCase& b) {
      b.c.mask.alibi = true;
      b.c.mask.alibi_per_batch = true;
    }));
    v.push_back(varlen({1, 7, 127, 0, 200}, {}, 2, 2, 64, dt, true));
    v.push_back(varlen({1, 7, 50}, {10, 7, 127}, 2, 1, 128, dt, true));
    v.push_back(with(shape(1, 127, 127, 2, 2, 64, dt, false), [](BwdCase& b) {
      b.c.mask.sparse_block_m = 32;
      b.c.mask.sparse_block_n = 32;
    }));
    v.push_back(with(shape(2, 200, 200, 2, 1, 64, dt, true), [](BwdCase& b) {
      b.c.mask.sparse_block_m = 48;
      b.c.mask.sparse_block_n = 40;
      b.c.mask.sparse_per_head = true;
    }));
  }
  // Block-sparse masks whose blocks the CUDA backward's tiles divide (64x64 at head dims 64 and 128,
  // 32x64 at 256), so the kernel runs them (the blocks above it refuses with a sentence).
  v.push_back(with(shape(1, 300, 300, 2, 1, 64, kBf16, true), [](BwdCase& b) {
    b.c.mask.sparse_block_m = 128;
    b.c.mask.sparse_block_n = 64;
    b.c.mask.sparse_per_head = true;
  }));
  v.push_back(with(shape(1, 200, 260, 2, 2, 256, kF16, false), [](BwdCase& b) {
    b.c.mask.sparse_block_m = 64;
    b.c.mask.sparse_block_n = 128;
  }));
  // The SDPA layout through strides.
  v.push_back(with(shape(2, 127, 127, 4, 2, 64, kF16, true), [](BwdCase& b) { b.c.layout = Layout::kBhsd; }));
  // dL/dLSE, and deterministic dQ (with GQA: several heads add to the same tiles).
  v.push_back(with(shape(1, 127, 127, 2, 2, 64, kF32, true), [](BwdCase& b) { b.dlse = true; }));
  v.push_back(with(varlen({5, 100}, {9, 120}, 2, 2, 64, kBf16, true), [](BwdCase& b) { b.dlse = true; }));
  v.push_back(with(shape(1, 300, 300, 4, 1, 64, kF32, true), [](BwdCase& b) { b.deterministic = true; }));
  v.push_back(with(shape(1, 1000, 1000, 2, 2, 64, kBf16, true), [](BwdCase& b) { b.deterministic = true; }));
  // NaN in q and dout of rows that see every key.
  v.push_back(with(shape(2, 127, 127, 4, 2, 64, kBf16, true), [](BwdCase& b) { b.c.mask.nan_inputs = true; }));
  v.push_back(with(shape(1, 100, 130, 2, 2, 128, kF32, false), [](BwdCase& b) { b.c.mask.nan_inputs = true; }));
  v.push_back(with(varlen({3, 70, 40}, {5, 90, 40}, 2, 2, 64, kF16, true), [](BwdCase& b) { b.c.mask.nan_inputs = true; }));
  if (kind == TableKind::kFull) {
    v.push_back(shape(1, 4097, 4097, 1, 1, 64, kBf16, true));
    v.push_back(shape(1, 4097, 4097, 1, 1, 128, kF32, false));
    v.push_back(shape(1, 1000, 4097, 2, 1, 64, kF16, true));
    v.push_back(with(shape(1, 4097, 4097, 1, 1, 64, kBf16, true), [](BwdCase& b) { b.c.mask.window_left = 256; b.c.mask.window_right = 0; }));
    v.push_back(varlen({1000, 1, 2048}, {}, 2, 1, 64, kBf16, true));
    v.push_back(with(shape(1, 2048, 2048, 2, 2, 64, kBf16, true), [](BwdCase& b) {
      b.c.mask.sparse_block_m = 128;
      b.c.mask.sparse_block_n = 128;
    }));
    v.push_back(with(shape(1, 2048, 2048, 2, 1, 128, kBf16, true), [](BwdCase& b) { b.deterministic = true; }));
  }
  return v;
}

}  // namespace

std::vector<AreaCase> make_backward_table(TableKind kind, Backend /*backend*/) {
  std::vector<AreaCase> table;
  for (const BwdCase& bc : backward_cases(kind)) {
    table.push_back({bc.name(), [bc](const RunConfig& cfg) {
                       CaseResult r;
                       r.area = "backward";
                       r.c = bc.c;
                       r.name = bc.name();
                       r.seed = case_seed(cfg.seed, r.name);
                       run_guarded(&r, [&] { run_backward_case(bc, cfg, &r); });
                       return r;
                     }});
  }
  return table;
}

}  // namespace flashcpp::harness
