// sm80 prefill: AttnParams -> Fa2Params, the config registry and the tuned config choice.
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>

#include "cuda/cuda_api.h"
#include "cuda/prefill/fa2_registry.h"
#include "cuda/prefill/fa2_tuning.h"
#include "cuda/prefill/prefill_common.h"
#include "cuda/prefill/prefill_select.h"

namespace flashcpp::cuda {

std::string fa2_config_name(const Fa2Entry& e) {
  // Appends, not a chain of operator+ (GCC 12 warns falsely about -Wrestrict on the chain).
  std::string s = "m";
  s += std::to_string(e.block_m);
  s += 'n';
  s += std::to_string(e.block_n);
  s += 'w';
  s += std::to_string(e.warps);
  s += 's';
  s += std::to_string(e.stages);
  s += e.q_in_regs ? 'r' : 'q';
  if (e.min_blocks > 1) {
    s += 'b';
    s += std::to_string(e.min_blocks);
  }
  return s;
}

std::span<const Fa2Entry> fa2_entries(int head_dim) {
  switch (head_dim) {
    case 64: return fa2_entries_hd64();
    case 128: return fa2_entries_hd128();
    case 256: return fa2_entries_hd256();
    default: return {};
  }
}

std::vector<std::string> prefill_sm80_configs(int head_dim) {
  std::vector<std::string> out;
  for (const auto& e : fa2_entries(head_dim)) out.push_back(fa2_config_name(e));
  return out;
}

namespace {
/// Whether a config can run the problem's block-sparse mask (always true without one).
bool fa2_fits(const Fa2Entry& e, const AttnParams& p) {
  return p.mask.block_sparse == nullptr || tiles_fit_block_sparse(*p.mask.block_sparse, e.block_m, e.block_n);
}
}  // namespace

std::string prefill_sm80_pick(const AttnParams& p, const DeviceInfo& dev) {
  const auto entries = fa2_entries(p.head_dim);
  const std::string tuned = tuned_config(dev, p.head_dim, p.mask.causal, p.q.dtype, std::max(p.seqlen_q, p.seqlen_k));
  auto usable = [&](const Fa2Entry& e) {
    return static_cast<std::size_t>(e.smem_bytes) <= dev.smem_optin && fa2_fits(e, p);
  };
  for (const auto& e : entries)
    if (fa2_config_name(e) == tuned && usable(e)) return tuned;
  for (const auto& e : entries)  // no table row (or it cannot run the mask): the first listed config that can
    if (usable(e)) return fa2_config_name(e);
  return {};
}

std::string prefill_sm80_misfit(const AttnParams& p, const std::string& config) {
  for (const auto& e : fa2_entries(p.head_dim))
    if (fa2_config_name(e) == config) {
      if (fa2_fits(e, p)) return {};
      return "sm80 config " + config + " has " + std::to_string(e.block_m) + "x" + std::to_string(e.block_n) +
             " tiles, which do not divide the " + std::to_string(p.mask.block_sparse->block_m) + "x" +
             std::to_string(p.mask.block_sparse->block_n) + " block-sparse blocks";
    }
  return "no sm80 prefill config '" + config + "' for head_dim " + std::to_string(p.head_dim);
}

std::string prefill_sm80_tiles(int head_dim) {
  std::string out;
  for (const auto& e : fa2_entries(head_dim)) {
    const std::string t = std::to_string(e.block_m) + "x" + std::to_string(e.block_n);
    if (out.find(t) == std::string::npos) out += (out.empty() ? "" : ", ") + t;
  }
  return out;
}

Status prefill_sm80(const AttnParams& a, const std::string& config, Stream stream) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
  const Fa2Entry* entry = nullptr;
  for (const auto& e : fa2_entries(a.head_dim))
    if (fa2_config_name(e) == config) entry = &e;
  if (entry == nullptr)
    return Status::Invalid("no sm80 prefill config '" + config + "' for head_dim " + std::to_string(a.head_dim));
  if (!fa2_fits(*entry, a)) return Status::Unsupported(prefill_sm80_misfit(a, config));
  if (static_cast<std::size_t>(entry->smem_bytes) > dev.smem_optin)
    return Status::Unsupported("config " + config + " needs " + std::to_string(entry->smem_bytes) +
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

}  // namespace flashcpp::cuda
