// RMSNorm and fused residual-add + RMSNorm (semantics in include/flashcpp/fused.h).
//
// Napkin math (H200, 4.3 TB/s HBM; bytes that must move, bf16):
//   fused_add_rms_norm 8192 x 4096: read x + read residual + write residual + write y
//     = 4 * 8192 * 4096 * 2 B = 268.4 MB -> floor 62.4 us (weight: 8 KB, L2-resident)
//     anchors: eager PyTorch 497 us, torch.compile 72.3 us. Bar: <= 72.3 us (1.0x compile,
//     also 86% of the floor), 1.8x eager = 276 us is then met with room.
//   rms_norm 8192 x 4096: read x + write y = 134.2 MB -> floor 31.2 us.
//   FLOPs are ~5 per element: nothing here is compute bound; the work is keeping enough
//   16-byte loads in flight (Little: ~16 B/cycle/SM x ~1000 cycles of latency = ~16 KB/SM).
//
// Kernels (instantiated for bf16 and fp16 each): register {16-byte vectors at 1, 2 or 4 slots,
// scalar}, two_pass {16-byte, scalar}, persistent and stream (16-byte only): 16 in all.
//   register   hidden <= kRegisterMaxHidden (8192). The row lives in registers between the load
//              and the store: each thread holds kSlots vectors (1 x 8 elements, or 8 scalars),
//              kept as the packed, ROUNDED h (what residual_out receives, and what y is computed
//              from). Small rows (<= 32 threads' worth, e.g. per-head QK-norm at 128) are given
//              a power-of-two group of lanes inside a warp and reduce with shuffles; bigger rows
//              get a block per row and a two-level (shuffle + shared memory) reduction.
//   two_pass   any hidden: a block per row; pass 1 forms h (writing residual_out) and the sum of
//              squares, pass 2 re-reads h (from residual_out, or x) and writes y. The re-read
//              hits L1/L2 (a row is at most a few hundred KB), so DRAM traffic stays at the floor;
//              the cost is the second round of load latency.
// Every thread touches the same elements in both halves of the work, so the in-place forms
// (y == x, residual_out == residual) are safe: each element is read before it is written, by
// the thread that writes it.
//
// Where it falls off: rows whose start is not 16-byte aligned (odd hidden with a contiguous
// layout, e.g. 4097) take the scalar kernels, 8x more memory instructions; expect roughly half
// the bandwidth there. hidden > 8192 takes two_pass.
#include <algorithm>

#include "cuda/common/ptx.cuh"
#include "cuda/cuda_api.h"
#include "cuda/fused/fused_common.cuh"
#include "cuda/fused/fused_launch.h"
#include "cuda/fused/norm_row.cuh"

