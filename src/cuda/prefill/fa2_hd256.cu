// sm80 prefill instantiations for head_dim 256 (bf16 + fp16 each). Order = fallback preference.
// Every config here compiles without register spills for sm_80 and sm_90a (checked in the build
// log, -Xptxas -v); configs that spilled were dropped (reports/prefill/README.md lists them).
#include "cuda/prefill/fa2_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa2Entry kEntries[] = {
    fa2_entry<Fa2Config<256, 128, 32, 8, 2, false>>(),  // 128 KB smem, 8 warps
    fa2_entry<Fa2Config<256, 64, 32, 4, 2, false>>(),  // 96 KB smem: 2 CTAs/SM (fits A100)
    fa2_entry<Fa2Config<256, 128, 32, 8, 3, false>>(),  // 160 KB smem, 3 stages
    fa2_entry<Fa2Config<256, 64, 32, 4, 3, false>>(),  // 128 KB smem, 3 stages
};
}  // namespace
std::span<const Fa2Entry> fa2_entries_hd256() { return kEntries; }
}  // namespace flashcpp::cuda
