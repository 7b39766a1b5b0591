// Ops on CUDA: bf16 device buffers on one stream, cuBLASLt GEMMs, and CUDA-graph capture/replay.
// The engine's kernels (the batch-small GEMV with its fused prologue, embedding, KV scatter,
// sampling, counters) are under src/cuda/engine; this file launches them through
// cuda/engine/engine_launch.h and decides which GEMM a call takes: the GEMV up to two rows by
// default (batch-1 and -2 decode; up to 8 when forced), cuBLASLt for everything else (prefill,
// M > 8).
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/common/cublas_dl.h"
#include "cuda/common/device.h"
#include "cuda/cuda_api.h"
#include "cuda/engine/engine_common.cuh"
#include "cuda/engine/engine_launch.h"
#include "engine/ops.h"

namespace flashcpp::engine {
namespace {

using cuda::engine::cuda_status;
#define ENGINE_CUDA(expr) FLASHCPP_RETURN_IF_ERROR(cuda_status((expr), #expr))

Status lt_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status::Cuda(std::string(what) + " failed: cuBLASLt status " + std::to_string(static_cast<int>(s)));
}
#define ENGINE_LT(expr) FLASHCPP_RETURN_IF_ERROR(lt_status((expr), #expr))

constexpr int kGemvAutoRows = 2;  // rows up to which gemm() takes the GEMV in "auto" mode
using cuda::engine::kGemvMaxSmem;

cuda::engine::GemvPrologueKind kernel_prologue(GemvPrologue::Kind k) {
  using K = cuda::engine::GemvPrologueKind;
  switch (k) {
    case GemvPrologue::Kind::kRmsNorm: return K::kRmsNorm;
    case GemvPrologue::Kind::kAddRmsNorm: return K::kAddRmsNorm;
    case GemvPrologue::Kind::kSiluMul: return K::kSiluMul;
    case GemvPrologue::Kind::kNone: break;
  }
  return K::kNone;
}

// ---- the Ops ------------------------------------------------------------------------------
class CudaOps final : public Ops {
 public:
  ~CudaOps() override {
    for (auto& [k, g] : graphs_) cudaGraphExecDestroy(g);
    for (auto& [k, e] : lt_cache_) {  // entries exist only once lt_api_ is set
      lt_api_->cublasLtMatmulDescDestroy(e.desc);
      lt_api_->cublasLtMatrixLayoutDestroy(e.a);
      lt_api_->cublasLtMatrixLayoutDestroy(e.b);
      lt_api_->cublasLtMatrixLayoutDestroy(e.c);
    }
    for (cudaEvent_t e : events_) if (e) cudaEventDestroy(e);
    if (workspace_) cudaFree(workspace_);
    if (lt_) lt_api_->cublasLtDestroy(lt_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  Status init() {
    cuda::DeviceInfo dev;
    FLASHCPP_RETURN_IF_ERROR(cuda::current_device(&dev));
    sm_major_ = dev.sm_major;
    num_sms_ = dev.num_sms;
    pdl_ = sm_major_ >= 9;  // programmatic dependent launch: Hopper and newer
    name_ = dev.name + " (" + std::to_string(dev.num_sms) + " SMs, bf16)";
    ENGINE_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    FLASHCPP_RETURN_IF_ERROR(cuda::dl::cublaslt(&lt_api_));  // opened here, at the engine's start
    ENGINE_LT(lt_api_->cublasLtCreate(&lt_));
    ENGINE_CUDA(cudaMalloc(&workspace_, kWorkspace));
    events_.assign(kMaxEvents, nullptr);
    return Status::Ok();
  }
  bool cuda() const override { return true; }
  DType dtype() const override { return DType::kBF16; }
  Stream stream() const override { return reinterpret_cast<Stream>(stream_); }
  bool programmatic() const override { return pdl_; }
  std::string describe() const override { return name_; }

  Status alloc(std::size_t bytes, void** out) override {
    ENGINE_CUDA(cudaMalloc(out, bytes));
    // On stream_, and awaited: a cudaMemset goes to the legacy default stream, which the
    // non-blocking stream_ does not wait for, so it could land after an upload or a kernel that
    // followed on stream_ (EngineGpu.GemvMatchesTheHostForEveryGrouping read zeros for its x).
    ENGINE_CUDA(cudaMemsetAsync(*out, 0, bytes, stream_));
    return sync();
  }
  void release(void* p) noexcept override { cudaFree(p); }
  Status upload(void* dst, const void* src, std::size_t bytes) override {
    ENGINE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return sync();
  }
  Status download(void* dst, const void* src, std::size_t bytes) override {
    ENGINE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    return sync();
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
  }
  Status sync() override { return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  Status fill_random(void* p, std::int64_t n, std::uint64_t seed, float stddev) override {
    return cuda::fill_random(p, DType::kBF16, n, seed, stddev, stream());
  }

  Status set_gemm_mode(const std::string& mode) override {
    if (mode != "auto" && mode != "cublaslt" && mode != "gemv" && mode != "gemv-nopdl")
      return Status::Invalid("gemm mode '" + mode + "' is not one of auto, cublaslt, gemv, gemv-nopdl");
    // Decided here once, so gemm() compares integers, not strings.
    gemv_max_rows_ = mode == "auto" ? kGemvAutoRows : mode == "cublaslt" ? 0 : 8;
    pdl_ = sm_major_ >= 9 && mode != "gemv-nopdl";
    return Status::Ok();
  }

  Status gemm(int M, int N, int K, const void* x, std::int64_t ldx, const void* w, void* y, std::int64_t ldy,
              DType y_dtype) override {
    if (M == 0 || N == 0) return Status::Ok();
    if (gemv_ok(M, K, x, ldx, w)) return gemv(M, N, K, x, ldx, GemvPrologue{}, w, y, ldy, y_dtype);
    return lt_gemm(M, N, K, x, ldx, w, y, ldy, y_dtype);
  }
  Status gemv_fused(int M, int N, int K, const void* x, std::int64_t ldx, const GemvPrologue& pro, const void* w, void* y,
                    std::int64_t ldy, DType y_dtype) override {
    const bool aligned = pro.kind != GemvPrologue::Kind::kSiluMul || (ldx % 8 == 0);
    if (M > 0 && N > 0 && aligned && gemv_ok(M, K, x, ldx, w)) return gemv(M, N, K, x, ldx, pro, w, y, ldy, y_dtype);
    return Ops::gemv_fused(M, N, K, x, ldx, pro, w, y, ldy, y_dtype);
  }

  Status embed(const std::int32_t* tokens, int n, const void* table, int vocab, int hidden, void* out) override {
    return cuda::engine::embed(tokens, n, table, vocab, hidden, out, stream_);
  }
  Status write_kv(const KvPool& pool, const std::int32_t* block_table, int pages_per_seq, int seq, int start, int n,
                  const void* k, const void* v, std::int64_t ld) override {
    cuda::engine::WriteKvParams p;
    p.k_cache = pool.k;
    p.v_cache = pool.v;
    p.num_pages = pool.num_pages;
    p.page_size = pool.page_size;
    p.row = pool.heads_kv * pool.head_dim;
    p.block_table = block_table;
    p.pages_per_seq = pages_per_seq;
    p.seq = seq;
    p.start = start;
    p.n = n;
    p.k = k;
    p.v = v;
    p.ld = ld;
    if (pool.dtype == DType::kF8E4M3) {
      p.k_scale = pool.k_scale;
      p.v_scale = pool.v_scale;
      p.head_dim = pool.head_dim;
    }
    return cuda::engine::write_kv(p, stream_);
  }
  Status sample(const float* logits, int rows, int vocab, const SampleArgs& args, std::int32_t* tokens_out,
                std::int32_t* history, const std::int32_t* step_counter) override {
    return cuda::engine::sample(logits, rows, vocab, args, tokens_out, history, step_counter, stream_);
  }
  Status advance(std::int32_t* seqlens, int n, std::int32_t* step_counter) override {
    return cuda::engine::advance(seqlens, n, step_counter, stream_);
  }
  Status spin(int us) override {
    return cuda::engine::spin(static_cast<std::uint64_t>(us) * 1000u, stream_);
  }
  Status record_event(int slot) override {
    if (slot < 0 || slot >= kMaxEvents) return Status::Internal("event slot out of range");
    if (!events_[slot]) ENGINE_CUDA(cudaEventCreate(&events_[slot]));
    return cuda_status(cudaEventRecord(events_[slot], stream_), "cudaEventRecord");
  }
  float event_ms(int from, int to) override {
    float ms = 0.f;
    if (from < 0 || to < 0 || from >= kMaxEvents || to >= kMaxEvents || !events_[from] || !events_[to]) return 0.f;
    if (cudaEventElapsedTime(&ms, events_[from], events_[to]) != cudaSuccess) return 0.f;
    return ms;
  }
  Status begin_capture() override {
    return cuda_status(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  }
  Status end_capture(int id) override {
    cudaGraph_t g = nullptr;
    ENGINE_CUDA(cudaStreamEndCapture(stream_, &g));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    ENGINE_CUDA(e);
    auto it = graphs_.find(id);
    if (it != graphs_.end()) cudaGraphExecDestroy(it->second);
    graphs_[id] = exec;
    return Status::Ok();
  }
  Status replay(int id) override {
    auto it = graphs_.find(id);
    if (it == graphs_.end()) return Status::Internal("no graph captured for id " + std::to_string(id));
    return cuda_status(cudaGraphLaunch(it->second, stream_), "cudaGraphLaunch");
  }

 private:
  struct LtEntry {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  bool gemv_ok(int M, int K, const void* x, std::int64_t ldx, const void* w) const {
    const int m_pad = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8;
    // auto: the GEMV up to two rows, where it beats cuBLASLt (H200, Llama-3.2-1B step: 1078 vs
    // 1234 us at 1 row, 1260 vs 1321 at 2); at 4 rows cuBLASLt wins (1321 vs 1658 us), at 8 by 2x.
    return M <= gemv_max_rows_ && K % 8 == 0 && ldx % 8 == 0 &&
           static_cast<std::size_t>(m_pad) * K * 2 <= kGemvMaxSmem && reinterpret_cast<std::uintptr_t>(x) % 16 == 0 &&
           reinterpret_cast<std::uintptr_t>(w) % 16 == 0;
  }
  Status gemv(int M, int N, int K, const void* x, std::int64_t ldx, const GemvPrologue& pro, const void* w, void* y,
              std::int64_t ldy, DType y_dtype) {
    cuda::engine::GemvParams p;
    p.x = x;
    p.ldx = ldx;
    p.w = w;
    p.y = y;
    p.ldy = ldy;
    p.y_dtype = y_dtype;
    p.M = M;
    p.N = N;
    p.K = K;
    p.prologue = kernel_prologue(pro.kind);
    p.norm_weight = pro.weight;
    p.eps = pro.eps;
    p.residual = pro.residual;
    p.residual_out = pro.residual_out;
    return cuda::engine::gemv(p, cuda::engine::GemvDevice{num_sms_, sm_major_, pdl_}, stream_);
  }
  Status lt_gemm(int M, int N, int K, const void* x, std::int64_t ldx, const void* w, void* y, std::int64_t ldy,
                 DType y_dtype) {
    const auto key = std::make_tuple(M, N, K, ldx, ldy, static_cast<int>(y_dtype));
    auto it = lt_cache_.find(key);
    if (it == lt_cache_.end()) {
      LtEntry e;
      const cudaDataType_t ct = y_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
      ENGINE_LT(lt_api_->cublasLtMatmulDescCreate(&e.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      ENGINE_LT(lt_api_->cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      ENGINE_LT(lt_api_->cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      // Column-major view: W (N, K) row-major is (K, N) col-major, used transposed; x is (K, M);
      // y (M, N) row-major is (N, M) col-major.
      ENGINE_LT(lt_api_->cublasLtMatrixLayoutCreate(&e.a, CUDA_R_16BF, K, N, K));
      ENGINE_LT(lt_api_->cublasLtMatrixLayoutCreate(&e.b, CUDA_R_16BF, K, M, ldx));
      ENGINE_LT(lt_api_->cublasLtMatrixLayoutCreate(&e.c, ct, N, M, ldy));
      cublasLtMatmulPreference_t pref = nullptr;
      ENGINE_LT(lt_api_->cublasLtMatmulPreferenceCreate(&pref));
      const std::size_t ws = kWorkspace;
      lt_api_->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      const cublasStatus_t hs = lt_api_->cublasLtMatmulAlgoGetHeuristic(lt_, e.desc, e.a, e.b, e.c, e.c, pref, 1, &res, &found);
      lt_api_->cublasLtMatmulPreferenceDestroy(pref);
      if (hs != CUBLAS_STATUS_SUCCESS || found == 0)
        return Status::Cuda("cuBLASLt found no algorithm for a " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                            std::to_string(K) + " GEMM");
      e.algo = res.algo;
      it = lt_cache_.emplace(key, e).first;
    }
    const float alpha = 1.f, beta = 0.f;
    const LtEntry& e = it->second;
    return lt_status(lt_api_->cublasLtMatmul(lt_, e.desc, &alpha, w, e.a, x, e.b, &beta, y, e.c, y, e.c, &e.algo, workspace_,
                                    kWorkspace, stream_),
                     "cublasLtMatmul");
  }

  static constexpr std::size_t kWorkspace = 32u << 20;
  cudaStream_t stream_ = nullptr;
  const cuda::dl::CublasLt* lt_api_ = nullptr;  ///< cuBLASLt's functions (cuda/common/cublas_dl.h)
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  std::string name_;
  int gemv_max_rows_ = kGemvAutoRows;  ///< rows up to which gemm() takes the GEMV (0: never)
  bool pdl_ = true;
  int sm_major_ = 0, num_sms_ = 1;
  std::vector<cudaEvent_t> events_;
  std::map<int, cudaGraphExec_t> graphs_;
  std::map<std::tuple<int, int, int, std::int64_t, std::int64_t, int>, LtEntry> lt_cache_;
};

}  // namespace

Status make_cuda_ops(std::unique_ptr<Ops>* out) {
  auto ops = std::make_unique<CudaOps>();
  FLASHCPP_RETURN_IF_ERROR(ops->init());
  *out = std::move(ops);
  return Status::Ok();
}

}  // namespace flashcpp::engine
