// generate(): prefill every prompt, then decode step by step (CUDA graph replays or eager
// launches), timing the decode loop and, on CUDA, the kernel time of a step.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace flashcpp::engine {
namespace {

int bucket_of(int batch) {
  int b = 1;
  while (b < batch) b *= 2;
  return b;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Downloads `rows` logits rows (fp32, row stride vocab) and refuses a NaN or Inf: greedy
/// sampling would turn NaN logits into token 0 at every step without a word. `when` says where
/// in the run ("after the prefill of sequence 0", ...); the first row is sequence `first_seq`.
Status check_logits(Ops* ops, const float* logits, int rows, int vocab, int first_seq, const std::string& when) {
  std::vector<float> host(static_cast<std::size_t>(rows) * vocab);
  FLASHCPP_RETURN_IF_ERROR(ops->download(host.data(), logits, host.size() * sizeof(float)));
  for (int r = 0; r < rows; ++r) {
    // Every logit equal: the final hidden state was zero, e.g. RMSNorm's sum of squares overflowed
    // float (finite activations past ~1e19): greedy would pick token 0 at every step.
    const float* row = host.data() + static_cast<std::size_t>(r) * vocab;
    if (vocab > 1 && std::isfinite(row[0]) && std::all_of(row, row + vocab, [&](float x) { return x == row[0]; })) {
      char v0[32];
      std::snprintf(v0, sizeof v0, "%g", static_cast<double>(row[0]));
      return Status::Internal(std::string("the logits of sequence ") + std::to_string(first_seq + r) + " " + when +
                              " are all " + v0 +
                              ": the final hidden state is constant (the activations overflowed float, so RMSNorm "
                              "scaled them to 0, or the weights are zero); the tokens would be garbage (greedy picks "
                              "token 0 at every step)");
    }
    for (int v = 0; v < vocab; ++v) {
      const float x = host[static_cast<std::size_t>(r) * vocab + v];
      if (std::isfinite(x)) continue;
      return Status::Internal(std::string("the logits of sequence ") + std::to_string(first_seq + r) + " " + when +
                              " are not finite (" + (std::isnan(x) ? "NaN" : "Inf") + " for token " +
                              std::to_string(v) +
                              "): the model's activations overflowed or the weights are not what config.json "
                              "describes; the tokens would be garbage (greedy picks token 0 for NaN logits)");
    }
  }
  return Status::Ok();
}

/// The sampling arguments (SampleArgs, flashcpp/engine.h): temperature finite and >= 0 (0 = greedy), top_p in (0, 1].
Status check_sampling(const SampleArgs& a) {
  if (!std::isfinite(a.temperature) || a.temperature < 0.f)
    return Status::Invalid("temperature " + std::to_string(a.temperature) +
                           " must be a finite number >= 0 (0 = greedy)");
  // 1/temperature must be finite: a subnormal temperature (below FLT_MIN, e.g. 1e-40) made it inf,
  // (logit - max) * inf NaN for the best token, and the sampler picked the last token forever.
  if (a.temperature > 0.f && !std::isfinite(1.f / a.temperature)) {
    char t[32];
    std::snprintf(t, sizeof t, "%.3g", static_cast<double>(a.temperature));
    return Status::Invalid(std::string("temperature ") + t +
                           " is too small to divide by (1/temperature overflows float); give 0 for greedy or "
                           "a temperature >= 1.2e-38");
  }
  if (!(a.top_p > 0.f && a.top_p <= 1.f))
    return Status::Invalid("top_p " + std::to_string(a.top_p) +
                           " must be in (0, 1] (the probability mass nucleus sampling keeps; 1 = all tokens)");
  return Status::Ok();
}

}  // namespace

Status parse_token_ids(const std::string& text, int vocab, std::vector<std::int32_t>* out) {
  out->clear();
  std::size_t i = 0;
  // Ids are separated by whitespace or by one comma: "1,,2" or a leading/trailing comma is a
  // missing id (a typo), not a separator.
  bool after_comma = true;  // the start counts as a comma: a leading comma is an empty id
  while (i < text.size()) {
    const char ch = text[i];
    if (ch == ',') {
      if (after_comma)
        return Status::Invalid("token ids: an empty id at character " + std::to_string(i + 1) + " of '" + text +
                               "' (ids are separated by one comma or by spaces)");
      after_comma = true;
      ++i;
      continue;
    }
    if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') { ++i; continue; }
    after_comma = false;
    if (ch < '0' || ch > '9') return Status::Invalid(std::string("token ids must be non-negative integers; found '") + ch + "'");
    long long v = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      v = v * 10 + (text[i] - '0');
      if (v > INT32_MAX) return Status::Invalid("token id too large");
      ++i;
    }
    if (vocab > 0 && v >= vocab)
      return Status::Invalid("token id " + std::to_string(v) + " is outside the vocabulary (size " +
                             std::to_string(vocab) + ")");
    out->push_back(static_cast<std::int32_t>(v));
  }
  if (after_comma && !out->empty())
    return Status::Invalid("token ids: '" + text + "' ends with a comma (an empty id)");
  return Status::Ok();
}

