// The engine's checkpoint loader: safetensors files written and read back (every dtype
// conversion, bit patterns worked out by hand here, chunk boundaries), sharded checkpoints, every
// class of malformed header refused with a sentence naming the file and the tensor, and config.json
// parsing (a real Llama-3.2-1B config, refusals, Llama-3 rope scaling against a direct computation).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/safetensors.h"

namespace flashcpp::engine {
namespace {

namespace fs = std::filesystem;

// ---- helpers ---------------------------------------------------------------------------------

/// A fresh directory under the system temp dir, removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("flashcpp_engine_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool bf16_is_nan(std::uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

/// A file made of an 8-byte size `h` (the header's length unless given), the header text, and
/// `data_bytes` bytes of data.
void write_raw(const std::string& path, const std::string& header, std::size_t data_bytes, std::uint64_t h = ~0ull) {
  if (h == ~0ull) h = header.size();
  std::ofstream f(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>(h >> (8 * i)));
  f << header;
  f << std::string(data_bytes, '\x5a');
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// Opens `path`, expecting a refusal whose message holds every one of `parts`.
void expect_open_refused(const std::string& path, const std::vector<std::string>& parts) {
  std::unique_ptr<SafetensorsArchive> a;
  Status st = SafetensorsArchive::open(path, &a);
  ASSERT_FALSE(st.ok()) << "accepted " << path;
  EXPECT_EQ(a, nullptr);
  EXPECT_FALSE(st.message().empty());
  for (const auto& p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << "missing '" << p << "' in: " << st.message();
}

std::unique_ptr<SafetensorsArchive> open_ok(const std::string& path) {
  std::unique_ptr<SafetensorsArchive> a;
  Status st = SafetensorsArchive::open(path, &a);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return a;
}

// ---- round trips -----------------------------------------------------------------------------

TEST(EngineLoader, RoundTripEveryConversion) {
  TempDir dir;
  // F32 -> bf16, round to nearest even; expected bits worked out by hand.
  const std::vector<std::uint32_t> f32_in = {
      0x3F800000,  // 1.0
      0x3F808000,  // 1 + 2^-8: halfway between 0x3F80 and 0x3F81 -> even 0x3F80
      0x3F818000,  // halfway between 0x3F81 and 0x3F82 -> even 0x3F82
      0x3F808001,  // just above halfway -> 0x3F81
      0xBF80FFFF,  // -(1 + 0xFFFF ulp) -> 0xBF81
      0x7F800001,  // signalling NaN: truncation would give +inf
      0x7F7FFFFF,  // FLT_MAX rounds up to +inf
      0xFF800000,  // -inf
      0x80000000,  // -0
      0x00000001,  // smallest subnormal -> +0
  };
  const std::vector<std::uint16_t> f32_to_bf16 = {0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xBF81,
                                                  0 /*NaN*/, 0x7F80, 0xFF80, 0x8000, 0x0000};
  // F16 -> bf16 (through the exact float value).
  const std::vector<std::uint16_t> f16_in = {
      0x3C00,  // 1.0
      0x3C04,  // 1 + 2^-8: bf16 tie -> 0x3F80
      0x3C0C,  // 1 + 3*2^-8: bf16 tie -> 0x3F82
      0x3C01,  // 1 + 2^-10 -> 0x3F80
      0x0001,  // 2^-24 (fp16 subnormal) = 0x33800000 -> 0x3380
      0x7BFF,  // 65504 -> 65536 = 0x4780
      0x7C00, 0xFC00,  // +-inf
      0x7E00,  // NaN
      0x8000,  // -0
      0x3555,  // 0.333251953125 = 0x3EAAA000 -> 0x3EAB
  };
  const std::vector<std::uint16_t> f16_to_bf16 = {0x3F80, 0x3F80, 0x3F82, 0x3F80, 0x3380, 0x4780,
                                                  0x7F80, 0xFF80, 0 /*NaN*/, 0x8000, 0x3EAB};
  const std::vector<float> f16_to_f32 = {1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-10f, 0x1p-24f,
                                         65504.0f, INFINITY, -INFINITY, NAN, -0.0f, 0.333251953125f};
  const std::vector<std::uint16_t> bf16_in = {0x3F80, 0x7FC1, 0x0001, 0xC2F7, 0xFF80, 0x8000};
  const std::vector<std::int64_t> i64_in = {1, -2, 1ll << 40};
  const float scalar = 3.5f;

  const std::string path = dir.file("model.safetensors");
  ASSERT_TRUE(write_safetensors(path,
                                {{"w.f32", StDType::kF32, {2, 5}, f32_in.data()},
                                 {"w.f16", StDType::kF16, {11}, f16_in.data()},
                                 {"w.bf16", StDType::kBF16, {3, 2}, bf16_in.data()},
                                 {"w.i64", StDType::kI64, {3}, i64_in.data()},
                                 {"scalar", StDType::kF32, {}, &scalar},
                                 {"empty", StDType::kBF16, {0, 3}, nullptr}},
                                {{"format", "pt"}})
                  .ok());

  // The layout: an 8-byte size, a header padded to 8 bytes, the data right after it.
  const std::string bytes = read_file(path);
  std::uint64_t h = 0;
  for (int i = 7; i >= 0; --i) h = (h << 8) | static_cast<std::uint8_t>(bytes[i]);
  EXPECT_EQ(h % 8, 0u);
  std::vector<StTensorInfo> infos;
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(parse_safetensors_header(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), bytes.size(),
                                       &infos, &meta)
                  .ok());
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(infos.size(), 6u);

  auto a = open_ok(path);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->names(), (std::vector<std::string>{"empty", "scalar", "w.bf16", "w.f16", "w.f32", "w.i64"}));
  EXPECT_EQ(a->find("nope"), nullptr);
  const StTensorInfo* t32 = a->find("w.f32");
  ASSERT_NE(t32, nullptr);
  EXPECT_EQ(t32->begin, 8 + h);  // written first
  EXPECT_EQ(t32->nbytes, 40u);
  EXPECT_EQ(t32->shape, (std::vector<std::int64_t>{2, 5}));
  EXPECT_EQ(t32->numel(), 10);

  {  // F32
    std::vector<std::uint16_t> b(10);
    ASSERT_TRUE(a->read_bf16(*t32, b.data(), b.size()).ok());
    for (std::size_t i = 0; i < b.size(); ++i) {
      if (i == 5) {
        EXPECT_TRUE(bf16_is_nan(b[i])) << std::hex << b[i];
      } else {
        EXPECT_EQ(b[i], f32_to_bf16[i]) << "element " << i;
      }
    }
    std::vector<float> f(10);
    ASSERT_TRUE(a->read_f32(*t32, f.data(), f.size()).ok());
    for (std::size_t i = 0; i < f.size(); ++i) EXPECT_EQ(f32_bits(f[i]), f32_in[i]) << "element " << i;
  }
  {  // F16
    const StTensorInfo* t = a->find("w.f16");
    ASSERT_NE(t, nullptr);
    std::vector<std::uint16_t> b(11);
    ASSERT_TRUE(a->read_bf16(*t, b.data(), b.size()).ok());
    for (std::size_t i = 0; i < b.size(); ++i) {
      if (i == 8) {
        EXPECT_TRUE(bf16_is_nan(b[i])) << std::hex << b[i];
      } else {
        EXPECT_EQ(b[i], f16_to_bf16[i]) << "element " << i;
      }
    }
    std::vector<float> f(11);
    ASSERT_TRUE(a->read_f32(*t, f.data(), f.size()).ok());
    for (std::size_t i = 0; i < f.size(); ++i) {
      if (std::isnan(f16_to_f32[i])) {
        EXPECT_TRUE(std::isnan(f[i]));
      } else {
        EXPECT_EQ(f32_bits(f[i]), f32_bits(f16_to_f32[i])) << "element " << i;
      }
    }
  }
  {  // BF16: unchanged as bf16, exact as fp32
    const StTensorInfo* t = a->find("w.bf16");
    ASSERT_NE(t, nullptr);
    std::vector<std::uint16_t> b(6);
    ASSERT_TRUE(a->read_bf16(*t, b.data(), b.size()).ok());
    EXPECT_EQ(b, bf16_in);
    std::vector<float> f(6);
    ASSERT_TRUE(a->read_f32(*t, f.data(), f.size()).ok());
    for (std::size_t i = 0; i < f.size(); ++i) EXPECT_EQ(f32_bits(f[i]), std::uint32_t{bf16_in[i]} << 16);
  }
  {  // raw bytes, a scalar, an empty tensor
    const StTensorInfo* t = a->find("w.i64");
    ASSERT_NE(t, nullptr);
    std::vector<std::int64_t> v(3);
    ASSERT_TRUE(a->read_raw(*t, v.data(), v.size() * 8).ok());
    EXPECT_EQ(v, i64_in);
    EXPECT_FALSE(a->read_raw(*t, v.data(), 16).ok());  // destination too small
    std::uint16_t b[3];
    Status st = a->read_bf16(*t, b, 3);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find("'w.i64' is I64"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st.message();

    const StTensorInfo* s = a->find("scalar");
    ASSERT_NE(s, nullptr);
    EXPECT_TRUE(s->shape.empty());
    EXPECT_EQ(s->numel(), 1);
    float x = 0;
    ASSERT_TRUE(a->read_f32(*s, &x, 1).ok());
    EXPECT_EQ(x, 3.5f);

    const StTensorInfo* e = a->find("empty");
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->numel(), 0);
    EXPECT_EQ(e->nbytes, 0u);
    EXPECT_TRUE(a->read_bf16(*e, nullptr, 0).ok());
  }
  {  // the element count must match
    std::vector<float> f(9);
    Status st = a->read_f32(*t32, f.data(), f.size());
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.message().find("'w.f32' has 10 elements"), std::string::npos) << st.message();
  }
}

/// f16 bits of a positive integer k < 2048 (exact), written out directly.
std::uint16_t f16_of_int(int k) {
  if (k == 0) return 0;
  int e = 0;
  while ((k >> (e + 1)) != 0) ++e;
  const int mant = (k << (10 - e)) & 0x3ff;
  return static_cast<std::uint16_t>(((e + 15) << 10) | mant);
}

TEST(EngineLoader, ConversionAcrossChunkBoundaries) {
  // 9M fp16 elements (18 MB) cross the loader's 16 MB chunks; each element is its index mod 2048.
  TempDir dir;
  const std::int64_t n = 9'000'001;
  std::vector<std::uint16_t> in(n);
  for (std::int64_t i = 0; i < n; ++i) in[i] = f16_of_int(static_cast<int>(i % 2048));
  const std::string path = dir.file("big.safetensors");
  ASSERT_TRUE(write_safetensors(path, {{"pad", StDType::kU8, {3}, "abc"}, {"big", StDType::kF16, {n}, in.data()}}).ok());
  auto a = open_ok(path);
  ASSERT_NE(a, nullptr);
  const StTensorInfo* t = a->find("big");
  ASSERT_NE(t, nullptr);
  std::vector<float> f(n);
  ASSERT_TRUE(a->read_f32(*t, f.data(), f.size()).ok());
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad += f[i] != static_cast<float>(i % 2048);
  EXPECT_EQ(bad, 0);
  std::vector<std::uint16_t> b(n);
  ASSERT_TRUE(a->read_bf16(*t, b.data(), b.size()).ok());
  bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    // integers < 256 are exact in bf16; larger ones lose low bits (checked by magnitude)
    const float v = bits_f32(std::uint32_t{b[i]} << 16), want = static_cast<float>(i % 2048);
    bad += (want < 256 ? v != want : std::fabs(v - want) > want * 0x1p-8f);
  }
  EXPECT_EQ(bad, 0);
}

