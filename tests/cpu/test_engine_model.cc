// The Llama engine on the CPU backend against an independent fp64 Llama written here from the
// raw weights: a tiny random checkpoint is written to a temp dir (never downloaded), loaded,
// prefilled and decoded; every logit row (prompt positions and decode steps) is compared.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/engine/gemv_plan.h"
#include "engine/engine.h"
#include "engine/safetensors.h"
#include "engine/sampling.h"
#include "engine_tiny.h"
#include "flashcpp/engine.h"
#include "flashcpp/half.h"

namespace fs = std::filesystem;
using namespace flashcpp;
using namespace flashcpp::engine;
using namespace flashcpp::engine::testing;

namespace {

Loaded load(const fs::path& dir) { return load_tiny(dir, make_cpu_ops(2)); }

void expect_matches_reference(const Tiny& t, const fs::path& dir, const std::vector<int>& prompt, int new_tokens,
                              double tol) {
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  GenerateOptions g;
  g.prompts = {std::vector<std::int32_t>(prompt.begin(), prompt.end())};
  g.max_new_tokens = new_tokens;
  g.eager = true;
  g.dump_logits = true;
  g.page_size = 4;  // several pages per sequence: the paged addressing is exercised
  GenerateResult r;
  Status s = generate(*l.model, g, &r);
  ASSERT_TRUE(s.ok()) << s.message();
  const int P = static_cast<int>(prompt.size());
  ASSERT_EQ(r.logits.size(), static_cast<std::size_t>(P + new_tokens - 1) * t.vocab);
  ASSERT_EQ(r.tokens[0].size(), static_cast<std::size_t>(new_tokens));
  std::vector<int> seq(prompt);
  for (int i = 0; i + 1 < new_tokens; ++i) seq.push_back(r.tokens[0][i]);
  const auto ref = reference_logits(t, seq);
  LogitError e;
  logit_error(t, ref, r.logits, &e);
  if (::testing::Test::HasFatalFailure()) return;
  const double worst = e.worst, scale = e.scale;
  EXPECT_LE(worst, tol * std::max(1.0, scale)) << "max |logit - fp64| over " << ref.size() << " rows";
  EXPECT_GT(scale, 0.5) << "degenerate logits: the test could not see an error";
  // Greedy tokens: generated token s comes from row P - 1 + s of the reference.
  for (int s2 = 0; s2 < new_tokens; ++s2) {
    if (static_cast<std::size_t>(P - 1 + s2) >= ref.size()) break;
    EXPECT_EQ(r.tokens[0][s2], argmax(ref[P - 1 + s2])) << "step " << s2;
  }
}

}  // namespace

TEST(EngineModelCpu, MatchesFp64LlamaPromptAndDecode) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "f32", false, 1);
  expect_matches_reference(t, dir, {3, 14, 15, 92, 65, 35, 89}, 9, 2e-4);
  fs::remove_all(dir);
}

TEST(EngineModelCpu, HeadDims96And80And32DecodeLikeFp64) {
  // Phi-3-mini's 96, Phi-2's 80 and a small model's 32: the checkpoint loads, prefills and decodes.
  for (int d : {96, 80, 32}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    Tiny t;
    t.head_dim = d;
    t.heads = 4;
    t.kv_heads = 2;
    const fs::path dir = write_tiny(&t, "d" + std::to_string(d), false, 40 + d);
    expect_matches_reference(t, dir, {3, 14, 15, 92, 65}, 6, 2e-4);
    fs::remove_all(dir);
  }
}

TEST(EngineModelCpu, TiedEmbeddingsBf16CheckpointGqa4) {
  Tiny t;
  t.tied = true;
  t.heads = 4;
  t.kv_heads = 1;
  t.hidden = 256;
  t.llama3 = false;
  const fs::path dir = write_tiny(&t, "bf16", true, 2);
  expect_matches_reference(t, dir, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 6, 2e-4);
  fs::remove_all(dir);
}

