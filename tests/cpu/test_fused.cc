// Fused kernels on the CPU backend (fp32 math) against fp64 references written here from the
// formulas of include/flashcpp/fused.h, plus the validation sentences. Fresh random inputs each
// run (FLASHCPP_SEED replays), outputs poisoned with NaN so an unwritten element fails.
//
// Tolerance (norm, SwiGLU, rotary): |out - ref| <= 1e-3 + 1e-3 * |ref| + round_T(|ref|), where
// round_T is the half-ulp that storing into the output dtype costs by itself (2^-8 |ref| for
// bf16, 2^-11 |ref| for fp16, 0 for fp32): bf16's own rounding exceeds 1e-3 relative, so the
// issue's atol = rtol = 1e-3 applies on top of it. The updated residual h = round_T(x + r) must
// match bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "test_util.h"

namespace flashcpp::testing {
namespace {

constexpr double kAtol = 1e-3, kRtol = 1e-3;
constexpr DType kAllDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

double rounding_allowance(DType dt, double ref) {
  switch (dt) {
    case DType::kBF16: return std::ldexp(std::fabs(ref), -8);
    case DType::kF16: return std::ldexp(std::fabs(ref), -11);
    case DType::kF32: return 0.0;
  }
  return 0.0;
}

/// Compares out (dtype dt) against ref; reports the worst element and per-element statistics.
struct Compare {
  DType dt;
  double max_abs = 0, worst_ratio = 0;  // worst_ratio: max |err| / tol
  std::int64_t bad = 0, nan = 0, n = 0, first_bad = -1;
  void add(std::int64_t idx, double got, double ref) {
    ++n;
    if (std::isnan(got) != std::isnan(ref)) {
      ++nan;
      if (first_bad < 0) first_bad = idx;
      return;
    }
    if (std::isnan(ref)) return;
    const double err = std::fabs(got - ref), tol = kAtol + kRtol * std::fabs(ref) + rounding_allowance(dt, ref);
    max_abs = std::max(max_abs, err);
    worst_ratio = std::max(worst_ratio, err / tol);
    if (err > tol) {
      ++bad;
      if (first_bad < 0) first_bad = idx;
    }
  }
  ::testing::AssertionResult ok() const {
    if (bad == 0 && nan == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << bad << " of " << n << " elements out of tolerance, " << nan
                                         << " NaN mismatches (first at " << first_bad << "), max abs err " << max_abs
                                         << ", worst err/tol " << worst_ratio;
  }
};

/// Rounds v to dtype dt (what storing it costs), back to float.
float round_to(DType dt, float v) {
  HostBuffer b(dt, 1);
  b.set(0, v);
  return b.get(0);
}

::testing::AssertionResult Fails(const Status& st, StatusCode code, std::initializer_list<const char*> words) {
  if (st.code() != code)
    return ::testing::AssertionFailure() << "expected " << status_code_name(code) << ", got " << st.to_string();
  for (const char* w : words)
    if (st.message().find(w) == std::string::npos)
      return ::testing::AssertionFailure() << "message '" << st.message() << "' lacks '" << w << "'";
  return ::testing::AssertionSuccess() << st.to_string();
}
::testing::AssertionResult Invalid(const Status& st, std::initializer_list<const char*> words) {
  return Fails(st, StatusCode::kInvalidArgument, words);
}
::testing::AssertionResult Passes(const Status& st) {
  if (st.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << st.to_string();
}

RunOptions cpu(int threads = 0) {
  RunOptions o;
  o.backend = Backend::kCpu;
  o.cpu_threads = threads;
  return o;
}

// ---- RMSNorm -----------------------------------------------------------------------------

struct NormCase {
  std::int64_t rows, hidden;
  DType dt;
  bool residual;
  std::int64_t pad = 0;  // extra elements per row (row_stride = hidden + pad)
  bool in_place = false;  // y == x and residual_out == residual
  int threads = 0;
};

std::string describe(const NormCase& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.hidden) + " " + dtype_name(c.dt) +
         (c.residual ? " +residual" : "") + " pad" + std::to_string(c.pad) + (c.in_place ? " in-place" : "");
}

void run_norm(const NormCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  auto g = rng(salt);
  const std::int64_t ld = c.hidden + c.pad, n = c.rows * ld;
  HostBuffer x(c.dt, n), r(c.dt, n), ro(c.dt, n), y(c.dt, n), w(c.dt, c.hidden);
  x.fill_normal(g, 2.f);
  r.fill_normal(g, 2.f);
  w.fill_normal(g, 1.f);
  const HostBuffer x0 = x, r0 = r;
  ro.poison();
  y.poison();
  RmsNormParams p;
  p.rows = c.rows;
  p.hidden = c.hidden;
  p.eps = 1e-5f;
  p.x = MatrixView{x.data(), c.dt, ld};
  p.weight = w.data();
  p.y = c.in_place ? p.x : MatrixView{y.data(), c.dt, ld};
  if (c.residual) {
    p.residual = MatrixView{r.data(), c.dt, ld};
    p.residual_out = c.in_place ? p.residual : MatrixView{ro.data(), c.dt, ld};
  }
  const Status st = c.residual ? fused_add_rms_norm(p, cpu(c.threads)) : rms_norm(p, cpu(c.threads));
  ASSERT_TRUE(st.ok()) << st.to_string();
  const HostBuffer& yb = c.in_place ? x : y;
  const HostBuffer& hb = c.in_place ? r : ro;
  Compare cmp{c.dt};
  std::int64_t h_mismatch = 0;
  for (std::int64_t row = 0; row < c.rows; ++row) {
    std::vector<double> h(c.hidden);
    double ss = 0;
    for (std::int64_t j = 0; j < c.hidden; ++j) {
      const std::int64_t i = row * ld + j;
      // h = round_T(fp32 sum), as fused.h defines it.
      h[j] = c.residual ? round_to(c.dt, x0.get(i) + r0.get(i)) : x0.get(i);
      ss += h[j] * h[j];
      if (c.residual) {
        const float got = hb.get(i);
        if (!(got == static_cast<float>(h[j])) && !(std::isnan(got) && std::isnan(h[j]))) ++h_mismatch;
      }
    }
    const double rstd = 1.0 / std::sqrt(ss / c.hidden + static_cast<double>(p.eps));
    for (std::int64_t j = 0; j < c.hidden; ++j)
      cmp.add(row * ld + j, yb.get(row * ld + j), h[j] * rstd * w.get(j));
  }
  EXPECT_TRUE(cmp.ok());
  EXPECT_EQ(h_mismatch, 0) << "residual_out differs from round(x + residual)";
  // Padding between rows is never written.
  if (c.pad > 0 && !c.in_place)
    for (std::int64_t row = 0; row < c.rows; ++row)
      for (std::int64_t j = c.hidden; j < ld; ++j) ASSERT_TRUE(std::isnan(y.get(row * ld + j))) << "pad written";
}

TEST(RmsNorm, OddSizesAllDtypes) {
  std::uint64_t salt = 100;
  for (DType dt : kAllDtypes)
    for (std::int64_t hidden : {1, 8, 127, 4097})
      for (std::int64_t rows : {1, 3, 17}) run_norm({rows, hidden, dt, false}, salt++);
}

TEST(RmsNorm, FusedAddOddSizesAllDtypes) {
  std::uint64_t salt = 200;
  for (DType dt : kAllDtypes)
    for (std::int64_t hidden : {1, 8, 127, 4097})
      for (std::int64_t rows : {1, 3, 17}) run_norm({rows, hidden, dt, true}, salt++);
}

TEST(RmsNorm, InPlaceResidualAndOutput) {
  std::uint64_t salt = 300;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (std::int64_t hidden : {8, 4097}) {
      run_norm({5, hidden, dt, true, 0, true}, salt++);
      run_norm({5, hidden, dt, false, 0, true}, salt++);
    }
}

TEST(RmsNorm, StridedRowsAndThreads) {
  run_norm({9, 100, DType::kBF16, true, 28}, 400);
  run_norm({64, 4096, DType::kBF16, true, 0, false, 4}, 401);  // several threads
  run_norm({64, 4096, DType::kF16, false, 8, false, 3}, 402);
}

TEST(RmsNorm, ZeroRowStaysFiniteWithEps) {
  HostBuffer x(DType::kBF16, 16), y(DType::kBF16, 16), w(DType::kBF16, 16);
  for (int i = 0; i < 16; ++i) {
    x.set(i, 0.f);
    w.set(i, 1.f);
  }
  y.poison();
  RmsNormParams p;
  p.rows = 1;
  p.hidden = 16;
  p.x = contiguous_matrix(x.data(), DType::kBF16, 16);
  p.y = contiguous_matrix(y.data(), DType::kBF16, 16);
  p.weight = w.data();
  ASSERT_TRUE(Passes(rms_norm(p, cpu())));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(y.get(i), 0.f);
}

TEST(RmsNorm, EmptyProblemsWriteNothing) {
  RmsNormParams p;  // all pointers null
  p.rows = 0;
  p.hidden = 4096;
  EXPECT_TRUE(Passes(rms_norm(p, cpu())));
  EXPECT_TRUE(Passes(fused_add_rms_norm(p, cpu())));
  p.rows = 4;
  p.hidden = 0;
  EXPECT_TRUE(Passes(rms_norm(p, cpu())));
}

// ---- SwiGLU ------------------------------------------------------------------------------

double silu_mul_ref(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }

void run_silu(std::int64_t rows, std::int64_t d, DType dt, bool fused, bool in_place, std::uint64_t salt) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(d) + " " + dtype_name(dt) + (fused ? " fused" : " two") +
               (in_place ? " in-place" : ""));
  auto g = rng(salt);
  HostBuffer x(dt, rows * 2 * d), gate(dt, rows * d), up(dt, rows * d), out(dt, rows * d);
  x.fill_normal(g, 3.f);
  gate.fill_normal(g, 3.f);
  up.fill_normal(g, 3.f);
  out.poison();
  const HostBuffer x0 = x;
  SiluMulParams p;
  if (fused) {
    const MatrixView o = in_place ? MatrixView{x.data(), dt, 2 * d} : MatrixView{out.data(), dt, d};
    p = SiluMulParams::from_fused(x.data(), dt, rows, d, 2 * d, o);
  } else {
    p.rows = rows;
    p.d = d;
    p.gate = contiguous_matrix(gate.data(), dt, d);
    p.up = contiguous_matrix(up.data(), dt, d);
    p.out = in_place ? p.up : contiguous_matrix(out.data(), dt, d);
  }
  const HostBuffer gate0 = gate, up0 = up;
  ASSERT_TRUE(Passes(silu_and_mul(p, cpu())));
  Compare cmp{dt};
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < d; ++j) {
      const double gv = fused ? x0.get(r * 2 * d + j) : gate0.get(r * d + j);
      const double uv = fused ? x0.get(r * 2 * d + d + j) : up0.get(r * d + j);
      double got;
      if (fused) got = in_place ? x.get(r * 2 * d + j) : out.get(r * d + j);
      else got = in_place ? up.get(r * d + j) : out.get(r * d + j);
      cmp.add(r * d + j, got, silu_mul_ref(gv, uv));
    }
  EXPECT_TRUE(cmp.ok());
  if (fused && in_place)  // the up half is untouched
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < d; ++j) ASSERT_EQ(x.get(r * 2 * d + d + j), x0.get(r * 2 * d + d + j));
}

