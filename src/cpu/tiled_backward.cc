// Tiled fp32 attention backward on the CPU: the FA2/FA3 backward algorithm, tile for tile, in the
// workspace layout a GPU kernel uses (BackwardWorkspaceLayout, include/flashcpp/backward.h).
//
// Three passes, as the GPU runs three kernels:
//   1. preprocess, per query row: D = rowsum(dO * O) - dLSE and LSE log2(e) into the workspace
//      (algebra::row_delta, algebra::lse_log2: an empty row gets D = 0 and +inf, so its P is 0);
//      the dQ accumulator (and the semaphores) zeroed;
//   2. main pass, one work item per (sequence b, KV head hk, key tile n) of bn keys: K and V of the
//      tile are loaded once; for each query head h of the group and each query tile m of bm rows
//      that sees the tile (walk::query_tiles, walk::backward_visit: the forward's tile decision,
//      src/common/attention_walk.h), with Q, dO, D and the LSE of the tile:
//        u  = Q K^T (raw units), t = ScoreTransform(u) (softcap, ALiBi), -inf where hidden
//        P  = exp2(t c - LSE log2 e)                      (algebra::backward_p)
//        dV += P^T dO                                     (kept across m and h: the item owns the tile)
//        dP = dO V^T,  dS = P (dP - D) softcap'(u)        (algebra::backward_ds, softcap_grad)
//        dK += dS^T Q
//        dQ_accum[tile m] += dS K                         (fp32, in the workspace)
//      then writes dK = scale dK and dV in the output dtype;
//   3. postprocess, per query row: dQ = scale dQ_accum in the output dtype.
// Every sum over a tile (q.k and dO.v over head_dim, P^T dO and dS^T Q over the tile's rows, dS K
// over its keys, dO.O over head_dim) is a pairwise tree, added once per tile to the running values:
// as in the forward (tiled_common.h, pairwise_sum_rows), running sums would dominate the fp32 error.
//
// dQ accumulation. Different key tiles add to the same query tile from different threads. Default:
// each element is added atomically (std::atomic_ref::fetch_add, the GPU's red.global.add.f32), so
// the order, and the last bits of dQ, depend on timing. Deterministic: query tile m's semaphore in
// the workspace counts the key tiles that have added; key tile n waits until it equals
// walk::key_tile_rank(m, n), adds, and sets it to rank + 1, so the additions run in ascending key
// order whatever the thread count (bitwise equal to a one-thread run). Items are pulled in ascending
// (b, hk, n) order and an item waits only for smaller key tiles of its own (b, hk), each already
// started by some thread, so the waiting never deadlocks. dK and dV are repeatable in both modes.
//
// Numerics: fp32 throughout with the exponent, softcap and LSE terms evaluated by the algebra's host
// rules (exact in double, rounded once); P and dS stay fp32 (a GPU rounds them to 16 bits for the
// tensor cores), so this checks the algorithm and the walk, not the kernels' 16-bit rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "flashcpp/half.h"
#include "common/attention_algebra.h"
#include "common/attention_walk.h"
#include "common/backward_algebra.h"
#include "common/mask_rules.h"
#include "cpu/backward_backend.h"
#include "cpu/cpu_backend.h"
#include "cpu/tiled_common.h"
#include "cpu/parallel.h"

namespace flashcpp::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kDefaultBlock = 64;

void load_row(const TensorView& t, std::int64_t offset, int dim, float* dst) {
  if (t.dtype == DType::kF32) {
    const float* src = static_cast<const float*>(t.data) + offset;
    std::copy(src, src + dim, dst);
    return;
  }
  for (int d = 0; d < dim; ++d) dst[d] = load_as_float(t.data, t.dtype, offset + d);
}

/// The workspace's parts as pointers.
struct Workspace {
  BackwardWorkspaceLayout layout;
  float* delta = nullptr;
  float* lse2 = nullptr;
  float* dq = nullptr;
  std::int32_t* sem = nullptr;