TEST(EngineModelCpu, BatchOfRaggedPromptsEqualsSingleRuns) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "batch", false, 3);
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  const std::vector<std::vector<std::int32_t>> prompts = {{5, 6, 7}, {8}, {9, 10, 11, 12, 13, 14, 15, 16, 17}};
  GenerateOptions g;
  g.prompts = prompts;
  g.max_new_tokens = 7;
  g.eager = true;
  g.sampling.temperature = 0.8f;
  g.sampling.top_p = 0.9f;
  g.sampling.seed = 42;
  GenerateResult all;
  Status s = generate(*l.model, g, &all);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(all.bucket, 4);
  ASSERT_EQ(all.tokens.size(), 3u);
  // Greedy: each sequence of the batch generates what it generates alone (batch invariance of
  // the paged cache, the padded graph bucket and the ragged lengths).
  GenerateOptions greedy_all = g;
  greedy_all.sampling.temperature = 0.f;
  GenerateResult ga;
  ASSERT_TRUE(generate(*l.model, greedy_all, &ga).ok());
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    GenerateOptions one = greedy_all;
    one.prompts = {prompts[b]};
    GenerateResult r;
    ASSERT_TRUE(generate(*l.model, one, &r).ok());
    EXPECT_EQ(r.tokens[0], ga.tokens[b]) << "sequence " << b;
  }
  GenerateResult again;
  ASSERT_TRUE(generate(*l.model, g, &again).ok());
  EXPECT_EQ(again.tokens, all.tokens) << "sampling with a fixed seed must repeat";
  for (const auto& seq : all.tokens)
    for (int tok : seq) EXPECT_TRUE(tok >= 0 && tok < t.vocab);
  fs::remove_all(dir);
}

TEST(EngineModelCpu, TinyTopPIsGreedy) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "topp", false, 4);
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  GenerateOptions g;
  g.prompts = {{1, 2, 3}};
  g.max_new_tokens = 5;
  g.eager = true;
  GenerateResult greedy, nucleus;
  ASSERT_TRUE(generate(*l.model, g, &greedy).ok());
  g.sampling.temperature = 1.0f;
  g.sampling.top_p = 1e-6f;  // only the most likely token survives
  ASSERT_TRUE(generate(*l.model, g, &nucleus).ok());
  EXPECT_EQ(greedy.tokens, nucleus.tokens);
  fs::remove_all(dir);
}

