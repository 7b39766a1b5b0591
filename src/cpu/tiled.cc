// Tiled fp32 online-softmax attention on the CPU: the FA2 forward algorithm, tile for tile.
//
// One work item = one (batch, head, query tile of Br rows). Per row it keeps the online-softmax
// state (m, l) of common/attention_algebra.h (RowSoftmax, the state every GPU kernel keeps) and an
// unnormalized output accumulator acc, and visits Br x Bc key tiles:
//
//   S   = Q_tile . K_tile^T                     (fp32 dot products, raw q.k units u)
//   u   = transform(S), masked                  (ScoreTransform: softcap, ALiBi; -inf where hidden)
//   m'  = max(m, rowmax(u)),  corr = exp2((m - m') c)          c = |softmax_scale| * log2(e)
//   P   = exp2((u - m') c),   l = l corr + rowsum(P),  acc = acc corr + P . V_tile
//
// and at the end O = acc / l and LSE = (m c + log2 l) ln 2, natural log. A row that saw no key
// keeps l = 0 and gets O = 0, LSE = -inf; a row that saw a NaN score has l = NaN and gets NaN
// (attention.h). The derivation is in docs/online_softmax.md.
//
// Which key tiles are visited mirrors the GPU kernel exactly (src/common/mask_rules.h): the tiles
// of [lo, hi) that some row of the query tile sees through its window, from the last down to the
// first, then the attention-sink tiles (global keys) below the window; tiles that MaskRules
// proves fully visible skip the element mask. With a block-sparse mask the CSR list of the query
// block's key blocks is walked instead (also last to first), a query tile never straddles a
// sparse query block and a key tile never straddles a sparse key block.
//
// Numerics, and where they differ from the GPU on purpose:
// - The rules are the kernels' (common/attention_algebra.h, the same functions), evaluated as the
//   host evaluates them: exactly, in double, rounded once to fp32. So exp2 takes (u - m) c, a
//   difference first: the max's own term is exactly exp2(0) = 1 and no exponent is ever above 0,
//   at any magnitude, where the GPU's one FFMA fma(u, c, -fl(m c)) exponentiates the rounding
//   residual of m c (harmless for ordinary scores; past |m c| ~ 2^31 it overflows exp2: fp16 q and
//   k of ~1.6e4 at head_dim 128, tests/cpu/test_tiled.cc Tiled.HugeScoresStayFinite). Softcap is
//   cap tanh(u / cap) in double where the GPU uses two MUFU operations.
// - q.k over head_dim, and P.V and the row sum of P over a tile's keys, are pairwise (tree) sums,
//   added once per tile to the rescaled running values; see pairwise_sum_rows() in
//   tiled_common.h for why. With running sums this backend missed the 1e-6 bar against the fp64
//   reference (tests/cpu/test_tiled.cc tells the measurements); the GPU's MMA reduces k in
//   hardware trees too.
// - P stays fp32 for the P.V product; the GPU rounds P to fp16/bf16 for the tensor cores. So
//   this backend is the "fp32 everywhere" version of the algorithm, used to test the algorithm
//   and the mask walk, not the GPU's 16-bit rounding.
//
// Cost: per work item Q is loaded once and each visited K/V tile once (converted to fp32), and
// a tile costs 2*Br*Bc*D multiply-adds. Not tuned: it is here to be read against the GPU kernel
// and to be checked against the reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "flashcpp/half.h"
#include "common/attention_algebra.h"
#include "common/mask_rules.h"
#include "cpu/cpu_backend.h"
#include "cpu/tiled_common.h"
#include "cpu/parallel.h"

namespace flashcpp::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kDefaultBlockM = 64;  // Br: query rows per tile (the GPU kernel's BlockM)
constexpr int kDefaultBlockN = 64;  // Bc: key columns per tile (the GPU kernel's BlockN)
constexpr std::int32_t kFullBlock = -1;  // BlockSparseMask::partial value of a fully listed block

