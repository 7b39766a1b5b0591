// The sampling rule of SampleArgs (flashcpp/engine.h) on the host; the CUDA kernel
// (src/cuda/engine/sample_kernel.cuh) implements the same rule.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "flashcpp/engine.h"

namespace flashcpp::engine {

/// One row: greedy (lowest index of the maximum) or temperature + top-p with the uniform u.
inline int sample_row_host(const float* logits, int vocab, const SampleArgs& a, float u) {
  int best = 0;
  for (int i = 1; i < vocab; ++i)
    if (logits[i] > logits[best] || (std::isnan(logits[i]) && !std::isnan(logits[best]))) best = i;
  if (a.temperature <= 0.f) return best;
  const float inv_t = 1.f / a.temperature, mx = logits[best];
  std::vector<float> p(vocab);
  double total = 0.0;
  for (int i = 0; i < vocab; ++i) total += p[i] = std::exp((logits[i] - mx) * inv_t);
  for (auto& x : p) x = static_cast<float>(x / total);
  // t*: the largest probability value whose kept set {p >= t*} has mass >= top_p.
  float thresh = 0.f;
  if (a.top_p < 1.f) {
    std::vector<float> s(p);
    std::sort(s.begin(), s.end(), std::greater<float>());
    double mass = 0.0;
    for (float x : s) {
      mass += x;
      thresh = x;
      if (mass >= a.top_p) break;
    }
  }
  double kept = 0.0;
  for (float x : p) if (x >= thresh) kept += x;
  const double target = static_cast<double>(u) * kept;
  double acc = 0.0;
  int last = best;
  for (int i = 0; i < vocab; ++i) {
    if (p[i] < thresh) continue;
    acc += p[i];
    last = i;
    if (acc > target) return i;
  }
  return last;
}

}  // namespace flashcpp::engine
