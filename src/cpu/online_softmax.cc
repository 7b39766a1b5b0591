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
// The exponent is taken of a difference, (x - m) * log2(e), never of fma(x, log2e, -m*log2e):
// x - m is exact for every x within a factor 2 of m and the max's own term is exactly
// exp2(0) = 1 at any magnitude. The fma form exponentiates the rounding residual of m*log2e,
// which exceeds 128 once |m*log2e| >= 2^31 and then overflows exp2 (or flushes it to 0).
#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/cpu_backend.h"

namespace flashcpp::cpu {
namespace {

constexpr float kLog2e = 1.44269504088896340736f;  // log2(e)
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
  // As in the tiled backend: the max m is kept in the units of x and every exponent is
  // exp2((x - m) * log2e), so the max's own term is exactly 1 and no exponent exceeds 0.
  float m = kNegInf;
  float l = 0.f, carry = 0.f;  // l and its Kahan compensation (the low part lost so far)
  for (int i = 0; i < n; ++i) {
    if (x[i] == kNegInf) continue;  // contributes exp(-inf) = 0
    if (x[i] > m) {  // new max: rescale what was summed so far (0 * anything while l == 0)
      const float alpha = std::exp2((m - x[i]) * kLog2e);
      l *= alpha;
      carry *= alpha;
      m = x[i];
    }
    // A NaN x fails the comparison above and lands here: its term, and so l, is NaN.
    const float term = std::exp2((x[i] - (m == kNegInf ? 0.f : m)) * kLog2e) - carry;
    const float next = l + term;
    carry = (next - l) - term;
    l = next;
  }
  if (l == 0.f) {  // every entry -inf (a NaN entry leaves l NaN, never 0)
    std::fill(y, y + n, 0.f);
    return;
  }
  const float m_use = m == kNegInf ? 0.f : m;
  for (int i = 0; i < n; ++i) y[i] = std::exp2((x[i] - m_use) * kLog2e) / l;
}

void merge_states(SoftmaxState* a, float* o_a, const SoftmaxState& b, const float* o_b, int d) {
  // Emptiness is l == 0 (m = -inf with l = NaN is a side that saw a NaN score, which must spread).
  if (b.l == 0.f) return;  // b saw nothing
  if (a->l == 0.f) {       // a saw nothing: the merge is b
    *a = b;
    std::copy(o_b, o_b + d, o_a);
    return;
  }
  const float m = std::max(a->m, b.m);
  const float m_use = m == kNegInf ? 0.f : m;  // both m = -inf: both sides are NaN already
  const float ca = std::exp2(a->m - m_use), cb = std::exp2(b.m - m_use);  // one of them is exactly 1
  a->l = a->l * ca + b.l * cb;
  for (int i = 0; i < d; ++i) o_a[i] = o_a[i] * ca + o_b[i] * cb;
  a->m = m;
}

void merge_by_lse(const float* o_a, float lse_a, const float* o_b, float lse_b, int d, float* o,
                  float* lse) {
  if (lse_a == kNegInf && lse_b == kNegInf) {  // neither side saw a key
    std::fill(o, o + d, 0.f);
    *lse = kNegInf;
    return;
  }
  // An empty side contributes nothing; skip it explicitly so that whatever its o holds (it is
  // 0 by convention, but NaN garbage must not leak either) is never multiplied in.
  if (lse_a == kNegInf || lse_b == kNegInf) {
    const float* src = lse_a == kNegInf ? o_b : o_a;
    const float kept = lse_a == kNegInf ? lse_b : lse_a;
    for (int i = 0; i < d; ++i) o[i] = src[i];  // o may alias src
    *lse = kept;
    return;
  }
  // hi and lo by one comparison, which is false when either is NaN: then a NaN lands in hi or lo
  // and so in the merged LSE (std::max / std::min would drop a NaN second argument).
  const bool a_hi = lse_a > lse_b;
  const float hi = a_hi ? lse_a : lse_b, lo = a_hi ? lse_b : lse_a;
  // log(e^a + e^b) = hi + log1p(e^(lo - hi)), which cannot overflow.
  const float merged = hi + std::log1p(std::exp(lo - hi));
  const float wa = std::exp(lse_a - merged), wb = std::exp(lse_b - merged);
  for (int i = 0; i < d; ++i) o[i] = o_a[i] * wa + o_b[i] * wb;  // o may alias o_a or o_b
  *lse = merged;
}

}  // namespace flashcpp::cpu