TEST(Swiglu, BothFormsOddSizesAllDtypes) {
  std::uint64_t salt = 500;
  for (DType dt : kAllDtypes)
    for (std::int64_t d : {1, 8, 4097})
      for (bool fused : {false, true}) run_silu(3, d, dt, fused, false, salt++);
}

TEST(Swiglu, InPlaceAndThreads) {
  run_silu(7, 100, DType::kBF16, true, true, 600);
  run_silu(7, 100, DType::kF16, false, true, 601);
  run_silu(64, 4096, DType::kBF16, true, false, 602);
}

TEST(Swiglu, ExtremeGates) {
  const float gates[] = {-1e4f, -100.f, -20.f, -1.f, 0.f, 1.f, 20.f, 100.f, 1e4f, -0.f};
  const int n = 10;
  HostBuffer g(DType::kF32, n), u(DType::kF32, n), o(DType::kF32, n);
  for (int i = 0; i < n; ++i) {
    g.set(i, gates[i]);
    u.set(i, 2.f);
  }
  o.poison();
  SiluMulParams p;
  p.rows = 1;
  p.d = n;
  p.gate = contiguous_matrix(g.data(), DType::kF32, n);
  p.up = contiguous_matrix(u.data(), DType::kF32, n);
  p.out = contiguous_matrix(o.data(), DType::kF32, n);
  ASSERT_TRUE(Passes(silu_and_mul(p, cpu())));
  for (int i = 0; i < n; ++i) {
    const double ref = silu_mul_ref(gates[i], 2.0);
    EXPECT_TRUE(std::isfinite(o.get(i))) << gates[i];
    EXPECT_NEAR(o.get(i), ref, 1e-6 * (1 + std::fabs(ref))) << gates[i];
  }
}

// ---- rotary ------------------------------------------------------------------------------

/// Llama-3 scaling written the way Hugging Face's _compute_llama3_parameters does (vectorized
/// torch.where form), independently of fused_math.h.
double llama3_direct(double inv_freq, const Llama3Scaling& s) {
  const double pi = 3.14159265358979323846;
  const double low_wavelen = s.original_max_position / static_cast<double>(s.low_freq_factor);
  const double high_wavelen = s.original_max_position / static_cast<double>(s.high_freq_factor);
  const double wavelen = 2 * pi / inv_freq;
  const double llama = wavelen > low_wavelen ? inv_freq / s.factor : inv_freq;
  const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                        (static_cast<double>(s.high_freq_factor) - s.low_freq_factor);
  const double smoothed = (1 - smooth) * llama / s.factor + smooth * llama;
  const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
  return medium ? smoothed : llama;
}

double inv_freq_direct(int i, int rot, double theta, const Llama3Scaling& s) {
  const double f = 1.0 / std::pow(theta, 2.0 * i / rot);
  return s.enabled() ? llama3_direct(f, s) : f;
}

TEST(Rotary, InvFreqMatchesDirectFormulaWithLlama3Scaling) {
  const Llama3Scaling off{};
  const Llama3Scaling l31{8.f, 1.f, 4.f, 8192};   // Llama-3.1
  const Llama3Scaling l32{32.f, 1.f, 4.f, 8192};  // Llama-3.2
  int scaled = 0, kept = 0, smoothed = 0;
  for (const Llama3Scaling& s : {off, l31, l32})
    for (int rot : {64, 128})
      for (double theta : {10000.0, 500000.0})
        for (int i = 0; i < rot / 2; ++i) {
          const double got = rotary_inv_freq(i, rot, theta, s), want = inv_freq_direct(i, rot, theta, s);
          ASSERT_NEAR(got, want, 1e-12 * want) << "i " << i << " rot " << rot << " theta " << theta << " factor " << s.factor;
          if (s.enabled()) {
            const double f = inv_freq_direct(i, rot, theta, off);
            if (got == f) ++kept;
            else if (std::fabs(got - f / s.factor) < 1e-15 * f) ++scaled;
            else ++smoothed;
          }
        }
  // All three regimes of the scaling are exercised.
  EXPECT_GT(kept, 0);
  EXPECT_GT(scaled, 0);
  EXPECT_GT(smoothed, 0);
  // Llama-3.1 8B, rot 128, theta 5e5: the highest frequency is kept, the lowest divided by 8.
  EXPECT_EQ(rotary_inv_freq(0, 128, 500000.0, l31), 1.0);
  const double lowest = 1.0 / std::pow(500000.0, 126.0 / 128);
  EXPECT_NEAR(rotary_inv_freq(63, 128, 500000.0, l31), lowest / 8, 1e-12 * lowest);
}

// The memoized table the CUDA launches copy: every entry is rotary_inv_freq's, bit for bit, for
// specs that differ in one field only, after the thread's four slots have been reused, and at the
// range's ends; outside the range null; a NaN theta gives NaN entries (never a stale match).
TEST(Rotary, InvFreqTableIsTheFunctionBitForBit) {
  const Llama3Scaling off{}, l31{8.f, 1.f, 4.f, 8192}, l31b{8.f, 1.f, 4.f, 4096}, l31c{8.f, 2.f, 4.f, 8192};
  struct Spec {
    int rot;
    double theta;
    Llama3Scaling s;
  };
  const Spec specs[] = {{128, 10000.0, off}, {128, 500000.0, off}, {128, 500000.0, l31}, {128, 500000.0, l31b},
                        {128, 500000.0, l31c}, {64, 10000.0, off},   {2, 10000.0, off},   {1024, 1e6, l31}};
  for (int round = 0; round < 3; ++round)  // 8 specs over 4 slots: each round evicts the last one's
    for (const Spec& sp : specs) {
      const double* t = rotary_inv_freq_table(sp.rot, sp.theta, sp.s);
      ASSERT_NE(t, nullptr);
      for (int i = 0; i < sp.rot / 2; ++i) {
        const double want = rotary_inv_freq(i, sp.rot, sp.theta, sp.s);
        ASSERT_EQ(std::memcmp(&t[i], &want, sizeof want), 0) << "rot " << sp.rot << " theta " << sp.theta << " i " << i;
      }
      const double* again = rotary_inv_freq_table(sp.rot, sp.theta, sp.s);
      EXPECT_EQ(again, t) << "a repeated spec is served from its slot";
    }
  EXPECT_EQ(rotary_inv_freq_table(0, 10000.0, off), nullptr);
  EXPECT_EQ(rotary_inv_freq_table(3, 10000.0, off), nullptr);
  EXPECT_EQ(rotary_inv_freq_table(2 * kRotaryTableMaxPairs + 2, 10000.0, off), nullptr);
  const double* nan_table = rotary_inv_freq_table(8, std::nan(""), off);
  ASSERT_NE(nan_table, nullptr);
  EXPECT_TRUE(std::isnan(nan_table[1]));
}

struct RotCase {
  int batch = 2, seqlen = 5, hq = 4, hk = 2, head_dim = 64, rot = 0;
  RopeStyle style = RopeStyle::kNeox;
  DType dt = DType::kBF16;
  bool positions = true;
  bool out_of_place = false;
  bool packed_qkv = false;  // q and k interleaved in one (tokens, hq + 2 hk, d) buffer, in place
  bool cache = false;
  Llama3Scaling llama3{};
  double theta = 10000.0;
  int max_pos = 70000;  // positions drawn from [0, max_pos)
};

std::string describe(const RotCase& c) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seqlen) + " hq" + std::to_string(c.hq) + " hk" +
         std::to_string(c.hk) + " d" + std::to_string(c.head_dim) + " rot" + std::to_string(c.rot) + " " +
         rope_style_name(c.style) + " " + dtype_name(c.dt) + (c.positions ? " pos" : " arange") +
         (c.out_of_place ? " out" : "") + (c.packed_qkv ? " qkv" : "") + (c.cache ? " cache" : "") +
         (c.llama3.enabled() ? " llama3" : "");
}

