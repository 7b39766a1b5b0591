// config.json of a Hugging Face Llama-family checkpoint.
#pragma once

#include <string>
#include <string_view>

#include "flashcpp/status.h"

namespace flashcpp::engine {

struct RopeScaling {
  /// "none" (no rope_scaling or rope_type "default") or "llama3". Others are refused when parsed.
  std::string type = "none";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  std::string model_type = "llama";       ///< "llama" (also accepted: "mistral" without sliding window)
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;             ///< defaults to num_attention_heads when absent
  int head_dim = 0;                        ///< defaults to hidden_size / num_attention_heads
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;             ///< true is refused (not built)
  bool mlp_bias = false;                   ///< true is refused (not built)
  std::string hidden_act = "silu";         ///< anything else is refused
  std::string torch_dtype = "bfloat16";    ///< informational
  int bos_token_id = -1, eos_token_id = -1;  ///< -1 when absent (eos may be a list: first kept)
};

/// Parses and checks config.json text: required fields present with the right JSON types,
/// positive sizes, heads dividing, architecture supported (architectures[0] "LlamaForCausalLM"
/// when present, model_type "llama"), head_dim even. A clear sentence otherwise.
Status parse_llama_config(std::string_view json_text, LlamaConfig* out);
/// Reads `path` (a config.json file, or a directory holding one) and parses it.
Status load_llama_config(const std::string& path, LlamaConfig* out);
/// The config as config.json text (for writing tiny checkpoints in tests).
std::string llama_config_to_json(const LlamaConfig& c);

/// The rotary inverse frequencies of this config, rotary_dim/2 values (Llama-3 scaling applied),
/// as Hugging Face computes them (fp64 here; the engine rounds to fp32).
void rope_inv_freq(const LlamaConfig& c, double* inv_freq /* head_dim/2 */);

}  // namespace flashcpp::engine
