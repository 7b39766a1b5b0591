// Rotary position embedding on q and k (semantics in include/flashcpp/fused.h): neox (half
// split) and interleaved pairs, partial rotary_dim, per-token positions, base theta with the
// Llama-3 frequency scaling, cos/sin computed in the kernel or read from an fp32 cache.
//
// Napkin math (H200, 4.3 TB/s; bf16), the DESIGN case (4, 4096, 32, 128) = q of 16384 tokens:
//   read q + write q = 2 * 16384 * 32 * 128 * 2 B = 268.4 MB -> floor 62.4 us.
//   Anchors: eager PyTorch 1066.8 us, torch.compile 84.3 us. Bar: <= 73.4 us (85% of the floor),
//   which also beats compile by 1.15x. With k of 8 heads (Llama-3-8B GQA) too: 335.5 MB, 78.0 us.
//   Per 16 bytes of q: 8 pairs of FMAs and conversions (~40 instructions); cos/sin once per
//   (token, pair, head group) -- see below. Memory bound with room to spare on A100/H100/H200.
//
// Work split: a thread owns one "lane" of one token -- VEC consecutive pairs (the two
// VEC-element halves of a neox item, or 2*VEC consecutive elements of an interleaved one) -- in
// H heads of q and k (heads g, g + G, ... with G = ceil(heads / H) groups; H = 1 by default).
// A token's lanes x groups threads are threadIdx.x (split over blockIdx.y when a token needs
// more than kThreads); threadIdx.y picks one of the block's tokens. A thread issues all its loads
// first, then forms its VEC cos/sin in registers (overlapping the load latency), rotates and
// stores. No loop, no barrier, 32-bit index math: 16384 x 2 blocks of 128 threads for the DESIGN
// case.
// inv_freq comes from the host (fp64, in the kernel arguments), so no block computes a pow or
// waits at a barrier. What limits this kernel is the bytes in flight per SM (ncu: DRAM 42-46%
// busy); see reports/fused and the staged variant below.
// cos/sin are evaluated G times per (token, pair) (once per head by default): ~5 fp64 operations
// and 2 MUFU each, a few percent of the issue slots on A100/H100/H200. On parts with 1/64-rate
// fp64 (L40, A10) that share is much larger: pass a cos_sin_cache there.
// In place is safe: an element is read and written by the same thread.
//
// The kernels of this file: the register kernel above (the scalar path, the fallback for tokens of
// more than 1024 units, and cuda_config heads1 / heads2), the shared-cos/sin kernel (varlen key
// pre-passes, cuda_config shared), the staged kernel (cuda_config staged) and the stream kernel, the
// 16-byte default (below: the measurements against the others are in reports/fused). Instantiations,
// each for bf16 and fp16: register {16-byte at 1 and 2 heads, scalar}, shared {1, 2 heads}, staged,
// stream: 14 in all.
//
#include <algorithm>
#include <limits>

#include "cuda/common/ptx.cuh"
#include "cuda/common/rope.cuh"
#include "cuda/cuda_api.h"
#include "cuda/fused/fused_common.cuh"
#include "cuda/fused/fused_launch.h"
#include "common/fused_math.h"

