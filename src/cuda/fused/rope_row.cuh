// Rotary of one (token, head) row that a group of lanes holds in registers, shared by the row
// kernels qk_norm_rope (qk_norm_rope.cu) and rope_append_kv (rope_append.cu). The pairing, the
// angles and the rotation are apply_rotary's (common/rope.cuh: fused::cos_sin_angle and
// fused::rotate_pair, or the cos/sin tables with NaN outside them), so a row rotated here has the
// bits apply_rotary gives it.
//
// Row layout (the norms' register layout, rms_norm.cu): a group of G lanes (a power of two <= 32,
// inside one warp) owns a row; lane l holds SLOTS vectors of VEC elements, vector k at element
// (l + k * G) * VEC. A pair's two elements may sit in different lanes (neox pairs are rotary_dim / 2
// apart), so the group first parks its rounded row in shared memory (a warp-private stage: one
// __syncwarp, no block barrier) and each lane then reads the partners of its own elements from
// there. A lane writes only the elements it loaded itself, so in-place rows are safe.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/common/rope.cuh"
#include "cuda/fused/fused_common.cuh"
#include "flashcpp/fused.h"

namespace flashcpp::cuda::fused {

constexpr int kRowMaxPairs = kFusedRowMaxHeadDim / 2;
constexpr int kRowBlockThreads = 128;  ///< rows per block = 128 / G
/// Elements a lane holds: one 16-byte vector, or 8 scalars (the scalar path's slots).
constexpr int kRowLaneElems = 8;
/// Shared-memory stage per block: every row's pitch is G * 8 >= head_dim elements.
constexpr int kRowStageElems = kRowBlockThreads * kRowLaneElems;

/// The rotation of a row kernel (RotarySpec resolved on the host).
struct RowRotary {
  int style = 0;   ///< RopeStyle code: 0 none, 1 neox, 2 interleaved
  int rot = 0;     ///< rotary_dim (resolved)
  int half = 0;    ///< rot / 2
  /// 16-byte path: every pair lies in one lane's vector (interleaved) or pairs a whole vector with
  /// a whole vector (neox with half a multiple of 8), so the chunk kernels rotate through
  /// shuffles; otherwise they park each row in the stage (lane_pairs below).
  bool in_lanes = false;
  rope::CosSinTables tables;  ///< cos null: angles from inv_freq
  /// fp64 inv_freq per pair without tables (theta and Llama-3 scaling applied on the host by
  /// rotary_inv_freq, as for apply_rotary). 1 KB of the kernel arguments.
  double inv_freq[kRowMaxPairs] = {};
};

/// Fills r from a validated spec (rope.h) for rows of head_dim elements.
inline void set_row_rotary(const RotarySpec& spec, int head_dim, RowRotary* r) {
  r->style = static_cast<int>(spec.style);
  r->rot = spec.enabled() ? spec.effective_rotary_dim(head_dim) : 0;
  r->half = r->rot / 2;
  r->in_lanes = spec.style == RopeStyle::kInterleaved || (spec.style == RopeStyle::kNeox && r->half % 8 == 0);
  if (!spec.enabled()) return;
  if (spec.has_tables()) {
    r->tables = rope::CosSinTables{spec.cos, spec.sin, spec.effective_table_stride(head_dim), spec.max_position};
  } else {
    std::copy_n(rotary_inv_freq_table(r->rot, spec.theta, spec.llama3), r->half, r->inv_freq);  // rot <= 256 here
  }
}

/// The rotated value of element e < rotary_dim of a row (rotation on) in fp32, before any rounding:
/// `own` is the element's value, `row` the row's stage in shared memory (for the partner).
template <class T>
__device__ __forceinline__ float rotated_f32(const RowRotary& r, const T* row, int e, T own, std::int32_t pos) {
  bool first;
  int i, partner;
  if (r.style == static_cast<int>(RopeStyle::kNeox)) {
    first = e < r.half;
    i = first ? e : e - r.half;
    partner = first ? e + r.half : e - r.half;
  } else {  // interleaved
    first = (e & 1) == 0;
    i = e >> 1;
    partner = e ^ 1;
  }
  float c, s;
  rope::cos_sin(r.tables, r.inv_freq, pos, i, &c, &s);
  float x0 = to_float(first ? own : row[partner]);
  float x1 = to_float(first ? row[partner] : own);
  rope::rotate_pair(x0, x1, c, s);
  return first ? x0 : x1;
}

/// The rotated value of element e of a row, rounded to T (rotated_f32); elements past rotary_dim
/// pass through.
template <class T>
__device__ __forceinline__ T rotate_element(const RowRotary& r, const T* row, int e, T own, std::int32_t pos) {
  if (r.style == 0 || e >= r.rot) return own;
  return from_float<T>(rotated_f32<T>(r, row, e, own, pos));
}

/// Element offset of a lane's vector k in the row.
template <int VEC>
__device__ __forceinline__ int row_elem(int lane, int k, int group) {
  return (lane + k * group) * VEC;
}

/// Parks a lane's vectors in the row's stage (every element below `n` of the row).
template <class T, int VEC, int SLOTS>
__device__ __forceinline__ void stage_row(T* row, const Vec<T, VEC> (&v)[SLOTS], int lane, int group, int n) {
#pragma unroll
  for (int k = 0; k < SLOTS; ++k) {
    const int e0 = row_elem<VEC>(lane, k, group);
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (e0 + i < n) row[e0 + i] = v[k].v[i];
  }
}

/// Rotates a lane's vectors in registers from the staged row (after the group's __syncwarp).
template <class T, int VEC, int SLOTS>
__device__ __forceinline__ void rotate_lane_row(const RowRotary& r, const T* row, Vec<T, VEC> (&v)[SLOTS], int lane,
                                                int group, int n, std::int32_t pos) {
  if (r.style == 0) return;
#pragma unroll
  for (int k = 0; k < SLOTS; ++k) {
    const int e0 = row_elem<VEC>(lane, k, group);
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (e0 + i < n) v[k].v[i] = rotate_element<T>(r, row, e0 + i, v[k].v[i], pos);
  }
}

// ---- The 16-byte chunk layout (qk_norm_rope and rope_append_kv on aligned rows) ----------------
//
// A group of G lanes (as above) owns a chunk of kChunkRows (token, head) rows of one token; lane l
// holds elements [8l, 8l + 8) of every row of the chunk (one 16-byte vector per row: G * 8 >=
// head_dim). All the chunk's loads are issued before any arithmetic, so a thread keeps
// kChunkRows * 16 bytes (a KV row: twice that) in flight, and the token's cos/sin are formed once
// per lane for all its rows while those loads are out. Pairs never need shared memory when
// RowRotary::in_lanes: an interleaved pair (2i, 2i + 1) sits in one vector, and with half a
// multiple of 8 the neox partners of lane l's elements are exactly lane l + half / 8's (or
// l - half / 8's), one vector brought over by four 32-bit shuffles.

/// (token, head) rows of one token per group of lanes: 4 keeps 64 bytes of loads in flight per
/// thread (128 for a KV row) and divides the head counts of the models that use these ops.
constexpr int kChunkRows = 4;

/// Resident 128-thread blocks per SM the chunk kernels ask of ptxas (__launch_bounds__): 6 caps
/// them at 80 registers, which the bf16 sm_90a build meets without spills (64 spilled), so 768
/// threads of 64 bytes in flight = 48 KB per SM, about what Little's law asks at 4.3 TB/s over 132
/// SMs and ~1.5 us of loaded latency (reports/fused); the row kernel held ~24 KB.
constexpr int kChunkBlocksPerSm = 6;

/// The launch of a row-layout op over `tokens` x `heads` (token, head) rows: a group of `group`
/// lanes takes one row (scalar path) or one chunk of kChunkRows heads of a token (the 16-byte
/// chunk kernels). Sets the chunk counts the chunk kernels read and returns the block count.
struct RowGrid {
  int chunks_per_token = 0;  ///< ceil(heads / kChunkRows)
  std::int64_t chunks = 0;   ///< tokens * chunks_per_token
  std::int64_t blocks = 0;   ///< 128-thread blocks
};
inline RowGrid row_grid(std::int64_t tokens, int heads, int group, bool chunks) {
  RowGrid gr;
  gr.chunks_per_token = (heads + kChunkRows - 1) / kChunkRows;
  gr.chunks = tokens * gr.chunks_per_token;
  const std::int64_t items = chunks ? gr.chunks : tokens * heads;
  const int per_block = kRowBlockThreads / group;
  gr.blocks = (items + per_block - 1) / per_block;
  return gr;
}

/// How a lane's vector rotates on the chunk layout (in_lanes): `count` elements from element 0
/// are rotated (8 or 0 for neox, the elements below rotary_dim for interleaved), the rest pass.
struct LanePairs {
  int count = 0;
  int first = 0;         ///< pair index of the vector's first pair
  int partner = 0;       ///< neox: the warp lane that holds the partner vector (this lane otherwise)
  bool neox = false;
  bool x0 = false;       ///< neox: the vector holds the first element of its pairs
  float c[kVec16] = {};  ///< cos of pair first + k (interleaved: k < 4)
  float s[kVec16] = {};  ///< sin likewise; for a neox x0 vector, -sin (see rotate_lane_f32)
};

/// The pairs of lane `lane` of its group (warp lane `wlane`) and their cos/sin at `pos`; `load_cs`
/// false (a dead chunk) skips the cos/sin. Call only when r.in_lanes.
__device__ __forceinline__ LanePairs lane_pairs(const RowRotary& r, int lane, int wlane, std::int32_t pos, bool load_cs) {
  LanePairs p;
  p.partner = wlane;
  if (r.style == static_cast<int>(RopeStyle::kNeox)) {
    const int q = r.half / kVec16;  // vectors per half
    p.neox = true;
    if (lane < 2 * q) {
      p.x0 = lane < q;
      p.count = kVec16;
      p.first = (p.x0 ? lane : lane - q) * kVec16;
      p.partner = p.x0 ? wlane + q : wlane - q;
    }
  } else if (r.style == static_cast<int>(RopeStyle::kInterleaved)) {
    p.count = max(0, min(kVec16, r.rot - lane * kVec16));
    p.first = lane * (kVec16 / 2);
  }
  if (!load_cs || p.count == 0) return p;
  const int pairs = p.neox ? kVec16 : (p.count + 1) / 2;
  // The table test outside the pairs: a pair's loads (or angle) never wait behind a branch.
  if (r.tables.cos != nullptr) {
#pragma unroll
    for (int k = 0; k < kVec16; ++k)
      if (k < pairs) rope::cos_sin_table(r.tables, pos, p.first + k, &p.c[k], &p.s[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec16; ++k)
      if (k < pairs) rope::cos_sin_angle(pos, r.inv_freq[p.first + k], &p.c[k], &p.s[k]);
  }
  if (p.x0) {
#pragma unroll
    for (int k = 0; k < kVec16; ++k) p.s[k] = -p.s[k];
  }
  return p;
}

/// The partner vector of a neox lane (its own vector for the others). Every lane of the warp must
/// call it (a full-warp shuffle).
template <class T>
__device__ __forceinline__ Vec<T, kVec16> partner_vec(const LanePairs& p, const Vec<T, kVec16>& y) {
  static_assert(sizeof(Vec<T, kVec16>) == 16, "four 32-bit words");
  const uint4 w = *reinterpret_cast<const uint4*>(&y);
  uint4 o;
  o.x = __shfl_sync(0xffffffffu, w.x, p.partner);
  o.y = __shfl_sync(0xffffffffu, w.y, p.partner);
  o.z = __shfl_sync(0xffffffffu, w.z, p.partner);
  o.w = __shfl_sync(0xffffffffu, w.w, p.partner);
  Vec<T, kVec16> r;
  *reinterpret_cast<uint4*>(&r) = o;
  return r;
}

/// The rotated values of elements [0, p.count) of a lane's vector y in fp32, before any rounding
/// (pp: partner_vec's vector, used by neox only). rotate_pair's arithmetic: a neox x0 element is
/// fma(x0, c, -(x1 s)) and x1 fma(x1, c, x0 s); here each lane forms only its own element, as
/// fma(own, c, partner * s') with s' = -s for x0 (LanePairs::s), and partner * -s == -(partner * s)
/// exactly (round-to-nearest is symmetric), so the bits are rotate_pair's.
template <class T>
__device__ __forceinline__ void rotate_lane_f32(const LanePairs& p, const Vec<T, kVec16>& y, const Vec<T, kVec16>& pp,
                                                float (&f)[kVec16]) {
  if (p.neox) {
#pragma unroll
    for (int k = 0; k < kVec16; ++k) f[k] = fmaf(to_float(y.v[k]), p.c[k], to_float(pp.v[k]) * p.s[k]);
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec16 / 2; ++k) {
    float x0 = to_float(y.v[2 * k]), x1 = to_float(y.v[2 * k + 1]);
    rope::rotate_pair(x0, x1, p.c[k], p.s[k]);
    f[2 * k] = x0;
    f[2 * k + 1] = x1;
  }
}

/// The rotated values of elements [0, count) of lane `lane`'s vector y from the row parked in
/// `srow` (any neox half; rotated_f32 per element), count = the vector's elements below rotary_dim.
template <class T>
__device__ __forceinline__ int rotate_staged_f32(const RowRotary& r, const T* srow, const Vec<T, kVec16>& y, int lane,
                                                 std::int32_t pos, float (&f)[kVec16]) {
  const int e0 = lane * kVec16, count = max(0, min(kVec16, r.rot - e0));
#pragma unroll
  for (int k = 0; k < kVec16; ++k)
    if (k < count) f[k] = rotated_f32<T>(r, srow, e0 + k, y.v[k], pos);
  return count;
}

/// y with its first `count` elements replaced by f rounded to T (the rest pass through untouched).
template <class T>
__device__ __forceinline__ Vec<T, kVec16> merge_rotated(const Vec<T, kVec16>& y, const float (&f)[kVec16], int count) {
  Vec<T, kVec16> o;
#pragma unroll
  for (int k = 0; k < kVec16; ++k) o.v[k] = k < count ? from_float<T>(f[k]) : y.v[k];
  return o;
}

/// A row of the chunk layout rotated and rounded to T: through the lanes (in_lanes), or through the
/// group's stage `srow` (two __syncwarp: every lane of the warp must call it, with the same r).
/// `has` = this lane holds a vector of a live row (the others only take part in the shuffles and
/// barriers). With fp32 `f` and `count` out for an fp8 store.
template <class T>
__device__ __forceinline__ int rotate_chunk_row_f32(const RowRotary& r, const LanePairs& p, T* srow,
                                                    const Vec<T, kVec16>& y, int lane, bool has, std::int32_t pos,
                                                    float (&f)[kVec16]) {
  if (r.in_lanes) {
    const Vec<T, kVec16> pp = p.neox ? partner_vec<T>(p, y) : y;
    if (!has) return 0;
    rotate_lane_f32<T>(p, y, pp, f);
    return p.count;
  }
  if (has) *reinterpret_cast<Vec<T, kVec16>*>(srow + lane * kVec16) = y;
  __syncwarp();
  const int count = has ? rotate_staged_f32<T>(r, srow, y, lane, pos, f) : 0;
  __syncwarp();  // the stage is free for the next row
  return count;
}

}  // namespace flashcpp::cuda::fused
