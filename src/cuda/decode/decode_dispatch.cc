// CUDA backend of decode_run and merge_attention_states: DecodeParams + plan -> one kernel
// params struct, then the launches (append, split-KV, merge) on one stream. Runtime values
// become template constants only here: the head-dim class (cuda_head_dim_class of head_dim and
// head_dim_v: 64, 128 or 256) picks the translation unit, dtype the type.
// Nothing allocates and nothing synchronizes, so the sequence is capturable in a CUDA graph;
// the kernels read cache_seqlens at run time, so a replay sees new lengths.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_api.h"
#include "core/decode_backends.h"
#include "common/decode_common.h"
#include "cuda/decode/decode_launch.h"

namespace flashcpp::cuda {
namespace {

int log2_exact(int x) {
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

DecodeKernelParams make_params(const DecodeParams& a, const DecodePlan& plan) {
  DecodeKernelParams p{};
  p.q = a.q.data;
  p.o = a.o.data;
  p.lse = a.lse;
  p.q_batch_stride = a.q.batch_stride;
  p.q_seq_stride = a.q.seq_stride;
  p.q_head_stride = a.q.head_stride;
  p.o_batch_stride = a.o.batch_stride;
  p.o_seq_stride = a.o.seq_stride;
  p.o_head_stride = a.o.head_stride;

  const KVCacheView& c = a.cache;
  p.k_cache = c.k.data;
  p.v_cache = c.v.data;
  p.k_cache_w = c.k.data;
  p.v_cache_w = c.v.data;
  p.k_batch_stride = c.k.batch_stride;
  p.k_seq_stride = c.k.seq_stride;
  p.k_head_stride = c.k.head_stride;
  p.v_batch_stride = c.v.batch_stride;
  p.v_seq_stride = c.v.seq_stride;
  p.v_head_stride = c.v.head_stride;
  p.paged = c.paged() ? 1 : 0;
  p.block_table = c.block_table;
  p.block_table_stride = c.block_table_stride;
  p.page_shift = c.paged() ? log2_exact(c.page_size) : 0;
  p.page_mask = c.paged() ? c.page_size - 1 : 0;
  p.num_pages = c.num_pages;
  p.slots = static_cast<int>(c.slots());
  p.cache_seqlens = a.cache_seqlens;
  p.kv_fp8 = c.fp8() ? 1 : 0;
  p.k_scale = c.k_scale;
  p.v_scale = c.v_scale;

  p.append = a.has_append() ? 1 : 0;
  p.k_new = a.k_new.data;
  p.v_new = a.v_new.data;
  p.kn_batch_stride = a.k_new.batch_stride;
  p.kn_seq_stride = a.k_new.seq_stride;
  p.kn_head_stride = a.k_new.head_stride;
  p.vn_batch_stride = a.v_new.batch_stride;
  p.vn_seq_stride = a.v_new.seq_stride;
  p.vn_head_stride = a.v_new.head_stride;

  const RotarySpec& ro = a.rotary;
  p.rot_style = ro.style == RopeStyle::kNeox ? 1 : ro.style == RopeStyle::kInterleaved ? 2 : 0;
  p.rot_dim = ro.effective_rotary_dim(a.head_dim);
  p.rot_cos = ro.cos;
  p.rot_sin = ro.sin;
  p.rot_table_stride = ro.effective_table_stride(a.head_dim);
  p.rot_max_pos = ro.max_position;
  if (p.rot_style != 0 && ro.cos == nullptr)  // rot_dim <= 256: validated
    std::copy_n(rotary_inv_freq_table(p.rot_dim, ro.theta, ro.llama3), p.rot_dim / 2, p.rot_inv_freq);

  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.heads_q = a.heads_q;
  p.heads_kv = a.heads_kv;
  p.head_dim = a.head_dim;
  p.head_dim_v = a.effective_head_dim_v();
  p.group = a.heads_q / a.heads_kv;
  p.rows = plan.rows_per_kv;
  p.row_blocks = plan.row_blocks;
  p.warp_rows = plan.warp_rows;

  p.softmax_scale = a.effective_scale();
  p.softcap = a.mask.softcap;
  p.score = algebra::ScoreTransform::make(p.softmax_scale, p.softcap);
  p.alibi = a.mask.alibi_slopes;
  p.alibi_batch_stride = a.mask.alibi_batch_stride;
  p.causal = a.mask.causal ? 1 : 0;
  p.window_left = decode::clamp_window(a.mask.window_left, p.slots);
  p.window_right = decode::clamp_window(a.mask.window_right, p.slots);

  const decode::WorkList wl = decode::worklist_view(plan.int_workspace, a.batch, plan.num_items);
  p.first_item = wl.first_item;
  p.num_splits = wl.num_splits;
  p.item_batch = wl.item_batch;
  p.item_split = wl.item_split;
  p.fused_append = plan.fused_append && p.append ? 1 : 0;
  p.uniform_splits =
      plan.max_splits > 0 && static_cast<std::int64_t>(plan.num_items) == static_cast<std::int64_t>(a.batch) * plan.max_splits
          ? plan.max_splits
          : 0;
  if (plan.fused_merge)
    p.merge_counters = static_cast<int*>(plan.int_workspace) + decode::worklist_int_count(a.batch, plan.num_items);
  if (plan.needs_merge) {
    p.part_o = static_cast<float*>(plan.float_workspace);
    // Partial rows are head_dim_v wide, as decode_workspace_size sized them (not the class).
    p.part_lse = p.part_o + decode::partial_lse_offset(plan.num_items, a.heads_kv, plan.rows_per_kv, p.head_dim_v);
  }
  return p;
}

Status check_device(DeviceInfo* dev) {
  FLASHCPP_RETURN_IF_ERROR(current_device(dev));
  if (dev->sm_major < 8)
    return Status::Unsupported("the CUDA decode kernels need compute capability 8.0 or newer; device '" + dev->name +
                               "' is " + std::to_string(dev->sm_major) + "." + std::to_string(dev->sm_minor));
  return Status::Ok();
}

}  // namespace

Status decode_run(const DecodeParams& a, const DecodePlan& plan, Stream stream, bool programmatic) {
  DeviceInfo dev;
  FLASHCPP_RETURN_IF_ERROR(check_device(&dev));
  const bool fp8 = a.cache.fp8();
  // The class runs the shape padded inside the kernel (decode_params.h), nothing copied.
  const int cls = cuda_head_dim_class(a.head_dim, a.effective_head_dim_v());
  const std::size_t smem = static_cast<std::size_t>(decode::cta_smem_bytes(cls, fp8));
  if (smem > dev.smem_optin)
    return Status::Unsupported("the head_dim class " + std::to_string(cls) + " decode kernel needs " +
                               std::to_string(smem) + " bytes of shared memory; " + dev.name + " allows " +
                               std::to_string(dev.smem_optin));
  DecodeKernelParams p = make_params(a, plan);
  // The first launch is programmatic only when asked (RunOptions::programmatic_launch). A launch
  // that follows one of this step's own kernels always is on sm_90+: every decode kernel waits for
  // the grid before it (griddepcontrol.wait) and then releases its dependents, so the next launch
  // (the merge above all, a few us at B = 1) overlaps the tail instead of waiting for it; results
  // are the same.
  const bool pdl_ok = dev.sm_major >= 9;
  p.pdl = programmatic && pdl_ok ? 1 : 0;
  const DType dt = a.q.dtype;
  if (p.append && !p.fused_append) {
    FLASHCPP_RETURN_IF_ERROR(decode_append_launch(p, dt, stream));
    p.pdl = pdl_ok ? 1 : 0;
    p.after_own_append = pdl_ok ? 1 : 0;  // the split kernel may start its loads beside the append
  }
  const int pad = decode::launch_smem_pad(cls, fp8, plan.ctas_per_sm, static_cast<int>(dev.smem_optin) + 1024);
  switch (cls) {
    case 64: FLASHCPP_RETURN_IF_ERROR(decode_split_launch_hd64(p, dt, plan.ctas, pad, stream, dev.device)); break;
    case 128: FLASHCPP_RETURN_IF_ERROR(decode_split_launch_hd128(p, dt, plan.ctas, pad, stream, dev.device)); break;
    case 256: FLASHCPP_RETURN_IF_ERROR(decode_split_launch_hd256(p, dt, plan.ctas, pad, stream, dev.device)); break;
    default:
      return Status::Internal("decode_run: head_dim " + std::to_string(a.head_dim) + " / head_dim_v " +
                              std::to_string(a.effective_head_dim_v()) + " has no class but passed validation");
  }
  p.pdl = pdl_ok ? 1 : 0;
  p.after_own_append = 0;
  if (plan.needs_merge && !plan.fused_merge) FLASHCPP_RETURN_IF_ERROR(decode_merge_launch(p, dt, stream));
  return Status::Ok();
}

Status merge_attention_states(const MergeStatesParams& a, Stream stream) {
  MergeStatesKernelParams p{};
  p.o_a = a.o_a.data;
  p.o_b = a.o_b.data;
  p.o = a.o.data;
  p.lse_a = a.lse_a;
  p.lse_b = a.lse_b;
  p.lse = a.lse;
  p.a_batch_stride = a.o_a.batch_stride;
  p.a_seq_stride = a.o_a.seq_stride;
  p.a_head_stride = a.o_a.head_stride;
  p.b_batch_stride = a.o_b.batch_stride;
  p.b_seq_stride = a.o_b.seq_stride;
  p.b_head_stride = a.o_b.head_stride;
  p.o_batch_stride = a.o.batch_stride;
  p.o_seq_stride = a.o.seq_stride;
  p.o_head_stride = a.o.head_stride;
  p.batch = a.batch;
  p.seqlen = a.seqlen;
  p.heads = a.heads;
  p.head_dim = a.head_dim;
  return merge_states_launch(p, a.o_a.dtype, stream);
}

}  // namespace flashcpp::cuda