TEST(EngineModelCpu, SampledTokensFollowTheDistribution) {
  // sample_row_host against frequencies: logits log(p) for p = (0.5, 0.3, 0.2).
  const float logits[3] = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SampleArgs a;
  a.temperature = 1.f;
  int count[3] = {0, 0, 0};
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++count[sample_row_host(logits, 3, a, sample_uniform(7, i, 0))];
  EXPECT_NEAR(count[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(count[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(count[2] / double(n), 0.2, 0.02);
  a.top_p = 0.7f;  // keeps 0.5 and 0.3 (mass 0.8 >= 0.7), renormalized to 5/8 and 3/8
  count[0] = count[1] = count[2] = 0;
  for (int i = 0; i < n; ++i) ++count[sample_row_host(logits, 3, a, sample_uniform(9, i, 1))];
  EXPECT_EQ(count[2], 0);
  EXPECT_NEAR(count[0] / double(n), 0.625, 0.02);
}

TEST(EngineModelCpu, ClearErrors) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "err", false, 5);
  auto ops = make_cpu_ops(1);
  std::unique_ptr<LlamaModel> m;
  // A missing tensor.
  {
    Tiny t2 = t;
    t2.w.erase("model.layers.1.mlp.up_proj.weight");
    std::vector<StWriteTensor> ts;
    for (auto& [name, v] : t2.w) ts.push_back(StWriteTensor{name, StDType::kF32, t2.shape[name], v.data()});
    ASSERT_TRUE(write_safetensors((dir / "model.safetensors").string(), ts).ok());
    Status s = LlamaModel::load(dir.string(), ops.get(), &m);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << s.message();
  }
  // A tensor of the wrong shape.
  {
    Tiny t2 = t;
    t2.shape["model.norm.weight"] = {t.hidden / 2};
    t2.w["model.norm.weight"].resize(t.hidden / 2);
    std::vector<StWriteTensor> ts;
    for (auto& [name, v] : t2.w) ts.push_back(StWriteTensor{name, StDType::kF32, t2.shape[name], v.data()});
    ASSERT_TRUE(write_safetensors((dir / "model.safetensors").string(), ts).ok());
    Status s = LlamaModel::load(dir.string(), ops.get(), &m);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("model.norm.weight"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("shape"), std::string::npos) << s.message();
  }
  // An unsupported head dim: even (rotary pairs it), not a multiple of 8.
  {
    Tiny t3 = t;
    t3.head_dim = 36;
    std::ofstream(dir / "config.json") << config_json(t3);
    Status s = LlamaModel::load(dir.string(), ops.get(), &m);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.message(), "config.json: head_dim 36 is not supported (attention takes a multiple of 8 in [8, 256])");
  }
  // Token ids outside the vocabulary; a bad id list.
  std::vector<std::int32_t> ids;
  EXPECT_FALSE(parse_token_ids("1, 2, 97", 97, &ids).ok());
  EXPECT_FALSE(parse_token_ids("1 -2", 97, &ids).ok());
  ASSERT_TRUE(parse_token_ids("1, 2 3\n4", 97, &ids).ok());
  EXPECT_EQ(ids, (std::vector<std::int32_t>{1, 2, 3, 4}));
  // An empty id between, before or after commas is a typo, not a separator (was read as "1,2").
  for (const char* bad : {"1,,2", ",1,2", "1,2,", "1, ,2"}) {
    const Status st = parse_token_ids(bad, 97, &ids);
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_NE(st.message().find("empty id"), std::string::npos) << st.message();
  }
  fs::remove_all(dir);
}

// ---- what the engine refuses (each used to run silently) ----------------------------------------

namespace {

/// Rewrites dir's model.safetensors from t's weights (after an edit).
void rewrite_weights(Tiny& t, const fs::path& dir) {
  std::vector<StWriteTensor> ts;
  for (auto& [name, v] : t.w) ts.push_back(StWriteTensor{name, StDType::kF32, t.shape[name], v.data()});
  ASSERT_TRUE(write_safetensors((dir / "model.safetensors").string(), ts).ok());
}

}  // namespace

// A NaN weight made every logit NaN, and greedy sampling picked token 0 forever without a word.
TEST(EngineModelCpu, NonFiniteWeightsAreRefusedAtLoad) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "nanw", false, 21);
  auto ops = make_cpu_ops(1);
  std::unique_ptr<LlamaModel> m;
  t.w["model.layers.0.self_attn.k_proj.weight"][2 * 128 + 9] = std::nanf("");
  rewrite_weights(t, dir);
  Status s = LlamaModel::load(dir.string(), ops.get(), &m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("tensor 'model.layers.0.self_attn.k_proj.weight' of the checkpoint holds a NaN at "
                             "element 265 (row 2, column 9)"),
            std::string::npos)
      << s.message();
  t.w["model.layers.0.self_attn.k_proj.weight"][2 * 128 + 9] = 0.f;
  t.w["model.norm.weight"][100] = -INFINITY;
  rewrite_weights(t, dir);
  s = LlamaModel::load(dir.string(), ops.get(), &m);
  EXPECT_NE(s.message().find("'model.norm.weight' of the checkpoint holds an Inf at element 100"), std::string::npos)
      << s.message();
  t.w["model.norm.weight"][100] = 1.f;
  rewrite_weights(t, dir);
  EXPECT_TRUE(LlamaModel::load(dir.string(), ops.get(), &m).ok());
  fs::remove_all(dir);
}