namespace flashcpp::cuda {
namespace fused {
namespace {

constexpr int kRegisterMaxHidden = 8192;
constexpr int kGroupBlockThreads = 128;  // register kernel, rows of <= 32 threads: rows per block = 128 / group
constexpr int kTwoPassThreads = 512;

/// Register slots per thread and the block size bound of the register kernel, per width.
/// 16-byte vectors: one slot by default, so hidden 4096 takes 512 threads a row at 32 registers
/// and an SM holds 2048 threads (four rows) with their loads in flight. Measured on the H200
/// (fused_add_rms_norm 8192x4096 bf16): four slots (128 threads, 93 registers) 57% of the
/// floor, two slots 70%, one slot 86.5%. cuda_config "slots2|4" picks the others (measurement).
template <int VEC, int SLOTS = (VEC == kVec16 ? 1 : 8)>
struct RegisterConfig {
  static constexpr int kSlots = SLOTS;
  static constexpr int kMaxThreads = kRegisterMaxHidden / (VEC * kSlots);  // 1024, 512, 256; scalar 1024
  static_assert(kMaxThreads % 32 == 0 && kMaxThreads <= 1024, "one block must hold the largest register row");
};
constexpr int kDefaultVecSlots = RegisterConfig<kVec16>::kSlots;

/// Kernel arguments (passed as one __grid_constant__ struct).
struct NormArgs {
  const void* x = nullptr;
  const void* residual = nullptr;  ///< null: plain rms_norm
  void* residual_out = nullptr;
  const void* weight = nullptr;
  void* y = nullptr;
  std::int64_t x_stride = 0, r_stride = 0, ro_stride = 0, y_stride = 0;
  int rows = 0, hidden = 0;
  int nvec = 0;   ///< ceil(hidden / VEC)
  int group = 0;  ///< register kernel: threads per row, a power of two <= 32, or > 32 = the whole block
  float eps = 0.f, inv_hidden = 0.f;
  bool streaming = false;  ///< evict-first hints on data touched once (not on weight or re-read rows)
  int stages = 0;          ///< stream kernel: rows a block has in shared memory (in flight + current)
};

template <class T, int VEC, int SLOTS = RegisterConfig<VEC>::kSlots>
__global__ void __launch_bounds__(RegisterConfig<VEC, SLOTS>::kMaxThreads)
    rms_norm_register_kernel(const __grid_constant__ NormArgs a) {
  constexpr int kSlots = SLOTS;
  __shared__ float scratch[32];
  const bool whole_block = a.group > 32;  // uniform over the block
  const int lane = whole_block ? threadIdx.x : (threadIdx.x & (a.group - 1));
  const int step = whole_block ? blockDim.x : a.group;  // vectors between a thread's slots
  const std::int64_t row =
      whole_block ? blockIdx.x : static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / a.group) + threadIdx.x / a.group;
  // A group past the last row still runs the shuffles (all 32 lanes must), with no memory access.
  const bool live = row < a.rows;
  const bool has_res = a.residual != nullptr;
  const T* x = static_cast<const T*>(a.x) + (live ? row * a.x_stride : 0);
  const T* res = static_cast<const T*>(a.residual) + (live && has_res ? row * a.r_stride : 0);

  // 1. Issue every load of the row (x and residual) before any arithmetic.
  Vec<T, VEC> xv[kSlots], rv[kSlots];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * step;
    const int n = live && v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0;
    if (n > 0) {
      xv[k] = load_vec<T, VEC>(x + v * VEC, n, a.streaming);
      if (has_res) rv[k] = load_vec<T, VEC>(res + v * VEC, n, a.streaming);
    }
  }
  // 2. h = round(x + r), kept packed; sum of squares of the rounded values.
  Vec<T, VEC> h[kSlots];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * step;
    ss += add_residual<T, VEC>(xv[k], rv[k], live && v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0, has_res, &h[k]);
  }
  // 3. residual_out, then the weight loads (L1/L2 hits), whose latency overlaps the reduction.
  //    After the stores, so x/r/w are never all live at once (fewer registers).
  if (has_res && live) {
    T* ro = static_cast<T*>(a.residual_out) + row * a.ro_stride;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int v = lane + k * step;
      const int n = v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0;
      if (n > 0) store_vec<T, VEC>(ro + v * VEC, h[k], n, a.streaming);
    }
  }
  Vec<T, VEC> w[kSlots];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * step;
    const int n = live && v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0;
    if (n > 0) w[k] = load_vec<T, VEC>(static_cast<const T*>(a.weight) + v * VEC, n);
  }
  // 4. Reduce, then y = (h * rstd) * w.
  ss = whole_block ? block_sum(ss, scratch) : group_sum(ss, a.group);
  const float rstd = row_rstd(ss, a.inv_hidden, a.eps);
  if (!live) return;
  T* y = static_cast<T*>(a.y) + row * a.y_stride;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int v = lane + k * step;
    const int n = v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0;
    if (n > 0) store_vec<T, VEC>(y + v * VEC, scale_by_weight<T, VEC>(h[k], rstd, w[k]), n, a.streaming);
  }
}

