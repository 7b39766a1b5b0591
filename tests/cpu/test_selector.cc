// The selector (src/core/selector.h) on the CPU: config names round-trip through the typed
// TileConfig, the register budgets the sm90 kernel is built with, the CPU kernel choices, and the
// score-unit check that validation shares (softcap and ALiBi in units of 1/|scale|). The sm90
// wide-tile and persistent rules are checked on their measured shapes in test_tile_order.cc, the
// decode split rule in test_decode.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/attention_algebra.h"
#include "core/decode_backends.h"
#include "core/selector.h"
#if FLASHCPP_HAS_SM90
#include "cuda/prefill/fa3_registry.h"
#endif
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
  // configs, 160 / 128 the sm90 kernel's 192 / 128 class (Test Sm90Runs192By128InItsOwnClass) and
  // the sm80 kernel's 256 class, and the reason names the class.
  cuda::DeviceInfo h200{0, 9, 0, 132, 232448, "NVIDIA H200"}, a100{0, 8, 0, 108, 166912, "NVIDIA A100"};
  const struct {
    int d, dv, cls;
  } cases[] = {{96, 96, 128}, {80, 80, 128}, {32, 32, 64}, {8, 8, 64}, {160, 128, 256}, {128, 64, 128}, {64, 128, 128}};
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
      const bool sm90 = kc.id == KernelId::kCudaSm90;
      const std::string cls = sm90 && cuda_sm90_head_dim_class(c.d, c.dv) == 192 ? "192/128" : std::to_string(c.cls);
      EXPECT_NE(kc.reason.find(" " + cls + " class"), std::string::npos) << kc.reason;
      // The chosen config is one of the class's own.
      const std::vector<std::string> names =
          sm90 ? cuda::prefill_sm90_configs(c.d, c.dv) : cuda::prefill_sm80_configs(c.cls);
      EXPECT_NE(std::find(names.begin(), names.end(), kc.config), names.end()) << kc.config;
    }
  // A head dim that is its own class says nothing about classes.
  std::vector<std::uint16_t> buf;
  KernelChoice kc;
  ASSERT_TRUE(select::cuda_prefill(host_problem(&buf), RunOptions{}, h200, &kc).ok());
  EXPECT_EQ(kc.reason.find("class"), std::string::npos) << kc.reason;
}

TEST(Selector, AChoiceWithoutExplainIsTheSameKernelAndTile) {
  // attention_forward asks without `explain`: the same kernel and tile as flashcpp info's choice,
  // with no config name or reason built; a refusal keeps its sentence.
  cuda::DeviceInfo h200{0, 9, 0, 132, 232448, "NVIDIA H200"}, a100{0, 8, 0, 108, 166912, "NVIDIA A100"};
  const struct {
    int d, sq, sk;
    bool causal;
    const char* config;
  } cases[] = {{128, 4096, 4096, true, ""}, {64, 512, 512, false, ""}, {96, 1000, 3000, false, ""},
               {256, 128, 4096, true, ""}, {128, 4096, 4096, false, "sm80"}, {64, 2048, 2048, true, "sm90"}};
  for (const auto& c : cases)
    for (const cuda::DeviceInfo* dev : {&h200, &a100}) {
      std::vector<std::uint16_t> buf;
      AttnParams p = host_problem(&buf);
      p.seqlen_q = c.sq;
      p.seqlen_k = c.sk;
      p.head_dim = p.head_dim_v = c.d;
      p.mask.causal = c.causal;
      RunOptions opt;
      opt.cuda_config = c.config;
      KernelChoice full, lean;
      const Status a = select::cuda_prefill(p, opt, *dev, &full), b = select::cuda_prefill(p, opt, *dev, &lean, false);
      const std::string what = std::to_string(c.d) + " " + c.config + " on " + dev->name;
      ASSERT_EQ(a.ok(), b.ok()) << what;
      if (!a.ok()) {
        EXPECT_EQ(a.message(), b.message()) << what;
        continue;
      }
      EXPECT_EQ(full.id, lean.id) << what;
      EXPECT_EQ(full.tile, lean.tile) << what;
      EXPECT_FALSE(full.config.empty()) << what;
      EXPECT_FALSE(full.reason.empty()) << what;
      EXPECT_TRUE(lean.config.empty()) << what;
      EXPECT_TRUE(lean.reason.empty()) << what;
    }
}
#endif