// The scan the loader runs, on each dtype's bit patterns (the CUDA backend scans bf16).
TEST(EngineModelCpu, FirstNonFiniteFindsNanAndInfInEveryDtype) {
  std::vector<float> f(10000, 1.f);
  EXPECT_EQ(first_nonfinite(f.data(), f.size(), DType::kF32), -1);
  f[9001] = INFINITY;
  f[9500] = NAN;
  EXPECT_EQ(first_nonfinite(f.data(), f.size(), DType::kF32), 9001);
  f[9001] = 3.4e38f;  // the largest finite values stay finite
  EXPECT_EQ(first_nonfinite(f.data(), f.size(), DType::kF32), 9500);
  std::vector<std::uint16_t> bf(5000, float_to_bf16_bits(-2.5f));
  EXPECT_EQ(first_nonfinite(bf.data(), bf.size(), DType::kBF16), -1);
  bf[4097] = float_to_bf16_bits(NAN);
  EXPECT_EQ(first_nonfinite(bf.data(), bf.size(), DType::kBF16), 4097);
  bf[4097] = float_to_bf16_bits(-INFINITY);
  bf[3] = float_to_bf16_bits(3.0e38f);
  EXPECT_EQ(first_nonfinite(bf.data(), bf.size(), DType::kBF16), 4097);
  std::vector<std::uint16_t> h(100, 0x3c00u);  // fp16 1.0; 0x7bff is 65504, the largest finite
  h[50] = 0x7bffu;
  EXPECT_EQ(first_nonfinite(h.data(), h.size(), DType::kF16), -1);
  h[60] = 0x7c00u;
  EXPECT_EQ(first_nonfinite(h.data(), h.size(), DType::kF16), 60);
  EXPECT_EQ(first_nonfinite(h.data(), 0, DType::kF16), -1);
}

// A config.json with fewer layers than the file ran the truncated model silently.
TEST(EngineModelCpu, AConfigWithFewerLayersThanTheCheckpointIsRefused) {
  Tiny t;
  t.layers = 3;
  const fs::path dir = write_tiny(&t, "layers", false, 22);
  auto ops = make_cpu_ops(1);
  std::unique_ptr<LlamaModel> m;
  Tiny c = t;
  c.layers = 2;
  std::ofstream(dir / "config.json") << config_json(c);
  Status s = LlamaModel::load(dir.string(), ops.get(), &m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("holds layers up to model.layers.2 (3 layers) but config.json says num_hidden_layers 2"),
            std::string::npos)
      << s.message();
  c.layers = 4;  // more layers than the file: the first missing tensor is named
  std::ofstream(dir / "config.json") << config_json(c);
  s = LlamaModel::load(dir.string(), ops.get(), &m);
  EXPECT_NE(s.message().find("model.layers.3."), std::string::npos) << s.message();
  std::ofstream(dir / "config.json") << config_json(t);
  EXPECT_TRUE(LlamaModel::load(dir.string(), ops.get(), &m).ok());
  fs::remove_all(dir);
}

// --temperature nan emitted one token forever with exit 0; top_p outside (0, 1] was taken.
TEST(EngineModelCpu, BadSamplingArgumentsAreRefused) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "samp", false, 23);
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  GenerateOptions g;
  g.prompts = {{1, 2, 3}};
  g.max_new_tokens = 3;
  g.eager = true;
  GenerateResult r;
  const std::pair<float, float> bad[] = {{NAN, 1.f}, {-1.f, 1.f}, {INFINITY, 1.f}, {1.f, 0.f},
                                         {1.f, 2.f}, {1.f, NAN}, {0.f, -0.5f}};
  for (const auto& [temp, top_p] : bad) {
    g.sampling.temperature = temp;
    g.sampling.top_p = top_p;
    const Status s = generate(*l.model, g, &r);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << temp << " " << top_p << ": " << s.message();
    EXPECT_NE(s.message().find(std::isfinite(temp) && temp >= 0 ? "top_p" : "temperature"), std::string::npos)
        << s.message();
  }
  g.sampling.temperature = 0.7f;
  g.sampling.top_p = 1.f;
  EXPECT_TRUE(generate(*l.model, g, &r).ok());
  fs::remove_all(dir);
}

