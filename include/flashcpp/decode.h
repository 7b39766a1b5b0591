// Decode attention against a KV cache: a few query tokens per sequence (1..16) over a long,
// ragged, optionally paged cache, with the new tokens' K/V appended (and rotated) in the same
// call. Plan/run, as FlashInfer: decode_plan() decides on the host how the keys are split over
// CTAs and writes a work list into caller-owned workspaces; decode_run() only launches.
//
// Semantics (every backend computes exactly this; docs/decode.md has the design):
//
//   For sequence b let c_b = cache_seqlens[b] (keys already in the cache before this step) and
//   the total length L_b = c_b + (append ? seqlen_q : 0). With append, step 1 writes the new keys
//   and values of query token t into cache slot c_b + t (K rotated, see below). Then query row t of
//   head h attends to cache keys j in [0, L_b) of KV head h / (heads_q / heads_kv), exactly as
//   attention_forward with seqlen_k = L_b:
//     causal alignment is BOTTOM-RIGHT over the total length: row t sits at key position
//       ia = t + L_b - seqlen_q and, with mask.causal, sees keys j <= ia;
//     mask.window_left / window_right, mask.softcap and ALiBi (slope * (j - ia)) as in attention.h;
//     a row that sees no key writes O = 0 and LSE = -inf; a NaN score at a key the row sees (a
//     NaN in q, in a visible cached key, in the head's ALiBi slope) makes the row NaN, O and LSE,
//     whatever the split count and the merge (attention.h's NaN rule).
//
//   Rotary (DecodeParams::rotary, a RotarySpec of rope.h): query row t and, with append, new key
//   t are rotated at position ia = c_b + t (with append) / L_b - seqlen_q + t (without), by the
//   rotation every rotary path computes (rope.h: tables of either layout, or theta with the
//   optional Llama-3 scaling), in fp32 and rounded to the dtype. The rotated q is used for the
//   attention only: q itself is never written.
//
//   The KV cache is either contiguous, k/v views over (batch, capacity, heads_kv, head_dim), or
//   paged, k/v views over (num_pages, page_size, heads_kv, head_dim) whose batch_stride is the
//   stride between pages, with block_table[b * block_table_stride + j / page_size] naming the page
//   that holds key j of sequence b. page_size is any power of two in [1, 256].
//
//   FP8 cache (cache.k and cache.v of DType::kF8E4M3, q/o/k_new/v_new fp16, bf16 or fp32): every
//   KV head hk has scales k_scale[hk], v_scale[hk] (fp32, positive and finite), and the step
//   attends over the dequantized cache K = code * k_scale, V = code * v_scale. The append stores
//   the code of x / scale (K after rotary, in fp32; round to nearest even, saturating at +-448).
//   The kernels fold the scales instead of dequantizing each element: scores use
//   softmax_scale * k_scale[hk] (softcap and ALiBi act on that score as usual) and O is
//   v_scale[hk] times the weighted sum of the codes, the same numbers up to fp32 rounding.
//   Both backends: the CUDA kernels copy the codes (half the bytes of a 16-bit cache) and convert
//   each tile to q's dtype in shared memory, exactly, before the same tensor-core loop. CUDA
//   strides of an fp8 cache are multiples of 16 elements (16 bytes).
//
// Safety against device-resident values the host cannot check (CUDA backend): a length outside
// [0, slots - (append ? seqlen_q : 0)] is clamped into it, a block-table entry outside
// [0, num_pages) is clamped into it and a rotary position outside the tables is clamped to their
// rows (rope.h), so no kernel reads or writes outside the views it was given. The CPU backend reads
// those arrays and refuses bad values with a sentence instead.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashcpp/attention.h"
#include "flashcpp/rope.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp {

inline constexpr int kDecodeMaxSeqlenQ = 16;    ///< query tokens per sequence and step
inline constexpr int kDecodeMaxPageSize = 256;  ///< largest page size (any power of two up to it)
inline constexpr int kDecodeMaxSplits = 256;    ///< most key splits of one sequence
inline constexpr int kDecodeBlockN = 64;        ///< keys per tile; split boundaries are multiples of it

/// The KV cache: contiguous (page_size 0) or paged.
struct KVCacheView {
  /// Contiguous: (batch, capacity, heads_kv, head_dim) views. Paged: (num_pages, page_size,
  /// heads_kv, head_dim) views, batch_stride = elements between pages. v's last extent is
  /// head_dim_v. Strides in elements, the last dim contiguous; k and v may have different
  /// strides. Same dtype as q.
  TensorView k, v;
  int capacity = 0;   ///< contiguous only: key slots per sequence
  int page_size = 0;  ///< 0 = contiguous; else a power of two in [1, kDecodeMaxPageSize]
  int num_pages = 0;  ///< paged only: pages in the pool
  /// Paged only: int32 (batch, pages_per_seq), row b at block_table + b * block_table_stride.
  const std::int32_t* block_table = nullptr;
  std::int64_t block_table_stride = 0;
  int pages_per_seq = 0;  ///< paged only: columns of the block table
  /// FP8 cache only (k and v of DType::kF8E4M3): fp32 [heads_kv] per-head scales, positive and
  /// finite, in the memory of the backend (see the header comment). Null otherwise.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;

