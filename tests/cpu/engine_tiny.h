// A tiny random Llama checkpoint written on the fly, and an independent fp64 Llama computed
// from its raw weights (recomputing the whole prefix per position). Shared by the CPU and GPU
// engine tests.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model.h"
#include "engine/safetensors.h"
#include "flashcpp/half.h"

namespace flashcpp::engine::testing {

namespace fs = std::filesystem;


struct Tiny {
  int vocab = 97, hidden = 128, inter = 192, layers = 2, heads = 2, kv_heads = 1, head_dim = 64;
  double eps = 1e-5, theta = 10000.0;
  bool tied = false;
  bool llama3 = true;  // factor 8, low 1, high 4, original 16: every regime of the scaling
  std::map<std::string, std::vector<float>> w;
  std::map<std::string, std::vector<std::int64_t>> shape;
};

inline std::string config_json(const Tiny& t) {
  std::string s = "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"vocab_size\": " +
                  std::to_string(t.vocab) + ", \"hidden_size\": " + std::to_string(t.hidden) +
                  ", \"intermediate_size\": " + std::to_string(t.inter) +
                  ", \"num_hidden_layers\": " + std::to_string(t.layers) +
                  ", \"num_attention_heads\": " + std::to_string(t.heads) +
                  ", \"num_key_value_heads\": " + std::to_string(t.kv_heads) +
                  ", \"head_dim\": " + std::to_string(t.head_dim) + ", \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0, " +
                  "\"max_position_embeddings\": 4096, \"hidden_act\": \"silu\", \"tie_word_embeddings\": " +
                  (t.tied ? "true" : "false") + ", \"torch_dtype\": \"float32\"";
  if (t.llama3)
    s += ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
         "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 16}";
  return s + "}";
}

inline void add(Tiny* t, std::mt19937& rng, const std::string& name, std::vector<std::int64_t> shape, float scale, float mean = 0) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v(n);
  for (auto& x : v) x = mean + scale * nd(rng);
  t->w[name] = v;
  t->shape[name] = shape;
}

