// Fused LLM kernels: RMSNorm (plain and with the residual add), SwiGLU, rotary position embedding.
//
// Semantics (every backend computes exactly this with fp32 math; the tests compare it with an
// fp64 evaluation of the same formulas). T is the tensors' dtype (bf16 or fp16 on CUDA; fp32 too
// on the CPU backend); round_T is one round-to-nearest-even into T.
//
//   rms_norm, per row r:
//       y[r, :] = round_T( x[r, :] * rsqrt(mean_j x[r, j]^2 + eps) * weight[:] )
//
//   fused_add_rms_norm, per row r:
//       h            = round_T( x[r, :] + residual[r, :] )   (the fp32 sum, rounded to T)
//       residual_out = h
//       y[r, :]      = round_T( h * rsqrt(mean_j h_j^2 + eps) * weight[:] )
//     y is computed from the ROUNDED h, i.e. it equals rms_norm(residual_out): what PyTorch does
//     when it adds in bf16 and then normalizes, and what a reader of residual_out can reproduce.
//     The product h * rstd * weight is rounded once (Hugging Face's LlamaRMSNorm rounds h * rstd
//     to T before multiplying by the weight, so it can differ from this by one ulp).
//
//   silu_and_mul (SwiGLU), per element:
//       out = round_T( silu(gate) * up ),  silu(g) = g / (1 + exp(-g))
//     Either from two tensors gate and up, or from one fused projection output x = [gate | up]
//     of shape (rows, 2d) (see SiluMulParams::from_fused).
//
//   apply_rotary, for each token (b, s) with position p = positions[b * seqlen + s] (or s when
//   positions is null), each head of q and k, and each pair index i in [0, rotary_dim / 2):
//       inv_freq[i] = theta^(-2i / rotary_dim), then the Llama-3 scaling when enabled (below)
//       c, s_ = cos(p * inv_freq[i]), sin(p * inv_freq[i])   (or row p of the cos/sin tables)
//       pair (a, b): neox (half split)    a = x[i],  b = x[i + rotary_dim / 2]
//                    interleaved (GPT-J)  a = x[2i], b = x[2i + 1]
//       a' = a * c - b * s_,   b' = b * c + a * s_
//     Dimensions [rotary_dim, head_dim) pass through unchanged (partial rotary, e.g. GPT-NeoX).
//     The angle p * inv_freq[i] is formed and reduced modulo 2*pi in fp64 before an fp32
//     sincos, so long positions keep full fp32 accuracy (an fp32 product, as PyTorch reference
//     code does, is off by up to ~1e-2 rad at position 128k). Llama-3 frequency scaling, with
//     wavelen = 2*pi / f, low = original_max_position / low_freq_factor and
//     high = original_max_position / high_freq_factor:
//       wavelen < high:  f            (high frequencies kept)
//       wavelen > low:   f / factor   (low frequencies scaled)
//       else:            (1 - a) * f / factor + a * f,
//                        a = (original_max_position / wavelen - low_freq_factor)
//                            / (high_freq_factor - low_freq_factor)
//
// Entry points validate first (one-sentence Status on failure), then run on opt.backend:
// kAuto picks CUDA for device pointers and the CPU backend for host pointers; kCpu runs the fp32
// CPU implementation; kCpuReference is refused (kUnsupported: the fp64 ground truth of these
// kernels lives in the tests, tests/cpu/test_fused.cc). CUDA launches are asynchronous on opt.stream, allocate nothing and never
// synchronize (capturable in a CUDA graph). opt.cuda_config may force a CUDA path for tests
// and tuning: a comma-separated list of "scalar" (element-wise loads instead of 16-byte
// vectors), "two_pass" (norms: re-read the row instead of keeping it in registers) and
// "streaming" (evict-first cache hints on the 16-byte loads and stores); "" is automatic.
// None of them changes a result. The automatic choice takes 16-byte vectors whenever every pointer is 16-byte
// aligned and every row/token/head stride is a multiple of 8 elements (rotary also needs
// rotary_dim % 16 == 0 and head_dim % 8 == 0; the norms and SwiGLU take any row length, the
// last partial vector of a row element by element), and element-wise accesses otherwise
// (correct for any alignment, slower). Nothing is ever read or written outside the described
// elements.
#pragma once

#include <cstdint>

