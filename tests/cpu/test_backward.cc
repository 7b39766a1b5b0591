// The attention backward on the CPU (include/flashcpp/backward.h):
//   - the fp64 reference backward equals central finite differences of the fp64 forward, for every
//     mask kind, GQA, varlen, block-sparse and dL/dLSE (DType::kF64 end to end);
//   - the tiled fp32 backward against the fp64 reference, per row, on odd sizes and every mask;
//   - deterministic mode: bitwise equal across thread counts and runs;
//   - the block walk of src/common/attention_walk.h (every visible pair covered, never more than the
//     forward visits, the query-tile bounds, the key order of deterministic dQ, the workspace layout);
//   - NaN propagation, empty problems, uncovered varlen rows, and the validator's sentences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <tuple>
#include <string>
#include <vector>

#include "backward_problem.h"
#include "common/attention_walk.h"
#include "common/mask_rules.h"
#include "flashcpp/backward.h"
#include "test_util.h"

namespace flashcpp::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

RunOptions options(Backend b, int threads = 2, int bm = 0, int bn = 0) {
  RunOptions o;
  o.backend = b;
  o.cpu_threads = threads;
  o.cpu_block_m = bm;
  o.cpu_block_n = bn;
  return o;
}

bool contains(const Status& st, const std::string& what) { return st.message().find(what) != std::string::npos; }

// ---- the fp64 reference against finite differences ----------------------------------------------

/// L = sum dout . O + sum dlse . LSE of the fp64 forward (rows with LSE = -inf are constant: left out).
double loss(BwdProblem& pb) {
  cpu::RefOutput r;
  const Status st = cpu::reference_attention(pb.forward_params(), &r, 1);
  EXPECT_TRUE(st.ok()) << st.to_string();
  double l = 0;
  for (std::size_t e = 0; e < r.o.size(); ++e) l += pb.dout.get(static_cast<std::int64_t>(e)) * r.o[e];
  if (!pb.dlse.empty()) {
    const bool varlen = !pb.cu_q.empty();
    for (int h = 0; h < pb.s.heads_q; ++h)
      for (std::int64_t row = 0; row < r.total_q; ++row) {
        const double x = r.lse[static_cast<std::size_t>(h * r.total_q + row)];
        if (x == -INFINITY) continue;
        const std::int64_t b = varlen ? 0 : row / pb.s.seqlen_q, i = varlen ? row : row % pb.s.seqlen_q;
        const std::int64_t at = varlen ? h * r.total_q + row : (b * pb.s.heads_q + h) * pb.s.seqlen_q + i;
        l += pb.dlse[static_cast<std::size_t>(at)] * x;
      }
  }
  return l;
}

void expect_matches_finite_differences(BwdSpec s, std::uint64_t salt) {
  s.dtype = DType::kF64;
  BwdProblem pb(s, run_seed() ^ salt);
  ASSERT_TRUE(pb.forward(Backend::kCpuReference).ok());
  const Status st = pb.backward(options(Backend::kCpuReference, 1));
  ASSERT_TRUE(st.ok()) << st.to_string();
  const double eps = 1e-5;
  double worst = 0, scale = 0;
  int checked = 0;
  for (auto [x, g, name] : {std::tuple{&pb.q, &pb.dq, "dq"}, std::tuple{&pb.k, &pb.dk, "dk"}, std::tuple{&pb.v, &pb.dv, "dv"}}) {
    for (std::int64_t e = 0; e < x->n; ++e) {
      const double x0 = x->get(e);
      x->set(e, x0 + eps);
      const double lp = loss(pb);
      x->set(e, x0 - eps);
      const double lm = loss(pb);
      x->set(e, x0);
      const double fd = (lp - lm) / (2 * eps);
      const double got = g->get(e);
      ASSERT_TRUE(std::isfinite(got)) << s.name() << " " << name << "[" << e << "]";
      worst = std::max(worst, std::fabs(got - fd));
      scale = std::max(scale, std::fabs(fd));
      ++checked;
      // Central differences of a smooth function: truncation ~eps^2, cancellation ~1e-16 / eps.
      ASSERT_NEAR(got, fd, 1e-7 + 1e-6 * std::fabs(fd)) << s.name() << " " << name << "[" << e << "]";
    }
  }
  EXPECT_GT(scale, 1e-3) << s.name() << ": the gradients are all ~0, the comparison would prove nothing";
  EXPECT_GT(checked, 0);
  std::printf("[ fd ] %s: %d gradients, max |analytic - fd| %.2e (largest %.2e)\n", s.name().c_str(), checked, worst,
              scale);
}

