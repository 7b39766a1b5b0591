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
/// it and reads nothing past the row. C is the cache's
/// element: T (16-bit stages, swizzled as the warps read them) or Fp8Code (byte stages, rows
/// unswizzled: the conversion pass reads them in order, convert_fp8_tile). Contiguous cache:
/// one row offset per tile, the rest by a constant stride. Paged: one block-table read per tile when
/// a page holds whole tiles (page_size >= BN; tiles start on multiples of BN), else one per row, all
/// loaded before the first copy is issued.
template <int D, typename C>
struct DecodeKvLoads {
  using Cfg = Config<D>;
  static constexpr int kElems = 16 / static_cast<int>(sizeof(C));  ///< elements per 16-byte copy
  static constexpr int BN = Cfg::kBlockN, kRowChunks = D / kElems, kRowsPerPass = Cfg::kThreads / kRowChunks;
  const C* gK;
  const C* gV;
  int c, r0;
  int k_bytes, v_bytes;  ///< source bytes of chunk c inside head_dim / head_dim_v: 16, or 0 past them
  bool page_holds_tile;

  /// Bytes of chunk `chunk` inside a row of `dim` elements (16 when the head dim is the class).
  static __device__ __forceinline__ int chunk_bytes(int dim, int chunk) {
    const int left = (dim - chunk * kElems) * static_cast<int>(sizeof(C));
    return left >= 16 ? 16 : left > 0 ? left : 0;
  }

  __device__ __forceinline__ DecodeKvLoads(const DecodeKernelParams& p, int hk, int tid)
      : c(tid % kRowChunks), r0(tid / kRowChunks), k_bytes(chunk_bytes(p.head_dim, tid % kRowChunks)),
        v_bytes(chunk_bytes(p.head_dim_v, tid % kRowChunks)), page_holds_tile(p.paged && p.page_mask + 1 >= BN) {
    // A padding chunk keeps its row's first address: nothing is read, and it stays inside the view.
    gK = static_cast<const C*>(p.k_cache) + hk * p.k_head_stride + (k_bytes > 0 ? c * kElems : 0);
    gV = static_cast<const C*>(p.v_cache) + hk * p.v_head_stride + (v_bytes > 0 ? c * kElems : 0);
  }

  /// Element offset of chunk `chunk` of row `row` in a stage.
  static __device__ __forceinline__ int stage_offset(int row, int chunk) {
    if constexpr (kFp8Cache<C>) return row * D + chunk * kElems;
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
      ptx::cp_async_16(ptx::smem_u32(dK + stage_offset(r, c)), gK + (ok ? ko[it] : 0), ok ? k_bytes : 0);
      ptx::cp_async_16(ptx::smem_u32(dV + stage_offset(r, c)), gV + (ok ? vo[it] : 0), ok ? v_bytes : 0);
    }
  }
};

/// An fp8 stage (K and V codes, rows in order) into the converted tile (q's dtype T, swizzled as a
/// 16-bit stage): each 16-byte chunk of codes becomes two 16-byte chunks of T. Exact (fp8x4_to), so
/// the warps compute q . code and P . code, and the scales act once per score and per row
/// (DecodeCta::score, v_scale).
template <int D, typename T>
__device__ __forceinline__ void convert_fp8_tile(const Fp8Code* s8K, const Fp8Code* s8V, T* sK, T* sV, int tid) {
  using Cfg = Config<D>;
  constexpr int kRowChunks = D / 16;
  const auto* k8 = reinterpret_cast<const unsigned char*>(s8K);
  const auto* v8 = reinterpret_cast<const unsigned char*>(s8V);
#pragma unroll
  for (int idx = tid; idx < Cfg::kBlockN * kRowChunks; idx += Cfg::kThreads) {
    const int r = idx / kRowChunks, c = idx % kRowChunks;
    const uint4 k = *reinterpret_cast<const uint4*>(k8 + r * D + c * 16);
    const uint4 v = *reinterpret_cast<const uint4*>(v8 + r * D + c * 16);
    const uint2 k0 = fp8x4_to<T>(k.x), k1 = fp8x4_to<T>(k.y), k2 = fp8x4_to<T>(k.z), k3 = fp8x4_to<T>(k.w);
    const uint2 v0 = fp8x4_to<T>(v.x), v1 = fp8x4_to<T>(v.y), v2 = fp8x4_to<T>(v.z), v3 = fp8x4_to<T>(v.w);
    *reinterpret_cast<uint4*>(sK + swz<D>(r, 2 * c)) = make_uint4(k0.x, k0.y, k1.x, k1.y);
    *reinterpret_cast<uint4*>(sK + swz<D>(r, 2 * c + 1)) = make_uint4(k2.x, k2.y, k3.x, k3.y);
    *reinterpret_cast<uint4*>(sV + swz<D>(r, 2 * c)) = make_uint4(v0.x, v0.y, v1.x, v1.y);
    *reinterpret_cast<uint4*>(sV + swz<D>(r, 2 * c + 1)) = make_uint4(v2.x, v2.y, v3.x, v3.y);
  }
}

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