void run_rotary(const RotCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  auto g = rng(salt);
  const int d = c.head_dim, rot = c.rot ? c.rot : d, half = rot / 2;
  const std::int64_t tokens = static_cast<std::int64_t>(c.batch) * c.seqlen;
  // Layout: q (tokens, hq, d), k (tokens, hk, d), or one packed (tokens, hq + 2 hk, d) buffer.
  const int hqkv = c.hq + 2 * c.hk;
  HostBuffer qkv(c.dt, tokens * hqkv * d), q(c.dt, tokens * c.hq * d), k(c.dt, tokens * c.hk * d);
  HostBuffer qo(c.dt, tokens * c.hq * d), ko(c.dt, tokens * c.hk * d);
  qkv.fill_normal(g);
  q.fill_normal(g);
  k.fill_normal(g);
  qo.poison();
  ko.poison();
  std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens));
  std::uniform_int_distribution<std::int32_t> pd(0, c.max_pos - 1);
  for (auto& v : pos) v = pd(g);
  std::vector<float> cache;
  if (c.cache) {
    cache.resize(static_cast<std::size_t>(c.max_pos) * rot);
    for (int p = 0; p < c.max_pos; ++p)
      for (int i = 0; i < half; ++i) {
        const double a = p * inv_freq_direct(i, rot, c.theta, c.llama3);
        cache[static_cast<std::size_t>(p) * rot + i] = static_cast<float>(std::cos(a));
        cache[static_cast<std::size_t>(p) * rot + half + i] = static_cast<float>(std::sin(a));
      }
  }
  RopeParams p;
  p.batch = c.batch;
  p.seqlen = c.seqlen;
  p.heads_q = c.hq;
  p.heads_k = c.hk;
  p.head_dim = d;
  p.rotary.rotary_dim = c.rot;
  p.rotary.style = c.style;
  p.rotary.theta = c.theta;
  p.rotary.llama3 = c.llama3;
  p.positions = c.positions ? pos.data() : nullptr;
  if (c.cache) p.rotary.set_cos_sin_cache(cache.data(), c.max_pos, c.rot ? c.rot : d);
  const auto elem = static_cast<std::int64_t>(dtype_size(c.dt));
  if (c.packed_qkv) {
    p.q = TensorView{qkv.data(), c.dt, c.seqlen * hqkv * d, hqkv * d, d};
    p.k = TensorView{static_cast<char*>(qkv.data()) + c.hq * d * elem, c.dt, c.seqlen * hqkv * d, hqkv * d, d};
  } else {
    p.q = bshd_view(q.data(), c.dt, c.seqlen, c.hq, d);
    p.k = bshd_view(k.data(), c.dt, c.seqlen, c.hk, d);
  }
  if (c.out_of_place) {
    p.q_out = bshd_view(qo.data(), c.dt, c.seqlen, c.hq, d);
    p.k_out = bshd_view(ko.data(), c.dt, c.seqlen, c.hk, d);
  }
  const HostBuffer qkv0 = qkv, q0 = q, k0 = k;
  ASSERT_TRUE(Passes(apply_rotary(p, cpu())));

  Compare cmp{c.dt};
  std::int64_t changed_outside = 0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t s = t % c.seqlen;
    const double pp = c.positions ? pos[t] : static_cast<double>(s);
    for (int w = 0; w < 2; ++w)
      for (int h = 0; h < (w == 0 ? c.hq : c.hk); ++h) {
        // input and output element index of dim j of this head
        auto in_at = [&](int j) {
          return c.packed_qkv ? qkv0.get((t * hqkv + (w == 0 ? h : c.hq + h)) * d + j)
                              : (w == 0 ? q0 : k0).get((t * (w == 0 ? c.hq : c.hk) + h) * d + j);
        };
        auto out_at = [&](int j) {
          if (c.out_of_place) return (w == 0 ? qo : ko).get((t * (w == 0 ? c.hq : c.hk) + h) * d + j);
          return c.packed_qkv ? qkv.get((t * hqkv + (w == 0 ? h : c.hq + h)) * d + j)
                              : (w == 0 ? q : k).get((t * (w == 0 ? c.hq : c.hk) + h) * d + j);
        };
        std::vector<double> ref(d);
        for (int j = 0; j < d; ++j) ref[j] = in_at(j);
        for (int i = 0; i < half; ++i) {
          double cs, sn;
          if (c.cache) {
            cs = cache[static_cast<std::size_t>(pp) * rot + i];
            sn = cache[static_cast<std::size_t>(pp) * rot + half + i];
          } else {
            const double a = pp * inv_freq_direct(i, rot, c.theta, c.llama3);
            cs = std::cos(a);
            sn = std::sin(a);
          }
          const int ia = c.style == RopeStyle::kNeox ? i : 2 * i;
          const int ib = c.style == RopeStyle::kNeox ? i + half : 2 * i + 1;
          const double a0 = in_at(ia), b0 = in_at(ib);
          ref[ia] = a0 * cs - b0 * sn;
          ref[ib] = b0 * cs + a0 * sn;
        }
        for (int j = 0; j < d; ++j) cmp.add(t * 1000 + j, out_at(j), ref[j]);
      }
    // In the packed buffer the v heads are never touched.
    if (c.packed_qkv)
      for (int h = c.hq + c.hk; h < hqkv; ++h)
        for (int j = 0; j < d; ++j)
          changed_outside += qkv.get((t * hqkv + h) * d + j) != qkv0.get((t * hqkv + h) * d + j);
  }
  EXPECT_TRUE(cmp.ok());
  EXPECT_EQ(changed_outside, 0);
}

TEST(Rotary, BothStylesPartialDimsPositions) {
  std::uint64_t salt = 700;
  for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved})
    for (DType dt : kAllDtypes)
      for (int rot : {0, 32, 16, 2}) {
        RotCase c;
        c.style = st;
        c.dt = dt;
        c.rot = rot;
        run_rotary(c, salt++);
        c.positions = false;
        c.out_of_place = true;
        run_rotary(c, salt++);
      }
}

TEST(Rotary, OddHeadDimsAndGqa) {
  RotCase c;
  c.head_dim = 10;
  c.rot = 6;
  c.hq = 3;
  c.hk = 1;
  c.seqlen = 7;
  c.batch = 1;
  run_rotary(c, 800);
  c.style = RopeStyle::kInterleaved;
  c.out_of_place = true;
  run_rotary(c, 801);
  c.hk = 0;  // q only
  c.out_of_place = false;
  run_rotary(c, 802);
}

TEST(Rotary, PackedQkvInPlace) {
  RotCase c;
  c.packed_qkv = true;
  c.head_dim = 128;
  c.hq = 8;
  c.hk = 2;
  run_rotary(c, 900);
  c.style = RopeStyle::kInterleaved;
  c.rot = 64;
  run_rotary(c, 901);
}

TEST(Rotary, Llama3ScalingAndLongPositions) {
  RotCase c;
  c.head_dim = 128;
  c.theta = 500000.0;
  c.llama3 = Llama3Scaling{8.f, 1.f, 4.f, 8192};
  c.max_pos = 131072;  // 128k context: fp32 angles would be off by ~1e-2 rad here
  c.dt = DType::kF32;
  run_rotary(c, 1000);
  c.dt = DType::kBF16;
  c.style = RopeStyle::kInterleaved;
  run_rotary(c, 1001);
}

TEST(Rotary, CosSinCache) {
  RotCase c;
  c.cache = true;
  c.max_pos = 300;
  run_rotary(c, 1100);
  c.style = RopeStyle::kInterleaved;
  c.rot = 32;
  c.out_of_place = true;
  c.dt = DType::kF16;
  run_rotary(c, 1101);
  c.positions = false;  // arange positions must be < max_position too
  run_rotary(c, 1102);
}

TEST(Rotary, CacheRefusesOutOfRangePositionsOnHost) {
  std::vector<float> cache(4 * 8, 0.f);
  std::vector<std::int32_t> pos = {0, 1, 4};
  HostBuffer q(DType::kBF16, 3 * 8);
  RopeParams p;
  p.seqlen = 3;
  p.heads_q = 1;
  p.head_dim = 8;
  p.q = bshd_view(q.data(), DType::kBF16, 3, 1, 8);
  p.positions = pos.data();
  p.rotary.set_cos_sin_cache(cache.data(), 4, 8);
  EXPECT_TRUE(Invalid(apply_rotary(p, cpu()), {"position 4", "token 2", "max_position 4"}));
  pos[2] = -1;
  EXPECT_TRUE(Invalid(apply_rotary(p, cpu()), {"position -1"}));
  pos[2] = 3;
  EXPECT_TRUE(Passes(apply_rotary(p, cpu())));
}

// ---- validation --------------------------------------------------------------------------

void* fake(std::uintptr_t a) { return reinterpret_cast<void*>(a); }
constexpr std::uintptr_t kX = 0x10000000, kR = 0x20000000, kRo = 0x30000000, kW = 0x40000000, kY = 0x50000000;

RmsNormParams norm_base(DType dt = DType::kBF16) {
  RmsNormParams p;
  p.rows = 16;
  p.hidden = 4096;
  p.x = contiguous_matrix(fake(kX), dt, 4096);
  p.residual = contiguous_matrix(fake(kR), dt, 4096);
  p.residual_out = contiguous_matrix(fake(kRo), dt, 4096);
  p.weight = fake(kW);
  p.y = contiguous_matrix(fake(kY), dt, 4096);
  return p;
}

TEST(FusedValidate, RmsNormSentences) {
  const Backend b = Backend::kCuda;
  EXPECT_TRUE(Passes(validate(norm_base(), true, b)));
  RmsNormParams p = norm_base();
  EXPECT_TRUE(Invalid(validate(p, false, b), {"residual.data is set", "fused_add_rms_norm"}));
  p.rows = -1;
  EXPECT_TRUE(Invalid(validate(p, true, b), {"rows -1", "negative"}));
  p = norm_base();
  p.eps = NAN;
  EXPECT_TRUE(Invalid(validate(p, true, b), {"eps", "finite"}));
  p = norm_base();
  p.x.data = nullptr;
  EXPECT_TRUE(Invalid(validate(p, true, b), {"x.data is null"}));
  p = norm_base();
  p.y.data = fake(kY + 1);
  EXPECT_TRUE(Invalid(validate(p, true, b), {"y.data", "not aligned", "2-byte bf16"}));
  p = norm_base();
  p.residual.row_stride = 100;
  EXPECT_TRUE(Invalid(validate(p, true, b), {"residual.row_stride 100", "less than hidden 4096"}));
  p = norm_base();
  p.y.dtype = DType::kF16;
  EXPECT_TRUE(Invalid(validate(p, true, b), {"y.dtype fp16 differs from x.dtype bf16"}));
  EXPECT_TRUE(Fails(validate(norm_base(DType::kF32), true, b), StatusCode::kUnsupported, {"fp32", "CPU backend"}));
  EXPECT_TRUE(Passes(validate(norm_base(DType::kF32), true, Backend::kCpu)));
  p = norm_base();
  p.weight = nullptr;
  EXPECT_TRUE(Invalid(validate(p, true, b), {"weight is null"}));
  EXPECT_TRUE(Invalid(validate(norm_base(), true, static_cast<Backend>(42)), {"backend 42"}));
}

TEST(FusedValidate, RmsNormAliasing) {
  const Backend b = Backend::kCuda;
  RmsNormParams p = norm_base();
  p.y = p.x;  // in place
  p.residual_out = p.residual;
  EXPECT_TRUE(Passes(validate(p, true, b)));
  p.residual_out = p.x;  // h written over x, y over x too: outputs meet
  EXPECT_TRUE(Invalid(validate(p, true, b), {"y overlaps residual_out"}));
  p = norm_base();
  p.y.data = fake(kX + 64);  // shifted by 32 elements
  EXPECT_TRUE(Invalid(validate(p, true, b), {"y overlaps x", "in-place"}));
  p = norm_base();
  p.y.row_stride = 8192;  // same pointer as x? no: a different buffer, but wider rows
  p.y.data = fake(kX);
  EXPECT_TRUE(Invalid(validate(p, true, b), {"y overlaps x"}));
  p = norm_base();
  p.residual_out.data = fake(kW);
  EXPECT_TRUE(Invalid(validate(p, true, b), {"residual_out overlaps weight"}));
  p = norm_base();
  p.residual_out = p.x;  // residual_out == x exactly: allowed
  EXPECT_TRUE(Passes(validate(p, true, b)));
}

SiluMulParams silu_base() {
  SiluMulParams p = SiluMulParams::from_fused(fake(kX), DType::kBF16, 64, 14336, 2 * 14336,
                                              contiguous_matrix(fake(kY), DType::kBF16, 14336));
  return p;
}

