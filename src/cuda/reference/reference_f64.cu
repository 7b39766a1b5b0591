// fp64 ground truth on the GPU for long sequences, where the CPU reference is too slow.
// Per (sequence, head): inputs widened to double, S = Q K^T by cuBLAS DGEMM, an fp64 softmax
// kernel that applies scale, softcap, ALiBi and the mask rules of attention.h (read directly
// from the spec, not through MaskRules, so the kernels are checked against an independent
// reading), then O = P V by DGEMM. Allocates and synchronizes: a test utility, not a kernel.
// Block-sparse masks are not evaluated here (the CPU reference covers them).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/common/cublas_dl.h"
#include "cuda/cuda_api.h"

namespace flashcpp::cuda {

namespace {

constexpr int kThreads = 256;

__device__ double load_elem(const void* base, DType t, std::int64_t i) {
  switch (t) {
    case DType::kBF16: return static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]));
    case DType::kF16: return static_cast<double>(__half2float(static_cast<const __half*>(base)[i]));
    default: return static_cast<double>(static_cast<const float*>(base)[i]);
  }
}

/// dst[r][d] = src[base + r*row_stride + d] as double, rows x dim.
__global__ void widen_kernel(const void* src, DType t, std::int64_t base, std::int64_t row_stride, int rows, int dim,
                             double* dst) {
  const std::int64_t n = static_cast<std::int64_t>(rows) * dim;
  for (std::int64_t x = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; x < n;
       x += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = x / dim, d = x % dim;
    dst[x] = load_elem(src, t, base + r * row_stride + d);
  }
}

struct SoftmaxArgs {
  int sq, sk;
  double scale, softcap, slope;
  bool causal, global_queries;
  int wl, wr, global_tokens;
};

/// Row i of S (sq x sk, row-major) -> normalized probabilities in place; lse[i] (natural log).
__global__ void softmax_kernel(double* S, SoftmaxArgs a, double* lse, std::int64_t lse_stride) {
  const int i = blockIdx.x;
  double* row = S + static_cast<std::int64_t>(i) * a.sk;
  const int ia = i + a.sk - a.sq;  // bottom-right alignment
  const bool gq = a.global_queries && ia < a.global_tokens;
  __shared__ double red[kThreads];
  double mx = -INFINITY;
  for (int j = threadIdx.x; j < a.sk; j += kThreads) {
    bool vis = true;
    if (a.causal && j > ia) vis = false;
    if (!gq && a.wr >= 0 && j > ia + a.wr) vis = false;
    if (!gq && a.wl >= 0 && j < ia - a.wl && j >= a.global_tokens) vis = false;
    double s = row[j] * a.scale;
    if (a.softcap > 0) s = a.softcap * tanh(s / a.softcap);
    s += a.slope * static_cast<double>(j - ia);
    s = vis ? s : -INFINITY;
    row[j] = s;
    mx = fmax(mx, s);
  }
  red[threadIdx.x] = mx;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  mx = red[0];
  __syncthreads();
  // Against 0 while the max is -inf (every visible score -inf, or NaN: fmax drops NaN), so that
  // masked keys give exp(-inf) = 0 and a NaN score gives NaN; the sum then tells an empty row
  // (0) from a row with a NaN score (NaN), which comes out NaN in O and the LSE (attention.h).
  const double m_use = mx == -INFINITY ? 0.0 : mx;
  double sum = 0;
  for (int j = threadIdx.x; j < a.sk; j += kThreads) {
    const double e = exp(row[j] - m_use);
    row[j] = e;
    sum += e;
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  sum = red[0];
  const double inv = sum != 0 ? 1.0 / sum : 0.0;
  for (int j = threadIdx.x; j < a.sk; j += kThreads) row[j] *= inv;
  if (threadIdx.x == 0) lse[static_cast<std::int64_t>(i) * lse_stride] = sum != 0 ? mx + log(sum) : -INFINITY;
}

struct Scratch {
  std::vector<void*> ptrs;
  ~Scratch() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <typename T>
  Status alloc(T** out, std::size_t n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
      cudaGetLastError();
      return Status::Cuda("fp64 reference: cudaMalloc of " + std::to_string(n * sizeof(T)) + " bytes failed");
    }
    ptrs.push_back(p);
    *out = static_cast<T*>(p);
    return Status::Ok();
  }
};

