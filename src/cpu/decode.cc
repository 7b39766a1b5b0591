// CPU backend of decode: the GPU algorithm on host memory, one step at a time.
//
//   1. append: new K (rotated) and V of token t go to cache slot c_b + t, through the same paged
//      addressing as the kernels (page = block_table[b][j / page_size], slot j % page_size);
//   2. split-KV: for every work item of the plan (sequence b, split s of n_b) and KV head, the
//      split's 64-key tiles (decode::split_tiles over the rows' visible range) are folded into an
//      online-softmax state (m, l, acc) per query row (common/attention_algebra.h, raw q.k units); a sequence with
//      n_b = 1 writes O and the LSE directly, else the normalized partial O and its LSE go to the
//      float workspace;
//   3. merge: the n_b partials of each row combined by their LSEs, in split order.
// Step 2 reads only tiles and keys that the CUDA kernel reads, and steps 2-3 use the same
// workspace layout, so a bug in a split boundary, the paged addressing or the merge shows up here
// on CI, without a GPU. (The kernel additionally splits each tile over warps and merges those
// in-CTA; that changes the fp32 rounding only.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "flashcpp/half.h"
#include "cpu/cpu_backend.h"
#include "core/decode_backends.h"
#include "common/attention_algebra.h"
#include "common/decode_common.h"
#include "common/fused_math.h"
#include "cpu/parallel.h"
#include "cpu/rotary.h"

namespace flashcpp::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float round_to(DType dt, float x) {
  std::uint64_t buf = 0;  // room for one element of any dtype (fp64 is 8 bytes)
  store_from_float(&buf, dt, 0, x);
  return load_as_float(&buf, dt, 0);
}

/// Element offset of (sequence b, key j, KV head hk, dim 0) in a cache view.
std::int64_t kv_offset(const KVCacheView& c, const TensorView& t, int b, int j, int hk) {
  if (c.paged()) {
    const std::int32_t page = c.block_table[b * c.block_table_stride + j / c.page_size];  // validated
    return page * t.batch_stride + static_cast<std::int64_t>(j % c.page_size) * t.seq_stride + hk * t.head_stride;
  }
  return b * t.batch_stride + static_cast<std::int64_t>(j) * t.seq_stride + hk * t.head_stride;
}

/// The rotary rule of decode.h for one row of x (fp32, in place; the caller rounds to the dtype):
/// the spec's angles as every CPU rotary path reads them (cpu/rotary.h), rotated by
/// fused::rotate_pair, as the CUDA kernels do.
class Rotary {
 public:
  Rotary(const RotarySpec& ro, int head_dim) : ro_(ro) {
    if (ro.enabled()) angles_.emplace(ro, head_dim);
  }
  void apply(float* x, int pos) const {
    if (!angles_) return;
    const int half = angles_->half();
    for (int i = 0; i < half; ++i) {
      float c, s;
      angles_->at(pos, i, &c, &s);  // validated: pos inside the tables
      int a, b;
      decode::rotary_pair(ro_.style, i, 2 * half, &a, &b);
      fused::rotate_pair(x[a], x[b], c, s);
    }
  }

 private:
  const RotarySpec& ro_;
  std::optional<RotaryAngles> angles_;  // empty: rotary off
};

void load_row(const TensorView& t, std::int64_t off, int d, float* dst) {
  for (int i = 0; i < d; ++i) dst[i] = load_as_float(t.data, t.dtype, off + i);
}

/// Step 1: new K (rotated) and V into the cache.
void append(const DecodeParams& p, const Rotary& rot) {
  const int D = p.head_dim, Dv = p.effective_head_dim_v();
  std::vector<float> row(static_cast<std::size_t>(std::max(D, Dv)));
  const int slots = static_cast<int>(p.cache.slots());
  for (int b = 0; b < p.batch; ++b) {
    const int len = decode::total_len(p.cache_seqlens[b], slots, p.seqlen_q, true);
    for (int t = 0; t < p.seqlen_q; ++t) {
      const int pos = len - p.seqlen_q + t;  // = cache_seqlens[b] + t
      for (int hk = 0; hk < p.heads_kv; ++hk) {
        load_row(p.k_new, b * p.k_new.batch_stride + t * p.k_new.seq_stride + hk * p.k_new.head_stride, D, row.data());
        rot.apply(row.data(), pos);
        // An fp8 cache stores the code of x / scale (decode.h); any other cache rounds x to its dtype.
        const float ks = p.cache.fp8() ? p.cache.k_scale[hk] : 1.f, vs = p.cache.fp8() ? p.cache.v_scale[hk] : 1.f;
        if (p.cache.fp8())
          for (int d = 0; d < D; ++d) row[d] /= ks;
        const std::int64_t ko = kv_offset(p.cache, p.cache.k, b, pos, hk);
        for (int d = 0; d < D; ++d) store_from_float(p.cache.k.data, p.cache.k.dtype, ko + d, row[d]);
        load_row(p.v_new, b * p.v_new.batch_stride + t * p.v_new.seq_stride + hk * p.v_new.head_stride, Dv, row.data());
        if (p.cache.fp8())
          for (int d = 0; d < Dv; ++d) row[d] /= vs;
        const std::int64_t vo = kv_offset(p.cache, p.cache.v, b, pos, hk);
        for (int d = 0; d < Dv; ++d) store_from_float(p.cache.v.data, p.cache.v.dtype, vo + d, row[d]);
      }
    }
  }
}