TEST(EngineLoader, ShardedIndexAndDirectory) {
  TempDir dir;
  const std::vector<float> a_vals = {1, 2, 3, 4}, c_vals = {-1, -2};
  const std::vector<std::uint16_t> b_vals = {0x4000, 0x4040};  // bf16 2, 3
  ASSERT_TRUE(write_safetensors(dir.file("model-00001-of-00002.safetensors"),
                                {{"model.layers.0.w", StDType::kF32, {2, 2}, a_vals.data()},
                                 {"model.embed_tokens.weight", StDType::kBF16, {2}, b_vals.data()}})
                  .ok());
  ASSERT_TRUE(write_safetensors(dir.file("model-00002-of-00002.safetensors"),
                                {{"lm_head.weight", StDType::kF32, {2}, c_vals.data()},
                                 {"unlisted", StDType::kF32, {2}, c_vals.data()}})
                  .ok());
  {
    std::ofstream f(dir.file("model.safetensors.index.json"));
    f << R"({"metadata": {"total_size": 28}, "weight_map": {
      "model.layers.0.w": "model-00001-of-00002.safetensors",
      "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
      "lm_head.weight": "model-00002-of-00002.safetensors"}})";
  }
  for (const std::string& p : {dir.file("model.safetensors.index.json"), dir.str()}) {
    SCOPED_TRACE(p);
    auto a = open_ok(p);
    ASSERT_NE(a, nullptr);
    ASSERT_EQ(a->files().size(), 2u);
    EXPECT_EQ(fs::path(a->files()[0]).filename(), "model-00001-of-00002.safetensors");
    EXPECT_EQ(a->names(), (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.w"}));
    const StTensorInfo* head = a->find("lm_head.weight");
    ASSERT_NE(head, nullptr);
    EXPECT_EQ(head->file_index, 1);
    std::vector<float> f(2);
    ASSERT_TRUE(a->read_f32(*head, f.data(), 2).ok());
    EXPECT_EQ(f, c_vals);
    const StTensorInfo* w = a->find("model.layers.0.w");
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->file_index, 0);
    std::vector<std::uint16_t> b(4);
    ASSERT_TRUE(a->read_bf16(*w, b.data(), 4).ok());
    EXPECT_EQ(b, (std::vector<std::uint16_t>{0x3F80, 0x4000, 0x4040, 0x4080}));
    const StTensorInfo* e = a->find("model.embed_tokens.weight");
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(a->read_f32(*e, f.data(), 2).ok());
    EXPECT_EQ(f, (std::vector<float>{2, 3}));
  }

  // A directory with one model.safetensors.
  TempDir single;
  ASSERT_TRUE(write_safetensors(single.file("model.safetensors"), {{"x", StDType::kF32, {1}, a_vals.data()}}).ok());
  auto s = open_ok(single.str());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->names(), std::vector<std::string>{"x"});

  // Refusals: a shard that does not hold its tensor, a missing shard, a path outside the
  // directory, no weight_map, an empty directory.
  auto index = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir.file(name)) << text;
    return dir.file(name);
  };
  expect_open_refused(index("i1.json", R"({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})"),
                      {"i1.json", "'lm_head.weight'", "does not hold it"});
  expect_open_refused(index("i2.json", R"({"weight_map": {"x": "missing.safetensors"}})"),
                      {"missing.safetensors", "no such file"});
  expect_open_refused(index("i3.json", R"({"weight_map": {"x": "../model-00001-of-00002.safetensors"}})"),
                      {"i3.json", "'x'", "plain file names"});
  expect_open_refused(index("i4.json", R"({"weight_map": {"x": "sub/a.safetensors"}})"), {"i4.json", "plain file names"});
  expect_open_refused(index("i5.json", R"({"metadata": {}})"), {"i5.json", "no \"weight_map\""});
  expect_open_refused(index("i6.json", R"({"weight_map": {"x": 3}})"), {"i6.json", "'x'", "not a file name"});
  expect_open_refused(index("i7.json", R"({"weight_map": )"), {"i7.json", "not valid JSON"});
  TempDir empty;
  expect_open_refused(empty.str(), {"neither model.safetensors.index.json nor model.safetensors"});
  expect_open_refused(dir.file("nothing.safetensors"), {"nothing.safetensors", "no such file"});

  std::map<std::string, std::string> wm;
  EXPECT_TRUE(parse_safetensors_index(R"({"weight_map": {"a": "x.safetensors"}})", &wm).ok());
  EXPECT_EQ(wm, (std::map<std::string, std::string>{{"a", "x.safetensors"}}));
  EXPECT_FALSE(parse_safetensors_index(R"({"weight_map": {"a": ".."}})", &wm).ok());
  EXPECT_FALSE(parse_safetensors_index(R"([])", &wm).ok());
}

