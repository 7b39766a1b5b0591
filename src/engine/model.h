// The Llama model of the engine: weights on one backend (Ops), a paged KV cache, and the two
// forward passes: a prompt prefill of one sequence and one decode step of the whole batch.
//
// Per layer (Hugging Face LlamaDecoderLayer, residual stream kept by fused_add_rms_norm):
//   y   = rms_norm(residual) * input_layernorm          (layer 0: residual = embedding)
//   qkv = y W_qkv^T                       one GEMM over the concatenated q, k, v projections
//   prefill: rotary on q, k (apply_rotary); K, V scattered into the cache; causal attention_forward
//   decode:  decode_run with the step's K, V appended and q, k rotated inside the kernel
//   y   = fused_add_rms_norm(attn W_o^T, residual) * post_attention_layernorm
//   x   = silu_and_mul(y W_gate_up^T) W_down^T          (gate and up concatenated: one GEMM)
// then y = fused_add_rms_norm(x, residual) * norm and logits = y W_lm^T in fp32.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/ops.h"
#include "flashcpp/decode.h"
#include "flashcpp/engine.h"  // OpTiming, SampleArgs
#include "flashcpp/status.h"

namespace flashcpp::engine {

/// Index of the first NaN or Inf among n values of `dt` (fp32, fp16 or bf16 bits), or -1. The
/// loader refuses a checkpoint with one (LlamaModel::load).
std::int64_t first_nonfinite(const void* data, std::size_t n, DType dt);

struct LayerWeights {
  Buffer qkv;        ///< ((heads_q + 2 heads_kv) * head_dim, hidden)
  Buffer o;          ///< (hidden, heads_q * head_dim)
  Buffer gate_up;    ///< (2 * intermediate, hidden): gate rows, then up rows
  Buffer down;       ///< (hidden, intermediate)
  Buffer in_norm;    ///< (hidden,)
  Buffer post_norm;  ///< (hidden,)
};

class LlamaModel {
 public:
  /// Reads config.json and the safetensors of `dir` onto `ops` (converted to ops->dtype()).
  /// Refuses, with a sentence: a missing tensor or a wrong shape, a NaN or Inf weight (naming
  /// the tensor and the element), and layers beyond config.json's num_hidden_layers.
  static Status load(const std::string& dir, Ops* ops, std::unique_ptr<LlamaModel>* out);
  const LlamaConfig& config() const noexcept { return cfg_; }
  Ops* ops() const noexcept { return ops_; }
  std::size_t weight_bytes() const noexcept { return weight_bytes_; }
  /// Bytes one decode step must read at batch 1 (every weight once, the embedding row aside).
  std::size_t step_weight_bytes() const noexcept;

  std::vector<LayerWeights> layers;
  Buffer embed;    ///< (vocab, hidden)
  Buffer norm;     ///< (hidden,)
  Buffer lm_head;  ///< (vocab, hidden); empty when tied to embed
  const void* lm_head_ptr() const noexcept { return lm_head.get() ? lm_head.get() : embed.get(); }

 private:
  LlamaConfig cfg_;
  Ops* ops_ = nullptr;
  std::size_t weight_bytes_ = 0;
};

/// One launch (or a few) of a decode step, named for the kernel-time breakdown.
struct StepOp {
  const char* name;
  const char* category;  ///< "gemm", "attention", "norm", "other"
  std::function<Status()> run;
  bool repeatable = true;  ///< running it twice in a row is harmless (timing in isolation)
};

struct SessionOptions {
  int batch = 1;          ///< sequences (the graph bucket: padded sequences run as dummies)
  int capacity = 0;       ///< key slots per sequence
  int page_size = 16;     ///< power of two in [1, 256]
  int max_prompt = 0;     ///< longest prefill (tokens of one sequence)
  int logits_rows = 0;    ///< prefill rows whose logits may be requested (all-position dumps)
  int max_steps = 0;      ///< history rows (one per generated token)
  /// An fp8 e4m3 KV cache (both backends): K and V stored as codes of x / kv_scale, every KV
  /// head of every layer with the scale kv_scale (positive, finite); the prompt's attention reads
  /// its own unquantized K/V, the decode steps read the cache (decode.h, "FP8 cache").
  bool kv_fp8 = false;
  float kv_scale = 1.f;
};

/// KV cache, rotary tables, scratch and per-step device state of one batch.
class Session {
 public:
  Status init(const LlamaModel* model, const SessionOptions& opt);
  const SessionOptions& options() const noexcept { return opt_; }

  /// Runs the prompt of sequence `seq` (host ids) at cache slots [start, start + n); leaves the
  /// fp32 logits of its last `rows` positions (rows <= logits_rows, or 1) in prefill_logits().
  Status prefill(int seq, const std::int32_t* host_tokens, int n, int start, int rows);
  const float* prefill_logits() const noexcept { return logits_.as<float>(); }

  /// Plans the decode attention for lengths that grow up to `host_final_lengths` (one per
  /// sequence of the batch). Run before capturing a graph of decode_step.
  Status plan(const std::vector<std::int32_t>& host_final_lengths, int num_splits = 0, int max_splits = 0,
              bool fused_merge = false, bool fused_append = false);
  /// One decode step of the batch: embeds tokens(), runs every layer with the K/V appended at
  /// slot seqlens()[b], samples into tokens() and history()[step], advances seqlens and step.
  /// Launches only (capturable). With `profile`, records ops->record_event around every op
  /// starting at slot *profile (advanced), so the caller can sum the kernel times.
  Status decode_step(const SampleArgs& sampling);
  /// The ops of decode_step in launch order.
  Status decode_ops(const SampleArgs& sampling, std::vector<StepOp>* ops);
  /// CUDA: times every op of a step alone (a CUDA graph of `reps` launches of it, replayed);
  /// the sum is the kernel time of a step without launch gaps. Changes the cache and counters.
  Status profile_decode(const SampleArgs& sampling, int reps, std::vector<OpTiming>* out);

  std::int32_t* tokens() const noexcept { return tokens_.as<std::int32_t>(); }       ///< (batch,)
  std::int32_t* seqlens() const noexcept { return seqlens_.as<std::int32_t>(); }     ///< (batch,)
  std::int32_t* step_counter() const noexcept { return step_.as<std::int32_t>(); }   ///< (1,)
  std::int32_t* history() const noexcept { return history_.as<std::int32_t>(); }     ///< (max_steps, batch)
  const float* step_logits() const noexcept { return logits_.as<float>(); }          ///< (batch, vocab)
  /// Fills every cache pool with random values (a simulated context of any length).
  Status fill_cache_random(std::uint64_t seed);
  const DecodePlan& decode_plan() const noexcept { return plan_; }

 private:
  DecodeParams layer_decode_params(int layer) const;
  /// The model's rotary over the session's cos_sin_cache: the one RotarySpec that the prompt's
  /// apply_rotary and every decode step rotate with.
  RotarySpec rope_spec() const;

  const LlamaModel* m_ = nullptr;
  Ops* ops_ = nullptr;
  SessionOptions opt_;
  int pages_per_seq_ = 0;
  std::vector<KvPool> pools_;
  std::vector<Buffer> kv_;          // 2 per layer
  Buffer kv_scales_;                // fp8 cache: k and v scales, heads_kv each (every layer shares them)
  Buffer block_table_, positions_, rope_cos_sin_;
  Buffer x_, y_, residual_, residual2_, qkv_, attn_, gate_up_, act_, logits_;
  Buffer tokens_, seqlens_, step_, history_, prompt_tokens_;
  Buffer ws_int_, ws_float_;
  DecodePlan plan_;
};

}  // namespace flashcpp::engine
