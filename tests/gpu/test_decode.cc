// GPU tests of decode (src/cuda/decode/): the split-KV kernel, the merge, append + rotary, paged
// addressing and plan/run under CUDA-graph capture, against
//   - the fp64 reference (cpu::reference_attention on a dense, packed copy of the cache after the
//     append, q rotated by the rule of decode.h): O within atol = rtol = 1e-2, LSE within 1e-3 (5e-3 for bf16 with in-kernel theta rotary)
//     (docs/tolerances.md, the prefill bands);
//   - the CPU decode backend run on a host mirror of the same step: the cache after the append
//     must match it to one ulp of the dtype (the rotation's cos/sin differ by < 1e-6 between
//     double on the host and MUFU on the device, which can flip a rounding), V exactly.
// Fresh random inputs each run (seed printed), O/LSE poisoned with NaN, cache slots past every
// sequence's length poisoned with NaN (a read past the length would poison O). Head dims between
// the compiled classes (64, 128, 256) run padded inside the kernels; a case with `pad` gives every
// head row of q, o, the cache and the new K/V `pad` more elements, poisoned with NaN: a read of
// them would poison O, and O's and the cache's must come back with their poison bits unchanged.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/cpu_backend.h"
#include "flashcpp/decode.h"
#include "flashcpp/half.h"
#include "gpu_util.h"

#if FLASHCPP_HAS_DECODE
namespace flashcpp::testing {
namespace {

constexpr double kAtol = 1e-2, kRtol = 1e-2, kLseAtol = 1e-3, kLseAtolThetaBf16 = 5e-3;

struct GCase {
  std::string name;
  int batch = 1, hq = 32, hkv = 8, d = 128, sq = 1;
  int dv = 0;   ///< head_dim_v (v, v_new, o); 0 = d
  int pad = 0;  ///< elements past each head row (poisoned, never read or written); keeps rows 16-byte aligned
  int width_v() const { return dv ? dv : d; }
  DType dt = DType::kBF16;
  std::vector<int> lens;  ///< cache_seqlens before the step
  int page_size = 0;      ///< 0 = contiguous
  bool append = false;
  RopeStyle rot = RopeStyle::kNone;
  bool tables = false;
  bool cos_sin_cache = false;  ///< tables as one (maxpos, rd) cos_sin_cache in cos_t (rows [cos | sin])
  int rotary_dim = 0;
  bool causal = true;
  int wl = -1;
  float softcap = 0.f;
  bool alibi = false;
  int num_splits = 0;
  int extra_slots = 17;
  bool fp8 = false;  ///< an fp8 e4m3 cache with per-KV-head scales (decode.h)
  /// q rows (one per token and head) scaled by 1e-6 .. 1e5 (bf16; fp16 up to 30) in turn, and
  /// within a row one element 1e6 times smaller than the rest: the fp8 kernel's per-row fp16
  /// scaling of q (decode_mainloop.cuh), past fp16's range for bf16 q (give such a case a softcap,
  /// or its scores of ~1e6 leave the LSE to fp32 rounding)
  bool q_spread = false;
};

std::string describe(const GCase& c) {
  std::string s = c.name + ": b" + std::to_string(c.batch) + " hq" + std::to_string(c.hq) + " hkv" +
                  std::to_string(c.hkv) + " d" + std::to_string(c.d) + (c.dv ? "/" + std::to_string(c.dv) : "") +
                  (c.pad ? " pad" + std::to_string(c.pad) : "") + " sq" + std::to_string(c.sq) +
                  (c.dt == DType::kBF16 ? " bf16" : " fp16") + " page" + std::to_string(c.page_size);
  if (c.append) s += " append";
  if (c.rot != RopeStyle::kNone) s += std::string(" rot-") + rope_style_name(c.rot) + (c.tables ? (c.cos_sin_cache ? "-cache" : "-tables") : "");
  if (c.wl >= 0) s += " wl" + std::to_string(c.wl);
  if (c.softcap > 0) s += " softcap";
  if (c.alibi) s += " alibi";
  if (c.num_splits) s += " splits" + std::to_string(c.num_splits);
  if (c.fp8) s += " fp8";
  if (c.q_spread) s += " q-spread";
  return s;
}

/// Device memory that can be moved (gpu_util's DeviceBuffer cannot).
struct DevMem {
  void* ptr = nullptr;
  DevMem() = default;
  explicit DevMem(std::size_t n) {
    if (cudaMalloc(&ptr, std::max<std::size_t>(n, 16)) != cudaSuccess) ptr = nullptr;
  }
  ~DevMem() { cudaFree(ptr); }
  DevMem(DevMem&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(ptr, o.ptr);
    return *this;
  }
};

/// Host buffer of 16-bit elements with a device twin.
struct Twin {
  std::vector<std::uint16_t> h;
  DevMem d;
  explicit Twin(std::size_t n) : h(std::max<std::size_t>(n, 1)), d(std::max<std::size_t>(n, 1) * 2) {}
  void upload() { cudaMemcpy(d.ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice); }
  void download() { cudaMemcpy(h.data(), d.ptr, h.size() * 2, cudaMemcpyDeviceToHost); }
};
template <class T>
struct TwinOf {
  std::vector<T> h;
  DevMem d;
  explicit TwinOf(std::vector<T> v) : h(std::move(v)) {
    if (h.empty()) h.resize(1);
    d = DevMem(h.size() * sizeof(T));
  }
  void upload() { cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice); }
  void download() { cudaMemcpy(h.data(), d.ptr, h.size() * sizeof(T), cudaMemcpyDeviceToHost); }
};

std::uint16_t to_bits(float x, DType dt) { return dt == DType::kBF16 ? float_to_bf16_bits(x) : float_to_half_bits(x); }

/// A (batch, s, h, d) view whose head rows are w >= d elements apart (w - d padding elements).
TensorView padded_view(void* ptr, DType dt, std::int64_t s, std::int64_t h, int w) {
  return TensorView{ptr, dt, s * h * w, h * w, w};
}

constexpr std::uint16_t kPoison16 = 0xFFFF;  // a NaN no kernel writes (they write 0x7FFF / 0x7FC0)
constexpr std::uint8_t kPoison8 = 0x7f;      // an e4m3 NaN code

/// One decode step with host and device copies of everything. `hp` points at host memory (for
/// the CPU backend), `dp` at device memory; both describe the same step.
struct Step {
  GCase c;
  std::int64_t slots = 0;
  int pps = 0, num_pages = 0, bt_stride = 0;
  Twin q, o, knew, vnew, kc, vc;
  TwinOf<std::int32_t> lens, block_table;
  TwinOf<float> lse, cos_t, sin_t, slopes;
  /// fp8 cache: the codes (kc / vc then hold one unused element) and the per-KV-head scales.
  TwinOf<std::uint8_t> kc8, vc8;
  TwinOf<float> kscale, vscale;
  std::vector<std::uint16_t> o_cpu;
  std::vector<float> lse_cpu;
  DecodeParams hp, dp;

  static std::int64_t need(const GCase& c) {
    int m = 0;
    for (int l : c.lens) m = std::max(m, l + (c.append ? c.sq : 0));
    return m + c.extra_slots;
  }
  /// Elements of a K (w = d + pad) or V (w = dv + pad) cache.
  static std::int64_t cache_elems(const GCase& c, int w) {
    const std::int64_t n = need(c);
    if (c.page_size == 0) return c.batch * n * c.hkv * w;
    const std::int64_t pps = (n + c.page_size - 1) / c.page_size;
    return (c.batch * pps + 5) * c.page_size * c.hkv * w;
  }
  int wk() const { return c.d + c.pad; }
  int wv() const { return c.width_v() + c.pad; }

