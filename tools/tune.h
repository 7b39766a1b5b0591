// `flashcpp bench` and `flashcpp tune`: time flashcpp's own CUDA prefill kernels from C++.
// (Peers are timed in the same process by `python -m flashcpp.bench`.)
#pragma once

#include <string>
#include <vector>

#include "flashcpp/attention.h"

namespace flashcpp::tools {

struct BenchOptions {
  /// Classes to time; 192 is the sm90 192 / 128 class (q/k head dim 192, v/o 128: DeepSeek's).
  std::vector<int> head_dims = {64, 128, 256};
  bool all_configs = false;  ///< time every compiled config, not just the tuned choice
  bool quick = false;        ///< the course shapes only at fewer iterations
  std::string csv;           ///< write rows here when non-empty
  int warmup = 5, iters = 30;
};
struct TuneOptions {
  std::string out;           ///< JSON cache path ("" = the library's default cache path)
  bool emit_table = false;   ///< also print rows for src/core/sm80_tuned_table.inc
  std::vector<int> head_dims = {64, 128, 256};
  int warmup = 3, iters = 15;
};

int bench_main(const BenchOptions& opt);
int tune_main(const TuneOptions& opt);

/// FLOPs of a prefill problem as DESIGN.md counts them: 4*B*Hq*Sq*Sk*D, halved for causal; with a
/// head_dim_v (0: head_dim) 2*B*Hq*Sq*Sk*(D + Dv) (Q K^T and P V apart).
double prefill_flops(int batch, int heads_q, int seqlen_q, int seqlen_k, int head_dim, bool causal, int head_dim_v = 0);

}  // namespace flashcpp::tools