TEST(FusedValidate, SwigluSentences) {
  const Backend b = Backend::kCuda;
  EXPECT_TRUE(Passes(validate(silu_base(), b)));
  SiluMulParams p = silu_base();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.up.data), kX + 2 * 14336);
  p.out = p.gate;  // in place into the gate half
  EXPECT_TRUE(Passes(validate(p, b)));
  p.out = p.up;
  EXPECT_TRUE(Passes(validate(p, b)));
  p.out = contiguous_matrix(fake(kX), DType::kBF16, 14336);  // dense rows over the [gate|up] rows
  EXPECT_TRUE(Invalid(validate(p, b), {"out overlaps gate"}));
  p = silu_base();
  p.d = -3;
  EXPECT_TRUE(Invalid(validate(p, b), {"d -3"}));
  p = silu_base();
  p.up.dtype = DType::kF16;
  EXPECT_TRUE(Invalid(validate(p, b), {"up.dtype fp16 differs from gate.dtype bf16"}));
  p = silu_base();
  p.gate.row_stride = 14335;
  EXPECT_TRUE(Invalid(validate(p, b), {"gate.row_stride 14335", "less than d 14336"}));
  p = silu_base();
  p.rows = 0;
  p.gate.data = nullptr;
  EXPECT_TRUE(Passes(validate(p, b)));
  // One row, so the row stride is never stepped and may be anything: gate, up and out with a row
  // stride near 2^63, out apart or written over the gate. The interleaving test computed
  // (offset % stride + stride) and (offset + extent) in int64; fuzz_fused_validate found both
  // overflowing (fixed in 128-bit-free forms).
  for (std::int64_t stride : {std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::max() - 7}) {
    p = silu_base();
    p.rows = 1;
    p.d = 8;
    p.gate = MatrixView{fake(kX), DType::kBF16, stride};
    p.up = MatrixView{fake(kX + 16), DType::kBF16, stride};  // right after the gate's 8 elements
    p.out = MatrixView{fake(kR), DType::kBF16, 8};
    EXPECT_TRUE(Passes(validate(p, b))) << stride;
    p.out = MatrixView{fake(kX + 2), DType::kBF16, stride};  // written over the gate's row
    EXPECT_TRUE(Invalid(validate(p, b), {"out overlaps gate"})) << stride;
  }
}

RopeParams rot_base() {
  RopeParams p;
  p.batch = 2;
  p.seqlen = 128;
  p.heads_q = 32;
  p.heads_k = 8;
  p.head_dim = 128;
  p.q = bshd_view(fake(kX), DType::kBF16, 128, 32, 128);
  p.k = bshd_view(fake(kR), DType::kBF16, 128, 8, 128);
  return p;
}

// Tables without a positions array: the positions are 0 .. seqlen - 1 of every sequence, checked
// at once however many tokens there are (a loop over them took seconds near 2^31 tokens, which
// fuzz_fused_validate reported as a slow unit).
TEST(FusedValidate, PositionsWithoutAnArrayAreCheckedAtOnce) {
  RopeParams p;
  p.batch = 1 << 20;
  p.seqlen = 2047;  // 2^31 - 2^20 tokens, under the 2^31 - 1 limit
  p.heads_q = 1;
  p.heads_k = 0;
  p.head_dim = 64;
  p.q = bshd_view(fake(kX), DType::kBF16, 2047, 1, 64);  // 256 GiB: never read
  p.rotary.cos = static_cast<const float*>(fake(kX + (std::uintptr_t{1} << 40)));
  p.rotary.sin = static_cast<const float*>(fake(kX + (std::uintptr_t{1} << 41)));
  p.rotary.max_position = 4096;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  p.rotary.max_position = 100;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu),
                      {"position 100 of token 100 is outside the cos/sin tables' rows [0, max_position 100)"}));
}

TEST(FusedValidate, RotarySentences) {
  const Backend b = Backend::kCuda;
  EXPECT_TRUE(Passes(validate(rot_base(), b)));
  RopeParams p = rot_base();
  p.head_dim = 7;
  EXPECT_TRUE(Invalid(validate(p, b), {"head_dim 7", "even"}));
  p = rot_base();
  p.rotary.rotary_dim = 130;
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.rotary_dim 130", "head_dim 128"}));
  p.rotary.rotary_dim = 33;
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.rotary_dim 33"}));
  p = rot_base();
  p.rotary.theta = 0;
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.theta 0"}));
  p = rot_base();
  p.rotary.llama3.factor = 0.5f;
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.llama3.factor 0.5"}));
  p.rotary.llama3 = Llama3Scaling{8.f, 4.f, 4.f, 8192};
  EXPECT_TRUE(Invalid(validate(p, b), {"llama3.high_freq_factor 4", "low_freq_factor 4"}));
  p = rot_base();
  p.rotary.style = static_cast<RopeStyle>(9);
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.style 9 is not a rotary style"}));
  p.rotary.style = RopeStyle::kNone;  // apply_rotary always rotates
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.style is none"}));
  p = rot_base();
  p.heads_k = 0;
  p.k_out = p.q;
  EXPECT_TRUE(Invalid(validate(p, b), {"k_out.data is set but heads_k is 0"}));
  p = rot_base();
  p.rotary.set_cos_sin_cache(reinterpret_cast<const float*>(kW), 0, 128);
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.max_position 0"}));
  p.rotary.max_position = 4096;
  EXPECT_TRUE(Passes(validate(p, b)));
  // Separate tables: every backend reads them (the CUDA kernel by pointer and row stride too).
  p.rotary.sin = reinterpret_cast<const float*>(kW) + 4096 * 64;
  p.rotary.table_stride = 0;  // rotary_dim / 2
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  EXPECT_TRUE(Passes(validate(p, b)));
  p.rotary.table_stride = 63;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"rotary.table_stride 63 must be >= rotary_dim / 2 = 64"}));
  p.rotary.table_stride = 64;
  p.rotary.sin = nullptr;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"rotary.sin is null but rotary.cos is set"}));
  p = rot_base();
  p.positions = reinterpret_cast<const std::int32_t*>(kW + 2);
  EXPECT_TRUE(Invalid(validate(p, b), {"positions", "4-byte aligned"}));
  p = rot_base();
  p.q.head_stride = 64;  // heads overlap inside a token
  EXPECT_TRUE(Invalid(validate(p, b), {"q.head_stride 64", "share one element"}));
  p = rot_base();
  p.q.dtype = DType::kF32;
  p.k.dtype = DType::kF32;
  EXPECT_TRUE(Fails(validate(p, b), StatusCode::kUnsupported, {"fp32"}));
}

TEST(FusedValidate, RotaryAliasing) {
  const Backend b = Backend::kCuda;
  // q and k of one packed qkv buffer (tokens, 32 + 8 + 8 heads, 128), rotated in place.
  RopeParams p = rot_base();
  const std::int64_t row = 48 * 128;
  p.q = TensorView{fake(kX), DType::kBF16, 128 * row, row, 128};
  p.k = TensorView{static_cast<char*>(fake(kX)) + 32 * 128 * 2, DType::kBF16, 128 * row, row, 128};
  EXPECT_TRUE(Passes(validate(p, b)));
  // k starting inside q's heads is refused.
  p.k.data = static_cast<char*>(fake(kX)) + 31 * 128 * 2;
  EXPECT_TRUE(Invalid(validate(p, b), {"overlaps"}));
  // Out of place into a buffer that overlaps q partially.
  p = rot_base();
  p.q_out = p.q;
  EXPECT_TRUE(Passes(validate(p, b)));  // exactly q: in place
  p.q_out.data = static_cast<char*>(fake(kX)) + 256;
  EXPECT_TRUE(Invalid(validate(p, b), {"q_out overlaps q"}));
  // An output over the positions array.
  p = rot_base();
  p.positions = reinterpret_cast<const std::int32_t*>(kX + 1024);
  EXPECT_TRUE(Invalid(validate(p, b), {"overlaps positions"}));
}

TEST(FusedValidate, BackendsAndConfig) {
  EXPECT_TRUE(Passes(validate(norm_base(), true, Backend::kCpuReference)));
  // The fused kernels have no fp64 backend: the reference is in these tests.
  HostBuffer x(DType::kBF16, 8), w(DType::kBF16, 8), y(DType::kBF16, 8);
  RmsNormParams p;
  p.rows = 1;
  p.hidden = 8;
  p.x = contiguous_matrix(x.data(), DType::kBF16, 8);
  p.y = contiguous_matrix(y.data(), DType::kBF16, 8);
  p.weight = w.data();
  RunOptions o;
  o.backend = Backend::kCpuReference;
  EXPECT_TRUE(Fails(rms_norm(p, o), StatusCode::kUnsupported, {"no fp64 reference backend"}));
#if !FLASHCPP_WITH_CUDA
  o.backend = Backend::kCuda;
  EXPECT_TRUE(Fails(rms_norm(p, o), StatusCode::kUnsupported, {"no CUDA kernels"}));
#endif
  o.backend = Backend::kAuto;  // host memory -> CPU backend
  EXPECT_TRUE(Passes(rms_norm(p, o)));
  EXPECT_STREQ(rope_style_name(RopeStyle::kInterleaved), "interleaved");
  EXPECT_STREQ(rope_style_name(RopeStyle::kNone), "none");
}


// ---- QK-RMSNorm + rotary -----------------------------------------------------------------