template <class T, int VEC>
__global__ void __launch_bounds__(kTwoPassThreads) rms_norm_two_pass_kernel(const __grid_constant__ NormArgs a) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const bool has_res = a.residual != nullptr;
  const T* x = static_cast<const T*>(a.x) + row * a.x_stride;
  const T* res = has_res ? static_cast<const T*>(a.residual) + row * a.r_stride : nullptr;
  T* ro = has_res ? static_cast<T*>(a.residual_out) + row * a.ro_stride : nullptr;
  // Pass 1: h and the sum of squares (h written to residual_out).
  float ss = 0.f;
  for (int v = threadIdx.x; v < a.nvec; v += blockDim.x) {
    const int n = valid_in<VEC>(v, a.hidden);
    Vec<T, VEC> h = load_vec<T, VEC>(x + v * VEC, n);
    if (has_res) {
      const Vec<T, VEC> r = load_vec<T, VEC>(res + v * VEC, n, a.streaming);  // read once
#pragma unroll
      for (int i = 0; i < VEC; ++i) h.v[i] = from_float<T>(to_float(h.v[i]) + to_float(r.v[i]));
      store_vec<T, VEC>(ro + v * VEC, h, n);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) ss += to_float(h.v[i]) * to_float(h.v[i]);  // tail lanes are 0
  }
  ss = block_sum(ss, scratch);
  const float rstd = row_rstd(ss, a.inv_hidden, a.eps);
  // Pass 2: re-read h (this thread's own elements: program order makes its writes visible).
  const T* hsrc = has_res ? ro : x;
  T* y = static_cast<T*>(a.y) + row * a.y_stride;
  for (int v = threadIdx.x; v < a.nvec; v += blockDim.x) {
    const int n = valid_in<VEC>(v, a.hidden);
    const Vec<T, VEC> h = load_vec<T, VEC>(hsrc + v * VEC, n);
    const Vec<T, VEC> w = load_vec<T, VEC>(static_cast<const T*>(a.weight) + v * VEC, n);
    store_vec<T, VEC>(y + v * VEC, scale_by_weight<T, VEC>(h, rstd, w), n, a.streaming);
  }
}

/// Persistent variant (cuda_config "persistent"; 16-byte path, rows of 33..1024 vectors): as
/// many blocks as fit the GPU at once loop over rows r = blockIdx.x, r + gridDim.x, ... The next
/// row's x and residual loads are issued before this row's reduction, so loads stay in flight
/// across row boundaries instead of pausing while a block drains and the next one starts. The
/// weight is loaded once per block. One 16-byte slot per tensor, as in the register kernel.
template <class T>
__global__ void __launch_bounds__(1024) rms_norm_persistent_kernel(const __grid_constant__ NormArgs a) {
  constexpr int VEC = kVec16;
  __shared__ float scratch[2][32];  // alternating: block_sum's last read of one overlaps the next row
  const int v = threadIdx.x;
  const int n = v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0;
  const bool has_res = a.residual != nullptr;
  Vec<T, VEC> w, xc, rc, xn, rn;
  if (n > 0) w = load_vec<T, VEC>(static_cast<const T*>(a.weight) + v * VEC, n);
  auto load_row = [&](std::int64_t row, Vec<T, VEC>& xv, Vec<T, VEC>& rv) {
    if (n == 0 || row >= a.rows) return;
    xv = load_vec<T, VEC>(static_cast<const T*>(a.x) + row * a.x_stride + v * VEC, n, a.streaming);
    if (has_res) rv = load_vec<T, VEC>(static_cast<const T*>(a.residual) + row * a.r_stride + v * VEC, n, a.streaming);
  };
  std::int64_t row = blockIdx.x;
  load_row(row, xc, rc);
  for (int it = 0; row < a.rows; ++it, row += gridDim.x) {
    load_row(row + gridDim.x, xn, rn);  // in flight while this row is reduced and stored
    Vec<T, VEC> h;
    float ss = add_residual<T, VEC>(xc, rc, n, has_res, &h);
    if (has_res && n > 0) store_vec<T, VEC>(static_cast<T*>(a.residual_out) + row * a.ro_stride + v * VEC, h, n, a.streaming);
    ss = block_sum(ss, scratch[it & 1]);
    const float rstd = row_rstd(ss, a.inv_hidden, a.eps);
    if (n > 0) store_vec<T, VEC>(static_cast<T*>(a.y) + row * a.y_stride + v * VEC, scale_by_weight<T, VEC>(h, rstd, w), n,
                                 a.streaming);
    xc = xn;
    rc = rn;
  }
}

