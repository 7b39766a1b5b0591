// sm80 prefill instantiations for head_dim 64 (bf16 + fp16 each). Order = fallback preference.
#include "cuda/prefill/fa2_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa2Entry kEntries[] = {
    fa2_entry<Fa2Config<64, 128, 64, 4, 2, false>>(),   // 32 rows/warp, K/V fragments reused twice
    fa2_entry<Fa2Config<64, 128, 128, 8, 2, true>>(),   // 16 rows/warp, wide key blocks
    fa2_entry<Fa2Config<64, 64, 128, 4, 2, true>>(),    // small CTAs: more CTAs/SM
    fa2_entry<Fa2Config<64, 128, 64, 4, 3, true>>(),    // 32 rows/warp, Q in registers, 3 stages
    fa2_entry<Fa2Config<64, 128, 64, 8, 2, true, 2>>(),  // 16 rows/warp, 2 CTAs x 8 warps per SM
    fa2_entry<Fa2Config<64, 64, 64, 4, 2, true, 4>>(),   // 16 rows/warp, 4 CTAs x 4 warps per SM
};
}  // namespace
std::span<const Fa2Entry> fa2_entries_hd64() { return kEntries; }
}  // namespace flashcpp::cuda
