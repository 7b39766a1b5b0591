// What the decode kernels and the CPU decode backend share, as plain host/device arithmetic:
// the tile config, the work-list layout, the per-sequence length rule, the split of a key range
// and the rotary pairing (the score algebra is common/attention_algebra.h's). The CPU backend (src/cpu/decode.cc) includes this
// file too, so both walk exactly the same splits and tiles (as common/mask_rules.h does for
// prefill). No CUDA types here.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/fused_math.h"
#include "common/mask_rules.h"  // FC_HD, MaskRules
#include "flashcpp/decode.h"

namespace flashcpp::decode {

/// Tile config of the split-KV kernel per head dim. Tuning only: none of it changes results
/// beyond fp32 rounding, except kBlockN, which fixes where split boundaries may fall.
///
/// Why these numbers (H200: 132 SMs, 228 KB smem/SM, ~4.2 TB/s): decode moves K/V once and does
/// little math on it, so the config is about bytes in flight. Little's law with ~1 us of DRAM
/// latency asks for 4.2 MB in flight, ~32 KB per SM. A stage is kBlockN keys of K and V
/// (2*64*D*2 bytes: 16/32/64 KB for D = 64/128/256); while a CTA waits all kStages stages are in
/// flight (decode_kernel.cuh) and kCtasPerSm CTAs share an SM, so every head dim keeps >= 96 KB
/// per SM in flight.
template <int D>
struct Config {
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = kDecodeBlockN;            ///< keys per pipeline stage
  static constexpr int kChunkN = 16;                        ///< keys per warp step (one k16 of P@V)
  static constexpr int kChunks = kBlockN / kChunkN;         ///< warp steps per tile
  static constexpr int kRowsPerWarp = 16;                   ///< one m16 tile of query rows
  static constexpr int kMaxRows = kRowsPerWarp * kWarps;    ///< query rows per CTA (4 warps on rows)
  static constexpr int kStages = D == 64 ? 4 : D == 128 ? 3 : 2;
  static constexpr int kCtasPerSm = D == 64 ? 3 : D == 128 ? 2 : 1;  ///< on a 228 KB SM (planner hint)
  static constexpr int kQBytes = kMaxRows * D * 2;
  static constexpr int kStageBytes = 2 * kBlockN * D * 2;   ///< K + V of one tile
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;
  /// Epilogue scratch (reuses the K/V stages): per warp 16 rows of fp32 O (rows padded by 4
  /// floats against bank conflicts) plus m and l.
  static constexpr int kMergeBytes = kWarps * kRowsPerWarp * (D + 4 + 2) * 4;
  /// An fp8 e4m3 cache (one byte per element): a ring of kStages8 fp8 stages, which the warps read
  /// directly (ldmatrix on the codes, converted in registers), and the query rows' fp16 scales. A
  /// stage is half the bytes of a 16-bit one. The fp8 step is issue-bound rather than memory-bound
  /// (1.08x the bf16 step at D = 256 and 1.2-1.5x at D = 128 at 8ad80be, with one and two CTAs of
  /// 4 warps per SM), so the ring is kept short and the shared memory buys CTAs instead: 4 / 3 / 2
  /// per SM at D = 64 / 128 / 256 (4 / 3 / 2 stages: 128-144 KB of codes in flight per SM, 4x
  /// what Little's law asks for). A batch whose whole sequences fill several waves may run at the
  /// 16-bit count instead (DecodePlan::ctas_per_sm: the launch pads its shared memory). The
  /// epilogue scratch can be larger than the ring: the size takes the larger.
  static constexpr int kStages8 = D == 64 ? 4 : D == 128 ? 3 : 2;
  static constexpr int kCtasPerSm8 = D == 64 ? 4 : D == 128 ? 3 : 2;
  static constexpr int kStage8Bytes = 2 * kBlockN * D;
  static constexpr int kQScaleBytes = kMaxRows * 4;
  static constexpr int kRing8Bytes = kStages8 * kStage8Bytes + kQScaleBytes;
  static constexpr int kSmemBytes8 = kQBytes + (kRing8Bytes > kMergeBytes ? kRing8Bytes : kMergeBytes);
  static_assert(kBlockN % (kChunkN * 1) == 0 && kChunks == kWarps, "a tile is one chunk per warp");
  static_assert(kMergeBytes <= kStages * kStageBytes, "epilogue scratch fits in the K/V stages");
  static_assert(kMergeBytes <= kSmemBytes8 - kQBytes, "epilogue scratch fits behind the fp8 Q tile");
  static_assert((kSmemBytes8 + 1024) * kCtasPerSm8 <= 228 * 1024, "the fp8 config's CTAs fit on a 228 KB SM");
  static_assert(kCtasPerSm8 >= kCtasPerSm, "the fp8 ring never runs fewer CTAs per SM than the 16-bit one");
  static_assert(D % 16 == 0, "head_dim is a multiple of the mma k");
};

/// Dynamic shared memory of one split-KV CTA for a head dim and cache kind (Config<D>::kSmemBytes,
/// or kSmemBytes8 over an fp8 cache); a head dim between the compiled ones counts as the next
/// larger one.
inline int cta_smem_bytes(int head_dim, bool fp8) {
  if (head_dim <= 64) return fp8 ? Config<64>::kSmemBytes8 : Config<64>::kSmemBytes;
  if (head_dim <= 128) return fp8 ? Config<128>::kSmemBytes8 : Config<128>::kSmemBytes;
  return fp8 ? Config<256>::kSmemBytes8 : Config<256>::kSmemBytes;
}

/// CTAs per SM the planner counts for a head dim and cache kind: Config<D>::kCtasPerSm (or
/// kCtasPerSm8 over an fp8 cache), which the configs size for a 228 KB SM (H100, H200), or fewer
/// where the SM has less shared memory (smem_per_sm > 0: an A100's 164 KB holds one D = 128
/// 16-bit CTA, not two), 1 KB of it reserved per CTA; at least 1. A head dim between the compiled
/// ones (the CPU backend's plan) counts as the next larger one.
inline int ctas_per_sm(int head_dim, bool fp8 = false, int smem_per_sm = 0) {
  const int natural = head_dim <= 64    ? (fp8 ? Config<64>::kCtasPerSm8 : Config<64>::kCtasPerSm)
                      : head_dim <= 128 ? (fp8 ? Config<128>::kCtasPerSm8 : Config<128>::kCtasPerSm)
                                        : (fp8 ? Config<256>::kCtasPerSm8 : Config<256>::kCtasPerSm);
  if (smem_per_sm <= 0) return natural;
  const int fit = smem_per_sm / (cta_smem_bytes(head_dim, fp8) + 1024);
  return fit < 1 ? 1 : fit < natural ? fit : natural;
}

/// Dynamic shared memory that holds a split-KV launch to `plan_ctas` CTAs per SM (DecodePlan::
/// ctas_per_sm) on an SM of `smem_per_sm` bytes: 0, the kernel's own size, unless the plan asks
/// for a 16-bit cache's count on an fp8 cache whose config fits more (select::decode_splits); then
/// the SM's shared memory over that count, less the 1 KB reserved per CTA, in 128-byte steps.
inline int launch_smem_pad(int head_dim, bool fp8, int plan_ctas, int smem_per_sm) {
  const int lo = ctas_per_sm(head_dim, false, smem_per_sm), hi = ctas_per_sm(head_dim, fp8, smem_per_sm);
  if (!fp8 || lo >= hi || plan_ctas != lo) return 0;
  const int pad = (smem_per_sm / lo - 1024) / 128 * 128;
  return pad > cta_smem_bytes(head_dim, fp8) && pad <= smem_per_sm - 1024 ? pad : 0;
}

/// Rows of the query that share one KV head, and how a CTA covers them: warp_rows warps along the
/// rows (16 rows each), the other 4 / warp_rows warps split each tile's keys; row_blocks CTAs
/// when more than 64 rows share a KV head (MQA with many heads, long speculative steps).
struct RowLayout {
  int rows = 0, warp_rows = 1, row_blocks = 1;
};
inline RowLayout row_layout(int heads_q, int heads_kv, int seqlen_q) {
  RowLayout r;
  r.rows = heads_q / heads_kv * seqlen_q;
  const int m16 = (r.rows + 15) / 16;
  r.warp_rows = m16 <= 1 ? 1 : m16 <= 2 ? 2 : 4;
  r.row_blocks = (r.rows + 16 * r.warp_rows - 1) / (16 * r.warp_rows);
  return r;
}

/// The int workspace: four int32 arrays, back to back.
///   first_item[batch]  index of sequence b's first work item
///   num_splits[batch]  its split count n_b (items first_item[b] .. first_item[b] + n_b - 1)
///   item_batch[items]  the sequence of each work item
///   item_split[items]  the split index s of each work item, 0 <= s < n_b
/// The float workspace (only when some n_b > 1): normalized partial O, then LSEs (natural log),
///   part_o  [items][heads_kv][rows][head_dim]      part_lse [items][heads_kv][rows]
/// where rows = (heads_q / heads_kv) * seqlen_q and row r is (head h = hkv*group + r / seqlen_q,
/// token t = r % seqlen_q).
struct WorkList {
  const std::int32_t* first_item = nullptr;
  const std::int32_t* num_splits = nullptr;
  const std::int32_t* item_batch = nullptr;
  const std::int32_t* item_split = nullptr;
};
inline std::size_t worklist_int_count(int batch, int items) {
  return 2 * static_cast<std::size_t>(batch) + 2 * static_cast<std::size_t>(items);
}
inline WorkList worklist_view(const void* base, int batch, int items) {
  const auto* p = static_cast<const std::int32_t*>(base);
  return WorkList{p, p + batch, p + 2 * batch, p + 2 * batch + items};
}
/// Arrival counters of the fused merge, one per (sequence, KV head, row block), after the work list.
inline std::size_t merge_counter_count(int batch, int heads_kv, int row_blocks) {
  return static_cast<std::size_t>(batch) * heads_kv * row_blocks;
}
inline std::size_t partial_float_count(int items, int heads_kv, int rows, int head_dim) {
  return static_cast<std::size_t>(items) * heads_kv * rows * (static_cast<std::size_t>(head_dim) + 1);
}
/// part_lse starts after part_o, rounded up to 4 floats so both are 16-byte aligned.
inline std::size_t partial_lse_offset(int items, int heads_kv, int rows, int head_dim) {
  const std::size_t n = static_cast<std::size_t>(items) * heads_kv * rows * head_dim;
  return (n + 3) / 4 * 4;
}
inline std::size_t partial_float_bytes(int items, int heads_kv, int rows, int head_dim) {
  return (partial_lse_offset(items, heads_kv, rows, head_dim) +
          static_cast<std::size_t>(items) * heads_kv * rows) * sizeof(float);
}

/// The total key count L_b of a sequence from its raw cache length, clamped so that appending
/// stays inside the cache and reading stays inside the slots (device values are unchecked).
FC_HD int total_len(int cache_len, int slots, int seqlen_q, bool append) {
  const int room = append ? slots - seqlen_q : slots;  // validate: slots >= seqlen_q when appending
  const int c = cache_len < 0 ? 0 : (cache_len > room ? room : cache_len);
  return append ? c + seqlen_q : c;
}

/// The key tiles [*begin, *end) of split s out of n of the visible key range [lo, hi): the range's
/// tiles are dealt out evenly in order; a split may be empty (more splits than tiles).
FC_HD void split_tiles(int lo, int hi, int s, int n, int block_n, int* begin, int* end) {
  const int t0 = lo / block_n;
  const int nt = hi > lo ? (hi + block_n - 1) / block_n - t0 : 0;
  *begin = t0 + static_cast<int>(static_cast<long long>(nt) * s / n);
  *end = t0 + static_cast<int>(static_cast<long long>(nt) * (s + 1) / n);
}

/// The mask rules of one sequence (windows are pre-clamped on the host so ia + window fits int).
FC_HD MaskRules sequence_rules(int seqlen_q, int len, bool causal, int window_left, int window_right) {
  return MaskRules{seqlen_q, len, causal, window_left, window_right, 0, false};
}
/// Host: windows wider than any sequence see the same keys; clamp so device arithmetic cannot overflow.
inline int clamp_window(int w, std::int64_t slots) {
  const std::int64_t cap = slots + kDecodeMaxSeqlenQ;
  return w < 0 ? -1 : static_cast<int>(w > cap ? cap : w);
}

/// Element indices of rotary pair i: neox (i, i + rd/2), interleaved (2i, 2i+1). (The angles'
/// inv_freq come from flashcpp::rotary_inv_freq on the host, rope.h, as on every rotary path.)
FC_HD void rotary_pair(RopeStyle style, int i, int rotary_dim, int* a, int* b) {
  if (style == RopeStyle::kInterleaved) {
    *a = 2 * i;
    *b = 2 * i + 1;
  } else {
    *a = i;
    *b = i + rotary_dim / 2;
  }
}

}  // namespace flashcpp::decode
