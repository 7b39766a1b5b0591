// Fused LLM kernels: RMSNorm (plain and with the residual add), SwiGLU, rotary position embedding,
// per-head QK-RMSNorm + rotary, and rotary + KV-cache append.
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
//   qk_norm_rope (the per-head QK-RMSNorm of Qwen3 and Gemma3, then rotary), for each token (b, s)
//   and each head of q (weights q_weight) and of k (weights k_weight), with w the head's weights:
//       n[j] = round_T( x[j] * rsqrt(mean_j x[j]^2 + eps) * (weight_offset + w[j]) )
//       y    = apply_rotary(n)   (the pairs, angles and rotation above, read from the ROUNDED n)
//     The normed value is rounded to T before the rotation, so y equals rms_norm over each head
//     (hidden = head_dim) followed by apply_rotary, bit for bit on the same backend, when
//     weight_offset is 0. weight_offset 1 is Gemma3's "1 + weight" (the sum formed in fp32).
//     rotary.style kNone: the norm only.
//
//   rope_append_kv (FlashInfer's append_paged_kv_cache with rotary; decode.h's append), for each
//   new token (b, s) with slot j = cache_seqlens[b] + s of sequence b and rotary position
//   p = positions[b * seqlen + s] (or j when positions is null):
//       cache.k[slot j of b] = apply_rotary(k_new[b, s]) at position p   (all heads_kv heads)
//       cache.v[slot j of b] = v_new[b, s]                               (copied, bit for bit)
//       q_out[b, s]          = apply_rotary(q[b, s]) at position p       (when heads_q > 0)
//     Slot j of sequence b is decode's: contiguous cache row j of batch entry b, or in-page row
//     j % page_size of page block_table[b * block_table_stride + j / page_size].
//     An fp8 e4m3 cache (cache.k and cache.v of DType::kF8E4M3, with fp32 per-KV-head scales
//     cache.k_scale / v_scale; decode.h) stores codes instead, by decode's rule, for KV head hk:
//       cache.k[slot j of b] = e4m3( rotate_fp32(k_new[b, s]) / k_scale[hk] )
//       cache.v[slot j of b] = e4m3( v_new[b, s] / v_scale[hk] )
//     where rotate_fp32 is the rotation above in fp32, NOT rounded to the dtype first, the division
//     is an fp32 division and e4m3() rounds to nearest even, saturating at +-448 (infinity too);
//     NaN gives a NaN code, 0x7f or 0xff (the CPU backend keeps the NaN's sign; the GPU's
//     cvt.rn.satfinite gives 0x7f). decode_run's append applies the same rule with the same
//     conversions, so both appends write the same bytes on one backend. q_out is q's dtype as above.
//
// Entry points validate first (one-sentence Status on failure), then run on opt.backend:
// kAuto picks CUDA for device pointers and the CPU backend for host pointers; kCpu runs the fp32
// CPU implementation; kCpuReference is refused (kUnsupported: the fp64 ground truth of these
// kernels lives in the tests, tests/cpu/test_fused.cc). CUDA launches are asynchronous on opt.stream, allocate nothing and never
// synchronize (capturable in a CUDA graph). opt.cuda_config may force a CUDA path for tests
// and tuning: a comma-separated list of "scalar" (element-wise loads instead of 16-byte
// vectors), "two_pass" (norms: re-read the row instead of keeping it in registers), "stream"
// (norms and rotary: a resident grid that keeps the next rows in flight into shared memory; rotary's
// 16-byte default), "stages2|3|4" (its depth), "shared" (rotary: the shared-cos/sin kernel) and
// "streaming" (evict-first cache hints on the 16-byte loads and stores); "" is automatic.
// None of them changes a result. qk_norm_rope and rope_append_kv take "scalar" only (their row
// kernels have no two-pass or streaming variant; the other tokens leave them unchanged). The automatic choice takes 16-byte vectors whenever every pointer is 16-byte
// aligned and every row/token/head stride is a multiple of 8 elements (rotary also needs
// rotary_dim % 16 == 0 and head_dim % 8 == 0; the norms and SwiGLU take any row length, the
// last partial vector of a row element by element), and element-wise accesses otherwise
// (correct for any alignment, slower). Nothing is ever read or written outside the described
// elements.
#pragma once

#include <cstdint>

#include "flashcpp/attention.h"  // Backend, RunOptions
#include "flashcpp/decode.h"     // KVCacheView (rope_append_kv)
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

// ---- QK-RMSNorm + rotary ------------------------------------------------------------------

/// The largest head_dim of qk_norm_rope and rope_append_kv: on CUDA one warp (a power-of-two
/// group of its lanes) holds a (token, head) row in registers, 8 elements a lane.
inline constexpr int kFusedRowMaxHeadDim = 256;