// Finite weights whose logits overflow: the run fails with a sentence instead of printing the
// tokens greedy sampling draws from NaN/Inf logits.
TEST(EngineModelCpu, NonFiniteLogitsAreReported) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "inflogit", false, 24);
  for (float& x : t.w["lm_head.weight"]) x = x > 0 ? 3e38f : -3e38f;
  rewrite_weights(t, dir);
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  GenerateOptions g;
  g.prompts = {{1, 2, 3}, {4, 5}};
  g.max_new_tokens = 4;
  g.eager = true;
  GenerateResult r;
  const Status s = generate(*l.model, g, &r);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the logits of sequence 0 after its prefill are not finite"), std::string::npos)
      << s.message();
  fs::remove_all(dir);
}

// The CPU backend has one GEMM: a CUDA mode was accepted and ignored.
TEST(EngineModelCpu, CpuOpsRefuseCudaGemmModes) {
  auto ops = make_cpu_ops(1);
  EXPECT_TRUE(ops->set_gemm_mode("auto").ok());
  for (const char* m : {"cublaslt", "gemv", "gemv-nopdl"}) {
    const Status s = ops->set_gemm_mode(m);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << m;
    EXPECT_NE(s.message().find("CPU backend"), std::string::npos) << s.message();
  }
}

// The GEMV's row grouping: 2-row groups only where they cut the most-loaded CTA's rows by 10%.
TEST(EngineModelCpu, GemvGroupingFollowsTheWave) {
  using flashcpp::cuda::engine::gemv_grouping;
  using flashcpp::cuda::engine::gemv_rows_per_group;
  const int slots = 132 * 3;  // H200, three 256-thread CTAs per SM
  EXPECT_EQ(gemv_rows_per_group(2048, slots), 2);    // o/down of a 1B Llama: 8 rows -> 6 on the critical path
  EXPECT_EQ(gemv_rows_per_group(3072, slots), 4);    // qkv: 768 groups, 2 each either way (8 rows)
  EXPECT_EQ(gemv_rows_per_group(16384, slots), 4);   // gate_up: 44 -> 42 rows, under 10%
  EXPECT_EQ(gemv_rows_per_group(128256, slots), 4);  // lm_head: 324 either way
  EXPECT_EQ(gemv_rows_per_group(77, slots), 2);      // one group per CTA: 2 rows instead of 4
  EXPECT_EQ(gemv_rows_per_group(4 * slots, slots), 4);
  EXPECT_EQ(gemv_rows_per_group(4 * slots + 4, slots), 2);  // one group more than a wave: 8 -> 6 rows (25% less)
  EXPECT_EQ(gemv_rows_per_group(0, slots), 4);
  EXPECT_EQ(gemv_rows_per_group(100, 0), 4);
  // K split over a cluster of two: only the down projection's K (>= 8192) and no norm prologue.
  EXPECT_EQ(gemv_grouping(2048, 8192, slots, true).ksplit, 2);   // down: 8 -> 6 rows' worth, 4 rows in flight
  EXPECT_EQ(gemv_grouping(2048, 8192, slots, true).rows, 4);
  EXPECT_EQ(gemv_grouping(2048, 8192, slots, false).ksplit, 1);  // no clusters (sm_80) or a norm prologue
  EXPECT_EQ(gemv_grouping(2048, 8192, slots, false).rows, 2);
  EXPECT_EQ(gemv_grouping(2048, 2048, slots, true).ksplit, 1);   // o_proj: half of K is 1 chunk a lane: rows of 2
  EXPECT_EQ(gemv_grouping(2048, 2048, slots, true).rows, 2);
  EXPECT_EQ(gemv_grouping(16384, 2048, slots, true).ksplit, 1);  // gate_up's K is too short
  EXPECT_EQ(gemv_grouping(3072, 8192, slots, true).ksplit, 1);   // 768 groups: 8 rows' worth either way
  for (int n = 1; n < 20000; n += 37) {  // never more rows on the critical path than 4-row groups
    const int r = gemv_rows_per_group(n, slots);
    auto critical = [&](int rows) { return ((n + rows - 1) / rows + slots - 1) / slots * rows; };
    EXPECT_LE(critical(r), critical(4)) << n;
  }
}

