// TMA tensor maps (tma_map.h): cuTensorMapEncodeTiled through the runtime's driver entry point.
#include "cuda/common/tma_map.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <string>

namespace flashcpp::cuda {

namespace {

/// cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link needed).
Status get_encode_fn(PFN_cuTensorMapEncodeTiled_v12000* out) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  static cudaError_t err = cudaSuccess;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
    if (err == cudaSuccess && q == cudaDriverEntryPointSuccess) fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  if (fn == nullptr) return Status::Cuda(std::string("cuTensorMapEncodeTiled is unavailable: ") + cudaGetErrorString(err));
  *out = fn;
  return Status::Ok();
}

}  // namespace

Status encode_tma_map(CUtensorMap* map, const TensorView& t, int seqlen, int heads, int batch, int head_dim, int box_rows,
                      bool varlen) {
  PFN_cuTensorMapEncodeTiled_v12000 encode;
  FLASHCPP_RETURN_IF_ERROR(get_encode_fn(&encode));
  const CUtensorMapDataType dt = t.dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  // A stride of an extent-1 dimension is never used; TMA still wants a multiple of 16 bytes.
  auto stride = [](std::int64_t s_elems, std::int64_t extent, std::int64_t fallback) -> cuuint64_t {
    const std::int64_t bytes = s_elems * 2;
    return static_cast<cuuint64_t>(extent == 1 || bytes <= 0 ? fallback : bytes);
  };
  const std::int64_t row_bytes = static_cast<std::int64_t>(head_dim) * 2;
  void* origin = t.data;
  std::int64_t outer_extent = batch, outer_stride = t.batch_stride;
  if (varlen) {
    origin = static_cast<char*>(t.data) - static_cast<std::int64_t>(seqlen) * t.seq_stride * 2;
    // Coordinates are int32; a larger extent would only allow coordinates the kernel never uses.
    outer_extent = std::min<std::int64_t>(static_cast<std::int64_t>(batch) * seqlen + 1, INT32_MAX);
    outer_stride = t.seq_stride;
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(outer_extent)};
  const cuuint64_t strides[3] = {stride(t.seq_stride, seqlen, row_bytes), stride(t.head_stride, heads, row_bytes),
                                 stride(outer_stride, outer_extent, row_bytes)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, dt, 4, origin, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status::Cuda("cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r) +
                        (varlen ? " (varlen map with a shifted origin)" : ""));
  return Status::Ok();
}


Status encode_f32_rows_map(CUtensorMap* map, float* data, int cols, std::int64_t rows, int heads, int box_cols,
                           int box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode;
  FLASHCPP_RETURN_IF_ERROR(get_encode_fn(&encode));
  if (rows > INT32_MAX) return Status::Unsupported("a TMA map addresses at most 2^31-1 rows per head");
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(heads)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 4, static_cast<cuuint64_t>(cols) * 4 * rows};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, data, dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return Status::Cuda("cuTensorMapEncodeTiled (fp32 rows) failed with CUresult " + std::to_string(r));
  return Status::Ok();
}

}  // namespace flashcpp::cuda
