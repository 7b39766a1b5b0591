// The wgmma backward main kernel for head-dim class 64 (bf16 and fp16, sm_90a): 128 query rows x 128 keys per
// pair, two warpgroups of 64 keys each (bwd_sm90.cuh).
#include "cuda/backward/bwd_launch.cuh"

namespace flashcpp::cuda {
const BwdEntry& bwd_entry_sm90_hd64() {
  static const BwdEntry e = bwd_entry_of<BwdSm90Config<64, 128>>();
  return e;
}
}  // namespace flashcpp::cuda