// The public Engine (include/flashcpp/engine.h, what `flashcpp decode` drives): the same tokens as
// generate() on a model loaded by hand, the checkpoint's shape, and a sentence for a second load
// or a generate before any load.
TEST(EngineModelCpu, PublicEngineRunsLikeTheInternalPath) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "public", false, 11);
  std::unique_ptr<Engine> eng = Engine::cpu(2);
  ASSERT_TRUE(eng);
  EXPECT_FALSE(eng->is_cuda());
  EXPECT_NE(eng->describe().find("cpu"), std::string::npos) << eng->describe();
  EXPECT_EQ(eng->set_gemm_mode("gemv").code(), StatusCode::kInvalidArgument);
  GenerateOptions g;
  g.prompts = {{5, 6, 7}, {8, 9}};
  g.max_new_tokens = 5;
  g.eager = true;
  g.sampling.temperature = 0.7f;
  g.sampling.seed = 3;
  GenerateResult early;
  const Status none = eng->generate(g, &early);
  EXPECT_FALSE(none.ok());
  EXPECT_NE(none.message().find("no model is loaded"), std::string::npos) << none.message();
  EXPECT_EQ(eng->model().vocab_size, 0);

  ASSERT_TRUE(eng->load(dir.string()).ok());
  const ModelInfo m = eng->model();
  EXPECT_EQ(m.num_hidden_layers, t.layers);
  EXPECT_EQ(m.hidden_size, t.hidden);
  EXPECT_EQ(m.num_attention_heads, t.heads);
  EXPECT_EQ(m.num_key_value_heads, t.kv_heads);
  EXPECT_EQ(m.vocab_size, t.vocab);
  EXPECT_GT(m.weight_bytes, 0u);
  EXPECT_GT(m.step_weight_bytes, 0u);
  EXPECT_LE(m.step_weight_bytes, m.weight_bytes);
  const Status twice = eng->load(dir.string());
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("loaded on this engine already"), std::string::npos) << twice.message();

  GenerateResult pub, internal;
  ASSERT_TRUE(eng->generate(g, &pub).ok());
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  EXPECT_EQ(m.weight_bytes, l.model->weight_bytes());
  EXPECT_EQ(m.step_weight_bytes, l.model->step_weight_bytes());
  ASSERT_TRUE(generate(*l.model, g, &internal).ok());
  EXPECT_EQ(pub.tokens, internal.tokens);
  fs::remove_all(dir);
}