namespace flashcpp::cuda {
namespace fused {
namespace {

constexpr int kThreads = 128;       // 12 blocks of 128 at 40 registers: 1536 threads an SM
// Heads one thread loads and rotates (cuda_config heads2: measurement). One head per thread
// at 40 registers beats sharing cos/sin over 2 or 4 heads (72 / 108 registers): on the H200 the
// DESIGN case took 104 / 114 / 134 us. Memory-level parallelism (threads x bytes in flight) is
// what limits this kernel, not the cos/sin arithmetic.
constexpr int kHeadsInFlight = 1;
constexpr int kMaxPairs = kRotaryTableMaxPairs;  // rotary_dim / 2 for head_dim <= 1024 (fused_validate.cc)

/// Kernel arguments; index 0 = q, 1 = k.
struct RotaryArgs {
  const void* in[2] = {nullptr, nullptr};
  void* out[2] = {nullptr, nullptr};
  std::int64_t in_bs[2] = {}, in_ss[2] = {}, in_hs[2] = {};    ///< batch / seq / head strides of the inputs
  std::int64_t out_bs[2] = {}, out_ss[2] = {}, out_hs[2] = {};
  int heads_q = 0, heads = 0;  ///< heads of q, and of q and k together
  std::int64_t tokens = 0;     ///< batch * seqlen
  int per_token = 0;           ///< lanes * groups: threads of one token
  int seqlen = 0;
  int half = 0;       ///< rotary_dim / 2
  int rot_lanes = 0;  ///< lanes of VEC pairs: half / VEC
  int lanes = 0;      ///< rot_lanes + pass-through lanes (out of place with a partial rotary_dim)
  int groups = 0;     ///< head groups G; group g takes heads g, g + G, g + 2G, ...
  bool neox = true;
  const std::int32_t* positions = nullptr;  ///< null: position = s
  /// Packed sequences (rotate_keys of a varlen attention): token (b, s) is packed row
  /// cu_seqlens[b] + s, present only for s < cu_seqlens[b + 1] - cu_seqlens[b]; the batch
  /// strides are unused and positions are indexed by the packed row. Null: plain (b, s) tokens.
  const std::int32_t* cu_seqlens = nullptr;
  rope::CosSinTables tables;                ///< the spec's cos/sin tables; cos null: compute cos/sin
  bool streaming = false;  ///< evict-first hints on q/k loads and stores
  int units = 0, stages = 0;  ///< stream kernel: units a thread, tokens a block keeps in shared memory
  // Staged kernel (cuda_config "staged"): rows = (token, head) pairs of head_dim elements.
  int head_dim = 0;
  std::int64_t total_rows = 0;  ///< tokens * heads
  int rows_per_block = 0;
  /// Without a cache: fp64 inv_freq per pair (theta and Llama-3 scaling applied on the host by
  /// the same fused::inv_freq the CPU backend uses). 4 KB of the 32 KB kernel-argument space.
  double inv_freq[kMaxPairs] = {};
};

using rope::rotate_pair;  // shared with the rotary fused into attention (common/rope.cuh)

/// Element offsets of a lane's two VEC-element vectors inside a head.
template <int VEC>
__device__ __forceinline__ void lane_offsets(const RotaryArgs& a, int lane, int* oa, int* ob) {
  if (lane < a.rot_lanes) {
    *oa = a.neox ? lane * VEC : 2 * lane * VEC;
    *ob = a.neox ? a.half + lane * VEC : *oa + VEC;
  } else {  // pass-through: one vector
    *oa = *ob = 2 * a.half + (lane - a.rot_lanes) * VEC;
  }
}

/// cos/sin of rotary pair i at position pos (common/rope.cuh: the cache, NaN outside it, or sincos
/// of the fp64-reduced angle).
__device__ __forceinline__ void cos_sin_at(const RotaryArgs& a, std::int32_t pos, int i, float* c, float* sn) {
  rope::cos_sin(a.tables, a.inv_freq, pos, i, c, sn);
}

/// Rotates a lane's two vectors (A at oa, B at ob) into ra, rb with pair k's cos/sin from
/// get(k, &c, &s). neox: pair k = (A[k], B[k]); interleaved: pair k = (AB[2k], AB[2k+1]).
/// Constant indices only (a runtime index would put the vectors in local memory).
template <class T, int VEC, class Get>
__device__ __forceinline__ void rotate_lane(bool neox, const Vec<T, VEC>& va, const Vec<T, VEC>& vb, Vec<T, VEC>& ra,
                                            Vec<T, VEC>& rb, Get&& get) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    float c, sn;
    get(k, &c, &sn);
    if (neox) {
      float x0 = to_float(va.v[k]), x1 = to_float(vb.v[k]);
      rotate_pair(x0, x1, c, sn);
      ra.v[k] = from_float<T>(x0);
      rb.v[k] = from_float<T>(x1);
    } else {
      const int j = 2 * k;  // element j and j + 1 of the 2*VEC-element run A|B
      float x0 = to_float(j < VEC ? va.v[j % VEC] : vb.v[j % VEC]);
      float x1 = to_float(j + 1 < VEC ? va.v[(j + 1) % VEC] : vb.v[(j + 1) % VEC]);
      rotate_pair(x0, x1, c, sn);
      // Each element goes back where it came from (with VEC = 1 the pair spans A and B).
      (j < VEC ? ra : rb).v[j % VEC] = from_float<T>(x0);
      (j + 1 < VEC ? ra : rb).v[(j + 1) % VEC] = from_float<T>(x1);
    }
  }
}

/// Token t's sequence b and position s, and its row: (tb, ts) for the tensors' batch and seq strides
/// and tpos into positions. Packed sequences (cu_seqlens): the packed row, batch strides unused, and
/// live = false past its sequence's end.
struct TokenRow {
  std::int64_t s, tb, ts, tpos;
  bool live;
};
__device__ __forceinline__ TokenRow token_row(const RotaryArgs& a, std::int64_t t) {
  std::int64_t b;
  if (t <= 0x7fffffff)  // 32-bit division whenever it can be (always, in practice)
    b = static_cast<std::uint32_t>(t) / static_cast<std::uint32_t>(a.seqlen);
  else
    b = t / a.seqlen;
  TokenRow r{t - b * a.seqlen, b, 0, t, true};
  r.ts = r.s;
  if (a.cu_seqlens != nullptr) {
    const std::int32_t first = a.cu_seqlens[b];
    r.live = r.s < a.cu_seqlens[b + 1] - first;
    r.tb = 0;
    r.ts = r.tpos = first + r.s;
  }
  return r;
}

/// Head h's row of q or k (heads_q and up are k's) at a token's (tb, ts): input and output.
template <class T>
__device__ __forceinline__ const T* head_src(const RotaryArgs& a, const TokenRow& r, int h) {
  return h >= a.heads_q ? static_cast<const T*>(a.in[1]) + r.tb * a.in_bs[1] + r.ts * a.in_ss[1] + (h - a.heads_q) * a.in_hs[1]
                        : static_cast<const T*>(a.in[0]) + r.tb * a.in_bs[0] + r.ts * a.in_ss[0] + h * a.in_hs[0];
}
template <class T>
__device__ __forceinline__ T* head_dst(const RotaryArgs& a, const TokenRow& r, int h) {
  return h >= a.heads_q ? static_cast<T*>(a.out[1]) + r.tb * a.out_bs[1] + r.ts * a.out_ss[1] + (h - a.heads_q) * a.out_hs[1]
                        : static_cast<T*>(a.out[0]) + r.tb * a.out_bs[0] + r.ts * a.out_ss[0] + h * a.out_hs[0];
}

template <class T, int VEC, int H = kHeadsInFlight>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const __grid_constant__ RotaryArgs a) {
  const int slot = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);  // inside the token
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (slot >= a.per_token || t >= a.tokens) return;
  const int lane = slot % a.lanes, group = slot / a.lanes;
  const TokenRow row = token_row(a, t);
  if (!row.live) return;  // past this packed sequence's end
  const std::int64_t s = row.s, tpos = row.tpos;
  const bool rotate = lane < a.rot_lanes;
  int oa, ob;
  lane_offsets<VEC>(a, lane, &oa, &ob);
  // Heads group, group + G, ... (at most H of them, by the choice of G).
  auto head_valid = [&](int u) { return group + u * a.groups < a.heads; };
  auto src_of = [&](int u) { return head_src<T>(a, row, group + u * a.groups); };
  auto dst_of = [&](int u) { return head_dst<T>(a, row, group + u * a.groups); };

  // 1. Every load first: their latency overlaps the cos/sin work below.
  Vec<T, VEC> va[H], vb[H];
