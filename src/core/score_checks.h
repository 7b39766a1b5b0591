// The check that attention and decode validation share on the score transform: softcap and ALiBi
// are kept in raw q.k units (common/attention_algebra.h), i.e. divided by |softmax_scale|, which
// must stay finite.
#pragma once

#include <string>

#include "common/attention_algebra.h"
#include "core/message.h"
#include "flashcpp/status.h"

namespace flashcpp {

/// Unsupported when softcap or ALiBi is on and cap / |scale| or 1 / |scale| overflows fp32 (a
/// scale below ~3e-39); `scale` is the effective (non-zero, finite) softmax scale.
inline Status check_score_units(float scale, float softcap, bool alibi) {
  if (!(softcap > 0.f || alibi)) return Status::Ok();
  if (algebra::ScoreTransform::make(scale, softcap).raw_units_finite()) return Status::Ok();
  return Status::Unsupported(detail::cat("softcap or ALiBi with softmax_scale ", static_cast<double>(scale),
                                 ": the kernels keep scores in units of 1/|softmax_scale| (the cap and the slopes are "
                                 "divided by it), which overflow fp32 at this scale"));
}

}  // namespace flashcpp
