// sm80 prefill instantiations for head_dim 128 (bf16 + fp16 each). Order = fallback preference.
// Every config here compiles without register spills for sm_80 and sm_90a (checked in the build
// log, -Xptxas -v); configs that spilled were dropped (reports/prefill/README.md lists them).
#include "cuda/prefill/fa2_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa2Entry kEntries[] = {
    fa2_entry<Fa2Config<128, 128, 32, 4, 3, false>>(),  // 32 rows/warp, Q re-read, narrow S keeps 255 regs spill-free
    fa2_entry<Fa2Config<128, 64, 64, 4, 2, true>>(),  // 16 rows/warp, Q in registers, 2 CTAs/SM
    fa2_entry<Fa2Config<128, 64, 64, 4, 3, true>>(),  // same, 3 stages
    fa2_entry<Fa2Config<128, 128, 64, 8, 2, true>>(),  // 16 rows/warp, 8 warps
};
}  // namespace
std::span<const Fa2Entry> fa2_entries_hd128() { return kEntries; }
}  // namespace flashcpp::cuda
