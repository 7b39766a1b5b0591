// The main loop of the split-KV decode kernel (decode_kernel.cuh has the whole picture): which keys
// a CTA owns, the cp.async copies of its key tiles, the query rows into shared memory, and the
// per-warp recurrence over 16-key chunks with the shared algebra (common/attention_algebra.h,
// common/softmax.cuh): S = Q K^T in raw q.k units, softcap and ALiBi, the mask, the online softmax,
// O = O * corr + P V.
#pragma once

#include <cstdint>

#include "common/attention_algebra.h"
#include "common/decode_common.h"
#include "common/mask_rules.h"
#include "cuda/common/ptx.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/decode/decode_append.cuh"
#include "cuda/decode/decode_device.cuh"

namespace flashcpp::cuda::decode_dev {

using flashcpp::decode::Config;

/// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] tile.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return algebra::swizzled_offset<D>(row, chunk);
}

/// Byte offset of 16-code chunk `chunk` of row `row` in an fp8 stage ([rows][D] codes): the same
/// 128-byte XOR swizzle as a 16-bit tile, so the 8 rows one ldmatrix phase reads land in 8 bank
/// groups. Rows of D bytes: at D = 64 two rows share a 128-byte segment, so the XOR takes row / 2.
template <int D>
__device__ __forceinline__ int swz8(int row, int chunk) {
  if constexpr (D >= 128) return row * D + (algebra::swizzle_chunk(row, chunk) << 4);
  else return row * D + ((chunk ^ ((row >> 1) & 3)) << 4);
}

/// One CTA's work: (work item, KV head, row block) from blockIdx.x, the item's sequence and split,
/// and the split's key tiles [tile_begin, tile_end) of the keys its rows can see.
struct DecodeCta {
  int item, hk, rb, b, split, nsplit, len;
  MaskRules rules;
  int key_lo, key_hi, tile_begin, tile_end;
  /// The score transform and the output factor of this KV head: p.score and 1, or for an fp8
  /// cache softmax_scale * k_scale[hk] (made as the CPU backend makes it) and v_scale[hk].
  algebra::ScoreTransform score;
  float v_scale;

  __device__ __forceinline__ DecodeCta(const DecodeKernelParams& p, int block_n) {
    int bid = blockIdx.x;
    rb = bid % p.row_blocks;
    bid /= p.row_blocks;
    hk = bid % p.heads_kv;
    item = bid / p.heads_kv;
    item_of(p, item, &b, &split, &nsplit);
    len = flashcpp::decode::total_len(p.cache_seqlens[b], p.slots, p.seqlen_q, p.append != 0);
    rules = flashcpp::decode::sequence_rules(p.seqlen_q, len, p.causal != 0, p.window_left, p.window_right);
    rules.key_range(0, p.seqlen_q, &key_lo, &key_hi);
    flashcpp::decode::split_tiles(key_lo, key_hi, split, nsplit, block_n, &tile_begin, &tile_end);
    if (p.kv_fp8) {
      score = algebra::ScoreTransform::make(p.softmax_scale * __ldg(p.k_scale + hk), p.softcap);
      v_scale = __ldg(p.v_scale + hk);
    } else {
      score = p.score;
      v_scale = 1.f;
    }
  }
  __device__ __forceinline__ int n_iters() const { return tile_end - tile_begin; }
};

