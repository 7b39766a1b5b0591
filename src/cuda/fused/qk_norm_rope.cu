// Per-head QK-RMSNorm + rotary (qk_norm_rope, semantics in include/flashcpp/fused.h): Qwen3's and
// Gemma3's norm of every q and k head over head_dim, then the rotary embedding, in one pass.
//
// Napkin math (H200, 4.3 TB/s; bf16), Qwen3-8B prefill (4, 4096 tokens, 32 q + 8 k heads, 128):
//   read q, k + write q, k = 2 * 16384 * 40 * 128 * 2 B = 335.5 MB -> floor 78 us. The unfused
//   sequence (rms_norm of q, of k, then apply_rotary) moves the same bytes twice: 156 us floor.
//   Per element ~10 FLOPs and, per pair, one sincos (or two table loads): memory bound.
//
// Work split: one (token, head) row per group of G lanes, G = the next power of two of
// head_dim / 8 (16 lanes for 128), 128 / G rows per 128-thread block; the row stays in registers
// from the load to the store. Exactly the layout of rms_norm's register kernel for a row of
// head_dim (norm_row.cuh: the same sum of squares, lanes, shuffle tree and rsqrt), so the normed
// head has rms_norm's bits; then the group parks the rounded row in a warp-private shared-memory
// stage and every lane rotates its own elements with apply_rotary's arithmetic (rope_row.cuh).
// Each element forms its pair's cos/sin itself, so a pair's angle is evaluated twice (once per
// element): a few percent of issue slots on Hopper; pass a cos_sin_cache where fp64 is slow.
//
// Instantiations: {bf16, fp16} x {16-byte vectors, scalar} = 4. The scalar path (a pointer not
// 16-byte aligned, a stride or head_dim not a multiple of 8) holds 8 elements a lane at stride G
// (rms_norm's scalar layout) and is ~8x more memory instructions: expect about half the bandwidth.
#include <algorithm>
#include <limits>

#include "cuda/cuda_api.h"
#include "cuda/fused/fused_common.cuh"
#include "cuda/fused/fused_launch.h"
#include "cuda/fused/norm_row.cuh"
#include "cuda/fused/rope_row.cuh"

namespace flashcpp::cuda {
namespace fused {
namespace {

/// Kernel arguments (one __grid_constant__ struct); index 0 = q, 1 = k.
struct QkNormArgs {
  const void* in[2] = {nullptr, nullptr};
  void* out[2] = {nullptr, nullptr};
  const void* weight[2] = {nullptr, nullptr};
  std::int64_t in_bs[2] = {}, in_ss[2] = {}, in_hs[2] = {};
  std::int64_t out_bs[2] = {}, out_ss[2] = {}, out_hs[2] = {};
  int heads_q = 0, heads = 0;  ///< heads of q, and of q and k together
  int seqlen = 0;
  std::int64_t rows = 0;       ///< tokens * heads
  int head_dim = 0;
  int nvec = 0;                ///< vectors of VEC elements in a row
  int group = 0;               ///< lanes per row: a power of two <= 32
  float eps = 0.f, inv_hidden = 0.f, weight_offset = 0.f;
  const std::int32_t* positions = nullptr;  ///< null: position = s
  RowRotary rotary;
};

template <class T, int VEC>
__global__ void __launch_bounds__(kRowBlockThreads) qk_norm_rope_kernel(const __grid_constant__ QkNormArgs a) {
  constexpr int kSlots = kRowLaneElems / VEC;  // 1 vector, or 8 scalars
  __shared__ __align__(16) T stage[kRowStageElems];
  const int g = a.group, lane = threadIdx.x & (g - 1);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kRowBlockThreads / g) + threadIdx.x / g;
  T* srow = stage + (threadIdx.x / g) * (g * kRowLaneElems);
  // A group past the last row still runs the shuffles and the __syncwarp (all lanes must).
  const bool live = row < a.rows;
  const std::int64_t t = live ? row / a.heads : 0;
  const int h = live ? static_cast<int>(row - t * a.heads) : 0;
  const int w = h >= a.heads_q;
  const int hh = w ? h - a.heads_q : h;
  const std::int64_t b = t / a.seqlen, s = t - b * a.seqlen;
  const T* src = static_cast<const T*>(a.in[w]) + b * a.in_bs[w] + s * a.in_ss[w] + hh * a.in_hs[w];
  const T* wt = static_cast<const T*>(a.weight[w]);

