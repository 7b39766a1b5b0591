// GPU tests of the prefill kernels (sm90 wgmma path and sm80 mma.sync path) against the fp64 GPU reference (which the CPU tests and
// the harness check against the CPU fp64 reference on small sizes). Fresh random inputs each run
// (seed printed), outputs poisoned with NaN, tolerance atol = rtol = 1e-2 (docs/tolerances.md).
#include <cstring>

#include "gpu_util.h"

#if FLASHCPP_HAS_SM80 || FLASHCPP_HAS_SM90
namespace flashcpp::testing {
namespace {

struct Case {
  int b, sq, sk, hq, hkv, d;
  bool causal = false;
  DType dt = DType::kBF16;
  bool sdpa_layout = false;
  int wl = -1, wr = -1;
  std::string config;  // empty: tuned choice
  int dv = 0;          // head_dim_v of v and o; 0 = d
  int vdim() const { return dv ? dv : d; }
};

std::string describe(const Case& c) {
  return "b" + std::to_string(c.b) + " sq" + std::to_string(c.sq) + " sk" + std::to_string(c.sk) + " hq" +
         std::to_string(c.hq) + " hkv" + std::to_string(c.hkv) + " d" + std::to_string(c.d) +
         (c.dv && c.dv != c.d ? " dv" + std::to_string(c.dv) : "") +
         (c.causal ? " causal" : "") + (c.dt == DType::kBF16 ? " bf16" : " fp16") + (c.sdpa_layout ? " sdpa" : "") +
         " wl" + std::to_string(c.wl) + " wr" + std::to_string(c.wr) + (c.config.empty() ? "" : " cfg " + c.config);
}

constexpr double kAtol = 1e-2, kRtol = 1e-2, kLseAtol = 1e-3;
/// Case::config value that forces the sm80 kernel (with its tuned config) on any device.
const std::string kSm80 = "sm80";
/// Every suite runs on both paths: the automatic choice (the sm90 kernel on Hopper) and sm80 (when
/// the build holds it: FLASHCPP_WITH_SM80).
#if FLASHCPP_HAS_SM80
const std::string kPaths[] = {"", kSm80};
#else
const std::string kPaths[] = {""};
#endif

TensorView make_view(void* ptr, DType dt, const Case& c, int seqlen, int heads, int dim) {
  return c.sdpa_layout ? bhsd_view(ptr, dt, seqlen, heads, dim) : bshd_view(ptr, dt, seqlen, heads, dim);
}

/// Runs one case; returns the output bits (in the tensor's own layout) for determinism checks.
void run_case(const Case& c, std::uint64_t salt, std::vector<std::uint16_t>* bits_out = nullptr) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const std::int64_t nq = static_cast<std::int64_t>(c.b) * c.sq * c.hq * c.d;
  const std::int64_t nk = static_cast<std::int64_t>(c.b) * c.sk * c.hkv * c.d;
  const int dv = c.vdim();
  const std::int64_t nv = static_cast<std::int64_t>(c.b) * c.sk * c.hkv * dv;
  const std::int64_t no = static_cast<std::int64_t>(c.b) * c.sq * c.hq * dv;
  auto hq = random_half_bits(nq, c.dt, g), hk = random_half_bits(nk, c.dt, g), hv = random_half_bits(nv, c.dt, g);
  DeviceBuffer q(nq * 2), k(nk * 2), v(nv * 2), o(no * 2), lse(sizeof(float) * c.b * c.hq * c.sq);
  DeviceBuffer oref(sizeof(double) * no), lseref(sizeof(double) * c.b * c.hq * c.sq);
  ASSERT_TRUE(q.ptr && k.ptr && v.ptr && o.ptr && lse.ptr && oref.ptr && lseref.ptr);
  CUDA_OK(cudaMemcpy(q.ptr, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(k.ptr, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(v.ptr, hv.data(), nv * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(o.ptr, 0xFF, no * 2));  // NaN in fp16 and bf16
  CUDA_OK(cudaMemset(lse.ptr, 0xFF, lse.bytes));

  AttnParams p;
  p.batch = c.b; p.seqlen_q = c.sq; p.seqlen_k = c.sk; p.heads_q = c.hq; p.heads_kv = c.hkv; p.head_dim = c.d;
  p.head_dim_v = c.dv;
  p.q = make_view(q.ptr, c.dt, c, c.sq, c.hq, c.d);
  p.k = make_view(k.ptr, c.dt, c, c.sk, c.hkv, c.d);
  p.v = make_view(v.ptr, c.dt, c, c.sk, c.hkv, dv);
  p.o = make_view(o.ptr, c.dt, c, c.sq, c.hq, dv);
  p.lse = static_cast<float*>(lse.ptr);
  p.mask.causal = c.causal;
  p.mask.window_left = c.wl;
  p.mask.window_right = c.wr;
  RunOptions opt;
  opt.backend = Backend::kCuda;
  opt.cuda_config = c.config;
  if (c.config == kSm80) {  // the sm80 kernel's tuned choice, even on a Hopper device
    cuda::DeviceInfo dev;
    ASSERT_TRUE(cuda::current_device(&dev).ok());
    opt.cuda_config = cuda::prefill_sm80_pick(p, dev);
  }
  KernelChoice choice;
  const Status sel = select_kernel(p, opt, &choice);
  if (left_out_of_build(sel)) GTEST_SKIP() << sel.message();  // e.g. no sm80 kernels on an sm_80 device
  ASSERT_TRUE(sel.ok()) << sel.to_string();
  const Status st = attention_forward(p, opt);
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  const Status rs = cuda::reference_attention_f64(p, static_cast<double*>(oref.ptr), static_cast<double*>(lseref.ptr), nullptr);
  ASSERT_TRUE(rs.ok()) << rs.to_string();

  std::vector<std::uint16_t> ho(no);
  std::vector<float> hlse(c.b * c.hq * c.sq);
  std::vector<double> ro(no), rlse(c.b * c.hq * c.sq);
  CUDA_OK(cudaMemcpy(ho.data(), o.ptr, no * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hlse.data(), lse.ptr, lse.bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(ro.data(), oref.ptr, oref.bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(rlse.data(), lseref.ptr, lseref.bytes, cudaMemcpyDeviceToHost));

  double max_abs = 0, worst_viol = -1;
  std::int64_t bad = 0, nan = 0;
  for (int b = 0; b < c.b; ++b)
    for (int i = 0; i < c.sq; ++i)
      for (int h = 0; h < c.hq; ++h)
        for (int d = 0; d < dv; ++d) {
          const std::int64_t idx = b * p.o.batch_stride + i * p.o.seq_stride + h * p.o.head_stride + d;
          const double out = bits_to_float(ho[idx], c.dt);
          const double ref = ro[((static_cast<std::int64_t>(b) * c.sq + i) * c.hq + h) * dv + d];
          if (std::isnan(out)) { ++nan; continue; }
          const double err = std::fabs(out - ref);
          max_abs = std::max(max_abs, err);
          worst_viol = std::max(worst_viol, err - (kAtol + kRtol * std::fabs(ref)));
          bad += err > kAtol + kRtol * std::fabs(ref);
        }
  double lse_err = 0;
  std::int64_t lse_bad = 0;
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.hq; ++h)
      for (int i = 0; i < c.sq; ++i) {
        const double out = hlse[(static_cast<std::int64_t>(b) * c.hq + h) * c.sq + i];
        const double ref = rlse[h * static_cast<std::int64_t>(c.b) * c.sq + static_cast<std::int64_t>(b) * c.sq + i];
        if (std::isinf(ref) && ref < 0) { lse_bad += !(std::isinf(out) && out < 0); continue; }
        const double e = std::fabs(out - ref);
        if (std::isnan(out) || e > kLseAtol) ++lse_bad;
        if (!std::isnan(e)) lse_err = std::max(lse_err, e);
      }
  EXPECT_EQ(nan, 0) << "NaN (unwritten or poisoned) outputs";
  EXPECT_EQ(bad, 0) << "elements over tolerance; max_abs_err " << max_abs;
  EXPECT_EQ(lse_bad, 0) << "LSE rows over " << kLseAtol << "; max " << lse_err;
  ::testing::Test::RecordProperty("max_abs_err", std::to_string(max_abs));
  std::printf("    %-70s %-16s max_abs_err %.3e  lse_err %.3e\n", describe(c).c_str(), kernel_name(choice.id), max_abs,
              lse_err);
  if (bits_out) *bits_out = std::move(ho);
}

TEST(Prefill, CourseShapes) {
  const int shapes[][4] = {{1, 8, 512, 64}, {1, 8, 2048, 64}, {4, 32, 4096, 128}, {1, 8, 8192, 128}, {2, 16, 16384, 64}};
  std::uint64_t salt = 1;
  for (auto& s : shapes)
    for (bool causal : {false, true})
      for (DType dt : {DType::kBF16, DType::kF16})
        for (const auto& path : kPaths) {
          Case c{s[0], s[2], s[2], s[1], s[1], s[3], causal, dt};
          c.config = path;
          run_case(c, salt++);
        }
}

TEST(Prefill, OddSizesAllHeadDims) {
  std::uint64_t salt = 100;
  for (int d : {64, 128, 256})
    for (int n : {1, 17, 1000, 4097})
      for (bool causal : {false, true})
        for (const auto& path : kPaths) {
          Case c{2, n, n, 3, 3, d, causal};
          c.config = path;
          run_case(c, salt++);
        }
}

void run_paths(Case c, std::uint64_t salt) {
  for (const auto& path : kPaths) {
    c.config = path;
    run_case(c, salt);
  }
}

TEST(Prefill, GqaMqaAndUnequalLengths) {
  run_paths(Case{1, 1024, 1024, 32, 8, 128, true}, 200);
  run_paths(Case{2, 777, 777, 8, 1, 64, false, DType::kF16}, 201);
  for (bool causal : {false, true}) {
    run_paths(Case{1, 1000, 4097, 4, 2, 128, causal}, 202 + causal);
    run_paths(Case{1, 4097, 1000, 4, 2, 128, causal}, 204 + causal);
    run_paths(Case{2, 1, 3000, 8, 8, 64, causal}, 206 + causal);
  }
  run_paths(Case{1, 2048, 2048, 8, 8, 256, true}, 208);
}

TEST(Prefill, SdpaLayoutThroughStrides) {
  run_paths(Case{2, 1000, 1000, 4, 4, 128, true, DType::kBF16, true}, 300);
  run_paths(Case{1, 513, 1025, 8, 2, 64, false, DType::kF16, true}, 301);
}

TEST(Prefill, SlidingWindows) {
  std::uint64_t salt = 400;
  const int windows[][2] = {{256, 0}, {0, 0}, {100, 37}, {5000, -1}, {-1, 64}, {1, 1}};
  for (auto& w : windows)
    for (bool causal : {false, true}) {
      Case c{1, 1500, 1500, 4, 2, 128, causal};
      c.wl = w[0], c.wr = w[1];
      run_paths(c, salt++);
      c.sq = 700;  // seqlen_q != seqlen_k with a window
      run_paths(c, salt++);
    }
}

/// Every compiled config this device runs for head dims (d, dv) (dv 0: d): the sm80 kernel's and,
/// on Hopper, those of the pair's sm90 class that take head dim d.
std::vector<std::string> all_configs(int d, int dv = 0) {
  auto v = cuda::prefill_sm80_configs(d);
#if FLASHCPP_HAS_SM90
  if (sm90_device())
    for (const auto& c : cuda::prefill_sm90_configs(d, dv))
      if (sm90_config_takes(c, d)) v.push_back(c);
#endif
  return v;
}

TEST(Prefill, EveryCompiledConfig) {
  std::uint64_t salt = 500;
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  for (int d : {64, 128, 256})
    for (const auto& cfg : all_configs(d))
      for (bool causal : {false, true})
        for (DType dt : {DType::kBF16, DType::kF16}) {
          Case c{2, 777, 1025, 4, 2, d, causal, dt};
          c.config = cfg;
          run_case(c, salt++);
        }
}

TEST(Prefill, BitwiseDeterministic) {
  for (const auto& path : kPaths) {
    std::vector<std::uint16_t> first, again;
    Case c{1, 2047, 2047, 8, 8, 128, true};  // not a multiple of any tile size
    c.config = path;
    run_case(c, 600, &first);
    for (int r = 0; r < 5; ++r) {
      run_case(c, 600, &again);  // same salt: same inputs
      ASSERT_EQ(std::memcmp(first.data(), again.data(), first.size() * 2), 0) << "run " << r << " differs";
    }
  }
}

#if FLASHCPP_HAS_SM90
/// Runs each case on t.config and on its twin with the same inputs (same salt) and expects equal
/// outputs, bit for bit. Returns the cases compared.
int expect_equals_twin(const Sm90Twin& t, std::initializer_list<Case> cases, std::uint64_t salt) {
  int compared = 0;
  for (Case c : cases) {
    // Lean-mask configs run no window (the selector refuses it; LeanMaskEqualsTheGeneralPath), a
    // "_k96" twin no head dim above 96 (QkTwinEqualsTheWholeClass).
    if (t.config.find("_lean") != std::string::npos && (c.wl >= 0 || c.wr >= 0)) continue;
    if (!sm90_config_takes(t.config, c.d)) continue;
    std::vector<std::uint16_t> a, b;
    c.config = t.config;
    run_case(c, ++salt, &a);
    c.config = t.twin;
    run_case(c, salt, &b);  // same salt: same inputs
    EXPECT_EQ(a.size(), b.size());
    EXPECT_TRUE(a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 2) == 0)
        << describe(c) << ": " << t.config << " differs from " << t.twin;
    ++compared;
  }
  return compared;
}
#endif

// A persistent sm90 config computes every tile exactly as its non-persistent twin (same consumer
// code, only the tile order, the loads' overlap and the TMA-store epilogue differ): the outputs
// must be equal bit for bit. Shapes with more tiles than SMs (several tiles per CTA), several L2
// head groups (long K/V), GQA, causal, a causal window in fp16, and odd lengths. The automatic
// choice takes the persistent twin for large causal problems (prefer_persistent).
TEST(Prefill, PersistentEqualsItsTwinBitForBit) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  int compared = 0;
  for (int d : {64, 128, 256})
    for (const Sm90Twin& t : sm90_twins(d, "_persist"))
      compared += expect_equals_twin(t,
                                     {Case{2, 2047, 2047, 8, 8, d, true}, Case{2, 777, 1025, 4, 2, d, false},
                                      Case{2, 1100, 16384, 8, 2, d, true}, Case{3, 1, 300, 4, 4, d, true},
                                      Case{2, 3000, 3000, 8, 4, d, true, DType::kF16, false, 700, -1},
                                      // ~16 tiles per CTA: each Q buffer's barriers wrap their phases
                                      Case{16, 515, 515, 32, 8, d, true}},
                                     700 + d);
  // The sm90 192 / 128 class (fa3_hd192.cu), at its own pair and padded.
  auto dv = [](Case c, int v) {
    c.dv = v;
    return c;
  };
  for (const auto& [d, v] : {std::pair{192, 128}, {160, 96}})
    for (const Sm90Twin& t : sm90_twins(d, "_persist", v))
      compared += expect_equals_twin(t,
                                     {dv(Case{2, 2047, 2047, 8, 8, d, true}, v), dv(Case{2, 777, 1025, 4, 2, d, false}, v),
                                      dv(Case{2, 1100, 16384, 8, 2, d, true}, v), dv(Case{3, 1, 300, 4, 4, d, true}, v),
                                      dv(Case{2, 3000, 3000, 8, 4, d, true, DType::kF16, false, 700, -1}, v),
                                      dv(Case{16, 515, 515, 32, 8, d, true}, v)},  // ~16 tiles per CTA
                                     760 + d);
  EXPECT_GT(compared, 0) << "no persistent sm90 config compiled";
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// The lean-mask configs (TileConfig::lean_mask: only the causal and sequence-end masks; d64's
// 192-row tile and its persistent twin, d128's default and persistent twin, d256's persistent one:
// the automatic choice wherever the masks allow) compute every score, max and sum as the general
// config of the same tile: the element mask sets the same scores to -inf, from two rule registers
// instead of the general path. Their outputs must be equal bit for
// bit, and each passes the fp64 check of run_case. Odd lengths (partial first and last tiles, a
// single row), q longer and shorter than k under causal (rows that see no key), GQA and MQA, fp16,
// the SDPA layout; the persistent ones also with ~10 tiles per CTA (d64's against the lean
// non-persistent config: no general 192-row persistent config is built).
TEST(Prefill, LeanMaskEqualsTheGeneralPathBitForBit) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  int compared = 0, configs = 0, persistent = 0;
  std::uint64_t salt = 2800;
  for (int d : {64, 128, 256}) {
    const std::vector<std::string> names = cuda::prefill_sm90_configs(d);
    for (const std::string& lean : names) {
      const std::size_t at = lean.find("_lean");
      if (at == std::string::npos || lean.find("_k") != std::string::npos) continue;  // Q K^T twins: below
      ++configs;
      std::string twin = lean.substr(0, at) + lean.substr(at + 5);  // the general config, persistent if lean is
      if (std::find(names.begin(), names.end(), twin) == names.end()) twin = lean.substr(0, lean.find("_persist"));
      const Sm90Twin t{lean, twin};
      for (bool causal : {false, true}) {
        compared += expect_equals_twin(t,
                                       {Case{2, 1, 1, 3, 3, d, causal}, Case{2, 17, 17, 3, 3, d, causal},
                                        Case{1, 1000, 1000, 4, 2, d, causal}, Case{1, 4097, 4097, 4, 1, d, causal},
                                        Case{1, 1000, 4097, 4, 2, d, causal}, Case{1, 4097, 1000, 4, 2, d, causal},
                                        Case{2, 777, 777, 8, 1, d, causal, DType::kF16},
                                        Case{1, 513, 1025, 8, 2, d, causal, DType::kF16, true}},
                                       salt);
        salt += 20;
      }
      if (lean.find("_persist") != std::string::npos && ++persistent)
        compared += expect_equals_twin(t, {Case{2, 1100, 16384, 8, 2, d, true}, Case{16, 515, 515, 32, 8, d, true, DType::kF16}},
                                       salt += 20);
    }
  }
  EXPECT_GE(configs, 1) << "the lean d64 config is not compiled";
  EXPECT_EQ(compared, configs * 16 + persistent * 2);  // every case ran: no window among them
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// The Q K^T twins ("_k<N>": Q K^T over the first N dims of the class, Fa3Config::kQkDims; the 128
// class's _k96 and its persistent twin) give the bits of the
// class's configs at every head dim up to N (the columns past it are zeros on both sides), with
// head_dim_v anywhere in the class; each also passes run_case's fp64 check. The automatic choice
// takes _k96 for head dims up to 96 (Selector.Sm90QkTwinsServeHeadDimsUpTo96).
TEST(Prefill, QkTwinEqualsTheWholeClassBitForBit) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  std::uint64_t salt = 3000;
  auto dv = [](Case c, int v) {
    c.dv = v;
    return c;
  };
  int k96 = 0;
  for (int cls : {64, 128, 256})
    for (const std::string& cfg : cuda::prefill_sm90_configs(cls)) {
      const std::size_t at = cfg.find("_k");
      if (at == std::string::npos) continue;
      const std::size_t end = cfg.find('_', at + 2);
      const int n = std::stoi(cfg.substr(at + 2, end == std::string::npos ? std::string::npos : end - at - 2));
      const Sm90Twin t{cfg, cfg.substr(0, at) + (end == std::string::npos ? "" : cfg.substr(end))};
      SCOPED_TRACE(cfg + " against " + t.twin);
      int compared = 0;
      // Head dims up to n, multiples of 8, down to the class below (or 8).
      for (int d = n; d > (cls == 64 ? 0 : cls / 2) && d >= n - 24; d -= 8)
        for (bool causal : {false, true}) {
          compared += expect_equals_twin(t,
                                         {Case{2, 777, 1025, 4, 2, d, causal}, Case{1, 1, 300, 4, 4, d, causal},
                                          Case{1, 4097, 1000, 4, 1, d, causal, DType::kF16},
                                          Case{2, 513, 513, 8, 8, d, causal, DType::kBF16, true},
                                          dv(Case{1, 1000, 1000, 4, 2, d, causal}, cls), dv(Case{1, 700, 900, 2, 2, d, causal}, n)},
                                         salt);
          salt += 10;
        }
      if (cfg.find("_persist") != std::string::npos)  // ~16 tiles per CTA
        compared += expect_equals_twin(t, {Case{16, 515, 515, 32, 8, n, true}, Case{2, 1100, 16384, 8, 2, n - 8, true}}, salt++);
      EXPECT_GE(compared, 2 * 6) << cfg;
      k96 += cfg.rfind("sm90_m128n128s2p_k96", 0) == 0;
    }
  EXPECT_EQ(k96, 2) << "the 128 class's _k96 twins (default and persistent)";
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

#if FLASHCPP_HAS_SM90
/// The automatic choice's config for a dense bf16 problem with equal lengths (select_kernel
/// validates and picks, it launches nothing; the buffers only have to be large enough).
std::string auto_config(const DeviceBuffer& q, const DeviceBuffer& k, const DeviceBuffer& v, const DeviceBuffer& o,
                        int batch, int heads, int seqlen, int head_dim, bool causal) {
  AttnParams p = attn_params(batch, seqlen, seqlen, heads, heads, head_dim, DType::kBF16, false, q.ptr, k.ptr, v.ptr, o.ptr);
  p.mask.causal = causal;
  RunOptions opt;
  opt.backend = Backend::kCuda;
  KernelChoice ch;
  const Status st = select_kernel(p, opt, &ch);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return ch.config;
}
#endif

// The automatic sm90 choice (fa3_dispatch.cc, prefer_persistent): the persistent twin for a
// causal problem whose work units (two row blocks each) fill their last wave of SMs at least 3/4
// full; the plain default for a non-causal one, a small causal one, or one whose units leave a
// ragged last wave. Heads count in SMs, so the fill is exact on any device.
TEST(Prefill, AutoChoiceTakesThePersistentTwinForLargeCausalProblems) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  const int heads_max = 2 * dev.num_sms;
  const std::int64_t elems = std::int64_t{512} * heads_max * 128;
  DeviceBuffer q(elems * 2), k(elems * 2), v(elems * 2), o(elems * 2);
  auto pick = [&](int heads, int seqlen, bool causal) { return auto_config(q, k, v, o, 1, heads, seqlen, 128, causal); };
  auto persistent = [](const std::string& c) { return c.find("_persist") != std::string::npos; };
  const int sms = dev.num_sms;
  EXPECT_TRUE(persistent(pick(sms, 512, true))) << pick(sms, 512, true);          // 2 x SMs units: two full waves
  EXPECT_TRUE(persistent(pick(2 * sms, 256, true))) << pick(2 * sms, 256, true);  // one unit per head: 2 x SMs units
  EXPECT_TRUE(persistent(pick(sms, 512, false))) << pick(sms, 512, false);        // non-causal, short tiles
  EXPECT_FALSE(persistent(pick(8, 16384, false))) << pick(8, 16384, false);       // 128 key tiles per tile
  EXPECT_FALSE(persistent(pick(8, 16384, true))) << pick(8, 16384, true);         // 64 on average
  EXPECT_FALSE(persistent(pick(16, 256, true))) << pick(16, 256, true);           // 16 units
  EXPECT_FALSE(persistent(pick(sms + 8, 256, true))) << pick(sms + 8, 256, true); // SMs + 8 units: a second wave of 8
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// The automatic d64 choice (fa3_dispatch.cc, suits): the 192-row three-consumer tile for large
// problems (non-causal: where its per-row gain beats its coarser waves; causal: from 10 of its
// tiles per SM), the 128-row config (persistent when causal and large enough) otherwise.
TEST(Prefill, AutoChoiceTakesTheWideD64TileForLargeProblems) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  const int big = 192 * ((10 * dev.num_sms + 15) / 16);  // 16 heads x big / 192 tiles >= 10 x SMs
  const std::int64_t elems = std::max<std::int64_t>(std::int64_t{big} * 16, std::int64_t{dev.num_sms} * 128 * 16) * 64;
  DeviceBuffer q(elems * 2), k(elems * 2), v(elems * 2), o(elems * 2);
  auto pick = [&](int batch, int seqlen, bool causal) { return auto_config(q, k, v, o, batch, 16, seqlen, 64, causal); };
  EXPECT_EQ(pick(1, big, false), "sm90_m192n128s4p_lean");  // lean masks: no window or modifier here
  EXPECT_EQ(pick(1, big, true), "sm90_m192n128s4p_lean");
  // Half as many: causal takes the 192-row lean persistent twin (a tile walks 32 key tiles on
  // average: the persistent rule's limit).
  EXPECT_EQ(pick(1, big / 2, true), "sm90_m192n128s4p_lean_persist");
  // Sequences of 128 rows: a 192-row tile would only add empty rows.
  EXPECT_EQ(pick(dev.num_sms, 128, false).rfind("sm90_m128n128s4p", 0), 0u) << pick(dev.num_sms, 128, false);
  // Short sequences in large batches: causal takes the 192-row lean persistent twin ((16,32,1024,64)
  // causal: 1.17x the 128-row persistent twin on an H100), non-causal the 128-row persistent twin
  // (sm90_short_for_wide_tile; the 192-row one is not measured there).
  const int wide_batch = (10 * dev.num_sms + 6 * 16 - 1) / (6 * 16);  // 6 wide tiles a head of 1024: >= 10 x SMs
  EXPECT_EQ(pick(wide_batch, 1024, true), "sm90_m192n128s4p_lean_persist");
  EXPECT_EQ(pick(2 * dev.num_sms / 16, 512, false), "sm90_m128n128s4p_persist");
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// Every key of a row scores the same large value (s = 64 a_i, 1024..3968 raw; m * scale * log2 e
// ~ 130..510), so the row max never moves after the first key tile. The running O and l must then
// keep their scale exactly: an online softmax that rescales by exp2(m_old * c - m * c) computed as
// one FMA multiplies them by exp2(rounding residual of m * c) on every tile, and with 256 tiles
// (sm80's 32-key tiles) the LSE drifts by ~1e-3 (the numerics audit found 1e-2 at 32k keys).
// Exact LSE here is s * scale + ln(n), and the fp64 reference gives it; the bound, 1e-4, is the
// fp32 rounding of LSE ~ 360 plus the few rescales of the first tiles, well under that drift.
TEST(Prefill, LseHoldsWhileTheRowMaxStaysPut) {
  constexpr int kSq = 128, kSk = 8192, kD = 128;
  std::mt19937_64 g(gpu_seed() ^ 0x5EEDull);
  std::vector<std::uint16_t> hq(static_cast<std::size_t>(kSq) * kD, 0), hk(static_cast<std::size_t>(kSk) * kD, 0);
  for (int i = 0; i < kSq; ++i)  // a_i in 16..62 (exact in bf16), scores 64 a_i
    hq[static_cast<std::size_t>(i) * kD] = float_to_bf16_bits(static_cast<float>(16 + (i * 7) % 47));
  for (int j = 0; j < kSk; ++j) hk[static_cast<std::size_t>(j) * kD] = float_to_bf16_bits(64.f);
  auto hv = random_half_bits(static_cast<std::int64_t>(kSk) * kD, DType::kBF16, g);
  DeviceBuffer q(hq.size() * 2), k(hk.size() * 2), v(hv.size() * 2), o(hq.size() * 2), lse(sizeof(float) * kSq);
  DeviceBuffer oref(sizeof(double) * hq.size()), lseref(sizeof(double) * kSq);
  ASSERT_TRUE(q.ptr && k.ptr && v.ptr && o.ptr && lse.ptr && oref.ptr && lseref.ptr);
  CUDA_OK(cudaMemcpy(q.ptr, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(k.ptr, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(v.ptr, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  AttnParams p = attn_params(1, kSq, kSk, 1, 1, kD, DType::kBF16, false, q.ptr, k.ptr, v.ptr, o.ptr);
  p.lse = static_cast<float*>(lse.ptr);
  ASSERT_TRUE(
      cuda::reference_attention_f64(p, static_cast<double*>(oref.ptr), static_cast<double*>(lseref.ptr), nullptr).ok());
  std::vector<double> rlse(kSq), ro(hq.size());
  CUDA_OK(cudaMemcpy(rlse.data(), lseref.ptr, lseref.bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(ro.data(), oref.ptr, oref.bytes, cudaMemcpyDeviceToHost));
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  int ran = 0;
  for (const std::string& cfg : all_configs(kD)) {
    SCOPED_TRACE(cfg);
    CUDA_OK(cudaMemset(o.ptr, 0xFF, o.bytes));
    CUDA_OK(cudaMemset(lse.ptr, 0xFF, lse.bytes));
    RunOptions opt;
    opt.backend = Backend::kCuda;
    opt.cuda_config = cfg;
    const Status st = attention_forward(p, opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    std::vector<float> hl(kSq);
    std::vector<std::uint16_t> ho(hq.size());
    CUDA_OK(cudaMemcpy(hl.data(), lse.ptr, lse.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(ho.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost));
    double lse_err = 0, o_err = 0;
    for (int i = 0; i < kSq; ++i) {
      const double e = std::fabs(static_cast<double>(hl[i]) - rlse[i]);
      lse_err = std::isnan(e) ? INFINITY : std::max(lse_err, e);
    }
    for (std::size_t x = 0; x < ho.size(); ++x) {
      const double e = std::fabs(bits_to_float(ho[x], DType::kBF16) - ro[x]) - (kAtol + kRtol * std::fabs(ro[x]));
      o_err = std::isnan(e) ? INFINITY : std::max(o_err, e);
    }
    EXPECT_LT(lse_err, 1e-4) << "LSE drifted (reference LSE ~" << rlse[0] << ")";
    EXPECT_LE(o_err, 0.0) << "O over atol + rtol |ref| by " << o_err;
    std::printf("    %-28s lse_err %.3e\n", cfg.c_str(), lse_err);
    ++ran;
  }
  EXPECT_GT(ran, 0);
}

TEST(Prefill, EmptyProblemsWriteNothingAndNoKeysGiveZero) {
  DeviceBuffer o(1024 * 2);
  CUDA_OK(cudaMemset(o.ptr, 0x5A, 1024 * 2));
  AttnParams p;
  p.batch = 0; p.seqlen_q = 16; p.seqlen_k = 16; p.heads_q = 1; p.heads_kv = 1; p.head_dim = 64;
  p.q = p.k = p.v = p.o = bshd_view(o.ptr, DType::kBF16, 16, 1, 64);
  RunOptions opt;
  opt.backend = Backend::kCuda;
  ASSERT_TRUE(attention_forward(p, opt).ok());
  std::vector<std::uint8_t> h(1024 * 2);
  CUDA_OK(cudaMemcpy(h.data(), o.ptr, h.size(), cudaMemcpyDeviceToHost));
  for (auto x : h) ASSERT_EQ(x, 0x5A);
}

// Varlen with batch 0 (cu_seqlens = [0]) and mask.total_q = 8: every packed row is uncovered,
// and O = 0, LSE = -inf on both kernel families (attention.h), by one small kernel on the stream:
// nothing allocated, no synchronization, so it is captured into a CUDA graph and replayed too.
// q, k and v are null (never read). Before, nothing was written: the torch.empty output of the
// Python wrapper came back as 3.4e38 and NaN. With total_q = 0 (unknown) nothing is written.
TEST(Prefill, VarlenBatchZeroFillsEveryPackedRow) {
  constexpr int kRows = 8, kHeads = 16, kD = 128;
  DeviceBuffer o(kRows * kHeads * kD * 2), lse(sizeof(float) * kRows * kHeads), cu(sizeof(std::int32_t));
  ASSERT_TRUE(o.ptr && lse.ptr && cu.ptr);
  CUDA_OK(cudaMemset(cu.ptr, 0, sizeof(std::int32_t)));
  AttnParams p = attn_params(0, 0, 0, kHeads, kHeads, kD, DType::kBF16, true, nullptr, nullptr, nullptr, o.ptr);
  p.lse = static_cast<float*>(lse.ptr);
  p.mask.cu_seqlens_q = p.mask.cu_seqlens_k = static_cast<const std::int32_t*>(cu.ptr);
  auto check = [&](bool filled) {
    std::vector<std::uint16_t> ho(kRows * kHeads * kD);
    std::vector<float> hl(kRows * kHeads);
    CUDA_OK(cudaMemcpy(ho.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hl.data(), lse.ptr, lse.bytes, cudaMemcpyDeviceToHost));
    for (std::uint16_t x : ho) ASSERT_EQ(x, filled ? 0 : 0xFFFF);
    for (float x : hl) ASSERT_TRUE(filled ? x == -INFINITY : std::isnan(x)) << x;
  };
  for (const std::string& path : kPaths) {
    SCOPED_TRACE(path.empty() ? "auto" : path);
    RunOptions opt;
    opt.backend = Backend::kCuda;
    opt.cuda_config = path;
    p.mask.total_q = 0;
    CUDA_OK(cudaMemset(o.ptr, 0xFF, o.bytes));
    CUDA_OK(cudaMemset(lse.ptr, 0xFF, lse.bytes));
    ASSERT_TRUE(attention_forward(p, opt).ok());
    CUDA_OK(cudaDeviceSynchronize());
    check(false);
    p.mask.total_q = kRows;
    ASSERT_TRUE(attention_forward(p, opt).ok());
    CUDA_OK(cudaDeviceSynchronize());
    check(true);
    // The same inside a CUDA graph (capture, re-poison, replay).
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    opt.stream = stream;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status st = attention_forward(p, opt);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(st.ok()) << st.to_string();
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    // re-poisoned on the graph's stream: a non-blocking stream does not wait for cudaMemset's
    CUDA_OK(cudaMemsetAsync(o.ptr, 0xFF, o.bytes, stream));
    CUDA_OK(cudaMemsetAsync(lse.ptr, 0xFF, lse.bytes, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    check(true);
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Every head dim runs in its class (attention.h, cuda_head_dim_class): the columns past a tensor's
// own head dim load as zeros and are never stored. o is poisoned with NaN and laid out at exactly
// head_dim_v, packed against its neighbours (bshd and the sdpa layout): a write past a row's own
// columns would land on the next head's row and show as a wrong element, an unwritten one as NaN.
TEST(Prefill, EveryHeadDimRunsPaddedToItsClass) {
  std::uint64_t salt = 900;
  for (int d = 8; d <= 256; d += 8) {
    const bool causal = d % 16 == 0;
    Case c{1, 300, 333, 4, 2, d, causal, d % 24 == 0 ? DType::kF16 : DType::kBF16, d % 40 == 0};
    run_paths(c, salt++);
  }
  // head_dim_v != head_dim (DeepSeek's 192/128 and others), GQA, odd lengths, both layouts.
  const int pairs[][2] = {{192, 128}, {128, 64}, {64, 128}, {96, 80}, {40, 256}, {256, 24}};
  for (const auto& pr : pairs)
    for (bool causal : {false, true}) {
      Case c{2, 257, 600, 8, 2, pr[0], causal, DType::kBF16, causal};
      c.dv = pr[1];
      run_paths(c, salt++);
    }
}

// Every compiled config of the 128 class at head dims 96 and 80 (both epilogues: the coalesced
// stores and, in the persistent configs, the TMA store through the map's own bounds), and at
// 192 / 128 of the sm80 kernel's 256 class and the sm90 kernel's 192 / 128 class.
TEST(Prefill, EveryConfigOfAClassAtAPaddedHeadDim) {
  std::uint64_t salt = 950;
  const int dims[][2] = {{96, 96}, {80, 80}, {192, 128}};
  for (const auto& dd : dims)
    for (const auto& cfg : all_configs(dd[0], dd[1]))
      for (bool causal : {false, true}) {
        Case c{2, 777, 1025, 4, 2, dd[0], causal, causal ? DType::kF16 : DType::kBF16};
        c.dv = dd[1];
        c.config = cfg;
        run_case(c, salt++);
      }
}

// DeepSeek-V2/V3's head dims, q/k 192 with v/o 128, and pairs padded to them (q/k in (128, 192],
// v/o up to 128): on Hopper the sm90 kernel's own 192 / 128 class (fa3_hd192.cu), on the sm80
// kernel the 256 class. Odd lengths (1, 7, 127, 1000: a partial tile, a single row, one short of a
// tile, several tiles with a partial last one), causal and not, GQA and MQA, both layouts, both
// dtypes, sq != sk, a window; o poisoned with NaN and laid out at exactly head_dim_v.
TEST(Prefill, HeadDims192By128RunInTheSm90Class) {
  std::uint64_t salt = 2000;
  const int pairs[][2] = {{192, 128}, {160, 128}, {192, 96}, {136, 64}};
  for (const auto& pr : pairs)
    for (int n : {1, 7, 127, 1000})
      for (bool causal : {false, true}) {
        Case c{2, n, n, 4, 2, pr[0], causal, (n + causal) % 2 ? DType::kF16 : DType::kBF16, n == 127};
        c.dv = pr[1];
        run_paths(c, salt++);
      }
  for (const auto& pr : pairs)
    for (bool causal : {false, true}) {
      Case g{1, 1000, 1000, 16, 1, pr[0], causal};  // MQA
      g.dv = pr[1];
      run_paths(g, salt++);
      Case u{2, 300, 1025, 8, 2, pr[0], causal, DType::kF16};  // sq < sk (bottom-right causal)
      u.dv = pr[1];
      run_paths(u, salt++);
      Case w{1, 1500, 1500, 4, 2, pr[0], causal};  // sliding window
      w.dv = pr[1], w.wl = 100, w.wr = causal ? 0 : 37;
      run_paths(w, salt++);
    }
#if FLASHCPP_HAS_SM90
  // On Hopper the automatic choice is the sm90 kernel in the 192 / 128 class (its reason says so).
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major == 9)
    for (const auto& pr : pairs) {
      const std::int64_t bytes = std::int64_t{4096} * 16 * 192 * 2;  // select_kernel reads no element
      DeviceBuffer q(bytes), k(bytes), v(bytes), o(bytes);
      AttnParams p = attn_params(1, 4096, 4096, 16, 16, pr[0], DType::kBF16, false, q.ptr, k.ptr, v.ptr, o.ptr);
      p.head_dim_v = pr[1];
      p.v = bshd_view(v.ptr, DType::kBF16, 4096, 16, pr[1]);
      p.o = bshd_view(o.ptr, DType::kBF16, 4096, 16, pr[1]);
      RunOptions opt;
      opt.backend = Backend::kCuda;
      KernelChoice ch;
      const Status st = select_kernel(p, opt, &ch);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(ch.id, KernelId::kCudaSm90);
      EXPECT_NE(ch.reason.find("192/128 class"), std::string::npos) << pr[0] << "/" << pr[1] << ": " << ch.reason;
    }
#endif
}

// Every compiled config of the sm90 192 / 128 class, forced by name (the default, its plain twin
// and its persistent twin: coalesced and TMA-store epilogues), at the class's own pair and padded
// ones, odd lengths, causal and not, GQA.
TEST(Prefill, EveryConfigOfTheSm90Class192By128) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  std::uint64_t salt = 2100;
  const std::vector<std::string> names = cuda::prefill_sm90_configs(192, 128);
  ASSERT_FALSE(names.empty()) << "no config of the 192 / 128 class compiled";
  const int pairs[][2] = {{192, 128}, {160, 128}, {192, 96}, {136, 64}};
  for (const auto& cfg : names)
    for (const auto& pr : pairs)
      for (bool causal : {false, true}) {
        for (const auto& sz : {std::pair{1, 1}, {7, 7}, {127, 127}, {1000, 1000}, {777, 1025}, {1025, 130}}) {
          Case c{2, sz.first, sz.second, 8, 2, pr[0], causal, causal ? DType::kF16 : DType::kBF16};
          c.dv = pr[1];
          c.config = cfg;
          run_case(c, salt++);
        }
      }
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

}  // namespace
}  // namespace flashcpp::testing
#else
FLASHCPP_GPU_TESTS_LEFT_OUT(Prefill, "sm80", "sm90")
#endif
