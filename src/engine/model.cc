// Llama weights, the KV-cache session and the forward passes (see model.h).
#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "engine/safetensors.h"
#include "flashcpp/attention.h"
#include "flashcpp/fused.h"
#include "flashcpp/half.h"

namespace flashcpp::engine {
namespace {

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

namespace {

/// The exponent and mantissa masks of a dtype's bits (fp32, fp16, bf16): non-finite when the
/// exponent bits are all set, NaN when the mantissa is also non-zero.
struct FloatBits {
  std::uint32_t exp, man;
};
FloatBits float_bits(DType dt) {
  if (dt == DType::kF32) return {0x7f800000u, 0x007fffffu};
  if (dt == DType::kF16) return {0x7c00u, 0x03ffu};
  return {0x7f80u, 0x007fu};
}

std::uint32_t bits_at(const unsigned char* data, std::size_t i, DType dt) {
  if (dt == DType::kF32) return reinterpret_cast<const std::uint32_t*>(data)[i];
  return reinterpret_cast<const std::uint16_t*>(data)[i];
}

/// Whether the non-finite element i of `data` is a NaN (else an Inf).
bool is_nan_at(const unsigned char* data, std::int64_t i, DType dt) {
  return (bits_at(data, static_cast<std::size_t>(i), dt) & float_bits(dt).man) != 0;
}

template <class Bits>
bool any_nonfinite(const Bits* x, std::size_t b, std::size_t e, Bits exp) {
  bool bad = false;
  for (std::size_t i = b; i < e; ++i) bad |= (x[i] & exp) == exp;  // no branch: vectorizes
  return bad;
}

}  // namespace

std::int64_t first_nonfinite(const void* bytes, std::size_t n, DType dt) {
  const auto* data = static_cast<const unsigned char*>(bytes);
  const FloatBits fb = float_bits(dt);
  constexpr std::size_t kBlock = 4096;
  for (std::size_t b = 0; b < n; b += kBlock) {
    const std::size_t e = std::min(n, b + kBlock);
    const bool bad = dt == DType::kF32
                         ? any_nonfinite(reinterpret_cast<const std::uint32_t*>(data), b, e, fb.exp)
                         : any_nonfinite(reinterpret_cast<const std::uint16_t*>(data), b, e,
                                         static_cast<std::uint16_t>(fb.exp));
    if (!bad) continue;
    for (std::size_t i = b; i < e; ++i)
      if ((bits_at(data, i, dt) & fb.exp) == fb.exp) return static_cast<std::int64_t>(i);
  }
  return -1;
}

namespace {

/// Reads tensor `name` of shape `shape` (converted to ops->dtype()) into dst + byte offset.
/// A NaN or Inf weight is refused with its tensor and position: the engine would otherwise
/// turn every logit into NaN and decode token 0 forever.
Status load_tensor(const SafetensorsArchive& a, const std::string& name, const std::vector<std::int64_t>& shape,
                   Ops* ops, void* dst, std::size_t offset_bytes, std::vector<unsigned char>* staging) {
  const StTensorInfo* t = a.find(name);
  if (!t) return Status::Invalid("the checkpoint has no tensor '" + name + "' (a Llama checkpoint needs it)");
  if (t->shape != shape)
    return Status::Invalid("tensor '" + name + "' has shape " + shape_str(t->shape) + " but config.json implies " +
                           shape_str(shape));
  const std::size_t n = static_cast<std::size_t>(t->numel());
  const std::size_t es = dtype_size(ops->dtype());
  staging->resize(n * es);
  if (ops->dtype() == DType::kF32) {
    FLASHCPP_RETURN_IF_ERROR(a.read_f32(*t, reinterpret_cast<float*>(staging->data()), n));
  } else {
    FLASHCPP_RETURN_IF_ERROR(a.read_bf16(*t, reinterpret_cast<std::uint16_t*>(staging->data()), n));
  }
  if (const std::int64_t bad = first_nonfinite(staging->data(), n, ops->dtype()); bad >= 0) {
    std::string where = "element " + std::to_string(bad);
    if (shape.size() == 2)
      where += " (row " + std::to_string(bad / shape[1]) + ", column " + std::to_string(bad % shape[1]) + ")";
    return Status::Invalid("tensor '" + name + "' of the checkpoint holds " +
                           (is_nan_at(staging->data(), bad, ops->dtype()) ? "a NaN" : "an Inf") + " at " + where +
                           " (read as " + dtype_name(ops->dtype()) +
                           "): the weights are damaged; a model with a non-finite weight decodes nothing but NaN");
  }
  return ops->upload(static_cast<unsigned char*>(dst) + offset_bytes, staging->data(), n * es);
}

std::int64_t i64(int v) { return static_cast<std::int64_t>(v); }

/// config.json's num_hidden_layers must be the checkpoint's layer count: fewer would run a
/// truncated model without a word (a missing layer is caught as a missing tensor on load).
Status check_layer_count(const SafetensorsArchive& a, int layers) {
  const std::string prefix = "model.layers.";
  long long top = -1;
  for (const std::string& name : a.names()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    std::size_t i = prefix.size();
    long long l = 0;
    bool digits = false;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && l < (1ll << 40); ++i, digits = true)
      l = l * 10 + (name[i] - '0');
    if (digits && i < name.size() && name[i] == '.') top = std::max(top, l);
  }
  if (top >= layers)
    return Status::Invalid("the checkpoint holds layers up to model.layers." + std::to_string(top) + " (" +
                           std::to_string(top + 1) + " layers) but config.json says num_hidden_layers " +
                           std::to_string(layers) +
                           ": the config does not describe these weights (running the first " + std::to_string(layers) +
                           " layers alone would produce a different model's tokens)");
  return Status::Ok();
}

}  // namespace

Status LlamaModel::load(const std::string& dir, Ops* ops, std::unique_ptr<LlamaModel>* out) {
  auto m = std::make_unique<LlamaModel>();
  m->ops_ = ops;
  FLASHCPP_RETURN_IF_ERROR(load_llama_config(dir, &m->cfg_));
  const LlamaConfig& c = m->cfg_;
  if (!is_supported_head_dim(c.head_dim))
    return Status::Unsupported("config.json: head_dim " + std::to_string(c.head_dim) +
                               " is not supported (attention takes a multiple of 8 in [8, 256])");
  std::unique_ptr<SafetensorsArchive> a;
  FLASHCPP_RETURN_IF_ERROR(SafetensorsArchive::open(dir, &a));
  FLASHCPP_RETURN_IF_ERROR(check_layer_count(*a, c.num_hidden_layers));
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const std::int64_t Q = i64(c.num_attention_heads) * D, KV = i64(c.num_key_value_heads) * D;
  const std::size_t es = dtype_size(ops->dtype());
  std::vector<unsigned char> st;
  auto alloc = [&](Buffer* b, std::int64_t elems) {
    m->weight_bytes_ += static_cast<std::size_t>(elems) * es;
    return b->allocate(ops, static_cast<std::size_t>(elems) * es);
  };
  FLASHCPP_RETURN_IF_ERROR(alloc(&m->embed, V * H));
  FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, "model.embed_tokens.weight", {V, H}, ops, m->embed.get(), 0, &st));
  FLASHCPP_RETURN_IF_ERROR(alloc(&m->norm, H));
  FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, "model.norm.weight", {H}, ops, m->norm.get(), 0, &st));
  if (!c.tie_word_embeddings) {
    FLASHCPP_RETURN_IF_ERROR(alloc(&m->lm_head, V * H));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, "lm_head.weight", {V, H}, ops, m->lm_head.get(), 0, &st));
  }
  m->layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& w = m->layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    FLASHCPP_RETURN_IF_ERROR(alloc(&w.qkv, (Q + 2 * KV) * H));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "self_attn.q_proj.weight", {Q, H}, ops, w.qkv.get(), 0, &st));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "self_attn.k_proj.weight", {KV, H}, ops, w.qkv.get(), Q * H * es, &st));
    FLASHCPP_RETURN_IF_ERROR(
        load_tensor(*a, p + "self_attn.v_proj.weight", {KV, H}, ops, w.qkv.get(), (Q + KV) * H * es, &st));
    FLASHCPP_RETURN_IF_ERROR(alloc(&w.o, H * Q));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "self_attn.o_proj.weight", {H, Q}, ops, w.o.get(), 0, &st));
    FLASHCPP_RETURN_IF_ERROR(alloc(&w.gate_up, 2 * I * H));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "mlp.gate_proj.weight", {I, H}, ops, w.gate_up.get(), 0, &st));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "mlp.up_proj.weight", {I, H}, ops, w.gate_up.get(), I * H * es, &st));
    FLASHCPP_RETURN_IF_ERROR(alloc(&w.down, H * I));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "mlp.down_proj.weight", {H, I}, ops, w.down.get(), 0, &st));
    FLASHCPP_RETURN_IF_ERROR(alloc(&w.in_norm, H));
    FLASHCPP_RETURN_IF_ERROR(load_tensor(*a, p + "input_layernorm.weight", {H}, ops, w.in_norm.get(), 0, &st));
    FLASHCPP_RETURN_IF_ERROR(alloc(&w.post_norm, H));
    FLASHCPP_RETURN_IF_ERROR(
        load_tensor(*a, p + "post_attention_layernorm.weight", {H}, ops, w.post_norm.get(), 0, &st));
  }
  *out = std::move(m);
  return Status::Ok();
}

