// The CUDA attention backward: AttnBackwardParams -> BwdParams, then, on one stream, the workspace's
// initial values (cudaMemsetAsync), the preprocess, the main kernel of the selector's config, the
// postprocess, and the zeroing of varlen rows no sequence covers. Allocates nothing and never
// synchronizes (capturable in a CUDA graph). Which config runs is the selector's choice.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/attention_walk.h"
#include "core/selector.h"
#include "cuda/backward/bwd_kernel.cuh"
#include "cuda/backward/bwd_registry.h"
#include "cuda/common/tma_map.h"
#include "cuda/cuda_api.h"
#include "cuda/prefill/prefill_common.h"

namespace flashcpp::cuda {

const BwdEntry* bwd_entry(int head_dim_class) {
  switch (head_dim_class) {
    case 64: return &bwd_entry_hd64();
    case 128: return &bwd_entry_hd128();
    case 256: return &bwd_entry_hd256();
    default: return nullptr;
  }
}

const BwdEntry* bwd_entry_sm90(int head_dim_class, bool warp_specialized) {
#if FLASHCPP_HAS_SM90
  switch (head_dim_class) {
    case 64: return warp_specialized ? &bwd_entry_sm90ws_hd64() : &bwd_entry_sm90_hd64();
    case 128: return warp_specialized ? &bwd_entry_sm90ws_hd128() : &bwd_entry_sm90_hd128();
    default: return nullptr;
  }
#else
  (void)head_dim_class;
  (void)warp_specialized;
  return nullptr;
#endif
}

namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + " failed: " + cudaGetErrorString(e));
}

BwdParams make_params(const AttnBackwardParams& a, const BackwardWorkspaceLayout& l) {
  BwdParams p{};
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.o = a.o.data;
  p.dout = a.dout.data;
  p.dq = a.dq.data;
  p.dk = a.dk.data;
  p.dv = a.dv.data;
  p.lse = a.lse;
  p.dlse = a.dlse;
  const TensorView* views[] = {&a.q, &a.k, &a.v, &a.o, &a.dout, &a.dq, &a.dk, &a.dv};
  std::int64_t* batch[] = {&p.q_batch_stride, &p.k_batch_stride, &p.v_batch_stride, &p.o_batch_stride,
                           &p.do_batch_stride, &p.dq_batch_stride, &p.dk_batch_stride, &p.dv_batch_stride};
  std::int32_t* seq[] = {&p.q_seq_stride, &p.k_seq_stride, &p.v_seq_stride, &p.o_seq_stride,
                         &p.do_seq_stride, &p.dq_seq_stride, &p.dk_seq_stride, &p.dv_seq_stride};
  std::int32_t* head[] = {&p.q_head_stride, &p.k_head_stride, &p.v_head_stride, &p.o_head_stride,
                          &p.do_head_stride, &p.dq_head_stride, &p.dk_head_stride, &p.dv_head_stride};
  for (int i = 0; i < 8; ++i) {  // validate() guarantees in-sequence offsets fit in int32
    *batch[i] = views[i]->batch_stride;
    *seq[i] = static_cast<std::int32_t>(views[i]->seq_stride);
    *head[i] = static_cast<std::int32_t>(views[i]->head_stride);
  }
  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.heads_q = a.heads_q;
  p.heads_kv = a.heads_kv;
  p.group = a.heads_q / a.heads_kv;
  p.head_dim = a.head_dim;
  p.head_dim_v = a.effective_head_dim_v();
  p.scale = a.effective_scale();
  const AttnParams f = a.forward();
  p.score = algebra::ScoreTransform::make(p.scale, a.mask.softcap);
  p.rules = MaskRules::make(a.seqlen_q, a.seqlen_k, a.mask.causal, a.mask.window_left, a.mask.window_right,
                            a.mask.global_tokens, a.mask.global_queries);
  p.mask = make_prefill_mask(f);
  if (a.mask.block_sparse != nullptr) p.bs = *a.mask.block_sparse;
  auto* base = static_cast<unsigned char*>(a.workspace);
  p.delta = reinterpret_cast<float*>(base + l.delta);
  p.lse2 = reinterpret_cast<float*>(base + l.lse_log2);
  p.dq_accum = reinterpret_cast<float*>(base + l.dq_accum);
  p.sem = l.bytes > l.semaphores ? reinterpret_cast<std::int32_t*>(base + l.semaphores) : nullptr;
  p.ws_rows = l.rows;
  p.row_pad = l.row_pad;
  p.total_q = a.mask.is_varlen() ? a.mask.total_q : 0;
  p.total_k = a.mask.is_varlen() ? a.total_k : 0;
  return p;
}

/// Rows [cu[batch], total) of a packed view get zeros (varlen with a known total).
template <typename T>
Status zero_uncovered(const TensorView& x, int heads, int dim, const std::int32_t* cu, int batch, std::int64_t total,
                      cudaStream_t stream) {
  if (total <= 0 || heads <= 0) return Status::Ok();
  const dim3 grid(static_cast<unsigned>((total + 3) / 4), static_cast<unsigned>(heads));
  bwd_zero_rows_kernel<T><<<grid, 128, 0, stream>>>(static_cast<T*>(x.data), static_cast<std::int32_t>(x.seq_stride),
                                                    static_cast<std::int32_t>(x.head_stride), dim, cu, batch, total);
  return cuda_status(cudaGetLastError(), "backward zero-rows kernel launch");
}

