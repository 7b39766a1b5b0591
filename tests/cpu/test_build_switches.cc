// The build switches (CMake's FLASHCPP_WITH_SM80, _SM90, _DECODE, _FUSED, _ENGINE) on the CPU:
// the list flashcpp/build.h reports follows the FLASHCPP_HAS_* definitions, every refusal names
// its family and switch in one sentence, and, in a build that leaves a family out, each entry
// point that would use it answers that sentence with kUnsupported before touching a device (so
// these run without a GPU), while the CPU backends keep working. Which sources each switch leaves
// out is checked at configure time (tests/cmake/test_build_switches.cmake); the sections under
// #if below run in a build configured with that family off.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/families.h"
#include "core/selector.h"
#include "flashcpp/attention.h"
#include "flashcpp/build.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "test_util.h"
#if FLASHCPP_WITH_CUDA
#include "flashcpp/tune.h"
#endif

namespace flashcpp {
namespace {

using build::Family;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The refusal of a left-out family: kUnsupported, the family's sentence first, its switch named.
::testing::AssertionResult LeftOut(const Status& st, const std::string& option) {
  if (st.code() != StatusCode::kUnsupported) return ::testing::AssertionFailure() << "not unsupported: " << st.to_string();
  if (st.message().rfind("this build leaves out ", 0) != 0 || !has(st.message(), option))
    return ::testing::AssertionFailure() << "the sentence does not name " << option << ": " << st.message();
  return ::testing::AssertionSuccess();
}

TEST(BuildSwitches, TheFamilyListFollowsTheDefinitions) {
  const std::vector<BuildFamily> f = build_families();
  ASSERT_EQ(f.size(), 5u);
  const char* names[] = {"sm80", "sm90", "decode", "fused", "engine"};
  const char* options[] = {"FLASHCPP_WITH_SM80", "FLASHCPP_WITH_SM90", "FLASHCPP_WITH_DECODE", "FLASHCPP_WITH_FUSED",
                           "FLASHCPP_WITH_ENGINE"};
  const bool built[] = {FLASHCPP_HAS_SM80 != 0, FLASHCPP_HAS_SM90 != 0, FLASHCPP_HAS_DECODE != 0,
                        FLASHCPP_HAS_FUSED != 0, FLASHCPP_HAS_ENGINE != 0};
  for (int i = 0; i < 5; ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(f[i].name, names[i]);
    EXPECT_EQ(f[i].option, options[i]);
    EXPECT_EQ(f[i].built, built[i]);
    // Built: nothing to say. Left out: what did it, the sentence, how to get it back.
    EXPECT_EQ(f[i].left_out_by.empty(), f[i].built);
    EXPECT_EQ(f[i].left_out.empty(), f[i].built);
    if (!f[i].built) {
      EXPECT_EQ(f[i].left_out, "this build leaves out the " + f[i].what + " (" + f[i].left_out_by + ")");
      EXPECT_TRUE(has(f[i].remedy, "reconfigure with")) << f[i].remedy;
    }
  }
#if !FLASHCPP_WITH_CUDA  // a CPU-only build holds no kernel family, whatever the switches say
  for (int i = 0; i < 4; ++i) EXPECT_EQ(f[i].left_out_by, "FLASHCPP_CUDA=OFF") << names[i];
#endif
}

TEST(BuildSwitches, EveryRefusalIsOneSentenceNamingItsSwitch) {
  struct Want {
    Family f;
    std::string what, option;
  };
  const Want wants[] = {{Family::kSm80, "sm80 prefill kernels", "FLASHCPP_WITH_SM80"},
                        {Family::kSm90, "sm90 prefill kernels", "FLASHCPP_WITH_SM90"},
                        {Family::kDecode, "CUDA decode kernels", "FLASHCPP_WITH_DECODE"},
                        {Family::kFused, "fused CUDA ops", "FLASHCPP_WITH_FUSED"},
                        {Family::kEngine, "Llama decode engine", "FLASHCPP_WITH_ENGINE"}};
  for (const Want& w : wants) {
    const Status st = build::refuse(w.f, "the context");
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    // "this build leaves out the <what> (<cause>): <context>; <remedy>", whether or not this build
    // holds the family (then the cause is its switch).
    const BuildFamily b = build::family(w.f);
    const std::string cause = b.built ? w.option + "=OFF" : b.left_out_by;
    const std::string remedy = b.built ? "reconfigure with -D" + w.option + "=ON" : b.remedy;
    EXPECT_EQ(st.message(), "this build leaves out the " + w.what + " (" + cause + "): the context; " + remedy);
  }
#if FLASHCPP_WITH_CUDA
  EXPECT_TRUE(LeftOut(build::refuse(Family::kDecode, "x"), "FLASHCPP_WITH_DECODE=OFF"));
  EXPECT_TRUE(has(build::refuse(Family::kFused, "x").message(), "-DFLASHCPP_WITH_FUSED=ON"));
#endif
  const Status both = build::refuse_cuda_prefill();
  EXPECT_EQ(both.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(both.message(), "both CUDA prefill kernel families")) << both.message();
  EXPECT_TRUE(has(both.message(), "CPU backends")) << both.message();
}

// ---- the public entry points of a family left out (a build configured with it OFF) --------------

AttnParams small_attention(testing::HostBuffer& q, testing::HostBuffer& o, int head_dim = 64) {
  AttnParams p;
  p.batch = 1, p.seqlen_q = 4, p.seqlen_k = 4, p.heads_q = 1, p.heads_kv = 1, p.head_dim = head_dim;
  p.q = p.k = p.v = bshd_view(q.data(), q.dt, 4, 1, head_dim);
  p.o = bshd_view(o.data(), o.dt, 4, 1, head_dim);
  return p;
}

TEST(BuildSwitches, CpuAttentionRunsInEveryBuild) {
  testing::HostBuffer q(DType::kF32, 4 * 64), o(DType::kF32, 4 * 64);
  RunOptions opt;
  opt.backend = Backend::kCpu;
  EXPECT_TRUE(attention_forward(small_attention(q, o), opt).ok());
}

#if FLASHCPP_WITH_CUDA
/// A device for the selector to choose on: no GPU is touched (cuda_prefill reads only these).
cuda::DeviceInfo fake_device(int major, const char* name) {
  cuda::DeviceInfo d;
  d.device = 0, d.sm_major = major, d.sm_minor = 0, d.num_sms = 132, d.smem_optin = 227 * 1024;
  d.name = name;
  return d;
}

Status choose(const AttnParams& p, const cuda::DeviceInfo& dev, const std::string& config, KernelChoice* kc) {
  RunOptions opt;
  opt.backend = Backend::kCuda;
  opt.cuda_config = config;
  return select::cuda_prefill(p, opt, dev, kc);
}
#endif

#if FLASHCPP_WITH_CUDA && FLASHCPP_HAS_SM80 && FLASHCPP_HAS_SM90
TEST(BuildSwitches, BothPrefillFamiliesBuiltEachOnItsDevice) {
  testing::HostBuffer q(DType::kBF16, 4 * 64), o(DType::kBF16, 4 * 64);
  const AttnParams p = small_attention(q, o);
  KernelChoice kc;
  ASSERT_TRUE(choose(p, fake_device(9, "H200"), "", &kc).ok());
  EXPECT_EQ(kc.id, KernelId::kCudaSm90);
  ASSERT_TRUE(choose(p, fake_device(8, "A100"), "", &kc).ok());
  EXPECT_EQ(kc.id, KernelId::kCudaSm80);
  ASSERT_TRUE(choose(p, fake_device(9, "H200"), "sm80", &kc).ok());
  EXPECT_EQ(kc.id, KernelId::kCudaSm80);
}
#endif

#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_SM80 && FLASHCPP_HAS_SM90
TEST(BuildSwitches, WithoutSm80HopperStillChoosesSm90AndTheRestIsRefused) {
  testing::HostBuffer q(DType::kBF16, 4 * 64), o(DType::kBF16, 4 * 64);
  AttnParams p = small_attention(q, o);
  KernelChoice kc;
  ASSERT_TRUE(choose(p, fake_device(9, "H200"), "", &kc).ok());
  EXPECT_EQ(kc.id, KernelId::kCudaSm90);
  ASSERT_TRUE(choose(p, fake_device(9, "H200"), "sm90", &kc).ok());
  EXPECT_EQ(kc.id, KernelId::kCudaSm90);
  const Status ampere = choose(p, fake_device(8, "A100"), "", &kc);
  EXPECT_TRUE(LeftOut(ampere, "FLASHCPP_WITH_SM80=OFF"));
  EXPECT_TRUE(has(ampere.message(), "'A100' (sm_80)")) << ampere.message();
  EXPECT_TRUE(LeftOut(choose(p, fake_device(9, "H200"), "sm80", &kc), "FLASHCPP_WITH_SM80=OFF"));
  const Status named = choose(p, fake_device(9, "H200"), "m128n64w4s2q", &kc);
  EXPECT_TRUE(LeftOut(named, "FLASHCPP_WITH_SM80=OFF"));
  EXPECT_TRUE(has(named.message(), "not an sm90 config")) << named.message();
  // 64x64 block-sparse blocks: no sm90 tile divides them; the sm80 kernel that would is not built.
  BlockSparseMask bs;
  bs.block_m = 64, bs.block_n = 64;
  p.mask.block_sparse = &bs;
  const Status sparse = choose(p, fake_device(9, "H200"), "", &kc);
  EXPECT_TRUE(LeftOut(sparse, "FLASHCPP_WITH_SM80=OFF"));
  EXPECT_TRUE(has(sparse.message(), "64x64 block-sparse")) << sparse.message();
  // flashcpp/tune.h still links: no configs, a run refused.
  EXPECT_TRUE(cuda::prefill_sm80_configs(64).empty());
  EXPECT_EQ(cuda::prefill_sm80_pick(p, fake_device(9, "H200")), "");
  EXPECT_TRUE(LeftOut(cuda::prefill_sm80(p, "", nullptr), "FLASHCPP_WITH_SM80=OFF"));
  EXPECT_FALSE(cuda::prefill_sm90_configs(64).empty());
}
#endif

#if FLASHCPP_WITH_CUDA && FLASHCPP_HAS_SM80 && !FLASHCPP_HAS_SM90
TEST(BuildSwitches, WithoutSm90HopperChoosesSm80) {
  testing::HostBuffer q(DType::kBF16, 4 * 64), o(DType::kBF16, 4 * 64);
  const AttnParams p = small_attention(q, o);
  KernelChoice kc;
  ASSERT_TRUE(choose(p, fake_device(9, "H200"), "", &kc).ok());
  EXPECT_EQ(kc.id, KernelId::kCudaSm80);
  const std::string why = build::family(Family::kSm90).left_out_by;  // the switch, or the archs
  EXPECT_TRUE(LeftOut(choose(p, fake_device(9, "H200"), "sm90", &kc), why));
  EXPECT_TRUE(LeftOut(choose(p, fake_device(9, "H200"), "sm90_m128n128s2p", &kc), why));
  EXPECT_TRUE(cuda::prefill_sm90_configs(64).empty());
  EXPECT_TRUE(LeftOut(cuda::prefill_sm90(p, "", nullptr), why));
}
#endif

#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_SM80 && !FLASHCPP_HAS_SM90
TEST(BuildSwitches, WithoutEitherPrefillFamilyCudaAttentionIsRefusedBeforeAnyDevice) {
  testing::HostBuffer q(DType::kBF16, 4 * 64), o(DType::kBF16, 4 * 64);
  const AttnParams p = small_attention(q, o);
  RunOptions opt;
  opt.backend = Backend::kCuda;
  KernelChoice kc;
  const Status sel = select_kernel(p, opt, &kc);
  EXPECT_TRUE(LeftOut(sel, "FLASHCPP_WITH_SM80")) << sel.message();
  EXPECT_TRUE(has(sel.message(), "FLASHCPP_WITH_SM90")) << sel.message();
  EXPECT_EQ(attention_forward(p, opt).message(), sel.message());
  EXPECT_EQ(choose(p, fake_device(9, "H200"), "", &kc).message(), sel.message());
  EXPECT_TRUE(cuda::prefill_sm80_configs(64).empty());
  EXPECT_TRUE(cuda::prefill_sm90_configs(64).empty());
}
#endif

#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_DECODE
TEST(BuildSwitches, WithoutDecodeEveryCudaDecodeEntryIsRefusedBeforeAnyDevice) {
  // The refusal comes before validation: a default problem is enough.
  DecodeParams p;
  DecodePlanOptions po;
  po.backend = Backend::kCuda;
  DecodeWorkspaceSize ws;
  EXPECT_TRUE(LeftOut(decode_workspace_size(p, po, &ws), "FLASHCPP_WITH_DECODE=OFF"));
  DecodePlan plan;
  EXPECT_TRUE(LeftOut(decode_plan(p, po, nullptr, 0, nullptr, 0, &plan), "FLASHCPP_WITH_DECODE=OFF"));
  plan.planned = true;
  plan.backend = Backend::kCuda;
  RunOptions ro;
  EXPECT_TRUE(LeftOut(decode_run(p, plan, ro), "FLASHCPP_WITH_DECODE=OFF"));
  MergeStatesParams mp;
  ro.backend = Backend::kCuda;
  const Status merge = merge_attention_states(mp, ro);
  EXPECT_TRUE(LeftOut(merge, "FLASHCPP_WITH_DECODE=OFF"));
  EXPECT_TRUE(has(merge.message(), "CPU backend only")) << merge.message();
}
#endif

#if FLASHCPP_WITH_CUDA && !FLASHCPP_HAS_FUSED
TEST(BuildSwitches, WithoutFusedEveryCudaFusedOpIsRefusedAndTheCpuRuns) {
  testing::HostBuffer x(DType::kBF16, 8), w(DType::kBF16, 8), y(DType::kBF16, 8);
  RmsNormParams p;
  p.rows = 1;
  p.hidden = 8;
  p.x = contiguous_matrix(x.data(), DType::kBF16, 8);
  p.y = contiguous_matrix(y.data(), DType::kBF16, 8);
  p.weight = w.data();
  RunOptions o;
  o.backend = Backend::kCuda;
  const Status st = rms_norm(p, o);
  EXPECT_TRUE(LeftOut(st, "FLASHCPP_WITH_FUSED=OFF"));
  EXPECT_TRUE(has(st.message(), "rms_norm runs on the CPU backend only")) << st.message();
  o.backend = Backend::kCpu;
  EXPECT_TRUE(rms_norm(p, o).ok());
}
#endif

}  // namespace
}  // namespace flashcpp
