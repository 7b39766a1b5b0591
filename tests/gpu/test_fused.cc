// GPU tests of the fused kernels (src/cuda/fused/) against fp64 references computed on the host
// from the same inputs, at the DESIGN sizes and odd ones, on every path (16-byte vectors,
// scalar, register row, two-pass), with misaligned and strided views. Every device buffer has
// guard elements around the view and is poisoned with NaN (0xFFFF) before the call: an element
// the kernel forgets to write stays NaN, and an element it writes outside the view (padding
// between rows, the guards) changes and fails the test.
//
// Tolerance as in tests/cpu/test_fused.cc: |out - ref| <= 1e-3 + 1e-3 |ref| + half an ulp of the
// output dtype at |ref|; the updated residual is compared bit for bit with round_T(x + r).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/fused/fused_launch.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "gpu_util.h"

#if FLASHCPP_HAS_FUSED
namespace flashcpp::testing {
namespace {

constexpr std::uint16_t kPoison = 0xFFFF;  // NaN in fp16 and bf16
constexpr std::int64_t kGuard = 64;        // elements before and after every view

double half_ulp(DType dt, double ref) {
  return std::ldexp(std::fabs(ref), dt == DType::kBF16 ? -8 : -11);
}

float round_to(DType dt, float v) {
  return dt == DType::kBF16 ? bf16_bits_to_float(float_to_bf16_bits(v)) : half_bits_to_float(float_to_half_bits(v));
}

std::uint16_t to_bits(DType dt, float v) { return dt == DType::kBF16 ? float_to_bf16_bits(v) : float_to_half_bits(v); }

/// A device buffer of 16-bit elements with kGuard poisoned elements on each side of `n` elements
/// that start `offset` elements after a 256-byte aligned address (offset 1 misaligns vectors).
struct Guarded {
  std::int64_t n, offset;
  DeviceBuffer buf;
  std::vector<std::uint16_t> host;  // the whole buffer, guards included
  Guarded(std::int64_t n_, std::int64_t offset_ = 0)
      : n(n_), offset(offset_), buf(static_cast<std::size_t>(n_ + 2 * kGuard + offset_) * 2),
        host(static_cast<std::size_t>(n_ + 2 * kGuard + offset_), kPoison) {}
  std::int64_t base() const { return kGuard + offset; }
  void* data() { return static_cast<std::uint16_t*>(buf.ptr) + base(); }
  std::uint16_t& at(std::int64_t i) { return host[static_cast<std::size_t>(base() + i)]; }
  float get(DType dt, std::int64_t i) const { return bits_to_float(host[static_cast<std::size_t>(base() + i)], dt); }
  void fill_random(DType dt, std::mt19937_64& g, float stddev = 1.f) {
    std::normal_distribution<float> d(0.f, stddev);
    for (std::int64_t i = 0; i < n; ++i) at(i) = to_bits(dt, d(g));
  }
  bool upload() { return cudaMemcpy(buf.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess; }
  bool download() { return cudaMemcpy(host.data(), buf.ptr, host.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess; }
  /// Elements outside the view (and outside `written`) that are not the poison any more.
  std::int64_t guards_changed() const {
    std::int64_t c = 0;
    for (std::int64_t i = 0; i < base(); ++i) c += host[static_cast<std::size_t>(i)] != kPoison;
    for (std::size_t i = static_cast<std::size_t>(base() + n); i < host.size(); ++i) c += host[i] != kPoison;
    return c;
  }
};

/// Host copy of a Guarded buffer's contents (the inputs before the call).
struct Snap {
  std::vector<std::uint16_t> host;
  std::int64_t base = 0;
  explicit Snap(const Guarded& g) : host(g.host), base(g.base()) {}
  std::uint16_t at(std::int64_t i) const { return host[static_cast<std::size_t>(base + i)]; }
  float get(DType dt, std::int64_t i) const { return bits_to_float(at(i), dt); }
};

struct Compare {
  DType dt;
  double max_abs = 0, worst_ratio = 0;
  std::int64_t bad = 0, nan = 0, n = 0, first_bad = -1;
  void add(std::int64_t idx, double got, double ref) {
    ++n;
    if (std::isnan(got) != std::isnan(ref)) {
      ++nan;
      if (first_bad < 0) first_bad = idx;
      return;
    }
    if (std::isnan(ref)) return;
    const double err = std::fabs(got - ref), tol = 1e-3 + 1e-3 * std::fabs(ref) + half_ulp(dt, ref);
    max_abs = std::max(max_abs, err);
    worst_ratio = std::max(worst_ratio, err / tol);
    if (err > tol) {
      ++bad;
      if (first_bad < 0) first_bad = idx;
    }
  }
  ::testing::AssertionResult ok() const {
    if (bad == 0 && nan == 0) return ::testing::AssertionSuccess() << "max abs err " << max_abs;
    return ::testing::AssertionFailure() << bad << " of " << n << " out of tolerance, " << nan
                                         << " NaN mismatches (first at " << first_bad << "), max abs err " << max_abs
                                         << ", worst err/tol " << worst_ratio;
  }
};

RunOptions cuda_opt(const std::string& config, Stream stream = nullptr) {
  RunOptions o;
  o.backend = Backend::kCuda;
  o.cuda_config = config;
  o.stream = stream;
  return o;
}

// ---- RMSNorm -----------------------------------------------------------------------------

struct NormCase {
  std::int64_t rows, hidden;
  DType dt = DType::kBF16;
  bool residual = true;
  std::int64_t pad = 0;       // row_stride = hidden + pad
  std::int64_t misalign = 0;  // element offset of every tensor from a 16-byte boundary
  bool in_place = false;
  std::string config;  // "", "scalar", "two_pass", "scalar,two_pass", "slots2", "persistent", ...
};

std::string describe(const NormCase& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.hidden) + " " + dtype_name(c.dt) +
         (c.residual ? " +res" : "") + " pad" + std::to_string(c.pad) + " mis" + std::to_string(c.misalign) +
         (c.in_place ? " in-place" : "") + " cfg '" + c.config + "'";
}

void run_norm(const NormCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const std::int64_t ld = c.hidden + c.pad, n = (c.rows - 1) * ld + c.hidden;
  Guarded x(n, c.misalign), r(n, c.misalign), ro(n, c.misalign), y(n, c.misalign), w(c.hidden, c.misalign);
  x.fill_random(c.dt, g, 2.f);
  r.fill_random(c.dt, g, 2.f);
  w.fill_random(c.dt, g);
  const Snap x0h(x), r0h(r);
  ASSERT_TRUE(x.upload() && r.upload() && ro.upload() && y.upload() && w.upload());
  RmsNormParams p;
  p.rows = c.rows;
  p.hidden = c.hidden;
  p.eps = 1e-6f;
  p.x = MatrixView{x.data(), c.dt, ld};
  p.y = c.in_place ? p.x : MatrixView{y.data(), c.dt, ld};
  p.weight = w.data();
  if (c.residual) {
    p.residual = MatrixView{r.data(), c.dt, ld};
    p.residual_out = c.in_place ? p.residual : MatrixView{ro.data(), c.dt, ld};
  }
  const RunOptions opt = cuda_opt(c.config);
  const Status st = c.residual ? fused_add_rms_norm(p, opt) : rms_norm(p, opt);
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(x.download() && r.download() && ro.download() && y.download());
  Guarded& yb = c.in_place ? x : y;
  Guarded& hb = c.in_place ? r : ro;
  Compare cmp{c.dt};
  std::int64_t h_bad = 0;
  std::vector<double> h(static_cast<std::size_t>(c.hidden));
  for (std::int64_t row = 0; row < c.rows; ++row) {
    double ss = 0;
    for (std::int64_t j = 0; j < c.hidden; ++j) {
      const std::int64_t i = row * ld + j;
      h[j] = c.residual ? round_to(c.dt, x0h.get(c.dt, i) + r0h.get(c.dt, i)) : x0h.get(c.dt, i);
      ss += h[j] * h[j];
      if (c.residual && hb.get(c.dt, i) != static_cast<float>(h[j])) ++h_bad;
    }
    const double rstd = 1.0 / std::sqrt(ss / c.hidden + 1e-6);
    for (std::int64_t j = 0; j < c.hidden; ++j) cmp.add(row * ld + j, yb.get(c.dt, row * ld + j), h[j] * rstd * w.get(c.dt, j));
  }
  EXPECT_TRUE(cmp.ok());
  EXPECT_EQ(h_bad, 0) << "residual_out differs from round(x + residual)";
  if (!c.in_place) {
    EXPECT_EQ(y.guards_changed(), 0);
    if (c.residual) EXPECT_EQ(ro.guards_changed(), 0);
    std::int64_t pad_written = 0;
    for (std::int64_t row = 0; row + 1 < c.rows; ++row)
      for (std::int64_t j = c.hidden; j < ld; ++j) pad_written += y.at(row * ld + j) != kPoison;
    EXPECT_EQ(pad_written, 0);
  }
}

TEST(FusedGpuRmsNorm, DesignSizeEveryPath) {
  std::uint64_t salt = 1;
  for (const char* cfg : {"", "two_pass", "scalar", "scalar,two_pass", "slots1", "slots2", "slots4", "persistent", "stream",
                          "stream,stages2", "stream,stages3", "stream,stages4,streaming"})
    run_norm({8192, 4096, DType::kBF16, true, 0, 0, false, cfg}, salt++);
  run_norm({8192, 4096, DType::kF16, true}, salt++);
  run_norm({8192, 4096, DType::kBF16, false}, salt++);
}

TEST(FusedGpuRmsNorm, OddSizes) {
  std::uint64_t salt = 100;
  // {3, 264}: 33 vectors, the shortest row past one warp; {7, 16384}: 2048 vectors; {1000, 1000}:
  // 125 vectors, a part-filled block; {5, 4088}: 511 vectors, a row the stream kernel takes.
  const std::int64_t shapes[][2] = {{1, 1},   {3, 8},     {5, 127},  {17, 4097},   {7, 128},    {1000, 64},
                                    {33, 8192}, {4, 8193}, {2, 20000}, {3, 24},     {9, 40},     {3, 264},
                                    {7, 16384}, {1000, 1000}, {5, 4088}};
  for (DType dt : {DType::kBF16, DType::kF16})
    for (const auto& s : shapes)
      for (bool res : {false, true})
        for (const char* cfg : {"", "slots1", "slots2", "persistent", "stream"}) run_norm({s[0], s[1], dt, res, 0, 0, false, cfg}, salt++);
}

TEST(FusedGpuRmsNorm, StridedMisalignedInPlace) {
  std::uint64_t salt = 300;
  run_norm({64, 4096, DType::kBF16, true, 8}, salt++);     // aligned padding: vector path
  run_norm({64, 4096, DType::kBF16, true, 3}, salt++);     // odd row stride: scalar path
  run_norm({64, 4096, DType::kBF16, true, 0, 1}, salt++);  // pointers 2 bytes off
  run_norm({64, 1000, DType::kF16, false, 5, 3}, salt++);
  run_norm({64, 4096, DType::kBF16, true, 0, 0, true}, salt++);  // y == x, residual_out == residual
  run_norm({64, 4097, DType::kBF16, true, 0, 0, true, "two_pass"}, salt++);
  run_norm({5000, 4096, DType::kBF16, true, 0, 0, true, "persistent"}, salt++);  // rows > blocks: the loop and prefetch
  run_norm({64, 12000, DType::kF16, false, 16, 0, true}, salt++);
  // The stream kernel: a part-filled last vector (4092 = 511 * 8 + 4) beside padding, in place with
  // more rows than the resident grid (each block walks ~40 rows through its stages), the shortest
  // rows it takes (257 vectors: 96 threads), and fp16.
  run_norm({64, 4092, DType::kBF16, true, 4, 0, false, "stream"}, salt++);
  run_norm({40000, 4096, DType::kBF16, true, 0, 0, true, "stream"}, salt++);
  run_norm({40000, 2056, DType::kF16, false, 0, 0, true, "stream,stages2"}, salt++);
  run_norm({9000, 4092, DType::kF16, true, 12, 0, false, "stream,stages3"}, salt++);
  run_norm({1000, 4096, DType::kBF16, false}, salt++);  // plain rows of 512 vectors: the stream kernel by default
}

// ---- SwiGLU ------------------------------------------------------------------------------

struct SiluCase {
  std::int64_t rows, d;
  DType dt = DType::kBF16;
  bool fused = true;
  std::int64_t misalign = 0;
  bool in_place = false;  // out = gate
  std::string config;
};

void run_silu(const SiluCase& c, std::uint64_t salt) {
  SCOPED_TRACE(std::to_string(c.rows) + "x" + std::to_string(c.d) + " " + dtype_name(c.dt) +
               (c.fused ? " fused" : " two") + " mis" + std::to_string(c.misalign) + (c.in_place ? " in-place" : "") +
               " cfg '" + c.config + "'");
  std::mt19937_64 g(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const std::int64_t nin = c.rows * c.d;
  Guarded x(c.fused ? 2 * nin : 0, c.misalign), gate(c.fused ? 0 : nin, c.misalign), up(c.fused ? 0 : nin, c.misalign);
  Guarded out(nin, c.misalign);
  x.fill_random(c.dt, g, 3.f);
  gate.fill_random(c.dt, g, 3.f);
  up.fill_random(c.dt, g, 3.f);
  const Snap x0(x), g0(gate), u0(up);
  ASSERT_TRUE(x.upload() && gate.upload() && up.upload() && out.upload());
  SiluMulParams p;
  if (c.fused) {
    const MatrixView o = c.in_place ? MatrixView{x.data(), c.dt, 2 * c.d} : contiguous_matrix(out.data(), c.dt, c.d);
    p = SiluMulParams::from_fused(x.data(), c.dt, c.rows, c.d, 2 * c.d, o);
  } else {
    p.rows = c.rows;
    p.d = c.d;
    p.gate = contiguous_matrix(gate.data(), c.dt, c.d);
    p.up = contiguous_matrix(up.data(), c.dt, c.d);
    p.out = c.in_place ? p.gate : contiguous_matrix(out.data(), c.dt, c.d);
  }
  const Status st = silu_and_mul(p, cuda_opt(c.config));
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(x.download() && gate.download() && out.download());
  Compare cmp{c.dt};
  std::int64_t up_changed = 0;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t j = 0; j < c.d; ++j) {
      const double gv = c.fused ? x0.get(c.dt, r * 2 * c.d + j) : g0.get(c.dt, r * c.d + j);
      const double uv = c.fused ? x0.get(c.dt, r * 2 * c.d + c.d + j) : u0.get(c.dt, r * c.d + j);
      double got;
      if (c.in_place) got = c.fused ? x.get(c.dt, r * 2 * c.d + j) : gate.get(c.dt, r * c.d + j);
      else got = out.get(c.dt, r * c.d + j);
      cmp.add(r * c.d + j, got, gv / (1.0 + std::exp(-gv)) * uv);
      if (c.fused) up_changed += x.at(r * 2 * c.d + c.d + j) != x0.at(r * 2 * c.d + c.d + j);
    }
  EXPECT_TRUE(cmp.ok());
  EXPECT_EQ(up_changed, 0);
  if (!c.in_place) EXPECT_EQ(out.guards_changed(), 0);
}

TEST(FusedGpuSwiglu, DesignSizeBothForms) {
  run_silu({8192, 14336, DType::kBF16, true}, 1);
  run_silu({8192, 14336, DType::kBF16, false}, 2);
  run_silu({8192, 14336, DType::kF16, true, 0, false, "scalar"}, 3);
}

TEST(FusedGpuSwiglu, OddSizesMisalignedInPlace) {
  std::uint64_t salt = 100;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (std::int64_t d : {1, 8, 13, 4097, 14336})
      for (bool fused : {false, true}) run_silu({5, d, dt, fused}, salt++);
  run_silu({70000, 8, DType::kBF16, true}, salt++);  // more rows than gridDim.y: grid-stride
  run_silu({64, 4096, DType::kBF16, false, 1}, salt++);
  run_silu({64, 4096, DType::kBF16, true, 0, true}, salt++);
  run_silu({64, 4100, DType::kF16, false, 0, true}, salt++);
}

// ---- rotary ------------------------------------------------------------------------------

struct RopeCase {
  int batch = 4, seqlen = 4096, hq = 32, hk = 0, head_dim = 128, rot = 0;
  RopeStyle style = RopeStyle::kNeox;
  DType dt = DType::kBF16;
  bool positions = false;
  int max_pos = 131072;
  bool out_of_place = false;
  bool packed_qkv = false;
  bool cache = false;
  bool out_of_range = false;  // with a cache: make some positions invalid (expect NaN)
  Llama3Scaling llama3{};
  double theta = 10000.0;
  std::int64_t misalign = 0;
  std::string config;
};

std::string describe(const RopeCase& c) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seqlen) + " hq" + std::to_string(c.hq) + " hk" +
         std::to_string(c.hk) + " d" + std::to_string(c.head_dim) + " rot" + std::to_string(c.rot) + " " +
         rope_style_name(c.style) + " " + dtype_name(c.dt) + (c.positions ? " pos" : " arange") +
         (c.out_of_place ? " out" : "") + (c.packed_qkv ? " qkv" : "") + (c.cache ? " cache" : "") +
         (c.llama3.enabled() ? " llama3" : "") + " mis" + std::to_string(c.misalign) + " cfg '" + c.config + "'";
}

double inv_freq_direct(int i, int rot, double theta, const Llama3Scaling& s) {
  double f = 1.0 / std::pow(theta, 2.0 * i / rot);
  if (!s.enabled()) return f;
  const double pi = 3.14159265358979323846, wavelen = 2 * pi / f;
  const double low = s.original_max_position / static_cast<double>(s.low_freq_factor);
  const double high = s.original_max_position / static_cast<double>(s.high_freq_factor);
  if (wavelen < high) return f;
  if (wavelen > low) return f / s.factor;
  const double a = (s.original_max_position / wavelen - s.low_freq_factor) /
                   (static_cast<double>(s.high_freq_factor) - s.low_freq_factor);
  return (1 - a) * f / s.factor + a * f;
}

void run_rope(const RopeCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const int d = c.head_dim, rot = c.rot ? c.rot : d, half = rot / 2;
  const std::int64_t tokens = static_cast<std::int64_t>(c.batch) * c.seqlen;
  const int hqkv = c.hq + 2 * c.hk;
  Guarded qkv(c.packed_qkv ? tokens * hqkv * d : 0, c.misalign);
  Guarded q(c.packed_qkv ? 0 : tokens * c.hq * d, c.misalign), k(c.packed_qkv ? 0 : tokens * c.hk * d, c.misalign);
  Guarded qo(c.out_of_place ? tokens * c.hq * d : 0, c.misalign), ko(c.out_of_place ? tokens * c.hk * d : 0, c.misalign);
  qkv.fill_random(c.dt, g);
  q.fill_random(c.dt, g);
  k.fill_random(c.dt, g);
  const Snap qkv0(qkv), q0(q), k0(k);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens));
  std::uniform_int_distribution<std::int32_t> pd(0, c.max_pos - 1);
  for (std::int64_t t = 0; t < tokens; ++t) {
    pos[t] = c.positions ? pd(g) : static_cast<std::int32_t>(t % c.seqlen);
    if (c.out_of_range && t % 5 == 3) pos[t] = (t % 2) ? c.max_pos + static_cast<std::int32_t>(t) : -1 - static_cast<std::int32_t>(t);
  }
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
  DeviceBuffer dpos(pos.size() * 4), dcache(cache.size() * 4);
  CUDA_OK(cudaMemcpy(dpos.ptr, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
  if (c.cache) CUDA_OK(cudaMemcpy(dcache.ptr, cache.data(), cache.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_TRUE(qkv.upload() && q.upload() && k.upload() && qo.upload() && ko.upload());

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
  p.positions = (c.positions || c.out_of_range) ? static_cast<const std::int32_t*>(dpos.ptr) : nullptr;
  if (c.cache) p.rotary.set_cos_sin_cache(static_cast<const float*>(dcache.ptr), c.max_pos, c.rot ? c.rot : d);
  if (c.packed_qkv) {
    p.q = TensorView{qkv.data(), c.dt, c.seqlen * hqkv * d, hqkv * d, d};
    p.k = TensorView{static_cast<std::uint16_t*>(qkv.data()) + c.hq * d, c.dt, c.seqlen * hqkv * d, hqkv * d, d};
  } else {
    p.q = bshd_view(q.data(), c.dt, c.seqlen, c.hq, d);
    p.k = bshd_view(k.data(), c.dt, c.seqlen, c.hk, d);
  }
  if (c.out_of_place) {
    p.q_out = bshd_view(qo.data(), c.dt, c.seqlen, c.hq, d);
    p.k_out = bshd_view(ko.data(), c.dt, c.seqlen, c.hk, d);
  }
  const Status st = apply_rotary(p, cuda_opt(c.config));
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(qkv.download() && q.download() && k.download() && qo.download() && ko.download());

  Compare cmp{c.dt};
  std::int64_t v_changed = 0;
  std::vector<double> cs(half), sn(half), ref(d);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t pp = pos[t];
    const bool bad_pos = c.cache && (pp < 0 || pp >= c.max_pos);
    for (int i = 0; i < half; ++i) {
      if (bad_pos) {
        cs[i] = sn[i] = NAN;
      } else if (c.cache) {
        cs[i] = cache[static_cast<std::size_t>(pp) * rot + i];
        sn[i] = cache[static_cast<std::size_t>(pp) * rot + half + i];
      } else {
        const double a = pp * inv_freq_direct(i, rot, c.theta, c.llama3);
        cs[i] = std::cos(a);
        sn[i] = std::sin(a);
      }
    }
    for (int w = 0; w < 2; ++w) {
      const int nh = w == 0 ? c.hq : c.hk;
      for (int h = 0; h < nh; ++h) {
        const std::int64_t in_idx = c.packed_qkv ? (t * hqkv + (w == 0 ? h : c.hq + h)) * d : (t * nh + h) * d;
        const Snap& in0 = c.packed_qkv ? qkv0 : (w == 0 ? q0 : k0);
        const Guarded& outb = c.out_of_place ? (w == 0 ? qo : ko) : (c.packed_qkv ? qkv : (w == 0 ? q : k));
        const std::int64_t out_idx = c.out_of_place ? (t * nh + h) * d : in_idx;
        for (int j = 0; j < d; ++j) ref[j] = in0.get(c.dt, in_idx + j);
        for (int i = 0; i < half; ++i) {
          const int ia = c.style == RopeStyle::kNeox ? i : 2 * i, ib = c.style == RopeStyle::kNeox ? i + half : 2 * i + 1;
          const double a0 = in0.get(c.dt, in_idx + ia), b0 = in0.get(c.dt, in_idx + ib);
          ref[ia] = a0 * cs[i] - b0 * sn[i];
          ref[ib] = b0 * cs[i] + a0 * sn[i];
        }
        for (int j = 0; j < d; ++j) cmp.add(out_idx + j, outb.get(c.dt, out_idx + j), ref[j]);
      }
    }
    if (c.packed_qkv)
      for (int h = c.hq + c.hk; h < hqkv; ++h)
        for (int j = 0; j < d; ++j) {
          const std::int64_t i = (t * hqkv + h) * d + j;
          v_changed += qkv.at(i) != qkv0.at(i);
        }
  }
  EXPECT_TRUE(cmp.ok());
  EXPECT_EQ(v_changed, 0);
  EXPECT_EQ(qkv.guards_changed() + q.guards_changed() + k.guards_changed() + qo.guards_changed() + ko.guards_changed(), 0);
}

TEST(FusedGpuRotary, DesignSize) {
  run_rope({}, 1);  // (4, 4096, 32, 128) q only, neox, arange positions
  RopeCase c;
  c.hk = 8;
  c.positions = true;
  c.theta = 500000.0;
  c.llama3 = Llama3Scaling{8.f, 1.f, 4.f, 8192};
  run_rope(c, 2);
  c.config = "heads2";  // two heads per thread sharing cos/sin (the measurement knob)
  run_rope(c, 3);
  c.config = "shared";  // cos/sin once per token in shared memory, one head a thread, no stages
  run_rope(c, 11);
  c.config = "stream,stages2,streaming";  // two stages and evict-first stores
  run_rope(c, 12);
  c.config = "stream";
  c.cache = true;  // the stream kernel's cos/sin from an fp32 cache
  run_rope(c, 13);
  c.cache = false;
  c.config = "staged";  // rows through shared memory with cp.async
  run_rope(c, 6);
  c.cache = true;
  run_rope(c, 7);
  c.config = "shared,heads2";  // cos/sin once per token in shared memory, two heads per thread
  run_rope(c, 8);
  c.cache = false;
  run_rope(c, 9);
  c.config = "heads1";  // the register kernel, one head a thread
  run_rope(c, 10);
  c.config = "heads2";
  c.style = RopeStyle::kInterleaved;
  c.out_of_place = true;
  run_rope(c, 4);
  c.config = "scalar";
  run_rope(c, 5);
}

TEST(FusedGpuRotary, StylesPartialOddAndPacked) {
  std::uint64_t salt = 100;
  for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved})
    for (DType dt : {DType::kBF16, DType::kF16})
      for (int rot : {0, 64, 32, 24, 2})
        for (bool oop : {false, true})
          for (const char* cfg : {"", "staged", "heads1", "shared"}) {  // the 16-byte kernels (stream by default)
            RopeCase c;
            c.batch = 2;
            c.seqlen = 37;
            c.hq = 6;
            c.hk = 2;
            c.style = st;
            c.dt = dt;
            c.rot = rot;
            c.positions = true;
            c.out_of_place = oop;
            c.config = cfg;
            run_rope(c, salt++);
          }
  RopeCase c;
  c.batch = 3;
  c.seqlen = 11;
  c.hq = 5;
  c.hk = 1;
  c.head_dim = 10;
  c.rot = 6;
  run_rope(c, salt++);
  c.head_dim = 80;
  c.rot = 32;
  c.out_of_place = true;
  run_rope(c, salt++);
  c = RopeCase{};
  c.batch = 2;
  c.seqlen = 100;
  c.hq = 8;
  c.hk = 2;
  c.packed_qkv = true;
  c.positions = true;
  run_rope(c, salt++);
  c.config = "staged";  // packed rows: the staged copy follows the head and token strides
  run_rope(c, salt++);
  c.config = "heads1";
  run_rope(c, salt++);
  c.config = "";
  c.misalign = 1;  // scalar path
  run_rope(c, salt++);
  c = RopeCase{};  // the stream kernel with 4 units a thread over 160 threads, 600 tokens of 72 heads
  c.config = "stream";
  c.batch = 2;
  c.seqlen = 300;
  c.hq = 64;
  c.hk = 8;
  c.positions = true;
  c.out_of_place = true;
  run_rope(c, salt++);
  c.style = RopeStyle::kInterleaved;
  c.rot = 64;  // partial: pass-through units beside rotary ones
  run_rope(c, salt++);
}