/// Converts `dim` elements of t starting at `offset` to fp32.
void load_row(const TensorView& t, std::int64_t offset, int dim, float* dst) {
  switch (t.dtype) {
    case DType::kF32: {
      const float* src = static_cast<const float*>(t.data) + offset;
      std::copy(src, src + dim, dst);
      return;
    }
    case DType::kBF16:
    case DType::kF16:
    case DType::kF64:  // validation keeps fp64 on the fp64 reference; converted here all the same
    case DType::kF8E4M3:  // refused by attention's validation; converted all the same
      for (int d = 0; d < dim; ++d) dst[d] = load_as_float(t.data, t.dtype, offset + d);
      return;
  }
}

/// Per-thread buffers, sized once for Br x Bc, D (q, k) and Dv (v, o).
struct Scratch {
  std::vector<float> q;     // [Br][D] query tile
  std::vector<float> kt;    // [D][Bc] key tile, transposed
  std::vector<float> v;     // [Bc][Dv] value tile
  std::vector<float> prod;  // products before their pairwise sum: Q.K^T [D][Bc], then P.V [Bc][Dv]
  std::vector<float> s;     // [Br][Bc] scores, then logits, then P
  std::vector<float> acc;   // [Br][Dv] unnormalized output accumulator
  std::vector<algebra::RowSoftmax> row;  // [Br] online-softmax state (m in raw units, l)
  std::vector<int> row_hi, row_lo;    // [Br] MaskRules key_hi / key_lo of each row of the tile
  Scratch(int br, int bc, int dim, int dim_v)
      : q(static_cast<std::size_t>(br) * dim), kt(static_cast<std::size_t>(dim) * bc),
        v(static_cast<std::size_t>(bc) * dim_v), prod(static_cast<std::size_t>(std::max(dim, dim_v)) * bc),
        s(static_cast<std::size_t>(br) * bc), acc(static_cast<std::size_t>(br) * dim_v), row(br),
        row_hi(br), row_lo(br) {}
};

/// Everything one work item needs to visit key tiles.
struct TileContext {
  const AttnParams* p = nullptr;
  int b = 0, h = 0, hk = 0, dim = 0, dim_v = 0;
  bool varlen = false;
  Sequence seq;
  MaskRules rules;
  Logits logits;
  int i0 = 0, rows = 0;  // query rows [i0, i0 + rows) of the sequence
  const BlockSparseMask* bs = nullptr;  // block-sparse mask, or null
  int bs_q_block = 0;                   // the sparse query block the rows lie in
};

bool sparse_bit(const BlockSparseMask& bs, std::int32_t partial, int i, int j) {
  const int words_per_row = (bs.block_n + 63) / 64;
  const int r = i % bs.block_m, c = j % bs.block_n;
  const std::uint64_t word =
      bs.element_masks[(static_cast<std::int64_t>(partial) * bs.block_m + r) * words_per_row + c / 64];
  return (word >> (c % 64)) & 1u;
}

