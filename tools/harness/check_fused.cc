// `flashcpp check --area fused`: the fused LLM kernels of include/flashcpp/fused.h (norms, SwiGLU,
// rotary, qk_norm_rope, rope_append_kv) against fp64
// evaluations of the formulas in that header, written here.
//
// Tolerance (as tests/cpu/test_fused.cc and the fused issue): per element
//   |out - ref| <= 1e-3 + (1e-3 + h_T) * |ref|,
// where h_T is half an ulp of the output dtype relative to |ref| (2^-8 bf16, 2^-11 fp16, 0 fp32):
// storing the result costs that much by itself, and bf16's half ulp already exceeds the issue's
// 1e-3 relative, so atol = rtol = 1e-3 applies on top of it (docs/tolerances.md explains the
// same floor argument for attention). The updated residual of fused_add_rms_norm,
// h = round_T(x + residual) in fp32, must match bit for bit.
//
// qk_norm_rope: the reference is fused.h's formula in fp64 with its one intermediate rounding,
// n = round_T(x * rstd * (offset + w)), then the fp64 rotation of n. The kernels form rstd in fp32,
// so a normed value may round to the neighbouring T: atol adds that one ulp of n (2 h_T times the
// case's largest |n|). rope_append_kv: q_out and the K rows as apply_rotary; the V rows must equal
// v_new (error 0), and every cache byte outside the step's slots must keep its poison (counted
// with the guard bytes as writes outside the output). rope_append_kv into an fp8 e4m3 cache
// (per-head scales drawn log-uniform in [2^-8, 1], so some heads saturate and some reach the
// subnormal codes): q_out as above; every written code must be a nearest e4m3 value of the fp64
// truth x = rotated k (or v) / scale, i.e. |code - clamp(x, +-448)| <= half an e4m3 ulp of it plus
// the fp32 rotation's own error, 2e-6 of the row's largest |value| / scale (the device's sincos is
// within ~4e-7; a code further away counts as a violation); NaN needs a NaN code.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <tuple>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flashcpp/half.h"
#include "flashcpp/fused.h"
#include "harness/harness.h"
#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashcpp::harness {

namespace {

using Clock = std::chrono::steady_clock;

enum class Op : std::uint8_t { kRmsNorm, kAddRmsNorm, kSilu, kSiluFused, kRotary, kQkNormRope, kRopeAppend };

struct FusedCase {
  Op op = Op::kRmsNorm;
  DType dt = DType::kBF16;
  std::int64_t rows = 7, hidden = 8;  ///< norms / SwiGLU: (rows, hidden); rotary: tokens = rows
  RopeStyle style = RopeStyle::kNeox;
  int heads_q = 4, heads_k = 2, head_dim = 128, rotary_dim = 0;
  float weight_offset = 0.f;  ///< qk_norm_rope: 0 (Qwen3) or 1 (Gemma3)
  int page_size = 0;          ///< rope_append_kv: 0 = contiguous cache
  bool fp8 = false;           ///< rope_append_kv: an fp8 e4m3 cache with per-head scales

