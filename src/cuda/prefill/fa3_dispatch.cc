// sm_90a prefill: AttnParams -> TMA tensor maps + Fa3Params and the launch of a compiled config.
// Which config runs is the selector's choice (core/selector.cc); this file runs it.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <string>

#include "common/tile_order.h"
#include "core/selector.h"
#include "cuda/common/tma_map.h"
#include "cuda/cuda_api.h"
#include "cuda/prefill/fa3_registry.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

std::span<const Fa3Entry> fa3_entries_hd64();
std::span<const Fa3Entry> fa3_entries_hd128();
std::span<const Fa3Entry> fa3_entries_hd192();
std::span<const Fa3Entry> fa3_entries_hd256();

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
  if (entry == nullptr)
    return Status::Invalid("no sm90 prefill config '" + select::sm90_config_name(tile) + "' for head_dim " +
                           std::to_string(a.head_dim));
  if (a.mask.block_sparse != nullptr &&
      (tile.ping_pong || !select::tiles_fit_block_sparse(*a.mask.block_sparse, tile.block_m, tile.block_n)))
    return Status::Unsupported("sm90 config " + select::sm90_config_name(tile) +
                               " cannot walk these block-sparse blocks (select_kernel says why)");
  const bool varlen = a.mask.is_varlen();
  Fa3Params p{};
  FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_q, a.q, a.seqlen_q, a.heads_q, a.batch, a.head_dim, tile.block_m, varlen));
  if (a.seqlen_k > 0) {  // no keys: every row is empty, K/V are never loaded (and may be null)
    FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_k, a.k, a.seqlen_k, a.heads_kv, a.batch, a.head_dim, tile.block_n, varlen));
    FLASHCPP_RETURN_IF_ERROR(
        encode_tma_map(&p.tmap_v, a.v, a.seqlen_k, a.heads_kv, a.batch, a.effective_head_dim_v(), tile.block_n, varlen));
  }
  fill_prefill_common(p, a);
  if (tile.persistent) {
    // TMA-store epilogue: a map over o with one consumer warpgroup's 64 rows per box.
    FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_o, a.o, a.seqlen_q, a.heads_q, a.batch, a.effective_head_dim_v(), 64, varlen));
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
    KernelChoice kc;  // the tile alone runs: no name or reason (explain off)
    FLASHCPP_RETURN_IF_ERROR(select::cuda_prefill(a, opt, dev, &kc, false));
    return prefill_sm90(a, kc.tile, stream);
  }
  for (const auto& e : fa3_entries(a.head_dim, a.effective_head_dim_v()))
    if (select::sm90_config_name(e.tile) == config) return prefill_sm90(a, e.tile, stream);
  return Status::Invalid("no sm90 prefill config '" + config + "' for head_dim " + std::to_string(a.head_dim));
}

}  // namespace flashcpp::cuda
