// sm_90a prefill instantiations for head_dim 64 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa3Entry kEntries[] = {
    fa3_entry<Fa3Config<64, 128, 4, true>>(),   // default: pipelined consumers + ping-pong (+10-15% at hd64)
    fa3_entry<Fa3Config<64, 128, 4>>(),         // plain: Q K^T, softmax, P V in sequence
    fa3_entry<Fa3Config<64, 128, 4, true, true, true>>(),  // the default config, persistent (tile scheduler, TMA store)
    // The default with a quarter of the exponentials on the FMA pipe (exp2_poly): d64 is where the
    // MUFU's exp throughput matches the tensor cores' GEMM time. To be timed against the default.
    fa3_entry<Fa3Config<64, 128, 4, true, true, false, true>>(),
    // 192 keys per stage (4 stages: 216 KB of shared memory): a third fewer key tiles, so a third
    // fewer barrier waits, row-max shuffles and rescale checks per key. To be timed against the default.
    fa3_entry<Fa3Config<64, 192, 4, true>>(),
    // FA3's d64 tile: 192 query rows, three consumer warpgroups at 160 registers (producer 32),
    // pipelined with the ping-pong turns in round robin (two warpgroups' softmax under one's
    // GEMMs), and plain. ptxas spills 192 / 116 bytes at 160 registers (the general mask path
    // does not fit; FA3 specializes it away). To be timed against the default.
    fa3_entry<Fa3Config<64, 128, 4, true, true, false, false, 3>>(),
    fa3_entry<Fa3Config<64, 128, 4, false, true, false, false, 3>>(),
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd64() { return kEntries; }
}  // namespace flashcpp::cuda
