// FA3-style attention forward for sm_90a: TMA loads into a multi-stage shared-memory ring
// synchronized by mbarriers, a producer warpgroup (one thread issues the TMA copies), two consumer
// warpgroups with register reallocation (setmaxnreg), wgmma for S = Q K^T (both operands in
// shared memory) and O += P V (P from registers, V read MN-major from shared memory).
//
// A CTA owns kBlockM = 64 x kConsumers query rows of one (batch, head) (128, or 192 with three
// consumer warpgroups): consumer warpgroup c computes rows [64c, 64c + 64). Per key block, per
// consumer warpgroup:
//   wait K full -> S = Q K^T (wgmma.ss, D/16 k-steps) -> mask boundary tiles -> online softmax
//   (same recurrence as the sm80 kernel, exp2 with the scale folded in) -> P to 16-bit A fragments
//   -> wait V full -> O = O * corr + P V (wgmma.rs, BlockN/16 k-steps) -> release V.
// K and V of a stage are released separately: K as soon as Q K^T has read it, V after P V. The
// producer thread refills each as soon as both consumers released it. With one barrier for both,
// a pipelined consumer (P V of block j-1 still reading its stage while the softmax of block j
// runs) freed the stage of block j+1's keys only after that softmax, and with two stages the
// Q K^T of j+1 then waited for a fresh load every block.
//
// Masks: the same CtaWork as the sm80 kernel (prefill_mask.cuh): the producer and the consumers
// walk the same key tiles (window range, then attention sinks, or the listed blocks of a
// block-sparse mask); softcap and ALiBi rewrite S in raw units before the element mask (runtime
// flags, uniform branches). Varlen loads each sequence through the same rank-4 tensor maps with
// a shifted origin (fa3_dispatch.cc, encode_map): coordinate (x, seq_end) addresses
// packed row x + seq_end - max_len, and x >= max_len is out of bounds, so TMA zero-fills exactly
// the rows past this sequence's end, as it does past seqlen without varlen.
//
// Rotary (kRotary, prefill_rope.cuh): each consumer warpgroup rotates its 64 rows of the Q tile
// in shared memory after q_full, fences them for wgmma and syncs its 128 threads; the K/V loads
// of the first stages proceed meanwhile. The keys were rotated by a pre-pass (k_rotated).
//
// Persistent configs (Fa3Config::kPersistent): min(units, SMs) CTAs, each walking work units of
// two tiles (fa3_tile, common/tile_order.h). Every role loops over the same tiles, counting K/V stage uses across them
// (`ring`) and tiles (`done`) for the barrier phases; the producer loads a tile's first K/V stages
// before the consumers have finished the previous tile, and its Q after q_empty; O leaves through a
// TMA store from the Q buffer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/mask_rules.h"
#include "common/tile_order.h"
#include "cuda/common/hopper.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/prefill/fa3_params.h"
#include "cuda/prefill/prefill_mask.cuh"
#include "cuda/prefill/prefill_rope.cuh"

namespace flashcpp::cuda {
inline constexpr float kLn2Fa3 = 0.6931471805599453f;
}

