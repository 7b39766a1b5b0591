// The pieces of attention's validation (validate.cc) that the backward's validation
// (backward_validate.cc) shares, so the shared fields are checked by the same code with the same
// sentences: a tensor view's strides, alignment, 32-bit in-sequence offsets, injectivity and span.
#pragma once

#include <cstdint>

#include "core/message.h"
#include "flashcpp/attention.h"
#include "flashcpp/status.h"

namespace flashcpp::detail {

/// The (batch, seq, head, dim) index map a view must address (validate.cc calls it Extents).
struct ViewExtents {
  std::int64_t batch = 0;    ///< ignored when varlen (no batch dim)
  std::int64_t seq = 0;      ///< rows addressed from the base: seqlen, or the packed total
  std::int64_t seq_max = 0;  ///< rows inside one sequence (for the 32-bit offset rule)
  std::int64_t heads = 0;
  std::int64_t dim = 0;
  bool varlen = false;
  const char* seqlen_name = "";  ///< "seqlen_q" / "seqlen_k"
  const char* heads_name = "";   ///< "heads_q" / "heads_kv"
  const char* dim_name = "head_dim";  ///< "head_dim" (q, k) / "head_dim_v" (v, o)
};

/// Checks view `name` as attention's validation checks q, k, v and o on `backend` (null, element
/// and CUDA vector alignment, strides, offsets, injectivity) and returns its byte span.
Status check_attention_view(const char* name, const TensorView& t, const ViewExtents& e, Backend backend, Span* span);

}  // namespace flashcpp::detail