TEST(BackwardReference, MatchesFiniteDifferencesOnEveryMask) {
  BwdSpec base;
  base.seqlen_q = 5;
  base.seqlen_k = 6;
  base.heads_q = 2;
  base.heads_kv = 1;  // GQA: dk and dv sum both query heads
  std::vector<BwdSpec> specs;
  specs.push_back(base);
  BwdSpec s = base;
  s.causal = true;
  specs.push_back(s);
  s = base;
  s.window_left = 1;
  s.window_right = 1;
  s.global_tokens = 1;
  s.global_queries = true;
  specs.push_back(s);
  s = base;
  s.softcap = 1.5f;  // saturating: q.k / sqrt(64) reaches ~2
  s.stddev = 2.f;
  specs.push_back(s);
  s = base;
  s.alibi = true;
  s.causal = true;
  s.dlse = true;
  specs.push_back(s);
  s = base;
  s.varlen_q = {3, 0, 4};
  s.varlen_k = {2, 3, 5};
  s.causal = true;
  s.dlse = true;
  specs.push_back(s);
  s = base;
  s.sparse_m = 2;
  s.sparse_n = 3;
  s.softmax_scale = -0.2f;  // a negative scale flips the raw units' sign
  specs.push_back(s);
  s = base;  // values narrower than the keys
  s.head_dim = 24;
  s.head_dim_v = 16;
  s.causal = true;
  s.dlse = true;
  specs.push_back(s);
  s = base;  // and wider
  s.head_dim = 8;
  s.head_dim_v = 40;
  s.softcap = 1.f;
  specs.push_back(s);
  std::uint64_t salt = 1;
  for (const BwdSpec& sp : specs) {
    SCOPED_TRACE(sp.name());
    expect_matches_finite_differences(sp, salt++);
  }
}

// ---- the tiled backward against the fp64 reference --------------------------------------------------

struct Errors {
  double max_err = 0, max_ref = 0, p99_row = 0;
  std::int64_t nonfinite = 0;
};

/// |tiled - ref| over dq, dk, dv, per row (a row: one head_dim or head_dim_v vector).
Errors compare(BwdProblem& pb, const cpu::RefGrads& g) {
  Errors e;
  std::vector<double> rows;
  for (auto [t, ref] : {std::pair{&pb.dq, &g.dq}, std::pair{&pb.dk, &g.dk}, std::pair{&pb.dv, &g.dv}}) {
    const int d = t == &pb.dv ? pb.s.dim_v() : pb.s.head_dim;
    for (std::int64_t r = 0; r * d < t->n; ++r) {
      double row = 0;
      for (int c = 0; c < d; ++c) {
        const std::int64_t i = r * d + c;
        const double got = t->get(i), want = (*ref)[static_cast<std::size_t>(i)];
        if (!std::isfinite(got)) ++e.nonfinite;
        row = std::max(row, std::fabs(got - want));
        e.max_ref = std::max(e.max_ref, std::fabs(want));
      }
      rows.push_back(row);
      e.max_err = std::max(e.max_err, row);
    }
  }
  std::sort(rows.begin(), rows.end());
  if (!rows.empty()) e.p99_row = rows[static_cast<std::size_t>(0.99 * (rows.size() - 1))];
  return e;
}

/// Runs the tiled forward and backward of `s` and compares with the fp64 reference backward.
Errors tiled_vs_reference(const BwdSpec& s, std::uint64_t salt, const RunOptions& opt, bool deterministic = false) {
  BwdProblem pb(s, run_seed() ^ salt);
  EXPECT_TRUE(pb.forward(Backend::kCpu).ok());
  const Status st = pb.backward(opt, deterministic);
  EXPECT_TRUE(st.ok()) << st.to_string();
  cpu::RefGrads g;
  EXPECT_TRUE(cpu::reference_attention_backward(pb.backward_params(), &g, 2).ok());
  return compare(pb, g);
}

/// fp32 inputs: the tiled backward keeps fp32 everywhere, so its error is fp32 rounding of pairwise
/// sums over head_dim and over the tiles: measured 1e-7 to 1e-6 absolute for gradients of magnitude
/// 2 to 6 (about 2e-7 relative to the largest), so 3e-6 relative leaves a margin of 4 or more. The
/// check_backward harness holds every dtype to the rule (2x a plain same-dtype
/// implementation, plus a small atol).
constexpr double kF32RelBound = 3e-6;

TEST(BackwardTiled, MatchesReferenceOnOddSizesAndEveryMask) {
  std::vector<BwdSpec> specs;
  for (int n : {1, 7, 127}) {
    BwdSpec s;
    s.seqlen_q = n;
    s.seqlen_k = n == 127 ? 100 : n;
    s.heads_q = 4;
    s.heads_kv = 2;
    specs.push_back(s);
    s.causal = true;
    specs.push_back(s);
  }
  BwdSpec s;
  s.seqlen_q = 70;
  s.seqlen_k = 130;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.window_left = 20;
  s.window_right = 3;
  s.global_tokens = 5;
  s.global_queries = true;
  specs.push_back(s);
  s = specs.back();
  s.window_left = 10;
  s.window_right = -1;
  s.global_queries = false;
  s.causal = true;
  s.softcap = 2.f;
  s.stddev = 2.f;
  specs.push_back(s);
  s = BwdSpec{};
  s.seqlen_q = 90;
  s.seqlen_k = 90;
  s.alibi = true;
  s.causal = true;
  s.dlse = true;
  specs.push_back(s);
  s = BwdSpec{};
  s.varlen_q = {1, 0, 77, 20};
  s.varlen_k = {5, 9, 70, 0};
  s.causal = true;
  s.head_dim = 128;
  s.dlse = true;
  specs.push_back(s);
  s = BwdSpec{};
  s.seqlen_q = 100;
  s.seqlen_k = 75;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.sparse_m = 40;  // tiles shrink to the blocks' divisors (20 rows) and to 30 keys
  s.sparse_n = 30;
  s.head_dim = 256;
  specs.push_back(s);
  std::uint64_t salt = 100;
  for (const BwdSpec& sp : specs) {
    for (const RunOptions& opt : {options(Backend::kCpu), options(Backend::kCpu, 3, 16, 32)}) {
      const Errors e = tiled_vs_reference(sp, salt++, opt);
      std::printf("[ tiled ] %s tiles %dx%d: max err %.2e (max |grad| %.2e), p99 row %.2e\n", sp.name().c_str(),
                  opt.cpu_block_m, opt.cpu_block_n, e.max_err, e.max_ref, e.p99_row);
      EXPECT_EQ(e.nonfinite, 0) << sp.name();
      EXPECT_LE(e.max_err, kF32RelBound * std::max(1.0, e.max_ref))
          << sp.name() << " tiles " << opt.cpu_block_m << "x" << opt.cpu_block_n << ": p99 row " << e.p99_row;
    }
  }
}

