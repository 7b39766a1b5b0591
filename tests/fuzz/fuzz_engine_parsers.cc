// libFuzzer target for the engine's parsers of outside files: parse_safetensors_header,
// parse_safetensors_index and parse_llama_config.
//
// The first byte picks the parser and, for headers, how the file is made:
//   sel % 4 == 0  the rest is a file prefix as-is (8-byte size, JSON, data); (sel >> 2) & 3 picks
//                 the file size: the prefix itself, the prefix plus up to 15 KB not given, half
//                 the prefix (must be refused), or 2^50 bytes;
//   sel % 4 == 3  the rest is the JSON header; the 8-byte size is made to match it and the file
//                 gets (sel >> 2) * 16 bytes of data past the header (not given);
//   sel % 4 == 1  the rest is a model.safetensors.index.json text;
//   sel % 4 == 2  the rest is a config.json text.
// The contract it checks:
//   * no crash, no UB, no read outside the input (ASan + UBSan, no recovery);
//   * a refusal is invalid_argument or unsupported and carries a sentence;
//   * what is accepted is sound, re-checked here: tensors inside the file's data region with
//     bytes = numel * dtype size, no two sharing a byte; index file names plain; config sizes
//     positive, heads dividing, head_dim even, llama_config_to_json parsing back to the same
//     config, rotary frequencies finite and non-negative.
// An accepted-but-unsound input prints itself and traps.
//
// Build and run: tests/fuzz/run_fuzz.sh.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config.h"
#include "engine/safetensors.h"

namespace {

using namespace flashcpp;
using namespace flashcpp::engine;

[[noreturn]] void fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_engine_parsers: accepted an invalid input: %s (%s)\n", what, detail.c_str());
  __builtin_trap();
}

void check_refusal(const Status& st) {
  if (st.ok()) return;
  if (st.message().empty()) fail("refusal without a sentence", "");
  if (st.code() != StatusCode::kInvalidArgument && st.code() != StatusCode::kUnsupported) {
    fail("refusal with an unexpected code", st.to_string());
  }
}

void fuzz_header(const std::uint8_t* data, std::size_t size, std::uint64_t file_size) {
  std::vector<StTensorInfo> out;
  std::map<std::string, std::string> meta;
  const Status st = parse_safetensors_header(data, size, file_size, &out, &meta);
  check_refusal(st);
  if (!st.ok()) return;
  if (size < 8 || size > file_size) fail("header accepted with a bad size", std::to_string(size));
  std::uint64_t h = 0;
  for (int i = 7; i >= 0; --i) h = (h << 8) | data[i];
  if (h > size - 8) fail("header longer than the bytes given", std::to_string(h));
  const std::uint64_t data_begin = 8 + h;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& t : out) {
    if (t.name == "__metadata__") fail("__metadata__ taken for a tensor", t.name);
    const std::size_t es = st_dtype_size(t.dtype);
    if (es == 0) fail("unknown dtype", t.name);
    const std::int64_t n = t.numel();
    if (n < 0) fail("numel overflow accepted", t.name);
    unsigned __int128 bytes = static_cast<unsigned __int128>(n) * es;
    if (bytes != t.nbytes) fail("nbytes != numel * dtype size", t.name);
    if (t.begin < data_begin || t.begin > file_size || t.nbytes > file_size - t.begin) {
      fail("tensor outside the data region", t.name);
    }
    for (auto d : t.shape) {
      if (d < 0) fail("negative dimension", t.name);
    }
    if (t.nbytes > 0) spans.emplace_back(t.begin, t.begin + t.nbytes);
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i) {
    if (spans[i - 1].second > spans[i].first) fail("overlapping tensors", std::to_string(spans[i].first));
  }
}

void fuzz_index(std::string_view text) {
  std::map<std::string, std::string> wm;
  const Status st = parse_safetensors_index(text, &wm);
  check_refusal(st);
  if (!st.ok()) return;
  for (const auto& [tensor, file] : wm) {
    if (file.empty() || file.find('/') != std::string::npos || file.find("..") != std::string::npos) {
      fail("shard name escaping the directory", file);
    }
  }
}

void fuzz_config(std::string_view text) {
  LlamaConfig c;
  const Status st = parse_llama_config(text, &c);
  check_refusal(st);
  if (!st.ok()) return;
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_hidden_layers <= 0 ||
      c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.head_dim <= 0) {
    fail("non-positive size", llama_config_to_json(c));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) fail("kv heads do not divide heads", llama_config_to_json(c));
  if (c.head_dim % 2 != 0) fail("odd head_dim", llama_config_to_json(c));
  if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta) || !(c.rms_norm_eps > 0)) fail("bad rope_theta/eps", "");
  if (c.rope_scaling.type != "none" && c.rope_scaling.type != "llama3") fail("unknown rope type", c.rope_scaling.type);
  if (c.rope_scaling.type == "llama3" &&
      (!(c.rope_scaling.factor >= 1) || !(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor) ||
       !(c.rope_scaling.low_freq_factor > 0) || c.rope_scaling.original_max_position_embeddings <= 0)) {
    fail("bad llama3 scaling", llama_config_to_json(c));
  }
  if (c.attention_bias || c.mlp_bias || c.hidden_act != "silu") fail("unbuilt feature accepted", "");

  // What the engine writes, it reads back as the same config.
  const std::string json = llama_config_to_json(c);
  LlamaConfig back;
  const Status st2 = parse_llama_config(json, &back);
  if (!st2.ok()) fail("llama_config_to_json output refused", st2.to_string() + "\n" + json);
  if (llama_config_to_json(back) != json) fail("config JSON round trip changed it", json);

  if (c.head_dim <= 4096) {
    std::vector<double> inv(static_cast<std::size_t>(c.head_dim / 2));
    rope_inv_freq(c, inv.data());
    for (double v : inv) {
      if (!(v >= 0) || !std::isfinite(v)) fail("rotary frequency not finite", json);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t sel = data[0];
  const std::uint8_t* rest = data + 1;
  const std::size_t n = size - 1;
  switch (sel % 4) {
    case 0: {
      std::uint64_t file_size = n;
      switch ((sel >> 2) & 3) {
        case 0: break;
        case 1: file_size = n + static_cast<std::uint64_t>(sel >> 4) * 1000; break;
        case 2: file_size = n / 2; break;
        case 3: file_size = 1ull << 50; break;
      }
      fuzz_header(rest, n, file_size);
      break;
    }
    case 3: {
      // An exact-size copy so ASan sees a read past the header.
      std::vector<std::uint8_t> buf(8 + n);
      for (int i = 0; i < 8; ++i) buf[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(n) >> (8 * i));
      if (n) std::memcpy(buf.data() + 8, rest, n);
      fuzz_header(buf.data(), buf.size(), buf.size() + static_cast<std::uint64_t>(sel >> 2) * 16);
      break;
    }
    case 1: fuzz_index(std::string_view(reinterpret_cast<const char*>(rest), n)); break;
    case 2: fuzz_config(std::string_view(reinterpret_cast<const char*>(rest), n)); break;
  }
  return 0;
}