struct Step {
  const DecodeParams& p;
  const DecodePlan& plan;
  decode::WorkList wl;
  algebra::ScoreTransform score;
  int slots = 0, wl_left = -1, wl_right = -1, group = 1;
  float* part_o = nullptr;
  float* part_lse = nullptr;
};

/// Step 2 for one (work item, KV head): every query row of the KV head over the split's tiles.
void split_partial(const Step& st, const Rotary& rot, int item, int hk) {
  const DecodeParams& p = st.p;
  const int D = p.head_dim, Dv = p.effective_head_dim_v(), Sq = p.seqlen_q, rows = st.plan.rows_per_kv;
  const int BN = kDecodeBlockN;
  const int b = st.wl.item_batch[item], s = st.wl.item_split[item], n = st.wl.num_splits[b];
  const bool append = p.has_append();
  // An fp8 cache's scales fold into the score's scale (K) and the output (V), as the kernels do.
  const algebra::ScoreTransform score =
      p.cache.fp8() ? algebra::ScoreTransform::make(p.effective_scale() * p.cache.k_scale[hk], p.mask.softcap)
                    : st.score;
  const float v_scale = p.cache.fp8() ? p.cache.v_scale[hk] : 1.f;
  const int len = decode::total_len(p.cache_seqlens[b], st.slots, Sq, append);
  const MaskRules rules = decode::sequence_rules(Sq, len, p.mask.causal, st.wl_left, st.wl_right);
  int lo = 0, hi = 0, t_begin = 0, t_end = 0;
  rules.key_range(0, Sq, &lo, &hi);
  decode::split_tiles(lo, hi, s, n, BN, &t_begin, &t_end);

  // Query rows (rotated at ia, rounded to the dtype as the kernel's shared-memory copy is).
  std::vector<float> q(static_cast<std::size_t>(rows) * D), slope(static_cast<std::size_t>(rows), 0.f);
  for (int r = 0; r < rows; ++r) {
    const int h = hk * st.group + r / Sq, t = r % Sq;
    float* qr = &q[static_cast<std::size_t>(r) * D];
    load_row(p.q, b * p.q.batch_stride + t * p.q.seq_stride + h * p.q.head_stride, D, qr);
    if (p.rotary.enabled()) {
      rot.apply(qr, len - Sq + t);
      for (int d = 0; d < D; ++d) qr[d] = round_to(p.q.dtype, qr[d]);
    }
    if (p.mask.alibi_slopes) slope[r] = score.slope_raw(p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h]);
  }
  std::vector<algebra::RowSoftmax> row(static_cast<std::size_t>(rows));
  std::vector<float> acc(static_cast<std::size_t>(rows) * Dv, 0.f);
  std::vector<float> kt(static_cast<std::size_t>(BN) * D), vt(static_cast<std::size_t>(BN) * Dv);
  std::vector<float> y(static_cast<std::size_t>(BN));
  const float c = score.c;

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int j0 = tile * BN, jn = std::min(BN, hi - j0);  // keys at or past hi are never loaded
    for (int jj = 0; jj < jn; ++jj) {
      load_row(p.cache.k, kv_offset(p.cache, p.cache.k, b, j0 + jj, hk), D, &kt[static_cast<std::size_t>(jj) * D]);
      load_row(p.cache.v, kv_offset(p.cache, p.cache.v, b, j0 + jj, hk), Dv, &vt[static_cast<std::size_t>(jj) * Dv]);
    }
    for (int r = 0; r < rows; ++r) {
      const int t = r % Sq;
      const float* qr = &q[static_cast<std::size_t>(r) * D];
      const int ia = t + len - Sq;
      float tile_max = kNegInf;
      for (int jj = 0; jj < jn; ++jj) {
        const int j = j0 + jj;
        if (!rules.visible(t, j)) {
          y[jj] = kNegInf;
          continue;
        }
        const float* kr = &kt[static_cast<std::size_t>(jj) * D];
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot = std::fma(qr[d], kr[d], dot);
        // Raw q.k units, as the kernel keeps them (common/attention_algebra.h).
        float u = score.raw(dot);
        if (score.cap > 0.f) u = score.softcap(u);
        if (p.mask.alibi_slopes) u = algebra::alibi(u, slope[r], static_cast<float>(j - ia));
        y[jj] = u;
        tile_max = std::max(tile_max, u);
      }
      // As in the kernel: no skip of a tile whose max is -inf (a NaN score never wins the max,
      // so a tile of NaN scores has max -inf too, and its NaN must reach l).
      algebra::RowSoftmax& rs = row[static_cast<std::size_t>(r)];
      const float corr = rs.rescale(std::max(rs.m, tile_max), c);  // m = -inf: 0, and l, acc are 0 (or NaN)
      float* ar = &acc[static_cast<std::size_t>(r) * Dv];
      for (int d = 0; d < Dv; ++d) ar[d] *= corr;
      const float mc = rs.offset(c);
      float sum = 0.f;
      for (int jj = 0; jj < jn; ++jj) {
        if (y[jj] == kNegInf) continue;  // masked: weight 0
        const float w = rs.p(y[jj], c, mc);
        sum += w;
        const float* vr = &vt[static_cast<std::size_t>(jj) * Dv];
        for (int d = 0; d < Dv; ++d) ar[d] = std::fma(w, vr[d], ar[d]);
      }
      rs.accumulate(corr, sum);
    }
  }

  // Epilogue: O = acc / l and the LSE; to the output (n = 1) or the workspace. l == 0: the row saw
  // no key (O = 0, LSE = -inf); l = NaN (a NaN score) gives NaN in both.
  for (int r = 0; r < rows; ++r) {
    const int h = hk * st.group + r / Sq, t = r % Sq;
    const algebra::RowSoftmax& rs = row[static_cast<std::size_t>(r)];
    algebra::RowResult res = rs.finalize(rs.l, c);
    res.inv *= v_scale;  // 1 without an fp8 cache: O = v_scale * (sum of P * codes) / l
    const float* ar = &acc[static_cast<std::size_t>(r) * Dv];
    if (n == 1) {
      const std::int64_t oo = b * p.o.batch_stride + t * p.o.seq_stride + h * p.o.head_stride;
      for (int d = 0; d < Dv; ++d) store_from_float(p.o.data, p.o.dtype, oo + d, ar[d] * res.inv);
      if (p.lse) p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * Sq + t] = res.lse;
    } else {
      const std::size_t idx = (static_cast<std::size_t>(item) * p.heads_kv + hk) * rows + r;
      for (int d = 0; d < Dv; ++d) st.part_o[idx * Dv + d] = ar[d] * res.inv;
      st.part_lse[idx] = res.lse;
    }
  }
}

