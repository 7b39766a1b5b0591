// sm80 prefill instantiations for head_dim 256 (bf16 + fp16 each). Order = fallback preference.
#include "cuda/prefill/fa2_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa2Entry kEntries[] = {
    fa2_entry<Fa2Config<256, 64, 64, 4, 2, false>>(),   // 160 KB smem: fits A100 and H100
    fa2_entry<Fa2Config<256, 128, 64, 8, 2, false>>(),  // 192 KB smem: Hopper only
    fa2_entry<Fa2Config<256, 64, 32, 4, 2, false>>(),   // 96 KB: 2 CTAs/SM
    fa2_entry<Fa2Config<256, 128, 32, 8, 2, false>>(),  // 128 KB, 8 warps
};
}  // namespace
std::span<const Fa2Entry> fa2_entries_hd256() { return kEntries; }
}  // namespace flashcpp::cuda