/// The packed-sequence walk (rotate_keys of a varlen attention: token (b, s) is packed row
/// cu_seqlens[b] + s, live only inside its sequence): the stream kernel equals the shared kernel bit
/// for bit (same arithmetic), with and without positions, and writes no row twice or past the end.
TEST(FusedGpuRotary, StreamPackedSequencesEqualTheSharedKernel) {
  const int d = 128, heads = 8;
  const std::vector<std::int32_t> cu = {0, 5, 5, 42, 43};  // lengths 5, 0, 37, 1
  const int batch = static_cast<int>(cu.size()) - 1, max_len = 37, total = cu.back();
  std::mt19937_64 g(gpu_seed() ^ 0x51ull);
  Guarded k(static_cast<std::int64_t>(total) * heads * d);
  k.fill_random(DType::kBF16, g);
  ASSERT_TRUE(k.upload());
  DeviceBuffer dcu(cu.size() * 4), dpos(static_cast<std::size_t>(total) * 4);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(total));
  for (auto& x : pos) x = static_cast<std::int32_t>(g() % 5000);
  CUDA_OK(cudaMemcpy(dcu.ptr, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dpos.ptr, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
  for (bool with_pos : {false, true}) {
    SCOPED_TRACE(with_pos ? "positions" : "positions = s");
    std::vector<std::uint16_t> outs[2];
    for (int kernel = 0; kernel < 2; ++kernel) {
      Guarded o(k.n);  // poisoned
      ASSERT_TRUE(o.upload());
      RopeParams rp;
      rp.batch = batch;
      rp.seqlen = max_len;
      rp.heads_q = heads;
      rp.head_dim = d;
      rp.rotary.theta = 10000.0;
      rp.q = TensorView{k.data(), DType::kBF16, 0, heads * d, d};  // packed rows: no batch stride
      rp.q_out = TensorView{o.data(), DType::kBF16, 0, heads * d, d};
      rp.positions = with_pos ? static_cast<const std::int32_t*>(dpos.ptr) : nullptr;
      cuda::FusedForce f;
      f.stream = kernel == 0;
      f.shared = kernel == 1;
      ASSERT_EQ(cuda::rotary_path(rp, f).name.find(kernel == 0 ? " stream" : " shared") != std::string::npos, true)
          << cuda::rotary_path(rp, f).name;
      const Status st = cuda::apply_rotary(rp, f, nullptr, static_cast<const std::int32_t*>(dcu.ptr));
      ASSERT_TRUE(st.ok()) << st.to_string();
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(o.download());
      EXPECT_EQ(o.guards_changed(), 0);
      std::int64_t unwritten = 0;
      for (std::int64_t i = 0; i < o.n; ++i) unwritten += o.at(i) == kPoison;
      EXPECT_EQ(unwritten, 0) << "every packed row belongs to a sequence, so every element is written";
      outs[kernel] = o.host;
    }
    EXPECT_TRUE(outs[0] == outs[1]) << "the stream kernel's packed walk differs from the shared kernel's";
  }
}

TEST(FusedGpuRotary, CacheAndOutOfRangePositions) {
  RopeCase c;
  c.batch = 2;
  c.seqlen = 64;
  c.hq = 4;
  c.hk = 2;
  c.cache = true;
  c.max_pos = 2048;
  c.positions = true;
  run_rope(c, 1);
  c.out_of_range = true;  // rotated dims NaN, nothing read outside the cache
  c.rot = 64;
  run_rope(c, 2);
  c.style = RopeStyle::kInterleaved;
  c.out_of_place = true;
  run_rope(c, 3);
}

// ---- path choices (host logic only; named so a regression in dispatch is visible) -------

TEST(FusedGpuPaths, ChosenPathsForTypicalShapes) {
  alignas(16) static char buf[64];
  auto norm = [&](std::int64_t hidden, std::int64_t stride, cuda::FusedForce f = {}) {
    RmsNormParams p;
    p.rows = 8192;
    p.hidden = hidden;
    p.x = MatrixView{buf, DType::kBF16, stride};
    p.y = p.residual = p.residual_out = p.x;
    p.weight = buf;
    return cuda::rms_norm_path(p, true, f).name;
  };
  auto plain = [&](std::int64_t hidden, cuda::FusedForce f = {}) {  // rms_norm, no residual
    RmsNormParams p;
    p.rows = 8192;
    p.hidden = hidden;
    p.x = p.y = MatrixView{buf, DType::kBF16, hidden};
    p.weight = buf;
    return cuda::rms_norm_path(p, false, f).name;
  };
  EXPECT_EQ(norm(4096, 4096), "fused_add_rms_norm vec8 two_pass threads=512 group=512");  // wide rows: two passes
  cuda::FusedForce slots1;
  slots1.slots = 1;  // the register kernel on request
  EXPECT_EQ(norm(4096, 4096, slots1), "fused_add_rms_norm vec8 register threads=512 group=512 slots=1");
  EXPECT_EQ(norm(8192, 8192), "fused_add_rms_norm vec8 two_pass threads=512 group=512");
  EXPECT_EQ(norm(128, 128), "fused_add_rms_norm vec8 register threads=128 group=16");  // QK-norm: 8 rows/block
  EXPECT_EQ(norm(4097, 4097), "fused_add_rms_norm scalar register threads=544 group=544");
  EXPECT_EQ(norm(4097, 4104), "fused_add_rms_norm vec8 two_pass threads=512 group=512");  // padded rows: vector + tail
  EXPECT_EQ(norm(8193, 8200), "fused_add_rms_norm vec8 two_pass threads=512 group=512");
  EXPECT_EQ(norm(4096, 4096, {true, false}), "fused_add_rms_norm scalar register threads=512 group=512");
  EXPECT_EQ(norm(4096, 4096, {false, true}), "fused_add_rms_norm vec8 two_pass threads=512 group=512");
  // Plain rows of 257..512 vectors stream through shared memory by default (8 KB stages, 3 of them).
  EXPECT_EQ(plain(4096), "rms_norm vec8 stream threads=128 vecs=4 stages=3 group=128");
  EXPECT_EQ(plain(2056), "rms_norm vec8 stream threads=96 vecs=4 stages=3 group=96");
  EXPECT_EQ(plain(2048), "rms_norm vec8 two_pass threads=256 group=256");
  EXPECT_EQ(plain(8192), "rms_norm vec8 two_pass threads=512 group=512");
  EXPECT_EQ(plain(4096, {false, true}), "rms_norm vec8 two_pass threads=512 group=512");
  EXPECT_EQ(plain(4096, slots1), "rms_norm vec8 register threads=512 group=512 slots=1");
  // The stream kernel on request: 16 KB stages (x and residual), at most 3 by default.
  cuda::FusedForce stream;
  stream.stream = true;
  EXPECT_EQ(norm(4096, 4096, stream), "fused_add_rms_norm vec8 stream threads=128 vecs=4 stages=3 group=128");
  EXPECT_EQ(norm(4092, 4096, stream), "fused_add_rms_norm vec8 stream threads=128 vecs=4 stages=3 group=128");  // tail
  EXPECT_EQ(norm(2056, 2056, stream), "fused_add_rms_norm vec8 stream threads=96 vecs=4 stages=3 group=96");
  EXPECT_EQ(norm(8192, 8192, stream), "fused_add_rms_norm vec8 two_pass threads=512 group=512");  // past its rows
  EXPECT_EQ(norm(2048, 2048, stream), "fused_add_rms_norm vec8 two_pass threads=256 group=256");
  EXPECT_EQ(norm(4097, 4104, stream), "fused_add_rms_norm vec8 two_pass threads=512 group=512");
  stream.stages = 2;
  EXPECT_EQ(norm(4096, 4096, stream), "fused_add_rms_norm vec8 stream threads=128 vecs=4 stages=2 group=128");
  cuda::FusedForce persistent;
  persistent.persistent = true;
  EXPECT_EQ(norm(4096, 4096, persistent), "fused_add_rms_norm vec8 persistent threads=512 group=512");
  EXPECT_EQ(norm(128, 128, persistent), "fused_add_rms_norm vec8 register threads=128 group=16");  // small rows: grouped
  cuda::FusedForce staged;
  staged.staged = true;
  const SiluMulParams sp = SiluMulParams::from_fused(buf, DType::kBF16, 8192, 14336, 2 * 14336,
                                                     MatrixView{buf, DType::kBF16, 14336});
  EXPECT_EQ(cuda::silu_and_mul_path(sp, {}).name, "silu_and_mul vec8 threads=256");
  const SiluMulParams odd = SiluMulParams::from_fused(buf, DType::kBF16, 8, 4097, 2 * 4097, MatrixView{buf, DType::kBF16, 4097});
  EXPECT_EQ(cuda::silu_and_mul_path(odd, {}).name, "silu_and_mul scalar threads=256");
  RopeParams rp;
  rp.batch = 4;
  rp.seqlen = 4096;
  rp.heads_q = 32;
  rp.head_dim = 128;
  rp.q = bshd_view(buf, DType::kBF16, 4096, 32, 128);
  // The stream kernel by default. 256 units (32 heads x 8 lanes): 128 threads of 2; a stage is 8 KB
  // of q and 512 B of cos/sin.
  EXPECT_EQ(cuda::rotary_path(rp, {}).name, "rotary neox vec8 sincos stream threads=128 units=2 stages=3");
  EXPECT_EQ(cuda::rotary_path(rp, staged).name, "rotary neox vec8 sincos staged");
  cuda::FusedForce shared;
  shared.shared = true;
  EXPECT_EQ(cuda::rotary_path(rp, shared).name, "rotary neox vec8 sincos shared");
  rp.heads_k = 8;  // 320 units: 4 a thread
  rp.k = bshd_view(buf, DType::kBF16, 4096, 8, 128);
  EXPECT_EQ(cuda::rotary_path(rp, {}).name, "rotary neox vec8 sincos stream threads=96 units=4 stages=3");
  rp.heads_q = 64;  // 576 units: 160 threads of 4
  EXPECT_EQ(cuda::rotary_path(rp, {}).name, "rotary neox vec8 sincos stream threads=160 units=4 stages=3");
  rp.heads_q = 200;  // 1664 units: more than a block of the stream kernel holds (and the shared kernel's 256)
  EXPECT_EQ(cuda::rotary_path(rp, {}).name, "rotary neox vec8 sincos");
  rp.heads_q = 32;
  rp.heads_k = 0;
  cuda::FusedForce heads1;
  heads1.heads = 1;
  EXPECT_EQ(cuda::rotary_path(rp, heads1).name, "rotary neox vec8 sincos");
  rp.rotary.rotary_dim = 24;
  EXPECT_EQ(cuda::rotary_path(rp, {}).name, "rotary neox scalar sincos");
  EXPECT_EQ(cuda::rotary_path(rp, staged).name, "rotary neox scalar sincos");  // staged needs 16-byte rows
}

// ---- CUDA graphs: launches are capturable (no sync, no allocation) ----------------------

TEST(FusedGpu, CapturedInCudaGraph) {
  const DType dt = DType::kBF16;
  const std::int64_t rows = 256, hidden = 4096, d = 1024;
  std::mt19937_64 g(gpu_seed());
  Guarded x(rows * hidden), r(rows * hidden), w(hidden), y(rows * hidden), gu(rows * 2 * d), o(rows * d), q(rows * 8 * 128);
  for (Guarded* b : {&x, &r, &w, &gu, &q}) b->fill_random(dt, g);
  ASSERT_TRUE(x.upload() && r.upload() && w.upload() && y.upload() && gu.upload() && o.upload() && q.upload());
  RmsNormParams np;
  np.rows = rows;
  np.hidden = hidden;
  np.x = contiguous_matrix(x.data(), dt, hidden);
  np.residual = contiguous_matrix(r.data(), dt, hidden);
  np.residual_out = np.residual;
  np.weight = w.data();
  np.y = contiguous_matrix(y.data(), dt, hidden);
  const SiluMulParams sp = SiluMulParams::from_fused(gu.data(), dt, rows, d, 2 * d, contiguous_matrix(o.data(), dt, d));
  RopeParams rp;
  rp.seqlen = static_cast<int>(rows);
  rp.heads_q = 8;
  rp.head_dim = 128;
  rp.q = bshd_view(q.data(), dt, rows, 8, 128);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // A direct run first (also warms the device-property cache), kept for comparison: SwiGLU's
  // inputs are not modified, so the replay must reproduce its output bit for bit.
  ASSERT_TRUE(silu_and_mul(sp, cuda_opt("", s)).ok());
  CUDA_OK(cudaStreamSynchronize(s));
  ASSERT_TRUE(o.download());
  const std::vector<std::uint16_t> o_direct = o.host;
  CUDA_OK(cudaMemsetAsync(o.buf.ptr, 0xFF, o.buf.bytes, s));  // on s: it does not wait for the legacy stream
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const Status a = fused_add_rms_norm(np, cuda_opt("", s));
  const Status b = silu_and_mul(sp, cuda_opt("", s));
  const Status c = apply_rotary(rp, cuda_opt("", s));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << a.to_string() << b.to_string() << c.to_string();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  ASSERT_TRUE(y.download() && o.download());
  std::int64_t nan = 0;
  for (std::int64_t i = 0; i < rows * hidden; ++i) nan += std::isnan(y.get(dt, i));
  for (std::int64_t i = 0; i < rows * d; ++i) nan += std::isnan(o.get(dt, i));
  EXPECT_EQ(nan, 0);
  EXPECT_TRUE(o.host == o_direct) << "graph replay differs from the direct launch";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}


// ---- QK-RMSNorm + rotary -----------------------------------------------------------------

struct QkCase {
  int tokens, heads_q, heads_k, head_dim, rotary_dim;
  DType dt = DType::kBF16;
  RopeStyle style = RopeStyle::kNeox;
  bool in_place = false;
  std::int64_t misalign = 0;  // element offset of q and k (1: the scalar path)
  std::string config;         // "" or "scalar" (both sides)
};

std::string describe(const QkCase& c) {
  return std::to_string(c.tokens) + "t " + std::to_string(c.heads_q) + "/" + std::to_string(c.heads_k) + " d" +
         std::to_string(c.head_dim) + " rot" + std::to_string(c.rotary_dim) + " " + dtype_name(c.dt) + " " +
         rope_style_name(c.style) + (c.in_place ? " in-place" : "") + " misalign" + std::to_string(c.misalign) + " [" +
         c.config + "]";
}

/// qk_norm_rope equals CUDA rms_norm over each head (rows of head_dim) followed by CUDA
/// apply_rotary, bit for bit (fused.h's rounding rule), and writes nothing outside its outputs.
void run_qk(const QkCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ salt);
  const int d = c.head_dim;
  const std::int64_t nq = static_cast<std::int64_t>(c.tokens) * c.heads_q * d, nk = static_cast<std::int64_t>(c.tokens) * c.heads_k * d;
  Guarded q(nq, c.misalign), k(nk, c.misalign), wq(d), wk(d), oq(nq), ok(nk), uq(nq, c.misalign), uk(nk, c.misalign), pos(2 * c.tokens);
  q.fill_random(c.dt, g, 2.f);
  k.fill_random(c.dt, g, 2.f);
  wq.fill_random(c.dt, g);
  wk.fill_random(c.dt, g);
  for (int t = 0; t < c.tokens; ++t) {  // int32 positions in pairs of 16-bit elements
    const std::int32_t v = static_cast<std::int32_t>(g() % 40000);
    std::memcpy(&pos.at(2 * t), &v, 4);
  }
  uq.host = q.host;
  uk.host = k.host;
  ASSERT_TRUE(q.upload() && k.upload() && wq.upload() && wk.upload() && oq.upload() && ok.upload() && uq.upload() &&
              uk.upload() && pos.upload());
  const auto* positions = static_cast<const std::int32_t*>(pos.data());
  RotarySpec spec = RotarySpec::of_style(c.style);
  spec.rotary_dim = c.rotary_dim;
  // Unfused: rms_norm in place on copies of q and k, then apply_rotary in place.
  for (auto [x, w, n] : {std::tuple{&uq, &wq, nq}, std::tuple{&uk, &wk, nk}}) {
    if (n == 0) continue;
    RmsNormParams np;
    np.rows = n / d;
    np.hidden = d;
    np.x = contiguous_matrix(x->data(), c.dt, d);
    np.y = np.x;
    np.weight = w->data();
    ASSERT_TRUE(rms_norm(np, cuda_opt(c.config)).ok());
  }
  RopeParams rp;
  rp.seqlen = c.tokens, rp.heads_q = c.heads_q, rp.heads_k = c.heads_k, rp.head_dim = d;
  rp.q = bshd_view(uq.data(), c.dt, c.tokens, c.heads_q, d);
  rp.k = bshd_view(uk.data(), c.dt, c.tokens, c.heads_k, d);
  rp.positions = positions;
  rp.rotary = spec;
  ASSERT_TRUE(apply_rotary(rp, cuda_opt(c.config)).ok());
  // Fused.
  QkNormRopeParams p;
  p.seqlen = c.tokens, p.heads_q = c.heads_q, p.heads_k = c.heads_k, p.head_dim = d;
  p.q = bshd_view(q.data(), c.dt, c.tokens, c.heads_q, d);
  p.k = bshd_view(k.data(), c.dt, c.tokens, c.heads_k, d);
  if (!c.in_place) {
    p.q_out = bshd_view(oq.data(), c.dt, c.tokens, c.heads_q, d);
    if (c.heads_k > 0) p.k_out = bshd_view(ok.data(), c.dt, c.tokens, c.heads_k, d);  // no k: no k_out
  }
  p.q_weight = wq.data();
  p.k_weight = c.heads_k ? wk.data() : nullptr;
  p.positions = positions;
  p.rotary = spec;
  const Status st = qk_norm_rope(p, cuda_opt(c.config));
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(q.download() && k.download() && oq.download() && ok.download() && uq.download() && uk.download());
  Guarded& gq = c.in_place ? q : oq;
  Guarded& gk = c.in_place ? k : ok;
  std::int64_t diff = 0, first = -1;
  for (std::int64_t i = 0; i < nq; ++i)
    if (gq.at(i) != uq.at(i) && diff++ == 0) first = i;
  for (std::int64_t i = 0; i < nk; ++i)
    if (gk.at(i) != uk.at(i) && diff++ == 0) first = nq + i;
  EXPECT_EQ(diff, 0) << "first differing element " << first;
  EXPECT_EQ(gq.guards_changed() + gk.guards_changed(), 0);
}