  std::string name() const {
    const char* t = dtype_name(dt);
    switch (op) {
      case Op::kRmsNorm: return fmt::format("rms_norm_r{}_h{}_{}", rows, hidden, t);
      case Op::kAddRmsNorm: return fmt::format("fused_add_rms_norm_r{}_h{}_{}", rows, hidden, t);
      case Op::kSilu: return fmt::format("silu_and_mul_r{}_d{}_{}", rows, hidden, t);
      case Op::kSiluFused: return fmt::format("silu_and_mul_fused_r{}_d{}_{}", rows, hidden, t);
      case Op::kRotary:
        return fmt::format("rotary_{}_t{}_h{}kv{}_d{}{}_{}", rope_style_name(style), rows, heads_q, heads_k, head_dim,
                           rotary_dim ? fmt::format("_rot{}", rotary_dim) : "", t);
      case Op::kQkNormRope:
        return fmt::format("qk_norm_rope_{}_t{}_h{}kv{}_d{}{}{}_{}", rope_style_name(style), rows, heads_q, heads_k,
                           head_dim, rotary_dim ? fmt::format("_rot{}", rotary_dim) : "",
                           weight_offset != 0.f ? "_offset1" : "", t);
      case Op::kRopeAppend:
        return fmt::format("rope_append_kv_{}_b3_s{}_h{}kv{}_d{}{}_{}_{}", rope_style_name(style), rows, heads_q,
                           heads_k, head_dim, rotary_dim ? fmt::format("_rot{}", rotary_dim) : "",
                           page_size ? fmt::format("page{}", page_size) : std::string("contiguous"),
                           fp8 ? fmt::format("{}_fp8cache", t) : std::string(t));
    }
    return "?";
  }
  const char* op_name() const {
    switch (op) {
      case Op::kRmsNorm: return "rms_norm";
      case Op::kAddRmsNorm: return "fused_add_rms_norm";
      case Op::kSilu: return "silu_and_mul";
      case Op::kSiluFused: return "silu_and_mul_fused";
      case Op::kRotary: return "apply_rotary";
      case Op::kQkNormRope: return "qk_norm_rope";
      case Op::kRopeAppend: return "rope_append_kv";
    }
    return "?";
  }
};

std::vector<FusedCase> fused_cases(TableKind kind) {
  std::vector<FusedCase> v;
  const std::int64_t rows = kind == TableKind::kFull ? 33 : 7;
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (Op op : {Op::kRmsNorm, Op::kAddRmsNorm, Op::kSilu, Op::kSiluFused})
      for (std::int64_t h : {1, 8, 4097, 8192}) {
        FusedCase c;
        c.op = op;
        c.dt = dt;
        c.rows = rows;
        c.hidden = h;
        v.push_back(c);
      }
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved})
      // (head_dim, rotary_dim): the 16-byte path, partial rotary, and the scalar paths
      // (rotary_dim not a multiple of 16; head_dim not a multiple of 8), where an interleaved
      // pair can straddle two scalar vectors.
      for (auto [d, rd] : {std::pair{128, 0}, std::pair{64, 32}, std::pair{64, 24}, std::pair{30, 0}}) {
        FusedCase c;
        c.op = Op::kRotary;
        c.dt = dt;
        c.rows = kind == TableKind::kFull ? 257 : 13;
        c.style = st;
        c.head_dim = d;
        c.rotary_dim = rd;
        v.push_back(c);
      }
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      // qk_norm_rope (head_dim, rotary_dim, weight_offset): the 16-byte path at 128 and 256
      // (Gemma3's 1 + w), partial rotary, a scalar head (30: not a multiple of 8).
      for (auto [d, rd, off] : {std::tuple{128, 0, 0.f}, std::tuple{64, 32, 1.f}, std::tuple{256, 0, 1.f},
                                std::tuple{30, 0, 0.f}}) {
        FusedCase c;
        c.op = Op::kQkNormRope;
        c.dt = dt;
        c.rows = kind == TableKind::kFull ? 257 : 13;
        c.style = st;
        c.head_dim = d;
        c.rotary_dim = rd;
        c.weight_offset = off;
        v.push_back(c);
      }
      // rope_append_kv (head_dim, rotary_dim, page_size): pages of 16 and of 1, a contiguous cache
      // with a scalar head; 3 sequences of `rows` new tokens each.
      for (auto [d, rd, ps] : {std::tuple{128, 0, 16}, std::tuple{64, 32, 1}, std::tuple{30, 0, 0}}) {
        FusedCase c;
        c.op = Op::kRopeAppend;
        c.dt = dt;
        c.rows = kind == TableKind::kFull ? 33 : 5;
        c.style = st;
        c.heads_q = 4;
        c.heads_k = 2;
        c.head_dim = d;
        c.rotary_dim = rd;
        c.page_size = ps;
        v.push_back(c);
      }
      // ... into an fp8 e4m3 cache: paged with the 16-byte path, and page_size 1 with partial
      // rotary (head dims whose strides are multiples of 16 codes, as CUDA requires of fp8 caches).
      for (auto [d, rd, ps] : {std::tuple{128, 0, 16}, std::tuple{64, 32, 1}}) {
        FusedCase c;
        c.op = Op::kRopeAppend;
        c.dt = dt;
        c.rows = kind == TableKind::kFull ? 33 : 5;
        c.style = st;
        c.head_dim = d;
        c.rotary_dim = rd;
        c.page_size = ps;
        c.fp8 = true;
        v.push_back(c);
      }
    }
  }
  return v;
}

/// Whether an e4m3 code is a nearest value of x (code units: the value divided by its scale),
/// saturating at +-448; `slack` (code units) covers an fp32 rotation against the fp64 truth.
bool nearest_e4m3(std::uint8_t code, double x, double slack) {
  if (std::isnan(x)) return (code & 0x7f) == 0x7f;
  const double y = std::clamp(x, -448.0, 448.0), a = std::fabs(y);
  const double ulp = a < 0x1p-6 ? 0x1p-9 : std::ldexp(1.0, std::ilogb(a) - 3);
  const float got = fp8e4m3_bits_to_float(code);
  return !std::isnan(got) && std::fabs(got - y) <= 0.5 * ulp + slack;
}

/// The fp64 rotation of one row in place (fused.h), theta 10000, from the (rounded) inputs.
void rotate_ref(double* x, int rot, RopeStyle style, std::int32_t pos) {
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const double a = pos * std::pow(10000.0, -2.0 * i / rot);
    const double cs = std::cos(a), sn = std::sin(a);
    const int ia = style == RopeStyle::kNeox ? i : 2 * i;
    const int ib = style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    const double a0 = x[ia], b0 = x[ib];
    x[ia] = a0 * cs - b0 * sn;
    x[ib] = b0 * cs + a0 * sn;
  }
}

