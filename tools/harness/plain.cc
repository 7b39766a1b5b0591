// A plain fp32 attention: scores, softmax and P@V in fp32, one row at a time, no tiling, no
// online rescaling. It is not a backend. Its error against the fp64 reference is what rounding
// to fp32 alone costs on a given problem (the "plain same-dtype implementation" of the flash-attn
// tolerance rule), which sets the fp32 band: a problem whose scores reach |s| ~ 250 (ALiBi with
// large slopes) or whose dot products are large (softmax_scale 1) cannot be computed in fp32 to
// 1e-6, by any algorithm. See docs/tolerances.md.
//
// Visibility is written here a third time, straight from the rules in attention.h (the fp64
// reference and MaskRules are the other two); run_case fails a case when this implementation and
// the reference disagree by more than rounding, so a mask slip in either cannot widen the band.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "harness/harness.h"

namespace flashcpp::harness {

namespace {

struct Seq {
  int lq = 0, lk = 0;
  std::int64_t q0 = 0, k0 = 0;  ///< first packed row (varlen) of the sequence
};

Seq seq_of(const AttnParams& p, int b) {
  Seq s;
  if (p.mask.cu_seqlens_q) {
    s.q0 = p.mask.cu_seqlens_q[b];
    s.lq = p.mask.cu_seqlens_q[b + 1] - p.mask.cu_seqlens_q[b];
    s.k0 = p.mask.cu_seqlens_k[b];
    s.lk = p.mask.cu_seqlens_k[b + 1] - p.mask.cu_seqlens_k[b];
  } else {
    s.q0 = static_cast<std::int64_t>(b) * p.seqlen_q;
    s.lq = p.seqlen_q;
    s.lk = p.seqlen_k;
  }
  return s;
}

const float* row_ptr(const TensorView& t, bool varlen, int b, std::int64_t first, int row, int h) {
  const std::int64_t off = (varlen ? (first + row) * t.seq_stride : b * t.batch_stride + row * t.seq_stride) +
                           static_cast<std::int64_t>(h) * t.head_stride;
  return static_cast<const float*>(t.data) + off;
}

bool block_sparse_visible(const BlockSparseMask& bs, int b, int h, int i, int j) {
  const std::int64_t row = (static_cast<std::int64_t>(bs.num_batch == 1 ? 0 : b) * bs.num_heads +
                            (bs.num_heads == 1 ? 0 : h)) * bs.num_q_blocks + i / bs.block_m;
  const int kb = j / bs.block_n;
  for (std::int32_t e = bs.row_ptr[row]; e < bs.row_ptr[row + 1]; ++e) {
    if (bs.col_idx[e] != kb) continue;
    const std::int32_t part = bs.partial[e];
    if (part < 0) return true;
    const int words = (bs.block_n + 63) / 64, c = j % bs.block_n;
    const std::uint64_t w =
        bs.element_masks[(static_cast<std::int64_t>(part) * bs.block_m + i % bs.block_m) * words + c / 64];
    return (w >> (c % 64)) & 1u;
  }
  return false;
}

bool visible(const AttnParams& p, const Seq& s, int b, int h, int i, int j) {
  const MaskParams& m = p.mask;
  const int ia = i + s.lk - s.lq;
  const bool global_query = m.global_queries && ia < m.global_tokens;
  if (m.causal && j > ia) return false;
  if (m.window_right >= 0 && !global_query && j > ia + m.window_right) return false;
  if (m.window_left >= 0 && !global_query && j >= m.global_tokens && j < ia - m.window_left) return false;
  if (m.block_sparse && !block_sparse_visible(*m.block_sparse, b, h, i, j)) return false;
  return true;
}

}  // namespace

Status plain_attention_fp32(const AttnParams& p, std::vector<float>* o, std::vector<float>* lse, int threads,
                            float* max_abs_score) {
  if (p.q.dtype != DType::kF32) return Status::Invalid("plain_attention_fp32 takes fp32 inputs");
  const bool varlen = p.mask.is_varlen();
  const std::int64_t total_q =
      varlen ? p.mask.cu_seqlens_q[p.batch] : static_cast<std::int64_t>(p.batch) * p.seqlen_q;
  const int hq = p.heads_q, d = p.head_dim, group = p.heads_q / p.heads_kv;
  o->assign(static_cast<std::size_t>(total_q * hq * d), 0.f);
  lse->assign(static_cast<std::size_t>(total_q * hq), -INFINITY);
  const float scale = p.effective_scale(), cap = p.mask.softcap;

  std::vector<float> top(static_cast<std::size_t>(std::max(p.batch * p.heads_q, 0)), 0.f);  // per (b, h)
  auto one = [&](int bh) {
    const int b = bh / hq, h = bh % hq, hk = h / group;
    const Seq s = seq_of(p, b);
    std::vector<float> sc(static_cast<std::size_t>(std::max(s.lk, 1))), acc(static_cast<std::size_t>(d));
    std::vector<int> keys;
    const float slope = p.mask.alibi_slopes ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] : 0.f;
    for (int i = 0; i < s.lq; ++i) {
      const float* q = row_ptr(p.q, varlen, b, s.q0, i, h);
      const int ia = i + s.lk - s.lq;
      keys.clear();
      float mx = -INFINITY;
      for (int j = 0; j < s.lk; ++j) {
        if (!visible(p, s, b, h, i, j)) continue;
        const float* k = row_ptr(p.k, varlen, b, s.k0, j, hk);
        float dot = 0.f;
        for (int e = 0; e < d; ++e) dot += q[e] * k[e];
        float x = dot * scale;
        if (cap > 0.f) x = cap * std::tanh(x / cap);
        if (p.mask.alibi_slopes) x += slope * static_cast<float>(j - ia);
        sc[keys.size()] = x;
        if (std::fabs(x) > top[static_cast<std::size_t>(bh)]) top[static_cast<std::size_t>(bh)] = std::fabs(x);
        keys.push_back(j);
        mx = std::max(mx, x);
      }
      const std::int64_t r = s.q0 + i;
      if (keys.empty()) continue;  // O = 0, LSE = -inf
      float l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (std::size_t t = 0; t < keys.size(); ++t) {
        const float w = std::exp(sc[t] - mx);
        l += w;
        const float* v = row_ptr(p.v, varlen, b, s.k0, keys[t], hk);
        for (int e = 0; e < d; ++e) acc[e] += w * v[e];
      }
      float* out = o->data() + (r * hq + h) * d;
      for (int e = 0; e < d; ++e) out[e] = acc[e] / l;
      (*lse)[static_cast<std::size_t>(h * total_q + r)] = mx + std::log(l);
    }
  };

  const int items = p.batch * hq;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::max(1, std::min(threads, items));
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int it; (it = next.fetch_add(1)) < items;) one(it);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (max_abs_score) *max_abs_score = top.empty() ? 0.f : *std::max_element(top.begin(), top.end());
  return Status::Ok();
}

}  // namespace flashcpp::harness