std::size_t LlamaModel::step_weight_bytes() const noexcept {
  const std::size_t es = dtype_size(ops_->dtype());
  return weight_bytes_ - (lm_head.get() ? static_cast<std::size_t>(cfg_.vocab_size) * cfg_.hidden_size * es : 0) +
         static_cast<std::size_t>(cfg_.hidden_size) * es;  // untied: the embedding table is not read whole
}

// ---- session --------------------------------------------------------------------------------

Status Session::init(const LlamaModel* model, const SessionOptions& opt) {
  m_ = model;
  ops_ = model->ops();
  opt_ = opt;
  const LlamaConfig& c = m_->config();
  if (opt.batch < 1) return Status::Invalid("batch must be >= 1");
  if (opt.capacity < 1) return Status::Invalid("the KV cache needs at least one slot per sequence");
  if (opt.page_size < 1 || opt.page_size > kDecodeMaxPageSize || (opt.page_size & (opt.page_size - 1)))
    return Status::Invalid("page size " + std::to_string(opt.page_size) + " is not a power of two in [1, 256]");
  if (opt.kv_fp8 && !(std::isfinite(opt.kv_scale) && opt.kv_scale > 0.f)) {
    char v[32];
    std::snprintf(v, sizeof v, "%g", static_cast<double>(opt.kv_scale));
    return Status::Invalid(std::string("the fp8 KV cache's scale ") + v + " must be positive and finite");
  }
  const std::size_t es = dtype_size(ops_->dtype());
  const DType kv_dt = opt.kv_fp8 ? DType::kF8E4M3 : ops_->dtype();
  const int D = c.head_dim, Hkv = c.num_key_value_heads, Hq = c.num_attention_heads;
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const std::int64_t QKV = i64(Hq + 2 * Hkv) * D;
  pages_per_seq_ = (opt.capacity + opt.page_size - 1) / opt.page_size;
  const std::int64_t num_pages = i64(opt.batch) * pages_per_seq_;
  if (num_pages > INT32_MAX) return Status::Invalid("the KV cache has more than 2^31 pages");
  const std::size_t pool_bytes = static_cast<std::size_t>(num_pages) * opt.page_size * Hkv * D * dtype_size(kv_dt);
  kv_.clear();
  pools_.clear();
  kv_.resize(2 * c.num_hidden_layers);
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  if (opt.kv_fp8) {
    const std::vector<float> scales(static_cast<std::size_t>(2 * Hkv), opt.kv_scale);
    FLASHCPP_RETURN_IF_ERROR(kv_scales_.allocate(ops_, scales.size() * 4));
    FLASHCPP_RETURN_IF_ERROR(ops_->upload(kv_scales_.get(), scales.data(), scales.size() * 4));
    k_scale = kv_scales_.as<float>();
    v_scale = k_scale + Hkv;
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    FLASHCPP_RETURN_IF_ERROR(kv_[2 * l].allocate(ops_, pool_bytes));
    FLASHCPP_RETURN_IF_ERROR(kv_[2 * l + 1].allocate(ops_, pool_bytes));
    pools_.push_back(KvPool{kv_[2 * l].get(), kv_[2 * l + 1].get(), static_cast<int>(num_pages), opt.page_size,
                            Hkv, D, kv_dt, k_scale, v_scale});
  }
  std::vector<std::int32_t> host(static_cast<std::size_t>(num_pages));
  std::iota(host.begin(), host.end(), 0);
  FLASHCPP_RETURN_IF_ERROR(block_table_.allocate(ops_, host.size() * 4));
  FLASHCPP_RETURN_IF_ERROR(ops_->upload(block_table_.get(), host.data(), host.size() * 4));
  host.resize(opt.capacity);
  std::iota(host.begin(), host.end(), 0);
  FLASHCPP_RETURN_IF_ERROR(positions_.allocate(ops_, host.size() * 4));
  FLASHCPP_RETURN_IF_ERROR(ops_->upload(positions_.get(), host.data(), host.size() * 4));

  // Rotary table, one cos_sin_cache (rows [cos | sin]) that prefill and decode both read
  // (rope_spec): angle = pos * inv_freq in fp64, rounded to fp32 after cos/sin.
  std::vector<double> inv(D / 2);
  rope_inv_freq(c, inv.data());
  std::vector<float> cs(static_cast<std::size_t>(opt.capacity) * D);
  for (int p = 0; p < opt.capacity; ++p)
    for (int i = 0; i < D / 2; ++i) {
      const double ang = static_cast<double>(p) * inv[i];
      const std::size_t r = static_cast<std::size_t>(p);
      cs[r * D + i] = static_cast<float>(std::cos(ang));
      cs[r * D + D / 2 + i] = static_cast<float>(std::sin(ang));
    }
  FLASHCPP_RETURN_IF_ERROR(rope_cos_sin_.allocate(ops_, cs.size() * 4));
  FLASHCPP_RETURN_IF_ERROR(ops_->upload(rope_cos_sin_.get(), cs.data(), cs.size() * 4));

  const std::int64_t M = std::max(opt.max_prompt, opt.batch);
  auto scratch = [&](Buffer* b, std::int64_t elems, std::size_t esz) {
    return b->allocate(ops_, static_cast<std::size_t>(std::max<std::int64_t>(elems, 1)) * esz);
  };
  FLASHCPP_RETURN_IF_ERROR(scratch(&x_, M * H, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&y_, M * H, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&residual_, M * H, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&residual2_, M * H, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&qkv_, M * QKV, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&attn_, M * Hq * D, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&gate_up_, M * 2 * I, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&act_, M * I, es));
  FLASHCPP_RETURN_IF_ERROR(scratch(&logits_, std::max({opt.logits_rows, opt.batch, 1}) * V, 4));
  FLASHCPP_RETURN_IF_ERROR(scratch(&tokens_, opt.batch, 4));
  FLASHCPP_RETURN_IF_ERROR(scratch(&seqlens_, opt.batch, 4));
  FLASHCPP_RETURN_IF_ERROR(scratch(&step_, 1, 4));
  FLASHCPP_RETURN_IF_ERROR(scratch(&history_, i64(std::max(opt.max_steps, 1)) * opt.batch, 4));
  FLASHCPP_RETURN_IF_ERROR(scratch(&prompt_tokens_, std::max(opt.max_prompt, 1), 4));
  plan_ = DecodePlan{};
  return Status::Ok();
}

