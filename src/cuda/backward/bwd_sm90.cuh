// The backward main kernel on Hopper's warpgroup tensor cores (wgmma, sm_90a). It replaces
// bwd_main_kernel (bwd_kernel.cuh) for the head-dim classes 64 and 128 and keeps everything else of
// the CUDA backward: the preprocess and postprocess kernels, the workspace, the pair walk
// (walk::backward_visit), the score transform and masks (bwd_p_ds), deterministic mode's turns.
//
// One CTA per (key tile of 128 keys, KV head, sequence); two warpgroups of 128 threads, each owning
// 64 of the keys with all head-dim columns of their dK and dV in registers. Per visited (query head,
// query tile) pair, each warpgroup computes
//     S^T  = K_w Q^T,  dP^T = V_w dO^T            wgmma, A and B K-major in shared memory
//     P, dS = bwd_p_ds(S^T, dP^T)                  (the sm80 kernel's code: same accumulator layout)
//     dV  += P^T dO,   dK  += dS^T Q               wgmma, A = P / dS from registers, B MN-major
// writes dS^T to shared memory, and after both warpgroups have, adds its 64 x 64 piece of
//     dQ = dS K                                    wgmma, A and B MN-major in shared memory
// to the fp32 accumulator (staged, 16-byte reductions as in bwd_dq). Head dim 128 takes query tiles
// of 64 rows and splits dQ's columns between the warpgroups; head dim 64 takes tiles of 128 rows and
// splits dQ's rows. Tiles are stored as 64-column panels with the 128-byte swizzle
// (algebra::panel_offset), the layout wgmma's descriptors read, filled by cp.async from all 256
// threads with the next pair's tiles in flight while the current one computes.
//
// Where speed falls off: at 255 registers ptxas serializes the wgmmas (each waits for the one
// before); freeing registers to pipeline them measured slower (reports/backward), since the two
// warpgroups then issue, wait and compute P and dS in step and the tensor cores idle in between.
// There is no producer warp, no TMA, and dQ leaves by red.global from every thread.
#pragma once

#include "cuda/backward/bwd_kernel.cuh"
#include "cuda/common/hopper.cuh"