#pragma unroll
  for (int u = 0; u < H; ++u) {
    if (!head_valid(u)) continue;
    const T* src = src_of(u);
    va[u] = load_vec<T, VEC>(src + oa, VEC, a.streaming);
    if (rotate) vb[u] = load_vec<T, VEC>(src + ob, VEC, a.streaming);
  }
  // cos/sin of pair i (lane * VEC + k) at this token's position.
  const std::int32_t pos = rotate ? (a.positions ? a.positions[tpos] : static_cast<std::int32_t>(s)) : 0;
  auto cos_sin = [&](int k, float* c, float* sn) { cos_sin_at(a, pos, lane * VEC + k, c, sn); };
  // Rotates head u's loaded vectors with pair k's cos/sin from get(k, &c, &s), and stores them.
  auto rotate_store = [&](int u, auto&& get) {
    T* dst = dst_of(u);
    if (!rotate) {  // pass-through lane
      store_vec<T, VEC>(dst + oa, va[u], VEC, a.streaming);
      return;
    }
    Vec<T, VEC> ra, rb;
    rotate_lane<T, VEC>(a.neox, va[u], vb[u], ra, rb, get);
    store_vec<T, VEC>(dst + oa, ra, VEC, a.streaming);
    store_vec<T, VEC>(dst + ob, rb, VEC, a.streaming);
  };
  if constexpr (H == 1) {
    // One head: each pair's cos/sin is formed right where it is used (no cos/sin arrays held
    // across the loop: fewer registers, more threads, more loads in flight).
    // The cache test is hoisted out of the pairs, so a pair's cos/sin loads (or angle) do not wait
    // behind the previous pair's branch.
    if (head_valid(0)) {
      if (a.tables.cos != nullptr)
        rotate_store(0, [&](int k, float* c, float* sn) { rope::cos_sin_table(a.tables, pos, lane * VEC + k, c, sn); });
      else
        rotate_store(0, [&](int k, float* c, float* sn) { rope::cos_sin_angle(pos, a.inv_freq[lane * VEC + k], c, sn); });
    }
  } else {
    // 2. This lane's cos/sin once, for all H heads.
    float c[VEC], sn[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (rotate) cos_sin(k, &c[k], &sn[k]);
    // 3. Rotate and store.
#pragma unroll
    for (int u = 0; u < H; ++u)
      if (head_valid(u)) rotate_store(u, [&](int k, float* ck, float* sk) { *ck = c[k]; *sk = sn[k]; });
  }
}

