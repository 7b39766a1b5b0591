// The wgmma backward main kernel for head-dim class 128 (bf16 and fp16, sm_90a): 64 query rows x 128 keys per
// pair, two warpgroups of 64 keys each (bwd_sm90.cuh).
#include "cuda/backward/bwd_launch.cuh"

namespace flashcpp::cuda {
const BwdEntry& bwd_entry_sm90_hd128() {
  static const BwdEntry e = bwd_entry_of<BwdSm90Config<128, 64>>();
  return e;
}
}  // namespace flashcpp::cuda