/// The producer side (every thread): copies of key tiles into the K/V ring, 16 bytes per thread and
/// row. A thread copies chunk c of rows r0, r0 + kRowsPerPass, ... of each tile. A chunk past the
/// tensor's own head dim (a head dim below the class D) copies 0 source bytes: cp.async zero-fills
/// it and reads nothing past the row. C is the cache's element: T or Fp8Code (byte stages); either
/// way the stage is swizzled as the warps' ldmatrix reads it (swz, swz8). Contiguous cache:
/// one row offset per tile, the rest by a constant stride. Paged: one block-table read per tile when
/// a page holds whole tiles (page_size >= BN; tiles start on multiples of BN), else one per row, all
/// loaded before the first copy is issued.
template <int D, typename C>
struct DecodeKvLoads {
  using Cfg = Config<D>;
  static constexpr int kElems = 16 / static_cast<int>(sizeof(C));  ///< elements per 16-byte copy
  static constexpr int BN = Cfg::kBlockN, kRowChunks = D / kElems, kRowsPerPass = Cfg::kThreads / kRowChunks;
  /// Dims a warp's MMA step covers (DecodeWarp: 16; DecodeWarp8: 32, one ldmatrix of codes): the
  /// warps read a stage's columns only up to the head dim rounded up to this, so the chunks past it
  /// are never copied (see DecodeWarp::chunk), and those inside it but past the head dim zero-fill.
  static constexpr int kStepDims = kFp8Cache<C> ? 32 : 16;
  const C* gK;
  const C* gV;
  int c, r0;
  int k_bytes, v_bytes;  ///< source bytes of chunk c inside head_dim / head_dim_v: 16, or 0 past them
  bool k_read, v_read;   ///< chunk c is read by the warps' MMA steps (else it is not copied at all)
  bool page_holds_tile;

  /// Bytes of chunk `chunk` inside a row of `dim` elements (16 when the head dim is the class).
  static __device__ __forceinline__ int chunk_bytes(int dim, int chunk) {
    const int left = (dim - chunk * kElems) * static_cast<int>(sizeof(C));
    return left >= 16 ? 16 : left > 0 ? left : 0;
  }

  __device__ __forceinline__ DecodeKvLoads(const DecodeKernelParams& p, int hk, int tid)
      : c(tid % kRowChunks), r0(tid / kRowChunks), k_bytes(chunk_bytes(p.head_dim, tid % kRowChunks)),
        v_bytes(chunk_bytes(p.head_dim_v, tid % kRowChunks)),
        k_read((tid % kRowChunks) * kElems < (p.head_dim + kStepDims - 1) / kStepDims * kStepDims),
        v_read((tid % kRowChunks) * kElems < (p.head_dim_v + kStepDims - 1) / kStepDims * kStepDims),
        page_holds_tile(p.paged && p.page_mask + 1 >= BN) {
    // A padding chunk keeps its row's first address: nothing is read, and it stays inside the view.
    gK = static_cast<const C*>(p.k_cache) + hk * p.k_head_stride + (k_bytes > 0 ? c * kElems : 0);
    gV = static_cast<const C*>(p.v_cache) + hk * p.v_head_stride + (v_bytes > 0 ? c * kElems : 0);
  }

  /// Element offset of chunk `chunk` of row `row` in a stage.
  static __device__ __forceinline__ int stage_offset(int row, int chunk) {
    if constexpr (kFp8Cache<C>) return swz8<D>(row, chunk);
    else return swz<D>(row, chunk);
  }

  /// Key tile `tile` of sequence b into ring stage `stage`; keys at or past key_hi are zero-filled.
  __device__ __forceinline__ void load(const DecodeKernelParams& p, C* sK, C* sV, int b, int key_hi, int stage,
                                       int tile) const {
    constexpr int kIt = BN / kRowsPerPass;
    C* dK = sK + stage * BN * D;
    C* dV = sV + stage * BN * D;
    const int j0 = tile * BN + r0;
    std::int64_t ko[kIt], vo[kIt];
    if (!p.paged || page_holds_tile) {
      kv_rows(p, b, j0, &ko[0], &vo[0]);
#pragma unroll
      for (int it = 1; it < kIt; ++it) {
        ko[it] = ko[0] + static_cast<std::int64_t>(it * kRowsPerPass) * p.k_seq_stride;
        vo[it] = vo[0] + static_cast<std::int64_t>(it * kRowsPerPass) * p.v_seq_stride;
      }
    } else {
      // Small pages: one block-table read per row, all issued before any is used (one round trip
      // per tile, not kIt in a row). Rows past the visible end read the last visible key's entry
      // and copy nothing.
      int page[kIt];
#pragma unroll
      for (int it = 0; it < kIt; ++it) page[it] = page_of(p, b, min(j0 + it * kRowsPerPass, key_hi - 1));
#pragma unroll
      for (int it = 0; it < kIt; ++it) kv_offsets(p, page[it], (j0 + it * kRowsPerPass) & p.page_mask, &ko[it], &vo[it]);
    }
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int r = r0 + it * kRowsPerPass;
      const bool ok = j0 + it * kRowsPerPass < key_hi;  // keys at or past the visible end are zero-filled, never read
      if (k_read) ptx::cp_async_16(ptx::smem_u32(dK + stage_offset(r, c)), gK + (ok ? ko[it] : 0), ok ? k_bytes : 0);
      if (v_read) ptx::cp_async_16(ptx::smem_u32(dV + stage_offset(r, c)), gV + (ok ? vo[it] : 0), ok ? v_bytes : 0);
    }
  }
};

