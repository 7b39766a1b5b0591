// flashcpp._flashcpp: the nanobind binding of the C++ API.
//
// Framework-free on purpose: a tensor arrives as a raw data pointer (a Python int) with its
// element strides, the element type as a dtype code (flashcpp::DType), and the CUDA stream as
// an int (torch.cuda.current_stream().cuda_stream). Nothing here knows about torch or DLPack,
// so the wheel links no libtorch and a launch never synchronizes. The Python layer
// (flashcpp/_core.py) checks types, devices and shapes and allocates the outputs; this layer
// fills AttnParams/RunOptions and turns a non-ok Status into a Python exception:
//   kInvalidArgument -> ValueError, kUnsupported -> NotImplementedError, else RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "flashcpp/masks.h"
#include "flashcpp/reference.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using flashcpp::AttnParams;
using flashcpp::Backend;
using flashcpp::DType;
using flashcpp::RunOptions;
using flashcpp::Status;
using flashcpp::StatusCode;

/// (data pointer, batch_stride, seq_stride, head_stride); strides in elements.
using TensorArg = std::tuple<std::uintptr_t, std::int64_t, std::int64_t, std::int64_t>;

/// Raises the Python exception that matches a non-ok Status. Call with the GIL held.
[[noreturn]] void raise_status(const Status& st) {
  PyObject* type = PyExc_RuntimeError;
  std::string msg = st.message();
  switch (st.code()) {
    case StatusCode::kInvalidArgument: type = PyExc_ValueError; break;
    case StatusCode::kUnsupported: type = PyExc_NotImplementedError; break;
    default: msg = st.to_string(); break;  // keep "cuda_error: ..." / "internal: ..." visible
  }
  PyErr_SetString(type, msg.c_str());
  throw nb::python_error();
}

[[noreturn]] void raise_value_error(const std::string& msg) {
  PyErr_SetString(PyExc_ValueError, msg.c_str());
  throw nb::python_error();
}

DType to_dtype(int code) {
  switch (code) {
    case static_cast<int>(DType::kF16): return DType::kF16;
    case static_cast<int>(DType::kBF16): return DType::kBF16;
    case static_cast<int>(DType::kF32): return DType::kF32;
    default: raise_value_error("dtype code " + std::to_string(code) + " is not one of 0 (fp16), 1 (bf16), 2 (fp32)");
  }
}

Backend to_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "cpu") return Backend::kCpu;
  if (name == "cpu-reference") return Backend::kCpuReference;
  if (name == "cuda") return Backend::kCuda;
  raise_value_error("backend '" + name + "' is not one of auto, cpu, cpu-reference, cuda");
}

flashcpp::TensorView to_view(const TensorArg& t, DType dt) {
  flashcpp::TensorView v;
  v.data = reinterpret_cast<void*>(std::get<0>(t));
  v.dtype = dt;
  v.batch_stride = std::get<1>(t);
  v.seq_stride = std::get<2>(t);
  v.head_stride = std::get<3>(t);
  return v;
}

/// The mask fields attention and decode share (Python passes the slopes as a data pointer).
flashcpp::MaskParams element_mask(bool causal, int window_left, int window_right, float softcap,
                                  std::uintptr_t alibi_slopes, std::int64_t alibi_batch_stride) {
  flashcpp::MaskParams m;
  m.causal = causal;
  m.window_left = window_left;
  m.window_right = window_right;
  m.softcap = softcap;
  m.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  m.alibi_batch_stride = alibi_batch_stride;
  return m;
}

/// A block-sparse mask as Python passes it: (row_ptr, col_idx, partial, element_masks) data
/// pointers, num_partial, block_m, block_n, num_batch, num_heads, num_q_blocks, num_k_blocks.
using BlockSparseArg = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t, std::int64_t,
                                  int, int, int, int, int, int>;

flashcpp::BlockSparseMask block_sparse_mask(const BlockSparseArg& a) {
  flashcpp::BlockSparseMask m;
  m.row_ptr = reinterpret_cast<const std::int32_t*>(std::get<0>(a));
  m.col_idx = reinterpret_cast<const std::int32_t*>(std::get<1>(a));
  m.partial = reinterpret_cast<const std::int32_t*>(std::get<2>(a));
  m.element_masks = reinterpret_cast<const std::uint64_t*>(std::get<3>(a));
  m.num_partial = std::get<4>(a);
  m.block_m = std::get<5>(a);
  m.block_n = std::get<6>(a);
  m.num_batch = std::get<7>(a);
  m.num_heads = std::get<8>(a);
  m.num_q_blocks = std::get<9>(a);
  m.num_k_blocks = std::get<10>(a);
  return m;
}

/// The rotary fused into attention as Python passes it: rotary_dim, style (RopeStyle value),
/// theta, Llama-3 factor / low / high / original_max_position, cos_sin_cache pointer,
/// max_position, positions_q pointer, positions_k pointer (0 = null), and k_rotated as a tensor
/// (data pointer 0 = none; CUDA needs one, Python allocates it).
using RotaryArg = std::tuple<int, int, double, float, float, float, int, std::uintptr_t, int, std::uintptr_t,
                             std::uintptr_t, TensorArg>;

