// Rotary + KV-cache append (rope_append_kv, semantics in include/flashcpp/fused.h): a step's new
// keys rotated and written with its values into a contiguous or paged cache, and q rotated in the
// same pass (FlashInfer's append_paged_kv_cache with the rotary of its fused rope ops).
//
// Napkin math (H200, 4.3 TB/s; bf16), a decode step of 256 sequences, Llama-3-8B (32 q heads,
// 8 KV heads, 128): read q, k, v + write q, k, v = 2 * 256 * 48 * 128 * 2 B = 6.3 MB -> 1.5 us
// floor: launch latency bound, which is the point of doing it in one launch instead of three
// (apply_rotary, then two scatters). A prefill chunk of 16384 tokens moves 403 MB: 94 us floor.
//
// Work split, 16-byte path: a group of G lanes (G = the next power of two of max(head_dim,
// head_dim_v) / 8) owns a chunk of kChunkRows = 4 heads of one token, rows over the heads_q query
// heads and then the heads_kv KV heads; lane l holds elements [8l, 8l + 8) of each (rope_row.cuh's
// chunk layout) and a KV row carries both the key (rotated) and the value (copied) of its head.
// A thread issues every load of its chunk first (up to 8 x 16 bytes), then forms the token's
// cos/sin once for the four heads and the cache place once for the token, rotates through
// shuffles and stores. Why: one row per group staged through shared memory kept 16-32 bytes a
// thread in flight and formed each pair's angle twice per head. A neox rotary_dim that is not a
// multiple of 16 parks each row in a warp-private stage instead (rope_row.cuh). Scalar path (any
// pointer, stride or head dim off the 16-byte grid): one row per group, 8 elements a lane at
// stride G, the rotation through the stage.
// Cache addressing is common/kv_append.h's (decode's rule: slot cache_seqlens[b] + s, the page from
// the block table), clamped on the device so no write leaves the cache.
//
// An fp8 e4m3 cache (k_scale set) is written in the same pass: a KV row's key is rotated in fp32
// from the staged row without rounding to T, divided by its head's scale and stored as its
// cvt.rn.satfinite code (decode's fp8_code, so decode's append writes the same bytes), 8 codes per
// 8-byte store on the vector path; the value likewise. A runtime branch per row, not a template
// parameter: the bytes a KV row moves drop from 8 to 6 per element pair (k, v read as T, written as
// codes) and the branch is uniform over a row's lanes.
//
// Instantiations: {bf16, fp16} x {16-byte chunk kernel, scalar row kernel} = 4 (either cache kind).
#include <algorithm>
#include <limits>

#include "common/kv_append.h"
#include "cuda/cuda_api.h"
#include "cuda/decode/decode_device.cuh"  // fp8_code: the code decode's append stores
#include "cuda/fused/fused_common.cuh"
#include "cuda/fused/fused_launch.h"
#include "cuda/fused/rope_row.cuh"