/// The CTA's query rows (row r = head offset r / seqlen_q, token r % seqlen_q of KV head hk) into
/// swizzled shared memory, rotated at their positions when rotary is on (rounded to the dtype, as
/// the cache's keys are). Zero rows past p.rows, zero columns past head_dim.
template <int D, typename T>
__device__ __forceinline__ void decode_load_q(const DecodeKernelParams& p, const DecodeCta& cta, T* sQ, int row0,
                                              int cta_rows, int tid) {
  using Cfg = Config<D>;
  constexpr int kRowChunks = D / 8;
  const int Sq = p.seqlen_q;
  const T* gQ = static_cast<const T*>(p.q) + cta.b * p.q_batch_stride;
  for (int idx = tid; idx < cta_rows * kRowChunks; idx += Cfg::kThreads) {
    const int rr = idx / kRowChunks, c = idx % kRowChunks, gr = row0 + rr;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (gr < p.rows && c * 8 < p.head_dim) {
      const int h = cta.hk * p.group + gr / Sq, t = gr % Sq;
      val = __ldg(reinterpret_cast<const uint4*>(gQ + t * p.q_seq_stride + h * p.q_head_stride + c * 8));
    }
    *reinterpret_cast<uint4*>(sQ + swz<D>(rr, c)) = val;
  }
  if (p.rot_style != 0) {
    __syncthreads();
    const int half = p.rot_dim / 2;
    const RopeStyle style = p.rot_style == 2 ? RopeStyle::kInterleaved : RopeStyle::kNeox;
    for (int idx = tid; idx < cta_rows * half; idx += Cfg::kThreads) {
      const int rr = idx / half, i = idx % half, gr = row0 + rr;
      if (gr >= p.rows) continue;
      float c, s;
      rotary_cos_sin(p, cta.len - Sq + gr % Sq, i, &c, &s);
      int ea, eb;
      flashcpp::decode::rotary_pair(style, i, p.rot_dim, &ea, &eb);
      T* qa = sQ + swz<D>(rr, ea >> 3) + (ea & 7);
      T* qb = sQ + swz<D>(rr, eb >> 3) + (eb & 7);
      rotate_pair(qa, qb, qa, qb, c, s);
    }
  }
}

/// What both warps of the loop (DecodeWarp over a 16-bit stage, DecodeWarp8 over fp8 codes) keep
/// for rows g and g + 8 of their m16 tile (warp row block wr): each row's token, bottom-right key
/// position and ALiBi slope, its online-softmax state and the O accumulator; and the step from a
/// 16-key chunk's raw scores to P, which both loops take the same way.
template <int D>
struct DecodeRows {
  static constexpr int DT = D / 8;
  int row_t[2], row_ia[2];  ///< each row's token and bottom-right key position
  float row_slope[2];       ///< ALiBi slopes in raw units (0 without ALiBi)
  float acc_o[DT][4];
  RowSoftmax row[2];