  // 1. Load the row and the head's weights, then the sum of squares (rms_norm's order).
  Vec<T, VEC> x[kSlots], wv[kSlots], y[kSlots];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * g;
    const int n = live && v < a.nvec ? valid_in<VEC>(v, a.head_dim) : 0;
    if (n > 0) {
      x[k] = load_vec<T, VEC>(src + v * VEC, n);
      wv[k] = load_vec<T, VEC>(wt + v * VEC, n);
    }
  }
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * g;
    ss += add_residual<T, VEC>(x[k], x[k], live && v < a.nvec ? valid_in<VEC>(v, a.head_dim) : 0, false, &y[k]);
  }
  ss = group_sum(ss, g);
  const float rstd = row_rstd(ss, a.inv_hidden, a.eps);
  // 2. The normed row, rounded to T (fused.h: the rotation reads the rounded values).
#pragma unroll
  for (int k = 0; k < kSlots; ++k) y[k] = scale_by_weight<T, VEC>(y[k], rstd, wv[k], a.weight_offset);
  // 3. Rotate through the warp-private stage, then store.
  if (a.rotary.style != 0) {
    if (live) stage_row<T, VEC, kSlots>(srow, y, lane, g, a.head_dim);
    __syncwarp();
    const std::int32_t pos = live ? (a.positions ? a.positions[t] : static_cast<std::int32_t>(s)) : 0;
    if (live) rotate_lane_row<T, VEC, kSlots>(a.rotary, srow, y, lane, g, a.head_dim, pos);
  }
  if (!live) return;
  T* dst = static_cast<T*>(a.out[w]) + b * a.out_bs[w] + s * a.out_ss[w] + hh * a.out_hs[w];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * g;
    const int n = v < a.nvec ? valid_in<VEC>(v, a.head_dim) : 0;
    if (n > 0) store_vec<T, VEC>(dst + v * VEC, y[k], n);
  }
}

int next_pow2(int a) {
  int p = 1;
  while (p < a) p <<= 1;
  return p;
}

/// 16-byte accesses: every pointer 16-byte aligned, head_dim and every stride in use a multiple
/// of 8 (rms_norm's rule for the same rows, so both take the same layout).
bool vector_ok(const QkNormRopeParams& p) {
  if (p.head_dim % kVec16 != 0) return false;
  auto ok = [&](const TensorView& t, int heads) {
    return aligned(t.data, 16) && (p.batch <= 1 || t.batch_stride % kVec16 == 0) &&
           (p.seqlen <= 1 || t.seq_stride % kVec16 == 0) && (heads <= 1 || t.head_stride % kVec16 == 0);
  };
  bool all = true;
  if (p.heads_q > 0) all = all && ok(p.q, p.heads_q) && (!p.q_out.data || ok(p.q_out, p.heads_q)) && aligned(p.q_weight, 16);
  if (p.heads_k > 0) all = all && ok(p.k, p.heads_k) && (!p.k_out.data || ok(p.k_out, p.heads_k)) && aligned(p.k_weight, 16);
  return all;
}

}  // namespace
}  // namespace fused

FusedPath qk_norm_rope_path(const QkNormRopeParams& p, const FusedForce& force) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p);
  path.register_row = true;
  path.threads = kRowBlockThreads;
  path.group = next_pow2((p.head_dim + kRowLaneElems - 1) / kRowLaneElems);
  path.name = std::string("qk_norm_rope ") + (p.rotary.enabled() ? rope_style_name(p.rotary.style) : "norm-only") +
              (path.vector ? " vec8" : " scalar") + (p.rotary.has_tables() ? " cache" : "") +
              " group=" + std::to_string(path.group);
  return path;
}

Status qk_norm_rope(const QkNormRopeParams& p, const FusedForce& force, Stream stream) {
  using namespace fused;
  const FusedPath path = qk_norm_rope_path(p, force);
  const int vec = path.vector ? kVec16 : kScalar;
  QkNormArgs a;
  set_qk_views(p.q, p.k, p.q_out, p.k_out, &a);
  a.weight[0] = p.q_weight;
  a.weight[1] = p.k_weight;
  a.heads_q = p.heads_q;
  a.heads = p.heads_q + p.heads_k;
  a.seqlen = p.seqlen;
  a.rows = static_cast<std::int64_t>(p.batch) * p.seqlen * a.heads;
  a.head_dim = p.head_dim;
  a.nvec = (p.head_dim + vec - 1) / vec;
  a.group = path.group;
  a.eps = p.eps;
  a.inv_hidden = static_cast<float>(1.0 / static_cast<double>(p.head_dim));  // rms_norm's, for hidden = head_dim
  a.weight_offset = p.weight_offset;
  a.positions = p.positions;
  if (p.head_dim > kFusedRowMaxHeadDim) return Status::Internal("qk_norm_rope: head_dim past the row kernel's 256");
  set_row_rotary(p.rotary, p.head_dim, &a.rotary);
  if (a.rows == 0) return Status::Ok();
  const int rows_per_block = kRowBlockThreads / path.group;
  const std::int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  if (blocks > std::numeric_limits<std::int32_t>::max())
    return Status::Unsupported("qk_norm_rope: the launch needs more than 2^31-1 blocks (too many tokens x heads)");
  return with_half_type(p.heads_q > 0 ? p.q.dtype : p.k.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.vector)
      qk_norm_rope_kernel<T, kVec16><<<static_cast<unsigned>(blocks), kRowBlockThreads, 0, stream>>>(a);
    else
      qk_norm_rope_kernel<T, kScalar><<<static_cast<unsigned>(blocks), kRowBlockThreads, 0, stream>>>(a);
    return launch_status("qk_norm_rope");
  });
}

}  // namespace flashcpp::cuda
