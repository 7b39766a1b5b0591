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
// up to kHeadsInFlight heads of q and k (heads g, g + G, ... with G = ceil(heads / 4) groups).
// It issues all its loads first, then (overlapping their latency) the block computes inv_freq
// in fp64 into shared memory (one barrier), the thread forms its VEC cos/sin in registers, and
// rotates and stores. Out of place with a partial rotary_dim, extra lanes copy the tail. No
// loop, no further barrier: 8192 blocks of 128 threads for the DESIGN case.
// cos/sin are evaluated G times per (token, pair) (8 for the DESIGN case): ~5 fp64 operations
// and 2 MUFU each, a few percent of the issue slots on A100/H100/H200. On parts with 1/64-rate
// fp64 (L40, A10) that share is much larger: pass a cos_sin_cache there.
// In place is safe: an element is read and written by the same thread.
//
#include <algorithm>
#include <limits>

#include "cuda/fused/fused_common.cuh"
#include "cuda/fused/fused_launch.h"
#include "cuda/fused/fused_math.h"

namespace flashcpp::cuda {
namespace fused {
namespace {

constexpr int kThreads = 128;       // small blocks: finer occupancy steps at ~100-128 registers
constexpr int kHeadsInFlight = 4;  // heads one thread loads (all at once) and rotates

/// Kernel arguments; index 0 = q, 1 = k.
struct RotaryArgs {
  const void* in[2] = {nullptr, nullptr};
  void* out[2] = {nullptr, nullptr};
  std::int64_t in_bs[2] = {}, in_ss[2] = {}, in_hs[2] = {};    ///< batch / seq / head strides of the inputs
  std::int64_t out_bs[2] = {}, out_ss[2] = {}, out_hs[2] = {};
  int heads_q = 0, heads = 0;  ///< heads of q, and of q and k together
  std::int64_t threads = 0;    ///< tokens * groups * lanes: one thread each
  int seqlen = 0;
  int half = 0;       ///< rotary_dim / 2
  int rot_lanes = 0;  ///< lanes of VEC pairs: half / VEC
  int lanes = 0;      ///< rot_lanes + pass-through lanes (out of place with a partial rotary_dim)
  int groups = 0;     ///< head groups G; group g takes heads g, g + G, g + 2G, ...
  bool neox = true;
  const std::int32_t* positions = nullptr;  ///< null: position = s
  const float* cache = nullptr;             ///< null: compute cos/sin
  int max_position = 0;
  double theta = 0.0;
  float factor = 0.f, low_freq_factor = 0.f, high_freq_factor = 0.f;
  int original_max_position = 0;
  bool streaming = false;  ///< evict-first hints on q/k loads and stores
};

/// (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, float c, float s) {
  const float a = x0, b = x1;
  x0 = a * c - b * s;
  x1 = b * c + a * s;
}

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

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const __grid_constant__ RotaryArgs a) {
  extern __shared__ double inv_freq[];  // [half], without a cache
  const std::int64_t slot = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = slot < a.threads;  // no early return: the block meets at a barrier below
  const int lane = active ? static_cast<int>(slot % a.lanes) : 0;
  const std::int64_t rest = slot / a.lanes;
  const int group = static_cast<int>(rest % a.groups);
  const std::int64_t t = active ? rest / a.groups : 0;
  const std::int64_t b = t / a.seqlen, s = t - b * a.seqlen;
  const bool rotate = lane < a.rot_lanes;
  int oa, ob;
  lane_offsets<VEC>(a, lane, &oa, &ob);
  // This token's rows of q and k (inputs and outputs). Named variables, not arrays: a runtime
  // index into a local array would put it in local memory.
  const T* src_q = static_cast<const T*>(a.in[0]) + b * a.in_bs[0] + s * a.in_ss[0];
  const T* src_k = static_cast<const T*>(a.in[1]) + b * a.in_bs[1] + s * a.in_ss[1];
  T* dst_q = static_cast<T*>(a.out[0]) + b * a.out_bs[0] + s * a.out_ss[0];
  T* dst_k = static_cast<T*>(a.out[1]) + b * a.out_bs[1] + s * a.out_ss[1];
  // Heads group, group + G, ... (at most kHeadsInFlight of them, by the choice of G).
  auto head_valid = [&](int u) { return active && group + u * a.groups < a.heads; };
  auto src_of = [&](int u) {
    const int h = group + u * a.groups;
    return h >= a.heads_q ? src_k + (h - a.heads_q) * a.in_hs[1] : src_q + h * a.in_hs[0];
  };
  auto dst_of = [&](int u) {
    const int h = group + u * a.groups;
    return h >= a.heads_q ? dst_k + (h - a.heads_q) * a.out_hs[1] : dst_q + h * a.out_hs[0];
  };

  // 1. Every load first: their latency overlaps the cos/sin work below.
  Vec<T, VEC> va[kHeadsInFlight], vb[kHeadsInFlight];
#pragma unroll
  for (int u = 0; u < kHeadsInFlight; ++u) {
    if (!head_valid(u)) continue;
    const T* src = src_of(u);
    va[u] = load_vec<T, VEC>(src + oa, VEC, a.streaming);
    if (rotate) vb[u] = load_vec<T, VEC>(src + ob, VEC, a.streaming);
  }
  // 2. inv_freq (fp64, once per block), then this lane's cos/sin (pairs lane * VEC + k).
  if (!a.cache) {  // uniform over the grid
    for (int i = threadIdx.x; i < a.half; i += blockDim.x)
      inv_freq[i] = flashcpp::fused::inv_freq(i, 2 * a.half, a.theta, a.factor, a.low_freq_factor,
                                              a.high_freq_factor, a.original_max_position);
    __syncthreads();
  }
  if (!active) return;
  float c[VEC], sn[VEC];
  if (rotate) {
    const std::int32_t pos = a.positions ? a.positions[t] : static_cast<std::int32_t>(s);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int i = lane * VEC + k;
      if (a.cache) {
        if (pos >= 0 && pos < a.max_position) {
          const float* row = a.cache + static_cast<std::int64_t>(pos) * (2 * a.half);
          c[k] = row[i];
          sn[k] = row[a.half + i];
        } else {
          c[k] = sn[k] = __int_as_float(0x7fffffff);  // NaN: out-of-range position, see the header
        }
      } else {
        // |angle| <= pi after the fp64 reduction: the hardware sin/cos is within ~4e-7 there.
        __sincosf(flashcpp::fused::reduced_angle(pos, inv_freq[i]), &sn[k], &c[k]);
      }
    }
  }
  // 3. Rotate and store.
#pragma unroll
  for (int u = 0; u < kHeadsInFlight; ++u) {
    if (!head_valid(u)) continue;
    T* dst = dst_of(u);
    if (!rotate) {  // pass-through lane
      store_vec<T, VEC>(dst + oa, va[u], VEC, a.streaming);
      continue;
    }
    float e[2 * VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      e[k] = to_float(va[u].v[k]);
      e[VEC + k] = to_float(vb[u].v[k]);
    }
    // neox: pair k = (A[k], B[k]); interleaved: pair k = (AB[2k], AB[2k+1]). Two loops rather
    // than a runtime index: e[] stays in registers only with constant indices.
    if (a.neox) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) rotate_pair(e[k], e[VEC + k], c[k], sn[k]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) rotate_pair(e[2 * k], e[2 * k + 1], c[k], sn[k]);
    }
    Vec<T, VEC> ra, rb;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      ra.v[k] = from_float<T>(e[k]);
      rb.v[k] = from_float<T>(e[VEC + k]);
    }
    store_vec<T, VEC>(dst + oa, ra, VEC, a.streaming);
    store_vec<T, VEC>(dst + ob, rb, VEC, a.streaming);
  }
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

