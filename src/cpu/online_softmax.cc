// The online-softmax primitives on their own, small enough to test exhaustively. The derivation
// (recurrence, invariant, worked example, merge rules) is in docs/online_softmax.md; the tiled
// backend (tiled.cc) and the GPU kernels run the same recurrence a tile at a time.
//
// A row whose every entry is -inf has no mass at all: softmax_plain/softmax_online write 0 there
// (the attention convention for a row that sees no key), never NaN. A NaN entry makes the whole
// row NaN, as torch.softmax does. Both come from one rule, applied at the end: the row is empty
// when its sum l is 0, not when its max is -inf. The max never becomes NaN (std::max keeps its
// first argument when a comparison with NaN is false), so a row whose only finite-looking
// entries are NaN keeps m = -inf; its terms exp2(NaN - 0) are NaN, l is NaN, and testing l
// (rather than m) lets that NaN reach the output instead of being mistaken for an empty row.
//
// The recurrence itself is common/attention_algebra.h's (RowSoftmax), which the GPU kernels and
// the tiled backend use too; on the host it takes the exponent of a difference, (x - m) * log2(e),
// so the max's own term is exactly exp2(0) = 1 at any magnitude.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/attention_algebra.h"
#include "cpu/cpu_backend.h"

namespace flashcpp::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kPairwiseLeaf = 8;  // below this many terms a plain loop is as accurate

/// Pairwise sum: the rounding error grows like log2(n), not like n as in a running sum.
float pairwise_sum(const float* a, int n) {
  if (n <= kPairwiseLeaf) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += a[i];
    return s;
  }
  const int half = n / 2;
  return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

}  // namespace

// Row sums, and why neither function uses a plain running sum: adding n terms one at a time
// into an fp32 accumulator rounds at every step by up to half an ulp of the running total, so
// the relative error of the sum grows like sqrt(n) * 2^-24 (measured: ~2e-6 at n = 4097 when
// one entry dominates and thousands of small ones follow). softmax_plain sums pairwise;
// softmax_online, which sees one element at a time, carries a Kahan compensation term that it
// rescales together with l. The kernels get the same effect by summing each tile pairwise.

void softmax_plain(const float* x, int n, float* y) {
  if (n <= 0) return;
  float m = kNegInf;
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  const float m_use = m == kNegInf ? 0.f : m;  // all -inf (or NaN): exp(-inf - 0) = 0, exp(NaN) = NaN
  for (int i = 0; i < n; ++i) y[i] = std::exp(x[i] - m_use);
  const float sum = pairwise_sum(y, n);
  if (sum == 0.f) {  // every entry -inf: no mass (a NaN entry makes sum NaN, not 0)
    std::fill(y, y + n, 0.f);
    return;
  }
  for (int i = 0; i < n; ++i) y[i] /= sum;
}

void softmax_online(const float* x, int n, float* y) {
  if (n <= 0) return;
  // The kernels' recurrence (common/attention_algebra.h's RowSoftmax) one element at a time, in
  // natural units: c = log2(e), so p = exp2(x c - m c) = e^(x - m). On the host RowSoftmax takes
  // the difference x - m first (exact), so the max's own term is exactly 1 at any magnitude.
  constexpr float c = algebra::kLog2e;
  algebra::RowSoftmax row;
  float carry = 0.f;  // Kahan compensation of row.l (the low part lost so far), rescaled with it
  for (int i = 0; i < n; ++i) {
    if (x[i] == kNegInf) continue;  // contributes exp(-inf) = 0
    // A NaN x never moves the max (std::max keeps m): its term, and so l, is NaN.
    const float corr = row.rescale(std::max(row.m, x[i]), c);  // exactly 1 unless the max moved
    row.l *= corr;
    carry *= corr;
    const float term = row.p(x[i], c, row.offset(c)) - carry;
    const float next = row.l + term;
    carry = (next - row.l) - term;
    row.l = next;
  }
  if (row.l == 0.f) {  // every entry -inf (a NaN entry leaves l NaN, never 0)
    std::fill(y, y + n, 0.f);
    return;
  }
  for (int i = 0; i < n; ++i) y[i] = row.p(x[i], c, row.offset(c)) / row.l;
}

void merge_states(SoftmaxState* a, float* o_a, const SoftmaxState& b, const float* o_b, int d) {
  // Emptiness is l == 0 (m = -inf with l = NaN is a side that saw a NaN score, which must spread).
  if (b.l == 0.f) return;  // b saw nothing
  if (a->l == 0.f) {       // a saw nothing: the merge is b
    *a = b;
    std::copy(o_b, o_b + d, o_a);
    return;
  }
  // The states are in the exp2 domain: the partial-state rule with c = 1 (one weight is exactly 1).
  const float m = std::max(a->m, b.m);
  const float ca = algebra::partial_weight(a->m, m, 1.f), cb = algebra::partial_weight(b.m, m, 1.f);
  a->l = a->l * ca + b.l * cb;
  for (int i = 0; i < d; ++i) o_a[i] = o_a[i] * ca + o_b[i] * cb;
  a->m = m;
}

void merge_by_lse(const float* o_a, float lse_a, const float* o_b, float lse_b, int d, float* o,
                  float* lse) {
  float wa, wb, merged;
  algebra::merge_two(lse_a, lse_b, &wa, &wb, &merged);
  // A zero weight (an empty side) is skipped, not multiplied: its o is 0 by convention, but NaN
  // garbage there must not leak. o may alias o_a or o_b.
  for (int i = 0; i < d; ++i) {
    float v = 0.f;
    if (wa != 0.f) v = o_a[i] * wa;
    if (wb != 0.f) v = std::fma(o_b[i], wb, v);
    o[i] = v;
  }
  *lse = merged;
}

}  // namespace flashcpp::cpu