/// One Br x Bc step of the online softmax: keys [j0, j0 + cols) against the tile's rows.
/// `need_mask`: some element may be hidden (else the tile was proven fully visible).
/// `partial`: the block-sparse element mask of these keys, or kFullBlock.
void visit_tile(const TileContext& c, Scratch& w, int j0, int cols, int bc, bool need_mask,
                std::int32_t partial) {
  const AttnParams& p = *c.p;
  const int dim = c.dim, dim_v = c.dim_v;
  // K^T and V tiles in fp32. K is transposed so that S = Q K^T runs over contiguous keys.
  for (int col = 0; col < cols; ++col) {
    const std::int64_t kofs = row_offset(p.k, c.varlen, c.b, c.seq.first_k, j0 + col, c.hk);
    const std::int64_t vofs = row_offset(p.v, c.varlen, c.b, c.seq.first_k, j0 + col, c.hk);
    load_row(p.v, vofs, dim_v, &w.v[static_cast<std::size_t>(col) * dim_v]);
    float* staging = w.prod.data();  // free until the products below
    load_row(p.k, kofs, dim, staging);
    for (int d = 0; d < dim; ++d) w.kt[static_cast<std::size_t>(d) * bc + col] = staging[d];
  }
  const int offset = c.rules.offset();
  for (int r = 0; r < c.rows; ++r) {
    const int i = c.i0 + r;
    const int ia = i + offset;
    float* srow = &w.s[static_cast<std::size_t>(r) * bc];
    const float* qrow = &w.q[static_cast<std::size_t>(r) * dim];
    // S row = q . K^T: every product, then a pairwise sum over d (vectorized over the keys).
    float* prod = w.prod.data();
    for (int d = 0; d < dim; ++d) {
      const float qd = qrow[d];
      const float* kd = &w.kt[static_cast<std::size_t>(d) * bc];
      float* pd = &prod[static_cast<std::size_t>(d) * bc];
      for (int col = 0; col < cols; ++col) pd[col] = qd * kd[col];
    }
    pairwise_sum_rows(prod, dim, cols, bc);
    std::copy(prod, prod + cols, srow);
    // Scores (raw units), masking, row max.
    algebra::RowSoftmax& rs = w.row[r];
    float m_new = rs.m;
    for (int col = 0; col < cols; ++col) {
      const int j = j0 + col;
      float u = c.logits(srow[col], ia, j);
      if (need_mask) {  // MaskRules::visible(i, j) with the row's bounds precomputed, and the bit
        const bool vis = j < w.row_hi[r] && (j >= w.row_lo[r] || j < c.rules.global_tokens) &&
                         (partial == kFullBlock || sparse_bit(*c.bs, partial, i, j));
        if (!vis) u = kNegInf;
      }
      srow[col] = u;
      m_new = std::max(m_new, u);  // a NaN score never wins the max: its P, and l, are NaN
    }
    // The kernels' step (RowSoftmax): corr = exp2((m - m') c), P = exp2((u - m') c); while the row
    // has seen nothing, P is taken against 0 (never -inf - (-inf) = NaN) and corr is 0.
    const float cf = c.logits.score.c;
    const float corr = rs.rescale(m_new, cf);
    const float mc = rs.offset(cf);
    // This tile's P.V and row sum, each a pairwise sum over the tile's keys (P.V vectorized over
    // d), added once to the rescaled running values.
    for (int col = 0; col < cols; ++col) {
      const float pr = rs.p(srow[col], cf, mc);
      srow[col] = pr;
      const float* vrow = &w.v[static_cast<std::size_t>(col) * dim_v];
      float* pd = &prod[static_cast<std::size_t>(col) * dim_v];
      for (int d = 0; d < dim_v; ++d) pd[d] = pr * vrow[d];
    }
    pairwise_sum_rows(prod, cols, dim_v, dim_v);
    pairwise_sum_rows(srow, cols, 1, 1);
    rs.accumulate(corr, srow[0]);
    float* acc = &w.acc[static_cast<std::size_t>(r) * dim_v];
    for (int d = 0; d < dim_v; ++d) acc[d] = acc[d] * corr + prod[d];
  }
}

/// Tile sizes and the number of query tiles per (batch, head).
struct Tiling {
  int br = kDefaultBlockM, bc = kDefaultBlockN;
  int tiles_per_head = 0;
  int sub_tiles = 1;  // block-sparse: query tiles per sparse query block
};

Tiling make_tiling(const AttnParams& p, const RunOptions& opt) {
  Tiling t;
  t.br = opt.cpu_block_m > 0 ? opt.cpu_block_m : kDefaultBlockM;
  t.bc = opt.cpu_block_n > 0 ? opt.cpu_block_n : kDefaultBlockN;
  if (const BlockSparseMask* bs = p.mask.block_sparse) {
    // Tiles never straddle a sparse block: a query tile lies inside one query block and a key
    // tile inside one listed key block.
    t.br = std::min(t.br, bs->block_m);
    t.bc = std::min(t.bc, bs->block_n);
    t.sub_tiles = (bs->block_m + t.br - 1) / t.br;
    t.tiles_per_head = (p.seqlen_q + bs->block_m - 1) / bs->block_m * t.sub_tiles;
  } else {
    t.tiles_per_head = (p.seqlen_q + t.br - 1) / t.br;
  }
  return t;
}