TEST(FusedGpuQkNormRope, EqualsRmsNormThenApplyRotaryBitForBit) {
  std::uint64_t salt = 700;
  run_qk({4096, 32, 8, 128, 0}, ++salt);                                  // Qwen3-8B prefill chunk
  run_qk({1000, 8, 4, 256, 0, DType::kBF16, RopeStyle::kNeox}, ++salt);   // Gemma3-style head 256
  for (DType dt : {DType::kBF16, DType::kF16})
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved})
      for (auto [d, rd] : {std::pair{128, 0}, std::pair{64, 32}, std::pair{96, 0}, std::pair{30, 0}, std::pair{72, 24}}) {
        run_qk({127, 4, 2, d, rd, dt, st}, ++salt);
        run_qk({7, 3, 1, d, rd, dt, st, true, 1}, ++salt);         // in place, misaligned: scalar
        run_qk({33, 2, 2, d, rd, dt, st, false, 0, "scalar"}, ++salt);
      }
  run_qk({1, 16, 0, 128, 0}, ++salt);  // no k, one token
}

TEST(FusedGpuQkNormRope, WeightOffsetAndNan) {
  const DType dt = DType::kBF16;
  const int tokens = 257, hq = 4, d = 128;
  std::mt19937_64 g(gpu_seed() ^ 777);
  Guarded q(tokens * hq * d), w(d), o(tokens * hq * d);
  q.fill_random(dt, g, 3.f);
  std::normal_distribution<float> wd(0.f, 0.2f);  // Gemma3: weights near 0, used as 1 + w
  for (int j = 0; j < d; ++j) w.at(j) = to_bits(dt, wd(g));
  q.at(5 * hq * d + d + 3) = to_bits(dt, NAN);  // token 5, head 1
  ASSERT_TRUE(q.upload() && w.upload() && o.upload());
  QkNormRopeParams p;
  p.seqlen = tokens, p.heads_q = hq, p.head_dim = d, p.weight_offset = 1.f;
  p.q = bshd_view(q.data(), dt, tokens, hq, d);
  p.q_out = bshd_view(o.data(), dt, tokens, hq, d);
  p.q_weight = w.data();
  ASSERT_TRUE(qk_norm_rope(p, cuda_opt("")).ok());
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(o.download());
  // fp64: n = round(x rstd (1 + w)), rotated at position s; one ulp of n of slack (fused.h).
  double worst = 0;
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < hq; ++h) {
      const std::int64_t base = (static_cast<std::int64_t>(t) * hq + h) * d;
      double ss = 0;
      for (int j = 0; j < d; ++j) ss += static_cast<double>(q.get(dt, base + j)) * q.get(dt, base + j);
      const double rstd = 1.0 / std::sqrt(ss / d + 1e-6);
      std::vector<double> n(d);
      for (int j = 0; j < d; ++j) n[j] = round_to(dt, static_cast<float>(q.get(dt, base + j) * rstd * (1.0 + w.get(dt, j))));
      for (int i = 0; i < d / 2; ++i) {
        const double a = t * std::pow(10000.0, -2.0 * i / d), cs = std::cos(a), sn = std::sin(a), x0 = n[i], x1 = n[i + d / 2];
        n[i] = x0 * cs - x1 * sn;
        n[i + d / 2] = x1 * cs + x0 * sn;
      }
      for (int j = 0; j < d; ++j) {
        const double got = o.get(dt, base + j);
        if (t == 5 && h == 1) {
          EXPECT_TRUE(std::isnan(got)) << j;  // NaN in, NaN out: the whole head
          continue;
        }
        const double err = std::fabs(got - n[j]), tol = 1e-3 + 1e-3 * std::fabs(n[j]) + half_ulp(dt, n[j]) + 2 * half_ulp(dt, 8.0);
        worst = std::max(worst, err / tol);
      }
    }
  EXPECT_LE(worst, 1.0);
  EXPECT_EQ(o.guards_changed(), 0);
}

