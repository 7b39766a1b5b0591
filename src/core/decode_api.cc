// Decode plan/run: the split heuristic, the work list, and the public entry points that route a
// step to the CPU or the CUDA backend. Host code shared by both backends, built with or without
// CUDA; it is the one dispatch point of decode, as src/core/dispatch.cc is for attention_forward.
//
// The split heuristic (docs/decode.md has the reasoning and examples):
//   units    = heads_kv * row_blocks          CTAs one split of one sequence occupies
//   target   = num_sms * ctas_per_sm(D)       one full wave (ctas_per_sm from the tile config)
//   tiles_b  = 64-key tiles of the keys some query row of sequence b can see (window-aware)
//   if batch * units >= target: no split (the batch alone fills the GPU; merging would only add
//     traffic)
//   else: base = max(min_tiles, ceil(sum_b tiles_b * units / target)) tiles per split; chunk =
//     the candidate >= base (base, or where the longest sequence's count changes) of least
//     waves x longest split (wave_aware_chunk), and n_b = clamp(ceil(tiles_b / chunk), 1, max_splits)
//   min_tiles = ceil(max(256, 16 * rows) / 64): a split reads at least 256 keys, and at least 16
//     keys per query row it serves, so the partials it writes and the merge reads (8 bytes per
//     row and dim) stay under 1/8 of the K/V bytes it reads (4 bytes per key and dim).
//   small problems (ceil(sum_b tiles_b * units / target) < min_tiles: 256-key splits cannot fill
//     a wave) are latency-bound: base = min(base, max(ceil(16 * rows / 64), ceil(sum_b tiles_b *
//     units / budget))), budget = 5/8 of num_sms CTAs; more splits than above, never fewer.
// Splits are proportional to each sequence's length, so a ragged batch gives every CTA about the
// same number of tiles. A forced count (DecodePlanOptions::num_splits) gives every sequence that
// count, even beyond its tile count (the extra splits are empty and merge as LSE = -inf).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/decode_backends.h"
#include "common/decode_common.h"
#include "flashcpp/decode.h"
#if FLASHCPP_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace flashcpp {
namespace {
constexpr int kCpuPlanSms = 132;  // the CPU backend plans as for an H200, so it walks the GPU's splits
constexpr int kMinSplitKeys = 256;
constexpr int kMinKeysPerRow = 16;
/// A problem too small to fill a wave with kMinSplitKeys-key splits is latency-bound: it splits
/// further, down to one tile per split, up to a budget of 5/8 of the SM count in CTAs (82 on an
/// H200; the engine's short contexts measured best at 72-80 CTAs and worse at 128+, docs/decode.md).
constexpr int kSmallPlanBudgetEighths = 5;
constexpr std::size_t kWorkspaceAlign = 16;
}  // namespace