/// The cos/sin of a lane's VEC pairs from a token's rows of them in shared memory (16-byte reads).
template <int VEC>
__device__ __forceinline__ void lane_cos_sin(const float* s_cos, const float* s_sin, int lane, float (&c)[VEC],
                                             float (&sn)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; k += 4) {
    const float4 cv = *reinterpret_cast<const float4*>(s_cos + lane * VEC + k);
    const float4 sv = *reinterpret_cast<const float4*>(s_sin + lane * VEC + k);
    c[k] = cv.x, c[k + 1] = cv.y, c[k + 2] = cv.z, c[k + 3] = cv.w;
    sn[k] = sv.x, sn[k + 1] = sv.y, sn[k + 2] = sv.z, sn[k + 3] = sv.w;
  }
}

/// Shared cos/sin kernel (cuda_config shared, and varlen key pre-passes): a block holds TB whole tokens
/// (threadIdx.y), each with all its (head group, lane) threads (threadIdx.x). Every thread issues its
/// loads first; then the block forms each token's rotary_dim / 2 cos/sin pairs once, in shared memory
/// (one pair per thread, instead of once per head and lane: 40x fewer for q of 32 heads and k of 8),
/// and after one barrier each thread reads its VEC pairs with 16-byte shared loads. H = 2 (two heads
/// a thread, 64 bytes in flight, cuda_config "shared,heads2") measured no faster than the register
/// kernel on the H200; H = 1 is the default.
template <class T, int H>
__global__ void __launch_bounds__(256, H == 2 ? 4 : 5) rotary_shared_kernel(const __grid_constant__ RotaryArgs a) {
  constexpr int VEC = kVec16;
  extern __shared__ __align__(16) float cs_raw[];  // [TB][2][half]: cos then sin of each token
  const int ty = threadIdx.y, slot = threadIdx.x;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + ty;
  float* s_cos = cs_raw + ty * 2 * a.half;
  float* s_sin = s_cos + a.half;
  // A token past the end (or past its packed sequence) loads and stores nothing but still reaches
  // the barrier.
  const TokenRow row = t < a.tokens ? token_row(a, t) : TokenRow{0, 0, 0, 0, false};
  const bool live = row.live;
  const bool mine = live && slot < a.per_token;
  const int lane = slot % a.lanes, group = slot / a.lanes;
  const bool rotate = lane < a.rot_lanes;
  int oa, ob;
  lane_offsets<VEC>(a, lane, &oa, &ob);
  auto head_valid = [&](int u) { return mine && group + u * a.groups < a.heads; };
  // 1. Loads first.
  Vec<T, VEC> va[H], vb[H];
#pragma unroll
  for (int u = 0; u < H; ++u) {
    if (!head_valid(u)) continue;
    const T* src = head_src<T>(a, row, group + u * a.groups);
    va[u] = load_vec<T, VEC>(src + oa, VEC, a.streaming);
    if (rotate) vb[u] = load_vec<T, VEC>(src + ob, VEC, a.streaming);
  }
  // 2. This token's cos/sin, one pair per thread of the token's row of the block.
  if (live) {
    const std::int32_t pos = a.positions ? a.positions[row.tpos] : static_cast<std::int32_t>(row.s);
    for (int i = slot; i < a.half; i += blockDim.x) rope::cos_sin(a.tables, a.inv_freq, pos, i, &s_cos[i], &s_sin[i]);
  }
  __syncthreads();
  // 3. Rotate and store.
  if (!mine) return;
  float c[VEC], sn[VEC];
  if (rotate) lane_cos_sin<VEC>(s_cos, s_sin, lane, c, sn);
#pragma unroll
  for (int u = 0; u < H; ++u) {
    if (!head_valid(u)) continue;
    T* dst = head_dst<T>(a, row, group + u * a.groups);
    if (!rotate) {
      store_vec<T, VEC>(dst + oa, va[u], VEC, a.streaming);
      continue;
    }
    Vec<T, VEC> ra, rb;
    rotate_lane<T, VEC>(a.neox, va[u], vb[u], ra, rb, [&](int k, float* ck, float* sk) {
      *ck = c[k];
      *sk = sn[k];
    });
    store_vec<T, VEC>(dst + oa, ra, VEC, a.streaming);
    store_vec<T, VEC>(dst + ob, rb, VEC, a.streaming);
  }
}

/// Staged variant (cuda_config "staged", 16-byte path): a block copies kStagedBytes (32 KB) of whole
/// (token, head) rows into shared memory with cp.async, then rotates from there. The bytes in
/// flight no longer cost registers: 4 blocks of 256 threads (56 registers) keep ~128 KB in flight per SM
/// (registers alone held ~48 KB in the register design). In place is safe: every row a block
/// writes was copied to shared memory by that block before the barrier.
constexpr int kStagedThreads = 256;
constexpr int kStagedBytes = 32768;

