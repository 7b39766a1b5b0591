// Element types and the tensor view used by every entry point.
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace flashcpp {

/// Same type as cudaStream_t, declared without pulling in CUDA headers. nullptr = legacy default stream.
using Stream = CUstream_st*;

enum class DType : std::uint8_t {
  kF16 = 0,   ///< IEEE half
  kBF16 = 1,  ///< bfloat16
  kF32 = 2,   ///< float (CPU backend only for attention)
  /// double: attention forward and backward on the fp64 reference backend only
  /// (Backend::kCpuReference), so that torch.autograd.gradcheck sees a function evaluated in
  /// double; every other backend and entry point refuses it with a sentence.
  kF64 = 3,
  /// OCP FP8 e4m3 ("e4m3fn": bias 7, largest finite 448, no infinity, NaN = 0x7f / 0xff): the
  /// decode KV cache only, with per-head scales (decode.h, KVCacheView). Stored from a float
  /// x / scale rounded to nearest even with saturation to +-448 (PTX cvt.rn.satfinite.e4m3x2).
  kF8E4M3 = 4,
};

constexpr std::size_t dtype_size(DType t) noexcept {
  return t == DType::kF64 ? 8 : t == DType::kF32 ? 4 : t == DType::kF8E4M3 ? 1 : 2;
}
const char* dtype_name(DType t) noexcept;  // "fp16", "bf16", "fp32", "fp64", "fp8_e4m3"

/// A strided view of a rank-3 (seqlen, heads, head_dim) slab repeated over a batch.
/// Strides are in elements. The innermost (head_dim) stride is always 1.
///
/// flash-attn layout (batch, seqlen, heads, dim), contiguous:
///   batch_stride = seqlen*heads*dim, seq_stride = heads*dim, head_stride = dim.
/// PyTorch SDPA layout (batch, heads, seqlen, dim), contiguous:
///   batch_stride = heads*seqlen*dim, head_stride = seqlen*dim, seq_stride = dim.
/// Packed variable-length layout (total_tokens, heads, dim): batch_stride is ignored,
/// the sequence of batch b starts at token cu_seqlens[b].
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  std::int64_t batch_stride = 0;
  std::int64_t seq_stride = 0;
  std::int64_t head_stride = 0;
};

/// Fill the strides of a contiguous flash-attn layout (batch, seqlen, heads, dim).
inline TensorView bshd_view(void* data, DType dt, std::int64_t seqlen, std::int64_t heads,
                            std::int64_t dim) {
  return TensorView{data, dt, seqlen * heads * dim, heads * dim, dim};
}
/// Fill the strides of a contiguous SDPA layout (batch, heads, seqlen, dim).
inline TensorView bhsd_view(void* data, DType dt, std::int64_t seqlen, std::int64_t heads,
                            std::int64_t dim) {
  return TensorView{data, dt, heads * seqlen * dim, dim, seqlen * dim};
}

}  // namespace flashcpp