flashcpp::AttnRotary attn_rotary(const RotaryArg& a, DType dt) {
  flashcpp::AttnRotary r;
  r.rotary_dim = std::get<0>(a);
  r.style = static_cast<flashcpp::RopeStyle>(std::get<1>(a));
  r.theta = std::get<2>(a);
  r.llama3 = flashcpp::Llama3Scaling{std::get<3>(a), std::get<4>(a), std::get<5>(a), std::get<6>(a)};
  r.cos_sin_cache = reinterpret_cast<const float*>(std::get<7>(a));
  r.max_position = std::get<8>(a);
  r.positions_q = reinterpret_cast<const std::int32_t*>(std::get<9>(a));
  r.positions_k = reinterpret_cast<const std::int32_t*>(std::get<10>(a));
  if (std::get<0>(std::get<11>(a)) != 0) r.k_rotated = to_view(std::get<11>(a), dt);
  return r;
}

/// One entry point for both "run" and "select only", so the two can never disagree on how
/// the arguments map to AttnParams.
nb::object attention(const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
                     std::uintptr_t lse, int dtype, int batch, int seqlen_q, int seqlen_k,
                     int heads_q, int heads_kv, int head_dim, float softmax_scale, bool causal,
                     int window_left, int window_right, float softcap, std::uintptr_t alibi_slopes,
                     std::int64_t alibi_batch_stride, int global_tokens, bool global_queries,
                     std::uintptr_t cu_seqlens_q, std::uintptr_t cu_seqlens_k, std::int64_t total_q,
                     const std::optional<BlockSparseArg>& block_sparse, const std::optional<RotaryArg>& rotary,
                     std::uintptr_t stream,
                     const std::string& backend, int cpu_threads, const std::string& cuda_config,
                     bool select_only) {
  const DType dt = to_dtype(dtype);
  AttnParams p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.q = to_view(q, dt);
  p.k = to_view(k, dt);
  p.v = to_view(v, dt);
  p.o = to_view(o, dt);
  p.lse = reinterpret_cast<float*>(lse);
  p.softmax_scale = softmax_scale;
  p.mask = element_mask(causal, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride);
  p.mask.global_tokens = global_tokens;
  p.mask.global_queries = global_queries;
  p.mask.cu_seqlens_q = reinterpret_cast<const std::int32_t*>(cu_seqlens_q);
  p.mask.cu_seqlens_k = reinterpret_cast<const std::int32_t*>(cu_seqlens_k);
  p.mask.total_q = total_q;  // varlen: the packed row count (LSE layout, batch-0 fill)
  // Lives through the call: the CPU backend computes before returning, and a CUDA launch copies
  // the fields into the kernel's parameters (the arrays it points at must outlive the kernel).
  flashcpp::BlockSparseMask sparse;
  if (block_sparse) {
    sparse = block_sparse_mask(*block_sparse);
    p.mask.block_sparse = &sparse;
  }
  if (rotary) p.rotary = attn_rotary(*rotary, dt);

  RunOptions opt;
  opt.backend = to_backend(backend);
  opt.stream = reinterpret_cast<flashcpp::Stream>(stream);
  opt.cpu_threads = cpu_threads;
  opt.cuda_config = cuda_config;

  Status st;
  flashcpp::KernelChoice choice;
  {
    // The CPU backend computes for a while; a CUDA launch may wait on the driver. Neither
    // touches Python objects.
    nb::gil_scoped_release release;
    st = select_only ? flashcpp::select_kernel(p, opt, &choice) : flashcpp::attention_forward(p, opt);
  }
  if (!st.ok()) raise_status(st);
  if (!select_only) return nb::none();
  return nb::make_tuple(std::string(flashcpp::kernel_name(choice.id)), choice.config, choice.reason);
}

using RowsIn = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using LseIn = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using RowsOut = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using LseOut = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// Row-wise cpu::merge_by_lse over (rows, dim) fp32 host arrays, into caller-owned outputs.
void merge_by_lse(const RowsIn& o_a, const LseIn& lse_a, const RowsIn& o_b, const LseIn& lse_b,
                  RowsOut& o, LseOut& lse) {
  const std::size_t rows = o_a.shape(0), dim = o_a.shape(1);
  auto same2 = [&](std::size_t r, std::size_t d) { return r == rows && d == dim; };
  if (!same2(o_b.shape(0), o_b.shape(1)) || !same2(o.shape(0), o.shape(1)))
    raise_value_error("merge_by_lse: o_a, o_b and o must have the same (rows, dim) shape");
  if (lse_a.shape(0) != rows || lse_b.shape(0) != rows || lse.shape(0) != rows)
    raise_value_error("merge_by_lse: lse_a, lse_b and lse must have one entry per row (" +
                      std::to_string(rows) + ")");
  if (dim > static_cast<std::size_t>(INT32_MAX)) raise_value_error("merge_by_lse: dim is too large");
  const float *pa = o_a.data(), *pb = o_b.data(), *la = lse_a.data(), *lb = lse_b.data();
  float *po = o.data(), *lo = lse.data();
  nb::gil_scoped_release release;
  for (std::size_t r = 0; r < rows; ++r)
    flashcpp::cpu::merge_by_lse(pa + r * dim, la[r], pb + r * dim, lb[r], static_cast<int>(dim),
                                po + r * dim, lo + r);
}

}  // namespace

