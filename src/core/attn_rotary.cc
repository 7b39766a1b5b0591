// Rotary fused into attention on the CPU backends: q and k are copied, rotated by the CPU
// apply_rotary (the same code and rounding as a separate apply_rotary call), and the backend runs
// on the copies. This is the semantics of AttnRotary (attention.h) that the GPU kernels must
// match: rotated q and k in the input dtype. When rotary.k_rotated is set, the rotated copy of k
// is stored there too (what the CUDA pre-pass writes). Public as cpu::run_with_rotary
// (flashcpp/reference.h): the harness's fp64 reference and plain fp32 implementation rotate
// through it.
#include "core/attn_rotary.h"

#include <cstring>
#include <vector>

#include "flashcpp/fused.h"

namespace flashcpp::cpu {
namespace {

/// A contiguous copy of a q or k view: (batch, seqlen, heads, head_dim), or with `packed` the
/// (rows, heads, head_dim) rows of a varlen tensor (batch_stride unused).
struct Copy {
  std::vector<unsigned char> bytes;
  TensorView view;
};

/// Calls f(row) with the address of each (b, s, h) row of a strided view, in contiguous order.
template <class F>
void for_each_row(const TensorView& v, std::int64_t batch, std::int64_t seqlen, int heads, F&& f) {
  const std::size_t es = dtype_size(v.dtype);
  auto* base = static_cast<unsigned char*>(v.data);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seqlen; ++s)
      for (int h = 0; h < heads; ++h)
        f(base + static_cast<std::size_t>(b * v.batch_stride + s * v.seq_stride + h * v.head_stride) * es);
}

void copy_view(const TensorView& v, std::int64_t batch, std::int64_t seqlen, int heads, int d, Copy* c) {
  const std::size_t row = static_cast<std::size_t>(d) * dtype_size(v.dtype);
  c->bytes.resize(static_cast<std::size_t>(batch * seqlen * heads) * row);
  c->view = bshd_view(c->bytes.data(), v.dtype, seqlen, heads, d);
  unsigned char* dst = c->bytes.data();
  for_each_row(v, batch, seqlen, heads, [&](const unsigned char* src) {
    std::memcpy(dst, src, row);
    dst += row;
  });
}

/// Writes the rows of a contiguous copy back into a strided view of the same extents (the
/// inverse of copy_view).
void store_view(const Copy& c, std::int64_t batch, std::int64_t seqlen, int heads, int d, const TensorView& v) {
  const std::size_t row = static_cast<std::size_t>(d) * dtype_size(v.dtype);
  const unsigned char* src = c.bytes.data();
  for_each_row(v, batch, seqlen, heads, [&](unsigned char* dst) {
    std::memcpy(dst, src, row);
    src += row;
  });
}

/// Default positions: query row i of a sequence with len_q queries and len_k keys sits at
/// i + len_k - len_q (bottom-right, the causal alignment); key row j at j.
std::vector<std::int32_t> default_positions(const AttnParams& p, bool query, std::int64_t rows) {
  std::vector<std::int32_t> pos(static_cast<std::size_t>(rows));
  const std::int32_t* cu = query ? p.mask.cu_seqlens_q : p.mask.cu_seqlens_k;
  for (int b = 0; b < p.batch; ++b) {
    const std::int64_t first = p.mask.is_varlen() ? cu[b] : static_cast<std::int64_t>(b) * (query ? p.seqlen_q : p.seqlen_k);
    const std::int64_t len_q = p.mask.is_varlen() ? p.mask.cu_seqlens_q[b + 1] - p.mask.cu_seqlens_q[b] : p.seqlen_q;
    const std::int64_t len_k = p.mask.is_varlen() ? p.mask.cu_seqlens_k[b + 1] - p.mask.cu_seqlens_k[b] : p.seqlen_k;
    const std::int64_t len = query ? len_q : len_k, shift = query ? len_k - len_q : 0;
    for (std::int64_t i = 0; i < len; ++i) pos[static_cast<std::size_t>(first + i)] = static_cast<std::int32_t>(i + shift);
  }
  return pos;
}

/// Rotates the copy of q (query = true) or k in place with the CPU apply_rotary.
Status rotate(const AttnParams& p, bool query, const RunOptions& opt, Copy* c) {
  const bool varlen = p.mask.is_varlen();
  const std::int64_t seqlen = query ? p.seqlen_q : p.seqlen_k;
  const std::int64_t rows = varlen ? (query ? p.mask.cu_seqlens_q[p.batch] : p.mask.cu_seqlens_k[p.batch])
                                   : static_cast<std::int64_t>(p.batch) * seqlen;
  const int heads = query ? p.heads_q : p.heads_kv;
  const TensorView& v = query ? p.q : p.k;
  if (varlen)
    copy_view(v, 1, rows, heads, p.head_dim, c);
  else
    copy_view(v, p.batch, seqlen, heads, p.head_dim, c);
  const std::int32_t* given = query ? p.rotary.positions_q : p.rotary.positions_k;
  std::vector<std::int32_t> defaults;
  if (given == nullptr) defaults = default_positions(p, query, rows);
  RopeParams rp = detail::attn_rope_params(p, query, varlen ? 1 : p.batch, static_cast<int>(varlen ? rows : seqlen),
                                            heads, c->view);
  if (given == nullptr) rp.positions = defaults.data();
  RunOptions ro;
  ro.backend = Backend::kCpu;
  ro.cpu_threads = opt.cpu_threads;
  const Status s = apply_rotary(rp, ro);
  if (!s.ok()) return Status(s.code(), std::string("rotary (") + (query ? "q" : "k") + "): " + s.message());
  return Status::Ok();
}

}  // namespace

Status run_with_rotary(const AttnParams& p, const RunOptions& opt, const std::function<Status(const AttnParams&)>& run) {
  if (!p.rotary.enabled()) return run(p);
  Copy q, k;
  FLASHCPP_RETURN_IF_ERROR(rotate(p, true, opt, &q));
  AttnParams r = p;
  r.q = q.view;
  if (p.seqlen_k > 0) {
    FLASHCPP_RETURN_IF_ERROR(rotate(p, false, opt, &k));
    r.k = k.view;
  }
  if (p.mask.is_varlen()) {  // packed copies: rows at seq_stride, no batch stride
    r.q.batch_stride = 0;
    r.k.batch_stride = 0;
  }
  r.rotary = AttnRotary{};
  FLASHCPP_RETURN_IF_ERROR(run(r));
  // The rotated keys, for a caller that keeps them (a KV cache). Stored after the run, so the
  // attention read v (and anything else sharing k's buffer) as the caller passed it, also when
  // k_rotated is k itself (in place).
  const TensorView& kr = p.rotary.k_rotated;
  if (kr.data != nullptr && p.seqlen_k > 0) {
    if (p.mask.is_varlen())  // packed rows, batch_stride unused
      store_view(k, 1, p.mask.cu_seqlens_k[p.batch], p.heads_kv, p.head_dim, kr);
    else
      store_view(k, p.batch, p.seqlen_k, p.heads_kv, p.head_dim, kr);
  }
  return Status::Ok();
}

}  // namespace flashcpp::cpu
