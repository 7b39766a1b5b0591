// `flashcpp decode`: the Llama engine from the command line.
#pragma once

#include <cstdint>
#include <string>

namespace CLI { class App; }

namespace flashcpp::tools {

struct DecodeCliOptions {
  std::string model;
  std::string prompt_ids, prompt_file;
  int batch = 1, prompt_len = 0, context = 0, max_new_tokens = 32;
  bool eager = false;
  float temperature = 0.f, top_p = 1.f;
  std::uint64_t seed = 0;
  int page_size = 16, decode_splits = 0, decode_max_splits = 0;
  std::string kv_dtype = "auto";  ///< "auto" (the backend's dtype) or "fp8" (e4m3 codes with kv_scale)
  float kv_scale = 1.f;
  bool decode_fused_merge = false;
  bool decode_fused_append = false;
  std::string dump_logits, json, backend = "auto", gemm = "auto";
  int threads = 0;
  bool no_profile = false;
  std::string trace;     ///< CUDA + CUPTI: kernel timeline of trace_steps more steps, as CSV
  int trace_steps = 3;
  int print_tokens = 32;  ///< generated tokens printed per sequence (every sequence); 0: none
};

void add_decode_options(CLI::App* sub, DecodeCliOptions* o);
int decode_main(const DecodeCliOptions& o);

}  // namespace flashcpp::tools