template <class T>
__global__ void __launch_bounds__(kStagedThreads) rotary_staged_kernel(const __grid_constant__ RotaryArgs a) {
  constexpr int VEC = kVec16;
  extern __shared__ __align__(16) unsigned char stage_raw[];
  T* stage = reinterpret_cast<T*>(stage_raw);
  const int cpr = a.head_dim / VEC;  // 16-byte chunks per row
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.x) * a.rows_per_block;
  const int nrows = static_cast<int>(min(static_cast<std::int64_t>(a.rows_per_block), a.total_rows - row0));
  // Row r -> (tensor w, token t, batch b, position sq, head h): 32-bit (the host sends larger
  // problems to the register kernel).
  auto decode = [&](std::int64_t r, int* w, std::int64_t* t, std::int64_t* b, std::int64_t* sq, int* hh) {
    const std::uint32_t r32 = static_cast<std::uint32_t>(r), tt = r32 / static_cast<std::uint32_t>(a.heads);
    const std::uint32_t b32 = tt / static_cast<std::uint32_t>(a.seqlen);
    const int h = static_cast<int>(r32 - tt * a.heads);
    *t = tt;
    *b = b32;
    *sq = tt - b32 * a.seqlen;
    *w = h >= a.heads_q;
    *hh = *w ? h - a.heads_q : h;
  };
  // 1. Copy the block's rows into shared memory.
  for (int i = threadIdx.x; i < nrows * cpr; i += blockDim.x) {
    const int lr = i / cpr, c = i - lr * cpr;
    int w, h;
    std::int64_t t, b, sq;
    decode(row0 + lr, &w, &t, &b, &sq, &h);
    const T* src = static_cast<const T*>(a.in[w]) + b * a.in_bs[w] + sq * a.in_ss[w] + h * a.in_hs[w] + c * VEC;
    ptx::cp_async_16(ptx::smem_u32(stage + lr * a.head_dim + c * VEC), src, 16);
  }
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncthreads();
  // 2. Rotate each (row, lane) from shared memory and store it.
  for (int i = threadIdx.x; i < nrows * a.lanes; i += blockDim.x) {
    const int lr = i / a.lanes, lane = i - lr * a.lanes;
    int w, h;
    std::int64_t t, b, sq;
    decode(row0 + lr, &w, &t, &b, &sq, &h);
    int oa, ob;
    lane_offsets<VEC>(a, lane, &oa, &ob);
    const T* srow = stage + lr * a.head_dim;
    T* dst = static_cast<T*>(a.out[w]) + b * a.out_bs[w] + sq * a.out_ss[w] + h * a.out_hs[w];
    const Vec<T, VEC> va = *reinterpret_cast<const Vec<T, VEC>*>(srow + oa);
    if (lane >= a.rot_lanes) {  // pass-through lane
      store_vec<T, VEC>(dst + oa, va, VEC, a.streaming);
      continue;
    }
    const Vec<T, VEC> vb = *reinterpret_cast<const Vec<T, VEC>*>(srow + ob);
    const std::int32_t pos = a.positions ? a.positions[t] : static_cast<std::int32_t>(sq);
    Vec<T, VEC> ra, rb;
    rotate_lane<T, VEC>(a.neox, va, vb, ra, rb,
                        [&](int k, float* c, float* sn) { cos_sin_at(a, pos, lane * VEC + k, c, sn); });
    store_vec<T, VEC>(dst + oa, ra, VEC, a.streaming);
    store_vec<T, VEC>(dst + ob, rb, VEC, a.streaming);
  }
}

/// Stream kernel (the default on the 16-byte path): a resident grid in which each block walks
/// tokens blockIdx.x, + gridDim.x, ... and keeps the next stages - 1 tokens' q and k rows in
/// flight into shared memory with cp.async while it rotates and stores the current one. The other
/// kernels hold a token's bytes in flight only during their own load phase, one short-lived block
/// at a time (60-70% of the floor, reports/fused); here the bytes in flight cost shared memory
/// and do not drop between tokens. A thread owns units u = threadIdx.x + k * blockDim.x (k < units)
/// of the token's heads x lanes (lane_offsets: the A and B vectors of a rotary lane, or one
/// pass-through vector), copies exactly those vectors and later reads only them, so
/// cp.async.wait_group makes them readable without a barrier. The token's cos/sin pairs are formed
/// once in shared memory (one pair a thread, as in the shared kernel) stages - 1 tokens ahead, just
/// after the block's one barrier a token, which both publishes them and retires the slot they
/// overwrite. In place is safe: a token is read before it is written, by the block that writes it.
constexpr int kStreamThreadsPref = 128;  // threads a block while 4 units a thread cover the token
constexpr int kStreamThreadsMax = 256;
constexpr int kStreamUnitsMax = 4;  // units a thread: tokens of up to 1024 units (e.g. 128 heads of 128)