  __device__ __forceinline__ DecodeRows(const DecodeKernelParams& p, const DecodeCta& cta, int row0, int wr, int lane) {
    const int g = lane / 4, Sq = p.seqlen_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int gr = min(row0 + wr * 16 + g + 8 * r, p.rows - 1);  // padding rows borrow a real row's constants
      row_t[r] = gr % Sq;
      row_ia[r] = row_t[r] + cta.len - Sq;
      row_slope[r] =
          p.alibi != nullptr ? cta.score.slope_raw(__ldg(p.alibi + cta.b * p.alibi_batch_stride + cta.hk * p.group + gr / Sq)) : 0.f;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  }

  /// The raw scores s of keys j_chunk .. j_chunk + 15 (q.k units; times row_scale[r] first when
  /// kRowScaled) through softcap, ALiBi and the mask (full: every key of the tile is visible to
  /// every row), then the online softmax: O *= corr only when some row's max moved, and P, packed
  /// as P_T two to a register, into the A fragment `a` of the P V MMAs.
  template <typename P_T, bool kRowScaled>
  __device__ __forceinline__ void scores_to_p(const DecodeKernelParams& p, const DecodeCta& cta, float (&s)[2][4],
                                              const float (&row_scale)[2], int j_chunk, bool full, int t4,
                                              std::uint32_t (&a)[4]) {
    const algebra::ScoreTransform& sc = cta.score;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, j = j_chunk + nt * 8 + 2 * t4 + (e & 1);
        float u = sc.raw(kRowScaled ? s[nt][e] * row_scale[r] : s[nt][e]);  // a negative softmax_scale: -q.k
        if (sc.cap > 0.f) u = sc.softcap(u);
        if (p.alibi != nullptr) u = algebra::alibi(u, row_slope[r], static_cast<float>(j - row_ia[r]));
        if (!full && !cta.rules.visible(row_t[r], j)) u = -INFINITY;
        s[nt][e] = u;
      }
    float corr[2];
    softmax_block<2>([&](int j, int k) -> float& { return s[j][k]; }, row, sc.c, corr);
    rescale_rows_if_moved<DT>([&](int j, int k) -> float& { return acc_o[j][k]; }, corr);
    a[0] = ptx::pack2<P_T>(s[0][0], s[0][1]);
    a[1] = ptx::pack2<P_T>(s[0][2], s[0][3]);
    a[2] = ptx::pack2<P_T>(s[1][0], s[1][1]);
    a[3] = ptx::pack2<P_T>(s[1][2], s[1][3]);
  }
};

/// One warp's share of the recurrence: rows g and g + 8 of its m16 tile (warp row block wr), the
/// 16-key chunks ch = wk, wk + WK, ... of each tile, its online-softmax state and O accumulator.
template <int D, typename T>
struct DecodeWarp : DecodeRows<D> {
  static constexpr int DT = D / 8, KT = D / 16;
  static constexpr std::uint32_t kRowBytes = D * 2;
  using DecodeRows<D>::acc_o;
  std::uint32_t q_base, k_base, v_base;

  __device__ __forceinline__ DecodeWarp(const DecodeKernelParams& p, const DecodeCta& cta, const T* sQ, const T* sK,
                                        const T* sV, int row0, int wr, int lane)
      : DecodeRows<D>(p, cta, row0, wr, lane) {
    // ldmatrix row addresses (see fa2_kernel.cuh): chunk 2*kk + c of a lane's row sits at
    // (row_base | ((c ^ row%8) << 4)) ^ (kk << 5); tiles and stages start on multiples of a row.
    const std::uint32_t r7 = lane & 7;
    q_base = ptx::smem_u32(sQ) + (wr * 16 + (lane & 15)) * kRowBytes + (((lane >> 4) ^ r7) << 4);
    k_base = ptx::smem_u32(sK) + ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((((lane >> 3) & 1) ^ r7) << 4);
    v_base = ptx::smem_u32(sV) + (lane & 15) * kRowBytes + (((lane >> 4) ^ r7) << 4);
  }

