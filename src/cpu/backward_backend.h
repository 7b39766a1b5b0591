// The CPU backward backends (include/flashcpp/backward.h): the fp64 reference and the fp32 tiled
// backward that walks the GPU kernels' blocks. Host memory; called after validate_backward.
#pragma once

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"

namespace flashcpp::cpu {

/// Backend::kCpuReference: reference_attention_backward, then dq, dk, dv stored in their dtype
/// (fp64 exactly), and the uncovered varlen rows zeroed.
Status reference_backward(const AttnBackwardParams& p, const RunOptions& opt);

/// Backend::kCpu: the tiled fp32 backward (tiled_backward.cc) in p.workspace, whose layout
/// attention_backward_workspace_size gave (validated against it).
Status tiled_backward(const AttnBackwardParams& p, const RunOptions& opt, const BackwardWorkspaceLayout& layout);

/// The tiled backward's query tile height (and so the workspace's row padding): opt.cpu_block_m (0:
/// 64), and with a block-sparse mask its largest divisor of the mask's block_m that is not above
/// that, so that query tiles never straddle a sparse block and each is one padded row block.
int tiled_backward_block_m(const AttnBackwardParams& p, const RunOptions& opt);
/// Its key tile width: opt.cpu_block_n (0: 64), at most the mask's block_n (the forward's rule).
int tiled_backward_block_n(const AttnBackwardParams& p, const RunOptions& opt);

/// Varlen rows no sequence covers, when their count is known (mask.total_q for dq, total_k for dk
/// and dv): set to 0. Every row when batch is 0. Host memory; does nothing without varlen.
void zero_uncovered_grads(const AttnBackwardParams& p);

/// Runs f(item, scratch) for item in [0, n) on up to `threads` threads (0 = hardware concurrency),
/// each thread with its own scratch = make(), pulling items in ascending order from one counter: an
/// item starts only after every smaller item has started, which the deterministic dQ order relies
/// on (an item waits only for smaller ones, each of which some thread is running or has finished).
template <class Make, class F>
void parallel_items(int n, int threads, Make&& make, F&& f) {
  if (n <= 0) return;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::min(threads, n);
  std::atomic<int> next{0};
  auto worker = [&] {
    auto scratch = make();
    for (int item = next.fetch_add(1); item < n; item = next.fetch_add(1)) f(item, scratch);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace flashcpp::cpu
