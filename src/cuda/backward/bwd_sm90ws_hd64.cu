// The warp-specialized wgmma backward for head-dim class 64 (bf16 and fp16, sm_90a; bwd_sm90_ws.cuh).
#include "cuda/backward/bwd_launch.cuh"

namespace flashcpp::cuda {
const BwdEntry& bwd_entry_sm90ws_hd64() {
  static const BwdEntry e = bwd_entry_of<BwdWsConfig<64, 128>>();
  return e;
}
}  // namespace flashcpp::cuda
