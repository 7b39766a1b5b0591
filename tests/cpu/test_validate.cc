// validate(): one test per rule (status code and the key words of the sentence) and the valid
// configurations that must pass. q/k/v/o/lse/alibi are fake addresses: validate() must never
// dereference them (a read would crash the test). Only the varlen and block-sparse arrays are
// real host memory, because the CPU backends read them.
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "flashcpp/attention.h"

namespace flashcpp {
namespace {

constexpr Backend kAllBackends[] = {Backend::kAuto, Backend::kCpu, Backend::kCpuReference, Backend::kCuda};
constexpr Backend kHostBackends[] = {Backend::kCpu, Backend::kCpuReference};

/// An address that is never mapped: validate() only does arithmetic on it.
void* fake(std::uintptr_t a) { return reinterpret_cast<void*>(a); }
template <class T>
T* fake_as(std::uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

constexpr std::uintptr_t kQ = 0x10000000, kK = 0x20000000, kV = 0x30000000, kO = 0x40000000,
                         kLse = 0x50000000;

/// batch 2, 128 x 128 rows, 8 heads, head_dim 128, bf16, flash-attn layout, distinct buffers.
AttnParams base(DType dt = DType::kBF16) {
  AttnParams p;
  p.batch = 2;
  p.seqlen_q = p.seqlen_k = 128;
  p.heads_q = p.heads_kv = 8;
  p.head_dim = 128;
  p.q = bshd_view(fake(kQ), dt, p.seqlen_q, p.heads_q, p.head_dim);
  p.k = bshd_view(fake(kK), dt, p.seqlen_k, p.heads_kv, p.head_dim);
  p.v = bshd_view(fake(kV), dt, p.seqlen_k, p.heads_kv, p.head_dim);
  p.o = bshd_view(fake(kO), dt, p.seqlen_q, p.heads_q, p.head_dim);
  return p;
}

/// The status has `code` and its sentence contains every word of `words`.
::testing::AssertionResult Fails(const Status& st, StatusCode code,
                                 std::initializer_list<const char*> words) {
  if (st.code() != code)
    return ::testing::AssertionFailure()
           << "expected " << status_code_name(code) << ", got " << st.to_string();
  for (const char* w : words)
    if (st.message().find(w) == std::string::npos)
      return ::testing::AssertionFailure() << "message '" << st.message() << "' lacks '" << w << "'";
  return ::testing::AssertionSuccess() << st.to_string();
}
::testing::AssertionResult Invalid(const Status& st, std::initializer_list<const char*> words) {
  return Fails(st, StatusCode::kInvalidArgument, words);
}
::testing::AssertionResult Passes(const Status& st) {
  if (st.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << st.to_string();
}

/// Builds a fresh fixture, changes it, validates it (fixtures hold arrays that p points into).
template <class Fixture, class Change>
Status validate_changed(Change change, Backend b) {
  Fixture f;
  change(f);
  return validate(f.p, b);
}

// ---- rule 1: shape -------------------------------------------------------------------------

TEST(ValidateShape, NegativeSizes) {
  auto p = base();
  p.batch = -1;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"batch -1", "negative"}));
  p = base();
  p.seqlen_q = -3;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"seqlen_q -3", "negative"}));
  p = base();
  p.seqlen_k = -7;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCuda), {"seqlen_k -7", "negative"}));
}

TEST(ValidateShape, Heads) {
  auto p = base();
  p.heads_q = 0;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"heads_q 0", ">= 1"}));
  p = base();
  p.heads_kv = -2;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"heads_kv -2", ">= 1"}));
  p = base();
  p.heads_q = 12;
  p.heads_kv = 5;
  const Status st = validate(p, Backend::kCpu);
  EXPECT_TRUE(Invalid(st, {}));
  EXPECT_EQ(st.message(), "heads_q 12 is not a multiple of heads_kv 5");
}

/// base() with head dims d (q, k) and dv (v, o; 0 = d), the views shaped to match.
AttnParams with_dims(int d, int dv = 0) {
  AttnParams p = base();
  p.head_dim = d;
  p.head_dim_v = dv;
  const int w = dv ? dv : d;
  p.q = bshd_view(fake(kQ), DType::kBF16, p.seqlen_q, p.heads_q, d);
  p.k = bshd_view(fake(kK), DType::kBF16, p.seqlen_k, p.heads_kv, d);
  p.v = bshd_view(fake(kV), DType::kBF16, p.seqlen_k, p.heads_kv, w);
  p.o = bshd_view(fake(kO), DType::kBF16, p.seqlen_q, p.heads_q, w);
  return p;
}

