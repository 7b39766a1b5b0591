// The audit's stress-input families (what each provokes: family_provokes() and docs/audit.md),
// the Problem description, and score_stats(), which measures in fp64 that a family produces
// what it claims.
//
// Notation: D = head_dim, scale = 1/sqrt(D), s_ij = scale * q_i . k_j. Most families build the
// scores they want along unit directions: with q = a * D^(1/4) * e and k = c * D^(1/4) * e for a
// unit vector e, s = a * c exactly (before rounding to the dtype). Every value is drawn from a
// counter-based generator (a hash of the seed, a salt per purpose and the element index), so the
// inputs do not depend on the thread count and each purpose has its own independent stream.
//
// The inputs are rounded to the problem's dtype once, here; the kernel and the fp64 reference
// then read identical values, so every error the audit reports is arithmetic, never quantization
// of the inputs. Claims about scores ("one key per row dominates") are about the rounded inputs
// and are checked by tests/cpu/test_audit.cc through score_stats().
#include <fmt/format.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include "audit.h"
#include "flashcpp/half.h"

namespace flashcpp::audit {

// ---- names ---------------------------------------------------------------------------------

const char* family_name(Family f) noexcept {
  switch (f) {
    case Family::kRandom:
      return "random";
    case Family::kSubnormal:
      return "subnormal";
    case Family::kOneHot:
      return "one_hot";
    case Family::kNearTies:
      return "near_ties";
    case Family::kConstant:
      return "constant";
    case Family::kOutlierKeys:
      return "outlier_keys";
    case Family::kLargeScale:
      return "large_scale";
    case Family::kLongRange:
      return "long_range";
  }
  return "unknown";
}

const char* family_provokes(Family f) noexcept {
  switch (f) {
    case Family::kRandom:
      return "control: q, k, v ~ normal(0, 1); the error every other family is compared with.";
    case Family::kSubnormal:
      return "scores spread over hundreds of nats (s = a*c, |a| in [150, 400], c in [-1, 1]): exp(s - m) is "
             "subnormal or exactly 0 for most keys (flush-to-zero on the GPU), rescale factors exp(m_old - m_new) "
             "underflow to 0, and exp(s) itself would overflow fp32 if the max were not subtracted.";
    case Family::kOneHot:
      return "one key per row (anywhere in the visible range, so in any key tile) scores >= ~24 nats above all "
             "others: P is 1 for it and < 1e-10 for the rest, O equals one V row (|O| up to ~4, the largest "
             "relative rounding of O), and a late peak forces a rescale of everything accumulated before it.";
    case Family::kNearTies:
      return "every 64th key is a copy of one direction, so n/64 keys per row, spread over every key tile, share "
             "the row max to within 0.03 nats (the rounding of the keys; some tie exactly) and sit ~8 nats above the "
             "rest: the running max creeps up by tiny amounts from tile to tile (rescale factors just below 1, "
             "exact ties s == m), which catches kernels that skip or approximate a small rescale.";
    case Family::kConstant:
      return "all keys identical, so every score of a row is the same value s_i in [-300, 300]: every key ties with "
             "the max (P == 1), l = n exactly, exp(s) overflows (s > 88.7) or underflows (s < -103) if the max is "
             "not subtracted; V has mean 1 so O ~ 1 and the error of summing n equal weights shows.";
    case Family::kOutlierKeys:
      return "key 0 (an attention sink) and one key in every 512 have 64x the norm (massive activations): their scores "
             "are +-100s of nats, so the row max jumps by far more than 104 nats when an outlier tile arrives "
             "(the running sums rescale to exactly 0) or the outliers vanish (exp underflow).";
    case Family::kLargeScale:
      return "q and k share a large direction (no QK-norm, a common key mean): |s| in [1000, 4000] with an O(1) "
             "spread within a row, so the fp32 rounding of s and of s - m (~|s| * 2^-24 per operation) is a "
             "relative error of P that is larger than fp16's rounding and far larger than fp32's.";
    case Family::kLongRange:
      return "the farthest visible key of each row (key 0 under causal, the window's left edge under a sliding "
             "window) sits 14 nats above a normal background: kernels that walk key tiles from the diagonal back "
             "meet the dominant key last, so the max jumps at the very end and every earlier tile is rescaled.";
  }
  return "";
}

bool parse_family(std::string_view s, Family* out) {
  for (Family f : kAllFamilies)
    if (s == family_name(f)) {
      *out = f;
      return true;
    }
  return false;
}

const char* mask_kind_name(MaskKind m) noexcept {
  switch (m) {
    case MaskKind::kNone:
      return "none";
    case MaskKind::kCausal:
      return "causal";
    case MaskKind::kWindow:
      return "window";
  }
  return "unknown";
}

bool parse_mask_kind(std::string_view s, MaskKind* out) {
  for (MaskKind m : kAllMasks)
    if (s == mask_kind_name(m)) {
      *out = m;
      return true;
    }
  return false;
}

// ---- Problem -------------------------------------------------------------------------------

harness::Case Problem::to_case() const {
  harness::Case c;
  c.batch = 1;
  c.seqlen_q = c.seqlen_k = seqlen;
  c.heads_q = c.heads_kv = heads;
  c.head_dim = head_dim;
  c.dtype = dtype;
  c.layout = harness::Layout::kBshd;
  c.mask.causal = mask != MaskKind::kNone;
  if (mask == MaskKind::kWindow) c.mask.window_left = window;
  if (rotary) c.mask.rotary_dim = head_dim;
  c.return_lse = true;
  return c;
}

std::string Problem::name() const { return std::string(family_name(family)) + "/" + to_case().name(); }

MaskParams Problem::mask_params() const {
  MaskParams m;
  m.causal = mask != MaskKind::kNone;
  if (mask == MaskKind::kWindow) m.window_left = window;
  return m;
}

int Problem::key_lo(int i) const noexcept { return mask == MaskKind::kWindow ? std::max(0, i - window) : 0; }
int Problem::key_hi(int i) const noexcept { return mask == MaskKind::kNone ? seqlen - 1 : i; }
float Problem::scale() const noexcept { return 1.f / std::sqrt(static_cast<float>(head_dim)); }

// ---- generators ----------------------------------------------------------------------------

namespace {

std::uint64_t mix64(std::uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Salts: one independent stream per purpose.
enum Salt : std::uint64_t {
  kSaltQ = 1,
  kSaltK,
  kSaltV,
  kSaltDirection,
  kSaltRowScale,
  kSaltRowSign,
  kSaltKeyScale,
  kSaltPeak,
  kSaltGroup,
  kSaltTieJitter,
  kSaltOutlier,
};

/// Counter-based random numbers: value i of a stream is a pure function of (seed, salt, i).
class Stream {
 public:
  Stream(std::uint64_t seed, std::uint64_t salt) : key_(mix64(seed ^ mix64(salt * 0xD1B54A32D192ED03ull))) {}
  /// Uniform in (0, 1).
  double uniform(std::uint64_t i) const { return (static_cast<double>(mix64(key_ ^ mix64(i)) >> 11) + 0.5) * 0x1p-53; }
  /// Standard normal (Box-Muller on two uniforms of the stream).
  double normal(std::uint64_t i) const {
    const double u1 = uniform(2 * i), u2 = uniform(2 * i + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t key_;
};

using detail::parallel_for;

/// Everything a family needs to fill one (row, head) vector of D elements.
struct Gen {
  const Problem& p;
  std::uint64_t seed;
  int n, h_count, d;
  double sd, d4, scale;     // sqrt(D), D^(1/4), 1/sqrt(D)
  std::vector<double> dir;  // [heads][D] unit direction per head

  Gen(const Problem& pr, std::uint64_t s) : p(pr), seed(s), n(pr.seqlen), h_count(pr.heads), d(pr.head_dim) {
    sd = std::sqrt(static_cast<double>(d));
    d4 = std::sqrt(sd);
    scale = 1.0 / sd;
    dir.resize(static_cast<std::size_t>(h_count) * d);
    const Stream st(seed, kSaltDirection);
    for (int h = 0; h < h_count; ++h)
      unit(st, static_cast<std::uint64_t>(h) * d, &dir[static_cast<std::size_t>(h) * d]);
  }
  /// A random unit vector from D normals of `st` starting at index `base`.
  void unit(const Stream& st, std::uint64_t base, double* out) const {
    double nn = 0;
    for (int e = 0; e < d; ++e) {
      out[e] = st.normal(base + e);
      nn += out[e] * out[e];
    }
    const double inv = 1.0 / std::sqrt(nn);
    for (int e = 0; e < d; ++e) out[e] *= inv;
  }
  const double* e_of(int h) const { return &dir[static_cast<std::size_t>(h) * d]; }
  std::uint64_t idx(int row, int h) const { return static_cast<std::uint64_t>(row) * h_count + h; }
  std::size_t off(int row, int h) const { return static_cast<std::size_t>(idx(row, h)) * d; }
  /// D normals of stream `st` for (row, head).
  void normals(const Stream& st, int row, int h, double* out) const {
    for (int e = 0; e < d; ++e) out[e] = st.normal(idx(row, h) * d + e);
  }
  /// x -= (x . u) u for a unit u.
  void project_out(double* x, const double* u) const {
    double dot = 0;
    for (int e = 0; e < d; ++e) dot += x[e] * u[e];
    for (int e = 0; e < d; ++e) x[e] -= dot * u[e];
  }
  /// The visible key farthest from query i (ties: the left one).
  int farthest(int i) const {
    const int lo = p.key_lo(i), hi = p.key_hi(i);
    return (i - lo) >= (hi - i) ? lo : hi;
  }
};

/// Runs fill(row, head, out[D]) over every (row, head) of a (seqlen, heads, D) tensor.
template <class F>
void fill_rows(const Gen& g, std::vector<float>& t, int threads, F&& fill) {
  t.assign(static_cast<std::size_t>(g.n) * g.h_count * g.d, 0.f);
  constexpr std::int64_t kRowsPerItem = 64;
  const std::int64_t rows = static_cast<std::int64_t>(g.n) * g.h_count;
  parallel_for((rows + kRowsPerItem - 1) / kRowsPerItem, threads, [&](std::int64_t item) {
    std::vector<double> buf(static_cast<std::size_t>(g.d));
    const std::int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (std::int64_t r = item * kRowsPerItem; r < end; ++r) {
      const int row = static_cast<int>(r / g.h_count), h = static_cast<int>(r % g.h_count);
      fill(row, h, buf.data());
      float* dst = t.data() + g.off(row, h);
      for (int e = 0; e < g.d; ++e) dst[e] = static_cast<float>(buf[e]);
    }
  });
}

void fill_normal(const Gen& g, std::vector<float>& t, std::uint64_t salt, double mean, double stddev, int threads) {
  const Stream st(g.seed, salt);
  fill_rows(g, t, threads, [&](int row, int h, double* out) {
    g.normals(st, row, h, out);
    for (int e = 0; e < g.d; ++e) out[e] = mean + stddev * out[e];
  });
}

// Family parameters (docs/audit.md gives the arithmetic behind each).
constexpr double kSubnormalAMin = 150, kSubnormalAMax = 400;  // |a|: s - m spans up to 2|a| nats
constexpr double kSubnormalNoise = 0.05;
constexpr double kOneHotGap = 24;  // nats between the peak and a 5-sigma competitor
constexpr double kOneHotSigmas = 5;
constexpr int kTieGroups = 64;          // key j is a copy of direction j mod 64
constexpr double kTieScore = 12;        // score of the tied keys (background ~ N(0, (12/sqrt D)^2))
constexpr double kTieJitter = 0x1p-10;  // relative jitter of the tied keys before rounding
constexpr double kConstantMax = 300;    // |s_i| <= 300: beyond exp's fp32 range both ways
constexpr double kOutlierNorm = 64;
constexpr int kOutlierSpacing = 512;
constexpr double kLargeMin = 1000, kLargeMax = 4000;  // |s| of the large_scale family
constexpr double kLargeKeyNorm = 32;                  // k = 32 D^(1/4) e + noise; q carries |s| / 32
constexpr double kLongRangeLift = 14;                 // nats the farthest key sits above the background

}  // namespace

Inputs generate(const Problem& p, std::uint64_t seed, int threads) {
  Inputs in;
  const Gen g(p, seed);
  const int d = g.d;
  switch (p.family) {
    case Family::kRandom:
      fill_normal(g, in.q, kSaltQ, 0, 1, threads);
      fill_normal(g, in.k, kSaltK, 0, 1, threads);
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;

    case Family::kSubnormal: {
      // q_i = a_i D^(1/4) e + noise, k_j = c_j D^(1/4) e + noise  =>  s_ij ~= a_i c_j.
      const Stream sq(seed, kSaltQ), sk(seed, kSaltK), sa(seed, kSaltRowScale), ss(seed, kSaltRowSign),
          sc(seed, kSaltKeyScale);
      fill_rows(g, in.q, threads, [&](int i, int h, double* out) {
        const double a = (kSubnormalAMin + (kSubnormalAMax - kSubnormalAMin) * sa.uniform(g.idx(i, h))) *
                         (ss.uniform(g.idx(i, h)) < 0.5 ? -1.0 : 1.0);
        g.normals(sq, i, h, out);
        for (int e = 0; e < d; ++e) out[e] = a * g.d4 * g.e_of(h)[e] + kSubnormalNoise * out[e];
      });
      fill_rows(g, in.k, threads, [&](int j, int h, double* out) {
        const double c = 2 * sc.uniform(g.idx(j, h)) - 1;
        g.normals(sk, j, h, out);
        for (int e = 0; e < d; ++e) out[e] = c * g.d4 * g.e_of(h)[e] + kSubnormalNoise * out[e];
      });
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;
    }

    case Family::kOneHot: {
      // Keys on the sphere of radius sqrt(D); q_i = beta k_t / sqrt(D) for a peak t(i) drawn in the
      // visible range: s_it = beta, s_ij = beta cos(k_t, k_j) ~ beta N(0, 1/D) for the others.
      const Stream sk(seed, kSaltK), st(seed, kSaltPeak);
      fill_rows(g, in.k, threads, [&](int j, int h, double* out) {
        g.normals(sk, j, h, out);
        double nn = 0;
        for (int e = 0; e < d; ++e) nn += out[e] * out[e];
        const double f = g.sd / std::sqrt(nn);
        for (int e = 0; e < d; ++e) out[e] *= f;
      });
      const double beta = kOneHotGap / (1 - kOneHotSigmas / g.sd);
      fill_rows(g, in.q, threads, [&](int i, int h, double* out) {
        const int lo = p.key_lo(i), hi = p.key_hi(i);
        const int t = std::min(hi, lo + static_cast<int>(st.uniform(g.idx(i, h)) * (hi - lo + 1)));
        const float* kt = in.k.data() + g.off(t, h);
        for (int e = 0; e < d; ++e) out[e] = beta * kt[e] / g.sd;
      });
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;
    }

    case Family::kNearTies: {
      // 64 unit directions u_g per head; key j = sqrt(D) u_{j mod 64} (1 + jitter); query i =
      // 12 u_{i mod 64} + noise orthogonal to u: the keys j = i (mod 64) all score ~12 (the diagonal
      // key j = i is always one of them, so every row has at least one), the others ~N(0, 144/D).
      const Stream sg(seed, kSaltGroup), sj(seed, kSaltTieJitter), sq(seed, kSaltQ);
      std::vector<double> u(static_cast<std::size_t>(g.h_count) * kTieGroups * d);
      for (int h = 0; h < g.h_count; ++h)
        for (int gr = 0; gr < kTieGroups; ++gr)
          g.unit(sg, (static_cast<std::uint64_t>(h) * kTieGroups + gr) * d,
                 &u[(static_cast<std::size_t>(h) * kTieGroups + gr) * d]);
      auto u_of = [&](int h, int gr) { return &u[(static_cast<std::size_t>(h) * kTieGroups + gr) * d]; };
      fill_rows(g, in.k, threads, [&](int j, int h, double* out) {
        const double f = g.sd * (1 + kTieJitter * sj.uniform(g.idx(j, h)));
        const double* ug = u_of(h, j % kTieGroups);
        for (int e = 0; e < d; ++e) out[e] = f * ug[e];
      });
      fill_rows(g, in.q, threads, [&](int i, int h, double* out) {
        const double* ug = u_of(h, i % kTieGroups);
        g.normals(sq, i, h, out);
        g.project_out(out, ug);
        for (int e = 0; e < d; ++e) out[e] = kTieScore * ug[e] + 0.1 * out[e];
      });
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;
    }

    case Family::kConstant: {
      // Every key is sqrt(D) e; q_i = a_i e + noise: s_ij = a_i + (noise . e) / 1, the same for all j.
      const Stream sq(seed, kSaltQ), sa(seed, kSaltRowScale);
      fill_rows(g, in.k, threads, [&](int, int h, double* out) {
        for (int e = 0; e < d; ++e) out[e] = g.sd * g.e_of(h)[e];
      });
      fill_rows(g, in.q, threads, [&](int i, int h, double* out) {
        const double a = kConstantMax * (2 * sa.uniform(g.idx(i, h)) - 1);
        g.normals(sq, i, h, out);
        for (int e = 0; e < d; ++e) out[e] = a * g.e_of(h)[e] + 0.5 * out[e];
      });
      fill_normal(g, in.v, kSaltV, 1, 1, threads);
      break;
    }

    case Family::kOutlierKeys: {
      // Key 0 and one key in every block of kOutlierSpacing, at a random offset per head.
      const Stream so(seed, kSaltOutlier), sk(seed, kSaltK);
      fill_normal(g, in.q, kSaltQ, 0, 1, threads);
      fill_rows(g, in.k, threads, [&](int j, int h, double* out) {
        const int offset = static_cast<int>(so.uniform(static_cast<std::uint64_t>(h)) * kOutlierSpacing);
        g.normals(sk, j, h, out);
        if (j == 0 || j % kOutlierSpacing == offset)
          for (int e = 0; e < d; ++e) out[e] *= kOutlierNorm;
      });
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;
    }

    case Family::kLargeScale: {
      // k_j = 32 D^(1/4) e + z (z orthogonal to e), q_i = (o_i / 32) D^(1/4) e + z':
      // s_ij = o_i + scale z.z' with |o_i| in [1000, 4000].
      const Stream sq(seed, kSaltQ), sk(seed, kSaltK), sa(seed, kSaltRowScale), ss(seed, kSaltRowSign);
      fill_rows(g, in.k, threads, [&](int j, int h, double* out) {
        g.normals(sk, j, h, out);
        g.project_out(out, g.e_of(h));
        for (int e = 0; e < d; ++e) out[e] += kLargeKeyNorm * g.d4 * g.e_of(h)[e];
      });
      fill_rows(g, in.q, threads, [&](int i, int h, double* out) {
        const double o = (kLargeMin + (kLargeMax - kLargeMin) * sa.uniform(g.idx(i, h))) *
                         (ss.uniform(g.idx(i, h)) < 0.5 ? -1.0 : 1.0);
        g.normals(sq, i, h, out);
        g.project_out(out, g.e_of(h));
        for (int e = 0; e < d; ++e) out[e] += o / kLargeKeyNorm * g.d4 * g.e_of(h)[e];
      });
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;
    }

    case Family::kLongRange: {
      // Normal keys; q_i = z (with its component along k_f removed) + lift * sqrt(D) k_f / |k_f|^2
      // for the farthest visible key f: s_if = lift exactly, s_ij ~ N(0, 1 + lift^2 / D) otherwise.
      fill_normal(g, in.k, kSaltK, 0, 1, threads);
      const Stream sq(seed, kSaltQ);
      fill_rows(g, in.q, threads, [&](int i, int h, double* out) {
        const float* kf = in.k.data() + g.off(g.farthest(i), h);
        std::vector<double> khat(static_cast<std::size_t>(d));
        double nn = 0;
        for (int e = 0; e < d; ++e) nn += static_cast<double>(kf[e]) * kf[e];
        for (int e = 0; e < d; ++e) khat[e] = kf[e] / std::sqrt(nn);
        g.normals(sq, i, h, out);
        g.project_out(out, khat.data());
        for (int e = 0; e < d; ++e) out[e] += kLongRangeLift * g.sd * kf[e] / nn;
      });
      fill_normal(g, in.v, kSaltV, 0, 1, threads);
      break;
    }
  }
  for (auto* t : {&in.q, &in.k, &in.v})
    for (float& x : *t) x = round_to_dtype(p.dtype, x);
  return in;
}

// ---- score statistics ----------------------------------------------------------------------

ScoreStats score_stats(const Problem& p, const Inputs& in, int min_keys, double tie_eps) {
  const int n = p.seqlen, hc = p.heads, d = p.head_dim;
  const double scale = p.scale();
  const double ln_flt_min = std::log(static_cast<double>(FLT_MIN));  // -87.34
  const double ln_zero = -150.0 * std::numbers::ln2;                 // exp below 2^-150 rounds to 0
  struct Row {
    bool used = false;
    int keys = 0;
    double top_w = 0, gap = INFINITY, ties = 0, under = 0, zero = 0, abs_sum = 0, abs_max = 0, spread = 0, sd = 0;
    bool argmax_far = false, far_major = false;
  };
  std::vector<Row> rows(static_cast<std::size_t>(n) * hc);
  parallel_for(static_cast<std::int64_t>(n) * hc, 0, [&](std::int64_t r) {
    const int i = static_cast<int>(r / hc), h = static_cast<int>(r % hc);
    const int lo = p.key_lo(i), hi = p.key_hi(i), cnt = hi - lo + 1;
    Row& out = rows[static_cast<std::size_t>(r)];
    if (cnt < min_keys) return;
    out.used = true;
    out.keys = cnt;
    const float* q = in.q.data() + (static_cast<std::size_t>(i) * hc + h) * d;
    std::vector<double> s(static_cast<std::size_t>(cnt));
    double m = -INFINITY, second = -INFINITY, mean = 0;
    int arg = lo;
    for (int j = lo; j <= hi; ++j) {
      const float* k = in.k.data() + (static_cast<std::size_t>(j) * hc + h) * d;
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += static_cast<double>(q[e]) * k[e];
      const double x = scale * dot;
      s[j - lo] = x;
      mean += x;
      out.abs_sum += std::fabs(x);
      out.abs_max = std::max(out.abs_max, std::fabs(x));
      if (x > m) {
        second = m;
        m = x;
        arg = j;
      } else if (x > second) {
        second = x;
      }
    }
    mean /= cnt;
    double sum = 0, var = 0, mn = INFINITY;
    for (double x : s) {
      sum += std::exp(x - m);
      var += (x - mean) * (x - mean);
      mn = std::min(mn, x);
      if (x - m < ln_flt_min) ++out.under;
      if (x - m < ln_zero) ++out.zero;
      if (m - x <= tie_eps) ++out.ties;
    }
    out.top_w = 1.0 / sum;
    out.gap = cnt >= 2 ? m - second : INFINITY;
    out.spread = m - mn;
    out.sd = std::sqrt(var / cnt);
    const int lo_far = (i - lo) >= (hi - i) ? lo : hi;
    out.argmax_far = arg == lo_far;
    out.far_major = std::exp(s[lo_far - lo] - m) / sum >= 0.5;
  });
  ScoreStats st;
  std::int64_t pairs = 0, big_rows = 0, big_major = 0;
  double under = 0, zero = 0, abs_sum = 0, gap_sum = 0;
  std::int64_t gap_rows = 0;
  st.min_ties = INFINITY;
  for (const Row& r : rows) {
    if (!r.used) continue;
    ++st.rows;
    pairs += r.keys;
    st.min_top_weight = std::min(st.min_top_weight, r.top_w);
    st.mean_top_weight += r.top_w;
    under += r.under;
    zero += r.zero;
    if (r.keys >= 64) {
      ++big_rows;
      if (r.under * 2 > r.keys) ++big_major;
    }
    if (r.keys >= 2) {
      st.min_top_gap = std::min(st.min_top_gap, r.gap);
      gap_sum += r.gap;
      ++gap_rows;
    }
    st.min_ties = std::min(st.min_ties, r.ties);
    st.mean_ties += r.ties;
    st.frac_rows_argmax_farthest += r.argmax_far;
    st.frac_rows_farthest_majority += r.far_major;
    abs_sum += r.abs_sum;
    st.max_abs_score = std::max(st.max_abs_score, r.abs_max);
    st.max_row_score_spread = std::max(st.max_row_score_spread, r.spread);
    st.max_row_score_std = std::max(st.max_row_score_std, r.sd);
  }
  if (st.rows == 0) {
    st.min_ties = 0;
    return st;
  }
  const double rn = static_cast<double>(st.rows);
  st.mean_top_weight /= rn;
  st.mean_ties /= rn;
  st.frac_rows_argmax_farthest /= rn;
  st.frac_rows_farthest_majority /= rn;
  st.frac_pairs_underflow = under / static_cast<double>(pairs);
  st.frac_pairs_zero = zero / static_cast<double>(pairs);
  st.frac_rows_majority_underflow = big_rows ? static_cast<double>(big_major) / big_rows : 0.0;
  st.mean_abs_score = abs_sum / static_cast<double>(pairs);
  st.mean_top_gap = gap_rows ? gap_sum / gap_rows : 0.0;
  return st;
}

}  // namespace flashcpp::audit
