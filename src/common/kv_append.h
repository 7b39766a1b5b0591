// Where a new token lands in a KV cache (decode.h's rule, shared by decode's append and by
// rope_append_kv of fused.h), as plain host/device arithmetic: the CUDA kernel
// (src/cuda/fused/rope_append.cu) and the CPU backend (src/cpu/fused.cc) both call it. On the
// device the lengths and block-table entries are unchecked values, so they are clamped here; the
// CPU backend has refused out-of-range values before it gets here, so there the clamps change
// nothing.
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace flashcpp::fused {

/// Keys already in a sequence, clamped into [0, slots - seqlen] so that its seqlen new tokens fit.
FC_HD int append_base(std::int32_t cache_len, std::int64_t slots, int seqlen) {
  const std::int64_t room = slots - seqlen;  // validation: slots >= seqlen
  const std::int64_t c = cache_len < 0 ? 0 : (cache_len > room ? room : cache_len);
  return static_cast<int>(c);
}

/// Slot j of sequence b as (block, row): a paged cache's page block_table[b * bt_stride +
/// j / page_size] (clamped into [0, num_pages)) and row j % page_size (page_size a power of two,
/// page_shift its log2), or a contiguous cache's batch entry b and row j. The element offset of a
/// head is then block * batch_stride + row * seq_stride + head * head_stride.
FC_HD void slot_place(const std::int32_t* block_table, std::int64_t bt_stride, int page_shift, int num_pages, bool paged,
                      int b, int j, std::int64_t* block, std::int64_t* row) {
  if (!paged) {
    *block = b;
    *row = j;
    return;
  }
#if defined(__CUDA_ARCH__)
  int page = __ldg(block_table + b * bt_stride + (j >> page_shift));
#else
  int page = block_table[b * bt_stride + (j >> page_shift)];
#endif
  page = page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);
  *block = page;
  *row = j & ((1 << page_shift) - 1);
}

}  // namespace flashcpp::fused
