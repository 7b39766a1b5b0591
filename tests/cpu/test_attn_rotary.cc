// Rotary fused into attention (AttnParams::rotary) on the CPU backends, against a reference
// built here: q and k rotated in fp64 from the formulas (theta^(-2i/rotary_dim), neox or
// interleaved pairs), rounded to the input dtype, then the fp64 attention reference with rotary
// off. Tolerance: atol = rtol = 5e-3 on O and 5e-3 on LSE (the band for rotary in
// attention; a rotated element may round one ulp apart between fp64 here and the library's
// fp32/fp64 rotation). Also: rotary in attention is bit-identical to apply_rotary followed by
// attention (the documented semantics), q and k are left untouched, rotary.k_rotated receives
// exactly apply_rotary's keys (out of place with its own strides, and in place), and every bad
// input gets a sentence. Fresh random inputs each run (FLASHCPP_SEED replays), O, LSE and
// k_rotated poisoned with NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/fused.h"
#include "test_util.h"

namespace flashcpp::testing {
namespace {

struct RotCase {
  int batch = 2, sq = 37, sk = 53, hq = 4, hkv = 2, d = 64;
  DType dt = DType::kBF16;
  bool causal = true;
  RopeStyle style = RopeStyle::kNeox;
  int rot = 0;  // 0 = head_dim
  bool positions = false;
  bool cache = false;
  bool varlen = false;
  double theta = 10000.0;
  Llama3Scaling llama3{};
};

/// fp64 rotation of one (rows, heads, d) contiguous buffer in place, rounded to its dtype.
void rotate_ref(HostBuffer* x, std::int64_t rows, int heads, int d, int rot, RopeStyle style, double theta,
                const Llama3Scaling& l3, const std::vector<std::int32_t>& pos) {
  const int half = rot / 2;
  for (std::int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const std::int64_t base = (r * heads + h) * d;
      for (int i = 0; i < half; ++i) {
        const double f = l3.enabled() ? rotary_inv_freq(i, rot, theta, l3) : std::pow(theta, -2.0 * i / rot);
        const double a = pos[static_cast<std::size_t>(r)] * f, c = std::cos(a), s = std::sin(a);
        const std::int64_t i0 = style == RopeStyle::kNeox ? base + i : base + 2 * i;
        const std::int64_t i1 = style == RopeStyle::kNeox ? base + i + half : base + 2 * i + 1;
        const double x0 = x->get(i0), x1 = x->get(i1);
        x->set(i0, static_cast<float>(x0 * c - x1 * s));
        x->set(i1, static_cast<float>(x1 * c + x0 * s));
      }
    }
}

struct Problem {
  RotCase c;
  std::int64_t rows_q = 0, rows_k = 0;
  std::vector<std::int32_t> cu_q, cu_k, pos_q, pos_k;
  HostBuffer q, k, v, o, lse;
  std::vector<float> cache;
  int max_pos = 6000;