Status generate(const LlamaModel& model, const GenerateOptions& opt, GenerateResult* out) {
  Ops* ops = model.ops();
  const LlamaConfig& c = model.config();
  *out = GenerateResult{};
  const bool ctx_mode = opt.context > 0;
  if (ctx_mode && !opt.prompts.empty()) return Status::Invalid("--context and a prompt exclude each other");
  if (!ctx_mode && opt.prompts.empty()) return Status::Invalid("no prompt: give token ids or a context length");
  const int B = ctx_mode ? opt.batch : static_cast<int>(opt.prompts.size());
  if (B < 1 || B > kMaxBatch)
    return Status::Invalid("batch " + std::to_string(B) + " is out of range [1, " + std::to_string(kMaxBatch) + "]");
  if (opt.max_new_tokens < 1) return Status::Invalid("max_new_tokens must be >= 1");
  FLASHCPP_RETURN_IF_ERROR(check_sampling(opt.sampling));
  if (opt.eager == false && !ops->cuda()) return Status::Unsupported("CUDA graphs need the CUDA backend (use --eager)");
  if (opt.dump_logits && ctx_mode) return Status::Invalid("logits dumps need a prompt (not --context)");
  const bool streaming = static_cast<bool>(opt.on_tokens) || !opt.stop_ids.empty();
  if (streaming && ctx_mode)
    return Status::Invalid("on_tokens and stop_ids need prompts (a --context run has no real tokens to stream)");
  for (std::int32_t t : opt.stop_ids)
    if (t < 0 || t >= c.vocab_size)
      return Status::Invalid("stop id " + std::to_string(t) + " is outside the vocabulary (size " +
                             std::to_string(c.vocab_size) + ")");
  int prompt_len = 0;
  for (const auto& p : opt.prompts) {
    if (p.empty()) return Status::Invalid("an empty prompt: every sequence needs at least one token");
    for (int t : p)
      if (t < 0 || t >= c.vocab_size) return Status::Invalid("token id " + std::to_string(t) + " is outside the vocabulary");
    prompt_len = std::max(prompt_len, static_cast<int>(p.size()));
  }
  const int steps = ctx_mode ? opt.max_new_tokens : opt.max_new_tokens - 1;  // decode steps after the prefill
  const int margin = opt.warmup_steps + 8;
  const int start_len = ctx_mode ? opt.context : prompt_len;
  const std::int64_t cap64 = static_cast<std::int64_t>(start_len) + steps + margin + 1;
  if (cap64 > c.max_position_embeddings && cap64 > 1 << 20)
    return Status::Invalid(std::string(ctx_mode ? "a context of " : "a prompt of ") + std::to_string(start_len) +
                           (ctx_mode ? " positions" : " tokens") + " + " + std::to_string(steps) + " decode steps + " +
                           std::to_string(margin + 1) + " spare positions = " + std::to_string(cap64) +
                           " positions exceed both config.json's max_position_embeddings " +
                           std::to_string(c.max_position_embeddings) + " and the engine's cap of 1048576 (2^20)");
  const int bucket = bucket_of(B);
  SessionOptions so;
  so.batch = bucket;
  so.capacity = static_cast<int>(cap64);
  so.page_size = opt.page_size;
  so.kv_fp8 = opt.kv_fp8;
  so.kv_scale = opt.kv_scale;
  so.max_prompt = std::max(prompt_len, 1);
  so.logits_rows = opt.dump_logits ? prompt_len : 1;
  so.max_steps = opt.max_new_tokens + margin + 1;
  if (opt.dump_logits && static_cast<double>(prompt_len) * c.vocab_size * 4 > 4e9)
    return Status::Invalid("the prompt's logits dump would exceed 4 GB; use a shorter prompt");
  Session s;
  FLASHCPP_RETURN_IF_ERROR(s.init(&model, so));
  out->bucket = bucket;
  out->prompt_len = prompt_len;
  out->mode = opt.eager ? "eager" : "graph";
  const std::int64_t V = c.vocab_size;

  // ---- prefill (or a simulated context) ----
  std::vector<std::int32_t> lens(bucket, 0), toks(bucket, 0);
  const double t0 = now_ms();
  if (ctx_mode) {
    FLASHCPP_RETURN_IF_ERROR(s.fill_cache_random(opt.sampling.seed + 17));
    for (int b = 0; b < bucket; ++b) {
      lens[b] = b < B ? opt.context : 0;
      toks[b] = static_cast<std::int32_t>(sample_uniform(opt.sampling.seed, 0xffffu, b) * static_cast<float>(V - 1));
    }
    FLASHCPP_RETURN_IF_ERROR(ops->upload(s.tokens(), toks.data(), toks.size() * 4));
  } else {
    for (int b = 0; b < B; ++b) {
      const int n = static_cast<int>(opt.prompts[b].size());
      const int rows = (opt.dump_logits && b == 0) ? n : 1;
      FLASHCPP_RETURN_IF_ERROR(s.prefill(b, opt.prompts[b].data(), n, 0, rows));
      if (opt.dump_logits && b == 0) {
        out->logits.resize(static_cast<std::size_t>(n) * V);
        FLASHCPP_RETURN_IF_ERROR(ops->download(out->logits.data(), s.prefill_logits(), out->logits.size() * 4));
      }
      // Sequence 0's logits are checked at once, so a model that yields NaN fails before the
      // rest of the prefill and the decode (one row; the other sequences at the first step).
      if (b == 0)
        FLASHCPP_RETURN_IF_ERROR(check_logits(ops, s.prefill_logits() + static_cast<std::int64_t>(rows - 1) * V, 1,
                                              c.vocab_size, 0, "after its prefill"));
      SampleArgs sa = opt.sampling;
      sa.row_offset = b;
      FLASHCPP_RETURN_IF_ERROR(ops->sample(s.prefill_logits() + static_cast<std::int64_t>(rows - 1) * V, 1,
                                           c.vocab_size, sa, s.tokens() + b, nullptr, s.step_counter()));
      lens[b] = n;
    }
  }
  FLASHCPP_RETURN_IF_ERROR(ops->upload(s.seqlens(), lens.data(), lens.size() * 4));
  FLASHCPP_RETURN_IF_ERROR(ops->copy(s.history(), s.tokens(), static_cast<std::size_t>(bucket) * 4));
  const std::int32_t one = 1;
  FLASHCPP_RETURN_IF_ERROR(ops->upload(s.step_counter(), &one, 4));
  FLASHCPP_RETURN_IF_ERROR(ops->sync());
  out->prefill_ms = ctx_mode ? 0.0 : now_ms() - t0;

  // ---- streaming and stops: the batch's ids after every token (GenerateOptions::on_tokens) ----
  // kept[b]: the tokens sequence b keeps; all_stopped: no decode step is needed any more.
  std::vector<int> kept(B, opt.max_new_tokens);
  std::vector<char> stopped(B, 0);
  std::vector<std::int32_t> step_toks(B);
  bool all_stopped = false;
  auto observe = [&](int step) -> Status {  // step: the index of the token just generated
    FLASHCPP_RETURN_IF_ERROR(ops->download(step_toks.data(), s.tokens(), static_cast<std::size_t>(B) * 4));
    for (int b = 0; b < B; ++b)
      if (stopped[b]) step_toks[b] = -1;
    bool go_on = true;
    if (opt.on_tokens) {
      try {
        go_on = opt.on_tokens(step, step_toks);
      } catch (const std::exception& e) {
        return Status::Internal(std::string("on_tokens threw at step ") + std::to_string(step) + ": " + e.what());
      } catch (...) {
        return Status::Internal("on_tokens threw at step " + std::to_string(step));
      }
    }
    int live = 0;
    for (int b = 0; b < B; ++b) {
      if (stopped[b]) continue;
      if (!go_on || std::find(opt.stop_ids.begin(), opt.stop_ids.end(), step_toks[b]) != opt.stop_ids.end()) {
        stopped[b] = 1;
        kept[b] = step + 1;
      } else {
        ++live;
      }
    }
    all_stopped = live == 0;
    return Status::Ok();
  };
  if (streaming) FLASHCPP_RETURN_IF_ERROR(observe(0));

  // ---- plan for the lengths this run reaches, then warm up (and capture) ----
  std::vector<std::int32_t> final_lens(lens);
  for (auto& v : final_lens) v += steps + margin;
  FLASHCPP_RETURN_IF_ERROR(s.plan(final_lens, opt.decode_splits, opt.decode_max_splits, opt.decode_fused_merge,
                                   opt.decode_fused_append));
  out->plan = s.decode_plan();
  std::vector<std::int32_t> tok_save(bucket);
  FLASHCPP_RETURN_IF_ERROR(ops->download(tok_save.data(), s.tokens(), tok_save.size() * 4));
  auto restore = [&]() -> Status {
    FLASHCPP_RETURN_IF_ERROR(ops->upload(s.seqlens(), lens.data(), lens.size() * 4));
    FLASHCPP_RETURN_IF_ERROR(ops->upload(s.tokens(), tok_save.data(), tok_save.size() * 4));
    return ops->upload(s.step_counter(), &one, 4);
  };
  const int graph_id = bucket;
  if (steps > 0 && !all_stopped) {
    for (int w = 0; w < opt.warmup_steps; ++w) {
      FLASHCPP_RETURN_IF_ERROR(s.decode_step(opt.sampling));
      if (w == 0)  // every real sequence, before anything is timed
        FLASHCPP_RETURN_IF_ERROR(check_logits(ops, s.step_logits(), B, c.vocab_size, 0, "at the first decode step"));
    }
    if (!opt.eager) {
      FLASHCPP_RETURN_IF_ERROR(ops->begin_capture());
      Status st = s.decode_step(opt.sampling);
      Status st2 = ops->end_capture(graph_id);
      FLASHCPP_RETURN_IF_ERROR(st);
      FLASHCPP_RETURN_IF_ERROR(st2);
      for (int w = 0; w < opt.warmup_steps; ++w) FLASHCPP_RETURN_IF_ERROR(ops->replay(graph_id));
    }
    FLASHCPP_RETURN_IF_ERROR(ops->sync());
    FLASHCPP_RETURN_IF_ERROR(restore());
    FLASHCPP_RETURN_IF_ERROR(ops->sync());
  }

  // ---- the timed decode loop ----
  const double t1 = now_ms();
  int done = 0;  // decode steps run
  for (int i = 0; i < steps && !all_stopped; ++i, ++done) {
    if (opt.eager) {
      FLASHCPP_RETURN_IF_ERROR(s.decode_step(opt.sampling));
    } else {
      FLASHCPP_RETURN_IF_ERROR(ops->replay(graph_id));
    }
    if (opt.dump_logits) {
      const std::size_t at = out->logits.size();
      out->logits.resize(at + V);
      FLASHCPP_RETURN_IF_ERROR(ops->download(out->logits.data() + at, s.step_logits(), V * 4));
    }
    if (streaming) FLASHCPP_RETURN_IF_ERROR(observe(i + 1));
  }
  FLASHCPP_RETURN_IF_ERROR(ops->sync());
  out->decode_ms = now_ms() - t1;
  out->decode_steps = done;
  // The last step's logits (after the timing): activations that overflow late in a run.
  if (done > 0)
    FLASHCPP_RETURN_IF_ERROR(check_logits(ops, s.step_logits(), B, c.vocab_size, 0, "at the last decode step"));
  if (done > 0) {
    out->wall_us_per_step = 1e3 * out->decode_ms / done;
    out->decode_tok_s = 1e3 * B * done / out->decode_ms;
  }
  std::vector<std::int32_t> hist(static_cast<std::size_t>(opt.max_new_tokens) * bucket);
  FLASHCPP_RETURN_IF_ERROR(ops->download(hist.data(), s.history(), hist.size() * 4));
  out->tokens.assign(B, {});
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < std::min(kept[b], done + 1 + (ctx_mode ? 1 : 0)) && t < opt.max_new_tokens; ++t)
      out->tokens[b].push_back(hist[static_cast<std::size_t>(t) * bucket + b]);

  // ---- kernel time of a step: every op alone; and the device time of a graph replay ----
  // (Both need the warmed-up state, and a graph captured, that a run stopped at its first token skipped.)
  if (ops->cuda() && opt.profile && steps > 0 && done > 0) {
    std::vector<OpTiming> t;
    FLASHCPP_RETURN_IF_ERROR(s.profile_decode(opt.sampling, 10, &t));
    for (const auto& o : t) {
      out->kernel_us_per_step += o.us;
      (o.category == std::string("gemm")        ? out->gemm_us
       : o.category == std::string("attention") ? out->attention_us
       : o.category == std::string("norm")      ? out->norm_us
                                                : out->other_us) += o.us;
      auto it = std::find_if(out->op_times.begin(), out->op_times.end(), [&](const OpTiming& x) { return x.name == o.name; });
      if (it == out->op_times.end()) out->op_times.push_back(o); else it->us += o.us;
    }
    if (!opt.eager) {
      FLASHCPP_RETURN_IF_ERROR(restore());
      FLASHCPP_RETURN_IF_ERROR(ops->spin(2000));
      FLASHCPP_RETURN_IF_ERROR(ops->record_event(0));
      constexpr int kReplays = 5;
      for (int i = 0; i < kReplays; ++i) FLASHCPP_RETURN_IF_ERROR(ops->replay(graph_id));
      FLASHCPP_RETURN_IF_ERROR(ops->record_event(1));
      FLASHCPP_RETURN_IF_ERROR(ops->sync());
      out->graph_gpu_us_per_step = 1e3 * ops->event_ms(0, 1) / kReplays;
    }
  }

  // ---- traced steps (a kernel timeline of the real step, launch gaps included) ----
  if (ops->cuda() && opt.trace && steps > 0 && done > 0) {
    if (opt.trace_steps < 1 || opt.trace_steps > steps + margin)
      return Status::Invalid("trace_steps " + std::to_string(opt.trace_steps) + " must be in [1, " +
                             std::to_string(steps + margin) + "] (the lengths the plan covers)");
    FLASHCPP_RETURN_IF_ERROR(restore());
    FLASHCPP_RETURN_IF_ERROR(ops->sync());
    FLASHCPP_RETURN_IF_ERROR(opt.trace(true));
    Status st;
    for (int i = 0; i < opt.trace_steps && st.ok(); ++i) st = opt.eager ? s.decode_step(opt.sampling) : ops->replay(graph_id);
    Status st2 = ops->sync();
    Status st3 = opt.trace(false);
    FLASHCPP_RETURN_IF_ERROR(st);
    FLASHCPP_RETURN_IF_ERROR(st2);
    FLASHCPP_RETURN_IF_ERROR(st3);
  }
  return Status::Ok();
}

}  // namespace flashcpp::engine
