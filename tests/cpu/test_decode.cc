// Decode on the CPU backend (src/cpu/decode.cc, planner src/core/decode_api.cc) against the fp64
// reference (cpu::reference_attention on a dense, packed copy of the cache after the append).
//
// What is checked, per case:
//   - O and LSE vs fp64 over every (sequence, token, head), outputs poisoned with NaN first;
//   - the whole cache after the step vs a straightforward append (+ rotary) written here from the
//     rule in decode.h, bit for bit: every new token lands in its slot, nothing else changes;
//   - cache slots past each sequence's length hold NaN, so a read past the length poisons O.
// Tolerances: fp32 inputs 2e-5 abs (fp32 dot products of length <= 256 and softmax sums over
// <= ~1100 keys with O(1) logits); fp16/bf16 outputs add half an ulp of the output dtype
// (u * |O_ref|), the rounding of the stored result. LSE (always fp32): 2e-5 + 2^-24 |LSE|.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashcpp/half.h"
#include "cpu/cpu_backend.h"
#include "core/decode_backends.h"
#include "core/selector.h"
#include "common/decode_common.h"
#include "common/fused_math.h"
#include "flashcpp/decode.h"
#include "test_util.h"

namespace flashcpp {
namespace {

using testing::HostBuffer;

constexpr double kAtol = 2e-5;

struct DCase {
  std::string name;
  int batch = 1, hq = 1, hkv = 1, d = 64, sq = 1;
  int dv = 0;  ///< head_dim_v (values and o); 0 = d
  int width_v() const { return dv ? dv : d; }
  DType dt = DType::kF32;
  bool fp8 = false;  ///< an fp8_e4m3 cache with per-head scales (q, o and the new K/V stay dt)
  DType cache_dt() const { return fp8 ? DType::kF8E4M3 : dt; }
  std::vector<int> lens;  ///< cache_seqlens before the step (size batch)
  int extra_slots = 5;    ///< slots beyond the largest total length (NaN-filled)
  int page_size = 0;      ///< 0 = contiguous
  bool shuffle_pages = true;
  bool append = false;
  RopeStyle rot = RopeStyle::kNone;
  int rotary_dim = 0;
  bool tables = false;
  bool cos_sin_cache = false;  ///< tables as one (maxpos, rd) cache of rows [cos | sin] (else two (maxpos, rd/2))
  double theta = 10000.0;
  Llama3Scaling llama3;
  bool causal = true;
  int wl = -1, wr = -1;
  float softcap = 0.f, scale = 0.f;
  bool alibi = false, alibi_per_batch = false;
  int num_splits = 0;     ///< forced split count (0 = heuristic)
  int num_sms = 0;        ///< planner SM count (0 = default 132)
  bool sdpa_cache = false;  ///< contiguous cache as (batch, heads, slots, dim) through strides
};

std::int64_t max_total(const DCase& c) {
  int m = 0;
  for (int l : c.lens) m = std::max(m, l + (c.append ? c.sq : 0));
  return m;
}

/// Every buffer of one decode step; DecodeParams points into them (never copied or moved).
struct Problem {
  DCase c;
  DecodeParams p;
  HostBuffer q, o, knew, vnew, kc, vc;
  std::vector<float> lse, cos_t, sin_t, slopes, k_scale, v_scale;
  std::vector<std::int32_t> lens, block_table;
  std::int64_t slots = 0;

  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
  Problem(const DCase& cs, std::uint64_t salt) : c(cs) {
    auto g = testing::rng(salt);
    const int B = c.batch, D = c.d, Dv = c.width_v();
    lens.assign(c.lens.begin(), c.lens.end());
    const std::int64_t need = max_total(c) + c.extra_slots;
    const DType cdt = c.cache_dt();
    if (c.fp8) {  // about amax / 448 of N(0, 1) values, different per head
      std::uniform_real_distribution<float> u(0.006f, 0.012f);
      for (int h = 0; h < c.hkv; ++h) k_scale.push_back(u(g)), v_scale.push_back(u(g));
    }
    p.batch = B;
    p.seqlen_q = c.sq;
    p.heads_q = c.hq;
    p.heads_kv = c.hkv;
    p.head_dim = D;
    p.head_dim_v = c.dv;
    p.softmax_scale = c.scale;
    q = HostBuffer(c.dt, static_cast<std::int64_t>(B) * c.sq * c.hq * D);
    q.fill_normal(g);
    o = HostBuffer(c.dt, static_cast<std::int64_t>(B) * c.sq * c.hq * Dv);
    o.poison();
    p.q = bshd_view(q.data(), c.dt, c.sq, c.hq, D);
    p.o = bshd_view(o.data(), c.dt, c.sq, c.hq, Dv);
    lse.assign(static_cast<std::size_t>(B) * c.hq * c.sq, NAN);
    p.lse = lse.data();
    if (c.page_size > 0) {
      const int pps = static_cast<int>((need + c.page_size - 1) / c.page_size);
      const int num_pages = B * pps + 3;  // a few pages no sequence uses
      slots = static_cast<std::int64_t>(pps) * c.page_size;
      std::vector<std::int32_t> order(static_cast<std::size_t>(num_pages));
      std::iota(order.begin(), order.end(), 0);
      auto gp = testing::rng(salt ^ 0x5eed);  // its own stream: same cache contents as a contiguous twin
      if (c.shuffle_pages) std::shuffle(order.begin(), order.end(), gp);
      const int stride = pps + 2;  // padded rows: the table's row stride is honored
      block_table.assign(static_cast<std::size_t>(B) * stride, -7);
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < pps; ++i) block_table[b * stride + i] = order[b * pps + i];
      kc = HostBuffer(cdt, static_cast<std::int64_t>(num_pages) * c.page_size * c.hkv * D);
      vc = HostBuffer(cdt, static_cast<std::int64_t>(num_pages) * c.page_size * c.hkv * Dv);
      p.cache.k = bshd_view(kc.data(), cdt, c.page_size, c.hkv, D);
      p.cache.v = bshd_view(vc.data(), cdt, c.page_size, c.hkv, Dv);
      p.cache.page_size = c.page_size;
      p.cache.num_pages = num_pages;
      p.cache.block_table = block_table.data();
      p.cache.block_table_stride = stride;
      p.cache.pages_per_seq = pps;
    } else {
      slots = need;
      kc = HostBuffer(cdt, static_cast<std::int64_t>(B) * slots * c.hkv * D);
      vc = HostBuffer(cdt, static_cast<std::int64_t>(B) * slots * c.hkv * Dv);
      auto view = [&](HostBuffer& h, int w) {
        return c.sdpa_cache ? bhsd_view(h.data(), cdt, slots, c.hkv, w) : bshd_view(h.data(), cdt, slots, c.hkv, w);
      };
      p.cache.k = view(kc, D);
      p.cache.v = view(vc, Dv);
      p.cache.capacity = static_cast<int>(slots);
    }
    // Cache contents: N(0,1) where a sequence has keys before the step, NaN everywhere else.
    kc.poison();
    vc.poison();
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < lens[b]; ++j)
        for (int h = 0; h < c.hkv; ++h) {
          const std::int64_t ko = offset(p.cache.k, b, j, h), vo = offset(p.cache.v, b, j, h);
          const float ks = c.fp8 ? k_scale[h] : 1.f, vs = c.fp8 ? v_scale[h] : 1.f;
          for (int d = 0; d < D; ++d) kc.set(ko + d, nd(g) / ks);  // an fp8 cache holds codes of x / scale
          for (int d = 0; d < Dv; ++d) vc.set(vo + d, nd(g) / vs);
        }
    p.cache_seqlens = lens.data();
    if (c.fp8) {
      p.cache.k_scale = k_scale.data();
      p.cache.v_scale = v_scale.data();
    }
    if (c.append) {
      knew = HostBuffer(c.dt, static_cast<std::int64_t>(B) * c.sq * c.hkv * D);
      vnew = HostBuffer(c.dt, static_cast<std::int64_t>(B) * c.sq * c.hkv * Dv);
      knew.fill_normal(g);
      vnew.fill_normal(g);
      p.k_new = bshd_view(knew.data(), c.dt, c.sq, c.hkv, D);
      p.v_new = bshd_view(vnew.data(), c.dt, c.sq, c.hkv, Dv);
    }
    p.rotary.style = c.rot;
    p.rotary.rotary_dim = c.rotary_dim;
    p.rotary.theta = c.theta;
    p.rotary.llama3 = c.llama3;
    if (c.rot != RopeStyle::kNone && c.tables) {
      const int rd = c.rotary_dim ? c.rotary_dim : D;
      const int maxpos = static_cast<int>(slots) + 3;
      std::uniform_real_distribution<float> ang(-3.14159f, 3.14159f);
      for (int pos = 0; pos < maxpos; ++pos) {
        std::vector<float> co, si;
        for (int i = 0; i < rd / 2; ++i) {
          const float a = ang(g);
          co.push_back(std::cos(a));
          si.push_back(std::sin(a));
        }
        if (c.cos_sin_cache) {  // one row [cos | sin] per position, all in cos_t
          cos_t.insert(cos_t.end(), co.begin(), co.end());
          cos_t.insert(cos_t.end(), si.begin(), si.end());
        } else {
          cos_t.insert(cos_t.end(), co.begin(), co.end());
          sin_t.insert(sin_t.end(), si.begin(), si.end());
        }
      }
      if (c.cos_sin_cache) {
        p.rotary.set_cos_sin_cache(cos_t.data(), maxpos, rd);
      } else {
        p.rotary.cos = cos_t.data();
        p.rotary.sin = sin_t.data();
        p.rotary.max_position = maxpos;
      }
    }
    p.mask.causal = c.causal;
    p.mask.window_left = c.wl;
    p.mask.window_right = c.wr;
    p.mask.softcap = c.softcap;
    if (c.alibi) {
      std::uniform_real_distribution<float> u(0.02f, 0.3f);
      const int nb = c.alibi_per_batch ? B : 1;
      for (int i = 0; i < nb * c.hq; ++i) slopes.push_back(u(g));
      p.mask.alibi_slopes = slopes.data();
      p.mask.alibi_batch_stride = c.alibi_per_batch ? c.hq : 0;
    }
  }

  /// Element offset of (sequence b, key j, KV head h) in a cache view (paged or not).
  std::int64_t offset(const TensorView& t, int b, int j, int h) const {
    if (p.cache.paged()) {
      const std::int32_t page = block_table[b * p.cache.block_table_stride + j / p.cache.page_size];
      return page * t.batch_stride + static_cast<std::int64_t>(j % p.cache.page_size) * t.seq_stride + h * t.head_stride;
    }
    return b * t.batch_stride + j * t.seq_stride + h * t.head_stride;
  }
  int total(int b) const { return lens[b] + (c.append ? c.sq : 0); }
};