Status Session::fill_cache_random(std::uint64_t seed) {
  if (opt_.kv_fp8) {  // the backend's N(0, 1) values, quantized as the append would store them
    const std::int64_t n = static_cast<std::int64_t>(kv_.empty() ? 0 : kv_[0].bytes());
    Buffer tmp;
    FLASHCPP_RETURN_IF_ERROR(tmp.allocate(ops_, static_cast<std::size_t>(n) * dtype_size(ops_->dtype())));
    std::vector<unsigned char> host(static_cast<std::size_t>(n) * dtype_size(ops_->dtype()));  // the backend's dtype
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < kv_.size(); ++i) {
      FLASHCPP_RETURN_IF_ERROR(ops_->fill_random(tmp.get(), n, seed + i, 1.f));
      FLASHCPP_RETURN_IF_ERROR(ops_->download(host.data(), tmp.get(), host.size()));
      for (std::int64_t e = 0; e < n; ++e)
        store_from_float(codes.data(), DType::kF8E4M3, e, load_as_float(host.data(), ops_->dtype(), e) / opt_.kv_scale);
      FLASHCPP_RETURN_IF_ERROR(ops_->upload(kv_[i].get(), codes.data(), codes.size()));
    }
    return Status::Ok();
  }
  const std::int64_t n = static_cast<std::int64_t>(kv_.empty() ? 0 : kv_[0].bytes() / dtype_size(ops_->dtype()));
  for (std::size_t i = 0; i < kv_.size(); ++i) FLASHCPP_RETURN_IF_ERROR(ops_->fill_random(kv_[i].get(), n, seed + i, 1.f));
  return Status::Ok();
}

