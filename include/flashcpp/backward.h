// Attention backward: one parameter struct, one entry point, a workspace-size query, one validator.
//
// Semantics. The forward of attention.h maps (q, k, v) to O (and the LSE); given dL/dO (dout) and,
// optionally, dL/dLSE (dlse), the backward writes dL/dq, dL/dk and dL/dv of exactly that forward,
// with the same MaskParams and softmax_scale. With s(i,j) the score of attention.h (after softcap
// and ALiBi), u = q.k the raw dot product, and P(i,j) = exp(s(i,j) - LSE(i)) on the keys row i sees:
//
//     dP(i,j) = dO(i) . V(j)
//     D(i)    = sum_d dO(i,d) O(i,d) - dLSE(i)            (= sum_j P(i,j) dP(i,j) - dLSE(i))
//     dS(i,j) = P(i,j) (dP(i,j) - D(i))                   (dL/ds; 0 where row i does not see key j)
//     dU(i,j) = dS(i,j) * scale * (1 - tanh^2(scale u / softcap))   (softcap's chain rule; without
//                                                          softcap the last factor is 1)
//     dQ(i)   = sum_j dU(i,j) K(j)
//     dK(j)   = sum_i dU(i,j) Q(i)      summed over the query heads of key j's KV head (GQA)
//     dV(j)   = sum_i P(i,j) dO(i)      likewise
//
// ALiBi's bias does not depend on q or k: it gets no gradient (nor do its slopes). The dLSE term
// makes the LSE output differentiable too (ring attention and cascades combine results by it).
//
// What is read and what is written. q, k, v, o (the forward's output), dout, lse (the forward's
// LSE) and dlse are read; dq, dk, dv and the workspace are written, nothing else. Every element of
// dq (q's rows), dk and dv (k's rows) that belongs to a sequence is written, with 0 where no
// gradient flows (a query row that sees no key, a key no row sees, all keys when seqlen_q is 0,
// all query rows when seqlen_k is 0). Varlen rows that no sequence covers (past cu_seqlens[batch])
// get 0 when their count is known (MaskParams::total_q for dq, AttnBackwardParams::total_k for dk
// and dv); with total_q / total_k = 0 they are left as they are.
//
// NaN. A NaN reaches the gradients along the pairs (i, j) that row i sees, as the formulas say.
// The fp64 reference follows those pairs only. The tiled CPU backend and the kernels multiply
// zero weights by whole tiles (0 * NaN = NaN), so a NaN can also reach gradients through pairs a
// mask hides inside a visited tile; there it is unspecified (the forward's rule for v, attention.h).
// A query row whose every key is visible has no hidden pair: a NaN in its q or dout reaches its dq,
// every dk and dv of the (sequence, KV head), and nothing else.
//
// Rotary (AttnParams::rotary) has no backward here: rotate q and k with apply_rotary (fused.h)
// before attention and differentiate through that rotation (it is linear: its transpose is the
// rotation by the opposite angle).
//
// Backends. Backend::kCpuReference (fp64, src/cpu/reference_backward.cc: recomputes P and D
// exactly from q, k, v and dout and reads neither o nor lse; the ground truth), Backend::kCpu (fp32
// tiled, src/cpu/tiled_backward.cc: the GPU kernels' algorithm and block walk), Backend::kCuda (fp16
// and bf16, src/cuda/backward: a preprocess, the mma.sync main kernel on sm80 and newer, a
// postprocess; the sm80 kernel family's build switch holds it). DType::kF64 runs on Backend::kCpuReference only (torch.autograd.gradcheck).
//
// The algorithm a kernel runs (docs/backward.md): a preprocess writes D and the LSE in exp2 units
// into the workspace and zeroes the dQ accumulator; the main pass walks key tiles (one work item
// per (sequence, KV head, key tile): dK and dV of the tile stay in registers across the query
// tiles of the group's heads that see the tile), recomputes P = exp2(u c - LSE log2 e) with the
// forward's score transform, and adds each (query tile, key tile)'s dS K into the fp32 dQ
// accumulator; a postprocess writes dQ = scale * accumulator in the output dtype. Deterministic
// mode orders those additions (see `deterministic`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp {

