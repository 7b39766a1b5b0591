// sm_90a prefill instantiations for the class of two head dims 192 / 128 (bf16 + fp16): q/k head
// dims in (128, 192] with v/o head dims up to 128 (DeepSeek-V2/V3's MLA prefill, 192 / 128) run
// here rather than in the 256 class, where Q K^T did 4/3 and P V twice this class's work.
//
// The tile is d128's: 128 query rows, 128 keys per stage, the same S and O accumulators (64 fp32
// registers each) and register budgets; only Q K^T is deeper (12 k16 steps, three 64-column panels
// of Q and K). Shared memory: Q 48 KB, a stage of K 48 KB and of V 32 KB, two stages: 208 KB of
// operands, 211.4 KB in all (227 KB per block). A third stage (288 KB) or 176 keys (Q + two stages
// 268 KB) do not fit, nor a second Q buffer for the persistent twin (259.5 KB): it keeps one, as
// d256's, and the selector's one-buffer persistent rule. FA3 takes the same tile for 192 / 128
// (hopper/tile_size.h).
// On the H200: reports/hopper/README.md ("Head dims 192 / 128").
#include "cuda/prefill/fa3_launch.cuh"

namespace flashcpp::cuda {
namespace {
/// Fa3Config of the 192 / 128 class (two consumer warpgroups, BlockM 128).
template <int BlockN, int Stages, bool PingPong = false, bool Sched = true, bool Persistent = false>
using Fa3Config192 = Fa3Config<192, BlockN, Stages, PingPong, Sched, Persistent, 2, 128>;

const Fa3Entry kEntries[] = {
    fa3_entry<Fa3Config192<128, 2, true>>(),               // default: pipelined consumers + ping-pong
    fa3_entry<Fa3Config192<128, 2>>(),                     // plain: Q K^T, softmax, P V in sequence (block-sparse masks)
    fa3_entry<Fa3Config192<128, 2, true, true, true>>(),   // the default config, persistent (tile scheduler, TMA store)
};
}  // namespace
std::span<const Fa3Entry> fa3_entries_hd192() { return kEntries; }
}  // namespace flashcpp::cuda