/// One warp's share of the recurrence: rows g and g + 8 of its m16 tile (warp row block wr), the
/// 16-key chunks ch = wk, wk + WK, ... of each tile, its online-softmax state and O accumulator.
template <int D, typename T>
struct DecodeWarp {
  static constexpr int DT = D / 8, KT = D / 16;
  static constexpr std::uint32_t kRowBytes = D * 2;
  int row_t[2], row_ia[2];  ///< each row's token and bottom-right key position
  float row_slope[2];       ///< ALiBi slopes in raw units (0 without ALiBi)
  std::uint32_t q_base, k_base, v_base;
  float acc_o[DT][4];
  RowSoftmax row[2];

  __device__ __forceinline__ DecodeWarp(const DecodeKernelParams& p, const DecodeCta& cta, const T* sQ, const T* sK,
                                        const T* sV, int row0, int wr, int lane) {
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
    // ldmatrix row addresses (see fa2_kernel.cuh): chunk 2*kk + c of a lane's row sits at
    // (row_base | ((c ^ row%8) << 4)) ^ (kk << 5); tiles and stages start on multiples of a row.
    const std::uint32_t r7 = lane & 7;
    q_base = ptx::smem_u32(sQ) + (wr * 16 + (lane & 15)) * kRowBytes + (((lane >> 4) ^ r7) << 4);
    k_base = ptx::smem_u32(sK) + ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((((lane >> 3) & 1) ^ r7) << 4);
    v_base = ptx::smem_u32(sV) + (lane & 15) * kRowBytes + (((lane >> 4) ^ r7) << 4);
  }

  /// The 16 keys j_chunk .. j_chunk + 15 of the stage chunk at byte offset chunk_off. full: every
  /// key of the tile is visible to every row (no mask test).
  __device__ __forceinline__ void chunk(const DecodeKernelParams& p, const DecodeCta& cta, std::uint32_t chunk_off,
                                        int j_chunk, bool full, int t4) {
    const algebra::ScoreTransform& sc = cta.score;
    // S = Q K^T for 16 rows x 16 keys, raw q.k units
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      std::uint32_t a[4], bk[4];
      ptx::ldmatrix_x4(a, q_base ^ (kk << 5));
      ptx::ldmatrix_x4(bk, (k_base + chunk_off) ^ (kk << 5));
      ptx::mma_16816<T>(s_acc[0], a, bk[0], bk[1]);
      ptx::mma_16816<T>(s_acc[1], a, bk[2], bk[3]);
    }
    // softcap, ALiBi, mask
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, j = j_chunk + nt * 8 + 2 * t4 + (e & 1);
        float u = sc.raw(s_acc[nt][e]);  // a negative softmax_scale: the raw units are -q.k
        if (sc.cap > 0.f) u = sc.softcap(u);
        if (p.alibi != nullptr) u = algebra::alibi(u, row_slope[r], static_cast<float>(j - row_ia[r]));
        if (!full && !cta.rules.visible(row_t[r], j)) u = -INFINITY;
        s_acc[nt][e] = u;
      }
    // online softmax; O *= corr only when some row's max moved
    float corr[2];
    softmax_block<2>([&](int j, int k) -> float& { return s_acc[j][k]; }, row, sc.c, corr);
    rescale_rows_if_moved<DT>([&](int j, int k) -> float& { return acc_o[j][k]; }, corr);
    // O += P V (P straight from the S fragments)
    std::uint32_t a[4];
    a[0] = ptx::pack2<T>(s_acc[0][0], s_acc[0][1]);
    a[1] = ptx::pack2<T>(s_acc[0][2], s_acc[0][3]);
    a[2] = ptx::pack2<T>(s_acc[1][0], s_acc[1][1]);
    a[3] = ptx::pack2<T>(s_acc[1][2], s_acc[1][3]);
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      std::uint32_t bv[4];
      ptx::ldmatrix_x4_trans(bv, (v_base + chunk_off) ^ (dp << 5));
      ptx::mma_16816<T>(acc_o[2 * dp], a, bv[0], bv[1]);
      ptx::mma_16816<T>(acc_o[2 * dp + 1], a, bv[2], bv[3]);
    }
  }
};

}  // namespace flashcpp::cuda::decode_dev