  /// Row r (g or g + 8) of the warp's O accumulator into an fp32 row of D columns.
  __device__ __forceinline__ void store_o(float* o_row, int r, int t4) const {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(o_row + dt * 8 + 2 * t4) = make_float2(acc_o[dt][2 * r], acc_o[dt][2 * r + 1]);
  }

  /// The 16 keys j_chunk .. j_chunk + 15 of the stage chunk at byte offset chunk_off. full: every
  /// key of the tile is visible to every row (no mask test).
  __device__ __forceinline__ void chunk(const DecodeKernelParams& p, const DecodeCta& cta, std::uint32_t chunk_off,
                                        int j_chunk, bool full, int t4) {
    // S = Q K^T for 16 rows x 16 keys, raw q.k units
    // A head dim below the class runs only the k16 steps that hold its dims (the loads copy no
    // column past them): a warp-uniform test, so 96 in the 128 class does 6 of 8 steps.
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      if (kk * 16 >= p.head_dim) break;
      std::uint32_t a[4], bk[4];
      ptx::ldmatrix_x4(a, q_base ^ (kk << 5));
      ptx::ldmatrix_x4(bk, (k_base + chunk_off) ^ (kk << 5));
      ptx::mma_16816<T>(s_acc[0], a, bk[0], bk[1]);
      ptx::mma_16816<T>(s_acc[1], a, bk[2], bk[3]);
    }
    // softcap, ALiBi, mask, online softmax; O += P V (P straight from the S fragments)
    std::uint32_t a[4];
    this->template scores_to_p<T, false>(p, cta, s_acc, {1.f, 1.f}, j_chunk, full, t4, a);
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      if (dp * 16 >= p.head_dim_v) break;  // likewise the n16 steps of O that hold head_dim_v's dims
      std::uint32_t bv[4];
      ptx::ldmatrix_x4_trans(bv, (v_base + chunk_off) ^ (dp << 5));
      ptx::mma_16816<T>(acc_o[2 * dp], a, bv[0], bv[1]);
      ptx::mma_16816<T>(acc_o[2 * dp + 1], a, bv[2], bv[3]);
    }
  }
};

/// Two e4m3 codes (the low 16 bits of x, lowest first) as an fp16 pair, exact (cvt.rn.f16x2.e4m3x2
/// on sm_89+).
__device__ __forceinline__ std::uint32_t f16x2_of_e4m3x2(std::uint32_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3);
  return static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
}