#define FC_CUDA(call)                                                                               \
  do {                                                                                              \
    const cudaError_t _e = (call);                                                                  \
    if (_e != cudaSuccess) return Status::Cuda(std::string(#call " failed: ") + cudaGetErrorString(_e)); \
  } while (0)
#define FC_CUBLAS(call)                                                                          \
  do {                                                                                           \
    const cublasStatus_t _s = (call);                                                            \
    if (_s != CUBLAS_STATUS_SUCCESS) return Status::Cuda(std::string(#call " failed: status ") + std::to_string(_s)); \
  } while (0)

// cuBLAS opened at the first call (cuda/common/cublas_dl.h), and a handle on it.
struct Handle {
  const dl::Cublas* api = nullptr;
  cublasHandle_t h = nullptr;
  ~Handle() {
    if (h) api->cublasDestroy_v2(h);
  }
};

}  // namespace

Status reference_attention_f64(const AttnParams& a, double* o_f64, double* lse_f64, Stream stream) {
  if (a.mask.block_sparse) return Status::Unsupported("the fp64 GPU reference does not evaluate block-sparse masks");
  if (a.batch == 0 || a.seqlen_q == 0) return Status::Ok();
  const int D = a.head_dim, Dv = a.effective_head_dim_v(), group = a.heads_q / a.heads_kv;
  // Per-sequence lengths and packed row offsets (varlen: copied from the device).
  std::vector<int> cu_q(a.batch + 1), cu_k(a.batch + 1);
  if (a.mask.is_varlen()) {
    FC_CUDA(cudaMemcpy(cu_q.data(), a.mask.cu_seqlens_q, sizeof(int) * (a.batch + 1), cudaMemcpyDeviceToHost));
    FC_CUDA(cudaMemcpy(cu_k.data(), a.mask.cu_seqlens_k, sizeof(int) * (a.batch + 1), cudaMemcpyDeviceToHost));
  } else {
    for (int b = 0; b <= a.batch; ++b) cu_q[b] = b * a.seqlen_q, cu_k[b] = b * a.seqlen_k;
  }
  const std::int64_t total_q = cu_q[a.batch];
  std::vector<float> slopes;
  if (a.mask.alibi_slopes) {
    const std::size_t n = a.mask.alibi_batch_stride ? static_cast<std::size_t>(a.batch) * a.heads_q : a.heads_q;
    slopes.resize(n);
    FC_CUDA(cudaMemcpy(slopes.data(), a.mask.alibi_slopes, n * sizeof(float), cudaMemcpyDeviceToHost));
  }
  int max_sq = 0, max_sk = 0;
  for (int b = 0; b < a.batch; ++b)
    max_sq = std::max(max_sq, cu_q[b + 1] - cu_q[b]), max_sk = std::max(max_sk, cu_k[b + 1] - cu_k[b]);
  Scratch scratch;
  double *qd, *kd, *vd, *s;
  FLASHCPP_RETURN_IF_ERROR(scratch.alloc(&qd, static_cast<std::size_t>(max_sq) * D));
  FLASHCPP_RETURN_IF_ERROR(scratch.alloc(&kd, static_cast<std::size_t>(max_sk) * D));
  FLASHCPP_RETURN_IF_ERROR(scratch.alloc(&vd, static_cast<std::size_t>(max_sk) * Dv));
  FLASHCPP_RETURN_IF_ERROR(scratch.alloc(&s, static_cast<std::size_t>(max_sq) * std::max(max_sk, 1)));
  Handle handle;
  FLASHCPP_RETURN_IF_ERROR(dl::cublas(&handle.api));
  FC_CUBLAS(handle.api->cublasCreate_v2(&handle.h));
  FC_CUBLAS(handle.api->cublasSetStream_v2(handle.h, stream));
  const double one = 1.0, zero = 0.0;
  for (int b = 0; b < a.batch; ++b) {
    const int sq = cu_q[b + 1] - cu_q[b], sk = cu_k[b + 1] - cu_k[b];
    if (sq == 0) continue;
    // Element offsets of row 0 of this sequence.
    const bool varlen = a.mask.is_varlen();
    const std::int64_t qb = varlen ? cu_q[b] * a.q.seq_stride : b * a.q.batch_stride;
    const std::int64_t kb = varlen ? cu_k[b] * a.k.seq_stride : b * a.k.batch_stride;
    const std::int64_t vb = varlen ? cu_k[b] * a.v.seq_stride : b * a.v.batch_stride;
    for (int h = 0; h < a.heads_q; ++h) {
      const int hk = h / group;
      const int blocks = 1024;
      widen_kernel<<<blocks, kThreads, 0, stream>>>(a.q.data, a.q.dtype, qb + h * a.q.head_stride, a.q.seq_stride, sq, D, qd);
      if (sk > 0 && (h % group == 0)) {
        widen_kernel<<<blocks, kThreads, 0, stream>>>(a.k.data, a.k.dtype, kb + hk * a.k.head_stride, a.k.seq_stride, sk, D, kd);
        widen_kernel<<<blocks, kThreads, 0, stream>>>(a.v.data, a.v.dtype, vb + hk * a.v.head_stride, a.v.seq_stride, sk, Dv, vd);
      }
      double* o_rows = o_f64 + (static_cast<std::int64_t>(cu_q[b]) * a.heads_q + h) * Dv;
      if (sk == 0) {  // no keys: O = 0, LSE = -inf
        FC_CUDA(cudaMemset2DAsync(o_rows, sizeof(double) * a.heads_q * Dv, 0, sizeof(double) * Dv, sq, stream));
        std::vector<double> ninf(sq, -INFINITY);
        FC_CUDA(cudaMemcpyAsync(lse_f64 + h * total_q + cu_q[b], ninf.data(), sizeof(double) * sq, cudaMemcpyHostToDevice, stream));
        FC_CUDA(cudaStreamSynchronize(stream));
        continue;
      }
      // S^T (sk x sq, column-major) = K (row-major sk x D) * Q^T  ==  S row-major (sq x sk).
      FC_CUBLAS(handle.api->cublasDgemm_v2(handle.h, CUBLAS_OP_T, CUBLAS_OP_N, sk, sq, D, &one, kd, D, qd, D, &zero, s, sk));
      SoftmaxArgs sa{sq, sk, static_cast<double>(a.effective_scale()), static_cast<double>(a.mask.softcap),
                     slopes.empty() ? 0.0 : static_cast<double>(slopes[(a.mask.alibi_batch_stride ? b * a.heads_q : 0) + h]),
                     a.mask.causal, a.mask.global_queries, a.mask.window_left, a.mask.window_right, a.mask.global_tokens};
      softmax_kernel<<<sq, kThreads, 0, stream>>>(s, sa, lse_f64 + h * total_q + cu_q[b], 1);
      // O^T (Dv x sq, column-major, ld heads_q*Dv) = V^T (Dv x sk) * P^T (sk x sq).
      FC_CUBLAS(handle.api->cublasDgemm_v2(handle.h, CUBLAS_OP_N, CUBLAS_OP_N, Dv, sq, sk, &one, vd, Dv, s, sk, &zero, o_rows,
                            a.heads_q * Dv));
      FC_CUDA(cudaGetLastError());
    }
  }
  FC_CUDA(cudaStreamSynchronize(stream));
  return Status::Ok();
}

}  // namespace flashcpp::cuda
