// The position in a ring of shared-memory stages guarded by mbarriers (sm90 kernels): which stage
// a use lands in and which phase parity of that stage's barriers it waits for. Every role that
// walks the ring (the producer filling it, each consumer draining it) counts its uses in one
// PipelineState, across tiles too, so their positions agree without any other bookkeeping.
#pragma once

#include <cstdint>

namespace flashcpp::cuda {

/// Use number `count` of a ring of Stages stages: stage count % Stages, barrier phase parity
/// (count / Stages) & 1 (each stage's barriers complete one phase per pass over the ring). One
/// counter, not a (stage, phase) pair: the ping-pong consumer looks at two neighbouring uses at
/// once and has no registers to spare, and with Stages a power of two the two fields are a mask
/// and a shift of it.
template <int Stages>
struct PipelineState {
  static_assert(Stages > 0 && (Stages & (Stages - 1)) == 0, "a power-of-two ring");
  std::uint32_t count = 0;

  __device__ __forceinline__ int stage() const { return static_cast<int>(count % Stages); }
  /// Parity of the phase a consumer of this use waits for (its barrier's "full" phase).
  __device__ __forceinline__ std::uint32_t phase() const { return (count / Stages) & 1u; }
  /// Parity a producer waits for before refilling this use's stage ("empty" barrier): the phase
  /// before, so the first pass over the ring does not wait.
  __device__ __forceinline__ std::uint32_t empty_phase() const { return phase() ^ 1u; }
  /// The use `n` positions after this one.
  __device__ __forceinline__ PipelineState operator+(std::uint32_t n) const { return PipelineState{count + n}; }
  __device__ __forceinline__ PipelineState& operator+=(std::uint32_t n) {
    count += n;
    return *this;
  }
  __device__ __forceinline__ PipelineState& operator++() {
    ++count;
    return *this;
  }
};

}  // namespace flashcpp::cuda