/// Over an fp8 cache the warps multiply in fp16: e4m3 -> fp16 is one cvt per pair (bf16 would take
/// four), and every e4m3 value is an fp16 value. So the CTA's query rows (q's dtype, in sQ) become
/// fp16 in place, each scaled by a power of two 2^e that puts the row's largest |q| in
/// [2^14, 2^15): nothing overflows, every element above 2^-24 of the scaled maximum keeps all its
/// bits (a smaller one weighs < 2^-38 of the row's largest term and rounds), and qinv[row] = 2^-e
/// undoes it on the scores. The dims are also permuted within each 16 so that the A fragment an
/// ldmatrix takes from the row pairs each k slot with the dim that an ldmatrix over codes puts in
/// the K fragment's slot (DecodeWarp8: k slots 2t, 2t+1, 2t+8, 2t+9 hold dims 4t .. 4t+3). A lane
/// owns 16 dims of a row: it reads and writes only those 32 bytes.
template <int D, typename T>
__device__ __forceinline__ void prepare_q_fp16(T* sQ, float* qinv, int cta_rows, int tid) {
  constexpr int kLanesPerRow = D / 16, kRowsPerPass = 32 / kLanesPerRow;
  const int warp = tid / 32, lane = tid % 32, sub = lane / kLanesPerRow, c = lane % kLanesPerRow;
  for (int r0 = warp * kRowsPerPass; r0 < cta_rows; r0 += Config<D>::kWarps * kRowsPerPass) {
    const int rr = r0 + sub;
    const bool ok = rr < cta_rows;
    uint4 raw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (ok) {
      raw[0] = *reinterpret_cast<const uint4*>(sQ + swz<D>(rr, 2 * c));
      raw[1] = *reinterpret_cast<const uint4*>(sQ + swz<D>(rr, 2 * c + 1));
    }
    const T* e16 = reinterpret_cast<const T*>(raw);
    float v[16], m = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = ptx::to_float(e16[i]);
      m = fmaxf(m, fabsf(v[i]));  // NaN is dropped here and kept in v
    }
#pragma unroll
    for (int o = kLanesPerRow / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int x = 0;
    if (m > 0.f && m <= 3.0e38f) frexpf(m, &x);  // m = f 2^x, f in [0.5, 1); 0 and inf keep e = 15
    const int e = min(max(15 - x, -126), 126);
    std::uint32_t out[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // slots 2k, 2k + 1 <- dims (k < 4: 4k, 4k + 1; else 4(k - 4) + 2, + 3)
      const int src = k < 4 ? 4 * k : 4 * (k - 4) + 2;
      out[k] = ptx::pack2<__half>(ldexpf(v[src], e), ldexpf(v[src + 1], e));
    }
    if (ok) {
      *reinterpret_cast<uint4*>(sQ + swz<D>(rr, 2 * c)) = make_uint4(out[0], out[1], out[2], out[3]);
      *reinterpret_cast<uint4*>(sQ + swz<D>(rr, 2 * c + 1)) = make_uint4(out[4], out[5], out[6], out[7]);
      if (c == 0) qinv[rr] = ldexpf(1.f, -e);
    }
  }
}

/// DecodeWarp over an fp8 stage: the same recurrence, with K and V fragments taken by ldmatrix
/// straight from the codes and converted in registers (no converted copy in shared memory, no
/// extra barrier), fp16 MMAs against the fp16 query rows of prepare_q_fp16, and P packed as fp16
/// (finer than bf16 on [0, 1]; a p below 2^-24 flushes, as in any fp16 attention).
///   K: an ldmatrix of 8 keys x 16 codes gives lane (g, t) codes 4t .. 4t+3 of key g, one cvt per
///      pair: the B fragment of that n8 x k16 block with k slots (2t, 2t+1, 2t+8, 2t+9) holding dims
///      4t .. 4t+3, the order prepare_q_fp16 gave Q.
///   V: an ldmatrix.trans of the same block gives lane (g, t) dims 2g, 2g+1 of keys 2t, 2t+1; one
///      byte permute makes the key pairs of dim 2g and of dim 2g+1, so a block of 16 dims feeds two
///      n8 tiles, the even dims (acc_o[2c]) and the odd ones (acc_o[2c + 1]). Lane (g, t) ends with
///      dims 16c + 4t .. 4t+3 of its rows (store_o).
template <int D, typename T>
struct DecodeWarp8 : DecodeRows<D> {
  static constexpr int DT = D / 8, KT = D / 16;
  static constexpr std::uint32_t kRowBytes = D;  ///< a stage row: D codes
  using DecodeRows<D>::acc_o;
  float row_qinv[2];  ///< 2^-e of each row's fp16 scale (prepare_q_fp16)
  std::uint32_t q_base, k_base, v_base;