// GenerateOptions::on_tokens and stop_ids (what the Python binding streams with): the callback sees
// every token of every sequence in order (the prefill's first, as step 0), a stop id ends its
// sequence there (kept as its last token, -1 in later callbacks) while the others run on, the run
// ends when all stopped or the callback says false, and bad uses are refused with a sentence.
TEST(EngineModelCpu, OnTokensStreamsAndStopIdsStop) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "stream", false, 5);
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  GenerateOptions g;
  g.prompts = {{5, 6, 7}, {8}, {9, 10, 11, 12}};
  g.max_new_tokens = 8;
  g.eager = true;
  GenerateResult full;
  ASSERT_TRUE(generate(*l.model, g, &full).ok());
  ASSERT_EQ(full.tokens.size(), 3u);

  // Streaming alone changes nothing and sees every token in order.
  std::vector<std::vector<std::int32_t>> seen(3);
  int calls = 0;
  GenerateOptions gs = g;
  gs.on_tokens = [&](int step, const std::vector<std::int32_t>& toks) {
    EXPECT_EQ(step, calls++);
    EXPECT_EQ(toks.size(), 3u);
    for (std::size_t b = 0; b < toks.size(); ++b) seen[b].push_back(toks[b]);
    return true;
  };
  GenerateResult streamed;
  ASSERT_TRUE(generate(*l.model, gs, &streamed).ok());
  EXPECT_EQ(streamed.tokens, full.tokens);
  EXPECT_EQ(seen, full.tokens);
  EXPECT_EQ(streamed.decode_steps, 7);

  // Sequence 0 stops at its 3rd token (the first occurrence of that id); the others run on.
  const std::int32_t stop = full.tokens[0][2];
  int first0 = 0;
  while (full.tokens[0][first0] != stop) ++first0;
  auto stop_at = [&](const std::vector<std::int32_t>& seq) {
    for (std::size_t i = 0; i < seq.size(); ++i)
      if (seq[i] == stop) return std::vector<std::int32_t>(seq.begin(), seq.begin() + i + 1);
    return seq;
  };
  GenerateOptions gstop = g;
  gstop.stop_ids = {stop};
  std::vector<std::vector<std::int32_t>> seen2(3);
  gstop.on_tokens = [&](int, const std::vector<std::int32_t>& toks) {
    for (std::size_t b = 0; b < toks.size(); ++b) seen2[b].push_back(toks[b]);
    return true;
  };
  GenerateResult stopped;
  ASSERT_TRUE(generate(*l.model, gstop, &stopped).ok());
  ASSERT_EQ(stopped.tokens.size(), 3u);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(stopped.tokens[b], stop_at(full.tokens[b])) << "sequence " << b;
  EXPECT_EQ(stopped.tokens[0].size(), static_cast<std::size_t>(first0 + 1));
  for (std::size_t i = first0 + 1; i < seen2[0].size(); ++i) EXPECT_EQ(seen2[0][i], -1) << "step " << i;

  // All sequences stop: the run ends early; the callback returning false ends it too.
  GenerateOptions one = g;
  one.prompts = {g.prompts[0]};
  one.stop_ids = {stop};
  GenerateResult r1;
  ASSERT_TRUE(generate(*l.model, one, &r1).ok());
  EXPECT_EQ(r1.tokens[0], stop_at(full.tokens[0]));
  EXPECT_EQ(r1.decode_steps, first0);
  GenerateOptions quit = g;
  quit.on_tokens = [](int step, const std::vector<std::int32_t>&) { return step < 3; };
  GenerateResult rq;
  ASSERT_TRUE(generate(*l.model, quit, &rq).ok());
  for (int b = 0; b < 3; ++b)
    EXPECT_EQ(rq.tokens[b], std::vector<std::int32_t>(full.tokens[b].begin(), full.tokens[b].begin() + 4));
  GenerateOptions at0 = g;
  at0.on_tokens = [](int, const std::vector<std::int32_t>&) { return false; };
  GenerateResult r0;
  ASSERT_TRUE(generate(*l.model, at0, &r0).ok());
  for (int b = 0; b < 3; ++b) EXPECT_EQ(r0.tokens[b], std::vector<std::int32_t>{full.tokens[b][0]});
  EXPECT_EQ(r0.decode_steps, 0);

  // Refused: a stop id outside the vocabulary, streaming a --context run; a throwing callback.
  GenerateOptions bad = g;
  bad.stop_ids = {t.vocab};
  GenerateResult rb;
  Status s = generate(*l.model, bad, &rb);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("outside the vocabulary"), std::string::npos) << s.message();
  GenerateOptions ctx;
  ctx.context = 16;
  ctx.eager = true;
  ctx.stop_ids = {1};
  s = generate(*l.model, ctx, &rb);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("need prompts"), std::string::npos) << s.message();
  GenerateOptions thrower = g;
  thrower.on_tokens = [](int step, const std::vector<std::int32_t>&) -> bool {
    if (step == 2) throw std::runtime_error("boom");
    return true;
  };
  s = generate(*l.model, thrower, &rb);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("on_tokens threw at step 2: boom"), std::string::npos) << s.message();
  fs::remove_all(dir);
}