TEST(BackwardTiled, EveryHeadDimAndHeadDimV) {
  // Every multiple of 8 up to 256 on a small odd problem, then values narrower and wider than the
  // keys, on tiles that split the rows and keys unevenly.
  std::vector<BwdSpec> specs;
  for (int d = 8; d <= kMaxHeadDim; d += 8) {
    BwdSpec s;
    s.seqlen_q = 13;
    s.seqlen_k = 19;
    s.heads_q = 2;
    s.heads_kv = 1;
    s.head_dim = d;
    s.causal = d % 16 == 0;
    specs.push_back(s);
  }
  for (auto [d, dv] : {std::pair{192, 128}, std::pair{128, 64}, std::pair{64, 128}, std::pair{96, 80},
                       std::pair{8, 256}, std::pair{256, 8}}) {
    BwdSpec s;
    s.seqlen_q = 21;
    s.seqlen_k = 34;
    s.heads_q = 4;
    s.heads_kv = 2;
    s.head_dim = d;
    s.head_dim_v = dv;
    s.causal = true;
    s.dlse = true;
    specs.push_back(s);
    s.varlen_q = {5, 0, 16};
    s.varlen_k = {9, 4, 20};
    specs.push_back(s);
  }
  std::uint64_t salt = 900;
  for (const BwdSpec& sp : specs) {
    const Errors e = tiled_vs_reference(sp, salt++, options(Backend::kCpu, 2, 8, 16));
    EXPECT_EQ(e.nonfinite, 0) << sp.name();
    EXPECT_GT(e.max_ref, 0.1) << sp.name() << ": the gradients are all ~0, the comparison would prove nothing";
    EXPECT_LE(e.max_err, kF32RelBound * std::max(1.0, e.max_ref)) << sp.name() << ": p99 row " << e.p99_row;
  }
}

TEST(BackwardTiled, ThousandKeysPerRowStatistics) {
  BwdSpec s;
  s.seqlen_q = 1000;
  s.seqlen_k = 1000;
  s.heads_q = 1;
  s.heads_kv = 1;
  s.causal = true;
  const Errors e = tiled_vs_reference(s, 7, options(Backend::kCpu));
  std::printf("[ tiled ] 1000 x 1000 causal: max err %.2e (max |grad| %.2e), p99 row %.2e\n", e.max_err, e.max_ref,
              e.p99_row);
  EXPECT_EQ(e.nonfinite, 0);
  EXPECT_LE(e.max_err, kF32RelBound * std::max(1.0, e.max_ref)) << "p99 row " << e.p99_row;
  EXPECT_LE(e.p99_row, e.max_err);
}

TEST(BackwardTiled, SixteenBitInputsStayNearTheReference) {
  // bf16/fp16: o arrives rounded (D = dO . O carries that rounding, as on the GPU) and the
  // gradients are stored rounded: a few 2^-8 (bf16) / 2^-11 (fp16) of the largest gradient.
  for (DType dt : {DType::kBF16, DType::kF16}) {
    BwdSpec s;
    s.dtype = dt;
    s.seqlen_q = 33;
    s.seqlen_k = 65;
    s.heads_q = 2;
    s.heads_kv = 1;
    s.causal = true;
    const Errors e = tiled_vs_reference(s, 11, options(Backend::kCpu));
    const double ulp = dt == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    EXPECT_EQ(e.nonfinite, 0);
    EXPECT_LE(e.max_err, 8 * ulp * std::max(1.0, e.max_ref)) << dtype_name(dt);
  }
}

// ---- determinism ---------------------------------------------------------------------------------------

std::vector<std::uint8_t> grads_bytes(BwdProblem& pb) {
  std::vector<std::uint8_t> out;
  for (Tensor* t : {&pb.dq, &pb.dk, &pb.dv}) out.insert(out.end(), t->b.data(), t->b.data() + t->b.size);
  return out;
}

