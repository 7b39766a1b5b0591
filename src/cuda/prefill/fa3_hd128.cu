// sm_90a prefill instantiations for head_dim 128 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
// The pipelined ping-pong consumers are the default: with K and V released apart they beat the
// sequential ones on every shape measured; the overlap without ping-pong ("o"), FA3's 176-key tile
// (it spills at 240 registers) and the sequential persistent twin lost to them and are not
// compiled (reports/hopper: the measurements).
const Fa3Entry kEntries[] = {
    // The default's twin for head dims up to 96 (Phi-3's 96, Phi-2's and StableLM's 80): Q K^T over
    // the first 96 dims, 6 of the class's 8 k16 steps (Fa3Config::kQkDims), the same bits. Listed
    // first, so the automatic choice takes it wherever it fits; its persistent twin is below.
    fa3_entry<Fa3Config<128, 128, 2, true, true, false, 2, 128, false, 96>>(),
    // Lean-mask twin of the default (causal and sequence-end masks only, TileConfig::lean_mask): the
    // general steady-state loop carries three copies of the softmax, one per mask branch (2,433
    // static instructions against 792). Listed before the default, so the automatic choice takes
    // it wherever the masks allow; its persistent twin is below.
    fa3_entry<Fa3Config<128, 128, 2, true, true, false, 2, 128, true>>(),
    fa3_entry<Fa3Config<128, 128, 2, true>>(),   // default: pipelined consumers + ping-pong
    fa3_entry<Fa3Config<128, 128, 2>>(),         // plain: Q K^T, softmax, P V in sequence (block-sparse masks)
    fa3_entry<Fa3Config<128, 128, 2, true, true, true>>(),  // the default config, persistent (tile scheduler, TMA store)
    fa3_entry<Fa3Config<128, 128, 2, true, true, true, 2, 128, false, 96>>(),  // ... and its twin up to 96
    fa3_entry<Fa3Config<128, 128, 2, true, true, true, 2, 128, true>>(),  // the lean default's persistent twin
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd128() { return kEntries; }
}  // namespace flashcpp::cuda
