// Attention forward: one parameter struct, one entry point, one validator.
//
// Semantics (every backend computes exactly this; the fp64 CPU reference is the ground truth):
//
//   For batch b, query head h, query row i, key row j, with the KV head hk = h / (heads_q/heads_kv):
//     if rotary:             Q, K = apply_rotary(Q, positions_q), apply_rotary(K, positions_k)
//                            (AttnRotary below; rounded to the input dtype)
//     s(i,j)  = softmax_scale * dot(Q[b,i,h,:], K[b,j,hk,:])
//     if softcap > 0:        s = softcap * tanh(s / softcap)                  (Gemma-2)
//     if alibi_slopes:       s += slope[b,h] * (j - ia)                       (BLOOM)
//     P(i,:)  = softmax over the visible keys j of s(i,j)
//     O[b,i,h,:] = sum_j P(i,j) V[b,j,hk,:]
//     LSE[b,h,i] = log(sum_j exp(s(i,j)))      (natural log, fp32)
//
//   Causal alignment is BOTTOM-RIGHT, as in flash-attn: the query row i sits at key position
//   ia = i + seqlen_k - seqlen_q, and sees keys j <= ia. (PyTorch SDPA's is_causal is
//   top-left; the two agree only when seqlen_q == seqlen_k.)
//
//   Visibility of key j for query i (all conditions that are enabled must hold):
//     causal:                         j <= ia
//     window_right >= 0:              j <= ia + window_right      (not for global queries)
//     window_left  >= 0:              j >= ia - window_left       (not for global keys/queries)
//     global tokens (G = global_tokens): keys j < G are exempt from window_left
//                                     (attention sinks); with global_queries, query rows with
//                                     ia < G are exempt from both window bounds (causal still holds).
//     block_sparse:                   the (i / block_m, j / block_n) block is listed, and for a
//                                     partial block its element bit is set.
//     varlen:                         i and j belong to the same packed sequence (always true:
//                                     each sequence is an independent problem).
//
//   A query row that sees no key at all has O = 0 and LSE = -inf.
//
//   NaN propagates as in PyTorch SDPA and flash-attn: a NaN score s(i,j) at a key j that row i
//   sees (a NaN in q, in a visible key's k, or in the head's ALiBi slope; an inf that makes
//   inf - inf) gives that row O = NaN (every element) and LSE = NaN, on every backend. A NaN in
//   the k of a key the row does not see is masked out before the softmax and does not reach the
//   row. A NaN in v reaches O through the keys the row sees; through keys hidden from it, the
//   fp64 references never read it, while the tiled CPU backend and the CUDA kernels multiply a
//   zero weight by every value row of a key tile they visit (0 * NaN = NaN, as SDPA's math path
//   does for the whole sequence), so there it is unspecified. A row that sees no key stays
//   O = 0, LSE = -inf whatever its inputs hold.
//
//   Varlen rows that no sequence covers (packed rows past cu_seqlens_q[batch], all of them when
//   batch is 0): when MaskParams::total_q gives the packed row count, batch 0 (or seqlen_q 0)
//   writes O = 0 and LSE = -inf into all total_q rows on every backend, and the CPU backends do
//   the same for the rows past cu_seqlens_q[batch] of any batch. The CUDA kernels leave the rows
//   past a non-empty batch's cu_seqlens_q[batch] as they are (flash-attn's behaviour): the count
//   is in device memory and reading it would synchronize. With total_q = 0 (unknown) no such
//   row is written anywhere.
#pragma once

#include <cstdint>
#include <string>

#include "flashcpp/rope.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp {

/// Head dims: q and k share head_dim, v and o share head_dim_v (AttnParams), and each is any
/// multiple of kHeadDimStep in [kHeadDimStep, kMaxHeadDim] (Phi-3's 96, Phi-2's 80, DeepSeek's
/// 192/128, 16 and 32 for small models).
inline constexpr int kHeadDimStep = 8;
inline constexpr int kMaxHeadDim = 256;
constexpr bool is_supported_head_dim(int d) noexcept {
  return d >= kHeadDimStep && d <= kMaxHeadDim && d % kHeadDimStep == 0;
}