TEST(BackwardTiled, DeterministicIsBitwiseRepeatableAcrossThreadCounts) {
  BwdSpec s;
  s.seqlen_q = 150;
  s.seqlen_k = 200;
  s.heads_q = 4;
  s.heads_kv = 1;  // four heads' key tiles add to the same dq tiles from different threads
  s.causal = true;
  s.global_tokens = 3;
  s.window_left = 40;
  BwdProblem pb(s, run_seed() ^ 31);
  ASSERT_TRUE(pb.forward(Backend::kCpu).ok());
  ASSERT_TRUE(pb.backward(options(Backend::kCpu, 1, 16, 16), true).ok());
  const std::vector<std::uint8_t> one = grads_bytes(pb);
  for (int threads : {2, 3, 4, 4}) {
    ASSERT_TRUE(pb.backward(options(Backend::kCpu, threads, 16, 16), true).ok());
    EXPECT_TRUE(grads_bytes(pb) == one) << threads << " threads";
  }
  // One thread walks the key tiles in the deterministic order anyway: the default mode agrees there.
  ASSERT_TRUE(pb.backward(options(Backend::kCpu, 1, 16, 16), false).ok());
  EXPECT_TRUE(grads_bytes(pb) == one);
  // Block-sparse: the order counts the listed tiles only.
  BwdSpec t;
  t.seqlen_q = 96;
  t.seqlen_k = 96;
  t.heads_q = 2;
  t.heads_kv = 1;
  t.sparse_m = 32;
  t.sparse_n = 16;
  BwdProblem ps(t, run_seed() ^ 32);
  ASSERT_TRUE(ps.forward(Backend::kCpu).ok());
  ASSERT_TRUE(ps.backward(options(Backend::kCpu, 1, 16, 16), true).ok());
  const std::vector<std::uint8_t> sparse_one = grads_bytes(ps);
  ASSERT_TRUE(ps.backward(options(Backend::kCpu, 4, 16, 16), true).ok());
  EXPECT_TRUE(grads_bytes(ps) == sparse_one);
}

// ---- the walk --------------------------------------------------------------------------------------------

struct WalkCase {
  int len_q, len_k, bm, bn;
  MaskParams m;
};

/// Every visible pair lies in a pair of tiles the backward visits; the backward visits only pairs
/// the forward visits; query_tiles bounds the visited query tiles; key_tile_rank counts them.
void check_walk(const WalkCase& c, const BlockSparseMask* bs, int heads) {
  const MaskRules r = MaskRules::make(c.len_q, c.len_k, c.m.causal, c.m.window_left, c.m.window_right,
                                      c.m.global_tokens, c.m.global_queries);
  const walk::Tiles t = walk::Tiles::make(c.len_q, c.len_k, c.bm, c.bn, bs);
  const std::string what = "q" + std::to_string(c.len_q) + " k" + std::to_string(c.len_k) + " tiles " +
                           std::to_string(c.bm) + "x" + std::to_string(c.bn);
  for (int h = 0; h < heads; ++h) {
    // Tiles partition the rows and the keys.
    std::vector<int> row_tile(static_cast<std::size_t>(c.len_q), -1), key_tile(static_cast<std::size_t>(c.len_k), -1);
    for (int m = 0; m < t.num_q_tiles(); ++m) {
      int i0, i1;
      t.q_rows(m, &i0, &i1);
      for (int i = i0; i < i1; ++i) {
        ASSERT_EQ(row_tile[i], -1) << what;
        row_tile[i] = m;
        ASSERT_EQ(t.q_tile_of(i), m) << what;
      }
    }
    for (int n = 0; n < t.num_k_tiles(); ++n) {
      int j0, j1;
      t.k_cols(n, &j0, &j1);
      for (int j = j0; j < j1; ++j) key_tile[j] = n;
    }
    ASSERT_EQ(std::count(row_tile.begin(), row_tile.end(), -1), 0) << what;
    ASSERT_EQ(std::count(key_tile.begin(), key_tile.end(), -1), 0) << what;
    for (int i = 0; i < c.len_q; ++i)
      for (int j = 0; j < c.len_k; ++j) {
        bool vis = r.visible(i, j);
        if (bs) vis = vis && block_sparse_visible(*bs, 0, h, i, j);
        if (!vis) continue;
        const walk::TileVisit v = walk::backward_visit(r, t, bs, 0, h, row_tile[i], key_tile[j]);
        ASSERT_TRUE(v.visit) << what << ": pair (" << i << ", " << j << ") is visible but its tiles are skipped";
        if (!v.need_mask) ASSERT_TRUE(vis);
      }
    for (int n = 0; n < t.num_k_tiles(); ++n) {
      int lo, hi;
      walk::query_tiles(r, t, n, &lo, &hi);
      for (int m = 0; m < t.num_q_tiles(); ++m) {
        const walk::TileVisit bv = walk::backward_visit(r, t, bs, 0, h, m, n);
        if (bv.visit) {
          ASSERT_TRUE(walk::visit(r, t, bs, 0, h, m, n).visit) << what;
          ASSERT_TRUE(m >= lo && m < hi) << what;
        }
      }
    }
    for (int m = 0; m < t.num_q_tiles(); ++m) {
      int rank = 0;
      for (int n = 0; n < t.num_k_tiles(); ++n) {
        ASSERT_EQ(walk::key_tile_rank(r, t, bs, 0, h, m, n), rank) << what;
        rank += walk::backward_visit(r, t, bs, 0, h, m, n).visit;
      }
    }
  }
}

