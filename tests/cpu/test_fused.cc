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

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace flashcpp::testing