// ---- the straightforward model of a step ------------------------------------------------------

/// The rotary rule of decode.h, written out once more from the header comment; the angle's cos/sin
/// is the library's one rule (fused_math.h, checked against fp64 in RotaryRuleIsARotation and in
/// test_fused.cc), so the appended cache can be compared bit for bit.
void rotate(const RotarySpec& ro, int head_dim, int pos, float* x) {
  if (ro.style == RopeStyle::kNone) return;
  const int rd = ro.rotary_dim ? ro.rotary_dim : head_dim, half = rd / 2;
  for (int i = 0; i < half; ++i) {
    float c, s;
    if (ro.cos) {
      c = ro.cos[pos * ro.effective_table_stride(head_dim) + i];
      s = ro.sin[pos * ro.effective_table_stride(head_dim) + i];
    } else {
      const double inv_freq =
          ro.llama3.enabled() ? rotary_inv_freq(i, rd, ro.theta, ro.llama3) : std::pow(ro.theta, -2.0 * i / rd);
      fused::cos_sin_angle(pos, inv_freq, &c, &s);
    }
    const int a = ro.style == RopeStyle::kNeox ? i : 2 * i;
    const int b = ro.style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    const float x1 = x[a], x2 = x[b];
    x[a] = std::fma(x1, c, -(x2 * s));
    x[b] = std::fma(x2, c, x1 * s);
  }
}

struct Expected {
  HostBuffer kc, vc;  ///< the whole cache after the step
  cpu::RefOutput ref;
};

/// Appends on copies of the cache, gathers a dense packed (sum L_b, heads_kv, D) K/V and rotated
/// q, and runs the fp64 reference with per-sequence lengths (varlen) for the bottom-right mask.
void expected(const Problem& pr, Expected* e) {
  const DCase& c = pr.c;
  const DecodeParams& p = pr.p;
  const int D = c.d, Dv = c.width_v();
  e->kc = pr.kc;
  e->vc = pr.vc;
  std::vector<float> row(static_cast<std::size_t>(D));
  if (c.append)
    for (int b = 0; b < c.batch; ++b)
      for (int t = 0; t < c.sq; ++t)
        for (int h = 0; h < c.hkv; ++h) {
          const int pos = pr.lens[b] + t;
          for (int d = 0; d < D; ++d) row[d] = pr.knew.get(((b * c.sq + t) * c.hkv + h) * D + d);
          rotate(p.rotary, D, pos, row.data());
          const std::int64_t ko = pr.offset(p.cache.k, b, pos, h), vo = pr.offset(p.cache.v, b, pos, h);
          // decode.h: an fp8 cache stores the code of x / scale (in fp32), any other x rounded.
          const float ks = c.fp8 ? pr.k_scale[h] : 1.f, vs = c.fp8 ? pr.v_scale[h] : 1.f;
          for (int d = 0; d < D; ++d) e->kc.set(ko + d, c.fp8 ? row[d] / ks : row[d]);
          for (int d = 0; d < Dv; ++d) {
            const float x = pr.vnew.get(((b * c.sq + t) * c.hkv + h) * Dv + d);
            e->vc.set(vo + d, c.fp8 ? x / vs : x);
          }
        }
  std::vector<std::int32_t> cu_q{0}, cu_k{0};
  int max_k = 0;
  for (int b = 0; b < c.batch; ++b) {
    cu_q.push_back(cu_q.back() + c.sq);
    cu_k.push_back(cu_k.back() + pr.total(b));
    max_k = std::max(max_k, pr.total(b));
  }
  const std::int64_t tk = std::max(cu_k.back(), 1);
  // The reference reads one dtype: fp32 over a dequantized fp8 cache (code * scale), else the dtype.
  const DType rdt = c.fp8 ? DType::kF32 : c.dt;
  HostBuffer qd(rdt, static_cast<std::int64_t>(c.batch) * c.sq * c.hq * D);
  HostBuffer kd(rdt, tk * c.hkv * D), vd(rdt, tk * c.hkv * Dv);
  for (int b = 0; b < c.batch; ++b) {
    for (int t = 0; t < c.sq; ++t)
      for (int h = 0; h < c.hq; ++h) {
        for (int d = 0; d < D; ++d) row[d] = pr.q.get(((b * c.sq + t) * c.hq + h) * D + d);
        rotate(p.rotary, D, pr.total(b) - c.sq + t, row.data());
        for (int d = 0; d < D; ++d)  // rounded like the kernel
          qd.set(((b * c.sq + t) * c.hq + h) * D + d, round_to_dtype(c.dt, row[d]));
      }
    for (int j = 0; j < pr.total(b); ++j)
      for (int h = 0; h < c.hkv; ++h) {
        const std::int64_t row_kv = (cu_k[b] + j) * c.hkv + h;
        const std::int64_t ko = pr.offset(p.cache.k, b, j, h), vo = pr.offset(p.cache.v, b, j, h);
        const float ks = c.fp8 ? pr.k_scale[h] : 1.f, vs = c.fp8 ? pr.v_scale[h] : 1.f;
        for (int d = 0; d < D; ++d) kd.set(row_kv * D + d, e->kc.get(ko + d) * ks);
        for (int d = 0; d < Dv; ++d) vd.set(row_kv * Dv + d, e->vc.get(vo + d) * vs);
      }
  }
  AttnParams a;
  a.batch = c.batch;
  a.seqlen_q = c.sq;
  a.seqlen_k = max_k;
  a.heads_q = c.hq;
  a.heads_kv = c.hkv;
  a.head_dim = D;
  a.head_dim_v = c.dv;
  a.q = TensorView{qd.data(), rdt, 0, static_cast<std::int64_t>(c.hq) * D, D};
  a.k = TensorView{kd.data(), rdt, 0, static_cast<std::int64_t>(c.hkv) * D, D};
  a.v = TensorView{vd.data(), rdt, 0, static_cast<std::int64_t>(c.hkv) * Dv, Dv};
  a.softmax_scale = c.scale;
  a.mask.causal = c.causal;
  a.mask.window_left = c.wl;
  a.mask.window_right = c.wr;
  a.mask.softcap = c.softcap;
  a.mask.alibi_slopes = p.mask.alibi_slopes;
  a.mask.alibi_batch_stride = p.mask.alibi_batch_stride;
  a.mask.cu_seqlens_q = cu_q.data();
  a.mask.cu_seqlens_k = cu_k.data();
  const Status st = cpu::reference_attention(a, &e->ref);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

// ---- running a step -------------------------------------------------------------------------

/// 16-byte aligned host workspace.
struct Workspace {
  std::vector<std::uint8_t> raw;
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit Workspace(std::size_t n) : raw(n + 32), bytes(n) {
    const auto a = reinterpret_cast<std::uintptr_t>(raw.data());
    ptr = raw.data() + ((16 - a % 16) % 16);
    std::memset(ptr, 0xFF, n);  // NaN / -1: a partial that is never written shows up
  }
};

struct RunResult {
  DecodePlan plan;
};

Status plan_and_run(Problem& pr, RunResult* rr, const std::int32_t* plan_lens = nullptr,
                    std::unique_ptr<Workspace>* iw_out = nullptr, std::unique_ptr<Workspace>* fw_out = nullptr) {
  DecodePlanOptions po;
  po.backend = Backend::kCpu;
  po.host_cache_seqlens = plan_lens ? plan_lens : pr.lens.data();
  po.num_splits = pr.c.num_splits;
  po.num_sms = pr.c.num_sms;
  DecodeWorkspaceSize ws;
  FLASHCPP_RETURN_IF_ERROR(decode_workspace_size(pr.p, po, &ws));
  auto iw = std::make_unique<Workspace>(ws.int_bytes), fw = std::make_unique<Workspace>(ws.float_bytes);
  FLASHCPP_RETURN_IF_ERROR(decode_plan(pr.p, po, iw->ptr, iw->bytes, fw->ptr, fw->bytes, &rr->plan));
  RunOptions ro;
  ro.backend = Backend::kCpu;
  ro.cpu_threads = 2;
  FLASHCPP_RETURN_IF_ERROR(decode_run(pr.p, rr->plan, ro));
  if (iw_out) *iw_out = std::move(iw);
  if (fw_out) *fw_out = std::move(fw);
  return Status::Ok();
}

double unit_roundoff(DType dt) {
  return dt == DType::kBF16 ? 1.0 / 256 : dt == DType::kF16 ? 1.0 / 2048 : 0.0;
}

/// Compares O, LSE and the cache against the model; returns max |O - O_ref|. Where the fp64
/// model is NaN (NaN inputs) O and LSE must be NaN; `nan_elements` gets how many such O elements.
double compare(const Problem& pr, const Expected& e, std::int64_t* nan_elements = nullptr) {
  const DCase& c = pr.c;
  const int D = c.width_v();  // o's width
  const std::int64_t total_q = static_cast<std::int64_t>(c.batch) * c.sq;
  const double u = unit_roundoff(c.dt);
  double max_err = 0;
  std::int64_t bad = 0, nan = 0, lse_bad = 0, nan_expected = 0;
  for (int b = 0; b < c.batch; ++b)
    for (int t = 0; t < c.sq; ++t)
      for (int h = 0; h < c.hq; ++h) {
        const std::int64_t row = b * c.sq + t;
        for (int d = 0; d < D; ++d) {
          const double out = pr.o.get(((b * c.sq + t) * c.hq + h) * D + d);
          const double ref = e.ref.o[static_cast<std::size_t>((row * c.hq + h) * D + d)];
          if (std::isnan(ref)) {  // NaN inputs: NaN is the expected answer (attention.h)
            ++nan_expected;
            bad += !std::isnan(out);
            continue;
          }
          if (std::isnan(out)) {
            ++nan;
            continue;
          }
          const double err = std::fabs(out - ref);
          max_err = std::max(max_err, err);
          bad += err > kAtol + u * std::fabs(ref);
        }
        const double lo = pr.lse[static_cast<std::size_t>((b * c.hq + h) * c.sq + t)];
        const double lr = e.ref.lse[static_cast<std::size_t>(h * total_q + row)];
        if (std::isnan(lr)) {
          lse_bad += !std::isnan(lo);
        } else if (std::isinf(lr)) {
          lse_bad += !(std::isinf(lo) && lo < 0);
        } else {
          lse_bad += !(std::fabs(lo - lr) <= kAtol + std::fabs(lr) / 16777216.0);
        }
      }
  EXPECT_EQ(nan, 0) << "NaN in O (unwritten, or a read past a sequence's length)";
  if (nan_elements) *nan_elements = nan_expected;
  EXPECT_EQ(bad, 0) << "O elements over tolerance; max |err| " << max_err;
  EXPECT_EQ(lse_bad, 0) << "LSE rows over tolerance";
  if (c.append) {
    std::int64_t diff = 0;
    diff += std::memcmp(pr.kc.bytes.data(), e.kc.bytes.data(), pr.kc.bytes.size()) != 0;
    diff += std::memcmp(pr.vc.bytes.data(), e.vc.bytes.data(), pr.vc.bytes.size()) != 0;
    EXPECT_EQ(diff, 0) << "the cache after the append differs from the model (bit for bit, NaN slots included)";
  }
  return max_err;
}

void run_and_check(const DCase& c, std::uint64_t salt, DecodePlan* plan_out = nullptr) {
  SCOPED_TRACE(c.name);
  Problem pr(c, salt);
  const HostBuffer kc0 = pr.kc, vc0 = pr.vc;
  Expected e;
  expected(pr, &e);
  RunResult rr;
  const Status st = plan_and_run(pr, &rr);
  ASSERT_TRUE(st.ok()) << st.to_string();
  compare(pr, e);
  if (!c.append) {
    EXPECT_EQ(std::memcmp(pr.kc.bytes.data(), kc0.bytes.data(), kc0.bytes.size()), 0) << "the cache was written";
    EXPECT_EQ(std::memcmp(pr.vc.bytes.data(), vc0.bytes.data(), vc0.bytes.size()), 0) << "the cache was written";
  }
  if (plan_out) *plan_out = rr.plan;
}

std::uint64_t salt_of(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char ch : s) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return h;
}