// ---- masks (include/flashcpp/masks.h): ALiBi slopes and block-sparse builders -------------------
// A built mask is handed to Python without a copy: the BlockMask moves to the heap, a capsule
// owns it, and every returned array (row_ptr, col_idx, partial, element_masks) is a numpy view
// into it that keeps the capsule alive.
namespace masks_binding {

using flashcpp::BlockMask;
using flashcpp::BlockSparseOptions;
using flashcpp::BlockSparseShape;

template <class T, class... Dims>
nb::object view_of(const T* data, nb::handle owner, Dims... dims) {
  const std::size_t shape[] = {static_cast<std::size_t>(dims)...};
  return nb::cast(nb::ndarray<nb::numpy, const T>(data, sizeof...(Dims), shape, owner));
}

/// The built mask as a dict of scalars and numpy arrays (see flashcpp/masks.py).
nb::dict to_python(BlockMask&& built) {
  auto* bm = new BlockMask(std::move(built));
  nb::capsule owner(bm, [](void* p) noexcept { delete static_cast<BlockMask*>(p); });
  const flashcpp::BlockSparseMask& v = bm->view();
  const int words = (v.block_n + 63) / 64;
  nb::dict d;
  d["block_m"] = v.block_m;
  d["block_n"] = v.block_n;
  d["num_batch"] = v.num_batch;
  d["num_heads"] = v.num_heads;
  d["num_q_blocks"] = v.num_q_blocks;
  d["num_k_blocks"] = v.num_k_blocks;
  d["seqlen_q"] = bm->seqlen_q();
  d["seqlen_k"] = bm->seqlen_k();
  d["num_full_blocks"] = bm->num_full_blocks();
  d["visible_pairs"] = bm->visible_pairs();
  d["row_ptr"] = view_of(v.row_ptr, owner, bm->row_ptr().size());
  d["col_idx"] = view_of(v.col_idx, owner, bm->col_idx().size());
  d["partial"] = view_of(v.partial, owner, bm->partial().size());
  static const std::uint64_t kNone[1] = {0};  // numpy wants a pointer even for 0 elements
  d["element_masks"] = view_of(v.element_masks ? v.element_masks : kNone, owner, v.num_partial, v.block_m, words);
  return d;
}

template <class Build>
nb::dict build_and_return(Build&& build) {
  BlockMask bm;
  Status st;
  {
    nb::gil_scoped_release release;  // pure C++ (the dense / rules routes call no Python)
    st = build(&bm);
  }
  if (!st.ok()) raise_status(st);
  return to_python(std::move(bm));
}

using DenseMask = nb::ndarray<const std::uint8_t, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using CuSeqlens = nb::ndarray<const std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::dict from_dense(const DenseMask& dense, int block_m, int block_n, bool share) {
  for (std::size_t a = 0; a < 4; ++a)
    if (dense.shape(a) > static_cast<std::size_t>(INT32_MAX))
      raise_value_error("block_sparse_from_dense: the dense mask has a dimension above 2^31-1");
  const BlockSparseShape s{static_cast<int>(dense.shape(2)), static_cast<int>(dense.shape(3)), block_m,
                           block_n, static_cast<int>(dense.shape(0)), static_cast<int>(dense.shape(1))};
  const std::uint8_t* data = dense.data();
  return build_and_return([&](BlockMask* out) {
    return flashcpp::build_block_sparse_from_dense(s, data, out, BlockSparseOptions{share});
  });
}

flashcpp::MaskParams rules(bool causal, int window_left, int window_right, int global_tokens,
                           bool global_queries) {
  flashcpp::MaskParams m;
  m.causal = causal;
  m.window_left = window_left;
  m.window_right = window_right;
  m.global_tokens = global_tokens;
  m.global_queries = global_queries;
  return m;
}

nb::dict from_rules(int seqlen_q, int seqlen_k, int block_m, int block_n, bool causal, int window_left,
                    int window_right, int global_tokens, bool global_queries, int num_batch, int num_heads,
                    bool share) {
  const BlockSparseShape s{seqlen_q, seqlen_k, block_m, block_n, num_batch, num_heads};
  const flashcpp::MaskParams m = rules(causal, window_left, window_right, global_tokens, global_queries);
  return build_and_return(
      [&](BlockMask* out) { return flashcpp::block_mask_from_rules(s, m, out, BlockSparseOptions{share}); });
}

nb::dict document(const CuSeqlens& cu_q, const CuSeqlens& cu_k, int block_m, int block_n, bool causal,
                  int window_left, int window_right, int global_tokens, bool global_queries, int num_batch,
                  int num_heads, bool share) {
  const BlockSparseShape s{0, 0, block_m, block_n, num_batch, num_heads};
  const flashcpp::MaskParams m = rules(causal, window_left, window_right, global_tokens, global_queries);
  const std::span<const std::int32_t> q(cu_q.data(), cu_q.shape(0)), k(cu_k.data(), cu_k.shape(0));
  return build_and_return(
      [&](BlockMask* out) { return flashcpp::document_block_mask(s, q, k, m, out, BlockSparseOptions{share}); });
}

nb::object alibi(int num_heads) {
  auto* slopes = new std::vector<float>(static_cast<std::size_t>(std::max(num_heads, 0)));
  nb::capsule owner(slopes, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  const Status st = flashcpp::alibi_slopes(num_heads, slopes->data());
  if (!st.ok()) raise_status(st);  // the capsule frees the vector
  return view_of(slopes->data(), owner, slopes->size());
}

}  // namespace masks_binding

// ---- decode (include/flashcpp/decode.h): plan/run over a KV cache, and merge of partial states ----
// Python (flashcpp/decode.py) checks shapes and devices, owns the workspaces (torch or numpy
// buffers) and keeps the DecodePlan; this layer only fills DecodeParams from raw pointers and
// strides and maps a non-ok Status to an exception, like attention() above. decode_run never
// allocates or synchronizes, so a run can be captured in a CUDA graph.
namespace decode_binding {

using flashcpp::DecodeParams;
using flashcpp::DecodePlan;
using flashcpp::DecodePlanOptions;

using HostInt32 = nb::ndarray<const std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

flashcpp::RotaryStyle to_rotary(int style) {
  switch (style) {
    case static_cast<int>(flashcpp::RotaryStyle::kNone): return flashcpp::RotaryStyle::kNone;
    case static_cast<int>(flashcpp::RotaryStyle::kNeox): return flashcpp::RotaryStyle::kNeox;
    case static_cast<int>(flashcpp::RotaryStyle::kInterleaved): return flashcpp::RotaryStyle::kInterleaved;
    default:
      raise_value_error("rotary style code " + std::to_string(style) + " is not 0 (none), 1 (neox) or 2 (interleaved)");
  }
}

/// One decode step's DecodeParams. Tensors are (data_ptr, batch_stride, seq_stride, head_stride);
/// for a paged cache batch_stride is the page stride. A zero pointer means "absent".
DecodeParams make_params(const TensorArg& q, const TensorArg& o, std::uintptr_t lse, int dtype, int batch,
                         int seqlen_q, int heads_q, int heads_kv, int head_dim, const TensorArg& k_cache,
                         const TensorArg& v_cache, int capacity, int page_size, int num_pages,
                         std::uintptr_t block_table, std::int64_t block_table_stride, int pages_per_seq,
                         std::uintptr_t cache_seqlens, const TensorArg& k_new, const TensorArg& v_new,
                         int rotary_style, int rotary_dim, std::uintptr_t rotary_cos, std::uintptr_t rotary_sin,
                         int max_position, float rope_theta, float softmax_scale, bool causal, int window_left,
                         int window_right, float softcap, std::uintptr_t alibi_slopes,
                         std::int64_t alibi_batch_stride) {
  const DType dt = to_dtype(dtype);
  DecodeParams p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.q = to_view(q, dt);
  p.o = to_view(o, dt);
  p.lse = reinterpret_cast<float*>(lse);
  p.cache.k = to_view(k_cache, dt);
  p.cache.v = to_view(v_cache, dt);
  p.cache.capacity = capacity;
  p.cache.page_size = page_size;
  p.cache.num_pages = num_pages;
  p.cache.block_table = reinterpret_cast<const std::int32_t*>(block_table);
  p.cache.block_table_stride = block_table_stride;
  p.cache.pages_per_seq = pages_per_seq;
  p.cache_seqlens = reinterpret_cast<const std::int32_t*>(cache_seqlens);
  if (std::get<0>(k_new) != 0 || std::get<0>(v_new) != 0) {
    p.k_new = to_view(k_new, dt);
    p.v_new = to_view(v_new, dt);
  }
  p.rotary.style = to_rotary(rotary_style);
  p.rotary.rotary_dim = rotary_dim;
  p.rotary.cos = reinterpret_cast<const float*>(rotary_cos);
  p.rotary.sin = reinterpret_cast<const float*>(rotary_sin);
  p.rotary.max_position = max_position;
  p.rotary.theta = rope_theta;
  p.softmax_scale = softmax_scale;
  p.mask = element_mask(causal, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride);
  return p;
}

/// Plan options, with the checked host lengths (one int32 per sequence).
DecodePlanOptions plan_options(const DecodeParams& p, const std::string& backend,
                               const std::optional<HostInt32>& host_cache_seqlens, int num_splits, int max_splits,
                               int num_sms, std::uintptr_t stream, bool fused_merge, bool fused_append = false) {
  DecodePlanOptions opt;
  opt.fused_merge = fused_merge;
  opt.fused_append = fused_append;
  opt.backend = to_backend(backend);
  if (host_cache_seqlens) {
    if (host_cache_seqlens->shape(0) != static_cast<std::size_t>(std::max(p.batch, 0)))
      raise_value_error("host_cache_seqlens has " + std::to_string(host_cache_seqlens->shape(0)) +
                        " entries; the plan is for batch " + std::to_string(p.batch));
    opt.host_cache_seqlens = host_cache_seqlens->data();
  }
  opt.num_splits = num_splits;
  opt.max_splits = max_splits;
  opt.num_sms = num_sms;
  opt.stream = reinterpret_cast<flashcpp::Stream>(stream);
  return opt;
}

/// decode_plan reads only the scalar fields of DecodeParams, and "is there an append" is "are
/// k_new/v_new set": at plan time the new tokens may not exist yet, so `append` stands in for them
/// with a non-null address that is never read.
DecodeParams for_plan(DecodeParams p, bool append) {
  static const std::uint64_t kNeverRead[2] = {0, 0};
  if (append && !p.has_append()) {
    p.k_new.data = const_cast<std::uint64_t*>(kNeverRead);
    p.v_new.data = const_cast<std::uint64_t*>(kNeverRead);
    p.k_new.dtype = p.v_new.dtype = p.q.dtype;
  }
  return p;
}

std::tuple<std::size_t, std::size_t> workspace_size(const DecodeParams& params, bool append,
                                                    const std::string& backend,
                                                    const std::optional<HostInt32>& host_cache_seqlens,
                                                    int num_splits, int max_splits, int num_sms, bool fused_merge) {
  const DecodeParams p = for_plan(params, append);
  const DecodePlanOptions opt =
      plan_options(p, backend, host_cache_seqlens, num_splits, max_splits, num_sms, 0, fused_merge);
  flashcpp::DecodeWorkspaceSize ws;
  Status st;
  {
    nb::gil_scoped_release release;  // the CUDA backend asks the driver for the SM count
    st = flashcpp::decode_workspace_size(p, opt, &ws);
  }
  if (!st.ok()) raise_status(st);
  return {ws.int_bytes, ws.float_bytes};
}

DecodePlan plan(const DecodeParams& params, bool append, const std::string& backend,
                const std::optional<HostInt32>& host_cache_seqlens, int num_splits, int max_splits, int num_sms,
                std::uintptr_t stream, std::uintptr_t int_workspace, std::size_t int_bytes,
                std::uintptr_t float_workspace, std::size_t float_bytes, bool fused_merge, bool fused_append) {
  const DecodeParams p = for_plan(params, append);
  const DecodePlanOptions opt = plan_options(p, backend, host_cache_seqlens, num_splits, max_splits, num_sms, stream,
                                             fused_merge, fused_append);
  DecodePlan out;
  Status st;
  {
    nb::gil_scoped_release release;  // uploads the work list (may wait for the stream)
    st = flashcpp::decode_plan(p, opt, reinterpret_cast<void*>(int_workspace), int_bytes,
                               reinterpret_cast<void*>(float_workspace), float_bytes, &out);
  }
  if (!st.ok()) raise_status(st);
  return out;
}

void run(const DecodeParams& p, const DecodePlan& plan, std::uintptr_t stream, const std::string& backend,
         int cpu_threads) {
  RunOptions opt;
  opt.backend = to_backend(backend);
  opt.stream = reinterpret_cast<flashcpp::Stream>(stream);
  opt.cpu_threads = cpu_threads;
  Status st;
  {
    nb::gil_scoped_release release;  // launches only (CUDA), or computes a while (CPU)
    st = flashcpp::decode_run(p, plan, opt);
  }
  if (!st.ok()) raise_status(st);
}

void merge_states(const TensorArg& o_a, std::uintptr_t lse_a, const TensorArg& o_b, std::uintptr_t lse_b,
                  const TensorArg& o, std::uintptr_t lse, int dtype, int batch, int seqlen, int heads, int head_dim,
                  std::uintptr_t stream, const std::string& backend) {
  const DType dt = to_dtype(dtype);
  flashcpp::MergeStatesParams p;
  p.batch = batch;
  p.seqlen = seqlen;
  p.heads = heads;
  p.head_dim = head_dim;
  p.o_a = to_view(o_a, dt);
  p.o_b = to_view(o_b, dt);
  p.o = to_view(o, dt);
  p.lse_a = reinterpret_cast<const float*>(lse_a);
  p.lse_b = reinterpret_cast<const float*>(lse_b);
  p.lse = reinterpret_cast<float*>(lse);
  RunOptions opt;
  opt.backend = to_backend(backend);
  opt.stream = reinterpret_cast<flashcpp::Stream>(stream);
  Status st;
  {
    nb::gil_scoped_release release;
    st = flashcpp::merge_attention_states(p, opt);
  }
  if (!st.ok()) raise_status(st);
}

void bind(nb::module_& m) {
  nb::class_<DecodeParams>(m, "DecodeParams",
                           "flashcpp::DecodeParams of one decode step (opaque; made by decode_params)");
  nb::class_<DecodePlan>(m, "DecodePlan", "flashcpp::DecodePlan: the decisions decode_plan made (read-only)")
      .def_ro("planned", &DecodePlan::planned)
      .def_prop_ro("backend", [](const DecodePlan& p) { return std::string(flashcpp::backend_name(p.backend)); })
      .def_ro("batch", &DecodePlan::batch)
      .def_ro("seqlen_q", &DecodePlan::seqlen_q)
      .def_ro("heads_q", &DecodePlan::heads_q)
      .def_ro("heads_kv", &DecodePlan::heads_kv)
      .def_ro("head_dim", &DecodePlan::head_dim)
      .def_prop_ro("dtype", [](const DecodePlan& p) { return static_cast<int>(p.dtype); })
      .def_ro("paged", &DecodePlan::paged)
      .def_ro("append", &DecodePlan::append)
      .def_ro("rows_per_kv", &DecodePlan::rows_per_kv)
      .def_ro("row_blocks", &DecodePlan::row_blocks)
      .def_ro("warp_rows", &DecodePlan::warp_rows)
      .def_ro("num_items", &DecodePlan::num_items)
      .def_ro("max_splits", &DecodePlan::max_splits)
      .def_ro("num_sms", &DecodePlan::num_sms)
      .def_ro("needs_merge", &DecodePlan::needs_merge)
      .def_ro("fused_merge", &DecodePlan::fused_merge)
      .def_ro("fused_append", &DecodePlan::fused_append)
      .def_ro("ctas", &DecodePlan::ctas)
      .def_ro("int_bytes", &DecodePlan::int_bytes)
      .def_ro("float_bytes", &DecodePlan::float_bytes)
      .def("__repr__", [](const DecodePlan& p) {
        return "DecodePlan(backend=" + std::string(flashcpp::backend_name(p.backend)) +
               ", batch=" + std::to_string(p.batch) + ", seqlen_q=" + std::to_string(p.seqlen_q) +
               ", heads=" + std::to_string(p.heads_q) + "/" + std::to_string(p.heads_kv) +
               ", head_dim=" + std::to_string(p.head_dim) + ", paged=" + (p.paged ? "True" : "False") +
               ", append=" + (p.append ? "True" : "False") + ", num_items=" + std::to_string(p.num_items) +
               ", max_splits=" + std::to_string(p.max_splits) + ", ctas=" + std::to_string(p.ctas) + ")";
      });
  m.def("decode_params", &make_params, "q"_a, "o"_a, "lse"_a, "dtype"_a, "batch"_a, "seqlen_q"_a, "heads_q"_a,
        "heads_kv"_a, "head_dim"_a, "k_cache"_a, "v_cache"_a, "capacity"_a, "page_size"_a, "num_pages"_a,
        "block_table"_a, "block_table_stride"_a, "pages_per_seq"_a, "cache_seqlens"_a, "k_new"_a, "v_new"_a,
        "rotary_style"_a, "rotary_dim"_a, "rotary_cos"_a, "rotary_sin"_a, "max_position"_a, "rope_theta"_a,
        "softmax_scale"_a, "causal"_a, "window_left"_a, "window_right"_a, "softcap"_a, "alibi_slopes"_a,
        "alibi_batch_stride"_a,
        "flashcpp::DecodeParams from raw pointers; tensors are (data_ptr, batch_stride, seq_stride, head_stride) "
        "in elements (page stride first for a paged cache), 0 = absent.");
  m.def("decode_workspace_size", &workspace_size, "params"_a, "append"_a, "backend"_a,
        "host_cache_seqlens"_a.none(), "num_splits"_a, "max_splits"_a, "num_sms"_a, "fused_merge"_a = false,
        "flashcpp::decode_workspace_size: (int_bytes, float_bytes) of a plan for these scalars.");
  m.def("decode_plan", &plan, "params"_a, "append"_a, "backend"_a, "host_cache_seqlens"_a.none(), "num_splits"_a,
        "max_splits"_a, "num_sms"_a, "stream"_a, "int_workspace"_a, "int_bytes"_a, "float_workspace"_a,
        "float_bytes"_a, "fused_merge"_a = false, "fused_append"_a = false,
        "flashcpp::decode_plan into caller-owned workspaces (16-byte aligned, on the run's device); "
        "returns the DecodePlan.");
  m.def("decode_run", &run, "params"_a, "plan"_a, "stream"_a, "backend"_a, "cpu_threads"_a,
        "flashcpp::decode_run: launches the step (CUDA: asynchronous on stream, no allocation, no sync).");
  m.def("merge_attention_states", &merge_states, "o_a"_a, "lse_a"_a, "o_b"_a, "lse_b"_a, "o"_a, "lse"_a,
        "dtype"_a, "batch"_a, "seqlen"_a, "heads"_a, "head_dim"_a, "stream"_a, "backend"_a,
        "flashcpp::merge_attention_states on (batch, seqlen, heads, head_dim) views and contiguous "
        "(batch, heads, seqlen) fp32 LSEs; o may be exactly o_a or o_b; lse 0 = not wanted.");
  m.attr("ROTARY_NONE") = static_cast<int>(flashcpp::RotaryStyle::kNone);
  m.attr("ROTARY_NEOX") = static_cast<int>(flashcpp::RotaryStyle::kNeox);
  m.attr("ROTARY_INTERLEAVED") = static_cast<int>(flashcpp::RotaryStyle::kInterleaved);
  m.attr("DECODE_MAX_SEQLEN_Q") = flashcpp::kDecodeMaxSeqlenQ;
  m.attr("DECODE_MAX_PAGE_SIZE") = flashcpp::kDecodeMaxPageSize;
  m.attr("DECODE_MAX_SPLITS") = flashcpp::kDecodeMaxSplits;
}

}  // namespace decode_binding

NB_MODULE(_flashcpp, m) {
  m.doc() = "flashcpp C++ binding (raw pointers, element strides, dtype codes, stream as int)";
  m.attr("WITH_CUDA") = bool(FLASHCPP_WITH_CUDA);
  m.attr("VERSION") = FLASHCPP_VERSION;
  m.attr("GIT_COMMIT") = FLASHCPP_GIT_COMMIT;
  nb::list dims;
  for (int d : flashcpp::kSupportedHeadDims) dims.append(d);
  m.attr("SUPPORTED_HEAD_DIMS") = nb::tuple(dims);
  m.attr("DTYPE_F16") = static_cast<int>(DType::kF16);
  m.attr("DTYPE_BF16") = static_cast<int>(DType::kBF16);
  m.attr("DTYPE_F32") = static_cast<int>(DType::kF32);

  m.def("attention", &attention, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dtype"_a, "batch"_a,
        "seqlen_q"_a, "seqlen_k"_a, "heads_q"_a, "heads_kv"_a, "head_dim"_a, "softmax_scale"_a,
        "causal"_a, "window_left"_a, "window_right"_a, "softcap"_a, "alibi_slopes"_a,
        "alibi_batch_stride"_a, "global_tokens"_a, "global_queries"_a, "cu_seqlens_q"_a,
        "cu_seqlens_k"_a, "total_q"_a = 0, "block_sparse"_a.none(), "rotary"_a.none(), "stream"_a, "backend"_a, "cpu_threads"_a,
        "cuda_config"_a, "select_only"_a,
        "Runs flashcpp::attention_forward (select_only=False, returns None) or "
        "flashcpp::select_kernel (select_only=True, returns (kernel, config, reason)). Tensors are "
        "(data_ptr, batch_stride, seq_stride, head_stride) with strides in elements; block_sparse "
        "is None or (row_ptr, col_idx, partial, element_masks, num_partial, block_m, block_n, "
        "num_batch, num_heads, num_q_blocks, num_k_blocks) with data pointers first; rotary is None "
        "or (rotary_dim, style, theta, llama3 factor, low, high, original_max_position, "
        "cos_sin_cache, max_position, positions_q, positions_k, k_rotated) with 0 for a null pointer "
        "and k_rotated a tensor like k (k's dtype; data pointer 0 = none, which CUDA refuses).");
  m.def("merge_by_lse", &merge_by_lse, "o_a"_a, "lse_a"_a, "o_b"_a, "lse_b"_a, "o"_a.noconvert(),
        "lse"_a.noconvert(),
        "Row-wise merge of two normalized partial attention outputs by their natural-log LSEs "
        "(fp32, C-contiguous host arrays; writes o and lse).");

  // masks (flashcpp/masks.py wraps these)
  m.def("alibi_slopes", &masks_binding::alibi, "num_heads"_a,
        "BLOOM's ALiBi slopes for num_heads heads (float32 numpy array), flashcpp::alibi_slopes.");
  m.def("block_sparse_from_dense", &masks_binding::from_dense, "dense"_a, "block_m"_a, "block_n"_a,
        "share_identical_partials"_a,
        "Block-sparse CSR arrays (a dict) of a dense uint8 (num_batch, num_heads, seqlen_q, seqlen_k) mask.");
  m.def("block_sparse_from_rules", &masks_binding::from_rules, "seqlen_q"_a, "seqlen_k"_a, "block_m"_a,
        "block_n"_a, "causal"_a, "window_left"_a, "window_right"_a, "global_tokens"_a, "global_queries"_a,
        "num_batch"_a, "num_heads"_a, "share_identical_partials"_a,
        "Block-sparse CSR arrays (a dict) of the causal/window/global rules, flashcpp::block_mask_from_rules.");
  m.def("block_sparse_document", &masks_binding::document, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "block_m"_a,
        "block_n"_a, "causal"_a, "window_left"_a, "window_right"_a, "global_tokens"_a, "global_queries"_a,
        "num_batch"_a, "num_heads"_a, "share_identical_partials"_a,
        "Block-sparse CSR arrays (a dict) of a document (packed varlen) mask, flashcpp::document_block_mask.");
  // ---- fused kernels (include/flashcpp/fused.h): RMSNorm (+ residual), SwiGLU, rotary ----------
  // Matrices arrive as (data_ptr, row_stride), 4-D views as TensorArg; flashcpp/fused.py checks
  // shapes and allocates outputs. Same Status -> exception mapping as attention().
  using FusedMatrix = std::tuple<std::uintptr_t, std::int64_t>;
  static auto to_matrix = [](const FusedMatrix& t, DType dt) {
    return flashcpp::MatrixView{reinterpret_cast<void*>(std::get<0>(t)), dt, std::get<1>(t)};
  };
  static auto fused_options = [](std::uintptr_t stream, const std::string& backend, int cpu_threads,
                                 const std::string& cuda_config) {
    RunOptions opt;
    opt.backend = to_backend(backend);
    opt.stream = reinterpret_cast<flashcpp::Stream>(stream);
    opt.cpu_threads = cpu_threads;
    opt.cuda_config = cuda_config;
    return opt;
  };
  m.def(
      "rms_norm",
      [](const FusedMatrix& x, const FusedMatrix& residual, const FusedMatrix& residual_out, std::uintptr_t weight,
         const FusedMatrix& y, int dtype, std::int64_t rows, std::int64_t hidden, float eps, bool with_residual,
         std::uintptr_t stream, const std::string& backend, int cpu_threads, const std::string& cuda_config) {
        const DType dt = to_dtype(dtype);
        flashcpp::RmsNormParams p;
        p.rows = rows;
        p.hidden = hidden;
        p.x = to_matrix(x, dt);
        if (with_residual) {
          p.residual = to_matrix(residual, dt);
          p.residual_out = to_matrix(residual_out, dt);
        }
        p.weight = reinterpret_cast<const void*>(weight);
        p.y = to_matrix(y, dt);
        p.eps = eps;
        const RunOptions opt = fused_options(stream, backend, cpu_threads, cuda_config);
        Status st;
        {
          nb::gil_scoped_release release;
          st = with_residual ? flashcpp::fused_add_rms_norm(p, opt) : flashcpp::rms_norm(p, opt);
        }
        if (!st.ok()) raise_status(st);
      },
      "x"_a, "residual"_a, "residual_out"_a, "weight"_a, "y"_a, "dtype"_a, "rows"_a, "hidden"_a, "eps"_a,
      "with_residual"_a, "stream"_a, "backend"_a, "cpu_threads"_a, "cuda_config"_a,
      "flashcpp::rms_norm / fused_add_rms_norm on (data_ptr, row_stride) matrices.");
  m.def(
      "silu_and_mul",
      [](const FusedMatrix& gate, const FusedMatrix& up, const FusedMatrix& out, int dtype, std::int64_t rows,
         std::int64_t d, std::uintptr_t stream, const std::string& backend, int cpu_threads,
         const std::string& cuda_config) {
        const DType dt = to_dtype(dtype);
        flashcpp::SiluMulParams p;
        p.rows = rows;
        p.d = d;
        p.gate = to_matrix(gate, dt);
        p.up = to_matrix(up, dt);
        p.out = to_matrix(out, dt);
        const RunOptions opt = fused_options(stream, backend, cpu_threads, cuda_config);
        Status st;
        {
          nb::gil_scoped_release release;
          st = flashcpp::silu_and_mul(p, opt);
        }
        if (!st.ok()) raise_status(st);
      },
      "gate"_a, "up"_a, "out"_a, "dtype"_a, "rows"_a, "d"_a, "stream"_a, "backend"_a, "cpu_threads"_a,
      "cuda_config"_a, "flashcpp::silu_and_mul on (data_ptr, row_stride) matrices.");
  m.def(
      "apply_rotary",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& q_out, const TensorArg& k_out, int dtype, int batch,
         int seqlen, int heads_q, int heads_k, int head_dim, int rotary_dim, std::uintptr_t positions, int style,
         double theta, float llama3_factor, float llama3_low_freq_factor, float llama3_high_freq_factor,
         int llama3_original_max_position, std::uintptr_t cos_sin_cache, int max_position, std::uintptr_t stream,
         const std::string& backend, int cpu_threads, const std::string& cuda_config) {
        const DType dt = to_dtype(dtype);
        flashcpp::RopeParams p;
        p.batch = batch;
        p.seqlen = seqlen;
        p.heads_q = heads_q;
        p.heads_k = heads_k;
        p.head_dim = head_dim;
        p.rotary_dim = rotary_dim;
        p.q = to_view(q, dt);
        p.k = to_view(k, dt);
        p.q_out = to_view(q_out, dt);
        p.k_out = to_view(k_out, dt);
        p.positions = reinterpret_cast<const std::int32_t*>(positions);
        p.style = static_cast<flashcpp::RopeStyle>(style);
        p.theta = theta;
        p.llama3 = flashcpp::Llama3Scaling{llama3_factor, llama3_low_freq_factor, llama3_high_freq_factor,
                                           llama3_original_max_position};
        p.cos_sin_cache = reinterpret_cast<const float*>(cos_sin_cache);
        p.max_position = max_position;
        const RunOptions opt = fused_options(stream, backend, cpu_threads, cuda_config);
        Status st;
        {
          nb::gil_scoped_release release;
          st = flashcpp::apply_rotary(p, opt);
        }
        if (!st.ok()) raise_status(st);
      },
      "q"_a, "k"_a, "q_out"_a, "k_out"_a, "dtype"_a, "batch"_a, "seqlen"_a, "heads_q"_a, "heads_k"_a,
      "head_dim"_a, "rotary_dim"_a, "positions"_a, "style"_a, "theta"_a, "llama3_factor"_a,
      "llama3_low_freq_factor"_a, "llama3_high_freq_factor"_a, "llama3_original_max_position"_a,
      "cos_sin_cache"_a, "max_position"_a, "stream"_a, "backend"_a, "cpu_threads"_a, "cuda_config"_a,
      "flashcpp::apply_rotary; tensors are (data_ptr, batch_stride, seq_stride, head_stride), a null "
      "q_out/k_out data pointer rotates in place.");
  // ---- decode and merge (flashcpp/decode.py, flashcpp/merge.py wrap these) ---------------------
  decode_binding::bind(m);
  m.attr("ROPE_NEOX") = static_cast<int>(flashcpp::RopeStyle::kNeox);
  m.attr("ROPE_INTERLEAVED") = static_cast<int>(flashcpp::RopeStyle::kInterleaved);
}
