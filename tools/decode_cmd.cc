// `flashcpp decode`: load a Hugging Face Llama checkpoint, prefill the prompts, decode, report.
#include "decode_cmd.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <system_error>

#include "cli_checks.h"
#include "flashcpp/engine.h"
#include "harness/kernel_trace.h"

#include "flashcpp_git_commit.h"  // FLASHCPP_GIT_COMMIT, written at build time (cmake/git_commit.cmake)

namespace flashcpp::tools {

void add_decode_options(CLI::App* sub, DecodeCliOptions* o) {
  using engine::kMaxBatch;
  sub->add_option("--model", o->model, "checkpoint directory (config.json + model.safetensors[.index.json])")
      ->required()
      ->check(non_empty("a checkpoint directory"));
  sub->add_option("--prompt-ids", o->prompt_ids, "one prompt as token ids (\"1,2,3\"), used for every sequence");
  sub->add_option("--prompt-file", o->prompt_file, "one prompt per line (ids separated by spaces or commas)");
  sub->add_option("--prompt-len", o->prompt_len, "random prompt ids of this length (seeded) when no ids are given")
      ->check(at_least(1));
  sub->add_option("--batch", o->batch, "sequences (with --prompt-ids, --prompt-len or --context)")
      ->check(in_range(1, kMaxBatch))
      ->capture_default_str();
  sub->add_option("--context", o->context,
                  "start as if this many tokens were cached (random K/V, no prefill): long-context decode speed")
      ->check(at_least(1));
  sub->add_option("--max-new-tokens", o->max_new_tokens, "tokens to generate per sequence")
      ->check(at_least(1))
      ->capture_default_str();
  sub->add_flag("--eager", o->eager, "launch op by op instead of replaying a CUDA graph");
  sub->add_option("--temperature", o->temperature, "0 = greedy")->check(at_least(0.f))->capture_default_str();
  sub->add_option("--top-p", o->top_p, "nucleus sampling mass (with --temperature > 0)")
      ->check(in_range(0.f, 1.f, /*lo_open=*/true))
      ->capture_default_str();
  sub->add_option("--seed", o->seed, "sampling / random-prompt seed")
      ->check(non_negative_integer<std::uint64_t>())
      ->capture_default_str();
  sub->add_option("--page-size", o->page_size, "KV cache page size (power of two, 1..256)")
      ->check(power_of_two_upto(256))
      ->capture_default_str();
  sub->add_option("--kv-dtype", o->kv_dtype, "KV cache dtype: auto (the backend's) or fp8 (e4m3 with --kv-scale)")
      ->check(CLI::IsMember({"auto", "fp8"}))
      ->capture_default_str();
  sub->add_option("--kv-scale", o->kv_scale, "fp8 KV cache: the scale of every K and V head (value = code * scale)")
      ->check(in_range(0.f, std::numeric_limits<float>::max(), /*lo_open=*/true))
      ->capture_default_str();
  sub->add_option("--decode-splits", o->decode_splits, "force the decode attention's key splits (0: heuristic)")
      ->check(at_least(0));
  sub->add_option("--decode-max-splits", o->decode_max_splits, "cap the heuristic's key splits (0: none)")
      ->check(at_least(0));
  sub->add_flag("--decode-fused-merge", o->decode_fused_merge,
                "merge the key splits inside the split-KV kernel instead of a merge launch (CUDA)");
  sub->add_flag("--decode-fused-append", o->decode_fused_append,
                "write each step's new K/V inside the split-KV kernel instead of an append launch (CUDA)");
  sub->add_option("--dump-logits", o->dump_logits,
                  "write sequence 0's fp32 logits (prompt positions, then each step) as raw little-endian floats");
  sub->add_option("--json", o->json, "write tokens and timings here");
  sub->add_option("--backend", o->backend, "cuda, cpu or auto")
      ->check(CLI::IsMember({"cuda", "cpu", "auto"}))
      ->capture_default_str();
  sub->add_option("--gemm", o->gemm,
                  "cuda GEMMs: auto (fused GEMV for <= 2 rows, PDL on Hopper; cuBLASLt above), cublaslt, gemv (<= 8 rows), gemv-nopdl")
      ->check(CLI::IsMember({"auto", "cublaslt", "gemv", "gemv-nopdl"}))
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "CPU backend threads (0: all)")->check(in_range(0, kMaxThreads));
  sub->add_flag("--no-profile", o->no_profile, "skip the per-step kernel-time measurement");
  auto* trace = sub->add_option("--trace", o->trace,
                  "CUDA (CUPTI): run --trace-steps more steps under a kernel tracer, write their timeline here (CSV) "
                  "and print each kernel's share of the step: launch gap and busy time");
  sub->add_option("--trace-steps", o->trace_steps, "steps the --trace timeline covers")
      ->check(at_least(1))
      ->needs(trace)  // alone it would be dropped
      ->capture_default_str();
  sub->add_option("--print-tokens", o->print_tokens,
                  "generated tokens printed per sequence, for every sequence (0: none; --json holds them all)")
      ->check(at_least(0))
      ->capture_default_str();
}