double half_ulp(DType dt) {
  return dt == DType::kBF16 ? std::ldexp(1.0, -8) : dt == DType::kF16 ? std::ldexp(1.0, -11) : 0.0;
}

void fill(std::uint8_t* p, DType dt, std::int64_t n, std::mt19937_64& rng, float sd) {
  std::normal_distribution<float> nd(0.f, sd);
  for (std::int64_t i = 0; i < n; ++i) store_from_float(p, dt, i, nd(rng));
}

void run_fused_case(const FusedCase& c, const RunConfig& cfg, CaseResult* r) {
  const DType dt = c.dt;
  const std::size_t es = dtype_size(dt);
  std::mt19937_64 rng(r->seed);
  BufferSpace sp;
  RunOptions ro;
  ro.backend = cfg.backend == Backend::kCuda ? Backend::kCuda : Backend::kCpu;
  ro.cpu_threads = cfg.cpu_threads;
  r->kernel = fmt::format("{}_{}", cfg.backend == Backend::kCuda ? "cuda" : "cpu", c.op_name());
  r->reference = "cpu_fp64";
  std::vector<double> ref;  // expected output, in the output's element order
  std::int64_t n_out = 0;
  int iout = -1, ires = -1;
  std::vector<float> h_model;  // fused_add_rms_norm: the residual_out model
  std::vector<float> gathered;  // rope_append_kv: the written elements (q_out, then K and V rows)
  std::function<std::int64_t()> gather;  // rope_append_kv: fills `gathered`, returns bytes changed elsewhere
  std::function<void(CaseResult*)> fp8_check;  // rope_append_kv, fp8 cache: the codes' verdict (after gather)
  Status st;
  double ms = NAN;
  auto timed = [&](auto&& f) {
    const auto t0 = Clock::now();
    Status s = f();
#if FLASHCPP_WITH_CUDA
    if (s.ok() && cfg.backend == Backend::kCuda && cudaDeviceSynchronize() != cudaSuccess)
      s = Status::Cuda(cudaGetErrorString(cudaGetLastError()));
#endif
    ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    return s;
  };

  if (c.op == Op::kRmsNorm || c.op == Op::kAddRmsNorm) {
    const bool add = c.op == Op::kAddRmsNorm;
    const std::int64_t n = c.rows * c.hidden;
    const int ix = sp.add(n * es, false), iw = sp.add(c.hidden * es, false);
    const int irin = add ? sp.add(n * es, false) : -1;
    iout = sp.add(n * es, true);
    ires = add ? sp.add(n * es, true) : -1;
    fill(sp.host(ix), dt, n, rng, 2.f);
    fill(sp.host(iw), dt, c.hidden, rng, 1.f);
    if (add) fill(sp.host(irin), dt, n, rng, 2.f);
    const float eps = 1e-5f;
    // fp64 truth from the (rounded) inputs.
    ref.resize(static_cast<std::size_t>(n));
    h_model.resize(static_cast<std::size_t>(n));
    for (std::int64_t row = 0; row < c.rows; ++row) {
      double ss = 0;
      for (std::int64_t j = 0; j < c.hidden; ++j) {
        const std::int64_t i = row * c.hidden + j;
        const float x = load_as_float(sp.host(ix), dt, i);
        // h = round_T(fp32 sum), as fused.h defines it.
        const double h = add ? round_to_dtype(dt, x + load_as_float(sp.host(irin), dt, i)) : x;
        h_model[static_cast<std::size_t>(i)] = static_cast<float>(h);
        ss += h * h;
      }
      const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(c.hidden) + static_cast<double>(eps));
      for (std::int64_t j = 0; j < c.hidden; ++j)
        ref[static_cast<std::size_t>(row * c.hidden + j)] =
            h_model[static_cast<std::size_t>(row * c.hidden + j)] * rstd * load_as_float(sp.host(iw), dt, j);
    }
    st = sp.materialize(cfg.backend);
    if (st.ok()) {
      RmsNormParams p;
      p.rows = c.rows;
      p.hidden = c.hidden;
      p.eps = eps;
      p.x = contiguous_matrix(sp.ptr(ix), dt, c.hidden);
      p.weight = sp.ptr(iw);
      p.y = contiguous_matrix(sp.ptr(iout), dt, c.hidden);
      if (add) {
        p.residual = contiguous_matrix(sp.ptr(irin), dt, c.hidden);
        p.residual_out = contiguous_matrix(sp.ptr(ires), dt, c.hidden);
      }
      st = timed([&] { return add ? fused_add_rms_norm(p, ro) : rms_norm(p, ro); });
    }
    n_out = n;
  } else if (c.op == Op::kSilu || c.op == Op::kSiluFused) {
    const bool fused = c.op == Op::kSiluFused;
    const std::int64_t d = c.hidden, n = c.rows * d;
    const int ix = sp.add((fused ? 2 * n : n) * es, false), iu = fused ? -1 : sp.add(n * es, false);
    iout = sp.add(n * es, true);
    fill(sp.host(ix), dt, fused ? 2 * n : n, rng, 3.f);
    if (!fused) fill(sp.host(iu), dt, n, rng, 3.f);
    ref.resize(static_cast<std::size_t>(n));
    for (std::int64_t row = 0; row < c.rows; ++row)
      for (std::int64_t j = 0; j < d; ++j) {
        const double g = fused ? load_as_float(sp.host(ix), dt, row * 2 * d + j) : load_as_float(sp.host(ix), dt, row * d + j);
        const double u = fused ? load_as_float(sp.host(ix), dt, row * 2 * d + d + j) : load_as_float(sp.host(iu), dt, row * d + j);
        ref[static_cast<std::size_t>(row * d + j)] = g / (1.0 + std::exp(-g)) * u;
      }
    st = sp.materialize(cfg.backend);
    if (st.ok()) {
      SiluMulParams p;
      const MatrixView out = contiguous_matrix(sp.ptr(iout), dt, d);
      if (fused) {
        p = SiluMulParams::from_fused(sp.ptr(ix), dt, c.rows, d, 2 * d, out);
      } else {
        p.rows = c.rows;
        p.d = d;
        p.gate = contiguous_matrix(sp.ptr(ix), dt, d);
        p.up = contiguous_matrix(sp.ptr(iu), dt, d);
        p.out = out;
      }
      st = timed([&] { return silu_and_mul(p, ro); });
    }
    n_out = n;
  } else if (c.op == Op::kQkNormRope) {
    // q (tokens, heads_q, d), k (tokens, heads_k, d), out of place into one buffer. Reference:
    // n = round_T(x * rstd * (offset + w)) with rstd in fp64, then the fp64 rotation of n. The
    // kernels form rstd in fp32, so a normed value can round to the neighbouring T: the tolerance
    // adds that one ulp of n (2 h_T |n|, at most the case's largest |n|) to the usual rule.
    const int d = c.head_dim, rot = c.rotary_dim ? c.rotary_dim : d;
    const std::int64_t t = c.rows, nq = t * c.heads_q * d, nk = t * c.heads_k * d;
    const int iq = sp.add(nq * es, false), ik = sp.add(nk * es, false);
    const int iwq = sp.add(d * es, false), iwk = sp.add(d * es, false);
    const int ipos = sp.add(static_cast<std::size_t>(t) * sizeof(std::int32_t), false);
    iout = sp.add((nq + nk) * es, true);
    fill(sp.host(iq), dt, nq, rng, 2.f);
    fill(sp.host(ik), dt, nk, rng, 2.f);
    std::normal_distribution<float> wd(c.weight_offset != 0.f ? 0.f : 1.f, 0.2f);  // Qwen3 ~1, Gemma3 ~0
    for (int j = 0; j < d; ++j) {
      store_from_float(sp.host(iwq), dt, j, wd(rng));
      store_from_float(sp.host(iwk), dt, j, wd(rng));
    }
    std::vector<std::int32_t> pos(static_cast<std::size_t>(t));
    std::uniform_int_distribution<std::int32_t> pd(0, 32767);
    for (auto& x : pos) x = pd(rng);
    std::memcpy(sp.host(ipos), pos.data(), pos.size() * sizeof(std::int32_t));
    const float eps = 1e-6f;
    ref.resize(static_cast<std::size_t>(nq + nk));
    double nmax = 0;
    for (int w = 0; w < 2; ++w) {
      const int heads = w == 0 ? c.heads_q : c.heads_k;
      const std::uint8_t* in = sp.host(w == 0 ? iq : ik);
      const std::uint8_t* wt = sp.host(w == 0 ? iwq : iwk);
      double* out = ref.data() + (w == 0 ? 0 : nq);
      for (std::int64_t tok = 0; tok < t; ++tok)
        for (int h = 0; h < heads; ++h) {
          const std::int64_t base = (tok * heads + h) * d;
          double ss = 0;
          for (int j = 0; j < d; ++j) ss += static_cast<double>(load_as_float(in, dt, base + j)) * load_as_float(in, dt, base + j);
          const double rstd = 1.0 / std::sqrt(ss / d + static_cast<double>(eps));
          for (int j = 0; j < d; ++j) {
            const double wf = c.weight_offset + static_cast<double>(load_as_float(wt, dt, j));
            out[base + j] = round_to_dtype(dt, static_cast<float>(load_as_float(in, dt, base + j) * rstd * wf));
            nmax = std::max(nmax, std::fabs(out[base + j]));
          }
          rotate_ref(out + base, rot, c.style, pos[static_cast<std::size_t>(tok)]);
        }
    }
    r->tol.atol += 2 * half_ulp(dt) * nmax;
    r->effective_atol = r->tol.atol;
    st = sp.materialize(cfg.backend);
    if (st.ok()) {
      QkNormRopeParams p;
      p.batch = 1;
      p.seqlen = static_cast<int>(t);
      p.heads_q = c.heads_q;
      p.heads_k = c.heads_k;
      p.head_dim = d;
      p.eps = eps;
      p.weight_offset = c.weight_offset;
      p.rotary.rotary_dim = c.rotary_dim;
      p.rotary.style = c.style;
      p.q = bshd_view(sp.ptr(iq), dt, p.seqlen, c.heads_q, d);
      p.k = bshd_view(sp.ptr(ik), dt, p.seqlen, c.heads_k, d);
      p.q_out = bshd_view(sp.ptr(iout), dt, p.seqlen, c.heads_q, d);
      p.k_out = bshd_view(static_cast<std::uint8_t*>(sp.ptr(iout)) + nq * es, dt, p.seqlen, c.heads_k, d);
      p.q_weight = sp.ptr(iwq);
      p.k_weight = sp.ptr(iwk);
      p.positions = static_cast<const std::int32_t*>(sp.ptr(ipos));
      st = timed([&] { return qk_norm_rope(p, ro); });
    }
    n_out = nq + nk;
  } else if (c.op == Op::kRopeAppend) {
    // 3 sequences of `rows` new tokens each into a poisoned cache (every byte 0xFF) at random
    // lengths, pages in a shuffled order; explicit positions (slot + 1000). Compared: q_out, and
    // the K (rotated) and V (bit for bit) rows of every written slot; any other cache byte that
    // changed counts as written outside the output.
    const int d = c.head_dim, rot = c.rotary_dim ? c.rotary_dim : d, hq = c.heads_q, hkv = c.heads_k;
    const DType cdt = c.fp8 ? DType::kF8E4M3 : dt;  // the cache's
    const std::size_t ces = dtype_size(cdt);
    const int batch = 3, sn = static_cast<int>(c.rows);
    const int ps = c.page_size, capacity = sn + 11;
    const int pages_per_seq = ps ? (capacity + ps - 1) / ps : 0;
    const int num_pages = ps ? batch * pages_per_seq + 1 : 0;
    const int slots = ps ? pages_per_seq * ps : capacity;
    const std::int64_t tok = static_cast<std::int64_t>(batch) * sn, nq = tok * hq * d, nkv = tok * hkv * d;
    const std::int64_t cache_elems = static_cast<std::int64_t>(ps ? num_pages * ps : batch * capacity) * hkv * d;
    const int iq = sp.add(nq * es, false), ikn = sp.add(nkv * es, false), ivn = sp.add(nkv * es, false);
    const int ilen = sp.add(batch * sizeof(std::int32_t), false);
    const int ipos = sp.add(static_cast<std::size_t>(tok) * sizeof(std::int32_t), false);
    const int ibt = ps ? sp.add(static_cast<std::size_t>(batch) * pages_per_seq * sizeof(std::int32_t), false) : -1;
    iout = sp.add(nq * es, true);
    const int ikc = sp.add(cache_elems * ces, true), ivc = sp.add(cache_elems * ces, true);
    const int iks = c.fp8 ? sp.add(hkv * sizeof(float), false) : -1, ivs = c.fp8 ? sp.add(hkv * sizeof(float), false) : -1;
    std::vector<float> scale_k(static_cast<std::size_t>(hkv), 1.f), scale_v = scale_k;
    if (c.fp8) {
      std::uniform_real_distribution<float> ex(-8.f, 0.f);
      for (auto* sv : {&scale_k, &scale_v})
        for (auto& x : *sv) x = std::exp2(ex(rng));
      std::memcpy(sp.host(iks), scale_k.data(), scale_k.size() * sizeof(float));
      std::memcpy(sp.host(ivs), scale_v.data(), scale_v.size() * sizeof(float));
    }
    fill(sp.host(iq), dt, nq, rng, 1.f);
    fill(sp.host(ikn), dt, nkv, rng, 1.f);
    fill(sp.host(ivn), dt, nkv, rng, 1.f);
    std::vector<std::int32_t> len(batch), pos(static_cast<std::size_t>(tok)), bt;
    std::uniform_int_distribution<int> ld(0, slots - sn);
    for (auto& x : len) x = ld(rng);
    for (int b = 0; b < batch; ++b)
      for (int s = 0; s < sn; ++s) pos[static_cast<std::size_t>(b * sn + s)] = len[b] + s + 1000;
    if (ps) {
      std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages));
      for (int i = 0; i < num_pages; ++i) perm[i] = i;
      std::shuffle(perm.begin(), perm.end(), rng);
      bt.assign(perm.begin(), perm.begin() + batch * pages_per_seq);
      std::memcpy(sp.host(ibt), bt.data(), bt.size() * sizeof(std::int32_t));
    }
    std::memcpy(sp.host(ilen), len.data(), len.size() * sizeof(std::int32_t));
    std::memcpy(sp.host(ipos), pos.data(), pos.size() * sizeof(std::int32_t));
    // Element offset of (sequence b, slot j, head h) in the cache.
    auto cache_at = [=](int b, int j, int h) -> std::int64_t {
      const std::int64_t block = ps ? bt[static_cast<std::size_t>(b * pages_per_seq + j / ps)] : b;
      const std::int64_t row = ps ? j % ps : j;
      return ((block * (ps ? ps : capacity) + row) * hkv + h) * d;
    };
    // Reference, in the gathered order: q_out (tokens, hq, d), then per (token, KV head) K then V.
    ref.resize(static_cast<std::size_t>(nq + 2 * nkv));
    std::vector<double> row(static_cast<std::size_t>(d));
    for (std::int64_t i = 0; i < tok; ++i) {
      for (int h = 0; h < hq; ++h) {
        for (int j = 0; j < d; ++j) row[j] = load_as_float(sp.host(iq), dt, (i * hq + h) * d + j);
        rotate_ref(row.data(), rot, c.style, pos[static_cast<std::size_t>(i)]);
        std::copy(row.begin(), row.end(), ref.begin() + (i * hq + h) * d);
      }
      for (int h = 0; h < hkv; ++h) {
        for (int j = 0; j < d; ++j) row[j] = load_as_float(sp.host(ikn), dt, (i * hkv + h) * d + j);
        rotate_ref(row.data(), rot, c.style, pos[static_cast<std::size_t>(i)]);
        const std::int64_t at = nq + (i * hkv + h) * 2 * d;
        std::copy(row.begin(), row.end(), ref.begin() + at);
        for (int j = 0; j < d; ++j) ref[static_cast<std::size_t>(at + d + j)] = load_as_float(sp.host(ivn), dt, (i * hkv + h) * d + j);
      }
    }
    // fp8: every written code against the fp64 truth in code units (nearest_e4m3), counted in
    // fp8_bad with the first one described in fp8_msg; only q_out goes through the error statistics.
    auto fp8_bad = std::make_shared<std::int64_t>(0);
    auto fp8_msg = std::make_shared<std::string>();
    gather = [&sp, &gathered, &ref, cache_at, cache_elems, ces, dt, cdt, iout, ikc, ivc, nq, nkv, tok, hq, hkv, d, sn, len,
              fp8 = c.fp8, scale_k, scale_v, fp8_bad, fp8_msg] {
      gathered.assign(static_cast<std::size_t>(fp8 ? nq : nq + 2 * nkv), 0.f);
      for (std::int64_t i = 0; i < nq; ++i) gathered[static_cast<std::size_t>(i)] = load_as_float(sp.host(iout), dt, i);
      std::vector<char> written(static_cast<std::size_t>(cache_elems), 0);
      for (std::int64_t i = 0; i < tok; ++i) {
        const int b = static_cast<int>(i / sn), s = static_cast<int>(i % sn);
        for (int h = 0; h < hkv; ++h) {
          const std::int64_t at = cache_at(b, len[b] + s, h), g = nq + (i * hkv + h) * 2 * d;
          for (int j = 0; j < d; ++j) {
            written[static_cast<std::size_t>(at + j)] = 1;
            if (!fp8) {
              gathered[static_cast<std::size_t>(g + j)] = load_as_float(sp.host(ikc), cdt, at + j);
              gathered[static_cast<std::size_t>(g + d + j)] = load_as_float(sp.host(ivc), cdt, at + j);
              continue;
            }
            for (int w = 0; w < 2; ++w) {  // K, then V
              const std::uint8_t code = sp.host(w == 0 ? ikc : ivc)[at + j];
              const double scale = (w == 0 ? scale_k : scale_v)[static_cast<std::size_t>(h)];
              double row_max = 0;
              for (int e = 0; e < d; ++e) row_max = std::max(row_max, std::fabs(ref[static_cast<std::size_t>(g + w * d + e)]));
              const double x = ref[static_cast<std::size_t>(g + w * d + j)] / scale;
              if (!nearest_e4m3(code, x, 2e-6 * row_max / scale) && (*fp8_bad)++ == 0)
                *fp8_msg = fmt::format("{} code 0x{:02x} ({}) of token {} head {} dim {} is not a nearest e4m3 value of {:.8g}",
                                       w == 0 ? "K" : "V", code, fp8e4m3_bits_to_float(code), i, h, j, x);
            }
          }
        }
      }
      std::int64_t changed = sp.guard_violations(ikc) + sp.guard_violations(ivc);
      for (std::int64_t e = 0; e < cache_elems; ++e)
        if (!written[static_cast<std::size_t>(e)])
          for (std::size_t k = 0; k < ces; ++k)
            changed += (sp.host(ikc)[e * ces + k] != 0xFF) + (sp.host(ivc)[e * ces + k] != 0xFF);
      return changed;
    };
    fp8_check = [fp8_bad, fp8_msg](CaseResult* res) {
      res->violations += *fp8_bad;
      if (*fp8_bad && res->message.empty()) res->message = fmt::format("{} fp8 code(s) off: {}", *fp8_bad, *fp8_msg);
    };
    st = sp.materialize(cfg.backend);
    if (st.ok()) {
      RopeAppendParams p;
      p.batch = batch;
      p.seqlen = sn;
      p.heads_q = hq;
      p.heads_kv = hkv;
      p.head_dim = d;
      p.rotary.rotary_dim = c.rotary_dim;
      p.rotary.style = c.style;
      p.q = bshd_view(sp.ptr(iq), dt, sn, hq, d);
      p.q_out = bshd_view(sp.ptr(iout), dt, sn, hq, d);
      p.k_new = bshd_view(sp.ptr(ikn), dt, sn, hkv, d);
      p.v_new = bshd_view(sp.ptr(ivn), dt, sn, hkv, d);
      p.cache.k = bshd_view(sp.ptr(ikc), cdt, ps ? ps : capacity, hkv, d);
      p.cache.v = bshd_view(sp.ptr(ivc), cdt, ps ? ps : capacity, hkv, d);
      if (c.fp8) {
        p.cache.k_scale = static_cast<const float*>(sp.ptr(iks));
        p.cache.v_scale = static_cast<const float*>(sp.ptr(ivs));
      }
      p.cache.capacity = ps ? 0 : capacity;
      p.cache.page_size = ps;
      p.cache.num_pages = num_pages;
      p.cache.pages_per_seq = pages_per_seq;
      p.cache.block_table_stride = pages_per_seq;
      p.cache.block_table = ps ? static_cast<const std::int32_t*>(sp.ptr(ibt)) : nullptr;
      p.cache_seqlens = static_cast<const std::int32_t*>(sp.ptr(ilen));
      p.positions = static_cast<const std::int32_t*>(sp.ptr(ipos));
      st = timed([&] { return rope_append_kv(p, ro); });
    }
    n_out = c.fp8 ? nq : nq + 2 * nkv;
  } else {  // rotary: q (tokens, heads_q, d) and k (tokens, heads_k, d), out of place
    const int d = c.head_dim, rot = c.rotary_dim ? c.rotary_dim : d, half = rot / 2;
    const std::int64_t t = c.rows, nq = t * c.heads_q * d, nk = t * c.heads_k * d;
    const int iq = sp.add(nq * es, false), ik = sp.add(nk * es, false);
    const int ipos = sp.add(static_cast<std::size_t>(t) * sizeof(std::int32_t), false);
    iout = sp.add((nq + nk) * es, true);  // q_out then k_out in one buffer
    fill(sp.host(iq), dt, nq, rng, 1.f);
    fill(sp.host(ik), dt, nk, rng, 1.f);
    std::vector<std::int32_t> pos(static_cast<std::size_t>(t));
    std::uniform_int_distribution<std::int32_t> pd(0, 32767);
    for (auto& x : pos) x = pd(rng);
    std::memcpy(sp.host(ipos), pos.data(), pos.size() * sizeof(std::int32_t));
    ref.resize(static_cast<std::size_t>(nq + nk));
    for (int w = 0; w < 2; ++w) {
      const int heads = w == 0 ? c.heads_q : c.heads_k;
      const std::uint8_t* in = sp.host(w == 0 ? iq : ik);
      double* out = ref.data() + (w == 0 ? 0 : nq);
      for (std::int64_t tok = 0; tok < t; ++tok)
        for (int h = 0; h < heads; ++h) {
          const std::int64_t base = (tok * heads + h) * d;
          for (int j = 0; j < d; ++j) out[base + j] = load_as_float(in, dt, base + j);
          for (int i = 0; i < half; ++i) {
            const double a = pos[static_cast<std::size_t>(tok)] * std::pow(10000.0, -2.0 * i / rot);
            const double cs = std::cos(a), sn = std::sin(a);
            const int ia = c.style == RopeStyle::kNeox ? i : 2 * i;
            const int ib = c.style == RopeStyle::kNeox ? i + half : 2 * i + 1;
            const double a0 = load_as_float(in, dt, base + ia), b0 = load_as_float(in, dt, base + ib);
            out[base + ia] = a0 * cs - b0 * sn;
            out[base + ib] = b0 * cs + a0 * sn;
          }
        }
    }
    st = sp.materialize(cfg.backend);
    if (st.ok()) {
      RopeParams p;
      p.batch = 1;
      p.seqlen = static_cast<int>(t);
      p.heads_q = c.heads_q;
      p.heads_k = c.heads_k;
      p.head_dim = d;
      p.rotary.rotary_dim = c.rotary_dim;
      p.rotary.style = c.style;
      p.q = bshd_view(sp.ptr(iq), dt, p.seqlen, c.heads_q, d);
      p.k = bshd_view(sp.ptr(ik), dt, p.seqlen, c.heads_k, d);
      p.q_out = bshd_view(sp.ptr(iout), dt, p.seqlen, c.heads_q, d);
      p.k_out = bshd_view(static_cast<std::uint8_t*>(sp.ptr(iout)) + nq * es, dt, p.seqlen, c.heads_k, d);
      p.positions = static_cast<const std::int32_t*>(sp.ptr(ipos));
      st = timed([&] { return apply_rotary(p, ro); });
    }
    n_out = nq + nk;
  }
  r->ms = ms;
  if (st.ok()) st = sp.fetch();
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
  r->guard_violations = sp.guard_violations(iout) + (ires >= 0 ? sp.guard_violations(ires) : 0);
  if (gather) r->guard_violations += gather();  // rope_append_kv: cache slots it must not write
  if (r->guard_violations)
    r->message = fmt::format("{} byte(s) written outside the output buffers", r->guard_violations);
  ErrorStats stats{dt, r->tol.atol, r->tol.rtol};
  HostTensor out(dt, n_out);
  if (gathered.empty())
    std::memcpy(out.data(), sp.host(iout), out.bytes.size());
  else
    for (std::int64_t i = 0; i < n_out; ++i) store_from_float(out.data(), dt, i, gathered[static_cast<std::size_t>(i)]);
  std::vector<float> no_lse;
  if (cfg.perturb_output) {
    Case pc;
    pc.batch = 1;
    pc.seqlen_q = static_cast<int>(c.rows);
    pc.dtype = dt;
    pc.return_lse = false;
    cfg.perturb_output(pc, out, no_lse);
  }
  const std::int64_t row_len = c.op == Op::kRotary || c.op == Op::kQkNormRope || c.op == Op::kRopeAppend ? c.head_dim : c.hidden;
  for (std::int64_t i = 0; i < n_out; ++i) {
    stats.add(r, out.get(i), ref[static_cast<std::size_t>(i)],
              [&] { return fmt::format("out[row={},j={}]", i / row_len, i % row_len); });
    if ((i + 1) % row_len == 0) stats.end_row();
  }
  stats.finish(r);
  if (fp8_check) fp8_check(r);
  if (ires >= 0) {  // residual_out must be round_T(x + residual), bit for bit
    std::int64_t diff = 0;
    for (std::int64_t i = 0; i < n_out; ++i) {
      const float got = load_as_float(sp.host(ires), dt, i), want = h_model[static_cast<std::size_t>(i)];
      if (!(got == want) && diff++ == 0 && r->message.empty())
        r->message = fmt::format("residual_out[row={},j={}] = {:.8g} vs round(x + residual) = {:.8g}", i / c.hidden,
                                 i % c.hidden, got, want);
    }
    r->violations += diff;
  }
  const bool ok = r->nan_count == 0 && r->guard_violations == 0 && r->violations == 0;
  r->status = ok ? CaseStatus::kPass : CaseStatus::kFail;
}

}  // namespace