/// Step 3 for one sequence with n > 1 splits: every (token, head) row merged by LSE.
void merge_sequence(const Step& st, int b) {
  const DecodeParams& p = st.p;
  const int D = p.effective_head_dim_v(), Sq = p.seqlen_q, rows = st.plan.rows_per_kv;  // o's width
  const int first = st.wl.first_item[b], n = st.wl.num_splits[b];
  std::vector<float> o(static_cast<std::size_t>(D));
  for (int h = 0; h < p.heads_q; ++h) {
    const int hk = h / st.group;
    for (int t = 0; t < Sq; ++t) {
      const int r = (h % st.group) * Sq + t;
      auto at = [&](int i) { return (static_cast<std::size_t>(first + i) * p.heads_kv + hk) * rows + r; };
      // The merge kernel's rule (algebra::lse_weight / merged_lse): weights against the largest
      // LSE; an empty split adds nothing; a NaN LSE never wins the max but makes its weight, the
      // sum, O and the LSE NaN; sum == 0: all empty.
      float lse_max = kNegInf;
      for (int i = 0; i < n; ++i) lse_max = std::max(lse_max, st.part_lse[at(i)]);
      std::fill(o.begin(), o.end(), 0.f);
      float sum = 0.f;
      for (int i = 0; i < n; ++i) {
        const float w = algebra::lse_weight(st.part_lse[at(i)], lse_max);
        if (w == 0.f) continue;  // an empty split contributes nothing
        sum += w;
        for (int d = 0; d < D; ++d) o[d] = std::fma(w, st.part_o[at(i) * D + d], o[d]);
      }
      const float inv = sum != 0.f ? 1.f / sum : 0.f;
      for (int d = 0; d < D; ++d) o[d] *= inv;
      const float lse = algebra::merged_lse(lse_max, sum);
      const std::int64_t oo = b * p.o.batch_stride + t * p.o.seq_stride + h * p.o.head_stride;
      for (int d = 0; d < D; ++d) store_from_float(p.o.data, p.o.dtype, oo + d, o[d]);
      if (p.lse) p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * Sq + t] = lse;
    }
  }
}

}  // namespace

