// GPU tests of the rotary fused into attention (AttnRotary, attention.h) on every compiled config
// of both prefill kernel families (sm80 everywhere, sm90 on a Hopper device).
//
// Two checks per case and config:
//   1. exact: the fused run must equal, bit for bit (O and LSE), apply_rotary on the GPU into
//      copies of q and k followed by the same config without rotary. The kernels rotate with the
//      same expression and cos/sin rule as apply_rotary (src/cuda/common/rope.cuh), so any
//      indexing slip (wrong position, row, panel, swizzle, pair) shows as a changed bit;
//   2. band: the fused O against the fp64 reference (cpu::reference_attention) on q and k rotated
//      by the CPU apply_rotary: |O - ref| <= 1e-2 + 1e-2 |ref|, |LSE - ref| <= 1e-3
//      (docs/tolerances.md); CPU and GPU sin/cos may differ by an ulp, inside that band.
//   3. keys: the rotated keys the pre-pass leaves in rotary.k_rotated equal apply_rotary's k bit
//      for bit; configs alternate between a separate buffer and k itself (rotated in place, k
//      re-uploaded before each run).
// O, the LSE and k_rotated start as NaN (0xFF) before every run: an unwritten element fails.
// Fresh random inputs each run (FLASHCPP_SEED).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "core/selector.h"
#if FLASHCPP_HAS_SM80
#include "cuda/prefill/fa2_registry.h"
#endif
#if FLASHCPP_HAS_SM90
#include "cuda/prefill/fa3_registry.h"
#endif
#include "flashcpp/fused.h"
#include "gpu_util.h"