namespace flashcpp::cuda {

template <int HeadDim, int BlockN, int Stages, bool PingPong = false, bool Sched = true, bool Persistent = false,
          int Consumers = 2>
struct Fa3Config {
  static constexpr int kHeadDim = HeadDim;
  /// Consumer warpgroups, 64 query rows each: 2 (BlockM 128), or 3 (BlockM 192, FA3's d64 tile:
  /// more rows per K/V stage, and with ping-pong two warpgroups' softmax under one's GEMMs).
  static constexpr int kConsumers = Consumers;
  static constexpr int kBlockM = 64 * Consumers;
  static constexpr int kBlockN = BlockN;           ///< keys per stage
  static constexpr int kStages = Stages;           ///< K/V ring depth
  /// Software-pipelined consumers (Q K^T of block j overlaps softmax of j and P V of j-1) with
  /// ping-pong scheduling: the two consumer warpgroups take turns issuing their wgmmas, so one
  /// warpgroup's softmax runs while the other's matrix products occupy the tensor cores.
  static constexpr bool kPingPong = PingPong;
  /// With kPingPong: whether the named-barrier turn-taking runs (false = the in-warpgroup
  /// overlap alone, config suffix "o").
  static constexpr bool kSched = PingPong && Sched;
  /// Persistent CTAs (config suffix "_persist"): a grid of min(units, SMs) CTAs, each walking work
  /// units blockIdx.x, + gridDim.x, ... (common/tile_order.h: two row blocks of equal causal cost,
  /// heads in L2-sized groups), with the next tile's K/V loads overlapping the current tile's last
  /// blocks and epilogue, and O stored by TMA from shared memory.
  static constexpr bool kPersistent = Persistent;
  static constexpr int kThreads = 128 * (1 + Consumers);  ///< producer warpgroup + the consumers
  static constexpr int kPanels = HeadDim / 64;     ///< 64-column (128-byte) panels per row
  static constexpr int kQBytes = kBlockM * HeadDim * 2;
  static constexpr int kKVBytes = BlockN * HeadDim * 2;
  static constexpr int kBarrierBytes = 256;
  /// Rotary: each consumer warpgroup's copy of the fp64 inv_freq table (128 pairs at most).
  static constexpr int kRopeBytes = Consumers * 128 * 8;
  static constexpr int kSmemBytes =
      kCtaWorkBytes + 1024 /*align*/ + kQBytes + 2 * Stages * kKVBytes + kBarrierBytes + kRopeBytes;
  /// setmaxnreg budgets (multiples of 8; the 64K-register file split over the warpgroups).
  static constexpr int kProducerRegs = Consumers == 3 ? 32 : BlockN > 128 ? 24 : 40;
  static constexpr int kConsumerRegs = Consumers == 3 ? 160 : BlockN > 128 ? 240 : 232;
  static_assert(HeadDim % 64 == 0 && BlockN % 16 == 0 && BlockN <= 256);
  static_assert(8 * (2 + 4 * Stages) <= kBarrierBytes, "the mbarriers fit their bytes");
  static_assert(kSmemBytes <= 227 * 1024, "one CTA's shared memory fits an sm_90 SM (227 KB per block)");
  static_assert(Consumers == 2 || Consumers == 3, "two or three consumer warpgroups");
  static_assert(kProducerRegs * 128 + Consumers * kConsumerRegs * 128 <= 65536, "register file");
};

/// Byte offset of 16-byte chunk `chunk` (columns 8 chunk .. 8 chunk + 7) of row r in a tile of
/// Rows rows stored as 64-column panels of 128-byte rows in the TMA 128B swizzle (chunk c of a
/// panel row at c ^ (r % 8)); the tile starts 1024-byte aligned.
template <int Rows>
__device__ __forceinline__ std::uint32_t swizzled_chunk(int r, int chunk) {
  return (chunk >> 3) * (Rows * 128) + r * 128 + (((chunk & 7) ^ (r & 7)) << 4);
}

/// One (row block, head, batch) tile of the launch.
struct Fa3Tile {
  int m_block, h, b;
};

/// %ctaid / %nctaid read anew where a role needs them (volatile: not merged with the kernel entry's
/// reads). A value computed before the producer / consumer split stays live into the producer's
/// 40-register region, and ptxas then spills it for the whole kernel, consumers' hot loop included.
__device__ __forceinline__ int fresh_sreg_ctaid(int dim) {
  unsigned v;
  if (dim == 0)
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  else if (dim == 1)
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(v));
  else
    asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(v));
  return static_cast<int>(v);
}
__device__ __forceinline__ int fresh_sreg_nctaid_x() {
  unsigned v;
  asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(v));
  return static_cast<int>(v);
}

