#pragma once
// The GEMV's row grouping, a host-side rule (CPU-tested; the kernel is gemv_kernel.cuh, its
// launcher gemv.cu).

namespace flashcpp::cuda::engine {

/// Output rows per CTA iteration of the batch-1/2 GEMV: 4, or 2 where that leaves clearly less
/// wave-quantization idle. The grid is one wave of `slots` CTAs striding over ceil(n / rows)
/// groups, so a CTA streams ceil(groups / slots) * rows rows at most, and the step waits for that
/// CTA: with n = 2048 (o_proj, down_proj of a 1B Llama) and 396 slots (132 SMs x 3), 4-row
/// groups give 512 groups, 116 CTAs with two of them, 8 rows on the critical path; 2-row groups
/// give 6. Rows of 2 halve the loads a lane has in flight per iteration, so they are taken only
/// when they cut the critical path by at least 10%.
/// The slowest CTA's work in half-rows of K: groups per CTA (per cluster of `ksplit` CTAs) x rows
/// x (2 / ksplit). `slots` > 0 CTAs in one wave.
inline long long gemv_critical_half_rows(int n, int slots, int rows, int ksplit) {
  const long long units = slots / ksplit;
  if (units <= 0) return 1LL << 62;
  return (static_cast<long long>(n + rows - 1) / rows + units - 1) / units * rows * (2 / ksplit);
}

inline int gemv_rows_per_group(int n, int slots) {
  if (n <= 0 || slots <= 0) return 4;
  return gemv_critical_half_rows(n, slots, 2, 1) * 10 <= gemv_critical_half_rows(n, slots, 4, 1) * 9 ? 2 : 4;
}

/// Row grouping and K split of the batch-1/2 GEMV. ksplit 2 (sm_90, a cluster of two CTAs per row
/// group, each streaming half of K; the second adds its row sums into the first's shared memory):
/// the same balance as 2-row groups (n 2048: 6 rows' worth on the critical path instead of 8) with
/// every lane keeping 4 rows of loads in flight, which 2-row groups halve (they made the down
/// projection alone 192 -> 217 us). Only where each lane still streams >= 2 chunks of a row in its
/// half (K >= 8192 with 256 threads: the down projection) and the prologue needs no whole-row sum
/// (`can_split_k`: no RMSNorm).
struct GemvGrouping {
  int rows = 4;
  int ksplit = 1;
};

inline GemvGrouping gemv_grouping(int n, int k, int slots, bool can_split_k) {
  if (n <= 0 || slots <= 0) return {};
  const long long base = gemv_critical_half_rows(n, slots, 4, 1);
  if (can_split_k && k % 16 == 0 && k / 16 >= 2 * 256 && gemv_critical_half_rows(n, slots, 4, 2) * 10 <= base * 9)
    return {4, 2};
  return {gemv_rows_per_group(n, slots), 1};
}

}  // namespace flashcpp::cuda::engine