TEST(BackwardWalk, CoversEveryVisiblePairAndNoMore) {
  std::vector<MaskParams> masks(1);
  auto add = [&](auto f) {
    MaskParams m;
    f(m);
    masks.push_back(m);
  };
  add([](MaskParams& m) { m.causal = true; });
  add([](MaskParams& m) { m.window_left = 5; m.window_right = 0; });
  add([](MaskParams& m) { m.window_left = 3; m.window_right = 7; m.global_tokens = 4; });
  add([](MaskParams& m) { m.window_left = 2; m.window_right = 2; m.global_tokens = 6; m.global_queries = true; });
  add([](MaskParams& m) { m.causal = true; m.window_left = 9; m.global_tokens = 2; m.global_queries = true; });
  add([](MaskParams& m) { m.window_left = 0; m.window_right = 0; });
  for (const MaskParams& m : masks)
    for (auto [lq, lk] : {std::pair{1, 1}, std::pair{7, 7}, std::pair{13, 29}, std::pair{29, 13}, std::pair{40, 40}})
      for (auto [bm, bn] : {std::pair{1, 1}, std::pair{4, 8}, std::pair{8, 4}, std::pair{64, 64}})
        check_walk({lq, lk, bm, bn, m}, nullptr, 1);
  // Block-sparse masks of random blocks, per head, with tiles smaller than the blocks.
  std::mt19937_64 g(run_seed() ^ 41);
  std::bernoulli_distribution coin(0.5);
  for (auto [lq, lk, sm, sn] : {std::tuple{23, 31, 8, 8}, std::tuple{40, 17, 10, 6}, std::tuple{9, 50, 3, 16}}) {
    BlockMask bm;
    std::vector<std::uint8_t> dense(static_cast<std::size_t>(2 * lq * lk));
    for (auto& x : dense) x = coin(g);
    ASSERT_TRUE(build_block_sparse_from_dense({lq, lk, sm, sn, 1, 2}, dense.data(), &bm).ok());
    for (const MaskParams& m : masks)
      for (auto [bm_, bn_] : {std::pair{sm, sn}, std::pair{std::max(1, sm / 2), std::max(1, sn / 3)}})
        check_walk({lq, lk, bm_, bn_, m}, bm.get(), 2);
  }
}

TEST(BackwardWalk, WorkspaceLayoutKeepsSequencesApart) {
  // Padded starts: aligned, and each sequence's padded rows end before the next one starts.
  for (int pad : {1, 16, 64, 128})
    for (const std::vector<int>& lens : {std::vector<int>{0, 1, 127, 128, 129, 0, 5}, std::vector<int>{1000}}) {
      std::int64_t first = 0;
      std::int64_t prev_end = 0;
      for (int b = 0; b < static_cast<int>(lens.size()); ++b) {
        const std::int64_t start = walk::padded_row_start(first, b, pad);
        EXPECT_EQ(start % pad, 0);
        EXPECT_GE(start, prev_end);
        prev_end = start + (lens[b] + pad - 1) / pad * pad;
        first += lens[b];
      }
      const BackwardWorkspaceLayout l = walk::workspace_layout(static_cast<int>(lens.size()), first, 3, 64, pad, true);
      EXPECT_LE(prev_end, l.rows);
      EXPECT_EQ(l.rows % pad, 0);
      EXPECT_GE(l.lse_log2, l.delta + 3 * l.rows * sizeof(float));
      EXPECT_GE(l.dq_accum, l.lse_log2 + 3 * l.rows * sizeof(float));
      EXPECT_GE(l.semaphores, l.dq_accum + 3 * l.rows * 64 * sizeof(float));
      EXPECT_GE(l.bytes, l.semaphores + 3 * (l.rows / pad) * sizeof(std::int32_t));
      for (std::size_t off : {l.delta, l.lse_log2, l.dq_accum, l.semaphores}) EXPECT_EQ(off % walk::kWorkspaceAlign, 0u);
      EXPECT_EQ(walk::workspace_layout(static_cast<int>(lens.size()), first, 3, 64, pad, false).bytes, l.semaphores);
    }
}

// ---- NaN, empty problems, uncovered rows ---------------------------------------------------------------