#include "flashcpp/attention.h"  // Backend, RunOptions
#include "flashcpp/rope.h"       // RotarySpec, rotary_inv_freq
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp {

/// A row-major (rows, cols) matrix: element (r, c) lives at data[r * row_stride + c].
struct MatrixView {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  std::int64_t row_stride = 0;  ///< elements between consecutive rows; >= cols unless rows <= 1
};

/// A contiguous (rows, cols) matrix.
inline MatrixView contiguous_matrix(void* data, DType dt, std::int64_t cols) {
  return MatrixView{data, dt, cols};
}

// ---- RMSNorm ------------------------------------------------------------------------------

/// RMSNorm over the last dimension of a (rows, hidden) matrix, optionally after a residual add.
///
/// Aliasing: an output may be exactly an input (same data and row_stride): y == x gives the
/// in-place form, residual_out == residual the in-place residual update (vLLM's and FlashInfer's
/// fused_add_rms_norm use both). Any other overlap between an output and an input, or between
/// the two outputs, is refused.
struct RmsNormParams {
  std::int64_t rows = 0;    ///< 0 writes nothing
  std::int64_t hidden = 0;  ///< normalized length; 0 writes nothing
  MatrixView x;             ///< input
  MatrixView residual;      ///< fused_add_rms_norm only: the residual stream (input)
  MatrixView residual_out;  ///< fused_add_rms_norm only: receives h = x + residual
  const void* weight = nullptr;  ///< (hidden,) contiguous, x's dtype
  MatrixView y;             ///< output, x's dtype
  float eps = 1e-6f;        ///< >= 0, finite
};

/// Checks a problem for rms_norm (with_residual = false) or fused_add_rms_norm (true) without
/// touching its memory. Never launches.
Status validate(const RmsNormParams& p, bool with_residual, Backend backend);

/// y = x * rsqrt(mean(x^2) + eps) * weight. residual / residual_out must be unset (null).
Status rms_norm(const RmsNormParams& p, const RunOptions& opt = {});

/// h = x + residual; residual_out = h; y = h * rsqrt(mean(h^2) + eps) * weight.
Status fused_add_rms_norm(const RmsNormParams& p, const RunOptions& opt = {});

// ---- SwiGLU -------------------------------------------------------------------------------

/// out = silu(gate) * up over (rows, d) matrices. out may be exactly gate or exactly up (in
/// place); no other overlap of out with the inputs is allowed. gate and up may share a buffer.
struct SiluMulParams {
  std::int64_t rows = 0;  ///< 0 writes nothing
  std::int64_t d = 0;     ///< columns of gate, up and out; 0 writes nothing
  MatrixView gate, up, out;

  /// The fused projection layout: x is (rows, 2d) = [gate | up] with row stride x_row_stride
  /// (2d when contiguous), out is (rows, d).
  static SiluMulParams from_fused(void* x, DType dt, std::int64_t rows, std::int64_t d,
                                  std::int64_t x_row_stride, MatrixView out) {
    SiluMulParams p;
    p.rows = rows;
    p.d = d;
    p.gate = MatrixView{x, dt, x_row_stride};
    p.up = MatrixView{static_cast<char*>(x) + d * static_cast<std::int64_t>(dtype_size(dt)), dt,
                      x_row_stride};
    p.out = out;
    return p;
  }
};

Status validate(const SiluMulParams& p, Backend backend);

/// out = silu(gate) * up (SwiGLU), two-tensor form or fused [gate | up] (SiluMulParams::from_fused).
Status silu_and_mul(const SiluMulParams& p, const RunOptions& opt = {});

// ---- rotary -------------------------------------------------------------------------------

/// Rotary embedding applied to q and (optionally) k.
///
/// q and k are TensorViews of (batch, seqlen, heads, head_dim) with any strides but a
/// contiguous head_dim (attention.h's convention); a packed (tokens, heads, head_dim) tensor is
/// batch = 1, seqlen = tokens. q and k may be views of one packed qkv buffer. The results go
/// to q_out / k_out; a null q_out.data (k_out.data) rotates q (k) in place. Outputs have the
/// inputs' dtype and shapes; an output may be exactly its own input, nothing else may overlap it.
struct RopeParams {
  int batch = 1;
  int seqlen = 0;        ///< tokens per sequence; 0 writes nothing
  int heads_q = 0;       ///< >= 1
  int heads_k = 0;       ///< 0: no k
  int head_dim = 0;      ///< even, <= 1024
  TensorView q, k;
  TensorView q_out, k_out;  ///< data null: in place
  /// int32 [batch * seqlen] position of token (b, s) at positions[b * seqlen + s]; null: s.
  const std::int32_t* positions = nullptr;
  /// The rotation (rope.h): style (neox by default here; kNone is refused), rotary_dim (0 =
  /// head_dim), theta and Llama-3 scaling, or cos/sin tables. With tables, positions must lie in
  /// [0, max_position): the CPU backend checks them (host memory); the CUDA kernel cannot read
  /// them before launching, so it writes NaN to the rotated dims of a token whose position is out
  /// of range instead of reading outside the tables.
  RotarySpec rotary = RotarySpec::of_style(RopeStyle::kNeox);

  int effective_rotary_dim() const noexcept { return rotary.effective_rotary_dim(head_dim); }
};

/// Never launches; reads positions only for the CPU backends (host memory), to check them
/// against the cache.
Status validate(const RopeParams& p, Backend backend);

/// Applies the rotary embedding (see the header comment) to q and k.
Status apply_rotary(const RopeParams& p, const RunOptions& opt = {});

}  // namespace flashcpp