/// Attention backward problem. Pointers are device pointers for CUDA and host pointers for the CPU
/// backends. Shapes and layouts are AttnParams' (attention.h): q and dq are (batch, seqlen_q,
/// heads_q, head_dim) views (varlen: (total_q, heads_q, head_dim)), o and dout the same with
/// head_dim_v; k and dk are (batch, seqlen_k, heads_kv, head_dim) views (varlen: (total_k,
/// heads_kv, head_dim)), v and dv the same with head_dim_v; every view has its own strides. All
/// eight share one dtype.
struct AttnBackwardParams {
  int batch = 0;
  int seqlen_q = 0;   ///< query rows per sequence (max over sequences when varlen)
  int seqlen_k = 0;   ///< key rows per sequence (max over sequences when varlen)
  int heads_q = 0;
  int heads_kv = 0;   ///< heads_q % heads_kv == 0; dk and dv sum the group's query heads
  int head_dim = 0;   ///< of q and k: a multiple of 8 in [8, 256] (is_supported_head_dim)
  int head_dim_v = 0; ///< of v and o: likewise; 0 = head_dim
  TensorView q, k, v; ///< the forward's inputs (read)
  TensorView o;       ///< the forward's output (read)
  TensorView dout;    ///< dL/dO (read), o's shape
  /// The forward's fp32 LSE (read; required), AttnParams::lse's layout: contiguous (batch, heads_q,
  /// seqlen_q), or (heads_q, total_q) when varlen.
  const float* lse = nullptr;
  /// Optional fp32 dL/dLSE in lse's layout (read); nullptr = 0.
  const float* dlse = nullptr;
  TensorView dq;      ///< dL/dq (written), q's shape; must not overlap anything else
  TensorView dk, dv;  ///< dL/dk, dL/dv (written), k's and v's shapes
  /// Multiplies q.k; 0 means 1/sqrt(head_dim). The forward's value.
  float softmax_scale = 0.f;
  MaskParams mask;    ///< the forward's mask (every field of attention.h applies)
  /// Varlen only: the packed rows of k, v, dk and dv (k.shape[0]); 0 = unknown. When given, the rows
  /// past cu_seqlens_k[batch] get dk = dv = 0 (the header comment).
  std::int64_t total_k = 0;
  /// Bitwise-repeatable gradients, dQ included: the dQ accumulator receives each query tile's
  /// contributions in one fixed order of key tiles (ascending), whatever the thread or CTA timing.
  /// Costs waiting (a key tile's work item waits for the previous key tile's addition to each
  /// query tile it shares); dK and dV are repeatable in either mode (one work item owns a key tile).
  bool deterministic = false;
  /// Scratch of attention_backward_workspace_size() bytes (CPU tiled backend and CUDA; the fp64
  /// reference needs none), 256-byte aligned, in the backend's memory. Its contents on entry do
  /// not matter (the preprocess initializes what it uses); the layout is BackwardWorkspaceLayout.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;

  float effective_scale() const noexcept;
  int effective_head_dim_v() const noexcept { return head_dim_v == 0 ? head_dim : head_dim_v; }
  /// The forward problem these gradients belong to (o as its output, lse as its LSE, no rotary):
  /// what validation and kernel selection see of the shared fields.
  AttnParams forward() const;
};

/// Where the workspace's parts lie (bytes from its start; each part 256-byte aligned). Rows are
/// padded per sequence to whole query tiles of `row_pad` rows (the backend's tile height), so a
/// kernel reads and adds whole tiles without bounds checks: sequence b's row i lives at padded row
/// start(b) + i, start(b) = floor((first_q(b) + b row_pad) / row_pad) row_pad, first_q(b) its first
/// packed row (b * seqlen_q, or cu_seqlens_q[b] when varlen).
struct BackwardWorkspaceLayout {
  int row_pad = 0;             ///< query tile height the padding is for (0: no workspace)
  std::int64_t rows = 0;       ///< padded rows per head
  std::size_t delta = 0;       ///< fp32 [heads_q][rows]: D = rowsum(dO * O) - dLSE (0 for empty rows)
  std::size_t lse_log2 = 0;    ///< fp32 [heads_q][rows]: LSE * log2(e), +inf for empty rows (P = 0)
  std::size_t dq_accum = 0;    ///< fp32 [heads_q][rows][head_dim]: sum over key tiles of dS K (unscaled)
  std::size_t semaphores = 0;  ///< int32 [heads_q][rows / row_pad]: key tiles added (deterministic)
  std::size_t bytes = 0;       ///< total (0: the backend needs no workspace)
};

/// Checks everything that can be checked without touching device memory (the forward's checks
/// for the shared fields, then dout, dlse, dq, dk, dv, total_k and the aliasing of the outputs).
/// Never launches. One sentence per error. The workspace is checked by attention_backward, which
/// knows its size (non-null, 256-byte aligned, at least that size, not overlapping anything).
Status validate_backward(const AttnBackwardParams& p, Backend backend);

/// Chooses the implementation (validates first; workspace not checked). CUDA: the mma.sync backward
/// (KernelId::kCudaSm80, src/cuda/backward) for fp16 and bf16 with a positive scale.
Status select_backward_kernel(const AttnBackwardParams& p, const RunOptions& opt, KernelChoice* out);

/// The workspace attention_backward needs with these params and options (validates and selects
/// first; the workspace fields themselves are not checked). *layout (optional) receives the layout.
Status attention_backward_workspace_size(const AttnBackwardParams& p, const RunOptions& opt, std::size_t* bytes,
                                         BackwardWorkspaceLayout* layout = nullptr);

/// Validates, selects and runs. CUDA (when it lands): asynchronous on opt.stream, allocates
/// nothing, never synchronizes. The CPU tiled backend runs on opt.cpu_threads threads with
/// opt.cpu_block_m x opt.cpu_block_n tiles (default 64 x 64).
Status attention_backward(const AttnBackwardParams& p, const RunOptions& opt = {});

namespace cpu {

/// The fp64 gradients in packed order, for the harness and the tests: dq (total_q, heads_q,
/// head_dim), dk (total_k, heads_kv, head_dim) and dv (total_k, heads_kv, head_dim_v), rows as
/// cpu::RefOutput orders them
/// (b * seqlen + i, or cu_seqlens[b] + i when varlen).
struct RefGrads {
  std::vector<double> dq, dk, dv;
  std::int64_t total_q = 0, total_k = 0;
};

/// The fp64 reference backward (validated params, host memory): P and D recomputed exactly from
/// q, k, v and dout (o and lse are not read), the mask element by element from attention.h's rules.
/// Multithreaded over (batch, KV head). `delta_from_o`: D = dO . o from the given o (read in its
/// dtype) instead, as the kernels compute it; the harness uses the two to bound what o's rounding
/// alone moves the gradients.
Status reference_attention_backward(const AttnBackwardParams& p, RefGrads* out, int threads = 0,
                                    bool delta_from_o = false);

}  // namespace cpu
}  // namespace flashcpp
