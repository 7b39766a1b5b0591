// The backward main kernel for head-dim class 64 (bf16 and fp16): 64 query rows x 64 keys, 4 warps of 16 keys; ~58 KB of shared memory, two CTAs per SM.
#include "cuda/backward/bwd_launch.cuh"

namespace flashcpp::cuda {
const BwdEntry& bwd_entry_hd64() {
  static const BwdEntry e = bwd_entry_of<BwdConfig<64, 64, 4, 1, 2>>();
  return e;
}
}  // namespace flashcpp::cuda