TEST(ValidateShape, HeadDim) {
  for (int d : {0, 4, 12, 127, 260, 264, 512, -64}) {
    auto p = base();
    p.head_dim = d;
    const Status st = validate(p, Backend::kCpu);
    EXPECT_TRUE(Invalid(st, {}));
    EXPECT_EQ(st.message(), "head_dim " + std::to_string(d) + " is not supported (it must be a multiple of 8 in [8, 256])");
    p.head_dim = 128;
    p.head_dim_v = d;
    if (d == 0) continue;  // head_dim_v 0 means head_dim
    EXPECT_EQ(validate(p, Backend::kCpu).message(),
              "head_dim_v " + std::to_string(d) + " is not supported (it must be a multiple of 8 in [8, 256])");
  }
}

TEST(ValidateShape, EveryMultipleOfEightOnTheCpuBackends) {
  for (int d = 8; d <= 256; d += 8)
    for (int dv : {0, 8, 64, 128, 200, 256})
      for (Backend b : {Backend::kAuto, Backend::kCpu, Backend::kCpuReference})
        EXPECT_TRUE(Passes(validate(with_dims(d, dv), b))) << "d=" << d << " dv=" << dv << " " << backend_name(b);
}

TEST(ValidateShape, CudaTakesEveryPairInItsClass) {
  // The CUDA prefill kernels pad to their class inside (attention.h): every supported pair passes.
  for (int d = 8; d <= 256; d += 8)
    for (int dv : {0, 8, 64, 96, 128, 256})
      EXPECT_TRUE(Passes(validate(with_dims(d, dv), Backend::kCuda))) << "d=" << d << " dv=" << dv;
  EXPECT_TRUE(Passes(validate(with_dims(192, 128), Backend::kCuda)));
}

TEST(HeadDimClass, SmallestCompiledClassThatHoldsBoth) {
  EXPECT_EQ(cuda_head_dim_class(8, 8), 64);
  EXPECT_EQ(cuda_head_dim_class(64, 64), 64);
  EXPECT_EQ(cuda_head_dim_class(72, 64), 128);
  EXPECT_EQ(cuda_head_dim_class(64, 72), 128);
  EXPECT_EQ(cuda_head_dim_class(96, 96), 128);
  EXPECT_EQ(cuda_head_dim_class(192, 128), 256);
  EXPECT_EQ(cuda_head_dim_class(256, 8), 256);
  EXPECT_EQ(cuda_head_dim_class(264, 8), 0);
  AttnParams p = with_dims(80);
  EXPECT_EQ(p.head_dim_class(), 128);
  p.head_dim_v = 136;
  EXPECT_EQ(p.head_dim_class(), 256);
}

TEST(HeadDimClass, Sm90PrefillHasA192By128Class) {
  // q/k in (128, 192] with v/o up to 128: the sm90 prefill kernel's 192 / 128 class (id 192).
  for (const auto& dd : {std::pair{192, 128}, {160, 128}, {192, 96}, {136, 64}, {136, 8}, {144, 128}}) {
    EXPECT_EQ(cuda_sm90_head_dim_class(dd.first, dd.second), 192) << dd.first << "/" << dd.second;
    EXPECT_EQ(cuda_head_dim_class(dd.first, dd.second), 256) << "the other kernels keep the 256 class";
  }
  // Everything else is cuda_head_dim_class's.
  for (const auto& dd : {std::pair{128, 128}, {128, 64}, {96, 96}, {64, 8}, {192, 136}, {192, 192}, {200, 128},
                         {256, 128}, {64, 192}, {128, 192}, {264, 8}})
    EXPECT_EQ(cuda_sm90_head_dim_class(dd.first, dd.second), cuda_head_dim_class(dd.first, dd.second))
        << dd.first << "/" << dd.second;
  AttnParams p = with_dims(192);
  EXPECT_EQ(p.sm90_head_dim_class(), 256);  // head_dim_v 0: 192 / 192
  p.head_dim_v = 128;
  EXPECT_EQ(p.sm90_head_dim_class(), 192);
  EXPECT_EQ(p.head_dim_class(), 256);
}

TEST(ValidateShape, VAndOAreCheckedAtHeadDimV) {
  // o laid out 64 wide but head_dim_v 128: o's own rows overlap.
  AttnParams p = with_dims(128, 64);
  p.head_dim_v = 128;
  const Status st = validate(p, Backend::kCpu);
  EXPECT_TRUE(Invalid(st, {"v.", "at least 128"})) << st.message();
  // A wider q than k is fine for attention only when head_dim says so: q and k share head_dim.
  p = with_dims(64, 128);
  p.k = bshd_view(fake(kK), DType::kBF16, p.seqlen_k, p.heads_kv, 32);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"k.", "at least 64"}));
}

