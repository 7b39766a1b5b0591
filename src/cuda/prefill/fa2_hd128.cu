// sm80 prefill instantiations for head_dim 128 (bf16 + fp16 each). Order = fallback preference.
#include "cuda/prefill/fa2_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa2Entry kEntries[] = {
    fa2_entry<Fa2Config<128, 128, 64, 4, 2, false>>(),  // 32 rows/warp, Q re-read (register bound)
    fa2_entry<Fa2Config<128, 128, 32, 4, 2, false>>(),  // 32 rows/warp, narrower S
    fa2_entry<Fa2Config<128, 64, 64, 4, 2, true>>(),    // 16 rows/warp, 2 CTAs/SM
    fa2_entry<Fa2Config<128, 128, 64, 8, 2, true>>(),   // 16 rows/warp, 8 warps
    fa2_entry<Fa2Config<128, 64, 32, 4, 2, true, 3>>(),  // 16 rows/warp, 3 CTAs per SM
    fa2_entry<Fa2Config<128, 128, 32, 4, 3, false>>(),  // 32 rows/warp, 3 stages
};
}  // namespace
std::span<const Fa2Entry> fa2_entries_hd128() { return kEntries; }
}  // namespace flashcpp::cuda