TEST(Backward, NaNInARowThatSeesEveryKeyReachesExactlyItsGradients) {
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    BwdSpec s;
    s.seqlen_q = 20;
    s.seqlen_k = 30;
    s.heads_q = 2;
    s.heads_kv = 2;
    s.causal = true;  // the last row sees every key
    BwdProblem pb(s, run_seed() ^ 51);
    ASSERT_TRUE(pb.forward(Backend::kCpu).ok());
    const int d = s.head_dim, last = s.seqlen_q - 1;
    pb.dout.set((last * s.heads_q + 1) * d + 3, kNaN);  // head 1's last row
    ASSERT_TRUE(pb.backward(options(b)).ok());
    for (int i = 0; i < s.seqlen_q; ++i)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < d; ++c) {
          const double x = pb.dq.get((i * 2 + h) * d + c);
          EXPECT_EQ(std::isnan(x), i == last && h == 1) << backend_name(b) << " dq row " << i << " head " << h;
          if (std::isnan(x)) break;
        }
    // dk: every element of KV head 1 (dS of the row is NaN); dv: only column 3 (dV = sum P dO).
    for (int j = 0; j < s.seqlen_k; ++j)
      for (int h = 0; h < 2; ++h) {
        EXPECT_EQ(std::isnan(pb.dk.get((j * 2 + h) * d)), h == 1) << backend_name(b) << " dk key " << j;
        EXPECT_EQ(std::isnan(pb.dv.get((j * 2 + h) * d + 3)), h == 1) << backend_name(b) << " dv key " << j;
        EXPECT_FALSE(std::isnan(pb.dv.get((j * 2 + h) * d))) << backend_name(b) << " dv key " << j;
      }
  }
}

TEST(Backward, EmptySidesWriteZeros) {
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    BwdSpec s;
    s.seqlen_q = 0;
    s.seqlen_k = 9;
    BwdProblem pq(s, 61);
    ASSERT_TRUE(pq.backward(options(b)).ok());
    for (std::int64_t e = 0; e < pq.dk.n; ++e) ASSERT_EQ(pq.dk.get(e), 0.0) << backend_name(b);
    for (std::int64_t e = 0; e < pq.dv.n; ++e) ASSERT_EQ(pq.dv.get(e), 0.0) << backend_name(b);
    s.seqlen_q = 9;
    s.seqlen_k = 0;
    BwdProblem pk(s, 62);
    ASSERT_TRUE(pk.backward(options(b)).ok());
    for (std::int64_t e = 0; e < pk.dq.n; ++e) ASSERT_EQ(pk.dq.get(e), 0.0) << backend_name(b);
    // A row that sees no key (window out of range) gets dq = 0; a key no row sees gets dk = dv = 0.
    BwdSpec w;
    w.seqlen_q = 4;
    w.seqlen_k = 12;
    w.window_left = 0;
    w.window_right = 0;
    w.causal = true;  // row i sees only key i + 8: keys 0..7 get nothing
    BwdProblem pw(w, 63);
    ASSERT_TRUE(pw.forward(Backend::kCpu).ok());
    ASSERT_TRUE(pw.backward(options(b)).ok());
    for (std::int64_t e = 0; e < 8 * w.heads_kv * w.head_dim; ++e) {
      ASSERT_EQ(pw.dk.get(e), 0.0) << backend_name(b);
      ASSERT_EQ(pw.dv.get(e), 0.0) << backend_name(b);
    }
  }
}

TEST(Backward, UncoveredVarlenRowsGetZeros) {
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    BwdSpec s;
    s.varlen_q = {3, 4};
    s.varlen_k = {5, 2};
    BwdProblem pb(s, 71);
    ASSERT_TRUE(pb.forward(Backend::kCpu).ok());
    // Two extra packed rows in every tensor beyond cu_seqlens[batch], counted by total_q / total_k.
    BwdProblem big(s, 71);
    const int hq = s.heads_q, hk = s.heads_kv, d = s.head_dim;
    for (auto [t, heads] : {std::pair{&big.q, hq}, std::pair{&big.o, hq}, std::pair{&big.dout, hq}, std::pair{&big.dq, hq}})
      t->alloc(s.dtype, (pb.rows_q + 2) * heads * d);
    for (auto [t, heads] : {std::pair{&big.k, hk}, std::pair{&big.v, hk}, std::pair{&big.dk, hk}, std::pair{&big.dv, hk}})
      t->alloc(s.dtype, (pb.rows_k + 2) * heads * d);
    for (auto [src, dst] : {std::pair{&pb.q, &big.q}, std::pair{&pb.o, &big.o}, std::pair{&pb.dout, &big.dout},
                            std::pair{&pb.k, &big.k}, std::pair{&pb.v, &big.v}})
      std::memcpy(dst->data(), src->data(), src->b.size);
    big.rows_q = pb.rows_q + 2;
    big.rows_k = pb.rows_k + 2;
    big.lse.assign(static_cast<std::size_t>(big.rows_q * hq), -INFINITY);
    for (int h = 0; h < hq; ++h)
      for (std::int64_t r = 0; r < pb.rows_q; ++r)
        big.lse[static_cast<std::size_t>(h * big.rows_q + r)] = pb.lse[static_cast<std::size_t>(h * pb.rows_q + r)];
    ASSERT_TRUE(big.backward(options(b, 1)).ok());  // one thread: the same dq addition order in both
    ASSERT_TRUE(pb.backward(options(b, 1)).ok());
    for (std::int64_t e = 0; e < big.dq.n; ++e)
      ASSERT_EQ(big.dq.get(e), e < pb.dq.n ? pb.dq.get(e) : 0.0) << backend_name(b) << " dq " << e;
    for (std::int64_t e = 0; e < big.dk.n; ++e) {
      ASSERT_EQ(big.dk.get(e), e < pb.dk.n ? pb.dk.get(e) : 0.0) << backend_name(b) << " dk " << e;
      ASSERT_EQ(big.dv.get(e), e < pb.dv.n ? pb.dv.get(e) : 0.0) << backend_name(b) << " dv " << e;
    }
  }
}