// ---- rotary + KV-cache append --------------------------------------------------------------

struct AppendCase {
  int batch, seqlen, heads_q, heads_kv, head_dim, rotary_dim, page_size;
  DType dt = DType::kBF16;
  RopeStyle style = RopeStyle::kNeox;
  std::string config;
  bool wild_device_values = false;  // lengths and block-table entries outside their ranges
};

std::string describe(const AppendCase& c) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seqlen) + " " + std::to_string(c.heads_q) + "/" +
         std::to_string(c.heads_kv) + " d" + std::to_string(c.head_dim) + " rot" + std::to_string(c.rotary_dim) + " page" +
         std::to_string(c.page_size) + " " + dtype_name(c.dt) + " " + rope_style_name(c.style) + " [" + c.config + "]" +
         (c.wild_device_values ? " wild" : "");
}

/// A rope_append_kv test's block table: pages 1 .. num_pages - 2 in a random order (the wild entries
/// of make_wild clamp to 0 and num_pages - 1, so no page is named twice).
void shuffle_pages(std::mt19937_64& g, int num_pages, std::vector<std::int32_t>* table) {
  std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages - 2));
  for (int i = 0; i < num_pages - 2; ++i) perm[static_cast<std::size_t>(i)] = i + 1;
  std::shuffle(perm.begin(), perm.end(), g);
  std::copy(perm.begin(), perm.begin() + static_cast<std::ptrdiff_t>(table->size()), table->begin());
}

