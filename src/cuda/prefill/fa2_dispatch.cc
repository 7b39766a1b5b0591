// sm80 prefill: AttnParams -> Fa2Params and the launch of a compiled config. Which config runs is
// the selector's choice (core/selector.cc); this file runs it.
#include <cuda_runtime_api.h>

#include <string>

#include "core/selector.h"
#include "cuda/cuda_api.h"
#include "cuda/prefill/fa2_registry.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

std::span<const Fa2Entry> fa2_entries(int head_dim) {
  switch (cuda_head_dim_class(head_dim, head_dim)) {  // a head dim runs in its class, padded inside
    case 64: return fa2_entries_hd64();
    case 128: return fa2_entries_hd128();
    case 256: return fa2_entries_hd256();
    default: return {};
  }
}

std::vector<std::string> prefill_sm80_configs(int head_dim) {
  std::vector<std::string> out;
  for (const auto& e : fa2_entries(head_dim)) out.push_back(select::sm80_config_name(e.tile));
  return out;
}

Status prefill_sm80(const AttnParams& a, const TileConfig& tile, Stream stream) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
  const Fa2Entry* entry = nullptr;
  for (const auto& e : fa2_entries(a.head_dim_class()))
    if (e.tile == tile) entry = &e;
  const std::string name = select::sm80_config_name(tile);
  if (entry == nullptr)
    return Status::Invalid("no sm80 prefill config '" + name + "' for head_dim " + std::to_string(a.head_dim));
  if (a.mask.block_sparse != nullptr && !select::tiles_fit_block_sparse(*a.mask.block_sparse, tile.block_m, tile.block_n))
    return Status::Unsupported("sm80 config " + name + " has " + std::to_string(tile.block_m) + "x" +
                               std::to_string(tile.block_n) + " tiles, which do not divide the block-sparse blocks");
  if (static_cast<std::size_t>(entry->smem_bytes) > dev.smem_optin)
    return Status::Unsupported("config " + name + " needs " + std::to_string(entry->smem_bytes) +
                               " bytes of shared memory; " + dev.name + " allows " + std::to_string(dev.smem_optin));
  Fa2Params p{};
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.q_batch_stride = a.q.batch_stride;
  p.k_batch_stride = a.k.batch_stride;
  p.v_batch_stride = a.v.batch_stride;
  p.q_seq_stride = static_cast<std::int32_t>(a.q.seq_stride);
  p.k_seq_stride = static_cast<std::int32_t>(a.k.seq_stride);
  p.v_seq_stride = static_cast<std::int32_t>(a.v.seq_stride);
  p.q_head_stride = static_cast<std::int32_t>(a.q.head_stride);
  p.k_head_stride = static_cast<std::int32_t>(a.k.head_stride);
  p.v_head_stride = static_cast<std::int32_t>(a.v.head_stride);
  fill_prefill_common(p, a);
  const Fa2RunFn fn = a.q.dtype == DType::kBF16 ? entry->run_bf16 : entry->run_fp16;
  return fn(p, stream, dev.device);
}

Status prefill_sm80(const AttnParams& a, const std::string& config, Stream stream) {
  std::string name = config;
  if (name.empty()) {
    DeviceInfo dev;
    FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
    name = prefill_sm80_pick(a, dev);
  }
  for (const auto& e : fa2_entries(a.head_dim_class()))
    if (select::sm80_config_name(e.tile) == name) return prefill_sm80(a, e.tile, stream);
  return Status::Invalid("no sm80 prefill config '" + name + "' for head_dim " + std::to_string(a.head_dim));
}

}  // namespace flashcpp::cuda
