#pragma once
// The GEMV's row grouping, a host-side rule (CPU-tested; the kernel is in ops_cuda.cu).

namespace flashcpp::engine {

/// Output rows per CTA iteration of the batch-1/2 GEMV: 4, or 2 where that leaves clearly less
/// wave-quantization idle. The grid is one wave of `slots` CTAs striding over ceil(n / rows)
/// groups, so a CTA streams ceil(groups / slots) * rows rows at most, and the step waits for that
/// CTA: with n = 2048 (o_proj, down_proj of a 1B Llama) and 396 slots (132 SMs x 3), 4-row
/// groups give 512 groups, 116 CTAs with two of them, 8 rows on the critical path; 2-row groups
/// give 6. Rows of 2 halve the loads a lane has in flight per iteration, so they are taken only
/// when they cut the critical path by at least 10%.
inline int gemv_rows_per_group(int n, int slots) {
  if (n <= 0 || slots <= 0) return 4;
  auto critical = [&](int rows) { return (static_cast<long long>(n + rows - 1) / rows + slots - 1) / slots * rows; };
  return critical(2) * 10 <= critical(4) * 9 ? 2 : 4;
}

}  // namespace flashcpp::engine