// ---- malformed headers -----------------------------------------------------------------------

const char* const kNorm = R"("model.norm.weight": {"dtype": "BF16", "shape": [2048], "data_offsets": [0, 4096]})";

TEST(EngineLoader, ValidBaselineOpens) {
  // The malformed cases below are this file with one thing broken; unbroken, it opens.
  TempDir dir;
  write_raw(dir.file("ok.safetensors"), std::string("{") + kNorm + "}", 4096);
  auto a = open_ok(dir.file("ok.safetensors"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(a->find("model.norm.weight"), nullptr);
  EXPECT_EQ(a->find("model.norm.weight")->nbytes, 4096u);
  // "__metadata__": null is no metadata, as the reference implementation reads it.
  write_raw(dir.file("null_meta.safetensors"), std::string("{\"__metadata__\": null, ") + kNorm + "}", 4096);
  auto b = open_ok(dir.file("null_meta.safetensors"));
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->names(), std::vector<std::string>{"model.norm.weight"});
}

struct BadHeader {
  const char* what;
  std::string header;
  std::size_t data_bytes;
  std::vector<std::string> parts;  // in the message, besides the file name
};

TEST(EngineLoader, MalformedHeadersRefusedWithASentence) {
  TempDir dir;
  const std::string norm = kNorm;
  const std::vector<BadHeader> cases = {
      {"non-JSON", "{not json", 0, {"not valid JSON"}},
      {"empty header", "", 16, {"not valid JSON"}},
      {"trailing garbage", "{" + norm + "} x", 4096, {"not valid JSON"}},
      {"not an object", "[1, 2]", 0, {"must be a JSON object", "array"}},
      {"entry not an object", R"({"t": [1]})", 0, {"tensor 't'", "must be an object"}},
      {"no dtype", R"({"t": {"shape": [1], "data_offsets": [0, 4]}})", 4, {"tensor 't'", "no \"dtype\""}},
      {"dtype a number", R"({"t": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", 4,
       {"tensor 't'", "\"dtype\" must be a string"}},
      {"unknown dtype", R"({"t": {"dtype": "Q4_K", "shape": [1], "data_offsets": [0, 4]}})", 4,
       {"tensor 't'", "unknown dtype \"Q4_K\""}},
      {"shape a string", R"({"t": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})", 4,
       {"tensor 't'", "\"shape\" must be an array"}},
      {"negative dimension", R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4,
       {"tensor 't'", "non-negative integers", "-1"}},
      {"fractional dimension", R"({"t": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 10]}})", 10,
       {"tensor 't'", "non-negative integers", "2.5"}},
      {"boolean dimension", R"({"t": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}})", 4,
       {"tensor 't'", "non-negative integers"}},
      {"three offsets", R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", 8,
       {"tensor 't'", "\"data_offsets\" must be an array of two"}},
      {"negative offset", R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 8,
       {"tensor 't'", "\"data_offsets\" must be an array of two"}},
      {"no offsets", R"({"t": {"dtype": "F32", "shape": [1]}})", 8, {"tensor 't'", "no \"data_offsets\""}},
      {"reversed offsets", R"({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", 8,
       {"tensor 't'", "[8, 0] end before they begin"}},
      {"lying offsets", R"({"model.norm.weight": {"dtype": "BF16", "shape": [2048], "data_offsets": [0, 4000]}})",
       4096, {"tensor 'model.norm.weight' data_offsets [0, 4000]", "do not match its shape [2048] of BF16 (4096 bytes expected"}},
      {"offsets past the data", "{" + norm + "}", 4000, {"tensor 'model.norm.weight'", "past the data region", "4000 bytes"}},
      {"overlapping tensors",
       "{" + norm + R"(, "b": {"dtype": "F32", "shape": [512], "data_offsets": [2048, 4096]}})", 4096,
       {"'model.norm.weight'", "'b'", "overlap"}},
      {"numel overflows", R"({"t": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})", 0,
       {"tensor 't'", "more bytes than fit in 64 bits"}},
      {"bytes overflow", R"({"t": {"dtype": "F32", "shape": [2305843009213693952, 2], "data_offsets": [0, 0]}})", 0,
       {"tensor 't'", "more bytes than fit in 64 bits"}},
      {"dimension beyond int64", R"({"t": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 0]}})",
       0, {"tensor 't'", "fit in 64 bits"}},
      {"metadata not strings", "{" + norm + R"(, "__metadata__": {"format": 1}})", 4096,
       {"\"__metadata__\" entry 'format' must be a string"}},
      {"duplicate tensor", "{" + norm + ", " + norm + "}", 4096, {"'model.norm.weight' is named twice"}},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].what);
    const std::string name = "bad" + std::to_string(i) + ".safetensors";
    write_raw(dir.file(name), cases[i].header, cases[i].data_bytes);
    std::vector<std::string> parts = cases[i].parts;
    parts.push_back(name);
    expect_open_refused(dir.file(name), parts);
  }
}

