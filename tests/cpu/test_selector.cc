// The selector (src/core/selector.h) on the CPU: config names round-trip through the typed
// TileConfig, the register budgets the sm90 kernel is built with, the CPU kernel choices, and the
// score-unit check that validation shares (softcap and ALiBi in units of 1/|scale|). The sm90
// wide-tile and persistent rules are checked on their measured shapes in test_tile_order.cc, the
// decode split rule in test_decode.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/attention_algebra.h"
#include "core/decode_backends.h"
#include "core/selector.h"
#include "flashcpp/tune.h"
#include "flashcpp/attention.h"
#include "flashcpp/decode.h"

namespace flashcpp {
namespace {

TEST(Selector, ConfigNamesSayWhatTheTileIs) {
  TileConfig a;
  a.block_m = 128, a.block_n = 64, a.warps = 4, a.stages = 2, a.q_in_regs = false;
  EXPECT_EQ(select::sm80_config_name(a), "m128n64w4s2q");
  a.q_in_regs = true, a.min_blocks = 3;
  EXPECT_EQ(select::sm80_config_name(a), "m128n64w4s2rb3");
  TileConfig h;
  h.block_m = 128, h.block_n = 128, h.stages = 2;
  EXPECT_EQ(select::sm90_config_name(h), "sm90_m128n128s2");
  h.ping_pong = h.sched = true;
  EXPECT_EQ(select::sm90_config_name(h), "sm90_m128n128s2p");
  h.sched = false;
  EXPECT_EQ(select::sm90_config_name(h), "sm90_m128n128s2o");
  h.sched = true, h.persistent = true, h.block_m = 192;
  EXPECT_EQ(select::sm90_config_name(h), "sm90_m192n128s2p_persist");
  // Typed equality is what dispatch launches by: a field that differs is another config.
  TileConfig b = h;
  EXPECT_TRUE(b == h);
  b.stages = 3;
  EXPECT_FALSE(b == h);
}

TEST(Selector, Sm90RegisterBudgetsFillTheRegisterFile) {
  // Two consumer warpgroups of 232 and a producer of 40: 128 * (40 + 2 * 232) = 64512 <= 65536.
  static_assert(select::sm90_registers(2, 128).producer == 40 && select::sm90_registers(2, 128).consumer == 232);
  static_assert(select::sm90_registers(2, 176).producer == 24 && select::sm90_registers(2, 176).consumer == 240);
  static_assert(select::sm90_registers(3, 128).producer == 32 && select::sm90_registers(3, 128).consumer == 160);
  for (int consumers : {2, 3})
    for (int block_n : {64, 128, 176, 256}) {
      const select::Sm90Registers r = select::sm90_registers(consumers, block_n);
      EXPECT_LE(128 * (r.producer + consumers * r.consumer), 65536) << consumers << " x " << block_n;
      EXPECT_EQ(r.producer % 8, 0);
      EXPECT_EQ(r.consumer % 8, 0);
    }
}

TEST(Selector, BlockSparseFitIsWholeTilesAndWholeWords) {
  BlockSparseMask bs;
  bs.block_m = 128, bs.block_n = 128;
  EXPECT_TRUE(select::tiles_fit_block_sparse(bs, 128, 128));
  EXPECT_TRUE(select::tiles_fit_block_sparse(bs, 64, 32));
  EXPECT_FALSE(select::tiles_fit_block_sparse(bs, 192, 128));  // rows straddle mask rows
  bs.block_n = 96;
  EXPECT_FALSE(select::tiles_fit_block_sparse(bs, 128, 96));  // 96 keys: neither whole words nor inside one
  EXPECT_TRUE(select::tiles_fit_block_sparse(bs, 128, 32));
}

AttnParams host_problem(std::vector<std::uint16_t>* buf) {
  AttnParams p;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = 8;
  p.heads_q = p.heads_kv = 1;
  p.head_dim = 64;
  buf->assign(4 * 8 * 64, 0);
  p.q = bshd_view(buf->data(), DType::kBF16, 8, 1, 64);
  p.k = bshd_view(buf->data() + 512, DType::kBF16, 8, 1, 64);
  p.v = bshd_view(buf->data() + 1024, DType::kBF16, 8, 1, 64);
  p.o = bshd_view(buf->data() + 1536, DType::kBF16, 8, 1, 64);
  return p;
}

TEST(Selector, CpuBackendsAreNamedChoicesWithoutATile) {
  std::vector<std::uint16_t> buf;
  const AttnParams p = host_problem(&buf);
  for (Backend b : {Backend::kCpu, Backend::kCpuReference}) {
    RunOptions opt;
    opt.backend = b;
    KernelChoice kc;
    ASSERT_TRUE(select_kernel(p, opt, &kc).ok());
    EXPECT_EQ(kc.id, b == Backend::kCpu ? KernelId::kCpuTiled : KernelId::kCpuReference);
    EXPECT_TRUE(kc.config.empty());
    EXPECT_TRUE(kc.tile == TileConfig{});
    EXPECT_FALSE(kc.reason.empty());
  }
}

#if FLASHCPP_WITH_CUDA
TEST(Selector, AHeadDimRunsInTheSmallestClassThatHoldsIt) {
  // Described devices (nothing is launched): an H200 and an A100. head_dim 96 picks the 128 class's
  // configs, 192 / 128 the 256 class's, and the reason names the class.
  cuda::DeviceInfo h200{0, 9, 0, 132, 232448, "NVIDIA H200"}, a100{0, 8, 0, 108, 166912, "NVIDIA A100"};
  const struct {
    int d, dv, cls;
  } cases[] = {{96, 96, 128}, {80, 80, 128}, {32, 32, 64}, {8, 8, 64}, {192, 128, 256}, {128, 64, 128}, {64, 128, 128}};
  for (const auto& c : cases)
    for (const cuda::DeviceInfo* dev : {&h200, &a100}) {
      std::vector<std::uint16_t> buf;
      AttnParams p = host_problem(&buf);
      p.seqlen_q = p.seqlen_k = 4096;
      p.head_dim = c.d;
      p.head_dim_v = c.dv;
      KernelChoice kc;
      const Status st = select::cuda_prefill(p, RunOptions{}, *dev, &kc);
#if !FLASHCPP_HAS_SM80
      if (dev->sm_major != 9) continue;
#endif
      ASSERT_TRUE(st.ok()) << c.d << "/" << c.dv << " " << dev->name << ": " << st.message();
      EXPECT_NE(kc.reason.find(std::to_string(c.cls) + " class"), std::string::npos) << kc.reason;
      // The chosen config is one of the class's own.
      const std::vector<std::string> names =
          kc.id == KernelId::kCudaSm90 ? cuda::prefill_sm90_configs(c.cls) : cuda::prefill_sm80_configs(c.cls);
      EXPECT_NE(std::find(names.begin(), names.end(), kc.config), names.end()) << kc.config;
    }
  // A head dim that is its own class says nothing about classes.
  std::vector<std::uint16_t> buf;
  KernelChoice kc;
  ASSERT_TRUE(select::cuda_prefill(host_problem(&buf), RunOptions{}, h200, &kc).ok());
  EXPECT_EQ(kc.reason.find("class"), std::string::npos) << kc.reason;
}
#endif

TEST(Selector, SoftcapAndAlibiNeedFiniteRawUnits) {
  // The kernels keep scores in units of 1/|scale|: at a scale whose inverse overflows fp32 the
  // cap and the slopes have no such units, and validation says so on every backend.
  std::vector<std::uint16_t> buf;
  AttnParams p = host_problem(&buf);
  p.softmax_scale = 1e-39f;  // 1 / scale = 1e39 > FLT_MAX
  ASSERT_TRUE(validate(p, Backend::kCpu).ok()) << "without softcap or ALiBi any scale is fine";
  p.mask.softcap = 30.f;
  const Status st = validate(p, Backend::kCpu);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("units of 1/|softmax_scale|"), std::string::npos) << st.message();
  p.softmax_scale = -0.125f;  // a negative scale has raw units (the sign is kept apart)
  EXPECT_TRUE(validate(p, Backend::kCpu).ok());
  const algebra::ScoreTransform t = algebra::ScoreTransform::make(-0.125f, 30.f);
  EXPECT_EQ(t.sign, -1.f);
  EXPECT_FLOAT_EQ(t.cap, 240.f);
  EXPECT_FLOAT_EQ(t.raw(2.f), -2.f);
  // Python's softmax_scale = 0.0 arrives as 2^-100: still representable.
  EXPECT_TRUE(algebra::ScoreTransform::make(std::ldexp(1.f, -100), 30.f).raw_units_finite());
}

TEST(Selector, DecodeValidationSharesTheScoreUnitCheck) {
  DecodeParams p;
  p.batch = 1;
  p.seqlen_q = 1;
  p.heads_q = p.heads_kv = 1;
  p.head_dim = 64;
  p.softmax_scale = 1e-39f;
  p.mask.softcap = 10.f;
  const Status st = decode::validate_decode_shape(p, Backend::kCpu);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.message();
  EXPECT_NE(st.message().find("units of 1/|softmax_scale|"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace flashcpp
