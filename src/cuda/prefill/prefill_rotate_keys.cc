// The rotary fused into attention, key side (cuda_api.h): before a prefill kernel that rotates
// only its q tiles, the keys are rotated once into rotary.k_rotated by apply_rotary's kernel, so
// they carry the same rounding as a separate apply_rotary(k) (attention.h, AttnRotary). Host code:
// the parameters come from the rule the CPU backends use (core/attn_rotary.h).
#include <string>

#include "core/attn_rotary.h"
#include "cuda/cuda_api.h"
#include "cuda/fused/fused_launch.h"

namespace flashcpp::cuda {

Status rotate_keys(const AttnParams& p, Stream stream) {
  const AttnRotary& r = p.rotary;
  if (!r.enabled() || p.seqlen_k == 0 || p.batch == 0) return Status::Ok();
  if (r.k_rotated.data == nullptr)
    return Status::Internal("rotate_keys: rotary.k_rotated is null (validate() requires it on CUDA)");
  // The keys as apply_rotary's "q" (heads_kv heads, no second tensor): the same kernel, hence the
  // same rounding, as a separate apply_rotary(k). Varlen: max-length sequences over packed rows.
  const bool varlen = p.mask.is_varlen();
  RopeParams rp = detail::attn_rope_params(p, /*query=*/false, p.batch, p.seqlen_k, p.heads_kv, p.k);
  const bool in_place = r.k_rotated.data == p.k.data;  // validate(): then it is k, strides and all
  if (!in_place) rp.q_out = r.k_rotated;
  if (varlen) rp.q.batch_stride = rp.q_out.batch_stride = 0;
  // Packed (varlen) keys take the shared-cos/sin kernel: the stream kernel's packed-sequence walk
  // has not run on a GPU yet (same arithmetic either way, so the same bits).
  FusedForce force;
  force.shared = varlen;
  const Status s = apply_rotary(rp, force, stream, varlen ? p.mask.cu_seqlens_k : nullptr);
  if (!s.ok()) return Status(s.code(), std::string("rotary (k pre-pass): ") + s.message());
  return Status::Ok();
}

}  // namespace flashcpp::cuda
