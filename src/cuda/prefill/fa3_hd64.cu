// sm_90a prefill instantiations for head_dim 64 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
const Fa3Entry kEntries[] = {
    // FA3's d64 tile: 192 query rows over three consumer warpgroups at 160 registers (producer 32),
    // pipelined, the ping-pong turns in round robin (two warpgroups' softmax under one's GEMMs).
    // The selector takes it where its per-row gain beats its coarser waves (core/selector.cc,
    // wide_tile_pays, with the measurements).
    // Its lean-mask twin first (causal and sequence-end masks only, TileConfig::lean_mask): the
    // general mask path spills 148 bytes in the main loop at 160 registers, the lean one none.
    fa3_entry<Fa3Config<64, 128, 4, true, true, false, 3, 64, true>>(),
    fa3_entry<Fa3Config<64, 128, 4, true, true, false, 3>>(),
    fa3_entry<Fa3Config<64, 128, 4, true>>(),   // pipelined consumers + ping-pong
    fa3_entry<Fa3Config<64, 128, 4>>(),         // plain: Q K^T, softmax, P V in sequence (block-sparse masks)
    fa3_entry<Fa3Config<64, 128, 4, true, true, true>>(),  // the 128-row config, persistent (tile scheduler, TMA store)
    // The 192-row lean twin, persistent (no spills; the general one spilled 224 bytes and lost
    // everywhere, and is not built): the short and mid-size causal problems' tile.
    fa3_entry<Fa3Config<64, 128, 4, true, true, true, 3, 64, true>>(),
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd64() { return kEntries; }
}  // namespace flashcpp::cuda