TEST(ValidateShape, EmptyProblemsNeedNoPointers) {
  for (Backend b : kAllBackends) {
    AttnParams p;  // every pointer null
    p.heads_q = p.heads_kv = 4;
    p.head_dim = 64;
    p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = DType::kF16;
    p.batch = 0;
    p.seqlen_q = p.seqlen_k = 100;
    EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
    p.batch = 3;
    p.seqlen_q = 0;
    EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
    // The scalar checks still run.
    p.head_dim = 84;
    EXPECT_TRUE(Invalid(validate(p, b), {"head_dim 84 is not supported", "multiple of 8 in [8, 256]"}));
  }
}

TEST(ValidateShape, NoKeysNeedsNoKeyPointers) {
  for (Backend b : kAllBackends) {
    auto p = base();
    p.seqlen_k = 0;
    p.k.data = p.v.data = nullptr;
    EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
    p.lse = fake_as<float>(kLse);
    EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
  }
}

// ---- rule 2: dtypes --------------------------------------------------------------------------

TEST(ValidateDtype, MismatchNamesBoth) {
  auto p = base();
  p.k.dtype = DType::kF16;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"k.dtype fp16", "q.dtype bf16"}));
  p = base(DType::kF16);
  p.o.dtype = DType::kF32;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o.dtype fp32", "q.dtype fp16"}));
  p = base();
  p.v.dtype = DType::kF32;
  EXPECT_TRUE(Invalid(validate(p, Backend::kAuto), {"v.dtype fp32", "q.dtype bf16"}));
}

TEST(ValidateDtype, UnknownDtype) {
  auto p = base();
  p.q.dtype = static_cast<DType>(7);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"q.dtype 7", "not a known dtype"}));
}

TEST(ValidateDtype, Fp32IsCpuOnly) {
  const auto p = base(DType::kF32);
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  EXPECT_TRUE(Passes(validate(p, Backend::kCpuReference)));
  EXPECT_TRUE(Passes(validate(p, Backend::kAuto)));  // the most permissive backend
  EXPECT_TRUE(
      Fails(validate(p, Backend::kCuda), StatusCode::kUnsupported, {"fp32 runs on the CPU backend only"}));
}

TEST(ValidateDtype, UnknownBackend) {
  EXPECT_TRUE(Invalid(validate(base(), static_cast<Backend>(9)), {"backend 9", "not a known backend"}));
}

// ---- rule 3: pointers and alignment ------------------------------------------------------------

TEST(ValidatePointers, NullTensors) {
  for (Backend b : kAllBackends) {
    auto p = base();
    p.q.data = nullptr;
    EXPECT_TRUE(Invalid(validate(p, b), {"q.data is null"}));
    p = base();
    p.k.data = nullptr;
    EXPECT_TRUE(Invalid(validate(p, b), {"k.data is null"}));
    p = base();
    p.v.data = nullptr;
    EXPECT_TRUE(Invalid(validate(p, b), {"v.data is null"}));
    p = base();
    p.o.data = nullptr;
    EXPECT_TRUE(Invalid(validate(p, b), {"o.data is null"}));
  }
}

TEST(ValidatePointers, ElementAlignment) {
  for (Backend b : kAllBackends) {
    auto p = base();
    p.v.data = fake(kV + 1);
    EXPECT_TRUE(Invalid(validate(p, b), {"v.data 0x30000001", "2-byte bf16"})) << backend_name(b);
  }
  auto p = base(DType::kF32);
  p.o.data = fake(kO + 2);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o.data 0x40000002", "4-byte fp32"}));
}

TEST(ValidatePointers, CudaNeeds16ByteBasePointers) {
  auto p = base();
  p.k.data = fake(kK + 8);  // element-aligned, not vector-aligned
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  EXPECT_TRUE(Passes(validate(p, Backend::kAuto)));
  EXPECT_TRUE(Invalid(validate(p, Backend::kCuda), {"k.data 0x20000008", "16-byte", "vector loads"}));
}

TEST(ValidatePointers, CudaNeedsStridesOfEightElements) {
  auto p = base();
  p.q.seq_stride = p.heads_q * p.head_dim + 4;  // padded rows, 8-byte steps
  p.q.batch_stride = p.q.seq_stride * p.seqlen_q;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  EXPECT_TRUE(Invalid(validate(p, Backend::kCuda), {"q.seq_stride 1028", "multiple of 8", "vector loads"}));
  p = base();
  p.v.batch_stride += 2;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCuda), {"v.batch_stride", "multiple of 8"}));
  // A size-1 dim's stride is never used: any value passes (PyTorch gives such dims odd strides).
  p = base();
  p.batch = 1;
  p.q.batch_stride = p.o.batch_stride = 3;
  EXPECT_TRUE(Passes(validate(p, Backend::kCuda)));
}

TEST(ValidatePointers, LseAlignment) {
  auto p = base();
  p.lse = fake_as<float>(kLse + 2);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"lse 0x50000002", "4-byte"}));
  p.lse = fake_as<float>(kLse + 4);
  EXPECT_TRUE(Passes(validate(p, Backend::kCuda)));
}

