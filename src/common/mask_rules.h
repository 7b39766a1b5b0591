// Visibility rules of MaskParams as plain integer arithmetic, shared by the CUDA kernels and the
// CPU tiled backend (which mirrors them), so both walk exactly the same key blocks.
// The fp64 reference (src/cpu/reference.cc) deliberately does NOT use this file: it evaluates
// the rules of attention.h element by element, so the two can check each other.
#pragma once

#include "common/hd.h"

namespace flashcpp {

/// The window/causal/global part of a mask for one sequence (block-sparse is handled apart).
struct MaskRules {
  int seqlen_q = 0, seqlen_k = 0;
  bool causal = false;
  int window_left = -1, window_right = -1;
  int global_tokens = 0;
  bool global_queries = false;

  /// Builds the rules with windows clamped to seqlen_q + seqlen_k (a wider window sees the same
  /// keys), so that ia + window never overflows int.
  static inline MaskRules make(int seqlen_q, int seqlen_k, bool causal, int window_left, int window_right,
                               int global_tokens, bool global_queries) {
    const long long cap = static_cast<long long>(seqlen_q) + seqlen_k;
    auto clamp = [cap](int w) { return w < 0 ? -1 : static_cast<int>(w > cap ? cap : w); };
    return MaskRules{seqlen_q, seqlen_k, causal, clamp(window_left), clamp(window_right), global_tokens,
                     global_queries};
  }

  FC_HD int offset() const { return seqlen_k - seqlen_q; }
  FC_HD bool is_global_query(int i) const {
    return global_queries && i + offset() < global_tokens;
  }
  /// Exclusive upper bound of the keys row i can see.
  FC_HD int key_hi(int i) const {
    const int ia = i + offset();
    int hi = seqlen_k;
    if (causal && ia + 1 < hi) hi = ia + 1;
    if (window_right >= 0 && !is_global_query(i) && ia + window_right + 1 < hi)
      hi = ia + window_right + 1;
    return hi < 0 ? 0 : hi;
  }
  /// key_hi of a rule set without a window (no window_right, no global queries): the sequence's
  /// end, or ia + 1 when causal. May be negative (a causal row that sees no key).
  FC_HD int causal_key_hi(int i) const {
    const int ia1 = i + offset() + 1;
    return causal && ia1 < seqlen_k ? ia1 : seqlen_k;
  }
  /// Inclusive lower bound of the window of row i (keys below it are visible only if global).
  FC_HD int key_lo(int i) const {
    if (window_left < 0 || is_global_query(i)) return 0;
    const int lo = i + offset() - window_left;
    return lo < 0 ? 0 : lo;
  }
  FC_HD bool visible(int i, int j) const {
    return j >= 0 && j < key_hi(i) && (j >= key_lo(i) || j < global_tokens);
  }
  /// Keys [lo, hi) that some row of [i0, i1) sees through its window (i0 < i1 <= seqlen_q).
  /// Global keys below lo are extra: see sink_hi().
  FC_HD void key_range(int i0, int i1, int* lo, int* hi) const {
    const int h0 = key_hi(i0), h1 = key_hi(i1 - 1);
    *hi = h0 > h1 ? h0 : h1;
    *lo = key_lo(i0);
    if (*lo > *hi) *lo = *hi;
  }
  /// Exclusive end of the global keys visible to some row of [i0, i1) below `lo`.
  FC_HD int sink_hi(int i0, int i1, int lo) const {
    int g = global_tokens < lo ? global_tokens : lo;
    const int h0 = key_hi(i0), h1 = key_hi(i1 - 1);
    const int hmax = h0 > h1 ? h0 : h1;
    return g < hmax ? g : hmax;
  }
  /// True when every (i, j) of the tile is visible, so the kernel may skip the element mask.
  /// Conservative: may answer false for a tile that happens to be fully visible.
  FC_HD bool tile_fully_visible(int i0, int i1, int j0, int j1) const {
    int hmin, lmax;
    if (!common_window(i0, i1, &hmin, &lmax)) return false;
    return j1 <= hmin && (j0 >= lmax || j1 <= global_tokens);
  }
  /// Keys [*lmax, *hmin) that every row of [i0, i1) sees through its window (key_lo and key_hi
  /// are monotone in the row, so the end rows bound them). False when the rows differ in being
  /// global queries (their windows then do not nest).
  FC_HD bool common_window(int i0, int i1, int* hmin, int* lmax) const {
    if (global_queries && is_global_query(i0) != is_global_query(i1 - 1)) return false;
    *hmin = key_hi(i0) < key_hi(i1 - 1) ? key_hi(i0) : key_hi(i1 - 1);
    *lmax = key_lo(i1 - 1) > key_lo(i0) ? key_lo(i1 - 1) : key_lo(i0);
    return true;
  }
  /// The window walk of rows [i0, i1) visits key tile n_last - it at iteration it < n_window.
  /// Sets [*lo, *hi) to the iterations whose tile (block_n keys) every row sees whole, as
  /// tile_fully_visible does (without its global-key case): the kernels skip the element mask
  /// there with two register compares. Empty when the rows differ in being global queries.
  FC_HD void plain_window_iters(int i0, int i1, int block_n, int n_last, int n_window, int* lo, int* hi) const {
    *lo = *hi = 0;
    int hmin, lmax;  // both >= 0
    if (!common_window(i0, i1, &hmin, &lmax)) return;
    const int n_min = (lmax + block_n - 1) / block_n;  // first tile whose keys all lie >= lmax
    const int n_max = hmin / block_n - 1;              // last tile whose keys all lie < hmin
    const int a = n_last - n_max, b = n_last - n_min + 1;
    *lo = a > 0 ? a : 0;
    *hi = b < n_window ? b : n_window;
    if (*hi < *lo) *hi = *lo;
  }
};

}  // namespace flashcpp