TEST(Backward, Fp64ForwardIsTheReferenceInDouble) {
  BwdSpec s;
  s.dtype = DType::kF64;
  s.seqlen_q = 9;
  s.seqlen_k = 11;
  s.causal = true;
  BwdProblem pb(s, 81);
  ASSERT_TRUE(pb.forward(Backend::kCpuReference).ok());
  cpu::RefOutput r;
  ASSERT_TRUE(cpu::reference_attention(pb.forward_params(), &r, 1).ok());
  for (std::int64_t e = 0; e < pb.o.n; ++e) ASSERT_EQ(pb.o.get(e), r.o[static_cast<std::size_t>(e)]);
  // Every other backend refuses fp64 with a sentence.
  const Status st = pb.forward(Backend::kCpu);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(st, "fp64 runs on the fp64 reference backend only")) << st.message();
  const Status sb = pb.backward(options(Backend::kCpu));
  EXPECT_EQ(sb.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(sb, "fp64 runs on the fp64 reference backend only")) << sb.message();
}

/// delta_from_o: D = dO . o from the given o. On the exact o (an fp64 forward) it is the default
/// gradient to rounding; a change to one o row moves that row's dq and the dk of the keys it sees,
/// never dv (which does not read D) and never another row.
TEST(BackwardReference, DeltaFromTheGivenOMovesOnlyWhatThatRowReaches) {
  BwdSpec s;
  s.dtype = DType::kF64;
  s.seqlen_q = 9;
  s.seqlen_k = 9;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.head_dim = 16;
  s.causal = true;
  s.softcap = 5.f;
  s.dlse = true;
  BwdProblem pb(s, 97);
  ASSERT_TRUE(pb.forward(Backend::kCpuReference).ok());
  cpu::RefGrads exact, from_o;
  ASSERT_TRUE(cpu::reference_attention_backward(pb.backward_params(), &exact, 1).ok());
  ASSERT_TRUE(cpu::reference_attention_backward(pb.backward_params(), &from_o, 1, true).ok());
  double top = 0, diff = 0;
  for (std::size_t e = 0; e < exact.dq.size(); ++e) {
    top = std::max(top, std::fabs(exact.dq[e]));
    diff = std::max(diff, std::fabs(exact.dq[e] - from_o.dq[e]));
  }
  EXPECT_GT(top, 1e-3);
  EXPECT_LE(diff, 1e-12 * top) << "on the exact o the two D agree to double rounding";
  // Row 4 of head 1 (bshd, batch 1): o[(4 * heads_q + 1) * d + 3] += 0.25.
  const int d = s.head_dim, row = 4, h = 1;
  const std::int64_t at = (static_cast<std::int64_t>(row) * s.heads_q + h) * d + 3;
  pb.o.set(at, pb.o.get(at) + 0.25);
  cpu::RefGrads moved;
  ASSERT_TRUE(cpu::reference_attention_backward(pb.backward_params(), &moved, 1, true).ok());
  for (int i = 0; i < s.seqlen_q; ++i)
    for (int hh = 0; hh < s.heads_q; ++hh) {
      double m = 0;
      for (int c = 0; c < d; ++c) {
        const std::size_t e = static_cast<std::size_t>((i * s.heads_q + hh) * d + c);
        m = std::max(m, std::fabs(moved.dq[e] - from_o.dq[e]));
      }
      if (i == row && hh == h)
        EXPECT_GT(m, 1e-6) << "the changed row's dq must move";
      else
        EXPECT_EQ(m, 0.0) << "dq row " << i << " head " << hh << " does not read that o row";
    }
  for (int j = 0; j < s.seqlen_k; ++j) {
    double mk = 0, mv = 0;
    for (int c = 0; c < d; ++c) {
      const std::size_t e = static_cast<std::size_t>(j * d + c);
      mk = std::max(mk, std::fabs(moved.dk[e] - from_o.dk[e]));
      mv = std::max(mv, std::fabs(moved.dv[e] - from_o.dv[e]));
    }
    EXPECT_EQ(mv, 0.0) << "dv of key " << j;
    if (j <= row) EXPECT_GT(mk, 0.0) << "dk of key " << j << ", which row " << row << " sees (causal)";
    else EXPECT_EQ(mk, 0.0) << "dk of key " << j << ", hidden from row " << row;
  }
}

// ---- validation ----------------------------------------------------------------------------------------

class BackwardValidation : public ::testing::Test {
 protected:
  BwdSpec spec() {
    BwdSpec s;
    s.seqlen_q = 8;
    s.seqlen_k = 8;
    return s;
  }
  /// The sentence attention_backward answers for pb with `edit` applied to its params.
  template <class Edit>
  Status run(BwdProblem& pb, Edit&& edit, Backend b = Backend::kCpu) {
    AttnBackwardParams p = pb.backward_params();
    RunOptions opt = options(b);
    std::size_t bytes = 0;
    if (attention_backward_workspace_size(p, opt, &bytes).ok()) {
      pb.workspace.alloc(bytes);
      p.workspace = pb.workspace.data();
      p.workspace_bytes = bytes;
    }
    edit(p);
    return attention_backward(p, opt);
  }
};