/// Device values out of range (a length past max_len and a negative one, pages below and past the
/// pool) in dev_lens / dev_table, and in lens / table what the kernel must clamp them to (lengths
/// into [0, max_len], pages into [0, num_pages)): the expectations, and the CPU backend's inputs.
void make_wild(int batch, int max_len, int num_pages, std::vector<std::int32_t>* lens, std::vector<std::int32_t>* table,
               std::vector<std::int32_t>* dev_lens, std::vector<std::int32_t>* dev_table) {
  (*dev_lens)[0] = 1 << 30;
  if (batch > 1) (*dev_lens)[1] = -5;
  if (!dev_table->empty()) dev_table->front() = -7, dev_table->back() = 1 << 29;
  (*lens)[0] = max_len;
  if (batch > 1) (*lens)[1] = 0;
  if (!table->empty()) table->front() = 0, table->back() = num_pages - 1;
}

/// rope_append_kv: K rows equal CUDA apply_rotary's, V rows the new values' bits, q_out apply_rotary's
/// q, in the slots of decode's rule; every other cache element keeps the poison.
void run_append(const AppendCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ salt);
  const int d = c.head_dim, ps = c.page_size, capacity = c.seqlen + 13;
  const int pages_per_seq = ps ? (capacity + ps - 1) / ps : 0, num_pages = ps ? c.batch * pages_per_seq + 3 : 0;
  const int slots = ps ? pages_per_seq * ps : capacity, rows = ps ? ps : capacity, blocks = ps ? num_pages : c.batch;
  const std::int64_t tokens = static_cast<std::int64_t>(c.batch) * c.seqlen, cache_n = static_cast<std::int64_t>(blocks) * rows * c.heads_kv * d;
  Guarded q(tokens * c.heads_q * d), qo(tokens * c.heads_q * d), kn(tokens * c.heads_kv * d), vn(tokens * c.heads_kv * d);
  Guarded rq(tokens * c.heads_q * d), rk(tokens * c.heads_kv * d), kc(cache_n), vc(cache_n);
  Guarded len(2 * c.batch), bt(2 * std::max(1, c.batch * pages_per_seq));
  q.fill_random(c.dt, g);
  kn.fill_random(c.dt, g);
  vn.fill_random(c.dt, g);
  rq.host = q.host;
  rk.host = kn.host;
  std::vector<std::int32_t> lens(c.batch), table(static_cast<std::size_t>(c.batch * pages_per_seq));
  for (auto& x : lens) x = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(slots - c.seqlen + 1));
  if (ps) shuffle_pages(g, num_pages, &table);
  std::vector<std::int32_t> dev_lens = lens, dev_table = table;
  if (c.wild_device_values) make_wild(c.batch, slots - c.seqlen, num_pages, &lens, &table, &dev_lens, &dev_table);
  std::memcpy(&len.at(0), dev_lens.data(), dev_lens.size() * 4);
  if (ps) std::memcpy(&bt.at(0), dev_table.data(), dev_table.size() * 4);
  for (Guarded* b : {&q, &qo, &kn, &vn, &rq, &rk, &kc, &vc, &len, &bt}) ASSERT_TRUE(b->upload());
  // Expected rotations: CUDA apply_rotary of q and k_new at the slots (positions null).
  std::vector<std::int32_t> slot_pos(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) slot_pos[static_cast<std::size_t>(t)] = lens[static_cast<std::size_t>(t / c.seqlen)] + static_cast<std::int32_t>(t % c.seqlen);
  DeviceBuffer dpos(slot_pos.size() * 4);
  CUDA_OK(cudaMemcpy(dpos.ptr, slot_pos.data(), slot_pos.size() * 4, cudaMemcpyHostToDevice));
  RotarySpec spec = RotarySpec::of_style(c.style);
  spec.rotary_dim = c.rotary_dim;
  RopeParams rp;
  rp.batch = c.batch, rp.seqlen = c.seqlen, rp.heads_q = c.heads_q, rp.heads_k = c.heads_kv, rp.head_dim = d;
  rp.q = bshd_view(rq.data(), c.dt, c.seqlen, c.heads_q, d);
  rp.k = bshd_view(rk.data(), c.dt, c.seqlen, c.heads_kv, d);
  rp.positions = static_cast<const std::int32_t*>(dpos.ptr);
  rp.rotary = spec;
  ASSERT_TRUE(apply_rotary(rp, cuda_opt(c.config)).ok());

  RopeAppendParams p;
  p.batch = c.batch, p.seqlen = c.seqlen, p.heads_q = c.heads_q, p.heads_kv = c.heads_kv, p.head_dim = d;
  p.q = bshd_view(q.data(), c.dt, c.seqlen, c.heads_q, d);
  p.q_out = bshd_view(qo.data(), c.dt, c.seqlen, c.heads_q, d);
  p.k_new = bshd_view(kn.data(), c.dt, c.seqlen, c.heads_kv, d);
  p.v_new = bshd_view(vn.data(), c.dt, c.seqlen, c.heads_kv, d);
  p.cache.k = bshd_view(kc.data(), c.dt, rows, c.heads_kv, d);
  p.cache.v = bshd_view(vc.data(), c.dt, rows, c.heads_kv, d);
  p.cache.capacity = ps ? 0 : capacity;
  p.cache.page_size = ps;
  p.cache.num_pages = num_pages;
  p.cache.pages_per_seq = pages_per_seq;
  p.cache.block_table_stride = pages_per_seq;
  p.cache.block_table = ps ? static_cast<const std::int32_t*>(bt.data()) : nullptr;
  p.cache_seqlens = static_cast<const std::int32_t*>(len.data());
  p.rotary = spec;
  const Status st = rope_append_kv(p, cuda_opt(c.config));
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  for (Guarded* b : {&qo, &kc, &vc, &rq, &rk}) ASSERT_TRUE(b->download());
  std::int64_t diff = 0;
  for (std::int64_t i = 0; i < qo.n; ++i) diff += qo.at(i) != rq.at(i);
  EXPECT_EQ(diff, 0) << "q_out differs from apply_rotary's q";
  std::vector<char> written(static_cast<std::size_t>(cache_n), 0);
  std::int64_t kdiff = 0, vdiff = 0, stray = 0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const int b = static_cast<int>(t / c.seqlen), j = lens[static_cast<std::size_t>(b)] + static_cast<int>(t % c.seqlen);
    const std::int64_t block = ps ? table[static_cast<std::size_t>(b * pages_per_seq + j / ps)] : b, row = ps ? j % ps : j;
    for (int h = 0; h < c.heads_kv; ++h)
      for (int e = 0; e < d; ++e) {
        const std::int64_t at = ((block * rows + row) * c.heads_kv + h) * d + e, src = (t * c.heads_kv + h) * d + e;
        kdiff += kc.at(at) != rk.at(src);
        vdiff += vc.at(at) != vn.at(src);
        written[static_cast<std::size_t>(at)] = 1;
      }
  }
  for (std::int64_t i = 0; i < cache_n; ++i)
    if (!written[static_cast<std::size_t>(i)]) stray += (kc.at(i) != kPoison) + (vc.at(i) != kPoison);
  EXPECT_EQ(kdiff, 0) << "cache K differs from apply_rotary's k";
  EXPECT_EQ(vdiff, 0) << "cache V differs from v_new";
  EXPECT_EQ(stray, 0) << "cache elements written outside the step's slots";
  EXPECT_EQ(kc.guards_changed() + vc.guards_changed() + qo.guards_changed(), 0);
}