namespace {

int fail(const Status& s) {
  std::cerr << "flashcpp decode: " << s.message() << "\n";
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

int usage(const std::string& sentence) {
  std::cerr << "flashcpp decode: " << sentence << "\n";
  return 2;
}

/// Which of the prompt sources were given, joined ("--prompt-ids and --context").
std::string given_sources(const DecodeCliOptions& o) {
  std::vector<std::string> g;
  if (!o.prompt_ids.empty()) g.push_back("--prompt-ids");
  if (!o.prompt_file.empty()) g.push_back("--prompt-file");
  if (o.prompt_len > 0) g.push_back("--prompt-len");
  if (o.context > 0) g.push_back("--context");
  std::string s;
  for (std::size_t i = 0; i < g.size(); ++i) s += (i ? (i + 1 == g.size() ? " and " : ", ") : "") + g[i];
  return s;
}

}  // namespace

int decode_main(const DecodeCliOptions& o) {
  using namespace flashcpp::engine;
  // Usage first, before a device is opened or a weight read (CLI11 has checked each flag's range).
  const int sources = !o.prompt_ids.empty() + !o.prompt_file.empty() + (o.prompt_len > 0) + (o.context > 0);
  if (sources == 0)
    return usage("no prompt: give token ids (--prompt-ids or --prompt-file), a random prompt length (--prompt-len) "
                 "or a simulated context length (--context)");
  if (sources > 1)
    return usage(given_sources(o) + " were given together; they are alternative prompt sources, give one of them");
  if (o.top_p < 1.f && o.temperature == 0.f) {  // greedy would drop it
    std::ostringstream p;
    p << o.top_p;
    return usage("--top-p " + p.str() +
                 " applies to sampling, but --temperature is 0 (greedy, which ignores it); give --temperature > 0");
  }
  if (!o.prompt_file.empty() && !std::ifstream(o.prompt_file))
    return usage("cannot open --prompt-file " + o.prompt_file);
  for (const auto& [flag, path] : {std::pair{"--json", &o.json}, std::pair{"--dump-logits", &o.dump_logits},
                                   std::pair{"--trace", &o.trace}})
    if (!path->empty())
      if (const std::string why = unwritable(flag, *path); !why.empty()) return usage(why);

  std::unique_ptr<Engine> eng;
  std::string cpu_why = "--backend cpu";  // why the run is on the CPU backend, for the sentences below
  if (o.backend == "cpu") {
    eng = Engine::cpu(o.threads);
  } else {
    Status s = Engine::cuda(&eng);
    if (!s.ok()) {
      if (o.backend == "cuda") return fail(s);
      cpu_why = "--backend auto fell back to it: " + s.message();
      eng = Engine::cpu(o.threads);
    }
  }
  if (!eng->is_cuda()) {
    // CUDA-only flags would be ignored on the CPU backend: refuse them rather than drop them.
    if (o.gemm != "auto")
      return usage("--gemm " + o.gemm + " selects a CUDA GEMM, but the run is on the CPU backend (" + cpu_why +
                   "), which has one GEMM; leave --gemm at auto");
    if (o.decode_fused_merge || o.decode_fused_append)
      return usage(std::string(o.decode_fused_merge ? "--decode-fused-merge" : "--decode-fused-append") +
                   " changes the CUDA split-KV kernel, but the run is on the CPU backend (" + cpu_why + ")");
    if (!o.trace.empty()) return usage("--trace needs the CUDA backend (CUPTI); the run is on the CPU (" + cpu_why + ")");
  } else if (o.threads != 0) {
    return usage("--threads sets the CPU backend's threads, but the run is on CUDA (add --backend cpu)");
  }
  if (Status s = eng->set_gemm_mode(o.gemm); !s.ok()) return fail(s);
  if (Status s = eng->load(o.model); !s.ok()) return fail(s);
  const ModelInfo c = eng->model();

  GenerateOptions g;
  g.max_new_tokens = o.max_new_tokens;
  g.eager = o.eager || !eng->is_cuda();
  g.sampling.temperature = o.temperature;
  g.sampling.top_p = o.top_p;
  g.sampling.seed = o.seed;
  g.page_size = o.page_size;
  g.kv_fp8 = o.kv_dtype == "fp8";
  g.kv_scale = o.kv_scale;
  g.decode_splits = o.decode_splits;
  g.decode_max_splits = o.decode_max_splits;
  g.decode_fused_merge = o.decode_fused_merge;
  g.decode_fused_append = o.decode_fused_append;
  g.profile = !o.no_profile;
  g.dump_logits = !o.dump_logits.empty();
  if (!o.prompt_ids.empty()) {
    std::vector<std::int32_t> ids;
    if (Status s = parse_token_ids(o.prompt_ids, c.vocab_size, &ids); !s.ok()) return fail(s);
    g.prompts.assign(o.batch, ids);
  } else if (!o.prompt_file.empty()) {
    std::ifstream f(o.prompt_file);
    if (!f) { std::cerr << "flashcpp decode: cannot open " << o.prompt_file << "\n"; return 2; }
    std::string line;
    while (std::getline(f, line)) {
      std::vector<std::int32_t> ids;
      if (Status s = parse_token_ids(line, c.vocab_size, &ids); !s.ok()) return fail(s);
      if (!ids.empty()) g.prompts.push_back(std::move(ids));
    }
    if (g.prompts.empty()) { std::cerr << "flashcpp decode: " << o.prompt_file << " holds no prompt\n"; return 2; }
    if (o.batch != 1 && o.batch != static_cast<int>(g.prompts.size()))
      return usage("--batch " + std::to_string(o.batch) + " does not match the " + std::to_string(g.prompts.size()) +
                   " prompts of " + o.prompt_file + " (one sequence per line; leave --batch out)");
  } else if (o.prompt_len > 0) {
    for (int b = 0; b < o.batch; ++b) {
      std::vector<std::int32_t> ids;
      for (int i = 0; i < o.prompt_len; ++i)
        ids.push_back(static_cast<std::int32_t>(sample_uniform(o.seed, i, b) * static_cast<float>(c.vocab_size - 1)));
      g.prompts.push_back(std::move(ids));
    }
  } else {
    g.context = o.context;
    g.batch = o.batch;
  }

  std::vector<harness::KernelRecord> trace;
  if (!o.trace.empty()) {
    g.trace_steps = o.trace_steps;
    g.trace = [&trace](bool begin) { return begin ? harness::trace_begin() : harness::trace_end(&trace); };
  }

  GenerateResult r;
  if (Status s = eng->generate(g, &r); !s.ok()) return fail(s);

  const int B = static_cast<int>(r.tokens.size());
  std::cout << "model: " << c.num_hidden_layers << " layers, hidden " << c.hidden_size << ", heads " << c.num_attention_heads
            << "/" << c.num_key_value_heads << ", vocab " << c.vocab_size << ", " << c.weight_bytes / 1e9
            << " GB on " << eng->describe() << "\n";
  std::cout << "batch " << B << " (graph bucket " << r.bucket << "), " << (g.context ? "context " : "prompt ")
            << (g.context ? g.context : r.prompt_len) << ", " << r.decode_steps << " decode steps, " << r.mode << "\n";
  std::cout << "prefill " << r.prefill_ms << " ms; decode " << r.decode_ms << " ms = " << r.wall_us_per_step
            << " us/step, " << r.decode_tok_s << " tok/s\n";
  if (r.kernel_us_per_step > 0)
    std::cout << "kernel time (sum of ops alone) " << r.kernel_us_per_step << " us/step (gemm " << r.gemm_us << ", attention "
              << r.attention_us << ", norm " << r.norm_us << ", other " << r.other_us << ")"
              << (r.graph_gpu_us_per_step > 0 ? "; graph replay " + std::to_string(r.graph_gpu_us_per_step) + " us/step" : "")
              << "\n";
  if (!r.op_times.empty()) {
    std::cout << "per op (us/step, alone):";
    for (const auto& t : r.op_times) std::cout << " " << t.name << " " << t.us;
    std::cout << "\n";
  }
  harness::TraceSummary tsum;
  if (!o.trace.empty()) {
    if (trace.empty()) {
      std::cerr << "flashcpp decode: the tracer recorded no kernel (CUPTI returned no kernel records)\n";
      return 1;
    }
    if (Status s = harness::write_trace_csv(trace, o.trace); !s.ok()) return fail(s);
    tsum = harness::summarize(trace);
    const double n = o.trace_steps;
    std::printf("trace (%s, %d steps, %zu kernels): wall %.1f us/step = busy %.1f + launch gaps %.1f\n", o.trace.c_str(),
                o.trace_steps, trace.size(), tsum.wall_us / n, tsum.busy_us / n, tsum.gap_us / n);
    std::printf("  %-44s %6s %10s %10s %10s\n", "kernel", "/step", "busy us", "gap us", "span us");
    for (const auto& k : tsum.by_name)
      std::printf("  %-44.44s %6.1f %10.1f %10.1f %10.1f\n", k.name.c_str(), k.count / n, k.busy_us / n, k.gap_us / n,
                  k.duration_us / n);
  }
  // Every sequence's tokens, each line cut at --print-tokens (the JSON holds all of them).
  if (o.print_tokens > 0)
    for (int b = 0; b < B; ++b) {
      const auto& t = r.tokens[b];
      std::cout << "seq " << b << ":";
      for (std::size_t i = 0; i < std::min<std::size_t>(t.size(), static_cast<std::size_t>(o.print_tokens)); ++i)
        std::cout << " " << t[i];
      std::cout << (t.size() > static_cast<std::size_t>(o.print_tokens)
                        ? " ... (" + std::to_string(t.size()) + " tokens; --print-tokens " + std::to_string(t.size()) +
                              " or --json for all)"
                        : std::string())
                << "\n";
    }

  if (!o.dump_logits.empty()) {
    std::ofstream f(o.dump_logits, std::ios::binary);
    f.write(reinterpret_cast<const char*>(r.logits.data()), static_cast<std::streamsize>(r.logits.size() * 4));
    f.flush();  // a full disk shows at the flush (or the close), not at the buffered write
    if (!f) { std::cerr << "flashcpp decode: cannot write " << o.dump_logits << "\n"; return 1; }
  }
  if (!o.json.empty()) {
    nlohmann::json j;
    j["tokens"] = r.tokens;
    j["batch"] = B;
    j["bucket"] = r.bucket;
    j["prompt_len"] = r.prompt_len;
    j["context"] = g.context;
    j["max_new_tokens"] = g.max_new_tokens;
    j["decode_steps"] = r.decode_steps;
    j["mode"] = r.mode;
    j["prefill_ms"] = r.prefill_ms;
    j["decode_ms"] = r.decode_ms;
    j["decode_tok_s"] = r.decode_tok_s;
    j["wall_us_per_step"] = r.wall_us_per_step;
    j["kernel_us_per_step"] = r.kernel_us_per_step;
    j["graph_gpu_us_per_step"] = r.graph_gpu_us_per_step;
    j["kernel_split_us"] = {{"gemm", r.gemm_us}, {"attention", r.attention_us}, {"norm", r.norm_us},
                            {"other", r.other_us}};
    nlohmann::json ops_j = nlohmann::json::object();
    for (const auto& t : r.op_times) ops_j[t.name] = t.us;
    j["op_us_per_step"] = ops_j;
    j["decode_plan"] = {{"num_items", r.plan.num_items}, {"max_splits", r.plan.max_splits}, {"ctas", r.plan.ctas},
                        {"ctas_per_sm", r.plan.ctas_per_sm}, {"needs_merge", r.plan.needs_merge}};
    j["page_size"] = g.page_size;
    j["kv_dtype"] = g.kv_fp8 ? "fp8_e4m3" : "auto";
    if (g.kv_fp8) j["kv_scale"] = g.kv_scale;
    j["gemm"] = o.gemm;
    j["weight_bytes"] = c.weight_bytes;
    j["step_weight_bytes"] = c.step_weight_bytes;
    j["gpu"] = eng->describe();
    j["git_commit"] = FLASHCPP_GIT_COMMIT;
    j["vocab"] = c.vocab_size;
    if (!trace.empty()) {
      const double n = o.trace_steps;
      nlohmann::json by = nlohmann::json::array();
      for (const auto& k : tsum.by_name)
        by.push_back({{"name", k.name}, {"per_step", k.count / n}, {"busy_us", k.busy_us / n}, {"gap_us", k.gap_us / n},
                      {"span_us", k.duration_us / n}});
      j["trace"] = {{"file", o.trace}, {"steps", o.trace_steps}, {"kernels", trace.size()},
                    {"wall_us_per_step", tsum.wall_us / n}, {"busy_us_per_step", tsum.busy_us / n},
                    {"gap_us_per_step", tsum.gap_us / n}, {"by_kernel", by}};
    }
    std::ofstream f(o.json);
    f << j.dump(1) << "\n";
    f.flush();  // as above: the check must see the bytes reach the file
    if (!f) { std::cerr << "flashcpp decode: cannot write " << o.json << "\n"; return 1; }
  }
  return 0;
}

}  // namespace flashcpp::tools