TEST_F(BackwardValidation, OneSentencePerError) {
  BwdProblem pb(spec(), 91);
  ASSERT_TRUE(pb.forward(Backend::kCpu).ok());
  struct Expect {
    std::function<void(AttnBackwardParams&)> edit;
    StatusCode code;
    std::string sentence;
  };
  float spare[64];
  const std::vector<Expect> cases = {
      {[](AttnBackwardParams& p) { p.lse = nullptr; }, StatusCode::kInvalidArgument, "lse is null"},
      {[](AttnBackwardParams& p) { p.dout.dtype = DType::kBF16; }, StatusCode::kInvalidArgument,
       "dout.dtype bf16 differs from q.dtype fp32"},
      {[](AttnBackwardParams& p) { p.dq.data = nullptr; }, StatusCode::kInvalidArgument, "dq.data is null"},
      {[](AttnBackwardParams& p) { p.dk.seq_stride = -1; }, StatusCode::kInvalidArgument, "dk.seq_stride -1 is negative"},
      {[](AttnBackwardParams& p) { p.dv = p.v; }, StatusCode::kInvalidArgument, "dv overlaps v"},
      {[](AttnBackwardParams& p) { p.dq.data = p.dk.data; }, StatusCode::kInvalidArgument, "dq overlaps"},  // dk, or a neighbour the heap put first
      {[&](AttnBackwardParams& p) { p.dlse = spare + 1; p.dq.data = static_cast<void*>(spare); },
       StatusCode::kInvalidArgument, "dq overlaps dlse"},
      {[](AttnBackwardParams& p) { p.workspace = nullptr; }, StatusCode::kInvalidArgument, "workspace is null"},
      {[](AttnBackwardParams& p) { p.workspace_bytes -= 1; }, StatusCode::kInvalidArgument, "workspace_bytes"},
      {[](AttnBackwardParams& p) { p.workspace = static_cast<std::uint8_t*>(p.workspace) + 16; },
       StatusCode::kInvalidArgument, "is not 256-byte aligned"},
      {[](AttnBackwardParams& p) { p.workspace = p.dq.data; }, StatusCode::kInvalidArgument, "overlaps"},
      {[](AttnBackwardParams& p) { p.total_k = 8; }, StatusCode::kInvalidArgument, "total_k 8 is set without cu_seqlens"},
      {[](AttnBackwardParams& p) { p.head_dim = 264; }, StatusCode::kInvalidArgument, "head_dim 264 is not supported"},
      {[](AttnBackwardParams& p) { p.head_dim_v = 12; }, StatusCode::kInvalidArgument, "head_dim_v 12 is not supported"},
      {[](AttnBackwardParams& p) { p.head_dim_v = 128; }, StatusCode::kInvalidArgument, "v.seq_stride 64 makes two"},
      {[](AttnBackwardParams& p) { p.mask.softcap = -1.f; }, StatusCode::kInvalidArgument, "mask.softcap -1"},
  };
  for (const Expect& e : cases) {
    const Status st = run(pb, e.edit);
    EXPECT_EQ(st.code(), e.code) << e.sentence << " <- " << st.to_string();
    EXPECT_TRUE(contains(st, e.sentence)) << e.sentence << " <- " << st.to_string();
    EXPECT_EQ(st.message().find('\n'), std::string::npos);
  }
}

TEST_F(BackwardValidation, CudaChoosesTheKernelOrSaysWhyNot) {
  BwdSpec s = spec();
  s.dtype = DType::kBF16;
  BwdProblem pb(s, 92);
  KernelChoice choice;
  AttnBackwardParams p = pb.backward_params();
  const Status st = select_backward_kernel(p, options(Backend::kCuda), &choice);
  std::size_t bytes = 0;
  if (st.ok()) {  // a CUDA build on a machine with a device (selection touches no tensor memory)
    EXPECT_EQ(choice.id, KernelId::kCudaSm80);
    EXPECT_TRUE(attention_backward_workspace_size(p, options(Backend::kCuda), &bytes).ok());
    EXPECT_GT(bytes, 0u);
  } else {  // no device here, or no CUDA in this build: one sentence that says so
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_TRUE(contains(st, "no usable CUDA device") || contains(st, "no CUDA kernels") ||
                contains(st, "this build leaves out"))
        << st.message();
    EXPECT_EQ(attention_backward_workspace_size(p, options(Backend::kCuda), &bytes).code(), StatusCode::kUnsupported);
    EXPECT_EQ(attention_backward(p, options(Backend::kCuda)).code(), StatusCode::kUnsupported);
  }
  // The CPU choices, and the reference needs no workspace.
  ASSERT_TRUE(select_backward_kernel(p, options(Backend::kCpu), &choice).ok());
  EXPECT_EQ(choice.id, KernelId::kCpuTiled);
  ASSERT_TRUE(attention_backward_workspace_size(p, options(Backend::kCpuReference), &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  ASSERT_TRUE(attention_backward_workspace_size(p, options(Backend::kCpu), &bytes).ok());
  EXPECT_GT(bytes, 0u);
}

}  // namespace
}  // namespace flashcpp::testing
