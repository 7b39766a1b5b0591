// Case names, descriptions and the case tables of `flashcpp check`.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "harness/harness.h"

namespace flashcpp::harness {

const char* layout_name(Layout l) noexcept { return l == Layout::kBhsd ? "bhsd" : "bshd"; }

const char* table_name(TableKind t) noexcept { return t == TableKind::kFull ? "full" : "quick"; }

namespace {

std::string join_ints(const std::vector<int>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

std::string Case::name() const {
  std::string s = fmt::format("b{}_h{}", batch, heads_q);
  if (heads_kv != heads_q) s += fmt::format("kv{}", heads_kv);
  if (seqlen_q == seqlen_k)
    s += fmt::format("_n{}", seqlen_q);
  else
    s += fmt::format("_q{}_k{}", seqlen_q, seqlen_k);
  s += fmt::format("_d{}", head_dim);
  if (mask.causal) s += "_causal";
  if (mask.window_left >= 0) s += fmt::format("_wl{}", mask.window_left);
  if (mask.window_right >= 0) s += fmt::format("_wr{}", mask.window_right);
  if (mask.global_tokens > 0)
    s += fmt::format("_{}{}", mask.global_queries ? "global" : "sink", mask.global_tokens);
  if (mask.softcap > 0.f) s += fmt::format("_softcap{:g}", mask.softcap);
  if (softmax_scale != 0.f) s += fmt::format("_scale{:g}", softmax_scale);
  if (mask.alibi) s += mask.alibi_per_batch ? "_alibib" : "_alibi";
  if (mask.is_varlen()) {
    s += "_varlen" + join_ints(mask.varlen_q, "-");
    if (!mask.varlen_k.empty() && mask.varlen_k != mask.varlen_q) s += "_k" + join_ints(mask.varlen_k, "-");
  }
  if (mask.is_block_sparse())
    s += fmt::format("_bsparse{}x{}{}", mask.sparse_block_m, mask.sparse_block_n,
                     mask.sparse_per_head ? "h" : "");
  if (mask.rotary_dim > 0) s += fmt::format("_rope{}{}", mask.rotary_interleaved ? "i" : "", mask.rotary_dim);
  if (mask.nan_inputs) s += "_nan";
  if (layout == Layout::kBhsd) s += "_bhsd";
  s += "_";
  s += dtype_name(dtype);
  if (!return_lse) s += "_nolse";
  return s;
}

std::string Case::mask_description() const {
  std::vector<std::string> parts;
  if (mask.causal) parts.push_back("causal");
  if (mask.window_left >= 0) parts.push_back(fmt::format("window_left={}", mask.window_left));
  if (mask.window_right >= 0) parts.push_back(fmt::format("window_right={}", mask.window_right));
  if (mask.global_tokens > 0) parts.push_back(fmt::format("global_tokens={}", mask.global_tokens));
  if (mask.global_queries) parts.push_back("global_queries");
  if (mask.softcap > 0.f) parts.push_back(fmt::format("softcap={:g}", mask.softcap));
  if (mask.alibi) parts.push_back(mask.alibi_per_batch ? "alibi(per-batch slopes)" : "alibi");
  if (mask.rotary_dim > 0)
    parts.push_back(fmt::format("rotary({}, rotary_dim={})", mask.rotary_interleaved ? "interleaved" : "neox",
                                mask.rotary_dim));
  if (mask.is_varlen()) {
    const auto& k = mask.varlen_k.empty() ? mask.varlen_q : mask.varlen_k;
    parts.push_back("varlen(q=[" + join_ints(mask.varlen_q, ",") + "], k=[" + join_ints(k, ",") + "])");
  }
  if (mask.is_block_sparse())
    parts.push_back(fmt::format("block_sparse({}x{}{})", mask.sparse_block_m, mask.sparse_block_n,
                                mask.sparse_per_head ? ", per head" : ""));
  if (mask.nan_inputs) parts.push_back("NaN inputs");
  if (parts.empty()) return "none";
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? ", " : "") + parts[i];
  return s;
}

std::vector<std::string> Case::mask_kinds() const {
  std::vector<std::string> k;
  if (mask.causal) k.push_back("causal");
  if (mask.window_left >= 0 || mask.window_right >= 0) k.push_back("window");
  if (mask.softcap > 0.f) k.push_back("softcap");
  if (mask.alibi) k.push_back("alibi");
  if (mask.is_varlen()) k.push_back("varlen");
  if (mask.global_tokens > 0) k.push_back("global");
  if (mask.is_block_sparse()) k.push_back("block_sparse");
  if (k.empty()) k.push_back("none");
  return k;
}

double Case::work() const {
  double pairs = 0;
  if (mask.is_varlen()) {
    for (size_t b = 0; b < mask.varlen_q.size(); ++b) {
      const int lk = mask.varlen_k.empty() ? mask.varlen_q[b] : mask.varlen_k[b];
      pairs += static_cast<double>(mask.varlen_q[b]) * lk;
    }
  } else {
    pairs = static_cast<double>(batch) * seqlen_q * seqlen_k;
  }
  return 2.0 * pairs * heads_q * head_dim;
}

std::int64_t Case::total_q() const {
  if (!mask.is_varlen()) return static_cast<std::int64_t>(batch) * seqlen_q;
  std::int64_t t = 0;
  for (int l : mask.varlen_q) t += l;
  return t;
}

std::int64_t Case::total_k() const {
  if (!mask.is_varlen()) return static_cast<std::int64_t>(batch) * seqlen_k;
  const auto& k = mask.varlen_k.empty() ? mask.varlen_q : mask.varlen_k;
  std::int64_t t = 0;
  for (int l : k) t += l;
  return t;
}

// ---- tables ------------------------------------------------------------------------------

namespace {

constexpr DType kBf16 = DType::kBF16, kF16 = DType::kF16, kF32 = DType::kF32;

Case shape(int b, int sq, int sk, int hq, int hkv, int d, DType dt, bool causal = false) {
  Case c;
  c.batch = b;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = hq;
  c.heads_kv = hkv;
  c.head_dim = d;
  c.dtype = dt;
  c.mask.causal = causal;
  return c;
}

Case varlen(std::vector<int> lq, std::vector<int> lk, int hq, int hkv, int d, DType dt, bool causal) {
  Case c = shape(static_cast<int>(lq.size()), *std::max_element(lq.begin(), lq.end()),
                 *std::max_element((lk.empty() ? lq : lk).begin(), (lk.empty() ? lq : lk).end()), hq,
                 hkv, d, dt, causal);
  c.mask.varlen_q = std::move(lq);
  c.mask.varlen_k = std::move(lk);
  return c;
}

Case window(Case c, int left, int right) {
  c.mask.window_left = left;
  c.mask.window_right = right;
  return c;
}
Case global(Case c, int g, bool queries) {
  c.mask.global_tokens = g;
  c.mask.global_queries = queries;
  return c;
}
Case softcap(Case c, float cap, float scale = 0.f) {
  c.mask.softcap = cap;
  c.softmax_scale = scale;
  return c;
}
Case alibi(Case c, bool per_batch) {
  c.mask.alibi = true;
  c.mask.alibi_per_batch = per_batch;
  return c;
}
Case sparse(Case c, int bm, int bn, bool per_head) {
  c.mask.sparse_block_m = bm;
  c.mask.sparse_block_n = bn;
  c.mask.sparse_per_head = per_head;
  return c;
}
Case rope(Case c, int rotary_dim, bool interleaved) {
  c.mask.rotary_dim = rotary_dim;
  c.mask.rotary_interleaved = interleaved;
  return c;
}
Case bhsd(Case c) {
  c.layout = Layout::kBhsd;
  return c;
}
Case nolse(Case c) {
  c.return_lse = false;
  return c;
}
Case nan_in(Case c) {
  c.mask.nan_inputs = true;
  return c;
}

class Table {
 public:
  void add(const Case& c) {
    if (seen_.insert(c.name()).second) cases_.push_back(c);
  }
  std::vector<Case> take() { return std::move(cases_); }

