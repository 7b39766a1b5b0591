// sm_90a prefill instantiations for head_dim 128 (bf16 + fp16).
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
// The pipelined ping-pong consumers are the default: with K and V released apart they beat the
// sequential ones on every shape measured; the overlap without ping-pong ("o"), FA3's 176-key tile
// (it spills at 240 registers) and the sequential persistent twin lost to them and are not
// compiled (reports/hopper: the measurements).
const Fa3Entry kEntries[] = {
    fa3_entry<Fa3Config<128, 128, 2, true>>(),   // default: pipelined consumers + ping-pong
    fa3_entry<Fa3Config<128, 128, 2>>(),         // plain: Q K^T, softmax, P V in sequence (block-sparse masks)
    fa3_entry<Fa3Config<128, 128, 2, true, true, true>>(),  // the default config, persistent (tile scheduler, TMA store)
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd128() { return kEntries; }
}  // namespace flashcpp::cuda
