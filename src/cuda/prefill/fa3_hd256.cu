// sm_90a prefill instantiations for head_dim 256 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa3Entry kEntries[] = {
    // Lean-mask twin of the default (causal and sequence-end masks only), listed first so that the
    // automatic choice takes it wherever the masks allow.
    fa3_entry<Fa3Config<256, 64, 2, true, true, false, 2, 256, true>>(),
    fa3_entry<Fa3Config<256, 64, 2, true>>(),   // default: pipelined consumers + ping-pong
    fa3_entry<Fa3Config<256, 64, 2>>(),         // plain: Q K^T, softmax, P V in sequence (block-sparse masks)
    // The default config, persistent: where the selector's persistent rule holds (large causal
    // problems) it beats the default and a plain persistent config, which is not compiled
    // (reports/hopper/raw/persist_a367a06_2026-11-30.txt).
    fa3_entry<Fa3Config<256, 64, 2, true, true, true>>(),
    // The lean default's persistent twin: no spills where the general one has 36 bytes.
    fa3_entry<Fa3Config<256, 64, 2, true, true, true, 2, 256, true>>(),
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd256() { return kEntries; }
}  // namespace flashcpp::cuda