TEST(EngineLoader, TruncatedAndOversizedFilesRefused) {
  TempDir dir;
  // Shorter than the 8-byte size.
  {
    std::ofstream(dir.file("tiny.safetensors"), std::ios::binary) << "abcde";
    expect_open_refused(dir.file("tiny.safetensors"), {"tiny.safetensors", "5 bytes", "too short"});
    std::ofstream(dir.file("zero.safetensors"), std::ios::binary);
    expect_open_refused(dir.file("zero.safetensors"), {"zero.safetensors", "0 bytes"});
  }
  // A header size larger than the file: a truncated download.
  write_raw(dir.file("trunc.safetensors"), "{" + std::string(kNorm) + "}", 0, 100000);
  expect_open_refused(dir.file("trunc.safetensors"), {"trunc.safetensors", "header size 100000", "larger than the file"});
  // A header cut in the middle (the size is right, the file ends early).
  {
    const std::string header = "{" + std::string(kNorm) + "}";
    write_raw(dir.file("cut.safetensors"), header.substr(0, 20), 0, header.size());
    expect_open_refused(dir.file("cut.safetensors"), {"cut.safetensors", "larger than the file"});
  }
  // Not a safetensors file at all (a pickle's first bytes read as a size).
  {
    std::ofstream(dir.file("pickle.safetensors"), std::ios::binary) << std::string("\x80\x02}q\x00(X\x03", 8) + std::string(64, 'x');
    expect_open_refused(dir.file("pickle.safetensors"), {"pickle.safetensors", "header size"});
  }
  // The header-size cap, checked before anything is allocated.
  std::uint8_t buf[8];
  const std::uint64_t h = 200ull << 20;
  for (int i = 0; i < 8; ++i) buf[i] = static_cast<std::uint8_t>(h >> (8 * i));
  std::vector<StTensorInfo> out;
  Status st = parse_safetensors_header(buf, 8, 1ull << 40, &out);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("100 MB"), std::string::npos) << st.message();
  // More bytes given than the file has.
  EXPECT_FALSE(parse_safetensors_header(buf, 8, 4, &out).ok());
}