 private:
  std::set<std::string> seen_;
  std::vector<Case> cases_;
};

// Every mask kind, every head dim and dtype, odd sizes, GQA/MQA, seqlen_q != seqlen_k both
// ways, both layouts. Each case is at most ~3e8 multiply-adds, so the whole table runs in
// seconds on the CPU backends.
void add_quick(Table& t) {
  // Odd sizes, causal and not.
  for (int n : {1, 7, 17, 127, 1000})
    for (bool causal : {false, true}) t.add(shape(n < 1000 ? 2 : 1, n, n, 2, 2, 64, kBf16, causal));
  // Every dtype x head dim.
  for (DType dt : {kBf16, kF16, kF32})
    for (int d : {64, 128, 256})
      for (bool causal : {false, true}) t.add(shape(1, causal ? 130 : 127, causal ? 130 : 127, 2, 2, d, dt, causal));
  // GQA 4/2 and MQA 4/1.
  for (int hkv : {2, 1})
    for (bool causal : {false, true}) {
      t.add(shape(2, 127, 127, 4, hkv, 64, kBf16, causal));
      t.add(shape(1, 1000, 1000, 4, hkv, 128, causal ? kF16 : kF32, causal));
    }
  // seqlen_q != seqlen_k, both ways (bottom-right causal: with seqlen_q > seqlen_k the first
  // rows see no key at all and must give O = 0, LSE = -inf).
  for (auto [sq, sk] : {std::pair{1, 1000}, {7, 127}, {127, 7}, {17, 1000}, {1000, 17}, {1000, 127}})
    for (bool causal : {false, true}) t.add(shape(1, sq, sk, 2, 2, 64, kBf16, causal));
  t.add(shape(2, 127, 1000, 2, 1, 128, kF16, true));
  t.add(shape(1, 127, 1000, 2, 2, 128, kF32, true));
  t.add(shape(1, 1000, 127, 2, 2, 256, kF32, true));

  // Masks: each kind in bf16 d64, again in fp32 d128 (exact backend) and some in fp16 d256.
  for (auto [dt, d] : {std::pair{kBf16, 64}, {kF32, 128}, {kF16, 256}}) {
    const int n = dt == kF16 ? 300 : 1000;
    // Sliding window (Mistral: causal, left window), two-sided, diagonal only, and sq != sk.
    t.add(window(shape(1, n, n, 2, 2, d, dt, true), 64, 0));
    t.add(window(shape(1, n, n, 2, 2, d, dt, false), 32, 16));
    t.add(window(shape(1, 127, 127, 2, 2, d, dt, false), 0, 0));
    t.add(window(shape(1, 127, n, 2, 1, d, dt, true), 100, -1));
    // Attention sinks (global keys) and global queries (Longformer-style).
    t.add(global(window(shape(1, n, n, 2, 2, d, dt, true), 32, 0), 4, false));
    t.add(global(window(shape(1, n, n, 2, 2, d, dt, false), 16, 16), 8, true));
    // Softcap: Gemma-2's 50 with a large scale (scores of spread ~8, so the cap bends them), and a
    // small cap that bends almost everything.
    t.add(softcap(shape(1, n, n, 2, 2, d, dt, true), 50.f, 1.f));
    t.add(softcap(shape(2, 127, 127, 2, 2, d, dt, false), 1.f));
    // ALiBi, per-head and per-batch slopes.
    t.add(alibi(shape(1, n, n, 4, 2, d, dt, false), false));
    t.add(alibi(shape(2, 127, 127, 2, 2, d, dt, true), true));
    // Varlen documents: odd lengths incl. 1; q shorter than k (chunked prefill).
    t.add(varlen({1, 7, 127, 300}, {}, 2, 2, d, dt, true));
    t.add(varlen({17, 500, 5}, {}, 2, 1, d, dt, false));
    t.add(varlen({1, 7, 50}, {10, 7, 127}, 2, 2, d, dt, true));
    // Block-sparse: shared square blocks; per-head with causal; odd block shape.
    t.add(sparse(shape(1, 127, 127, 2, 2, d, dt, false), 32, 32, false));
    t.add(sparse(shape(2, 300, 300, 2, 1, d, dt, true), 64, 32, true));
    if (dt != kF16) t.add(sparse(shape(1, n, n, 2, 2, d, dt, false), 16, 128, false));
    // Block-sparse with blocks the CUDA kernels' tiles divide (128x128, FlexAttention's default;
    // the blocks above are refused on CUDA with a sentence).
    t.add(sparse(shape(1, n, n, 2, 2, d, dt, false), 128, 128, false));
    t.add(sparse(shape(2, 300, 300, 2, 1, d, dt, true), 128, 128, true));
  }
  t.add(global(window(shape(1, 1000, 1000, 2, 2, 64, kF16, true), 64, 0), 4, false));  // sinks, fp16 d64
  // SDPA layout (batch, heads, seqlen, dim) through strides alone.
  t.add(bhsd(shape(2, 127, 127, 4, 2, 64, kBf16, true)));
  t.add(bhsd(shape(1, 1000, 1000, 2, 2, 128, kF32, false)));
  t.add(bhsd(shape(1, 127, 1000, 2, 2, 64, kF16, true)));
  t.add(bhsd(window(shape(1, 1000, 1000, 2, 2, 64, kBf16, true), 64, 0)));
  t.add(bhsd(shape(2, 17, 17, 4, 1, 256, kBf16, false)));
  // No LSE requested.
  t.add(nolse(shape(2, 127, 127, 2, 2, 64, kBf16, true)));
  t.add(nolse(shape(1, 1000, 1000, 2, 1, 128, kF16, false)));
  // Rotary fused into attention (CPU backends; the CUDA kernels refuse it for now): neox and
  // interleaved, partial, GQA with seqlen_q != seqlen_k (bottom-right default positions), varlen
  // (per-document positions), with a window.
  t.add(rope(shape(2, 37, 53, 4, 2, 64, kBf16, true), 64, false));
  t.add(rope(shape(1, 127, 127, 2, 1, 128, kF32, false), 32, true));
  t.add(rope(varlen({1, 7, 50}, {10, 7, 127}, 2, 2, 64, kF16, true), 64, true));
  t.add(rope(window(shape(1, 300, 300, 2, 2, 128, kBf16, true), 64, 0), 96, false));
  // NaN inputs (MaskSpec::nan_inputs): the rows that see a NaN must be NaN, the others exact as
  // ever; every backend, both kernel families. Causal (later rows see the NaN key), GQA, a
  // window (rows past it do not see the NaN key), ALiBi with a NaN slope, varlen, fp32.
  t.add(nan_in(shape(2, 127, 127, 4, 2, 64, kBf16, true)));
  t.add(nan_in(window(shape(1, 1000, 1000, 2, 2, 128, kF16, true), 64, 0)));
  t.add(nan_in(alibi(shape(1, 300, 300, 4, 4, 64, kBf16, true), false)));
  t.add(nan_in(varlen({1, 70, 200}, {}, 2, 2, 128, kBf16, true)));
  t.add(nan_in(softcap(shape(1, 127, 127, 2, 1, 256, kF32, true), 30.f)));
}

// Larger problems within kCpuMaxWorkPerCase.
void add_full_cpu(Table& t) {
  t.add(shape(1, 4097, 4097, 2, 2, 64, kBf16, false));
  t.add(shape(1, 4097, 4097, 2, 1, 64, kF16, true));
  t.add(shape(1, 4097, 4097, 1, 1, 128, kF32, true));
  t.add(shape(1, 2048, 2048, 4, 2, 128, kBf16, true));
  t.add(shape(1, 2048, 2048, 2, 2, 128, kF32, false));
  t.add(shape(1, 2048, 2048, 1, 1, 256, kF16, true));
  t.add(shape(1, 2048, 2048, 2, 2, 256, kBf16, false));
  for (bool causal : {false, true}) {
    t.add(shape(1, 1000, 4097, 2, 1, 64, kBf16, causal));
    t.add(shape(1, 4097, 1000, 2, 1, 64, kBf16, causal));
  }
  t.add(window(shape(1, 4097, 4097, 2, 2, 64, kBf16, true), 256, 0));
  t.add(window(shape(1, 4097, 4097, 1, 1, 128, kF32, false), 128, 128));
  t.add(global(window(shape(1, 4097, 4097, 2, 2, 64, kBf16, true), 256, 0), 4, false));
  t.add(softcap(shape(1, 2048, 2048, 2, 2, 128, kBf16, true), 50.f, 1.f));
  t.add(alibi(shape(1, 2048, 2048, 4, 2, 64, kF16, true), false));
  t.add(varlen({1000, 2048, 1, 4097}, {}, 2, 2, 64, kBf16, true));
  t.add(varlen({300, 1, 1000}, {2048, 17, 4097}, 2, 1, 128, kF32, true));
  t.add(sparse(shape(1, 2048, 2048, 2, 2, 64, kBf16, true), 64, 64, true));
  t.add(bhsd(shape(1, 2048, 2048, 4, 2, 128, kBf16, true)));
  t.add(bhsd(shape(2, 1000, 1000, 4, 4, 64, kF16, false)));
}

// The course's shapes and long sequences: CUDA only (the fp64 truth runs on the GPU).
void add_full_cuda(Table& t) {
  struct S { int b, h, n, d; };
  for (S s : {S{1, 8, 512, 64}, S{1, 8, 2048, 64}, S{4, 32, 4096, 128}, S{1, 8, 8192, 128}, S{2, 16, 16384, 64}})
    for (DType dt : {kBf16, kF16})
      for (bool causal : {false, true}) t.add(shape(s.b, s.n, s.n, s.h, s.h, s.d, dt, causal));
  for (bool causal : {false, true}) {
    t.add(shape(1, 4096, 4096, 32, 8, 128, kBf16, causal));  // GQA 32/8 (Llama-3 8B)
    t.add(shape(2, 1000, 4097, 8, 8, 128, kBf16, causal));
    t.add(shape(2, 4097, 1000, 8, 8, 128, kBf16, causal));
    t.add(shape(2, 2048, 2048, 8, 8, 256, kBf16, causal));
    t.add(shape(2, 2048, 2048, 8, 8, 256, kF16, causal));
  }
  t.add(shape(1, 4096, 4096, 32, 8, 128, kF16, true));
  t.add(shape(2, 4096, 4096, 32, 1, 64, kBf16, true));  // MQA
  t.add(shape(1, 4097, 4097, 16, 16, 128, kBf16, true));
  t.add(bhsd(shape(2, 4096, 4096, 16, 16, 64, kBf16, true)));
  t.add(window(shape(2, 8192, 8192, 16, 16, 128, kBf16, true), 1024, 0));  // sliding window 1024
  t.add(window(shape(1, 4096, 4096, 8, 8, 64, kF16, false), 256, 256));
}

}  // namespace

std::vector<Case> make_table(TableKind kind, Backend backend) {
  Table t;
  add_quick(t);
  if (kind == TableKind::kFull) {
    add_full_cpu(t);
    if (backend == Backend::kCuda) add_full_cuda(t);
  }
  return t.take();
}

// ---- tolerance policy ---------------------------------------------------------------------

Tolerance tolerance_for(DType t) noexcept {
  switch (t) {
    case DType::kBF16: return {1e-2, 1e-2, 1e-3};
    case DType::kF16: return {1e-2, 1e-2, 1e-3};
    case DType::kF32: return {1e-6, 1e-6, 1e-5, 2.0};
  }
  return {};
}

nlohmann::json tolerance_policy_json() {
  nlohmann::json j;
  j["rule"] = "per element |out - ref| <= atol + rtol * |ref| against an fp64 reference; no NaN/Inf; "
              "per row |lse - lse_ref| <= lse_atol (rows that see no key: O = 0 and LSE = -inf exactly)";
  j["doc"] = "docs/tolerances.md";
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    const Tolerance tol = tolerance_for(t);
    j[dtype_name(t)] = {{"atol", tol.atol}, {"rtol", tol.rtol}, {"lse_atol", tol.lse_atol}};
    if (tol.plain_factor > 0) {
      j[dtype_name(t)]["plain_factor"] = tol.plain_factor;
      j[dtype_name(t)]["plain_rule"] =
          "atol and lse_atol grow by plain_factor x the max error of a plain fp32 implementation on the "
          "case (scores, softmax, P@V in fp32); a plain error above the sanity bound fails the case";
      j[dtype_name(t)]["plain_sanity_bound"] = kPlainSanityBound;
    }
  }
  return j;
}

}  // namespace flashcpp::harness