// ---- split + merge ---------------------------------------------------------------------------

TEST(DecodeCpu, SplitCountsAgainstFp64) {
  // 1 split (no merge), 2, 7, more splits than tiles (empty splits), and the heuristic.
  for (int splits : {1, 2, 7, 40, 0}) {
    DCase c;
    c.name = "splits" + std::to_string(splits);
    c.batch = 4;
    c.hq = 8;
    c.hkv = 2;
    c.d = 64;
    c.lens = {517, 1, 130, 64};
    c.num_splits = splits;
    c.num_sms = 4;  // a small "GPU" so the heuristic splits too
    DecodePlan plan;
    run_and_check(c, salt_of(c.name), &plan);
    if (splits > 0) {
      EXPECT_EQ(plan.max_splits, splits);
      EXPECT_EQ(plan.num_items, 4 * splits);
    }
    EXPECT_EQ(plan.needs_merge, plan.max_splits > 1);
  }
}

TEST(DecodeCpu, SplitsOfOneSequenceCoverItsTiles) {
  // split_tiles deals a range's tiles out in order, without gaps or overlaps, for any count.
  for (int lo : {0, 5, 64, 130})
    for (int hi : {lo, lo + 1, lo + 63, lo + 64, lo + 1000})
      for (int n : {1, 2, 3, 7, 16, 100}) {
        int prev_end = -1, total = 0;
        for (int s = 0; s < n; ++s) {
          int b0, b1;
          decode::split_tiles(lo, hi, s, n, kDecodeBlockN, &b0, &b1);
          ASSERT_LE(b0, b1);
          if (prev_end >= 0) ASSERT_EQ(b0, prev_end);
          prev_end = b1;
          total += b1 - b0;
        }
        const int tiles = hi > lo ? (hi + 63) / 64 - lo / 64 : 0;
        ASSERT_EQ(total, tiles) << lo << " " << hi << " " << n;
      }
}

// ---- paged addressing --------------------------------------------------------------------------

TEST(DecodeCpu, PagedEveryPageSizeMatchesContiguousBitForBit) {
  // The paged and the contiguous run read the same keys in the same order, so the outputs are
  // identical bit for bit, not just close; and both match fp64.
  DCase base;
  base.batch = 3;
  base.hq = 4;
  base.hkv = 2;
  base.d = 64;
  base.dt = DType::kBF16;
  base.lens = {300, 1, 77};
  base.append = true;
  base.sq = 2;
  base.rot = RopeStyle::kNeox;
  base.num_splits = 3;
  base.name = "contiguous";
  Problem ref_pr(base, 11);
  Expected e;
  expected(ref_pr, &e);
  RunResult rr;
  ASSERT_TRUE(plan_and_run(ref_pr, &rr).ok());
  compare(ref_pr, e);
  for (int ps = 1; ps <= 256; ps *= 2) {
    DCase c = base;
    c.page_size = ps;
    c.name = "page" + std::to_string(ps);
    SCOPED_TRACE(c.name);
    Problem pr(c, 11);  // same salt: same q, k_new, v_new and cache contents
    ASSERT_EQ(std::memcmp(pr.q.bytes.data(), ref_pr.q.bytes.data(), pr.q.bytes.size()), 0);
    Expected pe;
    expected(pr, &pe);
    RunResult prr;
    const Status st = plan_and_run(pr, &prr);
    ASSERT_TRUE(st.ok()) << st.to_string();
    compare(pr, pe);
    EXPECT_EQ(std::memcmp(pr.o.bytes.data(), ref_pr.o.bytes.data(), pr.o.bytes.size()), 0)
        << "paged output differs from the contiguous one";
    EXPECT_EQ(std::memcmp(pr.lse.data(), ref_pr.lse.data(), pr.lse.size() * sizeof(float)), 0);
  }
}

TEST(DecodeCpu, PagedShuffledPagesAllSizesAgainstFp64) {
  for (int ps : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    DCase c;
    c.name = "paged" + std::to_string(ps);
    c.batch = 3;
    c.hq = 4;
    c.hkv = 1;
    c.d = 128;
    c.lens = {ps * 2 + 3, 0, 200};
    c.page_size = ps;
    c.num_splits = ps % 3 + 1;
    run_and_check(c, salt_of(c.name));
  }
}

// ---- ragged lengths, GQA, q_len ------------------------------------------------------------------

TEST(DecodeCpu, RaggedLengthsIncludingZeroAndOne) {
  for (bool append : {false, true}) {
    DCase c;
    c.name = append ? "ragged_append" : "ragged";
    c.batch = 7;
    c.hq = 4;
    c.hkv = 2;
    c.d = 64;
    c.lens = {0, 1, 2, 63, 64, 65, 333};
    c.append = append;
    c.num_sms = 2;
    run_and_check(c, salt_of(c.name));
  }
}

TEST(DecodeCpu, GqaAndMqa) {
  struct G {
    int hq, hkv, sq;
  };
  for (G gq : {G{4, 4, 1}, G{8, 2, 1}, G{8, 1, 3}, G{32, 1, 4}, G{12, 3, 7}}) {  // 32x4 = 128 rows: 2 row blocks
    DCase c;
    c.name = "gqa" + std::to_string(gq.hq) + "_" + std::to_string(gq.hkv) + "_sq" + std::to_string(gq.sq);
    c.batch = 2;
    c.hq = gq.hq;
    c.hkv = gq.hkv;
    c.sq = gq.sq;
    c.d = 64;
    c.lens = {150, 40};
    c.append = true;
    c.num_splits = 2;
    DecodePlan plan;
    run_and_check(c, salt_of(c.name), &plan);
    EXPECT_EQ(plan.rows_per_kv, gq.hq / gq.hkv * gq.sq);
  }
}

TEST(DecodeCpu, EveryHeadDimAndHeadDimV) {
  // Every multiple of 8 up to 256 (alternately split and merged, with rotary on the appended
  // keys), then values narrower and wider than the keys (DeepSeek's 192/128 among them).
  for (int d = 8; d <= kMaxHeadDim; d += 8) {
    DCase c;
    c.name = "d" + std::to_string(d);
    c.batch = 2;
    c.hq = 4;
    c.hkv = 2;
    c.sq = 2;
    c.d = d;
    c.lens = {37, 70};
    c.append = true;
    c.num_splits = d % 16 == 0 ? 2 : 1;
    if (d % 32 == 0) c.rot = RopeStyle::kNeox;
    DecodePlan plan;
    run_and_check(c, salt_of(c.name), &plan);
    EXPECT_EQ(plan.head_dim_v, d);
  }
  struct Dims {
    int d, dv;
  };
  for (Dims dd : {Dims{192, 128}, Dims{128, 64}, Dims{64, 128}, Dims{96, 80}, Dims{8, 256}, Dims{256, 8}}) {
    for (int splits : {1, 3}) {
      DCase c;
      c.name = "d" + std::to_string(dd.d) + "v" + std::to_string(dd.dv) + "_splits" + std::to_string(splits);
      c.batch = 2;
      c.hq = 4;
      c.hkv = 1;
      c.sq = 3;
      c.d = dd.d;
      c.dv = dd.dv;
      c.dt = splits == 1 ? DType::kBF16 : DType::kF32;
      c.lens = {150, 9};
      c.append = true;
      c.rot = RopeStyle::kInterleaved;
      c.num_splits = splits;
      c.page_size = splits == 3 ? 16 : 0;
      DecodePlan plan;
      run_and_check(c, salt_of(c.name), &plan);
      EXPECT_EQ(plan.head_dim, dd.d);
      EXPECT_EQ(plan.head_dim_v, dd.dv);
    }
  }
}

TEST(DecodeCpu, HeadDimVMustMatchThePlan) {
  DCase c;
  c.name = "plan_dv";
  c.d = 64;
  c.lens = {20};
  Problem pr(c, 5);
  pr.p.head_dim_v = 32;  // v and o read as the 32-wide leading slices of their 64-wide rows
  RunResult rr;
  const Status planned = plan_and_run(pr, &rr);
  ASSERT_TRUE(planned.ok()) << planned.to_string();
  EXPECT_EQ(rr.plan.head_dim_v, 32);
  pr.p.head_dim_v = 0;  // 64: the views still fit, the plan's partials do not
  RunOptions ro;
  ro.backend = Backend::kCpu;
  const Status st = decode_run(pr.p, rr.plan, ro);
  EXPECT_EQ(st.message(), "decode_run: head_dim_v 64 differs from the plan's 32 (run decode_plan again for this shape)");
}

// ---- the fp8 e4m3 cache ------------------------------------------------------------------

/// The e4m3 value nearest to x among all finite codes, ties to the code with an even last bit,
/// saturating at +-448: a brute-force model of float_to_fp8e4m3_bits (independent of its
/// frexp/nearbyint arithmetic).
std::uint8_t nearest_e4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448) return sign | 0x7e;
  int best = 0;
  double best_err = INFINITY;
  for (int code = 0; code <= 0x7e; ++code) {
    const double err = std::fabs(fp8e4m3_bits_to_float(static_cast<std::uint8_t>(code)) - a);
    if (err < best_err || (err == best_err && (code & 1) == 0)) best = code, best_err = err;
  }
  return sign | static_cast<std::uint8_t>(best);
}