// ---- rule 4: strides ---------------------------------------------------------------------------

TEST(ValidateStrides, Negative) {
  auto p = base();
  p.k.seq_stride = -1024;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"k.seq_stride -1024", "negative"}));
  p = base();
  p.o.batch_stride = -1;
  EXPECT_TRUE(Invalid(validate(p, Backend::kAuto), {"o.batch_stride -1", "negative"}));
}

TEST(ValidateStrides, OverlappingHeads) {
  auto p = base();
  p.q.head_stride = 64;  // heads of 128 elements, 64 apart
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"q.head_stride 64", "share one element", "at least 128"}));
}

TEST(ValidateStrides, BroadcastIsRejected) {
  auto p = base();
  p.k.seq_stride = 0;  // every key row on one element range
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"k.seq_stride 0", "share one element"}));
  p = base();
  p.o.batch_stride = 0;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o.batch_stride 0", "share one element"}));
}

TEST(ValidateStrides, BatchTooClose) {
  auto p = base();
  p.v.batch_stride = p.v.seq_stride * (p.seqlen_k - 1);  // last row of b0 == first row of b1
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"v.batch_stride", "share one element"}));
}

TEST(ValidateStrides, HeadDimMustBeInnermost) {
  auto p = base();
  p.q.seq_stride = 1;  // would interleave rows inside a head
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"q.seq_stride 1", "share one element"}));
}

// ---- rule 5: overflow ----------------------------------------------------------------------------

TEST(ValidateOverflow, Int64Span) {
  auto p = base();
  p.k.batch_stride = std::numeric_limits<std::int64_t>::max();  // + the rows of one sequence
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"k's largest element offset overflows int64"}));
}

TEST(ValidateOverflow, Int32InsideOneSequence) {
  auto p = base();
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = 1 << 20;
  p.heads_q = p.heads_kv = 32;
  p.q = bshd_view(fake(kQ), DType::kBF16, p.seqlen_q, 32, 128);  // 2^32 elements per sequence
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu),
                      {"q's offset inside one sequence", "4294967296", "does not fit in int32", "32-bit"}));
  // 16 heads reach exactly 2^31, one past INT32_MAX; 8 heads (2^30) are fine.
  p.heads_q = p.heads_kv = 16;
  p.q = bshd_view(fake(0x100000000000), DType::kBF16, p.seqlen_q, 16, 128);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"q's offset inside one sequence", "2147483648"}));
  p.heads_q = p.heads_kv = 8;
  p.q = bshd_view(fake(0x100000000000), DType::kBF16, p.seqlen_q, 8, 128);
  p.k = bshd_view(fake(0x200000000000), DType::kBF16, p.seqlen_k, 8, 128);
  p.v = bshd_view(fake(0x300000000000), DType::kBF16, p.seqlen_k, 8, 128);
  p.o = bshd_view(fake(0x400000000000), DType::kBF16, p.seqlen_q, 8, 128);
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
}

TEST(ValidateOverflow, AddressWrap) {
  auto p = base();
  p.o.data = fake(~std::uintptr_t{0} - 0xfff);  // aligned, but the span runs past 2^64
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o's byte span", "wraps around the address space"}));
  p = base();
  p.lse = fake_as<float>(~std::uintptr_t{0} - 0xfff);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"lse's byte span", "wraps around"}));
}

TEST(ValidateOverflow, LseCount) {
  auto p = base();
  p.batch = 1 << 30;
  p.heads_q = 1 << 20;
  p.heads_kv = 1;
  p.seqlen_q = 1 << 20;
  p.lse = fake_as<float>(kLse);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"lse element count", "overflows int64"}));
}

// ---- rule 6: aliasing ----------------------------------------------------------------------------

TEST(ValidateAliasing, OutputOverlapsInputs) {
  auto p = base();
  p.o.data = p.q.data;  // in place
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o overlaps q"}));
  p = base();
  p.o.data = fake(kK + 4096);  // partly inside k
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o overlaps k"}));
  p = base();
  p.o.data = fake(kV - 2 * 4096);  // the tail of o runs into v
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o overlaps v"}));
}

TEST(ValidateAliasing, LseOverlaps) {
  auto p = base();
  p.lse = fake_as<float>(kQ + 64);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"lse overlaps q"}));
  p.lse = fake_as<float>(kO + 64);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o overlaps lse"}));
}

TEST(ValidateAliasing, AdjacentBuffersAreFine) {
  auto p = base();
  const std::uintptr_t q_bytes = 2ull * 128 * 8 * 128 * 2;
  p.o.data = fake(kQ + q_bytes);  // o starts where q ends
  p.lse = fake_as<float>(kQ + 2 * q_bytes);
  EXPECT_TRUE(Passes(validate(p, Backend::kCuda)));
}

