// Thin typed wrappers for the sm_90a kernel: wgmma (descriptors, fence/commit/wait and the
// generated mma wrappers), setmaxnreg, named barriers, and mbarrier/TMA through CCCL's cuda::ptx.
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashcpp::cuda::sm90 {

namespace ptx = ::cuda::ptx;

// ---- wgmma ------------------------------------------------------------------------------
/// Shared-memory matrix descriptor, 128-byte swizzle (the layout TMA writes with
/// CU_TENSOR_MAP_SWIZZLE_128B: 8-row x 128-byte atoms, 16-byte chunk c of row r at c ^ (r % 8)).
///   K-major operand (rows x K, K contiguous): lbo unused (1), sbo = 1024 (8 rows x 128 B).
///   MN-major operand (K rows x MN, MN contiguous): lbo = bytes between 64-element MN panels,
///   sbo = 1024 (8 K-rows x 128 B).
/// Advancing along K inside a K-major atom = adding bytes to the start address (the hardware
/// applies the swizzle to the final address), so tiles must be 1024-byte aligned.
__device__ __forceinline__ std::uint64_t make_desc(std::uint32_t smem_addr, std::uint32_t lbo_bytes,
                                                   std::uint32_t sbo_bytes) {
  return static_cast<std::uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         static_cast<std::uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16 |
         static_cast<std::uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}

/// Orders register writes (accumulators, A fragments) before the wgmmas that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/// Runs f() as the body of a loop that ptxas cannot prove runs once (`never` is false at run time
/// but not a compile-time constant), so that f's code ends a basic block. Use it for work that a
/// later wgmma_wait must not overtake: ptxas's scheduler moves WARPGROUP.DEPBAR to the top of its
/// basic block (it has no register inputs), which in the pipelined consumers put the wait for
/// P V of block j-1 before the softmax of block j and serialized the two (SASS of fa3_hd128, the
/// `p` configs). Costs one compare and one branch.
template <class F>
__device__ __forceinline__ void in_own_block(bool never, F&& f) {
  int rep = 0;
  do {
    f();
  } while (++rep < 1 + static_cast<int>(never));
}

/// D(64 x N, fp32) (+)= A(64x16, smem, K-major) * B(16 x N, smem, K-major); scale_d = 0 zeroes D.
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b, int scale_d);
/// D(64 x N, fp32) (+)= A(64x16, registers) * B(16 x N, smem, MN-major).
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                         int scale_d);
/// D(64 x N, fp32) (+)= A(64x16, smem, MN-major) * B(16 x N, smem, MN-major): both operands stored
/// with K as the row (the backward's dQ = dS K from dS^T [key][query] and K [key][d]).
template <int N, typename T>
__device__ __forceinline__ void wgmma_tt(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b, int scale_d);
#include "cuda/common/wgmma_ops.inc"

// ---- registers and barriers ---------------------------------------------------------------
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
/// Barrier among `threads` threads (a warpgroup) on hardware barrier `id` (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// Arrive (without waiting) at named barrier `id`, counted against `threads` participants.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
/// (wgmma operands, TMA stores) of the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, std::uint32_t count) { ptx::mbarrier_init(bar, count); }
/// Blocks until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}
/// The same for a thread that may wait long (a producer waiting for a stage to be released): with a
/// suspend-time hint the thread sleeps in try_wait until the phase completes, where a plain try_wait
/// returns after a few cycles, so a spinning producer takes issue slots from the consumer warps on
/// its scheduler (ncu, sm90 prefill at d128: 15% of that scheduler's slots).
__device__ __forceinline__ void mbar_wait_sleep(std::uint64_t* bar, std::uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity, 0x989680u /* ns: CUTLASS's hint */)) {
  }
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) { (void)ptx::mbarrier_arrive(bar); }
/// Arrive and announce `bytes` of TMA traffic that will complete the current phase.
__device__ __forceinline__ void mbar_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  (void)ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar, bytes);
}
/// TMA load of one box of a rank-4 tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const void* tmap, int c0, int c1, int c2, int c3,
                                            std::uint64_t* bar) {
  const std::int32_t coords[4] = {c0, c1, c2, c3};
  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, smem_dst, tmap, coords, bar);
}

/// TMA store of one box from shared memory (laid out as the map's swizzle says) to a rank-4
/// tensor map; elements outside the map's bounds are not written. Completes in a bulk group.
__device__ __forceinline__ void tma_store_4d(const void* tmap, int c0, int c1, int c2, int c3, const void* smem_src) {
  const std::int32_t coords[4] = {c0, c1, c2, c3};
  ptx::cp_async_bulk_tensor(ptx::space_global, ptx::space_shared, tmap, coords, smem_src);
}
/// TMA reduce-add of one box from shared memory (the map's swizzle) into a rank-3 tensor map of the
/// map's element type; elements outside the map's bounds are skipped. Completes in a bulk group.
__device__ __forceinline__ void tma_reduce_add_3d(const void* tmap, int c0, int c1, int c2, const void* smem_src) {
  const std::int32_t coords[3] = {c0, c1, c2};
  ptx::cp_reduce_async_bulk_tensor(ptx::space_global, ptx::space_shared, ptx::op_add, tmap, coords, smem_src);
}
/// A 1D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to
/// shared memory, completing as transaction bytes on `bar`.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, std::uint32_t bytes, std::uint64_t* bar) {
  ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, smem_dst, gmem_src, bytes, bar);
}
__device__ __forceinline__ void bulk_commit() { ptx::cp_async_bulk_commit_group(); }
/// Waits until at most N bulk groups are still in flight (their writes done, not just their reads),
/// then orders those async-proxy writes to global memory before this thread's later generic accesses.
template <int N>
__device__ __forceinline__ void bulk_wait_done() {
  ptx::cp_async_bulk_wait_group(ptx::n32_t<N>{});
  ptx::fence_proxy_async(ptx::space_global);
}
/// Waits until at most N bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  ptx::cp_async_bulk_wait_group_read(ptx::n32_t<N>{});
}

}  // namespace flashcpp::cuda::sm90