TEST(Fp8E4M3, CodesDecodeToTheFormat) {
  EXPECT_EQ(fp8e4m3_bits_to_float(0x7e), 448.f);
  EXPECT_EQ(fp8e4m3_bits_to_float(0xfe), -448.f);
  EXPECT_EQ(fp8e4m3_bits_to_float(0x08), 0x1p-6f);   // smallest normal
  EXPECT_EQ(fp8e4m3_bits_to_float(0x07), 7 * 0x1p-9f);  // largest subnormal
  EXPECT_EQ(fp8e4m3_bits_to_float(0x01), 0x1p-9f);   // smallest subnormal
  EXPECT_EQ(fp8e4m3_bits_to_float(0x38), 1.f);
  EXPECT_EQ(fp8e4m3_bits_to_float(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(fp8e4m3_bits_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8e4m3_bits_to_float(0xff)));
  EXPECT_TRUE(std::signbit(fp8e4m3_bits_to_float(0x80)));
  // Every finite code comes back from its own value; the values increase with the code.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float v = fp8e4m3_bits_to_float(static_cast<std::uint8_t>(code));
    EXPECT_EQ(float_to_fp8e4m3_bits(v), code) << code;
    if ((code & 0x7f) > 0 && code < 0x7f) EXPECT_LT(fp8e4m3_bits_to_float(static_cast<std::uint8_t>(code - 1)), v);
  }
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_STREQ(dtype_name(DType::kF8E4M3), "fp8_e4m3");
}

TEST(Fp8E4M3, RoundsToNearestEvenAndSaturates) {
  // Every midpoint between neighbouring codes (ties to even), a hair either side of it, and
  // random values of every magnitude, against the brute-force nearest code.
  std::vector<float> xs;
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = fp8e4m3_bits_to_float(static_cast<std::uint8_t>(code));
    const float hi = fp8e4m3_bits_to_float(static_cast<std::uint8_t>(code + 1));
    const float mid = lo + (hi - lo) / 2;  // exact: a few bits wider than e4m3
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)});
  }
  auto g = testing::rng(0xf8);
  std::uniform_real_distribution<float> expo(-12.f, 10.f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(expo(g)));
  xs.insert(xs.end(), {0.f, 448.f, 449.f, 464.f, 480.f, 1e6f, INFINITY, 0x1p-10f, 0x1p-12f, 1e-30f});
  for (float x : xs)
    for (float v : {x, -x}) {
      const std::uint8_t got = float_to_fp8e4m3_bits(v), want = nearest_e4m3(v);
      ASSERT_EQ(got, want) << "x = " << v << " (" << std::hexfloat << v << std::defaultfloat << ")";
    }
  EXPECT_EQ(float_to_fp8e4m3_bits(INFINITY), 0x7e);   // satfinite: infinity saturates
  EXPECT_EQ(float_to_fp8e4m3_bits(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_fp8e4m3_bits(NAN) & 0x7f, 0x7f);  // NaN stays NaN
  EXPECT_EQ(float_to_fp8e4m3_bits(0x1p-10f), 0x00);    // half the smallest subnormal: ties to 0
  EXPECT_EQ(float_to_fp8e4m3_bits(3 * 0x1p-10f), 0x02);  // 1.5 subnormal steps: ties to 2
}

DCase fp8_case(const std::string& name) {
  DCase c;
  c.name = name;
  c.fp8 = true;
  c.batch = 3;
  c.hq = 8;
  c.hkv = 2;
  c.sq = 2;
  c.d = 128;
  c.lens = {300, 0, 77};
  c.append = true;
  return c;
}

TEST(DecodeCpu, Fp8CacheIsAttentionOverTheDequantizedCache) {
  // Against fp64 attention over code * scale: the append's codes bit for bit (rotary on K before
  // the division by the scale), O and LSE within the decode tolerance, through every path.
  std::vector<DCase> cases;
  cases.push_back(fp8_case("fp8_contiguous_fp32"));
  DCase c = fp8_case("fp8_paged_bf16_rotary_splits");
  c.dt = DType::kBF16;
  c.page_size = 16;
  c.rot = RopeStyle::kNeox;
  c.num_splits = 3;
  cases.push_back(c);
  c = fp8_case("fp8_fp16_window_softcap_alibi");
  c.dt = DType::kF16;
  c.wl = 40;
  c.softcap = 15.f;
  c.alibi = true;
  c.num_splits = 2;
  cases.push_back(c);
  c = fp8_case("fp8_d96v80_interleaved_no_append");
  c.d = 96;
  c.dv = 80;
  c.append = false;
  c.rot = RopeStyle::kInterleaved;
  c.sdpa_cache = true;
  cases.push_back(c);
  c = fp8_case("fp8_mqa_sq16_scale");
  c.hq = 4;
  c.hkv = 1;
  c.sq = 16;
  c.scale = 0.05f;
  cases.push_back(c);
  for (const DCase& k : cases) run_and_check(k, salt_of(k.name));
}

TEST(DecodeCpu, Fp8CacheErrorAgainstTheUnquantizedCache) {
  // What the quantization itself costs: the same step over a bf16 cache and over an fp8 cache of
  // the same values (scale = amax / 448 per head). e4m3 keeps 3 mantissa bits (relative step
  // 2^-3, rounding error <= 2^-4 of the value), so K moves each score by ~2^-4 |q| |k| / sqrt(d) / 3
  // and V each product by up to 2^-4: measured max |O_fp8 - O_bf16| ~ 2e-2 for N(0, 1) inputs at
  // 1000 keys (the error averages over the keys), mean ~2.5e-3 (d 64 and 128, 2026-12-03). The
  // bounds below are 4x the worst max and 3x the worst mean seen over seeds.
  for (int d : {64, 128}) {
    DCase c;
    c.name = "fp8_error_d" + std::to_string(d);
    c.batch = 2;
    c.hq = 4;
    c.hkv = 2;
    c.sq = 1;
    c.d = d;
    c.dt = DType::kBF16;
    c.lens = {1000, 200};
    Problem ref(c, salt_of(c.name));
    c.fp8 = true;
    Problem q8(c, salt_of(c.name));
    // The fp8 cache: the bf16 cache's values quantized with scale = amax / 448 per KV head.
    for (int h = 0; h < c.hkv; ++h) {
      float amax_k = 0, amax_v = 0;
      for (int b = 0; b < c.batch; ++b)
        for (int j = 0; j < ref.lens[b]; ++j)
          for (int x = 0; x < d; ++x) {
            amax_k = std::max(amax_k, std::fabs(ref.kc.get(ref.offset(ref.p.cache.k, b, j, h) + x)));
            amax_v = std::max(amax_v, std::fabs(ref.vc.get(ref.offset(ref.p.cache.v, b, j, h) + x)));
          }
      q8.k_scale[h] = amax_k / 448.f;
      q8.v_scale[h] = amax_v / 448.f;
      for (int b = 0; b < c.batch; ++b)
        for (int j = 0; j < ref.lens[b]; ++j)
          for (int x = 0; x < d; ++x) {
            const std::int64_t ko = ref.offset(ref.p.cache.k, b, j, h) + x, vo = ref.offset(ref.p.cache.v, b, j, h) + x;
            q8.kc.set(ko, ref.kc.get(ko) / q8.k_scale[h]);
            q8.vc.set(vo, ref.vc.get(vo) / q8.v_scale[h]);
          }
    }
    for (std::int64_t i = 0; i < ref.q.size(); ++i) q8.q.set(i, ref.q.get(i));
    RunResult r1, r2;
    ASSERT_TRUE(plan_and_run(ref, &r1).ok());
    ASSERT_TRUE(plan_and_run(q8, &r2).ok());
    double worst = 0, sum = 0;
    for (std::int64_t i = 0; i < ref.o.size(); ++i) {
      const double e = std::fabs(static_cast<double>(q8.o.get(i)) - ref.o.get(i));
      ASSERT_TRUE(std::isfinite(e)) << i;
      worst = std::max(worst, e);
      sum += e;
    }
    const double mean = sum / static_cast<double>(ref.o.size());
    std::printf("[ fp8 ] head_dim %d: max |O_fp8 - O_bf16| %.3g, mean %.3g\n", d, worst, mean);
    EXPECT_LT(worst, 0.08) << "head_dim " << d;
    EXPECT_LT(mean, 0.008) << "head_dim " << d;
    EXPECT_GT(worst, 0.0) << "the fp8 cache gave the bf16 answer exactly: was it quantized?";
  }
}

TEST(DecodeValidate, Fp8CacheMessages) {
  DCase c = fp8_case("fp8_messages");
  Problem pr(c, 3);
  auto status = [&](auto edit, Backend b = Backend::kCpu) {
    DecodeParams p = pr.p;
    edit(p);
    return validate(p, b);
  };
  EXPECT_TRUE(status([](DecodeParams&) {}).ok());
  EXPECT_EQ(status([](DecodeParams& p) { p.cache.k_scale = nullptr; }).message(), "cache.k_scale is null");
  EXPECT_EQ(status([](DecodeParams& p) { p.cache.v.dtype = DType::kF32; }).message(),
            "cache.k.dtype fp8_e4m3 differs from cache.v.dtype fp32 (an fp8 cache quantizes both K and V)");
  EXPECT_EQ(status([](DecodeParams& p) { p.q.dtype = DType::kF8E4M3; }).message(),
            "q.dtype 4 is not a known dtype (fp16, bf16 or fp32)");
  std::vector<float> bad = pr.k_scale;
  bad[1] = 0.f;
  EXPECT_EQ(status([&](DecodeParams& p) { p.cache.k_scale = bad.data(); }).message(),
            "cache.k_scale[1] 0 must be positive and finite");
  bad[1] = NAN;
  EXPECT_EQ(status([&](DecodeParams& p) { p.cache.v_scale = bad.data(); }).message(),
            "cache.v_scale[1] nan must be positive and finite");
  // The CUDA kernels read an fp8 cache too; its strides must be multiples of 16 codes (16 bytes),
  // not 8 elements as for a 16-bit cache.
  const Status cuda = status(
      [](DecodeParams& p) {
        p.q.dtype = p.o.dtype = p.k_new.dtype = p.v_new.dtype = DType::kBF16;
        p.cache.k.head_stride = 136;
      },
      Backend::kCuda);
  EXPECT_EQ(cuda.message(), "cache.k.head_stride 136 is not a multiple of 16 elements (the CUDA kernels use 16-byte "
                            "vector loads)");
  // Scales on a cache that is not fp8 are a mistake, not ignored.
  DCase plain = fp8_case("bf16_with_scales");
  plain.fp8 = false;
  Problem pb(plain, 4);
  DecodeParams p = pb.p;
  p.cache.k_scale = pr.k_scale.data();
  EXPECT_EQ(validate(p, Backend::kCpu).message(),
            "cache.k_scale is set but the cache is fp32 (the scales belong to an fp8_e4m3 cache)");
}