#if FLASHCPP_HAS_SM80 || FLASHCPP_HAS_SM90
namespace flashcpp::testing {
namespace {

constexpr double kAtol = 1e-2, kRtol = 1e-2, kLseAtol = 1e-3;

struct RotCase {
  int b = 1, sq = 0, sk = 0, hq = 2, hkv = 2, d = 64;
  DType dt = DType::kBF16;
  std::vector<int> lq, lk;  ///< varlen lengths (lq non-empty = varlen; lk empty = lq)
  bool causal = false;
  int wl = -1;
  float softcap = 0.f;
  int rot = 0;  ///< rotary_dim (0 = head_dim)
  RopeStyle style = RopeStyle::kNeox;
  bool llama3 = false, cache = false, positions = false;
  bool separate = false;  ///< with cache: the same angles as two tables with a padded row stride
};

std::string describe(const RotCase& c) {
  std::string s = c.lq.empty() ? "b" + std::to_string(c.b) + " sq" + std::to_string(c.sq) + " sk" + std::to_string(c.sk)
                               : "varlen" + std::to_string(c.lq.size());
  s += " hq" + std::to_string(c.hq) + " hkv" + std::to_string(c.hkv) + " d" + std::to_string(c.d) +
       (c.dt == DType::kBF16 ? " bf16" : " fp16") + (c.causal ? " causal" : "") +
       (c.wl >= 0 ? " wl" + std::to_string(c.wl) : "") + (c.softcap > 0.f ? " softcap" : "") + " rot" +
       std::to_string(c.rot ? c.rot : c.d) + (c.style == RopeStyle::kNeox ? " neox" : " interleaved") +
       (c.llama3 ? " llama3" : "") + (c.cache ? (c.separate ? " tables" : " cache") : "") +
       (c.positions ? " positions" : "");
  return s;
}

/// Every compiled config of the families this device runs that takes rotary.
std::vector<std::string> configs(int d) {
  std::vector<std::string> out;
#if FLASHCPP_HAS_SM80
  for (const auto& e : cuda::fa2_entries(d)) out.push_back(select::sm80_config_name(e.tile));
#endif
#if FLASHCPP_HAS_SM90
  if (sm90_device())
    for (const auto& e : cuda::fa3_entries(d, d))
      out.push_back(select::sm90_config_name(e.tile));
#endif
  return out;
}

template <class T>
void upload(DeviceBuffer& d, const std::vector<T>& h) {
  ASSERT_TRUE(d.ptr != nullptr);
  if (!h.empty()) CUDA_OK(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

void run_case(const RotCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 gen(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const SeqLayout sl = seq_layout(c.lq, c.lk, c.b, c.sq, c.sk);
  const bool vl = sl.varlen;
  const std::vector<int>& lk = c.lk.empty() ? c.lq : c.lk;
  const int batch = sl.batch, max_q = sl.max_q, max_k = sl.max_k;
  const std::vector<std::int32_t>& cu_q = sl.cu_q;
  const std::vector<std::int32_t>& cu_k = sl.cu_k;
  const int rows_q = static_cast<int>(sl.rows_q), rows_k = static_cast<int>(sl.rows_k);
  const std::int64_t nq = static_cast<std::int64_t>(rows_q) * c.hq * c.d, nk = static_cast<std::int64_t>(rows_k) * c.hkv * c.d;
  const std::int64_t n_lse = static_cast<std::int64_t>(rows_q) * c.hq;
  const auto hq_bits = random_half_bits(nq, c.dt, gen), hk_bits = random_half_bits(nk, c.dt, gen),
             hv_bits = random_half_bits(nk, c.dt, gen);

  // Positions: given (random, up to 3000) or the defaults (query i at i + len_k - len_q, key j at
  // j), as explicit arrays for the unfused path either way.
  std::vector<std::int32_t> pos_q(rows_q), pos_k(rows_k);
  std::uniform_int_distribution<int> upos(0, 2999);
  for (int b = 0; b < batch; ++b) {
    const int q0 = vl ? cu_q[b] : b * c.sq, k0 = vl ? cu_k[b] : b * c.sk;
    const int len_q = vl ? c.lq[b] : c.sq, len_k = vl ? lk[b] : c.sk;
    for (int i = 0; i < len_q; ++i) pos_q[q0 + i] = c.positions ? upos(gen) : i + len_k - len_q;
    for (int j = 0; j < len_k; ++j) pos_k[k0 + j] = c.positions ? upos(gen) : j;
  }
  const int rot = c.rot ? c.rot : c.d, half = rot / 2, max_pos = 3072;
  Llama3Scaling l3;
  if (c.llama3) l3.factor = 8.f, l3.original_max_position = 512;
  std::vector<float> cache;
  if (c.cache) {  // fp32 [max_pos][cos | sin], from the fp64 inv_freq
    cache.resize(static_cast<std::size_t>(max_pos) * rot);
    for (int p = 0; p < max_pos; ++p)
      for (int i = 0; i < half; ++i) {
        const double a = p * rotary_inv_freq(i, rot, 10000.0, l3);
        cache[static_cast<std::size_t>(p) * rot + i] = static_cast<float>(std::cos(a));
        cache[static_cast<std::size_t>(p) * rot + half + i] = static_cast<float>(std::sin(a));
      }
  }
  // c.separate: the same values as two tables (flash-attn's rotary_cos / rotary_sin) with rows
  // padded to half + 3 (NaN in the padding, so a stride mistake shows as NaN).
  const std::int64_t sep_stride = half + 3;
  std::vector<float> sep_cos, sep_sin;
  if (c.cache && c.separate) {
    sep_cos.assign(static_cast<std::size_t>(max_pos * sep_stride), NAN);
    sep_sin.assign(sep_cos.size(), NAN);
    for (int p = 0; p < max_pos; ++p)
      for (int i = 0; i < half; ++i) {
        sep_cos[static_cast<std::size_t>(p * sep_stride + i)] = cache[static_cast<std::size_t>(p) * rot + i];
        sep_sin[static_cast<std::size_t>(p * sep_stride + i)] = cache[static_cast<std::size_t>(p) * rot + half + i];
      }
  }
  auto set_tables = [&](RotarySpec& r, const float* cache_ptr, const float* cos_ptr, const float* sin_ptr) {
    if (!c.cache) return;
    if (!c.separate) {
      r.set_cos_sin_cache(cache_ptr, max_pos, rot);
      return;
    }
    r.cos = cos_ptr;
    r.sin = sin_ptr;
    r.table_stride = sep_stride;
    r.max_position = max_pos;
  };

  DeviceBuffer q(nq * 2), k(nk * 2), v(nk * 2), q2(nq * 2), k2(nk * 2), o(nq * 2), o2(nq * 2),
      lse(sizeof(float) * n_lse), lse2(sizeof(float) * n_lse), d_pos_q(4 * rows_q), d_pos_k(4 * rows_k),
      d_cache(sizeof(float) * std::max<std::size_t>(cache.size(), 1)), d_cu_q(4 * (batch + 1)), d_cu_k(4 * (batch + 1)),
      kr(nk * 2), d_cos(sizeof(float) * std::max<std::size_t>(sep_cos.size(), 1)),
      d_sin(sizeof(float) * std::max<std::size_t>(sep_sin.size(), 1));
  upload(q, hq_bits);
  upload(k, hk_bits);
  upload(v, hv_bits);
  upload(q2, hq_bits);
  upload(k2, hk_bits);
  upload(d_pos_q, pos_q);
  upload(d_pos_k, pos_k);
  if (c.cache) upload(d_cache, cache);
  if (c.separate) {
    upload(d_cos, sep_cos);
    upload(d_sin, sep_sin);
  }
  upload(d_cu_q, cu_q);
  upload(d_cu_k, cu_k);

  auto view = [&](void* ptr, int seqlen, int heads) {
    return vl ? TensorView{ptr, c.dt, 0, static_cast<std::int64_t>(heads) * c.d, c.d}
              : bshd_view(ptr, c.dt, seqlen, heads, c.d);
  };
  AttnParams p = attn_params(batch, max_q, max_k, c.hq, c.hkv, c.d, c.dt, vl, q.ptr, k.ptr, v.ptr, o.ptr);
  p.lse = static_cast<float*>(lse.ptr);
  p.mask.causal = c.causal;
  p.mask.window_left = c.wl;
  p.mask.softcap = c.softcap;
  if (vl) {
    p.mask.cu_seqlens_q = static_cast<const std::int32_t*>(d_cu_q.ptr);
    p.mask.cu_seqlens_k = static_cast<const std::int32_t*>(d_cu_k.ptr);
  }
  p.rotary.spec.rotary_dim = rot;
  p.rotary.spec.style = c.style;
  p.rotary.spec.llama3 = l3;
  set_tables(p.rotary.spec, static_cast<const float*>(d_cache.ptr), static_cast<const float*>(d_cos.ptr),
             static_cast<const float*>(d_sin.ptr));
  if (c.positions) {
    p.rotary.positions_q = static_cast<const std::int32_t*>(d_pos_q.ptr);
    p.rotary.positions_k = static_cast<const std::int32_t*>(d_pos_k.ptr);
  }

  // ---- unfused inputs: apply_rotary on the GPU (q and k separately: their positions differ) ----
  auto rotate = [&](void* ptr, int heads, int rows, int seqlen, const DeviceBuffer& pos, const RunOptions& ro) {
    RopeParams rp;
    rp.batch = vl ? 1 : batch;
    rp.seqlen = vl ? rows : seqlen;
    rp.heads_q = heads;
    rp.head_dim = c.d;
    rp.q = bshd_view(ptr, c.dt, rp.seqlen, heads, c.d);
    rp.positions = static_cast<const std::int32_t*>(pos.ptr);
    rp.rotary = p.rotary.spec;  // the same RotarySpec
    return apply_rotary(rp, ro);
  };
  RunOptions gro;
  gro.backend = Backend::kCuda;
  ASSERT_TRUE(rotate(q2.ptr, c.hq, rows_q, max_q, d_pos_q, gro).ok());
  ASSERT_TRUE(rotate(k2.ptr, c.hkv, rows_k, max_k, d_pos_k, gro).ok());
  AttnParams p2 = p;
  p2.q = view(q2.ptr, max_q, c.hq);
  p2.k = view(k2.ptr, max_k, c.hkv);
  p2.o = view(o2.ptr, max_q, c.hq);
  p2.lse = static_cast<float*>(lse2.ptr);
  p2.rotary = AttnRotary{};

  // ---- fp64 reference on CPU-rotated copies -----------------------------------------------------
  std::vector<std::uint16_t> hq_rot = hq_bits, hk_rot = hk_bits;
  {
    RunOptions cro;
    cro.backend = Backend::kCpu;
    RopeParams rp;
    rp.batch = 1;
    rp.head_dim = c.d;
    rp.rotary.rotary_dim = rot;
    rp.rotary.style = c.style;
    rp.rotary.llama3 = l3;
    set_tables(rp.rotary, cache.data(), sep_cos.data(), sep_sin.data());
    rp.seqlen = rows_q;
    rp.heads_q = c.hq;
    rp.q = bshd_view(hq_rot.data(), c.dt, rows_q, c.hq, c.d);
    rp.positions = pos_q.data();
    ASSERT_TRUE(apply_rotary(rp, cro).ok());
    rp.seqlen = rows_k;
    rp.heads_q = c.hkv;
    rp.q = bshd_view(hk_rot.data(), c.dt, rows_k, c.hkv, c.d);
    rp.positions = pos_k.data();
    ASSERT_TRUE(apply_rotary(rp, cro).ok());
  }
  AttnParams hp = p;
  hp.q = view(hq_rot.data(), max_q, c.hq);
  hp.k = view(hk_rot.data(), max_k, c.hkv);
  hp.v = view(const_cast<std::uint16_t*>(hv_bits.data()), max_k, c.hkv);
  hp.o = TensorView{};
  hp.lse = nullptr;
  hp.mask.cu_seqlens_q = vl ? cu_q.data() : nullptr;
  hp.mask.cu_seqlens_k = vl ? cu_k.data() : nullptr;
  hp.rotary = AttnRotary{};
  cpu::RefOutput ref;
  const Status rs = cpu::reference_attention(hp, &ref);
  ASSERT_TRUE(rs.ok()) << rs.to_string();

  std::vector<std::uint16_t> hk2(nk);
  CUDA_OK(cudaMemcpy(hk2.data(), k2.ptr, k2.bytes, cudaMemcpyDeviceToHost));
  int run_index = 0;
  for (const std::string& cfg : configs(c.d)) {
    if (!sm90_config_takes(cfg, c.d)) continue;  // a Q K^T twin of smaller head dims (its refusal: test_selector)
    SCOPED_TRACE(cfg);
    // Keys rotated into a separate buffer, or in place into k (every other config).
    const bool in_place = (run_index++ + salt) % 2 == 1;
    SCOPED_TRACE(in_place ? "k_rotated = k (in place)" : "k_rotated separate");
    upload(k, hk_bits);
    CUDA_OK(cudaMemset(kr.ptr, 0xFF, kr.bytes));
    p.rotary.k_rotated = view(in_place ? k.ptr : kr.ptr, max_k, c.hkv);
    RunOptions opt;
    opt.backend = Backend::kCuda;
    opt.cuda_config = cfg;
    KernelChoice choice;
    Status st = select_kernel(p, opt, &choice);
    // A lean-mask twin refuses windows and sinks with its sentence (MasksGpuWideTile checks it).
    if (!st.ok() && cfg.find("_lean") != std::string::npos && st.message().find("lean masks") != std::string::npos)
      continue;
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (auto* b : {&o, &o2, &lse, &lse2}) CUDA_OK(cudaMemset(b->ptr, 0xFF, b->bytes));
    st = attention_forward(p, opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    st = attention_forward(p2, opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<std::uint16_t> ho(nq), ho2(nq);
    std::vector<float> hl(n_lse), hl2(n_lse);
    CUDA_OK(cudaMemcpy(ho.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(ho2.data(), o2.ptr, o2.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hl.data(), lse.ptr, lse.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hl2.data(), lse2.ptr, lse2.bytes, cudaMemcpyDeviceToHost));

    // 1. exact against the unfused path.
    std::int64_t o_diff = 0, lse_diff = 0, first = -1;
    for (std::int64_t x = 0; x < nq; ++x)
      if (ho[x] != ho2[x]) {
        ++o_diff;
        if (first < 0) first = x;
      }
    lse_diff = static_cast<std::int64_t>(std::memcmp(hl.data(), hl2.data(), hl.size() * 4) != 0);
    EXPECT_EQ(o_diff, 0) << "elements differ from apply_rotary + attention (first at " << first << ")";
    EXPECT_EQ(lse_diff, 0) << "LSE differs from apply_rotary + attention";
    std::vector<std::uint16_t> hkr(nk);
    CUDA_OK(cudaMemcpy(hkr.data(), in_place ? k.ptr : kr.ptr, kr.bytes, cudaMemcpyDeviceToHost));
    std::int64_t k_diff = 0;
    for (std::int64_t x = 0; x < nk; ++x) k_diff += hkr[x] != hk2[x];
    EXPECT_EQ(k_diff, 0) << "k_rotated differs from apply_rotary(k)";

    // 2. the band against the fp64 reference (packed rows; reference LSE is (hq, rows_q)).
    double max_abs = 0, lse_err = 0;
    std::int64_t bad = 0, nan = 0, lse_bad = 0;
    for (int b = 0; b < batch; ++b) {
      const int len = vl ? c.lq[b] : c.sq;
      for (int i = 0; i < len; ++i) {
        const std::int64_t row = (vl ? cu_q[b] : static_cast<std::int64_t>(b) * c.sq) + i;
        for (int h = 0; h < c.hq; ++h) {
          for (int dd = 0; dd < c.d; ++dd) {
            const std::int64_t idx = (row * c.hq + h) * c.d + dd;
            const double val = bits_to_float(ho[idx], c.dt), r = ref.o[idx];
            if (!std::isfinite(val)) {
              ++nan;
              continue;
            }
            max_abs = std::max(max_abs, std::fabs(val - r));
            bad += std::fabs(val - r) > kAtol + kRtol * std::fabs(r);
          }
          const double rl = ref.lse[h * static_cast<std::int64_t>(rows_q) + row];
          const double kl = hl[vl ? h * static_cast<std::int64_t>(rows_q) + row
                                  : (static_cast<std::int64_t>(b) * c.hq + h) * c.sq + i];
          if (std::isinf(rl)) {
            lse_bad += !(std::isinf(kl) && kl < 0);
          } else {
            const double e = std::fabs(kl - rl);
            lse_bad += !(e <= kLseAtol);
            if (!std::isnan(e)) lse_err = std::max(lse_err, e);
          }
        }
      }
    }
    EXPECT_EQ(nan, 0) << "NaN/Inf (unwritten) outputs";
    EXPECT_EQ(bad, 0) << "elements over the band; max_abs_err " << max_abs;
    EXPECT_EQ(lse_bad, 0) << "LSE rows over " << kLseAtol << "; max " << lse_err;
    std::printf("    %-84s %-18s exact %s  max_abs %.2e lse %.2e\n", describe(c).c_str(), cfg.c_str(),
                o_diff == 0 && lse_diff == 0 ? "yes" : "NO ", max_abs, lse_err);
  }
}

RotCase dense(int b, int sq, int sk, int hq, int hkv, int d, DType dt, bool causal) {
  RotCase c;
  c.b = b, c.sq = sq, c.sk = sk, c.hq = hq, c.hkv = hkv, c.d = d, c.dt = dt, c.causal = causal;
  return c;
}

TEST(RotaryAttentionGpu, NeoxAndInterleavedEveryHeadDimAndConfig) {
  std::uint64_t salt = 7000;
  for (int d : {64, 128, 256, 96, 80, 32}) {  // 96, 80, 32: padded to their class inside
    RotCase c = dense(2, 200, 200, 4, 2, d, DType::kBF16, true);  // GQA 2, causal, default positions
    run_case(c, ++salt);
    c = dense(1, 77, 203, 2, 1, d, DType::kF16, false);  // odd lengths, MQA, fp16
    c.style = RopeStyle::kInterleaved;
    c.positions = true;
    run_case(c, ++salt);
  }
}

TEST(RotaryAttentionGpu, PartialDimsCacheLlama3AndPositions) {
  std::uint64_t salt = 7100;
  RotCase c = dense(2, 130, 130, 2, 2, 128, DType::kBF16, true);
  c.rot = 64;  // partial neox: pairs (i, i + 32) in one 64-column panel
  c.cache = true;
  c.positions = true;
  run_case(c, ++salt);
  c = dense(1, 1, 517, 4, 4, 128, DType::kF16, true);  // one query row at the bottom right
  c.llama3 = true;
  run_case(c, ++salt);
  c = dense(1, 150, 150, 2, 2, 256, DType::kBF16, false);
  c.rot = 24;  // partial interleaved, not a multiple of 16
  c.style = RopeStyle::kInterleaved;
  c.positions = true;
  run_case(c, ++salt);
  c = dense(1, 64, 300, 2, 2, 64, DType::kBF16, true);
  c.rot = 8;  // the smallest neox piece: one 8-byte piece per half
  c.cache = true;
  run_case(c, ++salt);
  c = dense(2, 130, 130, 2, 2, 128, DType::kBF16, true);
  c.rot = 64;
  c.cache = c.separate = true;  // two tables with a padded stride, on both prefill kernels
  c.positions = true;
  run_case(c, ++salt);
}

TEST(RotaryAttentionGpu, WithVarlenWindowAndSoftcap) {
  std::uint64_t salt = 7200;
  RotCase c;
  c.lq = {5, 130, 64, 1};
  c.lk = {5, 200, 64, 257};
  c.hq = 8, c.hkv = 2, c.d = 128, c.causal = true;
  run_case(c, ++salt);  // default positions: bottom-right per sequence
  c.positions = true;
  c.style = RopeStyle::kInterleaved;
  run_case(c, ++salt);
  c = dense(2, 257, 257, 2, 2, 64, DType::kF16, true);
  c.wl = 40;
  c.softcap = 30.f;
  run_case(c, ++salt);
}

}  // namespace
}  // namespace flashcpp::testing
#else
FLASHCPP_GPU_TESTS_LEFT_OUT(RotaryAttentionGpu, "sm80", "sm90")
#endif
