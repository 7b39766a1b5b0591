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
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "cpu/cpu_backend.h"
#include "flashcpp/attention.h"

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

/// One entry point for both "run" and "select only", so the two can never disagree on how
/// the arguments map to AttnParams.
nb::object attention(const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
                     std::uintptr_t lse, int dtype, int batch, int seqlen_q, int seqlen_k,
                     int heads_q, int heads_kv, int head_dim, float softmax_scale, bool causal,
                     int window_left, int window_right, float softcap, std::uintptr_t alibi_slopes,
                     std::int64_t alibi_batch_stride, int global_tokens, bool global_queries,
                     std::uintptr_t cu_seqlens_q, std::uintptr_t cu_seqlens_k, std::uintptr_t stream,
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
  p.mask.causal = causal;
  p.mask.window_left = window_left;
  p.mask.window_right = window_right;
  p.mask.global_tokens = global_tokens;
  p.mask.global_queries = global_queries;
  p.mask.softcap = softcap;
  p.mask.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  p.mask.alibi_batch_stride = alibi_batch_stride;
  p.mask.cu_seqlens_q = reinterpret_cast<const std::int32_t*>(cu_seqlens_q);
  p.mask.cu_seqlens_k = reinterpret_cast<const std::int32_t*>(cu_seqlens_k);

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
        "cu_seqlens_k"_a, "stream"_a, "backend"_a, "cpu_threads"_a, "cuda_config"_a,
        "select_only"_a,
        "Runs flashcpp::attention_forward (select_only=False, returns None) or "
        "flashcpp::select_kernel (select_only=True, returns (kernel, config, reason)). Tensors are "
        "(data_ptr, batch_stride, seq_stride, head_stride) with strides in elements.");
  m.def("merge_by_lse", &merge_by_lse, "o_a"_a, "lse_a"_a, "o_b"_a, "lse_b"_a, "o"_a.noconvert(),
        "lse"_a.noconvert(),
        "Row-wise merge of two normalized partial attention outputs by their natural-log LSEs "
        "(fp32, C-contiguous host arrays; writes o and lse).");
}
