// Launch functions of the decode kernels, one per translation unit family. The instantiations
// (the whole list; everything else is a runtime argument: page size, paged or not, causal,
// window, softcap, ALiBi, rotary style, GQA group, seqlen_q, split count, and the head dims inside
// a class, which pad to it in the loads and stores):
//   decode_split_kernel<D, T, C>  D in {64, 128, 256} x T in {bf16, fp16}   decode_hd{64,128,256}.cu
//                                 x cache C in {T, fp8 e4m3}
//   decode_append_kernel<T, C>    T in {bf16, fp16} x C in {T, fp8 e4m3}    decode_aux.cu
//   decode_merge_kernel<T>        T in {bf16, fp16}                         decode_aux.cu
//   merge_states_kernel<T>        T in {bf16, fp16, fp32}                   decode_aux.cu
// 21 kernels in all, each compiled for sm_80 and sm_90a.
#pragma once

#include "cuda/decode/decode_params.h"
#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

/// The split-KV kernel of one head-dim class (every head_dim, head_dim_v it holds); `ctas` = plan.ctas (1-D grid).
Status decode_split_launch_hd64(const DecodeKernelParams& p, DType dt, int ctas, int smem_pad, Stream stream, int device);
Status decode_split_launch_hd128(const DecodeKernelParams& p, DType dt, int ctas, int smem_pad, Stream stream, int device);
Status decode_split_launch_hd256(const DecodeKernelParams& p, DType dt, int ctas, int smem_pad, Stream stream, int device);
/// New K (rotated) and V into the cache: one warp per (sequence, token, KV head).
Status decode_append_launch(const DecodeKernelParams& p, DType dt, Stream stream);
/// Combines the partials of split sequences: one warp per (sequence, token, query head).
Status decode_merge_launch(const DecodeKernelParams& p, DType dt, Stream stream);
/// merge_attention_states: one warp per (batch, position, head) row.
Status merge_states_launch(const MergeStatesKernelParams& p, DType dt, Stream stream);

}  // namespace flashcpp::cuda
