// generate(): prompts in, token ids out, with the timings the engine report needs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/model.h"

namespace flashcpp::engine {

/// The most sequences generate() runs at once (the largest CUDA graph bucket).
inline constexpr int kMaxBatch = 256;

struct GenerateOptions {
  /// One prompt per sequence (token ids). Empty with `context` > 0.
  std::vector<std::vector<std::int32_t>> prompts;
  /// > 0: no prompt; every sequence starts as if `context` tokens were cached (random K/V) and
  /// its first input token is random. Measures decode at long context without a prefill.
  int context = 0;
  int batch = 1;                 ///< sequences (prompts.size() when prompts are given)
  int max_new_tokens = 32;       ///< generated tokens per sequence (the first from the prefill)
  bool eager = false;            ///< launch op by op instead of replaying a CUDA graph
  SampleArgs sampling;
  int page_size = 16;
  int decode_splits = 0;         ///< > 0: force the decode attention's key splits (0: the planner's heuristic)
  int decode_max_splits = 0;     ///< > 0: cap the heuristic
  bool decode_fused_merge = false;  ///< merge the key splits inside the split-KV kernel (DecodePlanOptions::fused_merge)
  bool decode_fused_append = false; ///< write the new K/V inside the split-KV kernel (DecodePlanOptions::fused_append)
  int warmup_steps = 2;
  bool profile = true;           ///< CUDA: measure kernel time per step after the timed run
  bool dump_logits = false;      ///< keep seq 0's logits (prompt positions, then every step)
  /// CUDA: after the timed steps and the profile, `trace_steps` more steps (graph replays, or eager
  /// steps with `eager`) run between trace(true) and trace(false), from the same starting state as
  /// the timed run: a kernel tracer (`flashcpp decode --trace`) records exactly those steps.
  std::function<Status(bool begin)> trace;
  int trace_steps = 3;
};

struct GenerateResult {
  std::vector<std::vector<std::int32_t>> tokens;  ///< generated ids per real sequence
  int bucket = 0;               ///< padded batch of the captured graph
  int prompt_len = 0;           ///< longest prompt
  int decode_steps = 0;         ///< steps timed
  std::string mode;             ///< "graph" or "eager"
  double prefill_ms = 0, decode_ms = 0, decode_tok_s = 0, wall_us_per_step = 0;
  /// Sum over the ops of a step of each op's device time alone (a graph of repeated launches of
  /// it): the kernel time of a step with no launch gaps.
  double kernel_us_per_step = 0;
  double graph_gpu_us_per_step = 0;  ///< device time of one graph replay (kernels + gaps)
  double gemm_us = 0, attention_us = 0, norm_us = 0, other_us = 0;  ///< kernel time split per step
  std::vector<OpTiming> op_times;    ///< per op name, summed over layers
  DecodePlan plan;
  std::vector<float> logits;    ///< dump_logits: (prompt_len + max_new_tokens - 1, vocab)
};

Status generate(const LlamaModel& model, const GenerateOptions& opt, GenerateResult* out);

/// Parses "1,2 3" style id lists (spaces and/or commas); ids must be in [0, vocab) when vocab > 0.
Status parse_token_ids(const std::string& text, int vocab, std::vector<std::int32_t>* out);

}  // namespace flashcpp::engine
