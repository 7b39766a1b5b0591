// A backward problem on the host for the CPU tests: inputs in any dtype (fp64 too), the mask of a
// Spec (every MaskParams kind, varlen, block-sparse, GQA), the forward run to get o and lse, and
// the backward's params with its own poisoned outputs and workspace.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/half.h"
#include "flashcpp/masks.h"
#include "flashcpp/reference.h"

namespace flashcpp::testing {

struct BwdSpec {
  int batch = 1, seqlen_q = 7, seqlen_k = 7, heads_q = 2, heads_kv = 1, head_dim = 64;
  int head_dim_v = 0;  ///< of v, o, dout and dv; 0 = head_dim
  int dim_v() const { return head_dim_v ? head_dim_v : head_dim; }
  DType dtype = DType::kF32;
  bool causal = false;
  int window_left = -1, window_right = -1, global_tokens = 0;
  bool global_queries = false;
  float softcap = 0.f;
  bool alibi = false;
  float softmax_scale = 0.f;
  std::vector<int> varlen_q, varlen_k;  ///< non-empty: packed varlen (batch = size)
  int sparse_m = 0, sparse_n = 0;       ///< > 0: a random block-sparse mask of these blocks
  bool dlse = false;                    ///< also a random dL/dLSE
  float stddev = 1.f;
  std::string name() const {
    std::string s = "b" + std::to_string(batch) + "_q" + std::to_string(seqlen_q) + "_k" + std::to_string(seqlen_k) + "_h" +
                    std::to_string(heads_q) + "kv" + std::to_string(heads_kv) + "_d" + std::to_string(head_dim) +
                    (head_dim_v && head_dim_v != head_dim ? "v" + std::to_string(head_dim_v) : "") + "_" + dtype_name(dtype);
    if (causal) s += "_causal";
    if (window_left >= 0 || window_right >= 0) s += "_w" + std::to_string(window_left) + "," + std::to_string(window_right);
    if (global_tokens) s += "_g" + std::to_string(global_tokens) + (global_queries ? "q" : "");
    if (softcap > 0) s += "_softcap";
    if (alibi) s += "_alibi";
    if (!varlen_q.empty()) s += "_varlen";
    if (sparse_m) s += "_sparse" + std::to_string(sparse_m) + "x" + std::to_string(sparse_n);
    if (dlse) s += "_dlse";
    return s;
  }
};

/// Host bytes of one tensor, 256-byte aligned storage.
struct Bytes {
  std::vector<std::uint8_t> raw;
  std::size_t offset = 0, size = 0;
  void alloc(std::size_t n) {
    raw.assign(n + 256, 0);
    offset = (256 - reinterpret_cast<std::uintptr_t>(raw.data()) % 256) % 256;
    size = n;
  }
  std::uint8_t* data() { return raw.data() + offset; }
  const std::uint8_t* data() const { return raw.data() + offset; }
};

struct Tensor {
  DType dt = DType::kF32;
  std::int64_t n = 0;
  Bytes b;
  void alloc(DType t, std::int64_t count) {
    dt = t;
    n = count;
    b.alloc(static_cast<std::size_t>(count) * dtype_size(t));
  }
  double get(std::int64_t i) const { return load_as_double(b.data(), dt, i); }
  void set(std::int64_t i, double v) { store_from_double(b.data(), dt, i, v); }
  void* data() { return b.data(); }
  void poison() {
    for (std::int64_t i = 0; i < n; ++i) set(i, NAN);
  }
  void fill_normal(std::mt19937_64& g, float sd) {
    std::normal_distribution<double> d(0.0, sd);
    for (std::int64_t i = 0; i < n; ++i) set(i, d(g));
  }
};

class BwdProblem {
 public:
  BwdSpec s;
  std::vector<std::int32_t> cu_q, cu_k;
  std::vector<float> slopes;
  BlockMask sparse;
  std::int64_t rows_q = 0, rows_k = 0;
  Tensor q, k, v, o, dout, dq, dk, dv;
  std::vector<float> lse, dlse;
  Bytes workspace;

