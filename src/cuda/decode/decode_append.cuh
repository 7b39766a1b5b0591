// The append role of decode: a step's new K (rotated) and V into the cache, one warp per
// (sequence, token, KV head). Run by its own kernel (decode_aux.cu) or, with
// DecodePlan::fused_append, by the split-KV kernel for the tokens inside each split's tiles.
#pragma once

#include <cstdint>

#include "common/decode_common.h"
#include "common/fused_math.h"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/decode_device.cuh"

namespace flashcpp::cuda::decode_dev {

/// (cos, sin) of rotary pair i at position pos (decode.h): from the tables (RotarySpec's rows at
/// rot_table_stride, so separate tables and one cos_sin_cache alike), the position clamped to
/// them, or from the angle pos * inv_freq[i] by the rule every rotary path shares
/// (fused::cos_sin_angle: fp64 reduction, then MUFU sin/cos).
__device__ __forceinline__ void rotary_cos_sin(const DecodeKernelParams& p, int pos, int i, float* c, float* s) {
  if (p.rot_cos != nullptr) {
    pos = min(max(pos, 0), p.rot_max_pos - 1);
    const std::int64_t at = static_cast<std::int64_t>(pos) * p.rot_table_stride + i;
    *c = __ldg(p.rot_cos + at);
    *s = __ldg(p.rot_sin + at);
    return;
  }
  fused::cos_sin_angle(pos, p.rot_inv_freq[i], c, s);
}

/// Rotates the pair (src_a, src_b) in fp32 (fused::rotate_pair, the expression every rotary path
/// shares) and stores the rounded results to (dst_a, dst_b) (decode.h's rule); in place when equal.
/// The query rows of the split-KV kernel (decode_load_q).
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* src_a, const T* src_b, T* dst_a, T* dst_b, float c, float s) {
  float x1 = ptx::to_float(*src_a), x2 = ptx::to_float(*src_b);
  fused::rotate_pair(x1, x2, c, s);
  *dst_a = ptx::from_float<T>(x1);
  *dst_b = ptx::from_float<T>(x2);
}

/// Stores x, computed in fp32, into a cache element (decode.h's rule): rounded to T, or for an fp8
/// cache (C = Fp8Code) the code of x / scale.
template <typename T, typename C>
__device__ __forceinline__ void store_cache(C* dst, float x, float scale) {
  if constexpr (kFp8Cache<C>) dst->bits = fp8_code(x / scale);
  else *dst = ptx::from_float<T>(x);
}
/// An element of k_new / v_new into the cache unchanged: copied bit for bit, or its fp8 code.
template <typename T, typename C>
__device__ __forceinline__ void copy_cache(C* dst, T x, float scale) {
  if constexpr (kFp8Cache<C>) dst->bits = fp8_code(ptx::to_float(x) / scale);
  else *dst = x;
}

/// Appends token t of sequence b, KV head hk, at cache slot `pos`, by one warp: V copied, K
/// rotated in fp32 (fused::rotate_pair, the expression every rotary path shares; dims past
/// rotary_dim copied), stored by store_cache / copy_cache (an fp8 cache: K is not rounded to T
/// before its division by the scale). The append kernel and the fused append of the split-KV kernel both call
/// this, so the cache bytes are the same either way.
template <typename T, typename C>
__device__ __forceinline__ void append_row(const DecodeKernelParams& p, int b, int t, int hk, int pos, int lane) {
  const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_batch_stride + t * p.kn_seq_stride + hk * p.kn_head_stride;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_batch_stride + t * p.vn_seq_stride + hk * p.vn_head_stride;
  std::int64_t ko, vo;
  kv_rows(p, b, pos, &ko, &vo);
  C* kc = static_cast<C*>(p.k_cache_w) + ko + hk * p.k_head_stride;
  C* vc = static_cast<C*>(p.v_cache_w) + vo + hk * p.v_head_stride;
  const int rd = p.rot_style != 0 ? p.rot_dim : 0;
  float ks = 1.f, vs = 1.f;
  if constexpr (kFp8Cache<C>) {
    ks = __ldg(p.k_scale + hk);
    vs = __ldg(p.v_scale + hk);
  }
  // Only the tensors' own elements: a cache row padded past head_dim (head_dim_v) keeps its bytes.
  for (int e = lane; e < p.head_dim_v; e += 32) copy_cache(vc + e, vn[e], vs);
  for (int e = rd + lane; e < p.head_dim; e += 32) copy_cache(kc + e, kn[e], ks);  // dims past rotary_dim pass through
  if (rd > 0) {
    const RopeStyle style = p.rot_style == 2 ? RopeStyle::kInterleaved : RopeStyle::kNeox;
    for (int i = lane; i < rd / 2; i += 32) {
      float c, s;
      rotary_cos_sin(p, pos, i, &c, &s);
      int ea, eb;
      flashcpp::decode::rotary_pair(style, i, rd, &ea, &eb);
      float x1 = ptx::to_float(kn[ea]), x2 = ptx::to_float(kn[eb]);
      fused::rotate_pair(x1, x2, c, s);
      store_cache<T>(kc + ea, x1, ks);
      store_cache<T>(kc + eb, x2, ks);
    }
  }
}

}  // namespace flashcpp::cuda::decode_dev