template <class T>
__global__ void __launch_bounds__(kStreamThreadsMax) rotary_stream_kernel(const __grid_constant__ RotaryArgs a) {
  constexpr int VEC = kVec16, U = kStreamUnitsMax;
  using V = Vec<T, VEC>;
  extern __shared__ __align__(16) unsigned char stream_raw[];
  const int S = a.stages, B = blockDim.x, tid = threadIdx.x, per_stage = 2 * B * a.units;  // vectors a stage
  V* stages = reinterpret_cast<V*>(stream_raw);
  float* cs = reinterpret_cast<float*>(stages + S * per_stage);  // [S][cos half | sin half]
  int oa[U], ob[U], head[U], lane[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int u = tid + k * B;
    lane[k] = k < a.units && u < a.per_token ? u % a.lanes : -1;  // -1: no unit
    head[k] = u / a.lanes;
    lane_offsets<VEC>(a, lane[k] < 0 ? 0 : lane[k], &oa[k], &ob[k]);
  }
  auto slot = [&](int s, int k, int which) { return stages + s * per_stage + (2 * k + which) * B + tid; };
  const std::int64_t step = gridDim.x;
  auto issue = [&](std::int64_t t, int s) {  // one commit group per call, empty past the end
    if (t < a.tokens) {
      const TokenRow row = token_row(a, t);
      if (row.live) {
#pragma unroll
        for (int k = 0; k < U; ++k) {
          if (lane[k] < 0) continue;
          const T* src = head_src<T>(a, row, head[k]);
          ptx::cp_async_16(ptx::smem_u32(slot(s, k, 0)), src + oa[k], 16);
          if (lane[k] < a.rot_lanes) ptx::cp_async_16(ptx::smem_u32(slot(s, k, 1)), src + ob[k], 16);
        }
      }
    }
    ptx::cp_async_commit();
  };
  auto fill_cos_sin = [&](std::int64_t t, int s) {
    if (t >= a.tokens) return;
    const TokenRow row = token_row(a, t);
    if (!row.live) return;
    const std::int32_t pos = a.positions ? a.positions[row.tpos] : static_cast<std::int32_t>(row.s);
    float* c = cs + s * 2 * a.half;
    for (int i = tid; i < a.half; i += B) rope::cos_sin(a.tables, a.inv_freq, pos, i, &c[i], &c[a.half + i]);
  };
  std::int64_t t = blockIdx.x;
  for (int s = 0; s + 1 < S; ++s) {
    issue(t + s * step, s);
    fill_cos_sin(t + s * step, s);
  }
  for (int it = 0; t < a.tokens; ++it, t += step) {
    const int s = it % S, ahead = (it + S - 1) % S;
    issue(t + (S - 1) * step, ahead);  // the stage this thread emptied last token
    ptx::cp_async_wait_n(S - 1);          // this token's vectors (and every older group) landed
    __syncthreads();                   // this token's cos/sin are written; the slot `ahead` is read by all
    fill_cos_sin(t + (S - 1) * step, ahead);
    const TokenRow row = token_row(a, t);
    if (!row.live) continue;
    const float* c = cs + s * 2 * a.half;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (lane[k] < 0) continue;
      T* dst = head_dst<T>(a, row, head[k]);
      const V va = *slot(s, k, 0);
      if (lane[k] >= a.rot_lanes) {  // pass-through
        store_vec<T, VEC>(dst + oa[k], va, VEC, a.streaming);
        continue;
      }
      const V vb = *slot(s, k, 1);
      float cv[VEC], sv[VEC];
      lane_cos_sin<VEC>(c, c + a.half, lane[k], cv, sv);
      V ra, rb;
      rotate_lane<T, VEC>(a.neox, va, vb, ra, rb, [&](int j, float* cj, float* sj) {
        *cj = cv[j];
        *sj = sv[j];
      });
      store_vec<T, VEC>(dst + oa[k], ra, VEC, a.streaming);
      store_vec<T, VEC>(dst + ob[k], rb, VEC, a.streaming);
    }
  }
  ptx::cp_async_wait<0>();  // the empty groups past the last token
}

/// Units a thread (1, 2 or 4) and the block's threads of the stream kernel for a token of
/// per_token units; false when a token has more units than a block holds.
bool stream_shape(int per_token, int* units, int* threads) {
  int u = 1;
  while (u < kStreamUnitsMax && u * kStreamThreadsPref < per_token) u *= 2;
  if (per_token > u * kStreamThreadsMax) return false;
  *units = u;
  *threads = ((per_token + u - 1) / u + 31) / 32 * 32;
  return true;
}

/// Shared memory of one stage of the stream kernel: its vectors and their cos/sin.
int stream_stage_bytes(int threads, int units, int half) { return 2 * threads * units * 16 + 2 * half * 4; }