// An fp8 e4m3 KV cache (GenerateOptions::kv_fp8, `flashcpp decode --kv-dtype fp8`): the prompt's
// own attention reads unquantized K/V, so its logits equal the unquantized cache's bit for bit; the
// decode steps attend over code * kv_scale (decode.h). Against the fp64 Llama whose decode rows read
// K and V through the same quantization (engine_tiny.h, reference_logits with quant_from): within
// the fp32 engine's tolerance plus what a rounding tie decided the other way can move (the engine
// quantizes fp32 K/V, the reference fp64 ones). And the quantization is visible: the decode logits
// differ from the unquantized cache's. A simulated context (random K/V) runs too; a bad scale is
// refused.
TEST(EngineModelCpu, Fp8KvCacheDecodesLikeTheFp64LlamaOverTheQuantizedCache) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "fp8kv", false, 29);
  Loaded l = load(dir);
  ASSERT_TRUE(l.model);
  const std::vector<int> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  GenerateOptions g;
  g.prompts = {std::vector<std::int32_t>(prompt.begin(), prompt.end())};
  g.max_new_tokens = 8;
  g.eager = true;
  g.dump_logits = true;
  g.page_size = 4;
  GenerateResult plain, q8;
  ASSERT_TRUE(generate(*l.model, g, &plain).ok());
  g.kv_fp8 = true;
  g.kv_scale = 0.01f;  // |K|, |V| of the tiny model reach ~1: codes up to ~100, in e4m3's normal range
  ASSERT_TRUE(generate(*l.model, g, &q8).ok());
  const std::size_t V = static_cast<std::size_t>(t.vocab), P = prompt.size();
  ASSERT_EQ(plain.logits.size(), q8.logits.size());
  for (std::size_t i = 0; i < P * V; ++i) ASSERT_EQ(plain.logits[i], q8.logits[i]) << "prompt logit " << i;
  std::vector<int> seq(prompt);
  for (int i = 0; i + 1 < g.max_new_tokens; ++i) seq.push_back(q8.tokens[0][i]);
  const auto ref = reference_logits(t, seq, static_cast<int>(P), g.kv_scale);
  LogitError e;
  logit_error(t, ref, q8.logits, &e);
  if (HasFatalFailure()) return;
  double moved = 0;
  for (std::size_t i = P * V; i < q8.logits.size(); ++i)
    moved = std::max(moved, std::fabs(static_cast<double>(q8.logits[i]) - plain.logits[i]));
  std::printf("[ fp8 kv ] max |logit - fp64 over the quantized cache| %.3g, max move from the fp32 cache %.3g, "
              "logits up to %.3g\n", e.worst, moved, e.scale);
  EXPECT_LE(e.worst, 2e-3 * std::max(1.0, e.scale));
  EXPECT_GT(moved, 10 * e.worst) << "the decode steps must read the fp8 cache";
  // A simulated context fills the fp8 pools with quantized random values and decodes.
  GenerateOptions c;
  c.context = 40;
  c.batch = 2;
  c.max_new_tokens = 3;
  c.eager = true;
  c.kv_fp8 = true;
  GenerateResult rc;
  const Status sc = generate(*l.model, c, &rc);
  ASSERT_TRUE(sc.ok()) << sc.message();
  ASSERT_EQ(rc.tokens.size(), 2u);
  for (const auto& sq : rc.tokens)
    for (int tok : sq) EXPECT_TRUE(tok >= 0 && tok < t.vocab) << tok;
  for (float bad : {0.f, -1.f, std::numeric_limits<float>::infinity()}) {
    g.kv_scale = bad;
    GenerateResult rb;
    const Status sb = generate(*l.model, g, &rb);
    EXPECT_EQ(sb.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(sb.message().find("scale"), std::string::npos) << sb.message();
  }
  fs::remove_all(dir);
}