  __device__ __forceinline__ DecodeWarp8(const DecodeKernelParams& p, const DecodeCta& cta, const T* sQ,
                                         const float* qinv, const Fp8Code* sK, const Fp8Code* sV, int row0, int wr,
                                         int lane)
      : DecodeRows<D>(p, cta, row0, wr, lane) {
    const int g = lane / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) row_qinv[r] = qinv[wr * 16 + g + 8 * r];
    const std::uint32_t r7 = lane & 7;
    q_base = ptx::smem_u32(sQ) + (wr * 16 + (lane & 15)) * (D * 2) + (((lane >> 4) ^ r7) << 4);
    // lanes 8m .. 8m + 7 address matrix m: keys 0-7 / 8-15 (m & 1) of the chunk, 16-code block
    // 2 kp + m / 2; kp enters as an XOR on the swizzled block (swz8), as in DecodeWarp
    const std::uint32_t f = D >= 128 ? r7 : (r7 >> 1) & 3;
    const std::uint32_t lane_off = (r7 + ((lane >> 3) & 1) * 8) * D + (((lane >> 4) ^ f) << 4);
    k_base = ptx::smem_u32(sK) + lane_off;
    v_base = ptx::smem_u32(sV) + lane_off;
  }

  /// As DecodeWarp::chunk (16 keys at byte offset chunk_off of the stages).
  __device__ __forceinline__ void chunk(const DecodeKernelParams& p, const DecodeCta& cta, std::uint32_t chunk_off,
                                        int j_chunk, bool full, int t4) {
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kp = 0; kp < KT / 2; ++kp) {
      if (kp * 32 >= p.head_dim) break;  // the 32-dim steps that hold head_dim's dims (DecodeWarp::chunk)
      std::uint32_t kf[4];  // keys 0-7 / 8-15 of dims 32 kp .. + 15, then of dims 32 kp + 16 .. + 31
      ptx::ldmatrix_x4(kf, (k_base + chunk_off) ^ (kp << 5));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        std::uint32_t a[4];
        ptx::ldmatrix_x4(a, q_base ^ ((2 * kp + h) << 5));
        ptx::mma_16816<__half>(s_acc[0], a, f16x2_of_e4m3x2(kf[2 * h]), f16x2_of_e4m3x2(kf[2 * h] >> 16));
        ptx::mma_16816<__half>(s_acc[1], a, f16x2_of_e4m3x2(kf[2 * h + 1]), f16x2_of_e4m3x2(kf[2 * h + 1] >> 16));
      }
    }
    std::uint32_t a[4];
    this->template scores_to_p<__half, true>(p, cta, s_acc, row_qinv, j_chunk, full, t4, a);
#pragma unroll
    for (int kp = 0; kp < KT / 2; ++kp) {
      if (kp * 32 >= p.head_dim_v) break;
      std::uint32_t vf[4];  // as kf, transposed: lane (g, t) holds dims 2g, 2g+1 of keys 2t, 2t+1
      ptx::ldmatrix_x4_trans(vf, (v_base + chunk_off) ^ (kp << 5));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * kp + h;
        const std::uint32_t lo = __byte_perm(vf[2 * h], 0, 0x3120);      // keys 2t, 2t+1: dim 2g | dim 2g+1
        const std::uint32_t hi = __byte_perm(vf[2 * h + 1], 0, 0x3120);  // keys 2t+8, 2t+9
        ptx::mma_16816<__half>(acc_o[2 * c], a, f16x2_of_e4m3x2(lo), f16x2_of_e4m3x2(hi));
        ptx::mma_16816<__half>(acc_o[2 * c + 1], a, f16x2_of_e4m3x2(lo >> 16), f16x2_of_e4m3x2(hi >> 16));
      }
    }
  }

  /// Row r (g or g + 8) of the warp's O accumulator into an fp32 row of D columns: lane (g, t) holds
  /// dims 16c + 4t .. 4t+3 (even dims in acc_o[2c], odd ones in acc_o[2c + 1]).
  __device__ __forceinline__ void store_o(float* o_row, int r, int t4) const {
#pragma unroll
    for (int c = 0; c < KT; ++c)
      *reinterpret_cast<float4*>(o_row + 16 * c + 4 * t4) =
          make_float4(acc_o[2 * c][2 * r], acc_o[2 * c + 1][2 * r], acc_o[2 * c][2 * r + 1], acc_o[2 * c + 1][2 * r + 1]);
  }
};

}  // namespace flashcpp::cuda::decode_dev