/// Lanes of a token's head (RotaryArgs::lanes) at `vec` elements a vector: the rotary ones, plus
/// pass-through ones when some output is out of place. A tensor rotated in place then copies its own
/// tail onto itself (same bytes, same thread): harmless, and only on the rare partial-rotary call
/// that mixes in-place and out-of-place outputs.
int head_lanes(const RopeParams& p, int vec) {
  const int rot = p.effective_rotary_dim();
  const bool any_out = p.q_out.data != nullptr || (p.heads_k > 0 && p.k_out.data != nullptr);
  return rot / 2 / vec + (rot < p.head_dim && any_out ? (p.head_dim - rot) / vec : 0);
}

/// Heads per thread of the shared kernel: 1, or 2 with cuda_config "shared,heads2".
int shared_heads(const FusedForce& force) { return force.shared && force.heads == 2 ? 2 : 1; }

/// The shared kernel takes a token's threads in one block of at most 256 and 32-bit token math.
bool shared_ok(const RopeParams& p, const FusedForce& force) {
  const int rot = p.effective_rotary_dim(), H = shared_heads(force);
  const int heads = p.heads_q + p.heads_k, groups = (heads + H - 1) / H;
  const int lanes = rot / 2 / kVec16 + (rot < p.head_dim ? (p.head_dim - rot) / kVec16 : 0);
  return static_cast<std::int64_t>(groups) * lanes <= 256 &&
         static_cast<std::int64_t>(p.batch) * p.seqlen <= std::numeric_limits<std::int32_t>::max();
}

bool vector_ok(const RopeParams& p) {
  const int rot = p.effective_rotary_dim();
  if (rot % (2 * kVec16) != 0 || p.head_dim % kVec16 != 0) return false;
  auto ok = [&](const TensorView& t, int heads) {
    return aligned(t.data, 16) && (p.batch <= 1 || t.batch_stride % kVec16 == 0) &&
           (p.seqlen <= 1 || t.seq_stride % kVec16 == 0) && (heads <= 1 || t.head_stride % kVec16 == 0);
  };
  bool all = ok(p.q, p.heads_q) && (!p.q_out.data || ok(p.q_out, p.heads_q));
  if (p.heads_k > 0) all = all && ok(p.k, p.heads_k) && (!p.k_out.data || ok(p.k_out, p.heads_k));
  return all;
}

}  // namespace
}  // namespace fused

FusedPath rotary_path(const RopeParams& p, const FusedForce& force, bool named) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p);
  const bool staged = path.vector && force.staged &&
                      static_cast<std::int64_t>(p.batch) * p.seqlen * (p.heads_q + p.heads_k) <= std::numeric_limits<std::int32_t>::max();
  // The stream kernel is the default on the 16-byte path; a knob naming another kernel picks that
  // one: shared (the shared-cos/sin kernel), heads1 / heads2 (the register kernel) or staged.
  // reports/fused has their measurements.
  const int rot = p.effective_rotary_dim();
  const std::int64_t per_token = static_cast<std::int64_t>(p.heads_q + p.heads_k) * head_lanes(p, kVec16);
  const bool stream = path.vector && !staged && !force.shared && force.heads == 0 && per_token <= 1 << 20 &&
                      stream_shape(static_cast<int>(per_token), &path.per_thread, &path.threads);
  if (stream) {
    const int stage_bytes = stream_stage_bytes(path.threads, path.per_thread, rot / 2);
    path.stages = stream_stages(force.stages, stage_bytes);
    path.smem = path.stages * stage_bytes;
  } else {
    path.threads = staged ? kStagedThreads : kThreads;
  }
  path.stream = stream;
  const bool shared = path.vector && !staged && !stream && (force.shared || force.heads == 0) && shared_ok(p, force);
  path.shared = shared;
  if (!named) return path;
  path.name = std::string("rotary ") + rope_style_name(p.rotary.style) + (path.vector ? " vec8" : " scalar") +
              (p.rotary.has_tables() ? " cache" : " sincos") + (staged ? " staged" : "") + (shared ? " shared" : "") +
              (stream ? " stream threads=" + std::to_string(path.threads) + " units=" + std::to_string(path.per_thread) +
                            " stages=" + std::to_string(path.stages)
                      : "") +
              (force.streaming ? " streaming" : "");
  return path;
}