// ---- rule 7: scalars -----------------------------------------------------------------------------

TEST(ValidateScalars, SoftmaxScale) {
  auto p = base();
  p.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"softmax_scale nan", "not finite"}));
  p.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"softmax_scale inf", "not finite"}));
  p.softmax_scale = 0.5f;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
}

TEST(ValidateScalars, Softcap) {
  auto p = base();
  p.mask.softcap = -1.f;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.softcap -1", ">= 0"}));
  p.mask.softcap = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.softcap inf", "finite"}));
  p.mask.softcap = 30.f;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
}

TEST(ValidateScalars, Windows) {
  auto p = base();
  p.mask.window_left = -2;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.window_left -2", ">= -1"}));
  p = base();
  p.mask.window_right = -5;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.window_right -5", ">= -1"}));
  p = base();
  p.mask.window_left = 0;
  p.mask.window_right = 0;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
}

TEST(ValidateScalars, GlobalTokens) {
  auto p = base();
  p.mask.global_tokens = -1;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.global_tokens -1", "negative"}));
  p = base();
  p.mask.global_queries = true;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.global_queries", "global_tokens > 0"}));
  p.mask.global_tokens = 4;
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
}

TEST(ValidateScalars, Alibi) {
  auto p = base();
  p.mask.alibi_slopes = fake_as<const float>(0x60000000);
  for (std::int64_t s : {std::int64_t{0}, std::int64_t{8}}) {
    p.mask.alibi_batch_stride = s;
    EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));
  }
  p.mask.alibi_batch_stride = 3;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.alibi_batch_stride 3", "0 or heads_q 8"}));
  p.mask.alibi_batch_stride = 0;
  p.mask.alibi_slopes = fake_as<const float>(0x60000002);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.alibi_slopes 0x60000002", "4-byte"}));
}

// ---- rule 8: varlen ------------------------------------------------------------------------------

/// Three packed sequences of lengths (5, 0, 9) queries and (7, 3, 16) keys, (total, heads, dim).
struct Varlen {
  std::vector<std::int32_t> cu_q{0, 5, 5, 14}, cu_k{0, 7, 10, 26};
  AttnParams p;
  Varlen(const Varlen&) = delete;  // p points into this object's arrays
  Varlen& operator=(const Varlen&) = delete;
  Varlen() {
    p = base();
    p.batch = 3;
    p.seqlen_q = 9;
    p.seqlen_k = 16;
    p.q = bshd_view(fake(kQ), DType::kBF16, 0, 8, 128);
    p.k = bshd_view(fake(kK), DType::kBF16, 0, 8, 128);
    p.v = bshd_view(fake(kV), DType::kBF16, 0, 8, 128);
    p.o = bshd_view(fake(kO), DType::kBF16, 0, 8, 128);
    p.q.batch_stride = -12345;  // ignored with varlen
    set();
  }
  void set() {
    p.mask.cu_seqlens_q = cu_q.data();
    p.mask.cu_seqlens_k = cu_k.data();
  }
};

TEST(ValidateVarlen, Valid) {
  Varlen v;
  for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(v.p, b))) << backend_name(b);
  // Head-major packing (heads, total, dim): the packed total (14 rows) is read on the CPU.
  v.p.q.head_stride = 14 * 128;
  v.p.q.seq_stride = 128;
  v.p.lse = fake_as<float>(kLse);
  EXPECT_TRUE(Passes(validate(v.p, Backend::kCpu)));
  v.p.q.head_stride = 13 * 128;  // one row short: head h's last row is head h+1's first
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCpu), {"q.head_stride 1664", "share one element"}));
}

TEST(ValidateVarlen, BothOrNeither) {
  Varlen v;
  v.p.mask.cu_seqlens_k = nullptr;
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCpu), {"mask.cu_seqlens_k is null", "cu_seqlens_q is set"}));
  v.set();
  v.p.mask.cu_seqlens_q = nullptr;
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCuda), {"mask.cu_seqlens_q is null", "cu_seqlens_k is set"}));
}

TEST(ValidateVarlen, PrefixSumsOnHost) {
  for (Backend b : kHostBackends) {
    EXPECT_TRUE(Invalid(validate_changed<Varlen>([](Varlen& v) { v.cu_q[0] = 1; }, b),
                        {"mask.cu_seqlens_q[0] is 1", "must be 0"}));
    EXPECT_TRUE(Invalid(validate_changed<Varlen>([](Varlen& v) { v.cu_k[2] = 6; }, b),
                        {"mask.cu_seqlens_k[2] 6", "cu_seqlens_k[1] 7", "non-decreasing"}));
    // Sequence 2 gets 10 rows; seqlen_q says at most 9.
    EXPECT_TRUE(Invalid(validate_changed<Varlen>([](Varlen& v) { v.cu_q[3] = 15; }, b),
                        {"sequence 2", "length 10", "seqlen_q 9"}));
  }
}

