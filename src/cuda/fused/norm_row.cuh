// The row arithmetic of RMSNorm on the device, shared by rms_norm / fused_add_rms_norm
// (rms_norm.cu) and the per-head norm of qk_norm_rope (qk_norm_rope.cu): one code path for the
// sum of squares and the scaled, rounded output, so a head normed by qk_norm_rope has the bits
// rms_norm gives it (same lanes, same order, same contractions).
#pragma once

#include "cuda/fused/fused_common.cuh"

namespace flashcpp::cuda::fused {

/// Elements of vector v inside a row of `hidden` elements (VEC, or fewer for the tail).
template <int VEC>
__device__ __forceinline__ int valid_in(int v, int hidden) {
  return min(VEC, hidden - v * VEC);
}

/// h = round(x + r) (or x without a residual), kept packed; returns the sum of squares of the
/// rounded h. n == 0 (no elements here) gives h = 0; load_vec zero-filled a tail already.
template <class T, int VEC>
__device__ __forceinline__ float add_residual(const Vec<T, VEC>& x, const Vec<T, VEC>& r, int n, bool has_res,
                                              Vec<T, VEC>* h) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    float f = 0.f;
    if (n > 0) {
      f = to_float(x.v[i]);
      if (has_res) {
        h->v[i] = from_float<T>(f + to_float(r.v[i]));
        f = to_float(h->v[i]);
      } else {
        h->v[i] = x.v[i];
      }
    } else {
      h->v[i] = from_float<T>(0.f);
    }
    ss += f * f;
  }
  return ss;
}

/// y = (h * rstd) * w, rounded to T.
template <class T, int VEC>
__device__ __forceinline__ Vec<T, VEC> scale_by_weight(const Vec<T, VEC>& h, float rstd, const Vec<T, VEC>& w) {
  Vec<T, VEC> o;
#pragma unroll
  for (int i = 0; i < VEC; ++i) o.v[i] = from_float<T>(to_float(h.v[i]) * rstd * to_float(w.v[i]));
  return o;
}

/// y = (h * rstd) * (offset + w), rounded to T (qk_norm_rope's weight_offset, Gemma3's 1 + w).
/// offset 0 takes w itself, not 0 + w (whose -0 + 0 would be +0), so it is scale_by_weight's
/// expression exactly.
template <class T, int VEC>
__device__ __forceinline__ Vec<T, VEC> scale_by_weight(const Vec<T, VEC>& h, float rstd, const Vec<T, VEC>& w,
                                                       float offset) {
  Vec<T, VEC> o;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float wf = offset != 0.f ? offset + to_float(w.v[i]) : to_float(w.v[i]);
    o.v[i] = from_float<T>(to_float(h.v[i]) * rstd * wf);
  }
  return o;
}

/// 1 / sqrt(mean of squares + eps) of a row from its sum of squares (rsqrt.approx, as every norm).
__device__ __forceinline__ float row_rstd(float ss, float inv_hidden, float eps) { return rsqrtf(ss * inv_hidden + eps); }

}  // namespace flashcpp::cuda::fused