  explicit Problem(const RotCase& rc, std::mt19937_64& g) : c(rc) {
    if (c.varlen) {
      cu_q = {0};
      cu_k = {0};
      const int lq[] = {5, 1, 17}, lk[] = {9, 1, 23};
      for (int b = 0; b < c.batch; ++b) {
        cu_q.push_back(cu_q.back() + lq[b % 3]);
        cu_k.push_back(cu_k.back() + lk[b % 3]);
      }
      rows_q = cu_q.back();
      rows_k = cu_k.back();
      c.sq = 17;
      c.sk = 23;
    } else {
      rows_q = static_cast<std::int64_t>(c.batch) * c.sq;
      rows_k = static_cast<std::int64_t>(c.batch) * c.sk;
    }
    q = HostBuffer(c.dt, rows_q * c.hq * c.d);
    k = HostBuffer(c.dt, rows_k * c.hkv * c.d);
    v = HostBuffer(c.dt, rows_k * c.hkv * c.d);
    o = HostBuffer(c.dt, rows_q * c.hq * c.d);
    lse = HostBuffer(DType::kF32, rows_q * c.hq);
    q.fill_normal(g);
    k.fill_normal(g);
    v.fill_normal(g);
    // Positions: random (explicit arrays), or the documented defaults.
    std::uniform_int_distribution<std::int32_t> pd(0, max_pos - 1);
    pos_q.resize(static_cast<std::size_t>(rows_q));
    pos_k.resize(static_cast<std::size_t>(rows_k));
    for (int b = 0; b < c.batch; ++b) {
      const std::int64_t q0 = c.varlen ? cu_q[b] : static_cast<std::int64_t>(b) * c.sq;
      const std::int64_t k0 = c.varlen ? cu_k[b] : static_cast<std::int64_t>(b) * c.sk;
      const std::int64_t lq = c.varlen ? cu_q[b + 1] - cu_q[b] : c.sq, lk = c.varlen ? cu_k[b + 1] - cu_k[b] : c.sk;
      for (std::int64_t i = 0; i < lq; ++i)
        pos_q[static_cast<std::size_t>(q0 + i)] = c.positions ? pd(g) : static_cast<std::int32_t>(i + lk - lq);
      for (std::int64_t j = 0; j < lk; ++j) pos_k[static_cast<std::size_t>(k0 + j)] = c.positions ? pd(g) : static_cast<std::int32_t>(j);
    }
    if (c.cache) {
      const int rot = c.rot ? c.rot : c.d, half = rot / 2;
      cache.resize(static_cast<std::size_t>(max_pos) * rot);
      for (int p = 0; p < max_pos; ++p)
        for (int i = 0; i < half; ++i) {
          const double a = p * std::pow(c.theta, -2.0 * i / rot);
          cache[static_cast<std::size_t>(p) * rot + i] = static_cast<float>(std::cos(a));
          cache[static_cast<std::size_t>(p) * rot + half + i] = static_cast<float>(std::sin(a));
        }
    }
  }

  AttnParams params(const HostBuffer& qb, const HostBuffer& kb, bool rotary) {
    AttnParams p;
    p.batch = c.batch;
    p.seqlen_q = c.sq;
    p.seqlen_k = c.sk;
    p.heads_q = c.hq;
    p.heads_kv = c.hkv;
    p.head_dim = c.d;
    p.q = bshd_view(const_cast<void*>(qb.data()), c.dt, c.varlen ? rows_q : c.sq, c.hq, c.d);
    p.k = bshd_view(const_cast<void*>(kb.data()), c.dt, c.varlen ? rows_k : c.sk, c.hkv, c.d);
    p.v = bshd_view(v.data(), c.dt, c.varlen ? rows_k : c.sk, c.hkv, c.d);
    p.o = bshd_view(o.data(), c.dt, c.varlen ? rows_q : c.sq, c.hq, c.d);
    p.lse = static_cast<float*>(lse.data());
    p.mask.causal = c.causal;
    if (c.varlen) {
      p.mask.cu_seqlens_q = cu_q.data();
      p.mask.cu_seqlens_k = cu_k.data();
    }
    if (rotary) {
      p.rotary.spec.rotary_dim = c.rot ? c.rot : c.d;
      p.rotary.spec.style = c.style;
      p.rotary.spec.theta = c.theta;
      p.rotary.spec.llama3 = c.llama3;
      if (c.positions) {
        p.rotary.positions_q = pos_q.data();
        p.rotary.positions_k = pos_k.data();
      }
      if (c.cache) p.rotary.spec.set_cos_sin_cache(cache.data(), max_pos, c.rot ? c.rot : c.d);
    }
    return p;
  }