TEST(EngineLoader, WriteRefusesBadTensors) {
  TempDir dir;
  const float x = 1;
  EXPECT_FALSE(write_safetensors(dir.file("a.safetensors"), {{"t", StDType::kF32, {-1}, &x}}).ok());
  EXPECT_FALSE(write_safetensors(dir.file("a.safetensors"), {{"t", StDType::kF32, {1}, &x}, {"t", StDType::kF32, {1}, &x}}).ok());
  EXPECT_FALSE(write_safetensors(dir.file("a.safetensors"), {{"__metadata__", StDType::kF32, {1}, &x}}).ok());
  EXPECT_FALSE(write_safetensors(dir.file("a.safetensors"), {{"t", StDType::kF32, {1}, nullptr}}).ok());
  EXPECT_FALSE(write_safetensors(dir.file("no/such/dir/a.safetensors"), {{"t", StDType::kF32, {1}, &x}}).ok());
  EXPECT_TRUE(write_safetensors(dir.file("a.safetensors"), {{"t", StDType::kF32, {1}, &x}}).ok());
}

// ---- config.json -----------------------------------------------------------------------------

// meta-llama/Llama-3.2-1B config.json.
const char* const kLlama32_1B = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

/// kLlama32_1B with `from` replaced by `to` (which must occur).
std::string edited(const std::string& from, const std::string& to) {
  std::string s = kLlama32_1B;
  const auto pos = s.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  if (pos != std::string::npos) s.replace(pos, from.size(), to);
  return s;
}