namespace {

struct Dims {
  std::int64_t H, I, V, D, Hq, Hkv, QKV;
  explicit Dims(const LlamaConfig& c)
      : H(c.hidden_size), I(c.intermediate_size), V(c.vocab_size), D(c.head_dim), Hq(c.num_attention_heads),
        Hkv(c.num_key_value_heads), QKV((Hq + 2 * Hkv) * D) {}
};

char* off(const Buffer& b, std::int64_t elems, std::size_t es) { return b.as<char>() + elems * static_cast<std::int64_t>(es); }

}  // namespace

// The prefill's layer body (decode builds its own op list, with the norms fused into the GEMVs:
// decode_ops): `attend` runs the attention of layer l from qkv_ into attn_ and stores K/V;
// n = rows of the activations.
template <class Attend>
static Status run_layers(const LlamaModel& m, Ops* ops, int n, const Buffer& x, const Buffer& y, const Buffer& residual,
                         const Buffer& qkv, const Buffer& attn, const Buffer& gate_up, const Buffer& act,
                         Attend&& attend) {
  const LlamaConfig& c = m.config();
  const Dims d(c);
  const DType dt = ops->dtype();
  RunOptions ro;
  ro.backend = ops->cuda() ? Backend::kCuda : Backend::kCpu;
  ro.stream = ops->stream();
  const float eps = static_cast<float>(c.rms_norm_eps);
  auto norm = [&](bool add, const Buffer& xin, const void* w) {
    RmsNormParams p;
    p.rows = n;
    p.hidden = d.H;
    p.x = contiguous_matrix(xin.get(), dt, d.H);
    p.weight = w;
    p.y = contiguous_matrix(y.get(), dt, d.H);
    p.eps = eps;
    if (!add) return rms_norm(p, ro);
    p.residual = contiguous_matrix(residual.get(), dt, d.H);
    p.residual_out = p.residual;
    return fused_add_rms_norm(p, ro);
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = m.layers[l];
    FLASHCPP_RETURN_IF_ERROR(l == 0 ? norm(false, residual, w.in_norm.get()) : norm(true, x, w.in_norm.get()));
    FLASHCPP_RETURN_IF_ERROR(ops->gemm(n, static_cast<int>(d.QKV), static_cast<int>(d.H), y.get(), d.H, w.qkv.get(),
                                       qkv.get(), d.QKV, dt));
    FLASHCPP_RETURN_IF_ERROR(attend(l, ro));
    FLASHCPP_RETURN_IF_ERROR(ops->gemm(n, static_cast<int>(d.H), static_cast<int>(d.Hq * d.D), attn.get(), d.Hq * d.D,
                                       w.o.get(), x.get(), d.H, dt));
    FLASHCPP_RETURN_IF_ERROR(norm(true, x, w.post_norm.get()));
    FLASHCPP_RETURN_IF_ERROR(ops->gemm(n, static_cast<int>(2 * d.I), static_cast<int>(d.H), y.get(), d.H,
                                       w.gate_up.get(), gate_up.get(), 2 * d.I, dt));
    FLASHCPP_RETURN_IF_ERROR(silu_and_mul(
        SiluMulParams::from_fused(gate_up.get(), dt, n, d.I, 2 * d.I, contiguous_matrix(act.get(), dt, d.I)), ro));
    FLASHCPP_RETURN_IF_ERROR(ops->gemm(n, static_cast<int>(d.H), static_cast<int>(d.I), act.get(), d.I,
                                       w.down.get(), x.get(), d.H, dt));
  }
  // Final norm: residual += x; y = norm(residual).
  RmsNormParams p;
  p.rows = n;
  p.hidden = d.H;
  p.x = contiguous_matrix(x.get(), dt, d.H);
  p.residual = contiguous_matrix(residual.get(), dt, d.H);
  p.residual_out = p.residual;
  p.weight = m.norm.get();
  p.y = contiguous_matrix(y.get(), dt, d.H);
  p.eps = eps;
  return fused_add_rms_norm(p, ro);
}

