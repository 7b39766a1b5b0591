// How the tiled CPU backends (tiled.cc, the forward; tiled_backward.cc, the backward) turn a dot
// product into a score: the kernels' rule (common/attention_algebra.h), sign and scale, softcap,
// then ALiBi with the (batch, head)'s slope in raw units. One copy, so that the forward and the
// backward recompute the same P.
#pragma once

#include "common/attention_algebra.h"
#include "flashcpp/attention.h"

namespace flashcpp::cpu {

struct Logits {
  algebra::ScoreTransform score;
  bool softcap = false, alibi = false;
  float slope_raw = 0.f;

  /// For AttnParams or AttnBackwardParams (their mask and effective_scale() mean the same).
  template <class Params>
  static Logits make(const Params& p, int b, int h) {
    Logits g;
    const MaskParams& m = p.mask;
    g.score = algebra::ScoreTransform::make(p.effective_scale(), m.softcap);
    g.softcap = m.softcap > 0.f;
    g.alibi = m.alibi_slopes != nullptr;
    if (g.alibi) g.slope_raw = g.score.slope_raw(m.alibi_slopes[b * m.alibi_batch_stride + h]);
    return g;
  }
  /// The transformed score of dot product s, query position ia (bottom-right aligned), key j.
  float operator()(float s, int ia, int j) const {
    const float u = score.raw(s);
    return with_alibi(softcap ? score.softcap(u) : u, ia, j);
  }
  /// ALiBi's bias added to a score already scaled and softcapped (the backward keeps the scaled u
  /// for the softcap's chain rule).
  float with_alibi(float t, int ia, int j) const {
    return alibi ? algebra::alibi(t, slope_raw, static_cast<float>(j - ia)) : t;
  }
};

}  // namespace flashcpp::cpu