  Workspace(const BackwardWorkspaceLayout& l, void* base) : layout(l) {
    auto* bytes = static_cast<std::uint8_t*>(base);
    delta = reinterpret_cast<float*>(bytes + l.delta);
    lse2 = reinterpret_cast<float*>(bytes + l.lse_log2);
    dq = reinterpret_cast<float*>(bytes + l.dq_accum);
    sem = l.bytes > l.semaphores ? reinterpret_cast<std::int32_t*>(bytes + l.semaphores) : nullptr;
  }
  /// Padded row of sequence b's row i (per head).
  std::int64_t row(const Sequence& s, int b, int i) const {
    return walk::padded_row_start(s.first_q, b, layout.row_pad) + i;
  }
};

/// The problem-wide values every pass reads.
struct Problem {
  const AttnBackwardParams* p = nullptr;
  int dim = 0, dim_v = 0, group = 0, bm = 0, bn = 0;  // dim: q and k; dim_v: v, o and dO
  bool varlen = false;
  float scale = 0.f;
  std::int64_t lse_rows = 0;  // varlen LSE row count
  std::int64_t lse_index(const Sequence& s, int b, int i, int h) const {
    return varlen ? h * lse_rows + s.first_q + i : (static_cast<std::int64_t>(b) * p->heads_q + h) * p->seqlen_q + i;
  }
};

// ---- 1. preprocess -----------------------------------------------------------------------------------

/// D and LSE log2(e) of every row of (sequence b, head h).
void preprocess_head(const Problem& pr, const Workspace& ws, int b, int h, std::vector<float>& buf) {
  const AttnBackwardParams& p = *pr.p;
  const Sequence s = sequence(p, b);
  const int dim = pr.dim_v;
  buf.resize(static_cast<std::size_t>(2 * dim));
  float* o = buf.data();
  float* dout = o + dim;
  for (int i = 0; i < s.len_q; ++i) {
    load_row(p.o, row_offset(p.o, pr.varlen, b, s.first_q, i, h), dim, o);
    load_row(p.dout, row_offset(p.dout, pr.varlen, b, s.first_q, i, h), dim, dout);
    for (int d = 0; d < dim; ++d) o[d] *= dout[d];
    pairwise_sum_rows(o, dim, 1, 1);
    const std::int64_t at = pr.lse_index(s, b, i, h);
    const float lse = p.lse[at];
    const std::int64_t row = h * ws.layout.rows + ws.row(s, b, i);
    ws.delta[row] = algebra::row_delta(o[0], p.dlse ? p.dlse[at] : 0.f, lse);
    ws.lse2[row] = algebra::lse_log2(lse);
  }
}

// ---- 2. the main pass --------------------------------------------------------------------------------

/// Per-thread buffers for bm x bn tiles, head_dim d (q, k) and dv (v, o, dO).
struct Scratch {
  int bm = 0, bn = 0;
  std::vector<float> kt, vt;      // [d][bn] K and [dv][bn] V of the key tile, transposed (dot products over keys)
  std::vector<float> k, q, dout;  // [bn][d] K; [bm][d] Q; [bm][dv] dO
  std::vector<float> pt, dst;     // [bn][bm] P and dS of the pair, transposed (sums over rows per key)
  std::vector<float> prod;        // products before their pairwise sums, [max][max(bn, d, dv)]
  std::vector<float> row_lse2, row_delta;  // [bm]
  std::vector<float> dk, dv;      // [bn][d] running dK, [bn][dv] running dV of the key tile
  std::vector<float> dq;          // [bm][d] this pair's dS K
  std::vector<float> srow, dprow, ds_row;  // [bn] one row's scores, dP, dS
  Scratch(int bm_, int bn_, int d, int d_v) : bm(bm_), bn(bn_) {
    const std::size_t n = static_cast<std::size_t>(bn), m = static_cast<std::size_t>(bm), dd = static_cast<std::size_t>(d),
                      ddv = static_cast<std::size_t>(d_v);
    kt.resize(dd * n);
    vt.resize(ddv * n);
    k.resize(n * dd);
    q.resize(m * dd);
    dout.resize(m * ddv);
    pt.resize(n * m);
    dst.resize(n * m);
    const std::size_t rows = std::max({m, n, dd, ddv}), cols = std::max({n, dd, ddv});
    prod.resize(rows * cols);
    row_lse2.resize(m);
    row_delta.resize(m);
    dk.resize(n * dd);
    dv.resize(n * ddv);
    dq.resize(m * dd);
    srow.resize(n);
    dprow.resize(n);
    ds_row.resize(n);
  }
};

