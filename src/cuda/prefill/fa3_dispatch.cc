// sm_90a prefill: AttnParams -> TMA tensor maps + Fa3Params and the launch of a compiled config.
// Which config runs is the selector's choice (core/selector.cc); this file runs it.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>

#include "common/tile_order.h"
#include "core/selector.h"
#include "cuda/cuda_api.h"
#include "cuda/prefill/fa3_registry.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

std::span<const Fa3Entry> fa3_entries_hd64();
std::span<const Fa3Entry> fa3_entries_hd128();
std::span<const Fa3Entry> fa3_entries_hd192();
std::span<const Fa3Entry> fa3_entries_hd256();

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

/// Rank-4 map over (head_dim, seqlen, heads, batch) of a 16-bit tensor view, box (64, rows, 1, 1),
/// 128-byte swizzle. Rows past seqlen read as zeros (TMA out-of-bounds fill), and so do columns
/// past head_dim when the kernel's class is wider (a head dim of 96 in the 128 class: the second
/// panel's columns 96..127); a store through the map skips them.
///
/// Varlen (packed (total, heads, head_dim) with sequences at unknown device-side offsets): the
/// map is (head_dim, x, heads, e) with extents (head_dim, max_len, heads, batch * max_len + 1),
/// strides (seq, head, seq) and its origin max_len rows BEFORE the data. Coordinate (x, e)
/// addresses packed row x + e - max_len, so the kernel loads row r of the sequence that starts
/// at row `first` and has `len` rows with x = max_len - len + r, e = first + len; x < max_len
/// holds exactly for r < len, so TMA zero-fills the rows past this sequence's end (never another
/// sequence's rows), and e <= total <= batch * max_len stays in range. The shifted origin is
/// only an address the hardware adds offsets to; every row it reads lies inside the tensor.
Status encode_map(CUtensorMap* map, const TensorView& t, int seqlen, int heads, int batch, int head_dim, int box_rows,
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

}  // namespace

std::span<const Fa3Entry> fa3_entries(int head_dim, int head_dim_v) {
  switch (cuda_sm90_head_dim_class(head_dim, head_dim_v)) {  // a pair runs in its class, padded inside
    case 64: return fa3_entries_hd64();
    case 128: return fa3_entries_hd128();
    case kCudaSm90HeadDim192: return fa3_entries_hd192();
    case 256: return fa3_entries_hd256();
    default: return {};
  }
}

std::vector<std::string> prefill_sm90_configs(int head_dim, int head_dim_v) {
  std::vector<std::string> out;
  for (const auto& e : fa3_entries(head_dim, head_dim_v == 0 ? head_dim : head_dim_v))
    out.push_back(select::sm90_config_name(e.tile));
  return out;
}

Status prefill_sm90(const AttnParams& a, const TileConfig& tile, Stream stream) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
  if (dev.sm_major != 9) return Status::Unsupported("the sm90 prefill kernel needs an sm_90 (Hopper) device");
  const Fa3Entry* entry = nullptr;
  for (const auto& e : fa3_entries(a.head_dim, a.effective_head_dim_v()))
    if (e.tile == tile) entry = &e;
  const std::string name = select::sm90_config_name(tile);
  if (entry == nullptr)
    return Status::Invalid("no sm90 prefill config '" + name + "' for head_dim " + std::to_string(a.head_dim));
  if (a.mask.block_sparse != nullptr &&
      (tile.ping_pong || !select::tiles_fit_block_sparse(*a.mask.block_sparse, tile.block_m, tile.block_n)))
    return Status::Unsupported("sm90 config " + name + " cannot walk these block-sparse blocks (select_kernel says why)");
  const bool varlen = a.mask.is_varlen();
  Fa3Params p{};
  FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_q, a.q, a.seqlen_q, a.heads_q, a.batch, a.head_dim, tile.block_m, varlen));
  if (a.seqlen_k > 0) {  // no keys: every row is empty, K/V are never loaded (and may be null)
    FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_k, a.k, a.seqlen_k, a.heads_kv, a.batch, a.head_dim, tile.block_n, varlen));
    FLASHCPP_RETURN_IF_ERROR(
        encode_map(&p.tmap_v, a.v, a.seqlen_k, a.heads_kv, a.batch, a.effective_head_dim_v(), tile.block_n, varlen));
  }
  fill_prefill_common(p, a);
  if (tile.persistent) {
    // TMA-store epilogue: a map over o with one consumer warpgroup's 64 rows per box.
    FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_o, a.o, a.seqlen_q, a.heads_q, a.batch, a.effective_head_dim_v(), 64, varlen));
    const std::int64_t m_blocks = (a.seqlen_q + tile.block_m - 1) / tile.block_m;
    const std::int64_t tiles = m_blocks * a.heads_q * a.batch;
    if (tiles > INT32_MAX)
      return Status::Unsupported("the persistent sm90 config walks at most 2^31-1 tiles; this problem has " +
                                 std::to_string(tiles) + " (use a non-persistent config)");
    p.m_blocks = static_cast<int>(m_blocks);
    p.n_units = persistent_units(p.m_blocks, a.heads_q, a.batch);
    // (head, batch) pairs per L2 group: their K/V within ~24 MB, half the H100/H200 L2.
    p.tile_heads = persistent_tile_heads(a.seqlen_k, a.head_dim, a.heads_q, a.heads_kv, a.batch);
  }
  const Fa3RunFn fn = a.q.dtype == DType::kBF16 ? entry->run_bf16 : entry->run_fp16;
  return fn(p, stream, dev.device);
}

Status prefill_sm90(const AttnParams& a, const std::string& config, Stream stream) {
  if (config.empty()) {  // the selector's automatic sm90 choice
    DeviceInfo dev;
    FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
    RunOptions opt;
    opt.cuda_config = "sm90";
    KernelChoice kc;
    FLASHCPP_RETURN_IF_ERROR(select::cuda_prefill(a, opt, dev, &kc));
    return prefill_sm90(a, kc.tile, stream);
  }
  for (const auto& e : fa3_entries(a.head_dim, a.effective_head_dim_v()))
    if (select::sm90_config_name(e.tile) == config) return prefill_sm90(a, e.tile, stream);
  return Status::Invalid("no sm90 prefill config '" + config + "' for head_dim " + std::to_string(a.head_dim));
}

}  // namespace flashcpp::cuda
