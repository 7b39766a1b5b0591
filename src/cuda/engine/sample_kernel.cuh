// The engine's sampling kernel: one CTA of kSampleThreads per logits row, the rule of SampleArgs
// (flashcpp/engine.h) that the host version (src/engine/sampling.h) also follows: greedy argmax,
// or temperature softmax, the top-p threshold by bisection and a draw with sample_uniform.
// Launcher: sample.cu.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flashcpp/engine.h"

namespace flashcpp::cuda::engine {

using flashcpp::engine::SampleArgs;
using flashcpp::engine::sample_uniform;

constexpr int kSampleThreads = 1024;
static_assert(kSampleThreads == 32 * 32, "block_reduce reduces 32 warp partials in one warp");

struct ArgMax { float v; int i; };
__device__ __forceinline__ bool better(const ArgMax& a, const ArgMax& b) {
  const bool an = isnan(a.v), bn = isnan(b.v);
  if (an != bn) return an;
  if (a.v != b.v && !an) return a.v > b.v;
  return a.i < b.i;
}

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ ArgMax shfl_xor(const ArgMax& v, int o) { return {shfl_xor(v.v, o), shfl_xor(v.i, o)}; }

/// op-reduction over the CTA (kSampleThreads); every thread gets the result.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* smem) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  auto warp_reduce = [&](T x) {
    for (int o = 16; o > 0; o >>= 1) x = op(x, shfl_xor(x, o));
    return x;
  };
  __syncthreads();  // smem may still be read by the previous call
  v = warp_reduce(v);
  if (lane == 0) smem[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = warp_reduce(smem[lane]);  // kSampleThreads / 32 == 32 partials
    if (lane == 0) smem[0] = v;
  }
  __syncthreads();
  return smem[0];
}

__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const float* __restrict__ logits, int rows, int vocab,
                                                                SampleArgs args, std::int32_t* tokens_out,
                                                                std::int32_t* history, const std::int32_t* step_counter) {
  __shared__ ArgMax s_am[32];
  __shared__ float s_f[32];
  const int r = blockIdx.x;
  const float* l = logits + static_cast<std::int64_t>(r) * vocab;
  ArgMax best{-INFINITY, vocab};
  // 16-byte loads, eight in flight per thread: one CTA reads the 0.5 MB row of a 128k vocabulary
  // in a few L2 round trips instead of one per element. `better` is a strict total order on
  // (value, index), so the result does not depend on the order the elements are visited in.
  auto take4 = [&best](const float4& c, int i) {  // elements i .. i + 3, in index order
    if (better({c.x, i}, best)) best = {c.x, i};
    if (better({c.y, i + 1}, best)) best = {c.y, i + 1};
    if (better({c.z, i + 2}, best)) best = {c.z, i + 2};
    if (better({c.w, i + 3}, best)) best = {c.w, i + 3};
  };
  int tail = 0;
  if (vocab % 4 == 0 && (reinterpret_cast<std::uintptr_t>(l) & 15) == 0) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int n4 = vocab / 4;
    constexpr int kUnroll = 8;
    int v = threadIdx.x;
    for (; v + (kUnroll - 1) * kSampleThreads < n4; v += kUnroll * kSampleThreads) {
      float4 c[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) c[u] = __ldg(l4 + v + u * kSampleThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) take4(c[u], 4 * (v + u * kSampleThreads));
    }
    for (; v < n4; v += kSampleThreads) take4(__ldg(l4 + v), 4 * v);
    tail = vocab;
  }
  for (int i = tail + threadIdx.x; i < vocab; i += kSampleThreads) {
    const ArgMax c{l[i], i};
    if (better(c, best)) best = c;
  }
  best = block_reduce(best, [](const ArgMax& a, const ArgMax& b) { return better(a, b) ? a : b; }, s_am);
  int token = min(best.i, vocab - 1);
  const int step = step_counter ? *step_counter : 0;
  if (args.temperature > 0.f && !isnan(best.v)) {
    const float inv_t = 1.f / args.temperature, mx = best.v;
    auto plus = [](float a, float b) { return a + b; };
    float part = 0.f;
    for (int i = threadIdx.x; i < vocab; i += kSampleThreads) part += __expf((l[i] - mx) * inv_t);
    const float inv_total = 1.f / block_reduce(part, plus, s_f);
    auto prob = [&](int i) { return __expf((l[i] - mx) * inv_t) * inv_total; };
    auto mass_at_least = [&](float t) {
      float m = 0.f;
      for (int i = threadIdx.x; i < vocab; i += kSampleThreads) {
        const float p = prob(i);
        if (p >= t) m += p;
      }
      return block_reduce(m, plus, s_f);
    };
    // t*: the largest probability value whose kept set {p >= t*} reaches top_p (bisection on
    // the bits of a positive float, which order like the values).
    float thresh = 0.f;
    if (args.top_p < 1.f) {
      unsigned lo = 0, hi = __float_as_uint(inv_total);  // p_max = exp(0) * inv_total
      while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        if (mass_at_least(__uint_as_float(mid)) >= args.top_p) lo = mid; else hi = mid - 1;
      }
      thresh = __uint_as_float(lo);
    }
    // Each thread owns a contiguous chunk; the chunk whose kept mass crosses u * kept picks.
    const int chunk = (vocab + kSampleThreads - 1) / kSampleThreads;
    const int b0 = threadIdx.x * chunk, b1 = min(vocab, b0 + chunk);
    float mine = 0.f;
    int last_kept = -1;
    for (int i = b0; i < b1; ++i) {
      const float p = prob(i);
      if (p >= thresh) { mine += p; last_kept = i; }
    }
    __shared__ float s_scan[kSampleThreads];
    __shared__ int s_pick;
    s_scan[threadIdx.x] = mine;
    if (threadIdx.x == 0) s_pick = INT32_MAX;
    __syncthreads();
    for (int o = 1; o < kSampleThreads; o <<= 1) {  // inclusive Hillis-Steele scan
      const float add = threadIdx.x >= o ? s_scan[threadIdx.x - o] : 0.f;
      __syncthreads();
      s_scan[threadIdx.x] += add;
      __syncthreads();
    }
    const float kept = s_scan[kSampleThreads - 1];
    const float target = sample_uniform(args.seed, static_cast<std::uint32_t>(step), args.row_offset + r) * kept;
    const float before = s_scan[threadIdx.x] - mine;
    if (mine > 0.f && before <= target && target < s_scan[threadIdx.x]) {
      float acc = before;
      int pick = last_kept;
      for (int i = b0; i < b1; ++i) {
        const float p = prob(i);
        if (p < thresh) continue;
        acc += p;
        if (acc > target) { pick = i; break; }
      }
      atomicMin(&s_pick, pick);
    }
    // Rounding can leave the target past every chunk: take the last kept token then.
    __shared__ int s_i[32];
    const int fallback = block_reduce(last_kept, [](int a, int b) { return max(a, b); }, s_i);  // its barriers publish s_pick
    if (s_pick != INT32_MAX) token = s_pick; else if (fallback >= 0) token = fallback;
  }
  if (threadIdx.x == 0) {
    tokens_out[r] = token;
    if (history) history[static_cast<std::int64_t>(step) * rows + r] = token;
  }
}

}  // namespace flashcpp::cuda::engine