  /// O and LSE of `backend` with rotary in attention.
  Status run(Backend backend, std::vector<float>* out, std::vector<float>* out_lse) {
    o.poison();
    lse.poison();
    RunOptions ro;
    ro.backend = backend;
    const Status s = attention_forward(params(q, k, true), ro);
    out->assign(static_cast<std::size_t>(o.size()), 0.f);
    out_lse->assign(static_cast<std::size_t>(lse.size()), 0.f);
    for (std::int64_t i = 0; i < o.size(); ++i) (*out)[static_cast<std::size_t>(i)] = o.get(i);
    for (std::int64_t i = 0; i < lse.size(); ++i) (*out_lse)[static_cast<std::size_t>(i)] = lse.get(i);
    return s;
  }
};

std::string describe(const RotCase& c) {
  return "b" + std::to_string(c.batch) + " sq" + std::to_string(c.sq) + " sk" + std::to_string(c.sk) + " hq" +
         std::to_string(c.hq) + " hkv" + std::to_string(c.hkv) + " d" + std::to_string(c.d) + " " + dtype_name(c.dt) +
         (c.causal ? " causal" : "") + " " + rope_style_name(c.style) + " rot" + std::to_string(c.rot) +
         (c.positions ? " positions" : " default-positions") + (c.cache ? " cache" : "") + (c.varlen ? " varlen" : "") +
         (c.llama3.enabled() ? " llama3" : "");
}

void check_case(const RotCase& rc, std::uint64_t salt) {
  SCOPED_TRACE(describe(rc));
  auto g = rng(salt);
  Problem pb(rc, g);
  const RotCase& c = pb.c;
  const HostBuffer q0 = pb.q, k0 = pb.k;
  // Reference: fp64 rotation here, rounded to the dtype, then the fp64 attention without rotary.
  HostBuffer qr = pb.q, kr = pb.k;
  const int rot = c.rot ? c.rot : c.d;
  rotate_ref(&qr, pb.rows_q, c.hq, c.d, rot, c.style, c.theta, c.llama3, pb.pos_q);
  rotate_ref(&kr, pb.rows_k, c.hkv, c.d, rot, c.style, c.theta, c.llama3, pb.pos_k);
  RunOptions ref_opt;
  ref_opt.backend = Backend::kCpuReference;
  ASSERT_TRUE(attention_forward(pb.params(qr, kr, false), ref_opt).ok());
  std::vector<float> ref_o(static_cast<std::size_t>(pb.o.size())), ref_lse(static_cast<std::size_t>(pb.lse.size()));
  for (std::int64_t i = 0; i < pb.o.size(); ++i) ref_o[static_cast<std::size_t>(i)] = pb.o.get(i);
  for (std::int64_t i = 0; i < pb.lse.size(); ++i) ref_lse[static_cast<std::size_t>(i)] = pb.lse.get(i);

  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    SCOPED_TRACE(backend_name(b));
    std::vector<float> out, out_lse;
    const Status s = pb.run(b, &out, &out_lse);
    ASSERT_TRUE(s.ok()) << s.to_string();
    double worst = 0;
    std::int64_t bad = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const double err = std::fabs(out[i] - ref_o[i]);
      worst = std::max(worst, err);
      bad += !(err <= 5e-3 + 5e-3 * std::fabs(ref_o[i]));  // NaN fails
    }
    for (std::size_t i = 0; i < out_lse.size(); ++i) {
      if (std::isinf(ref_lse[i])) {
        bad += !(std::isinf(out_lse[i]) && out_lse[i] < 0);
        continue;
      }
      bad += !(std::fabs(out_lse[i] - ref_lse[i]) <= 5e-3);
    }
    EXPECT_EQ(bad, 0) << "max abs err " << worst;
  }
  // q and k are not modified.
  EXPECT_EQ(std::memcmp(q0.data(), pb.q.data(), pb.q.bytes.size()), 0);
  EXPECT_EQ(std::memcmp(k0.data(), pb.k.data(), pb.k.bytes.size()), 0);
}