/// Exact bytes of two buffers (the fused op against the unfused sequence).
::testing::AssertionResult SameBits(const HostBuffer& a, const HostBuffer& b) {
  if (a.bytes == b.bytes) return ::testing::AssertionSuccess();
  for (std::int64_t i = 0; i < a.size(); ++i)
    if (std::memcmp(a.bytes.data() + i * dtype_size(a.dt), b.bytes.data() + i * dtype_size(a.dt), dtype_size(a.dt)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a.get(i) << " vs " << b.get(i);
  return ::testing::AssertionFailure() << "sizes differ";
}

struct QkCase {
  int tokens, heads_q, heads_k, head_dim, rotary_dim;
  DType dt;
  RopeStyle style;
  bool in_place = false;
  bool tables = false;
};

std::string describe(const QkCase& c) {
  return std::to_string(c.tokens) + "t " + std::to_string(c.heads_q) + "/" + std::to_string(c.heads_k) + " d" +
         std::to_string(c.head_dim) + " rot" + std::to_string(c.rotary_dim) + " " + dtype_name(c.dt) + " " +
         rope_style_name(c.style) + (c.in_place ? " in-place" : "") + (c.tables ? " tables" : "");
}

/// qk_norm_rope (weight_offset 0) equals rms_norm over each head followed by apply_rotary, bit
/// for bit (fused.h's rounding rule), in place or not, with tables or theta.
void run_qk_vs_unfused(const QkCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  auto g = rng(salt);
  const int d = c.head_dim;
  const std::int64_t nq = static_cast<std::int64_t>(c.tokens) * c.heads_q * d, nk = static_cast<std::int64_t>(c.tokens) * c.heads_k * d;
  HostBuffer q(c.dt, nq), k(c.dt, nk), wq(c.dt, d), wk(c.dt, d);
  q.fill_normal(g, 2.f);
  k.fill_normal(g, 2.f);
  wq.fill_normal(g, 1.f);
  wk.fill_normal(g, 1.f);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(c.tokens));
  for (auto& x : pos) x = static_cast<std::int32_t>(g() % 4000);
  const int rot = c.rotary_dim ? c.rotary_dim : d;
  std::vector<float> cache(static_cast<std::size_t>(4000) * rot);
  for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<float>(std::sin(0.001 * static_cast<double>(i)));
  RotarySpec spec = RotarySpec::of_style(c.style);
  spec.rotary_dim = c.rotary_dim;
  if (c.tables) spec.set_cos_sin_cache(cache.data(), 4000, rot);

  // Unfused: rms_norm of q's and k's heads as rows of head_dim, then apply_rotary in place.
  HostBuffer uq = q, uk = k;
  for (auto [x, w, n] : {std::tuple{&uq, &wq, nq}, std::tuple{&uk, &wk, nk}}) {
    RmsNormParams np;
    np.rows = n / d;
    np.hidden = d;
    np.eps = 1e-6f;
    np.x = contiguous_matrix(x->data(), c.dt, d);
    np.y = np.x;
    np.weight = w->data();
    ASSERT_TRUE(Passes(rms_norm(np, cpu())));
  }
  RopeParams rp;
  rp.seqlen = c.tokens, rp.heads_q = c.heads_q, rp.heads_k = c.heads_k, rp.head_dim = d;
  rp.q = bshd_view(uq.data(), c.dt, c.tokens, c.heads_q, d);
  rp.k = bshd_view(uk.data(), c.dt, c.tokens, c.heads_k, d);
  rp.positions = pos.data();
  rp.rotary = spec;
  ASSERT_TRUE(Passes(apply_rotary(rp, cpu())));

  HostBuffer oq(c.dt, nq), ok(c.dt, nk);
  oq.poison();
  ok.poison();
  if (c.in_place) oq = q, ok = k;
  QkNormRopeParams p;
  p.seqlen = c.tokens, p.heads_q = c.heads_q, p.heads_k = c.heads_k, p.head_dim = d;
  p.q = bshd_view(c.in_place ? oq.data() : q.data(), c.dt, c.tokens, c.heads_q, d);
  p.k = bshd_view(c.in_place ? ok.data() : k.data(), c.dt, c.tokens, c.heads_k, d);
  if (!c.in_place) {
    p.q_out = bshd_view(oq.data(), c.dt, c.tokens, c.heads_q, d);
    p.k_out = bshd_view(ok.data(), c.dt, c.tokens, c.heads_k, d);
  }
  p.q_weight = wq.data();
  p.k_weight = c.heads_k ? wk.data() : nullptr;
  p.positions = pos.data();
  p.rotary = spec;
  ASSERT_TRUE(Passes(qk_norm_rope(p, cpu(3))));
  EXPECT_TRUE(SameBits(oq, uq));
  EXPECT_TRUE(SameBits(ok, uk));
}

TEST(QkNormRope, EqualsRmsNormThenApplyRotaryBitForBit) {
  std::uint64_t salt = 9000;
  for (DType dt : kAllDtypes)
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved})
      for (auto [d, rd] : {std::pair{128, 0}, std::pair{64, 32}, std::pair{30, 0}, std::pair{256, 24}, std::pair{2, 0}})
        run_qk_vs_unfused({7, 4, 2, d, rd, dt, st}, ++salt);
  run_qk_vs_unfused({13, 3, 1, 128, 0, DType::kBF16, RopeStyle::kNeox, true, false}, ++salt);
  run_qk_vs_unfused({5, 2, 2, 64, 32, DType::kF16, RopeStyle::kInterleaved, true, true}, ++salt);
  run_qk_vs_unfused({1, 8, 0, 128, 0, DType::kBF16, RopeStyle::kNeox, false, true}, ++salt);  // no k
}

// Against the fp64 formula, Gemma3's weight_offset 1 included: n = round_T(x rstd (offset + w))
// with rstd in fp64, then the fp64 rotation. The fp32 rstd can round n to the neighbouring T, so
// the tolerance adds one ulp of n (2^-7 |n| bf16, 2^-10 fp16, 2^-23 fp32) to the usual rule.
TEST(QkNormRope, MatchesFp64FormulaWithWeightOffset) {
  for (DType dt : kAllDtypes)
    for (float off : {0.f, 1.f}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " offset " + std::to_string(off));
      auto g = rng(9100 + static_cast<int>(dt) * 2 + static_cast<int>(off));
      const int tokens = 9, hq = 3, hk = 2, d = 64, rot = 64, half = rot / 2;
      HostBuffer q(dt, tokens * hq * d), k(dt, tokens * hk * d), wq(dt, d), wk(dt, d), oq(dt, q.size()), ok(dt, k.size());
      q.fill_normal(g, 3.f);
      k.fill_normal(g, 3.f);
      std::normal_distribution<float> wd(off != 0.f ? 0.f : 1.f, 0.2f);
      for (int j = 0; j < d; ++j) wq.set(j, wd(g)), wk.set(j, wd(g));
      oq.poison();
      ok.poison();
      QkNormRopeParams p;
      p.seqlen = tokens, p.heads_q = hq, p.heads_k = hk, p.head_dim = d, p.weight_offset = off, p.eps = 1e-5f;
      p.q = bshd_view(q.data(), dt, tokens, hq, d);
      p.k = bshd_view(k.data(), dt, tokens, hk, d);
      p.q_out = bshd_view(oq.data(), dt, tokens, hq, d);
      p.k_out = bshd_view(ok.data(), dt, tokens, hk, d);
      p.q_weight = wq.data();
      p.k_weight = wk.data();
      ASSERT_TRUE(Passes(qk_norm_rope(p, cpu())));
      const double ulp = dt == DType::kBF16 ? std::ldexp(1.0, -7) : dt == DType::kF16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -23);
      for (auto [in, w, out, heads] : {std::tuple{&q, &wq, &oq, hq}, std::tuple{&k, &wk, &ok, hk}})
        for (int t = 0; t < tokens; ++t)
          for (int h = 0; h < heads; ++h) {
            const std::int64_t base = (static_cast<std::int64_t>(t) * heads + h) * d;
            double ss = 0;
            for (int j = 0; j < d; ++j) ss += static_cast<double>(in->get(base + j)) * in->get(base + j);
            const double rstd = 1.0 / std::sqrt(ss / d + 1e-5);
            std::vector<double> n(d);
            double nmax = 0;
            for (int j = 0; j < d; ++j) {
              n[j] = round_to(dt, static_cast<float>(in->get(base + j) * rstd * (off + static_cast<double>(w->get(j)))));
              nmax = std::max(nmax, std::fabs(n[j]));
            }
            for (int i = 0; i < half; ++i) {
              const double a = t * std::pow(10000.0, -2.0 * i / rot), cs = std::cos(a), sn = std::sin(a);
              const double x0 = n[i], x1 = n[i + half];
              n[i] = x0 * cs - x1 * sn;
              n[i + half] = x1 * cs + x0 * sn;
            }
            for (int j = 0; j < d; ++j) {
              const double tol = kAtol + kRtol * std::fabs(n[j]) + rounding_allowance(dt, n[j]) + 2 * ulp * nmax;
              ASSERT_LE(std::fabs(out->get(base + j) - n[j]), tol) << "token " << t << " head " << h << " j " << j;
            }
          }
    }
}

TEST(QkNormRope, NanInNanOutAndNormOnly) {
  const int tokens = 3, hq = 2, d = 16;
  HostBuffer q(DType::kF32, tokens * hq * d), w(DType::kF32, d), out(DType::kF32, q.size()), ref = q;
  auto g = rng(9200);
  q.fill_normal(g);
  w.fill_normal(g);
  q.set(d + 5, NAN);  // token 0, head 1
  QkNormRopeParams p;
  p.seqlen = tokens, p.heads_q = hq, p.head_dim = d;
  p.q = bshd_view(q.data(), DType::kF32, tokens, hq, d);
  p.q_out = bshd_view(out.data(), DType::kF32, tokens, hq, d);
  p.q_weight = w.data();
  ASSERT_TRUE(Passes(qk_norm_rope(p, cpu())));
  for (int j = 0; j < d; ++j) {
    EXPECT_TRUE(std::isnan(out.get(d + j))) << j;    // the NaN head
    EXPECT_FALSE(std::isnan(out.get(j))) << j;       // its neighbours
    EXPECT_FALSE(std::isnan(out.get(2 * d + j))) << j;
  }
  // Style none: the per-head norm alone, rms_norm's bits.
  q.set(d + 5, 0.5f);
  p.rotary = RotarySpec{};
  ASSERT_TRUE(Passes(qk_norm_rope(p, cpu())));
  ref = q;
  RmsNormParams np;
  np.rows = tokens * hq, np.hidden = d;
  np.x = contiguous_matrix(ref.data(), DType::kF32, d);
  np.y = np.x;
  np.weight = w.data();
  ASSERT_TRUE(Passes(rms_norm(np, cpu())));
  EXPECT_TRUE(SameBits(out, ref));
}

QkNormRopeParams qk_base() {
  QkNormRopeParams p;
  p.batch = 2;
  p.seqlen = 128;
  p.heads_q = 32;
  p.heads_k = 8;
  p.head_dim = 128;
  p.q = bshd_view(fake(kX), DType::kBF16, 128, 32, 128);
  p.k = bshd_view(fake(kR), DType::kBF16, 128, 8, 128);
  p.q_weight = fake(kW);
  p.k_weight = fake(kW + 4096);
  return p;
}

TEST(FusedValidate, QkNormRopeSentences) {
  const Backend b = Backend::kCuda;
  EXPECT_TRUE(Passes(validate(qk_base(), b)));
  QkNormRopeParams p = qk_base();
  p.head_dim = 512;
  EXPECT_TRUE(Invalid(validate(p, b), {"head_dim 512 must be even and in [2, 256]", "apply_rotary alone takes up to 1024"}));
  p = qk_base();
  p.weight_offset = 0.5f;
  EXPECT_TRUE(Invalid(validate(p, b), {"weight_offset 0.5 must be 0", "Gemma3"}));
  p = qk_base();
  p.q_weight = nullptr;
  EXPECT_TRUE(Invalid(validate(p, b), {"q_weight is null"}));
  p = qk_base();
  p.heads_k = 0;
  EXPECT_TRUE(Invalid(validate(p, b), {"k_weight is set but heads_k is 0"}));
  p = qk_base();
  p.eps = -1.f;
  EXPECT_TRUE(Invalid(validate(p, b), {"eps -1 must be finite and >= 0"}));
  p = qk_base();
  p.k.dtype = DType::kF16;
  EXPECT_TRUE(Invalid(validate(p, b), {"k.dtype fp16 differs from q.dtype bf16", "qk_norm_rope"}));
  p = qk_base();
  p.q_out = bshd_view(fake(kX + 64), DType::kBF16, 128, 32, 128);  // overlaps q, not equal
  EXPECT_TRUE(Invalid(validate(p, b), {"q_out overlaps q"}));
  p = qk_base();
  p.q_out = bshd_view(fake(kW - 64), DType::kBF16, 1, 1, 128);
  p.batch = 1, p.seqlen = 1, p.heads_q = 1, p.heads_k = 0, p.k_weight = nullptr;
  p.q = bshd_view(fake(kX), DType::kBF16, 1, 1, 128);
  EXPECT_TRUE(Invalid(validate(p, b), {"q_out overlaps q_weight"}));
  p = qk_base();
  p.rotary = RotarySpec{};  // style none: the norm only
  EXPECT_TRUE(Passes(validate(p, b)));
  p.rotary.style = static_cast<RopeStyle>(7);
  EXPECT_TRUE(Invalid(validate(p, b), {"rotary.style 7 is not a rotary style"}));
}