/// Writes the checkpoint; `bf16` stores the weights as BF16 (and rounds the in-memory copy to match).
inline fs::path write_tiny(Tiny* t, const std::string& tag, bool bf16, unsigned seed) {
  std::mt19937 rng(seed);
  const int Q = t->heads * t->head_dim, KV = t->kv_heads * t->head_dim;
  add(t, rng, "model.embed_tokens.weight", {t->vocab, t->hidden}, 1.0f);
  add(t, rng, "model.norm.weight", {t->hidden}, 0.1f, 1.0f);
  if (!t->tied) add(t, rng, "lm_head.weight", {t->vocab, t->hidden}, 0.1f);
  for (int l = 0; l < t->layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(t, rng, p + "self_attn.q_proj.weight", {Q, t->hidden}, 0.15f);
    add(t, rng, p + "self_attn.k_proj.weight", {KV, t->hidden}, 0.15f);
    add(t, rng, p + "self_attn.v_proj.weight", {KV, t->hidden}, 0.1f);
    add(t, rng, p + "self_attn.o_proj.weight", {t->hidden, Q}, 0.1f);
    add(t, rng, p + "mlp.gate_proj.weight", {t->inter, t->hidden}, 0.1f);
    add(t, rng, p + "mlp.up_proj.weight", {t->inter, t->hidden}, 0.1f);
    add(t, rng, p + "mlp.down_proj.weight", {t->hidden, t->inter}, 0.1f);
    add(t, rng, p + "input_layernorm.weight", {t->hidden}, 0.1f, 1.0f);
    add(t, rng, p + "post_attention_layernorm.weight", {t->hidden}, 0.1f, 1.0f);
  }
  fs::path dir = fs::temp_directory_path() / ("flashcpp_engine_" + tag + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config_json(*t);
  std::vector<StWriteTensor> ts;
  std::vector<std::vector<std::uint16_t>> bf(t->w.size());
  int i = 0;
  for (auto& [name, v] : t->w) {
    StWriteTensor w;
    w.name = name;
    w.shape = t->shape[name];
    if (bf16) {
      for (auto& x : v) {
        bf[i].push_back(float_to_bf16_bits(x));
        x = bf16_bits_to_float(bf[i].back());
      }
      w.dtype = StDType::kBF16;
      w.data = bf[i].data();
    } else {
      w.dtype = StDType::kF32;
      w.data = v.data();
    }
    ts.push_back(w);
    ++i;
  }
  Status s = write_safetensors((dir / "model.safetensors").string(), ts);
  EXPECT_TRUE(s.ok()) << s.message();
  return dir;
}

// ---- the independent fp64 model: recomputes the whole prefix for each position ----
inline std::vector<double> inv_freq_ref(const Tiny& t) {
  std::vector<double> f(t.head_dim / 2);
  for (int i = 0; i < t.head_dim / 2; ++i) {
    double v = 1.0 / std::pow(t.theta, 2.0 * i / t.head_dim);
    if (t.llama3) {
      const double factor = 8, low = 1, high = 4, orig = 16, pi = 3.14159265358979323846;
      const double wl = 2 * pi / v;
      if (wl > orig / low) v = v / factor;
      else if (wl >= orig / high) {
        const double a = (orig / wl - low) / (high - low);
        v = (1 - a) * v / factor + a * v;
      }
    }
    f[i] = v;
  }
  return f;
}

/// Logits (vocab) at every position of `tokens`.
/// quant_from >= 0: rows i >= quant_from attend over an fp8 e4m3 cache, every K and V element j <= i
/// read as code(float(x) / kv_scale) * kv_scale (the engine's --kv-dtype fp8 decode steps; rows
/// before it, the prompt, attend over the exact K/V).
inline std::vector<std::vector<double>> reference_logits(const Tiny& t, const std::vector<int>& tokens,
                                                         int quant_from = -1, float kv_scale = 1.f) {
  const int n = static_cast<int>(tokens.size()), H = t.hidden, D = t.head_dim, Hq = t.heads, Hkv = t.kv_heads;
  auto W = [&](const std::string& name) -> const std::vector<float>& { return t.w.at(name); };
  auto matvec = [](const std::vector<float>& w, int rows, int cols, const std::vector<double>& x) {
    std::vector<double> y(rows, 0.0);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) y[r] += static_cast<double>(w[static_cast<std::size_t>(r) * cols + c]) * x[c];
    return y;
  };
  auto rms = [&](const std::vector<double>& x, const std::vector<float>& g) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / x.size() + t.eps);
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * g[i];
    return y;
  };
  const auto inv = inv_freq_ref(t);
  auto rope = [&](std::vector<double>& v, int heads, int pos) {
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D / 2; ++i) {
        const double a = v[h * D + i], b = v[h * D + i + D / 2], ang = pos * inv[i];
        v[h * D + i] = a * std::cos(ang) - b * std::sin(ang);
        v[h * D + i + D / 2] = b * std::cos(ang) + a * std::sin(ang);
      }
  };
  std::vector<std::vector<double>> x(n, std::vector<double>(H));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < H; ++j) x[i][j] = W("model.embed_tokens.weight")[static_cast<std::size_t>(tokens[i]) * H + j];
  for (int l = 0; l < t.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (int i = 0; i < n; ++i) {
      const auto y = rms(x[i], W(p + "input_layernorm.weight"));
      q[i] = matvec(W(p + "self_attn.q_proj.weight"), Hq * D, H, y);
      k[i] = matvec(W(p + "self_attn.k_proj.weight"), Hkv * D, H, y);
      v[i] = matvec(W(p + "self_attn.v_proj.weight"), Hkv * D, H, y);
      rope(q[i], Hq, i);
      rope(k[i], Hkv, i);
    }
    auto quant = [&](const std::vector<double>& x) {
      std::vector<double> y(x.size());
      for (std::size_t e = 0; e < x.size(); ++e)
        y[e] = static_cast<double>(flashcpp::fp8e4m3_bits_to_float(
                   flashcpp::float_to_fp8e4m3_bits(static_cast<float>(x[e]) / kv_scale))) *
               kv_scale;
      return y;
    };
    std::vector<std::vector<double>> kq(n), vq(n);
    if (quant_from >= 0)
      for (int i = 0; i < n; ++i) kq[i] = quant(k[i]), vq[i] = quant(v[i]);
    for (int i = 0; i < n; ++i) {
      std::vector<double> att(Hq * D, 0.0);
      const bool q8 = quant_from >= 0 && i >= quant_from;
      const auto& kk = q8 ? kq : k;
      const auto& vv = q8 ? vq : v;
      for (int h = 0; h < Hq; ++h) {
        const int g = h / (Hq / Hkv);
        std::vector<double> s(i + 1);
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int e = 0; e < D; ++e) d += q[i][h * D + e] * kk[j][g * D + e];
          s[j] = d / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int j = 0; j <= i; ++j)
          for (int e = 0; e < D; ++e) att[h * D + e] += s[j] / sum * vv[j][g * D + e];
      }
      const auto o = matvec(W(p + "self_attn.o_proj.weight"), H, Hq * D, att);
      for (int j = 0; j < H; ++j) x[i][j] += o[j];
      const auto y = rms(x[i], W(p + "post_attention_layernorm.weight"));
      const auto gt = matvec(W(p + "mlp.gate_proj.weight"), t.inter, H, y);
      const auto up = matvec(W(p + "mlp.up_proj.weight"), t.inter, H, y);
      std::vector<double> a(t.inter);
      for (int j = 0; j < t.inter; ++j) a[j] = gt[j] / (1.0 + std::exp(-gt[j])) * up[j];
      const auto dn = matvec(W(p + "mlp.down_proj.weight"), H, t.inter, a);
      for (int j = 0; j < H; ++j) x[i][j] += dn[j];
    }
  }
  std::vector<std::vector<double>> logits(n);
  const auto& head = t.tied ? W("model.embed_tokens.weight") : W("lm_head.weight");
  for (int i = 0; i < n; ++i) logits[i] = matvec(head, t.vocab, H, rms(x[i], W("model.norm.weight")));
  return logits;
}