  Step(const GCase& cs, std::mt19937_64& g)
      : c(cs),
        q(static_cast<std::size_t>(cs.batch) * cs.sq * cs.hq * (cs.d + cs.pad)),
        o(static_cast<std::size_t>(cs.batch) * cs.sq * cs.hq * (cs.width_v() + cs.pad)),
        knew(static_cast<std::size_t>(cs.batch) * cs.sq * cs.hkv * (cs.d + cs.pad)),
        vnew(static_cast<std::size_t>(cs.batch) * cs.sq * cs.hkv * (cs.width_v() + cs.pad)),
        kc(cs.fp8 ? 1 : static_cast<std::size_t>(cache_elems(cs, cs.d + cs.pad))),
        vc(cs.fp8 ? 1 : static_cast<std::size_t>(cache_elems(cs, cs.width_v() + cs.pad))),
        lens(std::vector<std::int32_t>(cs.lens.begin(), cs.lens.end())),
        block_table(std::vector<std::int32_t>{}),
        lse(std::vector<float>(static_cast<std::size_t>(cs.batch) * cs.hq * cs.sq, NAN)),
        cos_t(std::vector<float>{}),
        sin_t(std::vector<float>{}),
        slopes(std::vector<float>{}),
        kc8(std::vector<std::uint8_t>(cs.fp8 ? static_cast<std::size_t>(cache_elems(cs, cs.d + cs.pad)) : 1, kPoison8)),
        // NaN codes: slots no sequence has yet, and the padding
        vc8(std::vector<std::uint8_t>(cs.fp8 ? static_cast<std::size_t>(cache_elems(cs, cs.width_v() + cs.pad)) : 1,
                                      kPoison8)),
        kscale(std::vector<float>{}),
        vscale(std::vector<float>{}) {
    const int D = c.d, Dv = c.width_v();
    const std::int64_t n = need(c);
    std::normal_distribution<float> nd(0.f, 1.f);
    // Random elements, the padding of each head row poisoned (a read of it would poison O).
    auto fill = [&](std::vector<std::uint16_t>& v, int d, int w) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int>(i % w) < d ? to_bits(nd(g), c.dt) : kPoison16;
    };
    fill(q.h, D, wk());
    if (c.q_spread) {
      const float bf16_scale[] = {1e-6f, 1e-3f, 1.f, 30.f, 1e5f}, f16_scale[] = {1e-5f, 1e-3f, 1.f, 3.f, 30.f};
      const float* row_scale = c.dt == DType::kBF16 ? bf16_scale : f16_scale;
      const std::size_t w = static_cast<std::size_t>(wk());
      for (std::size_t r = 0; r * w < q.h.size(); ++r)
        for (int d = 0; d < D; ++d) {
          const float f = row_scale[r % 5] * (d == static_cast<int>(r % D) ? 1e-6f : 1.f);
          q.h[r * w + d] = to_bits(bits_to_float(q.h[r * w + d], c.dt) * f, c.dt);
        }
    }
    fill(knew.h, D, wk());
    fill(vnew.h, Dv, wv());
    std::fill(kc.h.begin(), kc.h.end(), kPoison16);  // NaN: slots no sequence has yet, and the padding
    std::fill(vc.h.begin(), vc.h.end(), kPoison16);
    std::fill(o.h.begin(), o.h.end(), kPoison16);
    DecodeParams p;
    p.batch = c.batch;
    p.seqlen_q = c.sq;
    p.heads_q = c.hq;
    p.heads_kv = c.hkv;
    p.head_dim = D;
    p.head_dim_v = c.dv;
    p.mask.causal = c.causal;
    p.mask.window_left = c.wl;
    p.mask.softcap = c.softcap;
    p.rotary.style = c.rot;
    p.rotary.rotary_dim = c.rotary_dim;
    if (c.page_size > 0) {
      pps = static_cast<int>((n + c.page_size - 1) / c.page_size);
      num_pages = c.batch * pps + 5;
      bt_stride = pps + 1;
      slots = static_cast<std::int64_t>(pps) * c.page_size;
      std::vector<std::int32_t> order(static_cast<std::size_t>(num_pages));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), g);  // random page order
      block_table.h.assign(static_cast<std::size_t>(c.batch) * bt_stride, -1);
      for (int b = 0; b < c.batch; ++b)
        for (int i = 0; i < pps; ++i) block_table.h[b * bt_stride + i] = order[b * pps + i];
      block_table.d = DevMem(block_table.h.size() * 4);
      p.cache.page_size = c.page_size;
      p.cache.num_pages = num_pages;
      p.cache.block_table_stride = bt_stride;
      p.cache.pages_per_seq = pps;
      p.cache.k = padded_view(nullptr, cache_dt(), c.page_size, c.hkv, wk());
      p.cache.v = padded_view(nullptr, cache_dt(), c.page_size, c.hkv, wv());
    } else {
      slots = n;
      p.cache.capacity = static_cast<int>(n);
      p.cache.k = padded_view(nullptr, cache_dt(), n, c.hkv, wk());
      p.cache.v = padded_view(nullptr, cache_dt(), n, c.hkv, wv());
    }
    if (c.fp8) {  // about amax / 448 of N(0, 1) values, different per head and for K and V
      std::uniform_real_distribution<float> u(3.f, 5.f);
      std::vector<float> ks(static_cast<std::size_t>(c.hkv)), vs(ks.size());
      for (auto& x : ks) x = u(g) / 448.f;
      for (auto& x : vs) x = u(g) / 448.f;
      kscale = TwinOf<float>(ks);
      vscale = TwinOf<float>(vs);
    }
    for (int b = 0; b < c.batch; ++b)
      for (int j = 0; j < c.lens[b]; ++j)
        for (int h = 0; h < c.hkv; ++h) {
          const std::int64_t ko = offset(p.cache.k, b, j, h), vo = offset(p.cache.v, b, j, h);
          for (int d = 0; d < D; ++d) {
            if (c.fp8) kc8.h[ko + d] = float_to_fp8e4m3_bits(nd(g) / kscale.h[h]);
            else kc.h[ko + d] = to_bits(nd(g), c.dt);
          }
          for (int d = 0; d < Dv; ++d) {
            if (c.fp8) vc8.h[vo + d] = float_to_fp8e4m3_bits(nd(g) / vscale.h[h]);
            else vc.h[vo + d] = to_bits(nd(g), c.dt);
          }
        }
    if (c.rot != RopeStyle::kNone && c.tables) {
      const int rd = c.rotary_dim ? c.rotary_dim : D;
      const int maxpos = static_cast<int>(slots) + 1;
      std::uniform_real_distribution<float> ang(-3.14159f, 3.14159f);
      std::vector<float> cs_, sn_;
      for (int i = 0; i < maxpos * (rd / 2); ++i) {
        const float a = ang(g);
        cs_.push_back(std::cos(a));
        sn_.push_back(std::sin(a));
      }
      if (c.cos_sin_cache) {  // the same angles as one cache of rows [cos | sin]
        std::vector<float> cache;
        for (int pos = 0; pos < maxpos; ++pos) {
          cache.insert(cache.end(), cs_.begin() + pos * (rd / 2), cs_.begin() + (pos + 1) * (rd / 2));
          cache.insert(cache.end(), sn_.begin() + pos * (rd / 2), sn_.begin() + (pos + 1) * (rd / 2));
        }
        cs_ = cache;
      }
      cos_t = TwinOf<float>(cs_);
      sin_t = TwinOf<float>(sn_);
      p.rotary.max_position = maxpos;
    }
    if (c.alibi) {
      std::uniform_real_distribution<float> u(0.02f, 0.3f);
      std::vector<float> s_(static_cast<std::size_t>(c.hq));
      for (auto& x : s_) x = u(g);
      slopes = TwinOf<float>(s_);
    }
    // Host and device views of the same step.
    hp = p;
    dp = p;
    auto bind = [&](DecodeParams& x, bool dev) {
      auto ptr = [&](auto& twin) -> void* { return dev ? twin.d.ptr : static_cast<void*>(twin.h.data()); };
      x.q = padded_view(ptr(q), c.dt, c.sq, c.hq, wk());
      x.o = padded_view(ptr(o), c.dt, c.sq, c.hq, wv());
      x.lse = static_cast<float*>(ptr(lse));
      x.cache.k.data = c.fp8 ? ptr(kc8) : ptr(kc);
      x.cache.v.data = c.fp8 ? ptr(vc8) : ptr(vc);
      if (c.fp8) {
        x.cache.k_scale = static_cast<const float*>(ptr(kscale));
        x.cache.v_scale = static_cast<const float*>(ptr(vscale));
      }
      x.cache_seqlens = static_cast<const std::int32_t*>(ptr(lens));
      if (c.page_size > 0) x.cache.block_table = static_cast<const std::int32_t*>(ptr(block_table));
      if (c.append) {
        x.k_new = padded_view(ptr(knew), c.dt, c.sq, c.hkv, wk());
        x.v_new = padded_view(ptr(vnew), c.dt, c.sq, c.hkv, wv());
      }
      if (c.rot != RopeStyle::kNone && c.tables) {
        if (c.cos_sin_cache) {
          x.rotary.set_cos_sin_cache(static_cast<const float*>(ptr(cos_t)), x.rotary.max_position,
                                     c.rotary_dim ? c.rotary_dim : D);
        } else {
          x.rotary.cos = static_cast<const float*>(ptr(cos_t));
          x.rotary.sin = static_cast<const float*>(ptr(sin_t));
        }
      }
      if (c.alibi) x.mask.alibi_slopes = static_cast<const float*>(ptr(slopes));
    };
    bind(hp, false);
    bind(dp, true);
    upload_all();
  }

  void upload_all() {
    for (Twin* t : {&q, &o, &knew, &vnew, &kc, &vc}) t->upload();
    lens.upload();
    block_table.upload();
    lse.upload();
    cos_t.upload();
    sin_t.upload();
    slopes.upload();
    kc8.upload();
    vc8.upload();
    kscale.upload();
    vscale.upload();
  }

  DType cache_dt() const { return c.fp8 ? DType::kF8E4M3 : c.dt; }
  /// Cache element i of K (V) as the attention sees it: the value, or code * scale of its KV head.
  float k_at(std::int64_t i, int h) const {
    return c.fp8 ? fp8e4m3_bits_to_float(kc8.h[i]) * kscale.h[h] : bits_to_float(kc.h[i], c.dt);
  }
  float v_at(std::int64_t i, int h) const {
    return c.fp8 ? fp8e4m3_bits_to_float(vc8.h[i]) * vscale.h[h] : bits_to_float(vc.h[i], c.dt);
  }

  std::int64_t offset(const TensorView& t, int b, int j, int h) const {
    if (c.page_size > 0) {
      const std::int32_t page = block_table.h[b * bt_stride + j / c.page_size];
      return page * t.batch_stride + static_cast<std::int64_t>(j % c.page_size) * t.seq_stride + h * t.head_stride;
    }
    return b * t.batch_stride + j * t.seq_stride + h * t.head_stride;
  }
  int total(int b) const { return lens.h[b] + (c.append ? c.sq : 0); }
};