#if FLASHCPP_HAS_SM90
TEST(Selector, Sm90Runs192By128InItsOwnClass) {
  // q/k head dims in (128, 192] with v/o up to 128 (DeepSeek-V2/V3's 192 / 128 and its padded
  // neighbours) run on Hopper in the sm90 kernel's 192 / 128 class: its configs (BlockM 128,
  // BlockN 128, two stages: Q K^T over 192 columns, P V over 128), chosen by the same rules as the
  // other classes. The sm80 kernel (an A100) keeps the 256 class.
  cuda::DeviceInfo h200{0, 9, 0, 132, 232448, "NVIDIA H200"}, a100{0, 8, 0, 108, 166912, "NVIDIA A100"};
  // The class's compiled configs: the default, its plain twin (block-sparse) and its persistent twin.
  const std::vector<std::string> names = cuda::prefill_sm90_configs(192, 128);
  EXPECT_EQ(names, (std::vector<std::string>{"sm90_m128n128s2p", "sm90_m128n128s2", "sm90_m128n128s2p_persist"}));
  EXPECT_EQ(cuda::prefill_sm90_configs(192), cuda::prefill_sm90_configs(256, 256)) << "192 / 192 stays in the 256 class";
  for (const auto& e : cuda::fa3_entries(192, 128)) {
    EXPECT_EQ(e.head_dim, 192);
    EXPECT_EQ(e.head_dim_v, 128);
    // Q 48 KB + 2 x (K 48 KB + V 32 KB) + CtaWork, alignment, barriers, rotary tables.
    EXPECT_EQ(e.smem_bytes, 128 + 1024 + 128 * 192 * 2 + 2 * 128 * (192 + 128) * 2 + 256 + 2 * 128 * 8);
    EXPECT_LE(static_cast<std::size_t>(e.smem_bytes), h200.smem_optin);
  }
  struct Want {
    int d, dv;
    bool causal;
    int batch, seqlen;
    bool sparse;
    const char* config;
  };
  const Want wants[] = {
      {192, 128, false, 1, 4096, false, "sm90_m128n128s2p"},         // the default
      {160, 128, true, 1, 1000, false, "sm90_m128n128s2p"},          // causal, too few units for the persistent twin
      {192, 96, true, 2, 4096, false, "sm90_m128n128s2p_persist"},   // causal, 512 units fill four waves
      {136, 64, false, 1, 127, false, "sm90_m128n128s2p"},
      {192, 128, false, 1, 4096, true, "sm90_m128n128s2"},           // block-sparse: the plain consumers
  };
  for (const Want& w : wants) {
    std::vector<std::uint16_t> buf;
    AttnParams p = host_problem(&buf);
    p.batch = w.batch;
    p.heads_q = p.heads_kv = 16;
    p.seqlen_q = p.seqlen_k = w.seqlen;
    p.head_dim = w.d;
    p.head_dim_v = w.dv;
    p.mask.causal = w.causal;
    BlockSparseMask bs;
    bs.block_m = bs.block_n = 128;
    if (w.sparse) p.mask.block_sparse = &bs;
    const std::string what = std::to_string(w.d) + "/" + std::to_string(w.dv) + (w.causal ? " causal" : "") +
                             (w.sparse ? " block-sparse" : "") + " n" + std::to_string(w.seqlen);
    KernelChoice kc;
    Status st = select::cuda_prefill(p, RunOptions{}, h200, &kc);
    ASSERT_TRUE(st.ok()) << what << ": " << st.message();
    EXPECT_EQ(kc.id, KernelId::kCudaSm90) << what;
    EXPECT_EQ(kc.config, w.config) << what;
    EXPECT_EQ(kc.tile.block_m, 128) << what;
    EXPECT_EQ(kc.tile.block_n, 128) << what;
    EXPECT_NE(kc.reason.find("192/128 class"), std::string::npos) << what << ": " << kc.reason;
    // A config of the class forced by name runs there too; a 256-class name is not one of them.
    RunOptions named;
    named.cuda_config = "sm90_m128n128s2";
    ASSERT_TRUE(select::cuda_prefill(p, named, h200, &kc).ok()) << what;
    EXPECT_EQ(kc.config, "sm90_m128n128s2") << what;
#if FLASHCPP_HAS_SM80
    // The sm80 kernel runs it in the 256 class.
    st = select::cuda_prefill(p, RunOptions{}, a100, &kc);
    ASSERT_TRUE(st.ok()) << what << ": " << st.message();
    EXPECT_EQ(kc.id, KernelId::kCudaSm80) << what;
    const std::vector<std::string> sm80 = cuda::prefill_sm80_configs(256);
    EXPECT_NE(std::find(sm80.begin(), sm80.end(), kc.config), sm80.end()) << what << ": " << kc.config;
    EXPECT_NE(kc.reason.find("256 class"), std::string::npos) << what << ": " << kc.reason;
#endif
  }
  // 192 / 128 exactly is the class's own pair: the reason still names the class (its config names
  // are the 128 class's too), without the padding sentence.
  std::vector<std::uint16_t> buf;
  AttnParams p = host_problem(&buf);
  p.seqlen_q = p.seqlen_k = 4096;
  p.head_dim = 192;
  p.head_dim_v = 128;
  KernelChoice kc;
  ASSERT_TRUE(select::cuda_prefill(p, RunOptions{}, h200, &kc).ok());
  EXPECT_NE(kc.reason.find("runs in the sm90 192/128 class"), std::string::npos) << kc.reason;
  EXPECT_EQ(kc.reason.find("zero columns"), std::string::npos) << kc.reason;
  // Just outside the class: v/o 136 or q/k 200 run in the 256 class on Hopper as before.
  for (const auto& dd : {std::pair{192, 136}, {200, 128}}) {
    p.head_dim = dd.first;
    p.head_dim_v = dd.second;
    ASSERT_TRUE(select::cuda_prefill(p, RunOptions{}, h200, &kc).ok());
    const std::vector<std::string> n256 = cuda::prefill_sm90_configs(256);
    EXPECT_NE(std::find(n256.begin(), n256.end(), kc.config), n256.end()) << kc.config;
    EXPECT_NE(kc.reason.find(" 256 class"), std::string::npos) << kc.reason;
  }
}
#endif

