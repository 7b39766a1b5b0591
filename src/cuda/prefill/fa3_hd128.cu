// sm_90a prefill instantiations for head_dim 128 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa3Entry kEntries[] = {
    fa3_entry<Fa3Config<128, 128, 2>>(),         // default: Q K^T, softmax, P V in sequence (measured faster here)
    fa3_entry<Fa3Config<128, 128, 2, true>>(),   // pipelined consumers + ping-pong
    // Pipelined consumers without the ping-pong turns: measured as slow as "p" while ptxas hoisted
    // the P V wait above the softmax (in_own_block, hopper.cuh); back to be timed against both.
    fa3_entry<Fa3Config<128, 128, 2, true, false>>(),
    fa3_entry<Fa3Config<128, 176, 2, true>>(),  // FA3's d128 tile: 176 keys per stage, ping-pong
    fa3_entry<Fa3Config<128, 128, 2, false, true, true>>(),  // the default config, persistent (tile scheduler, TMA store)
    fa3_entry<Fa3Config<128, 128, 2, true, true, true>>(),   // ping-pong, persistent: the causal twin should "p" win
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd128() { return kEntries; }
}  // namespace flashcpp::cuda