/// Device workspaces + plan for a step.
struct GpuPlan {
  DevMem iw, fw;
  DecodePlan plan;
};

Status plan_gpu(const Step& st, GpuPlan* gp, const std::vector<std::int32_t>* plan_lens = nullptr,
                cudaStream_t stream = nullptr, bool fused_merge = false, bool fused_append = false) {
  DecodePlanOptions po;
  po.backend = Backend::kCuda;
  po.fused_merge = fused_merge;
  po.fused_append = fused_append;
  po.host_cache_seqlens = plan_lens ? plan_lens->data() : st.lens.h.data();
  po.num_splits = st.c.num_splits;
  po.stream = stream;
  DecodeWorkspaceSize ws;
  FLASHCPP_RETURN_IF_ERROR(decode_workspace_size(st.dp, po, &ws));
  gp->iw = DevMem(ws.int_bytes);
  gp->fw = DevMem(ws.float_bytes);
  return decode_plan(st.dp, po, gp->iw.ptr, ws.int_bytes, gp->fw.ptr, ws.float_bytes, &gp->plan);
}

/// The step on the CPU backend (host mirror): writes st.o_cpu / lse_cpu and appends to st.kc.h / vc.h.
void run_cpu(Step& st) {
  std::vector<std::uint16_t> o_save = st.o.h;
  std::vector<float> lse_save = st.lse.h;
  DecodePlanOptions po;
  po.backend = Backend::kCpu;
  po.num_splits = st.c.num_splits;
  DecodeWorkspaceSize ws;
  ASSERT_TRUE(decode_workspace_size(st.hp, po, &ws).ok());
  std::vector<float> iw(ws.int_bytes / 4 + 4), fw(ws.float_bytes / 4 + 4);
  DecodePlan plan;
  Status s = decode_plan(st.hp, po, iw.data(), ws.int_bytes, fw.data(), ws.float_bytes, &plan);
  ASSERT_TRUE(s.ok()) << s.to_string();
  RunOptions ro;
  ro.backend = Backend::kCpu;
  s = decode_run(st.hp, plan, ro);
  ASSERT_TRUE(s.ok()) << s.to_string();
  st.o_cpu = st.o.h;
  st.lse_cpu = st.lse.h;
  st.o.h = o_save;
  st.lse.h = lse_save;
}