TEST(FusedGpuRopeAppend, PagedAndContiguousEqualApplyRotaryAndCopies) {
  std::uint64_t salt = 800;
  run_append({256, 1, 32, 8, 128, 0, 16}, ++salt);  // a Llama-3-8B decode step
  for (DType dt : {DType::kBF16, DType::kF16})
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      run_append({3, 17, 4, 2, 128, 0, 16, dt, st}, ++salt);
      run_append({2, 5, 2, 1, 64, 32, 1, dt, st}, ++salt);
      run_append({3, 7, 8, 2, 30, 0, 0, dt, st}, ++salt);  // contiguous, scalar head
      run_append({2, 9, 4, 4, 256, 0, 8, dt, st, "scalar"}, ++salt);
    }
}

TEST(FusedGpuRopeAppend, ClampsDeviceLengthsAndPages) {
  run_append({3, 4, 2, 2, 64, 0, 4, DType::kBF16, RopeStyle::kNeox, "", true}, 900);
  run_append({3, 4, 2, 2, 64, 0, 0, DType::kBF16, RopeStyle::kNeox, "", true}, 901);
}

// ---- rotary + append into an fp8 e4m3 cache -------------------------------------------------

/// A device buffer of fp8 codes with kGuard bytes of 0xFF (NaN codes) on each side; the view starts
/// 16-byte aligned (CUDA's rule for fp8 caches).
struct Codes {
  std::int64_t n;
  DeviceBuffer buf;
  std::vector<std::uint8_t> host;
  explicit Codes(std::int64_t n_) : n(n_), buf(static_cast<std::size_t>(n_ + 2 * kGuard)), host(static_cast<std::size_t>(n_ + 2 * kGuard), 0xFF) {}
  void* data() { return static_cast<std::uint8_t*>(buf.ptr) + kGuard; }
  std::uint8_t* host_data() { return host.data() + kGuard; }
  std::uint8_t at(std::int64_t i) const { return host[static_cast<std::size_t>(kGuard + i)]; }
  bool upload() { return cudaMemcpy(buf.ptr, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess; }
  bool download() { return cudaMemcpy(host.data(), buf.ptr, host.size(), cudaMemcpyDeviceToHost) == cudaSuccess; }
};

bool nan_code(std::uint8_t c) { return (c & 0x7fu) == 0x7fu; }
/// Equal codes; NaN codes as one class (the CPU backend keeps a NaN's sign, cvt.rn.satfinite does not).
bool same_code(std::uint8_t a, std::uint8_t b) { return a == b || (nan_code(a) && nan_code(b)); }
/// Whether `code` is a nearest e4m3 value of x (code units), saturating at +-448, within `slack` ulps.
/// Whether code is a nearest e4m3 value of x: within half an ulp of it, plus slack ulps, plus
/// abs_slack (x's own uncertainty, in x's units).
bool nearest_e4m3(std::uint8_t code, float x, double slack, double abs_slack = 0.0) {
  if (std::isnan(x)) return nan_code(code);
  const double y = std::clamp(static_cast<double>(x), -448.0, 448.0), a = std::fabs(y);
  const double ulp = a < 0x1p-6 ? 0x1p-9 : std::ldexp(1.0, std::ilogb(a) - 3);
  const float got = fp8e4m3_bits_to_float(code);
  return !std::isnan(got) && std::fabs(got - y) <= (0.5 + slack) * ulp + abs_slack;
}

std::vector<float> random_scales(std::mt19937_64& g, int heads) {  // log-uniform in [2^-7, 2]
  std::uniform_real_distribution<float> e(-7.f, 1.f);
  std::vector<float> s(static_cast<std::size_t>(heads));
  for (auto& x : s) x = std::exp2(e(g));
  return s;
}

/// A cos_sin_cache (rows [cos | sin], rotary_dim wide) of fp32 values at theta 10000.
std::vector<float> cos_sin_cache(int rows, int rot) {
  std::vector<float> t(static_cast<std::size_t>(rows) * rot);
  for (int p = 0; p < rows; ++p)
    for (int i = 0; i < rot / 2; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * i / rot);
      t[static_cast<std::size_t>(p) * rot + i] = static_cast<float>(std::cos(a));
      t[static_cast<std::size_t>(p) * rot + rot / 2 + i] = static_cast<float>(std::sin(a));
    }
  return t;
}

struct Fp8AppendCase {
  int batch, seqlen, heads_q, heads_kv, head_dim, rotary_dim, page_size;
  DType dt = DType::kBF16;
  RopeStyle style = RopeStyle::kNeox;
  bool tables = true;  ///< cos/sin tables (the same fp32 angles on both backends) or theta
  std::string config;
  bool wild_device_values = false;
};

std::string describe(const Fp8AppendCase& c) {
  return "b" + std::to_string(c.batch) + " s" + std::to_string(c.seqlen) + " " + std::to_string(c.heads_q) + "/" +
         std::to_string(c.heads_kv) + " d" + std::to_string(c.head_dim) + " rot" + std::to_string(c.rotary_dim) + " page" +
         std::to_string(c.page_size) + " " + dtype_name(c.dt) + " " + rope_style_name(c.style) +
         (c.tables ? " tables" : " theta") + " [" + c.config + "]" + (c.wild_device_values ? " wild" : "");
}

