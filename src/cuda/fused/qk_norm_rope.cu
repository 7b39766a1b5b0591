// Per-head QK-RMSNorm + rotary (qk_norm_rope, semantics in include/flashcpp/fused.h): Qwen3's and
// Gemma3's norm of every q and k head over head_dim, then the rotary embedding, in one pass.
//
// Napkin math (H200, 4.3 TB/s; bf16), Qwen3-8B prefill (4, 4096 tokens, 32 q + 8 k heads, 128):
//   read q, k + write q, k = 2 * 16384 * 40 * 128 * 2 B = 335.5 MB -> floor 78 us. The unfused
//   sequence (rms_norm of q, of k, then apply_rotary) moves the same bytes twice: 156 us floor.
//   Per element ~10 FLOPs and, per pair, one sincos (or two table loads): memory bound.
//
// Work split, 16-byte path (rows aligned, head_dim a multiple of 8): a group of G lanes (G = the
// next power of two of head_dim / 8, 16 for 128) owns a chunk of kChunkRows = 4 heads of one
// token, lane l elements [8l, 8l + 8) of each (rope_row.cuh's chunk layout). A thread issues its
// four 16-byte row loads and its weight loads first, then forms the token's cos/sin for its 8
// pairs once (for all four heads) while they are in flight, then per head: rms_norm's sum of
// squares and shuffle tree (norm_row.cuh: the lane holds the vector rms_norm's lane holds, so the
// normed head has rms_norm's bits), the rounded normed vector rotated through shuffles with
// apply_rotary's arithmetic, and a 16-byte store. Why: one row per group with the rotation staged
// through shared memory kept only 16 bytes a thread in flight and evaluated each pair's angle
// twice per head; here a thread keeps 64 bytes in flight and evaluates its angles once per four
// heads. A neox rotary_dim that is not a multiple of 16 parks each row in a warp-private stage
// instead of shuffling (rope_row.cuh), still on this layout.
//
// Scalar path (a pointer not 16-byte aligned, a stride or head_dim not a multiple of 8): one row
// per group, 8 elements a lane at stride G (rms_norm's scalar layout), the rotation through the
// stage; ~8x more memory instructions: expect about half the bandwidth.
//
// Instantiations: {bf16, fp16} x {16-byte chunk kernel, scalar row kernel} = 4.
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
  std::int64_t chunks = 0;     ///< chunk kernel: tokens * chunks_per_token
  int chunks_per_token = 0;    ///< ceil(heads / kChunkRows)
  int head_dim = 0;
  int nvec = 0;                ///< vectors of VEC elements in a row
  int group = 0;               ///< lanes per row: a power of two <= 32
  float eps = 0.f, inv_hidden = 0.f, weight_offset = 0.f;
  const std::int32_t* positions = nullptr;  ///< null: position = s
  RowRotary rotary;
};

/// Row kernel (the scalar path): one (token, head) row per group of G lanes.
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