/// q . K^T (or dO . V^T) over the tile's keys: dst[c] = sum_d a[d] bt[d][c], pairwise over d.
void row_times_tile(const float* a, const float* bt, int dim, int cols, int bn, float* prod, float* dst) {
  for (int d = 0; d < dim; ++d) {
    const float ad = a[d];
    const float* bd = bt + static_cast<std::size_t>(d) * bn;
    float* pd = prod + static_cast<std::size_t>(d) * bn;
    for (int c = 0; c < cols; ++c) pd[c] = ad * bd[c];
  }
  pairwise_sum_rows(prod, dim, cols, bn);
  std::copy(prod, prod + cols, dst);
}

/// acc[d] += sum_r w[r] x[r][d] over n rows (pairwise over r), x rows `dim` apart.
void add_weighted_rows(const float* w, const float* x, int n, int dim, float* prod, float* acc) {
  for (int r = 0; r < n; ++r) {
    const float wr = w[r];
    const float* xr = x + static_cast<std::size_t>(r) * dim;
    float* pr = prod + static_cast<std::size_t>(r) * dim;
    for (int d = 0; d < dim; ++d) pr[d] = wr * xr[d];
  }
  pairwise_sum_rows(prod, n, dim, dim);
  for (int d = 0; d < dim; ++d) acc[d] += prod[d];
}

/// Everything one work item (b, hk, n) reads.
struct Item {
  int b = 0, hk = 0, n = 0;
  Sequence seq;
  MaskRules rules;
  walk::Tiles tiles;
  int j0 = 0, j1 = 0;
};