/// rope_append_kv into an fp8 cache on CUDA against the CPU backend on the same inputs (specials
/// included: a NaN key, +-inf values): V codes bit for bit; K codes bit for bit with cos/sin tables
/// (both backends then rotate the same fp32 numbers) and, from theta (hardware sincos against libm),
/// equal or a nearest e4m3 value of the CPU's fp32 rotation / scale; q_out bit for bit with tables;
/// every other cache byte, guards included, keeps its 0xFF poison.
void run_append_fp8(const Fp8AppendCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ salt);
  const int d = c.head_dim, ps = c.page_size, capacity = c.seqlen + 13, rot = c.rotary_dim ? c.rotary_dim : d;
  const int pages_per_seq = ps ? (capacity + ps - 1) / ps : 0, num_pages = ps ? c.batch * pages_per_seq + 3 : 0;
  const int slots = ps ? pages_per_seq * ps : capacity, rows = ps ? ps : capacity, blocks = ps ? num_pages : c.batch;
  const std::int64_t tokens = static_cast<std::int64_t>(c.batch) * c.seqlen, cache_n = static_cast<std::int64_t>(blocks) * rows * c.heads_kv * d;
  constexpr int kMaxPos = 4096;
  Guarded q(tokens * c.heads_q * d), qo(tokens * c.heads_q * d), kn(tokens * c.heads_kv * d), vn(tokens * c.heads_kv * d);
  Guarded rq(tokens * c.heads_q * d), len(2 * c.batch), bt(2 * std::max(1, c.batch * pages_per_seq)), pos(2 * tokens);
  Codes kc(cache_n), vc(cache_n);
  q.fill_random(c.dt, g, 2.f);
  kn.fill_random(c.dt, g, 2.f);
  vn.fill_random(c.dt, g, 2.f);
  kn.at(tokens * c.heads_kv * d - 2) = kPoison;  // a NaN key element (last token, last head)
  vn.at(0) = to_bits(c.dt, INFINITY);
  vn.at(1) = to_bits(c.dt, -INFINITY);
  rq.host = q.host;
  const std::vector<float> ks = random_scales(g, c.heads_kv), vs = random_scales(g, c.heads_kv);
  std::vector<std::int32_t> lens(static_cast<std::size_t>(c.batch)), table(static_cast<std::size_t>(c.batch * pages_per_seq));
  std::vector<std::int32_t> positions(static_cast<std::size_t>(tokens));
  for (auto& x : lens) x = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(slots - c.seqlen + 1));
  for (auto& x : positions) x = static_cast<std::int32_t>(g() % kMaxPos);
  if (ps) shuffle_pages(g, num_pages, &table);
  std::vector<std::int32_t> dev_lens = lens, dev_table = table;
  if (c.wild_device_values) make_wild(c.batch, slots - c.seqlen, num_pages, &lens, &table, &dev_lens, &dev_table);
  std::memcpy(&len.at(0), dev_lens.data(), dev_lens.size() * 4);
  if (ps) std::memcpy(&bt.at(0), dev_table.data(), dev_table.size() * 4);
  std::memcpy(&pos.at(0), positions.data(), positions.size() * 4);
  const std::vector<float> tab = cos_sin_cache(kMaxPos, rot);
  DeviceBuffer dks(ks.size() * 4), dvs(vs.size() * 4), dtab(tab.size() * 4);
  CUDA_OK(cudaMemcpy(dks.ptr, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dvs.ptr, vs.data(), vs.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dtab.ptr, tab.data(), tab.size() * 4, cudaMemcpyHostToDevice));
  for (Guarded* b : {&q, &qo, &kn, &vn, &rq, &len, &bt, &pos}) ASSERT_TRUE(b->upload());
  ASSERT_TRUE(kc.upload() && vc.upload());
  // The same problem on the host (CPU backend), from host copies taken before the launch.
  std::vector<std::uint16_t> hq(q.host), hkn(kn.host), hvn(vn.host), hqo(qo.host);
  std::vector<std::uint8_t> hkc(kc.host), hvc(vc.host);

  auto params = [&](void* qp, void* qop, void* knp, void* vnp, void* kcp, void* vcp, const float* ksp, const float* vsp,
                    const void* lp, const void* btp, const void* pp, const float* tp) {
    RopeAppendParams p;
    p.batch = c.batch, p.seqlen = c.seqlen, p.heads_q = c.heads_q, p.heads_kv = c.heads_kv, p.head_dim = d;
    if (c.heads_q > 0) {
      p.q = bshd_view(qp, c.dt, c.seqlen, c.heads_q, d);
      p.q_out = bshd_view(qop, c.dt, c.seqlen, c.heads_q, d);
    }
    p.k_new = bshd_view(knp, c.dt, c.seqlen, c.heads_kv, d);
    p.v_new = bshd_view(vnp, c.dt, c.seqlen, c.heads_kv, d);
    p.cache.k = bshd_view(kcp, DType::kF8E4M3, rows, c.heads_kv, d);
    p.cache.v = bshd_view(vcp, DType::kF8E4M3, rows, c.heads_kv, d);
    p.cache.k_scale = ksp;
    p.cache.v_scale = vsp;
    p.cache.capacity = ps ? 0 : capacity;
    p.cache.page_size = ps;
    p.cache.num_pages = num_pages;
    p.cache.pages_per_seq = pages_per_seq;
    p.cache.block_table_stride = pages_per_seq;
    p.cache.block_table = ps ? static_cast<const std::int32_t*>(btp) : nullptr;
    p.cache_seqlens = static_cast<const std::int32_t*>(lp);
    p.positions = static_cast<const std::int32_t*>(pp);
    p.rotary = RotarySpec::of_style(c.style);
    p.rotary.rotary_dim = c.rotary_dim;
    if (c.tables && c.style != RopeStyle::kNone) p.rotary.set_cos_sin_cache(tp, kMaxPos, rot);
    return p;
  };
  const RopeAppendParams dp = params(q.data(), qo.data(), kn.data(), vn.data(), kc.data(), vc.data(),
                                     static_cast<const float*>(dks.ptr), static_cast<const float*>(dvs.ptr), len.data(),
                                     bt.data(), pos.data(), static_cast<const float*>(dtab.ptr));
  const Status st = rope_append_kv(dp, cuda_opt(c.config));
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(qo.download() && kc.download() && vc.download());
  const RopeAppendParams hp = params(hq.data() + kGuard, hqo.data() + kGuard, hkn.data() + kGuard, hvn.data() + kGuard,
                                     hkc.data() + kGuard, hvc.data() + kGuard, ks.data(), vs.data(), lens.data(),
                                     table.data(), positions.data(), tab.data());
  RunOptions cpu;
  cpu.backend = Backend::kCpu;
  ASSERT_TRUE(rope_append_kv(hp, cpu).ok());
  // The CPU's fp32 rotation of k_new (apply_rotary on an fp32 copy), for the theta cases.
  std::vector<float> k32(static_cast<std::size_t>(kn.n));
  for (std::int64_t i = 0; i < kn.n; ++i) k32[static_cast<std::size_t>(i)] = kn.get(c.dt, i);
  if (c.style != RopeStyle::kNone) {
    RopeParams rp;
    rp.batch = c.batch, rp.seqlen = c.seqlen, rp.heads_q = c.heads_kv, rp.head_dim = d;
    rp.q = bshd_view(k32.data(), DType::kF32, c.seqlen, c.heads_kv, d);
    rp.positions = positions.data();
    rp.rotary = hp.rotary;
    ASSERT_TRUE(apply_rotary(rp, cpu).ok());
  }
  if (c.heads_q > 0 && !c.tables && c.style != RopeStyle::kNone) {  // theta: q_out as CUDA apply_rotary writes it
    RopeParams rp;
    rp.batch = c.batch, rp.seqlen = c.seqlen, rp.heads_q = c.heads_q, rp.head_dim = d;
    rp.q = bshd_view(rq.data(), c.dt, c.seqlen, c.heads_q, d);
    rp.positions = static_cast<const std::int32_t*>(pos.data());
    rp.rotary = dp.rotary;
    ASSERT_TRUE(apply_rotary(rp, cuda_opt(c.config)).ok());
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(rq.download());
    hqo = rq.host;
  }
  std::int64_t qdiff = 0;
  for (std::int64_t i = 0; i < qo.n; ++i) qdiff += qo.at(i) != hqo[static_cast<std::size_t>(kGuard + i)];
  EXPECT_EQ(qdiff, 0) << "q_out differs from the CPU backend's (tables) or CUDA apply_rotary's (theta)";
  std::vector<char> written(static_cast<std::size_t>(cache_n), 0);
  std::int64_t kdiff = 0, kflip = 0, vdiff = 0, stray = 0, nans = 0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const int b = static_cast<int>(t / c.seqlen), j = lens[static_cast<std::size_t>(b)] + static_cast<int>(t % c.seqlen);
    const std::int64_t block = ps ? table[static_cast<std::size_t>(b * pages_per_seq + j / ps)] : b, row = ps ? j % ps : j;
    for (int h = 0; h < c.heads_kv; ++h)
      for (int e = 0; e < d; ++e) {
        const std::int64_t at = ((block * rows + row) * c.heads_kv + h) * d + e, src = (t * c.heads_kv + h) * d + e;
        const std::uint8_t want_k = hkc[static_cast<std::size_t>(kGuard + at)];
        if (!same_code(kc.at(at), want_k)) {
          ++kflip;  // theta: the rounding may fall the other way from a last-bit different rotation
          // The device's __sincosf is within 4e-7 of libm's on the reduced angle (fused_math.h), so the
          // two fp32 rotations of a pair (x0, x1) differ by up to (|x0| + |x1|) * 4e-7 plus their roundings.
          const int half = rot / 2, mate = e >= rot ? e : c.style == RopeStyle::kNeox ? (e < half ? e + half : e - half) : e ^ 1;
          const double pair = std::fabs(kn.get(c.dt, src)) + std::fabs(kn.get(c.dt, src - e + mate));
          const double scale = ks[static_cast<std::size_t>(h)];
          if (c.tables || !nearest_e4m3(kc.at(at), k32[static_cast<std::size_t>(src)] / scale, 1e-3, pair * 1e-6 / scale)) ++kdiff;
        }
        vdiff += !same_code(vc.at(at), hvc[static_cast<std::size_t>(kGuard + at)]);
        nans += nan_code(kc.at(at));
        written[static_cast<std::size_t>(at)] = 1;
      }
  }
  for (std::int64_t i = 0; i < cache_n; ++i)
    if (!written[static_cast<std::size_t>(i)]) stray += (kc.at(i) != 0xFF) + (vc.at(i) != 0xFF);
  for (std::int64_t i = 0; i < kGuard; ++i)
    stray += (kc.host[static_cast<std::size_t>(i)] != 0xFF) + (vc.host[static_cast<std::size_t>(i)] != 0xFF) +
             (kc.host[static_cast<std::size_t>(kGuard + cache_n + i)] != 0xFF) + (vc.host[static_cast<std::size_t>(kGuard + cache_n + i)] != 0xFF);
  EXPECT_EQ(kdiff, 0) << "cache K codes differ from the CPU backend's (" << kflip << " differ in all)";
  EXPECT_EQ(vdiff, 0) << "cache V codes differ from the CPU backend's";
  EXPECT_GE(nans, 1) << "the NaN key element gives a NaN code";
  EXPECT_EQ(stray, 0) << "cache bytes written outside the step's slots";
  EXPECT_EQ(qo.guards_changed(), 0);
}

TEST(FusedGpuRopeAppendFp8, CodesEqualCpuBackend) {
  std::uint64_t salt = 1200;
  run_append_fp8({256, 1, 32, 8, 128, 0, 16}, ++salt);  // a Llama-3-8B decode step
  for (DType dt : {DType::kBF16, DType::kF16})
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      run_append_fp8({3, 17, 4, 2, 128, 0, 16, dt, st}, ++salt);
      run_append_fp8({2, 5, 2, 1, 64, 32, 1, dt, st}, ++salt);                  // page_size 1, partial rotary
      run_append_fp8({3, 7, 8, 2, 48, 0, 0, dt, st}, ++salt);                   // contiguous
      run_append_fp8({2, 9, 4, 4, 256, 0, 8, dt, st, true, "scalar"}, ++salt);  // the scalar path
      run_append_fp8({3, 6, 4, 2, 128, 64, 16, dt, st, false}, ++salt);         // theta
      run_append_fp8({2, 3, 0, 3, 32, 0, 0, dt, st, false, "scalar"}, ++salt);  // theta, no q
    }
  run_append_fp8({2, 4, 2, 2, 64, 0, 4, DType::kBF16, RopeStyle::kNone}, ++salt);  // no rotary
}

TEST(FusedGpuRopeAppendFp8, ClampsDeviceLengthsAndPages) {
  run_append_fp8({3, 4, 2, 2, 64, 0, 4, DType::kBF16, RopeStyle::kNeox, true, "", true}, 1300);
  run_append_fp8({3, 4, 2, 2, 64, 0, 0, DType::kF16, RopeStyle::kInterleaved, true, "scalar", true}, 1301);
}