TEST(AttnRotary, MatchesRotateThenAttend) {
  std::uint64_t salt = 1;
  RotCase c;
  check_case(c, salt++);  // bf16 neox, default bottom-right positions, causal, GQA, sq != sk
  c.dt = DType::kF32;
  c.style = RopeStyle::kInterleaved;
  c.rot = 32;
  c.positions = true;
  c.causal = false;
  check_case(c, salt++);
  c = RotCase{};
  c.dt = DType::kF16;
  c.cache = true;
  c.positions = true;
  check_case(c, salt++);
  c = RotCase{};
  c.sq = 60;
  c.sk = 20;  // more queries than keys: default query positions go negative (theta path)
  c.causal = false;
  check_case(c, salt++);
  c = RotCase{};
  c.batch = 3;
  c.varlen = true;  // packed documents (one of length 1), per-document default positions
  check_case(c, salt++);
  c.positions = true;
  c.style = RopeStyle::kInterleaved;
  check_case(c, salt++);
  c = RotCase{};
  c.d = 128;
  c.theta = 500000.0;
  c.llama3 = Llama3Scaling{32.f, 1.f, 4.f, 8192};
  c.positions = true;
  check_case(c, salt++);
}

TEST(AttnRotary, IdenticalToApplyRotaryThenAttention) {
  auto g = rng(50);
  RotCase rc;
  rc.positions = true;
  Problem pb(rc, g);
  std::vector<float> fused, fused_lse;
  ASSERT_TRUE(pb.run(Backend::kCpu, &fused, &fused_lse).ok());
  HostBuffer qr = pb.q, kr = pb.k;
  for (bool query : {true, false}) {
    RopeParams rp;
    rp.batch = rc.batch;
    rp.seqlen = query ? rc.sq : rc.sk;
    rp.heads_q = query ? rc.hq : rc.hkv;
    rp.head_dim = rc.d;
    rp.q = bshd_view(query ? qr.data() : kr.data(), rc.dt, rp.seqlen, rp.heads_q, rc.d);
    rp.positions = query ? pb.pos_q.data() : pb.pos_k.data();
    RunOptions ro;
    ro.backend = Backend::kCpu;
    ASSERT_TRUE(apply_rotary(rp, ro).ok());
  }
  pb.o.poison();
  RunOptions ro;
  ro.backend = Backend::kCpu;
  ASSERT_TRUE(attention_forward(pb.params(qr, kr, false), ro).ok());
  for (std::int64_t i = 0; i < pb.o.size(); ++i) ASSERT_EQ(pb.o.get(i), fused[static_cast<std::size_t>(i)]) << "element " << i;
}