void rotate(const GCase& c, const float* cos_t, const float* sin_t, int pos, float* x) {
  if (c.rot == RopeStyle::kNone) return;
  const int rd = c.rotary_dim ? c.rotary_dim : c.d, half = rd / 2;
  for (int i = 0; i < half; ++i) {
    float cs, sn;
    if (c.tables && c.cos_sin_cache) {
      cs = cos_t[pos * rd + i];
      sn = cos_t[pos * rd + half + i];
    } else if (c.tables) {
      cs = cos_t[pos * half + i];
      sn = sin_t[pos * half + i];
    } else {
      const float angle = static_cast<float>(pos) * (1.f / std::pow(10000.f, static_cast<float>(2 * i) / rd));
      cs = static_cast<float>(std::cos(static_cast<double>(angle)));
      sn = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
    const int a = c.rot == RopeStyle::kNeox ? i : 2 * i, b = c.rot == RopeStyle::kNeox ? i + half : 2 * i + 1;
    const float x1 = x[a], x2 = x[b];
    x[a] = std::fma(x1, cs, -(x2 * sn));
    x[b] = std::fma(x2, cs, x1 * sn);
  }
}

/// fp64 reference over the host mirror's cache (after the CPU append).
void reference(const Step& st, cpu::RefOutput* ref) {
  const GCase& c = st.c;
  const int D = c.d, Dv = c.width_v();
  std::vector<std::int32_t> cu_q{0}, cu_k{0};
  int max_k = 0;
  for (int b = 0; b < c.batch; ++b) {
    cu_q.push_back(cu_q.back() + c.sq);
    cu_k.push_back(cu_k.back() + st.total(b));
    max_k = std::max(max_k, st.total(b));
  }
  const std::int64_t tk = std::max<std::int64_t>(cu_k.back(), 1);
  // Dense fp32 copies of the real elements only (q rotated as the kernels rotate it).
  std::vector<float> qd(static_cast<std::size_t>(c.batch) * c.sq * c.hq * D), kd(tk * c.hkv * D), vd(tk * c.hkv * Dv);
  std::vector<float> row(D);
  for (int b = 0; b < c.batch; ++b) {
    for (int t = 0; t < c.sq; ++t)
      for (int h = 0; h < c.hq; ++h) {
        const std::int64_t r = (static_cast<std::int64_t>(b) * c.sq + t) * c.hq + h;
        for (int d = 0; d < D; ++d) row[d] = bits_to_float(st.q.h[r * st.wk() + d], c.dt);
        rotate(c, st.cos_t.h.data(), st.sin_t.h.data(), st.total(b) - c.sq + t, row.data());
        for (int d = 0; d < D; ++d) qd[r * D + d] = bits_to_float(to_bits(row[d], c.dt), c.dt);
      }
    for (int j = 0; j < st.total(b); ++j)
      for (int h = 0; h < c.hkv; ++h) {
        const std::int64_t dst = (cu_k[b] + j) * static_cast<std::int64_t>(c.hkv) + h;
        const std::int64_t ks = st.offset(st.hp.cache.k, b, j, h), vs = st.offset(st.hp.cache.v, b, j, h);
        for (int d = 0; d < D; ++d) kd[dst * D + d] = st.k_at(ks + d, h);
        for (int d = 0; d < Dv; ++d) vd[dst * Dv + d] = st.v_at(vs + d, h);
      }
  }
  AttnParams a;
  a.batch = c.batch;
  a.seqlen_q = c.sq;
  a.seqlen_k = max_k;
  a.heads_q = c.hq;
  a.heads_kv = c.hkv;
  a.head_dim = D;
  a.head_dim_v = Dv;
  a.q = TensorView{qd.data(), DType::kF32, 0, static_cast<std::int64_t>(c.hq) * D, D};
  a.k = TensorView{kd.data(), DType::kF32, 0, static_cast<std::int64_t>(c.hkv) * D, D};
  a.v = TensorView{vd.data(), DType::kF32, 0, static_cast<std::int64_t>(c.hkv) * Dv, Dv};
  a.mask.causal = c.causal;
  a.mask.window_left = c.wl;
  a.mask.softcap = c.softcap;
  a.mask.alibi_slopes = c.alibi ? st.slopes.h.data() : nullptr;
  a.mask.cu_seqlens_q = cu_q.data();
  a.mask.cu_seqlens_k = cu_k.data();
  const Status s = cpu::reference_attention(a, ref);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

struct Errors {
  double max_abs = 0, cpu_max_abs = 0, lse_max = 0;
  std::int64_t bad = 0, nan = 0, lse_bad = 0;
  std::int64_t nan_rows = 0;  ///< rows the fp64 reference gives as NaN (NaN inputs): O and LSE must be NaN there
};

/// Compares the device outputs (already downloaded into st.o.h / st.lse.h) with fp64. Where the
/// reference is NaN (NaN inputs, attention.h) every element and the LSE must be NaN too.
Errors compare_outputs(const Step& st, const cpu::RefOutput& ref) {
  const GCase& c = st.c;
  const int D = c.width_v(), W = st.wv();  // o's columns; the device's rows are W apart, the reference's D
  const std::int64_t total_q = static_cast<std::int64_t>(c.batch) * c.sq;
  // With in-kernel theta rotary the device's fp32 angles differ from the host mirror's in the
  // last bits, so an appended bf16 K element may round one ulp apart (cache_mismatches allows
  // exactly that); such a flip moves a score by ~2^-8 |q_d k_d| * scale, and LSE with it. Seen
  // on the H200: up to 1.7e-3 over 8 appended rows. Tables (shared cos/sin) stay at 1e-3.
  const double lse_tol = c.rot != RopeStyle::kNone && !c.tables && c.dt == DType::kBF16 ? kLseAtolThetaBf16 : kLseAtol;
  Errors e;
  for (int b = 0; b < c.batch; ++b)
    for (int t = 0; t < c.sq; ++t)
      for (int h = 0; h < c.hq; ++h) {
        const std::int64_t row = static_cast<std::int64_t>(b) * c.sq + t;
        const double lo_row = st.lse.h[(static_cast<std::int64_t>(b) * c.hq + h) * c.sq + t];
        if (std::isnan(ref.lse[h * total_q + row])) {
          ++e.nan_rows;
          for (int d = 0; d < D; ++d) e.bad += !std::isnan(bits_to_float(st.o.h[(row * c.hq + h) * W + d], c.dt));
          e.lse_bad += !std::isnan(lo_row);
          continue;
        }
        for (int d = 0; d < D; ++d) {
          const std::int64_t at = (row * c.hq + h) * W + d;
          const double out = bits_to_float(st.o.h[at], c.dt), r = ref.o[(row * c.hq + h) * D + d];
          if (std::isnan(out)) {
            ++e.nan;
            continue;
          }
          const double err = std::fabs(out - r);
          e.max_abs = std::max(e.max_abs, err);
          e.bad += err > kAtol + kRtol * std::fabs(r);
          if (!st.o_cpu.empty()) e.cpu_max_abs = std::max(e.cpu_max_abs, std::fabs(bits_to_float(st.o_cpu[at], c.dt) - r));
        }
        const double lo = st.lse.h[(static_cast<std::int64_t>(b) * c.hq + h) * c.sq + t];
        const double lr = ref.lse[h * total_q + row];
        if (std::isinf(lr)) {
          e.lse_bad += !(std::isinf(lo) && lo < 0);
        } else {
          const double le = std::fabs(lo - lr);
          if (!(le <= lse_tol)) ++e.lse_bad;
          if (!std::isnan(le)) e.lse_max = std::max(e.lse_max, le);
        }
      }
  return e;
}

/// Cache after the step: device vs the CPU backend's append, to one ulp of the dtype.
std::int64_t cache_mismatches(const Step& st, const std::vector<std::uint16_t>& dev_k,
                              const std::vector<std::uint16_t>& dev_v) {
  const double u = st.c.dt == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;  // one ulp relative
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < dev_v.size(); ++i) bad += dev_v[i] != st.vc.h[i];
  for (std::size_t i = 0; i < dev_k.size(); ++i) {
    if (dev_k[i] == st.kc.h[i]) continue;
    const double a = bits_to_float(dev_k[i], st.c.dt), b = bits_to_float(st.kc.h[i], st.c.dt);
    if (!(std::fabs(a - b) <= u * std::fabs(b) + 1e-6)) ++bad;
  }
  return bad;
}

/// The fp8 cache after the step: device codes vs the CPU backend's. V bit for bit; a K code may be
/// one step (adjacent code, same sign) apart where the rotation's cos/sin differ in the last bits
/// (see cache_mismatches). NaN codes (0x7f, 0xff) are equal to each other.
std::int64_t fp8_cache_mismatches(const Step& st, const std::vector<std::uint8_t>& dev_k,
                                  const std::vector<std::uint8_t>& dev_v) {
  auto nan = [](std::uint8_t x) { return (x & 0x7f) == 0x7f; };
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < dev_v.size(); ++i) bad += dev_v[i] != st.vc8.h[i] && !(nan(dev_v[i]) && nan(st.vc8.h[i]));
  for (std::size_t i = 0; i < dev_k.size(); ++i) {
    const std::uint8_t a = dev_k[i], b = st.kc8.h[i];
    if (a == b || (nan(a) && nan(b))) continue;
    const bool rot = st.c.rot != RopeStyle::kNone;
    if (!(rot && (a & 0x80) == (b & 0x80) && std::abs((a & 0x7f) - (b & 0x7f)) == 1)) ++bad;
  }
  return bad;
}

/// Elements of the padding columns (index % w >= d) of a row-major array that are not `poison`
/// any more: the kernels must neither write them (O, the cache) nor need them.
template <class E>
std::int64_t padding_changed(const std::vector<E>& v, int d, int w, E poison) {
  std::int64_t bad = 0;
  if (w == d) return 0;
  for (std::size_t i = 0; i < v.size(); ++i) bad += static_cast<int>(i % w) >= d && v[i] != poison;
  return bad;
}

