// A kernel timeline from CUPTI's activity API: every kernel that runs between begin() and end(),
// CUDA-graph nodes included, with its device start and end timestamps. `flashcpp decode --trace`
// uses it to split a decode step's wall time into launch gaps and kernel time per kernel, in the
// graph itself (the per-op figures of the decode report time each op alone).
//
// Built when CMake finds CUPTI (FLASHCPP_HAS_CUPTI); otherwise begin() says so.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashcpp/status.h"

namespace flashcpp::harness {

struct KernelRecord {
  std::string name;              ///< demangled, without namespaces and parameter list
  std::uint64_t start_ns = 0;    ///< device timestamps (CUPTI clock)
  std::uint64_t end_ns = 0;
  int grid[3] = {0, 0, 0};
  int block[3] = {0, 0, 0};
  int registers = 0;
  std::uint32_t graph_id = 0;    ///< 0 when launched outside a graph
};

/// Starts recording kernels (CONCURRENT_KERNEL activity: kernels are not serialized).
Status trace_begin();
/// Flushes and stops recording; `out` gets every kernel recorded since trace_begin(), by start.
Status trace_end(std::vector<KernelRecord>* out);

/// The timeline as a critical path: kernel i's share of the wall time is end_i - end_{i-1}
/// (kernels of a decode step form one chain on one stream), split into the launch gap
/// max(0, start_i - end_{i-1}) and the busy time end_i - max(start_i, end_{i-1}). A kernel
/// launched programmatically starts before its predecessor ends: its gap is 0.
struct KernelShare {
  std::string name;
  int count = 0;
  double busy_us = 0, gap_us = 0, duration_us = 0;  ///< duration: end - start (includes time spent waiting on the predecessor)
};
struct TraceSummary {
  double wall_us = 0, busy_us = 0, gap_us = 0;
  std::vector<KernelShare> by_name;  ///< largest share first
};
TraceSummary summarize(const std::vector<KernelRecord>& records);

/// Writes one line per kernel: index, name, start/end (us from the first start), duration, gap,
/// busy, grid, block, registers, graph id.
Status write_trace_csv(const std::vector<KernelRecord>& records, const std::string& path);

/// "gemv_kernel<1, __nv_bfloat16>" from "void flashcpp::engine::(anonymous namespace)::gemv_kernel<1,
/// __nv_bfloat16>(flashcpp::engine::(anonymous namespace)::GemvArgs)".
std::string short_kernel_name(const std::string& demangled);

}  // namespace flashcpp::harness
