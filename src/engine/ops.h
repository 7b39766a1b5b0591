// The few operations of the Llama engine that are not flashcpp kernels: memory, GEMMs,
// embedding lookup, the KV-cache scatter of a prompt, sampling and the per-step counters.
// Two implementations: Ops for the CPU backend (fp32, host memory; what CI runs) and for CUDA
// (bf16, device memory, cuBLASLt or a batch-small GEMV, one stream). The model code is written
// once against this interface and the flashcpp entry points, which pick their backend from the
// pointers they are given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "flashcpp/engine.h"  // SampleArgs, sample_uniform
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::engine {

/// A paged KV cache pool of one layer: (num_pages, page_size, heads_kv, head_dim), contiguous.
struct KvPool {
  void* k = nullptr;
  void* v = nullptr;
  int num_pages = 0, page_size = 0, heads_kv = 0, head_dim = 0;
  /// The pool's element type: the backend's dtype(), or kF8E4M3 (an fp8 cache: codes of x / scale
  /// with the per-KV-head fp32 scales k_scale / v_scale, in the backend's memory; decode.h).
  DType dtype = DType::kF32;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

/// What a decode GEMV applies to its input rows before the dot products, so a norm or the
/// SwiGLU product does not need a kernel of its own (every rounding as in fused.h, T = dtype()):
///   kNone        x as given
///   kRmsNorm     x' = round_T(x * rsqrt(mean(x^2) + eps) * weight)
///   kAddRmsNorm  h = round_T(x + residual); residual_out = h; x' = round_T(h * rsqrt(mean(h^2) + eps) * weight)
///                (residual_out must not alias residual: every CTA reads residual, one writes h)
///   kSiluMul     x is (M, 2K) = [gate | up] with row stride ldx; x' = round_T(silu(gate) * up)
struct GemvPrologue {
  enum class Kind : std::uint8_t { kNone, kRmsNorm, kAddRmsNorm, kSiluMul };
  Kind kind = Kind::kNone;
  const void* weight = nullptr;    ///< (K,) norm weight
  float eps = 1e-5f;
  const void* residual = nullptr;  ///< (M, K), row stride K
  void* residual_out = nullptr;    ///< (M, K), row stride K
  /// (M, K) of dtype(), row stride K: where an implementation that cannot fuse the prologue
  /// writes x' before a plain GEMM (the CPU backend always does).
  void* scratch = nullptr;
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual bool cuda() const = 0;
  /// Activations and weights: fp32 on the CPU backend, bf16 on CUDA.
  virtual DType dtype() const = 0;
  virtual Stream stream() const = 0;
  /// Whether kernels launch programmatically (PDL: GEMVs and decode attention; off before sm_90
  /// and with the "gemv-nopdl" mode).
  virtual bool programmatic() const { return false; }
  virtual std::string describe() const = 0;  ///< e.g. "NVIDIA H200 (132 SMs)" or "cpu (2 threads)"

  virtual Status alloc(std::size_t bytes, void** out) = 0;  ///< zeroed
  virtual void release(void* p) noexcept = 0;
  /// Host -> buffer and buffer -> host copies; both wait until the copy is done.
  virtual Status upload(void* dst, const void* host_src, std::size_t bytes) = 0;
  virtual Status download(void* host_dst, const void* src, std::size_t bytes) = 0;
  /// Asynchronous (CUDA: on stream()) copy between buffers.
  virtual Status copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual Status sync() = 0;
  /// Fills n elements of dtype() with ~N(0, stddev) values (the KV of a simulated context).
  virtual Status fill_random(void* p, std::int64_t n, std::uint64_t seed, float stddev) = 0;

  /// y (M, N) = x (M, K) * w (N, K)^T; x and w of dtype(), row strides ldx (>= K) and K;
  /// y of y_dtype (dtype() or fp32), row stride ldy. fp32 accumulation.
  virtual Status gemm(int M, int N, int K, const void* x, std::int64_t ldx, const void* w, void* y,
                      std::int64_t ldy, DType y_dtype) = 0;
  /// y (M, N) = prologue(x) (M, K) * w (N, K)^T (see GemvPrologue). The default composes the
  /// flashcpp norm / SwiGLU entry points into pro.scratch with gemm(); CUDA fuses it for small M.
  virtual Status gemv_fused(int M, int N, int K, const void* x, std::int64_t ldx, const GemvPrologue& pro,
                            const void* w, void* y, std::int64_t ldy, DType y_dtype);
  /// out (n, hidden) = table[tokens[i]] (token ids clamped into [0, vocab)).
  virtual Status embed(const std::int32_t* tokens, int n, const void* table, int vocab, int hidden, void* out) = 0;
  /// Writes n tokens' K and V rows (k, v: (n, heads_kv, head_dim) with token stride ld elements)
  /// into slots start .. start+n-1 of sequence `seq` of the pool (block table row `seq`, int32);
  /// an fp8 pool stores the code of x / scale[head] (round to nearest even, saturating).
  virtual Status write_kv(const KvPool& pool, const std::int32_t* block_table, int pages_per_seq, int seq,
                          int start, int n, const void* k, const void* v, std::int64_t ld) = 0;
  /// Samples rows tokens from logits (rows, vocab) fp32 (row stride vocab): tokens_out[r], and
  /// history[step * rows + r] when history is set, where step = *step_counter (device-resident,
  /// so a graph replays with a new step).
  virtual Status sample(const float* logits, int rows, int vocab, const SampleArgs& args, std::int32_t* tokens_out,
                        std::int32_t* history, const std::int32_t* step_counter) = 0;
  /// seqlens[i] += 1 for i < n, then *step_counter += 1.
  virtual Status advance(std::int32_t* seqlens, int n, std::int32_t* step_counter) = 0;

  // ---- CUDA only (the CPU versions succeed and do nothing) ----
  /// Keeps the device busy for about `us` microseconds (so the host can queue work ahead of it).
  virtual Status spin(int us) { (void)us; return Status::Ok(); }
  /// Which GEMM implementation gemm() uses: "auto" (GEMV for M <= 2, cuBLASLt above), "cublaslt",
  /// "gemv" (GEMV up to M = 8), "gemv-nopdl" (the same without programmatic dependent launch, for
  /// the GEMVs and the decode attention kernels).
  virtual Status set_gemm_mode(const std::string& mode) { (void)mode; return Status::Ok(); }
  /// Timing events (CUDA): record event `slot` (0..kMaxEvents-1) on the stream; the ms between two
  /// recorded events after a sync. The CPU versions record nothing and report 0.
  static constexpr int kMaxEvents = 4096;
  /// CUDA graphs: capture the work queued on stream() between begin_capture and end_capture
  /// into graph `id` (replacing one of that id), replay it with replay(id). CPU: unsupported.
  virtual Status begin_capture() { return Status::Unsupported("CUDA graphs need the CUDA backend"); }
  virtual Status end_capture(int id) { (void)id; return Status::Unsupported("CUDA graphs need the CUDA backend"); }
  virtual Status replay(int id) { (void)id; return Status::Unsupported("CUDA graphs need the CUDA backend"); }
  virtual Status record_event(int slot) { (void)slot; return Status::Ok(); }
  virtual float event_ms(int from, int to) { (void)from; (void)to; return 0.f; }
};

std::unique_ptr<Ops> make_cpu_ops(int threads);
/// Fails with a sentence when CUDA is not built in or no device is usable.
Status make_cuda_ops(std::unique_ptr<Ops>* out);

/// A buffer owned through an Ops (released on destruction).
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ops_ = o.ops_; ptr_ = o.ptr_; bytes_ = o.bytes_;
      o.ops_ = nullptr; o.ptr_ = nullptr; o.bytes_ = 0;
    }
    return *this;
  }
  ~Buffer() { reset(); }
  Status allocate(Ops* ops, std::size_t bytes) {
    reset();
    ops_ = ops;
    bytes_ = bytes;
    return ops->alloc(bytes == 0 ? 16 : bytes, &ptr_);
  }
  void reset() noexcept {
    if (ops_ && ptr_) ops_->release(ptr_);
    ptr_ = nullptr; bytes_ = 0;
  }
  void* get() const noexcept { return ptr_; }
  template <class T> T* as() const noexcept { return static_cast<T*>(ptr_); }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  Ops* ops_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace flashcpp::engine