/// Runs one case on the GPU (plan + run), the CPU backend and fp64; checks everything.
void run_case(const GCase& c, std::uint64_t salt) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 g(gpu_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  Step st(c, g);
  GpuPlan gp;
  // Half of the cases merge the splits inside the split-KV kernel (the same arithmetic as the
  // merge kernel), half launch programmatically (PDL on sm_90: each kernel waits for the one
  // before it first), and half of the appending ones write the new K/V inside the split-KV kernel:
  // every check below must hold unchanged.
  Status s = plan_gpu(st, &gp, nullptr, nullptr, (salt & 2) != 0, (salt & 4) != 0);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(gp.plan.fused_append, c.append && (salt & 4) != 0);
  RunOptions ro;
  ro.backend = Backend::kCuda;
  ro.programmatic_launch = (salt & 1) != 0;
  s = decode_run(st.dp, gp.plan, ro);
  ASSERT_TRUE(s.ok()) << s.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> dev_k(st.kc.h.size()), dev_v(st.vc.h.size());
  CUDA_OK(cudaMemcpy(dev_k.data(), st.kc.d.ptr, dev_k.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dev_v.data(), st.vc.d.ptr, dev_v.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<std::uint8_t> dev_k8(st.kc8.h.size()), dev_v8(st.vc8.h.size());
  CUDA_OK(cudaMemcpy(dev_k8.data(), st.kc8.d.ptr, dev_k8.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dev_v8.data(), st.vc8.d.ptr, dev_v8.size(), cudaMemcpyDeviceToHost));
  const std::vector<std::uint8_t> k8_before = st.kc8.h;
  run_cpu(st);  // host mirror: appends into st.kc.h / vc.h (kc8 / vc8), writes o_cpu
  cpu::RefOutput ref;
  reference(st, &ref);
  st.o.download();
  st.lse.download();
  const Errors e = compare_outputs(st, ref);
  if (c.pad > 0) {
    const int dv = c.width_v();
    EXPECT_EQ(padding_changed(st.o.h, dv, st.wv(), kPoison16), 0) << "O written past head_dim_v";
    if (c.fp8) {
      EXPECT_EQ(padding_changed(dev_k8, c.d, st.wk(), kPoison8), 0) << "the fp8 K cache written past head_dim";
      EXPECT_EQ(padding_changed(dev_v8, dv, st.wv(), kPoison8), 0) << "the fp8 V cache written past head_dim_v";
    } else {
      EXPECT_EQ(padding_changed(dev_k, c.d, st.wk(), kPoison16), 0) << "the K cache written past head_dim";
      EXPECT_EQ(padding_changed(dev_v, dv, st.wv(), kPoison16), 0) << "the V cache written past head_dim_v";
    }
  }
  EXPECT_EQ(e.nan, 0) << "NaN in O (unwritten, or a read past a sequence's length or head dim)";
  EXPECT_EQ(e.bad, 0) << "O elements over tolerance; max_abs_err " << e.max_abs;
  EXPECT_EQ(e.lse_bad, 0) << "LSE rows over tolerance (1e-3, 5e-3 for bf16 theta rotary); max " << e.lse_max;
  if (c.fp8) {
    EXPECT_EQ(fp8_cache_mismatches(st, dev_k8, dev_v8), 0) << "fp8 cache after the step differs from the CPU backend's";
    if (!c.append) EXPECT_EQ(dev_k8, k8_before) << "the fp8 cache was written without append";
  } else if (c.append) {
    EXPECT_EQ(cache_mismatches(st, dev_k, dev_v), 0) << "cache after the append differs from the CPU backend's";
  } else {
    EXPECT_EQ(std::memcmp(dev_k.data(), st.kc.h.data(), dev_k.size() * 2), 0) << "the cache was written without append";
  }
  std::printf("    %-78s splits<=%-3d ctas %-5d%s%s max_abs_err %.3e (cpu %.3e) lse_err %.3e\n", describe(c).c_str(),
              gp.plan.max_splits, gp.plan.ctas, ro.programmatic_launch ? " pdl" : "    ",
              gp.plan.fused_merge ? " fused" : "      ", e.max_abs, e.cpu_max_abs, e.lse_max);
  if (gp.plan.fused_append) std::printf("      (new K/V written by the split-KV kernel)\n");
}

std::uint64_t salt_of(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char ch : s) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return h;
}

std::vector<int> ragged(int batch, int max_len, std::uint64_t salt) {
  std::mt19937_64 g(gpu_seed() ^ salt);
  std::uniform_int_distribution<int> u(0, max_len);
  std::vector<int> v(static_cast<std::size_t>(batch));
  for (auto& x : v) x = u(g);
  if (batch > 2) {
    v[0] = 0;
    v[1] = 1;
  }
  return v;
}

// ---- the cases --------------------------------------------------------------------------------------

TEST(DecodeGpu, CourseShapes) {
  // q (1, 32, 1, 128) against 8192 cached keys: MHA 32/32 and GQA 32/8, heuristic and forced splits.
  for (int hkv : {32, 8})
    for (int splits : {0, 1, 7})
      for (DType dt : {DType::kBF16, DType::kF16}) {
        GCase c;
        c.name = "course";
        c.hq = 32;
        c.hkv = hkv;
        c.lens = {8192};
        c.num_splits = splits;
        c.dt = dt;
        run_case(c, salt_of(describe(c)));
      }
}

TEST(DecodeGpu, RaggedBatchesGqa) {
  for (int batch : {1, 2, 7, 33, 64}) {
    GCase c;
    c.name = "ragged";
    c.batch = batch;
    c.lens = ragged(batch, batch > 16 ? 2048 : 4097, 17 + batch);
    run_case(c, salt_of(describe(c)));
  }
}

TEST(DecodeGpu, PagedRandomPageOrder) {
  for (int ps : {1, 16, 64, 256}) {
    GCase c;
    c.name = "paged";
    c.batch = 5;
    c.page_size = ps;
    c.lens = ragged(5, 3000, 100 + ps);
    run_case(c, salt_of(describe(c)));
  }
  for (int ps = 1; ps <= 256; ps *= 2) {  // every power of two, with append, small
    GCase c;
    c.name = "paged_all";
    c.batch = 3;
    c.hq = 8;
    c.hkv = 2;
    c.d = 64;
    c.sq = 2;
    c.page_size = ps;
    c.append = true;
    c.lens = {ps + 3, 0, 517};
    c.num_splits = 3;
    run_case(c, salt_of(describe(c)));
  }
}

TEST(DecodeGpu, SlidingWindowAlibiSoftcap) {
  std::vector<GCase> cs;
  for (int wl : {0, 100, 1000}) {
    GCase c;
    c.name = "window";
    c.batch = 3;
    c.lens = {5000, 64, 1500};
    c.wl = wl;
    cs.push_back(c);
  }
  GCase a;
  a.name = "alibi";
  a.batch = 2;
  a.lens = {3000, 77};
  a.alibi = true;
  cs.push_back(a);
  GCase s = a;
  s.name = "softcap";
  s.alibi = false;
  s.softcap = 30.f;
  cs.push_back(s);
  for (const GCase& c : cs) run_case(c, salt_of(describe(c)));
}

TEST(DecodeGpu, SpeculativeQueryLengthsCausal) {
  for (int sq : {2, 4, 7, 16}) {
    GCase c;
    c.name = "qlen";
    c.batch = 3;
    c.sq = sq;
    c.append = true;
    c.lens = {2000, 0, 333};
    run_case(c, salt_of(describe(c)));
  }
  GCase m;  // MQA: 32 query heads x 4 tokens = 128 rows per KV head -> two row blocks
  m.name = "mqa_rows128";
  m.batch = 2;
  m.hq = 32;
  m.hkv = 1;
  m.sq = 4;
  m.append = true;
  m.lens = {1000, 5};
  run_case(m, salt_of(describe(m)));
}

TEST(DecodeGpu, AppendRotary) {
  // tables: 0 = theta, 1 = separate cos/sin tables, 2 = one cos_sin_cache (RotarySpec's layouts)
  for (RopeStyle rot : {RopeStyle::kNeox, RopeStyle::kInterleaved})
    for (int tables : {0, 1, 2})
      for (int page : {0, 16}) {
        GCase c;
        c.name = "rotary";
        c.batch = 4;
        c.sq = 4;
        c.append = true;
        c.rot = rot;
        c.tables = tables > 0;
        c.cos_sin_cache = tables == 2;
        c.page_size = page;
        c.rotary_dim = tables ? 64 : 0;
        c.lens = {4000, 1, 250, 0};
        run_case(c, salt_of(describe(c)));
      }
}

TEST(DecodeGpu, HeadDimsAndDtypes) {
  for (int d : {64, 128, 256})
    for (DType dt : {DType::kBF16, DType::kF16}) {
      GCase c;
      c.name = "dims";
      c.batch = 3;
      c.d = d;
      c.dt = dt;
      c.sq = 2;
      c.append = true;
      c.rot = RopeStyle::kNeox;
      c.lens = {1234, 97, 4097};
      run_case(c, salt_of(describe(c)));
    }
}

// Every head dim from 8 to 256 runs in the class that holds it (64, 128, 256), padded inside the
// kernels: the K/V copies zero-fill the chunks past head_dim, q loads zeros there, and O, the split
// partials, both merges and the append store only real elements. Per head dim two steps, both with
// forced splits (the merge runs; the salt varies the fused merge, the fused append and PDL):
//   padded rows: contiguous, GQA 8/2, two speculative tokens, append + neox rotary over the whole
//     head, head rows 8 elements longer and poisoned (never read, never written);
//   dense rows: paged (page 16), MQA 4/1, append + interleaved rotary from tables over part of the
//     head, so the last head's real elements end where the allocation does.
TEST(DecodeGpu, EveryHeadDimPaddedToItsClass) {
  for (int d = 8; d <= 256; d += 8) {
    GCase a;
    a.name = "every_dim_padded";
    a.batch = 3;
    a.hq = 8;
    a.hkv = 2;
    a.d = d;
    a.sq = 2;
    a.pad = 8;
    a.dt = d % 16 == 0 ? DType::kBF16 : DType::kF16;
    a.append = true;
    a.rot = RopeStyle::kNeox;
    a.lens = {300, 1, 777};
    a.num_splits = 3;
    run_case(a, salt_of(describe(a)));
    GCase b;
    b.name = "every_dim_dense_paged";
    b.batch = 2;
    b.hq = 4;
    b.hkv = 1;
    b.d = d;
    b.page_size = 16;
    b.dt = d % 16 == 0 ? DType::kF16 : DType::kBF16;
    b.append = true;
    b.rot = RopeStyle::kInterleaved;
    b.tables = true;
    b.rotary_dim = d >= 16 ? d / 2 / 2 * 2 : d;
    b.lens = {517, 64};
    b.num_splits = 2;
    run_case(b, salt_of(describe(b)));
  }
}

// head_dim_v != head_dim: the class holds both; V is zero-filled past head_dim_v, q and K past
// head_dim, and O and the partials are head_dim_v wide. Padded rows, contiguous and paged, splits.
TEST(DecodeGpu, HeadDimVDiffersFromHeadDim) {
  const std::pair<int, int> pairs[] = {{192, 128}, {128, 64}, {64, 128}, {96, 80}, {8, 256}, {256, 8}, {40, 24}};
  for (const auto& [d, dv] : pairs)
    for (int page : {0, 16}) {
      GCase c;
      c.name = "head_dim_v";
      c.batch = 3;
      c.hq = 8;
      c.hkv = 2;
      c.d = d;
      c.dv = dv;
      c.sq = 2;
      c.pad = page ? 0 : 8;
      c.page_size = page;
      c.append = true;
      c.rot = RopeStyle::kNeox;
      c.lens = {1000, 3, 130};
      c.num_splits = page ? 0 : 4;
      run_case(c, salt_of(describe(c)));
    }
}

// An fp8 cache at head dims between the classes (multiples of 16): padded like the 16-bit one, the
// padding of each head row holding NaN codes that must stay. Head dims 8 past a multiple of 16 are
// refused with a sentence before any kernel (decode_validate.cc).
TEST(DecodeGpu, Fp8CacheAtPaddedHeadDims) {
  const std::pair<int, int> dims[] = {{16, 16}, {48, 48}, {80, 80}, {96, 96}, {112, 112}, {144, 144}, {208, 208}, {96, 80}};
  for (const auto& [d, dv] : dims) {
    GCase c;
    c.name = "fp8_padded";
    c.fp8 = true;
    c.batch = 3;
    c.hq = 8;
    c.hkv = 2;
    c.d = d;
    c.dv = dv == d ? 0 : dv;
    c.sq = 2;
    c.pad = 16;  // fp8 strides are multiples of 16 codes
    c.append = true;
    c.rot = RopeStyle::kNeox;
    c.lens = {1234, 0, 300};
    c.num_splits = 3;
    run_case(c, salt_of(describe(c)));
  }
  GCase r;
  r.name = "fp8_refused";
  r.fp8 = true;
  r.batch = 1;
  r.hq = 2;
  r.hkv = 1;
  r.d = 24;
  r.pad = 8;
  r.lens = {10};
  std::mt19937_64 g(gpu_seed());
  Step st(r, g);
  GpuPlan gp;
  const Status s = plan_gpu(st, &gp);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("an fp8_e4m3 cache with head_dim 24 runs on the CPU backend only"), std::string::npos)
      << s.message();
}

