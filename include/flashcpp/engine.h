// The Llama decode engine as the CLI drives it (`flashcpp decode`): open a backend, load a
// Hugging Face checkpoint onto it, generate. The engine's internals (the Ops of each backend, the
// model and its KV session, the GEMV and sampling kernels) stay in src/engine and
// src/cuda/engine; this header is what a tool needs and nothing more. Library: flashcpp_engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flashcpp/decode.h"
#include "flashcpp/status.h"

namespace flashcpp::engine {

/// The most sequences generate() runs at once (the largest CUDA graph bucket).
inline constexpr int kMaxBatch = 256;

/// Sampling of the next token from fp32 logits. temperature 0 = greedy (argmax, lowest index on
/// ties). Otherwise p = softmax(logits / temperature); top_p < 1 keeps the tokens whose
/// probability is >= t*, the largest probability value for which the kept mass reaches top_p
/// (ties at t* are all kept); a token is drawn from the kept set in proportion to p with the
/// uniform u = sample_uniform(seed, step, row) (a counter-based hash: the same draw on every
/// backend and in every replay of a CUDA graph).
struct SampleArgs {
  float temperature = 0.f;
  float top_p = 1.f;
  std::uint64_t seed = 0;
  int row_offset = 0;  ///< the row index of logits row r in the draw is row_offset + r
};

/// Uniform in [0, 1) from (seed, step, row): splitmix64 of a mix of the three, top 24 bits. The
/// CUDA sampling kernel calls it too, so the draw is one function on every backend.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline float sample_uniform(std::uint64_t seed, std::uint32_t step, std::uint32_t row) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (1ull + step) + 0xbf58476d1ce4e5b9ull * (1ull + row);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z = z ^ (z >> 31);
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

/// Device time of one op of a decode step, in isolation (a graph of repeated launches).
struct OpTiming {
  std::string name, category;  ///< category: "gemm", "attention", "norm", "other"
  double us = 0;
};

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
  /// An fp8 e4m3 KV cache (CPU backend so far; CUDA refuses it with a sentence): K and V of every
  /// layer stored as codes of x / kv_scale (round to nearest even, saturating at +-448), the decode
  /// steps attending over code * kv_scale; the prompt's own attention reads unquantized K/V.
  bool kv_fp8 = false;
  float kv_scale = 1.f;          ///< positive, finite: every KV head's k and v scale
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
  /// Streaming: called after every generated token of the batch, first for the prefill's token
  /// (step 0), then after each decode step (step 1, 2, ...), with one id per sequence; a sequence
  /// that stopped at an earlier step (stop_ids) reads -1. Return false to end the run: every
  /// sequence keeps the tokens up to and including this step. Needs prompts (not `context`).
  /// Costs a download of the batch's ids per step (a CUDA graph replay then waits for the device).
  /// An exception it throws ends the run with Status::Internal naming it.
  std::function<bool(int step, const std::vector<std::int32_t>& tokens)> on_tokens;
  /// A sequence that produces one of these ids stops there (the id is kept as its last token);
  /// the run ends when every sequence has stopped. Needs prompts (not `context`).
  std::vector<std::int32_t> stop_ids;
};

struct GenerateResult {
  /// Generated ids per real sequence: max_new_tokens each, fewer when a stop id or on_tokens
  /// ended it early.
  std::vector<std::vector<std::int32_t>> tokens;
  int bucket = 0;               ///< padded batch of the captured graph
  int prompt_len = 0;           ///< longest prompt
  int decode_steps = 0;         ///< steps timed (fewer than max_new_tokens - 1 when stopped early)
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

/// Parses "1,2 3" style id lists (spaces and/or commas); ids must be in [0, vocab) when vocab > 0.
Status parse_token_ids(const std::string& text, int vocab, std::vector<std::int32_t>* out);

/// The loaded checkpoint's shape (config.json's names) and weight sizes.
struct ModelInfo {
  int num_hidden_layers = 0, hidden_size = 0, num_attention_heads = 0, num_key_value_heads = 0, vocab_size = 0;
  std::size_t weight_bytes = 0;       ///< every weight on the backend
  std::size_t step_weight_bytes = 0;  ///< what one batch-1 decode step reads (the embedding row aside)
};

/// A backend (CPU threads, or one CUDA device and stream) with at most one model loaded on it.
/// Opening the backend and loading the model are separate steps, so a caller can refuse flags
/// that do not apply to the backend it got before reading any weight.
class Engine {
 public:
  /// The CPU backend (fp32, host memory) with `threads` threads (0: all).
  static std::unique_ptr<Engine> cpu(int threads);
  /// The CUDA backend (bf16) on the current device; fails with a sentence when CUDA is not built
  /// in or no device is usable.
  static Status cuda(std::unique_ptr<Engine>* out);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  bool is_cuda() const;
  /// e.g. "NVIDIA H200 (132 SMs, bf16)" or "cpu (2 threads)".
  std::string describe() const;
  /// Which GEMM the CUDA backend uses: "auto" (a fused GEMV for <= 2 rows, cuBLASLt above),
  /// "cublaslt", "gemv" (<= 8 rows), "gemv-nopdl" (without programmatic dependent launch). The
  /// CPU backend accepts "auto" only.
  Status set_gemm_mode(const std::string& mode);

  /// Reads config.json and the safetensors of `dir` onto the backend (converted to its dtype).
  /// Refuses, with a sentence: a missing tensor or a wrong shape, a NaN or Inf weight, layers
  /// beyond config.json's num_hidden_layers, a second load.
  Status load(const std::string& dir);
  /// The loaded model (zeros before load()).
  ModelInfo model() const;
  /// Prefills the prompts and decodes (see GenerateOptions); needs a loaded model.
  Status generate(const GenerateOptions& opt, GenerateResult* out) const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashcpp::engine
