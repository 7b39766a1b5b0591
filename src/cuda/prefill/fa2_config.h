// Tile configurations of the sm80 (FA2-style) prefill kernel. These change speed, register
// pressure and shared memory only, never results (up to fp32 summation order).
#pragma once

#include "cuda/prefill/prefill_mask.h"

namespace flashcpp::cuda {

template <int HeadDim, int BlockM, int BlockN, int Warps, int Stages, bool QInRegs, int MinBlocks = 1>
struct Fa2Config {
  static constexpr int kHeadDim = HeadDim;  ///< D
  static constexpr int kBlockM = BlockM;    ///< query rows per CTA
  static constexpr int kBlockN = BlockN;    ///< key rows per pipeline stage
  static constexpr int kWarps = Warps;      ///< warps per CTA, each owns kBlockM/kWarps rows
  static constexpr int kStages = Stages;    ///< K/V shared-memory ring depth (cp.async groups in flight + 1)
  static constexpr bool kQInRegs = QInRegs; ///< Q fragments loaded once to registers, else re-read by ldmatrix
  static constexpr int kMinBlocks = MinBlocks; ///< CTAs per SM the register allocation must allow (launch bounds)

  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMT = kRowsPerWarp / 16;   ///< m16 tiles per warp
  static constexpr int kNT = kBlockN / 8;         ///< n8 tiles of S per warp row tile
  static constexpr int kDT = kHeadDim / 8;        ///< n8 tiles of O
  static constexpr int kKT = kHeadDim / 16;       ///< k16 steps of Q K^T
  static constexpr int kPT = kBlockN / 16;        ///< k16 steps of P V
  static constexpr int kChunks = kHeadDim / 8;    ///< 16-byte chunks per row
  static constexpr int kSmemQ = kBlockM * kHeadDim * 2;
  static constexpr int kSmemKV = kBlockN * kHeadDim * 2;
  static constexpr int kSmemBytes = kSmemQ + 2 * kStages * kSmemKV + kCtaWorkBytes;  ///< + the CTA's work record

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
  static_assert(kRowsPerWarp % 16 == 0 && (kMT == 1 || kMT == 2), "each warp owns 16 or 32 rows");
  static_assert(kBlockN % 16 == 0, "BlockN is a multiple of the k16 step of P V");
  static_assert(kStages >= 2, "at least double buffering");
};

}  // namespace flashcpp::cuda