TEST(DecodeGpu, Fp8CacheIsAttentionOverTheDequantizedCache) {
  // fp8 e4m3 codes with per-KV-head scales, against fp64 attention over code * scale and the CPU
  // backend's append (codes of x / scale, K rotated first): every head dim and dtype, contiguous
  // and paged (pages smaller and larger than a tile), splits, GQA and MQA, speculative tokens,
  // rotary, window, softcap and ALiBi. NaN codes poison every slot past the lengths.
  std::vector<GCase> cs;
  for (int d : {64, 128, 256})
    for (DType dt : {DType::kBF16, DType::kF16}) {
      GCase c;
      c.name = "fp8_dims";
      c.fp8 = true;
      c.batch = 3;
      c.d = d;
      c.dt = dt;
      c.sq = 2;
      c.append = true;
      c.rot = RopeStyle::kNeox;
      c.lens = {1234, 0, 4097};
      cs.push_back(c);
    }
  for (int ps : {16, 128}) {
    GCase c;
    c.name = "fp8_paged";
    c.fp8 = true;
    c.batch = 5;
    c.page_size = ps;
    c.lens = ragged(5, 3000, 300 + ps);
    c.num_splits = ps == 16 ? 3 : 0;
    cs.push_back(c);
  }
  GCase m;
  m.name = "fp8_mqa_rot_tables";
  m.fp8 = true;
  m.batch = 2;
  m.hq = 32;
  m.hkv = 1;
  m.sq = 4;
  m.append = true;
  m.rot = RopeStyle::kInterleaved;
  m.tables = true;
  m.lens = {1000, 5};
  cs.push_back(m);
  GCase w;
  w.name = "fp8_window_softcap_alibi";
  w.fp8 = true;
  w.batch = 2;
  w.hq = 8;
  w.hkv = 8;
  w.lens = {5000, 64};
  w.wl = 700;
  w.softcap = 30.f;
  w.alibi = true;
  w.dt = DType::kF16;
  cs.push_back(w);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    GCase q;
    q.name = "fp8_q_spread";
    q.fp8 = true;
    q.dt = dt;
    q.batch = 2;
    q.sq = 3;
    q.lens = {777, 2100};
    q.q_spread = true;
    q.softcap = dt == DType::kF16 ? 0.f : 50.f;
    cs.push_back(q);
  }
  GCase l;
  l.name = "fp8_long";
  l.fp8 = true;
  l.lens = {32768};
  cs.push_back(l);
  for (const GCase& c : cs) run_case(c, salt_of(describe(c)));
}