/// One (query tile m, key tile n) pair of head h: dV and dK of the tile, dS K into the accumulator.
void visit_pair(const Problem& pr, const Workspace& ws, const Item& it, const Logits& lg, int h, int m,
                const walk::TileVisit& v, Scratch& w) {
  const AttnBackwardParams& p = *pr.p;
  const BlockSparseMask* bs = p.mask.block_sparse;
  const int dim = pr.dim, dim_v = pr.dim_v, bn = w.bn, bm = w.bm;
  int i0, i1;
  it.tiles.q_rows(m, &i0, &i1);
  const int rows = i1 - i0, cols = it.j1 - it.j0;
  const Sequence& s = it.seq;
  for (int r = 0; r < rows; ++r) {
    load_row(p.q, row_offset(p.q, pr.varlen, it.b, s.first_q, i0 + r, h), dim, &w.q[static_cast<std::size_t>(r) * dim]);
    load_row(p.dout, row_offset(p.dout, pr.varlen, it.b, s.first_q, i0 + r, h), dim_v,
             &w.dout[static_cast<std::size_t>(r) * dim_v]);
    const std::int64_t row = h * ws.layout.rows + ws.row(s, it.b, i0 + r);
    w.row_lse2[r] = ws.lse2[row];
    w.row_delta[r] = ws.delta[row];
  }
  const float c = lg.score.c;
  const int offset = it.rules.offset();
  float* srow = w.srow.data();
  float* dprow = w.dprow.data();
  for (int r = 0; r < rows; ++r) {
    const int i = i0 + r, ia = i + offset;
    const int key_hi = it.rules.key_hi(i), key_lo = it.rules.key_lo(i);
    row_times_tile(&w.q[static_cast<std::size_t>(r) * dim], w.kt.data(), dim, cols, bn, w.prod.data(), srow);
    row_times_tile(&w.dout[static_cast<std::size_t>(r) * dim_v], w.vt.data(), dim_v, cols, bn, w.prod.data(), dprow);
    for (int col = 0; col < cols; ++col) {
      const int j = it.j0 + col;
      const float u = lg.score.raw(srow[col]);
      float t = lg.with_alibi(lg.softcap ? lg.score.softcap(u) : u, ia, j);
      if (v.need_mask) {  // MaskRules::visible(i, j), and the block's element bit
        const bool vis = j < key_hi && (j >= key_lo || j < it.rules.global_tokens) &&
                         (v.partial == walk::kFullBlock ||
                          walk::sparse_bit(*bs, v.partial, i % bs->block_m, j % bs->block_n));
        if (!vis) t = kNegInf;
      }
      const float pij = algebra::backward_p(t, c, w.row_lse2[r]);
      float ds = algebra::backward_ds(pij, dprow[col], w.row_delta[r]);
      if (lg.softcap) ds *= algebra::softcap_grad(lg.score, u);
      w.pt[static_cast<std::size_t>(col) * bm + r] = pij;
      w.dst[static_cast<std::size_t>(col) * bm + r] = ds;
    }
  }
  // dV_j += sum_r P(r, j) dO_r and dK_j += sum_r dS(r, j) Q_r (pairwise over the tile's rows).
  for (int col = 0; col < cols; ++col) {
    add_weighted_rows(&w.pt[static_cast<std::size_t>(col) * bm], w.dout.data(), rows, dim_v, w.prod.data(),
                      &w.dv[static_cast<std::size_t>(col) * dim_v]);
    add_weighted_rows(&w.dst[static_cast<std::size_t>(col) * bm], w.q.data(), rows, dim, w.prod.data(),
                      &w.dk[static_cast<std::size_t>(col) * dim]);
  }
  // This pair's dQ_r = sum_j dS(r, j) K_j (pairwise over the tile's keys).
  float* ds_row = w.ds_row.data();
  for (int r = 0; r < rows; ++r) {
    for (int col = 0; col < cols; ++col) ds_row[col] = w.dst[static_cast<std::size_t>(col) * bm + r];
    float* dq = &w.dq[static_cast<std::size_t>(r) * dim];
    std::fill(dq, dq + dim, 0.f);
    add_weighted_rows(ds_row, w.k.data(), cols, dim, w.prod.data(), dq);
  }
  // ... added to the accumulator rows of tile m: atomically, or in key order (header comment).
  float* acc = ws.dq + (h * ws.layout.rows + ws.row(s, it.b, i0)) * dim;
  if (p.deterministic) {
    std::atomic_ref<std::int32_t> sem(ws.sem[h * (ws.layout.rows / ws.layout.row_pad) + ws.row(s, it.b, i0) / ws.layout.row_pad]);
    const int rank = walk::key_tile_rank(it.rules, it.tiles, bs, it.b, h, m, it.n);
    while (sem.load(std::memory_order_acquire) != rank) std::this_thread::yield();
    for (int e = 0; e < rows * dim; ++e) acc[e] += w.dq[e];
    sem.store(rank + 1, std::memory_order_release);
  } else {
    for (int e = 0; e < rows * dim; ++e) std::atomic_ref<float>(acc[e]).fetch_add(w.dq[e], std::memory_order_relaxed);
  }
}