template <typename T>
Status run_typed(const AttnBackwardParams& a, const BwdEntry& e, const BackwardWorkspaceLayout& l, cudaStream_t stream,
                 const DeviceInfo& dev, int key_group) {
  BwdParams p = make_params(a, l);
  // The main kernel's grid: key tiles of the longest sequence, in groups (bwd_run).
  const int key_tiles =
      walk::Tiles::make(a.seqlen_q, a.seqlen_k, e.tile.block_m, e.tile.block_n, a.mask.block_sparse).num_k_tiles();
  p.key_group = select::backward_key_group(p.sem != nullptr, key_tiles, a.batch, a.heads_kv,
                                           dev.num_sms * std::max(1, e.tile.min_blocks), key_group);
  const bool rows = a.batch > 0 && a.seqlen_q > 0, keys = a.batch > 0 && a.seqlen_k > 0;
  if (e.ws && rows && keys) {  // the warp-specialized kernel loads Q, dO, K and V by TMA
    const bool varlen = a.mask.is_varlen();
    const int dv = a.effective_head_dim_v(), bm = e.tile.block_m, bn = e.tile.block_n;
    FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_q, a.q, a.seqlen_q, a.heads_q, a.batch, a.head_dim, bm, varlen));
    FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_do, a.dout, a.seqlen_q, a.heads_q, a.batch, dv, bm, varlen));
    FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_k, a.k, a.seqlen_k, a.heads_kv, a.batch, a.head_dim, bn, varlen));
    FLASHCPP_RETURN_IF_ERROR(encode_tma_map(&p.tmap_v, a.v, a.seqlen_k, a.heads_kv, a.batch, dv, bn, varlen));
    FLASHCPP_RETURN_IF_ERROR(encode_f32_rows_map(&p.tmap_dq, p.dq_accum, a.head_dim, l.rows, a.heads_q, 32, 64));
  }
  const dim3 rows_grid(static_cast<unsigned>((a.seqlen_q + 31) / 32), static_cast<unsigned>(a.heads_q),
                       static_cast<unsigned>(a.batch));
  // The dQ accumulator starts at 0 wherever query rows exist (without keys dQ stays 0).
  if (rows)
    FLASHCPP_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(p.dq_accum, 0, l.semaphores - l.dq_accum, stream), "cudaMemsetAsync(dq_accum)"));
  if (rows && keys) {
    // D = 0 and LSE log2 e = 0x7f7f7f7f (3.4e38) in every padded row, so their P = exp2(t c - 3.4e38) = 0
    // and dS = 0 without a bounds check, and the semaphores 0; the preprocess then writes the rows of
    // the sequences.
    const std::size_t row_bytes = static_cast<std::size_t>(a.heads_q) * static_cast<std::size_t>(l.rows) * sizeof(float);
    FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(p.delta, 0, row_bytes, stream), "cudaMemsetAsync(delta)"));
    FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(p.lse2, 0x7f, row_bytes, stream), "cudaMemsetAsync(lse)"));
    if (p.sem != nullptr)
      FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(p.sem, 0, l.bytes - l.semaphores, stream), "cudaMemsetAsync(semaphores)"));
    bwd_preprocess_kernel<T><<<rows_grid, 128, 0, stream>>>(p);
    FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "backward preprocess launch"));
  }
  // The main kernel wherever keys exist: without query rows it visits no pair and writes dK = dV = 0.
  if (keys) FLASHCPP_RETURN_IF_ERROR((std::is_same_v<T, __nv_bfloat16> ? e.run_bf16 : e.run_fp16)(p, key_tiles, stream, dev.device));
  if (rows) {
    bwd_postprocess_kernel<T><<<rows_grid, 128, 0, stream>>>(p);
    FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "backward postprocess launch"));
  }
  const MaskParams& m = a.mask;
  if (m.is_varlen()) {
    FLASHCPP_RETURN_IF_ERROR(zero_uncovered<T>(a.dq, a.heads_q, a.head_dim, m.cu_seqlens_q, a.batch, m.total_q, stream));
    FLASHCPP_RETURN_IF_ERROR(zero_uncovered<T>(a.dk, a.heads_kv, a.head_dim, m.cu_seqlens_k, a.batch, a.total_k, stream));
    FLASHCPP_RETURN_IF_ERROR(
        zero_uncovered<T>(a.dv, a.heads_kv, a.effective_head_dim_v(), m.cu_seqlens_k, a.batch, a.total_k, stream));
  }
  return Status::Ok();
}

}  // namespace

Status backward_cuda(const AttnBackwardParams& a, const TileConfig& tile, const BackwardWorkspaceLayout& layout,
                     Stream stream, int key_group) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(current_device(&dev));
  const int cls = cuda_head_dim_class(a.head_dim, a.effective_head_dim_v());
  const BwdEntry* e = bwd_entry(cls);
  for (bool ws : {false, true})
    if (const BwdEntry* e90 = bwd_entry_sm90(cls, ws); e90 != nullptr && e90->tile == tile) e = e90;
  if (e == nullptr || !(e->tile == tile))
    return Status::Invalid("no backward config with tiles " + std::to_string(tile.block_m) + "x" +
                           std::to_string(tile.block_n) + " for head_dim " + std::to_string(a.head_dim));
  if (layout.row_pad != e->tile.block_m)
    return Status::Internal("backward_cuda: the workspace layout was made for another tile height");
  if (a.heads_kv > 65535 || a.batch > 65535 || a.heads_q > 65535)
    return Status::Unsupported("batch " + std::to_string(a.batch) + " or heads " + std::to_string(a.heads_q) +
                               " exceeds the 65535 limit of a grid dimension");
  const auto stream_ = static_cast<cudaStream_t>(stream);
  return a.q.dtype == DType::kBF16 ? run_typed<__nv_bfloat16>(a, *e, layout, stream_, dev, key_group)
                                   : run_typed<__half>(a, *e, layout, stream_, dev, key_group);
}

}  // namespace flashcpp::cuda