TEST(DecodeCpu, QueryLengths1To16Causal) {
  for (int sq = 1; sq <= kDecodeMaxSeqlenQ; ++sq) {
    DCase c;
    c.name = "sq" + std::to_string(sq);
    c.batch = 2;
    c.hq = 2;
    c.hkv = 1;
    c.sq = sq;
    c.d = 64;
    c.lens = {sq % 2 ? 0 : 3, 90};  // an empty cache: the new tokens see only each other
    c.append = true;
    c.num_splits = sq % 3 + 1;
    run_and_check(c, salt_of(c.name));
  }
  // Without append a cache shorter than seqlen_q leaves the first rows with no key (O = 0, LSE = -inf).
  DCase c;
  c.name = "sq8_short_cache";
  c.sq = 8;
  c.lens = {5};
  c.hq = 2;
  run_and_check(c, salt_of(c.name));
}

// ---- masks -----------------------------------------------------------------------------------------

TEST(DecodeCpu, WindowAlibiSoftcap) {
  std::vector<DCase> cs;
  auto add = [&](const std::string& n, auto f) {
    DCase c;
    c.name = n;
    c.batch = 3;
    c.hq = 4;
    c.hkv = 2;
    c.sq = 4;
    c.d = 64;
    c.lens = {400, 3, 129};
    c.append = true;
    c.num_splits = 0;
    c.num_sms = 2;
    f(c);
    cs.push_back(c);
  };
  add("window100", [](DCase& c) { c.wl = 100; });
  add("window0", [](DCase& c) { c.wl = 0; });
  add("window70_split5", [](DCase& c) { c.wl = 70; c.num_splits = 5; });
  add("noncausal_window_right", [](DCase& c) { c.causal = false; c.wl = 30; c.wr = 1; });
  add("noncausal", [](DCase& c) { c.causal = false; });
  add("alibi", [](DCase& c) { c.alibi = true; });
  add("alibi_per_batch_window", [](DCase& c) { c.alibi = true; c.alibi_per_batch = true; c.wl = 50; });
  add("softcap", [](DCase& c) { c.softcap = 2.f; });
  add("softcap_alibi_scale", [](DCase& c) { c.softcap = 5.f; c.alibi = true; c.scale = 0.3f; });
  add("negative_scale", [](DCase& c) { c.scale = -0.125f; });
  for (const DCase& c : cs) run_and_check(c, salt_of(c.name));
}

// ---- append + rotary ----------------------------------------------------------------------------------

TEST(DecodeCpu, AppendRotaryBothStyles) {
  // tables: 0 = theta, 1 = separate cos/sin tables, 2 = one cos_sin_cache (RotarySpec's two layouts).
  for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved})
    for (int tables : {0, 1, 2})
      for (int rd : {0, 32}) {
        for (int ps : {0, 16}) {
          DCase c;
          c.name = std::string(rope_style_name(st)) + (tables == 0 ? "_theta" : tables == 1 ? "_tables" : "_cache") +
                   "_rd" + std::to_string(rd) + "_page" + std::to_string(ps);
          c.batch = 2;
          c.hq = 4;
          c.hkv = 2;
          c.sq = 3;
          c.d = 64;
          c.lens = {1000, 17};
          c.append = true;
          c.rot = st;
          c.rotary_dim = rd;
          c.tables = tables > 0;
          c.cos_sin_cache = tables == 2;
          c.page_size = ps;
          c.dt = DType::kBF16;
          run_and_check(c, salt_of(c.name));
        }
      }
}

TEST(DecodeCpu, AppendRotaryLlama3) {
  // Decode takes the whole RotarySpec: theta with the Llama-3 frequency scaling (Llama-3.2's).
  for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
    DCase c;
    c.name = std::string("llama3_") + rope_style_name(st);
    c.batch = 2;
    c.hq = 4;
    c.hkv = 2;
    c.sq = 2;
    c.d = 128;
    c.lens = {20000, 5};
    c.append = true;
    c.rot = st;
    c.theta = 500000.0;
    c.llama3 = Llama3Scaling{32.f, 1.f, 4.f, 8192};
    c.dt = DType::kBF16;
    run_and_check(c, salt_of(c.name));
  }
}

TEST(DecodeCpu, RotaryRuleIsARotation) {
  // The rule of decode.h vs exact fp64 rotation: a rotation by pos * theta^(-2i/d), with pairs
  // (i, i + d/2) for neox and (2i, 2i+1) for interleaved. The angle is reduced in fp64, so the
  // error stays at fp32 rounding at any position (an fp32 angle lost ~pos * 2^-24).
  RotarySpec ro;
  ro.theta = 10000.f;
  for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
    ro.style = st;
    for (int pos : {0, 1, 17, 4096, 1 << 20}) {
      std::vector<float> x(64);
      for (int i = 0; i < 64; ++i) x[i] = std::sin(0.37f * i + 1.f);
      std::vector<float> y = x;
      rotate(ro, 64, pos, y.data());
      for (int i = 0; i < 32; ++i) {
        const int a = st == RopeStyle::kNeox ? i : 2 * i, b = st == RopeStyle::kNeox ? i + 32 : 2 * i + 1;
        const double ang = pos * std::pow(10000.0, -2.0 * i / 64);
        const double ea = x[a] * std::cos(ang) - x[b] * std::sin(ang);
        const double eb = x[b] * std::cos(ang) + x[a] * std::sin(ang);
        EXPECT_NEAR(y[a], ea, 1e-6) << "pos " << pos << " pair " << i;
        EXPECT_NEAR(y[b], eb, 1e-6) << "pos " << pos << " pair " << i;
      }
    }
  }
}

TEST(DecodeCpu, DtypesAndLayouts) {
  for (DType dt : {DType::kBF16, DType::kF16})
    for (int d : {64, 128, 256}) {
      DCase c;
      c.name = std::string(dtype_name(dt)) + "_d" + std::to_string(d);
      c.batch = 2;
      c.hq = 4;
      c.hkv = 1;
      c.sq = 2;
      c.d = d;
      c.dt = dt;
      c.lens = {97, 54};
      c.append = true;
      c.num_splits = 2;
      c.rot = RopeStyle::kInterleaved;
      c.sdpa_cache = d == 128;
      run_and_check(c, salt_of(c.name));
    }
}

// ---- plan / run ----------------------------------------------------------------------------------------

TEST(DecodeCpu, ReplayWithNewLengthsUnderOnePlan) {
  // What a CUDA graph does: plan once (for bound lengths), then run with other lengths.
  DCase c;
  c.name = "replay";
  c.batch = 3;
  c.hq = 4;
  c.hkv = 2;
  c.d = 64;
  c.sq = 2;
  c.append = true;
  c.lens = {500, 260, 9};
  c.num_sms = 2;
  c.extra_slots = 610 - static_cast<int>(max_total(c));
  Problem pr(c, 5);
  const std::vector<std::int32_t> bound = {600, 600, 600};
  DecodePlanOptions po;
  po.backend = Backend::kCpu;
  po.host_cache_seqlens = bound.data();
  po.num_sms = 4;  // 12 CTAs a wave vs 6 unsplit: the plan splits (2 per sequence)
  DecodeWorkspaceSize ws;
  ASSERT_TRUE(decode_workspace_size(pr.p, po, &ws).ok());
  Workspace iw(ws.int_bytes), fw(ws.float_bytes);
  DecodePlan plan;
  ASSERT_TRUE(decode_plan(pr.p, po, iw.ptr, iw.bytes, fw.ptr, fw.bytes, &plan).ok());
  EXPECT_TRUE(plan.needs_merge);
  for (const std::vector<int>& lens : {std::vector<int>{500, 260, 9}, {3, 0, 200}, {120, 598, 1}}) {
    DCase cl = c;
    cl.lens = lens;
    cl.extra_slots = 610 - static_cast<int>(max_total(cl));  // one cache geometry for every step
    Problem step(cl, 5);
    Expected e;
    expected(step, &e);
    RunOptions ro;
    ro.backend = Backend::kCpu;
    const Status st = decode_run(step.p, plan, ro);
    ASSERT_TRUE(st.ok()) << st.to_string();
    compare(step, e);
  }
}