/// Chunk kernel (the 16-byte path): kChunkRows heads of one token per group of G lanes.
template <class T>
__global__ void __launch_bounds__(kRowBlockThreads, kChunkBlocksPerSm) qk_norm_rope_chunk_kernel(const __grid_constant__ QkNormArgs a) {
  constexpr int R = kChunkRows, V = kVec16;
  __shared__ __align__(16) T stage[kRowStageElems];  // rows of a neox half that is not a multiple of 8
  const int g = a.group, lane = threadIdx.x & (g - 1);
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.x) * (kRowBlockThreads / g) + threadIdx.x / g;
  T* srow = stage + (threadIdx.x / g) * (g * kRowLaneElems);
  // A dead group (past the last chunk) still runs the shuffles and the __syncwarp (all lanes must).
  const bool live = chunk < a.chunks;
  const std::int64_t t = live ? div_i64(chunk, a.chunks_per_token) : 0;
  const int h0 = live ? static_cast<int>(chunk - t * a.chunks_per_token) * R : a.heads;  // dead: no head
  const std::int64_t b = div_i64(t, a.seqlen), s = t - b * a.seqlen;
  const bool vec_lane = lane < a.nvec;  // holds a vector of each row
  const int e0 = lane * V;
  auto has = [&](int r) { return vec_lane && h0 + r < a.heads; };
  auto is_k = [&](int r) { return h0 + r >= a.heads_q; };
  auto src_of = [&](int r) {
    const int h = h0 + r;
    return is_k(r) ? static_cast<const T*>(a.in[1]) + b * a.in_bs[1] + s * a.in_ss[1] + (h - a.heads_q) * a.in_hs[1]
                   : static_cast<const T*>(a.in[0]) + b * a.in_bs[0] + s * a.in_ss[0] + h * a.in_hs[0];
  };
  auto dst_of = [&](int r) {
    const int h = h0 + r;
    return is_k(r) ? static_cast<T*>(a.out[1]) + b * a.out_bs[1] + s * a.out_ss[1] + (h - a.heads_q) * a.out_hs[1]
                   : static_cast<T*>(a.out[0]) + b * a.out_bs[0] + s * a.out_ss[0] + h * a.out_hs[0];
  };

  // 1. Every load first: the chunk's rows (kept as raw words: unpacked bf16 would take twice the
  //    registers), and the weight of its first head.
  auto weight_of = [&](int r) { return load_vec<T, V>(static_cast<const T*>(is_k(r) ? a.weight[1] : a.weight[0]) + e0, V); };
  uint4 xr[R];
  Vec<T, V> w;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (has(r)) xr[r] = *reinterpret_cast<const uint4*>(src_of(r) + e0);
  if (has(0)) w = weight_of(0);  // a chunk that runs from q's heads into k's reloads at the change
  // 2. The token's cos/sin for this lane's pairs, once for all R heads, while the loads are out.
  const std::int32_t pos = live ? (a.positions ? a.positions[t] : static_cast<std::int32_t>(s)) : 0;
  LanePairs lp;
  if (a.rotary.style != 0 && a.rotary.in_lanes) lp = lane_pairs(a.rotary, lane, threadIdx.x & 31, pos, live);
  // 3. Per head: the sum of squares (rms_norm's order), the group's shuffle tree (group_sum's), the
  //    normed row rounded to T (fused.h: the rotation reads the rounded values), rotated, stored.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    Vec<T, V> y, xv;
    *reinterpret_cast<uint4*>(&xv) = xr[r];
    float ss = 0.f;
    ss += add_residual<T, V>(xv, xv, has(r) ? V : 0, false, &y);
    ss = group_sum(ss, g);
    const float rstd = row_rstd(ss, a.inv_hidden, a.eps);
    if (r > 0 && has(r) && is_k(r) != is_k(r - 1)) w = weight_of(r);
    Vec<T, V> o = scale_by_weight<T, V>(y, rstd, w, a.weight_offset);
    if (a.rotary.style != 0) {
      float f[V];
      const int count = rotate_chunk_row_f32<T>(a.rotary, lp, srow, o, lane, has(r), pos, f);
      o = merge_rotated<T>(o, f, count);
    }
    if (has(r)) store_vec<T, V>(dst_of(r) + e0, o, V);
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

FusedPath qk_norm_rope_path(const QkNormRopeParams& p, const FusedForce& force, bool named) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p);
  path.register_row = true;
  path.threads = kRowBlockThreads;
  path.group = next_pow2((p.head_dim + kRowLaneElems - 1) / kRowLaneElems);
  if (!named) return path;
  path.name = std::string("qk_norm_rope ") + (p.rotary.enabled() ? rope_style_name(p.rotary.style) : "norm-only") +
              (path.vector ? " vec8" : " scalar") + (p.rotary.has_tables() ? " cache" : "") +
              " group=" + std::to_string(path.group);
  return path;
}

Status qk_norm_rope(const QkNormRopeParams& p, const FusedForce& force, Stream stream) {
  using namespace fused;
  const FusedPath path = qk_norm_rope_path(p, force, false);
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
  const RowGrid grid = row_grid(static_cast<std::int64_t>(p.batch) * p.seqlen, a.heads, path.group, path.vector);
  a.chunks_per_token = grid.chunks_per_token;
  a.chunks = grid.chunks;
  const std::int64_t blocks = grid.blocks;
  if (blocks > std::numeric_limits<std::int32_t>::max())
    return Status::Unsupported("qk_norm_rope: the launch needs more than 2^31-1 blocks (too many tokens x heads)");
  return with_half_type(p.heads_q > 0 ? p.q.dtype : p.k.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.vector)
      qk_norm_rope_chunk_kernel<T><<<static_cast<unsigned>(blocks), kRowBlockThreads, 0, stream>>>(a);
    else
      qk_norm_rope_kernel<T, kScalar><<<static_cast<unsigned>(blocks), kRowBlockThreads, 0, stream>>>(a);
    return launch_status("qk_norm_rope");
  });
}

}  // namespace flashcpp::cuda
