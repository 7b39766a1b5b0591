// flashcpp._flashcpp: the nanobind binding of the C++ API.
//
// Framework-free on purpose: a tensor arrives as a raw data pointer (a Python int) with its
// element strides, the element type as a dtype code (flashcpp::DType), and the CUDA stream as
// an int (torch.cuda.current_stream().cuda_stream). Nothing here knows about torch or DLPack,
// so the wheel links no libtorch and a launch never synchronizes.
//
// One parameter shape across the language boundary: the public parameter structs of
// include/flashcpp/ (AttnParams, MaskParams, TensorView, RunOptions, DecodeParams, the fused
// ops' params, ...) are nanobind classes whose fields read and write as Python attributes, and
// each entry point takes the structs the C++ function takes. A pointer field is an int property
// (0 = null); an enum field is its int code (dtype, rope style) or its name (backend), checked
// when set. The Python layer (flashcpp/_core.py and the modules above it) checks types, devices
// and shapes, allocates the outputs, fills one params object per call and makes one call; this
// layer turns a non-ok Status into a Python exception:
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
#include <type_traits>
#include <utility>
#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "flashcpp/masks.h"
#include "flashcpp/reference.h"
#include "eager_fast.h"
#include "engine_module.h"
#include "py_status.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using flashcpp::AttnParams;
using flashcpp::Backend;
using flashcpp::DType;
using flashcpp::RunOptions;
using flashcpp::Status;
using flashcpp::StatusCode;
using flashcpp::TensorView;

using flashcpp_python::call_released;  // py_status.h
using flashcpp_python::raise_status;

[[noreturn]] void raise_value_error(const std::string& msg) {
  PyErr_SetString(PyExc_ValueError, msg.c_str());
  throw nb::python_error();
}


DType to_dtype(int code) {
  switch (code) {
    case static_cast<int>(DType::kF16): return DType::kF16;
    case static_cast<int>(DType::kBF16): return DType::kBF16;
    case static_cast<int>(DType::kF32): return DType::kF32;
    case static_cast<int>(DType::kF64): return DType::kF64;
    case static_cast<int>(DType::kF8E4M3): return DType::kF8E4M3;
    default:
      raise_value_error("dtype code " + std::to_string(code) +
                        " is not one of 0 (fp16), 1 (bf16), 2 (fp32), 3 (fp64), 4 (fp8_e4m3)");
  }
}

Backend to_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "cpu") return Backend::kCpu;
  if (name == "cpu-reference") return Backend::kCpuReference;
  if (name == "cuda") return Backend::kCuda;
  raise_value_error("backend '" + name + "' is not one of auto, cpu, cpu-reference, cuda");
}

flashcpp::RopeStyle to_rope_style(int style) {
  switch (style) {
    case static_cast<int>(flashcpp::RopeStyle::kNone): return flashcpp::RopeStyle::kNone;
    case static_cast<int>(flashcpp::RopeStyle::kNeox): return flashcpp::RopeStyle::kNeox;
    case static_cast<int>(flashcpp::RopeStyle::kInterleaved): return flashcpp::RopeStyle::kInterleaved;
    default:
      raise_value_error("rotary style code " + std::to_string(style) + " is not 0 (none), 1 (neox) or 2 (interleaved)");
  }
}

/// A pointer field as an int property (0 = null). The address is not checked here: the C++
/// validators check what can be checked without reading device memory.
template <class T, class C, class P>
void pointer_rw(nb::class_<T>& cls, const char* name, P* C::*member, const char* doc = "") {
  static_assert(std::is_base_of_v<C, T>, "a member of the bound struct or of its base");
  cls.def_prop_rw(
      name, [member](const T& c) { return reinterpret_cast<std::uintptr_t>(c.*member); },
      [member](T& c, std::uintptr_t address) { c.*member = reinterpret_cast<P*>(address); }, doc);
}

/// The dtype field of a view as its DType code, checked when set.
template <class C>
void dtype_rw(nb::class_<C>& cls) {
  cls.def_prop_rw(
      "dtype", [](const C& c) { return static_cast<int>(c.dtype); },
      [](C& c, int code) { c.dtype = to_dtype(code); }, "element type code: 0 fp16, 1 bf16, 2 fp32, 3 fp64");
}

// ---- shared pieces: views, run options ------------------------------------------------------