Status apply_rotary(const RopeParams& p, const FusedForce& force, Stream stream, const std::int32_t* cu_seqlens) {
  using namespace fused;
  const FusedPath path = rotary_path(p, force, false);
  const int vec = path.vector ? kVec16 : kScalar;
  const int rot = p.effective_rotary_dim();
  RotaryArgs a;
  set_qk_views(p.q, p.k, p.q_out, p.k_out, &a);
  a.heads_q = p.heads_q;
  a.heads = p.heads_q + p.heads_k;
  a.seqlen = p.seqlen;
  a.half = rot / 2;
  a.rot_lanes = a.half / vec;
  a.lanes = head_lanes(p, vec);
  const int heads_in_flight = path.vector && force.heads > 0 ? force.heads : kHeadsInFlight;  // H of the kernel launched
  a.groups = (a.heads + heads_in_flight - 1) / heads_in_flight;
  a.per_token = a.groups * a.lanes;
  a.tokens = static_cast<std::int64_t>(p.batch) * p.seqlen;
  const RotarySpec& spec = p.rotary;
  a.neox = spec.style == RopeStyle::kNeox;
  a.positions = p.positions;
  a.cu_seqlens = cu_seqlens;
  a.tables = rope::CosSinTables{spec.cos, spec.sin, spec.effective_table_stride(p.head_dim), spec.max_position};
  if (!spec.has_tables()) {
    if (a.half > kMaxPairs) return Status::Internal("apply_rotary: rotary_dim / 2 exceeds the kernel's inv_freq table");
    const double* table = rotary_inv_freq_table(rot, spec.theta, spec.llama3);
    if (table == nullptr) return Status::Internal("apply_rotary: rotary_dim past the inv_freq table");
    std::copy_n(table, a.half, a.inv_freq);
  }
  a.streaming = force.streaming;
  if (a.tokens == 0) return Status::Ok();
  if (path.stream) {
    a.groups = a.heads;  // one head a unit
    a.per_token = a.groups * a.lanes;
    a.units = path.per_thread;
    a.stages = path.stages;
    return with_half_type(p.q.dtype, [&](auto tag) -> Status {
      using T = typename decltype(tag)::type;
      return launch_resident(rotary_stream_kernel<T>, a, path.threads, path.smem, a.tokens, stream, "apply_rotary");
    });
  }
  // Block: a token's threads (warps of it, at most kThreads; the rest on blockIdx.y) x as many
  // tokens as fill kThreads.
  const int bx = std::min(kThreads, (a.per_token + 31) / 32 * 32);
  const int by = std::max(1, kThreads / bx);
  const std::int64_t blocks = (a.tokens + by - 1) / by;
  const int chunks = (a.per_token + bx - 1) / bx;
  if (blocks > std::numeric_limits<std::int32_t>::max() || chunks > 65535)
    return Status::Unsupported("apply_rotary: the launch needs more than 2^31-1 x 65535 blocks (too many tokens x heads)");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(chunks)), block(bx, by);
  if (path.shared) {
    const int H = shared_heads(force);
    a.groups = (a.heads + H - 1) / H;
    a.per_token = a.groups * a.lanes;
    const int tx = a.per_token;  // <= 256 (shared_ok)
    const int ty = std::max(1, 256 / tx);
    const std::int64_t sblocks = (a.tokens + ty - 1) / ty;
    const std::size_t smem = static_cast<std::size_t>(ty) * 2 * a.half * sizeof(float);
    if (sblocks > std::numeric_limits<std::int32_t>::max())
      return Status::Unsupported("apply_rotary: the launch needs more than 2^31-1 blocks");
    return with_half_type(p.q.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const dim3 sgrid(static_cast<unsigned>(sblocks)), sblock(tx, ty);
      if (H == 2)
        rotary_shared_kernel<T, 2><<<sgrid, sblock, smem, stream>>>(a);
      else
        rotary_shared_kernel<T, 1><<<sgrid, sblock, smem, stream>>>(a);
      return launch_status("apply_rotary");
    });
  }
  if (path.vector && force.staged && cu_seqlens == nullptr &&
      a.tokens * a.heads <= std::numeric_limits<std::int32_t>::max()) {
    a.head_dim = p.head_dim;
    a.total_rows = a.tokens * a.heads;
    a.rows_per_block = std::max(1, kStagedBytes / (2 * p.head_dim));
    const std::int64_t sblocks = (a.total_rows + a.rows_per_block - 1) / a.rows_per_block;
    const std::size_t smem = static_cast<std::size_t>(a.rows_per_block) * p.head_dim * 2;  // <= 32 KB, or one row
    return with_half_type(p.q.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      rotary_staged_kernel<T><<<static_cast<unsigned>(sblocks), kStagedThreads, smem, stream>>>(a);
      return launch_status("apply_rotary");
    });
  }
  return with_half_type(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.vector && heads_in_flight == 2)
      rotary_kernel<T, kVec16, 2><<<grid, block, 0, stream>>>(a);
    else if (path.vector)
      rotary_kernel<T, kVec16><<<grid, block, 0, stream>>>(a);
    else
      rotary_kernel<T, kScalar><<<grid, block, 0, stream>>>(a);
    return launch_status("apply_rotary");
  });
}

}  // namespace flashcpp::cuda