TEST(AttnRotary, BadInputsGetASentence) {
  auto g = rng(60);
  RotCase rc;
  rc.positions = true;
  Problem pb(rc, g);
  RunOptions ro;
  ro.backend = Backend::kCpu;
  auto expect = [&](AttnParams p, Backend b, StatusCode code, const std::string& needle) {
    const Status s = validate(p, b).ok() && b != Backend::kCuda ? attention_forward(p, ro) : validate(p, b);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  AttnParams p = pb.params(pb.q, pb.k, true);
  p.rotary.spec.rotary_dim = 7;
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.spec.rotary_dim 7 must be even");
  p.rotary.spec.rotary_dim = 128;
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.spec.rotary_dim 128 must be even and in [2, head_dim 64]");
  p = pb.params(pb.q, pb.k, true);
  p.rotary.spec.theta = 0.0;
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.spec.theta 0 must be finite and > 0");
  p = pb.params(pb.q, pb.k, true);
  std::vector<float> tiny(64 * 2, 0.f);
  p.rotary.spec.set_cos_sin_cache(tiny.data(), 0, 64);
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.spec.max_position 0 must be >= 1");
  p.rotary.spec.max_position = 2;  // positions go up to 5999: outside the cache
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary (q)");
  p = pb.params(pb.q, pb.k, true);
  p.rotary.positions_k = reinterpret_cast<const std::int32_t*>(reinterpret_cast<const char*>(pb.pos_k.data()) + 1);
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.positions_k");
  // CUDA rotates 8-byte pieces: neox needs rotary_dim % 8 == 0, interleaved % 4 == 0.
  p = pb.params(pb.q, pb.k, true);
  p.rotary.spec.rotary_dim = 12;
  p.rotary.spec.style = RopeStyle::kNeox;
  expect(p, Backend::kCuda, StatusCode::kUnsupported, "rotary.spec.rotary_dim 12 is not a multiple of 8");
  EXPECT_TRUE(validate(p, Backend::kCpu).ok());
  p.rotary.spec.style = RopeStyle::kInterleaved;
  HostBuffer kr(rc.dt, pb.k.size());  // CUDA needs somewhere to put the rotated keys
  p.rotary.k_rotated = bshd_view(kr.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  EXPECT_TRUE(validate(p, Backend::kCuda).ok()) << validate(p, Backend::kCuda).to_string();
  p.rotary.spec.rotary_dim = 6;
  expect(p, Backend::kCuda, StatusCode::kUnsupported, "rotary.spec.rotary_dim 6 is not a multiple of 4");
}

/// apply_rotary (CPU) of pb's k with pb's positions, as a contiguous (rows_k, hkv, d) buffer:
/// the keys rotary.k_rotated must receive.
HostBuffer apply_rotary_to_k(const Problem& pb) {
  const RotCase& c = pb.c;
  HostBuffer kr = pb.k;
  RopeParams rp;
  rp.batch = c.varlen ? 1 : c.batch;
  rp.seqlen = static_cast<int>(c.varlen ? pb.rows_k : c.sk);
  rp.heads_q = c.hkv;
  rp.head_dim = c.d;
  rp.rotary.rotary_dim = c.rot ? c.rot : c.d;
  rp.rotary.style = c.style;
  rp.rotary.theta = c.theta;
  rp.rotary.llama3 = c.llama3;
  if (c.cache) rp.rotary.set_cos_sin_cache(pb.cache.data(), pb.max_pos, rp.rotary.rotary_dim);
  rp.q = bshd_view(kr.data(), c.dt, rp.seqlen, c.hkv, c.d);
  rp.positions = pb.pos_k.data();  // the documented defaults when the case passes none
  RunOptions ro;
  ro.backend = Backend::kCpu;
  const Status s = apply_rotary(rp, ro);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return kr;
}

/// The elements of a strided (rows, heads, d) view, read row by row into a contiguous buffer;
/// `rows` is batch * seqlen (dense, batch_stride used) or the packed rows (varlen).
HostBuffer gather(const Problem& pb, const HostBuffer& buf, const TensorView& v) {
  const RotCase& c = pb.c;
  HostBuffer out(c.dt, pb.rows_k * c.hkv * c.d);
  std::int64_t i = 0;
  for (std::int64_t r = 0; r < pb.rows_k; ++r) {
    const std::int64_t b = c.varlen ? 0 : r / c.sk, s = c.varlen ? r : r % c.sk;
    for (int h = 0; h < c.hkv; ++h)
      for (int e = 0; e < c.d; ++e, ++i) {
        const std::int64_t off = b * v.batch_stride + s * v.seq_stride + h * v.head_stride + e;
        std::memcpy(static_cast<std::uint8_t*>(out.data()) + i * dtype_size(c.dt),
                    static_cast<const std::uint8_t*>(buf.data()) + off * dtype_size(c.dt), dtype_size(c.dt));
      }
  }
  return out;
}

void check_k_rotated(const RotCase& rc, std::uint64_t salt) {
  SCOPED_TRACE(describe(rc));
  auto g = rng(salt);
  Problem pb(rc, g);
  const RotCase& c = pb.c;
  const HostBuffer want_k = apply_rotary_to_k(pb);
  ASSERT_NE(std::memcmp(want_k.data(), pb.k.data(), pb.k.bytes.size()), 0);  // the keys do rotate
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    SCOPED_TRACE(backend_name(b));
    RunOptions ro;
    ro.backend = b;
    std::vector<float> want_o, want_lse;  // rotary without k_rotated
    ASSERT_TRUE(pb.run(b, &want_o, &want_lse).ok());
    auto expect_same_outputs = [&] {
      for (std::int64_t i = 0; i < pb.o.size(); ++i)
        ASSERT_EQ(pb.o.get(i), want_o[static_cast<std::size_t>(i)]) << "O element " << i;
      for (std::int64_t i = 0; i < pb.lse.size(); ++i)
        ASSERT_EQ(pb.lse.get(i), want_lse[static_cast<std::size_t>(i)]) << "LSE element " << i;
    };

    // Out of place, into a view with strides of its own: dense (batch, heads, seqlen, d), varlen
    // rows padded by 16 elements per head. The padding must stay poisoned.
    const std::int64_t pad = c.varlen ? 16 : 0;
    HostBuffer kr(c.dt, pb.rows_k * c.hkv * (c.d + pad));
    std::memset(kr.data(), 0xFF, kr.bytes.size());  // NaN in fp16, bf16 and fp32
    const TensorView krv = c.varlen ? TensorView{kr.data(), c.dt, 0, c.hkv * (c.d + pad), c.d + pad}
                                    : bhsd_view(kr.data(), c.dt, c.sk, c.hkv, c.d);
    AttnParams p = pb.params(pb.q, pb.k, true);
    p.rotary.k_rotated = krv;
    pb.o.poison();
    pb.lse.poison();
    const HostBuffer k0 = pb.k;
    ASSERT_TRUE(attention_forward(p, ro).ok());
    expect_same_outputs();
    const HostBuffer got = gather(pb, kr, krv);
    EXPECT_EQ(std::memcmp(got.data(), want_k.data(), want_k.bytes.size()), 0) << "k_rotated differs from apply_rotary's k";
    EXPECT_EQ(std::memcmp(k0.data(), pb.k.data(), pb.k.bytes.size()), 0) << "k was modified";
    std::int64_t touched = 0;
    for (std::int64_t r = 0; r < pb.rows_k * c.hkv; ++r)
      for (std::int64_t e = c.d; e < c.d + pad; ++e) touched += !std::isnan(kr.get(r * (c.d + pad) + e));
    EXPECT_EQ(touched, 0) << "elements written into the padding between k_rotated's rows";

    // In place: k_rotated is k itself.
    HostBuffer kin = pb.k;
    p = pb.params(pb.q, kin, true);
    p.rotary.k_rotated = p.k;
    pb.o.poison();
    pb.lse.poison();
    ASSERT_TRUE(attention_forward(p, ro).ok());
    expect_same_outputs();
    EXPECT_EQ(std::memcmp(kin.data(), want_k.data(), want_k.bytes.size()), 0) << "k rotated in place differs";
  }
}

TEST(AttnRotary, KRotatedReceivesApplyRotarysKeys) {
  RotCase c;
  c.positions = true;
  check_k_rotated(c, 70);  // bf16 neox, explicit positions, GQA
  c = RotCase{};
  c.dt = DType::kF16;
  c.style = RopeStyle::kInterleaved;
  c.rot = 32;
  c.cache = true;
  c.positions = true;
  check_k_rotated(c, 71);
  c = RotCase{};
  c.batch = 3;
  c.varlen = true;  // packed rows, per-document default positions
  check_k_rotated(c, 72);
  c.dt = DType::kF32;
  c.positions = true;
  check_k_rotated(c, 73);
  c = RotCase{};
  c.d = 128;
  c.theta = 500000.0;
  c.llama3 = Llama3Scaling{32.f, 1.f, 4.f, 8192};
  check_k_rotated(c, 74);
}

TEST(AttnRotary, KRotatedValidation) {
  auto g = rng(80);
  RotCase rc;
  rc.positions = true;
  Problem pb(rc, g);
  HostBuffer kr(rc.dt, pb.k.size());
  auto expect = [&](const AttnParams& p, Backend b, StatusCode code, const std::string& needle) {
    const Status s = validate(p, b);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  // CUDA reads its keys from k_rotated: without one, a sentence naming the field.
  AttnParams p = pb.params(pb.q, pb.k, true);
  expect(p, Backend::kCuda, StatusCode::kUnsupported, "rotary on CUDA needs rotary.k_rotated");
  EXPECT_TRUE(validate(p, Backend::kCpu).ok());  // optional on the CPU backends
  AttnParams empty = p;  // no key, nothing to rotate: not needed
  empty.seqlen_k = 0;
  empty.k = empty.v = TensorView{};
  EXPECT_TRUE(validate(empty, Backend::kCuda).ok()) << validate(empty, Backend::kCuda).to_string();
  p.rotary.k_rotated = bshd_view(kr.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  EXPECT_TRUE(validate(p, Backend::kCuda).ok()) << validate(p, Backend::kCuda).to_string();
  // k itself: rotated in place.
  p.rotary.k_rotated = p.k;
  EXPECT_TRUE(validate(p, Backend::kCuda).ok()) << validate(p, Backend::kCuda).to_string();
  EXPECT_TRUE(validate(p, Backend::kCpu).ok()) << validate(p, Backend::kCpu).to_string();
  // In place, with q (or v) starting where k does, q would be read rotated.
  AttnParams shared = p;
  shared.v.data = shared.k.data;
  expect(shared, Backend::kCuda, StatusCode::kInvalidArgument, "rotary.k_rotated is k (rotated in place), but v");
  // Another dtype.
  p.rotary.k_rotated = bshd_view(kr.data(), DType::kF16, rc.sk, rc.hkv, rc.d);
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.k_rotated.dtype fp16 differs from k.dtype bf16");
  expect(p, Backend::kCuda, StatusCode::kInvalidArgument, "rotary.k_rotated.dtype fp16 differs from k.dtype bf16");
  // Checked like k: strides, alignment.
  p.rotary.k_rotated = bshd_view(kr.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  p.rotary.k_rotated.seq_stride = 4;
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.k_rotated.");
  p.rotary.k_rotated = bshd_view(static_cast<char*>(kr.data()) + 8, rc.dt, rc.sk, rc.hkv, rc.d);
  expect(p, Backend::kCuda, StatusCode::kInvalidArgument, "rotary.k_rotated.data");
  // It is an output: it must not overlap o, lse or the inputs (unless it is exactly k). Its span
  // (k's extents) may run past the buffer it starts in, into whichever allocation the heap put
  // next, so the sentence may name another tensor: the test asks for an overlap naming k_rotated.
  auto expect_overlap = [&](const AttnParams& pp, Backend b) {
    const Status s = validate(pp, b);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("overlaps"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rotary.k_rotated"), std::string::npos) << s.message();
  };
  p.rotary.k_rotated = bshd_view(pb.o.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  expect_overlap(p, Backend::kCpu);
  expect_overlap(p, Backend::kCuda);
  p.rotary.k_rotated = bshd_view(pb.lse.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  expect_overlap(p, Backend::kCpu);
  p.rotary.k_rotated = bshd_view(pb.q.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  expect_overlap(p, Backend::kCpu);
  p.rotary.k_rotated = bshd_view(pb.v.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  expect_overlap(p, Backend::kCpu);
  // k's memory under another index map is not "in place".
  p.rotary.k_rotated = bhsd_view(pb.k.data(), rc.dt, rc.sk, rc.hkv, rc.d);
  expect(p, Backend::kCpu, StatusCode::kInvalidArgument, "rotary.k_rotated must be k itself");
  p.rotary.k_rotated = bshd_view(static_cast<char*>(pb.k.data()) + 16 * 8, rc.dt, rc.sk, rc.hkv, rc.d);
  expect_overlap(p, Backend::kCuda);
  // Without rotary the field is ignored.
  p = pb.params(pb.q, pb.k, false);
  p.rotary.k_rotated = bshd_view(pb.o.data(), DType::kF16, rc.sk, rc.hkv, rc.d);
  EXPECT_TRUE(validate(p, Backend::kCuda).ok()) << validate(p, Backend::kCuda).to_string();
}

}  // namespace
}  // namespace flashcpp::testing