namespace flashcpp::cuda {
namespace fused {
namespace {

/// Kernel arguments (one __grid_constant__ struct).
struct AppendArgs {
  const void* q = nullptr;
  void* q_out = nullptr;
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  std::int64_t q_bs = 0, q_ss = 0, q_hs = 0, qo_bs = 0, qo_ss = 0, qo_hs = 0;
  std::int64_t kn_bs = 0, kn_ss = 0, kn_hs = 0, vn_bs = 0, vn_ss = 0, vn_hs = 0;
  std::int64_t kc_bs = 0, kc_ss = 0, kc_hs = 0, vc_bs = 0, vc_ss = 0, vc_hs = 0;
  int heads_q = 0, heads = 0;  ///< query heads, and query + KV heads (rows per token)
  int seqlen = 0;
  std::int64_t rows = 0;       ///< tokens * heads
  std::int64_t chunks = 0;     ///< chunk kernel: tokens * chunks_per_token
  int chunks_per_token = 0;    ///< ceil(heads / kChunkRows)
  int head_dim = 0, head_dim_v = 0;
  int group = 0;               ///< lanes per row
  // The cache (flashcpp/decode.h's KVCacheView).
  bool paged = false;
  int page_shift = 0, num_pages = 0;
  std::int64_t slots = 0;      ///< key slots a sequence can address
  const std::int32_t* block_table = nullptr;
  std::int64_t block_table_stride = 0;
  const std::int32_t* cache_seqlens = nullptr;
  const std::int32_t* positions = nullptr;  ///< null: the token's slot
  /// fp8 e4m3 cache only: fp32 [heads_kv] scales (the cache holds codes of x / scale); null: T.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  RowRotary rotary;
};

/// Loads the valid elements of a row of n elements in the lane layout.
template <class T, int VEC, int SLOTS>
__device__ __forceinline__ void load_row(const T* src, Vec<T, VEC> (&v)[SLOTS], int lane, int g, int n, bool live) {
#pragma unroll
  for (int k = 0; k < SLOTS; ++k) {
    const int e = row_elem<VEC>(lane, k, g);
    if (live && e < n) v[k] = load_vec<T, VEC>(src + e, min(VEC, n - e));
  }
}

template <class T, int VEC, int SLOTS>
__device__ __forceinline__ void store_row(T* dst, const Vec<T, VEC> (&v)[SLOTS], int lane, int g, int n) {
#pragma unroll
  for (int k = 0; k < SLOTS; ++k) {
    const int e = row_elem<VEC>(lane, k, g);
    if (e < n) store_vec<T, VEC>(dst + e, v[k], min(VEC, n - e));
  }
}

/// A row of an fp8 cache (fused.h): each valid element of the lane's vectors in fp32 (rotated from
/// the staged row `srow`, unrounded, when `rotate` and below rotary_dim), divided by the head's
/// scale and stored as its e4m3 code; a vector's codes in one store (8 bytes on the 16-byte path).
template <class T, int VEC, int SLOTS>
__device__ __forceinline__ void store_codes(std::uint8_t* dst, const Vec<T, VEC> (&x)[SLOTS], const RowRotary& r,
                                            bool rotate, const T* srow, std::int32_t pos, float scale, int lane, int g,
                                            int n) {
#pragma unroll
  for (int k = 0; k < SLOTS; ++k) {
    const int e0 = row_elem<VEC>(lane, k, g);
    if (e0 >= n) continue;
    Vec<std::uint8_t, VEC> c;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const int e = e0 + i;  // e >= n: never stored (rotary_dim <= n, so never rotated either)
      const float f = rotate && e < r.rot ? rotated_f32<T>(r, srow, e, x[k].v[i], pos) : to_float(x[k].v[i]);
      c.v[i] = decode_dev::fp8_code(f / scale);
    }
    store_vec<std::uint8_t, VEC>(dst + e0, c, min(VEC, n - e0));
  }
}

/// A chunk-layout vector of an fp8 cache row: its first `count` elements from the unrounded
/// rotation f, the rest from x, each divided by the head's scale and stored as its e4m3 code.
template <class T>
__device__ __forceinline__ void store_codes_vec(std::uint8_t* dst, const Vec<T, kVec16>& x, const float (&f)[kVec16],
                                                int count, float scale) {
  Vec<std::uint8_t, kVec16> c;
#pragma unroll
  for (int i = 0; i < kVec16; ++i) c.v[i] = decode_dev::fp8_code((i < count ? f[i] : to_float(x.v[i])) / scale);
  store_vec<std::uint8_t, kVec16>(dst, c, kVec16);
}

/// Row kernel (the scalar path): one (token, head) row per group of G lanes.
template <class T, int VEC>
__global__ void __launch_bounds__(kRowBlockThreads) rope_append_kernel(const __grid_constant__ AppendArgs a) {
  constexpr int kSlots = kRowLaneElems / VEC;
  __shared__ __align__(16) T stage[kRowStageElems];
  const int g = a.group, lane = threadIdx.x & (g - 1);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kRowBlockThreads / g) + threadIdx.x / g;
  T* srow = stage + (threadIdx.x / g) * (g * kRowLaneElems);
  const bool live = row < a.rows;  // a dead group still reaches the __syncwarp
  const std::int64_t t = live ? row / a.heads : 0;
  const int h = live ? static_cast<int>(row - t * a.heads) : 0;
  const bool is_q = h < a.heads_q;
  const int b = static_cast<int>(t / a.seqlen), s = static_cast<int>(t - static_cast<std::int64_t>(b) * a.seqlen);
  // The token's slot in its sequence (clamped so the step fits the cache) and rotary position.
  const int j = live ? flashcpp::fused::append_base(__ldg(a.cache_seqlens + b), a.slots, a.seqlen) + s : 0;
  const std::int32_t pos = live ? (a.positions ? __ldg(a.positions + t) : j) : 0;

