// GPU tests of the fused masks (softcap, ALiBi, sliding window + global tokens, varlen,
// block-sparse) on both prefill kernel families, forced with RunOptions::cuda_config "sm80" and
// "sm90" (the latter only on a Hopper device). Every case is compared element by element with an
// fp64 reference that reads the same rounded inputs: the GPU fp64 reference
// (cuda::reference_attention_f64, masks evaluated from attention.h, not through MaskRules) or,
// for block-sparse masks, the CPU fp64 reference (cpu::reference_attention, which walks the CSR
// itself). Outputs start as NaN (0xFF) with NaN guard rows after O and the LSE: an unwritten
// element, a NaN and a write past the packed rows all fail. Tolerances are those of
// docs/tolerances.md: |O - ref| <= 1e-2 + 1e-2 |ref|, |LSE - ref| <= 1e-3, and a row that sees
// no key must give exactly O = 0 and LSE = -inf. Fresh random inputs each run (FLASHCPP_SEED).
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>

#include "cpu/cpu_backend.h"
#include "flashcpp/masks.h"
#include "gpu_util.h"

#if FLASHCPP_HAS_SM80 || FLASHCPP_HAS_SM90
namespace flashcpp::testing {
namespace {

constexpr double kAtol = 1e-2, kRtol = 1e-2, kLseAtol = 1e-3;
constexpr int kGuardRows = 16;  // NaN rows after O (and 64 NaN floats after the LSE) that must stay NaN
constexpr DType kBf16 = DType::kBF16, kF16 = DType::kF16;

using BsFn = std::function<bool(int b, int h, int i, int j)>;

struct MaskCase {
  int b = 1, sq = 0, sk = 0, hq = 2, hkv = 2, d = 64;
  int dv = 0;  ///< head_dim_v of v and o (0 = d)
  DType dt = kBf16;
  std::vector<int> lq, lk;  ///< varlen lengths (lq non-empty = varlen; lk empty = lq)
  int max_pad = 0;          ///< varlen: max_seqlen passed = true maximum + this (grid CTAs past every sequence)
  bool causal = false;
  int wl = -1, wr = -1, g = 0;
  bool gq = false;
  float softcap = 0.f, scale = 0.f;
  int alibi = 0;            ///< 0 off, 1 per-head BLOOM slopes, 2 per-(batch, head) slopes
  int bsm = 0, bsn = 0;     ///< block-sparse block sizes (0 = no block-sparse mask)
  bool bs_per_head = false; ///< one mask per (batch, head) instead of one shared mask
  BsFn bs_fn;               ///< visibility of the block-sparse mask
  std::string bs_name;
  // NaN inputs (attention.h: a NaN score at a visible key makes that row NaN, O and LSE, and
  // nothing else): the fp64 reference reads the same NaNs, and where it is NaN the kernel must be.
  std::vector<std::array<int, 3>> nan_q;  ///< (packed row, head, dim) of q set to NaN
  std::vector<std::array<int, 3>> nan_k;  ///< (packed row, kv head, dim) of k set to NaN
  int nan_slope_head = -1;                ///< >= 0: this head's ALiBi slope is NaN (every batch)
  std::int64_t expect_nan_rows = 0;       ///< (row, head) pairs the reference must give as NaN
  /// Varlen: packed rows past cu_seqlens_q[batch] in q and o, passed as mask.total_q (0 = none,
  /// total_q unset). The LSE is then (heads, total_q); on CUDA those rows stay as they were.
  int extra_rows = 0;
};

bool varlen(const MaskCase& c) { return !c.lq.empty(); }

std::string join(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::string describe(const MaskCase& c) {
  std::string s = varlen(c) ? "varlen[" + join(c.lq) + (c.lk.empty() ? "" : "|" + join(c.lk)) + "]" +
                                  (c.max_pad ? "+pad" + std::to_string(c.max_pad) : "")
                            : "b" + std::to_string(c.b) + " sq" + std::to_string(c.sq) + " sk" + std::to_string(c.sk);
  s += " hq" + std::to_string(c.hq) + " hkv" + std::to_string(c.hkv) + " d" + std::to_string(c.d) +
       (c.dv && c.dv != c.d ? " dv" + std::to_string(c.dv) : "") + (c.dt == kBf16 ? " bf16" : " fp16");
  if (c.causal) s += " causal";
  if (c.wl >= 0 || c.wr >= 0) s += " w(" + std::to_string(c.wl) + "," + std::to_string(c.wr) + ")";
  if (c.g > 0) s += std::string(c.gq ? " gq" : " sink") + std::to_string(c.g);
  if (c.softcap > 0.f) s += " softcap" + std::to_string(static_cast<int>(c.softcap));
  if (c.scale > 0.f) s += " scale" + std::to_string(c.scale).substr(0, 4);
  if (c.alibi) s += c.alibi == 2 ? " alibi/b" : " alibi";
  if (c.bsm) s += " bs" + std::to_string(c.bsm) + "x" + std::to_string(c.bsn) + (c.bs_per_head ? "/h " : " ") + c.bs_name;
  if (!c.nan_q.empty()) s += " nan_q" + std::to_string(c.nan_q.size());
  if (!c.nan_k.empty()) s += " nan_k" + std::to_string(c.nan_k.size());
  if (c.nan_slope_head >= 0) s += " nan_slope_h" + std::to_string(c.nan_slope_head);
  if (c.extra_rows) s += " total_q+" + std::to_string(c.extra_rows);
  return s;
}

/// Kernel families to force: "sm80" when built (FLASHCPP_WITH_SM80), "sm90" on a Hopper device of
/// an sm_90a build.
std::vector<std::string> families() {
  std::vector<std::string> f;
#if FLASHCPP_HAS_SM80
  f.push_back("sm80");
#endif
#if FLASHCPP_HAS_SM90
  if (sm90_device()) f.push_back("sm90");
#endif
  return f;
}

struct Outcome {
  Status status;  ///< of attention_forward (or select_kernel)
  KernelChoice choice;
  std::vector<std::uint16_t> o_bits;  ///< O as written (for determinism checks)
};

template <class T>
void upload(DeviceBuffer& d, const std::vector<T>& h) {
  ASSERT_TRUE(d.ptr != nullptr);
  if (!h.empty()) CUDA_OK(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

/// Runs one case on `family` and checks it; *out gets the status and O (for callers that expect a
/// refusal or compare runs). expect_ok = false: only the refusal is returned, nothing is checked.
void run_mask_case(const MaskCase& c, const std::string& family, std::uint64_t salt, Outcome* out,
                   bool expect_ok = true) {
  SCOPED_TRACE(describe(c) + " [" + family + "]");
  std::mt19937_64 gen(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const SeqLayout sl = seq_layout(c.lq, c.lk, c.b, c.sq, c.sk, c.max_pad);
  const bool vl = sl.varlen;
  const int batch = sl.batch, max_q = sl.max_q, max_k = sl.max_k;
  const std::vector<std::int32_t>& cu_q = sl.cu_q;
  const std::vector<std::int32_t>& cu_k = sl.cu_k;
  const std::int64_t rows_q = sl.rows_q, rows_k = sl.rows_k;
  // total_q: rows_q covered rows, then extra_rows that no sequence covers (varlen only).
  const std::int64_t total_q = rows_q + (vl ? c.extra_rows : 0);
  const int dv = c.dv ? c.dv : c.d;  // v and o: (rows, heads, dv)
  const std::int64_t no = rows_q * c.hq * dv, nk = std::max<std::int64_t>(rows_k * c.hkv * c.d, 8);
  const std::int64_t nv = std::max<std::int64_t>(rows_k * c.hkv * dv, 8);
  const std::int64_t nq_all = total_q * c.hq * c.d, no_all = total_q * c.hq * dv;
  const std::int64_t n_lse = rows_q * c.hq, n_lse_all = total_q * c.hq;

  auto hq_bits = random_half_bits(nq_all, c.dt, gen), hk_bits = random_half_bits(nk, c.dt, gen),
       hv_bits = random_half_bits(nv, c.dt, gen);
  const std::uint16_t nan_bits = c.dt == kBf16 ? 0x7FC0 : 0x7E00;
  for (const auto& [r, h, dd] : c.nan_q) hq_bits[(static_cast<std::int64_t>(r) * c.hq + h) * c.d + dd] = nan_bits;
  for (const auto& [r, h, dd] : c.nan_k) hk_bits[(static_cast<std::int64_t>(r) * c.hkv + h) * c.d + dd] = nan_bits;
  const std::int64_t o_elems = no_all + static_cast<std::int64_t>(kGuardRows) * c.hq * dv;
  DeviceBuffer q(nq_all * 2), k(nk * 2), v(nv * 2), o(o_elems * 2), lse(sizeof(float) * (n_lse_all + 64));
  ASSERT_TRUE(q.ptr && k.ptr && v.ptr && o.ptr && lse.ptr);
  upload(q, hq_bits);
  upload(k, hk_bits);
  upload(v, hv_bits);
  CUDA_OK(cudaMemset(o.ptr, 0xFF, o.bytes));  // NaN in fp16 and bf16, guards included
  CUDA_OK(cudaMemset(lse.ptr, 0xFF, lse.bytes));

  AttnParams p = attn_params(batch, max_q, max_k, c.hq, c.hkv, c.d, c.dt, vl, q.ptr, k.ptr, v.ptr, o.ptr);
  auto view = [&](void* ptr, int seqlen, int heads, int dim) {
    return vl ? TensorView{ptr, c.dt, 0, static_cast<std::int64_t>(heads) * dim, dim}
              : bshd_view(ptr, c.dt, seqlen, heads, dim);
  };
  p.head_dim_v = c.dv;
  p.v = view(v.ptr, max_k, c.hkv, dv);
  p.o = view(o.ptr, max_q, c.hq, dv);
  p.lse = static_cast<float*>(lse.ptr);
  p.softmax_scale = c.scale;
  p.mask.causal = c.causal;
  p.mask.window_left = c.wl;
  p.mask.window_right = c.wr;
  p.mask.global_tokens = c.g;
  p.mask.global_queries = c.gq;
  p.mask.softcap = c.softcap;

  DeviceBuffer d_cu_q(sizeof(std::int32_t) * cu_q.size()), d_cu_k(sizeof(std::int32_t) * cu_k.size());
  if (vl) {
    upload(d_cu_q, cu_q);
    upload(d_cu_k, cu_k);
    p.mask.cu_seqlens_q = static_cast<const std::int32_t*>(d_cu_q.ptr);
    p.mask.cu_seqlens_k = static_cast<const std::int32_t*>(d_cu_k.ptr);
    if (c.extra_rows) p.mask.total_q = total_q;
  }
  std::vector<float> slopes;
  if (c.alibi) {
    const std::vector<float> bloom = alibi_slopes(c.hq);  // BLOOM's slopes, any head count
    slopes = bloom;
    if (c.alibi == 2) {  // per (batch, head): scaled copies, so a wrong batch index shows
      slopes.clear();
      for (int b = 0; b < batch; ++b)
        for (int h = 0; h < c.hq; ++h) slopes.push_back(bloom[h] * (1.f + 0.5f * static_cast<float>(b)));
    }
    if (c.nan_slope_head >= 0)
      for (std::size_t x = c.nan_slope_head; x < slopes.size(); x += c.hq) slopes[x] = NAN;
  }
  DeviceBuffer d_slopes(sizeof(float) * std::max<std::size_t>(slopes.size(), 1));
  if (c.alibi) {
    upload(d_slopes, slopes);
    p.mask.alibi_slopes = static_cast<const float*>(d_slopes.ptr);
    p.mask.alibi_batch_stride = c.alibi == 2 ? c.hq : 0;
  }
  BlockMask bm;
  BlockSparseMask dev_bs;
  std::unique_ptr<DeviceBuffer> rp, ci, pa, em;
  if (c.bsm) {
    BlockSparseShape shape{max_q, max_k, c.bsm, c.bsn, c.bs_per_head ? batch : 1, c.bs_per_head ? c.hq : 1};
    const Status bst = build_block_sparse(shape, MaskFn(c.bs_fn), &bm);
    ASSERT_TRUE(bst.ok()) << bst.to_string();
    auto up = [&](std::unique_ptr<DeviceBuffer>& d, auto span) {
      d = std::make_unique<DeviceBuffer>(std::max<std::size_t>(span.size_bytes(), 8));
      ASSERT_TRUE(d->ptr != nullptr);
      if (!span.empty()) CUDA_OK(cudaMemcpy(d->ptr, span.data(), span.size_bytes(), cudaMemcpyHostToDevice));
    };
    up(rp, bm.row_ptr());
    up(ci, bm.col_idx());
    up(pa, bm.partial());
    up(em, bm.element_masks());
    dev_bs = bm.view();
    dev_bs.row_ptr = static_cast<const std::int32_t*>(rp->ptr);
    dev_bs.col_idx = static_cast<const std::int32_t*>(ci->ptr);
    dev_bs.partial = static_cast<const std::int32_t*>(pa->ptr);
    dev_bs.element_masks = bm.view().num_partial ? static_cast<const std::uint64_t*>(em->ptr) : nullptr;
    p.mask.block_sparse = &dev_bs;
  }

  RunOptions opt;
  opt.backend = Backend::kCuda;
  opt.cuda_config = family;
  out->status = select_kernel(p, opt, &out->choice);
  if (left_out_of_build(out->status)) GTEST_SKIP() << out->status.message();  // e.g. "sm80" forced without it
  if (!expect_ok) return;
  ASSERT_TRUE(out->status.ok()) << out->status.to_string();
  out->status = attention_forward(p, opt);
  ASSERT_TRUE(out->status.ok()) << out->status.to_string();
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());

  // ---- reference (packed rows: o (rows_q, hq, dv), lse (hq, rows_q)) ------------------------
  std::vector<double> ro(no), rlse(n_lse);
  if (c.bsm) {  // the GPU reference does not evaluate block-sparse masks
    AttnParams hp = p;
    hp.q = view(hq_bits.data(), max_q, c.hq, c.d);
    hp.k = view(hk_bits.data(), max_k, c.hkv, c.d);
    hp.v = view(hv_bits.data(), max_k, c.hkv, dv);
    hp.o = TensorView{};
    hp.lse = nullptr;
    hp.mask.alibi_slopes = c.alibi ? slopes.data() : nullptr;
    hp.mask.cu_seqlens_q = vl ? cu_q.data() : nullptr;
    hp.mask.cu_seqlens_k = vl ? cu_k.data() : nullptr;
    hp.mask.block_sparse = bm.get();
    cpu::RefOutput ref;
    const Status rs = cpu::reference_attention(hp, &ref);
    ASSERT_TRUE(rs.ok()) << rs.to_string();
    ro = ref.o;
    rlse = ref.lse;
  } else {
    DeviceBuffer oref(sizeof(double) * no), lseref(sizeof(double) * std::max<std::int64_t>(n_lse, 1));
    ASSERT_TRUE(oref.ptr && lseref.ptr);
    AttnParams rp = p;
    rp.mask.total_q = 0;  // the reference's own packed layout: (hq, rows_q)
    const Status rs =
        cuda::reference_attention_f64(rp, static_cast<double*>(oref.ptr), static_cast<double*>(lseref.ptr), nullptr);
    ASSERT_TRUE(rs.ok()) << rs.to_string();
    CUDA_OK(cudaMemcpy(ro.data(), oref.ptr, sizeof(double) * no, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(rlse.data(), lseref.ptr, sizeof(double) * n_lse, cudaMemcpyDeviceToHost));
  }

  // ---- compare ------------------------------------------------------------------------------
  std::vector<std::uint16_t> ho(o_elems);
  std::vector<float> hlse(n_lse_all + 64);
  CUDA_OK(cudaMemcpy(ho.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hlse.data(), lse.ptr, lse.bytes, cudaMemcpyDeviceToHost));
  // Guards: the rows after O and the floats after the LSE, and (total_q given) the packed rows
  // past cu_seqlens_q[batch], which the CUDA kernels leave as they are (attention.h).
  std::int64_t guard_bad = 0;
  for (std::int64_t x = no; x < o_elems; ++x) guard_bad += ho[x] != 0xFFFF;
  auto lse_poisoned = [&](std::int64_t x) {
    std::uint32_t u;
    std::memcpy(&u, &hlse[x], 4);
    return u == 0xFFFFFFFFu;
  };
  for (std::int64_t x = n_lse_all; x < n_lse_all + 64; ++x) guard_bad += !lse_poisoned(x);
  for (int h = 0; h < c.hq; ++h)
    for (std::int64_t r = rows_q; r < total_q; ++r) guard_bad += !lse_poisoned(h * total_q + r);
  // Kernel LSE index of packed row `row` (sequence b, local row i) and head h.
  auto lse_at = [&](std::int64_t row, int b, int i, int h) -> std::int64_t {
    return vl ? h * total_q + row : (static_cast<std::int64_t>(b) * c.hq + h) * c.sq + i;
  };
  double max_abs = 0, lse_err = 0;
  std::int64_t nan = 0, bad = 0, lse_bad = 0, empty_rows = 0, nan_rows = 0;
  std::vector<double> row_err;
  row_err.reserve(static_cast<std::size_t>(rows_q * c.hq));
  for (int b = 0; b < batch; ++b) {
    const int len = vl ? c.lq[b] : c.sq;
    for (int i = 0; i < len; ++i) {
      const std::int64_t row = (vl ? cu_q[b] : static_cast<std::int64_t>(b) * c.sq) + i;
      for (int h = 0; h < c.hq; ++h) {
        const double rl = rlse[h * rows_q + row];
        const double kl = hlse[lse_at(row, b, i, h)];
        const bool empty = std::isinf(rl) && rl < 0;
        empty_rows += empty;
        if (std::isnan(rl)) {  // a NaN score at a visible key: every element and the LSE are NaN
          ++nan_rows;
          for (int dd = 0; dd < dv; ++dd) bad += !std::isnan(bits_to_float(ho[(row * c.hq + h) * dv + dd], c.dt));
          lse_bad += !std::isnan(kl);
          continue;
        }
        double rerr = 0;
        for (int dd = 0; dd < dv; ++dd) {
          const std::int64_t idx = (row * c.hq + h) * dv + dd;
          const double o_val = bits_to_float(ho[idx], c.dt), ref = ro[idx];
          if (std::isnan(o_val) || std::isinf(o_val)) {
            ++nan;
            continue;
          }
          const double err = std::fabs(o_val - ref);
          rerr = std::max(rerr, err);
          bad += empty ? o_val != 0.0 : err > kAtol + kRtol * std::fabs(ref);
        }
        max_abs = std::max(max_abs, rerr);
        row_err.push_back(rerr);
        if (empty) {
          lse_bad += !(std::isinf(kl) && kl < 0);
        } else {
          const double e = std::fabs(kl - rl);
          lse_bad += std::isnan(kl) || !(e <= kLseAtol);
          if (!std::isnan(e)) lse_err = std::max(lse_err, e);
        }
      }
    }
  }
  std::sort(row_err.begin(), row_err.end());
  const double p50 = row_err.empty() ? 0 : row_err[row_err.size() / 2];
  EXPECT_EQ(nan, 0) << "NaN/Inf (unwritten or poisoned) outputs";
  EXPECT_EQ(bad, 0) << "elements over tolerance (or non-zero O in a row that sees no key); max_abs_err " << max_abs;
  EXPECT_EQ(lse_bad, 0) << "LSE rows over " << kLseAtol << " (or not -inf for a row that sees no key); max " << lse_err;
  EXPECT_EQ(guard_bad, 0) << "writes past the packed rows of O or the LSE";
  EXPECT_EQ(nan_rows, c.expect_nan_rows) << "(row, head) pairs the fp64 reference gives as NaN";
  if (family == "sm90" && !c.bsm) EXPECT_EQ(out->choice.id, KernelId::kCudaSm90) << out->choice.reason;
  std::printf("    %-88s %-5s %-14s max_abs %.2e p50_row %.2e lse %.2e%s\n", describe(c).c_str(), family.c_str(),
              out->choice.config.c_str(), max_abs, p50, lse_err,
              empty_rows ? (" (" + std::to_string(empty_rows) + " empty rows)").c_str() : "");
  out->o_bits = std::move(ho);
}

/// Runs a case on every family.
void run_all(const MaskCase& c, std::uint64_t salt) {
  for (const auto& f : families()) {
    Outcome out;
    run_mask_case(c, f, salt, &out);
  }
}

MaskCase dense(int b, int sq, int sk, int hq, int hkv, int d, DType dt = kBf16, bool causal = false) {
  MaskCase c;
  c.b = b, c.sq = sq, c.sk = sk, c.hq = hq, c.hkv = hkv, c.d = d, c.dt = dt, c.causal = causal;
  return c;
}
MaskCase window(MaskCase c, int wl, int wr) {
  c.wl = wl, c.wr = wr;
  return c;
}
MaskCase global(MaskCase c, int g, bool gq) {
  c.g = g, c.gq = gq;
  return c;
}
MaskCase packed(std::vector<int> lq, std::vector<int> lk, int hq, int hkv, int d, DType dt = kBf16, bool causal = false) {
  MaskCase c;
  c.lq = std::move(lq), c.lk = std::move(lk), c.hq = hq, c.hkv = hkv, c.d = d, c.dt = dt, c.causal = causal;
  return c;
}

// ---- sliding windows ------------------------------------------------------------------------

TEST(MasksGpuWindow, OddLengthsWindowZeroAndWide) {
  std::uint64_t salt = 1000;
  for (int n : {1, 7, 127, 1000}) {
    run_all(window(dense(2, n, n, 2, 2, 64), 0, 0), salt++);                    // window 0: the diagonal only
    run_all(window(dense(1, n, n, 2, 1, 128, kF16, true), 0, 0), salt++);      // causal + window 0
    run_all(window(dense(1, n, n, 2, 2, 128), 5000, 5000), salt++);            // wider than the sequence
    run_all(window(dense(1, n, n, 4, 2, 64, kF16, true), 100, -1), salt++);    // Mistral: causal, left window
  }
}

TEST(MasksGpuWindow, HeadDimsDtypesAndUnequalLengths) {
  std::uint64_t salt = 1100;
  for (int d : {64, 128, 256})
    for (DType dt : {kBf16, kF16}) {
      run_all(window(dense(1, 1000, 1000, 4, 2, d, dt, true), 200, 0), salt++);   // causal sliding window
      run_all(window(dense(1, 777, 777, 2, 2, d, dt), 64, 33), salt++);           // two-sided, non-causal
    }
  for (bool causal : {false, true}) {
    run_all(window(dense(1, 300, 1000, 4, 2, 128, kBf16, causal), 128, 16), salt++);  // sq < sk
    run_all(window(dense(1, 1000, 300, 4, 2, 128, kF16, causal), 128, 16), salt++);   // sq > sk: rows see nothing
    run_all(window(dense(2, 1, 2049, 8, 8, 64, kBf16, causal), 1024, -1), salt++);    // decode-like row
  }
}

// ---- global tokens -----------------------------------------------------------------------

TEST(MasksGpuGlobal, SinksAndGlobalQueries) {
  std::uint64_t salt = 1200;
  for (int g : {0, 1, 4, 64, 100, 300}) {
    run_all(global(window(dense(1, 1000, 1000, 2, 2, 64, kBf16, true), 128, 0), g, false), salt++);
    if (g > 0) run_all(global(window(dense(1, 1000, 1000, 2, 2, 128, kF16, false), 50, 50), g, true), salt++);
  }
  run_all(global(window(dense(1, 2047, 2047, 4, 1, 128, kBf16, true), 512, 0), 64, false), salt++);
  run_all(global(window(dense(1, 300, 1200, 2, 2, 256, kBf16, true), 100, 0), 40, true), salt++);   // sq < sk
  run_all(global(window(dense(1, 1200, 300, 2, 2, 64, kF16, true), 100, 0), 40, false), salt++);    // sq > sk
  run_all(global(window(dense(2, 127, 127, 2, 2, 256, kF16), 0, 0), 7, true), salt++);
}

// ---- score modifiers -----------------------------------------------------------------------

TEST(MasksGpuSoftcap, CappedScoresAllHeadDims) {
  std::uint64_t salt = 1300;
  for (int d : {64, 128, 256})
    for (DType dt : {kBf16, kF16}) {
      MaskCase c = dense(1, 1000, 1000, 2, 2, d, dt, true);
      c.softcap = 50.f, c.scale = 1.f;  // Gemma-2's cap with scores of spread ~sqrt(d): the cap bends them
      run_all(c, salt++);
      MaskCase s = dense(2, 127, 127, 2, 1, d, dt, false);
      s.softcap = 1.f;  // a small cap bends every score
      run_all(s, salt++);
    }
  MaskCase u = dense(1, 7, 1000, 4, 2, 128, kBf16, true);  // sq != sk with softcap
  u.softcap = 30.f;
  run_all(u, salt++);
}

TEST(MasksGpuAlibi, BloomSlopesNonPowerOfTwoHeads) {
  std::uint64_t salt = 1400;
  for (bool causal : {false, true})
    for (int d : {64, 128, 256}) {
      MaskCase c = dense(1, 1000, 1000, 12, 4, d, d == 128 ? kF16 : kBf16, causal);  // 12 heads: 8 + 4 interleaved
      c.alibi = 1;
      run_all(c, salt++);
    }
  MaskCase pb = dense(3, 127, 300, 6, 6, 64, kBf16, true);  // per-(batch, head) slopes, sq != sk
  pb.alibi = 2;
  run_all(pb, salt++);
  MaskCase odd = dense(2, 1, 7, 3, 1, 128, kF16);
  odd.alibi = 1;
  run_all(odd, salt++);
}

TEST(MasksGpuCombined, SoftcapAlibiWindowSinks) {
  std::uint64_t salt = 1500;
  MaskCase c = global(window(dense(2, 1000, 1000, 6, 2, 128, kBf16, true), 256, 0), 16, false);
  c.softcap = 20.f;
  c.alibi = 2;
  run_all(c, salt++);
  MaskCase f = global(window(dense(1, 777, 777, 4, 4, 64, kF16), 64, 64), 8, true);
  f.softcap = 5.f;
  f.alibi = 1;
  run_all(f, salt++);
}

#if FLASHCPP_HAS_SM90
/// Two problems that stack every per-score mask feature: a causal window with attention sinks,
/// softcap and per-batch ALiBi (bf16, GQA 24/4, 288 persistent units at 128 rows), and causal
/// with global queries and ALiBi (fp16, 136 units).
std::vector<MaskCase> stacked_mask_cases(int d) {
  MaskCase a = global(window(dense(2, 1500, 1500, 24, 4, d, kBf16, true), 400, 0), 16, false);
  a.softcap = 20.f;
  a.alibi = 2;
  MaskCase b = global(dense(1, 2100, 2100, 16, 16, d, kF16, true), 8, true);
  b.alibi = 1;
  return {a, b};
}
#endif

// The persistent sm90 configs, which dispatch now picks for large causal problems, against fp64
// with every score modifier and element mask they can meet there (softcap, ALiBi per (batch,
// head), window, sinks and global queries), at every head dim, with several tiles per CTA.
TEST(MasksGpuPersistent, EveryMaskOnThePersistentConfigs) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  std::uint64_t salt = 1550;
  int ran = 0;
  for (int d : {64, 128, 256})
    for (const Sm90Twin& t : sm90_twins(d, "_persist")) {
      if (t.config.find("_lean") != std::string::npos) continue;  // takes none of these masks (below)
      if (!sm90_config_takes(t.config, d)) continue;                // a "_k96" twin at d 128
      for (const MaskCase& c : stacked_mask_cases(d)) {
        Outcome out;
        run_mask_case(c, t.config, salt++, &out);
        ++ran;
      }
    }
  EXPECT_GT(ran, 0) << "no persistent sm90 config compiled";
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// d64's 192-row tile (three consumer warpgroups, round-robin ping-pong) under every mask the
// automatic choice would give it: window + sinks + softcap + ALiBi, causal with global queries,
// varlen documents with a window and with ALiBi, and odd lengths that leave the last tile's third
// warpgroup without rows. The automatic choice gives this tile masked problems because this test
// passes (fa3_dispatch.cc, suits).
TEST(MasksGpuWideTile, EveryMaskOnTheD64WideTile) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  const std::vector<std::string> names = cuda::prefill_sm90_configs(64);
  const std::string wide = "sm90_m192n128s4p";
  if (std::find(names.begin(), names.end(), wide) == names.end()) GTEST_SKIP() << wide << " is not compiled";
  std::uint64_t salt = 1580;
  std::vector<MaskCase> cases = stacked_mask_cases(64);
  cases.push_back(window(dense(1, 1000, 1300, 8, 2, 64, kBf16, false), 200, 50));  // two-sided, q shorter than k
  cases.push_back(window(packed({1000, 1, 523, 64, 130}, {}, 4, 2, 64, kBf16, true), 100, 0));
  MaskCase w = packed({257, 1, 800}, {300, 5, 800}, 6, 3, 64, kF16, true);
  w.alibi = 2;
  cases.push_back(w);
  for (const MaskCase& m : cases) {
    Outcome out;
    run_mask_case(m, wide, salt++, &out);
  }
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// ---- NaN inputs ---------------------------------------------------------------------------------

// attention.h: a NaN score at a key a row sees makes that row NaN (every element of O and the
// LSE) on both kernel families, like SDPA and flash-attn; a NaN in the k of a key the row cannot
// see (causal, left of a window, even inside a visited key tile) does not reach it; a row that
// sees no key stays O = 0, LSE = -inf. Before, fmaxf dropped the NaN from the row max, the row max
// stayed -inf, and the epilogue's l > 0 test took the row for an empty one: the sm90 kernel wrote
// NaN O with LSE -inf, the sm80 kernel the same (NaN * 0), and a NaN slope's head likewise.
TEST(MasksGpuNan, NanInQKeysAndSlopesOnBothFamilies) {
  std::uint64_t salt = 1590;
  for (int d : {64, 128, 256}) {
    MaskCase a = dense(2, 300, 300, 4, 2, d, kBf16, true);
    a.nan_q = {{5, 3, 7}, {300 + 299, 0, 0}};  // batch 0 row 5 head 3; batch 1 row 299 head 0
    a.nan_k = {{250, 1, 3}};                   // batch 0 key 250, kv head 1: q heads 2, 3 of rows 250..299
    a.expect_nan_rows = 2 + 2 * 50;
    run_all(a, salt++);
  }
  MaskCase w = window(dense(1, 500, 500, 2, 2, 64, kF16, true), 32, -1);
  w.nan_k = {{100, 0, 0}};  // seen by rows 100..132 of head 0 only; masked in the tiles of later rows
  w.expect_nan_rows = 33;
  run_all(w, salt++);
  MaskCase al = dense(2, 200, 200, 4, 4, 64, kBf16, true);
  al.alibi = 1;
  al.nan_slope_head = 2;
  al.expect_nan_rows = 2 * 200;
  run_all(al, salt++);
  MaskCase empty = dense(1, 100, 40, 2, 2, 64, kBf16, true);  // rows 0..59 see no key
  empty.nan_q = {{10, 0, 0}, {80, 1, 5}};                     // row 10 stays 0 / -inf, row 80 is NaN
  empty.expect_nan_rows = 1;
  run_all(empty, salt++);
  MaskCase sc = dense(1, 129, 129, 2, 2, 128, kF16, false);
  sc.softcap = 30.f;
  sc.nan_q = {{128, 1, 127}};
  sc.expect_nan_rows = 1;
  run_all(sc, salt++);
  MaskCase vl = packed({5, 130, 1}, {}, 4, 2, 128, kBf16, true);
  vl.nan_q = {{5 + 129, 1, 0}, {135, 3, 2}};  // last row of sequence 1 (head 1), sequence 2 (head 3)
  vl.expect_nan_rows = 2;
  vl.extra_rows = 3;
  run_all(vl, salt++);
}

// ---- varlen ----------------------------------------------------------------------------------

TEST(MasksGpuVarlen, DocumentsOfOddLengths) {
  std::uint64_t salt = 1600;
  for (int d : {64, 128, 256})
    for (bool causal : {false, true}) {
      run_all(packed({1, 7, 127, 1000, 1, 300}, {}, 4, 2, d, causal ? kBf16 : kF16, causal), salt++);
    }
  run_all(packed({1, 7, 50}, {10, 7, 127}, 2, 2, 128, kBf16, true), salt++);  // q shorter than k (chunked prefill)
  run_all(packed({10, 7, 127}, {1, 7, 50}, 2, 2, 64, kF16, true), salt++);    // q longer than k: rows see nothing
  run_all(packed({0, 5, 0, 300, 1}, {3, 5, 0, 300, 1}, 2, 1, 64, kBf16, false), salt++);  // empty documents
  MaskCase pad = packed({200, 513, 64}, {}, 2, 2, 128, kBf16, true);  // max_seqlen above every length
  pad.max_pad = 150;
  run_all(pad, salt++);
}

// mask.total_q (attention.h): packed rows past cu_seqlens_q[batch] in q and o; the LSE is
// (heads, total_q), as Python allocates it for a (total_q, heads, d) q, and the kernels leave the
// uncovered rows of O and the LSE as they were (run_mask_case checks both, guards included).
TEST(MasksGpuVarlen, TotalQSetsTheLseLayoutAndLeavesUncoveredRows) {
  std::uint64_t salt = 1650;
  MaskCase t = packed({100, 37, 200}, {}, 2, 2, 64, kBf16, true);
  t.extra_rows = 13;
  run_all(t, salt++);
  MaskCase u = packed({1, 513, 64}, {40, 513, 64}, 4, 2, 128, kF16, false);
  u.extra_rows = 1;
  run_all(u, salt++);
}

TEST(MasksGpuVarlen, WithEveryOtherMask) {
  std::uint64_t salt = 1700;
  MaskCase w = window(packed({1000, 1, 523, 64}, {}, 4, 2, 128, kBf16, true), 100, 0);
  run_all(w, salt++);
  MaskCase g = global(window(packed({700, 9, 300}, {}, 2, 2, 64, kF16, true), 64, 0), 8, true);
  run_all(g, salt++);
  MaskCase a = packed({257, 1, 800}, {300, 5, 800}, 6, 3, 128, kBf16, true);
  a.alibi = 2;
  run_all(a, salt++);
  MaskCase s = packed({129, 1000, 2}, {}, 2, 2, 256, kF16, false);
  s.softcap = 10.f;
  run_all(s, salt++);
}

// ---- block-sparse --------------------------------------------------------------------------

/// A strided/local pattern with per-head variation: many full, empty and partial blocks.
bool dilated(int, int h, int i, int j) { return ((i / 48 + j / 48 + h) % 3 != 0) || std::abs(i - j) < 40; }
/// Element-level pseudo-random visibility inside block-level pseudo-random blocks: almost every
/// listed block is partial, so the element bits carry the mask.
bool speckled(int b, int h, int i, int j) {
  const std::uint32_t blk = static_cast<std::uint32_t>((i / 128) * 7919 + (j / 128) * 104729 + h * 31 + b * 17);
  const std::uint32_t el = static_cast<std::uint32_t>(i * 2654435761u ^ (j * 40503u + 0x9E37u));
  return (blk * 2654435761u >> 29) != 0 && ((el >> 13) % 5) != 0;
}

MaskCase sparse(MaskCase c, int bm, int bn, bool per_head, BsFn fn, std::string name) {
  c.bsm = bm, c.bsn = bn, c.bs_per_head = per_head, c.bs_fn = std::move(fn), c.bs_name = std::move(name);
  return c;
}

TEST(MasksGpuBlockSparse, FromMaskFunctions) {
  std::uint64_t salt = 1800;
  for (int d : {64, 128, 256}) {
    run_all(sparse(dense(1, 1000, 1000, 2, 2, d, d == 128 ? kF16 : kBf16), 128, 128, true, dilated, "dilated"), salt++);
    run_all(sparse(dense(2, 777, 1025, 2, 1, d, kBf16), 128, 128, true, speckled, "speckled"), salt++);
  }
  // Combined with the causal flag (the visibility conditions AND together).
  run_all(sparse(dense(1, 1000, 1000, 2, 2, 128, kBf16, true), 128, 128, false, dilated, "dilated"), salt++);
  // Mask blocks larger than the tiles (several key tiles per listed block) and odd sizes.
  run_all(sparse(dense(1, 1000, 1000, 2, 2, 64, kF16), 256, 256, false, speckled, "speckled"), salt++);
  run_all(sparse(dense(1, 127, 1, 2, 2, 128, kBf16), 128, 128, false, dilated, "dilated"), salt++);
  // A document mask built as block-sparse: the same visibility as varlen over the same documents.
  std::vector<int> doc(1000);
  for (int i = 0; i < 1000; ++i) doc[i] = i < 300 ? 0 : (i < 301 ? 1 : (i < 777 ? 2 : 3));
  run_all(sparse(dense(1, 1000, 1000, 4, 2, 128, kBf16), 128, 128, false,
                 [doc](int, int, int i, int j) { return doc[i] == doc[j] && j <= i; }, "documents"),
          salt++);
}

TEST(MasksGpuBlockSparse, SmallBlocksOnTheSm80Kernel) {
  // 64x64 blocks: only 64-row sm80 tiles divide them (head_dim 128 has m64n64 configs). On Hopper
  // the automatic choice falls back to sm80 and says so; forcing sm90 is refused with a sentence.
#if !FLASHCPP_HAS_SM80
  GTEST_SKIP() << left_out_families({"sm80"});
#endif
  const MaskCase c = sparse(dense(1, 1000, 1000, 2, 2, 128, kBf16), 64, 64, true, speckled, "speckled");
  Outcome o;
  run_mask_case(c, "sm80", 1900, &o);
  EXPECT_EQ(o.choice.id, KernelId::kCudaSm80);
  for (const auto& f : families())
    if (f == "sm90") {
      Outcome refused;
      run_mask_case(c, "sm90", 1900, &refused, /*expect_ok=*/false);
      EXPECT_EQ(refused.status.code(), StatusCode::kUnsupported) << refused.status.to_string();
      EXPECT_NE(refused.status.message().find("block-sparse"), std::string::npos) << refused.status.message();
      Outcome automatic;
      run_mask_case(c, "", 1900, &automatic);
      EXPECT_EQ(automatic.choice.id, KernelId::kCudaSm80);
      EXPECT_NE(automatic.choice.reason.find("sm80 kernel"), std::string::npos) << automatic.choice.reason;
    }
}

TEST(MasksGpuBlockSparse, BlocksNoTileDividesAreRefusedWithASentence) {
  const MaskCase c = sparse(dense(1, 256, 256, 2, 2, 64, kBf16), 32, 32, false, dilated, "dilated");
  for (const auto& f : families()) {
    Outcome o;
    run_mask_case(c, f, 1950, &o, /*expect_ok=*/false);
    EXPECT_EQ(o.status.code(), StatusCode::kUnsupported) << o.status.to_string();
    EXPECT_NE(o.status.message().find("32x32"), std::string::npos) << o.status.message();
  }
}

// Pipelined (ping-pong "p" / overlap "o") sm90 configs do not read element bits: forced onto a
// block-sparse mask they are refused with a sentence that names a compiled plain config (their
// twin) or, when none is compiled (sm90_m128n176s2p), says to let dispatch choose.
TEST(MasksGpuBlockSparse, PipelinedConfigsRefuseNamingACompiledConfig) {
#if FLASHCPP_HAS_SM90
  bool hopper = false;
  for (const auto& f : families()) hopper |= f == "sm90";
  if (!hopper) GTEST_SKIP() << "not a Hopper device (or no sm_90a kernels in this build)";
  int refused = 0;
  for (int d : {64, 128, 256}) {
    const std::vector<std::string> names = cuda::prefill_sm90_configs(d);
    const MaskCase c = sparse(dense(1, 512, 512, 2, 2, d, kBf16), 128, 128, false, dilated, "dilated");
    for (const std::string& cfg : names) {
      const std::string base = cfg.substr(0, cfg.find("_persist"));
      if (base.back() != 'p' && base.back() != 'o') continue;
      SCOPED_TRACE(cfg);
      Outcome o;
      run_mask_case(c, cfg, 2200, &o, /*expect_ok=*/false);
      ASSERT_EQ(o.status.code(), StatusCode::kUnsupported) << o.status.to_string();
      const std::string& m = o.status.message();
      const std::size_t at = m.find("its plain twin ");
      if (at == std::string::npos) {
        EXPECT_NE(m.find("leave cuda_config empty"), std::string::npos) << m;
      } else {
        const std::string twin = m.substr(at + 15, m.find(' ', at + 15) - (at + 15));
        EXPECT_NE(std::find(names.begin(), names.end(), twin), names.end()) << "names a config not compiled: " << m;
      }
      ++refused;
    }
  }
  EXPECT_GT(refused, 0) << "no pipelined sm90 config compiled";
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

// ---- races and choices -------------------------------------------------------------------------

TEST(MasksGpuDeterminism, SameInputsSameBits) {
  MaskCase c = global(window(packed({1000, 3, 517}, {}, 4, 2, 128, kBf16, true), 200, 0), 16, false);
  c.alibi = 1;
  c.softcap = 30.f;
  const MaskCase bs = sparse(dense(1, 1000, 1000, 2, 2, 128, kBf16), 128, 128, true, speckled, "speckled");
  for (const MaskCase* m : std::initializer_list<const MaskCase*>{&c, &bs})
    for (const auto& f : families()) {
      Outcome first, again;
      run_mask_case(*m, f, 2000, &first);
      for (int r = 0; r < 3; ++r) {
        run_mask_case(*m, f, 2000, &again);
        ASSERT_EQ(first.o_bits, again.o_bits) << "run " << r << " differs";
      }
    }
}

TEST(MasksGpuDispatch, HopperRunsEveryMaskOnTheSm90Kernel) {
  bool hopper = false;
  for (const auto& f : families()) hopper |= f == "sm90";
  if (!hopper) GTEST_SKIP() << "not a Hopper device (or no sm_90a kernels in this build)";
  MaskCase c = global(window(packed({100, 200}, {}, 4, 2, 128, kBf16, true), 64, 0), 4, false);
  c.softcap = 30.f;
  c.alibi = 1;
  Outcome o;
  run_mask_case(c, "", 2100, &o);
  EXPECT_EQ(o.choice.id, KernelId::kCudaSm90) << o.choice.reason;
  EXPECT_NE(o.choice.reason.find("masks fused"), std::string::npos) << o.choice.reason;
  const MaskCase bs = sparse(dense(1, 512, 512, 2, 2, 64, kBf16), 128, 128, false, dilated, "dilated");
  Outcome ob;
  run_mask_case(bs, "", 2101, &ob);
  EXPECT_EQ(ob.choice.id, KernelId::kCudaSm90) << ob.choice.reason;  // the plain (not ping-pong) config
  EXPECT_NE(ob.choice.config.back(), 'p') << ob.choice.config;  // ping-pong consumers do not read element bits
}

// ---- the sm90 192 / 128 class ---------------------------------------------------------------------

/// The mask cases of the 192 / 128 tests at head dims (d, dv): window, sinks + global queries,
/// softcap, ALiBi per (batch, head), varlen documents of odd lengths (q shorter than k too, and
/// uncovered rows), NaN rows, and a block-sparse mask of 128 x 128 blocks (the plain config's).
std::vector<MaskCase> class192_cases(int d, int dv) {
  std::vector<MaskCase> out;
  out.push_back(window(dense(1, 1000, 1000, 4, 2, d, kBf16, true), 200, 0));
  out.push_back(window(dense(2, 777, 777, 2, 2, d, kF16), 64, 33));
  out.push_back(global(window(dense(1, 1000, 1000, 2, 2, d, kF16, true), 128, 0), 16, true));
  MaskCase cap = dense(2, 127, 127, 2, 1, d, kBf16, false);
  cap.softcap = 1.f;
  out.push_back(cap);
  MaskCase al = dense(1, 1000, 1300, 6, 3, d, kF16, true);
  al.alibi = 2;
  out.push_back(al);
  for (bool causal : {false, true})
    out.push_back(packed({1, 7, 127, 1000, 1, 300}, {}, 4, 2, d, causal ? kBf16 : kF16, causal));
  MaskCase ck = packed({1, 7, 50}, {10, 7, 127}, 2, 2, d, kBf16, true);  // q shorter than k (chunked prefill)
  ck.extra_rows = 3;
  out.push_back(ck);
  MaskCase nan = dense(2, 300, 300, 4, 2, d, kBf16, true);
  nan.nan_q = {{5, 3, 7}};
  nan.nan_k = {{250, 1, 3}};  // batch 0 key 250, kv head 1: q heads 2, 3 of rows 250..299
  nan.expect_nan_rows = 1 + 2 * 50;
  out.push_back(nan);
  out.push_back(sparse(dense(1, 1000, 1000, 2, 2, d, kBf16), 128, 128, true, dilated, "dilated"));
  out.push_back(sparse(dense(2, 777, 1025, 2, 1, d, kF16, true), 128, 128, true, speckled, "speckled"));
  for (MaskCase& c : out) c.dv = dv;
  return out;
}

// DeepSeek's 192 / 128 and pairs padded to it under every mask, on both families: the sm90 kernel's
// automatic choice in its 192 / 128 class (the plain config for block-sparse masks), the sm80
// kernel in the 256 class.
TEST(MasksGpuHeadDim192By128, EveryMaskOnBothFamilies) {
  std::uint64_t salt = 2300;
  for (const auto& [d, dv] : {std::pair{192, 128}, {160, 128}, {192, 96}, {136, 64}})
    for (const MaskCase& c : class192_cases(d, dv)) {
      for (const auto& f : families()) {
        Outcome out;
        run_mask_case(c, f, salt, &out);
        if (f == "sm90")
          EXPECT_NE(out.choice.reason.find("192/128 class"), std::string::npos) << describe(c) << ": " << out.choice.reason;
      }
      ++salt;
    }
}

#if FLASHCPP_HAS_SM90
// Every compiled config of the 192 / 128 class forced by name under the stacked masks (window,
// sinks, softcap, ALiBi; several tiles per CTA for the persistent twin) and varlen; block-sparse
// masks on the plain config only (the pipelined ones refuse them, MasksGpuBlockSparse).
TEST(MasksGpuHeadDim192By128, EveryConfigUnderStackedMasks) {
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  std::uint64_t salt = 2400;
  const std::vector<std::string> names = cuda::prefill_sm90_configs(192, 128);
  ASSERT_FALSE(names.empty()) << "no config of the 192 / 128 class compiled";
  for (const std::string& cfg : names) {
    const bool plain = cfg.substr(0, cfg.find("_persist")).back() != 'p';
    for (const auto& [d, dv] : {std::pair{192, 128}, {136, 64}}) {
      std::vector<MaskCase> cases = stacked_mask_cases(d);
      cases.push_back(window(packed({1000, 1, 523, 64, 130}, {}, 4, 2, d, kBf16, true), 100, 0));
      MaskCase a = packed({257, 1, 800}, {300, 5, 800}, 6, 3, d, kF16, true);
      a.alibi = 2;
      cases.push_back(a);
      if (plain) cases.push_back(sparse(dense(2, 777, 1025, 2, 1, d, kBf16), 128, 128, true, speckled, "speckled"));
      for (MaskCase& c : cases) {
        c.dv = dv;
        Outcome out;
        run_mask_case(c, cfg, salt++, &out);
      }
    }
  }
}
#endif

// The lean-mask configs of d64's 192-row tile (TileConfig::lean_mask: causal and sequence ends
// only) against fp64 on what the automatic choice gives them beyond the dense shapes of
// test_prefill.cc: packed sequences (causal and not; lengths 1, odd, ones that leave the third
// warpgroup without rows, q shorter than k, empty documents, rows no sequence covers) and NaN in q
// and k, where a NaN a row sees makes the row NaN and a masked one does not reach it. Every mask
// they do not run is refused before any launch, with a sentence that names the general twin.
TEST(MasksGpuWideTile, LeanMaskConfigsOnPackedSequencesAndTheirRefusals) {
#if FLASHCPP_HAS_SM90
  cuda::DeviceInfo dev;
  ASSERT_TRUE(cuda::current_device(&dev).ok());
  if (dev.sm_major != 9) GTEST_SKIP() << "needs an sm_90 device";
  std::vector<std::string> lean;
  for (const std::string& n : cuda::prefill_sm90_configs(64))
    if (n.find("_lean") != std::string::npos && n.find("_k") == std::string::npos) lean.push_back(n);  // d64 whole-class
  ASSERT_FALSE(lean.empty()) << "no lean-mask sm90 config compiled";
  std::uint64_t salt = 2700;
  std::vector<MaskCase> cases = {
      packed({1000, 1, 523, 64, 130}, {}, 4, 2, 64, kBf16, true),
      packed({1000, 1, 523, 64, 130}, {}, 4, 2, 64, kF16, false),
      packed({1, 7, 50, 385}, {10, 7, 127, 700}, 2, 2, 64, kBf16, true),  // q shorter than k
      packed({10, 7, 127}, {1, 7, 50}, 2, 2, 64, kF16, true),             // q longer than k: rows see nothing
      packed({0, 5, 0, 300, 1}, {3, 5, 0, 300, 1}, 2, 1, 64, kBf16, false),  // empty documents
  };
  MaskCase t = packed({100, 37, 200}, {}, 2, 2, 64, kBf16, true);
  t.extra_rows = 13;
  cases.push_back(t);
  MaskCase nan = dense(2, 300, 300, 4, 2, 64, kBf16, true);
  nan.nan_q = {{17, 0, 5}};   // batch 0 row 17, head 0
  nan.nan_k = {{250, 1, 3}};  // batch 0 key 250, kv head 1: q heads 2, 3 of rows 250..299
  nan.expect_nan_rows = 1 + 2 * 50;
  cases.push_back(nan);
  MaskCase empty = dense(1, 100, 40, 2, 2, 64, kBf16, true);  // rows 0..59 see no key
  empty.nan_q = {{10, 0, 0}, {80, 1, 5}};                     // row 10 stays 0 / -inf, row 80 is NaN
  empty.expect_nan_rows = 1;
  cases.push_back(empty);
  for (const std::string& cfg : lean)
    for (const MaskCase& c : cases) {
      Outcome out;
      run_mask_case(c, cfg, salt++, &out);
    }
  MaskCase w = window(dense(1, 700, 700, 2, 2, 64, kBf16, true), 64, 0);
  MaskCase g = global(window(dense(1, 700, 700, 2, 2, 64, kBf16, true), 64, 0), 4, false);
  MaskCase sc = dense(1, 700, 700, 2, 2, 64, kBf16, true);
  sc.softcap = 30.f;
  MaskCase al = dense(1, 700, 700, 2, 2, 64, kBf16, false);
  al.alibi = 1;
  MaskCase bs = sparse(dense(1, 768, 768, 2, 2, 64, kBf16), 192, 128, false, dilated, "dilated");
  for (const std::string& cfg : lean)
    for (const MaskCase& c : {w, g, sc, al, bs}) {
      SCOPED_TRACE(cfg + " " + describe(c));
      Outcome out;
      run_mask_case(c, cfg, salt++, &out, /*expect_ok=*/false);
      ASSERT_EQ(out.status.code(), StatusCode::kUnsupported) << out.status.to_string();
      EXPECT_NE(out.status.message().find("lean masks"), std::string::npos) << out.status.message();
      EXPECT_NE(out.status.message().find("its twin sm90_m192n128s4p"), std::string::npos) << out.status.message();
    }
#else
  GTEST_SKIP() << "this build has no sm_90a kernels";
#endif
}

}  // namespace
}  // namespace flashcpp::testing
#else
FLASHCPP_GPU_TESTS_LEFT_OUT(MasksGpu, "sm80", "sm90")
#endif
