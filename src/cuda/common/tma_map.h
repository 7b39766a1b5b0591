// TMA tensor maps over the attention tensors (q, k, v, o, dO), shared by the sm_90a prefill
// (fa3_dispatch.cc) and the warp-specialized backward (bwd_dispatch.cu).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "flashcpp/status.h"
#include "flashcpp/types.h"

namespace flashcpp::cuda {

/// Rank-4 map over (head_dim, seqlen, heads, batch) of a 16-bit tensor view, box (64, rows, 1, 1),
/// 128-byte swizzle. Rows past seqlen read as zeros (TMA out-of-bounds fill), and so do columns
/// past head_dim when the kernel's class is wider (a head dim of 96 in the 128 class: the second
/// panel's columns 96..127); a store through the map skips them.
///
/// Varlen (packed (total, heads, head_dim) with sequences at unknown device-side offsets): the
/// map is (head_dim, x, heads, e) with extents (head_dim, max_len, heads, batch * max_len + 1),
/// strides (seq, head, seq) and its origin max_len rows BEFORE the data. Coordinate (x, e)
/// addresses packed row x + e - max_len, so the kernel loads row r of the sequence that starts
/// at row `first` and has `len` rows with x = max_len - len + r, e = first + len; x < max_len
/// holds exactly for r < len, so TMA zero-fills the rows past this sequence's end (never another
/// sequence's rows), and e <= total <= batch * max_len stays in range. The shifted origin is
/// only an address the hardware adds offsets to; every row it reads lies inside the tensor.
Status encode_tma_map(CUtensorMap* map, const TensorView& t, int seqlen, int heads, int batch, int head_dim,
                      int box_rows, bool varlen);

/// Rank-3 map over an fp32 array [heads][rows][cols] (the backward's dQ accumulator), box
/// (box_cols, box_rows, 1) with 128-byte swizzle (box_cols * 4 <= 128); a reduce-add through it
/// skips the columns past `cols`.
Status encode_f32_rows_map(CUtensorMap* map, float* data, int cols, std::int64_t rows, int heads, int box_cols,
                           int box_rows);

}  // namespace flashcpp::cuda
