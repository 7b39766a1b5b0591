// sm80 prefill instantiations for head_dim 64 (bf16 + fp16 each). Order = fallback preference.
// Every config here compiles without register spills for sm_80 and sm_90a (checked in the build
// log, -Xptxas -v); configs that spilled were dropped (reports/prefill/README.md lists them).
#include "cuda/prefill/fa2_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa2Entry kEntries[] = {
    fa2_entry<Fa2Config<64, 128, 64, 4, 2, false>>(),  // 32 rows/warp, Q re-read from smem, K/V fragments reused twice
    fa2_entry<Fa2Config<64, 128, 64, 4, 3, false>>(),  // same, 3-stage cp.async ring
    fa2_entry<Fa2Config<64, 128, 128, 8, 2, true>>(),  // 16 rows/warp, Q in registers, wide key blocks
    fa2_entry<Fa2Config<64, 64, 128, 4, 2, true>>(),  // small CTAs for short sequences (more CTAs per SM)
};
}  // namespace
std::span<const Fa2Entry> fa2_entries_hd64() { return kEntries; }
}  // namespace flashcpp::cuda