TEST(ValidateVarlen, DeviceArraysAreNotRead) {
  Varlen v;
  // Unreadable addresses: the CUDA backend (and kAuto, which may be CUDA) must not touch them.
  v.p.mask.cu_seqlens_q = fake_as<const std::int32_t>(0x70000000);
  v.p.mask.cu_seqlens_k = fake_as<const std::int32_t>(0x70001000);
  EXPECT_TRUE(Passes(validate(v.p, Backend::kCuda)));
  EXPECT_TRUE(Passes(validate(v.p, Backend::kAuto)));
  v.p.mask.cu_seqlens_k = fake_as<const std::int32_t>(0x70001002);
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCuda), {"mask.cu_seqlens_k 0x70001002", "4-byte"}));
}

TEST(ValidateVarlen, NoKeysAtAll) {
  Varlen v;
  v.cu_k = {0, 0, 0, 0};
  v.set();
  v.p.seqlen_k = 0;
  v.p.k.data = v.p.v.data = nullptr;
  EXPECT_TRUE(Passes(validate(v.p, Backend::kCpu)));
}

// mask.total_q: the packed row count of a varlen q (attention.h). It bounds the q/o spans and the
// LSE, must cover cu_seqlens_q[batch] where that can be read, and is for varlen only.
TEST(ValidateVarlen, TotalQ) {
  Varlen v;
  v.p.mask.total_q = 14;  // = cu_seqlens_q[3]
  for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(v.p, b))) << backend_name(b);
  v.p.mask.total_q = 20;  // rows past the last sequence
  EXPECT_TRUE(Passes(validate(v.p, Backend::kCpu)));
  v.p.mask.total_q = 13;
  for (Backend b : kHostBackends)
    EXPECT_TRUE(Invalid(validate(v.p, b), {"mask.total_q 13", "less than cu_seqlens_q[batch] 14"}));
  EXPECT_TRUE(Passes(validate(v.p, Backend::kCuda)));  // device arrays: not read
  v.p.mask.total_q = -1;
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCpu), {"mask.total_q -1", "negative"}));
  v.p.mask.total_q = std::int64_t{1} << 31;
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCuda), {"mask.total_q 2147483648", "2^31-1"}));
  auto p = base();
  p.mask.total_q = 5;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"mask.total_q 5", "without cu_seqlens"}));
  // Head-major packing (heads, total, dim) over 20 rows: head_stride must step past 20 rows.
  v.p.mask.total_q = 20;
  v.p.q.head_stride = v.p.o.head_stride = 20 * 128;
  v.p.q.seq_stride = v.p.o.seq_stride = 128;
  EXPECT_TRUE(Passes(validate(v.p, Backend::kCpu)));
  v.p.o.head_stride = 19 * 128;
  EXPECT_TRUE(Invalid(validate(v.p, Backend::kCpu), {"o.head_stride 2432", "share one element"}));
}

// Varlen batch 0 with total_q writes O = 0 and LSE = -inf into the packed rows: o and lse are
// checked (and only they: q, k and v are not read), where a plain empty problem checks nothing.
TEST(ValidateVarlen, BatchZeroWithTotalQChecksTheOutputs) {
  std::vector<std::int32_t> cu = {0};
  auto p = base();
  p.batch = 0;
  p.seqlen_q = p.seqlen_k = 0;
  p.q = p.k = p.v = TensorView{};  // null: never read
  p.o = bshd_view(fake(kO), DType::kBF16, 0, 8, 128);
  p.mask.cu_seqlens_q = p.mask.cu_seqlens_k = cu.data();
  EXPECT_TRUE(Passes(validate(p, Backend::kCpu)));  // total_q unknown: writes nothing
  p.mask.total_q = 8;
  for (Backend b : kHostBackends) EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
  p.lse = fake_as<float>(kLse);
  EXPECT_TRUE(Passes(validate(p, Backend::kCuda)));
  p.o.data = nullptr;
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o.data is null"}));
  p.o.data = fake(kLse + 4);  // overlaps the lse
  EXPECT_TRUE(Invalid(validate(p, Backend::kCpu), {"o overlaps lse"}));
  p.o.data = fake(kO + 2);
  EXPECT_TRUE(Invalid(validate(p, Backend::kCuda), {"o.data", "16-byte"}));
}

// ---- rule 9: block-sparse ------------------------------------------------------------------------