/// The head-dim classes the CUDA kernels are compiled for. The prefill, backward and decode kernels
/// run any supported pair (head_dim, head_dim_v) in the class of the larger (cuda_head_dim_class):
/// columns past a tensor's own head dim load as zeros inside the kernel (TMA out-of-bounds fill on
/// sm90, cp.async zero-fill on sm80 and in decode) and are never stored, so no tensor is copied or
/// padded in memory. (CUDA decode over an fp8 cache takes head dims that are multiples of 16.)
inline constexpr int kCudaHeadDims[] = {64, 128, 256};
constexpr bool is_cuda_head_dim(int d) noexcept {
  for (int c : kCudaHeadDims)
    if (c == d) return true;
  return false;
}
/// The smallest class of kCudaHeadDims that holds both head dims (0 when none does).
constexpr int cuda_head_dim_class(int head_dim, int head_dim_v) noexcept {
  const int d = head_dim > head_dim_v ? head_dim : head_dim_v;
  for (int c : kCudaHeadDims)
    if (c >= d) return c;
  return 0;
}
/// The sm90 (Hopper) prefill kernel's one class of two head dims: 192 for q/k and 128 for v/o
/// (DeepSeek-V2/V3's MLA prefill). Its class id is 192 (cuda_sm90_head_dim_class); the other
/// kernels (sm80 prefill, backward, decode) run such pairs in the 256 class.
inline constexpr int kCudaSm90HeadDim192 = 192, kCudaSm90HeadDimV192 = 128;
/// The sm90 prefill kernel's class for a pair: 192 (the 192 / 128 class) when head_dim is in
/// (128, 192] and head_dim_v <= 128 (zero columns inside the kernel as in every class), else
/// cuda_head_dim_class.
constexpr int cuda_sm90_head_dim_class(int head_dim, int head_dim_v) noexcept {
  if (head_dim > 128 && head_dim <= kCudaSm90HeadDim192 && head_dim_v >= 1 && head_dim_v <= kCudaSm90HeadDimV192)
    return kCudaSm90HeadDim192;
  return cuda_head_dim_class(head_dim, head_dim_v);
}

/// Block-sparse mask in CSR form over (mask_batch, mask_head, query_block).
/// Built on the host by build_block_sparse() (masks.h) or by hand. All arrays live in the
/// memory space of the backend that runs (host memory for the CPU backend).
struct BlockSparseMask {
  int block_m = 0;          ///< query rows per block (> 0)
  int block_n = 0;          ///< key columns per block (> 0)
  int num_batch = 1;        ///< 1 (same mask for every sequence) or batch
  int num_heads = 1;        ///< 1 (same mask for every head) or heads_q
  int num_q_blocks = 0;     ///< ceil(seqlen_q / block_m)
  int num_k_blocks = 0;     ///< ceil(seqlen_k / block_n)
  /// [num_batch * num_heads * num_q_blocks + 1]: row r = (mb * num_heads + mh) * num_q_blocks + qb.
  const std::int32_t* row_ptr = nullptr;
  /// [nnz] key-block index, strictly ascending within a row.
  const std::int32_t* col_idx = nullptr;
  /// [nnz] -1: every element of the block is visible; p >= 0: element mask p decides.
  const std::int32_t* partial = nullptr;
  /// [num_partial][block_m][words_per_row] with words_per_row = ceil(block_n / 64):
  /// bit c of word (c / 64) in row r says key (block_n*kb + c) is visible to query (block_m*qb + r).
  const std::uint64_t* element_masks = nullptr;
  std::int64_t num_partial = 0;  ///< number of element masks (bound for `partial` entries)
};

/// The mask description. Every field defaults to "off".
struct MaskParams {
  bool causal = false;     ///< bottom-right aligned (see the header comment)
  int window_left = -1;    ///< keys at most this far left of ia are visible; -1 = unbounded
  int window_right = -1;   ///< keys at most this far right of ia are visible; -1 = unbounded
  int global_tokens = 0;   ///< G: the first G keys ignore window_left (attention sinks)
  bool global_queries = false;  ///< also let query rows with ia < G ignore the window
  float softcap = 0.f;     ///< > 0: s = softcap * tanh(s / softcap); 0 = off
  /// ALiBi: per-head slopes (fp32), bias slope * (j - ia). nullptr = off.
  /// Indexed slopes[b * alibi_batch_stride + h]; alibi_batch_stride is 0 or heads_q.
  const float* alibi_slopes = nullptr;
  std::int64_t alibi_batch_stride = 0;
  /// Packed variable-length sequences: int32 [batch + 1] prefix sums of the lengths (first 0).
  /// When set, q/k/v/o are (total_tokens, heads, dim) views (batch_stride ignored) and
  /// seqlen_q / seqlen_k of AttnParams are the maximum lengths (used to size the grid).
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  /// Varlen only: the packed rows of q and o (q.shape[0] of a (total, heads, dim) tensor), at
  /// least cu_seqlens_q[batch]; 0 = unknown, taken as cu_seqlens_q[batch]. It is also the LSE's
  /// row count: LSE is (heads_q, total_q), head h's row r at lse[h * total_q + r]. When given,
  /// the rows that no sequence covers are defined (header comment: O = 0, LSE = -inf).
  std::int64_t total_q = 0;
  /// Block-sparse restriction; nullptr = off.
  const BlockSparseMask* block_sparse = nullptr;

