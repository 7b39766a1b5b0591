// GPU tests of the CUDA attention backward (src/cuda/backward): the forward on the GPU, then the
// backward, against the fp64 reference backward (cpu::reference_backward, which recomputes P and D
// from the same rounded q, k, v and dO and reads neither o nor the LSE). Gradients start as NaN
// (0xFF bytes): an unwritten element fails. Tolerance (docs/backward.md): per tensor,
// max |g - ref| <= tol max |ref| + 1e-6 with tol 2e-2 (bf16) or 5e-3 (fp16): P and dS are rounded to
// 16 bits for the tensor cores, which a bf16 plain implementation does too (the harness's
// `flashcpp check --backend cuda --area backward` applies the tighter per-case band). Fresh random
// inputs each run (FLASHCPP_SEED).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "flashcpp/backward.h"
#include "gpu_util.h"

#if FLASHCPP_HAS_SM80
namespace flashcpp::testing {
namespace {

struct BwdCase {
  int batch = 1, sq = 64, sk = 64, hq = 2, hkv = 2, d = 64, dv = 0;
  DType dt = DType::kBF16;
  std::vector<int> lq, lk;  ///< varlen lengths (lq non-empty = varlen)
  int extra_rows = 0;       ///< varlen: packed rows past the sequences (total_q / total_k), must get 0
  bool causal = false;
  int wl = -1, wr = -1;
  float softcap = 0.f;
  bool alibi = false;
  bool deterministic = false;
  bool dlse = false;
  std::vector<std::array<int, 3>> nan_q;  ///< (packed row, head, dim) of q set to NaN
  std::string config;  ///< RunOptions::cuda_config of the backward ("" = the selector's kernel)
};

int dim_v(const BwdCase& c) { return c.dv ? c.dv : c.d; }

struct Result {
  std::vector<std::uint16_t> dq, dk, dv;
  std::vector<double> ref_dq, ref_dk, ref_dv;
  std::int64_t rows_q = 0, rows_k = 0;
};

/// Runs the case on the GPU (forward, then backward) and the fp64 reference on the host.
void run_case(const BwdCase& c, std::mt19937_64& gen, Result* r) {
  const SeqLayout s = seq_layout(c.lq, c.lk, c.batch, c.sq, c.sk);
  const bool varlen = s.varlen;
  const int dv = dim_v(c);
  const std::int64_t rows_q = s.rows_q + c.extra_rows, rows_k = s.rows_k + c.extra_rows;
  r->rows_q = rows_q;
  r->rows_k = rows_k;
  const std::int64_t nq = rows_q * c.hq * c.d, nk = rows_k * c.hkv * c.d, nv = rows_k * c.hkv * dv, no = rows_q * c.hq * dv;
  std::vector<std::uint16_t> q = random_half_bits(nq, c.dt, gen), k = random_half_bits(nk, c.dt, gen),
                             v = random_half_bits(nv, c.dt, gen), dout = random_half_bits(no, c.dt, gen);
  for (const auto& [row, h, col] : c.nan_q) q[(static_cast<std::int64_t>(row) * c.hq + h) * c.d + col] = 0x7fc0;
  std::vector<float> slopes, dlse;
  if (c.alibi)
    for (int h = 0; h < c.hq; ++h) slopes.push_back(std::exp2(-8.f * (h + 1) / c.hq));
  std::normal_distribution<float> nd(0.f, 1.f);
  if (c.dlse)
    for (std::int64_t i = 0; i < rows_q * c.hq; ++i) dlse.push_back(0.1f * nd(gen));

  DeviceBuffer gq(nq * 2), gk(nk * 2), gv(nv * 2), gdo(no * 2), go(no * 2), gdq(nq * 2), gdk(nk * 2), gdv(nv * 2);
  DeviceBuffer glse(rows_q * c.hq * 4 + 4), gdlse(dlse.size() * 4 + 4), gsl(slopes.size() * 4 + 4);
  DeviceBuffer gcq(s.cu_q.size() * 4), gck(s.cu_k.size() * 4);
  CUDA_OK(cudaMemcpy(gq.ptr, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(gk.ptr, k.data(), nk * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(gv.ptr, v.data(), nv * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(gdo.ptr, dout.data(), no * 2, cudaMemcpyHostToDevice));
  if (!dlse.empty()) CUDA_OK(cudaMemcpy(gdlse.ptr, dlse.data(), dlse.size() * 4, cudaMemcpyHostToDevice));
  if (!slopes.empty()) CUDA_OK(cudaMemcpy(gsl.ptr, slopes.data(), slopes.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(gcq.ptr, s.cu_q.data(), s.cu_q.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(gck.ptr, s.cu_k.data(), s.cu_k.size() * 4, cudaMemcpyHostToDevice));
  for (DeviceBuffer* b : {&gdq, &gdk, &gdv}) CUDA_OK(cudaMemset(b->ptr, 0xff, b->bytes));

  auto view = [&](void* ptr, int seqlen, int heads, int dim) {
    return varlen ? TensorView{ptr, c.dt, 0, static_cast<std::int64_t>(heads) * dim, dim}
                  : bshd_view(ptr, c.dt, seqlen, heads, dim);
  };
  AttnBackwardParams p;
  p.batch = s.batch;
  p.seqlen_q = s.max_q;
  p.seqlen_k = s.max_k;
  p.heads_q = c.hq;
  p.heads_kv = c.hkv;
  p.head_dim = c.d;
  p.head_dim_v = c.dv;
  p.q = view(gq.ptr, s.max_q, c.hq, c.d);
  p.k = view(gk.ptr, s.max_k, c.hkv, c.d);
  p.v = view(gv.ptr, s.max_k, c.hkv, dv);
  p.o = view(go.ptr, s.max_q, c.hq, dv);
  p.dout = view(gdo.ptr, s.max_q, c.hq, dv);
  p.dq = view(gdq.ptr, s.max_q, c.hq, c.d);
  p.dk = view(gdk.ptr, s.max_k, c.hkv, c.d);
  p.dv = view(gdv.ptr, s.max_k, c.hkv, dv);
  p.lse = static_cast<const float*>(glse.ptr);
  p.dlse = dlse.empty() ? nullptr : static_cast<const float*>(gdlse.ptr);
  p.deterministic = c.deterministic;
  MaskParams& m = p.mask;
  m.causal = c.causal;
  m.window_left = c.wl;
  m.window_right = c.wr;
  m.softcap = c.softcap;
  if (c.alibi) m.alibi_slopes = static_cast<const float*>(gsl.ptr);
  if (varlen) {
    m.cu_seqlens_q = static_cast<const std::int32_t*>(gcq.ptr);
    m.cu_seqlens_k = static_cast<const std::int32_t*>(gck.ptr);
    if (c.extra_rows > 0) {
      m.total_q = rows_q;
      p.total_k = rows_k;
    }
  }
  AttnParams f = p.forward();
  f.lse = static_cast<float*>(glse.ptr);
  ASSERT_TRUE(attention_forward(f, RunOptions{}).ok());
  RunOptions ro;
  ro.backend = Backend::kCuda;
  ro.cuda_config = c.config;
  std::size_t ws_bytes = 0;
  const Status sz = attention_backward_workspace_size(p, ro, &ws_bytes);
  ASSERT_TRUE(sz.ok()) << sz.to_string();
  DeviceBuffer ws(ws_bytes);
  p.workspace = ws.ptr;
  p.workspace_bytes = ws_bytes;
  const Status st = attention_backward(p, ro);
  ASSERT_TRUE(st.ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  r->dq.resize(nq);
  r->dk.resize(nk);
  r->dv.resize(nv);
  CUDA_OK(cudaMemcpy(r->dq.data(), gdq.ptr, nq * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(r->dk.data(), gdk.ptr, nk * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(r->dv.data(), gdv.ptr, nv * 2, cudaMemcpyDeviceToHost));

  // The fp64 reference over host copies in the same layout (it reads neither o nor lse).
  std::vector<double> hq(nq), hk(nk), hv(nv), hdo(no), hdq(nq), hdk(nk), hdv(nv);
  for (std::int64_t i = 0; i < nq; ++i) hq[i] = bits_to_float(q[i], c.dt);
  for (std::int64_t i = 0; i < nk; ++i) hk[i] = bits_to_float(k[i], c.dt);
  for (std::int64_t i = 0; i < nv; ++i) hv[i] = bits_to_float(v[i], c.dt);
  for (std::int64_t i = 0; i < no; ++i) hdo[i] = bits_to_float(dout[i], c.dt);
  std::vector<float> host_lse(rows_q * c.hq, 0.f);
  auto hview = [&](std::vector<double>& x, int seqlen, int heads, int dim) {
    TensorView t = view(x.data(), seqlen, heads, dim);
    t.dtype = DType::kF64;
    return t;
  };
  AttnBackwardParams h = p;
  h.q = hview(hq, s.max_q, c.hq, c.d);
  h.k = hview(hk, s.max_k, c.hkv, c.d);
  h.v = hview(hv, s.max_k, c.hkv, dv);
  h.o = hview(hdo, s.max_q, c.hq, dv);  // not read by the reference
  h.dout = hview(hdo, s.max_q, c.hq, dv);
  h.dq = hview(hdq, s.max_q, c.hq, c.d);
  h.dk = hview(hdk, s.max_k, c.hkv, c.d);
  h.dv = hview(hdv, s.max_k, c.hkv, dv);
  h.lse = host_lse.data();
  h.dlse = dlse.empty() ? nullptr : dlse.data();
  h.workspace = nullptr;
  h.workspace_bytes = 0;
  h.deterministic = false;
  if (c.alibi) h.mask.alibi_slopes = slopes.data();
  if (varlen) {
    h.mask.cu_seqlens_q = s.cu_q.data();
    h.mask.cu_seqlens_k = s.cu_k.data();
  }
  RunOptions hr;
  hr.backend = Backend::kCpuReference;
  const Status hs = attention_backward(h, hr);
  ASSERT_TRUE(hs.ok()) << hs.to_string();
  r->ref_dq = std::move(hdq);
  r->ref_dk = std::move(hdk);
  r->ref_dv = std::move(hdv);
}

/// Max |g - ref| over max |ref| of one gradient; NaN where ref is finite (or unwritten) fails.
void expect_close(const char* name, const std::vector<std::uint16_t>& g, const std::vector<double>& ref, DType dt,
                  const std::string& what) {
  const double tol = dt == DType::kBF16 ? 2e-2 : 5e-3;
  double ref_max = 0, err_max = 0;
  std::int64_t bad_nan = 0, first_bad = -1;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double x = bits_to_float(g[i], dt), y = ref[i];
    if (std::isnan(y) != std::isnan(x)) {
      if (first_bad < 0) first_bad = static_cast<std::int64_t>(i);
      ++bad_nan;
      continue;
    }
    if (std::isnan(y)) continue;
    ref_max = std::max(ref_max, std::fabs(y));
    err_max = std::max(err_max, std::fabs(x - y));
  }
  EXPECT_EQ(bad_nan, 0) << what << " " << name << ": " << bad_nan << " elements NaN in one and not the other (first at "
                        << first_bad << ")";
  EXPECT_LE(err_max, tol * ref_max + 1e-6) << what << " " << name << ": max err " << err_max << " vs max |ref| " << ref_max;
}

std::string describe(const BwdCase& c) {
  std::string s = "b" + std::to_string(c.batch) + " sq" + std::to_string(c.sq) + " sk" + std::to_string(c.sk) + " hq" +
                  std::to_string(c.hq) + "/" + std::to_string(c.hkv) + " d" + std::to_string(c.d) + "/" +
                  std::to_string(dim_v(c)) + (c.dt == DType::kBF16 ? " bf16" : " fp16");
  if (!c.lq.empty()) s += " varlen";
  if (c.causal) s += " causal";
  if (c.wl >= 0 || c.wr >= 0) s += " window(" + std::to_string(c.wl) + "," + std::to_string(c.wr) + ")";
  if (c.softcap > 0) s += " softcap";
  if (c.alibi) s += " alibi";
  if (c.deterministic) s += " deterministic";
  if (c.dlse) s += " dlse";
  if (!c.config.empty()) s += " cuda_config " + c.config;
  return s;
}

void check_case(const BwdCase& c) {
  std::mt19937_64 gen(gpu_seed() ^ std::hash<std::string>{}(describe(c)));
  Result r;
  run_case(c, gen, &r);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string what = describe(c);
  expect_close("dq", r.dq, r.ref_dq, c.dt, what);
  expect_close("dk", r.dk, r.ref_dk, c.dt, what);
  expect_close("dv", r.dv, r.ref_dv, c.dt, what);
}

TEST(BackwardGpu, DenseMasksAndGqa) {
  for (DType dt : {DType::kBF16, DType::kF16})
    for (int d : {64, 128, 256}) {
      check_case({.batch = 2, .sq = 127, .sk = 200, .hq = 4, .hkv = 2, .d = d, .dt = dt});
      check_case({.batch = 1, .sq = 300, .sk = 300, .hq = 4, .hkv = 1, .d = d, .dt = dt, .causal = true});
    }
  check_case({.batch = 1, .sq = 1, .sk = 1, .hq = 1, .hkv = 1, .d = 64});
  check_case({.batch = 1, .sq = 7, .sk = 1000, .hq = 2, .hkv = 1, .d = 128, .causal = true});
  check_case({.batch = 1, .sq = 1000, .sk = 7, .hq = 2, .hkv = 2, .d = 128, .causal = true});
  check_case({.batch = 1, .sq = 500, .sk = 520, .hq = 2, .hkv = 2, .d = 128, .wl = 100, .wr = 10});
  check_case({.batch = 2, .sq = 200, .sk = 200, .hq = 4, .hkv = 4, .d = 128, .causal = true, .softcap = 30.f});
  check_case({.batch = 1, .sq = 256, .sk = 256, .hq = 4, .hkv = 2, .d = 64, .causal = true, .alibi = true});
  check_case({.batch = 2, .sq = 190, .sk = 190, .hq = 2, .hkv = 2, .d = 64, .dlse = true});
}

TEST(BackwardGpu, VarlenZeroesUncoveredRows) {
  check_case({.hq = 4, .hkv = 2, .d = 128, .lq = {1, 130, 0, 64, 257}, .lk = {5, 130, 3, 0, 300}, .extra_rows = 9,
              .causal = true});
  check_case({.hq = 2, .hkv = 2, .d = 64, .dt = DType::kF16, .lq = {33, 100}, .lk = {}, .wl = 20, .wr = 0});
}

TEST(BackwardGpu, EveryHeadDimRunsPaddedToItsClass) {
  for (int d = 8; d <= 256; d += 8) check_case({.batch = 1, .sq = 70, .sk = 90, .hq = 2, .hkv = 1, .d = d, .causal = d % 16 == 0});
  const int pairs[][2] = {{192, 128}, {128, 64}, {64, 128}, {96, 80}, {40, 256}, {256, 24}};
  for (const auto& pr : pairs) check_case({.batch = 1, .sq = 100, .sk = 100, .hq = 2, .hkv = 2, .d = pr[0], .dv = pr[1]});
}

/// Runs a deterministic case three times on the same inputs: every gradient must repeat bit for bit.
void expect_bitwise_repeat(const BwdCase& c) {
  Result first;
  for (int rep = 0; rep < 3; ++rep) {
    std::mt19937_64 gen(1234);  // the same inputs each time
    Result r;
    run_case(c, gen, &r);
    if (::testing::Test::HasFatalFailure()) return;
    if (rep == 0) {
      first = std::move(r);
      continue;
    }
    EXPECT_TRUE(r.dq == first.dq) << "dq differs between deterministic runs: " << describe(c);
    EXPECT_TRUE(r.dk == first.dk && r.dv == first.dv) << "dk or dv differs between deterministic runs: " << describe(c);
  }
}

TEST(BackwardGpu, DeterministicIsBitwiseRepeatable) {
  std::vector<std::string> cfgs = {"", "sm80"};  // "": the warp-specialized kernel on Hopper (d128)
  if (sm90_device()) cfgs.push_back("sm90");
  for (const std::string& cfg : cfgs) {
    const BwdCase c{.batch = 1, .sq = 1024, .sk = 1024, .hq = 4, .hkv = 1, .d = 128, .causal = true, .deterministic = true,
                    .config = cfg};
    check_case(c);
    expect_bitwise_repeat(c);
  }
}

// Deterministic mode runs the grid in groups of key tiles (select::backward_key_group: 4 per
// group here, with 40-48 (sequence, KV head) pairs): later groups' CTAs, and CTAs past a short
// sequence's last tile inside a group, must find their tile, take their turns and add in order.
TEST(BackwardGpu, DeterministicKeyTileGroups) {
  std::vector<std::string> cfgs = {"", "sm80"};
  if (sm90_device()) cfgs.push_back("sm90");
  for (const std::string& cfg : cfgs) {
    // Short query sides keep the fp64 reference cheap; every key tile adds to the same few query tiles.
    const BwdCase dense{.batch = 2, .sq = 100, .sk = 1000, .hq = 20, .hkv = 20, .d = 64, .causal = false,
                        .deterministic = true, .config = cfg};
    check_case(dense);
    expect_bitwise_repeat(dense);
    const BwdCase packed{.batch = 3, .hq = 16, .hkv = 16, .d = 128, .lq = {100, 37, 130}, .lk = {1100, 300, 650},
                         .causal = true, .deterministic = true, .config = cfg};
    check_case(packed);
    expect_bitwise_repeat(packed);
  }
}

TEST(BackwardGpu, HopperChoosesTheWgmmaKernelsForClasses64And128) {
  if (!sm90_device()) GTEST_SKIP() << "not an sm_90 device, or no sm90 kernels in this build";
  for (int d : {64, 96, 128, 256}) {
    AttnBackwardParams p;
    p.batch = 1;
    p.seqlen_q = p.seqlen_k = 256;
    p.heads_q = p.heads_kv = 2;
    p.head_dim = d;
    // Selection reads no data: eight disjoint (never dereferenced) address ranges for the views,
    // outputs must not overlap inputs.
    TensorView* views[] = {&p.q, &p.k, &p.v, &p.o, &p.dout, &p.dq, &p.dk, &p.dv};
    for (int i = 0; i < 8; ++i)
      *views[i] = bshd_view(reinterpret_cast<void*>((std::uintptr_t{1} << 32) * (i + 1)), DType::kBF16, 256, 2, d);
    p.lse = reinterpret_cast<const float*>((std::uintptr_t{1} << 32) * 9);
    RunOptions ro;
    ro.backend = Backend::kCuda;
    KernelChoice k;
    const Status st = select_backward_kernel(p, ro, &k);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(k.id, d <= 128 ? KernelId::kCudaSm90 : KernelId::kCudaSm80) << d << ": " << k.reason;
    // The classes 64 and 128 (96 pads into it) run the warp-specialized kernel.
    const std::string auto_prefix = d <= 128 ? "bwd_sm90ws_m" : "bwd_m";
    EXPECT_EQ(k.config.rfind(auto_prefix, 0), 0u) << d << ": " << k.config;
    ro.cuda_config = "sm80";
    ASSERT_TRUE(select_backward_kernel(p, ro, &k).ok());
    EXPECT_EQ(k.id, KernelId::kCudaSm80) << k.reason;
    for (const char* cfg : {"sm90", "sm90ws"}) {
      ro.cuda_config = cfg;
      const Status s = select_backward_kernel(p, ro, &k);
      EXPECT_EQ(s.ok(), d <= 128) << d << " " << cfg << ": " << s.to_string();
      if (s.ok()) EXPECT_EQ(k.config.rfind(std::string("bwd_") + cfg + "_m", 0), 0u) << k.config;
    }
    if (d <= 128) {  // softcap: the single-role kernel, which says why not the warp-specialized one
      p.mask.softcap = 30.f;
      ro.cuda_config = "";
      ASSERT_TRUE(select_backward_kernel(p, ro, &k).ok());
      EXPECT_EQ(k.config.rfind("bwd_sm90_m", 0), 0u) << k.config;
      EXPECT_NE(k.reason.find("not the warp-specialized kernel"), std::string::npos) << k.reason;
      ro.cuda_config = "sm90ws";
      EXPECT_EQ(select_backward_kernel(p, ro, &k).code(), StatusCode::kUnsupported);
    }
  }
}

TEST(BackwardGpu, WgmmaKernelOnLongerSequences) {
  // The single-role wgmma kernel (cuda_config "sm90"; the default is the warp-specialized one):
  // several key tiles of 128 and query tiles of 64 (d128) or 128 (d64), partial last tiles, GQA.
  for (DType dt : {DType::kBF16, DType::kF16})
    for (int d : {64, 128}) {
      check_case({.batch = 2, .sq = 1000, .sk = 777, .hq = 4, .hkv = 1, .d = d, .dt = dt, .causal = true, .config = "sm90"});
      check_case({.batch = 1, .sq = 333, .sk = 1031, .hq = 3, .hkv = 3, .d = d, .dt = dt, .config = "sm90"});
    }
  check_case({.batch = 1, .sq = 700, .sk = 700, .hq = 2, .hkv = 1, .d = 64, .causal = true, .deterministic = true,
              .config = "sm90"});
  check_case({.batch = 1, .sq = 520, .sk = 600, .hq = 2, .hkv = 2, .d = 128, .wl = 200, .wr = 30, .softcap = 20.f,
              .config = "sm90"});
}

TEST(BackwardGpu, WarpSpecializedWgmmaKernel) {
  // cuda_config "sm90ws" (the default at the classes 64 and 128): TMA producer and dQ writer warps
  // beside two consumer warpgroups (bwd_sm90_ws.cuh); no softcap, ALiBi or block-sparse.
  if (!sm90_device()) GTEST_SKIP() << "not an sm_90 device, or no sm90 kernels in this build";
  for (DType dt : {DType::kBF16, DType::kF16})
    for (int d : {64, 128}) {
      check_case({.batch = 2, .sq = 1000, .sk = 777, .hq = 4, .hkv = 1, .d = d, .dt = dt, .causal = true, .config = "sm90ws"});
      check_case({.batch = 1, .sq = 333, .sk = 1031, .hq = 3, .hkv = 3, .d = d, .dt = dt, .config = "sm90ws"});
      check_case({.batch = 2, .sq = 127, .sk = 200, .hq = 4, .hkv = 2, .d = d, .dt = dt, .config = "sm90ws"});
    }
  check_case({.batch = 1, .sq = 1, .sk = 1, .hq = 1, .hkv = 1, .d = 64, .config = "sm90ws"});
  check_case({.batch = 1, .sq = 7, .sk = 1000, .hq = 2, .hkv = 1, .d = 128, .causal = true, .config = "sm90ws"});
  check_case({.batch = 1, .sq = 1000, .sk = 7, .hq = 2, .hkv = 2, .d = 128, .causal = true, .config = "sm90ws"});
  check_case({.batch = 1, .sq = 500, .sk = 520, .hq = 2, .hkv = 2, .d = 128, .wl = 100, .wr = 10, .config = "sm90ws"});
  check_case({.batch = 2, .sq = 190, .sk = 190, .hq = 2, .hkv = 2, .d = 64, .dlse = true, .config = "sm90ws"});
  check_case({.batch = 1, .sq = 70, .sk = 90, .hq = 2, .hkv = 1, .d = 96, .dv = 80, .causal = true, .config = "sm90ws"});
  // Head dims short of their class: dQ's padding columns are not added (72 leaves 8 of the second
  // warpgroup's 64 columns at the class 128; 40 leaves 40 of 64 at the class 64).
  check_case({.batch = 1, .sq = 200, .sk = 150, .hq = 2, .hkv = 1, .d = 72, .causal = true, .config = "sm90ws"});
  check_case({.batch = 2, .sq = 130, .sk = 260, .hq = 2, .hkv = 2, .d = 40, .config = "sm90ws"});
  check_case({.hq = 4, .hkv = 2, .d = 128, .lq = {1, 130, 0, 64, 257}, .lk = {5, 130, 3, 0, 300}, .extra_rows = 9,
              .causal = true, .config = "sm90ws"});
  check_case({.batch = 1, .sq = 700, .sk = 700, .hq = 2, .hkv = 1, .d = 64, .causal = true, .deterministic = true,
              .config = "sm90ws"});
  BwdCase nan{.batch = 1, .sq = 96, .sk = 80, .hq = 4, .hkv = 2, .d = 64, .config = "sm90ws"};
  nan.nan_q = {{5, 1, 3}};
  check_case(nan);
}

TEST(BackwardGpu, WarpSpecializedSmall) {
  // A few small cases of cuda_config "sm90ws", short enough for compute-sanitizer (backward_round.sh's memcheck).
  if (!sm90_device()) GTEST_SKIP() << "not an sm_90 device, or no sm90 kernels in this build";
  check_case({.batch = 2, .sq = 130, .sk = 200, .hq = 2, .hkv = 1, .d = 128, .causal = true, .config = "sm90ws"});
  check_case({.batch = 1, .sq = 200, .sk = 130, .hq = 2, .hkv = 2, .d = 64, .config = "sm90ws"});
  check_case({.hq = 2, .hkv = 1, .d = 64, .lq = {1, 130, 0, 64}, .lk = {5, 130, 3, 0}, .extra_rows = 5, .causal = true,
              .deterministic = true, .config = "sm90ws"});
  // Several pairs per CTA at the class 128 in deterministic mode (the writer takes each query tile's
  // turn while the consumers stage the next piece), and a head dim short of its class.
  check_case({.batch = 1, .sq = 300, .sk = 260, .hq = 2, .hkv = 1, .d = 128, .causal = true, .deterministic = true,
              .config = "sm90ws"});
  check_case({.batch = 1, .sq = 333, .sk = 140, .hq = 2, .hkv = 2, .d = 72, .config = "sm90ws"});
}

TEST(BackwardGpu, TheMmaSyncKernelStillRunsOnHopper) {
  // On sm_90 the automatic choice is the wgmma kernel; cuda_config "sm80" keeps the mma.sync one tested.
  for (int d : {64, 128}) {
    check_case({.batch = 2, .sq = 127, .sk = 200, .hq = 4, .hkv = 2, .d = d, .config = "sm80"});
    check_case({.batch = 1, .sq = 300, .sk = 300, .hq = 4, .hkv = 1, .d = d, .dt = DType::kF16, .causal = true,
                .config = "sm80"});
  }
  check_case({.hq = 4, .hkv = 2, .d = 128, .lq = {1, 130, 0, 64, 257}, .lk = {5, 130, 3, 0, 300}, .extra_rows = 9,
              .causal = true, .config = "sm80"});
}

TEST(BackwardGpu, NanInQueryReachesItsRowAndTheKvHead) {
  // Non-causal: row 5 of head 1 sees every key, so its NaN reaches its dq row and every dk, dv of KV
  // head 0 (heads 0 and 1 share it), and nothing of KV head 1 (backward.h's NaN rule).
  BwdCase c{.batch = 1, .sq = 96, .sk = 80, .hq = 4, .hkv = 2, .d = 64};
  c.nan_q = {{5, 1, 3}};
  check_case(c);
}

}  // namespace
}  // namespace flashcpp::testing
#else
FLASHCPP_GPU_TESTS_LEFT_OUT(BackwardGpu, "sm80")
#endif