void expect_config_refused(const std::string& text, const std::vector<std::string>& parts) {
  LlamaConfig c;
  c.vocab_size = 77;
  Status st = parse_llama_config(text, &c);
  ASSERT_FALSE(st.ok()) << "accepted:\n" << text;
  EXPECT_EQ(c.vocab_size, 77) << "a refused parse must leave *out alone";
  for (const auto& p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << "missing '" << p << "' in: " << st.message();
}

TEST(EngineConfig, Llama32_1B) {
  LlamaConfig c;
  ASSERT_TRUE(parse_llama_config(kLlama32_1B, &c).ok());
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_id, 128001);

  // The Instruct model lists several eos ids: the first is kept.
  ASSERT_TRUE(parse_llama_config(edited(R"("eos_token_id": 128001)", R"("eos_token_id": [128001, 128008, 128009])"), &c).ok());
  EXPECT_EQ(c.eos_token_id, 128001);
}

TEST(EngineConfig, DefaultsWhenAbsent) {
  LlamaConfig c;
  ASSERT_TRUE(parse_llama_config(R"({"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                                     "num_hidden_layers": 32, "num_attention_heads": 32})",
                                 &c)
                  .ok());
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_scaling.type, "none");
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, -1);
}

TEST(EngineConfig, RopeScalingForms) {
  const std::string llama3 = R"("rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  })";
  LlamaConfig c;
  for (const std::string& none : {std::string(R"("rope_scaling": null)"), std::string(R"("rope_scaling": {"rope_type": "default"})"),
                                  std::string(R"("rope_scaling": {"type": "default", "factor": 2.0})")}) {
    ASSERT_TRUE(parse_llama_config(edited(llama3, none), &c).ok()) << none;
    EXPECT_EQ(c.rope_scaling.type, "none");
  }
  // The older spelling "type".
  ASSERT_TRUE(parse_llama_config(edited(R"("rope_type": "llama3")", R"("type": "llama3")"), &c).ok());
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.factor, 32.0);

  expect_config_refused(edited(llama3, R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0})"),
                        {"rope type 'yarn' is not supported", "llama3"});
  expect_config_refused(edited(llama3, R"("rope_scaling": {"type": "linear", "factor": 2.0})"), {"'linear'"});
  expect_config_refused(edited(llama3, R"("rope_scaling": {"type": "dynamic", "factor": 2.0})"), {"'dynamic'"});
  expect_config_refused(edited(llama3, R"("rope_scaling": 4)"), {"\"rope_scaling\" must be an object"});
  expect_config_refused(edited(R"("factor": 32.0,)", ""), {"\"factor\" is missing"});
  expect_config_refused(edited(R"("factor": 32.0)", R"("factor": "32")"), {"\"factor\" must be a number"});
  expect_config_refused(edited(R"("high_freq_factor": 4.0)", R"("high_freq_factor": 1.0)"),
                        {"\"high_freq_factor\" (1) must be larger than \"low_freq_factor\" (1)"});
}