Status decode_run(const DecodeParams& p, const DecodePlan& plan, const RunOptions& opt) {
  const Rotary rot(p.rotary, p.head_dim);
  if (p.has_append()) append(p, rot);

  Step st{p, plan, decode::worklist_view(plan.int_workspace, p.batch, plan.num_items), {}, 0, -1, -1, 1, nullptr, nullptr};
  st.slots = static_cast<int>(p.cache.slots());
  st.wl_left = decode::clamp_window(p.mask.window_left, st.slots);
  st.wl_right = decode::clamp_window(p.mask.window_right, st.slots);
  st.group = p.heads_q / p.heads_kv;
  st.score = algebra::ScoreTransform::make(p.effective_scale(), p.mask.softcap);
  if (plan.needs_merge) {
    st.part_o = static_cast<float*>(plan.float_workspace);
    st.part_lse = st.part_o + decode::partial_lse_offset(plan.num_items, p.heads_kv, plan.rows_per_kv, plan.head_dim_v);
  }
  // The work, for the thread count: every query row against its sequence's keys.
  double keys = 0;
  for (int b = 0; b < p.batch; ++b) keys += decode::total_len(p.cache_seqlens[b], st.slots, p.seqlen_q, p.has_append());
  const double work = keys * p.heads_q * p.seqlen_q * (p.head_dim + p.effective_head_dim_v());
  const std::int64_t tasks = static_cast<std::int64_t>(plan.num_items) * p.heads_kv;
  parallel_for(tasks, threads_for(opt.cpu_threads, tasks, work / static_cast<double>(std::max<std::int64_t>(tasks, 1))),
               [&](std::int64_t task) {
                 split_partial(st, rot, static_cast<int>(task / p.heads_kv), static_cast<int>(task % p.heads_kv));
               });
  if (plan.needs_merge) {
    const double merge_work = static_cast<double>(plan.num_items) * p.heads_q * p.seqlen_q * p.effective_head_dim_v();
    parallel_for(p.batch, threads_for(opt.cpu_threads, p.batch, merge_work / std::max(p.batch, 1)), [&](std::int64_t b) {
      if (st.wl.num_splits[b] > 1) merge_sequence(st, static_cast<int>(b));
    });
  }
  return Status::Ok();
}

Status merge_attention_states(const MergeStatesParams& p) {
  const int D = p.head_dim;
  std::vector<float> a(static_cast<std::size_t>(D)), bb(a.size()), o(a.size());
  for (int b = 0; b < p.batch; ++b)
    for (int s = 0; s < p.seqlen; ++s)
      for (int h = 0; h < p.heads; ++h) {
        auto off = [&](const TensorView& t) { return b * t.batch_stride + s * t.seq_stride + h * t.head_stride; };
        const std::int64_t li = (static_cast<std::int64_t>(b) * p.heads + h) * p.seqlen + s;
        load_row(p.o_a, off(p.o_a), D, a.data());
        load_row(p.o_b, off(p.o_b), D, bb.data());
        float lse = 0.f;
        merge_by_lse(a.data(), p.lse_a[li], bb.data(), p.lse_b[li], D, o.data(), &lse);
        const std::int64_t oo = off(p.o);
        for (int d = 0; d < D; ++d) store_from_float(p.o.data, p.o.dtype, oo + d, o[d]);
        if (p.lse) p.lse[li] = lse;
      }
  return Status::Ok();
}

}  // namespace flashcpp::cpu