/// One work item: key tile n of (sequence b, KV head hk), every query head of the group.
void run_item(const Problem& pr, const Workspace& ws, int b, int hk, int n, Scratch& w) {
  const AttnBackwardParams& p = *pr.p;
  const MaskParams& mk = p.mask;
  Item it;
  it.b = b;
  it.hk = hk;
  it.n = n;
  it.seq = sequence(p, b);
  it.tiles = walk::Tiles::make(it.seq.len_q, it.seq.len_k, pr.bm, pr.bn, mk.block_sparse);
  if (n >= it.tiles.num_k_tiles()) return;  // varlen: this sequence has fewer key tiles
  it.tiles.k_cols(n, &it.j0, &it.j1);
  it.rules = MaskRules::make(it.seq.len_q, it.seq.len_k, mk.causal, mk.window_left, mk.window_right,
                             mk.global_tokens, mk.global_queries);
  const int dim = pr.dim, dim_v = pr.dim_v, bn = w.bn, cols = it.j1 - it.j0;
  for (int col = 0; col < cols; ++col) {
    float* krow = &w.k[static_cast<std::size_t>(col) * dim];
    load_row(p.k, row_offset(p.k, pr.varlen, b, it.seq.first_k, it.j0 + col, hk), dim, krow);
    float* vrow = w.prod.data();  // staging until the first pair
    load_row(p.v, row_offset(p.v, pr.varlen, b, it.seq.first_k, it.j0 + col, hk), dim_v, vrow);
    for (int d = 0; d < dim; ++d) w.kt[static_cast<std::size_t>(d) * bn + col] = krow[d];
    for (int d = 0; d < dim_v; ++d) w.vt[static_cast<std::size_t>(d) * bn + col] = vrow[d];
  }
  std::fill(w.dk.begin(), w.dk.end(), 0.f);
  std::fill(w.dv.begin(), w.dv.end(), 0.f);
  int m_lo = 0, m_hi = 0;
  walk::query_tiles(it.rules, it.tiles, n, &m_lo, &m_hi);
  for (int h = hk * pr.group; h < (hk + 1) * pr.group; ++h) {
    const Logits lg = Logits::make(p, b, h);
    for (int m = m_lo; m < m_hi; ++m) {
      const walk::TileVisit v = walk::visit(it.rules, it.tiles, mk.block_sparse, b, h, m, n);
      if (v.visit) visit_pair(pr, ws, it, lg, h, m, v, w);
    }
  }
  for (int col = 0; col < cols; ++col) {
    const std::int64_t dk = row_offset(p.dk, pr.varlen, b, it.seq.first_k, it.j0 + col, hk);
    const std::int64_t dv = row_offset(p.dv, pr.varlen, b, it.seq.first_k, it.j0 + col, hk);
    for (int d = 0; d < dim; ++d)
      store_from_float(p.dk.data, p.dk.dtype, dk + d, pr.scale * w.dk[static_cast<std::size_t>(col) * dim + d]);
    for (int d = 0; d < dim_v; ++d)
      store_from_float(p.dv.data, p.dv.dtype, dv + d, w.dv[static_cast<std::size_t>(col) * dim_v + d]);
  }
}

// ---- 3. postprocess ----------------------------------------------------------------------------------

void postprocess_head(const Problem& pr, const Workspace& ws, int b, int h) {
  const AttnBackwardParams& p = *pr.p;
  const Sequence s = sequence(p, b);
  for (int i = 0; i < s.len_q; ++i) {
    const float* acc = ws.dq + (h * ws.layout.rows + ws.row(s, b, i)) * pr.dim;
    const std::int64_t dst = row_offset(p.dq, pr.varlen, b, s.first_q, i, h);
    for (int d = 0; d < pr.dim; ++d) store_from_float(p.dq.data, p.dq.dtype, dst + d, pr.scale * acc[d]);
  }
}

