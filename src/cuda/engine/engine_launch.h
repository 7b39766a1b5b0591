// Host-side launchers of the Llama engine's CUDA kernels (src/cuda/engine/*.cu): the batch-small
// GEMV with its fused prologue, the embedding lookup, the KV scatter of a prompt, sampling, the
// per-step counters and a spin. Called by the engine's CUDA Ops (src/engine/ops_cuda.cu), which
// owns the stream, cuBLASLt and the graphs. Plain C++ (no CUDA headers); bf16 activations and
// weights; each launches on `stream`, allocates nothing and never synchronizes. Compiled into
// flashcpp_engine, not the kernel library.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashcpp/engine.h"  // SampleArgs
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda::engine {

/// What the GEMV applies to its input rows before the dot products (the engine's
/// GemvPrologue::Kind, src/engine/ops.h, where the rule and its roundings are written down).
enum class GemvPrologueKind : std::uint8_t { kNone, kRmsNorm, kAddRmsNorm, kSiluMul };

/// The GEMV keeps prologue(x) for all its (padded) rows in shared memory: M_pad * K bf16 must fit.
inline constexpr std::size_t kGemvMaxSmem = 160 * 1024;

/// y (M, N) = prologue(x) (M, K) * w (N, K)^T for M <= 8, bf16 in, fp32 accumulation. Needs
/// K % 8 == 0, ldx % 8 == 0 (kSiluMul: ldx >= 2K), x and w 16-byte aligned, and M_pad * K * 2 <=
/// kGemvMaxSmem (M_pad: M rounded up to 1, 2, 4 or 8); the caller checks.
struct GemvParams {
  const void* x = nullptr;  ///< (M, K) bf16, row stride ldx; kSiluMul: (M, 2K) = [gate | up]
  std::int64_t ldx = 0;
  const void* w = nullptr;  ///< (N, K) bf16, row stride K
  void* y = nullptr;        ///< (M, N) of y_dtype, row stride ldy
  std::int64_t ldy = 0;
  DType y_dtype = DType::kBF16;  ///< kBF16 or kF32
  int M = 0, N = 0, K = 0;
  GemvPrologueKind prologue = GemvPrologueKind::kNone;
  const void* norm_weight = nullptr;  ///< (K,) bf16: the norms' weight
  float eps = 1e-5f;
  const void* residual = nullptr;     ///< kAddRmsNorm: (M, K) bf16, row stride K
  void* residual_out = nullptr;       ///< kAddRmsNorm: (M, K) bf16, row stride K; must not alias residual
};

/// The device the GEMV sizes its grid for, and whether it launches programmatically (PDL, sm_90+).
struct GemvDevice {
  int num_sms = 1;
  int sm_major = 0;
  bool pdl = false;
};

Status gemv(const GemvParams& p, const GemvDevice& dev, Stream stream);

/// out (n, hidden) bf16 = table[tokens[i]] (token ids clamped into [0, vocab)).
Status embed(const std::int32_t* tokens, int n, const void* table, int vocab, int hidden, void* out, Stream stream);

/// Writes n tokens' K and V rows (k, v: (n, row) bf16 with token stride ld elements, row =
/// heads_kv * head_dim) into slots start .. start+n-1 of sequence `seq` of a paged pool
/// (num_pages, page_size, row) through block table row `seq` (int32, pages_per_seq entries).
/// row and ld must be multiples of 8 (16-byte rows).
struct WriteKvParams {
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int num_pages = 0, page_size = 0, row = 0;
  const std::int32_t* block_table = nullptr;
  int pages_per_seq = 0, seq = 0, start = 0, n = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t ld = 0;
  /// An fp8 e4m3 pool: per-KV-head scales (device), codes of x / scale as decode's append stores
  /// them; null = a bf16 pool.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int head_dim = 0;  ///< fp8 only: the scale of element e of a row is that of head e / head_dim
};
Status write_kv(const WriteKvParams& p, Stream stream);

/// Samples `rows` tokens from logits (rows, vocab) fp32 (row stride vocab) by the rule of
/// SampleArgs: tokens_out[r], and history[step * rows + r] when history is set, where step =
/// *step_counter (device-resident, so a graph replays with a new step; null: step 0).
Status sample(const float* logits, int rows, int vocab, const flashcpp::engine::SampleArgs& args,
              std::int32_t* tokens_out, std::int32_t* history, const std::int32_t* step_counter, Stream stream);

/// seqlens[i] += 1 for i < n, then *step_counter += 1 (when set).
Status advance(std::int32_t* seqlens, int n, std::int32_t* step_counter, Stream stream);

/// Keeps the device busy for about `ns` nanoseconds (so the host can queue work ahead of it).
Status spin(std::uint64_t ns, Stream stream);

}  // namespace flashcpp::cuda::engine