TEST(DecodeCpu, SplitHeuristic) {
  // The documented examples (docs/decode.md).
  using SmallPlan = DecodePlanOptions::SmallPlan;
  // Every sequence `len` keys; fp8: an fp8 cache; smem: the SM's shared memory (0: 228 KB).
  auto splits = [](int batch, int hq, int hkv, int d, int len, int sq = 1, int sms = 132,
                   SmallPlan small = SmallPlan::kFullWave, bool fp8 = false, int smem = 0) {
    DecodeParams p;
    p.batch = batch;
    p.heads_q = hq;
    p.heads_kv = hkv;
    p.head_dim = d;
    p.seqlen_q = sq;
    p.cache.capacity = len;
    if (fp8) p.cache.k.dtype = p.cache.v.dtype = DType::kF8E4M3;
    select::SplitDecision s;
    std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
    EXPECT_TRUE(select::decode_splits(p, lens.data(), 0, 0, sms, &s, small, smem).ok());
    return s;
  };
  auto shared = [&](int batch, int hq, int hkv, int d, int len) {
    return splits(batch, hq, hkv, d, len, 1, 132, SmallPlan::kShared).max_splits;
  };
  // B=1, Hq=32, Hkv=8, N=8192, D=128: 8 CTAs unsplit; one wave is 132*2 = 264 CTAs;
  // 1024 tiles of work -> chunk max(4, ceil(1024/264)) = 4 tiles -> 32 splits, 256 CTAs.
  EXPECT_EQ(splits(1, 32, 8, 128, 8192).max_splits, 32);
  // MHA 32/32: 4096 tiles -> chunk 16 -> 8 splits (256 CTAs).
  EXPECT_EQ(splits(1, 32, 32, 128, 8192).max_splits, 8);
  // B=16 GQA: base chunk 63 tiles would give 3 splits = 384 CTAs, 1.45 waves; 2 splits = 256 CTAs
  // fill one wave (measured 137 us vs 175 us), and 4 splits cost as much with more merge traffic.
  EXPECT_EQ(splits(16, 32, 8, 128, 8192).max_splits, 2);
  // B=4 GQA: 4096 tile-CTAs over 264 -> chunk 16 -> 8 splits, 256 CTAs.
  EXPECT_EQ(splits(4, 32, 8, 128, 8192).max_splits, 8);
  // B=64 GQA: 512 CTAs unsplit already fill the GPU.
  EXPECT_EQ(splits(64, 32, 8, 128, 8192).max_splits, 1);
  // Too small to fill a wave with 256-key splits: latency-bound, so it splits further, down to one
  // 64-key tile (and >= 16 keys per row), never to fewer splits than 256-key splits give, until
  // one full wave of CTAs (attention alone; the split-count sweep at ce1fc6d,
  // reports/raw_decode_ce1fc6d_2026-12-04/probe_splits.csv, us for the old rule's count -> this
  // one's, both forced on the H200 in one run):
  EXPECT_EQ(splits(1, 32, 8, 128, 2048).max_splits, 32);  // 8 -> 32: 14.2 -> 11.3 us
  EXPECT_EQ(splits(4, 16, 2, 128, 2048).max_splits, 16);  // 8 -> 16: 15.7 -> 13.6
  EXPECT_EQ(splits(1, 64, 8, 256, 2048).max_splits, 16);  // 8 -> 16: 23.6 -> 20.3
  EXPECT_EQ(splits(4, 32, 8, 64, 512).max_splits, 8);     // 2 -> 8: 12.5 -> 10.3
  EXPECT_EQ(splits(1, 32, 32, 64, 512).max_splits, 8);    // 2 -> 8: 13.8 -> 11.0
  EXPECT_EQ(splits(32, 16, 2, 64, 512).max_splits, 4);    // 2 -> 4: 14.2 -> 13.3
  EXPECT_EQ(splits(1, 32, 8, 128, 512).max_splits, 8);    // as before (10.4 us)
  // With 8 query rows per KV head the 16-keys-per-row floor (2 tiles) decides, as before: 1 x 16/2
  // and 1 x 8/1 at 2048 keys keep 16 splits (12.0 and 9.8 us; one tile a split measured 10.4, 9.1).
  EXPECT_EQ(splits(1, 16, 2, 128, 2048).max_splits, 16);
  EXPECT_EQ(splits(1, 8, 1, 64, 2048).max_splits, 16);
  EXPECT_EQ(splits(1, 32, 8, 64, 513).max_splits, 9);
  EXPECT_EQ(splits(2, 32, 8, 64, 513).max_splits, 9);
  EXPECT_EQ(splits(1, 32, 8, 64, 2049).max_splits, 33);
  EXPECT_EQ(splits(8, 32, 8, 64, 513).max_splits, 5);
  EXPECT_EQ(splits(1, 32, 8, 128, 300).max_splits, 5);
  // SmallPlan::kShared stops at 5/8 of the SMs' worth of CTAs (82 on 132 SMs), the engine's
  // setting: its shapes (D 64, GQA 32/8, forced split counts inside the graph step, reports/engine)
  // measured ctx 512 at batch 1 -> 9 splits, 72 CTAs (3 splits 992 us/step, 9 splits 955); batch
  // 2 -> 5 splits, 80 CTAs (3: 1125, 4: 1117, 5: 1102, 9: 1169); ctx 2048 -> 9 splits (9: 999,
  // 16: 1099, 33: 1091), although attention alone got faster with more.
  EXPECT_EQ(shared(1, 32, 8, 64, 513), 9);
  EXPECT_EQ(shared(2, 32, 8, 64, 513), 5);
  EXPECT_EQ(shared(1, 32, 8, 64, 2049), 9);
  EXPECT_EQ(shared(8, 32, 8, 64, 513), 3);  // 256-key splits (3) beat the budget's 2
  EXPECT_EQ(splits(1, 32, 8, 128, 64).max_splits, 1);
  // ... and never below 16 keys per row: a 4-token speculative step of GQA 32/8 (16 rows) keeps
  // 256 keys per split.
  EXPECT_EQ(splits(1, 32, 8, 128, 300, 4).max_splits, 2);
  // The wave is that of the kernel class that holds both head dims: 64 / 128 plans as D = 128.
  {
    DecodeParams pv;
    pv.batch = 4;
    pv.heads_q = 32;
    pv.heads_kv = 8;
    pv.head_dim = 64;
    pv.head_dim_v = 128;
    pv.seqlen_q = 1;
    pv.cache.capacity = 8192;
    const std::vector<std::int32_t> lv(4, 8192);
    select::SplitDecision sv;
    ASSERT_TRUE(select::decode_splits(pv, lv.data(), 0, 0, 132, &sv).ok());
    EXPECT_EQ(sv.max_splits, splits(4, 32, 8, 128, 8192).max_splits);
    EXPECT_NE(sv.max_splits, splits(4, 32, 8, 64, 8192).max_splits);
  }
  // An fp8 cache runs two CTAs per SM at D = 256 (Config<256>::kCtasPerSm8; one for 16-bit
  // caches), so its wave is 264 CTAs: B=8, MQA 8/1, 16384 keys (2048 tiles) splits 32 ways where a
  // bf16 cache splits 16 ways; at D = 128 both run two CTAs per SM and plan alike.
  {
    auto fp8_splits = [&](int batch, int hq, int hkv, int d, int len, bool fp8) {
      return splits(batch, hq, hkv, d, len, 1, 132, SmallPlan::kFullWave, fp8);
    };
    EXPECT_EQ(fp8_splits(8, 8, 1, 256, 16384, false).max_splits, 16);
    EXPECT_EQ(fp8_splits(8, 8, 1, 256, 16384, true).max_splits, 32);
    EXPECT_EQ(fp8_splits(8, 8, 1, 256, 16384, true).ctas_per_sm, 2);
    EXPECT_EQ(fp8_splits(8, 8, 1, 256, 16384, false).ctas_per_sm, 1);
    // D = 128: three fp8 CTAs per SM, so a one-wave plan fills 396 CTAs: B=1 GQA 32/8 at 32768 keys
    // splits 47 ways (376 CTAs) where bf16 splits 32 ways (256).
    EXPECT_EQ(fp8_splits(1, 32, 8, 128, 32768, false).max_splits, 32);
    EXPECT_EQ(fp8_splits(1, 32, 8, 128, 32768, true).max_splits, 47);
    EXPECT_EQ(fp8_splits(1, 32, 8, 128, 32768, true).ctas_per_sm, 3);
    // ... but a batch of whole sequences that fills the GPU keeps two per SM where that takes fewer
    // waves: 64 x 8 KV heads = 512 CTAs are 2 waves x 2 per SM (cost 4) against 2 x 3 (cost 6);
    // 400 CTAs: 2 x 2 against 2 x 3 too; 396 fill one wave of 3 (3 against 2 x 2).
    EXPECT_EQ(fp8_splits(64, 32, 8, 128, 2048, true).max_splits, 1);
    EXPECT_EQ(fp8_splits(64, 32, 8, 128, 2048, true).ctas_per_sm, 2);
    EXPECT_EQ(fp8_splits(50, 32, 8, 128, 2048, true).ctas_per_sm, 2);
    EXPECT_EQ(fp8_splits(1, 396, 396, 128, 64, true).ctas_per_sm, 3);
    EXPECT_EQ(decode::ctas_per_sm(256, true), 2);
    EXPECT_EQ(decode::ctas_per_sm(256, false), 1);
    EXPECT_EQ(decode::ctas_per_sm(200, true), 2);  // padded into the 256 class
    EXPECT_EQ(decode::ctas_per_sm(128, true), 3);
    EXPECT_EQ(decode::ctas_per_sm(64, true), 4);
    // An SM with less shared memory holds fewer CTAs, and the wave is planned for what fits: an
    // A100 (108 SMs, 164 KB per SM) holds one D = 128 16-bit CTA (112 KB + 1 KB), two at D = 64
    // and two fp8 CTAs at D = 128.
    constexpr int kA100 = 164 * 1024;
    EXPECT_EQ(decode::ctas_per_sm(128, false, kA100), 1);
    EXPECT_EQ(decode::ctas_per_sm(64, false, kA100), 2);
    EXPECT_EQ(decode::ctas_per_sm(256, false, kA100), 1);
    EXPECT_EQ(decode::ctas_per_sm(128, true, kA100), 2);
    EXPECT_EQ(decode::ctas_per_sm(128, false, 228 * 1024), decode::ctas_per_sm(128, false));
    EXPECT_EQ(decode::ctas_per_sm(128, false, 1024), 1);  // never below one
    const select::SplitDecision a100 = splits(1, 32, 8, 128, 32768, 1, 108, SmallPlan::kFullWave, false, kA100);
    const select::SplitDecision h200 = splits(1, 32, 8, 128, 32768, 1, 108);
    EXPECT_LE(a100.num_items * 8, 108);   // one wave of one CTA per SM
    EXPECT_GT(h200.num_items * 8, 108);   // the 228 KB plan counts two
    EXPECT_EQ(a100.ctas_per_sm, 1);
    // The launch's shared memory for a plan's CTAs per SM: padded only for an fp8 cache planned
    // at the 16-bit count, to the SM's memory over that count (2 on an H200 at D = 128: 112 KB + 1
    // KB each, so 3 no longer fit; 1 on an A100), else the kernel's own size (0).
    constexpr int kH200 = 228 * 1024;
    const int pad = decode::launch_smem_pad(128, true, 2, kH200);
    EXPECT_EQ(pad, kH200 / 2 - 1024);
    EXPECT_GT(pad, decode::cta_smem_bytes(128, true));
    EXPECT_GT(3 * (pad + 1024), kH200);
    EXPECT_EQ(decode::launch_smem_pad(128, true, 3, kH200), 0);   // the fp8 count: its own size
    EXPECT_EQ(decode::launch_smem_pad(128, false, 2, kH200), 0);  // a 16-bit cache
    EXPECT_EQ(decode::launch_smem_pad(256, true, 1, kH200), kH200 - 1024);
    EXPECT_EQ(decode::launch_smem_pad(128, true, 1, kA100), kA100 - 1024);
    EXPECT_EQ(decode::launch_smem_pad(64, true, 3, kH200), (kH200 / 3 - 1024) / 128 * 128);
  }
  // A ragged batch: splits follow the lengths. 8 KV heads x (256 + 16) tiles = 2176 tile-CTAs
  // over 264 CTAs -> chunk 9 tiles: 29 splits for 16384 keys, 2 for 1024.
  DecodeParams p;
  p.batch = 2;
  p.heads_q = 8;
  p.heads_kv = 8;
  p.head_dim = 128;
  p.cache.capacity = 16384;
  const std::vector<std::int32_t> lens = {16384, 1024};
  select::SplitDecision s;
  ASSERT_TRUE(select::decode_splits(p, lens.data(), 0, 0, 132, &s).ok());
  EXPECT_EQ(s.splits[0], 29);
  EXPECT_EQ(s.splits[1], 2);
}