void bind_common(nb::module_& m) {
  nb::class_<TensorView> tv(m, "TensorView",
                            "flashcpp::TensorView: data pointer (int), dtype code and element strides of a "
                            "(batch, seqlen, heads, head_dim) view");
  tv.def(nb::init<>())
      .def(
          "__init__",
          [](TensorView* t, std::uintptr_t data, int dtype, std::int64_t batch_stride, std::int64_t seq_stride,
             std::int64_t head_stride) {
            const DType dt = to_dtype(dtype);  // before the object exists: a bad code leaves none behind
            new (t) TensorView{reinterpret_cast<void*>(data), dt, batch_stride, seq_stride, head_stride};
          },
          "data"_a, "dtype"_a, "batch_stride"_a = 0, "seq_stride"_a = 0, "head_stride"_a = 0);
  pointer_rw(tv, "data", &TensorView::data);
  dtype_rw(tv);
  tv.def_rw("batch_stride", &TensorView::batch_stride)
      .def_rw("seq_stride", &TensorView::seq_stride)
      .def_rw("head_stride", &TensorView::head_stride);

  nb::class_<RunOptions> opt(m, "RunOptions",
                             "flashcpp::RunOptions: backend (a name), CUDA stream (int), CPU threads and tiles, "
                             "cuda_config, programmatic_launch");
  opt.def(nb::init<>())
      .def(
          "__init__",
          [](RunOptions* o, const std::string& backend, std::uintptr_t stream, int cpu_threads,
             const std::string& cuda_config) {
            const Backend b = to_backend(backend);
            new (o) RunOptions();
            o->backend = b;
            o->stream = reinterpret_cast<flashcpp::Stream>(stream);
            o->cpu_threads = cpu_threads;
            o->cuda_config = cuda_config;
          },
          "backend"_a = "auto", "stream"_a = 0, "cpu_threads"_a = 0, "cuda_config"_a = "")
      .def_prop_rw(
          "backend", [](const RunOptions& o) { return std::string(flashcpp::backend_name(o.backend)); },
          [](RunOptions& o, const std::string& name) { o.backend = to_backend(name); },
          "auto, cpu, cpu-reference or cuda");
  pointer_rw(opt, "stream", &RunOptions::stream, "cudaStream_t as an int (0 = the legacy default stream)");
  opt.def_rw("cpu_threads", &RunOptions::cpu_threads)
      .def_rw("cpu_block_m", &RunOptions::cpu_block_m)
      .def_rw("cpu_block_n", &RunOptions::cpu_block_n)
      .def_rw("cuda_config", &RunOptions::cuda_config)
      .def_rw("programmatic_launch", &RunOptions::programmatic_launch);

  nb::class_<flashcpp::Llama3Scaling> l3(m, "Llama3Scaling", "flashcpp::Llama3Scaling (factor 0 = off)");
  l3.def(nb::init<>())
      .def(
          "__init__",
          [](flashcpp::Llama3Scaling* s, float factor, float low, float high, int original_max_position) {
            new (s) flashcpp::Llama3Scaling{factor, low, high, original_max_position};
          },
          "factor"_a, "low_freq_factor"_a = 1.f, "high_freq_factor"_a = 4.f, "original_max_position"_a = 8192)
      .def_rw("factor", &flashcpp::Llama3Scaling::factor)
      .def_rw("low_freq_factor", &flashcpp::Llama3Scaling::low_freq_factor)
      .def_rw("high_freq_factor", &flashcpp::Llama3Scaling::high_freq_factor)
      .def_rw("original_max_position", &flashcpp::Llama3Scaling::original_max_position);

  // The one rotary description (flashcpp/rope.h) that AttnRotary.spec, RopeParams.rotary and
  // DecodeParams.rotary hold. The tables are data pointers (ints) the caller keeps alive.
  using flashcpp::RotarySpec;
  nb::class_<RotarySpec> rs(m, "RotarySpec",
                            "flashcpp::RotarySpec: style (0 none, 1 neox, 2 interleaved), rotary_dim (0 = head_dim), "
                            "theta and llama3, or fp32 cos/sin tables with a row stride (0 = rotary_dim / 2)");
  rs.def(nb::init<>())
      .def_prop_rw(
          "style", [](const RotarySpec& r) { return static_cast<int>(r.style); },
          [](RotarySpec& r, int code) { r.style = to_rope_style(code); },
          "RopeStyle code: 0 none, 1 neox, 2 interleaved (ROPE_NONE, ROPE_NEOX, ROPE_INTERLEAVED)")
      .def_rw("rotary_dim", &RotarySpec::rotary_dim)
      .def_rw("theta", &RotarySpec::theta)
      .def_rw("llama3", &RotarySpec::llama3)
      .def_rw("table_stride", &RotarySpec::table_stride)
      .def_rw("max_position", &RotarySpec::max_position)
      .def(
          "set_cos_sin_cache",
          [](RotarySpec& r, std::uintptr_t cache, int rows, int rotary_dim) {
            r.set_cos_sin_cache(reinterpret_cast<const float*>(cache), rows, rotary_dim);
          },
          "cache"_a, "rows"_a, "rotary_dim"_a,
          "Points cos/sin at an fp32 (rows, rotary_dim) cos_sin_cache, rows [cos | sin].");
  pointer_rw(rs, "cos", &RotarySpec::cos);
  pointer_rw(rs, "sin", &RotarySpec::sin);
  m.attr("ROPE_NONE") = static_cast<int>(flashcpp::RopeStyle::kNone);
  m.attr("ROPE_NEOX") = static_cast<int>(flashcpp::RopeStyle::kNeox);
  m.attr("ROPE_INTERLEAVED") = static_cast<int>(flashcpp::RopeStyle::kInterleaved);
}

// ---- attention (include/flashcpp/attention.h) -----------------------------------------------------

