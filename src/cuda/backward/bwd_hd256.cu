// The backward main kernel for head-dim class 256 (bf16 and fp16): 32 query rows x 64 keys, 8 warps: two per 16-key slice, each with 128 of the columns of dK and dV.
#include "cuda/backward/bwd_launch.cuh"

namespace flashcpp::cuda {
const BwdEntry& bwd_entry_hd256() {
  static const BwdEntry e = bwd_entry_of<BwdConfig<256, 32, 8, 2, 1>>();
  return e;
}
}  // namespace flashcpp::cuda