TEST(EngineConfig, OtherArchitecturesRefused) {
  expect_config_refused(edited(R"(["LlamaForCausalLM"])", R"(["Qwen2ForCausalLM"])"),
                        {"Qwen2ForCausalLM", "only Llama-family"});
  std::string qwen = edited(R"("model_type": "llama")", R"("model_type": "qwen2")");
  expect_config_refused(qwen, {"model_type 'qwen2'", "only Llama-family"});
  qwen.replace(qwen.find(R"(["LlamaForCausalLM"])"), 20, R"(["Qwen2ForCausalLM"])");
  expect_config_refused(qwen, {"describes Qwen2ForCausalLM (model_type 'qwen2'); only Llama-family checkpoints are built"});
  std::string gemma = edited(R"(["LlamaForCausalLM"])", R"(["GemmaForCausalLM"])");
  gemma.replace(gemma.find(R"("model_type": "llama")"), 21, R"("model_type": "gemma")");
  expect_config_refused(gemma, {"GemmaForCausalLM", "model_type 'gemma'", "only Llama-family"});
  std::string mixtral = edited(R"(["LlamaForCausalLM"])", R"(["MixtralForCausalLM"])");
  mixtral.replace(mixtral.find(R"("model_type": "llama")"), 21, R"("model_type": "mixtral")");
  expect_config_refused(mixtral, {"MixtralForCausalLM", "only Llama-family"});
  // Mistral without a sliding window is Llama; with one it is not built.
  std::string mistral = edited(R"(["LlamaForCausalLM"])", R"(["MistralForCausalLM"])");
  mistral.replace(mistral.find(R"("model_type": "llama")"), 21, R"("model_type": "mistral", "sliding_window": null)");
  LlamaConfig c;
  EXPECT_TRUE(parse_llama_config(mistral, &c).ok());
  EXPECT_EQ(c.model_type, "mistral");
  mistral.replace(mistral.find(R"("sliding_window": null)"), 22, R"("sliding_window": 4096)");
  expect_config_refused(mistral, {"sliding_window 4096"});
}

TEST(EngineConfig, BadFieldsRefused) {
  expect_config_refused("{not json", {"not valid JSON"});
  expect_config_refused("[1]", {"must be a JSON object"});
  expect_config_refused(edited(R"("hidden_size": 2048,)", ""), {"\"hidden_size\" is missing"});
  expect_config_refused(edited(R"("vocab_size": 128256)", R"("vocab_size": null)"), {"\"vocab_size\" is missing"});
  expect_config_refused(edited(R"("hidden_size": 2048)", R"("hidden_size": "2048")"),
                        {"\"hidden_size\" must be an integer", "string"});
  expect_config_refused(edited(R"("hidden_size": 2048)", R"("hidden_size": 2048.5)"), {"\"hidden_size\" must be an integer"});
  expect_config_refused(edited(R"("num_hidden_layers": 16)", R"("num_hidden_layers": 0)"), {"\"num_hidden_layers\" is 0"});
  expect_config_refused(edited(R"("vocab_size": 128256)", R"("vocab_size": -5)"), {"\"vocab_size\" is -5"});
  expect_config_refused(edited(R"("vocab_size": 128256)", R"("vocab_size": 4294967296)"), {"\"vocab_size\" is 4294967296"});
  expect_config_refused(edited(R"("num_key_value_heads": 8)", R"("num_key_value_heads": 7)"),
                        {"num_attention_heads 32 is not a multiple of num_key_value_heads 7"});
  {
    std::string no_head_dim = edited(R"("head_dim": 64,)", "");
    no_head_dim.replace(no_head_dim.find(R"("hidden_size": 2048)"), 19, R"("hidden_size": 2050)");
    expect_config_refused(no_head_dim, {"hidden_size 2050 is not a multiple of num_attention_heads 32"});
  }
  expect_config_refused(edited(R"("head_dim": 64)", R"("head_dim": 63)"), {"head_dim 63 must be even"});
  expect_config_refused(edited(R"("attention_bias": false)", R"("attention_bias": true)"), {"attention_bias"});
  expect_config_refused(edited(R"("mlp_bias": false)", R"("mlp_bias": true)"), {"mlp_bias"});
  expect_config_refused(edited(R"("attention_bias": false)", R"("attention_bias": 0)"), {"\"attention_bias\" must be true or false"});
  expect_config_refused(edited(R"("hidden_act": "silu")", R"("hidden_act": "gelu")"), {"hidden_act 'gelu' is not built"});
  expect_config_refused(edited(R"("rope_theta": 500000.0)", R"("rope_theta": "500000")"), {"\"rope_theta\" must be a number"});
  expect_config_refused(edited(R"("rope_theta": 500000.0)", R"("rope_theta": -1)"), {"\"rope_theta\" is -1"});
  expect_config_refused(edited(R"("rms_norm_eps": 1e-05)", R"("rms_norm_eps": 0)"), {"\"rms_norm_eps\" is 0"});
  expect_config_refused(edited(R"("rms_norm_eps": 1e-05)", R"("rms_norm_eps": 1e300)"), {"\"rms_norm_eps\" is 1e+300; it must fit in fp32"});
  expect_config_refused(edited(R"("eos_token_id": 128001)", R"("eos_token_id": "eos")"), {"\"eos_token_id\" must be an integer"});
  expect_config_refused(edited(R"("eos_token_id": 128001)", R"("eos_token_id": [1, "x"])"), {"\"eos_token_id\" must hold"});
  expect_config_refused(edited(R"(["LlamaForCausalLM"])", R"("LlamaForCausalLM")"), {"\"architectures\" must be a list"});
}