  // 1. Load the row to rotate (q, or the new key) and, for a KV row, the value.
  Vec<T, VEC> x[kSlots], v[kSlots];
  const int hk = h - a.heads_q;
  const T* src = is_q ? static_cast<const T*>(a.q) + b * a.q_bs + s * a.q_ss + h * a.q_hs
                      : static_cast<const T*>(a.k_new) + b * a.kn_bs + s * a.kn_ss + hk * a.kn_hs;
  load_row<T, VEC, kSlots>(src, x, lane, g, a.head_dim, live);
  if (!is_q)
    load_row<T, VEC, kSlots>(static_cast<const T*>(a.v_new) + b * a.vn_bs + s * a.vn_ss + hk * a.vn_hs, v, lane, g,
                             a.head_dim_v, live);
  // 2. Rotate through the warp-private stage (rope_row.cuh); an fp8 KV row rotates as it stores.
  const bool rotate = a.rotary.style != 0, fp8 = !is_q && a.k_scale != nullptr;
  if (rotate) {
    if (live) stage_row<T, VEC, kSlots>(srow, x, lane, g, a.head_dim);
    __syncwarp();
    if (live && !fp8) rotate_lane_row<T, VEC, kSlots>(a.rotary, srow, x, lane, g, a.head_dim, pos);
  }
  if (!live) return;
  // 3. Store: q_out, or the cache's K and V rows of slot j.
  if (is_q) {
    store_row<T, VEC, kSlots>(static_cast<T*>(a.q_out) + b * a.qo_bs + s * a.qo_ss + h * a.qo_hs, x, lane, g, a.head_dim);
    return;
  }
  std::int64_t block, slot_row;
  flashcpp::fused::slot_place(a.block_table, a.block_table_stride, a.page_shift, a.num_pages, a.paged, b, j, &block,
                              &slot_row);
  if (fp8) {
    store_codes<T, VEC, kSlots>(static_cast<std::uint8_t*>(a.k_cache) + block * a.kc_bs + slot_row * a.kc_ss + hk * a.kc_hs,
                                x, a.rotary, rotate, srow, pos, __ldg(a.k_scale + hk), lane, g, a.head_dim);
    store_codes<T, VEC, kSlots>(static_cast<std::uint8_t*>(a.v_cache) + block * a.vc_bs + slot_row * a.vc_ss + hk * a.vc_hs,
                                v, a.rotary, false, srow, pos, __ldg(a.v_scale + hk), lane, g, a.head_dim_v);
    return;
  }
  store_row<T, VEC, kSlots>(static_cast<T*>(a.k_cache) + block * a.kc_bs + slot_row * a.kc_ss + hk * a.kc_hs, x, lane, g,
                            a.head_dim);
  store_row<T, VEC, kSlots>(static_cast<T*>(a.v_cache) + block * a.vc_bs + slot_row * a.vc_ss + hk * a.vc_hs, v, lane, g,
                            a.head_dim_v);
}

/// Chunk kernel (the 16-byte path): kChunkRows heads of one token per group of G lanes.
template <class T>
__global__ void __launch_bounds__(kRowBlockThreads) rope_append_chunk_kernel(const __grid_constant__ AppendArgs a) {
  constexpr int R = kChunkRows, V = kVec16;
  __shared__ __align__(16) T stage[kRowStageElems];  // rows of a neox half that is not a multiple of 8
  const int g = a.group, lane = threadIdx.x & (g - 1);
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.x) * (kRowBlockThreads / g) + threadIdx.x / g;
  T* srow = stage + (threadIdx.x / g) * (g * kRowLaneElems);
  const bool live = chunk < a.chunks;  // a dead group still reaches the shuffles and __syncwarp
  const std::int64_t t = live ? div_i64(chunk, a.chunks_per_token) : 0;
  const int h0 = live ? static_cast<int>(chunk - t * a.chunks_per_token) * R : a.heads;  // dead: no head
  const int b = static_cast<int>(div_i64(t, a.seqlen)), s = static_cast<int>(t - static_cast<std::int64_t>(b) * a.seqlen);
  const bool k_lane = lane * V < a.head_dim, v_lane = lane * V < a.head_dim_v;
  const int e0 = lane * V;
  auto valid = [&](int r) { return h0 + r < a.heads; };
  auto is_q = [&](int r) { return h0 + r < a.heads_q; };
  const bool any_kv = valid(0) && min(h0 + R, a.heads) > a.heads_q;
  // The token's slot in its sequence (clamped so the step fits the cache) and rotary position.
  const int j = live ? flashcpp::fused::append_base(__ldg(a.cache_seqlens + b), a.slots, a.seqlen) + s : 0;
  const std::int32_t pos = live ? (a.positions ? __ldg(a.positions + t) : j) : 0;