// ---- rotary + KV-cache append --------------------------------------------------------------

struct AppendCase {
  int batch, seqlen, heads_q, heads_kv, head_dim, head_dim_v, rotary_dim, page_size;
  DType dt;
  RopeStyle style;
  bool positions = true;
  bool q_in_place = false;
};

std::string describe(const AppendCase& c) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seqlen) + " " + std::to_string(c.heads_q) + "/" +
         std::to_string(c.heads_kv) + " d" + std::to_string(c.head_dim) + "/" + std::to_string(c.head_dim_v) + " rot" +
         std::to_string(c.rotary_dim) + " page" + std::to_string(c.page_size) + " " + dtype_name(c.dt) + " " +
         rope_style_name(c.style) + (c.positions ? "" : " slot-positions") + (c.q_in_place ? " q-in-place" : "");
}

/// The cache of a rope_append_kv CPU case: contiguous with `capacity` slots a sequence, or pages of
/// page_size keys (`spare` pages more than the batch names), with random lengths that leave room for
/// the new tokens and a shuffled block table.
struct AppendCache {
  int ps, capacity, pages_per_seq, num_pages, slots, rows, blocks;
  std::vector<std::int32_t> len, bt;

  AppendCache(int batch, int page_size, int cap, int spare)
      : ps(page_size), capacity(cap), pages_per_seq(ps ? (cap + ps - 1) / ps : 0),
        num_pages(ps ? batch * pages_per_seq + spare : 0), slots(ps ? pages_per_seq * ps : cap), rows(ps ? ps : cap),
        blocks(ps ? num_pages : batch) {}
  /// Elements of a K or V cache of `heads` x `dim`.
  std::int64_t elems(int heads, int dim) const { return static_cast<std::int64_t>(blocks) * rows * heads * dim; }
  /// Draws, in this order: lengths in [0, slots - seqlen], the `positions` (in [0, 100000)) when
  /// given, and the block table (paged).
  template <class G>
  void draw(G& g, int batch, int seqlen, std::vector<std::int32_t>* positions = nullptr) {
    len.assign(static_cast<std::size_t>(batch), 0);
    for (auto& x : len) x = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(slots - seqlen + 1));
    if (positions)
      for (auto& x : *positions) x = static_cast<std::int32_t>(g() % 100000);
    if (ps) {
      std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages));
      for (int i = 0; i < num_pages; ++i) perm[static_cast<std::size_t>(i)] = i;
      std::shuffle(perm.begin(), perm.end(), g);
      bt.assign(perm.begin(), perm.begin() + batch * pages_per_seq);
    }
  }
  /// Where key j of sequence b lives: its block (page, or the sequence) and row there.
  void slot(int b, int j, std::int64_t* block, std::int64_t* row) const {
    *block = ps ? bt[static_cast<std::size_t>(b * pages_per_seq + j / ps)] : b;
    *row = ps ? j % ps : j;
  }
  /// The geometry and block table into `c` (its k/v views and scales are the caller's).
  void wire(KVCacheView* c) const {
    c->capacity = ps ? 0 : capacity;
    c->page_size = ps;
    c->num_pages = num_pages;
    c->pages_per_seq = pages_per_seq;
    c->block_table_stride = pages_per_seq;
    c->block_table = ps ? bt.data() : nullptr;
  }
};

/// rope_append_kv writes apply_rotary's K (and q) and V's bits into exactly the slots decode's
/// rule names, and nothing else in the (NaN-poisoned) cache.
void run_append(const AppendCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  auto g = rng(salt);
  const int d = c.head_dim, dv = c.head_dim_v ? c.head_dim_v : d, ps = c.page_size;
  AppendCache ac(c.batch, ps, c.seqlen + 9, 2);
  const int rows = ac.rows;
  const std::int64_t tokens = static_cast<std::int64_t>(c.batch) * c.seqlen;
  HostBuffer q(c.dt, tokens * c.heads_q * d), kn(c.dt, tokens * c.heads_kv * d), vn(c.dt, tokens * c.heads_kv * dv);
  HostBuffer kc(c.dt, ac.elems(c.heads_kv, d)), vc(c.dt, ac.elems(c.heads_kv, dv)), qo(c.dt, q.size());
  q.fill_normal(g);
  kn.fill_normal(g);
  vn.fill_normal(g);
  kc.poison();
  vc.poison();
  qo.poison();
  std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens));
  ac.draw(g, c.batch, c.seqlen, &pos);
  const std::vector<std::int32_t>& len = ac.len;
  const std::vector<std::int32_t>& bt = ac.bt;
  RopeAppendParams p;
  p.batch = c.batch, p.seqlen = c.seqlen, p.heads_q = c.heads_q, p.heads_kv = c.heads_kv;
  p.head_dim = d, p.head_dim_v = c.head_dim_v;
  HostBuffer qin = q;  // q_in_place rotates this copy
  p.q = bshd_view(qin.data(), c.dt, c.seqlen, c.heads_q, d);
  if (!c.q_in_place) p.q_out = bshd_view(qo.data(), c.dt, c.seqlen, c.heads_q, d);
  p.k_new = bshd_view(kn.data(), c.dt, c.seqlen, c.heads_kv, d);
  p.v_new = bshd_view(vn.data(), c.dt, c.seqlen, c.heads_kv, dv);
  p.cache.k = bshd_view(kc.data(), c.dt, rows, c.heads_kv, d);
  p.cache.v = bshd_view(vc.data(), c.dt, rows, c.heads_kv, dv);
  ac.wire(&p.cache);
  p.cache_seqlens = len.data();
  p.positions = c.positions ? pos.data() : nullptr;
  p.rotary = RotarySpec::of_style(c.style);
  p.rotary.rotary_dim = c.rotary_dim;
  ASSERT_TRUE(Passes(rope_append_kv(p, cpu(2))));

  // Expected: apply_rotary of q and k_new at the same positions (the slots when none are given).
  std::vector<std::int32_t> want_pos(pos);
  if (!c.positions)
    for (std::int64_t t = 0; t < tokens; ++t) want_pos[static_cast<std::size_t>(t)] = len[static_cast<std::size_t>(t / c.seqlen)] + static_cast<std::int32_t>(t % c.seqlen);
  HostBuffer rq = q, rk = kn;
  if (c.style != RopeStyle::kNone) {
    RopeParams rp;
    rp.batch = c.batch, rp.seqlen = c.seqlen, rp.heads_q = c.heads_q ? c.heads_q : c.heads_kv, rp.head_dim = d;
    rp.heads_k = c.heads_q ? c.heads_kv : 0;
    rp.q = bshd_view(c.heads_q ? rq.data() : rk.data(), c.dt, c.seqlen, rp.heads_q, d);
    if (c.heads_q) rp.k = bshd_view(rk.data(), c.dt, c.seqlen, c.heads_kv, d);
    rp.positions = want_pos.data();
    rp.rotary = p.rotary;
    ASSERT_TRUE(Passes(apply_rotary(rp, cpu())));
  }
  if (c.heads_q) EXPECT_TRUE(SameBits(c.q_in_place ? qin : qo, rq));
  HostBuffer want_k = kc, want_v = vc;  // still all NaN: the written rows are filled in below
  for (std::int64_t t = 0; t < tokens; ++t) {
    const int b = static_cast<int>(t / c.seqlen), j = len[static_cast<std::size_t>(b)] + static_cast<int>(t % c.seqlen);
    std::int64_t block, row;
    ac.slot(b, j, &block, &row);
    for (int h = 0; h < c.heads_kv; ++h) {
      const std::int64_t at = (block * rows + row) * c.heads_kv + h;
      std::memcpy(want_k.bytes.data() + at * d * dtype_size(c.dt), rk.bytes.data() + (t * c.heads_kv + h) * d * dtype_size(c.dt),
                  d * dtype_size(c.dt));
      std::memcpy(want_v.bytes.data() + at * dv * dtype_size(c.dt), vn.bytes.data() + (t * c.heads_kv + h) * dv * dtype_size(c.dt),
                  dv * dtype_size(c.dt));
    }
  }
  EXPECT_TRUE(SameBits(kc, want_k));
  EXPECT_TRUE(SameBits(vc, want_v));
}

TEST(RopeAppendKv, PagedAndContiguousEqualApplyRotaryAndCopies) {
  std::uint64_t salt = 9300;
  for (DType dt : kAllDtypes)
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      run_append({3, 5, 4, 2, 128, 0, 0, 16, dt, st}, ++salt);
      run_append({2, 7, 2, 1, 64, 40, 32, 1, dt, st}, ++salt);   // page_size 1, partial rotary, head_dim_v 40
      run_append({3, 1, 8, 2, 30, 0, 0, 0, dt, st}, ++salt);    // contiguous, one token a sequence, odd head
    }
  run_append({2, 4, 0, 2, 64, 0, 0, 4, DType::kBF16, RopeStyle::kNeox}, ++salt);            // no q
  run_append({2, 4, 2, 2, 64, 0, 0, 4, DType::kBF16, RopeStyle::kNeox, false}, ++salt);     // positions = slots
  run_append({2, 4, 2, 2, 64, 0, 0, 0, DType::kF16, RopeStyle::kNeox, true, true}, ++salt); // q in place
  run_append({2, 3, 2, 2, 32, 0, 0, 8, DType::kF32, RopeStyle::kNone}, ++salt);             // no rotary: copies
}

RopeAppendParams append_base() {
  RopeAppendParams p;
  p.batch = 4;
  p.seqlen = 2;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.head_dim = 128;
  p.q = bshd_view(fake(kX), DType::kBF16, 2, 32, 128);
  p.k_new = bshd_view(fake(kR), DType::kBF16, 2, 8, 128);
  p.v_new = bshd_view(fake(kR + (1 << 20)), DType::kBF16, 2, 8, 128);
  p.cache.page_size = 16;
  p.cache.num_pages = 64;
  p.cache.pages_per_seq = 16;
  p.cache.block_table_stride = 16;
  p.cache.block_table = static_cast<const std::int32_t*>(fake(kW));
  p.cache.k = bshd_view(fake(kY), DType::kBF16, 16, 8, 128);
  p.cache.v = bshd_view(fake(kY + (std::uintptr_t{1} << 28)), DType::kBF16, 16, 8, 128);
  p.cache_seqlens = static_cast<const std::int32_t*>(fake(kW + 8192));
  return p;
}

