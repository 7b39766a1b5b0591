// Ops on the CPU backend: fp32 host buffers, a threaded GEMM, the same sampling rule as CUDA.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "cpu/parallel.h"
#include "engine/ops.h"
#include "flashcpp/half.h"
#include "engine/sampling.h"

namespace flashcpp::engine {
namespace {

class CpuOps final : public Ops {
 public:
  explicit CpuOps(int threads)
      : threads_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())) {}
  bool cuda() const override { return false; }
  DType dtype() const override { return DType::kF32; }
  Stream stream() const override { return nullptr; }
  std::string describe() const override { return "cpu (" + std::to_string(threads_) + " threads, fp32)"; }

  Status alloc(std::size_t bytes, void** out) override {
    void* p = std::calloc(1, bytes);
    if (!p) return Status::Invalid("cannot allocate " + std::to_string(bytes) + " bytes of host memory");
    *out = p;
    return Status::Ok();
  }
  void release(void* p) noexcept override { std::free(p); }
  Status upload(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); return {}; }
  Status download(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); return {}; }
  Status copy(void* dst, const void* src, std::size_t bytes) override { std::memmove(dst, src, bytes); return {}; }
  Status sync() override { return Status::Ok(); }
  /// The CPU backend has one GEMM: the CUDA modes would be ignored, so they are refused.
  Status set_gemm_mode(const std::string& mode) override {
    if (mode == "auto") return Status::Ok();
    return Status::Invalid("gemm mode '" + mode +
                           "' selects a CUDA GEMM, but this run is on the CPU backend, which has one GEMM "
                           "(leave --gemm at auto, or run with --backend cuda)");
  }
  Status fill_random(void* p, std::int64_t n, std::uint64_t seed, float stddev) override {
    float* f = static_cast<float*>(p);
    for (std::int64_t i = 0; i < n; ++i) {
      // Sum of uniforms: a cheap bell curve, fine for simulated cache contents.
      float s = 0.f;
      for (int j = 0; j < 4; ++j) s += sample_uniform(seed, static_cast<std::uint32_t>(i), j) - 0.5f;
      f[i] = s * stddev * 1.7320508f;
    }
    return Status::Ok();
  }

  Status gemm(int M, int N, int K, const void* xv, std::int64_t ldx, const void* wv, void* yv, std::int64_t ldy,
              DType y_dtype) override {
    if (y_dtype != DType::kF32) return Status::Internal("cpu gemm writes fp32");
    const float* x = static_cast<const float*>(xv);
    const float* w = static_cast<const float*>(wv);
    float* y = static_cast<float*>(yv);
    parallel(N, [&](int n0, int n1) {
      for (int n = n0; n < n1; ++n) {
        const float* wr = w + static_cast<std::int64_t>(n) * K;
        for (int m = 0; m < M; ++m) {
          const float* xr = x + m * ldx;
          float acc = 0.f;
          for (int k = 0; k < K; ++k) acc += xr[k] * wr[k];
          y[m * ldy + n] = acc;
        }
      }
    });
    return Status::Ok();
  }
  Status embed(const std::int32_t* tokens, int n, const void* table, int vocab, int hidden, void* out) override {
    for (int i = 0; i < n; ++i) {
      const int t = std::clamp(tokens[i], 0, vocab - 1);
      std::memcpy(static_cast<float*>(out) + static_cast<std::int64_t>(i) * hidden,
                  static_cast<const float*>(table) + static_cast<std::int64_t>(t) * hidden, sizeof(float) * hidden);
    }
    return Status::Ok();
  }
  Status write_kv(const KvPool& pool, const std::int32_t* block_table, int pages_per_seq, int seq, int start, int n,
                  const void* k, const void* v, std::int64_t ld) override {
    const std::int64_t row = static_cast<std::int64_t>(pool.heads_kv) * pool.head_dim;
    const bool fp8 = pool.dtype == DType::kF8E4M3;
    for (int t = 0; t < n; ++t) {
      const int slot = start + t;
      if (slot / pool.page_size >= pages_per_seq) return Status::Internal("write_kv past the block table");
      const int page = block_table[static_cast<std::int64_t>(seq) * pages_per_seq + slot / pool.page_size];
      const std::int64_t dst = (static_cast<std::int64_t>(page) * pool.page_size + slot % pool.page_size) * row;
      const float* ks = static_cast<const float*>(k) + t * ld;
      const float* vs = static_cast<const float*>(v) + t * ld;
      if (!fp8) {
        std::memcpy(static_cast<float*>(pool.k) + dst, ks, sizeof(float) * row);
        std::memcpy(static_cast<float*>(pool.v) + dst, vs, sizeof(float) * row);
        continue;
      }
      // The code of x / scale, as decode's append stores it (cpu/decode.cc).
      for (std::int64_t e = 0; e < row; ++e) {
        const int h = static_cast<int>(e / pool.head_dim);
        store_from_float(pool.k, DType::kF8E4M3, dst + e, ks[e] / pool.k_scale[h]);
        store_from_float(pool.v, DType::kF8E4M3, dst + e, vs[e] / pool.v_scale[h]);
      }
    }
    return Status::Ok();
  }
  Status sample(const float* logits, int rows, int vocab, const SampleArgs& args, std::int32_t* tokens_out,
                std::int32_t* history, const std::int32_t* step_counter) override {
    const int step = step_counter ? *step_counter : 0;
    for (int r = 0; r < rows; ++r) {
      const int tok = sample_row_host(logits + static_cast<std::int64_t>(r) * vocab, vocab, args,
                                      sample_uniform(args.seed, static_cast<std::uint32_t>(step), args.row_offset + r));
      tokens_out[r] = tok;
      if (history) history[static_cast<std::int64_t>(step) * rows + r] = tok;
    }
    return Status::Ok();
  }
  Status advance(std::int32_t* seqlens, int n, std::int32_t* step_counter) override {
    for (int i = 0; i < n; ++i) ++seqlens[i];
    if (step_counter) ++*step_counter;
    return Status::Ok();
  }

 private:
  /// fn(begin, end) over [0, n) on the engine's threads (the CPU backends' pool), in chunks of at
  /// least 16 items.
  void parallel(int n, const std::function<void(int, int)>& fn) const {
    const int t = std::min(threads_, std::max(1, n / 16));
    cpu::parallel_chunks(n, t, [&](std::int64_t a, std::int64_t b) { fn(static_cast<int>(a), static_cast<int>(b)); });
  }
  int threads_;
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops(int threads) { return std::make_unique<CpuOps>(threads); }

#if !FLASHCPP_WITH_CUDA
Status make_cuda_ops(std::unique_ptr<Ops>*) {
  return Status::Unsupported("this flashcpp was built without CUDA (configure with -DFLASHCPP_CUDA=ON)");
}
#endif

}  // namespace flashcpp::engine