#if FLASHCPP_HAS_SM90
TEST(Selector, Sm90LeanMaskConfigsTakeOnlyCausalAndSequenceEnds) {
  // d64's 192-row tile comes twice: with lean masks (causal and sequence ends only: no spills at
  // its 160 registers) and with the general mask path. The automatic choice takes the lean one
  // wherever the problem's masks allow, the general one for every other mask; a lean config named
  // for a mask it does not run is refused with a sentence naming its twin. d128 and d256 have lean
  // twins of their default and persistent configs (d256 of its persistent one only), taken the same
  // way; the 192-row lean tile has a persistent twin too, taken by the persistent rule (its general
  // twin is not built).
  cuda::DeviceInfo h200{0, 9, 0, 132, 232448, "NVIDIA H200"};
  const std::vector<std::string> names = cuda::prefill_sm90_configs(64);
  for (const char* n : {"sm90_m192n128s4p_lean", "sm90_m192n128s4p_lean_persist", "sm90_m192n128s4p"})
    ASSERT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  for (int d : {64, 128, 256}) {
    int lean = 0;
    for (const auto& e : cuda::fa3_entries(d, d)) lean += e.tile.lean_mask;
    EXPECT_EQ(lean, d == 256 ? 1 : 2) << d;  // a default and its persistent twin (d256: the persistent one)
  }
  const int big = 192 * ((10 * 132 + 15) / 16);  // 16 heads: >= 10 wide tiles per SM
  std::vector<std::uint16_t> buf;
  auto problem = [&](bool causal) {
    AttnParams p = host_problem(&buf);
    p.heads_q = p.heads_kv = 16;
    p.seqlen_q = p.seqlen_k = big;
    p.mask.causal = causal;
    return p;
  };
  auto pick = [&](const AttnParams& p, const std::string& named = "") {
    RunOptions opt;
    opt.cuda_config = named;
    KernelChoice kc;
    const Status st = select::cuda_prefill(p, opt, h200, &kc);
    return st.ok() ? kc.config : "refused: " + st.message();
  };
  for (bool causal : {false, true}) {
    AttnParams p = problem(causal);
    EXPECT_EQ(pick(p), "sm90_m192n128s4p_lean") << causal;
    p.seqlen_k = big + 77;  // unequal lengths: still causal and sequence ends
    EXPECT_EQ(pick(p), "sm90_m192n128s4p_lean") << causal;
  }
  const float slopes[16] = {};
  RotarySpec rope;
  rope.style = RopeStyle::kNeox;
  const std::vector<std::pair<std::string, std::function<void(AttnParams&)>>> others = {
      {"window", [](AttnParams& p) { p.mask.window_left = 256; }},
      {"right window", [](AttnParams& p) { p.mask.window_right = 0; }},
      {"sinks", [](AttnParams& p) { p.mask.window_left = 256, p.mask.global_tokens = 4; }},
      {"softcap", [](AttnParams& p) { p.mask.softcap = 30.f; }},
      {"alibi", [&](AttnParams& p) { p.mask.alibi_slopes = slopes; }},
      {"rotary", [&](AttnParams& p) { p.rotary.spec = rope; }},
  };
  for (const auto& [what, set] : others)
    for (bool causal : {false, true}) {
      AttnParams p = problem(causal);
      set(p);
      EXPECT_EQ(pick(p), "sm90_m192n128s4p") << what;
      const std::string refused = pick(p, "sm90_m192n128s4p_lean");
      EXPECT_EQ(refused.rfind("refused: ", 0), 0u) << what << ": " << refused;
      EXPECT_NE(refused.find("lean masks"), std::string::npos) << refused;
      EXPECT_NE(refused.find("its twin sm90_m192n128s4p does"), std::string::npos) << refused;
      EXPECT_NE(pick(p, "sm90_m192n128s4p_lean_persist").find("its twin"), std::string::npos) << what;
    }
  // d128 and d256: the lean default where one tile walks many key tiles (d256: the general default,
  // which has no lean twin), the lean persistent twin where the persistent rule holds; a window takes
  // the general configs, and a named lean one refuses it.
  for (const auto& [d, general] : {std::pair{128, "sm90_m128n128s2p"}, {256, "sm90_m128n64s2p"}}) {
    AttnParams p = problem(true);
    p.head_dim = d;
    p.seqlen_q = p.seqlen_k = 4096;
    p.heads_q = p.heads_kv = 4;  // 128 tiles: below the persistent rule's waves
    const std::string lean = std::string(general) + "_lean";
    EXPECT_EQ(pick(p), d == 256 ? std::string(general) : lean) << d;
    p.heads_q = p.heads_kv = 32;
    p.batch = 4;  // (4,32,4096) causal: the persistent twin
    EXPECT_EQ(pick(p), lean + "_persist") << d;
    p.mask.window_left = 100;
    EXPECT_EQ(pick(p), std::string(general) + "_persist") << d;  // the general persistent twin
    if (d == 128)
      EXPECT_NE(pick(p, lean).find("its twin " + std::string(general) + " does"), std::string::npos) << pick(p, lean);
    EXPECT_NE(pick(p, lean + "_persist").find("its twin " + std::string(general) + "_persist does"), std::string::npos);
  }
  // d64: the measured rows of the lean 192-row tile and its persistent twin (reports/hopper, the
  // H100 run at 3873b71: the persistent twin 1.14-1.17x the automatic choice before it on the
  // short and mid causal rows; the one-wave (1,8,2048) rows keep the 128-row tile).
  auto d64 = [&](int batch, int heads, int seqlen, bool causal) {
    AttnParams p = problem(causal);
    p.batch = batch;
    p.heads_q = p.heads_kv = heads;
    p.seqlen_q = p.seqlen_k = seqlen;
    return pick(p);
  };
  EXPECT_EQ(d64(2, 16, 4096, true), "sm90_m192n128s4p_lean_persist");
  EXPECT_EQ(d64(4, 32, 2048, true), "sm90_m192n128s4p_lean_persist");
  EXPECT_EQ(d64(16, 32, 1024, true), "sm90_m192n128s4p_lean_persist");
  EXPECT_EQ(d64(2, 16, 16384, true), "sm90_m192n128s4p_lean");  // 64 key tiles a tile: not persistent
  EXPECT_EQ(d64(2, 16, 4096, false), "sm90_m192n128s4p_lean");
  EXPECT_EQ(d64(2, 16, 16384, false), "sm90_m192n128s4p_lean");
  EXPECT_EQ(d64(1, 8, 2048, false).find("m192"), std::string::npos);
  EXPECT_EQ(d64(1, 8, 2048, true).find("m192"), std::string::npos);
}
#endif

