// The ground truths the correctness harness and the tests compare against: the fp64 CPU
// reference (every mask of MaskParams, element by element from the rules in attention.h), the fp64
// GPU reference for long sequences, the LSE merge rule of split-KV attention, and the rotary of
// attention as the CPU backends apply it (for a reference that reads q and k as given). Not for
// speed.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "flashcpp/attention.h"

namespace flashcpp::cpu {

/// Output of the fp64 reference, in double so the harness can measure errors of any dtype.
///   o:   (total_q, heads_q, head_dim_v) with total_q = batch*seqlen_q (or cu_seqlens_q[batch])
///   lse: (heads_q, total_q) natural log; -inf for rows that see no key
/// Rows are in the packed order (b * seqlen_q + i, or cu_seqlens_q[b] + i when varlen).
struct RefOutput {
  std::vector<double> o;
  std::vector<double> lse;
  std::int64_t total_q = 0;
};

/// Naive fp64 attention with every mask of MaskParams, evaluated element by element from the
/// rules in attention.h. Multithreaded over (batch, head). Reads p.q/p.k/p.v (any dtype, host)
/// as given: with p.rotary on, call it through run_with_rotary.
Status reference_attention(const AttnParams& p, RefOutput* out, int threads = 0);

/// Attention's rotary (AttnParams::rotary, attention.h) exactly as the CPU backends apply it, for
/// a reference or a plain implementation that reads q and k as given: runs `run` on p, or with
/// p.rotary on, on a copy of p whose q and k are host copies rotated by the CPU apply_rotary (in
/// the input dtype, the rounding the kernels' scores see) and whose rotary is off; afterwards
/// stores the rotated k in rotary.k_rotated when that is set. Rotates with opt.cpu_threads
/// threads. Host memory only.
Status run_with_rotary(const AttnParams& p, const RunOptions& opt, const std::function<Status(const AttnParams&)>& run);

/// Merge two normalized partial outputs by their natural-log LSEs (the split-KV / cascade rule):
///   lse = log(exp(lse_a) + exp(lse_b)); o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse).
/// Both -inf gives o = 0, lse = -inf.
void merge_by_lse(const float* o_a, float lse_a, const float* o_b, float lse_b, int d, float* o,
                  float* lse);

}  // namespace flashcpp::cpu

namespace flashcpp::cuda {

/// fp64 ground truth on the GPU: per (sequence, head) fp64 DGEMMs around an fp64 masked softmax
/// kernel; every mask of MaskParams except block_sparse. Outputs (device memory) in packed order
/// like cpu::RefOutput: o_f64 (total_q, heads_q, head_dim_v), lse_f64 (heads_q, total_q).
/// Allocates scratch and synchronizes `stream`: a test utility, not for graph capture. Defined in
/// CUDA builds only (callers guard with FLASHCPP_WITH_CUDA).
Status reference_attention_f64(const AttnParams& p, double* o_f64, double* lse_f64, Stream stream);

}  // namespace flashcpp::cuda