Status Session::prefill(int seq, const std::int32_t* host_tokens, int n, int start, int rows) {
  const LlamaConfig& c = m_->config();
  const Dims d(c);
  const DType dt = ops_->dtype();
  const std::size_t es = dtype_size(dt);
  if (seq < 0 || seq >= opt_.batch) return Status::Invalid("sequence index out of range");
  if (n < 1 || n > opt_.max_prompt)
    return Status::Invalid("a prompt of " + std::to_string(n) + " tokens does not fit the session (max " +
                           std::to_string(opt_.max_prompt) + ")");
  if (start != 0) return Status::Unsupported("prefill after cached tokens (chunked prefill) is not built");
  if (start + n > opt_.capacity) return Status::Invalid("the prompt does not fit the KV cache");
  if (rows < 1 || rows > n || rows > std::max(opt_.logits_rows, 1))
    return Status::Invalid("logit rows " + std::to_string(rows) + " out of range");
  FLASHCPP_RETURN_IF_ERROR(ops_->upload(prompt_tokens_.get(), host_tokens, static_cast<std::size_t>(n) * 4));
  FLASHCPP_RETURN_IF_ERROR(
      ops_->embed(prompt_tokens_.as<std::int32_t>(), n, m_->embed.get(), c.vocab_size, c.hidden_size, residual_.get()));
  auto attend = [&](int l, const RunOptions& ro) -> Status {
    TensorView q{qkv_.get(), dt, n * d.QKV, d.QKV, d.D};
    TensorView k{off(qkv_, d.Hq * d.D, es), dt, n * d.QKV, d.QKV, d.D};
    TensorView v{off(qkv_, (d.Hq + d.Hkv) * d.D, es), dt, n * d.QKV, d.QKV, d.D};
    RopeParams rp;
    rp.batch = 1;
    rp.seqlen = n;
    rp.heads_q = static_cast<int>(d.Hq);
    rp.heads_k = static_cast<int>(d.Hkv);
    rp.head_dim = static_cast<int>(d.D);
    rp.q = q;
    rp.k = k;
    rp.positions = positions_.as<std::int32_t>() + start;
    rp.rotary = rope_spec();
    FLASHCPP_RETURN_IF_ERROR(apply_rotary(rp, ro));
    FLASHCPP_RETURN_IF_ERROR(ops_->write_kv(pools_[l], block_table_.as<std::int32_t>(), pages_per_seq_, seq, start, n,
                                            k.data, v.data, d.QKV));
    AttnParams ap;
    ap.batch = 1;
    ap.seqlen_q = ap.seqlen_k = n;
    ap.heads_q = static_cast<int>(d.Hq);
    ap.heads_kv = static_cast<int>(d.Hkv);
    ap.head_dim = static_cast<int>(d.D);
    ap.q = q;
    ap.k = k;
    ap.v = v;
    ap.o = bshd_view(attn_.get(), dt, n, d.Hq, d.D);
    ap.mask.causal = true;
    return attention_forward(ap, ro);
  };
  FLASHCPP_RETURN_IF_ERROR(run_layers(*m_, ops_, n, x_, y_, residual_, qkv_, attn_, gate_up_, act_, attend));
  return ops_->gemm(rows, static_cast<int>(d.V), static_cast<int>(d.H), off(y_, (n - rows) * d.H, es), d.H,
                    m_->lm_head_ptr(), logits_.get(), d.V, DType::kF32);
}