int largest_divisor_at_most(int n, int cap) {
  for (int d = std::min(n, cap); d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

}  // namespace

int tiled_backward_block_m(const AttnBackwardParams& p, const RunOptions& opt) {
  const int want = opt.cpu_block_m > 0 ? opt.cpu_block_m : kDefaultBlock;
  const BlockSparseMask* bs = p.mask.block_sparse;
  return bs && bs->block_m > 0 ? largest_divisor_at_most(bs->block_m, want) : want;
}

int tiled_backward_block_n(const AttnBackwardParams& p, const RunOptions& opt) {
  const int want = opt.cpu_block_n > 0 ? opt.cpu_block_n : kDefaultBlock;
  const BlockSparseMask* bs = p.mask.block_sparse;
  return bs && bs->block_n > 0 ? std::min(want, bs->block_n) : want;
}

Status tiled_backward(const AttnBackwardParams& p, const RunOptions& opt, const BackwardWorkspaceLayout& layout) {
  if (layout.bytes == 0 || layout.row_pad != tiled_backward_block_m(p, opt) || p.workspace == nullptr ||
      p.workspace_bytes < layout.bytes)
    return Status::Internal("tiled_backward: the workspace was not validated against its layout");
  Problem pr;
  pr.p = &p;
  pr.dim = p.head_dim;
  pr.dim_v = p.effective_head_dim_v();
  pr.group = p.heads_q / p.heads_kv;
  pr.bm = layout.row_pad;
  pr.bn = tiled_backward_block_n(p, opt);
  pr.varlen = p.mask.is_varlen();
  pr.scale = p.effective_scale();
  pr.lse_rows = pr.varlen ? varlen_lse_rows(p.forward()) : 0;
  const Workspace ws(layout, p.workspace);
  const int dims = pr.dim + pr.dim_v;

  // 1. preprocess; the accumulator and the semaphores start at 0.
  std::memset(ws.dq, 0, static_cast<std::size_t>(p.heads_q) * layout.rows * p.head_dim * sizeof(float));
  if (ws.sem) std::memset(ws.sem, 0, static_cast<std::size_t>(p.heads_q) * (layout.rows / layout.row_pad) * sizeof(std::int32_t));
  const int heads_items = p.batch * p.heads_q;
  const int head_threads = threads_for(opt.cpu_threads, heads_items, static_cast<double>(p.seqlen_q) * dims);
  if (p.seqlen_q > 0 && p.seqlen_k > 0)
    parallel_for_scratch(heads_items, head_threads, [] { return std::vector<float>(); },
                         [&](std::int64_t item, std::vector<float>& buf) {
                           preprocess_head(pr, ws, static_cast<int>(item / p.heads_q), static_cast<int>(item % p.heads_q), buf);
                         });

  // 2. key tiles, (b, hk, n) ascending (the deterministic order needs it: parallel_for_scratch
  // starts an item only after every smaller one has started, and an item waits only for smaller ones).
  const walk::Tiles grid = walk::Tiles::make(p.seqlen_q, p.seqlen_k, pr.bm, pr.bn, p.mask.block_sparse);
  const int n_tiles = grid.num_k_tiles();
  const std::int64_t items = static_cast<std::int64_t>(p.batch) * p.heads_kv * n_tiles;
  if (items > std::numeric_limits<int>::max())
    return Status::Unsupported("tiled_backward: too many work items (" + std::to_string(items) + ")");
  const double per_tile = 3.0 * pr.group * static_cast<double>(p.seqlen_q) * pr.bn * dims;
  parallel_for_scratch(items, threads_for(opt.cpu_threads, items, per_tile),
                       [&] { return Scratch(pr.bm, pr.bn, pr.dim, pr.dim_v); },
                       [&](std::int64_t item, Scratch& w) {
                         const int b = static_cast<int>(item / (p.heads_kv * n_tiles));
                         const int rest = static_cast<int>(item % (p.heads_kv * n_tiles));
                         run_item(pr, ws, b, rest / n_tiles, rest % n_tiles, w);
                       });

  // 3. postprocess.
  parallel_for(heads_items, head_threads, [&](std::int64_t item) {
    postprocess_head(pr, ws, static_cast<int>(item / p.heads_q), static_cast<int>(item % p.heads_q));
  });
  zero_uncovered_grads(p);
  return Status::Ok();
}

}  // namespace flashcpp::cpu