// The work list numbers items sequence by sequence (first_item[b] = sum of the earlier split
// counts, then splits 0 .. n_b - 1 in order). The CUDA kernels rely on it: when every sequence has
// n splits (num_items == batch * n) they take (sequence, split) = (item / n, item % n) and a
// sequence's first item b * n without reading the list (decode_dispatch.cc, uniform_splits).
TEST(DecodeCpu, WorkListNumbersItemsSequenceBySequence) {
  int uniform_plans = 0, ragged_plans = 0;
  for (const auto& [lens, forced] : std::vector<std::pair<std::vector<int>, int>>{
           {{6000, 700, 0, 2500}, 0}, {{3000, 3000, 3000}, 0}, {{300, 7000}, 3}, {{1}, 0}}) {
    DCase c;
    c.batch = static_cast<int>(lens.size());
    c.hq = 2;
    c.hkv = 2;
    c.lens = lens;
    c.num_splits = forced;
    Problem pr(c, 11);
    DecodePlanOptions po;
    po.backend = Backend::kCpu;
    po.num_splits = forced;
    po.host_cache_seqlens = pr.lens.data();  // plan for these lengths: ragged split counts
    DecodeWorkspaceSize ws;
    ASSERT_TRUE(decode_workspace_size(pr.p, po, &ws).ok());
    Workspace iw(ws.int_bytes), fw(std::max<std::size_t>(ws.float_bytes, 16));
    DecodePlan plan;
    ASSERT_TRUE(decode_plan(pr.p, po, iw.ptr, iw.bytes, fw.ptr, fw.bytes, &plan).ok());
    const decode::WorkList wl = decode::worklist_view(iw.ptr, c.batch, plan.num_items);
    int next = 0;
    bool uniform = true;
    for (int b = 0; b < c.batch; ++b) {
      EXPECT_EQ(wl.first_item[b], next) << "sequence " << b;
      EXPECT_GE(wl.num_splits[b], 1);
      uniform = uniform && wl.num_splits[b] == plan.max_splits;
      for (int i = 0; i < wl.num_splits[b]; ++i, ++next) {
        EXPECT_EQ(wl.item_batch[next], b);
        EXPECT_EQ(wl.item_split[next], i);
      }
    }
    EXPECT_EQ(next, plan.num_items);
    // The kernels' test for "every sequence has max_splits splits".
    EXPECT_EQ(uniform, plan.num_items == c.batch * plan.max_splits);
    ++(uniform ? uniform_plans : ragged_plans);
    if (uniform)
      for (int item = 0; item < plan.num_items; ++item) {
        EXPECT_EQ(wl.item_batch[item], item / plan.max_splits);
        EXPECT_EQ(wl.item_split[item], item % plan.max_splits);
      }
  }
  EXPECT_GT(uniform_plans, 0);  // both kinds of plan were checked
  EXPECT_GT(ragged_plans, 0);
}

TEST(DecodeCpu, EmptyBatchAndWorkspaceChecks) {
  DCase c;
  c.batch = 2;
  c.hq = 2;
  c.lens = {100, 5};
  c.num_splits = 3;
  Problem pr(c, 3);
  DecodePlanOptions po;
  po.backend = Backend::kCpu;
  po.num_splits = 3;
  DecodeWorkspaceSize ws;
  ASSERT_TRUE(decode_workspace_size(pr.p, po, &ws).ok());
  EXPECT_EQ(ws.int_bytes, (2u * 2 + 2u * 6) * 4);
  EXPECT_GT(ws.float_bytes, 0u);
  for (int cap : {-1, kDecodeMaxSplits + 1}) {  // a cap outside [0, kDecodeMaxSplits], as num_splits
    DecodePlanOptions pc = po;
    pc.max_splits = cap;
    DecodeWorkspaceSize wc;
    const Status sc = decode_workspace_size(pr.p, pc, &wc);
    EXPECT_EQ(sc.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(sc.message().find("max_splits " + std::to_string(cap) + " is outside [0, 256]"), std::string::npos)
        << sc.message();
  }
  {  // the fused merge and append are CUDA options: the CPU backend plans the same workspaces
     // without them and its plan records neither
    DecodePlanOptions pf = po;
    pf.fused_merge = true;
    pf.fused_append = true;
    DecodeWorkspaceSize wf;
    ASSERT_TRUE(decode_workspace_size(pr.p, pf, &wf).ok());
    EXPECT_EQ(wf.int_bytes, ws.int_bytes);
    EXPECT_EQ(wf.float_bytes, ws.float_bytes);
    Workspace iw(wf.int_bytes), fw(wf.float_bytes);
    DecodePlan pl;
    ASSERT_TRUE(decode_plan(pr.p, pf, iw.ptr, iw.bytes, fw.ptr, fw.bytes, &pl).ok());
    EXPECT_FALSE(pl.fused_merge);
    EXPECT_FALSE(pl.fused_append);
  }
  Workspace iw(ws.int_bytes), fw(ws.float_bytes);
  DecodePlan plan;
  Status st = decode_plan(pr.p, po, iw.ptr, iw.bytes, fw.ptr, fw.bytes - 4, &plan);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("float workspace has"), std::string::npos) << st.message();
  st = decode_plan(pr.p, po, nullptr, 0, fw.ptr, fw.bytes, &plan);
  EXPECT_NE(st.message().find("int workspace is null"), std::string::npos) << st.message();
  st = decode_plan(pr.p, po, static_cast<char*>(iw.ptr) + 4, iw.bytes, fw.ptr, fw.bytes, &plan);
  EXPECT_NE(st.message().find("16-byte aligned"), std::string::npos) << st.message();
  ASSERT_TRUE(decode_plan(pr.p, po, iw.ptr, iw.bytes, fw.ptr, fw.bytes, &plan).ok());
  // run with a shape the plan was not made for
  DecodeParams p2 = pr.p;
  p2.batch = 1;
  st = decode_run(p2, plan, {});
  EXPECT_NE(st.message().find("batch 1 differs from the plan's 2"), std::string::npos) << st.message();
  // an unplanned plan
  st = decode_run(pr.p, DecodePlan{}, {});
  EXPECT_NE(st.message().find("call decode_plan first"), std::string::npos) << st.message();
  // batch 0: nothing to do, no pointers needed
  DecodeParams e;
  e.batch = 0;
  e.heads_q = e.heads_kv = 1;
  e.head_dim = 64;
  DecodePlan ep;
  ASSERT_TRUE(decode_plan(e, po, nullptr, 0, nullptr, 0, &ep).ok());
  EXPECT_TRUE(decode_run(e, ep, {}).ok());
}

// ---- validation --------------------------------------------------------------------------------------

TEST(DecodeValidate, Messages) {
  DCase c;
  c.batch = 2;
  c.hq = 4;
  c.hkv = 2;
  c.lens = {10, 20};
  c.page_size = 16;
  c.append = true;
  Problem pr(c, 1);
  auto msg = [&](auto mutate, Backend be = Backend::kCpu) {
    DecodeParams p = pr.p;
    mutate(p);
    const Status st = validate(p, be);
    return st.ok() ? std::string("ok") : st.message();
  };
  auto has = [](const std::string& m, const char* part) {
    return m.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                              : ::testing::AssertionFailure() << "message: " << m;
  };
  EXPECT_EQ(msg([](DecodeParams&) {}), "ok");
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.seqlen_q = 17; }), "seqlen_q 17 is outside the decode range 1..16"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.head_dim = 84; }), "head_dim 84 is not supported (it must be a multiple of 8 in [8, 256])"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.head_dim_v = 260; }), "head_dim_v 260 is not supported"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache.page_size = 48; }), "cache.page_size 48 is not a power of two in [1, 256]"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache.page_size = 512; }), "cache.page_size 512 is not a power of two"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache.block_table = nullptr; }), "cache.block_table is null but cache.page_size is 16"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.heads_kv = 3; }), "heads_q 4 is not a multiple of heads_kv 3"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.v_new.data = nullptr; }), "v_new is null but k_new is set"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache_seqlens = nullptr; }), "cache_seqlens is null"));
  EXPECT_TRUE(has(msg([&](DecodeParams& p) { static std::int32_t big[2] = {10, 1000}; p.cache_seqlens = big; }),
                  "cache_seqlens[1] 1000 + seqlen_q 1 = 1001 keys exceed the cache's"));
  EXPECT_TRUE(has(msg([&](DecodeParams& p) { static std::int32_t neg[2] = {-1, 3}; p.cache_seqlens = neg; }),
                  "cache_seqlens[0] -1 is negative"));
  EXPECT_TRUE(has(msg([&](DecodeParams& p) {
                    static std::vector<std::int32_t> bt;
                    bt.assign(pr.block_table.begin(), pr.block_table.end());
                    bt[0] = 9999;
                    p.cache.block_table = bt.data();
                  }),
                  "cache.block_table[0][0] 9999 is outside [0, num_pages"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.rotary.style = RopeStyle::kNeox; p.rotary.rotary_dim = 7; }),
                  "rotary.rotary_dim 7 must be even"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) {
                    static float t[4];
                    p.rotary.style = RopeStyle::kNeox;
                    p.rotary.cos = t;
                  }),
                  "rotary.sin is null but rotary.cos is set"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) {
                    static std::vector<float> t(32 * 4);
                    p.rotary.style = RopeStyle::kNeox;
                    p.rotary.cos = p.rotary.sin = t.data();
                    p.rotary.max_position = 4;
                  }),
                  "rotary positions [10, 10] of sequence 0 are outside the cos/sin tables' rows [0, 4)"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.mask.softcap = -1.f; }), "mask.softcap -1 must be finite and >= 0"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.mask.window_left = -5; }), "mask.window_left -5 must be >= -1"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { static float s[4]; p.mask.alibi_slopes = s; p.mask.alibi_batch_stride = 3; }),
                  "mask.alibi_batch_stride 3 must be 0 or heads_q 4"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.mask.global_tokens = 4; }), "global tokens are not supported by decode"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.o.dtype = DType::kBF16; }), "o.dtype bf16 differs from q.dtype fp32"));
  EXPECT_TRUE(has(msg([](DecodeParams&) {}, Backend::kCuda), "fp32 decode runs on the CPU backend only"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.o = p.q; }), "o overlaps q"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.k_new = p.cache.k; }), "cache.k overlaps k_new"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache.block_table_stride = 1; }),
                  "cache.block_table_stride 1 is less than cache.pages_per_seq"));
  // A stride whose rows overflow the block table's int64 extent (found by fuzz_decode_validate,
  // where the validator computed (batch - 1) * stride + pages_per_seq with signed overflow).
  for (std::int64_t huge : {std::numeric_limits<std::int64_t>::max(), std::int64_t{4448920629541715389}})
    EXPECT_TRUE(has(msg([huge](DecodeParams& p) { p.cache.block_table_stride = huge; }), "is too large"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.q.seq_stride = -64; }), "q.seq_stride -64 is negative"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache.pages_per_seq = 0; }), "cache.pages_per_seq 0 must be >= 1"));
  EXPECT_TRUE(has(msg([](DecodeParams& p) { p.cache.page_size = 0; p.cache.capacity = 10; }),
                  "cache.block_table is set but cache.page_size is 0"));
  EXPECT_TRUE(has(msg([](DecodeParams&) {}, Backend::kCpuReference), "no fp64 reference backend"));
}