  bool paged() const noexcept { return page_size > 0; }
  bool fp8() const noexcept { return k.dtype == DType::kF8E4M3; }
  /// Key slots one sequence can address: capacity, or pages_per_seq * page_size.
  std::int64_t slots() const noexcept {
    return paged() ? static_cast<std::int64_t>(pages_per_seq) * page_size : capacity;
  }
};

/// One decode step. Pointers are device pointers for the CUDA backend, host pointers for the CPU
/// backend. decode_plan() reads only the scalar fields (shapes, dtype, cache geometry, whether
/// there is an append, the mask scalars); decode_run() reads everything.
struct DecodeParams {
  int batch = 0;
  int seqlen_q = 1;   ///< query tokens per sequence, 1..kDecodeMaxSeqlenQ (speculative decoding: > 1)
  int heads_q = 0;
  int heads_kv = 0;   ///< heads_q % heads_kv == 0 (GQA/MQA)
  int head_dim = 0;   ///< of q and the keys: a multiple of 8 in [8, 256] (is_supported_head_dim)
  /// Of the values and o: likewise; 0 = head_dim. CUDA runs the pair in the class of both
  /// (cuda_head_dim_class, padded inside the kernels); an fp8 cache there takes multiples of 16.
  int head_dim_v = 0;
  TensorView q;       ///< (batch, seqlen_q, heads_q, head_dim)
  TensorView o;       ///< (batch, seqlen_q, heads_q, head_dim_v), q's dtype; must not overlap any input
  /// Optional fp32 log-sum-exp (natural log), contiguous (batch, heads_q, seqlen_q).
  float* lse = nullptr;
  KVCacheView cache;
  /// int32 [batch]: keys already in the cache before this step (the kernels read it at run time,
  /// so a CUDA graph replays with new lengths).
  const std::int32_t* cache_seqlens = nullptr;
  /// Optional new keys/values of this step, (batch, seqlen_q, heads_kv, head_dim) and
  /// (..., head_dim_v): both or neither.
  /// When set they are written into the cache (K rotated) before the attention reads it.
  TensorView k_new, v_new;
  /// Rotary applied in-kernel to q and to the appended keys; style kNone (the default) = off.
  RotarySpec rotary;
  float softmax_scale = 0.f;  ///< 0 = 1/sqrt(head_dim)
  /// causal, window_left, window_right, softcap, alibi_slopes (+ batch stride). Varlen, global
  /// tokens and block-sparse masks do not apply to decode and are refused.
  MaskParams mask;

  bool has_append() const noexcept { return k_new.data != nullptr || v_new.data != nullptr; }
  float effective_scale() const noexcept;
  int effective_head_dim_v() const noexcept { return head_dim_v == 0 ? head_dim : head_dim_v; }
};

/// How large the caller-owned workspaces must be for a plan (bytes).
struct DecodeWorkspaceSize {
  std::size_t int_bytes = 0;    ///< int32 work list: per-sequence split table + per-CTA items
  std::size_t float_bytes = 0;  ///< fp32 partial outputs (normalized O + LSE) of split sequences
};

struct DecodePlanOptions {
  /// Where decode_run will run, which is also where the workspaces live. kAuto: CUDA when q
  /// (or, if q is null at plan time, the workspaces) is device memory, else the CPU backend.
  Backend backend = Backend::kAuto;
  /// Host copy of the lengths to plan for, int32 [batch] in the meaning of cache_seqlens. For a
  /// CUDA graph that replays with growing lengths pass the largest lengths it will see. nullptr:
  /// every sequence is planned at its full cache (slots - appended tokens).
  const std::int32_t* host_cache_seqlens = nullptr;
  int num_splits = 0;  ///< > 0: force this many key splits for every sequence (<= kDecodeMaxSplits)
  int max_splits = 0;  ///< cap of the heuristic per sequence; 0 = kDecodeMaxSplits
  int num_sms = 0;     ///< 0 = the current device's (CUDA); the CPU backend plans for 132 (an H200)
  Stream stream = nullptr;  ///< CUDA: stream of the work-list upload (use the stream of run)
  /// CUDA: merge the splits inside the split-KV kernel instead of a merge launch. The last CTA of
  /// each (sequence, KV head, row block) to finish (an arrival counter in the int workspace,
  /// zeroed by the plan and reset by that CTA) merges the partials while they are in L2. Same
  /// arithmetic as the merge kernel, so the same results. The CPU backend ignores it.
  bool fused_merge = false;
  /// How widely a latency-bound plan spreads: one whose 256-key splits cannot fill a wave splits
  /// further (down to one 64-key tile per split) until it occupies, with kFullWave, one full wave
  /// of CTAs (num_sms x CTAs per SM: the fastest attention step alone, reports/decode), or with
  /// kShared, 5/8 of the SMs: for a caller whose other kernels run beside attention, as the
  /// engine's GEMVs do under programmatic launches, where fewer attention CTAs made the whole
  /// step faster (docs/decode.md, "The split heuristic").
  enum class SmallPlan { kFullWave, kShared };
  SmallPlan small_plan = SmallPlan::kFullWave;
  /// CUDA, with new K/V (append): the split-KV kernel writes them into the cache itself instead of
  /// an append launch. Each split's CTAs write the step's tokens whose slots fall in their tiles
  /// before loading any tile; same arithmetic as the append kernel, so the same cache bytes and
  /// results. The CPU backend ignores it.
  bool fused_append = false;
};