/// One work item: (batch b, head h, query tile `tile`).
void run_tile(const AttnParams& p, const Tiling& t, int b, int h, int tile, Scratch& w) {
  const MaskParams& m = p.mask;
  TileContext c;
  c.p = &p;
  c.b = b;
  c.h = h;
  c.hk = h / (p.heads_q / p.heads_kv);
  c.dim = p.head_dim;
  c.dim_v = p.effective_head_dim_v();
  c.varlen = m.is_varlen();
  c.seq = sequence(p, b);
  const int len_q = c.seq.len_q, len_k = std::max(c.seq.len_k, 0);
  c.bs = m.block_sparse;
  if (c.bs) {
    c.bs_q_block = tile / t.sub_tiles;
    c.i0 = c.bs_q_block * c.bs->block_m + (tile % t.sub_tiles) * t.br;
    const int block_end = std::min((c.bs_q_block + 1) * c.bs->block_m, len_q);
    c.rows = std::min(t.br, block_end - c.i0);
  } else {
    c.i0 = tile * t.br;
    c.rows = std::min(t.br, len_q - c.i0);
  }
  if (c.rows <= 0) return;  // varlen: this sequence is shorter than the grid
  c.rules = MaskRules::make(len_q, len_k, m.causal, m.window_left, m.window_right, m.global_tokens,
                            m.global_queries);
  c.logits = Logits::make(p, b, h);
  const int dim = c.dim, i0 = c.i0, i1 = c.i0 + c.rows;

  for (int r = 0; r < c.rows; ++r) {
    load_row(p.q, row_offset(p.q, c.varlen, b, c.seq.first_q, i0 + r, h), dim,
             &w.q[static_cast<std::size_t>(r) * dim]);
    w.row_hi[r] = c.rules.key_hi(i0 + r);
    w.row_lo[r] = c.rules.key_lo(i0 + r);
  }
  std::fill(w.row.begin(), w.row.end(), algebra::RowSoftmax{});
  std::fill(w.acc.begin(), w.acc.end(), 0.f);

  int lo = 0, hi = 0;
  c.rules.key_range(i0, i1, &lo, &hi);
  const int sink_hi = c.rules.sink_hi(i0, i1, lo);
  auto visit = [&](int j0, int j1, std::int32_t partial) {
    const bool need_mask = partial != kFullBlock || !c.rules.tile_fully_visible(i0, i1, j0, j1);
    visit_tile(c, w, j0, j1 - j0, t.bc, need_mask, partial);
  };

  if (c.bs) {
    const BlockSparseMask& bs = *c.bs;
    if (c.bs_q_block < bs.num_q_blocks) {
      const std::int64_t row =
          (static_cast<std::int64_t>(bs.num_batch == 1 ? 0 : b) * bs.num_heads +
           (bs.num_heads == 1 ? 0 : h)) * bs.num_q_blocks + c.bs_q_block;
      for (std::int32_t e = bs.row_ptr[row + 1] - 1; e >= bs.row_ptr[row]; --e) {
        const int kb = bs.col_idx[e];
        const int block_lo = kb * bs.block_n, block_hi = std::min(block_lo + bs.block_n, len_k);
        // Key tiles of this block, last to first, skipping those no row of the tile can see.
        const int n_sub = (block_hi - block_lo + t.bc - 1) / t.bc;
        for (int sub = n_sub - 1; sub >= 0; --sub) {
          const int j0 = block_lo + sub * t.bc, j1 = std::min(j0 + t.bc, block_hi);
          const bool in_window = j0 < hi && j1 > lo;
          const bool in_sinks = j0 < sink_hi;
          if (in_window || in_sinks) visit(j0, j1, bs.partial[e]);
        }
      }
    }
  } else {
    // Window tiles, last to first (the first tiles visited are the ones that need masking at
    // the causal/window diagonal), then the sink tiles that lie entirely below the window.
    const int first_block = lo / t.bc;
    const int end_block = (hi + t.bc - 1) / t.bc;
    for (int kb = end_block - 1; kb >= first_block; --kb)
      visit(kb * t.bc, std::min((kb + 1) * t.bc, len_k), kFullBlock);
    const int sink_end_block = std::min((sink_hi + t.bc - 1) / t.bc, first_block);
    for (int kb = sink_end_block - 1; kb >= 0; --kb)
      visit(kb * t.bc, std::min((kb + 1) * t.bc, len_k), kFullBlock);
  }

  // Epilogue (RowSoftmax::finalize): O = acc / l and the LSE; a row that saw no key (l == 0) has
  // O = 0 and LSE = -inf. Emptiness is l == 0, not m == -inf: a row whose every visible score is
  // NaN keeps m = -inf but has l = NaN, and must come out NaN (attention.h), as it does through
  // acc / l and log(l).
  const std::int64_t lse_rows = c.varlen ? varlen_lse_rows(p) : 0;
  for (int r = 0; r < c.rows; ++r) {
    const int i = i0 + r;
    const algebra::RowResult res = w.row[r].finalize(w.row[r].l, c.logits.score.c);
    const float* acc = &w.acc[static_cast<std::size_t>(r) * c.dim_v];
    const std::int64_t dst = row_offset(p.o, c.varlen, b, c.seq.first_q, i, h);
    for (int d = 0; d < c.dim_v; ++d)
      store_from_float(p.o.data, p.o.dtype, dst + d, w.row[r].l == 0.f ? 0.f : acc[d] / w.row[r].l);
    if (p.lse) {
      const std::int64_t at = c.varlen ? h * lse_rows + c.seq.first_q + i
                                       : (static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q + i;
      p.lse[at] = res.lse;
    }
  }
}

}  // namespace