// CUDA decode runs every head dim, and head_dim_v != head_dim, in the class that holds both (padded
// inside the kernels); over an fp8 cache it refuses head dims that are not multiples of 16, with a
// sentence naming the one. Validation only: host pointers, no device touched.
TEST(DecodeValidate, CudaTakesEveryHeadDimAndFp8MultiplesOf16) {
  for (int d = 8; d <= 256; d += 8)
    for (int dv : {0, 8, 40, 96, 256})
      for (bool fp8 : {false, true}) {
        DCase c = fp8_case("cuda_head_dims");
        c.fp8 = fp8;
        c.dt = DType::kBF16;
        c.d = d;
        c.dv = dv;
        c.batch = 1;
        c.hkv = 1;
        c.hq = 2;
        c.lens = {40};
        Problem pr(c, 5);
        const int w = c.width_v();
        SCOPED_TRACE("head_dim " + std::to_string(d) + " head_dim_v " + std::to_string(w) + (fp8 ? " fp8" : ""));
        ASSERT_TRUE(validate(pr.p, Backend::kCpu).ok());
        const Status s = validate(pr.p, Backend::kCuda);
        if (!fp8 || (d % 16 == 0 && w % 16 == 0)) {
          EXPECT_TRUE(s.ok()) << s.message();
        } else {
          const bool k_bad = d % 16 != 0;
          EXPECT_EQ(s.code(), StatusCode::kUnsupported);
          EXPECT_EQ(s.message(), "an fp8_e4m3 cache with " + std::string(k_bad ? "head_dim " : "head_dim_v ") +
                                     std::to_string(k_bad ? d : w) +
                                     " runs on the CPU backend only (the CUDA decode kernels copy 16 fp8 codes per "
                                     "16-byte load and take fp8 head dims that are multiples of 16; a 16-bit cache "
                                     "takes every multiple of 8)");
        }
      }
}

TEST(DecodeValidate, CudaAlignmentRules) {
  DCase c;
  c.batch = 1;
  c.hq = 2;
  c.hkv = 1;
  c.dt = DType::kBF16;
  c.lens = {10};
  Problem pr(c, 2);
  DecodeParams p = pr.p;
  p.q.seq_stride = 132;  // heads 2 * 64 + 4: not a multiple of 8 elements
  p.q.batch_stride = 2 * 132;
  // seq extent is 1 for seqlen_q 1, so seq_stride does not matter; head_stride does.
  p.q.head_stride = 68;
  const Status st = validate(p, Backend::kAuto);  // element rules only
  EXPECT_TRUE(st.ok() || st.message().find("share one element") != std::string::npos) << st.message();
  const Status sc = validate(p, Backend::kCuda);
  EXPECT_NE(sc.message().find("not a multiple of 8 elements"), std::string::npos) << sc.message();
}

// ---- NaN inputs (attention.h: a NaN score at a visible key makes the row NaN) ---------------------

// One NaN in q: its (token, head) row is NaN in O and LSE, with one split (the kernel writes O)
// and with several (the merge combines NaN partials), while the other heads of its KV group,
// which share the tiles and the merge, stay finite. Before, the split skipped a tile whose max
// was -inf (every score NaN) and the row came out finite (0) with LSE -inf.
TEST(DecodeCpu, NanQueryMakesItsRowNan) {
  for (int splits : {1, 3}) {
    for (int sq : {1, 4}) {
      DCase c;
      c.name = "nan_q_splits" + std::to_string(splits) + "_sq" + std::to_string(sq);
      SCOPED_TRACE(c.name);
      c.batch = 2;
      c.hq = 8;
      c.hkv = 2;
      c.sq = sq;
      c.lens = {300, 77};
      c.num_splits = splits;
      Problem pr(c, salt_of(c.name));
      pr.q.set(((1 * sq + sq - 1) * c.hq + 5) * c.d + 3, NAN);  // sequence 1, last token, head 5
      Expected e;
      expected(pr, &e);
      RunResult rr;
      ASSERT_TRUE(plan_and_run(pr, &rr).ok());
      std::int64_t nan_elements = 0;
      compare(pr, e, &nan_elements);
      EXPECT_EQ(nan_elements, c.d) << "exactly one row of the fp64 model is NaN";
      EXPECT_TRUE(std::isnan(pr.lse[static_cast<std::size_t>((1 * c.hq + 5) * sq + sq - 1)]));
    }
  }
}

// A NaN ALiBi slope makes its head NaN; a NaN in the k of a key left of the window does not
// reach any row (it is masked before the softmax).
TEST(DecodeCpu, NanSlopeSpreadsNanKeyOutsideTheWindowDoesNot) {
  DCase c;
  c.name = "nan_slope_window";
  c.batch = 2;
  c.hq = 4;
  c.hkv = 4;
  c.lens = {200, 90};
  c.wl = 32;
  c.alibi = true;
  c.num_splits = 2;
  Problem pr(c, salt_of(c.name));
  pr.slopes[2] = NAN;                                    // head 2, every sequence
  pr.kc.set(pr.offset(pr.p.cache.k, 0, 160, 1) + 0, NAN);  // sequence 0, key 160: in a visited tile, left of the window (167..199)
  Expected e;
  expected(pr, &e);
  RunResult rr;
  ASSERT_TRUE(plan_and_run(pr, &rr).ok());
  std::int64_t nan_elements = 0;
  compare(pr, e, &nan_elements);
  EXPECT_EQ(nan_elements, 2 * c.d) << "head 2 of both sequences";
}

// merge_attention_states: a NaN LSE on either side gives NaN (O and LSE), like merge_by_lse.
TEST(DecodeCpu, MergeAttentionStatesPropagatesNan) {
  const int D = 64;
  HostBuffer oa(DType::kF32, 2 * D), ob(DType::kF32, 2 * D), o(DType::kF32, 2 * D);
  for (std::int64_t i = 0; i < oa.size(); ++i) oa.set(i, 1.f), ob.set(i, 2.f);
  std::vector<float> la = {NAN, 0.5f}, lb = {0.25f, NAN}, lo(2, 0.f);
  MergeStatesParams m;
  m.batch = 1;
  m.seqlen = 1;
  m.heads = 2;
  m.head_dim = D;
  m.o_a = bshd_view(oa.data(), DType::kF32, 1, 2, D);
  m.o_b = bshd_view(ob.data(), DType::kF32, 1, 2, D);
  m.o = bshd_view(o.data(), DType::kF32, 1, 2, D);
  m.lse_a = la.data();
  m.lse_b = lb.data();
  m.lse = lo.data();
  ASSERT_TRUE(merge_attention_states(m).ok());
  EXPECT_TRUE(std::isnan(lo[0]));
  EXPECT_TRUE(std::isnan(lo[1]));  // was 0.5 + log1p(e^-0.25)-ish: std::max dropped the NaN
  for (std::int64_t i = 0; i < o.size(); ++i) EXPECT_TRUE(std::isnan(o.get(i))) << i;
}

// ---- merge_attention_states -------------------------------------------------------------------------

TEST(DecodeCpu, MergeAttentionStatesOfTwoKeyHalves) {
  // Attention over keys [0, 40) and [40, 97) merged = attention over [0, 97).
  const int B = 2, Nq = 3, Nk = 97, H = 4, D = 64, cut = 40;
  auto g = testing::rng(77);
  HostBuffer q(DType::kF32, B * Nq * H * D), k(DType::kF32, B * Nk * H * D), v(DType::kF32, B * Nk * H * D);
  q.fill_normal(g);
  k.fill_normal(g);
  v.fill_normal(g);
  auto run = [&](int k0, int k1, HostBuffer* o, std::vector<float>* lse) {
    AttnParams a;
    a.batch = B;
    a.seqlen_q = Nq;
    a.seqlen_k = k1 - k0;
    a.heads_q = a.heads_kv = H;
    a.head_dim = D;
    a.q = bshd_view(q.data(), DType::kF32, Nq, H, D);
    a.k = bshd_view(static_cast<float*>(k.data()) + static_cast<std::int64_t>(k0) * H * D, DType::kF32, Nk, H, D);
    a.v = bshd_view(static_cast<float*>(v.data()) + static_cast<std::int64_t>(k0) * H * D, DType::kF32, Nk, H, D);
    *o = HostBuffer(DType::kF32, B * Nq * H * D);
    a.o = bshd_view(o->data(), DType::kF32, Nq, H, D);
    lse->assign(B * H * Nq, NAN);
    a.lse = lse->data();
    RunOptions ro;
    ro.backend = Backend::kCpuReference;
    ASSERT_TRUE(attention_forward(a, ro).ok());
  };
  HostBuffer oa, ob, of;
  std::vector<float> la, lb, lf;
  run(0, cut, &oa, &la);
  run(cut, Nk, &ob, &lb);
  run(0, Nk, &of, &lf);
  MergeStatesParams m;
  m.batch = B;
  m.seqlen = Nq;
  m.heads = H;
  m.head_dim = D;
  m.o_a = bshd_view(oa.data(), DType::kF32, Nq, H, D);
  m.o_b = bshd_view(ob.data(), DType::kF32, Nq, H, D);
  m.o = m.o_a;  // in place
  m.lse_a = la.data();
  m.lse_b = lb.data();
  m.lse = la.data();
  const Status st = merge_attention_states(m);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (std::int64_t i = 0; i < oa.size(); ++i) ASSERT_NEAR(oa.get(i), of.get(i), 2e-6) << i;
  for (std::size_t i = 0; i < la.size(); ++i) ASSERT_NEAR(la[i], lf[i], 2e-6) << i;
  // Errors: partial overlap, dtype mismatch.
  MergeStatesParams bad = m;
  bad.o = bshd_view(static_cast<float*>(oa.data()) + 1, DType::kF32, Nq, H, D);
  EXPECT_NE(merge_attention_states(bad).message().find("o overlaps o_a"), std::string::npos);
  bad = m;
  bad.o_b.dtype = DType::kBF16;
  EXPECT_NE(merge_attention_states(bad).message().find("o_b.dtype bf16 differs from o_a.dtype fp32"), std::string::npos);
}

}  // namespace
}  // namespace flashcpp