/// The decisions of decode_plan, read by decode_run. Filled by decode_plan; the fields are public
/// so tools and tests can print them, not to be edited.
struct DecodePlan {
  bool planned = false;
  Backend backend = Backend::kCpu;  ///< kCpu or kCuda
  int batch = 0, seqlen_q = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int head_dim_v = 0;  ///< resolved: head_dim when DecodeParams::head_dim_v is 0
  DType dtype = DType::kBF16;
  bool paged = false;
  bool append = false;
  int rows_per_kv = 0;   ///< query rows that share one KV head: (heads_q / heads_kv) * seqlen_q
  int row_blocks = 0;    ///< CTAs along those rows (each CTA holds up to 64 rows)
  int warp_rows = 0;     ///< warps along the rows inside a CTA (1, 2 or 4; the rest split the keys)
  int num_items = 0;     ///< work items = sum over sequences of their split counts
  int max_splits = 0;    ///< largest split count of one sequence
  int num_sms = 0;       ///< SM count the heuristic used
  bool needs_merge = false;  ///< some sequence has > 1 split: the partials are merged
  bool fused_merge = false;  ///< CUDA, needs_merge: the split-KV kernel merges them (no merge launch)
  bool fused_append = false; ///< CUDA, append: the split-KV kernel writes the new K/V (no append launch)
  int ctas = 0;          ///< CTAs of the split-KV launch: num_items * heads_kv * row_blocks
  /// CTAs per SM the split-KV launch allows (CUDA): the kernel's own, or fewer for an fp8 cache
  /// whose CTAs fall into fewer waves that way (the launch pads its shared memory; select::decode_splits)
  int ctas_per_sm = 0;
  void* int_workspace = nullptr;
  std::size_t int_bytes = 0;
  void* float_workspace = nullptr;
  std::size_t float_bytes = 0;
};

/// Checks everything about a decode step that can be checked without touching device memory.
/// With a CPU backend it also reads cache_seqlens, the block table and the rotary positions.
Status validate(const DecodeParams& p, Backend backend);

/// Bytes of workspace a plan with these inputs needs (runs the same heuristic as decode_plan).
Status decode_workspace_size(const DecodeParams& p, const DecodePlanOptions& opt, DecodeWorkspaceSize* out);

/// Host step: decides the split of every sequence, writes the work list into int_workspace (CUDA:
/// an asynchronous copy on opt.stream from a buffer that may be released on return; the call may
/// wait for that stream) and fills *plan. Run it again when batch, seqlen_q, heads, head_dim,
/// dtype, the cache kind or append change, or when lengths outgrow what it planned for (correct
/// still, but slower). Workspaces must be 16-byte aligned and live as long as the plan is used.
Status decode_plan(const DecodeParams& p, const DecodePlanOptions& opt, void* int_workspace,
                   std::size_t int_bytes, void* float_workspace, std::size_t float_bytes, DecodePlan* plan);

/// Launches the step: append (+ rotary) if k_new/v_new are set, the split-KV kernel, and the merge
/// kernel if the plan split some sequence. CUDA: asynchronous on opt.stream, no allocation, no
/// host synchronization; capturable in a CUDA graph and replayable with new cache_seqlens (and new
/// tensor contents) as long as the plan's shapes hold. opt.backend must be kAuto or the plan's.
Status decode_run(const DecodeParams& p, const DecodePlan& plan, const RunOptions& opt = {});

/// Two partial attention outputs over disjoint key sets, merged by their LSEs:
///   lse = log(exp(lse_a) + exp(lse_b)),  o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)
/// (an empty side, lse = -inf, contributes nothing; both empty give o = 0, lse = -inf; a NaN
/// lse on either side gives lse = NaN, and o = NaN unless the other side is empty).
struct MergeStatesParams {
  int batch = 1, seqlen = 0, heads = 0;
  int head_dim = 0;                ///< any size >= 1
  TensorView o_a, o_b;             ///< (batch, seqlen, heads, head_dim), one dtype
  TensorView o;                    ///< output, same dtype; may be exactly o_a or o_b (in place)
  const float* lse_a = nullptr;    ///< fp32 natural log, contiguous (batch, heads, seqlen)
  const float* lse_b = nullptr;
  float* lse = nullptr;            ///< optional merged LSE, same layout
};
Status validate(const MergeStatesParams& p, Backend backend);
/// Runs on the CPU (host pointers) or CUDA (device pointers; asynchronous on opt.stream).
Status merge_attention_states(const MergeStatesParams& p, const RunOptions& opt = {});

}  // namespace flashcpp