/// 128 queries x 192 keys in 64 x 64 blocks (2 x 3), one mask for every batch and head:
/// row 0 sees key blocks {0, 1 (partial)}, row 1 sees {1, 2}.
struct Sparse {
  std::vector<std::int32_t> row_ptr{0, 2, 4}, col_idx{0, 1, 1, 2}, partial{-1, 0, -1, -1};
  std::vector<std::uint64_t> bits = std::vector<std::uint64_t>(64, ~0ull);
  BlockSparseMask m;
  AttnParams p;
  Sparse(const Sparse&) = delete;  // p points into this object's arrays
  Sparse& operator=(const Sparse&) = delete;
  Sparse() {
    p = base();
    p.seqlen_k = 192;
    p.k = bshd_view(fake(kK), DType::kBF16, 192, 8, 128);
    p.v = bshd_view(fake(kV), DType::kBF16, 192, 8, 128);
    m.block_m = m.block_n = 64;
    m.num_q_blocks = 2;
    m.num_k_blocks = 3;
    m.num_partial = 1;
    set();
  }
  void set() {
    m.row_ptr = row_ptr.data();
    m.col_idx = col_idx.data();
    m.partial = partial.data();
    m.element_masks = bits.data();
    p.mask.block_sparse = &m;
  }
};

TEST(ValidateBlockSparse, Valid) {
  Sparse s;
  for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(s.p, b))) << backend_name(b);
  // Per-batch, per-head masks: 2 * 8 * 2 rows, all empty.
  s.row_ptr.assign(2 * 8 * 2 + 1, 0);
  s.set();
  s.m.num_batch = 2;
  s.m.num_heads = 8;
  EXPECT_TRUE(Passes(validate(s.p, Backend::kCpu)));
  // No partial blocks: element_masks may be null.
  s.m.num_partial = 0;
  s.m.element_masks = nullptr;
  EXPECT_TRUE(Passes(validate(s.p, Backend::kCpu)));
}

TEST(ValidateBlockSparse, Descriptor) {
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.block_m = 0; }, Backend::kCpu),
                      {"block_sparse.block_m 0", "> 0"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.block_n = -64; }, Backend::kCpu),
                      {"block_sparse.block_n -64", "> 0"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.num_batch = 3; }, Backend::kCpu),
                      {"block_sparse.num_batch 3", "1 or batch 2"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.num_heads = 4; }, Backend::kCpu),
                      {"block_sparse.num_heads 4", "1 or heads_q 8"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.num_q_blocks = 3; }, Backend::kCpu),
                      {"block_sparse.num_q_blocks 3", "seqlen_q 128", ") = 2"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.num_k_blocks = 4; }, Backend::kCpu),
                      {"block_sparse.num_k_blocks 4", "seqlen_k 192", ") = 3"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.num_partial = -1; }, Backend::kCpu),
                      {"block_sparse.num_partial -1", "negative"}));
}

TEST(ValidateBlockSparse, TooManyRows) {
  Sparse s;
  s.p.batch = s.m.num_batch = 1 << 30;
  s.p.heads_q = s.m.num_heads = 1 << 30;
  s.p.heads_kv = 1;
  s.p.seqlen_q = 1 << 30;
  s.m.block_m = 1;
  s.m.num_q_blocks = 1 << 30;
  EXPECT_TRUE(Invalid(validate(s.p, Backend::kCpu), {"block_sparse has too many rows", "overflows int64"}));
}

TEST(ValidateBlockSparse, Pointers) {
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.row_ptr = nullptr; }, Backend::kCuda),
                      {"block_sparse.row_ptr is null"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.col_idx = nullptr; }, Backend::kCpu),
                      {"block_sparse.col_idx is null"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.partial = nullptr; }, Backend::kCpu),
                      {"block_sparse.partial is null"}));
  EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.m.element_masks = nullptr; }, Backend::kCpu),
                      {"block_sparse.element_masks is null", "num_partial is 1"}));
  EXPECT_TRUE(
      Invalid(validate_changed<Sparse>(
                  [](Sparse& s) { s.m.row_ptr = fake_as<const std::int32_t>(0x70000002); }, Backend::kCpu),
              {"block_sparse.row_ptr 0x70000002", "4-byte"}));
  EXPECT_TRUE(Invalid(
      validate_changed<Sparse>(
          [](Sparse& s) { s.m.element_masks = fake_as<const std::uint64_t>(0x70000004); }, Backend::kCpu),
      {"block_sparse.element_masks 0x70000004", "8-byte"}));
}

TEST(ValidateBlockSparse, ArraysOnHost) {
  for (Backend b : kHostBackends) {
    EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.row_ptr[0] = 1; }, b),
                        {"block_sparse.row_ptr[0] is 1", "must be 0"}));
    EXPECT_TRUE(Invalid(validate_changed<Sparse>(
                            [](Sparse& s) {
                              s.row_ptr = {0, 3, 2};
                              s.set();
                            },
                            b),
                        {"block_sparse.row_ptr[2] 2", "row_ptr[1] 3", "non-decreasing"}));
    EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.col_idx[3] = 3; }, b),
                        {"block_sparse.col_idx[3] 3", "num_k_blocks 3"}));
    EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.col_idx[0] = -1; }, b),
                        {"block_sparse.col_idx[0] -1", "outside"}));
    EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.col_idx[1] = 0; }, b),
                        {"block_sparse.col_idx[1] 0", "col_idx[0] 0", "strictly ascending"}));
    EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.partial[2] = 1; }, b),
                        {"block_sparse.partial[2] 1", "num_partial 1"}));
    EXPECT_TRUE(Invalid(validate_changed<Sparse>([](Sparse& s) { s.partial[0] = -2; }, b),
                        {"block_sparse.partial[0] -2", "[-1, num_partial"}));
  }
}