TEST(FusedValidate, RopeAppendSentences) {
  const Backend b = Backend::kCuda;
  EXPECT_TRUE(Passes(validate(append_base(), b)));
  RopeAppendParams p = append_base();
  p.cache.page_size = 3;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.page_size 3 is not a power of two in [1, 256]"}));
  p = append_base();
  p.heads_kv = 0;
  EXPECT_TRUE(Invalid(validate(p, b), {"heads_kv 0 must be >= 1"}));
  p = append_base();
  p.head_dim = 320;
  EXPECT_TRUE(Invalid(validate(p, b), {"head_dim 320 must be even and in [2, 256]"}));
  p = append_base();
  p.cache_seqlens = nullptr;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache_seqlens is null"}));
  p = append_base();
  p.cache.block_table = nullptr;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.block_table is null for a paged cache"}));
  p = append_base();
  p.seqlen = 300;
  EXPECT_TRUE(Invalid(validate(p, b), {"256 key slots per sequence, fewer than the seqlen 300"}));
  p = append_base();
  p.v_new = p.cache.v;  // reads what it writes
  p.v_new.seq_stride = 8 * 128;
  EXPECT_TRUE(Invalid(validate(p, b), {"overlaps v_new"}));
  p = append_base();
  p.k_new.dtype = DType::kF16;  // the cache holds k_new's dtype (decode's rule)
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k.dtype bf16 differs from k_new.dtype fp16", "or fp8_e4m3 with scales"}));
  p = append_base();
  p.q.dtype = DType::kF16;
  EXPECT_TRUE(Invalid(validate(p, b), {"q.dtype fp16 differs from k_new.dtype bf16", "rope_append_kv"}));
  p = append_base();  // FlashInfer's (pages, 2, page_size, heads, dim): K and V interleave page by page
  p.cache.k.batch_stride = p.cache.v.batch_stride = 2 * 16 * 8 * 128;
  p.cache.v.data = static_cast<char*>(p.cache.k.data) + 16 * 8 * 128 * 2;
  EXPECT_TRUE(Passes(validate(p, b)));
  p.cache.v.data = static_cast<char*>(p.cache.k.data) + 64;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k overlaps cache.v"}));
}

TEST(FusedValidate, RopeAppendChecksHostValuesOnTheCpu) {
  const int batch = 2, seqlen = 3, d = 8;
  HostBuffer kn(DType::kF32, batch * seqlen * d), vn = kn, kc(DType::kF32, 4 * 4 * d), vc = kc;
  std::vector<std::int32_t> len = {0, 6}, bt = {0, 1, 2, 3};
  RopeAppendParams p;
  p.batch = batch, p.seqlen = seqlen, p.heads_kv = 1, p.head_dim = d;
  p.k_new = bshd_view(kn.data(), DType::kF32, seqlen, 1, d);
  p.v_new = bshd_view(vn.data(), DType::kF32, seqlen, 1, d);
  p.cache.k = bshd_view(kc.data(), DType::kF32, 4, 1, d);
  p.cache.v = bshd_view(vc.data(), DType::kF32, 4, 1, d);
  p.cache.page_size = 4, p.cache.num_pages = 4, p.cache.pages_per_seq = 2, p.cache.block_table_stride = 2;
  p.cache.block_table = bt.data();
  p.cache_seqlens = len.data();
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"cache_seqlens[1] = 6 leaves no room for the 3 new tokens", "[0, 5]"}));
  len[1] = 5;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  EXPECT_TRUE(Passes(validate(p, Backend::kAuto)));  // values not read: on CUDA the kernel clamps them
  bt[3] = 9;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"cache.block_table[1][1] = 9 is outside the pool's pages [0, num_pages 4)"}));
  bt[3] = 3;
  std::vector<float> tables(16 * 4, 0.5f);
  p.rotary.set_cos_sin_cache(tables.data(), 7, d);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"position 7 of token 5 is outside the cos/sin tables' rows [0, max_position 7)"}));
}

// ---- rotary + append into an fp8 e4m3 cache ---------------------------------------------------

/// The e4m3 code of x / scale, fused.h's (and decode.h's) rule, from half.h's conversion.
std::uint8_t code_of(float x, float scale) { return float_to_fp8e4m3_bits(x / scale); }
bool nan_code(std::uint8_t c) { return (c & 0x7fu) == 0x7fu; }

/// Per-head scales, log-uniform over [2^-7, 2]: inputs of sd 2 reach past 448 * scale (saturation)
/// and below the smallest normal code (subnormals) on the heads at either end.
std::vector<float> random_scales(std::mt19937_64& g, int heads) {
  std::uniform_real_distribution<float> e(-7.f, 1.f);
  std::vector<float> s(static_cast<std::size_t>(heads));
  for (auto& x : s) x = std::exp2(e(g));
  return s;
}

/// An fp8 cache: q rotated into q_out in q's dtype as before; K = code(rotate_fp32(k_new) / k_scale)
/// and V = code(v_new / v_scale) in exactly the slots of decode's rule; every other byte of the
/// NaN-poisoned cache kept. The expectation is built from the public pieces: apply_rotary on an fp32
/// copy of k_new (the rotation in fp32, unrounded) and half.h's conversion. Special values: a NaN in
/// k_new (its pair turns NaN too), +-inf and 1e6 in v_new (saturate to +-448).
void run_append_fp8(const AppendCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c) + " fp8 cache");
  auto g = rng(salt);
  const int d = c.head_dim, dv = c.head_dim_v ? c.head_dim_v : d, ps = c.page_size;
  AppendCache ac(c.batch, ps, c.seqlen + 9, 2);
  const int rows = ac.rows;
  const std::int64_t tokens = static_cast<std::int64_t>(c.batch) * c.seqlen;
  HostBuffer q(c.dt, tokens * c.heads_q * d), kn(c.dt, tokens * c.heads_kv * d), vn(c.dt, tokens * c.heads_kv * dv);
  HostBuffer kc(DType::kF8E4M3, ac.elems(c.heads_kv, d)), vc(DType::kF8E4M3, ac.elems(c.heads_kv, dv));
  HostBuffer qo(c.dt, q.size());
  q.fill_normal(g);
  kn.fill_normal(g, 2.f);
  vn.fill_normal(g, 2.f);
  const std::int64_t nan_at = (tokens - 1) * c.heads_kv * d + 1;  // last token, head 0, element 1
  kn.set(nan_at, NAN);
  vn.set(0, INFINITY);
  vn.set(1, -INFINITY);
  vn.set(2, 1e6f);
  std::memset(kc.data(), 0xFF, kc.bytes.size());  // NaN codes: an unwritten element stays NaN
  std::memset(vc.data(), 0xFF, vc.bytes.size());
  qo.poison();
  const HostBuffer kc0 = kc, vc0 = vc;
  const std::vector<float> ks = random_scales(g, c.heads_kv), vs = random_scales(g, c.heads_kv);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens));
  ac.draw(g, c.batch, c.seqlen, &pos);
  const std::vector<std::int32_t>& len = ac.len;
  const std::vector<std::int32_t>& bt = ac.bt;
  RopeAppendParams p;
  p.batch = c.batch, p.seqlen = c.seqlen, p.heads_q = c.heads_q, p.heads_kv = c.heads_kv;
  p.head_dim = d, p.head_dim_v = c.head_dim_v;
  if (c.heads_q) {
    p.q = bshd_view(q.data(), c.dt, c.seqlen, c.heads_q, d);
    p.q_out = bshd_view(qo.data(), c.dt, c.seqlen, c.heads_q, d);
  }
  p.k_new = bshd_view(kn.data(), c.dt, c.seqlen, c.heads_kv, d);
  p.v_new = bshd_view(vn.data(), c.dt, c.seqlen, c.heads_kv, dv);
  p.cache.k = bshd_view(kc.data(), DType::kF8E4M3, rows, c.heads_kv, d);
  p.cache.v = bshd_view(vc.data(), DType::kF8E4M3, rows, c.heads_kv, dv);
  p.cache.k_scale = ks.data();
  p.cache.v_scale = vs.data();
  ac.wire(&p.cache);
  p.cache_seqlens = len.data();
  p.positions = c.positions ? pos.data() : nullptr;
  p.rotary = RotarySpec::of_style(c.style);
  p.rotary.rotary_dim = c.rotary_dim;
  ASSERT_TRUE(Passes(rope_append_kv(p, cpu(2))));

  std::vector<std::int32_t> want_pos(pos);
  if (!c.positions)
    for (std::int64_t t = 0; t < tokens; ++t)
      want_pos[static_cast<std::size_t>(t)] = len[static_cast<std::size_t>(t / c.seqlen)] + static_cast<std::int32_t>(t % c.seqlen);
  // q in its dtype, and k_new rotated in fp32 (an exact fp32 copy through apply_rotary's fp32 path).
  HostBuffer rq = q, rk(DType::kF32, kn.size());
  for (std::int64_t i = 0; i < kn.size(); ++i) rk.set(i, kn.get(i));
  if (c.style != RopeStyle::kNone) {
    RopeParams rp;
    rp.batch = c.batch, rp.seqlen = c.seqlen, rp.heads_q = c.heads_kv, rp.head_dim = d;
    rp.q = bshd_view(rk.data(), DType::kF32, c.seqlen, c.heads_kv, d);
    rp.positions = want_pos.data();
    rp.rotary = p.rotary;
    ASSERT_TRUE(Passes(apply_rotary(rp, cpu())));
    if (c.heads_q) {
      rp.heads_q = c.heads_q;
      rp.q = bshd_view(rq.data(), c.dt, c.seqlen, c.heads_q, d);
      rp.rotary = p.rotary;
      ASSERT_TRUE(Passes(apply_rotary(rp, cpu())));
    }
  }
  if (c.heads_q) EXPECT_TRUE(SameBits(qo, rq));
  HostBuffer want_k = kc0, want_v = vc0;
  std::int64_t nan_slot = -1;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const int b = static_cast<int>(t / c.seqlen), j = len[static_cast<std::size_t>(b)] + static_cast<int>(t % c.seqlen);
    std::int64_t block, row;
    ac.slot(b, j, &block, &row);
    for (int h = 0; h < c.heads_kv; ++h) {
      const std::int64_t at = (block * rows + row) * c.heads_kv + h, src = t * c.heads_kv + h;
      for (int e = 0; e < d; ++e) want_k.bytes[static_cast<std::size_t>(at * d + e)] = code_of(rk.get(src * d + e), ks[static_cast<std::size_t>(h)]);
      for (int e = 0; e < dv; ++e) want_v.bytes[static_cast<std::size_t>(at * dv + e)] = code_of(vn.get(src * dv + e), vs[static_cast<std::size_t>(h)]);
      if (src * d <= nan_at && nan_at < (src + 1) * d) nan_slot = at * d + (nan_at - src * d);
      if (t == 0 && h == 0) {  // the specials of v_new saturate
        EXPECT_EQ(vc.bytes[static_cast<std::size_t>(at * dv)], 0x7e) << "+inf -> +448";
        EXPECT_EQ(vc.bytes[static_cast<std::size_t>(at * dv + 1)], 0xfe) << "-inf -> -448";
        EXPECT_EQ(vc.bytes[static_cast<std::size_t>(at * dv + 2)], 0x7e) << "1e6 -> +448";
      }
    }
  }
  ASSERT_GE(nan_slot, 0);
  EXPECT_TRUE(nan_code(kc.bytes[static_cast<std::size_t>(nan_slot)])) << "NaN in k_new gives a NaN code";
  EXPECT_TRUE(SameBits(kc, want_k));
  EXPECT_TRUE(SameBits(vc, want_v));
}