RotarySpec Session::rope_spec() const {
  const int D = static_cast<int>(Dims(m_->config()).D);
  RotarySpec r;
  r.style = RopeStyle::kNeox;
  r.rotary_dim = D;
  r.set_cos_sin_cache(rope_cos_sin_.as<float>(), opt_.capacity, D);
  return r;
}

DecodeParams Session::layer_decode_params(int layer) const {
  const Dims d(m_->config());
  const DType dt = ops_->dtype();
  const std::size_t es = dtype_size(dt);
  DecodeParams p;
  p.batch = opt_.batch;
  p.seqlen_q = 1;
  p.heads_q = static_cast<int>(d.Hq);
  p.heads_kv = static_cast<int>(d.Hkv);
  p.head_dim = static_cast<int>(d.D);
  p.q = TensorView{qkv_.get(), dt, d.QKV, d.QKV, d.D};
  p.o = bshd_view(attn_.get(), dt, 1, d.Hq, d.D);
  const KvPool& pool = pools_[layer];
  const std::int64_t page_stride = static_cast<std::int64_t>(pool.page_size) * d.Hkv * d.D;
  p.cache.k = TensorView{pool.k, pool.dtype, page_stride, d.Hkv * d.D, d.D};
  p.cache.v = TensorView{pool.v, pool.dtype, page_stride, d.Hkv * d.D, d.D};
  p.cache.k_scale = pool.k_scale;  // null unless the pool is fp8
  p.cache.v_scale = pool.v_scale;
  p.cache.page_size = pool.page_size;
  p.cache.num_pages = pool.num_pages;
  p.cache.block_table = block_table_.as<std::int32_t>();
  p.cache.block_table_stride = pages_per_seq_;
  p.cache.pages_per_seq = pages_per_seq_;
  p.cache_seqlens = seqlens_.as<std::int32_t>();
  p.k_new = TensorView{off(qkv_, d.Hq * d.D, es), dt, d.QKV, d.QKV, d.D};
  p.v_new = TensorView{off(qkv_, (d.Hq + d.Hkv) * d.D, es), dt, d.QKV, d.QKV, d.D};
  p.rotary = rope_spec();
  p.mask.causal = true;
  return p;
}