  // 1. Every load first (raw words: unpacked bf16 would take twice the registers): q or the new key
  //    of each head, and the value of each KV head.
  uint4 xr[R], vr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int h = h0 + r, hk = h - a.heads_q;
    if (!valid(r)) continue;
    if (is_q(r)) {
      if (k_lane) xr[r] = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) + b * a.q_bs + s * a.q_ss + h * a.q_hs + e0);
      continue;
    }
    if (k_lane)
      xr[r] = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.k_new) + b * a.kn_bs + s * a.kn_ss + hk * a.kn_hs + e0);
    if (v_lane)
      vr[r] = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.v_new) + b * a.vn_bs + s * a.vn_ss + hk * a.vn_hs + e0);
  }
  // 2. While they are out: the token's cache place (one block-table read) and cos/sin, once for
  //    all R heads.
  std::int64_t block = 0, slot_row = 0;
  if (any_kv)
    flashcpp::fused::slot_place(a.block_table, a.block_table_stride, a.page_shift, a.num_pages, a.paged, b, j, &block,
                                &slot_row);
  const bool rotate = a.rotary.style != 0, fp8 = a.k_scale != nullptr;
  LanePairs lp;
  if (rotate && a.rotary.in_lanes) lp = lane_pairs(a.rotary, lane, threadIdx.x & 31, pos, live);
  // 3. Per head: rotate (every lane takes part in the shuffles or the stage), store.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int h = h0 + r, hk = h - a.heads_q;
    Vec<T, V> x;
    *reinterpret_cast<uint4*>(&x) = xr[r];
    float f[V];
    const int count = rotate ? rotate_chunk_row_f32<T>(a.rotary, lp, srow, x, lane, valid(r) && k_lane, pos, f) : 0;
    if (!valid(r)) continue;
    if (is_q(r)) {
      if (k_lane)
        store_vec<T, V>(static_cast<T*>(a.q_out) + b * a.qo_bs + s * a.qo_ss + h * a.qo_hs + e0, merge_rotated<T>(x, f, count), V);
      continue;
    }
    Vec<T, V> v;
    *reinterpret_cast<uint4*>(&v) = vr[r];
    const std::int64_t kc = block * a.kc_bs + slot_row * a.kc_ss + hk * a.kc_hs + e0;
    const std::int64_t vc = block * a.vc_bs + slot_row * a.vc_ss + hk * a.vc_hs + e0;
    if (fp8) {  // fused.h: codes of the unrounded rotation / k_scale and of v / v_scale
      if (k_lane) store_codes_vec<T>(static_cast<std::uint8_t*>(a.k_cache) + kc, x, f, count, __ldg(a.k_scale + hk));
      if (v_lane) store_codes_vec<T>(static_cast<std::uint8_t*>(a.v_cache) + vc, v, f, 0, __ldg(a.v_scale + hk));
      continue;
    }
    if (k_lane) store_vec<T, V>(static_cast<T*>(a.k_cache) + kc, merge_rotated<T>(x, f, count), V);
    if (v_lane) store_vec<T, V>(static_cast<T*>(a.v_cache) + vc, v, V);
  }
}

int next_pow2(int a) {
  int p = 1;
  while (p < a) p <<= 1;
  return p;
}
int log2_of(int pow2) {
  int s = 0;
  while ((1 << s) < pow2) ++s;
  return s;
}

/// 16-byte accesses: every pointer 16-byte aligned, head dims and every stride in use a multiple of 8
/// (an fp8 cache then takes aligned 8-byte stores of 8 codes).
bool vector_ok(const RopeAppendParams& p) {
  if (p.head_dim % kVec16 != 0 || p.effective_head_dim_v() % kVec16 != 0) return false;
  auto ok = [](const TensorView& t, std::int64_t e0, std::int64_t e1, std::int64_t e2) {
    return aligned(t.data, 16) && (e0 <= 1 || t.batch_stride % kVec16 == 0) && (e1 <= 1 || t.seq_stride % kVec16 == 0) &&
           (e2 <= 1 || t.head_stride % kVec16 == 0);
  };
  const KVCacheView& c = p.cache;
  const std::int64_t blocks = c.paged() ? c.num_pages : p.batch;
  const std::int64_t rows = c.paged() ? c.page_size : c.capacity;
  bool all = ok(p.k_new, p.batch, p.seqlen, p.heads_kv) && ok(p.v_new, p.batch, p.seqlen, p.heads_kv) &&
             ok(c.k, blocks, rows, p.heads_kv) && ok(c.v, blocks, rows, p.heads_kv);
  if (p.heads_q > 0) all = all && ok(p.q, p.batch, p.seqlen, p.heads_q) && (!p.q_out.data || ok(p.q_out, p.batch, p.seqlen, p.heads_q));
  return all;
}

}  // namespace
}  // namespace fused