namespace flashcpp::cuda {

/// A config of the wgmma backward. kBlockN = 128 keys (64 per warpgroup); kBlockM query rows per pair.
template <int HeadDim, int BlockM>
struct BwdSm90Config {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = 128;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 256;
  static constexpr int kMinBlocks = 1;
  static constexpr bool kSm90 = true;
  static constexpr bool kWs = false;  ///< bwd_sm90_ws.cuh has the warp-specialized twin
  static constexpr int kNQ = BlockM / 8;   ///< n8 chunks of query columns in S^T (bwd_p_ds)
  static constexpr int kDT = HeadDim / 8;  ///< n8 chunks of dK / dV columns (bwd_store_kv)
  static constexpr int kSmemKV = kBlockN * HeadDim * 2;  ///< K or V tile
  static constexpr int kSmemQ = BlockM * HeadDim * 2;    ///< one stage of Q or dO
  static constexpr int kSmemDs = kBlockN * BlockM * 2;   ///< dS^T [key][query]
  static constexpr int kSmemDq = 2 * 64 * 64 * 4;        ///< fp32 staging of dQ: 64 x 64 per warpgroup
  static constexpr int kSmemRows = 2 * BlockM * 4;       ///< one stage of LSE log2 e and D
  static constexpr int kSmemBytes = 2 * kSmemKV + 4 * kSmemQ + kSmemDs + kSmemDq + 2 * kSmemRows;
  static_assert((HeadDim == 128 && BlockM == 64) || (HeadDim == 64 && BlockM == 128),
                "dQ's 64 x 64 warpgroup pieces split the columns (64 rows) or the rows (64 columns)");
};

/// Shared memory: K, V, Q[2], dO[2], dS^T, dQ staging, row vectors; every tile 1024-byte aligned
/// (the row vectors last: they need 16).
template <class Cfg>
struct BwdSm90Smem {
  unsigned char* base;
  static constexpr int kV = Cfg::kSmemKV, kQ = 2 * Cfg::kSmemKV, kDo = kQ + 2 * Cfg::kSmemQ,
                       kDs = kDo + 2 * Cfg::kSmemQ, kDq = kDs + Cfg::kSmemDs, kRows = kDq + Cfg::kSmemDq;
  __device__ __forceinline__ std::uint32_t k() const { return ptx::smem_u32(base); }
  __device__ __forceinline__ std::uint32_t v() const { return ptx::smem_u32(base + kV); }
  __device__ __forceinline__ std::uint32_t q(int st) const { return ptx::smem_u32(base + kQ + st * Cfg::kSmemQ); }
  __device__ __forceinline__ std::uint32_t dout(int st) const { return ptx::smem_u32(base + kDo + st * Cfg::kSmemQ); }
  __device__ __forceinline__ unsigned char* ds() const { return base + kDs; }
  __device__ __forceinline__ float* dq_stage(int wg) const { return reinterpret_cast<float*>(base + kDq) + wg * 64 * 64; }
  __device__ __forceinline__ float* rows(int st) const {
    return reinterpret_cast<float*>(base + kRows) + st * 2 * Cfg::kBlockM;
  }
};

/// cp.async of rows [row0, row0 + Rows) of a [rows][cols <= D] view into a panel tile (zeros past
/// `limit` and past `cols`). Each thread keeps one 16-byte column chunk.
template <int Rows, int D, int Threads, typename T>
__device__ __forceinline__ void bwd90_load_tile(std::uint32_t smem, const T* gmem, std::int32_t seq_stride, int row0,
                                                int limit, int cols, int tid) {
  constexpr int kChunks = D / 8, kRowsPerPass = Threads / kChunks;
  static_assert(Threads % kChunks == 0 && Rows % kRowsPerPass == 0);
  const int ch = tid % kChunks, r0 = tid / kChunks;
  const bool col_ok = ch * 8 < cols;
#pragma unroll
  for (int it = 0; it < Rows / kRowsPerPass; ++it) {
    const int r = r0 + it * kRowsPerPass;
    const bool ok = col_ok && row0 + r < limit;
    const T* src = gmem + static_cast<std::int64_t>(row0 + r) * seq_stride + ch * 8;
    ptx::cp_async_16(smem + algebra::panel_offset<Rows>(r, ch), ok ? src : gmem, ok ? 16 : 0);
  }
}

template <class Cfg, typename T>
__device__ __forceinline__ void bwd90_load_pair(const BwdParams& p, const BwdSm90Smem<Cfg>& sm, const BwdCta& c,
                                                const BwdPair& pr, int st, int tid) {
  constexpr int BM = Cfg::kBlockM, D = Cfg::kHeadDim, NT = Cfg::kThreads;
  const int h = c.hk * p.group + pr.gi;
  const BwdPairRows<T> g(p, c, h);
  bwd90_load_tile<BM, D, NT>(sm.q(st), g.q, p.q_seq_stride, pr.m * BM, c.s.len_q, p.head_dim, tid);
  bwd90_load_tile<BM, D, NT>(sm.dout(st), g.dout, p.do_seq_stride, pr.m * BM, c.s.len_q, p.head_dim_v, tid);
  bwd_load_rows<BM>(p, sm.rows(st), c, h, pr.m, tid);
}

/// A descriptor advanced by `bytes` (addresses sit in the low 14 bits as bytes >> 4; no carry out
/// below 2^18 bytes of shared memory).
__device__ __forceinline__ std::uint64_t bwd90_adv(std::uint64_t d, int bytes) {
  return d + static_cast<std::uint64_t>(bytes >> 4);
}

/// A warpgroup's wgmma descriptors (stage 0, first k-step). K-major operands: lbo unused, sbo = 8
/// rows x 128 B. MN-major ones: lbo = the distance between 64-column panels (Rows x 128 B), sbo = 8
/// K-rows x 128 B. `ds` is the (first) dS^T buffer.
template <class Cfg>
struct Bwd90Descs {
  std::uint64_t k_a, v_a;   ///< this warpgroup's 64 keys of K and V (A of S^T and dP^T)
  std::uint64_t q_b, do_b;  ///< Q and dO, K-major (B of S^T and dP^T)
  std::uint64_t q_mn, do_mn;  ///< Q and dO, MN-major (B of dK and dV)
  std::uint64_t ds_a, k_b;  ///< dS^T and K, both MN-major, for this warpgroup's 64 x 64 piece of dQ
  template <class Smem>
  __device__ __forceinline__ Bwd90Descs(const Smem& sm, std::uint32_t ds, int wg) {
    constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
    k_a = sm90::make_desc(sm.k() + wg * 64 * 128, 16, 1024);
    v_a = sm90::make_desc(sm.v() + wg * 64 * 128, 16, 1024);
    q_b = sm90::make_desc(sm.q(0), 16, 1024);
    do_b = sm90::make_desc(sm.dout(0), 16, 1024);
    q_mn = sm90::make_desc(sm.q(0), BM * 128, 1024);
    do_mn = sm90::make_desc(sm.dout(0), BM * 128, 1024);
    // dQ's 64 x 64 piece: BM = 128 splits the rows (dS^T's query panel wg), BM = 64 the columns (K's panel wg).
    const int ds_panel = BM == 128 ? wg : 0, k_panel = BM == 64 ? wg : 0;
    ds_a = sm90::make_desc(ds + ds_panel * BN * 128, BN * 128, 1024);
    k_b = sm90::make_desc(sm.k() + k_panel * BN * 128, BN * 128, 1024);
  }
};

/// acc = A_w B^T over the head dim (S^T = K_w Q^T, dP^T = V_w dO^T), both K-major; B's stage starts
/// `qoff` bytes after the descriptor's.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd90_product_t(float (&acc)[Cfg::kBlockM / 2], std::uint64_t a, std::uint64_t b,
                                                int qoff) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    const int off = (kk % 4) * 32;  // 64-column panel kk / 4, then 32 bytes per k16 step
    sm90::wgmma_ss<BM, T>(acc, bwd90_adv(a, (kk / 4) * BN * 128 + off), bwd90_adv(b, qoff + (kk / 4) * BM * 128 + off),
                          kk > 0);
  }
}