namespace decode {
namespace {

std::int32_t split_count(std::int64_t tiles, std::int64_t chunk, int cap) {
  return static_cast<std::int32_t>(std::clamp<std::int64_t>((tiles + chunk - 1) / chunk, 1, cap));
}

/// The chunk (tiles per split) to plan with, >= base. Splitting at `base` fills one wave when the
/// splits divide evenly, but each n_b rounds up, and a few extra CTAs past the wave cost a whole
/// second wave: B=16, 8 KV heads, 8192 keys gets base 63 -> 3 splits -> 384 CTAs (1.45 waves,
/// 175 us on the H200) where 2 splits -> 256 CTAs take 137 us. So the candidates are base and
/// every chunk at which the longest sequence's split count changes; the cost of one is
/// waves x (tiles of the longest split), and a larger chunk (fewer splits, less merge traffic)
/// wins ties.
std::int64_t wave_aware_chunk(const std::vector<std::int64_t>& tiles, std::int64_t units, std::int64_t target,
                              std::int64_t base, int cap) {
  const std::int64_t max_tiles = *std::max_element(tiles.begin(), tiles.end());
  auto cost = [&](std::int64_t chunk) {
    std::int64_t items = 0, longest = 0;
    for (const std::int64_t t : tiles) {
      const std::int64_t n = split_count(t, chunk, cap);
      items += n;
      longest = std::max(longest, (t + n - 1) / n);
    }
    return ((items * units + target - 1) / target) * longest;
  };
  std::int64_t best = base, best_cost = cost(base);
  for (int n = cap; n >= 1; --n) {  // chunks in increasing order
    const std::int64_t chunk = (max_tiles + n - 1) / n;
    if (chunk <= base) continue;
    const std::int64_t c = cost(chunk);
    if (c <= best_cost) best = chunk, best_cost = c;
  }
  return best;
}

}  // namespace

Status plan_splits(const DecodeParams& p, const std::int32_t* lengths, int forced, int max_splits, int num_sms,
                   SplitDecision* out) {
  *out = SplitDecision{};
  out->splits.assign(static_cast<std::size_t>(p.batch), 1);
  if (p.batch == 0) return Status::Ok();
  const RowLayout rl = row_layout(p.heads_q, p.heads_kv, p.seqlen_q);
  const std::int64_t units = static_cast<std::int64_t>(p.heads_kv) * rl.row_blocks;
  const bool append = p.has_append();
  const int slots = static_cast<int>(p.cache.slots());
  const int wl = clamp_window(p.mask.window_left, slots), wr = clamp_window(p.mask.window_right, slots);
  const int cap = max_splits > 0 ? std::min(max_splits, kDecodeMaxSplits) : kDecodeMaxSplits;

  std::vector<std::int64_t> tiles(static_cast<std::size_t>(p.batch));
  std::int64_t total_tiles = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int raw = lengths ? lengths[b] : slots - (append ? p.seqlen_q : 0);
    const int len = total_len(raw, slots, p.seqlen_q, append);
    const MaskRules rules = sequence_rules(p.seqlen_q, len, p.mask.causal, wl, wr);
    int lo = 0, hi = 0;
    rules.key_range(0, p.seqlen_q, &lo, &hi);
    const int t0 = lo / kDecodeBlockN;
    tiles[b] = hi > lo ? (hi + kDecodeBlockN - 1) / kDecodeBlockN - t0 : 0;
    total_tiles += tiles[b] * units;
  }
  if (forced > 0) {
    std::fill(out->splits.begin(), out->splits.end(), forced);
  } else {
    const std::int64_t target = static_cast<std::int64_t>(std::max(num_sms, 1)) * ctas_per_sm(p.head_dim);
    if (static_cast<std::int64_t>(p.batch) * units < target) {
      // >= 16 keys per row it serves, and >= kMinSplitKeys keys unless the problem is small (below)
      const std::int64_t row_tiles = (kMinKeysPerRow * rl.rows + kDecodeBlockN - 1) / kDecodeBlockN;
      static_assert(kMinSplitKeys % kDecodeBlockN == 0, "the key floor is whole tiles");
      const std::int64_t min_tiles = std::max<std::int64_t>(kMinSplitKeys / kDecodeBlockN, row_tiles);
      const std::int64_t fill = (total_tiles + target - 1) / target;  // tiles per CTA for one full wave
      std::int64_t base = std::max(min_tiles, fill);
      if (fill < min_tiles) {  // small: more splits (never fewer), up to the CTA budget
        const std::int64_t budget = std::max<std::int64_t>(1, std::max(num_sms, 1) * kSmallPlanBudgetEighths / 8);
        base = std::min(base, std::max<std::int64_t>({1, row_tiles, (total_tiles + budget - 1) / budget}));
      }
      const std::int64_t chunk = wave_aware_chunk(tiles, units, target, base, cap);
      for (int b = 0; b < p.batch; ++b)
        out->splits[b] = split_count(tiles[b], chunk, cap);
    }
  }
  std::int64_t items = 0;
  for (int b = 0; b < p.batch; ++b) {
    items += out->splits[b];
    out->max_splits = std::max<int>(out->max_splits, out->splits[b]);
  }
  if (items * units > std::numeric_limits<std::int32_t>::max())
    return Status::Unsupported("the plan needs " + std::to_string(items) + " work items x " + std::to_string(units) +
                               " CTAs each, more than a grid holds (2^31 - 1); lower num_splits or the batch");
  out->num_items = static_cast<int>(items);
  out->needs_merge = out->max_splits > 1;
  return Status::Ok();
}

}  // namespace decode