/// Plan once for bound lengths, capture run() in a CUDA graph, replay with new cache_seqlens and
/// new q / k_new / v_new each step; the host mirror runs the same steps on the CPU backend. With
/// fused_merge the arrival counters must come back to zero after every replay.
void graph_replay_case(bool fused_merge) {
  SCOPED_TRACE(fused_merge ? "fused merge" : "merge kernel");
  GCase c;
  c.name = "graph";
  c.batch = 4;
  c.sq = 1;
  c.append = true;
  c.rot = RopeStyle::kNeox;
  c.page_size = 16;
  c.lens = {3000, 3000, 3000, 3000};  // sets the cache geometry (slots >= 3001 + 17)
  std::mt19937_64 g(gpu_seed() ^ 0xD1CE);
  Step st(c, g);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const std::vector<std::int32_t> bound = {3000, 3000, 3000, 3000};
  GpuPlan gp;
  Status s = plan_gpu(st, &gp, &bound, stream, fused_merge);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(gp.plan.fused_merge, fused_merge && gp.plan.needs_merge);
  RunOptions ro;
  ro.backend = Backend::kCuda;
  ro.stream = stream;
  ro.programmatic_launch = fused_merge;  // and PDL launches inside the graph
  // The first lengths: the cache holds random keys below each length (Step filled up to 3000).
  st.lens.h = {2000, 0, 17, 2999};
  st.lens.upload();
  s = decode_run(st.dp, gp.plan, ro);  // warm-up (first launch opts in to large shared memory)
  ASSERT_TRUE(s.ok()) << s.to_string();
  CUDA_OK(cudaStreamSynchronize(stream));
  run_cpu(st);  // mirror the warm-up step on the host
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  s = decode_run(st.dp, gp.plan, ro);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.ok()) << s.to_string();
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<std::vector<std::int32_t>> steps = {{2001, 1, 18, 1000}, {5, 2002, 2500, 0}, {2999, 7, 64, 65}};
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const auto& lens : steps) {
    SCOPED_TRACE("replay lens " + std::to_string(lens[0]) + "," + std::to_string(lens[1]) + "," +
                 std::to_string(lens[2]) + "," + std::to_string(lens[3]));
    st.lens.h = lens;
    for (auto& x : st.q.h) x = to_bits(nd(g), c.dt);
    for (auto& x : st.knew.h) x = to_bits(nd(g), c.dt);
    for (auto& x : st.vnew.h) x = to_bits(nd(g), c.dt);
    // Keys below each new length that no earlier step wrote are still NaN in the cache: fill
    // both mirrors with the same random rows so the step is well defined.
    for (int b = 0; b < c.batch; ++b)
      for (int j = 0; j < lens[b]; ++j)
        for (int h = 0; h < c.hkv; ++h) {
          const std::int64_t off = st.offset(st.hp.cache.k, b, j, h);
          if (!std::isnan(bits_to_float(st.kc.h[off], c.dt))) continue;
          for (int d = 0; d < c.d; ++d) {
            st.kc.h[off + d] = to_bits(nd(g), c.dt);
            st.vc.h[off + d] = to_bits(nd(g), c.dt);
          }
        }
    std::fill(st.o.h.begin(), st.o.h.end(), 0xFFFF);
    std::fill(st.lse.h.begin(), st.lse.h.end(), NAN);
    st.upload_all();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<std::uint16_t> dev_k(st.kc.h.size()), dev_v(st.vc.h.size());
    CUDA_OK(cudaMemcpy(dev_k.data(), st.kc.d.ptr, dev_k.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dev_v.data(), st.vc.d.ptr, dev_v.size() * 2, cudaMemcpyDeviceToHost));
    run_cpu(st);
    cpu::RefOutput ref;
    reference(st, &ref);
    st.o.download();
    st.lse.download();
    const Errors e = compare_outputs(st, ref);
    EXPECT_EQ(e.nan, 0);
    EXPECT_EQ(e.bad, 0) << "max_abs_err " << e.max_abs;
    EXPECT_EQ(e.lse_bad, 0) << "lse max " << e.lse_max;
    EXPECT_EQ(cache_mismatches(st, dev_k, dev_v), 0);
    st.kc.h = dev_k;  // continue from the device's cache (equal up to rotation ulps)
    st.vc.h = dev_v;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(DecodeGpu, GraphCaptureReplayWithNewLengths) {
  graph_replay_case(false);
  graph_replay_case(true);
}

// The fused append (DecodePlan::fused_append) leaves the same cache bytes and the same O / LSE as
// the append kernel, bit for bit: new tokens that straddle a 64-key tile and a split boundary
// (each split writes its own), forced splits past the tile count, a paged cache of page size 1,
// q_len 1..16, rotary on and off, and 80 query heads on one KV head (two row blocks writing the
// same bytes).
TEST(DecodeGpu, FusedAppendEqualsTheAppendKernel) {
  auto make = [](int batch, int sq, std::vector<int> lens) {
    GCase c;
    c.name = "fused-append";
    c.batch = batch;
    c.sq = sq;
    c.append = true;
    c.lens = std::move(lens);
    return c;
  };
  std::vector<GCase> cases;
  for (int splits : {0, 2, 3, 7, 40, 200}) {  // 40 and 200: the merge's second and seventh LSE rounds
    GCase c = make(4, 4, {62, 127, 1000, 0});  // 62..65 and 127..130 cross a tile boundary
    c.rot = RopeStyle::kNeox;
    c.num_splits = splits;
    cases.push_back(c);
  }
  GCase paged = make(2, 16, {57, 300});
  paged.rot = RopeStyle::kInterleaved;
  paged.tables = true;
  paged.rotary_dim = 64;
  paged.page_size = 1;
  paged.num_splits = 5;
  cases.push_back(paged);
  GCase mqa = make(2, 1, {500, 64});
  mqa.hq = 80;
  mqa.hkv = 1;
  cases.push_back(mqa);
  for (const GCase& c : cases) {
    SCOPED_TRACE(describe(c));
    std::mt19937_64 g(gpu_seed() ^ salt_of(describe(c)));
    Step st(c, g);
    std::vector<std::uint16_t> k[2], v[2], o[2];
    std::vector<float> lse[2];
    for (int fused = 0; fused < 2; ++fused) {
      st.upload_all();  // the same starting cache, q, new K/V and poisoned O / LSE for both runs
      GpuPlan gp;
      Status s = plan_gpu(st, &gp, nullptr, nullptr, false, fused != 0);
      ASSERT_TRUE(s.ok()) << s.to_string();
      ASSERT_EQ(gp.plan.fused_append, fused != 0);
      RunOptions ro;
      ro.backend = Backend::kCuda;
      s = decode_run(st.dp, gp.plan, ro);
      ASSERT_TRUE(s.ok()) << s.to_string();
      CUDA_OK(cudaDeviceSynchronize());
      k[fused].resize(st.kc.h.size());
      v[fused].resize(st.vc.h.size());
      o[fused].resize(st.o.h.size());
      lse[fused].resize(st.lse.h.size());
      CUDA_OK(cudaMemcpy(k[fused].data(), st.kc.d.ptr, k[fused].size() * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(v[fused].data(), st.vc.d.ptr, v[fused].size() * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(o[fused].data(), st.o.d.ptr, o[fused].size() * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(lse[fused].data(), st.lse.d.ptr, lse[fused].size() * 4, cudaMemcpyDeviceToHost));
    }
    EXPECT_NE(std::memcmp(k[0].data(), st.kc.h.data(), k[0].size() * 2), 0) << "the append wrote nothing";
    EXPECT_EQ(std::memcmp(k[0].data(), k[1].data(), k[0].size() * 2), 0) << "K cache differs";
    EXPECT_EQ(std::memcmp(v[0].data(), v[1].data(), v[0].size() * 2), 0) << "V cache differs";
    EXPECT_EQ(std::memcmp(o[0].data(), o[1].data(), o[0].size() * 2), 0) << "O differs";
    EXPECT_EQ(std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * 4), 0) << "LSE differs";
    for (std::uint16_t x : o[1]) ASSERT_FALSE(std::isnan(bits_to_float(x, c.dt))) << "NaN in O (a read of an unwritten slot)";
  }
}

TEST(DecodeGpu, MergeAttentionStates) {
  const int B = 3, N = 5, H = 8, D = 128;
  std::mt19937_64 g(gpu_seed() ^ 0x3E7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    const std::size_t n = static_cast<std::size_t>(B) * N * H * D, rows = static_cast<std::size_t>(B) * H * N;
    const std::size_t es = dtype_size(dt);
    std::vector<std::uint8_t> a(n * es), b(n * es), o_cpu(n * es), o_gpu(n * es);
    for (std::size_t i = 0; i < n; ++i) {
      store_from_float(a.data(), dt, static_cast<std::int64_t>(i), nd(g));
      store_from_float(b.data(), dt, static_cast<std::int64_t>(i), nd(g));
    }
    std::vector<float> la(rows), lb(rows), l_cpu(rows), l_gpu(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      la[r] = r % 7 == 0 ? -INFINITY : 3.f * nd(g);
      lb[r] = r % 11 == 0 ? -INFINITY : 3.f * nd(g);
    }
    DeviceBuffer da(a.size()), db(b.size()), dout(a.size()), dla(rows * 4), dlb(rows * 4), dl(rows * 4);
    CUDA_OK(cudaMemcpy(da.ptr, a.data(), a.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(db.ptr, b.data(), b.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dla.ptr, la.data(), rows * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dlb.ptr, lb.data(), rows * 4, cudaMemcpyHostToDevice));
    MergeStatesParams m;
    m.batch = B;
    m.seqlen = N;
    m.heads = H;
    m.head_dim = D;
    m.o_a = bshd_view(a.data(), dt, N, H, D);
    m.o_b = bshd_view(b.data(), dt, N, H, D);
    m.o = bshd_view(o_cpu.data(), dt, N, H, D);
    m.lse_a = la.data();
    m.lse_b = lb.data();
    m.lse = l_cpu.data();
    ASSERT_TRUE(merge_attention_states(m).ok());
    m.o_a.data = da.ptr;
    m.o_b.data = db.ptr;
    m.o.data = dout.ptr;
    m.lse_a = static_cast<float*>(dla.ptr);
    m.lse_b = static_cast<float*>(dlb.ptr);
    m.lse = static_cast<float*>(dl.ptr);
    RunOptions ro;
    ro.backend = Backend::kCuda;
    const Status s = merge_attention_states(m, ro);
    ASSERT_TRUE(s.ok()) << s.to_string();
    CUDA_OK(cudaMemcpy(o_gpu.data(), dout.ptr, o_gpu.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(l_gpu.data(), dl.ptr, rows * 4, cudaMemcpyDeviceToHost));
    // Both round the same fp32 merge (FMA on the device, mul+add on the host) to the dtype: at
    // most one ulp apart.
    const double ulp = dt == DType::kF32 ? 1e-6 : dt == DType::kF16 ? 1.0 / 1024 : 1.0 / 128;
    for (std::size_t i = 0; i < n; ++i) {
      const double ref = load_as_float(o_cpu.data(), dt, static_cast<std::int64_t>(i));
      ASSERT_NEAR(load_as_float(o_gpu.data(), dt, static_cast<std::int64_t>(i)), ref, ulp * std::max(1.0, std::fabs(ref)))
          << i;
    }
    for (std::size_t r = 0; r < rows; ++r) {
      if (std::isinf(l_cpu[r])) ASSERT_TRUE(std::isinf(l_gpu[r]) && l_gpu[r] < 0) << r;
      else ASSERT_NEAR(l_gpu[r], l_cpu[r], 1e-5) << r;
    }
  }
}

// NaN inputs (attention.h): a NaN in q makes its (token, head) row NaN in O and the LSE, a NaN
// ALiBi slope its head's rows; the other heads of the same KV group (which share the CTA, its
// tiles and the merge) stay finite. With one split (the split kernel writes O), several (the
// merge kernel, or the fused merge), and 1 or 4 query tokens. The case is among them:
// GQA 32/8, d128, NaN at q[0, 0, 1, 0]. Before, the split kernel's epilogue skipped a row whose
// warps all had max -inf (fmaxf drops NaN) and wrote a finite row with LSE -inf.
TEST(DecodeGpu, NanQueryOrSlopeMakesItsRowNan) {
  for (int splits : {1, 4})
    for (bool fused_merge : {false, true})
      for (int sq : {1, 4}) {
        if (splits == 1 && fused_merge) continue;  // nothing to merge
        GCase c;
        c.name = "nan";
        c.fp8 = sq == 4;  // the fp8 kernel's fp16 query rows keep the NaN too
        c.batch = 2;
        c.sq = sq;
        c.lens = {1000, 300};
        c.alibi = true;
        c.num_splits = splits;
        SCOPED_TRACE(describe(c) + (fused_merge ? " fused merge" : ""));
        std::mt19937_64 g(gpu_seed() ^ (0xA7 + splits * 16 + sq + fused_merge));
        Step st(c, g);
        const std::uint16_t nan_bits = 0x7FC0;  // bf16 NaN
        auto q_at = [&](int b, int t, int h, int d) { return ((static_cast<std::size_t>(b) * sq + t) * c.hq + h) * c.d + d; };
        st.q.h[q_at(0, 0, 1, 0)] = nan_bits;
        st.q.h[q_at(1, sq - 1, 9, 5)] = nan_bits;
        st.slopes.h[20] = NAN;
        st.upload_all();
        GpuPlan gp;
        Status s = plan_gpu(st, &gp, nullptr, nullptr, fused_merge);
        ASSERT_TRUE(s.ok()) << s.to_string();
        RunOptions ro;
        ro.backend = Backend::kCuda;
        s = decode_run(st.dp, gp.plan, ro);
        ASSERT_TRUE(s.ok()) << s.to_string();
        CUDA_OK(cudaDeviceSynchronize());
        cpu::RefOutput ref;
        reference(st, &ref);
        st.o.download();
        st.lse.download();
        const Errors e = compare_outputs(st, ref);
        EXPECT_EQ(e.nan_rows, 2 + 2 * sq) << "the fp64 reference's NaN rows: two q rows and head 20 of every token";
        EXPECT_EQ(e.nan, 0) << "NaN where the reference is finite";
        EXPECT_EQ(e.bad, 0) << "O over tolerance, or finite where the reference is NaN";
        EXPECT_EQ(e.lse_bad, 0) << "LSE over tolerance, or finite where the reference is NaN";
        EXPECT_EQ(gp.plan.max_splits, splits);
      }
}

// merge_attention_states on CUDA: a NaN LSE on either side gives NaN O and LSE (fmaxf used to
// drop it from the merged LSE), like the CPU rule; the other rows agree with the CPU.
TEST(DecodeGpu, MergeAttentionStatesPropagatesNan) {
  const int H = 4, D = 64;
  std::vector<std::uint16_t> a(H * D), b(H * D), o(H * D);
  for (int i = 0; i < H * D; ++i) a[i] = float_to_bf16_bits(1.f), b[i] = float_to_bf16_bits(2.f);
  std::vector<float> la = {NAN, 0.5f, NAN, 1.f}, lb = {0.25f, NAN, -INFINITY, 2.f}, l(H);
  DeviceBuffer da(a.size() * 2), db(b.size() * 2), dout(o.size() * 2), dla(H * 4), dlb(H * 4), dl(H * 4);
  CUDA_OK(cudaMemcpy(da.ptr, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(db.ptr, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dla.ptr, la.data(), H * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dlb.ptr, lb.data(), H * 4, cudaMemcpyHostToDevice));
  MergeStatesParams m;
  m.batch = 1;
  m.seqlen = 1;
  m.heads = H;
  m.head_dim = D;
  m.o_a = bshd_view(da.ptr, DType::kBF16, 1, H, D);
  m.o_b = bshd_view(db.ptr, DType::kBF16, 1, H, D);
  m.o = bshd_view(dout.ptr, DType::kBF16, 1, H, D);
  m.lse_a = static_cast<float*>(dla.ptr);
  m.lse_b = static_cast<float*>(dlb.ptr);
  m.lse = static_cast<float*>(dl.ptr);
  RunOptions ro;
  ro.backend = Backend::kCuda;
  ASSERT_TRUE(merge_attention_states(m, ro).ok());
  CUDA_OK(cudaMemcpy(o.data(), dout.ptr, o.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(l.data(), dl.ptr, H * 4, cudaMemcpyDeviceToHost));
  for (int h = 0; h < 3; ++h) EXPECT_TRUE(std::isnan(l[h])) << "head " << h << ": " << l[h];
  for (int h = 0; h < 2; ++h)  // head 2's other side is empty: its O is o_a as given
    for (int d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(bf16_bits_to_float(o[h * D + d]))) << h << " " << d;
  EXPECT_NEAR(l[3], 2.f + std::log1p(std::exp(-1.f)), 1e-5);
  for (int d = 0; d < D; ++d) EXPECT_TRUE(std::isfinite(bf16_bits_to_float(o[3 * D + d])));
}

TEST(DecodeGpu, ValidationReachesNoKernel) {
  GCase c;
  c.batch = 2;
  c.lens = {10, 20};
  c.page_size = 16;
  std::mt19937_64 g(1);
  Step st(c, g);
  DecodeParams p = st.dp;
  p.cache.page_size = 48;
  GpuPlan gp;
  DecodePlanOptions po;
  po.backend = Backend::kCuda;
  DecodeWorkspaceSize ws;
  Status s = decode_workspace_size(p, po, &ws);
  EXPECT_NE(s.message().find("cache.page_size 48 is not a power of two"), std::string::npos) << s.message();
  p = st.dp;
  p.q.data = static_cast<char*>(p.q.data) + 2;  // misaligned for 16-byte loads
  ASSERT_TRUE(plan_gpu(st, &gp).ok());
  s = decode_run(p, gp.plan, {});
  EXPECT_NE(s.message().find("not 16-byte aligned"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace flashcpp::testing
#else
FLASHCPP_GPU_TESTS_LEFT_OUT(DecodeGpu, "decode")
#endif