/// Stream kernel (16-byte rows of 257..512 vectors, 4 a thread; see rms_norm_path for when): a resident grid in
/// which each block walks rows blockIdx.x, + gridDim.x, ... and keeps the next stages - 1 rows'
/// x (and residual) in flight into shared memory with cp.async while it reduces and stores the
/// current one. The bytes in flight then cost shared memory, not registers, and never drop to zero
/// between rows: the register and two-pass kernels hold a row per block in flight only during its
/// load phase (Little's law: ~50 KB in flight per SM for the H200's 4.3 TB/s), which kept them at
/// 70-88% of the floor. A thread copies and later reads only its own vectors of a stage (vector
/// v = threadIdx.x + k * blockDim.x), so cp.async.wait_group alone makes a stage readable, and a
/// stage is refilled by the same thread that emptied it; the one barrier per row is the reduction's.
/// Each row is read before it is written, by the block that writes it, so in place is safe.
/// Where it falls off: a grid whose blocks get unequal row counts (rows not a multiple of the
/// grid) loses up to one row per block in the last round, a few percent below ~20 rows a block.
/// Only rows of 4 vectors a thread are built: 2 (shorter rows) and 8 (longer, 169 registers) ran
/// slower than the two-pass kernel on the H200 (reports/fused), as did every residual row.
constexpr int kStreamVecs = 4;       // 16-byte vectors a thread holds per tensor
constexpr int kStreamThreads = 128;  // at most: rows of 257..512 vectors take 96..128

template <class T>
__global__ void __launch_bounds__(kStreamThreads) rms_norm_stream_kernel(const __grid_constant__ NormArgs a) {
  constexpr int VEC = kVec16, P = kStreamVecs;
  extern __shared__ __align__(16) unsigned char stream_smem[];
  __shared__ float scratch[2][32];  // alternating: one barrier a row (see persistent's note)
  using V = Vec<T, VEC>;
  V* stages = reinterpret_cast<V*>(stream_smem);
  const int threads = blockDim.x, t = threadIdx.x;
  const bool has_res = a.residual != nullptr;
  const int tensors = has_res ? 2 : 1, per_tensor = threads * P, S = a.stages;
  int n[P];  // valid elements of each of this thread's vectors (0: past the row)
  V w[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int v = t + k * threads;
    n[k] = v < a.nvec ? valid_in<VEC>(v, a.hidden) : 0;
    if (n[k] > 0) w[k] = load_vec<T, VEC>(static_cast<const T*>(a.weight) + v * VEC, n[k]);
  }
  const std::int64_t step = gridDim.x;
  auto issue = [&](std::int64_t row, int s) {  // one commit group per call, empty past the last row
    if (row < a.rows) {
      const T* x = static_cast<const T*>(a.x) + row * a.x_stride;
      const T* r = has_res ? static_cast<const T*>(a.residual) + row * a.r_stride : nullptr;
      V* sx = stages + static_cast<std::int64_t>(s) * tensors * per_tensor;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const int v = t + k * threads;
        if (n[k] <= 0) continue;
        const int bytes = n[k] * static_cast<int>(sizeof(T));
        ptx::cp_async_16(ptx::smem_u32(sx + v), x + v * VEC, bytes);
        if (has_res) ptx::cp_async_16(ptx::smem_u32(sx + per_tensor + v), r + v * VEC, bytes);
      }
    }
    ptx::cp_async_commit();
  };
  std::int64_t row = blockIdx.x;
  for (int s = 0; s + 1 < S; ++s) issue(row + s * step, s);
  for (int it = 0; row < a.rows; ++it, row += step) {
    const int s = it % S;
    issue(row + (S - 1) * step, (it + S - 1) % S);  // the stage emptied last row, by its own threads
    ptx::cp_async_wait_n(S - 1);                        // this row's group (and every older one) landed
    const V* sx = stages + static_cast<std::int64_t>(s) * tensors * per_tensor;
    V h[P];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int v = t + k * threads;
      if (n[k] > 0) {
        const V xv = sx[v];
        const V rv = has_res ? sx[per_tensor + v] : xv;
        ss += add_residual<T, VEC>(xv, rv, n[k], has_res, &h[k]);
      }
    }
    if (has_res) {
      T* ro = static_cast<T*>(a.residual_out) + row * a.ro_stride;
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (n[k] > 0) store_vec<T, VEC>(ro + (t + k * threads) * VEC, h[k], n[k], a.streaming);
    }
    ss = block_sum(ss, scratch[it & 1]);
    const float rstd = row_rstd(ss, a.inv_hidden, a.eps);
    T* y = static_cast<T*>(a.y) + row * a.y_stride;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (n[k] > 0) store_vec<T, VEC>(y + (t + k * threads) * VEC, scale_by_weight<T, VEC>(h[k], rstd, w[k]), n[k], a.streaming);
  }
  ptx::cp_async_wait<0>();  // the empty groups past the last row
}