TEST(RopeAppendKv, Fp8CacheQuantizesTheFp32RotationPerHead) {
  std::uint64_t salt = 9400;
  for (DType dt : kAllDtypes)
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      run_append_fp8({3, 5, 4, 2, 128, 0, 0, 16, dt, st}, ++salt);
      run_append_fp8({2, 7, 2, 1, 64, 40, 32, 1, dt, st}, ++salt);  // page_size 1, partial rotary, head_dim_v 40
      run_append_fp8({3, 1, 8, 3, 30, 0, 0, 0, dt, st}, ++salt);    // contiguous, odd head, 3 KV heads
    }
  run_append_fp8({2, 4, 0, 2, 64, 0, 0, 4, DType::kBF16, RopeStyle::kNeox}, ++salt);         // no q
  run_append_fp8({2, 4, 2, 2, 64, 0, 0, 4, DType::kF16, RopeStyle::kNeox, false}, ++salt);   // positions = slots
  run_append_fp8({2, 3, 2, 2, 32, 0, 0, 8, DType::kF32, RopeStyle::kNone}, ++salt);          // no rotary
}

/// rope_append_kv (positions = slots) and decode_run's append write the same fp8 bytes into
/// identical caches: one quantization rule for both appends.
void append_fp8_equals_decode(int batch, int seqlen, int heads_q, int heads_kv, int d, int ps, DType dt,
                              RopeStyle style, std::uint64_t salt) {
  SCOPED_TRACE("b" + std::to_string(batch) + " s" + std::to_string(seqlen) + " " + std::to_string(heads_q) + "/" +
               std::to_string(heads_kv) + " d" + std::to_string(d) + " page" + std::to_string(ps) + " " +
               dtype_name(dt) + " " + rope_style_name(style));
  auto g = rng(salt);
  AppendCache ac(batch, ps, seqlen + 13, 1);
  const int rows = ac.rows;
  const std::int64_t tokens = static_cast<std::int64_t>(batch) * seqlen, cache_n = ac.elems(heads_kv, d);
  HostBuffer q(dt, tokens * heads_q * d), o(dt, tokens * heads_q * d), kn(dt, tokens * heads_kv * d), vn = kn;
  q.fill_normal(g);
  kn.fill_normal(g, 2.f);
  vn.fill_normal(g, 2.f);
  kn.set(3, NAN);
  HostBuffer kc(DType::kF8E4M3, cache_n), vc = kc;
  for (auto* c : {&kc, &vc})
    for (auto& byte : c->bytes) byte = static_cast<std::uint8_t>(g() & 0x77u);  // finite codes: the keys decode reads
  const HostBuffer kc0 = kc, vc0 = vc;
  const std::vector<float> ks = random_scales(g, heads_kv), vs = random_scales(g, heads_kv);
  ac.draw(g, batch, seqlen);
  const std::vector<std::int32_t>& len = ac.len;
  KVCacheView cache;
  cache.k = bshd_view(kc.data(), DType::kF8E4M3, rows, heads_kv, d);
  cache.v = bshd_view(vc.data(), DType::kF8E4M3, rows, heads_kv, d);
  cache.k_scale = ks.data();
  cache.v_scale = vs.data();
  ac.wire(&cache);
  const RotarySpec rot = RotarySpec::of_style(style);

  RopeAppendParams a;
  a.batch = batch, a.seqlen = seqlen, a.heads_kv = heads_kv, a.head_dim = d;
  a.k_new = bshd_view(kn.data(), dt, seqlen, heads_kv, d);
  a.v_new = bshd_view(vn.data(), dt, seqlen, heads_kv, d);
  a.cache = cache;
  a.cache_seqlens = len.data();
  a.rotary = rot;
  ASSERT_TRUE(Passes(rope_append_kv(a, cpu(2))));
  const HostBuffer kc_append = kc, vc_append = vc;
  EXPECT_FALSE(kc_append.bytes == kc0.bytes);  // it wrote something

  std::copy(kc0.bytes.begin(), kc0.bytes.end(), kc.bytes.begin());  // the same storage the view names
  std::copy(vc0.bytes.begin(), vc0.bytes.end(), vc.bytes.begin());
  DecodeParams p;
  p.batch = batch, p.seqlen_q = seqlen, p.heads_q = heads_q, p.heads_kv = heads_kv, p.head_dim = d;
  p.q = bshd_view(q.data(), dt, seqlen, heads_q, d);
  p.o = bshd_view(o.data(), dt, seqlen, heads_q, d);
  p.cache = cache;
  p.cache_seqlens = len.data();
  p.k_new = a.k_new;
  p.v_new = a.v_new;
  p.rotary = rot;
  DecodePlanOptions po;
  po.backend = Backend::kCpu;
  DecodeWorkspaceSize ws;
  ASSERT_TRUE(Passes(decode_workspace_size(p, po, &ws)));
  std::vector<std::uint8_t> iw(ws.int_bytes + 16), fw(ws.float_bytes + 16);
  auto aligned16 = [](std::vector<std::uint8_t>& v) {
    return v.data() + (16 - reinterpret_cast<std::uintptr_t>(v.data()) % 16) % 16;
  };
  DecodePlan plan;
  ASSERT_TRUE(Passes(decode_plan(p, po, aligned16(iw), ws.int_bytes, aligned16(fw), ws.float_bytes, &plan)));
  ASSERT_TRUE(Passes(decode_run(p, plan, cpu(2))));
  EXPECT_TRUE(SameBits(kc_append, kc));
  EXPECT_TRUE(SameBits(vc_append, vc));
}

TEST(RopeAppendKv, Fp8CacheBytesEqualDecodeAppends) {
  std::uint64_t salt = 9500;
  for (DType dt : kAllDtypes)
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      append_fp8_equals_decode(3, 4, 8, 2, 128, 16, dt, st, ++salt);
      append_fp8_equals_decode(2, 1, 4, 4, 64, 0, dt, st, ++salt);
      append_fp8_equals_decode(2, 7, 2, 1, 256, 1, dt, st, ++salt);
    }
  append_fp8_equals_decode(2, 3, 4, 2, 64, 8, DType::kBF16, RopeStyle::kNone, ++salt);
}

TEST(FusedValidate, RopeAppendFp8CacheFollowsDecodesRules) {
  const Backend b = Backend::kCuda;
  auto fp8 = [] {
    RopeAppendParams p = append_base();
    p.cache.k.dtype = p.cache.v.dtype = DType::kF8E4M3;
    p.cache.k_scale = static_cast<const float*>(fake(kW + 65536));
    p.cache.v_scale = static_cast<const float*>(fake(kW + 65536 + 64));
    return p;
  };
  EXPECT_TRUE(Passes(validate(fp8(), b)));
  EXPECT_TRUE(Passes(validate(fp8(), Backend::kAuto)));
  RopeAppendParams p = fp8();
  p.cache.k_scale = nullptr;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k_scale is null"}));
  p = fp8();
  p.cache.v_scale = static_cast<const float*>(fake(kW + 65536 + 66));
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.v_scale", "is not 4-byte aligned (fp32)"}));
  p = fp8();
  p.cache.v.dtype = DType::kBF16;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k.dtype fp8_e4m3 differs from cache.v.dtype bf16", "quantizes both"}));
  p = append_base();  // scales on a bf16 cache
  p.cache.v_scale = static_cast<const float*>(fake(kW + 65536));
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.v_scale is set but the cache is bf16"}));
  p = append_base();
  p.cache.k_scale = static_cast<const float*>(fake(kW + 65536));
  p.batch = 0;  // refused before the empty-problem shortcut, as decode refuses it
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k_scale is set but the cache is bf16"}));
  // CUDA: decode's 16-byte rule in codes; the CPU backend takes any stride.
  p = fp8();
  p.cache.k.head_stride = 136;
  p.cache.k.seq_stride = 8 * 136;
  p.cache.k.batch_stride = 16 * 8 * 136;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k.head_stride 136 is not a multiple of 16 elements"}));
  EXPECT_TRUE(Passes(validate(p, Backend::kAuto)));
  p = fp8();
  p.cache.v.data = static_cast<char*>(p.cache.v.data) + 8;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.v.data", "is not 16-byte aligned"}));
  p = fp8();  // the kernel reads the scales: the cache must not overlap them
  p.cache.k_scale = static_cast<const float*>(p.cache.k.data) + 4;
  EXPECT_TRUE(Invalid(validate(p, b), {"cache.k overlaps cache.k_scale"}));
  p = fp8();
  p.k_new.dtype = p.v_new.dtype = p.q.dtype = DType::kF32;
  EXPECT_TRUE(Fails(validate(p, b), StatusCode::kUnsupported, {"fp32 rope_append_kv runs on the CPU backend only"}));
}

TEST(FusedValidate, RopeAppendFp8ScalesAreCheckedOnTheCpu) {
  const int d = 16;
  HostBuffer kc(DType::kF8E4M3, 4 * 2 * d), vc = kc;
  std::vector<std::int32_t> len = {0};
  std::vector<float> ks = {0.5f, 0.25f}, vs = {1.f, 2.f};
  RopeAppendParams p;
  p.batch = 1, p.seqlen = 1, p.heads_kv = 2, p.head_dim = d;
  HostBuffer kn2(DType::kBF16, 2 * d), vn2 = kn2;
  p.k_new = bshd_view(kn2.data(), DType::kBF16, 1, 2, d);
  p.v_new = bshd_view(vn2.data(), DType::kBF16, 1, 2, d);
  p.cache.k = bshd_view(kc.data(), DType::kF8E4M3, 4, 2, d);
  p.cache.v = bshd_view(vc.data(), DType::kF8E4M3, 4, 2, d);
  p.cache.capacity = 4;
  p.cache.k_scale = ks.data();
  p.cache.v_scale = vs.data();
  p.cache_seqlens = len.data();
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  for (float bad : {0.f, -1.f, NAN, INFINITY}) {
    vs[1] = bad;
    EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"cache.v_scale[1]", "must be positive and finite"})) << bad;
    EXPECT_TRUE(Invalid(rope_append_kv(p, cpu()), {"cache.v_scale[1]"}));
    EXPECT_TRUE(Passes(validate(p, Backend::kAuto)));  // device values: not read
  }
}

}  // namespace
}  // namespace flashcpp::testing