#if FLASHCPP_HAS_SM90
TEST(Selector, Sm90QkTwinsServeHeadDimsUpTo96) {
  // The 128 class's default and its persistent twin come with "_k96" twins whose Q K^T covers the
  // first 96 dims (6 of 8 k16 steps): the automatic choice takes them for q/k head dims up to 96
  // (Phi-3's 96, Phi-2's 80, 64 with v/o 128), the whole-class configs above; a twin named for a
  // larger head dim is refused with a sentence; block-sparse masks keep the plain config.
  cuda::DeviceInfo h200{0, 9, 0, 132, 232448, "NVIDIA H200"};
  const std::vector<std::string> names = cuda::prefill_sm90_configs(128);
  for (const char* n : {"sm90_m128n128s2p_k96", "sm90_m128n128s2p_k96_persist"})
    ASSERT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  for (const auto& e : cuda::fa3_entries(128, 128))
    if (e.tile.qk_dims != 0) EXPECT_EQ(e.tile.qk_dims, 96);
  std::vector<std::uint16_t> buf;
  auto pick = [&](int d, int dv, bool causal, int batch, int seqlen, const std::string& named = "",
                  const BlockSparseMask* bs = nullptr) {
    AttnParams p = host_problem(&buf);
    p.head_dim = d;
    p.head_dim_v = dv;
    p.batch = batch;
    p.heads_q = p.heads_kv = 16;
    p.seqlen_q = p.seqlen_k = seqlen;
    p.mask.causal = causal;
    p.mask.block_sparse = bs;
    RunOptions opt;
    opt.cuda_config = named;
    KernelChoice kc;
    const Status st = select::cuda_prefill(p, opt, h200, &kc);
    return st.ok() ? kc.config : "refused: " + st.message();
  };
  for (int d : {96, 88, 80, 72}) {
    EXPECT_EQ(pick(d, d, false, 1, 4096), "sm90_m128n128s2p_k96") << d;
    EXPECT_EQ(pick(d, d, true, 1, 1000), "sm90_m128n128s2p_k96") << d;         // too few units to persist
    EXPECT_EQ(pick(d, d, true, 2, 4096), "sm90_m128n128s2p_k96_persist") << d;  // 512 units, four full waves
    EXPECT_EQ(pick(d, 128, false, 1, 4096), "sm90_m128n128s2p_k96") << d;       // v/o anywhere in the class
  }
  EXPECT_EQ(pick(64, 128, false, 1, 4096), "sm90_m128n128s2p_k96");
  for (int d : {104, 112, 120, 128}) {  // (their masks are lean: the lean twins of the whole class)
    EXPECT_EQ(pick(d, d, false, 1, 4096), "sm90_m128n128s2p_lean") << d;
    EXPECT_EQ(pick(d, d, true, 2, 4096), "sm90_m128n128s2p_lean_persist") << d;
    const std::string refused = pick(d, d, false, 1, 4096, "sm90_m128n128s2p_k96");
    EXPECT_EQ(refused.rfind("refused: ", 0), 0u) << refused;
    EXPECT_NE(refused.find("covers head dims up to 96"), std::string::npos) << refused;
  }
  BlockSparseMask bs;
  bs.block_m = bs.block_n = 128;
  EXPECT_EQ(pick(96, 96, false, 1, 4096, "", &bs), "sm90_m128n128s2");
  // Named at a head dim it takes, the twin runs; a plain config name is still there for block-sparse.
  EXPECT_EQ(pick(80, 80, false, 1, 4096, "sm90_m128n128s2p_k96_persist"), "sm90_m128n128s2p_k96_persist");
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

TEST(Selector, BackwardKeyGroupsBoundTheDeterministicChain) {
  // Default mode: one group of every key tile (each head's tiles side by side, today's grid).
  EXPECT_EQ(select::backward_key_group(false, 32, 4, 32, 132), 32);
  EXPECT_EQ(select::backward_key_group(false, 1, 1, 1, 132), 1);
  // Deterministic: enough tiles per head to fill the GPU, at least 4, never more than there are.
  EXPECT_EQ(select::backward_key_group(true, 32, 4, 32, 132), 4);    // 128 heads: 4 tiles each
  EXPECT_EQ(select::backward_key_group(true, 128, 1, 16, 132), 9);   // 16 heads: ceil(132 / 16)
  EXPECT_EQ(select::backward_key_group(true, 64, 2, 16, 132), 5);    // 32 heads: ceil(132 / 32)
  EXPECT_EQ(select::backward_key_group(true, 3, 1, 1, 132), 3);      // fewer tiles than the rule
  EXPECT_EQ(select::backward_key_group(true, 0, 1, 1, 132), 1);      // no key tile: one empty group
  EXPECT_EQ(select::backward_key_group(true, 8, 1, 1, 0), 4);        // no device count: the floor
  // The grid's z (batch x groups) stays within 65535: groups grow when the batch is large.
  for (const int batch : {1, 1000, 20000, 65535}) {
    const int key_tiles = 4096;
    for (const bool det : {false, true}) {
      const int g = select::backward_key_group(det, key_tiles, batch, 1, 132);
      ASSERT_GE(g, 1);
      ASSERT_LE(g, key_tiles);
      const long long groups = (key_tiles + g - 1) / g;
      EXPECT_LE(static_cast<long long>(batch) * groups, 65535) << "batch " << batch << " det " << det;
    }
  }
}

TEST(Selector, BackwardConfigTakesAFamilyAndAKeyGroup) {
  std::string family, why;
  int g = -1;
  EXPECT_TRUE(select::backward_config("", &family, &g, &why));
  EXPECT_EQ(family, "");
  EXPECT_EQ(g, 0);
  EXPECT_TRUE(select::backward_config("sm90ws+g8", &family, &g, &why));
  EXPECT_EQ(family, "sm90ws");
  EXPECT_EQ(g, 8);
  EXPECT_TRUE(select::backward_config("+g65535", &family, &g, &why));  // the automatic family, forced groups
  EXPECT_EQ(family, "");
  EXPECT_EQ(g, 65535);
  EXPECT_TRUE(select::backward_config("sm80", &family, &g, &why));
  EXPECT_EQ(g, 0);
  for (const char* bad : {"sm90ws+g", "sm90ws+g0", "sm90ws+g65536", "sm90ws+g-1", "sm90ws+g8x", "sm90ws+g 8",
                          "sm91", "sm90_m128n128s2p", "+g123456"}) {
    why.clear();
    EXPECT_FALSE(select::backward_config(bad, &family, &g, &why)) << bad;
    EXPECT_NE(why.find("+g<N>"), std::string::npos) << bad << ": " << why;
  }
  // A forced group size holds in either mode, within the same bounds.
  EXPECT_EQ(select::backward_key_group(true, 32, 4, 32, 132, 8), 8);
  EXPECT_EQ(select::backward_key_group(false, 32, 4, 32, 132, 2), 2);
  EXPECT_EQ(select::backward_key_group(true, 32, 4, 32, 132, 100), 32);  // at most the key tiles
  EXPECT_EQ(select::backward_key_group(true, 4096, 20000, 1, 132, 1), 1366);  // 3 groups: batch x groups <= 65535
}

}  // namespace
}  // namespace flashcpp