Status Session::plan(const std::vector<std::int32_t>& host_final_lengths, int num_splits, int max_splits,
                     bool fused_merge, bool fused_append) {
  if (static_cast<int>(host_final_lengths.size()) != opt_.batch) return Status::Internal("plan: one length per sequence");
  std::vector<std::int32_t> lens(host_final_lengths);
  for (auto& v : lens) v = std::clamp(v, 0, opt_.capacity - 1);
  DecodeParams p = layer_decode_params(0);
  DecodePlanOptions o;
  o.backend = ops_->cuda() ? Backend::kCuda : Backend::kCpu;
  o.host_cache_seqlens = lens.data();
  o.num_splits = num_splits;
  o.max_splits = max_splits;
  o.fused_merge = fused_merge;
  o.fused_append = fused_append;
  o.small_plan = DecodePlanOptions::SmallPlan::kShared;  // the GEMVs run beside attention (decode.h)
  o.stream = ops_->stream();
  DecodeWorkspaceSize ws;
  FLASHCPP_RETURN_IF_ERROR(decode_workspace_size(p, o, &ws));
  if (ws_int_.bytes() < ws.int_bytes || !ws_int_.get()) FLASHCPP_RETURN_IF_ERROR(ws_int_.allocate(ops_, ws.int_bytes));
  if (ws_float_.bytes() < ws.float_bytes || !ws_float_.get())
    FLASHCPP_RETURN_IF_ERROR(ws_float_.allocate(ops_, ws.float_bytes));
  return flashcpp::decode_plan(p, o, ws_int_.get(), ws_int_.bytes(), ws_float_.get(), ws_float_.bytes(), &plan_);
}

// Decode: the norms and the SwiGLU product ride in the GEMVs' prologues (Ops::gemv_fused), the
// residual stream alternates between two buffers (one CTA writes the sum while all read the
// previous one). Per layer: qkv GEMV (norm), decode_run (append + rotary + attention), o GEMV,
// gate_up GEMV (residual add + norm), down GEMV (silu * up); then the lm_head GEMV (add + norm).
Status Session::decode_ops(const SampleArgs& sampling, std::vector<StepOp>* out) {
  if (!plan_.planned) return Status::Internal("decode before plan()");
  out->clear();
  const LlamaConfig& c = m_->config();
  const Dims d(c);
  const int B = opt_.batch, vocab = c.vocab_size, hidden = c.hidden_size;
  const DType dt = ops_->dtype();
  Ops* ops = ops_;
  const float eps = static_cast<float>(c.rms_norm_eps);
  void* res[2] = {residual_.get(), residual2_.get()};
  int cur = 0;
  out->push_back({"embed", "other", [=, this] {
                    return ops->embed(tokens(), B, m_->embed.get(), vocab, hidden, res[0]);
                  }});
  auto add_norm = [&](const void* weight, void* scratch) {
    GemvPrologue p;
    p.kind = GemvPrologue::Kind::kAddRmsNorm;
    p.weight = weight;
    p.eps = eps;
    p.residual = res[cur];
    p.residual_out = res[cur ^ 1];
    p.scratch = scratch;
    cur ^= 1;
    return p;
  };
  RunOptions ro;
  ro.backend = ops->cuda() ? Backend::kCuda : Backend::kCpu;
  ro.stream = ops->stream();
  // The decode kernels launch programmatically, like the GEMVs around them: each launch overlaps
  // the previous kernel's tail (RunOptions::programmatic_launch; "gemv-nopdl" turns both off).
  ro.programmatic_launch = ops->programmatic();
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = m_->layers[l];
    const void* w_qkv = w.qkv.get();
    const void* w_o = w.o.get();
    const void* w_gu = w.gate_up.get();
    const void* w_down = w.down.get();
    GemvPrologue pq;
    const void* xin = x_.get();
    if (l == 0) {
      pq.kind = GemvPrologue::Kind::kRmsNorm;
      pq.weight = w.in_norm.get();
      pq.eps = eps;
      pq.scratch = y_.get();
      xin = res[0];
    } else {
      pq = add_norm(w.in_norm.get(), y_.get());
    }
    // The residual add is not idempotent when its output buffer is also an input elsewhere
    // (it never is here), so every op may be repeated for timing.
    out->push_back({"qkv", "gemm", [=, this] {
                      return ops->gemv_fused(B, static_cast<int>(d.QKV), static_cast<int>(d.H), xin, d.H, pq,
                                             w_qkv, qkv_.get(), d.QKV, dt);
                    }});
    const DecodeParams dp = layer_decode_params(l);
    out->push_back({"attention", "attention", [=, this] { return decode_run(dp, plan_, ro); }});
    out->push_back({"o_proj", "gemm", [=, this] {
                      return ops->gemm(B, static_cast<int>(d.H), static_cast<int>(d.Hq * d.D), attn_.get(), d.Hq * d.D,
                                       w_o, x_.get(), d.H, dt);
                    }});
    const GemvPrologue pg = add_norm(w.post_norm.get(), y_.get());
    out->push_back({"gate_up", "gemm", [=, this] {
                      return ops->gemv_fused(B, static_cast<int>(2 * d.I), static_cast<int>(d.H), x_.get(), d.H, pg,
                                             w_gu, gate_up_.get(), 2 * d.I, dt);
                    }});
    GemvPrologue ps;
    ps.kind = GemvPrologue::Kind::kSiluMul;
    ps.scratch = act_.get();
    out->push_back({"down", "gemm", [=, this] {
                      return ops->gemv_fused(B, static_cast<int>(d.H), static_cast<int>(d.I), gate_up_.get(), 2 * d.I,
                                             ps, w_down, x_.get(), d.H, dt);
                    }});
  }
  const GemvPrologue pf = add_norm(m_->norm.get(), y_.get());
  out->push_back({"lm_head", "gemm", [=, this] {
                    return ops->gemv_fused(B, static_cast<int>(d.V), static_cast<int>(d.H), x_.get(), d.H, pf,
                                           m_->lm_head_ptr(), logits_.get(), d.V, DType::kF32);
                  }});
  out->push_back({"sample", "other", [=, this] {
                    return ops->sample(logits_.as<float>(), B, vocab, sampling, tokens(), history(), step_counter());
                  }});
  out->push_back({"advance", "other", [=, this] { return ops->advance(seqlens(), B, step_counter()); }, false});
  return Status::Ok();
}

