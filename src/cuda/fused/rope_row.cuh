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
  if (!spec.enabled()) return;
  if (spec.has_tables()) {
    r->tables = rope::CosSinTables{spec.cos, spec.sin, spec.effective_table_stride(head_dim), spec.max_position};
  } else {
    for (int i = 0; i < r->half; ++i) r->inv_freq[i] = rotary_inv_freq(i, r->rot, spec.theta, spec.llama3);
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

}  // namespace flashcpp::cuda::fused