  BwdProblem(const BwdSpec& spec, std::uint64_t seed) : s(spec) {
    std::mt19937_64 g(seed);
    if (!s.varlen_q.empty()) {
      if (s.varlen_k.empty()) s.varlen_k = s.varlen_q;
      s.batch = static_cast<int>(s.varlen_q.size());
      cu_q.assign(1, 0);
      cu_k.assign(1, 0);
      s.seqlen_q = s.seqlen_k = 0;
      for (int b = 0; b < s.batch; ++b) {
        cu_q.push_back(cu_q.back() + s.varlen_q[b]);
        cu_k.push_back(cu_k.back() + s.varlen_k[b]);
        s.seqlen_q = std::max(s.seqlen_q, s.varlen_q[b]);
        s.seqlen_k = std::max(s.seqlen_k, s.varlen_k[b]);
      }
      rows_q = cu_q.back();
      rows_k = cu_k.back();
    } else {
      rows_q = static_cast<std::int64_t>(s.batch) * s.seqlen_q;
      rows_k = static_cast<std::int64_t>(s.batch) * s.seqlen_k;
    }
    if (s.alibi) {
      slopes = alibi_slopes(s.heads_q);
      for (float& x : slopes) x *= 4.f;  // steeper than BLOOM's, so the bias matters at these lengths
    }
    if (s.sparse_m > 0) {
      std::bernoulli_distribution coin(0.6);
      std::vector<std::uint8_t> dense(static_cast<std::size_t>(s.heads_q) * s.seqlen_q * s.seqlen_k);
      for (auto& x : dense) x = coin(g);
      BlockSparseShape shape{s.seqlen_q, s.seqlen_k, s.sparse_m, s.sparse_n, 1, s.heads_q};
      if (!build_block_sparse_from_dense(shape, dense.data(), &sparse).ok()) std::abort();
    }
    const std::int64_t nq = rows_q * s.heads_q * s.head_dim, nk = rows_k * s.heads_kv * s.head_dim;
    const std::int64_t no = rows_q * s.heads_q * s.dim_v(), nv = rows_k * s.heads_kv * s.dim_v();
    for (Tensor* t : {&q, &dq}) t->alloc(s.dtype, nq);
    for (Tensor* t : {&o, &dout}) t->alloc(s.dtype, no);
    for (Tensor* t : {&k, &dk}) t->alloc(s.dtype, nk);
    for (Tensor* t : {&v, &dv}) t->alloc(s.dtype, nv);
    q.fill_normal(g, s.stddev);
    k.fill_normal(g, s.stddev);
    v.fill_normal(g, 1.f);
    dout.fill_normal(g, 1.f);
    lse.assign(static_cast<std::size_t>(rows_q * s.heads_q), NAN);
    if (s.dlse) {
      dlse.resize(lse.size());
      std::normal_distribution<float> d(0.f, 1.f);
      for (float& x : dlse) x = d(g);
    }
  }

  TensorView view_q(Tensor& t) const { return view(t, s.heads_q); }
  TensorView view_k(Tensor& t) const { return view(t, s.heads_kv); }

  MaskParams mask() const {
    MaskParams m;
    m.causal = s.causal;
    m.window_left = s.window_left;
    m.window_right = s.window_right;
    m.global_tokens = s.global_tokens;
    m.global_queries = s.global_queries;
    m.softcap = s.softcap;
    if (s.alibi) m.alibi_slopes = slopes.data();
    if (!cu_q.empty()) {
      m.cu_seqlens_q = cu_q.data();
      m.cu_seqlens_k = cu_k.data();
      m.total_q = rows_q;
    }
    if (s.sparse_m > 0) m.block_sparse = sparse.get();
    return m;
  }

  AttnParams forward_params() {
    AttnParams p;
    p.batch = s.batch;
    p.seqlen_q = s.seqlen_q;
    p.seqlen_k = s.seqlen_k;
    p.heads_q = s.heads_q;
    p.heads_kv = s.heads_kv;
    p.head_dim = s.head_dim;
    p.head_dim_v = s.head_dim_v;
    p.q = view_q(q);
    p.k = view_k(k);
    p.v = view_k(v);
    p.o = view_q(o);
    p.lse = lse.data();
    p.softmax_scale = s.softmax_scale;
    p.mask = mask();
    return p;
  }

  /// Runs the forward (o, lse) on `b` (kCpuReference for fp64).
  Status forward(Backend b) {
    RunOptions opt;
    opt.backend = b;
    return attention_forward(forward_params(), opt);
  }

  AttnBackwardParams backward_params(bool deterministic = false) {
    AttnBackwardParams p;
    p.batch = s.batch;
    p.seqlen_q = s.seqlen_q;
    p.seqlen_k = s.seqlen_k;
    p.heads_q = s.heads_q;
    p.heads_kv = s.heads_kv;
    p.head_dim = s.head_dim;
    p.head_dim_v = s.head_dim_v;
    p.q = view_q(q);
    p.k = view_k(k);
    p.v = view_k(v);
    p.o = view_q(o);
    p.dout = view_q(dout);
    p.lse = lse.data();
    p.dlse = dlse.empty() ? nullptr : dlse.data();
    p.dq = view_q(dq);
    p.dk = view_k(dk);
    p.dv = view_k(dv);
    p.softmax_scale = s.softmax_scale;
    p.mask = mask();
    if (!cu_k.empty()) p.total_k = rows_k;
    p.deterministic = deterministic;
    return p;
  }

  /// Poisons dq, dk, dv, sizes the workspace and runs the backward.
  Status backward(const RunOptions& opt, bool deterministic = false) {
    for (Tensor* t : {&dq, &dk, &dv}) t->poison();
    AttnBackwardParams p = backward_params(deterministic);
    std::size_t bytes = 0;
    FLASHCPP_RETURN_IF_ERROR(attention_backward_workspace_size(p, opt, &bytes));
    workspace.alloc(bytes);
    std::memset(workspace.data(), 0xFF, bytes);  // NaN floats, -1 semaphores: the preprocess must init
    p.workspace = bytes ? workspace.data() : nullptr;
    p.workspace_bytes = bytes;
    return attention_backward(p, opt);
  }

 private:
  TensorView view(Tensor& t, int heads) const {
    const int w = &t == &v || &t == &o || &t == &dout || &t == &dv ? s.dim_v() : s.head_dim;
    if (!cu_q.empty()) return TensorView{t.data(), s.dtype, 0, static_cast<std::int64_t>(heads) * w, w};
    const int len = &t == &q || &t == &o || &t == &dout || &t == &dq ? s.seqlen_q : s.seqlen_k;
    return bshd_view(t.data(), s.dtype, len, heads, w);
  }
};

}  // namespace flashcpp::testing