Status Session::decode_step(const SampleArgs& sampling) {
  std::vector<StepOp> list;
  FLASHCPP_RETURN_IF_ERROR(decode_ops(sampling, &list));
  for (auto& op : list) FLASHCPP_RETURN_IF_ERROR(op.run());
  return Status::Ok();
}

Status Session::profile_decode(const SampleArgs& sampling, int reps, std::vector<OpTiming>* out) {
  out->clear();
  if (!ops_->cuda()) return Status::Unsupported("per-op kernel timing needs the CUDA backend");
  std::vector<StepOp> list;
  FLASHCPP_RETURN_IF_ERROR(decode_ops(sampling, &list));
  constexpr int kGraph = 1 << 20;  // graph ids above the batch buckets
  for (auto& op : list) {
    if (!op.repeatable) {
      FLASHCPP_RETURN_IF_ERROR(ops_->record_event(0));
      FLASHCPP_RETURN_IF_ERROR(op.run());
      FLASHCPP_RETURN_IF_ERROR(ops_->record_event(1));
      FLASHCPP_RETURN_IF_ERROR(ops_->sync());
      out->push_back({op.name, op.category, 1e3 * ops_->event_ms(0, 1)});
      continue;
    }
    FLASHCPP_RETURN_IF_ERROR(ops_->begin_capture());
    Status st;
    for (int r = 0; r < reps && st.ok(); ++r) st = op.run();
    Status st2 = ops_->end_capture(kGraph);
    FLASHCPP_RETURN_IF_ERROR(st);
    FLASHCPP_RETURN_IF_ERROR(st2);
    FLASHCPP_RETURN_IF_ERROR(ops_->replay(kGraph));  // warm
    FLASHCPP_RETURN_IF_ERROR(ops_->record_event(0));
    FLASHCPP_RETURN_IF_ERROR(ops_->replay(kGraph));
    FLASHCPP_RETURN_IF_ERROR(ops_->replay(kGraph));
    FLASHCPP_RETURN_IF_ERROR(ops_->record_event(1));
    FLASHCPP_RETURN_IF_ERROR(ops_->sync());
    out->push_back({op.name, op.category, 1e3 * ops_->event_ms(0, 1) / (2.0 * reps)});
  }
  return Status::Ok();
}

}  // namespace flashcpp::engine