int round_up(int a, int b) { return (a + b - 1) / b * b; }
int next_pow2(int a) {
  int p = 1;
  while (p < a) p <<= 1;
  return p;
}

/// 16-byte accesses need every pointer 16-byte aligned and every row stride a multiple of 8.
bool vector_ok(const RmsNormParams& p, bool with_residual) {
  auto ok = [&](const void* ptr, std::int64_t stride) {
    return aligned(ptr, 16) && (p.rows <= 1 || stride % kVec16 == 0);
  };
  return ok(p.x.data, p.x.row_stride) && ok(p.y.data, p.y.row_stride) && aligned(p.weight, 16) &&
         (!with_residual || (ok(p.residual.data, p.residual.row_stride) &&
                             ok(p.residual_out.data, p.residual_out.row_stride)));
}

}  // namespace
}  // namespace fused

FusedPath rms_norm_path(const RmsNormParams& p, bool with_residual, const FusedForce& force, bool named) {
  using namespace fused;
  FusedPath path;
  path.vector = !force.scalar && vector_ok(p, with_residual);
  const int vec = path.vector ? kVec16 : kScalar;
  const int nvec = static_cast<int>((p.hidden + vec - 1) / vec);
  // Rows of one warp or less (per-head QK-norm) stay in registers, grouped many to a block. Wider
  // 16-byte rows take the two-pass kernel unless a knob asks for the register one (slotsN,
  // persistent): on the H200 it ran 3-35% faster at every measured shape from 16384x1024 to
  // 8192x8192, plain and with residual (reports/fused, scripts/fused_knobs.py). Scalar rows keep
  // the register kernel (eight elements a thread).
  const int slots0 = path.vector ? (force.slots > 0 ? force.slots : kDefaultVecSlots) : RegisterConfig<kScalar>::kSlots;
  const bool one_warp = (nvec + slots0 - 1) / slots0 <= 32;
  const bool register_knob = force.slots > 0 || force.persistent;
  path.register_row = !force.two_pass && p.hidden <= kRegisterMaxHidden && (one_warp || register_knob || !path.vector);
  if (path.register_row) {
    const int slots = path.vector ? (force.slots > 0 ? force.slots : kDefaultVecSlots) : RegisterConfig<kScalar>::kSlots;
    const int need = (nvec + slots - 1) / slots;  // threads per row
    if (need <= 32) {
      path.group = next_pow2(need);
      path.threads = kGroupBlockThreads;
    } else {
      path.threads = path.group = round_up(need, 32);
    }
  } else {
    path.threads = std::min(kTwoPassThreads, round_up(nvec, 32));
    path.group = path.threads;
  }
  path.persistent = force.persistent && path.vector && path.register_row && path.group > 32 && force.slots <= 1;
  // The stream kernel takes 16-byte rows of 257..512 vectors (hidden 2049..4096 at 2 bytes): by
  // default the plain ones, where it ran faster than the two-pass kernel on the H200, and with a
  // residual on request (cuda_config "stream"), where it ran slower (reports/fused).
  const bool stream_rows = nvec > (kStreamVecs / 2) * kStreamThreads && nvec <= kStreamVecs * kStreamThreads;
  path.stream = stream_rows && (force.stream || (!with_residual && !register_knob)) && path.vector &&
                !path.register_row && !force.two_pass;
  if (path.stream) {
    path.per_thread = kStreamVecs;
    path.threads = path.group = round_up((nvec + kStreamVecs - 1) / kStreamVecs, 32);
    const int stage_bytes = path.threads * path.per_thread * 16 * (with_residual ? 2 : 1);
    path.stages = stream_stages(force.stages, stage_bytes);
    path.smem = path.stages * stage_bytes;
  }
  if (!named) return path;
  path.name = std::string(with_residual ? "fused_add_rms_norm" : "rms_norm") + (path.vector ? " vec8" : " scalar") +
              (path.persistent ? " persistent" : path.stream ? " stream" : path.register_row ? " register" : " two_pass") +
              " threads=" + std::to_string(path.threads) +
              (path.stream ? " vecs=" + std::to_string(path.per_thread) + " stages=" + std::to_string(path.stages) : "") +
              " group=" + std::to_string(path.group) + (force.streaming ? " streaming" : "") +
              (path.vector && path.register_row && force.slots > 0 ? " slots=" + std::to_string(force.slots) : "");
  return path;
}

