// Device side of the rotary fused into the prefill kernels (prefill_rope.h): rotate the rows of a
// q tile in shared memory, in place, after the tile has landed and before any matrix product
// reads it (the keys arrive rotated: a pre-pass wrote them to AttnRotary::k_rotated). Both kernels
// call rope_tile with their own tile addressing (sm80: [rows][D] with 16-byte chunks
// XOR-swizzled by row % 8; sm90: 64-column panels in the 128-byte TMA swizzle). An 8-byte piece
// never straddles a 16-byte chunk, so the swizzle moves it whole.
//
// Work item = one 8-byte piece of the rotated dims. Each item reads its row's position once,
// forms its cos/sin pair by pair (rope::cos_sin: the fp64-reduced angle or the cache, as
// apply_rotary) and writes the rotated values back rounded to the input dtype, which is what a
// separate apply_rotary stores.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/common/rope.cuh"
#include "cuda/prefill/prefill_rope.h"

namespace flashcpp::cuda {

template <class T>
__device__ __forceinline__ float rope_bits_to_f32(std::uint32_t bits16) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __uint_as_float(bits16 << 16);
  else
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}
template <class T>
__device__ __forceinline__ std::uint32_t rope_f32_to_bits(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else
    return __half_as_ushort(__float2half_rn(v));
}

__device__ __forceinline__ uint2 rope_ld(std::uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void rope_st(std::uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}
/// Element e (0..3) of a 4-element piece: the low (e even) or high (e odd) 16 bits of word e / 2.
/// Selects, not references: e is a runtime index here, and a reference would put v in local memory.
__device__ __forceinline__ std::uint32_t rope_elem(const uint2& v, int e) {
  const std::uint32_t w = e < 2 ? v.x : v.y;
  return (e & 1) ? w >> 16 : w & 0xffffu;
}
__device__ __forceinline__ void rope_set_elem(uint2& v, int e, std::uint32_t bits) {
  const std::uint32_t w = e < 2 ? v.x : v.y;
  const std::uint32_t n = (e & 1) ? (w & 0xffffu) | (bits << 16) : (w & 0xffff0000u) | bits;
  v.x = e < 2 ? n : v.x;
  v.y = e < 2 ? v.y : n;
}

/// A tensor's position array offset to its sequence's first row (the packed row with varlen, else
/// b * seqlen), or null (the default positions).
__device__ __forceinline__ const std::int32_t* rope_seq_positions(const std::int32_t* pos, bool varlen,
                                                                  std::int64_t packed_row0, int b, int seqlen) {
  return pos == nullptr ? pos : pos + (varlen ? packed_row0 : static_cast<std::int64_t>(b) * seqlen);
}

/// Rotates rows [0, valid) of a shared-memory q tile whose row r is sequence row row0 + r (rows at
/// or past `valid` lie past the sequence's end, hold zeros and are left alone). Row i's position
/// is positions[i] (the array already offset to the sequence's first row) or, without an array,
/// i + shift. `addr(r, col)` is the shared-memory byte address of element col (a multiple of 4)
/// of tile row r. `inv_freq` is rp.inv_freq or a copy of it (sm90: in shared memory, where a
/// warp's 16 different pairs are one access; the kernel-parameter copy serializes them). Threads
/// tid, tid + nthreads, ... of the calling group share the items; the caller synchronizes before
/// and after.
///
/// An item is one 8-byte piece (4 elements) of the rotated dims: a neox piece of the first half
/// with its partner half elements on (4 pairs), or an interleaved piece (2 adjacent pairs). A
/// thread takes kBatch items per round: all their shared-memory loads, then all their cos/sin
/// (the cache loads or the angles, the cache test hoisted out of the pairs), then the rotations
/// and stores, so the latencies overlap. The rotation is latency-bound: the first version (one
/// pair at a time, a branch and a dependent load per pair) cost more than the attention itself.
template <class T, int kBatch, class Addr>
__device__ __forceinline__ void rope_tile(const PrefillRope& rp, const double* inv_freq, const std::int32_t* positions,
                                          int row0, int shift, int valid, int tid, int nthreads, Addr&& addr) {
  const int per_row = rp.neox ? rp.half / 4 : rp.half / 2;
  const int np = rp.neox ? 4 : 2;  // pairs per item
  const int items = valid * per_row;
  for (int x0 = tid; x0 < items; x0 += kBatch * nthreads) {
    std::uint32_t pa[kBatch], pb[kBatch];
    uint2 va[kBatch], vb[kBatch];
    std::int32_t pos[kBatch];
    int pair0[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int x = min(x0 + u * nthreads, items - 1);  // a clamped duplicate is computed, never stored
      const int row = x / per_row, c = x - row * per_row;
      const int i = row0 + row;
      pos[u] = positions != nullptr ? __ldg(positions + i) : i + shift;
      pa[u] = addr(row, 4 * c);
      pb[u] = rp.neox ? addr(row, 4 * c + rp.half) : pa[u];
      pair0[u] = np * c;
      va[u] = rope_ld(pa[u]);
      if (rp.neox)
        vb[u] = rope_ld(pb[u]);
      else
        vb[u] = va[u];
    }
    float cs[kBatch][4], sn[kBatch][4];
    if (rp.tables.cos != nullptr) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (k < np) rope::cos_sin_table(rp.tables, pos[u], pair0[u] + k, &cs[u][k], &sn[u][k]);
    } else {
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (k < np) rope::cos_sin_angle(pos[u], inv_freq[pair0[u] + k], &cs[u][k], &sn[u][k]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (rp.neox) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float x0f = rope_bits_to_f32<T>(rope_elem(va[u], k)), x1f = rope_bits_to_f32<T>(rope_elem(vb[u], k));
          rope::rotate_pair(x0f, x1f, cs[u][k], sn[u][k]);
          rope_set_elem(va[u], k, rope_f32_to_bits<T>(x0f));
          rope_set_elem(vb[u], k, rope_f32_to_bits<T>(x1f));
        }
      } else {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          float x0f = rope_bits_to_f32<T>(rope_elem(va[u], 2 * k)), x1f = rope_bits_to_f32<T>(rope_elem(va[u], 2 * k + 1));
          rope::rotate_pair(x0f, x1f, cs[u][k], sn[u][k]);
          rope_set_elem(va[u], 2 * k, rope_f32_to_bits<T>(x0f));
          rope_set_elem(va[u], 2 * k + 1, rope_f32_to_bits<T>(x1f));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (x0 + u * nthreads >= items) break;
      rope_st(pa[u], va[u]);
      if (rp.neox) rope_st(pb[u], vb[u]);
    }
  }
}

}  // namespace flashcpp::cuda