  bool is_varlen() const noexcept { return cu_seqlens_q != nullptr || cu_seqlens_k != nullptr; }
  bool has_window() const noexcept { return window_left >= 0 || window_right >= 0; }
};

/// Rotary embedding fused into attention: q and k are rotated as apply_rotary (fused.h) rotates
/// them with the same RotarySpec (rope.h), then attention runs on the rotated q and k (v is not
/// rotated); q and v themselves are not modified. The rotated values enter the scores rounded
/// to the input dtype, exactly as a separate apply_rotary followed by attention gives them;
/// every backend, the fp64 reference included, computes that. Backends: CPU (both) and CUDA
/// (sm80 and sm90 kernels).
///
/// CUDA: the keys are rotated once, by a pre-pass with apply_rotary's kernel, into k_rotated (a
/// caller buffer: attention allocates nothing, and a model stores exactly these keys in its
/// cache); the attention kernel then reads its keys from k_rotated and rotates each q tile in
/// shared memory as it lands, with apply_rotary's arithmetic, so the result equals apply_rotary +
/// attention bit for bit. (Rotating every k tile inside the kernel instead repeats the work once
/// per query block: measured at a tenth of the speed, reports/fused.) The q tiles are rotated in
/// 8-byte pieces: rotary_dim % 8 == 0 for neox, % 4 == 0 for interleaved (Unsupported otherwise).
/// With tables, a position outside [0, max_position) is an error on the CPU backends and NaN
/// rows on CUDA (it cannot read device positions before launching), as for apply_rotary.
///
/// Positions (int32): query row i of sequence b at positions_q[b * seqlen_q + i] (varlen:
/// [total_q], packed like q), key row j at positions_k[b * seqlen_k + j] ([total_k]); null
/// defaults to ia = i + len_k - len_q for queries (bottom-right, the causal alignment) and j for
/// keys, so a prompt with a cached prefix needs no arrays.
struct AttnRotary {
  RotarySpec spec;  ///< style kNone (the default) = off; rotary_dim 0 = head_dim
  const std::int32_t* positions_q = nullptr;
  const std::int32_t* positions_k = nullptr;
  /// Where the rotated keys go: a view with k's dtype and extents ((batch, seqlen_k, heads_kv,
  /// head_dim), or the (total_k, heads_kv, head_dim) rows of a varlen k), its own strides. Required
  /// on CUDA (see above); the CPU backends fill it when it is set. It may be k itself (same data
  /// and strides: k is rotated in place); otherwise it must not overlap q, k, v, o or lse.
  TensorView k_rotated;

  bool enabled() const noexcept { return spec.enabled(); }
};

/// Attention forward problem. Pointers are device pointers for the CUDA backend and host
/// pointers for the CPU backend.
struct AttnParams {
  int batch = 0;
  int seqlen_q = 0;   ///< query rows per sequence (max over sequences when varlen)
  int seqlen_k = 0;   ///< key rows per sequence (max over sequences when varlen)
  int heads_q = 0;
  int heads_kv = 0;   ///< heads_q % heads_kv == 0 (GQA/MQA)
  int head_dim = 0;   ///< of q and k: a multiple of 8 in [8, 256] (is_supported_head_dim)
  int head_dim_v = 0; ///< of v and o: likewise; 0 = head_dim
  TensorView q, k, v; ///< inputs, all of the same dtype; v's last extent is head_dim_v
  /// Output, q's dtype, shaped like q but with head_dim_v; must not overlap the inputs.
  TensorView o;
  /// Optional fp32 log-sum-exp, contiguous (batch, heads_q, seqlen_q); (heads_q, total_q) if
  /// varlen, total_q = mask.total_q, or cu_seqlens_q[batch] when that is 0.
  float* lse = nullptr;
  /// Multiplies q.k; 0 means 1/sqrt(head_dim).
  float softmax_scale = 0.f;
  MaskParams mask;
  AttnRotary rotary;  ///< off by default

  float effective_scale() const noexcept;
  int effective_head_dim_v() const noexcept { return head_dim_v == 0 ? head_dim : head_dim_v; }
  /// The CUDA prefill kernels' class for this problem (cuda_head_dim_class of both head dims).
  int head_dim_class() const noexcept { return cuda_head_dim_class(head_dim, effective_head_dim_v()); }
  /// The sm90 prefill kernel's class (cuda_sm90_head_dim_class: 192 stands for 192 / 128).
  int sm90_head_dim_class() const noexcept { return cuda_sm90_head_dim_class(head_dim, effective_head_dim_v()); }
};

enum class Backend : std::uint8_t {
  kAuto = 0,  ///< CUDA if the pointers are device pointers and a kernel fits, else CPU
  kCpu,       ///< tiled fp32 online-softmax CPU backend
  kCpuReference,  ///< fp64 naive reference (slow; ground truth)
  kCuda,
};
const char* backend_name(Backend b) noexcept;

