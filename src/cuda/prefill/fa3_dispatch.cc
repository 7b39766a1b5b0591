// sm_90a prefill: AttnParams -> TMA tensor maps + Fa3Params, and the config registry.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>

#include "common/tile_order.h"
#include "cuda/cuda_api.h"
#include "cuda/prefill/fa3_registry.h"
#include "cuda/prefill/prefill_common.h"
#include "cuda/prefill/prefill_select.h"

namespace flashcpp::cuda {

std::span<const Fa3Entry> fa3_entries_hd64();
std::span<const Fa3Entry> fa3_entries_hd128();
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
/// 128-byte swizzle. Rows past seqlen read as zeros (TMA out-of-bounds fill).
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

std::string fa3_config_name(const Fa3Entry& e) {
  return "sm90_m" + std::to_string(e.block_m) + "n" + std::to_string(e.block_n) + "s" + std::to_string(e.stages) +
         (e.ping_pong ? (e.sched ? "p" : "o") : "") + (e.persistent ? "_persist" : "");
}

std::span<const Fa3Entry> fa3_entries(int head_dim) {
  switch (head_dim) {
    case 64: return fa3_entries_hd64();
    case 128: return fa3_entries_hd128();
    case 256: return fa3_entries_hd256();
    default: return {};
  }
}

namespace {
/// Same tiles and stages (twins differ in consumers or persistence only).
bool same_tiles(const Fa3Entry& x, const Fa3Entry& y) {
  return x.block_m == y.block_m && x.block_n == y.block_n && x.stages == y.stages;
}

/// Whether a config can run the problem's block-sparse mask (always true without one). The
/// ping-pong consumers do not read element bits (no registers left for it; fa3_kernel.cuh).
bool fa3_fits(const Fa3Entry& e, const AttnParams& a) {
  return a.mask.block_sparse == nullptr ||
         (!e.ping_pong && tiles_fit_block_sparse(*a.mask.block_sparse, e.block_m, e.block_n));
}

/// Whether a config's tile suits the problem: tiles of 128 rows always do; d64's 192-row tile
/// (three consumer warpgroups) where its per-row gain beats its coarser waves
/// (common/tile_order.h, wide_tile_pays, with the measurements), under any mask it runs
/// (MasksGpuWideTile; block-sparse masks are fa3_fits' call). Its own persistent twin lost
/// everywhere (spills at 160 registers) and is not built.
bool suits(const Fa3Entry& e, const AttnParams& a, int num_sms) {
  if (e.block_m <= 128) return true;
  return wide_tile_pays(a.seqlen_q, static_cast<std::int64_t>(a.heads_q) * a.batch, a.mask.causal, e.block_m, num_sms);
}

/// Whether the automatic choice is the persistent twin of `base`: causal problems of dense
/// (or window / sink) masks, without varlen or block-sparse walks, whose work units (two row
/// blocks of equal causal cost) fill their last wave of CTAs at least 3/4 full
/// (common/tile_order.h, persistent_units_fill_waves, with the measurements). Non-causal
/// problems keep the default (the twin measured 0.93-1.00x there).
bool prefer_persistent(const AttnParams& a, const Fa3Entry& base, int num_sms) {
  if (!a.mask.causal || a.mask.is_varlen() || a.mask.block_sparse != nullptr) return false;
  const int m_blocks = (a.seqlen_q + base.block_m - 1) / base.block_m;
  if (static_cast<std::int64_t>(m_blocks) * a.heads_q * a.batch > INT32_MAX) return false;  // units fit an int
  return persistent_units_fill_waves(persistent_units(m_blocks, a.heads_q, a.batch), num_sms);
}

/// The automatic choice: the first config (table order) that fits and suits the problem, or its
/// persistent twin (same tiles, stages and consumers) when prefer_persistent says so.
const Fa3Entry* fa3_auto(const AttnParams& a, int num_sms) {
  const Fa3Entry* base = nullptr;
  for (const auto& e : fa3_entries(a.head_dim))
    if (!e.persistent && fa3_fits(e, a) && suits(e, a, num_sms)) {
      base = &e;
      break;
    }
  if (base == nullptr || !prefer_persistent(a, *base, num_sms)) return base;
  for (const auto& e : fa3_entries(a.head_dim))
    if (e.persistent && same_tiles(e, *base) && e.ping_pong == base->ping_pong && e.sched == base->sched) return &e;
  return base;
}
}  // namespace

std::string prefill_sm90_pick(const AttnParams& a, int num_sms) {
  const Fa3Entry* e = fa3_auto(a, num_sms);
  return e != nullptr ? fa3_config_name(*e) : std::string{};
}

std::string prefill_sm90_misfit(const AttnParams& a, const std::string& config) {
  for (const auto& e : fa3_entries(a.head_dim))
    if (fa3_config_name(e) == config) {
      if (fa3_fits(e, a)) return {};
      if (e.ping_pong) {
        std::string twin;  // same tiles, stages and scheduling with plain consumers, if compiled
        for (const auto& t : fa3_entries(a.head_dim))
          if (!t.ping_pong && same_tiles(t, e) && t.persistent == e.persistent) twin = fa3_config_name(t);
        return "sm90 config " + config + " (pipelined consumers) does not run block-sparse masks; " +
               (twin.empty() ? std::string("leave cuda_config empty and dispatch picks a config that does")
                             : "its plain twin " + twin + " does");
      }
      return "sm90 config " + config + " has " + std::to_string(e.block_m) + "x" + std::to_string(e.block_n) +
             " tiles, which do not divide the " + std::to_string(a.mask.block_sparse->block_m) + "x" +
             std::to_string(a.mask.block_sparse->block_n) + " block-sparse blocks";
    }
  return "no sm90 prefill config '" + config + "' for head_dim " + std::to_string(a.head_dim);
}

std::string prefill_sm90_tiles(int head_dim) {
  std::string out;
  for (const auto& e : fa3_entries(head_dim)) {
    const std::string t = std::to_string(e.block_m) + "x" + std::to_string(e.block_n);
    if (out.find(t) == std::string::npos) out += (out.empty() ? "" : ", ") + t;
  }
  return out;
}

std::vector<std::string> prefill_sm90_configs(int head_dim) {
  std::vector<std::string> out;
  for (const auto& e : fa3_entries(head_dim)) out.push_back(fa3_config_name(e));
  return out;
}

Status prefill_sm90(const AttnParams& a, const std::string& config, Stream stream) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
  if (dev.sm_major != 9) return Status::Unsupported("the sm90 prefill kernel needs an sm_90 (Hopper) device");
  const Fa3Entry* entry = nullptr;
  if (config.empty())
    entry = fa3_auto(a, dev.num_sms);
  else
    for (const auto& e : fa3_entries(a.head_dim))
      if (fa3_config_name(e) == config) {
        entry = &e;
        break;
      }
  if (entry == nullptr)
    return Status::Invalid(config.empty() ? "no sm90 prefill config for head_dim " + std::to_string(a.head_dim) +
                                                " has tiles that divide the block-sparse blocks"
                                          : "no sm90 prefill config '" + config + "' for head_dim " +
                                                std::to_string(a.head_dim));
  if (!fa3_fits(*entry, a)) return Status::Unsupported(prefill_sm90_misfit(a, config));
  const bool varlen = a.mask.is_varlen();
  Fa3Params p{};
  FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_q, a.q, a.seqlen_q, a.heads_q, a.batch, a.head_dim, entry->block_m, varlen));
  if (a.seqlen_k > 0) {  // no keys: every row is empty, K/V are never loaded (and may be null)
    FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_k, a.k, a.seqlen_k, a.heads_kv, a.batch, a.head_dim, entry->block_n, varlen));
    FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_v, a.v, a.seqlen_k, a.heads_kv, a.batch, a.head_dim, entry->block_n, varlen));
  }
  fill_prefill_common(p, a);
  if (entry->persistent) {
    // TMA-store epilogue: a map over o with one consumer warpgroup's 64 rows per box.
    FLASHCPP_RETURN_IF_ERROR(encode_map(&p.tmap_o, a.o, a.seqlen_q, a.heads_q, a.batch, a.head_dim, 64, varlen));
    const std::int64_t m_blocks = (a.seqlen_q + entry->block_m - 1) / entry->block_m;
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

}  // namespace flashcpp::cuda
