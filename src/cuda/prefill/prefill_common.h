// Pieces both prefill kernels share on the host: filling the parameter fields they have in common,
// and launching a kernel on the (row block, head, batch) grid with its dynamic shared memory.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "common/attention_algebra.h"
#include "common/fused_math.h"
#include "common/mask_rules.h"
#include "cuda/common/smem_opt_in.h"
#include "cuda/prefill/prefill_mask.h"
#include "cuda/prefill/prefill_rope.h"
#include "flashcpp/attention.h"

namespace flashcpp::cuda {

/// The optional mask features (prefill_mask.h) of a validated problem whose scale is > 0 (the
/// dispatcher refuses the rest). The block-sparse struct is host memory pointing at device arrays.
inline PrefillMask make_prefill_mask(const AttnParams& a) {
  const MaskParams& m = a.mask;
  PrefillMask k;
  if (m.softcap > 0.f) k.flags |= PrefillMask::kSoftcap;
  if (m.alibi_slopes != nullptr) {
    k.flags |= PrefillMask::kAlibi;
    k.alibi_slopes = m.alibi_slopes;
    k.alibi_batch_stride = m.alibi_batch_stride;
  }
  if (m.is_varlen()) {
    k.flags |= PrefillMask::kVarlen;
    k.cu_seqlens_q = m.cu_seqlens_q;
    k.cu_seqlens_k = m.cu_seqlens_k;
    k.lse_rows = m.total_q;
  }
  if (const BlockSparseMask* bs = m.block_sparse) {
    k.flags |= PrefillMask::kSparse;
    k.bs_row_ptr = bs->row_ptr;
    k.bs_col_idx = bs->col_idx;
    k.bs_partial = bs->partial;
    k.bs_bits = bs->element_masks;
    // partial[] entries are int32, so no index reaches past 2^31-1 masks whatever num_partial says.
    k.bs_num_partial = static_cast<int>(std::min<std::int64_t>(bs->num_partial, INT32_MAX));
    k.bs_block_m = bs->block_m;
    k.bs_block_n = bs->block_n;
    k.bs_per_batch = bs->num_batch == 1 ? 0 : 1;
    k.bs_num_heads = bs->num_heads;
    k.bs_num_q_blocks = bs->num_q_blocks;
    k.bs_num_k_blocks = bs->num_k_blocks;
    k.bs_words = (bs->block_n + 63) / 64;
  }
  return k;
}

/// The q side of the rotary of a validated problem (validate.cc checks the CUDA rules: rotary_dim
/// % 8 for neox, % 4 for interleaved):
/// inv_freq in fp64 by the formula apply_rotary uses. The keys were rotated before the launch
/// (rotate_keys).
inline void fill_prefill_rope(PrefillRope& r, const AttnRotary& a, int head_dim) {
  r = PrefillRope{};
  if (!a.enabled()) return;
  const RotarySpec& s = a.spec;
  const int rd = s.effective_rotary_dim(head_dim);
  r.half = rd / 2;
  r.neox = s.style == RopeStyle::kNeox ? 1 : 0;
  r.tables = fused::CosSinTables{s.cos, s.sin, s.effective_table_stride(head_dim), s.max_position};
  r.positions_q = a.positions_q;
  if (!s.has_tables())  // rd <= 256: validated head dims
    std::copy_n(rotary_inv_freq_table(rd, s.theta, s.llama3), r.half, r.inv_freq);
}

/// Output, LSE, sizes, score transform and mask rules: the fields Fa2Params and Fa3Params share by name.
template <class P>
void fill_prefill_common(P& p, const AttnParams& a) {
  p.o = a.o.data;
  p.lse = a.lse;
  p.o_batch_stride = a.o.batch_stride;
  // validate() guarantees in-sequence offsets fit in int32.
  p.o_seq_stride = static_cast<std::int32_t>(a.o.seq_stride);
  p.o_head_stride = static_cast<std::int32_t>(a.o.head_stride);
  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.heads_q = a.heads_q;
  p.group = a.heads_q / a.heads_kv;
  p.head_dim = a.head_dim;
  p.head_dim_v = a.effective_head_dim_v();
  p.score = algebra::ScoreTransform::make(a.effective_scale(), a.mask.softcap);
  p.rules = MaskRules::make(a.seqlen_q, a.seqlen_k, a.mask.causal, a.mask.window_left, a.mask.window_right,
                            a.mask.global_tokens, a.mask.global_queries);
  p.mask = make_prefill_mask(a);
  fill_prefill_rope(p.rope, a.rotary, a.head_dim);
  if (p.rope.half > 0) p.mask.flags |= PrefillMask::kRotary;
}

/// Launches `kernel` on grid (ceil(seqlen_q / block_m), heads_q, batch): the row blocks of one
/// head are adjacent, so the CTAs resident together share that head's K/V in L2. A persistent
/// kernel passes `persistent_ctas` > 0 instead and gets grid (persistent_ctas, 1, 1). Opts in to
/// `smem_bytes` of dynamic shared memory once per device (not a stream operation, so safe while
/// a graph is captured). `what` names the kernel in error sentences.
template <class Params>
Status launch_prefill(void (*kernel)(Params), const Params& p, int block_m, int threads, int smem_bytes,
                      Stream stream, int device, std::atomic<unsigned long long>& opted_in, const char* what,
                      int persistent_ctas = 0) {
  FLASHCPP_RETURN_IF_ERROR(opt_in_dynamic_smem(kernel, smem_bytes, device, opted_in));
  if (p.batch > 65535 || p.heads_q > 65535)
    return Status::Unsupported("batch " + std::to_string(p.batch) + " or heads_q " + std::to_string(p.heads_q) +
                               " exceeds the 65535 limit of a grid dimension");
  const int m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  const dim3 grid = persistent_ctas > 0 ? dim3(static_cast<unsigned>(persistent_ctas))
                                        : dim3(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q),
                                               static_cast<unsigned>(p.batch));
  void* args[] = {const_cast<Params*>(&p)};  // runtime launch: this header also serves plain C++ files
  const cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, dim3(threads), args,
                                         static_cast<std::size_t>(smem_bytes), stream);
  if (e != cudaSuccess) return Status::Cuda(std::string(what) + " launch failed: " + cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace flashcpp::cuda
