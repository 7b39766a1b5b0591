// config.json of a Llama-family checkpoint: see config.h. The text comes from outside the
// process, so every field is checked for its JSON type and range before it is converted.
#include "engine/config.h"

#include "common/fused_math.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

namespace flashcpp::engine {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::uint64_t kMaxConfigBytes = 16ull << 20;

std::string brief(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

/// Field readers: absent (or, where `null_ok`, null) leaves *v unchanged and gives ok.
class Fields {
 public:
  explicit Fields(const json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  const json* get(const char* key) const {
    const auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
  }
  bool present(const char* key) const {
    const json* j = get(key);
    return j != nullptr && !j->is_null();
  }

  Status integer(const char* key, int* v, bool required, std::int64_t min = 1) const {
    const json* j = get(key);
    if (j == nullptr || j->is_null()) {
      if (required) return Status::Invalid(fmt::format("{}: required field \"{}\" is missing", where_, key));
      return Status::Ok();
    }
    std::int64_t x = 0;
    if (j->is_number_unsigned()) {
      const std::uint64_t u = j->get<std::uint64_t>();
      x = u > static_cast<std::uint64_t>(std::numeric_limits<int>::max()) ? std::int64_t{std::numeric_limits<int>::max()} + 1
                                                                           : static_cast<std::int64_t>(u);
    } else if (j->is_number_integer()) {
      x = j->get<std::int64_t>();
    } else {
      return Status::Invalid(fmt::format("{}: \"{}\" must be an integer, not a JSON {} ({})", where_, key,
                                         j->type_name(), brief(*j)));
    }
    if (x < min || x > std::numeric_limits<int>::max()) {
      return Status::Invalid(fmt::format("{}: \"{}\" is {}; it must be between {} and {}", where_, key, brief(*j), min,
                                         std::numeric_limits<int>::max()));
    }
    *v = static_cast<int>(x);
    return Status::Ok();
  }

  Status number(const char* key, double* v, bool required = false) const {
    const json* j = get(key);
    if (j == nullptr || j->is_null()) {
      if (required) return Status::Invalid(fmt::format("{}: required field \"{}\" is missing", where_, key));
      return Status::Ok();
    }
    if (!j->is_number()) {
      return Status::Invalid(fmt::format("{}: \"{}\" must be a number, not a JSON {} ({})", where_, key,
                                         j->type_name(), brief(*j)));
    }
    const double x = j->get<double>();
    if (!std::isfinite(x) || x <= 0) {
      return Status::Invalid(fmt::format("{}: \"{}\" is {}; it must be a positive finite number", where_, key, brief(*j)));
    }
    *v = x;
    return Status::Ok();
  }

  Status boolean(const char* key, bool* v) const {
    const json* j = get(key);
    if (j == nullptr || j->is_null()) return Status::Ok();
    if (!j->is_boolean()) {
      return Status::Invalid(fmt::format("{}: \"{}\" must be true or false, not a JSON {} ({})", where_, key,
                                         j->type_name(), brief(*j)));
    }
    *v = j->get<bool>();
    return Status::Ok();
  }

  Status string(const char* key, std::string* v) const {
    const json* j = get(key);
    if (j == nullptr || j->is_null()) return Status::Ok();
    if (!j->is_string()) {
      return Status::Invalid(fmt::format("{}: \"{}\" must be a string, not a JSON {} ({})", where_, key,
                                         j->type_name(), brief(*j)));
    }
    *v = j->get<std::string>();
    return Status::Ok();
  }

  /// A token id: an integer >= 0, or a list of them (the first is kept; an empty list is none).
  Status token(const char* key, int* v) const {
    const json* j = get(key);
    if (j == nullptr || j->is_null()) return Status::Ok();
    if (j->is_array()) {
      for (const auto& e : *j) {
        if (!e.is_number_integer() || (!e.is_number_unsigned() && e.get<std::int64_t>() < 0) ||
            (e.is_number_unsigned() && e.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))) {
          return Status::Invalid(fmt::format("{}: \"{}\" must hold non-negative integer token ids; {} is not", where_,
                                             key, brief(e)));
        }
      }
      if (!j->empty()) *v = (*j)[0].get<int>();
      return Status::Ok();
    }
    return integer(key, v, false, 0);
  }

 private:
  const json& obj_;
  std::string where_;
};

Status parse_rope_scaling(const json& rs, const char* key, LlamaConfig* c) {
  const std::string where = fmt::format("config.json \"{}\"", key);
  if (!rs.is_object()) {
    return Status::Invalid(fmt::format("{} must be an object or null, not a JSON {} ({})", where, rs.type_name(),
                                       brief(rs)));
  }
  const Fields f(rs, where);
  std::string type;
  if (f.present("rope_type")) {
    FLASHCPP_RETURN_IF_ERROR(f.string("rope_type", &type));
  } else {
    FLASHCPP_RETURN_IF_ERROR(f.string("type", &type));
  }
  if (type.empty() || type == "default") {
    c->rope_scaling = RopeScaling{};
    return Status::Ok();
  }
  if (type != "llama3") {
    return Status::Unsupported(fmt::format(
        "{}: rope type '{}' is not supported (supported: none or \"default\", and \"llama3\")", where, type));
  }
  RopeScaling s;
  s.type = "llama3";
  FLASHCPP_RETURN_IF_ERROR(f.number("factor", &s.factor, true));
  FLASHCPP_RETURN_IF_ERROR(f.number("low_freq_factor", &s.low_freq_factor, true));
  FLASHCPP_RETURN_IF_ERROR(f.number("high_freq_factor", &s.high_freq_factor, true));
  FLASHCPP_RETURN_IF_ERROR(f.integer("original_max_position_embeddings", &s.original_max_position_embeddings, true));
  if (s.factor < 1.0) {
    return Status::Invalid(fmt::format("{}: llama3 \"factor\" is {}; it must be at least 1", where, s.factor));
  }
  if (!(s.high_freq_factor > s.low_freq_factor)) {
    return Status::Invalid(fmt::format("{}: llama3 \"high_freq_factor\" ({}) must be larger than \"low_freq_factor\" ({})",
                                       where, s.high_freq_factor, s.low_freq_factor));
  }
  c->rope_scaling = s;
  return Status::Ok();
}

}  // namespace

Status parse_llama_config(std::string_view json_text, LlamaConfig* out) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    return Status::Invalid(fmt::format("config.json: not valid JSON ({})", e.what()));
  }
  if (!root.is_object()) {
    return Status::Invalid(fmt::format("config.json: must be a JSON object, not a JSON {}", root.type_name()));
  }
  const Fields f(root, "config.json");
  LlamaConfig c;

  // Architecture first: a Qwen2 or Gemma config is refused for what it is, not for a field.
  std::string arch;
  if (const json* a = f.get("architectures"); a != nullptr && !a->is_null()) {
    if (!a->is_array() || (!a->empty() && !(*a)[0].is_string())) {
      return Status::Invalid(fmt::format("config.json: \"architectures\" must be a list of strings, not {}", brief(*a)));
    }
    if (!a->empty()) arch = (*a)[0].get<std::string>();
  }
  const bool has_model_type = f.present("model_type");
  FLASHCPP_RETURN_IF_ERROR(f.string("model_type", &c.model_type));
  const bool llama = c.model_type == "llama" && (arch.empty() || arch == "LlamaForCausalLM");
  const bool mistral = c.model_type == "mistral" && (arch.empty() || arch == "MistralForCausalLM");
  if (!llama && !mistral) {
    const std::string what = arch.empty()      ? fmt::format("model_type '{}'", c.model_type)
                             : has_model_type  ? fmt::format("{} (model_type '{}')", arch, c.model_type)
                                               : arch;
    return Status::Unsupported(fmt::format(
        "config.json describes {}; only Llama-family checkpoints are built (LlamaForCausalLM, model_type 'llama'; "
        "MistralForCausalLM without a sliding window)",
        what));
  }
  if (mistral && f.present("sliding_window")) {
    return Status::Unsupported(fmt::format(
        "config.json: this Mistral config uses sliding-window attention (sliding_window {}), which is not built",
        brief(*f.get("sliding_window"))));
  }

  FLASHCPP_RETURN_IF_ERROR(f.integer("vocab_size", &c.vocab_size, true));
  FLASHCPP_RETURN_IF_ERROR(f.integer("hidden_size", &c.hidden_size, true));
  FLASHCPP_RETURN_IF_ERROR(f.integer("intermediate_size", &c.intermediate_size, true));
  FLASHCPP_RETURN_IF_ERROR(f.integer("num_hidden_layers", &c.num_hidden_layers, true));
  FLASHCPP_RETURN_IF_ERROR(f.integer("num_attention_heads", &c.num_attention_heads, true));
  c.num_key_value_heads = c.num_attention_heads;
  FLASHCPP_RETURN_IF_ERROR(f.integer("num_key_value_heads", &c.num_key_value_heads, false));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Status::Invalid(fmt::format(
        "config.json: num_attention_heads {} is not a multiple of num_key_value_heads {}", c.num_attention_heads,
        c.num_key_value_heads));
  }
  if (f.present("head_dim")) {
    FLASHCPP_RETURN_IF_ERROR(f.integer("head_dim", &c.head_dim, false));
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return Status::Invalid(fmt::format(
          "config.json: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given",
          c.hidden_size, c.num_attention_heads));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) {
    return Status::Invalid(fmt::format("config.json: head_dim {} must be even (rotary embeddings pair dimensions)",
                                       c.head_dim));
  }

  FLASHCPP_RETURN_IF_ERROR(f.number("rms_norm_eps", &c.rms_norm_eps));
  if (c.rms_norm_eps > std::numeric_limits<float>::max())  // the norms run in fp32: it would be inf there
    return Status::Invalid(fmt::format("config.json: \"rms_norm_eps\" is {}; it must fit in fp32 (at most {:g})",
                                       c.rms_norm_eps, std::numeric_limits<float>::max()));
  FLASHCPP_RETURN_IF_ERROR(f.integer("max_position_embeddings", &c.max_position_embeddings, false));
  FLASHCPP_RETURN_IF_ERROR(f.boolean("tie_word_embeddings", &c.tie_word_embeddings));
  FLASHCPP_RETURN_IF_ERROR(f.boolean("attention_bias", &c.attention_bias));
  FLASHCPP_RETURN_IF_ERROR(f.boolean("mlp_bias", &c.mlp_bias));
  FLASHCPP_RETURN_IF_ERROR(f.string("hidden_act", &c.hidden_act));
  if (f.present("torch_dtype")) {
    FLASHCPP_RETURN_IF_ERROR(f.string("torch_dtype", &c.torch_dtype));
  } else {
    FLASHCPP_RETURN_IF_ERROR(f.string("dtype", &c.torch_dtype));  // newer transformers spell it "dtype"
  }
  FLASHCPP_RETURN_IF_ERROR(f.token("bos_token_id", &c.bos_token_id));
  FLASHCPP_RETURN_IF_ERROR(f.token("eos_token_id", &c.eos_token_id));
  if (c.attention_bias) return Status::Unsupported("config.json: attention_bias true is not built (Llama has none)");
  if (c.mlp_bias) return Status::Unsupported("config.json: mlp_bias true is not built (Llama has none)");
  if (c.hidden_act != "silu") {
    return Status::Unsupported(
        fmt::format("config.json: hidden_act '{}' is not built (supported: silu)", c.hidden_act));
  }

  // Rotary: rope_theta + rope_scaling, or (transformers >= 5) one rope_parameters object.
  FLASHCPP_RETURN_IF_ERROR(f.number("rope_theta", &c.rope_theta));
  if (f.present("rope_scaling")) {
    FLASHCPP_RETURN_IF_ERROR(parse_rope_scaling(*f.get("rope_scaling"), "rope_scaling", &c));
  } else if (f.present("rope_parameters")) {
    const json& rp = *f.get("rope_parameters");
    FLASHCPP_RETURN_IF_ERROR(parse_rope_scaling(rp, "rope_parameters", &c));
    FLASHCPP_RETURN_IF_ERROR(Fields(rp, "config.json \"rope_parameters\"").number("rope_theta", &c.rope_theta));
  }

  if (out) *out = std::move(c);
  return Status::Ok();
}