TEST(EngineConfig, JsonRoundTripAndFiles) {
  LlamaConfig a, b;
  ASSERT_TRUE(parse_llama_config(kLlama32_1B, &a).ok());
  const std::string text = llama_config_to_json(a);
  ASSERT_TRUE(parse_llama_config(text, &b).ok()) << text;
  EXPECT_EQ(llama_config_to_json(b), text);
  EXPECT_EQ(b.num_key_value_heads, 8);
  EXPECT_EQ(b.rope_scaling.type, "llama3");
  EXPECT_EQ(b.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(b.eos_token_id, 128001);
  EXPECT_TRUE(b.tie_word_embeddings);

  TempDir dir;
  std::ofstream(dir.file("config.json")) << text;
  LlamaConfig c;
  ASSERT_TRUE(load_llama_config(dir.str(), &c).ok());
  EXPECT_EQ(c.hidden_size, 2048);
  ASSERT_TRUE(load_llama_config(dir.file("config.json"), &c).ok());
  std::ofstream(dir.file("bad.json")) << R"({"model_type": "gemma"})";
  Status st = load_llama_config(dir.file("bad.json"), &c);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("bad.json"), std::string::npos) << st.message();
  EXPECT_FALSE(load_llama_config(dir.file("missing.json"), &c).ok());
}

TEST(EngineConfig, RopeInvFreqLlama3Scaling) {
  LlamaConfig c;
  ASSERT_TRUE(parse_llama_config(kLlama32_1B, &c).ok());
  std::vector<double> inv(32, -1.0);
  rope_inv_freq(c, inv.data());
  // Llama-3.2-1B: head_dim 64, theta 5e5, wavelengths 2*pi*theta^(i/32). Below 8192/4 = 2048
  // (i <= 14) unchanged; above 8192/1 (i >= 18) divided by 32; i = 15..17 blended.
  const double log_theta = std::log(500000.0);
  auto base = [&](int i) { return std::exp(-log_theta * i / 32.0); };
  for (int i : {0, 1, 7, 14}) EXPECT_NEAR(inv[i], base(i), 1e-14 * base(i)) << i;
  for (int i : {18, 25, 31}) EXPECT_NEAR(inv[i], base(i) / 32.0, 1e-14 * base(i)) << i;
  for (int i : {15, 16, 17}) {
    const double wavelen = 2 * std::numbers::pi / base(i);
    ASSERT_GT(wavelen, 2048.0);
    ASSERT_LT(wavelen, 8192.0);
    const double s = (8192.0 / wavelen - 1.0) / 3.0;
    const double want = base(i) * (s + (1 - s) / 32.0);
    EXPECT_NEAR(inv[i], want, 1e-13 * want) << i;
    EXPECT_LT(inv[i], base(i));
    EXPECT_GT(inv[i], base(i) / 32.0);
  }
  EXPECT_EQ(inv[0], 1.0);
  for (int i = 1; i < 32; ++i) EXPECT_LT(inv[i], inv[i - 1]) << "not decreasing at " << i;

  // Without scaling: theta^(-2i/d) for every i.
  c.rope_scaling = RopeScaling{};
  c.rope_theta = 10000.0;
  c.head_dim = 128;
  std::vector<double> plain(64);
  rope_inv_freq(c, plain.data());
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(plain[i], std::pow(10000.0, -i / 64.0), 1e-15) << i;
}

}  // namespace
}  // namespace flashcpp::engine