/// Tile `half` of work unit `i`. Non-persistent: the CTA's own tile (blockIdx; row blocks of one
/// head run together so K/V stay in L2, heaviest causal block first). Persistent: units of two row
/// blocks of equal total causal cost, in L2-sized head groups (common/tile_order.h); m_block is -1
/// for the missing second tile of a one-tile unit.
template <class Cfg>
__device__ __forceinline__ Fa3Tile fa3_tile(const Fa3Params& p, int i, int half) {
  if constexpr (!Cfg::kPersistent) {
    return Fa3Tile{fresh_sreg_nctaid_x() - 1 - fresh_sreg_ctaid(0), fresh_sreg_ctaid(1), fresh_sreg_ctaid(2)};
  } else {
    const TileCoord c = persistent_tile(i, half, p.m_blocks, p.heads_q, p.batch, p.tile_heads);
    return Fa3Tile{c.m_block, c.h, c.b};
  }
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fa3_forward_kernel(const __grid_constant__ Fa3Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a pass
  constexpr int D = Cfg::kHeadDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN, S = Cfg::kStages;
  constexpr int NC = BN / 8;   // n8 column chunks of S per row
  constexpr int DC = D / 8;    // n8 column chunks of O per row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // 1024-byte alignment for the 128B-swizzle atoms (TMA writes them, wgmma reads them).
  // The CtaWork record sits first, at a fixed address (no register holds its base).
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw + kCtaWorkBytes) + 1023) & ~std::uintptr_t(1023));
  T* sQ = reinterpret_cast<T*>(base);                       // [panel][BM][64]
  T* sK = reinterpret_cast<T*>(base + Cfg::kQBytes);        // [stage][panel][BN][64]
  T* sV = reinterpret_cast<T*>(base + Cfg::kQBytes + S * Cfg::kKVBytes);
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(base + Cfg::kQBytes + 2 * S * Cfg::kKVBytes);
  std::uint64_t* q_full = bars;
  std::uint64_t* k_full = bars + 1;
  std::uint64_t* v_full = bars + 1 + S;
  std::uint64_t* k_empty = bars + 1 + 2 * S;  // both consumers' Q K^T read stage s's keys
  std::uint64_t* v_empty = bars + 1 + 3 * S;  // both consumers' P V read stage s's values
  // Persistent: both consumer warpgroups are done with the tile's Q buffer (also the O staging
  // area), so the producer may load the next tile's Q (2 arrivals).
  std::uint64_t* q_empty = bars + 1 + 4 * S;
  const bool rotary = p.mask.flags & PrefillMask::kRotary;

  const int tid = threadIdx.x, wg = tid / 128;
  // The tile's work (sequence, key walk) in shared memory. Non-persistent: every thread computes
  // it, thread 0 stores it, the barrier-init __syncthreads publishes it. Persistent: the producer
  // thread stores each tile's record before its Q load (after q_empty of the previous tile), and
  // the consumers / rotators read it after that Q barrier; the others only test the tile exists.
  CtaWork& cta = *reinterpret_cast<CtaWork*>(smem_raw);
  const bool varlen = p.mask.flags & PrefillMask::kVarlen;
  // This CTA's work units: [first, end) by step (persistent: blockIdx.x, + gridDim.x, ... of the
  // units of tile_order.h; else its one tile).
  auto tile_first = [] { return Cfg::kPersistent ? fresh_sreg_ctaid(0) : 0; };
  auto tile_step = [] { return Cfg::kPersistent ? fresh_sreg_nctaid_x() : 1; };
  const int tile_end = Cfg::kPersistent ? p.n_units : 1;
  constexpr int kHalves = Cfg::kPersistent ? 2 : 1;  // tiles per unit (persistent: heavy, then light)
  if constexpr (!Cfg::kPersistent) {
    const Fa3Tile tl = fa3_tile<Cfg>(p, 0, 0);
    CtaWork w;
    if (!make_cta_work<BM, BN>(p, tl.b, tl.h, tl.m_block * BM, &w)) return;  // varlen: past this sequence's end
    if (tid == 0) cta = w;
  }

  if (tid == 0) {
    sm90::mbar_init(q_full, 1);
    for (int s = 0; s < S; ++s) {
      sm90::mbar_init(&k_full[s], 1);
      sm90::mbar_init(&v_full[s], 1);
      sm90::mbar_init(&k_empty[s], 4 * Cfg::kConsumers);  // one arrival per consumer warp
      sm90::mbar_init(&v_empty[s], 4 * Cfg::kConsumers);
    }
    sm90::mbar_init(q_empty, Cfg::kConsumers);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    sm90::setmaxnreg_dec<Cfg::kProducerRegs>();
    // Each role walks the same tiles; `ring` counts K/V stage uses across them (stage ring % S,
    // phase (ring / S) & 1) and `done` the tiles (q barrier phase done & 1).
    if (tid == 0) {
      std::uint32_t ring = 0, done = 0;
      for (int ti = tile_first(), step = tile_step(); ti < tile_end; ti += step)
      for (int half = 0; half < kHalves; ++half) {
        const Fa3Tile tl = fa3_tile<Cfg>(p, ti, half);
        if (tl.m_block < 0) continue;  // a unit of one tile
        const int m0 = tl.m_block * BM, hk = tl.h / p.group;
        CtaWork own;  // persistent: this tile's record, computed here (the smem one may still be in use)
        if constexpr (Cfg::kPersistent)
          if (!make_cta_work<BM, BN>(p, tl.b, tl.h, m0, &own)) continue;
        const CtaWork& w = Cfg::kPersistent ? own : cta;
        // Tensor-map coordinates (row, outer) of this sequence's first row: (0, b), or with varlen
        // (max_len - len, first_row + len) of the shifted maps (see the header comment).
        const int q_x0 = varlen ? p.seqlen_q - w.rules.seqlen_q : 0;
        const int q_c3 = varlen ? static_cast<int>(w.q_row0) + w.rules.seqlen_q : tl.b;
        const int k_x0 = varlen ? p.seqlen_k - w.rules.seqlen_k : 0;
        const int k_c3 = varlen ? static_cast<int>(w.k_row0) + w.rules.seqlen_k : tl.b;
        auto load_kv = [&](int it) {
          const int s = ring % S;
          const std::uint32_t free_phase = ((ring / S) & 1) ^ 1;  // first pass: the "previous" phase counts as done
          const int n0 = w.key_n0<BN>(it);
          sm90::mbar_wait(&k_empty[s], free_phase);
          sm90::mbar_expect_tx(&k_full[s], Cfg::kKVBytes);
#pragma unroll
          for (int pn = 0; pn < Cfg::kPanels; ++pn)
            sm90::tma_load_4d(sK + (s * Cfg::kPanels + pn) * BN * 64, &p.tmap_k, pn * 64, k_x0 + n0, hk, k_c3, &k_full[s]);
          sm90::mbar_wait(&v_empty[s], free_phase);
          sm90::mbar_expect_tx(&v_full[s], Cfg::kKVBytes);
#pragma unroll
          for (int pn = 0; pn < Cfg::kPanels; ++pn)
            sm90::tma_load_4d(sV + (s * Cfg::kPanels + pn) * BN * 64, &p.tmap_v, pn * 64, k_x0 + n0, hk, k_c3,
                              &v_full[s]);
          ++ring;
        };
        // Persistent: the first stages of this tile load while the consumers finish the previous
        // tile; its Q (and the record) wait until they released the Q buffer.
        const int early = Cfg::kPersistent ? min(S, w.n_iters) : 0;
        for (int it = 0; it < early; ++it) load_kv(it);
        if constexpr (Cfg::kPersistent) {
          if (done > 0) sm90::mbar_wait(q_empty, (done - 1) & 1);
          cta = w;  // published by the Q barrier (this thread's arrive.expect_tx releases it)
        }
        sm90::mbar_expect_tx(q_full, Cfg::kQBytes);
#pragma unroll
        for (int pn = 0; pn < Cfg::kPanels; ++pn)
          sm90::tma_load_4d(sQ + pn * BM * 64, &p.tmap_q, pn * 64, q_x0 + m0, tl.h, q_c3, q_full);
        for (int it = early; it < w.n_iters; ++it) load_kv(it);
        ++done;
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int c = wg - 1;                  // rows [64c, 64c+64) of the tile
  const int ct = tid - 128 * wg;         // thread index inside the warpgroup
  const int warp = ct / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
  const std::uint32_t q_addr = ptx::smem_u32(sQ) + 64 * c * 128;  // this warpgroup's 64 rows
  // Rotary without a cache: this warpgroup's copy of inv_freq in shared memory (a warp reads 16
  // different pairs at once: one shared-memory access, but 16 serialized kernel-parameter reads).
  double* inv_freq = reinterpret_cast<double*>(reinterpret_cast<unsigned char*>(bars) + Cfg::kBarrierBytes) + 128 * c;
  if (rotary && p.rope.cache == nullptr) {
    for (int i = ct; i < p.rope.half; i += 128) inv_freq[i] = p.rope.inv_freq[i];
    sm90::named_barrier_sync(1 + c, 128);
  }
  std::uint32_t ring = 0, done = 0;
  for (int ti = tile_first(), step = tile_step(); ti < tile_end; ti += step)
  for (int half = 0; half < kHalves; ++half) {
  const Fa3Tile tl = fa3_tile<Cfg>(p, ti, half);
  if (tl.m_block < 0) continue;  // a unit of one tile
  const int h = tl.h, b = tl.b, m0 = tl.m_block * BM;
  if constexpr (Cfg::kPersistent)
    if (!tile_exists(p, b, m0)) continue;
  const int row_base = m0 + 64 * c + 16 * warp + g;  // query row of this thread's r = 0 values

  float acc_o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  sm90::mbar_wait(q_full, done & 1);
  const int n_iters = cta.n_iters;  // the record is this tile's until this warpgroup arrives on q_empty
  const PlainIters plain = plain_iters<BN>(p, cta, m0);  // tiles that skip mask() outright
  if (rotary) {
    // This warpgroup's 64 rows of Q, rotated in place (generic-proxy writes, fenced for the wgmma
    // reads of the async proxy), then its 128 threads meet before the first Q K^T. Items per round:
    // 4, or fewer where the persistent consumers' registers are short (ptxas: no spill at d64/d128;
    // d256 persistent spills 72 bytes, 100 before rotary moved here).
    const int r0 = m0 + 64 * c;
    rope_tile<T, Cfg::kPersistent ? (D >= 256 ? 1 : 2) : 4>(p.rope, inv_freq, rope_seq_positions(p.rope.positions_q, varlen, cta.q_row0, b, p.seqlen_q), r0,
                    cta.rules.seqlen_k - cta.rules.seqlen_q, max(0, min(64, cta.m_end - r0)), ct, 128,
                    [sq = ptx::smem_u32(sQ), c](int r, int col) {
                      return sq + swizzled_chunk<BM>(64 * c + r, col >> 3) + (col & 7) * 2;
                    });
    sm90::fence_proxy_async_smem();
    sm90::named_barrier_sync(1 + c, 128);
  }

  const std::uint32_t k_base = ptx::smem_u32(sK), v_base = ptx::smem_u32(sV);
  // Issue S = Q K^T for stage s (D/16 k-steps; the first overwrites S).
  auto issue_qk = [&](float (&acc_s)[BN / 2], int s) {
    const std::uint32_t k_addr = k_base + s * Cfg::kKVBytes;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int pn = kk / 4, off = (kk % 4) * 32;  // 64-column panel, then 32 bytes per k16 step
      const std::uint64_t da = sm90::make_desc(q_addr + pn * BM * 128 + off, 16, 1024);
      const std::uint64_t db = sm90::make_desc(k_addr + pn * BN * 128 + off, 16, 1024);
      sm90::wgmma_ss<BN, T>(acc_s, da, db, kk > 0 ? 1 : 0);
    }
  };
  // Issue O += P V for stage s: 16 keys = 2 K-groups of 8 rows x 128 B per k-step; panels of
  // 64 head-dim columns are BN*128 B apart (the MN-major leading byte offset).
  auto issue_pv = [&](const std::uint32_t (&pa)[BN / 16][4], int s) {
    const std::uint32_t v_addr = v_base + s * Cfg::kKVBytes;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      sm90::wgmma_rs<D, T>(acc_o, pa[kk], sm90::make_desc(v_addr + kk * 16 * 128, BN * 128, 1024), 1);
  };
  // Score modifiers (raw units: softcap, then ALiBi), then the element mask of a boundary or
  // partial tile (interior tiles skip it). acc_s[4j + 2r + e1] is row row_base + 8r, key
  // n0 + 8j + 2t + e1.
  // ALiBi adds only its column term slope * (key - ref), ref = the tile's first query row in key
  // coordinates: the row term -slope * (row - ref) is a per-row constant, which softmax ignores;
  // the epilogue adds it to LSE. One FFMA per column pair (shared by both rows) and one FADD per
  // score, instead of an FADD + FFMA per score.
  const int alibi_ref = m0 + cta.rules.offset();
  auto mask = [&](float (&acc_s)[BN / 2], int it) {
    if (plain.contains(it)) return;  // two register compares: no record lookup on the hot path
    const KeyTile kt = cta.key_tile<BN>(it);
    const int n0 = kt.n0;
    const MaskRules& rules = cta.rules;
    if (p.mask.flags & (PrefillMask::kSoftcap | PrefillMask::kAlibi)) {
      if (p.mask.flags & PrefillMask::kSoftcap) {
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc_s[e] = softcap_raw(acc_s[e], p.mask.softcap_raw, p.mask.softcap_k);
      }
      if (p.mask.flags & PrefillMask::kAlibi) {
        const float slope = alibi_slope_raw(p, b, h);
        const float base = slope * static_cast<float>(n0 + 2 * t - alibi_ref);  // |n0 + 2t - ref| < 2^24: exact
#pragma unroll
        for (int j = 0; j < NC; ++j)
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const float bias = fmaf(slope, static_cast<float>(8 * j + e1), base);
            acc_s[4 * j + e1] += bias;
            acc_s[4 * j + 2 + e1] += bias;
          }
      }
    }
    if (kt.partial < 0 && rules.tile_fully_visible(m0, cta.m_end, n0, n0 + BN)) return;
    constexpr bool kSparseBits = !Cfg::kPingPong;  // only plain consumers read element bits (below)
    static_assert(!kSparseBits || BN % 64 == 0 || 64 % BN == 0, "a key tile covers whole 64-bit words or lies in one");
    constexpr int kWords = kSparseBits && BN >= 64 ? BN / 64 : 1;  // element-mask words a tile row spans
    constexpr int kChunksPerWord = NC / kWords;     // n8 chunks of S per word
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row_base + 8 * r;
      const int hi = rules.key_hi(i), lo = rules.key_lo(i);
      // Block-sparse element bits: plain consumers only. The ping-pong consumer runs this while
      // P V of the previous block holds its accumulators and A fragments, and the bit lookup
      // spilled there (108 bytes at hdim 128); dispatch gives block-sparse masks a plain config.
      const std::uint64_t* rb = nullptr;
      if constexpr (!Cfg::kPingPong)
        if (kt.partial >= 0) rb = sparse_row_bits(p.mask, kt.partial, i - cta.bs_q0, kt.c0);
      const int bit0 = (kt.c0 & 63) + 2 * t;
#pragma unroll
      for (int wd = 0; wd < kWords; ++wd) {
        // One word at a time, loaded next to its use: the ping-pong consumer has no registers to spare.
        const std::uint64_t bits = rb != nullptr ? __ldg(rb + wd) : ~0ull;
#pragma unroll
        for (int jj = 0; jj < kChunksPerWord; ++jj)
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int j = wd * kChunksPerWord + jj;
            const int col = n0 + 8 * j + 2 * t + e1;
            const bool bit = !kSparseBits || ((bits >> (bit0 + 8 * jj + e1)) & 1u);
            if (!(col < hi && (col >= lo || col < rules.global_tokens) && bit)) acc_s[4 * j + 2 * r + e1] = -INFINITY;
          }
      }
    }
  };
  // Online softmax of one block (raw-score max, exp2 with the scale folded in): S becomes P in
  // place, row stats update, corr[r] = exp2((m_old - m_new) * c) is returned for the O rescale.
  // Lazy rescale: a row's reference max moves only when the block's max exceeds it by more than
  // kLazyLog2 in exp2 units; otherwise P = exp2(s c - m_ref c) <= 2^kLazyLog2 (exact enough in
  // fp32, and P's 16-bit rounding is relative), O and l keep their scale, corr = 1, and the O
  // rescale is skipped for a warp none of whose rows moved. Past the first blocks a row's max
  // rarely grows by that much, so most blocks skip the D/2 multiplies. O / l and the LSE use the
  // same reference max, so the result is the exact softmax either way.
  constexpr float kLazyLog2 = 8.f;
  auto softmax = [&](float (&acc_s)[BN / 2], float (&corr)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float old = row_max[r];
      float mx = old;
#pragma unroll
      for (int j = 0; j < NC; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const bool move = old == -INFINITY || (mx - old) * p.scale_log2 > kLazyLog2;
      const float m_ref = move ? mx : old;
      const float m_use = m_ref == -INFINITY ? 0.f : m_ref * p.scale_log2;
      corr[r] = move ? ptx::exp2_approx(old * p.scale_log2 - m_use) : 1.f;
      row_max[r] = m_ref;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        const float x0 = fmaf(acc_s[4 * j + 2 * r], p.scale_log2, -m_use);
        const float x1 = fmaf(acc_s[4 * j + 2 * r + 1], p.scale_log2, -m_use);
        const float p0 = ptx::exp2_approx(x0);
        const float p1 = ptx::exp2_approx(x1);
        acc_s[4 * j + 2 * r] = p0;
        acc_s[4 * j + 2 * r + 1] = p1;
        sum += p0 + p1;
      }
      row_sum[r] = row_sum[r] * corr[r] + sum;
    }
  };
  auto rescale_o = [&](const float (&corr)[2]) {
    if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;  // no row of this warp moved
#pragma unroll
    for (int j = 0; j < DC; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= corr[e >> 1];
  };
  // P as wgmma A fragments: k16 step kk covers S chunks 2kk (a0, a1) and 2kk+1 (a2, a3).
  auto pack_p = [&](const float (&acc_s)[BN / 2], std::uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = ptx::pack2<T>(acc_s[8 * kk + 2 * e], acc_s[8 * kk + 2 * e + 1]);
  };
  auto release_k = [&](int s) {
    if (lane == 0) sm90::mbar_arrive(&k_empty[s]);
  };
  auto release_v = [&](int s) {
    if (lane == 0) sm90::mbar_arrive(&v_empty[s]);
  };

  float acc_s[BN / 2];
  std::uint32_t pa[BN / 16][4];
  float corr[2];
  if constexpr (!Cfg::kPingPong) {
    for (int it = 0; it < n_iters; ++it) {
      const int s = (ring + it) % S;
      const std::uint32_t phase = ((ring + it) / S) & 1;
      sm90::mbar_wait(&k_full[s], phase);
      sm90::wgmma_fence();
      issue_qk(acc_s, s);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      release_k(s);
      mask(acc_s, it);
      softmax(acc_s, corr);
      rescale_o(corr);
      pack_p(acc_s, pa);
      sm90::mbar_wait(&v_full[s], phase);
      sm90::wgmma_fence();
      issue_pv(pa, s);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      release_v(s);
    }
  } else if (n_iters > 0) {
    // Scheduler barriers (ids after the per-warpgroup ones, 1 .. kConsumers): warpgroup c waits
    // on kSched + c before issuing, then hands the turn to the next (round robin). Warpgroup 0
    // goes first; the last warpgroup skips its last hand-over so that every barrier sees exactly
    // as many arrivals as waits (n_iters + 1 issue windows per warpgroup).
    constexpr int kSched = 1 + Cfg::kConsumers, kLast = Cfg::kConsumers - 1;
    auto window_begin = [&] {
      if constexpr (Cfg::kSched) sm90::named_barrier_sync(kSched + c, 256);
    };
    auto window_end = [&](bool last) {
      if constexpr (Cfg::kSched)
        // The next warpgroup, round robin. Spelled 1 - c for two: (c + 1) % kConsumers measured
        // other ptxas spills in the two-warpgroup configs (d128 persistent 8 -> 12 bytes).
        if (c != kLast || !last)
          sm90::named_barrier_arrive(kSched + (Cfg::kConsumers == 2 ? 1 - c : c == kLast ? 0 : c + 1), 256);
    };
    if constexpr (Cfg::kSched)
      if (c == kLast) sm90::named_barrier_arrive(kSched + 0, 256);
    // Block 0: Q K^T alone. Stage and phase of block it: (ring + it) % S, ((ring + it) / S) & 1.
    sm90::mbar_wait(&k_full[ring % S], (ring / S) & 1);
    window_begin();
    sm90::wgmma_fence();
    issue_qk(acc_s, ring % S);
    sm90::wgmma_commit();
    window_end(false);
    sm90::wgmma_wait<0>();
    release_k(ring % S);
    mask(acc_s, 0);
    softmax(acc_s, corr);
    pack_p(acc_s, pa);
    // Steady state: Q K^T of block it and P V of block it-1 in flight together.
    for (int it = 1; it < n_iters; ++it) {
      const std::uint32_t u = ring + it;
      const int s = u % S, sp = (u - 1) % S;
      sm90::mbar_wait(&k_full[s], (u / S) & 1);
      sm90::mbar_wait(&v_full[sp], ((u - 1) / S) & 1);
      window_begin();
      sm90::wgmma_fence();
      issue_qk(acc_s, s);
      sm90::wgmma_commit();
      issue_pv(pa, sp);
      sm90::wgmma_commit();
      window_end(false);
      sm90::wgmma_wait<1>();  // S of block it is ready; P V of it-1 may still run
      release_k(s);           // the producer may load block it+S's keys while the softmax runs
      // Softmax of block it overlaps P V of block it-1 only if the wait below stays below it.
      sm90::in_own_block(it > n_iters /*never*/, [&] {
        mask(acc_s, it);
        softmax(acc_s, corr);
      });
      sm90::wgmma_wait<0>();  // P V of it-1 done: its values are free, O can be rescaled
      release_v(sp);
      rescale_o(corr);
      pack_p(acc_s, pa);
    }
    // Last block: P V alone.
    const int sl = (ring + n_iters - 1) % S;
    sm90::mbar_wait(&v_full[sl], ((ring + n_iters - 1) / S) & 1);
    window_begin();
    sm90::wgmma_fence();
    issue_pv(pa, sl);
    sm90::wgmma_commit();
    window_end(true);
    sm90::wgmma_wait<0>();
    release_v(sl);
  }
  ring += n_iters;

  // ---- epilogue: O / l into this warpgroup's rows of sQ (same 128B-swizzled panels), then out
  //      by TMA (persistent) or 16-byte coalesced stores; LSE from the quad leader. ------------
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // l == 0: no visible key (O = 0, LSE = -inf); l = NaN (a NaN score, which fmaxf kept out of
    // the max) must reach O and the LSE, so the test is on l, not on the max (attention.h).
    inv[r] = l != 0.f ? 1.f / l : 0.f;
    const int i = row_base + 8 * r;
    if (p.lse != nullptr && t == 0 && i < cta.m_end) {
      // The ALiBi row term left out of the scores (see mask): -slope * (row - ref), raw units.
      const float row_term = -alibi_slope_raw(p, b, h) * static_cast<float>(i + cta.rules.offset() - alibi_ref);
      p.lse[cta.lse_row0 + i] = l != 0.f ? ((row_max[r] + row_term) * p.scale_log2 + __log2f(l)) * kLn2Fa3 : -INFINITY;
    }
  }
  unsigned char* sO = base;  // this warpgroup reads only its own Q rows, all S GEMMs are done
