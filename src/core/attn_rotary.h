// The rotary fused into attention: the parameters both backends rotate with, and the CPU
// backends' wrapper (attn_rotary.cc; declared in flashcpp/reference.h).
#pragma once

#include "flashcpp/attention.h"
#include "flashcpp/fused.h"
#include "flashcpp/reference.h"

namespace flashcpp::detail {

/// apply_rotary's parameters for one side of the attention rotary (query: q with positions_q,
/// else k with positions_k) over rows (batch, seqlen) of `heads` heads: the view, positions and
/// the spec; the caller sets q_out and, for defaults it computes itself, positions. Shared
/// by the CPU backends and the CUDA key pre-pass, so both rotate with the same parameters.
inline RopeParams attn_rope_params(const AttnParams& p, bool query, int batch, int seqlen, int heads,
                                   const TensorView& view) {
  RopeParams rp;
  rp.batch = batch;
  rp.seqlen = seqlen;
  rp.heads_q = heads;
  rp.head_dim = p.head_dim;
  rp.q = view;
  rp.positions = query ? p.rotary.positions_q : p.rotary.positions_k;
  rp.rotary = p.rotary.spec;  // the same RotarySpec: the same rotation as apply_rotary's
  return rp;
}

/// The CPU backends' rotary wrapper; public as cpu::run_with_rotary (flashcpp/reference.h), which
/// the harness's references use too, so the backends and their ground truth rotate alike.
using cpu::run_with_rotary;

}  // namespace flashcpp::detail