FusedPath rotary_path(const RopeParams& p, const FusedForce& force) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p);
  path.threads = kThreads;
  path.name = std::string("rotary ") + rope_style_name(p.style) + (path.vector ? " vec8" : " scalar") +
              (p.cos_sin_cache ? " cache" : " sincos") + (force.streaming ? " streaming" : "");
  return path;
}

Status apply_rotary(const RopeParams& p, const FusedForce& force, Stream stream) {
  using namespace fused;
  const FusedPath path = rotary_path(p, force);
  const int vec = path.vector ? kVec16 : kScalar;
  const int rot = p.effective_rotary_dim();
  RotaryArgs a;
  const TensorView* in[2] = {&p.q, &p.k};
  const TensorView* out[2] = {p.q_out.data ? &p.q_out : &p.q, p.k_out.data ? &p.k_out : &p.k};
  for (int w = 0; w < 2; ++w) {
    a.in[w] = in[w]->data;
    a.out[w] = out[w]->data;
    a.in_bs[w] = in[w]->batch_stride;
    a.in_ss[w] = in[w]->seq_stride;
    a.in_hs[w] = in[w]->head_stride;
    a.out_bs[w] = out[w]->batch_stride;
    a.out_ss[w] = out[w]->seq_stride;
    a.out_hs[w] = out[w]->head_stride;
  }
  a.heads_q = p.heads_q;
  a.heads = p.heads_q + p.heads_k;
  a.seqlen = p.seqlen;
  a.half = rot / 2;
  a.rot_lanes = a.half / vec;
  // Pass-through lanes only when some output is out of place. A tensor rotated in place then
  // copies its own tail onto itself (same bytes, same thread): harmless, and only on the rare
  // partial-rotary call that mixes in-place and out-of-place outputs.
  const bool any_out = p.q_out.data != nullptr || (p.heads_k > 0 && p.k_out.data != nullptr);
  a.lanes = a.rot_lanes + (rot < p.head_dim && any_out ? (p.head_dim - rot) / vec : 0);
  a.groups = (a.heads + kHeadsInFlight - 1) / kHeadsInFlight;
  a.threads = static_cast<std::int64_t>(p.batch) * p.seqlen * a.groups * a.lanes;
  a.neox = p.style == RopeStyle::kNeox;
  a.positions = p.positions;
  a.cache = p.cos_sin_cache;
  a.max_position = p.max_position;
  a.theta = p.theta;
  a.factor = p.llama3.factor;
  a.low_freq_factor = p.llama3.low_freq_factor;
  a.high_freq_factor = p.llama3.high_freq_factor;
  a.original_max_position = p.llama3.original_max_position;
  a.streaming = force.streaming;
  const std::int64_t blocks = (a.threads + kThreads - 1) / kThreads;
  if (blocks > std::numeric_limits<std::int32_t>::max())
    return Status::Unsupported("apply_rotary: more than 2^31-1 blocks of 256 threads (too many tokens x heads)");
  const std::size_t smem = p.cos_sin_cache ? 0 : sizeof(double) * a.half;
  const auto grid = static_cast<unsigned>(blocks);
  return with_half_type(p.q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.vector)
      rotary_kernel<T, kVec16><<<grid, kThreads, smem, stream>>>(a);
    else
      rotary_kernel<T, kScalar><<<grid, kThreads, smem, stream>>>(a);
    return launch_status("apply_rotary");
  });
}

}  // namespace flashcpp::cuda
