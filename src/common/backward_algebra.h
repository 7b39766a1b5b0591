// The backward's arithmetic on top of the attention algebra (attention_algebra.h): the row terms the
// preprocess writes (D and the LSE in exp2 units), P recomputed from the LSE, dS, and softcap's
// chain rule. The tiled CPU backward calls these; a GPU backward kernel calls the same functions
// (device: the fast instructions; host: exact in double, rounded once), so the CPU backend checks
// the kernels' rules, not a copy of them. docs/backward.md derives them.
//
// Units. Scores stay in the forward's raw units: t is ScoreTransform's output for a raw score
// u = sign * q.k (softcap, then ALiBi), and the forward's P is exp2(t c - m c) / l with
// LSE = (m c + log2 l) ln 2. So P = exp2(t c - LSE log2 e): one FFMA and one MUFU.EX2 per element
// with the row's LSE taken into exp2 units once (lse_log2), the same exponent RowSoftmax uses.
#pragma once

#include <cmath>

#include "common/attention_algebra.h"
#include "common/hd.h"

namespace flashcpp::algebra {

/// A row's LSE in exp2 units for backward_p: LSE * log2(e) (one fp32 multiply, host and device
/// alike: the preprocess stores this value), +inf for an empty row (LSE = -inf) so that every P of
/// the row is exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN. A NaN LSE stays NaN (NaN rows stay
/// NaN, attention.h).
FC_HD float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

/// D of a row: rowsum(dO * O) - dLSE, or 0 for an empty row (LSE = -inf: the row's P is 0
/// everywhere, so D multiplies nothing, and a dLSE of any value must not turn 0 * (dP - D) into NaN).
FC_HD float row_delta(float do_dot_o, float dlse, float lse) { return lse == -INFINITY ? 0.f : do_dot_o - dlse; }

/// P = exp2(t c - lse2) for a transformed score t (raw units; -inf where masked) and lse2 =
/// lse_log2(LSE). Device: one FFMA and one MUFU.EX2. Host: the exponent in double, rounded once.
FC_HD float backward_p(float t, float c, float lse2) {
#if defined(__CUDA_ARCH__)
  return exp2_fast(fmaf(t, c, -lse2));
#else
  return static_cast<float>(std::exp2(static_cast<double>(t) * static_cast<double>(c) - static_cast<double>(lse2)));
#endif
}

/// dS = P (dP - D): the gradient of the loss with respect to the score s of attention.h.
FC_HD float backward_ds(float p, float dp, float delta) { return p * (dp - delta); }

/// Softcap's chain rule: d/du of cap tanh(u / cap) (raw units) = 1 - tanh^2(u / cap), for the raw
/// score u before the cap (ScoreTransform::raw of the dot product). Device: tanh from the same two
/// MUFU operations as ScoreTransform::softcap, then one FFMA. Host: tanh in double.
FC_HD float softcap_grad(const ScoreTransform& st, float u) {
#if defined(__CUDA_ARCH__)
  const float th = fmaf(-2.f, rcp_fast(1.f + exp2_fast(u * st.cap_k)), 1.f);
  return fmaf(-th, th, 1.f);
#else
  const double th = std::tanh(static_cast<double>(u) / static_cast<double>(st.cap));
  return static_cast<float>(1.0 - th * th);
#endif
}

}  // namespace flashcpp::algebra
