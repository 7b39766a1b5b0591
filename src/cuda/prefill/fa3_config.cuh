// The tile configs of the sm90 prefill kernel and the shared memory of one CTA. Tuning only: a
// config changes speed, registers and shared memory, never results (up to fp32 summation order).
#pragma once

#include <cstdint>

#include "core/selector.h"
#include "cuda/prefill/fa3_params.h"
#include "cuda/prefill/prefill_mask.cuh"

namespace flashcpp::cuda {

/// HeadDim: the q/k class (Q K^T's depth); HeadDimV: the v/o class (P V's width, O's columns),
/// HeadDim unless a class of two head dims (fa3_hd192.cu: 192 / 128) says otherwise.
template <int HeadDim, int BlockN, int Stages, bool PingPong = false, bool Sched = true, bool Persistent = false,
          int Consumers = 2, int HeadDimV = HeadDim, bool LeanMask = false, int QkDims = HeadDim>
struct Fa3Config {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimV = HeadDimV;
  /// The q/k dims Q K^T covers (config suffix "_k<QkDims>" when below HeadDim): QkDims / 16 k16
  /// steps. A twin with fewer serves the head dims of its class up to QkDims (96 and 80 in the 128
  /// class: 6 of 8 steps), whose columns past them are zeros on both sides (TMA's out-of-bounds
  /// fill), so it gives the same bits. A compile-time count: a run-time test between two wgmmas
  /// makes ptxas fence each one and break the chain (reports/hopper). Q and K keep the class's
  /// panels and P V its N.
  static constexpr int kQkDims = QkDims;
  static_assert(QkDims % 16 == 0 && QkDims > 0 && QkDims <= HeadDim, "Q K^T covers whole k16 steps of the class");
  /// Consumer warpgroups, 64 query rows each: 2 (BlockM 128), or 3 (BlockM 192, FA3's d64 tile:
  /// more rows per K/V stage, and with ping-pong two warpgroups' softmax under one's GEMMs).
  static constexpr int kConsumers = Consumers;
  static constexpr int kBlockM = 64 * Consumers;
  static constexpr int kBlockN = BlockN;           ///< keys per stage
  static constexpr int kStages = Stages;           ///< K/V ring depth
  /// Software-pipelined consumers (Q K^T of block j overlaps softmax of j and P V of j-1) with
  /// ping-pong scheduling: the consumer warpgroups take turns issuing their wgmmas, so one
  /// warpgroup's softmax runs while another's matrix products occupy the tensor cores.
  static constexpr bool kPingPong = PingPong;
  /// With kPingPong: whether the named-barrier turn-taking runs (false = the in-warpgroup
  /// overlap alone, config suffix "o").
  static constexpr bool kSched = PingPong && Sched;
  /// Persistent CTAs (config suffix "_persist"): the tile scheduler (fa3_scheduler.cuh), the next
  /// tile's K/V loads overlapping the current tile's last blocks and epilogue, O stored by TMA.
  static constexpr bool kPersistent = Persistent;
  /// Lean masks (config suffix "_lean"): a boundary tile gets only the causal and sequence-end
  /// masks, from two registers of the tile's rules, instead of the general path (window, sinks,
  /// softcap, ALiBi: the record lookups and their registers). The selector gives such a config no
  /// other mask (TileConfig::lean_mask). At the 192-row tile's 160 registers the general path
  /// spills 148 bytes in the main loop (its persistent twin 224); the lean one spills none.
  static constexpr bool kLeanMask = LeanMask;
  static constexpr int kThreads = 128 * (1 + Consumers);  ///< producer warpgroup + the consumers
  static constexpr int kPanels = HeadDim / 64;     ///< 64-column (128-byte) panels per row of Q and K
  static constexpr int kPanelsV = HeadDimV / 64;   ///< the same per row of V and O
  static constexpr int kQBytes = kBlockM * HeadDim * 2;
  static constexpr int kKBytes = BlockN * HeadDim * 2;   ///< one K stage
  static constexpr int kVBytes = BlockN * HeadDimV * 2;  ///< one V stage
  static constexpr int kBarrierBytes = 256;
  /// Rotary: each consumer warpgroup's copy of the fp64 inv_freq table (128 pairs at most).
  static constexpr int kRopeBytes = Consumers * 128 * 8;
  /// Bytes of a CTA with q_bufs Q buffers (each with its own CtaWork record).
  static constexpr int smem_bytes(int q_bufs) {
    return q_bufs * (kCtaWorkBytes + kQBytes) + 1024 /*align*/ + Stages * (kKBytes + kVBytes) + kBarrierBytes +
           kRopeBytes;
  }
  /// Q buffers: persistent configs take two where they fit, so that the next tile's Q (and its
  /// CtaWork record) lands while the current tile still computes and writes O through its own
  /// buffer; with one, every tile waited for the previous epilogue's store and then for its Q.
  static constexpr int kQBufs = Persistent && smem_bytes(2) <= 227 * 1024 ? 2 : 1;
  /// With two Q buffers, tiles overlap further: the producer loads the next tile's Q before its
  /// keys, and a warpgroup releases a buffer only once the next tile's first Q K^T is queued (with
  /// one, the next Q needs the buffer at once, so it is released right after the O store).
  static constexpr bool kOverlapQ = kQBufs > 1;
  static constexpr int kSmemBytes = smem_bytes(kQBufs);
  /// setmaxnreg budgets: the selector's rule (core/selector.h, sm90_registers).
  static constexpr int kProducerRegs = select::sm90_registers(Consumers, BlockN).producer;
  static constexpr int kConsumerRegs = select::sm90_registers(Consumers, BlockN).consumer;
  static_assert(HeadDim % 64 == 0 && BlockN % 16 == 0 && BlockN <= 256);
  // O is staged in the Q buffer (fa3_epilogue.cuh): its panels must fit there.
  static_assert(HeadDimV % 64 == 0 && HeadDimV <= HeadDim, "v/o panels fit the Q buffer");
  static_assert(8 * (2 * kQBufs + 4 * Stages) <= kBarrierBytes, "the mbarriers fit their bytes");
  static_assert(kSmemBytes <= 227 * 1024, "one CTA's shared memory fits an sm_90 SM (227 KB per block)");
  static_assert(Consumers == 2 || Consumers == 3, "two or three consumer warpgroups");
  static_assert(kProducerRegs * 128 + Consumers * kConsumerRegs * 128 <= 65536, "register file");
};

/// The CTA's shared memory: the CtaWork records first (fixed addresses: no register holds their
/// base; one per Q buffer), then, 1024-byte aligned for the 128B-swizzle atoms that TMA writes
/// and wgmma reads:
///   Q [buffer][panel][BlockM][64]   K ring [stage][panel][BlockN][64]   V ring (same, HeadDimV's panels)
///   mbarriers: q_full[QB], k_full[S], v_full[S], k_empty[S], v_empty[S], q_empty[QB]
///   rotary: each consumer warpgroup's inv_freq copy (fp64)
/// k_empty / v_empty: every consumer warp has read stage s's keys (values); the producer may
/// refill it. q_empty[b] (persistent): every consumer warpgroup is done with Q buffer b, which is
/// also its tile's O staging area, so a later tile's Q may land there.
/// The kernel's dynamic shared memory. Read from the symbol wherever it is needed, never kept in a
/// variable: an address derived from the symbol is known to be shared memory (LDS/STS), one that
/// went through a struct or a reference may come back as a generic address (LD/ST).
__device__ __forceinline__ unsigned char* fa3_smem_raw() {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return smem_raw;
}

template <class Cfg, typename T>
struct Fa3Smem {
  static constexpr int S = Cfg::kStages, QB = Cfg::kQBufs;
  static constexpr int kQAll = QB * Cfg::kQBytes;
  /// Q buffer b's CtaWork record.
  __device__ __forceinline__ static CtaWork& work(int b = 0) {
    return *reinterpret_cast<CtaWork*>(fa3_smem_raw() + b * kCtaWorkBytes);
  }
  /// The 1024-byte aligned start of Q buffer b.
  __device__ __forceinline__ static unsigned char* base(int b = 0) {
    return reinterpret_cast<unsigned char*>(
               (reinterpret_cast<std::uintptr_t>(fa3_smem_raw() + QB * kCtaWorkBytes) + 1023) & ~std::uintptr_t(1023)) +
           b * Cfg::kQBytes;
  }
  __device__ __forceinline__ static T* q(int b = 0) { return reinterpret_cast<T*>(base(b)); }
  __device__ __forceinline__ static T* k() { return reinterpret_cast<T*>(base() + kQAll); }
  __device__ __forceinline__ static T* v() { return reinterpret_cast<T*>(base() + kQAll + S * Cfg::kKBytes); }
  __device__ __forceinline__ static std::uint64_t* bars() {
    return reinterpret_cast<std::uint64_t*>(base() + kQAll + S * (Cfg::kKBytes + Cfg::kVBytes));
  }
  __device__ __forceinline__ static std::uint64_t* q_full(int b = 0) { return bars() + b; }
  __device__ __forceinline__ static std::uint64_t* k_full(int s) { return bars() + QB + s; }
  __device__ __forceinline__ static std::uint64_t* v_full(int s) { return bars() + QB + S + s; }
  __device__ __forceinline__ static std::uint64_t* k_empty(int s) { return bars() + QB + 2 * S + s; }
  __device__ __forceinline__ static std::uint64_t* v_empty(int s) { return bars() + QB + 3 * S + s; }
  __device__ __forceinline__ static std::uint64_t* q_empty(int b = 0) { return bars() + QB + 4 * S + b; }
  /// Consumer warpgroup c's inv_freq copy (rotary without a cache).
  __device__ __forceinline__ static double* inv_freq(int c) {
    return reinterpret_cast<double*>(reinterpret_cast<unsigned char*>(bars()) + Cfg::kBarrierBytes) + 128 * c;
  }
};

}  // namespace flashcpp::cuda