Status rms_norm(const RmsNormParams& p, bool with_residual, const FusedForce& force, Stream stream) {
  using namespace fused;
  const FusedPath path = rms_norm_path(p, with_residual, force, false);
  const int vec = path.vector ? kVec16 : kScalar;
  NormArgs a;
  a.x = p.x.data;
  a.residual = with_residual ? p.residual.data : nullptr;
  a.residual_out = with_residual ? p.residual_out.data : nullptr;
  a.weight = p.weight;
  a.y = p.y.data;
  a.x_stride = p.x.row_stride;
  a.r_stride = with_residual ? p.residual.row_stride : 0;
  a.ro_stride = with_residual ? p.residual_out.row_stride : 0;
  a.y_stride = p.y.row_stride;
  a.rows = static_cast<int>(p.rows);
  a.hidden = static_cast<int>(p.hidden);
  a.nvec = static_cast<int>((p.hidden + vec - 1) / vec);
  a.group = path.group;
  a.eps = p.eps;
  a.inv_hidden = static_cast<float>(1.0 / static_cast<double>(p.hidden));
  a.streaming = force.streaming;
  if (path.stream) {
    a.stages = path.stages;
    return with_half_type(p.x.dtype, [&](auto tag) -> Status {
      using T = typename decltype(tag)::type;
      return launch_resident(rms_norm_stream_kernel<T>, a, path.threads, path.smem, a.rows, stream, "rms_norm");
    });
  }
  const int rows_per_block = path.register_row && path.group <= 32 ? path.threads / path.group : 1;
  const unsigned grid = static_cast<unsigned>((p.rows + rows_per_block - 1) / rows_per_block);
  if (path.persistent) {
    DeviceInfo dev;
    FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
    return with_half_type(p.x.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      int per_sm = 0;
      const cudaError_t e =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rms_norm_persistent_kernel<T>, path.threads, 0);
      if (e != cudaSuccess) return Status::Cuda(std::string("rms_norm: occupancy query failed: ") + cudaGetErrorString(e));
      const std::int64_t blocks = std::min<std::int64_t>(p.rows, static_cast<std::int64_t>(std::max(1, per_sm)) * dev.num_sms);
      rms_norm_persistent_kernel<T><<<static_cast<unsigned>(blocks), path.threads, 0, stream>>>(a);
      return launch_status("rms_norm");
    });
  }
  return with_half_type(p.x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (path.register_row) {
      if (path.vector && force.slots == 2)
        rms_norm_register_kernel<T, kVec16, 2><<<grid, path.threads, 0, stream>>>(a);
      else if (path.vector && force.slots == 4)
        rms_norm_register_kernel<T, kVec16, 4><<<grid, path.threads, 0, stream>>>(a);
      else if (path.vector)
        rms_norm_register_kernel<T, kVec16><<<grid, path.threads, 0, stream>>>(a);
      else
        rms_norm_register_kernel<T, kScalar><<<grid, path.threads, 0, stream>>>(a);
    } else {
      if (path.vector)
        rms_norm_two_pass_kernel<T, kVec16><<<grid, path.threads, 0, stream>>>(a);
      else
        rms_norm_two_pass_kernel<T, kScalar><<<grid, path.threads, 0, stream>>>(a);
    }
    return launch_status("rms_norm");
  });
}

}  // namespace flashcpp::cuda
