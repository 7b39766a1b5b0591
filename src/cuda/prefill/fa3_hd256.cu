// sm_90a prefill instantiations for head_dim 256 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa3Entry kEntries[] = {
    fa3_entry<Fa3Config<256, 64, 2, true>>(),   // default: pipelined consumers + ping-pong
    fa3_entry<Fa3Config<256, 64, 2>>(),         // plain: Q K^T, softmax, P V in sequence (block-sparse masks)
    // The default config, persistent: where the selector's persistent rule holds (large causal
    // problems) it beats the default and a plain persistent config, which is not compiled
    // (reports/hopper/raw/persist_a367a06_2026-11-30.txt).
    fa3_entry<Fa3Config<256, 64, 2, true, true, true>>(),
    // The persistent config's lean-mask twin (causal and sequence-end masks only): no spills where
    // the general one has 36 bytes, 1.05x it at (1,16,4096,256) causal (H100, 3873b71). It is the
    // persistent twin of the default wherever the masks allow (sm90_twin); a lean twin of the
    // default itself ran 1.00x the default there and is not built.
    fa3_entry<Fa3Config<256, 64, 2, true, true, true, 2, 256, true>>(),
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd256() { return kEntries; }
}  // namespace flashcpp::cuda