FusedPath rope_append_path(const RopeAppendParams& p, const FusedForce& force, bool named) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p);
  path.register_row = true;
  path.threads = kRowBlockThreads;
  const int widest = std::max(p.head_dim, p.effective_head_dim_v());
  path.group = next_pow2((widest + kRowLaneElems - 1) / kRowLaneElems);
  if (!named) return path;
  path.name = std::string("rope_append_kv ") + (p.rotary.enabled() ? rope_style_name(p.rotary.style) : "no-rotary") +
              (path.vector ? " vec8" : " scalar") + (p.cache.paged() ? " paged" : " contiguous") +
              (p.cache.fp8() ? " fp8" : "") +
              (p.rotary.has_tables() ? " cache" : "") + " group=" + std::to_string(path.group);
  return path;
}

Status rope_append_kv(const RopeAppendParams& p, const FusedForce& force, Stream stream) {
  using namespace fused;
  const FusedPath path = rope_append_path(p, force, false);
  const KVCacheView& c = p.cache;
  AppendArgs a;
  const TensorView& qo = p.q_out.data ? p.q_out : p.q;
  a.q = p.q.data;
  a.q_out = qo.data;
  a.q_bs = p.q.batch_stride, a.q_ss = p.q.seq_stride, a.q_hs = p.q.head_stride;
  a.qo_bs = qo.batch_stride, a.qo_ss = qo.seq_stride, a.qo_hs = qo.head_stride;
  a.k_new = p.k_new.data;
  a.v_new = p.v_new.data;
  a.kn_bs = p.k_new.batch_stride, a.kn_ss = p.k_new.seq_stride, a.kn_hs = p.k_new.head_stride;
  a.vn_bs = p.v_new.batch_stride, a.vn_ss = p.v_new.seq_stride, a.vn_hs = p.v_new.head_stride;
  a.k_cache = c.k.data;
  a.v_cache = c.v.data;
  a.kc_bs = c.k.batch_stride, a.kc_ss = c.k.seq_stride, a.kc_hs = c.k.head_stride;
  a.vc_bs = c.v.batch_stride, a.vc_ss = c.v.seq_stride, a.vc_hs = c.v.head_stride;
  a.heads_q = p.heads_q;
  a.heads = p.heads_q + p.heads_kv;
  a.seqlen = p.seqlen;
  a.rows = static_cast<std::int64_t>(p.batch) * p.seqlen * a.heads;
  a.head_dim = p.head_dim;
  a.head_dim_v = p.effective_head_dim_v();
  a.group = path.group;
  a.paged = c.paged();
  a.page_shift = c.paged() ? log2_of(c.page_size) : 0;
  a.num_pages = c.num_pages;
  a.slots = c.slots();
  a.block_table = c.block_table;
  a.block_table_stride = c.block_table_stride;
  a.cache_seqlens = p.cache_seqlens;
  a.positions = p.positions;
  a.k_scale = c.fp8() ? c.k_scale : nullptr;
  a.v_scale = c.fp8() ? c.v_scale : nullptr;
  if (p.head_dim > kFusedRowMaxHeadDim || a.head_dim_v > kFusedRowMaxHeadDim)
    return Status::Internal("rope_append_kv: a head dim past the row kernel's 256");
  set_row_rotary(p.rotary, p.head_dim, &a.rotary);
  if (a.rows == 0) return Status::Ok();
  const RowGrid grid = row_grid(static_cast<std::int64_t>(p.batch) * p.seqlen, a.heads, path.group, path.vector);
  a.chunks_per_token = grid.chunks_per_token;
  a.chunks = grid.chunks;
  const std::int64_t blocks = grid.blocks;
  if (blocks > std::numeric_limits<std::int32_t>::max())
    return Status::Unsupported("rope_append_kv: the launch needs more than 2^31-1 blocks (too many tokens x heads)");
  return with_half_type(p.k_new.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.vector)
      rope_append_chunk_kernel<T><<<static_cast<unsigned>(blocks), kRowBlockThreads, 0, stream>>>(a);
    else
      rope_append_kernel<T, kScalar><<<static_cast<unsigned>(blocks), kRowBlockThreads, 0, stream>>>(a);
    return launch_status("rope_append_kv");
  });
}

}  // namespace flashcpp::cuda