#pragma unroll
  for (int j = 0; j < DC; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 64 * c + 16 * warp + g + 8 * r;  // row inside the tile
      *reinterpret_cast<std::uint32_t*>(sO + swizzled_chunk<BM>(row, j) + 4 * t) =
          ptx::pack2<T>(acc_o[4 * j + 2 * r] * inv[r], acc_o[4 * j + 2 * r + 1] * inv[r]);
    }
  if constexpr (Cfg::kPersistent) {
    // Every writer fences its generic-proxy writes for the TMA (async proxy) read; one thread
    // stores the warpgroup's 64 rows per 64-column panel (rows past the sequence's end are out
    // of the map's bounds and not written), waits until the copy has read shared memory, and
    // hands the Q buffer back to the producer.
    sm90::fence_proxy_async_smem();
    sm90::named_barrier_sync(1 + c, 128);
    if (ct == 0) {
      const int q_x0 = varlen ? p.seqlen_q - cta.rules.seqlen_q : 0;
      const int q_c3 = varlen ? static_cast<int>(cta.q_row0) + cta.rules.seqlen_q : b;
#pragma unroll
      for (int pn = 0; pn < Cfg::kPanels; ++pn)
        sm90::tma_store_4d(&p.tmap_o, pn * 64, q_x0 + m0 + 64 * c, h, q_c3, sO + pn * BM * 128 + 64 * c * 128);
      sm90::bulk_commit();
      sm90::bulk_wait_read<0>();
      sm90::mbar_arrive(q_empty);
    }
  } else {
    sm90::named_barrier_sync(1 + c, 128);
    T* gO = static_cast<T*>(p.o) + (varlen ? cta.q_row0 * p.o_seq_stride : b * p.o_batch_stride) + h * p.o_head_stride;
    const int m_end = cta.m_end;
#pragma unroll
    for (int it = 0; it < 64 * DC / 128; ++it) {
      const int idx = ct + it * 128;
      const int row = 64 * c + idx / DC, j = idx % DC;
      if (m0 + row < m_end) {
        const uint4 val = *reinterpret_cast<const uint4*>(sO + swizzled_chunk<BM>(row, j));
        *reinterpret_cast<uint4*>(gO + static_cast<std::int64_t>(m0 + row) * p.o_seq_stride + j * 8) = val;
      }
    }
  }
  ++done;
  }  // tiles
#else
  __trap();  // never launched: dispatch picks this kernel only on sm_90 devices
#endif
}

}  // namespace flashcpp::cuda
