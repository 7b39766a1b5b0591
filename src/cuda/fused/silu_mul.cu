// SwiGLU: out = silu(gate) * up (semantics in include/flashcpp/fused.h), for two tensors or
// one fused [gate | up] projection output (the same kernel: only the pointers and strides differ).
//
// Napkin math (H200, 4.3 TB/s; bf16):
//   8192 x 14336: read gate + read up + write out = 3 * 8192 * 14336 * 2 B = 704.6 MB
//     -> floor 163.9 us. Anchors: eager PyTorch 287.6 us (silu, then mul: 5 passes),
//     torch.compile 166.7 us (one fused Triton kernel at 98% of the floor). Bar: <= 166.7 us,
//     i.e. a plain copy's efficiency (the measured copy ceiling is 4.24 TB/s = 98.6% of 4.3).
//   Compute: per 8 outputs 8 exp + 8 divisions (~150 instructions) against 48 bytes: about a
//     third of the issue budget at full bandwidth, so the kernel stays memory bound.
//
// Work split: blockIdx.x walks 256-thread chunks of one row's vectors, blockIdx.y walks rows
// (grid-stride past 65535 rows). Each thread loads its gate and up vectors (16 bytes each),
// computes in fp32 and stores 16 bytes: no index division, coalesced in every row, and one row
// is never split between the two halves of a vector. A row's last vector may be partial
// (d % 8 != 0): it is read and written element by element.
//
// Instantiations: {bf16, fp16} x {16-byte vectors, scalar} = 4. Vectors need gate, up and out
// 16-byte aligned and their row strides multiples of 8 (true for the fused layout whenever
// d % 8 == 0 and x is aligned); anything else takes the scalar kernel (~8x the memory
// instructions: expect about half the bandwidth).
#include <algorithm>

#include "cuda/fused/fused_common.cuh"
#include "cuda/fused/fused_launch.h"
#include "common/fused_math.h"

namespace flashcpp::cuda {
namespace fused {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

struct SiluArgs {
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;
  std::int64_t g_stride = 0, u_stride = 0, o_stride = 0;
  int rows = 0, d = 0;
  int nvec = 0;  ///< ceil(d / VEC)
  bool streaming = false;  ///< evict-first hints (every byte is touched once)
};

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) silu_mul_kernel(const __grid_constant__ SiluArgs a) {
  const std::int64_t v64 = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v64 >= a.nvec) return;
  const int v = static_cast<int>(v64);
  const int n = min(VEC, a.d - v * VEC);  // v * VEC < d: no overflow
  const T* gate = static_cast<const T*>(a.gate) + v * VEC;
  const T* up = static_cast<const T*>(a.up) + v * VEC;
  T* out = static_cast<T*>(a.out) + v * VEC;
  for (std::int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const Vec<T, VEC> g = load_vec<T, VEC>(gate + row * a.g_stride, n, a.streaming);
    const Vec<T, VEC> u = load_vec<T, VEC>(up + row * a.u_stride, n, a.streaming);
    Vec<T, VEC> o;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o.v[i] = from_float<T>(flashcpp::fused::silu_mul(to_float(g.v[i]), to_float(u.v[i])));
    store_vec<T, VEC>(out + row * a.o_stride, o, n, a.streaming);
  }
}

bool vector_ok(const SiluMulParams& p) {
  auto ok = [&](const MatrixView& m) { return aligned(m.data, 16) && (p.rows <= 1 || m.row_stride % kVec16 == 0); };
  return ok(p.gate) && ok(p.up) && ok(p.out);
}

}  // namespace
}  // namespace fused

FusedPath silu_and_mul_path(const SiluMulParams& p, const FusedForce& force, bool named) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p);
  const int vec = path.vector ? kVec16 : kScalar;
  const std::int64_t nvec = (p.d + vec - 1) / vec;
  path.threads = static_cast<int>(std::min<std::int64_t>(kThreads, (nvec + 31) / 32 * 32));
  if (!named) return path;
  path.name = std::string("silu_and_mul") + (path.vector ? " vec8" : " scalar") + " threads=" + std::to_string(path.threads) +
              (force.streaming ? " streaming" : "");
  return path;
}

Status silu_and_mul(const SiluMulParams& p, const FusedForce& force, Stream stream) {
  using namespace fused;
  const FusedPath path = silu_and_mul_path(p, force, false);
  const int vec = path.vector ? kVec16 : kScalar;
  SiluArgs a;
  a.gate = p.gate.data;
  a.up = p.up.data;
  a.out = p.out.data;
  a.g_stride = p.gate.row_stride;
  a.u_stride = p.up.row_stride;
  a.o_stride = p.out.row_stride;
  a.rows = static_cast<int>(p.rows);
  a.d = static_cast<int>(p.d);
  a.nvec = static_cast<int>((p.d + vec - 1) / vec);
  a.streaming = force.streaming;
  const dim3 grid(static_cast<unsigned>((a.nvec + path.threads - 1) / path.threads),
                  static_cast<unsigned>(std::min<std::int64_t>(p.rows, kMaxGridY)));
  return with_half_type(p.gate.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.vector)
      silu_mul_kernel<T, kVec16><<<grid, path.threads, 0, stream>>>(a);
    else
      silu_mul_kernel<T, kScalar><<<grid, path.threads, 0, stream>>>(a);
    return launch_status("silu_and_mul");
  });
}

}  // namespace flashcpp::cuda