inline int argmax(const std::vector<double>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

/// A model loaded onto `ops` (the load's status is checked with EXPECT; model is null on failure).
struct Loaded {
  std::unique_ptr<Ops> ops;
  std::unique_ptr<LlamaModel> model;
};
inline Loaded load_tiny(const fs::path& dir, std::unique_ptr<Ops> ops) {
  Loaded l;
  l.ops = std::move(ops);
  if (!l.ops) return l;
  Status s = LlamaModel::load(dir.string(), l.ops.get(), &l.model);
  EXPECT_TRUE(s.ok()) << s.message();
  return l;
}

/// Logits dumped by generate() (rows x vocab) against the fp64 model's rows: the largest
/// |ours - fp64| and the largest |fp64| (the scale the tolerance is relative to). Fails the
/// test (ASSERT) on the first NaN.
struct LogitError {
  double worst = 0, scale = 0;
};
inline void logit_error(const Tiny& t, const std::vector<std::vector<double>>& ref, const std::vector<float>& logits,
                        LogitError* e) {
  ASSERT_EQ(logits.size(), ref.size() * t.vocab);
  for (std::size_t row = 0; row < ref.size(); ++row)
    for (int v = 0; v < t.vocab; ++v) {
      const double ours = logits[row * t.vocab + v];
      ASSERT_FALSE(std::isnan(ours)) << "row " << row << " vocab " << v;
      e->worst = std::max(e->worst, std::abs(ours - ref[row][v]));
      e->scale = std::max(e->scale, std::abs(ref[row][v]));
    }
}

}  // namespace flashcpp::engine::testing