std::vector<AreaCase> make_fused_table(TableKind kind, Backend /*backend*/) {
  std::vector<AreaCase> table;
  for (const FusedCase& c : fused_cases(kind)) {
    table.push_back({c.name(), [c](const RunConfig& cfg) {
                       CaseResult r;
                       r.area = "fused";
                       r.name = c.name();
                       r.seed = case_seed(cfg.seed, r.name);
                       r.c.batch = 1;
                       r.c.seqlen_q = static_cast<int>(c.rows);
                       r.c.seqlen_k = 0;
                       const bool heads = c.op == Op::kRotary || c.op == Op::kQkNormRope || c.op == Op::kRopeAppend;
                       r.c.heads_q = heads ? c.heads_q : 1;
                       r.c.heads_kv = heads ? c.heads_k : 1;
                       r.c.head_dim = static_cast<int>(heads ? c.head_dim : c.hidden);
                       r.c.dtype = c.dt;
                       r.c.return_lse = false;
                       r.tol.atol = 1e-3;
                       r.tol.rtol = 1e-3 + half_ulp(c.dt);
                       r.effective_atol = r.tol.atol;
                       run_guarded(&r, [&] { run_fused_case(c, cfg, &r); });
                       return r;
                     }});
  }
  return table;
}

}  // namespace flashcpp::harness
