// The backward main kernel for head-dim class 128 (bf16 and fp16): 64 query rows x 64 keys, 4 warps of 16 keys with all 128 columns of dK and dV in registers.
#include "cuda/backward/bwd_launch.cuh"

namespace flashcpp::cuda {
const BwdEntry& bwd_entry_hd128() {
  static const BwdEntry e = bwd_entry_of<BwdConfig<128, 64, 4, 1, 1>>();
  return e;
}
}  // namespace flashcpp::cuda