/// Word e of k16 step kk of P or dS as an A fragment of an RS wgmma: step kk covers the
/// accumulator's chunks 2kk and 2kk + 1.
template <typename T, int N>
__device__ __forceinline__ std::uint32_t bwd90_frag_word(const float (&acc)[N], int kk, int e) {
  return ptx::pack2<T>(acc[8 * kk + 2 * e], acc[8 * kk + 2 * e + 1]);
}

/// One accumulator (P or dS) as A fragments.
template <class Cfg, typename T>
__device__ __forceinline__ void bwd90_fragment(const float (&acc)[Cfg::kBlockM / 2],
                                               std::uint32_t (&frag)[Cfg::kBlockM / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) frag[kk][e] = bwd90_frag_word<T>(acc, kk, e);
}

/// P and dS together, word by word (the single-role kernel's order, which ptxas schedules as measured).
template <class Cfg, typename T>
__device__ __forceinline__ void bwd90_fragments(const float (&s)[Cfg::kBlockM / 2], const float (&dp)[Cfg::kBlockM / 2],
                                                std::uint32_t (&pa)[Cfg::kBlockM / 16][4],
                                                std::uint32_t (&da)[Cfg::kBlockM / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pa[kk][e] = bwd90_frag_word<T>(s, kk, e);
      da[kk][e] = bwd90_frag_word<T>(dp, kk, e);
    }
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_sm90_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma exists only in the sm_90a pass
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, D = Cfg::kHeadDim;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const BwdSm90Smem<Cfg> sm{smem_raw};
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform: descriptors in uniform registers
  const int ct = tid % 128, wi = ct / 32;
  // The CTA's record lives in shared memory: read where used, it leaves the registers to the
  // accumulators (kept in registers, it made the kernel spill).
  __shared__ alignas(16) unsigned char cta_raw[sizeof(BwdCta)];
  BwdCta& c = *reinterpret_cast<BwdCta*>(cta_raw);
  {
    BwdCta mine;
    if (!bwd_make_cta<BM, BN>(p, &mine)) return;
    if (tid == 0) c = mine;
    __syncthreads();
  }
  {
    const BwdKvRows<T> kv(p, c);
    bwd90_load_tile<BN, D, Cfg::kThreads>(sm.k(), kv.k, p.k_seq_stride, c.j0, c.s.len_k, p.head_dim, tid);
    bwd90_load_tile<BN, D, Cfg::kThreads>(sm.v(), kv.v, p.v_seq_stride, c.j0, c.s.len_k, p.head_dim_v, tid);
  }
  BwdPair cur;
  bool have = bwd_first_pair(p, c, &cur);
  if (have) bwd90_load_pair<Cfg, T>(p, sm, c, cur, 0, tid);
  ptx::cp_async_commit();

  const auto [k_a, v_a, q_b, do_b, q_mn, do_mn, ds_a, k_b] = Bwd90Descs<Cfg>(sm, ptx::smem_u32(sm.ds()), wg);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const int key0 = c.j0 + wg * 64 + wi * 16;    // this warp's first key (rows g, g + 8 of its 16)
  const bool key_tail = c.j0 + BN > c.s.len_k;  // keys past the sequence must be masked in every pair

  for (int it = 0; have; ++it) {
    const int st = it & 1;
    BwdPair nxt;
    const bool have_next = bwd_next_pair(p, c, cur, &nxt);
    if (have_next) bwd90_load_pair<Cfg, T>(p, sm, c, nxt, st ^ 1, tid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    sm90::fence_proxy_async_smem();  // the cp.async writes (generic proxy) before wgmma's reads
    __syncthreads();

    const int qoff = st * Cfg::kSmemQ;
    float s[BM / 2], dp[BM / 2];
    sm90::wgmma_fence();
    bwd90_product_t<Cfg, T>(s, k_a, q_b, qoff);  // S^T = K_w Q^T
    bwd90_product_t<Cfg, T>(dp, v_a, do_b, qoff);  // dP^T = V_w dO^T
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    const float* rows = sm.rows(st);
    bwd_p_ds<Cfg>(reinterpret_cast<float(&)[Cfg::kNQ][4]>(s), reinterpret_cast<float(&)[Cfg::kNQ][4]>(dp), p, c, cur,
                  rows, rows + BM, cur.v.need_mask || key_tail, key0, g, t);

    std::uint32_t pa[BM / 16][4], da[BM / 16][4];
    bwd90_fragments<Cfg, T>(s, dp, pa, da);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) sm90::wgmma_rs<D, T>(dv, pa[kk], bwd90_adv(do_mn, qoff + kk * 16 * 128), 1);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) sm90::wgmma_rs<D, T>(dk, da[kk], bwd90_adv(q_mn, qoff + kk * 16 * 128), 1);
    sm90::wgmma_commit();

    // dS^T to shared memory for dQ (while dV and dK run): row = key, 16-bit pairs of query columns.
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key = wg * 64 + wi * 16 + g + 8 * r;
        *reinterpret_cast<std::uint32_t*>(sm.ds() + algebra::panel_offset<BN>(key, j) + 4 * t) =
            ptx::pack2<T>(dp[4 * j + 2 * r], dp[4 * j + 2 * r + 1]);
      }
    sm90::fence_proxy_async_smem();
    const BwdDqTurn<Cfg> turn(p, c, cur, tid);  // (deterministic: its barriers also publish dS^T)
    __syncthreads();

    float dq[32];
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)  // this warpgroup's 64 x 64 piece of dS K
      sm90::wgmma_tt<64, T>(dq, bwd90_adv(ds_a, kk * 16 * 128), bwd90_adv(k_b, kk * 16 * 128), kk > 0);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();  // dV, dK and dQ

    // Stage the piece (16-byte chunks swizzled by row), then 16-byte reductions: a warp adds two
    // whole 256-byte row segments per instruction.
    float* stage = sm.dq_stage(wg);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wi * 16 + g + 8 * r, c4 = 2 * j + (t >> 1);
        *reinterpret_cast<float2*>(stage + bwd_stage_offset(row, c4) + ((2 * t) & 3)) =
            make_float2(dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
      }
    sm90::named_barrier_sync(1 + wg, 128);
    {
      const int h = c.hk * p.group + cur.gi;
      const int row0 = cur.m * BM + (BM == 128 ? wg * 64 : 0), col0 = BM == 64 ? wg * 64 : 0;
      float* acc = p.dq_accum + (static_cast<std::int64_t>(h) * p.ws_rows + c.s.ws_row0 + row0) * p.head_dim;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int idx = i * 128 + ct, row = idx / 16, c4 = idx % 16, col = col0 + 4 * c4;
        if (col < p.head_dim)  // the class's padding columns (zero) are not accumulated
          red_add_v4(acc + static_cast<std::int64_t>(row) * p.head_dim + col,
                     *reinterpret_cast<const float4*>(stage + bwd_stage_offset(row, c4)));
      }
    }
    turn.done(tid);
    __syncthreads();  // stage st, dS^T and the staging are free for the next pair
    cur = nxt;
    have = have_next;
  }
  ptx::cp_async_wait<0>();
  bwd_store_kv<Cfg, T>(p, c, reinterpret_cast<const float(&)[Cfg::kDT][4]>(dk),
                       reinterpret_cast<const float(&)[Cfg::kDT][4]>(dv), c.j0 + wg * 64 + wi * 16, 0, g, t);
#endif
}

}  // namespace flashcpp::cuda
