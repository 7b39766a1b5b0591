// The fp64 reference (src/cpu/reference.cc) against cases small enough to work out by hand.
// Most use q = 0, which makes every visible key score the same: then O is the mean of V over
// the visible set and LSE = log(|set|), so a visibility rule can be checked by listing, per
// row, the keys it must see (written out here from the rules in attention.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "flashcpp/half.h"
#include "cpu/cpu_backend.h"
#include "test_util.h"

namespace flashcpp {
namespace {

using testing::HostBuffer;

constexpr double kExact = 1e-12;  // fp64 against a closed form: only double rounding
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr int kDim = 64;

/// Contiguous fp32 (batch, seqlen, heads, dim) tensors with q = 0 and random k, v.
struct Tiny {
  AttnParams p;
  HostBuffer q, k, v, o;
  std::vector<std::int32_t> cu_q, cu_k;

  Tiny(int batch, int nq, int nk, int hq = 1, int hkv = 1, std::uint64_t salt = 1) {
    auto g = testing::rng(salt);
    p.batch = batch;
    p.seqlen_q = nq;
    p.seqlen_k = nk;
    p.heads_q = hq;
    p.heads_kv = hkv;
    p.head_dim = kDim;
    q = HostBuffer(DType::kF32, std::int64_t{batch} * nq * hq * kDim);
    k = HostBuffer(DType::kF32, std::int64_t{batch} * nk * hkv * kDim);
    v = HostBuffer(DType::kF32, std::int64_t{batch} * nk * hkv * kDim);
    o = HostBuffer(DType::kF32, std::int64_t{batch} * nq * hq * kDim);
    k.fill_normal(g);
    v.fill_normal(g);
    o.poison();
    p.q = bshd_view(q.data(), DType::kF32, nq, hq, kDim);
    p.k = bshd_view(k.data(), DType::kF32, nk, hkv, kDim);
    p.v = bshd_view(v.data(), DType::kF32, nk, hkv, kDim);
    p.o = bshd_view(o.data(), DType::kF32, nq, hq, kDim);
  }
  /// Packs the sequences: the tensors become (total_tokens, heads, dim) with these lengths.
  void set_varlen(std::vector<int> len_q, std::vector<int> len_k) {
    cu_q = {0};
    cu_k = {0};
    for (std::size_t b = 0; b < len_q.size(); ++b) {
      cu_q.push_back(cu_q.back() + len_q[b]);
      cu_k.push_back(cu_k.back() + len_k[b]);
    }
    p.mask.cu_seqlens_q = cu_q.data();
    p.mask.cu_seqlens_k = cu_k.data();
  }
  float vk(std::int64_t token, int hk, int d) const { return v.get((token * p.heads_kv + hk) * kDim + d); }
  float& qk_raw(HostBuffer& buf, int heads, std::int64_t token, int h, int d) {
    return reinterpret_cast<float*>(buf.data())[(token * heads + h) * kDim + d];
  }
  cpu::RefOutput run() const {
    cpu::RefOutput ref;
    const Status st = cpu::reference_attention(p, &ref);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return ref;
  }
};

double ref_o(const cpu::RefOutput& r, int heads, std::int64_t row, int h, int d) {
  return r.o[static_cast<std::size_t>((row * heads + h) * kDim + d)];
}
double ref_lse(const cpu::RefOutput& r, std::int64_t row, int h) {
  return r.lse[static_cast<std::size_t>(h * r.total_q + row)];
}

/// Row `row`, head h saw exactly the key tokens in `keys` with equal scores.
void expect_uniform_over(const Tiny& t, const cpu::RefOutput& r, std::int64_t row, int h,
                         const std::vector<int>& keys, int hk = 0) {
  SCOPED_TRACE("row " + std::to_string(row) + " head " + std::to_string(h));
  if (keys.empty()) {
    EXPECT_EQ(ref_lse(r, row, h), kNegInf);
    for (int d = 0; d < kDim; ++d) EXPECT_EQ(ref_o(r, t.p.heads_q, row, h, d), 0.0);
    return;
  }
  EXPECT_NEAR(ref_lse(r, row, h), std::log(static_cast<double>(keys.size())), kExact);
  for (int d = 0; d < kDim; ++d) {
    double mean = 0;
    for (int j : keys) mean += t.vk(j, hk, d);
    mean /= static_cast<double>(keys.size());
    EXPECT_NEAR(ref_o(r, t.p.heads_q, row, h, d), mean, kExact) << "d=" << d;
  }
}

/// Random fp64 q, k (head dim d) and v (head dim dv) of one causal GQA problem, as flat
/// (tokens, heads, dim) arrays, and the reference over them.
struct Dims {
  int batch = 2, nq = 9, nk = 13, hq = 4, hkv = 2;
  std::vector<double> q, k, v;
  int d = 0, dv = 0;
  Dims(int d_, int dv_, std::uint64_t salt) : d(d_), dv(dv_) {
    auto g = testing::rng(salt);
    std::normal_distribution<double> n(0, 1);
    q.resize(static_cast<std::size_t>(batch) * nq * hq * d);
    k.resize(static_cast<std::size_t>(batch) * nk * hkv * d);
    v.resize(static_cast<std::size_t>(batch) * nk * hkv * dv);
    for (auto* t : {&q, &k, &v})
      for (double& x : *t) x = n(g);
  }
  /// The reference with q and k widened to `dq` columns (zeros past d) and v to `dvv` (the
  /// given columns first, then `fill`).
  cpu::RefOutput run(int dq, int dvv, double fill = 0.0) const {
    std::vector<double> qw = widen(q, d, dq, 0.0), kw = widen(k, d, dq, 0.0), vw = widen(v, dv, dvv, fill);
    AttnParams p;
    p.batch = batch;
    p.seqlen_q = nq;
    p.seqlen_k = nk;
    p.heads_q = hq;
    p.heads_kv = hkv;
    p.head_dim = dq;
    p.head_dim_v = dvv;
    p.softmax_scale = 0.3f;  // fixed: the default would follow head_dim
    p.mask.causal = true;
    p.q = bshd_view(qw.data(), DType::kF64, nq, hq, dq);
    p.k = bshd_view(kw.data(), DType::kF64, nk, hkv, dq);
    p.v = bshd_view(vw.data(), DType::kF64, nk, hkv, dvv);
    cpu::RefOutput r;
    EXPECT_TRUE(cpu::reference_attention(p, &r, 2).ok());
    return r;
  }
  static std::vector<double> widen(const std::vector<double>& x, int from, int to, double fill) {
    const std::size_t rows = x.size() / from;
    std::vector<double> y(rows * to, fill);
    for (std::size_t r = 0; r < rows; ++r)
      for (int c = 0; c < std::min(from, to); ++c) y[r * to + c] = x[r * from + c];
    return y;
  }
};

TEST(Reference, HeadDimVIsTheSameAttentionOverFewerOrMoreValueColumns) {
  // O's columns are independent sums over the same weights, and zero columns of q and k add exact
  // zeros to the dot products: so (d, dv) must equal the leading columns of a problem with
  // wider v, and the same problem with q and k padded by zeros, bit for bit.
  for (auto [d, dv] : {std::pair{192, 128}, std::pair{128, 64}, std::pair{64, 128}, std::pair{96, 80}, std::pair{8, 256}}) {
    SCOPED_TRACE("d " + std::to_string(d) + " dv " + std::to_string(dv));
    const Dims x(d, dv, 40 + d + dv);
    const cpu::RefOutput got = x.run(d, dv);
    const int w = std::max(d, dv);
    const cpu::RefOutput wide = x.run(w, w, 7.5);  // q, k zero-padded; v padded with 7.5 columns
    ASSERT_EQ(got.o.size() / dv, wide.o.size() / w);
    const std::size_t rows = got.o.size() / dv;
    std::size_t mismatches = 0;
    for (std::size_t r = 0; r < rows; ++r)
      for (int c = 0; c < dv; ++c) mismatches += got.o[r * dv + c] != wide.o[r * w + c];
    EXPECT_EQ(mismatches, 0u);
    EXPECT_EQ(got.lse, wide.lse);
    // The padded value columns are exactly the weights' sum times 7.5: the weights sum to 1.
    for (std::size_t r = 0; r < rows; ++r)
      for (int c = dv; c < w; ++c) ASSERT_NEAR(wide.o[r * w + c], 7.5, 1e-12);
  }
}

TEST(Reference, OneKeyOutputIsV) {
  Tiny t(1, 1, 1, 1, 1, 21);
  auto g = testing::rng(22);
  t.q.fill_normal(g);
  const auto r = t.run();
  double qk = 0;
  for (int d = 0; d < kDim; ++d) qk += double(t.q.get(d)) * t.k.get(d);
  EXPECT_NEAR(ref_lse(r, 0, 0), qk * t.p.effective_scale(), kExact);
  for (int d = 0; d < kDim; ++d) EXPECT_NEAR(ref_o(r, 1, 0, 0, d), t.v.get(d), kExact);
}

TEST(Reference, TwoKeysWithKnownScores) {
  Tiny t(1, 1, 2);  // default scale 1/sqrt(64) = 1/8
  t.qk_raw(t.q, 1, 0, 0, 0) = 1.f;
  std::fill(t.k.bytes.begin(), t.k.bytes.end(), 0);
  t.qk_raw(t.k, 1, 0, 0, 0) = 2.f;   // score 2/8
  t.qk_raw(t.k, 1, 1, 0, 0) = -1.f;  // score -1/8
  const auto r = t.run();
  const double s0 = 0.25, s1 = -0.125;
  const double w0 = std::exp(s0) / (std::exp(s0) + std::exp(s1)), w1 = 1 - w0;
  EXPECT_NEAR(ref_lse(r, 0, 0), std::log(std::exp(s0) + std::exp(s1)), kExact);
  for (int d = 0; d < kDim; ++d)
    EXPECT_NEAR(ref_o(r, 1, 0, 0, d), w0 * t.vk(0, 0, d) + w1 * t.vk(1, 0, d), kExact);
}

TEST(Reference, UniformScoresGiveMeanOfV) {
  Tiny t(1, 3, 5);  // q = 0
  const auto r = t.run();
  for (int i = 0; i < 3; ++i) expect_uniform_over(t, r, i, 0, {0, 1, 2, 3, 4});
}

TEST(Reference, CausalIsBottomRightAligned) {
  {
    Tiny t(1, 2, 4);  // fewer queries than keys: row i sits at key position i + 2
    t.p.mask.causal = true;
    const auto r = t.run();
    expect_uniform_over(t, r, 0, 0, {0, 1, 2});
    expect_uniform_over(t, r, 1, 0, {0, 1, 2, 3});
  }
  {
    Tiny t(1, 4, 2);  // more queries than keys: the first two rows see nothing
    t.p.mask.causal = true;
    const auto r = t.run();
    expect_uniform_over(t, r, 0, 0, {});
    expect_uniform_over(t, r, 1, 0, {});
    expect_uniform_over(t, r, 2, 0, {0});
    expect_uniform_over(t, r, 3, 0, {0, 1});
  }
}

TEST(Reference, SlidingWindowWithSinks) {
  Tiny t(1, 8, 8);
  t.p.mask.causal = true;
  t.p.mask.window_left = 2;
  t.p.mask.global_tokens = 2;
  const auto r = t.run();
  const std::vector<std::vector<int>> want = {
      {0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 3, 4, 5}, {0, 1, 4, 5, 6}, {0, 1, 5, 6, 7}};
  for (int i = 0; i < 8; ++i) expect_uniform_over(t, r, i, 0, want[i]);
}

TEST(Reference, TwoSidedWindowWithGlobalQueries) {
  Tiny t(1, 6, 6);
  t.p.mask.window_left = 1;
  t.p.mask.window_right = 2;
  t.p.mask.global_tokens = 1;
  t.p.mask.global_queries = true;  // row 0 (ia = 0 < G) ignores the window
  const auto r = t.run();
  const std::vector<std::vector<int>> want = {
      {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {0, 2, 3, 4, 5}, {0, 3, 4, 5}, {0, 4, 5}};
  for (int i = 0; i < 6; ++i) expect_uniform_over(t, r, i, 0, want[i]);
}

TEST(Reference, GlobalKeysDoNotEscapeWindowRight) {
  Tiny t(1, 5, 5);
  t.p.mask.window_left = 0;
  t.p.mask.window_right = 0;
  t.p.mask.global_tokens = 3;  // sinks: exempt from window_left only
  const auto r = t.run();
  const std::vector<std::vector<int>> want = {{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 4}};
  for (int i = 0; i < 5; ++i) expect_uniform_over(t, r, i, 0, want[i]);
}

TEST(Reference, SoftcapBendsScores) {
  Tiny t(1, 1, 2);
  t.p.softmax_scale = 1.f;
  t.p.mask.softcap = 10.f;
  t.qk_raw(t.q, 1, 0, 0, 0) = 1.f;
  std::fill(t.k.bytes.begin(), t.k.bytes.end(), 0);
  t.qk_raw(t.k, 1, 0, 0, 0) = 40.f;  // raw score 40, capped to 10 tanh(4)
  const auto r = t.run();
  const double s0 = 10 * std::tanh(4.0), s1 = 0;
  const double w0 = std::exp(s0) / (std::exp(s0) + std::exp(s1));
  EXPECT_NEAR(ref_lse(r, 0, 0), std::log(std::exp(s0) + std::exp(s1)), kExact);
  for (int d = 0; d < kDim; ++d)
    EXPECT_NEAR(ref_o(r, 1, 0, 0, d), w0 * t.vk(0, 0, d) + (1 - w0) * t.vk(1, 0, d), kExact);
}

TEST(Reference, AlibiPerBatchSlopes) {
  Tiny t(2, 1, 3);  // q = 0: scores are the biases slope * (j - ia), ia = 2
  const float slopes[2] = {0.5f, 2.f};
  t.p.mask.alibi_slopes = slopes;
  t.p.mask.alibi_batch_stride = 1;  // = heads_q
  const auto r = t.run();
  for (int b = 0; b < 2; ++b) {
    double s[3], sum = 0;
    for (int j = 0; j < 3; ++j) sum += std::exp(s[j] = slopes[b] * (j - 2.0));
    EXPECT_NEAR(ref_lse(r, b, 0), std::log(sum), kExact);
    for (int d = 0; d < kDim; ++d) {
      double want = 0;
      for (int j = 0; j < 3; ++j) want += std::exp(s[j]) / sum * t.vk(b * 3 + j, 0, d);
      EXPECT_NEAR(ref_o(r, 1, b, 0, d), want, kExact);
    }
  }
}

TEST(Reference, BlockSparseFullPartialAndEmptyBlocks) {
  Tiny t(1, 4, 4);
  // 2x2 blocks. Query block 0: key block 0 full, key block 1 partial (row 0 sees key 3 only,
  // row 1 sees none of it). Query block 1: nothing listed, so rows 2 and 3 see no key.
  const std::int32_t row_ptr[] = {0, 2, 2};
  const std::int32_t col_idx[] = {0, 1};
  const std::int32_t partial[] = {-1, 0};
  const std::uint64_t masks[] = {0b10, 0b00};  // [partial 0][row 0..1][1 word]
  BlockSparseMask bs;
  bs.block_m = bs.block_n = 2;
  bs.num_q_blocks = bs.num_k_blocks = 2;
  bs.row_ptr = row_ptr;
  bs.col_idx = col_idx;
  bs.partial = partial;
  bs.element_masks = masks;
  bs.num_partial = 1;
  t.p.mask.block_sparse = &bs;
  const auto r = t.run();
  expect_uniform_over(t, r, 0, 0, {0, 1, 3});
  expect_uniform_over(t, r, 1, 0, {0, 1});
  expect_uniform_over(t, r, 2, 0, {});
  expect_uniform_over(t, r, 3, 0, {});
}

TEST(Reference, VarlenSequencesAreIndependent) {
  Tiny t(2, 3, 3);  // buffers large enough for 4 packed tokens
  t.p.seqlen_q = t.p.seqlen_k = 3;
  t.set_varlen({1, 3}, {1, 3});
  t.p.q = t.p.k = t.p.v = t.p.o = TensorView{nullptr, DType::kF32, 0, kDim, kDim};
  t.p.q.data = t.q.data();
  t.p.k.data = t.k.data();
  t.p.v.data = t.v.data();
  t.p.o.data = t.o.data();
  t.p.mask.causal = true;
  const auto r = t.run();
  ASSERT_EQ(r.total_q, 4);
  expect_uniform_over(t, r, 0, 0, {0});        // sequence 0: its only key
  expect_uniform_over(t, r, 1, 0, {1});        // sequence 1, row 0: token 1 only (causal)
  expect_uniform_over(t, r, 2, 0, {1, 2});
  expect_uniform_over(t, r, 3, 0, {1, 2, 3});
}

TEST(Reference, EmptyKeySequenceGivesZeroAndMinusInf) {
  Tiny t(2, 2, 2);
  t.set_varlen({2, 2}, {0, 2});
  t.p.q = t.p.k = t.p.v = t.p.o = TensorView{nullptr, DType::kF32, 0, kDim, kDim};
  t.p.q.data = t.q.data();
  t.p.k.data = t.k.data();
  t.p.v.data = t.v.data();
  t.p.o.data = t.o.data();
  const auto r = t.run();
  expect_uniform_over(t, r, 0, 0, {});
  expect_uniform_over(t, r, 1, 0, {});
  expect_uniform_over(t, r, 2, 0, {0, 1});
  expect_uniform_over(t, r, 3, 0, {0, 1});
}

TEST(Reference, GqaMapsQueryHeadsToKvHeads) {
  Tiny t(1, 1, 3, 4, 2);
  const auto r = t.run();
  for (int h = 0; h < 4; ++h) expect_uniform_over(t, r, 0, h, {0, 1, 2}, h / 2);
}

TEST(Reference, ForwardWritesThroughStridesAndRoundsToDtype) {
  constexpr int kB = 2, kN = 5, kH = 3;
  auto g = testing::rng(31);
  AttnParams p;
  p.batch = kB;
  p.seqlen_q = p.seqlen_k = kN;
  p.heads_q = p.heads_kv = kH;
  p.head_dim = kDim;
  HostBuffer q(DType::kBF16, kB * kN * kH * kDim), k = q, v = q, o = q;
  q.fill_normal(g);
  k.fill_normal(g);
  v.fill_normal(g);
  o.poison();
  std::vector<float> lse(kB * kH * kN, NAN);
  p.q = bhsd_view(q.data(), DType::kBF16, kN, kH, kDim);  // SDPA (B, H, N, D)
  p.k = bhsd_view(k.data(), DType::kBF16, kN, kH, kDim);
  p.v = bhsd_view(v.data(), DType::kBF16, kN, kH, kDim);
  p.o = bhsd_view(o.data(), DType::kBF16, kN, kH, kDim);
  p.lse = lse.data();
  p.mask.causal = true;
  ASSERT_TRUE(cpu::reference_forward(p, RunOptions{}).ok());
  cpu::RefOutput r;
  ASSERT_TRUE(cpu::reference_attention(p, &r).ok());
  for (int b = 0; b < kB; ++b)
    for (int h = 0; h < kH; ++h)
      for (int i = 0; i < kN; ++i) {
        const std::int64_t row = b * kN + i;
        EXPECT_EQ(lse[(b * kH + h) * kN + i], static_cast<float>(ref_lse(r, row, h)));
        for (int d = 0; d < kDim; ++d) {
          HostBuffer want(DType::kBF16, 1);
          want.set(0, static_cast<float>(ref_o(r, kH, row, h, d)));
          EXPECT_EQ(o.get(((b * kH + h) * kN + i) * kDim + d), want.get(0));
        }
      }
}

TEST(Reference, ForwardVarlenLseLayoutIsHeadsByTotal) {
  Tiny t(1, 6, 6, 2, 2, 41);
  auto g = testing::rng(41);
  t.q.fill_normal(g);
  t.set_varlen({2, 4}, {3, 3});
  t.p.batch = 2;
  t.p.seqlen_q = 4;
  t.p.seqlen_k = 3;
  const TensorView packed{nullptr, DType::kF32, 0, 2 * kDim, kDim};
  t.p.q = t.p.k = t.p.v = t.p.o = packed;
  t.p.q.data = t.q.data();
  t.p.k.data = t.k.data();
  t.p.v.data = t.v.data();
  t.p.o.data = t.o.data();
  std::vector<float> lse(2 * 6, NAN);
  t.p.lse = lse.data();
  ASSERT_TRUE(cpu::reference_forward(t.p, RunOptions{}).ok());
  const auto r = t.run();
  for (int h = 0; h < 2; ++h)
    for (int row = 0; row < 6; ++row) EXPECT_EQ(lse[h * 6 + row], static_cast<float>(ref_lse(r, row, h)));
  for (std::int64_t x = 0; x < t.o.size(); ++x) EXPECT_FALSE(std::isnan(t.o.get(x)));
}

// The NaN rule of attention.h, from the ground truth: a NaN score at a visible key makes the row
// NaN (O and LSE); a NaN that the row cannot see does not reach it; a row that sees no key stays
// 0 / -inf. Before, a row whose every score was NaN kept the max at -inf and came out 0 / -inf.
TEST(Reference, NanScoreAtAVisibleKeyMakesTheRowNan) {
  Tiny t(1, 5, 4, 2, 1, 61);  // 5 query rows, 4 keys, causal bottom-right: row 0 sees nothing
  auto g = testing::rng(61);
  t.q.fill_normal(g);
  t.p.mask.causal = true;
  t.qk_raw(t.q, 2, 0, 1, 0) = NAN;  // row 0 head 1: sees no key
  t.qk_raw(t.q, 2, 2, 0, 5) = NAN;  // row 2 head 0: sees keys 0, 1
  t.qk_raw(t.k, 1, 3, 0, 9) = NAN;  // key 3: seen by row 4 only
  const auto r = t.run();
  for (int row = 0; row < 5; ++row)
    for (int h = 0; h < 2; ++h) {
      SCOPED_TRACE("row " + std::to_string(row) + " head " + std::to_string(h));
      const bool nan = (row == 2 && h == 0) || row == 4;
      const double lse = ref_lse(r, row, h);
      if (row == 0) {
        EXPECT_EQ(lse, kNegInf);
      } else {
        EXPECT_EQ(std::isnan(lse), nan);
        EXPECT_TRUE(nan || std::isfinite(lse));
      }
      for (int d = 0; d < kDim; ++d) {
        const double o = ref_o(r, 2, row, h, d);
        if (row == 0) EXPECT_EQ(o, 0.0);
        else EXPECT_EQ(std::isnan(o), nan) << "d=" << d;
      }
    }
}

TEST(Reference, NanAlibiSlopeMakesItsHeadNan) {
  Tiny t(2, 3, 3, 2, 2, 62);
  auto g = testing::rng(62);
  t.q.fill_normal(g);
  t.p.mask.causal = true;
  const std::vector<float> slopes = {0.25f, NAN, 0.5f, 0.125f};  // per batch: (b=0, h=1) is NaN
  t.p.mask.alibi_slopes = slopes.data();
  t.p.mask.alibi_batch_stride = 2;
  const auto r = t.run();
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 3; ++i)
      for (int h = 0; h < 2; ++h) {
        const bool nan = b == 0 && h == 1;
        EXPECT_EQ(std::isnan(ref_lse(r, b * 3 + i, h)), nan) << b << " " << i << " " << h;
        for (int d = 0; d < kDim; ++d) EXPECT_EQ(std::isnan(ref_o(r, 2, b * 3 + i, h, d)), nan);
      }
}

// reference_forward writes what the rule says, and a NaN row is NaN in every element.
TEST(Reference, ForwardWritesNanRows) {
  Tiny t(1, 2, 2, 1, 1, 63);
  t.qk_raw(t.q, 1, 1, 0, 0) = NAN;
  std::vector<float> lse(2, 0.f);
  t.p.lse = lse.data();
  ASSERT_TRUE(cpu::reference_forward(t.p, RunOptions{}).ok());
  EXPECT_TRUE(std::isfinite(lse[0]));
  EXPECT_TRUE(std::isnan(lse[1]));
  for (int d = 0; d < kDim; ++d) {
    EXPECT_TRUE(std::isfinite(t.o.get(d)));
    EXPECT_TRUE(std::isnan(t.o.get(kDim + d)));
  }
}

TEST(Reference, SameResultForAnyThreadCount) {
  Tiny t(2, 9, 11, 4, 2, 51);
  auto g = testing::rng(51);
  t.q.fill_normal(g);
  t.p.mask.causal = true;
  cpu::RefOutput a, b;
  ASSERT_TRUE(cpu::reference_attention(t.p, &a, 1).ok());
  ASSERT_TRUE(cpu::reference_attention(t.p, &b, 3).ok());
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.lse, b.lse);
}

TEST(Reference, RejectsHeadsNotAMultiple) {
  Tiny t(1, 2, 2, 3, 2);
  cpu::RefOutput r;
  EXPECT_FALSE(cpu::reference_attention(t.p, &r).ok());
}

}  // namespace
}  // namespace flashcpp