TEST(ValidateBlockSparse, DeviceArraysAreNotRead) {
  Sparse s;
  s.m.row_ptr = fake_as<const std::int32_t>(0x70000000);
  s.m.col_idx = fake_as<const std::int32_t>(0x70001000);
  s.m.partial = fake_as<const std::int32_t>(0x70002000);
  s.m.element_masks = fake_as<const std::uint64_t>(0x70003000);
  EXPECT_TRUE(Passes(validate(s.p, Backend::kCuda)));
  EXPECT_TRUE(Passes(validate(s.p, Backend::kAuto)));
}

TEST(ValidateBlockSparse, NotWithVarlen) {
  Sparse s;
  std::vector<std::int32_t> cu{0, 128, 256};
  s.p.mask.cu_seqlens_q = s.p.mask.cu_seqlens_k = cu.data();
  EXPECT_TRUE(Fails(validate(s.p, Backend::kCpu), StatusCode::kUnsupported, {"varlen", "block-sparse"}));
}

// ---- valid configurations ------------------------------------------------------------------------

TEST(ValidateValid, FlashAttnLayoutEveryBackendAndHeadDim) {
  for (int d : kCudaHeadDims)
    for (Backend b : kAllBackends) {
      auto p = base(DType::kF16);
      p.head_dim = d;
      p.q = bshd_view(fake(kQ), DType::kF16, 128, 8, d);
      p.k = bshd_view(fake(kK), DType::kF16, 128, 8, d);
      p.v = bshd_view(fake(kV), DType::kF16, 128, 8, d);
      p.o = bshd_view(fake(kO), DType::kF16, 128, 8, d);
      p.lse = fake_as<float>(kLse);
      EXPECT_TRUE(Passes(validate(p, b))) << "d=" << d << " " << backend_name(b);
    }
}

TEST(ValidateValid, SdpaLayoutThroughStrides) {
  auto p = base();
  p.q = bhsd_view(fake(kQ), DType::kBF16, 128, 8, 128);
  p.k = bhsd_view(fake(kK), DType::kBF16, 128, 8, 128);
  p.v = bhsd_view(fake(kV), DType::kBF16, 128, 8, 128);
  p.o = bhsd_view(fake(kO), DType::kBF16, 128, 8, 128);
  for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
}

TEST(ValidateValid, PackedQkvSharesOneBuffer) {
  // (batch, seqlen, 3, heads, dim): q, k and v are views into one buffer.
  auto p = base();
  const std::int64_t hd = 8 * 128;
  for (TensorView* t : {&p.q, &p.k, &p.v}) {
    t->seq_stride = 3 * hd;
    t->head_stride = 128;
    t->batch_stride = 128 * 3 * hd;
  }
  p.q.data = fake(kQ);
  p.k.data = fake(kQ + hd * 2);
  p.v.data = fake(kQ + 2 * hd * 2);
  for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
}

TEST(ValidateValid, GqaMqaAndUnequalLengths) {
  for (int hkv : {8, 4, 1}) {
    auto p = base();
    p.heads_q = 32;
    p.heads_kv = hkv;
    p.seqlen_q = 1;  // decode: one query against 4096 keys
    p.seqlen_k = 4096;
    p.q = bshd_view(fake(kQ), DType::kBF16, 1, 32, 128);
    p.o = bshd_view(fake(kO), DType::kBF16, 1, 32, 128);
    p.k = bshd_view(fake(0x100000000), DType::kBF16, 4096, hkv, 128);
    p.v = bshd_view(fake(0x200000000), DType::kBF16, 4096, hkv, 128);
    p.mask.causal = true;
    for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(p, b))) << hkv << " " << backend_name(b);
  }
}

TEST(ValidateValid, PaddedAndSlicedViews) {
  // Heads padded to 160 elements and rows padded: still injective, and multiples of 8.
  auto p = base();
  p.q.head_stride = 160;
  p.q.seq_stride = 8 * 160 + 64;
  p.q.batch_stride = 200 * p.q.seq_stride;
  for (Backend b : kAllBackends) EXPECT_TRUE(Passes(validate(p, b))) << backend_name(b);
}

}  // namespace
}  // namespace flashcpp