#if FLASHCPP_HAS_DECODE
/// CUDA rope_append_kv (positions = slots) and CUDA decode_run's append (its own kernel, or fused
/// into the split-KV kernel) write the same bytes into identical fp8 caches.
void append_fp8_equals_decode(int batch, int seqlen, int heads_q, int heads_kv, int d, int ps, DType dt, RopeStyle style,
                              bool tables, bool fused_append, std::uint64_t salt) {
  SCOPED_TRACE("b" + std::to_string(batch) + " s" + std::to_string(seqlen) + " " + std::to_string(heads_q) + "/" +
               std::to_string(heads_kv) + " d" + std::to_string(d) + " page" + std::to_string(ps) + " " + dtype_name(dt) +
               " " + rope_style_name(style) + (tables ? " tables" : " theta") + (fused_append ? " fused_append" : ""));
  std::mt19937_64 g(gpu_seed() ^ salt);
  const int capacity = seqlen + 40, pages_per_seq = ps ? (capacity + ps - 1) / ps : 0;
  const int num_pages = ps ? batch * pages_per_seq + 1 : 0, slots = ps ? pages_per_seq * ps : capacity;
  const int rows = ps ? ps : capacity, blocks = ps ? num_pages : batch;
  const std::int64_t tokens = static_cast<std::int64_t>(batch) * seqlen, cache_n = static_cast<std::int64_t>(blocks) * rows * heads_kv * d;
  constexpr int kMaxPos = 1024;
  Guarded q(tokens * heads_q * d), o(tokens * heads_q * d), kn(tokens * heads_kv * d), vn(tokens * heads_kv * d);
  Guarded len(2 * batch), bt(2 * std::max(1, batch * pages_per_seq));
  Codes kc(cache_n), vc(cache_n), kc2(cache_n), vc2(cache_n);
  q.fill_random(dt, g);
  kn.fill_random(dt, g, 2.f);
  vn.fill_random(dt, g, 2.f);
  kn.at(5) = kPoison;  // NaN in, NaN code out, on both
  for (Codes* c : {&kc, &vc})
    for (std::int64_t i = 0; i < cache_n; ++i) c->host_data()[i] = static_cast<std::uint8_t>(g() & 0x77u);  // finite keys
  kc2.host = kc.host;
  vc2.host = vc.host;
  const std::vector<float> ks = random_scales(g, heads_kv), vs = random_scales(g, heads_kv);
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch)), table(static_cast<std::size_t>(batch * pages_per_seq));
  for (auto& x : lens) x = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(slots - seqlen + 1));
  if (ps) {
    std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages));
    for (int i = 0; i < num_pages; ++i) perm[static_cast<std::size_t>(i)] = i;
    std::shuffle(perm.begin(), perm.end(), g);
    std::copy(perm.begin(), perm.begin() + static_cast<std::ptrdiff_t>(table.size()), table.begin());
  }
  std::memcpy(&len.at(0), lens.data(), lens.size() * 4);
  if (ps) std::memcpy(&bt.at(0), table.data(), table.size() * 4);
  const std::vector<float> tab = cos_sin_cache(kMaxPos, d);
  DeviceBuffer dks(ks.size() * 4), dvs(vs.size() * 4), dtab(tab.size() * 4);
  CUDA_OK(cudaMemcpy(dks.ptr, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dvs.ptr, vs.data(), vs.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dtab.ptr, tab.data(), tab.size() * 4, cudaMemcpyHostToDevice));
  for (Guarded* b : {&q, &o, &kn, &vn, &len, &bt}) ASSERT_TRUE(b->upload());
  for (Codes* c : {&kc, &vc, &kc2, &vc2}) ASSERT_TRUE(c->upload());
  RotarySpec rot = RotarySpec::of_style(style);
  if (tables && style != RopeStyle::kNone) rot.set_cos_sin_cache(static_cast<const float*>(dtab.ptr), kMaxPos, d);
  auto cache = [&](Codes& k, Codes& v) {
    KVCacheView cv;
    cv.k = bshd_view(k.data(), DType::kF8E4M3, rows, heads_kv, d);
    cv.v = bshd_view(v.data(), DType::kF8E4M3, rows, heads_kv, d);
    cv.k_scale = static_cast<const float*>(dks.ptr);
    cv.v_scale = static_cast<const float*>(dvs.ptr);
    cv.capacity = ps ? 0 : capacity;
    cv.page_size = ps;
    cv.num_pages = num_pages;
    cv.pages_per_seq = pages_per_seq;
    cv.block_table_stride = pages_per_seq;
    cv.block_table = ps ? static_cast<const std::int32_t*>(bt.data()) : nullptr;
    return cv;
  };
  RopeAppendParams a;
  a.batch = batch, a.seqlen = seqlen, a.heads_kv = heads_kv, a.head_dim = d;
  a.k_new = bshd_view(kn.data(), dt, seqlen, heads_kv, d);
  a.v_new = bshd_view(vn.data(), dt, seqlen, heads_kv, d);
  a.cache = cache(kc, vc);
  a.cache_seqlens = static_cast<const std::int32_t*>(len.data());
  a.rotary = rot;
  const Status sa = rope_append_kv(a, cuda_opt(""));
  ASSERT_TRUE(sa.ok()) << sa.to_string();

  DecodeParams p;
  p.batch = batch, p.seqlen_q = seqlen, p.heads_q = heads_q, p.heads_kv = heads_kv, p.head_dim = d;
  p.q = bshd_view(q.data(), dt, seqlen, heads_q, d);
  p.o = bshd_view(o.data(), dt, seqlen, heads_q, d);
  p.cache = cache(kc2, vc2);
  p.cache_seqlens = static_cast<const std::int32_t*>(len.data());
  p.k_new = a.k_new;
  p.v_new = a.v_new;
  p.rotary = rot;
  DecodePlanOptions po;
  po.backend = Backend::kCuda;
  po.host_cache_seqlens = lens.data();
  po.fused_append = fused_append;
  DecodeWorkspaceSize ws;
  ASSERT_TRUE(decode_workspace_size(p, po, &ws).ok());
  DeviceBuffer iw(ws.int_bytes), fw(ws.float_bytes);
  DecodePlan plan;
  const Status sp = decode_plan(p, po, iw.ptr, ws.int_bytes, fw.ptr, ws.float_bytes, &plan);
  ASSERT_TRUE(sp.ok()) << sp.to_string();
  const Status sr = decode_run(p, plan, cuda_opt(""));
  ASSERT_TRUE(sr.ok()) << sr.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  for (Codes* c : {&kc, &vc, &kc2, &vc2}) ASSERT_TRUE(c->download());
  std::int64_t kdiff = 0, vdiff = 0;
  for (std::size_t i = 0; i < kc.host.size(); ++i) kdiff += kc.host[i] != kc2.host[i], vdiff += vc.host[i] != vc2.host[i];
  EXPECT_EQ(kdiff, 0) << "K cache bytes differ from decode's append";
  EXPECT_EQ(vdiff, 0) << "V cache bytes differ from decode's append";
}

TEST(FusedGpuRopeAppendFp8, CodesEqualDecodeAppend) {
  std::uint64_t salt = 1400;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (RopeStyle st : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      append_fp8_equals_decode(3, 4, 8, 2, 128, 16, dt, st, false, false, ++salt);
      append_fp8_equals_decode(2, 1, 4, 4, 64, 0, dt, st, false, false, ++salt);
      append_fp8_equals_decode(2, 7, 2, 1, 256, 1, dt, st, true, false, ++salt);
      append_fp8_equals_decode(4, 2, 32, 8, 128, 16, dt, st, false, true, ++salt);  // the split-KV kernel appends
    }
  append_fp8_equals_decode(2, 3, 4, 2, 64, 8, DType::kBF16, RopeStyle::kNone, false, false, ++salt);
}
#endif

TEST(FusedGpuPaths, NewFusionsChosenPaths) {
  DeviceBuffer buf(1 << 20);
  QkNormRopeParams qp;
  qp.seqlen = 16, qp.heads_q = 32, qp.heads_k = 8, qp.head_dim = 128;
  qp.q = bshd_view(buf.ptr, DType::kBF16, 16, 32, 128);
  qp.k = bshd_view(buf.ptr, DType::kBF16, 16, 8, 128);
  qp.q_weight = qp.k_weight = buf.ptr;
  EXPECT_EQ(cuda::qk_norm_rope_path(qp, {}).name, "qk_norm_rope neox vec8 group=16");
  qp.head_dim = 30;
  EXPECT_EQ(cuda::qk_norm_rope_path(qp, {}).name, "qk_norm_rope neox scalar group=4");
  RopeAppendParams ap;
  ap.batch = 4, ap.seqlen = 1, ap.heads_kv = 8, ap.head_dim = 128;
  ap.k_new = ap.v_new = bshd_view(buf.ptr, DType::kBF16, 1, 8, 128);
  ap.cache.page_size = 16;
  ap.cache.num_pages = 8;
  ap.cache.k = ap.cache.v = bshd_view(buf.ptr, DType::kBF16, 16, 8, 128);
  EXPECT_EQ(cuda::rope_append_path(ap, {}).name, "rope_append_kv neox vec8 paged group=16");
  ap.cache.k.dtype = ap.cache.v.dtype = DType::kF8E4M3;  // the same kernel, codes stored
  EXPECT_EQ(cuda::rope_append_path(ap, {}).name, "rope_append_kv neox vec8 paged fp8 group=16");
}

TEST(FusedGpu, NewFusionsCapturedInCudaGraph) {
  const DType dt = DType::kBF16;
  const int tokens = 64, hq = 8, hk = 2, d = 128;
  std::mt19937_64 g(gpu_seed());
  Guarded q(tokens * hq * d), k(tokens * hk * d), w(d), kc(tokens * hk * d), vc(tokens * hk * d), len(2);
  for (Guarded* b : {&q, &k, &w}) b->fill_random(dt, g);
  len.at(0) = len.at(1) = 0;
  for (Guarded* b : {&q, &k, &w, &kc, &vc, &len}) ASSERT_TRUE(b->upload());
  QkNormRopeParams qp;
  qp.seqlen = tokens, qp.heads_q = hq, qp.heads_k = hk, qp.head_dim = d;
  qp.q = bshd_view(q.data(), dt, tokens, hq, d);
  qp.k = bshd_view(k.data(), dt, tokens, hk, d);
  qp.q_weight = qp.k_weight = w.data();
  RopeAppendParams ap;
  ap.batch = 1, ap.seqlen = tokens, ap.heads_kv = hk, ap.head_dim = d;
  ap.k_new = ap.v_new = bshd_view(k.data(), dt, tokens, hk, d);
  ap.cache.capacity = tokens;
  ap.cache.k = bshd_view(kc.data(), dt, tokens, hk, d);
  ap.cache.v = bshd_view(vc.data(), dt, tokens, hk, d);
  ap.cache_seqlens = static_cast<const std::int32_t*>(len.data());
  ap.rotary = RotarySpec{};  // k is already rotated by qk_norm_rope: copy it
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ASSERT_TRUE(qk_norm_rope(qp, cuda_opt("", s)).ok());  // warm the device-property cache
  CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const Status a = qk_norm_rope(qp, cuda_opt("", s));
  const Status b = rope_append_kv(ap, cuda_opt("", s));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  ASSERT_TRUE(a.ok() && b.ok()) << a.to_string() << b.to_string();
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  ASSERT_TRUE(k.download() && kc.download());
  EXPECT_TRUE(k.host == kc.host) << "the appended K is not the normed, rotated k";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace flashcpp::testing
#else
FLASHCPP_GPU_TESTS_LEFT_OUT(FusedGpu, "fused")
#endif