namespace {

using decode::RowLayout;
using decode::SplitDecision;

bool on_device(const void* ptr) {
#if FLASHCPP_WITH_CUDA
  return ptr != nullptr && cuda::is_device_pointer(ptr);
#else
  (void)ptr;
  return false;
#endif
}

/// kAuto becomes kCuda when the data (or, at plan time, the workspace) is device memory.
Backend resolve(Backend b, const void* data, const void* fallback) {
  if (b != Backend::kAuto) return b;
  return on_device(data ? data : fallback) ? Backend::kCuda : Backend::kCpu;
}

Status check_backend_built(Backend b) {
#if !FLASHCPP_WITH_CUDA
  if (b == Backend::kCuda)
    return Status::Unsupported("this build of flashcpp has no CUDA kernels (configure with -DFLASHCPP_CUDA=ON)");
#endif
  (void)b;
  return Status::Ok();
}

struct PlanSizes {
  SplitDecision split;
  RowLayout rows;
  std::size_t int_bytes = 0, float_bytes = 0;
  int num_sms = 0;
  bool fused_merge = false;  ///< CUDA plan with splits and DecodePlanOptions::fused_merge
  bool fused_append = false; ///< CUDA plan of an appending step and DecodePlanOptions::fused_append
};

Status plan_sizes(const DecodeParams& p, const DecodePlanOptions& opt, Backend backend, PlanSizes* out) {
  FLASHCPP_RETURN_IF_ERROR(check_backend_built(backend));
  FLASHCPP_RETURN_IF_ERROR(decode::validate_decode_shape(p, backend));
  if (opt.num_splits < 0 || opt.num_splits > kDecodeMaxSplits)
    return Status::Invalid("num_splits " + std::to_string(opt.num_splits) + " is outside [0, " +
                           std::to_string(kDecodeMaxSplits) + "] (0 = heuristic)");
  if (opt.max_splits < 0)
    return Status::Invalid("max_splits " + std::to_string(opt.max_splits) + " is negative (0 = " +
                           std::to_string(kDecodeMaxSplits) + ")");
  if (opt.num_sms < 0) return Status::Invalid("num_sms " + std::to_string(opt.num_sms) + " is negative (0 = the device's)");
  out->num_sms = opt.num_sms;
  if (out->num_sms == 0) {
    out->num_sms = kCpuPlanSms;
#if FLASHCPP_WITH_CUDA
    if (backend == Backend::kCuda) FLASHCPP_RETURN_IF_ERROR(cuda::decode_num_sms(&out->num_sms));
#endif
  }
  FLASHCPP_RETURN_IF_ERROR(
      decode::plan_splits(p, opt.host_cache_seqlens, opt.num_splits, opt.max_splits, out->num_sms, &out->split));
  out->rows = decode::row_layout(p.heads_q, p.heads_kv, p.seqlen_q);
  out->fused_merge = opt.fused_merge && backend == Backend::kCuda && out->split.needs_merge;
  out->fused_append = opt.fused_append && backend == Backend::kCuda && p.has_append();
  out->int_bytes = (decode::worklist_int_count(p.batch, out->split.num_items) +
                    (out->fused_merge ? decode::merge_counter_count(p.batch, p.heads_kv, out->rows.row_blocks) : 0)) *
                   sizeof(std::int32_t);
  out->float_bytes = out->split.needs_merge ? decode::partial_float_bytes(out->split.num_items, p.heads_kv,
                                                                          out->rows.rows, p.head_dim)
                                            : 0;
  return Status::Ok();
}

Status check_workspace(const char* which, const void* ptr, std::size_t have, std::size_t need) {
  if (need == 0) return Status::Ok();
  if (ptr == nullptr)
    return Status::Invalid(std::string(which) + " workspace is null; this plan needs " + std::to_string(need) +
                           " bytes (see decode_workspace_size)");
  if (reinterpret_cast<std::uintptr_t>(ptr) % kWorkspaceAlign != 0)
    return Status::Invalid(std::string(which) + " workspace is not 16-byte aligned");
  if (have < need)
    return Status::Invalid(std::string(which) + " workspace has " + std::to_string(have) + " bytes; this plan needs " +
                           std::to_string(need) + " (see decode_workspace_size)");
  return Status::Ok();
}

std::string mismatch(const char* field, long long got, long long planned) {
  return std::string("decode_run: ") + field + " " + std::to_string(got) + " differs from the plan's " +
         std::to_string(planned) + " (run decode_plan again for this shape)";
}

}  // namespace

Status decode_workspace_size(const DecodeParams& p, const DecodePlanOptions& opt, DecodeWorkspaceSize* out) {
  *out = DecodeWorkspaceSize{};
  PlanSizes s;
  FLASHCPP_RETURN_IF_ERROR(plan_sizes(p, opt, resolve(opt.backend, p.q.data, nullptr), &s));
  out->int_bytes = s.int_bytes;
  out->float_bytes = s.float_bytes;
  return Status::Ok();
}

