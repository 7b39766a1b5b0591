// One RotarySpec (flashcpp/rope.h), three entry points: apply_rotary (RopeParams::rotary), the
// rotary fused into attention (AttnParams::rotary.spec) and decode's append (DecodeParams::rotary).
//
//   1. Same bits: the same spec rotates the same keys at the same positions to the same bytes
//      through all three on the CPU (apply_rotary's output, attention's rotary.k_rotated, the
//      cache slots decode appends), and those bytes are the rule of rope.h written out here
//      (table lookup at p * table_stride + i, or fp64 inv_freq with the Llama-3 scaling and the
//      shared cos_sin_angle; fma rotation; rounding to the dtype). Variants: theta, theta with
//      Llama-3 scaling, separate tables, one cos_sin_cache, tables with a padded row stride (NaN
//      in the padding, so a stride mistake shows), both styles, full and partial rotary_dim,
//      bf16 and fp32.
//   2. Same sentences: one bad spec is refused by the three validators with one sentence (the
//      field prefix aside); every table layout accepted on CUDA too; positions
//      outside the tables refused on the CPU by all three.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "common/fused_math.h"
#include "flashcpp/attention.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "flashcpp/rope.h"
#include "test_util.h"

namespace flashcpp::testing {
namespace {

constexpr int kBatch = 2, kSq = 3, kHq = 4, kHkv = 2, kD = 64;

enum class Angles { kTheta, kLlama3, kSeparate, kCache, kPadded };

const char* angles_name(Angles a) {
  switch (a) {
    case Angles::kTheta: return "theta";
    case Angles::kLlama3: return "llama3";
    case Angles::kSeparate: return "separate_tables";
    case Angles::kCache: return "cos_sin_cache";
    case Angles::kPadded: return "padded_tables";
  }
  return "?";
}

/// 16-byte aligned bytes (decode's workspaces).
struct Aligned {
  std::size_t bytes;
  std::unique_ptr<std::byte[], void (*)(std::byte*)> p;
  explicit Aligned(std::size_t n)
      : bytes(n), p(static_cast<std::byte*>(::operator new(std::max<std::size_t>(n, 16), std::align_val_t(64))),
                   [](std::byte* x) { ::operator delete(x, std::align_val_t(64)); }) {}
  void* get() const { return p.get(); }
};

/// A spec and the tables it points at (kept alive here).
struct Spec {
  RotarySpec spec;
  std::vector<float> cos_t, sin_t;
};

Spec make_spec(Angles a, RopeStyle style, int rotary_dim, int max_position, std::mt19937_64& g) {
  Spec s;
  s.spec.style = style;
  s.spec.rotary_dim = rotary_dim;
  const int rd = rotary_dim ? rotary_dim : kD, half = rd / 2;
  if (a == Angles::kTheta) s.spec.theta = 10000.0;
  if (a == Angles::kLlama3) {
    s.spec.theta = 500000.0;
    s.spec.llama3 = Llama3Scaling{32.f, 1.f, 4.f, 64};  // a short original context: every band shows up
  }
  if (a == Angles::kTheta || a == Angles::kLlama3) return s;
  std::uniform_real_distribution<float> ang(-3.14159f, 3.14159f);
  const int pad = a == Angles::kPadded ? 5 : 0;
  const int stride = a == Angles::kCache ? rd : half + pad;
  s.cos_t.assign(static_cast<std::size_t>(max_position) * stride, NAN);  // padding stays NaN
  s.sin_t.assign(s.cos_t.size(), NAN);
  for (int p = 0; p < max_position; ++p)
    for (int i = 0; i < half; ++i) {
      const float x = ang(g);
      if (a == Angles::kCache) {
        s.cos_t[p * stride + i] = std::cos(x);
        s.cos_t[p * stride + half + i] = std::sin(x);
      } else {
        s.cos_t[p * stride + i] = std::cos(x);
        s.sin_t[p * stride + i] = std::sin(x);
      }
    }
  if (a == Angles::kCache) {
    s.spec.set_cos_sin_cache(s.cos_t.data(), max_position, rd);
  } else {
    s.spec.cos = s.cos_t.data();
    s.spec.sin = s.sin_t.data();
    s.spec.table_stride = a == Angles::kPadded ? stride : 0;  // 0: rotary_dim / 2
    s.spec.max_position = max_position;
  }
  return s;
}

/// rope.h's rule, written out: one (kD,) row of x rotated at `pos`, rounded to dt.
void rotate_row_ref(const RotarySpec& r, DType dt, int pos, const HostBuffer& in, std::int64_t off, HostBuffer* out) {
  const int rd = r.rotary_dim ? r.rotary_dim : kD, half = rd / 2;
  for (int e = 0; e < kD; ++e) out->set(off + e, in.get(off + e));
  for (int i = 0; i < half; ++i) {
    float c, s;
    if (r.cos) {
      const std::int64_t stride = r.table_stride ? r.table_stride : half;
      c = r.cos[pos * stride + i];
      s = r.sin[pos * stride + i];
    } else {
      fused::cos_sin_angle(pos, rotary_inv_freq(i, rd, r.theta, r.llama3), &c, &s);
    }
    const int a = r.style == RopeStyle::kNeox ? i : 2 * i, b = r.style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    const float x1 = in.get(off + a), x2 = in.get(off + b);
    out->set(off + a, std::fma(x1, c, -(x2 * s)));
    out->set(off + b, std::fma(x2, c, x1 * s));
  }
  (void)dt;
}

struct Outcome {
  HostBuffer via_apply, via_attention, via_decode, expected;  ///< (kBatch, kSq, kHkv, kD) keys
  HostBuffer unrotated;                                       ///< the keys as given
};

/// The step's new keys rotated at positions lens[b] + t by the three entry points.
Outcome rotate_three_ways(const RotarySpec& spec, DType dt, const std::vector<std::int32_t>& lens, int capacity,
                          std::mt19937_64& g) {
  const std::int64_t nk = static_cast<std::int64_t>(kBatch) * kSq * kHkv * kD;
  HostBuffer k_new(dt, nk), v_new(dt, nk), q(dt, static_cast<std::int64_t>(kBatch) * kSq * kHq * kD);
  k_new.fill_normal(g);
  v_new.fill_normal(g);
  q.fill_normal(g);
  std::vector<std::int32_t> pos;
  for (int b = 0; b < kBatch; ++b)
    for (int t = 0; t < kSq; ++t) pos.push_back(lens[b] + t);
  Outcome out{HostBuffer(dt, nk), HostBuffer(dt, nk), HostBuffer(dt, nk), HostBuffer(dt, nk), k_new};
  RunOptions cpu;
  cpu.backend = Backend::kCpu;
  cpu.cpu_threads = 2;

  // apply_rotary: k_new at those positions (heads of "q" = the KV heads), out of place.
  {
    RopeParams rp;
    rp.batch = kBatch;
    rp.seqlen = kSq;
    rp.heads_q = kHkv;
    rp.head_dim = kD;
    rp.q = bshd_view(k_new.data(), dt, kSq, kHkv, kD);
    rp.q_out = bshd_view(out.via_apply.data(), dt, kSq, kHkv, kD);
    rp.positions = pos.data();
    rp.rotary = spec;
    const Status s = apply_rotary(rp, cpu);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  // attention: k = k_new with positions_k, the rotated keys in rotary.k_rotated.
  {
    HostBuffer o(dt, q.size());
    AttnParams ap;
    ap.batch = kBatch;
    ap.seqlen_q = ap.seqlen_k = kSq;
    ap.heads_q = kHq;
    ap.heads_kv = kHkv;
    ap.head_dim = kD;
    ap.q = bshd_view(q.data(), dt, kSq, kHq, kD);
    ap.k = bshd_view(k_new.data(), dt, kSq, kHkv, kD);
    ap.v = bshd_view(v_new.data(), dt, kSq, kHkv, kD);
    ap.o = bshd_view(o.data(), dt, kSq, kHq, kD);
    ap.rotary.spec = spec;
    ap.rotary.positions_q = pos.data();  // any positions: q is not compared
    ap.rotary.positions_k = pos.data();
    ap.rotary.k_rotated = bshd_view(out.via_attention.data(), dt, kSq, kHkv, kD);
    const Status s = attention_forward(ap, cpu);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  // decode: append k_new at slots lens[b] + t of a contiguous cache, then read those slots.
  {
    const std::int64_t nc = static_cast<std::int64_t>(kBatch) * capacity * kHkv * kD;
    HostBuffer kc(dt, nc), vc(dt, nc), o(dt, q.size());
    DecodeParams dp;
    dp.batch = kBatch;
    dp.seqlen_q = kSq;
    dp.heads_q = kHq;
    dp.heads_kv = kHkv;
    dp.head_dim = kD;
    dp.q = bshd_view(q.data(), dt, kSq, kHq, kD);
    dp.o = bshd_view(o.data(), dt, kSq, kHq, kD);
    dp.cache.k = bshd_view(kc.data(), dt, capacity, kHkv, kD);
    dp.cache.v = bshd_view(vc.data(), dt, capacity, kHkv, kD);
    dp.cache.capacity = capacity;
    dp.cache_seqlens = lens.data();
    dp.k_new = bshd_view(k_new.data(), dt, kSq, kHkv, kD);
    dp.v_new = bshd_view(v_new.data(), dt, kSq, kHkv, kD);
    dp.rotary = spec;
    dp.mask.causal = true;
    DecodePlanOptions po;
    po.backend = Backend::kCpu;
    po.host_cache_seqlens = lens.data();
    DecodeWorkspaceSize ws;
    Status s = decode_workspace_size(dp, po, &ws);
    EXPECT_TRUE(s.ok()) << s.to_string();
    Aligned iw(ws.int_bytes), fw(ws.float_bytes);
    DecodePlan plan;
    if (s.ok()) s = decode_plan(dp, po, iw.get(), ws.int_bytes, fw.get(), ws.float_bytes, &plan);
    if (s.ok()) s = decode_run(dp, plan, cpu);
    EXPECT_TRUE(s.ok()) << s.to_string();
    const std::size_t row = static_cast<std::size_t>(kD) * dtype_size(dt);
    for (int b = 0; b < kBatch; ++b)
      for (int t = 0; t < kSq; ++t)
        for (int h = 0; h < kHkv; ++h) {
          const std::int64_t src = ((static_cast<std::int64_t>(b) * capacity + lens[b] + t) * kHkv + h) * kD;
          const std::int64_t dst = ((static_cast<std::int64_t>(b) * kSq + t) * kHkv + h) * kD;
          std::memcpy(out.via_decode.bytes.data() + dst * dtype_size(dt), kc.bytes.data() + src * dtype_size(dt), row);
        }
  }
  // The rule of rope.h.
  for (int b = 0; b < kBatch; ++b)
    for (int t = 0; t < kSq; ++t)
      for (int h = 0; h < kHkv; ++h)
        rotate_row_ref(spec, dt, lens[b] + t, k_new, ((static_cast<std::int64_t>(b) * kSq + t) * kHkv + h) * kD,
                       &out.expected);
  return out;
}

bool same_bytes(const HostBuffer& a, const HostBuffer& b) { return a.bytes == b.bytes; }

TEST(RotarySpec, SameBitsThroughEveryEntryPoint) {
  const std::vector<std::int32_t> lens = {1000, 17};  // positions 1000..1002 and 17..19
  const int capacity = 1024, max_position = 1100;
  for (DType dt : {DType::kBF16, DType::kF32})
    for (Angles a : {Angles::kTheta, Angles::kLlama3, Angles::kSeparate, Angles::kCache, Angles::kPadded})
      for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kInterleaved})
        for (int rd : {0, 32}) {
          const std::string name = std::string(dtype_name(dt)) + " " + angles_name(a) + " " + rope_style_name(style) +
                                   " rotary_dim " + std::to_string(rd);
          SCOPED_TRACE(name);
          auto g = rng(std::hash<std::string>{}(name));
          const Spec s = make_spec(a, style, rd, max_position, g);
          const Outcome o = rotate_three_ways(s.spec, dt, lens, capacity, g);
          EXPECT_FALSE(same_bytes(o.expected, o.unrotated)) << "nothing rotated: the comparison would be empty";
          EXPECT_TRUE(same_bytes(o.via_apply, o.expected)) << "apply_rotary differs from rope.h's rule";
          EXPECT_TRUE(same_bytes(o.via_attention, o.via_apply)) << "attention's k_rotated differs from apply_rotary";
          EXPECT_TRUE(same_bytes(o.via_decode, o.via_apply)) << "decode's appended keys differ from apply_rotary";
        }
}

TEST(RotarySpec, OneTableTwoLayoutsSameBits) {
  // The same angles as separate tables and as one cos_sin_cache rotate to the same bytes.
  const std::vector<std::int32_t> lens = {40, 3};
  auto g = rng(77);
  const Spec sep = make_spec(Angles::kSeparate, RopeStyle::kNeox, 0, 64, g);
  Spec cache;
  cache.spec = sep.spec;
  for (int p = 0; p < 64; ++p) {
    cache.cos_t.insert(cache.cos_t.end(), sep.cos_t.begin() + p * 32, sep.cos_t.begin() + (p + 1) * 32);
    cache.cos_t.insert(cache.cos_t.end(), sep.sin_t.begin() + p * 32, sep.sin_t.begin() + (p + 1) * 32);
  }
  cache.spec.set_cos_sin_cache(cache.cos_t.data(), 64, kD);
  EXPECT_TRUE(cache.spec.is_cos_sin_cache(kD));
  EXPECT_FALSE(sep.spec.is_cos_sin_cache(kD));
  auto g1 = rng(78), g2 = rng(78);
  const Outcome a = rotate_three_ways(sep.spec, DType::kBF16, lens, 64, g1);
  const Outcome b = rotate_three_ways(cache.spec, DType::kBF16, lens, 64, g2);
  EXPECT_TRUE(same_bytes(a.via_apply, b.via_apply));
  EXPECT_TRUE(same_bytes(a.via_attention, b.via_attention));
  EXPECT_TRUE(same_bytes(a.via_decode, b.via_decode));
}

TEST(RotarySpec, Helpers) {
  RotarySpec r;
  EXPECT_FALSE(r.enabled());
  EXPECT_EQ(r.style, RopeStyle::kNone);
  EXPECT_EQ(r.effective_rotary_dim(128), 128);
  EXPECT_EQ(r.effective_table_stride(128), 64);
  r.rotary_dim = 32;
  EXPECT_EQ(r.effective_table_stride(128), 16);
  float cache[8 * 32];
  r.set_cos_sin_cache(cache, 8, 32);
  EXPECT_EQ(r.cos, cache);
  EXPECT_EQ(r.sin, cache + 16);
  EXPECT_EQ(r.table_stride, 32);
  EXPECT_EQ(r.max_position, 8);
  EXPECT_TRUE(r.has_tables());
  EXPECT_TRUE(r.is_cos_sin_cache(128));
  r.table_stride = 40;  // rows of 40: no longer the [cos | sin] layout of one cache
  EXPECT_FALSE(r.is_cos_sin_cache(128));
  EXPECT_EQ(RotarySpec::of_style(RopeStyle::kInterleaved).style, RopeStyle::kInterleaved);
  EXPECT_EQ(RopeParams{}.rotary.style, RopeStyle::kNeox);  // apply_rotary's default
  EXPECT_FALSE(AttnRotary{}.enabled());
  EXPECT_FALSE(DecodeParams{}.rotary.enabled());
  EXPECT_STREQ(rope_style_name(RopeStyle::kNone), "none");
  EXPECT_STREQ(rope_style_name(RopeStyle::kNeox), "neox");
}

// ---- one sentence per mistake, on every path ------------------------------------------------------

/// The three entry points' validators on one (valid) problem of bf16 host views; `mutate` spoils
/// the spec. Returns the three statuses (apply_rotary, attention, decode).
struct Three {
  Status apply, attention, decode;
};
constexpr int kSlots = 40;  ///< decode's cache slots per sequence

Three validate_three(const std::function<void(RotarySpec&)>& mutate, Backend backend,
                     const std::vector<std::int32_t>& lens = {5, 9}) {
  static HostBuffer q(DType::kBF16, kBatch * kSq * kHq * kD), k(DType::kBF16, kBatch * kSq * kHkv * kD),
      v(DType::kBF16, kBatch * kSq * kHkv * kD), o(DType::kBF16, kBatch * kSq * kHq * kD),
      kr(DType::kBF16, kBatch * kSq * kHkv * kD), kc(DType::kBF16, kBatch * kSlots * kHkv * kD),
      vc(DType::kBF16, kBatch * kSlots * kHkv * kD);
  static std::vector<std::int32_t> pos;
  pos.clear();
  for (int b = 0; b < kBatch; ++b)
    for (int t = 0; t < kSq; ++t) pos.push_back(lens[b] + t);
  RotarySpec spec = RotarySpec::of_style(RopeStyle::kNeox);
  mutate(spec);
  Three out;
  RopeParams rp;
  rp.batch = kBatch;
  rp.seqlen = kSq;
  rp.heads_q = kHkv;
  rp.head_dim = kD;
  rp.q = bshd_view(k.data(), DType::kBF16, kSq, kHkv, kD);
  rp.q_out = bshd_view(kr.data(), DType::kBF16, kSq, kHkv, kD);
  rp.positions = pos.data();
  rp.rotary = spec;
  out.apply = validate(rp, backend);
  AttnParams ap;
  ap.batch = kBatch;
  ap.seqlen_q = ap.seqlen_k = kSq;
  ap.heads_q = kHq;
  ap.heads_kv = kHkv;
  ap.head_dim = kD;
  ap.q = bshd_view(q.data(), DType::kBF16, kSq, kHq, kD);
  ap.k = bshd_view(k.data(), DType::kBF16, kSq, kHkv, kD);
  ap.v = bshd_view(v.data(), DType::kBF16, kSq, kHkv, kD);
  ap.o = bshd_view(o.data(), DType::kBF16, kSq, kHq, kD);
  ap.rotary.spec = spec;
  ap.rotary.positions_q = ap.rotary.positions_k = pos.data();
  ap.rotary.k_rotated = bshd_view(kr.data(), DType::kBF16, kSq, kHkv, kD);
  out.attention = validate(ap, backend);
  // The CPU attention reads its positions where it rotates (apply_rotary's check): run it.
  if (out.attention.ok() && backend == Backend::kCpu) {
    RunOptions ro;
    ro.backend = Backend::kCpu;
    out.attention = attention_forward(ap, ro);
  }
  DecodeParams dp;
  dp.batch = kBatch;
  dp.seqlen_q = kSq;
  dp.heads_q = kHq;
  dp.heads_kv = kHkv;
  dp.head_dim = kD;
  dp.q = bshd_view(q.data(), DType::kBF16, kSq, kHq, kD);
  dp.o = bshd_view(o.data(), DType::kBF16, kSq, kHq, kD);
  dp.cache.k = bshd_view(kc.data(), DType::kBF16, kSlots, kHkv, kD);
  dp.cache.v = bshd_view(vc.data(), DType::kBF16, kSlots, kHkv, kD);
  dp.cache.capacity = kSlots;
  dp.cache_seqlens = lens.data();
  dp.k_new = bshd_view(k.data(), DType::kBF16, kSq, kHkv, kD);
  dp.v_new = bshd_view(v.data(), DType::kBF16, kSq, kHkv, kD);
  dp.rotary = spec;
  out.decode = validate(dp, backend);
  return out;
}

/// All three refuse with `code` and a message holding `rest` after their own field prefix
/// ("rotary." for apply_rotary and decode, "rotary.spec." for attention).
void expect_same_sentence(const Three& t, StatusCode code, const std::string& rest) {
  EXPECT_EQ(t.apply.code(), code) << t.apply.to_string();
  EXPECT_EQ(t.attention.code(), code) << t.attention.to_string();
  EXPECT_EQ(t.decode.code(), code) << t.decode.to_string();
  EXPECT_NE(t.apply.message().find("rotary." + rest), std::string::npos) << t.apply.message();
  EXPECT_NE(t.attention.message().find("rotary.spec." + rest), std::string::npos) << t.attention.message();
  EXPECT_NE(t.decode.message().find("rotary." + rest), std::string::npos) << t.decode.message();
}

TEST(RotarySpec, OneSentencePerMistakeOnEveryPath) {
  const Backend cpu = Backend::kCpu;
  const Three ok = validate_three([](RotarySpec&) {}, cpu);
  EXPECT_TRUE(ok.apply.ok() && ok.attention.ok() && ok.decode.ok())
      << ok.apply.to_string() << " / " << ok.attention.to_string() << " / " << ok.decode.to_string();
  const StatusCode bad = StatusCode::kInvalidArgument;
  expect_same_sentence(validate_three([](RotarySpec& r) { r.style = static_cast<RopeStyle>(7); }, cpu), bad,
                       "style 7 is not a rotary style (0 = none, 1 = neox, 2 = interleaved)");
  expect_same_sentence(validate_three([](RotarySpec& r) { r.rotary_dim = 7; }, cpu), bad,
                       "rotary_dim 7 must be even and in [2, head_dim 64] (0 = head_dim)");
  expect_same_sentence(validate_three([](RotarySpec& r) { r.rotary_dim = -2; }, cpu), bad, "rotary_dim -2 must be even");
  expect_same_sentence(validate_three([](RotarySpec& r) { r.theta = 0.0; }, cpu), bad,
                       "theta 0 must be finite and > 0 (or pass cos/sin tables)");
  expect_same_sentence(validate_three([](RotarySpec& r) { r.llama3.factor = 0.5f; }, cpu), bad,
                       "llama3.factor 0.5 must be >= 1 (0 = off)");
  expect_same_sentence(validate_three([](RotarySpec& r) { r.llama3 = Llama3Scaling{8.f, 1.f, 4.f, 0}; }, cpu), bad,
                       "llama3.original_max_position 0 must be >= 1");
  static std::vector<float> table(64 * 64, 0.25f);
  expect_same_sentence(validate_three([](RotarySpec& r) { r.cos = table.data(); }, cpu), bad,
                       "sin is null but rotary");
  expect_same_sentence(validate_three(
                           [](RotarySpec& r) {
                             r.cos = r.sin = table.data();
                             r.max_position = 0;
                           },
                           cpu),
                       bad, "max_position 0 must be >= 1 with cos/sin tables");
  expect_same_sentence(validate_three(
                           [](RotarySpec& r) {
                             r.cos = r.sin = table.data();
                             r.max_position = 16;
                             r.table_stride = 31;
                           },
                           cpu),
                       bad, "table_stride 31 must be >= rotary_dim / 2 = 32 (0 = rotary_dim / 2)");
  expect_same_sentence(validate_three(
                           [](RotarySpec& r) {
                             r.cos = table.data();
                             r.sin = reinterpret_cast<const float*>(reinterpret_cast<const char*>(table.data()) + 2);
                             r.max_position = 16;
                           },
                           cpu),
                       bad, "sin ");
  // Tables whose rows run past int64: refused before any span arithmetic.
  expect_same_sentence(validate_three(
                           [](RotarySpec& r) {
                             r.cos = r.sin = table.data();
                             r.max_position = 1 << 30;
                             r.table_stride = std::int64_t{1} << 40;
                           },
                           cpu),
                       bad, "cos/sin tables of 1073741824 rows at table_stride 1099511627776 overflow int64");
  // Without tables theta and llama3 are checked; with tables they are unused.
  const Three unused = validate_three(
      [](RotarySpec& r) {
        r.cos = r.sin = table.data();
        r.max_position = 64;
        r.theta = -1.0;
      },
      cpu);
  EXPECT_TRUE(unused.apply.ok() && unused.attention.ok() && unused.decode.ok());
}

TEST(RotarySpec, PositionsOutsideTheTablesAreRefusedOnTheCpu) {
  // Positions 30..32 of sequence 1 against 32 rows: every CPU path reads them and refuses.
  static std::vector<float> table(32 * 32, 0.5f);
  const Three t = validate_three(
      [](RotarySpec& r) {
        r.cos = r.sin = table.data();
        r.max_position = 32;
      },
      Backend::kCpu, {5, 30});
  for (const Status* s : {&t.apply, &t.attention, &t.decode}) {
    EXPECT_EQ(s->code(), StatusCode::kInvalidArgument) << s->to_string();
    EXPECT_NE(s->message().find("outside the cos/sin tables' rows [0, "), std::string::npos) << s->message();
  }
  EXPECT_NE(t.attention.message().find("rotary (q): "), std::string::npos) << t.attention.message();  // q rotates first
}

TEST(RotarySpec, CudaTakesEveryTableLayout) {
  // Every CUDA kernel reads the tables by pointer and row stride (rope.cuh's CosSinTables), as
  // the CPU backends do: separate tables and a cos_sin_cache both validate on all three paths.
  // (Validation only: no device is touched.)
  static std::vector<float> table(64 * 64, 0.25f);
  const Three separate = validate_three(
      [](RotarySpec& r) {
        r.cos = table.data();
        r.sin = table.data() + 32 * 64;
        r.max_position = 32;
      },
      Backend::kCuda);
  EXPECT_TRUE(separate.apply.ok()) << separate.apply.to_string();
  EXPECT_TRUE(separate.attention.ok()) << separate.attention.to_string();
  EXPECT_TRUE(separate.decode.ok()) << separate.decode.to_string();
  const Three cache = validate_three([](RotarySpec& r) { r.set_cos_sin_cache(table.data(), 64, kD); }, Backend::kCuda);
  EXPECT_TRUE(cache.apply.ok()) << cache.apply.to_string();
  EXPECT_TRUE(cache.attention.ok()) << cache.attention.to_string();
  EXPECT_TRUE(cache.decode.ok()) << cache.decode.to_string();
}

}  // namespace
}  // namespace flashcpp::testing