Status tiled_forward(const AttnParams& p, const RunOptions& opt) {
  if (p.batch == 0 || p.seqlen_q == 0) {
    fill_uncovered_rows(p);  // varlen with total_q: every packed row is uncovered
    return Status::Ok();
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0 || p.head_dim <= 0 || p.effective_head_dim_v() <= 0)
    return Status::Invalid("tiled_forward: bad problem shape (call validate() first)");
  if (!p.q.data || !p.k.data || !p.v.data || !p.o.data)
    return Status::Invalid("tiled_forward: q, k, v and o must not be null");
  if (opt.cpu_block_m < 0 || opt.cpu_block_n < 0)
    return Status::Invalid("cpu_block_m and cpu_block_n must be >= 0 (0 = default 64)");
  const BlockSparseMask* bs = p.mask.block_sparse;
  if (bs && (bs->block_m <= 0 || bs->block_n <= 0))
    return Status::Invalid("block-sparse block_m and block_n must be > 0");

  const Tiling t = make_tiling(p, opt);
  const std::int64_t items64 = static_cast<std::int64_t>(p.batch) * p.heads_q * t.tiles_per_head;
  if (items64 > std::numeric_limits<int>::max())
    return Status::Unsupported("tiled_forward: too many work items (" + std::to_string(items64) + ")");
  const int items = static_cast<int>(items64);
  const int per_batch = p.heads_q * t.tiles_per_head;

  const double per_item = static_cast<double>(t.br) * p.seqlen_k * (p.head_dim + p.effective_head_dim_v());
  parallel_for_scratch(items, threads_for(opt.cpu_threads, items, per_item),
                       [&] { return Scratch(t.br, t.bc, p.head_dim, p.effective_head_dim_v()); },
                       [&](std::int64_t item, Scratch& w) {
                         const int b = static_cast<int>(item / per_batch), rest = static_cast<int>(item % per_batch);
                         run_tile(p, t, b, rest / t.tiles_per_head, rest % t.tiles_per_head, w);
                       });
  fill_uncovered_rows(p);  // varlen rows past cu_seqlens_q[batch], when total_q says how many
  return Status::Ok();
}

}  // namespace flashcpp::cpu