/// Which implementation runs a problem: a named choice that `flashcpp info` prints.
enum class KernelId : std::uint8_t {
  kNone = 0,
  kCpuReference,  ///< fp64 naive, src/cpu/reference.cc
  kCpuTiled,      ///< fp32 tiled online softmax, src/cpu/tiled.cc
  kCudaSm80,      ///< FA2-style mma.sync kernel (sm80+), src/cuda/prefill/
  kCudaSm90,      ///< FA3-style wgmma/TMA kernel (sm90a)
};
const char* kernel_name(KernelId k) noexcept;

/// The tile config a CUDA prefill kernel runs with. Tuning only: a config changes speed, registers
/// and shared memory, never results beyond fp32 summation order.
struct TileConfig {
  int block_m = 0;  ///< query rows per CTA (sm90: 64 per consumer warpgroup)
  int block_n = 0;  ///< keys per pipeline stage
  int stages = 0;   ///< K/V ring depth
  // sm80 (mma.sync)
  int warps = 0;           ///< warps per CTA
  bool q_in_regs = false;  ///< Q fragments held in registers (else re-read by ldmatrix)
  int min_blocks = 1;      ///< CTAs per SM the register allocation must allow
  // sm90 (wgmma + TMA)
  bool ping_pong = false;   ///< pipelined consumers (Q K^T of block j with P V of block j-1)
  bool sched = false;       ///< with ping_pong: the warpgroups take turns (named barriers)
  bool persistent = false;  ///< persistent CTAs (tile scheduler, TMA-store epilogue)
  /// Lean masks: the consumers apply only the causal and sequence-end masks, so a problem with a
  /// window, attention sinks, softcap, ALiBi, a block-sparse mask or rotary does not fit the config
  /// (the selector knows); the registers the general mask path holds are freed.
  bool lean_mask = false;
  /// sm90: the q/k dims Q K^T covers when below the class's head dim (a twin that serves the head
  /// dims up to it with fewer k-steps); 0 = the class's own.
  int qk_dims = 0;
  friend bool operator==(const TileConfig&, const TileConfig&) = default;
};

/// What select_kernel chose, and what attention_forward runs: the kernel, its tile config (CUDA)
/// and why.
struct KernelChoice {
  KernelId id = KernelId::kNone;
  TileConfig tile;     ///< CUDA kernels: the config that runs; zero for CPU
  std::string config;  ///< its name, e.g. "m128n64w4s2q" or "sm90_m128n128s2p"; empty for CPU
  std::string reason;  ///< one sentence: why this kernel (and config) was chosen
};

struct RunOptions {
  Backend backend = Backend::kAuto;
  Stream stream = nullptr;  ///< CUDA stream (ignored by CPU backends)
  /// CPU backends: > 0 = that many threads (at most one per work item); 0 = choose: up to every
  /// core, fewer for small calls, one for the smallest (src/cpu/parallel.h).
  int cpu_threads = 0;
  /// CPU tiled backend tile sizes (mirror the GPU kernel's BlockM x BlockN); 0 = default 64x64.
  int cpu_block_m = 0, cpu_block_n = 0;
  /// CUDA: "" = automatic (sm90 kernel on Hopper, else sm80 with the tuned table); "sm80" or
  /// "sm90" = that kernel family with its default/tuned config; else an exact config name
  /// (see `flashcpp info`).
  std::string cuda_config;
  /// CUDA decode (decode_run): launch its first kernel with programmatic dependent launch on
  /// sm_90+, so the launch overlaps the tail of the previous kernel on the stream. Each kernel
  /// still waits for the previous grid to finish (griddepcontrol.wait) before it touches memory,
  /// so the results are the same; the gain is the launch gap, inside graphs of PDL-aware kernels
  /// (the engine's decode step). The step's later kernels (split after append, merge) launch
  /// this way on sm_90+ regardless. Ignored before sm_90.
  bool programmatic_launch = false;
};

/// Checks everything that can be checked without touching device memory. Never launches.
Status validate(const AttnParams& p, Backend backend);

/// Chooses the implementation for a problem (validates first).
Status select_kernel(const AttnParams& p, const RunOptions& opt, KernelChoice* out);

/// Validates, selects and runs. CUDA: asynchronous on opt.stream, allocates nothing,
/// never synchronizes (capturable in a CUDA graph). batch 0 or seqlen_q 0: writes nothing,
/// except for varlen with mask.total_q > 0, where all total_q rows get O = 0 and LSE = -inf
/// (on CUDA one small kernel on opt.stream; q, k and v are not read and may be null).
Status attention_forward(const AttnParams& p, const RunOptions& opt = {});

}  // namespace flashcpp