Status decode_plan(const DecodeParams& p, const DecodePlanOptions& opt, void* int_workspace, std::size_t int_bytes,
                   void* float_workspace, std::size_t float_bytes, DecodePlan* plan) {
  *plan = DecodePlan{};
  const Backend backend = resolve(opt.backend, p.q.data, int_workspace);
  PlanSizes s;
  FLASHCPP_RETURN_IF_ERROR(plan_sizes(p, opt, backend, &s));
  FLASHCPP_RETURN_IF_ERROR(check_workspace("int", int_workspace, int_bytes, s.int_bytes));
  FLASHCPP_RETURN_IF_ERROR(check_workspace("float", float_workspace, float_bytes, s.float_bytes));

  // The work list: per-sequence (first item, split count), then per-item (sequence, split); then
  // the fused merge's arrival counters, zero.
  const int items = s.split.num_items;
  std::vector<std::int32_t> host(s.int_bytes / sizeof(std::int32_t), 0);
  std::int32_t next = 0;
  for (int b = 0; b < p.batch; ++b) {
    host[b] = next;
    host[p.batch + b] = s.split.splits[b];
    for (int i = 0; i < s.split.splits[b]; ++i, ++next) {
      host[2 * p.batch + next] = b;
      host[2 * p.batch + items + next] = i;
    }
  }
  if (!host.empty()) {
    if (backend == Backend::kCuda) {
#if FLASHCPP_WITH_CUDA
      FLASHCPP_RETURN_IF_ERROR(cuda::decode_upload_worklist(int_workspace, host.data(), host.size(), opt.stream));
#endif
    } else {
      std::memcpy(int_workspace, host.data(), host.size() * sizeof(std::int32_t));
    }
  }
  plan->planned = true;
  plan->backend = backend;
  plan->batch = p.batch;
  plan->seqlen_q = p.seqlen_q;
  plan->heads_q = p.heads_q;
  plan->heads_kv = p.heads_kv;
  plan->head_dim = p.head_dim;
  plan->dtype = p.q.dtype;
  plan->paged = p.cache.paged();
  plan->append = p.has_append();
  plan->rows_per_kv = s.rows.rows;
  plan->row_blocks = s.rows.row_blocks;
  plan->warp_rows = s.rows.warp_rows;
  plan->num_items = items;
  plan->max_splits = s.split.max_splits;
  plan->num_sms = s.num_sms;
  plan->needs_merge = s.split.needs_merge;
  plan->fused_merge = s.fused_merge;
  plan->fused_append = s.fused_append;
  plan->ctas = items * p.heads_kv * s.rows.row_blocks;
  plan->int_workspace = int_workspace;
  plan->int_bytes = s.int_bytes;
  plan->float_workspace = float_workspace;
  plan->float_bytes = s.float_bytes;
  return Status::Ok();
}

Status decode_run(const DecodeParams& p, const DecodePlan& plan, const RunOptions& opt) {
  if (!plan.planned) return Status::Invalid("decode_run: the plan is empty (call decode_plan first)");
  if (opt.backend != Backend::kAuto && opt.backend != plan.backend)
    return Status::Invalid(std::string("decode_run: backend ") + backend_name(opt.backend) +
                           " differs from the plan's " + backend_name(plan.backend));
  FLASHCPP_RETURN_IF_ERROR(check_backend_built(plan.backend));
  FLASHCPP_RETURN_IF_ERROR(validate(p, plan.backend));
  if (p.batch != plan.batch) return Status::Invalid(mismatch("batch", p.batch, plan.batch));
  if (p.seqlen_q != plan.seqlen_q) return Status::Invalid(mismatch("seqlen_q", p.seqlen_q, plan.seqlen_q));
  if (p.heads_q != plan.heads_q) return Status::Invalid(mismatch("heads_q", p.heads_q, plan.heads_q));
  if (p.heads_kv != plan.heads_kv) return Status::Invalid(mismatch("heads_kv", p.heads_kv, plan.heads_kv));
  if (p.head_dim != plan.head_dim) return Status::Invalid(mismatch("head_dim", p.head_dim, plan.head_dim));
  if (p.q.dtype != plan.dtype)
    return Status::Invalid(std::string("decode_run: dtype ") + dtype_name(p.q.dtype) + " differs from the plan's " +
                           dtype_name(plan.dtype) + " (run decode_plan again for this shape)");
  if (p.cache.paged() != plan.paged)
    return Status::Invalid(std::string("decode_run: the cache is ") + (p.cache.paged() ? "paged" : "contiguous") +
                           " but the plan was made for a " + (plan.paged ? "paged" : "contiguous") + " cache");
  if (p.has_append() != plan.append)
    return Status::Invalid(std::string("decode_run: the step ") + (p.has_append() ? "appends" : "does not append") +
                           " but the plan was made for a step that " + (plan.append ? "appends" : "does not"));
  if (p.batch == 0) return Status::Ok();
  if (plan.backend == Backend::kCuda) {
#if FLASHCPP_WITH_CUDA
    return cuda::decode_run(p, plan, opt.stream, opt.programmatic_launch);
#endif
  }
  return cpu::decode_run(p, plan, opt);
}

Status merge_attention_states(const MergeStatesParams& p, const RunOptions& opt) {
  const Backend backend = resolve(opt.backend, p.o_a.data, nullptr);
  FLASHCPP_RETURN_IF_ERROR(check_backend_built(backend));
  FLASHCPP_RETURN_IF_ERROR(validate(p, backend));
  if (p.batch == 0 || p.seqlen == 0) return Status::Ok();
  if (backend == Backend::kCuda) {
#if FLASHCPP_WITH_CUDA
    return cuda::merge_attention_states(p, opt.stream);
#endif
  }
  return cpu::merge_attention_states(p);
}

}  // namespace flashcpp
