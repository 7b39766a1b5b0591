// The selector: the one place where a problem's runtime values (backend, device, head_dim, dtype,
// lengths, masks) become a kernel choice, and where every heuristic behind that choice lives:
//   prefill  the CUDA family (sm80 mma.sync or sm90a wgmma/TMA) and its tile config, as a typed
//            KernelChoice (TileConfig), from the tuned table (sm80), the wide-tile and persistent
//            rules (sm90) and the block-sparse fit;
//   decode   the split rule of the planner (how many splits per sequence);
//   budgets  the sm90 kernel's setmaxnreg register split.
// attention_forward, decode_plan / decode_workspace_size and `flashcpp info` all read it; the
// kernels only run what it chose. Rules are plain functions so the CPU tests check them on the
// shapes they were measured on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/decode.h"
#include "flashcpp/device.h"

namespace flashcpp::select {

// ---- prefill ----------------------------------------------------------------------------------
/// The kernel for a validated problem on the backend `b` (kCpu, kCpuReference or kCuda): the CPU
/// kernels directly, a CUDA kernel family and tile config via cuda_prefill.
/// Without `explain` (attention_forward's call) only id and tile are filled: no config name or
/// reason is built, which cost about half a microsecond of host time per call (strings and
/// allocations; error sentences are built as always).
Status prefill(const AttnParams& p, const RunOptions& opt, Backend b, KernelChoice* out, bool explain = true);

#if FLASHCPP_WITH_CUDA
/// The CUDA choice on device `dev`: opt.cuda_config "" (automatic), "sm80" / "sm90" (that family,
/// its automatic config) or an exact config name of either family.
Status cuda_prefill(const AttnParams& p, const RunOptions& opt, const cuda::DeviceInfo& dev, KernelChoice* out,
                    bool explain = true);
#endif

/// Config names (what RunOptions::cuda_config and `flashcpp tune` take): "m128n64w4s2q" (sm80:
/// BlockM, BlockN, warps, stages, q = Q re-read / r = Q in registers, "bN" = registers for N CTAs
/// per SM) and "sm90_m128n128s2p" (sm90: BlockM, BlockN, stages; "p" pipelined consumers with
/// ping-pong turns, "o" pipelined without; "_lean" only the causal and sequence-end masks; "_k96"
/// Q K^T over the first 96 dims, for the head dims of the class up to 96; "_persist" persistent CTAs).
std::string sm80_config_name(const TileConfig& t);
std::string sm90_config_name(const TileConfig& t);

/// Whether a tile of block_m x block_n keys can walk a block-sparse mask: the mask's blocks are
/// whole multiples of the tile (a CTA's rows lie in one mask row, a listed block is whole key
/// tiles) and a tile reads its element bits from whole 64-bit words or from inside one.
bool tiles_fit_block_sparse(const BlockSparseMask& bs, int block_m, int block_n);

/// The sm90 persistent rule: a causal problem's persistent work units (two row blocks of equal
/// causal cost) fill their last wave of CTAs (one per SM) at least 3/4 full. Persistent over its
/// twin, causal, on the H200: 1.31x at 128 units, 1.12x at 256, 0.99-1.08x from 512 up; 0.79x at
/// 64 units (half the SMs idle) and 0.78x at 144 (a second wave of 12). For a single wave this is
/// "at least 1.5 tiles per SM".
bool persistent_units_fill_waves(std::int64_t units, int sms);

/// The sm90 persistent rule as dispatch applies it: whether the persistent twin (q_bufs Q buffers)
/// beats its non-persistent config on a problem of `units` work units and `key_blocks` key tiles
/// per row block (before the causal triangle). Both need units that fill their waves
/// (persistent_units_fill_waves). With two Q buffers (d64, d128: the next tile's Q lands under the
/// current one): causal while a tile walks at most 32 key tiles on average ((16,32,512,128) 1.15x,
/// (4,32,4096,128) 1.03x; the longer (1,16,16384,128) loses its wave tail, 0.98x); non-causal at
/// most 4 ((16,32,512,128) 1.12x; from 8 the probe's 1.01-1.03x did not hold up in the prefill
/// bench, which put (8,16,1024,128) and (4,32,4096,128) 3-4% lower against FA4 than the
/// non-persistent kernel had). With one (d256): causal only, from 16 key tiles per tile on average
/// ((1,16,4096,256) 1.17x; (16,32,512,256) 0.93x, non-causal 0.89x).
bool sm90_persistent_pays(std::int64_t units, int sms, bool causal, int key_blocks, int q_bufs);

/// Whether a problem is short enough that the 128-row persistent twin (where it pays) beats a wide
/// tile that would also pay: keys below 2048 (non-causal; (16,32,512,64) 1.13x the 192-row tile,
/// (2,16,4096,64) 0.98x) or below 8192 (causal; (16,32,1024,64) 1.29x, (4,32,2048,64) 1.11x,
/// (2,16,16384,64) 0.87x).
bool sm90_short_for_wide_tile(int seqlen_k, bool causal);

/// The sm90 wide-tile rule: whether a tile of `wide_rows` (> 128) query rows beats the 128-row tile
/// on `heads_batch` (head, batch) pairs of `seqlen_q` rows. d64's 192-row tile costs 0.88x per
/// query row once the SMs are full ((2,16,16384,64): 476.5 vs 419.1 TFLOP/s) but comes in coarser
/// waves. Non-causal: taken when waves(wide) x wide_rows x 0.88 < waves(128) x 128, a wave being one
/// tile per SM. Causal: from 10 wide tiles per SM (below, the 128-row persistent twin balances the
/// triangle better: 339.0 vs 318.0 at 5.3 per SM; at 20.9 per SM the wide tile wins, 438.5 vs 403.8).
bool wide_tile_pays(std::int64_t seqlen_q, std::int64_t heads_batch, bool causal, int wide_rows, int sms);

// ---- backward ---------------------------------------------------------------------------------
/// The backward's implementation for a validated problem on backend `b`: the fp64 reference or the
/// tiled CPU backward; kCuda the mma.sync backward of src/cuda/backward (one config per head-dim class).
Status backward(const AttnBackwardParams& p, const RunOptions& opt, Backend b, KernelChoice* out);

/// The backward grid's key tiles per group. The grid runs groups of `key_tiles_per_group` key tiles
/// of every (sequence, KV head), group after group, the tiles of a group fastest (bwd_launch.cuh).
/// Default mode: one group of all `key_tiles` (each head's key tiles run side by side and share its
/// Q, dO and dQ in L2). Deterministic mode: key tile n adds to a query tile after tile n - 1 did,
/// one hand-over (the reduce-add landing, then the flag) per tile; with every key tile of a head
/// running at once, the last one finishes (key_tiles - 1) hand-overs after the first (1.82x the
/// default's time at (4,32,4096,128) causal). Groups bound that chain: G = max(4, resident_ctas /
/// kv_pairs) tiles of a head run at once, enough heads to fill the GPU, and the next group's tiles
/// start as this group's finish, their turns already passed. G >= 4 keeps the passes over Q, dO and
/// dQ (one per group; L2 holds a pass's tiles, not a head's) at key_tiles / 4 or fewer. G also grows
/// until batch x groups fits the grid's 65535 z limit.
/// `forced` > 0 (cuda_config's "+g<N>", backward_config) asks for that many tiles per group instead,
/// in either mode, within the same bounds (at most key_tiles, and batch x groups within 65535): a
/// measurement knob for the rule.
int backward_key_group(bool deterministic, int key_tiles, int batch, int heads_kv, int resident_ctas, int forced = 0);

/// The backward's cuda_config: a family ("" automatic, "sm80", "sm90", "sm90ws"), optionally followed
/// by "+g<N>" (N in [1, 65535]: key tiles per group of the grid, backward_key_group's `forced`; into
/// *key_group unless it is null). False (and a sentence in *why) for anything else.
bool backward_config(const std::string& cuda_config, std::string* family, int* key_group, std::string* why);

// ---- the sm80 tuned table ------------------------------------------------------------------------
/// The tuned table's seqlen buckets (flashcpp/tune.h: kSeqlenBuckets). Lookup order: the JSON cache
/// written by `flashcpp tune` (FLASHCPP_TUNE_CACHE, else ~/.cache/flashcpp/prefill_sm80_<device>.json),
/// then the table shipped in src/core/sm80_tuned_table.inc (measured on an H200, applied to sm_90
/// devices). "" when neither has the key.
std::string sm80_tuned_name(const cuda::DeviceInfo& dev, int head_dim, bool causal, DType dtype, int seqlen);

// ---- decode ------------------------------------------------------------------------------------
/// The planner's split decision, before it becomes a work list.
struct SplitDecision {
  std::vector<std::int32_t> splits;  ///< n_b per sequence
  int num_items = 0;
  int max_splits = 0;
  bool needs_merge = false;
  /// CTAs per SM to launch with: ctas_per_sm(D, fp8), or ctas_per_sm(D) when an fp8 cache's
  /// CTAs (more per SM than a 16-bit cache's) fall into fewer waves that way.
  int ctas_per_sm = 0;
};

/// The SM count the CPU backend plans for when none is given: an H200's, so the CPU walks the
/// splits the GPU would.
inline constexpr int kCpuPlanSms = 132;

/// The split rule (selector.cc has it in full; docs/decode.md the reasoning). `lengths`: host
/// lengths in the meaning of cache_seqlens (nullptr: full caches); `forced` > 0 gives every
/// sequence that many splits; `max_splits` caps the count (0: kDecodeMaxSplits); `small` is
/// DecodePlanOptions::small_plan.
/// smem_per_sm: the device's shared memory per SM (0: the 228 KB of an H100/H200, the CPU
/// backend's plan), which bounds the CTAs per SM (decode::ctas_per_sm).
Status decode_splits(const DecodeParams& p, const std::int32_t* lengths, int forced, int max_splits, int num_sms,
                     SplitDecision* out, DecodePlanOptions::SmallPlan small = DecodePlanOptions::SmallPlan::kFullWave,
                     int smem_per_sm = 0);

// ---- register budgets ----------------------------------------------------------------------------
/// The sm90 prefill kernel's setmaxnreg split of the 64K-register file (multiples of 8): the
/// producer warpgroup needs few (one thread issues TMA), the consumers as many as their S and O
/// accumulators take. Three consumer warpgroups (the 192-row tile) leave 160 each; a key tile wider
/// than 128 needs 240 for S (its producer gets 24).
struct Sm90Registers {
  int producer, consumer;
};
constexpr Sm90Registers sm90_registers(int consumers, int block_n) {
  return consumers == 3 ? Sm90Registers{32, 160} : block_n > 128 ? Sm90Registers{24, 240} : Sm90Registers{40, 232};
}

}  // namespace flashcpp::select