void bind_attention(nb::module_& m) {
  using flashcpp::AttnRotary;
  using flashcpp::BlockSparseMask;
  using flashcpp::MaskParams;

  nb::class_<BlockSparseMask> bs(m, "BlockSparseMask",
                                 "flashcpp::BlockSparseMask: CSR block mask; the arrays are data pointers (ints) "
                                 "that the caller keeps alive through the call");
  bs.def(nb::init<>())
      .def_rw("block_m", &BlockSparseMask::block_m)
      .def_rw("block_n", &BlockSparseMask::block_n)
      .def_rw("num_batch", &BlockSparseMask::num_batch)
      .def_rw("num_heads", &BlockSparseMask::num_heads)
      .def_rw("num_q_blocks", &BlockSparseMask::num_q_blocks)
      .def_rw("num_k_blocks", &BlockSparseMask::num_k_blocks)
      .def_rw("num_partial", &BlockSparseMask::num_partial);
  pointer_rw(bs, "row_ptr", &BlockSparseMask::row_ptr);
  pointer_rw(bs, "col_idx", &BlockSparseMask::col_idx);
  pointer_rw(bs, "partial", &BlockSparseMask::partial);
  pointer_rw(bs, "element_masks", &BlockSparseMask::element_masks);

  nb::class_<MaskParams> mask(m, "MaskParams", "flashcpp::MaskParams (every field defaults to off)");
  mask.def(nb::init<>())
      .def_rw("causal", &MaskParams::causal)
      .def_rw("window_left", &MaskParams::window_left)
      .def_rw("window_right", &MaskParams::window_right)
      .def_rw("global_tokens", &MaskParams::global_tokens)
      .def_rw("global_queries", &MaskParams::global_queries)
      .def_rw("softcap", &MaskParams::softcap)
      .def_rw("alibi_batch_stride", &MaskParams::alibi_batch_stride)
      .def_rw("total_q", &MaskParams::total_q);
  pointer_rw(mask, "alibi_slopes", &MaskParams::alibi_slopes);
  pointer_rw(mask, "cu_seqlens_q", &MaskParams::cu_seqlens_q);
  pointer_rw(mask, "cu_seqlens_k", &MaskParams::cu_seqlens_k);
  // A pointer to another bound struct. The setter ties the BlockSparseMask object's life to the
  // Python MaskParams object it is set on; `params.mask` is a fresh view of the struct inside
  // params each time it is read, so a caller that sets it through such a view holds the
  // BlockSparseMask itself until the call returns (as _core.launch does). The entry points copy
  // the struct before they release the GIL.
  mask.def_prop_rw(
      "block_sparse",
      [](const MaskParams& mp) -> nb::object {
        if (mp.block_sparse == nullptr) return nb::none();
        return nb::cast(mp.block_sparse, nb::rv_policy::reference);
      },
      [](MaskParams& mp, nb::handle value) {
        if (!value.is_none() && !nb::isinstance<BlockSparseMask>(value))
          throw nb::type_error("MaskParams.block_sparse takes a BlockSparseMask or None");
        mp.block_sparse = value.is_none() ? nullptr : nb::cast<const BlockSparseMask*>(value);
      },
      nb::for_setter(nb::keep_alive<1, 2>()), nb::for_setter(nb::arg("value").none()),
      "a BlockSparseMask or None");

  nb::class_<AttnRotary> rot(m, "AttnRotary",
                             "flashcpp::AttnRotary: rotary fused into attention (spec.style 0 = off)");
  rot.def(nb::init<>()).def_rw("spec", &AttnRotary::spec).def_rw("k_rotated", &AttnRotary::k_rotated);
  pointer_rw(rot, "positions_q", &AttnRotary::positions_q);
  pointer_rw(rot, "positions_k", &AttnRotary::positions_k);

  nb::class_<AttnParams> ap(m, "AttnParams", "flashcpp::AttnParams: one attention problem");
  ap.def(nb::init<>())
      .def_rw("batch", &AttnParams::batch)
      .def_rw("seqlen_q", &AttnParams::seqlen_q)
      .def_rw("seqlen_k", &AttnParams::seqlen_k)
      .def_rw("heads_q", &AttnParams::heads_q)
      .def_rw("heads_kv", &AttnParams::heads_kv)
      .def_rw("head_dim", &AttnParams::head_dim)
      .def_rw("head_dim_v", &AttnParams::head_dim_v)
      .def_rw("q", &AttnParams::q)
      .def_rw("k", &AttnParams::k)
      .def_rw("v", &AttnParams::v)
      .def_rw("o", &AttnParams::o)
      .def_rw("softmax_scale", &AttnParams::softmax_scale)
      .def_rw("mask", &AttnParams::mask)
      .def_rw("rotary", &AttnParams::rotary);
  pointer_rw(ap, "lse", &AttnParams::lse, "fp32 LSE output (0 = not wanted)");

  // The params are copied, and the block-sparse struct with them, before the GIL is released: the
  // call reads nothing that another Python thread could change or free meanwhile.
  struct Call {
    AttnParams p;
    BlockSparseMask sparse;
    explicit Call(const AttnParams& params) : p(params) {
      if (p.mask.block_sparse != nullptr) {
        sparse = *p.mask.block_sparse;
        p.mask.block_sparse = &sparse;
      }
    }
  };
  m.def(
      "attention_forward",
      [](const AttnParams& params, const RunOptions& options) {
        const Call c(params);
        const RunOptions opt = options;
        call_released([&] { return flashcpp::attention_forward(c.p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::attention_forward: validates, selects and runs (CUDA: asynchronous).");
  m.def(
      "select_kernel",
      [](const AttnParams& params, const RunOptions& options) {
        const Call c(params);
        const RunOptions opt = options;
        flashcpp::KernelChoice choice;
        call_released([&] { return flashcpp::select_kernel(c.p, opt, &choice); });
        return std::make_tuple(std::string(flashcpp::kernel_name(choice.id)), choice.config, choice.reason);
      },
      "params"_a, "options"_a,
      "flashcpp::select_kernel: validates like attention_forward and returns (kernel, config, reason) "
      "without running anything.");
}

// ---- attention backward (include/flashcpp/backward.h) ----------------------------------------------

void bind_backward(nb::module_& m) {
  using flashcpp::AttnBackwardParams;
  using flashcpp::BlockSparseMask;

  nb::class_<AttnBackwardParams> bp(m, "AttnBackwardParams", "flashcpp::AttnBackwardParams: one attention backward problem");
  bp.def(nb::init<>())
      .def_rw("batch", &AttnBackwardParams::batch)
      .def_rw("seqlen_q", &AttnBackwardParams::seqlen_q)
      .def_rw("seqlen_k", &AttnBackwardParams::seqlen_k)
      .def_rw("heads_q", &AttnBackwardParams::heads_q)
      .def_rw("heads_kv", &AttnBackwardParams::heads_kv)
      .def_rw("head_dim", &AttnBackwardParams::head_dim)
      .def_rw("head_dim_v", &AttnBackwardParams::head_dim_v)
      .def_rw("q", &AttnBackwardParams::q)
      .def_rw("k", &AttnBackwardParams::k)
      .def_rw("v", &AttnBackwardParams::v)
      .def_rw("o", &AttnBackwardParams::o)
      .def_rw("dout", &AttnBackwardParams::dout)
      .def_rw("dq", &AttnBackwardParams::dq)
      .def_rw("dk", &AttnBackwardParams::dk)
      .def_rw("dv", &AttnBackwardParams::dv)
      .def_rw("softmax_scale", &AttnBackwardParams::softmax_scale)
      .def_rw("mask", &AttnBackwardParams::mask)
      .def_rw("total_k", &AttnBackwardParams::total_k)
      .def_rw("deterministic", &AttnBackwardParams::deterministic)
      .def_rw("workspace_bytes", &AttnBackwardParams::workspace_bytes);
  pointer_rw(bp, "lse", &AttnBackwardParams::lse, "the forward's fp32 LSE (read)");
  pointer_rw(bp, "dlse", &AttnBackwardParams::dlse, "fp32 dL/dLSE (read; 0 = none)");
  pointer_rw(bp, "workspace", &AttnBackwardParams::workspace, "attention_backward_workspace_size bytes, 256-aligned");

  // Copied with the block-sparse struct before the GIL is released, as attention_forward's Call.
  struct Call {
    AttnBackwardParams p;
    BlockSparseMask sparse;
    explicit Call(const AttnBackwardParams& params) : p(params) {
      if (p.mask.block_sparse != nullptr) {
        sparse = *p.mask.block_sparse;
        p.mask.block_sparse = &sparse;
      }
    }
  };
  m.def(
      "attention_backward",
      [](const AttnBackwardParams& params, const RunOptions& options) {
        const Call c(params);
        const RunOptions opt = options;
        call_released([&] { return flashcpp::attention_backward(c.p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::attention_backward: validates, selects and runs (dq, dk, dv).");
  m.def(
      "attention_backward_workspace_size",
      [](const AttnBackwardParams& params, const RunOptions& options) {
        const Call c(params);
        const RunOptions opt = options;
        std::size_t bytes = 0;
        call_released([&] { return flashcpp::attention_backward_workspace_size(c.p, opt, &bytes); });
        return bytes;
      },
      "params"_a, "options"_a, "flashcpp::attention_backward_workspace_size: the workspace bytes the call needs.");
  m.def(
      "select_backward_kernel",
      [](const AttnBackwardParams& params, const RunOptions& options) {
        const Call c(params);
        const RunOptions opt = options;
        flashcpp::KernelChoice choice;
        call_released([&] { return flashcpp::select_backward_kernel(c.p, opt, &choice); });
        return std::make_tuple(std::string(flashcpp::kernel_name(choice.id)), choice.config, choice.reason);
      },
      "params"_a, "options"_a, "flashcpp::select_backward_kernel: (kernel, config, reason) without running anything.");
}

// ---- merge of partial states on the host (include/flashcpp/reference.h) --------------------------

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

/// The dense mask's (num_batch, num_heads, seqlen_q, seqlen_k) come from its shape; the block
/// sizes from `shape` (whose other fields are ignored).
nb::dict from_dense(const DenseMask& dense, const BlockSparseShape& shape, const BlockSparseOptions& options) {
  for (std::size_t a = 0; a < 4; ++a)
    if (dense.shape(a) > static_cast<std::size_t>(INT32_MAX))
      raise_value_error("block_sparse_from_dense: the dense mask has a dimension above 2^31-1");
  const BlockSparseShape s{static_cast<int>(dense.shape(2)), static_cast<int>(dense.shape(3)), shape.block_m,
                           shape.block_n, static_cast<int>(dense.shape(0)), static_cast<int>(dense.shape(1))};
  const std::uint8_t* data = dense.data();
  const BlockSparseOptions opt = options;
  return build_and_return([&](BlockMask* out) { return flashcpp::build_block_sparse_from_dense(s, data, out, opt); });
}

nb::dict from_rules(const BlockSparseShape& shape, const flashcpp::MaskParams& rules,
                    const BlockSparseOptions& options) {
  const BlockSparseShape s = shape;
  flashcpp::MaskParams m = rules;
  m.block_sparse = nullptr;  // a rules mask never reads another block mask; nothing to keep alive
  const BlockSparseOptions opt = options;
  return build_and_return([&](BlockMask* out) { return flashcpp::block_mask_from_rules(s, m, out, opt); });
}

nb::dict document(const BlockSparseShape& shape, const CuSeqlens& cu_q, const CuSeqlens& cu_k,
                  const flashcpp::MaskParams& within, const BlockSparseOptions& options) {
  const BlockSparseShape s = shape;
  flashcpp::MaskParams m = within;
  m.block_sparse = nullptr;
  const BlockSparseOptions opt = options;
  const std::span<const std::int32_t> q(cu_q.data(), cu_q.shape(0)), k(cu_k.data(), cu_k.shape(0));
  return build_and_return([&](BlockMask* out) { return flashcpp::document_block_mask(s, q, k, m, out, opt); });
}

nb::object alibi(int num_heads) {
  auto* slopes = new std::vector<float>(static_cast<std::size_t>(std::max(num_heads, 0)));
  nb::capsule owner(slopes, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  const Status st = flashcpp::alibi_slopes(num_heads, slopes->data());
  if (!st.ok()) raise_status(st);  // the capsule frees the vector
  return view_of(slopes->data(), owner, slopes->size());
}

void bind(nb::module_& m) {
  nb::class_<BlockSparseShape>(m, "BlockSparseShape", "flashcpp::BlockSparseShape: the problem a block mask is for")
      .def(nb::init<>())
      .def_rw("seqlen_q", &BlockSparseShape::seqlen_q)
      .def_rw("seqlen_k", &BlockSparseShape::seqlen_k)
      .def_rw("block_m", &BlockSparseShape::block_m)
      .def_rw("block_n", &BlockSparseShape::block_n)
      .def_rw("num_batch", &BlockSparseShape::num_batch)
      .def_rw("num_heads", &BlockSparseShape::num_heads);
  nb::class_<BlockSparseOptions>(m, "BlockSparseOptions", "flashcpp::BlockSparseOptions")
      .def(nb::init<>())
      .def_rw("share_identical_partials", &BlockSparseOptions::share_identical_partials);
  m.def("alibi_slopes", &alibi, "num_heads"_a,
        "BLOOM's ALiBi slopes for num_heads heads (float32 numpy array), flashcpp::alibi_slopes.");
  m.def("block_sparse_from_dense", &from_dense, "dense"_a, "shape"_a, "options"_a,
        "Block-sparse CSR arrays (a dict) of a dense uint8 (num_batch, num_heads, seqlen_q, seqlen_k) mask, "
        "flashcpp::build_block_sparse_from_dense (shape gives block_m and block_n).");
  m.def("block_mask_from_rules", &from_rules, "shape"_a, "rules"_a, "options"_a,
        "Block-sparse CSR arrays (a dict) of the causal/window/global rules, flashcpp::block_mask_from_rules.");
  m.def("document_block_mask", &document, "shape"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "within"_a, "options"_a,
        "Block-sparse CSR arrays (a dict) of a document (packed varlen) mask, flashcpp::document_block_mask.");
}

}  // namespace masks_binding

// ---- fused kernels (include/flashcpp/fused.h): RMSNorm (+ residual), SwiGLU, rotary -----------------
// flashcpp/fused.py checks shapes and allocates outputs; same Status -> exception mapping as attention.
namespace fused_binding {

using flashcpp::MatrixView;
using flashcpp::QkNormRopeParams;
using flashcpp::RmsNormParams;
using flashcpp::RopeAppendParams;
using flashcpp::RopeParams;
using flashcpp::SiluMulParams;

void bind(nb::module_& m) {
  nb::class_<MatrixView> mv(m, "MatrixView", "flashcpp::MatrixView: data pointer (int), dtype code, row stride");
  mv.def(nb::init<>())
      .def(
          "__init__",
          [](MatrixView* v, std::uintptr_t data, int dtype, std::int64_t row_stride) {
            const DType dt = to_dtype(dtype);
            new (v) MatrixView{reinterpret_cast<void*>(data), dt, row_stride};
          },
          "data"_a, "dtype"_a, "row_stride"_a)
      .def_rw("row_stride", &MatrixView::row_stride);
  pointer_rw(mv, "data", &MatrixView::data);
  dtype_rw(mv);

  nb::class_<RmsNormParams> rn(m, "RmsNormParams", "flashcpp::RmsNormParams (residual views only for fused_add_rms_norm)");
  rn.def(nb::init<>())
      .def_rw("rows", &RmsNormParams::rows)
      .def_rw("hidden", &RmsNormParams::hidden)
      .def_rw("x", &RmsNormParams::x)
      .def_rw("residual", &RmsNormParams::residual)
      .def_rw("residual_out", &RmsNormParams::residual_out)
      .def_rw("y", &RmsNormParams::y)
      .def_rw("eps", &RmsNormParams::eps);
  pointer_rw(rn, "weight", &RmsNormParams::weight);

  nb::class_<SiluMulParams>(m, "SiluMulParams", "flashcpp::SiluMulParams")
      .def(nb::init<>())
      .def_rw("rows", &SiluMulParams::rows)
      .def_rw("d", &SiluMulParams::d)
      .def_rw("gate", &SiluMulParams::gate)
      .def_rw("up", &SiluMulParams::up)
      .def_rw("out", &SiluMulParams::out);

  nb::class_<RopeParams> rp(m, "RopeParams", "flashcpp::RopeParams (q_out/k_out data 0 = in place)");
  rp.def(nb::init<>())
      .def_rw("batch", &RopeParams::batch)
      .def_rw("seqlen", &RopeParams::seqlen)
      .def_rw("heads_q", &RopeParams::heads_q)
      .def_rw("heads_k", &RopeParams::heads_k)
      .def_rw("head_dim", &RopeParams::head_dim)
      .def_rw("q", &RopeParams::q)
      .def_rw("k", &RopeParams::k)
      .def_rw("q_out", &RopeParams::q_out)
      .def_rw("k_out", &RopeParams::k_out)
      .def_rw("rotary", &RopeParams::rotary);
  pointer_rw(rp, "positions", &RopeParams::positions);

  nb::class_<QkNormRopeParams> qn(m, "QkNormRopeParams", "flashcpp::QkNormRopeParams (q_out/k_out data 0 = in place)");
  qn.def(nb::init<>())
      .def_rw("batch", &QkNormRopeParams::batch)
      .def_rw("seqlen", &QkNormRopeParams::seqlen)
      .def_rw("heads_q", &QkNormRopeParams::heads_q)
      .def_rw("heads_k", &QkNormRopeParams::heads_k)
      .def_rw("head_dim", &QkNormRopeParams::head_dim)
      .def_rw("q", &QkNormRopeParams::q)
      .def_rw("k", &QkNormRopeParams::k)
      .def_rw("q_out", &QkNormRopeParams::q_out)
      .def_rw("k_out", &QkNormRopeParams::k_out)
      .def_rw("weight_offset", &QkNormRopeParams::weight_offset)
      .def_rw("eps", &QkNormRopeParams::eps)
      .def_rw("rotary", &QkNormRopeParams::rotary);
  pointer_rw(qn, "q_weight", &QkNormRopeParams::q_weight);
  pointer_rw(qn, "k_weight", &QkNormRopeParams::k_weight);
  pointer_rw(qn, "positions", &QkNormRopeParams::positions);

  nb::class_<RopeAppendParams> ra(m, "RopeAppendParams", "flashcpp::RopeAppendParams (q_out data 0 = q in place)");
  ra.def(nb::init<>())
      .def_rw("batch", &RopeAppendParams::batch)
      .def_rw("seqlen", &RopeAppendParams::seqlen)
      .def_rw("heads_q", &RopeAppendParams::heads_q)
      .def_rw("heads_kv", &RopeAppendParams::heads_kv)
      .def_rw("head_dim", &RopeAppendParams::head_dim)
      .def_rw("head_dim_v", &RopeAppendParams::head_dim_v)
      .def_rw("q", &RopeAppendParams::q)
      .def_rw("q_out", &RopeAppendParams::q_out)
      .def_rw("k_new", &RopeAppendParams::k_new)
      .def_rw("v_new", &RopeAppendParams::v_new)
      .def_rw("cache", &RopeAppendParams::cache)
      .def_rw("rotary", &RopeAppendParams::rotary);
  pointer_rw(ra, "cache_seqlens", &RopeAppendParams::cache_seqlens);
  pointer_rw(ra, "positions", &RopeAppendParams::positions);

  m.def(
      "rms_norm",
      [](const RmsNormParams& params, const RunOptions& options) {
        const RmsNormParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::rms_norm(p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::rms_norm.");
  m.def(
      "fused_add_rms_norm",
      [](const RmsNormParams& params, const RunOptions& options) {
        const RmsNormParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::fused_add_rms_norm(p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::fused_add_rms_norm.");
  m.def(
      "silu_and_mul",
      [](const SiluMulParams& params, const RunOptions& options) {
        const SiluMulParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::silu_and_mul(p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::silu_and_mul.");
  m.def(
      "apply_rotary",
      [](const RopeParams& params, const RunOptions& options) {
        const RopeParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::apply_rotary(p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::apply_rotary.");
  m.def(
      "qk_norm_rope",
      [](const QkNormRopeParams& params, const RunOptions& options) {
        const QkNormRopeParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::qk_norm_rope(p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::qk_norm_rope.");
  m.def(
      "rope_append_kv",
      [](const RopeAppendParams& params, const RunOptions& options) {
        const RopeAppendParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::rope_append_kv(p, opt); });
      },
      "params"_a, "options"_a, "flashcpp::rope_append_kv.");
}

}  // namespace fused_binding

// ---- decode (include/flashcpp/decode.h): plan/run over a KV cache, and merge of partial states ----
// Python (flashcpp/_decode.py) checks shapes and devices, owns the workspaces (torch or numpy
// buffers) and keeps the DecodePlan; this layer maps the structs and a non-ok Status to an
// exception. decode_run never allocates or synchronizes, so a run can be captured in a CUDA graph.
namespace decode_binding {

using flashcpp::DecodeParams;
using flashcpp::DecodePlan;
using flashcpp::KVCacheView;
using flashcpp::MergeStatesParams;

using HostInt32 = nb::ndarray<const std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// flashcpp::DecodePlanOptions, plus the length of the host_cache_seqlens array it points at, so
/// that a plan checks it against the batch before reading it (the struct holds the pointer only).
struct PlanOptions : flashcpp::DecodePlanOptions {
  std::size_t host_cache_seqlens_size = 0;
};

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

/// The plan options as the C++ API takes them, with the host lengths checked against the batch.
flashcpp::DecodePlanOptions checked(const PlanOptions& opt, const DecodeParams& p) {
  if (opt.host_cache_seqlens != nullptr && opt.host_cache_seqlens_size != static_cast<std::size_t>(std::max(p.batch, 0)))
    raise_value_error("host_cache_seqlens has " + std::to_string(opt.host_cache_seqlens_size) +
                      " entries; the plan is for batch " + std::to_string(p.batch));
  return opt;
}

std::tuple<std::size_t, std::size_t> workspace_size(const DecodeParams& params, const PlanOptions& options,
                                                    bool append) {
  const DecodeParams p = for_plan(params, append);
  const flashcpp::DecodePlanOptions opt = checked(options, p);
  flashcpp::DecodeWorkspaceSize ws;
  call_released([&] { return flashcpp::decode_workspace_size(p, opt, &ws); });  // CUDA asks the driver for the SM count
  return {ws.int_bytes, ws.float_bytes};
}

DecodePlan plan(const DecodeParams& params, const PlanOptions& options, bool append, std::uintptr_t int_workspace,
                std::size_t int_bytes, std::uintptr_t float_workspace, std::size_t float_bytes) {
  const DecodeParams p = for_plan(params, append);
  const flashcpp::DecodePlanOptions opt = checked(options, p);
  DecodePlan out;
  call_released([&] {  // uploads the work list (may wait for the stream)
    return flashcpp::decode_plan(p, opt, reinterpret_cast<void*>(int_workspace), int_bytes,
                                 reinterpret_cast<void*>(float_workspace), float_bytes, &out);
  });
  return out;
}

void bind(nb::module_& m) {
  nb::class_<KVCacheView> kv(m, "KVCacheView", "flashcpp::KVCacheView: contiguous (page_size 0) or paged cache");
  kv.def(nb::init<>())
      .def_rw("k", &KVCacheView::k)
      .def_rw("v", &KVCacheView::v)
      .def_rw("capacity", &KVCacheView::capacity)
      .def_rw("page_size", &KVCacheView::page_size)
      .def_rw("num_pages", &KVCacheView::num_pages)
      .def_rw("block_table_stride", &KVCacheView::block_table_stride)
      .def_rw("pages_per_seq", &KVCacheView::pages_per_seq);
  pointer_rw(kv, "block_table", &KVCacheView::block_table);
  pointer_rw(kv, "k_scale", &KVCacheView::k_scale, "fp8_e4m3 cache: fp32 [heads_kv] scales of K (K = code * k_scale)");
  pointer_rw(kv, "v_scale", &KVCacheView::v_scale, "fp8_e4m3 cache: fp32 [heads_kv] scales of V (V = code * v_scale)");

  nb::class_<DecodeParams> dp(m, "DecodeParams", "flashcpp::DecodeParams of one decode step");
  dp.def(nb::init<>())
      .def_rw("batch", &DecodeParams::batch)
      .def_rw("seqlen_q", &DecodeParams::seqlen_q)
      .def_rw("heads_q", &DecodeParams::heads_q)
      .def_rw("heads_kv", &DecodeParams::heads_kv)
      .def_rw("head_dim", &DecodeParams::head_dim)
      .def_rw("head_dim_v", &DecodeParams::head_dim_v)
      .def_rw("q", &DecodeParams::q)
      .def_rw("o", &DecodeParams::o)
      .def_rw("cache", &DecodeParams::cache)
      .def_rw("k_new", &DecodeParams::k_new)
      .def_rw("v_new", &DecodeParams::v_new)
      .def_rw("rotary", &DecodeParams::rotary)
      .def_rw("softmax_scale", &DecodeParams::softmax_scale)
      .def_rw("mask", &DecodeParams::mask);
  pointer_rw(dp, "lse", &DecodeParams::lse);
  pointer_rw(dp, "cache_seqlens", &DecodeParams::cache_seqlens);

  nb::class_<PlanOptions> po(m, "DecodePlanOptions",
                             "flashcpp::DecodePlanOptions; host_cache_seqlens is an int32 host array, kept alive "
                             "by this object");
  po.def(nb::init<>())
      .def_prop_rw(
          "backend", [](const PlanOptions& o) { return std::string(flashcpp::backend_name(o.backend)); },
          [](PlanOptions& o, const std::string& name) { o.backend = to_backend(name); })
      .def_prop_rw(
          "host_cache_seqlens",
          [](const PlanOptions& o) { return reinterpret_cast<std::uintptr_t>(o.host_cache_seqlens); },
          [](PlanOptions& o, const std::optional<HostInt32>& lens) {
            o.host_cache_seqlens = lens ? lens->data() : nullptr;
            o.host_cache_seqlens_size = lens ? lens->shape(0) : 0;
          },
          nb::for_setter(nb::keep_alive<1, 2>()), nb::for_setter(nb::arg("lens").none()),
          "an int32 (batch,) host array or None; reads back as its address")
      .def_rw("num_splits", &PlanOptions::num_splits)
      .def_rw("max_splits", &PlanOptions::max_splits)
      .def_rw("num_sms", &PlanOptions::num_sms)
      .def_rw("fused_merge", &PlanOptions::fused_merge)
      .def_rw("fused_append", &PlanOptions::fused_append)
      .def_prop_rw(
          "small_plan",
          [](const PlanOptions& o) {
            return std::string(o.small_plan == flashcpp::DecodePlanOptions::SmallPlan::kShared ? "shared" : "full_wave");
          },
          [](PlanOptions& o, const std::string& v) {
            if (v != "full_wave" && v != "shared")
              throw nb::value_error(("small_plan must be 'full_wave' or 'shared'; got '" + v + "'").c_str());
            o.small_plan = v == "shared" ? flashcpp::DecodePlanOptions::SmallPlan::kShared
                                         : flashcpp::DecodePlanOptions::SmallPlan::kFullWave;
          },
          "DecodePlanOptions::small_plan: 'full_wave' or 'shared'");
  pointer_rw(po, "stream", &PlanOptions::stream, "cudaStream_t of the work-list upload, as an int");

  nb::class_<DecodePlan>(m, "DecodePlan", "flashcpp::DecodePlan: the decisions decode_plan made (read-only)")
      .def_ro("planned", &DecodePlan::planned)
      .def_prop_ro("backend", [](const DecodePlan& p) { return std::string(flashcpp::backend_name(p.backend)); })
      .def_ro("batch", &DecodePlan::batch)
      .def_ro("seqlen_q", &DecodePlan::seqlen_q)
      .def_ro("heads_q", &DecodePlan::heads_q)
      .def_ro("heads_kv", &DecodePlan::heads_kv)
      .def_ro("head_dim", &DecodePlan::head_dim)
      .def_ro("head_dim_v", &DecodePlan::head_dim_v)
      .def_prop_ro("dtype", [](const DecodePlan& p) { return static_cast<int>(p.dtype); })
      .def_ro("paged", &DecodePlan::paged)
      .def_ro("append", &DecodePlan::append)
      .def_ro("rows_per_kv", &DecodePlan::rows_per_kv)
      .def_ro("row_blocks", &DecodePlan::row_blocks)
      .def_ro("warp_rows", &DecodePlan::warp_rows)
      .def_ro("num_items", &DecodePlan::num_items)
      .def_ro("max_splits", &DecodePlan::max_splits)
      .def_ro("ctas_per_sm", &DecodePlan::ctas_per_sm)
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

  nb::class_<MergeStatesParams> ms(m, "MergeStatesParams", "flashcpp::MergeStatesParams (lse 0 = not wanted)");
  ms.def(nb::init<>())
      .def_rw("batch", &MergeStatesParams::batch)
      .def_rw("seqlen", &MergeStatesParams::seqlen)
      .def_rw("heads", &MergeStatesParams::heads)
      .def_rw("head_dim", &MergeStatesParams::head_dim)
      .def_rw("o_a", &MergeStatesParams::o_a)
      .def_rw("o_b", &MergeStatesParams::o_b)
      .def_rw("o", &MergeStatesParams::o);
  pointer_rw(ms, "lse_a", &MergeStatesParams::lse_a);
  pointer_rw(ms, "lse_b", &MergeStatesParams::lse_b);
  pointer_rw(ms, "lse", &MergeStatesParams::lse);

  m.def("decode_workspace_size", &workspace_size, "params"_a, "options"_a, "append"_a,
        "flashcpp::decode_workspace_size: (int_bytes, float_bytes) of a plan for these params and options; "
        "append: the steps will bring new k/v (they need not exist yet).");
  m.def("decode_plan", &plan, "params"_a, "options"_a, "append"_a, "int_workspace"_a, "int_bytes"_a,
        "float_workspace"_a, "float_bytes"_a,
        "flashcpp::decode_plan into caller-owned workspaces (16-byte aligned, on the run's device); "
        "returns the DecodePlan.");
  m.def(
      "decode_run",
      [](const DecodeParams& params, const DecodePlan& plan, const RunOptions& options) {
        const DecodeParams p = params;
        const DecodePlan pl = plan;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::decode_run(p, pl, opt); });  // launches only (CUDA), or computes (CPU)
      },
      "params"_a, "plan"_a, "options"_a,
      "flashcpp::decode_run: launches the step (CUDA: asynchronous on the stream, no allocation, no sync).");
  m.def(
      "merge_attention_states",
      [](const MergeStatesParams& params, const RunOptions& options) {
        const MergeStatesParams p = params;
        const RunOptions opt = options;
        call_released([&] { return flashcpp::merge_attention_states(p, opt); });
      },
      "params"_a, "options"_a,
      "flashcpp::merge_attention_states on (batch, seqlen, heads, head_dim) views and contiguous "
      "(batch, heads, seqlen) fp32 LSEs; o may be exactly o_a or o_b.");
  m.attr("DECODE_MAX_SEQLEN_Q") = flashcpp::kDecodeMaxSeqlenQ;
  m.attr("DECODE_MAX_PAGE_SIZE") = flashcpp::kDecodeMaxPageSize;
  m.attr("DECODE_MAX_SPLITS") = flashcpp::kDecodeMaxSplits;
}

}  // namespace decode_binding

NB_MODULE(_flashcpp, m) {
  m.doc() = "flashcpp C++ binding: the public parameter structs as classes (pointers as ints, dtype codes, "
            "stream as int), one call per entry point";
  m.attr("WITH_CUDA") = bool(FLASHCPP_WITH_CUDA);
  m.attr("VERSION") = FLASHCPP_VERSION;
  m.attr("GIT_COMMIT") = FLASHCPP_GIT_COMMIT;
  nb::list dims, cuda_dims;
  for (int d = flashcpp::kHeadDimStep; d <= flashcpp::kMaxHeadDim; d += flashcpp::kHeadDimStep)
    if (flashcpp::is_supported_head_dim(d)) dims.append(d);
  for (int d : flashcpp::kCudaHeadDims) cuda_dims.append(d);
  m.attr("SUPPORTED_HEAD_DIMS") = nb::tuple(dims);
  m.attr("CUDA_HEAD_DIMS") = nb::tuple(cuda_dims);
  m.attr("DTYPE_F16") = static_cast<int>(DType::kF16);
  m.attr("DTYPE_BF16") = static_cast<int>(DType::kBF16);
  m.attr("DTYPE_F32") = static_cast<int>(DType::kF32);
  m.attr("DTYPE_F64") = static_cast<int>(DType::kF64);
  m.attr("DTYPE_F8E4M3") = static_cast<int>(DType::kF8E4M3);

  bind_common(m);
  bind_attention(m);
  bind_backward(m);
  m.def("merge_by_lse", &merge_by_lse, "o_a"_a, "lse_a"_a, "o_b"_a, "lse_b"_a, "o"_a.noconvert(),
        "lse"_a.noconvert(),
        "Row-wise merge of two normalized partial attention outputs by their natural-log LSEs "
        "(fp32, C-contiguous host arrays; writes o and lse).");
  masks_binding::bind(m);
  fused_binding::bind(m);
  decode_binding::bind(m);
  flashcpp_python::bind_engine(m);
  flashcpp_python::bind_eager(m);
}
