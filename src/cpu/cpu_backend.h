// CPU backends: the fp64 reference (ground truth) and the tiled fp32 online-softmax backend
// that mirrors the GPU kernels' algorithm. Inputs and outputs are host memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/reference.h"  // RefOutput, reference_attention, merge_by_lse

namespace flashcpp::cpu {

/// Backend::kCpuReference: reference_attention, then writes p.o (rounded to its dtype) and p.lse.
Status reference_forward(const AttnParams& p, const RunOptions& opt);

/// Varlen (host cu_seqlens): the LSE's row count, mask.total_q or cu_seqlens_q[batch] when 0.
std::int64_t varlen_lse_rows(const AttnParams& p);

/// Varlen with mask.total_q > 0: O = 0 and LSE = -inf in the packed rows no sequence covers,
/// [cu_seqlens_q[batch], total_q) (all of them when batch or seqlen_q is 0). Host memory; does
/// nothing otherwise. attention.h states the rule; both CPU backends call this.
void fill_uncovered_rows(const AttnParams& p);

/// Backend::kCpu: Br x Bc tiles, running max m, denominator l, rescaled accumulator O, exp2 with
/// the scale folded in, fp32 throughout, walking the key blocks that MaskRules gives (same as the
/// GPU). Multithreaded over (batch, head, query block).
Status tiled_forward(const AttnParams& p, const RunOptions& opt);

// ---- online softmax primitives (documented in docs/online_softmax.md) -------------------

/// Partial softmax state of one row: running max m (in the exp2 domain of the caller) and
/// denominator l = sum exp2(x - m).
struct SoftmaxState {
  float m = -INFINITY;
  float l = 0.f;
};

/// Plain three-pass softmax of x[0..n) into y (max, exp-sum, normalize). n == 0 is a no-op.
void softmax_plain(const float* x, int n, float* y);
/// One-pass online softmax of x[0..n) into y: the running (m, l) recurrence over the row,
/// then one normalizing pass. Equal to softmax_plain within fp32 rounding.
void softmax_online(const float* x, int n, float* y);

/// Merge two partial states of the same row, each with an unnormalized accumulator o[0..d)
/// (o = sum exp2(x - m) * v). Writes the merged state into (a, o_a). -inf maxima (empty
/// partials) are handled: an empty side contributes nothing.
void merge_states(SoftmaxState* a, float* o_a, const SoftmaxState& b, const float* o_b, int d);

}  // namespace flashcpp::cpu