Status load_llama_config(const std::string& path, LlamaConfig* out) {
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "config.json").string();
  if (!fs::is_regular_file(file, ec)) return Status::Invalid(fmt::format("{}: no such file", file));
  const std::uint64_t size = fs::file_size(file, ec);
  if (ec) return Status::Invalid(fmt::format("{}: cannot read its size ({})", file, ec.message()));
  if (size > kMaxConfigBytes) {
    return Status::Invalid(fmt::format("{}: {} bytes is too large for a config.json", file, size));
  }
  std::ifstream in(file, std::ios::binary);
  std::string text(size, '\0');
  if (!in || !in.read(text.data(), static_cast<std::streamsize>(size))) {
    return Status::Invalid(fmt::format("{}: cannot read the file", file));
  }
  Status st = parse_llama_config(text, out);
  if (!st.ok()) return Status(st.code(), fmt::format("{}: {}", file, st.message()));
  return Status::Ok();
}

std::string llama_config_to_json(const LlamaConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {c.model_type == "mistral" ? "MistralForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type == "none") {
    j["rope_scaling"] = nullptr;
  } else {
    j["rope_scaling"] = {{"rope_type", c.rope_scaling.type},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_bias"] = c.attention_bias;
  j["mlp_bias"] = c.mlp_bias;
  j["hidden_act"] = c.hidden_act;
  j["torch_dtype"] = c.torch_dtype;
  j["bos_token_id"] = c.bos_token_id >= 0 ? nlohmann::ordered_json(c.bos_token_id) : nlohmann::ordered_json(nullptr);
  j["eos_token_id"] = c.eos_token_id >= 0 ? nlohmann::ordered_json(c.eos_token_id) : nlohmann::ordered_json(nullptr);
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

void rope_inv_freq(const LlamaConfig& c, double* inv_freq) {
  // The formula lives once, in the header-only fused::inv_freq that the rotary kernels and
  // flashcpp::rotary_inv_freq use (factor 0 = no Llama-3 scaling).
  const RopeScaling& s = c.rope_scaling;
  const bool llama3 = s.type == "llama3";
  for (int i = 0; i < c.head_dim / 2; ++i)
    inv_freq[i] = fused::inv_freq(i, c.head_dim, c.rope_theta, llama3 ? static_cast<float>(s.factor) : 0.f,
                                  static_cast<float>(s.low_freq_factor), static_cast<float>(s.high_freq_factor),
                                  s.original_max_position_embeddings);
}

}  // namespace flashcpp::engine