/// Per-head RMSNorm of q and k with separate weights, then the rotary embedding (header comment).
///
/// q and k are (batch, seqlen, heads, head_dim) TensorViews as in RopeParams (any strides, a
/// contiguous head_dim; a packed (tokens, heads, head_dim) tensor is batch = 1, seqlen = tokens;
/// views of one packed qkv buffer are fine). A null q_out.data (k_out.data) writes q (k) in
/// place; an output may be exactly its input, nothing else may overlap it.
struct QkNormRopeParams {
  int batch = 1;
  int seqlen = 0;    ///< tokens per sequence; 0 writes nothing
  int heads_q = 0;   ///< >= 1
  int heads_k = 0;   ///< 0: no k
  int head_dim = 0;  ///< even, in [2, kFusedRowMaxHeadDim]
  TensorView q, k;
  TensorView q_out, k_out;    ///< data null: in place
  const void* q_weight = nullptr;  ///< (head_dim,) contiguous, q's dtype
  const void* k_weight = nullptr;  ///< (head_dim,) contiguous, q's dtype (needed when heads_k > 0)
  float weight_offset = 0.f;  ///< 0 (Qwen3: w) or 1 (Gemma3: 1 + w)
  float eps = 1e-6f;          ///< >= 0, finite
  /// int32 [batch * seqlen] position of token (b, s); null: s. As RopeParams::positions.
  const std::int32_t* positions = nullptr;
  /// The rotation, exactly as apply_rotary takes it (rope.h); kNone = the norm only.
  RotarySpec rotary = RotarySpec::of_style(RopeStyle::kNeox);

  int effective_rotary_dim() const noexcept { return rotary.effective_rotary_dim(head_dim); }
};

/// Never launches; reads positions only for the CPU backends (host memory).
Status validate(const QkNormRopeParams& p, Backend backend);

/// y = rotary(rms_norm over head_dim (x) * (weight_offset + weight)) for q and k (header comment).
Status qk_norm_rope(const QkNormRopeParams& p, const RunOptions& opt = {});

// ---- rotary + KV-cache append ---------------------------------------------------------------

/// New keys (rotated) and values written into a contiguous or paged KV cache, and optionally q
/// rotated in the same pass (header comment).
///
/// k_new (batch, seqlen, heads_kv, head_dim) and v_new (..., head_dim_v) are TensorViews with a
/// contiguous last dim; a packed (tokens, heads, dim) tensor of one new token per sequence is
/// batch = tokens, seqlen = 1. The cache is decode.h's KVCacheView (contiguous or paged, same
/// geometry rules), of k_new's dtype (fp16 or bf16 on CUDA, fp32 too on the CPU backend) or fp8
/// e4m3 with per-KV-head k_scale / v_scale (required for fp8 and refused otherwise; positive and
/// finite; on CUDA the cache 16-byte aligned with strides in multiples of 16 codes, as decode
/// reads it): K and V are quantized in the same pass (header comment). Nothing outside the
/// written slots changes.
///
/// Device values the host cannot read (CUDA backend) are handled as decode does: a length
/// outside [0, slots - seqlen] is clamped into it and a block-table entry into [0, num_pages),
/// so no write leaves the cache; a position outside the cos/sin tables writes NaN to the
/// rotated dims (apply_rotary's rule). The CPU backend reads them and refuses bad values.
/// Sequences must not name the same page for the slots they append to (two writes to one slot
/// race on CUDA; nothing checks it).
struct RopeAppendParams {
  int batch = 0;        ///< sequences; 0 writes nothing
  int seqlen = 0;       ///< new tokens per sequence; 0 writes nothing
  int heads_q = 0;      ///< 0: no q
  int heads_kv = 0;     ///< >= 1
  int head_dim = 0;     ///< of q and the keys: even, in [2, kFusedRowMaxHeadDim]
  int head_dim_v = 0;   ///< of the values: [1, kFusedRowMaxHeadDim]; 0 = head_dim
  TensorView q, q_out;  ///< (batch, seqlen, heads_q, head_dim); q_out.data null: q in place
  TensorView k_new, v_new;
  KVCacheView cache;
  /// int32 [batch]: keys already in sequence b; its new token s goes to slot cache_seqlens[b] + s.
  const std::int32_t* cache_seqlens = nullptr;
  /// int32 [batch * seqlen] rotary position of token (b, s); null: its slot cache_seqlens[b] + s.
  const std::int32_t* positions = nullptr;
  /// The rotation, as apply_rotary takes it (rope.h); kNone appends K unrotated (q, when given,
  /// is copied to q_out).
  RotarySpec rotary = RotarySpec::of_style(RopeStyle::kNeox);

  int effective_head_dim_v() const noexcept { return head_dim_v == 0 ? head_dim : head_dim_v; }
  int effective_rotary_dim() const noexcept { return rotary.effective_rotary_dim(head_dim); }
};

/// Never launches; reads cache_seqlens, the block table and positions only for the CPU backends.
Status validate(const RopeAppendParams& p, Backend backend);

/// Rotates k_new (and q) and writes k and v into the cache (header comment).
Status rope_append_kv(const RopeAppendParams& p, const RunOptions& opt = {});

}  // namespace flashcpp
