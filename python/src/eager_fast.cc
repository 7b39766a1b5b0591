// The eager fast paths, marshalled in C++: a plain flash_attn_func, flash_attn_varlen_func,
// flash_attn_with_kvcache, rms_norm, fused_add_rms_norm, silu_and_mul or apply_rotary call on torch
// tensors is read and launched here in one call from Python (the kvcache step calls back once for
// its plan, which Python caches); so are the forward and the backward of the eager autograd
// formulas of flash_attn_func and flash_attn_varlen_func (_torch_ops.EagerAttention and
// EagerVarlenAttention: attention_fast and varlen_fast, backward_fast and varlen_backward_fast).
//
// Why: Python code that reads each tensor's shape, strides and pointer and then sets each params
// field as an attribute cost about 29 of flash_attn_func's 46 us of host time per call on the H200
// host (reports/integrations/README.md, scripts/host_probe.py); the same reads in C++ cost a few.
//
// The tensors are read through their Python attributes (dtype, shape, stride(), data_ptr(), ...):
// no torch header or library, so the wheel still links no libtorch. flashcpp._core hands over the
// few torch objects needed at import (_eager_bind); before that, or without torch, every entry
// returns None.
//
// Each entry returns None for a call it does not take: numpy arrays, tensor subclasses (FakeTensor
// under torch.compile), dtypes other than fp16/bf16/fp32, a device other than the host or the
// current CUDA device, inputs that require grad where the call writes or differentiates, strides it
// cannot read plainly, empty tensors, arguments of other Python types. The Python caller then runs
// its general path, whose checks and sentences are unchanged. A call it takes reaches the same C++
// entry point with the params the Python fast path filled before, and the C++ validator checks them
// as it checks every call (tests/python/test_attention_fast_path.py, test_fused_fast_path.py and
// test_rotary_fast_path.py compare it with the general path bit for bit).
//
// The entries also do what the Python guard in front of them did on every call (about 2-4 us of
// Python per call on the 2-core CPU machine): where autograd records (grad mode on and an input
// requires grad) they return None before checking anything that raises, so the callers make this
// call first and run their grad test only when it returns None; then they check what the guard
// checked, in its order (eps, window_size, the inference tensors and caches written in place,
// through the guard's own functions where a value is not the plain one), and move the version
// counters of what they wrote in place under grad mode (_core.bump_versions did). With autograd off
// they refuse exactly what they refused before.
#include "eager_fast.h"

#include <nanobind/stl/pair.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"
#include "flashcpp/decode.h"
#include "flashcpp/fused.h"
#include "py_status.h"

namespace nb = nanobind;

namespace flashcpp_python {
namespace {

using flashcpp::AttnParams;
using flashcpp::Backend;
using flashcpp::DType;
using flashcpp::MatrixView;
using flashcpp::RunOptions;
using flashcpp::TensorView;

/// What the fast paths need of torch, handed over by _eager_bind. Never destroyed: nothing here
/// may touch Python objects after the interpreter has finalized.
struct Torch {
  PyObject* tensor = nullptr;          // torch.Tensor and torch.nn.Parameter: the exact types taken
  PyObject* parameter = nullptr;
  PyObject* f16 = nullptr;             // torch.float16, torch.bfloat16, torch.float32
  PyObject* bf16 = nullptr;
  PyObject* f32 = nullptr;
  PyObject* i32 = nullptr;             // torch.int32: cache_seqlens and block_table
  PyObject* current_device = nullptr;  // () -> int: torch's current CUDA device (null: no CUDA in torch)
  PyObject* raw_stream = nullptr;      // (int) -> int: the current stream of that device
  PyObject* empty_like = nullptr;      // torch.empty_like: about 1.2 us cheaper than new_empty on the H200 host (host_probe)
  // _core.check_inference_write(t, name): raises the general path's sentence for an inference tensor
  // written outside inference mode (called only for a tensor whose is_inference() is True).
  PyObject* check_inference_write = nullptr;
  // What the Python guards in front of the fast paths called on every call, now called from here
  // only where a call needs them (a tensor requires grad, an eps outside the plain range, an append):
  // torch.is_grad_enabled, torch._C._increment_version (on a list: the one-tensor form costs ~9 us
  // on the H200 host), _core.check_eps, _core.check_window, _core.check_caches_apart.
  PyObject* is_grad_enabled = nullptr;
  PyObject* increment_version = nullptr;
  PyObject* check_eps = nullptr;
  PyObject* check_window = nullptr;
  PyObject* check_caches_apart = nullptr;
  long max_cpu_threads = 0;
  // Interned attribute names, ("dtype",) for new_empty's keyword, and the keys of a llama3 dict.
  PyObject *s_dtype, *s_shape, *s_stride, *s_data_ptr, *s_requires_grad, *s_is_cuda, *s_is_cpu, *s_get_device,
      *s_is_neg, *s_is_inference, *s_new_empty, *kw_dtype, *s_move_to_end, *s_fast, *s_contiguous;
  PyObject *k_factor, *k_low_freq_factor, *k_high_freq_factor, *k_original_max_position_embeddings,
      *k_original_max_position;
};
Torch* g_torch = nullptr;

constexpr int kMaxDims = 8;
/// What a softmax_scale of 0 runs with (_core.ZERO_SCALE, which is this value: its comment says why).
constexpr double kZeroScale = 0x1p-100;

/// A torch tensor's metadata, read through its Python attributes.
struct Tensor {
  PyObject* obj = nullptr;  // borrowed
  std::uintptr_t data = 0;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t stride[kMaxDims] = {};
  DType dtype = DType::kBF16;
  int device = -1;  // -1: the host, else the CUDA device index
  bool requires_grad = false;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  /// torch's is_contiguous(): row-major strides, size-1 dims excepted.
  bool contiguous() const {
    if (numel() == 0) return true;
    std::int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] == 1) continue;
      if (stride[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  bool same_place(const Tensor& o) const { return o.dtype == dtype && o.device == device; }
};

/// A new reference, or null with no Python error left pending.
nb::object cleared(PyObject* r) {
  if (r == nullptr) PyErr_Clear();
  return nb::steal(r);
}

/// An exact Python int (not a bool) in [lo, hi], or false with no Python error left pending.
bool int_in(nb::handle h, long long lo, long long hi, long long* out) {
  if (!PyLong_CheckExact(h.ptr())) return false;
  const long long v = PyLong_AsLongLong(h.ptr());  // -1 with an error past long long: outside too
  if (v < lo || v > hi || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

bool fits_int32(std::int64_t v) { return v <= 0x7fffffffLL; }

bool read_ints(PyObject* tuple, Py_ssize_t n, std::int64_t* out) {
  if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out[i] = v;
  }
  return true;
}

/// The address a call returned (a Python int; null: the call failed), with no Python error left
/// pending; false when there is none.
bool address_of(const nb::object& r, std::uintptr_t* out) {
  if (!r.is_valid()) return false;
  const unsigned long long v = PyLong_AsUnsignedLongLong(r.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *out = static_cast<std::uintptr_t>(v);
  return true;
}

/// Exactly torch.Tensor or torch.nn.Parameter (not a subclass such as FakeTensor).
bool plain_tensor(PyObject* o) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(o));
  return type == g_torch->tensor || type == g_torch->parameter;
}

/// A tensor's shape, strides (1 to kMaxDims dims) and data pointer.
bool read_layout(PyObject* o, Tensor* t) {
  const Torch& T = *g_torch;
  nb::object shape = cleared(PyObject_GetAttr(o, T.s_shape));
  if (!shape.is_valid() || !PyTuple_Check(shape.ptr())) return false;
  const Py_ssize_t nd = PyTuple_GET_SIZE(shape.ptr());
  if (nd < 1 || nd > kMaxDims) return false;
  t->ndim = static_cast<int>(nd);
  nb::object stride = cleared(PyObject_CallMethodNoArgs(o, T.s_stride));  // raises for sparse layouts
  return stride.is_valid() && read_ints(shape.ptr(), nd, t->shape) && read_ints(stride.ptr(), nd, t->stride) &&
         address_of(cleared(PyObject_CallMethodNoArgs(o, T.s_data_ptr)), &t->data);
}

/// A tensor's device: -1 for the host, else its CUDA index; false for any other device (meta, ...).
bool read_device(PyObject* o, int* device) {
  const Torch& T = *g_torch;
  nb::object cuda = cleared(PyObject_GetAttr(o, T.s_is_cuda));
  if (!cuda.is_valid()) return false;
  if (cuda.ptr() != Py_True) {
    nb::object cpu = cleared(PyObject_GetAttr(o, T.s_is_cpu));  // not meta, mps, xpu, ...
    *device = -1;
    return cpu.is_valid() && cpu.ptr() == Py_True;
  }
  nb::object dev = cleared(PyObject_CallMethodNoArgs(o, T.s_get_device));
  if (!dev.is_valid()) return false;
  const long d = PyLong_AsLong(dev.ptr());
  if (d < 0 || d > 1 << 20) {
    PyErr_Clear();
    return false;
  }
  *device = static_cast<int>(d);
  return true;
}

/// Reads a plain tensor of fp16, bf16 or fp32 on the host or a CUDA device; false for anything else.
bool read(nb::handle h, Tensor* t) {
  const Torch& T = *g_torch;
  PyObject* o = h.ptr();
  if (!plain_tensor(o)) return false;
  t->obj = o;
  nb::object dt = cleared(PyObject_GetAttr(o, T.s_dtype));
  if (!dt.is_valid()) return false;
  if (dt.ptr() == T.bf16) t->dtype = DType::kBF16;
  else if (dt.ptr() == T.f16) t->dtype = DType::kF16;
  else if (dt.ptr() == T.f32) t->dtype = DType::kF32;
  else return false;
  if (!read_device(o, &t->device)) return false;
  nb::object grad = cleared(PyObject_GetAttr(o, T.s_requires_grad));
  if (!grad.is_valid()) return false;
  t->requires_grad = grad.ptr() == Py_True;
  // A negative view (torch._neg_view) holds -x as x's bits plus a flag: its memory is not its values.
  nb::object neg = cleared(PyObject_CallMethodNoArgs(o, T.s_is_neg));
  if (!neg.is_valid() || neg.ptr() != Py_False) return false;
  return read_layout(o, t);
}

/// The backend and stream of a call on t's device: the host, or the current CUDA device with
/// torch's current stream on it (fp32 on CUDA only where the kernels take it).
bool place(const Tensor& t, bool fp32_on_cuda, RunOptions* opt) {
  if (t.device < 0) {
    opt->backend = Backend::kCpu;
    opt->stream = nullptr;
    return true;
  }
  const Torch& T = *g_torch;
  if ((t.dtype == DType::kF32 && !fp32_on_cuda) || T.current_device == nullptr || T.raw_stream == nullptr) return false;
  nb::object cur = cleared(PyObject_CallNoArgs(T.current_device));
  if (!cur.is_valid()) return false;
  const long c = PyLong_AsLong(cur.ptr());
  if (c != t.device) {
    PyErr_Clear();
    return false;
  }
  std::uintptr_t stream = 0;
  if (!address_of(cleared(PyObject_CallOneArg(T.raw_stream, cur.ptr())), &stream)) return false;
  opt->backend = Backend::kCuda;
  opt->stream = reinterpret_cast<flashcpp::Stream>(stream);
  return true;
}

/// Whether autograd records (torch.is_grad_enabled()); raises on failure.
bool grad_mode() {
  nb::object r = nb::steal(PyObject_CallNoArgs(g_torch->is_grad_enabled));
  if (!r.is_valid()) throw nb::python_error();
  return r.ptr() == Py_True;
}

/// Whether autograd would record a call on t: grad mode on and t requires grad, as _core.grad_needed
/// decides it for a plain tensor (grad mode read only for a tensor that requires grad). The entries
/// return None for such a call before anything they check could raise: the caller's general path
/// refuses it or runs it without a backward, as before.
bool grad_recorded(const Tensor& t) { return t.requires_grad && grad_mode(); }

/// _core.bump_versions from here: under grad mode, the version counters of tensors a fast path
/// wrote in place move (one torch._C._increment_version call on a list), as an in-place torch op
/// moves them, so that a backward that saved one of them before the write says so.
void bump_versions(std::initializer_list<PyObject*> written) {
  if (!grad_mode()) return;
  nb::list l;
  for (PyObject* t : written) l.append(nb::handle(t));
  nb::object r = nb::steal(PyObject_CallOneArg(g_torch->increment_version, l.ptr()));
  if (!r.is_valid()) throw nb::python_error();
}

/// Calls one of the handed-over Python checks (it raises the general path's sentence, or returns).
nb::object py_check(PyObject* fn, nb::handle a, nb::handle b = nb::handle()) {
  PyObject* r = b.is_valid() ? PyObject_CallFunctionObjArgs(fn, a.ptr(), b.ptr(), nullptr)
                             : PyObject_CallOneArg(fn, a.ptr());
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

/// A plain Python float or int (not bool) as a double.
bool number(nb::handle h, double* out) {
  PyObject* o = h.ptr();
  if (PyFloat_CheckExact(o)) {
    *out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (PyLong_CheckExact(o)) {
    const double v = PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    *out = v;
    return true;
  }
  return false;
}

bool cpu_threads_of(nb::handle h, int* out) {
  long long v = 0;
  if (!int_in(h, 0, g_torch->max_cpu_threads, &v)) return false;
  *out = static_cast<int>(v);
  return true;
}

/// torch.empty_like(like) for a contiguous `like`: a contiguous tensor of its shape, dtype and
/// device (empty_like keeps the strides of a dense input, which for a contiguous one are row-major
/// up to the strides of size-1 dims, which no view reads); raises on failure.
nb::object empty_like(const Tensor& like) {
  PyObject* r = PyObject_CallOneArg(g_torch->empty_like, like.obj);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

/// like.new_empty(shape) (like's dtype, or `dtype`), contiguous on like's device; raises on failure.
nb::object new_empty(const Tensor& like, nb::handle shape, PyObject* dtype = nullptr) {
  const Torch& T = *g_torch;
  PyObject* r = nullptr;
  if (dtype == nullptr) {
    r = PyObject_CallMethodOneArg(like.obj, T.s_new_empty, shape.ptr());
  } else {
    PyObject* args[] = {like.obj, shape.ptr(), dtype};
    r = PyObject_VectorcallMethod(T.s_new_empty, args, 2, T.kw_dtype);
  }
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

/// The data pointer of an output this file allocated; raises on failure.
std::uintptr_t data_ptr(nb::handle t) {
  nb::object p = nb::steal(PyObject_CallMethodNoArgs(t.ptr(), g_torch->s_data_ptr));
  if (!p.is_valid()) throw nb::python_error();
  std::uintptr_t a = 0;
  if (!address_of(p, &a)) throw nb::type_error("data_ptr() did not return an address");
  return a;
}

/// The TensorView of a 4-D (batch, seq, heads, dim) tensor, or with `packed` of a 3-D varlen
/// (total, heads, dim) one (no batch stride), with a contiguous last dim; a size-1 dim gets the
/// tensor's extent as its stride (torch leaves that stride arbitrary), exactly as the general
/// path's _core.tensor_view makes it. False for anything else.
bool view_of(const Tensor& t, bool packed, TensorView* v) {
  const int nd = packed ? 3 : 4;
  if (t.ndim != nd || t.stride[nd - 1] != 1) return false;
  std::int64_t extent = 1;
  for (int i = 0; i < nd; ++i)
    if (t.shape[i] > 0) extent += (t.shape[i] - 1) * t.stride[i];
  auto s = [&](int i) { return t.shape[i] > 1 ? t.stride[i] : extent; };
  *v = packed ? TensorView{reinterpret_cast<void*>(t.data), t.dtype, 0, s(0), s(1)}
              : TensorView{reinterpret_cast<void*>(t.data), t.dtype, s(0), s(1), s(2)};
  return true;
}

bool view4(const Tensor& t, TensorView* v) { return view_of(t, false, v); }

/// The metadata of a new contiguous (row-major) tensor of `shape` (ndim dims) at `data`.
Tensor contiguous_tensor(std::uintptr_t data, DType dt, int ndim, const std::int64_t* shape) {
  Tensor t;
  t.data = data;
  t.dtype = dt;
  t.ndim = ndim;
  std::int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= shape[i];
  }
  return t;
}

/// The view of a new contiguous (b, s, h, d) output at `data`.
TensorView contiguous_view4(std::uintptr_t data, DType dt, std::int64_t b, std::int64_t s, std::int64_t h,
                            std::int64_t d) {
  const std::int64_t shape[4] = {b, s, h, d};
  TensorView v;
  view4(contiguous_tensor(data, dt, 4, shape), &v);
  return v;
}

/// Whether t's strides are exactly row-major, size-1 dims included (contiguous() skips those).
bool row_major(const Tensor& t) {
  std::int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.stride[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

// ---- entries ---------------------------------------------------------------------------------------

/// What flash_attn_func and flash_attn_varlen_func (and their backward) share on the fast path: the
/// flags, softcap and scale, and q, k and v read (`dims` of them: 4, or 3 when packed), in one
/// place. Inputs that require grad are taken with grad mode off: the eager autograd formulas
/// (_torch_ops.EagerAttention, EagerVarlenAttention) run their forward and backward under it, and a
/// call there records nothing. With grad mode on such a call is autograd's: None, before anything
/// that raises.
struct AttnCall {
  bool causal = false, return_lse = false;
  double softcap = 0, scale = 0;
  Tensor q, k, v;
  RunOptions opt;
};

bool attn_call(nb::handle qh, nb::handle kh, nb::handle vh, nb::handle scale_h, nb::handle causal_h,
               nb::handle softcap_h, nb::handle return_lse_h, int dims, AttnCall* c) {
  if (g_torch == nullptr) return false;
  // Flags must be True or False and numbers numbers: anything else (None, "False") is the general
  // path's to refuse with its sentence.
  if (causal_h.ptr() != Py_True && causal_h.ptr() != Py_False) return false;
  if (return_lse_h.ptr() != Py_True && return_lse_h.ptr() != Py_False) return false;
  c->causal = causal_h.ptr() == Py_True;
  c->return_lse = return_lse_h.ptr() == Py_True;
  // A nonzero softcap that float32 rounds to 0 would turn it off: the general path refuses it.
  if (!number(softcap_h, &c->softcap) || (c->softcap != 0.0 && static_cast<float>(c->softcap) == 0.0f)) return false;
  // A call autograd records is the eager formula's (flash_attn_func makes this call first, then that
  // one, inside which grad mode is off): refused from q's flag before the three tensors are read,
  // so a training step does not read them twice (k's and v's flags are checked after the reads).
  if (nb::object g = cleared(PyObject_GetAttr(qh.ptr(), g_torch->s_requires_grad)); g.ptr() == Py_True && grad_mode())
    return false;
  Tensor &q = c->q, &k = c->k, &v = c->v;
  if (!read(qh, &q) || !read(kh, &k) || !read(vh, &v)) return false;
  if (!q.same_place(k) || !q.same_place(v)) return false;
  if ((q.requires_grad || k.requires_grad || v.requires_grad) && grad_mode()) return false;
  if (q.ndim != dims || k.ndim != dims || v.ndim != dims) return false;
  const std::int64_t D = q.shape[dims - 1], Hq = q.shape[dims - 2], Hkv = k.shape[dims - 2];
  if (k.shape[dims - 1] != D || v.shape[dims - 2] != Hkv || Hq == 0 || Hkv == 0 || Hq % Hkv != 0 || D <= 0 ||
      v.shape[dims - 1] <= 0)  // a head dim of 0: the general path's sentence
    return false;
  if (scale_h.is_none()) {
    c->scale = 1.0 / std::sqrt(static_cast<double>(D));
  } else {
    if (!number(scale_h, &c->scale) || !std::isfinite(c->scale) || std::fabs(c->scale) > FLT_MAX) return false;
    // 0 would mean the default in C++, and so would a scale float32 rounds to 0: uniform weights
    if (static_cast<float>(c->scale) == 0.0f) c->scale = kZeroScale;
  }
  return place(q, false, &c->opt);
}

/// The params' head counts, dims, scale and masks from a read call (AttnParams or AttnBackwardParams,
/// whose fields of these names mean the same).
template <class Params>
void fill_attn(const AttnCall& c, int window_left, int window_right, Params* p) {
  const int dims = c.q.ndim;
  p->heads_q = static_cast<int>(c.q.shape[dims - 2]);
  p->heads_kv = static_cast<int>(c.k.shape[dims - 2]);
  p->head_dim = static_cast<int>(c.q.shape[dims - 1]);
  p->head_dim_v = static_cast<int>(c.v.shape[dims - 1]);
  p->softmax_scale = static_cast<float>(c.scale);
  p->mask.causal = c.causal;
  p->mask.window_left = window_left;
  p->mask.window_right = window_right;
  p->mask.softcap = static_cast<float>(c.softcap);
}

/// flash_attn_func's plain call (no ALiBi, block-sparse mask or rotary: the caller checks those; no
/// gradient recorded: attn_call): out, or (out, lse) with return_lse; None when the call is not one
/// this path takes. EagerAttention's forward calls it too, with return_lse, under grad mode off.
nb::object attention_fast(nb::handle qh, nb::handle kh, nb::handle vh, nb::handle scale_h, nb::handle causal_h,
                          int window_left, int window_right, nb::handle softcap_h, nb::handle return_lse_h) {
  AttnCall c;
  if (!attn_call(qh, kh, vh, scale_h, causal_h, softcap_h, return_lse_h, 4, &c)) return nb::none();
  const Tensor &q = c.q, &k = c.k, &v = c.v;
  const std::int64_t B = q.shape[0], Sq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const std::int64_t Sk = k.shape[1], Dv = v.shape[3];
  if (k.shape[0] != B || v.shape[0] != B || v.shape[1] != Sk || B == 0 || Sq == 0 || Sk == 0) return nb::none();
  TensorView vq, vk, vv;
  if (!view4(q, &vq) || !view4(k, &vk) || !view4(v, &vv)) return nb::none();

  nb::object out = Dv == D && q.contiguous() ? empty_like(q) : new_empty(q, nb::make_tuple(B, Sq, Hq, Dv));
  nb::object lse = c.return_lse ? new_empty(q, nb::make_tuple(B, Hq, Sq), g_torch->f32) : nb::none();
  AttnParams p;
  fill_attn(c, window_left, window_right, &p);
  p.batch = static_cast<int>(B);
  p.seqlen_q = static_cast<int>(Sq);
  p.seqlen_k = static_cast<int>(Sk);
  p.q = vq;
  p.k = vk;
  p.v = vv;
  p.o = contiguous_view4(data_ptr(out), q.dtype, B, Sq, Hq, Dv);
  p.lse = c.return_lse ? reinterpret_cast<float*>(data_ptr(lse)) : nullptr;
  call_released([&] { return flashcpp::attention_forward(p, c.opt); });
  if (!c.return_lse) return out;
  return nb::make_tuple(out, lse);
}

/// Reads a plain contiguous int32 tensor on `device` (-1: the host): its shape and pointer (t's
/// dtype field, which has no int32, is left as it is).
bool read_int32_tensor(nb::handle h, int device, Tensor* t) {
  PyObject* o = h.ptr();
  if (!plain_tensor(o)) return false;
  nb::object dt = cleared(PyObject_GetAttr(o, g_torch->s_dtype));
  int dev = 0;
  if (!dt.is_valid() || dt.ptr() != g_torch->i32 || !read_device(o, &dev) || dev != device || !read_layout(o, t) ||
      !t->contiguous())
    return false;
  nb::object neg = cleared(PyObject_CallMethodNoArgs(o, g_torch->s_is_neg));  // memory holding -x: not its values
  return neg.is_valid() && neg.ptr() == Py_False;
}

/// Reads a plain contiguous int32 tensor of `ndim` dims on `device` (-1: the host): its shape and
/// pointer.
bool read_int32(nb::handle h, int device, int ndim, std::int64_t* shape, std::uintptr_t* data) {
  Tensor t;
  if (!read_int32_tensor(h, device, &t) || t.ndim != ndim) return false;
  for (int i = 0; i < ndim; ++i) shape[i] = t.shape[i];
  *data = t.data;
  return true;
}

/// Whether host int32 prefix sums `cu` (n entries) start at 0, never decrease, end within `rows`
/// packed rows, and step by at most `max_len`.
bool host_prefix_sums_fit(std::uintptr_t data, std::int64_t n, std::int64_t rows, int max_len) {
  const auto* cu = reinterpret_cast<const std::int32_t*>(data);
  if (cu[0] != 0 || cu[n - 1] > rows) return false;
  for (std::int64_t i = 1; i < n; ++i) {
    const std::int64_t len = static_cast<std::int64_t>(cu[i]) - cu[i - 1];
    if (len < 0 || len > max_len) return false;
  }
  return true;
}

/// An int in [1, 2^31 - 1] (not a bool), or false.
bool positive_int32(nb::handle h, int* out) {
  long long x = 0;
  if (!int_in(h, 1, 0x7fffffffLL, &x)) return false;
  *out = static_cast<int>(x);
  return true;
}

/// The varlen arguments both varlen entries take: the packed q, k, v of `c` (non-empty, k's and v's
/// rows equal, row counts within int32), the two maxima (ints in [1, 2^31 - 1]) and int32
/// cu_seqlens_q/k (batch + 1 >= 2 entries each) on q's device. Host arrays' values that the general
/// path refuses with its sentences (a first entry other than 0, a decrease, a sequence longer than
/// its maximum, more rows than the packed tensor holds: the C++ views do not know the packed length
/// of k) are left to it, as anything else false says; device arrays are not read (a sync).
struct VarlenArgs {
  int batch = 0, max_q = 0, max_k = 0;
  std::uintptr_t cu_q = 0, cu_k = 0;
};
bool varlen_args(const AttnCall& c, nb::handle cu_q_h, nb::handle cu_k_h, nb::handle max_q_h, nb::handle max_k_h,
                 VarlenArgs* a) {
  const Tensor &q = c.q, &k = c.k, &v = c.v;
  const std::int64_t Tq = q.shape[0], Tk = k.shape[0];
  if (v.shape[0] != Tk || Tq == 0 || Tk == 0 || !fits_int32(Tq) || !fits_int32(Tk)) return false;
  if (!positive_int32(max_q_h, &a->max_q) || !positive_int32(max_k_h, &a->max_k)) return false;
  std::int64_t nq = 0, nk = 0;
  if (!read_int32(cu_q_h, q.device, 1, &nq, &a->cu_q) || !read_int32(cu_k_h, q.device, 1, &nk, &a->cu_k) ||
      nq != nk || nq < 2 || !fits_int32(nq - 1))
    return false;
  if (q.device < 0 &&
      !(host_prefix_sums_fit(a->cu_q, nq, Tq, a->max_q) && host_prefix_sums_fit(a->cu_k, nk, Tk, a->max_k)))
    return false;
  a->batch = static_cast<int>(nq - 1);
  return true;
}

/// flash_attn_varlen_func's plain call (the same exclusions as attention_fast): packed q (total_q,
/// heads_q, dim), k and v (total_k, heads_kv, dim[_v]), int32 cu_seqlens_q/k (batch + 1) on q's
/// device, and the two maxima. Host arrays' values are checked by the C++ validator; device ones
/// are not read (a sync), as on the general path. Out (total_q, heads_q, dim_v), or (out, lse) with
/// lse (heads_q, total_q); None when the call is not one this path takes (batch 0, an empty packed
/// tensor, a zero maximum: the general path fills those).
nb::object varlen_fast(nb::handle qh, nb::handle kh, nb::handle vh, nb::handle cu_q_h, nb::handle cu_k_h,
                       nb::handle max_q_h, nb::handle max_k_h, nb::handle scale_h, nb::handle causal_h,
                       int window_left, int window_right, nb::handle softcap_h, nb::handle return_lse_h) {
  AttnCall c;
  if (!attn_call(qh, kh, vh, scale_h, causal_h, softcap_h, return_lse_h, 3, &c)) return nb::none();
  VarlenArgs a;
  if (!varlen_args(c, cu_q_h, cu_k_h, max_q_h, max_k_h, &a)) return nb::none();
  const Tensor &q = c.q, &k = c.k, &v = c.v;
  const std::int64_t Tq = q.shape[0], Hq = q.shape[1], D = q.shape[2], Dv = v.shape[2];
  TensorView vq, vk, vv;
  if (!view_of(q, true, &vq) || !view_of(k, true, &vk) || !view_of(v, true, &vv)) return nb::none();

  nb::object out = Dv == D && q.contiguous() ? empty_like(q) : new_empty(q, nb::make_tuple(Tq, Hq, Dv));
  nb::object lse = c.return_lse ? new_empty(q, nb::make_tuple(Hq, Tq), g_torch->f32) : nb::none();
  AttnParams p;
  fill_attn(c, window_left, window_right, &p);
  p.batch = a.batch;
  p.seqlen_q = a.max_q;
  p.seqlen_k = a.max_k;
  p.q = vq;
  p.k = vk;
  p.v = vv;
  p.o = TensorView{reinterpret_cast<void*>(data_ptr(out)), q.dtype, 0, Hq * Dv, Dv};
  p.lse = c.return_lse ? reinterpret_cast<float*>(data_ptr(lse)) : nullptr;
  p.mask.cu_seqlens_q = reinterpret_cast<const std::int32_t*>(a.cu_q);
  p.mask.cu_seqlens_k = reinterpret_cast<const std::int32_t*>(a.cu_k);
  p.mask.total_q = Tq;
  call_released([&] { return flashcpp::attention_forward(p, c.opt); });
  if (!c.return_lse) return out;
  return nb::make_tuple(out, lse);
}

// ---- the backward ----------------------------------------------------------------------------------
// flash_attn_bwd_eager and flash_attn_varlen_bwd_eager (the eager autograd formulas' backward) on
// the fast path: what their general path does (_grad_views, torch.empty_like x3,
// _attn._execute_backward -> _core.launch_backward) cost about 300 us of Python per backward on the
// CPU machine, ten times the kernels of a short sequence there. The same params and RunOptions are
// filled here; the C++ validator checks them as it checks every call.

/// Reads dout or dlse, the gradient of `like` (out or the LSE): a plain tensor of like's shape, dtype
/// and device, else false (the general path's sentence, or its run). Its contiguous() copy (what
/// _grad_views passes on: autograd hands out expanded, stride-0 gradients, e.g. of a sum) is made
/// by contiguous_grad, after the grad check.
bool read_grad(nb::handle h, const Tensor& like, Tensor* g) {
  if (!read(h, g) || !g->same_place(like) || g->ndim != like.ndim) return false;
  for (int i = 0; i < like.ndim; ++i)
    if (g->shape[i] != like.shape[i]) return false;
  return true;
}

/// g as _grad_views passes it on: itself when contiguous (torch's contiguous() returns the tensor
/// then), else its contiguous() copy, which `keep` holds and g then describes; raises what
/// contiguous() raises.
void contiguous_grad(Tensor* g, nb::object* keep) {
  if (g->contiguous()) return;
  *keep = nb::steal(PyObject_CallMethodNoArgs(g->obj, g_torch->s_contiguous));
  if (!keep->is_valid()) throw nb::python_error();
  if (!read_layout(keep->ptr(), g) || !g->contiguous())
    throw nb::type_error("contiguous() returned a tensor that is not contiguous");
  g->obj = keep->ptr();
}

/// torch.empty_like(like) (dq, dk, dv as the general path allocates them) and the view of it, with
/// `packed` as view_of. empty_like keeps a dense input's strides: a row-major `like` gives a
/// row-major tensor, whose strides are known here; any other is read back from the new tensor.
nb::object empty_like_view(const Tensor& like, bool packed, TensorView* v) {
  nb::object r = empty_like(like);
  Tensor t;
  if (row_major(like)) {
    t = contiguous_tensor(data_ptr(r), like.dtype, like.ndim, like.shape);
  } else if (!read_layout(r.ptr(), &t)) {
    throw nb::type_error("torch.empty_like returned a tensor whose layout cannot be read");
  }
  t.dtype = like.dtype;
  if (!view_of(t, packed, v)) throw nb::type_error("torch.empty_like returned a tensor with a strided last dim");
  return r;
}

/// Whether t has exactly this shape (ndim dims).
bool shape_is(const Tensor& t, int ndim, std::initializer_list<std::int64_t> shape) {
  if (t.ndim != ndim) return false;
  int i = 0;
  for (std::int64_t n : shape)
    if (t.shape[i++] != n) return false;
  return true;
}

/// The window as _core.check_window returns it: two ints in [-1, 2^31 - 1] (the formulas pass the
/// forward's checked pair); anything else is the general path's to refuse with check_window's
/// sentence (the C++ validator words its own).
bool window_ints(nb::handle left_h, nb::handle right_h, int* left, int* right) {
  long long l = 0, r = 0;
  if (!int_in(left_h, -1, 0x7fffffffLL, &l) || !int_in(right_h, -1, 0x7fffffffLL, &r)) return false;
  *left = static_cast<int>(l);
  *right = static_cast<int>(r);
  return true;
}

/// The part the two backward entries share, after the entry has read q, k and v (`c`, with
/// `packed` for varlen) and filled the problem's sizes (and varlen's mask fields) into p: reads
/// out (shape_o), the LSE (shape_lse, fp32, contiguous, on q's device), dout (out's shape and dtype)
/// and dlse (None, or the LSE's shape), then does what flash_attn_bwd_eager does: dout and dlse
/// contiguous (_grad_views), dq, dk and dv from torch.empty_like, and _core.launch_backward's call:
/// AttnBackwardParams from the views, RunOptions of the device (backend cpu or cuda, torch's
/// current stream, cpu_threads 0, cuda_config from FLASHCPP_BWD_CONFIG), the workspace the call
/// asks for as a tensor on q's device, 256-byte aligned. (dq, dk, dv), or None.
///
/// An empty LSE (a forward run without it) is the general path's sentence; so are a dout or dlse
/// of another shape or dtype. A non-contiguous LSE, which the general path would read as if it were
/// contiguous, is its to run too.
nb::object backward_run(const AttnCall& c, bool packed, std::initializer_list<std::int64_t> shape_o,
                        std::initializer_list<std::int64_t> shape_lse, nb::handle dout_h, nb::handle out_h,
                        nb::handle lse_h, nb::handle dlse_h, nb::handle deterministic_h,
                        flashcpp::AttnBackwardParams* p) {
  if (deterministic_h.ptr() != Py_True && deterministic_h.ptr() != Py_False) return nb::none();
  const Tensor& q = c.q;
  const int nd = packed ? 3 : 4;
  Tensor out, lse, dout, dlse;
  if (!read(out_h, &out) || !q.same_place(out) || !shape_is(out, nd, shape_o)) return nb::none();
  if (!read(lse_h, &lse) || lse.dtype != DType::kF32 || lse.device != q.device ||
      !shape_is(lse, nd - 1, shape_lse) || !lse.contiguous())
    return nb::none();
  const bool has_dlse = !dlse_h.is_none();
  if (!read_grad(dout_h, out, &dout) || (has_dlse && !read_grad(dlse_h, lse, &dlse))) return nb::none();
  // Grad mode is off in the autograd formulas' backward (create_graph included); with it on and a
  // gradient that requires grad the call is autograd's, as every entry's (q, k and v: attn_call).
  if ((dout.requires_grad || (has_dlse && dlse.requires_grad)) && grad_mode()) return nb::none();
  TensorView vq, vk, vv, vo, vdout, vdq, vdk, vdv;
  if (!view_of(q, packed, &vq) || !view_of(c.k, packed, &vk) || !view_of(c.v, packed, &vv) ||
      !view_of(out, packed, &vo))
    return nb::none();
  nb::object dout_keep, dlse_keep;
  contiguous_grad(&dout, &dout_keep);
  if (has_dlse) contiguous_grad(&dlse, &dlse_keep);
  if (!view_of(dout, packed, &vdout)) return nb::none();
  nb::object dq = empty_like_view(q, packed, &vdq);
  nb::object dk = empty_like_view(c.k, packed, &vdk);
  nb::object dv = empty_like_view(c.v, packed, &vdv);

  p->q = vq;
  p->k = vk;
  p->v = vv;
  p->o = vo;
  p->dout = vdout;
  p->dq = vdq;
  p->dk = vdk;
  p->dv = vdv;
  p->lse = reinterpret_cast<const float*>(lse.data);
  p->dlse = has_dlse ? reinterpret_cast<const float*>(dlse.data) : nullptr;
  p->deterministic = deterministic_h.ptr() == Py_True;
  RunOptions opt = c.opt;  // the device's backend and torch's current stream; cpu_threads 0
  // What launch_backward reads per call (os.environ writes reach the C environment through putenv).
  const char* config = std::getenv("FLASHCPP_BWD_CONFIG");
  opt.cuda_config = config == nullptr ? "" : config;
  std::size_t bytes = 0;
  call_released([&] { return flashcpp::attention_backward_workspace_size(*p, opt, &bytes); });
  nb::object workspace;  // held until the call returns (CUDA: the caching allocator orders its reuse on the stream)
  if (bytes != 0) {
    // int32 words rather than launch_backward's uint8 bytes: the same memory from the same allocator
    // (the contents do not matter, backward.h), through the dtype handed over at bind.
    const std::size_t words = (bytes + 255 + 3) / 4;
    workspace = new_empty(q, nb::make_tuple(words), g_torch->i32);
    p->workspace = reinterpret_cast<void*>((data_ptr(workspace) + 255) / 256 * 256);
    p->workspace_bytes = bytes;
  }
  call_released([&] { return flashcpp::attention_backward(*p, opt); });
  return nb::make_tuple(dq, dk, dv);
}

/// What both backward entries read first: the window as two ints and q, k, v of `rank` dims with the
/// forward's scale, flags and softcap (attn_call, the LSE asked for); false when the call is not one
/// they take.
bool backward_call(nb::handle qh, nb::handle kh, nb::handle vh, nb::handle scale_h, nb::handle causal_h,
                   nb::handle window_left_h, nb::handle window_right_h, nb::handle softcap_h, int rank, AttnCall* c,
                   int* window_left, int* window_right) {
  return window_ints(window_left_h, window_right_h, window_left, window_right) &&
         attn_call(qh, kh, vh, scale_h, causal_h, softcap_h, nb::handle(Py_True), rank, c);
}

/// flash_attn_bwd_eager's plain call (no ALiBi or block-sparse mask: the caller checks those):
/// dout, q, k, v, out, lse, dlse (None or a tensor) and the forward's scale (the checked one it
/// ran with), flags and window, as the eager formula saved them. (dq, dk, dv), or None when the
/// call is not one this path takes (empty problems among them: the general path fills their zeros).
nb::object backward_fast(nb::handle dout_h, nb::handle qh, nb::handle kh, nb::handle vh, nb::handle out_h,
                         nb::handle lse_h, nb::handle dlse_h, nb::handle scale_h, nb::handle causal_h,
                         nb::handle window_left_h, nb::handle window_right_h, nb::handle softcap_h,
                         nb::handle deterministic_h) {
  AttnCall c;
  int window_left = 0, window_right = 0;
  if (!backward_call(qh, kh, vh, scale_h, causal_h, window_left_h, window_right_h, softcap_h, 4, &c, &window_left,
                     &window_right))
    return nb::none();
  const Tensor &q = c.q, &k = c.k, &v = c.v;
  const std::int64_t B = q.shape[0], Sq = q.shape[1], Hq = q.shape[2], Sk = k.shape[1], Dv = v.shape[3];
  if (k.shape[0] != B || v.shape[0] != B || v.shape[1] != Sk || B == 0 || Sq == 0 || Sk == 0) return nb::none();
  for (std::int64_t n : {B, Sq, Sk, Hq, k.shape[2], q.shape[3], Dv})
    if (!fits_int32(n)) return nb::none();
  flashcpp::AttnBackwardParams p;
  fill_attn(c, window_left, window_right, &p);
  p.batch = static_cast<int>(B);
  p.seqlen_q = static_cast<int>(Sq);
  p.seqlen_k = static_cast<int>(Sk);
  return backward_run(c, false, {B, Sq, Hq, Dv}, {B, Hq, Sq}, dout_h, out_h, lse_h, dlse_h, deterministic_h, &p);
}

/// flash_attn_varlen_bwd_eager's plain call (no ALiBi): backward_fast's arguments with packed
/// q, k, v, out and dout, the (heads_q, total_q) LSE, and cu_seqlens and the maxima read as
/// varlen_fast reads them. (dq, dk, dv), or None (batch 0, an empty packed tensor or a zero maximum
/// among what it leaves to the general path).
nb::object varlen_backward_fast(nb::handle dout_h, nb::handle qh, nb::handle kh, nb::handle vh, nb::handle out_h,
                                nb::handle lse_h, nb::handle dlse_h, nb::handle cu_q_h, nb::handle cu_k_h,
                                nb::handle max_q_h, nb::handle max_k_h, nb::handle scale_h, nb::handle causal_h,
                                nb::handle window_left_h, nb::handle window_right_h, nb::handle softcap_h,
                                nb::handle deterministic_h) {
  AttnCall c;
  int window_left = 0, window_right = 0;
  if (!backward_call(qh, kh, vh, scale_h, causal_h, window_left_h, window_right_h, softcap_h, 3, &c, &window_left,
                     &window_right))
    return nb::none();
  VarlenArgs a;
  if (!varlen_args(c, cu_q_h, cu_k_h, max_q_h, max_k_h, &a)) return nb::none();
  const Tensor &q = c.q, &k = c.k, &v = c.v;
  const std::int64_t Tq = q.shape[0], Hq = q.shape[1], Tk = k.shape[0], Dv = v.shape[2];
  for (std::int64_t n : {Hq, k.shape[1], q.shape[2], Dv})
    if (!fits_int32(n)) return nb::none();
  flashcpp::AttnBackwardParams p;
  fill_attn(c, window_left, window_right, &p);
  p.batch = a.batch;
  p.seqlen_q = a.max_q;
  p.seqlen_k = a.max_k;
  p.mask.cu_seqlens_q = reinterpret_cast<const std::int32_t*>(a.cu_q);
  p.mask.cu_seqlens_k = reinterpret_cast<const std::int32_t*>(a.cu_k);
  p.mask.total_q = Tq;  // the packed rows (_fill_mask's total_q)
  p.total_k = Tk;       // rows past cu_seqlens_k[-1] get dk = dv = 0, as launch_backward asks
  return backward_run(c, true, {Tq, Hq, Dv}, {Hq, Tq}, dout_h, out_h, lse_h, dlse_h, deterministic_h, &p);
}

/// The checks of the fused ops' fast path on x and the other inputs (`same`: same dtype and
/// device as x, contiguous) and the run options; false when the call is not one it takes.
bool fused_inputs(nb::handle xh, nb::handle threads_h, Tensor* x, RunOptions* opt) {
  int threads = 0;
  if (g_torch == nullptr || !cpu_threads_of(threads_h, &threads) || !read(xh, x) || x->numel() == 0 ||
      !x->contiguous())
    return false;
  opt->cpu_threads = threads;
  return place(*x, /*fp32_on_cuda=*/true, opt);  // the fused CUDA kernels take fp32
}

bool fused_same(const Tensor& x, nb::handle h, Tensor* t) {
  return read(h, t) && x.same_place(*t) && t->contiguous();
}

/// An eps in (2^-150, float32 max] as an exact float (the default 1e-6 among them) needs no check
/// (fused._EPS_LO, _EPS_HI); any other value goes through _core.check_eps, which raises its
/// sentence or takes it (0, an int, a numpy number, a value just past float32's max): the binding
/// rounds eps to float32 unchecked.
void check_eps(nb::handle eps) {
  PyObject* e = eps.ptr();
  if (PyFloat_CheckExact(e) && PyFloat_AS_DOUBLE(e) > 0x1p-150 && PyFloat_AS_DOUBLE(e) <= FLT_MAX) return;
  py_check(g_torch->check_eps, eps);
}

/// Raises the general path's sentence (_core.check_inference_write) for an inference tensor t that
/// is written in place outside inference mode; false when is_inference() could not be read.
bool inference_checked(const Tensor& t, const char* name) {
  nb::object inference = cleared(PyObject_CallMethodNoArgs(t.obj, g_torch->s_is_inference));
  if (!inference.is_valid()) return false;
  if (inference.ptr() == Py_True) nb::handle(g_torch->check_inference_write)(nb::handle(t.obj), name);
  return true;
}

/// rms_norm(x, weight, eps) with a new output (residual None), or fused_add_rms_norm(x, residual,
/// weight, eps) in place (x receives the normalized rows, residual x + residual, their version
/// counters moved under grad mode): the output / True, or None. None too where autograd records
/// (grad mode on and an input requires grad), before eps is checked: the caller's general path
/// checks in its order.
nb::object norm_fast(nb::handle xh, nb::handle residual_h, nb::handle weight_h, nb::handle eps_h,
                     nb::handle threads_h) {
  Tensor x, w, r;
  RunOptions opt;
  double eps = 0;
  const bool fused = !residual_h.is_none();
  if (!fused_inputs(xh, threads_h, &x, &opt) || !fused_same(x, weight_h, &w) ||
      (fused && !fused_same(x, residual_h, &r)))
    return nb::none();
  // What the Python guard checked before this call, in its order: autograd (the general path
  // refuses the in-place call or runs rms_norm without a backward), then eps, then (in place) the
  // inference tensors written.
  if (grad_recorded(x) || grad_recorded(w) || (fused && grad_recorded(r))) return nb::none();
  if (fused && (x.requires_grad || r.requires_grad)) return nb::none();
  check_eps(eps_h);
  if (!number(eps_h, &eps)) return nb::none();
  if (fused && (!inference_checked(x, "x") || !inference_checked(r, "residual"))) return nb::none();
  const std::int64_t hidden = x.shape[x.ndim - 1];
  if (w.ndim != 1 || w.shape[0] != hidden) return nb::none();
  if (fused) {
    if (r.ndim != x.ndim) return nb::none();
    for (int i = 0; i < x.ndim; ++i)
      if (r.shape[i] != x.shape[i]) return nb::none();
  }
  flashcpp::RmsNormParams p;
  p.rows = x.numel() / hidden;
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  p.weight = reinterpret_cast<const void*>(w.data);
  const MatrixView xv{reinterpret_cast<void*>(x.data), x.dtype, hidden};
  if (fused) {
    const MatrixView rv{reinterpret_cast<void*>(r.data), x.dtype, hidden};
    p.x = p.y = xv;
    p.residual = p.residual_out = rv;
    call_released([&] { return flashcpp::fused_add_rms_norm(p, opt); });
    bump_versions({x.obj, r.obj});
    return nb::bool_(true);
  }
  nb::object out = empty_like(x);  // x is contiguous (fused_inputs)
  p.x = xv;
  p.y = MatrixView{reinterpret_cast<void*>(data_ptr(out)), x.dtype, hidden};
  call_released([&] { return flashcpp::rms_norm(p, opt); });
  return out;
}

/// silu_and_mul(x) on the fused projection [gate | up]: the new (..., d) output, or None (also
/// where autograd records: the caller runs it without a backward).
nb::object silu_and_mul_fast(nb::handle xh, nb::handle threads_h) {
  Tensor x;
  RunOptions opt;
  if (!fused_inputs(xh, threads_h, &x, &opt) || grad_recorded(x)) return nb::none();  // grad: no_backward's
  const std::int64_t cols = x.shape[x.ndim - 1];
  if (cols % 2 != 0) return nb::none();
  const std::int64_t d = cols / 2;
  nb::list shape;
  for (int i = 0; i + 1 < x.ndim; ++i) shape.append(x.shape[i]);
  shape.append(d);
  nb::object out = new_empty(x, nb::tuple(shape));
  flashcpp::SiluMulParams p;
  p.rows = x.numel() / cols;
  p.d = d;
  const auto elem = static_cast<std::int64_t>(flashcpp::dtype_size(x.dtype));
  p.gate = MatrixView{reinterpret_cast<void*>(x.data), x.dtype, cols};
  p.up = MatrixView{reinterpret_cast<void*>(x.data + static_cast<std::uintptr_t>(d * elem)), x.dtype, cols};
  p.out = MatrixView{reinterpret_cast<void*>(data_ptr(out)), x.dtype, d};
  call_released([&] { return flashcpp::silu_and_mul(p, opt); });
  return out;
}

/// A fresh contiguous tensor of t's shape, dtype and device, as the general path allocates one:
/// empty_like keeps a contiguous t's strides (row-major up to the strides of size-1 dims, which no
/// view reads); any other t gets row-major ones through new_empty.
nb::object empty_contiguous(const Tensor& t) {
  if (t.contiguous()) return empty_like(t);
  nb::list shape;
  for (int i = 0; i < t.ndim; ++i) shape.append(t.shape[i]);
  return new_empty(t, nb::tuple(shape));
}

/// A value of a dict (borrowed), null when the key is absent; false when the lookup raised.
bool dict_item(PyObject* dict, PyObject* key, PyObject** out) {
  *out = PyDict_GetItemWithError(dict, key);
  if (*out == nullptr && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

/// A llama3 rope_scaling dict read as fused._llama3 reads it (factor; low_freq_factor 1 and
/// high_freq_factor 4 by default; original_max_position_embeddings, else original_max_position,
/// else 8192), each number rounded to float as the Llama3Scaling binding rounds it. False for
/// anything else: not exactly a dict, no factor, a value that is not a plain float or int (the
/// general path converts a numpy number or a numeric string, and refuses the rest with its
/// sentence), an original_max_position outside [0, 2^31 - 1].
bool llama3_of(nb::handle h, flashcpp::Llama3Scaling* out) {
  const Torch& T = *g_torch;
  PyObject* d = h.ptr();
  if (!PyDict_CheckExact(d)) return false;
  PyObject *factor = nullptr, *low = nullptr, *high = nullptr, *orig = nullptr;
  if (!dict_item(d, T.k_factor, &factor) || !dict_item(d, T.k_low_freq_factor, &low) ||
      !dict_item(d, T.k_high_freq_factor, &high) || !dict_item(d, T.k_original_max_position_embeddings, &orig) ||
      (orig == nullptr && !dict_item(d, T.k_original_max_position, &orig)))
    return false;
  double f = 0, lo = 1.0, hi = 4.0;
  if (factor == nullptr || !number(factor, &f) || (low != nullptr && !number(low, &lo)) ||
      (high != nullptr && !number(high, &hi)))
    return false;
  long long max_position = 8192;
  if (orig != nullptr && orig != Py_None && !int_in(orig, 0, 0x7fffffffLL, &max_position)) return false;
  *out = flashcpp::Llama3Scaling{static_cast<float>(f), static_cast<float>(lo), static_cast<float>(hi),
                                 static_cast<int>(max_position)};
  return true;
}

/// Whether apply_rotary may write t in place here: false when t requires grad (the general path's
/// to take); raises the general path's sentence for an inference tensor outside inference mode.
bool writable_in_place(const Tensor& t, const char* name) { return !t.requires_grad && inference_checked(t, name); }

/// apply_rotary(q, k, positions, style=, rotary_dim=, theta=, llama3=, cos_sin_cache=, inplace=,
/// cpu_threads=) with no outputs passed, backend "auto", no cuda_config or stream: q (and k) of one
/// dtype and device (the host or the current CUDA device, on torch's current stream), 3-D (tokens,
/// heads, head_dim) or 4-D (batch, seqlen, heads, head_dim) with a contiguous head_dim and any other
/// strides (views of one packed qkv buffer too), nothing empty; positions None or a contiguous int32
/// tensor of shape (tokens,) or (batch, seqlen) on q's device; cos_sin_cache None or a contiguous
/// float32 (max_position, rotary_dim) tensor there; style "neox" or "interleaved", rotary_dim None or
/// an int in [0, head_dim], theta a float or int, llama3 None or a dict (llama3_of); inplace True
/// (nothing written may require grad; their version counters move under grad mode) or False (new
/// contiguous outputs); nothing that autograd records (grad mode on and q or k requiring grad: the
/// caller's general path). (q_out, k_out or None), or None.
nb::object rotary_fast(nb::handle qh, nb::handle kh, nb::handle positions_h, nb::handle style_h,
                       nb::handle rotary_dim_h, nb::handle theta_h, nb::handle llama3_h, nb::handle cache_h,
                       nb::handle inplace_h, nb::handle threads_h) {
  if (g_torch == nullptr) return nb::none();
  flashcpp::RopeParams p;
  flashcpp::RotarySpec& r = p.rotary;
  PyObject* style = style_h.ptr();
  if (!PyUnicode_CheckExact(style)) return nb::none();
  if (PyUnicode_CompareWithASCIIString(style, "neox") == 0) r.style = flashcpp::RopeStyle::kNeox;
  else if (PyUnicode_CompareWithASCIIString(style, "interleaved") == 0) r.style = flashcpp::RopeStyle::kInterleaved;
  else return nb::none();
  if (inplace_h.ptr() != Py_True && inplace_h.ptr() != Py_False) return nb::none();
  const bool inplace = inplace_h.ptr() == Py_True, has_k = !kh.is_none();
  Tensor q, k;
  if (!read(qh, &q) || q.numel() == 0 || (q.ndim != 3 && q.ndim != 4)) return nb::none();
  const int nd = q.ndim;
  const bool packed = nd == 3;  // (tokens, heads, head_dim): batch 1
  const std::int64_t batch = packed ? 1 : q.shape[0], seqlen = q.shape[nd - 3], head_dim = q.shape[nd - 1];
  if (has_k) {
    if (!read(kh, &k) || !q.same_place(k) || k.ndim != nd || k.shape[nd - 1] != head_dim || k.shape[nd - 2] == 0)
      return nb::none();
    for (int i = 0; i < nd - 2; ++i)
      if (k.shape[i] != q.shape[i]) return nb::none();
  }
  // Where autograd records, the caller's general path refuses the call or runs it without a
  // backward: checked before anything that raises (the in-place checks below).
  if (grad_recorded(q) || (has_k && grad_recorded(k))) return nb::none();
  long long rot = head_dim;
  if (!rotary_dim_h.is_none() && !int_in(rotary_dim_h, 0, head_dim, &rot)) return nb::none();
  // The general path checks what it writes in place after the checks above and before the rest.
  if (inplace && (!writable_in_place(q, "q") || (has_k && !writable_in_place(k, "k")))) return nb::none();
  int threads = 0;
  RunOptions opt;
  if (!number(theta_h, &r.theta) || (!llama3_h.is_none() && !llama3_of(llama3_h, &r.llama3)) ||
      !cpu_threads_of(threads_h, &threads))
    return nb::none();
  opt.cpu_threads = threads;
  if (!place(q, /*fp32_on_cuda=*/true, &opt)) return nb::none();  // the CUDA kernel's answer on fp32 is its own
  if (!fits_int32(batch) || !fits_int32(seqlen) || !fits_int32(q.shape[nd - 2]) || !fits_int32(head_dim) ||
      (has_k && !fits_int32(k.shape[nd - 2])))
    return nb::none();
  if (!view_of(q, packed, &p.q) || (has_k && !view_of(k, packed, &p.k))) return nb::none();
  if (!positions_h.is_none()) {
    Tensor pos;
    if (!read_int32_tensor(positions_h, q.device, &pos)) return nb::none();
    const bool tokens = pos.ndim == 1 && pos.shape[0] == batch * seqlen;
    if (!tokens && !(pos.ndim == 2 && pos.shape[0] == batch && pos.shape[1] == seqlen)) return nb::none();
    p.positions = reinterpret_cast<const std::int32_t*>(pos.data);
  }
  if (!cache_h.is_none()) {
    Tensor c;
    if (!read(cache_h, &c) || c.dtype != DType::kF32 || c.device != q.device || c.ndim != 2 || rot == 0 ||
        c.shape[1] != rot || c.shape[0] == 0 || !fits_int32(c.shape[0]) || !c.contiguous())
      return nb::none();
    r.set_cos_sin_cache(reinterpret_cast<const float*>(c.data), static_cast<int>(c.shape[0]), static_cast<int>(rot));
  }
  r.rotary_dim = static_cast<int>(rot);

  nb::object q_out = nb::borrow(qh), k_out = nb::borrow(kh);
  if (!inplace) {
    q_out = empty_contiguous(q);
    view_of(contiguous_tensor(data_ptr(q_out), q.dtype, nd, q.shape), packed, &p.q_out);
    if (has_k) {
      k_out = empty_contiguous(k);
      view_of(contiguous_tensor(data_ptr(k_out), k.dtype, nd, k.shape), packed, &p.k_out);
    }
  }
  p.batch = static_cast<int>(batch);
  p.seqlen = static_cast<int>(seqlen);
  p.heads_q = static_cast<int>(q.shape[nd - 2]);
  p.heads_k = has_k ? static_cast<int>(k.shape[nd - 2]) : 0;
  p.head_dim = static_cast<int>(head_dim);
  call_released([&] { return flashcpp::apply_rotary(p, opt); });
  if (inplace) {
    if (has_k) bump_versions({q.obj, k.obj});
    else bump_versions({q.obj});
  }
  return nb::make_tuple(q_out, k_out);
}

/// _core.fast_view in C++: the TensorView of a plain 4-D tensor with a contiguous last dim (a size-1
/// dim gets the extent as its stride), with dtype `code` (the caller checked the tensor's dtype), or
/// None. Reads only the shape, strides and pointer.
nb::object fast_view(nb::handle h, int code) {
  if (g_torch == nullptr || !plain_tensor(h.ptr())) return nb::none();
  Tensor t;
  switch (code) {
    case static_cast<int>(DType::kF16): t.dtype = DType::kF16; break;
    case static_cast<int>(DType::kBF16): t.dtype = DType::kBF16; break;
    case static_cast<int>(DType::kF32): t.dtype = DType::kF32; break;
    default: return nb::none();
  }
  TensorView v;
  if (!read_layout(h.ptr(), &t) || !view4(t, &v)) return nb::none();
  return nb::cast(v);
}

/// A number or bool entry of the plan's _cfg dict, as a double.
bool cfg_number(PyObject* cfg, const char* key, double* out) {
  PyObject* v = PyDict_GetItemString(cfg, key);  // borrowed
  if (v == nullptr) return false;
  if (PyBool_Check(v)) {
    *out = v == Py_True ? 1.0 : 0.0;
    return true;
  }
  return number(v, out);
}

/// window_size as _core.check_window reads it: the default (-1, -1) of exact ints here, anything
/// else through check_window itself (its sentence, or the pair).
std::pair<int, int> window_of(nb::handle h) {
  PyObject* o = h.ptr();
  long long l = 0, r = 0;
  if (PyTuple_CheckExact(o) && PyTuple_GET_SIZE(o) == 2 && int_in(PyTuple_GET_ITEM(o, 0), -1, -1, &l) &&
      int_in(PyTuple_GET_ITEM(o, 1), -1, -1, &r))
    return {-1, -1};
  return nb::cast<std::pair<int, int>>(py_check(g_torch->check_window, h));
}

/// flash_attn_with_kvcache's plain step (no rotary, ALiBi, fp8 scales, cache_batch_idx or
/// cache_leftpad; causal and return_lse bools, softcap a float or int, num_splits an int in range:
/// the caller checks those): reads q, the caches, the new k/v, cache_seqlens and block_table; then
/// what the Python guard checked before, in its order: autograd (None where it records: the
/// caller's general path refuses the append or runs the step without a backward), window_size
/// (_core.check_window's sentence), and for an append the caches' inference check and
/// _core.check_caches_apart. Then the plan: on the host `plan_for(batch, seqlen_q, heads_q,
/// heads_kv, head_dim, head_dim_v, slots, page_size, append, device, dtype_code, window, None)`
/// makes one for this call's lengths; on CUDA the plan of the shape is looked up here in
/// `plan_cache` (_decode._PLAN_CACHE, least recently used last) under a key of plain values, and
/// plan_for gets that key on a miss (it makes the plan, or returns None under a CUDA graph capture:
/// the general path runs). Fills DecodeParams and runs the step; an append moves the caches'
/// version counters under grad mode. (out, lse or None), or None.
///
/// Why the lookup is here: the Python callback that built the key and looked it up cost more than
/// the rest of the step's Python on the CPU machine (the call with 11 ints, the key tuple, the
/// closures, the lookup and move_to_end).
nb::object kvcache_fast(nb::handle qh, nb::handle kch, nb::handle vch, nb::handle kh, nb::handle vh, nb::handle lens_h,
                        nb::handle table_h, nb::handle plan_for, bool return_lse, nb::handle plan_cache,
                        nb::handle causal_h, nb::handle window_h, nb::handle softcap_h, nb::handle scale_h,
                        nb::handle splits_h) {
  if (g_torch == nullptr || !PyDict_Check(plan_cache.ptr())) return nb::none();
  Tensor q, kc, vc, k, v;
  if (!read(qh, &q) || !read(kch, &kc) || !read(vch, &vc)) return nb::none();
  if (q.ndim != 4 || kc.ndim != 4 || vc.ndim != 4 || !q.same_place(kc) || !q.same_place(vc)) return nb::none();
  const bool append = !kh.is_none() || !vh.is_none();
  if (append) {
    if (kh.is_none() || vh.is_none() || !read(kh, &k) || !read(vh, &v) || !q.same_place(k) || !q.same_place(v))
      return nb::none();
  }
  if (grad_recorded(q) || grad_recorded(kc) || grad_recorded(vc) ||
      (append && (grad_recorded(k) || grad_recorded(v))))
    return nb::none();
  if (append && (kc.requires_grad || vc.requires_grad)) return nb::none();
  const std::pair<int, int> window = window_of(window_h);
  if (append) {  // the call appends into both caches: what the general path's run() refuses, refused first
    if (!inference_checked(kc, "k_cache") || !inference_checked(vc, "v_cache")) return nb::none();
    py_check(g_torch->check_caches_apart, kch, vch);
  }
  std::int64_t lens_shape[1] = {0}, table_shape[2] = {0, 0};
  std::uintptr_t lens = 0, table = 0;
  const bool paged = !table_h.is_none();
  if (!read_int32(lens_h, q.device, 1, lens_shape, &lens) ||
      (paged && !read_int32(table_h, q.device, 2, table_shape, &table)))
    return nb::none();
  const std::int64_t B = q.shape[0], Sq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const std::int64_t Hkv = kc.shape[2], Dv = vc.shape[3];
  if (B == 0 || Sq < 1 || Sq > flashcpp::kDecodeMaxSeqlenQ || Hkv == 0 || Hq % Hkv != 0 || kc.shape[3] != D ||
      vc.shape[0] != kc.shape[0] || vc.shape[1] != kc.shape[1] || vc.shape[2] != kc.shape[2] || lens_shape[0] != B)
    return nb::none();
  std::int64_t ps = 0, slots = 0;
  if (paged) {
    if (table_shape[0] != B || table_shape[1] < 1) return nb::none();
    ps = kc.shape[1];
    if (ps < 1 || ps > flashcpp::kDecodeMaxPageSize || (ps & (ps - 1)) != 0) return nb::none();
    slots = table_shape[1] * ps;
  } else {
    if (kc.shape[0] != B) return nb::none();
    slots = kc.shape[1];
  }
  if (append) {
    const std::int64_t ks[4] = {B, Sq, Hkv, D}, vs[4] = {B, Sq, Hkv, Dv};
    if (k.ndim != 4 || v.ndim != 4 || slots < Sq) return nb::none();
    for (int i = 0; i < 4; ++i)
      if (k.shape[i] != ks[i] || v.shape[i] != vs[i]) return nb::none();
  }
  RunOptions opt;
  TensorView vq, vkc, vvc, vk, vv;
  if (Hq == 0 ||  // no q heads: the general path says so (a plan would blame num_qo_heads)
      !place(q, false, &opt) || !view4(q, &vq) || !view4(kc, &vkc) || !view4(vc, &vvc) ||
      (append && (!view4(k, &vk) || !view4(v, &vv))))
    return nb::none();
  const int code = static_cast<int>(q.dtype);
  const nb::tuple win = nb::make_tuple(window.first, window.second);
  nb::object w;
  if (q.device < 0) {
    w = plan_for(B, Sq, Hq, Hkv, D, Dv, slots, ps, append, q.device, code, win, nb::none());
  } else {
    // The key's fields: what the plan depends on (float(softcap) as the Python key had it, the
    // scale as passed: an unhashable one raises here as it did there).
    nb::object key = nb::steal(PyTuple_New(18));
    if (!key.is_valid()) throw nb::python_error();
    Py_ssize_t at = 0;
    auto put = [&](PyObject* item) {  // a new reference (null: raise), which the tuple keeps
      if (item == nullptr) throw nb::python_error();
      PyTuple_SET_ITEM(key.ptr(), at++, item);
    };
    auto put_int = [&](long long x) { put(PyLong_FromLongLong(x)); };
    put(nb::handle(g_torch->s_fast).inc_ref().ptr());
    put_int(q.device);
    for (std::int64_t x : {B, Hq, Hkv, D, Sq, Dv, slots, ps}) put_int(x);
    put(nb::bool_(append).release().ptr());
    put(nb::borrow(causal_h).release().ptr());
    put_int(window.first);
    put_int(window.second);
    put(PyNumber_Float(softcap_h.ptr()));
    put(nb::borrow(scale_h).release().ptr());
    put_int(code);
    put(nb::borrow(splits_h).release().ptr());
    PyObject* hit = PyDict_GetItemWithError(plan_cache.ptr(), key.ptr());  // borrowed
    if (hit == nullptr && PyErr_Occurred()) throw nb::python_error();
    if (hit != nullptr) {
      w = nb::borrow(hit);
      nb::object moved = nb::steal(PyObject_CallMethodOneArg(plan_cache.ptr(), g_torch->s_move_to_end, key.ptr()));
      if (!moved.is_valid()) throw nb::python_error();
    } else {
      w = plan_for(B, Sq, Hq, Hkv, D, Dv, slots, ps, append, q.device, code, win, key);
    }
  }
  if (w.is_none()) return nb::none();
  const flashcpp::DecodePlan& plan = nb::cast<const flashcpp::DecodePlan&>(w.attr("_plan"));
  nb::object cfg = w.attr("_cfg");
  double scale = 0, causal = 0, softcap = 0;
  if (!PyDict_Check(cfg.ptr()) || !cfg_number(cfg.ptr(), "scale", &scale) || !cfg_number(cfg.ptr(), "causal", &causal) ||
      !cfg_number(cfg.ptr(), "softcap", &softcap))
    throw nb::type_error("kvcache_fast: the plan's _cfg lacks scale, causal or softcap");
  const auto plan_window = nb::cast<std::pair<int, int>>(nb::handle(PyDict_GetItemString(cfg.ptr(), "window")));

  // An output of q's shape from empty_like (cheaper than new_empty) where q's strides are exactly
  // row-major, size-1 dims included: empty_like keeps them, so out's strides are new_empty's.
  nb::object out = Dv == D && row_major(q) ? empty_like(q) : new_empty(q, nb::make_tuple(B, Sq, Hq, Dv));
  nb::object lse = return_lse ? new_empty(q, nb::make_tuple(B, Hq, Sq), g_torch->f32) : nb::none();
  flashcpp::DecodeParams p;
  p.batch = static_cast<int>(B);
  p.seqlen_q = static_cast<int>(Sq);
  p.heads_q = static_cast<int>(Hq);
  p.heads_kv = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(D);
  p.head_dim_v = static_cast<int>(Dv);
  p.q = vq;
  p.o = contiguous_view4(data_ptr(out), q.dtype, B, Sq, Hq, Dv);
  p.lse = return_lse ? reinterpret_cast<float*>(data_ptr(lse)) : nullptr;
  p.cache.k = vkc;
  p.cache.v = vvc;
  p.cache.capacity = paged ? 0 : static_cast<int>(slots);
  p.cache.page_size = static_cast<int>(ps);
  p.cache.num_pages = paged ? static_cast<int>(kc.shape[0]) : 0;
  if (paged) {
    p.cache.block_table = reinterpret_cast<const std::int32_t*>(table);
    p.cache.block_table_stride = table_shape[1];
    p.cache.pages_per_seq = static_cast<int>(table_shape[1]);
  }
  p.cache_seqlens = reinterpret_cast<const std::int32_t*>(lens);
  if (append) {
    p.k_new = vk;
    p.v_new = vv;
  }
  p.softmax_scale = static_cast<float>(scale);
  p.mask.causal = causal != 0;
  p.mask.window_left = plan_window.first;
  p.mask.window_right = plan_window.second;
  p.mask.softcap = static_cast<float>(softcap);
  call_released([&] { return flashcpp::decode_run(p, plan, opt); });
  if (append) bump_versions({kc.obj, vc.obj});  // written in place
  return nb::make_tuple(out, lse);
}

PyObject* intern(const char* s) {
  PyObject* r = PyUnicode_InternFromString(s);
  if (r == nullptr) throw nb::python_error();
  return r;
}

PyObject* owned(nb::handle h) { return h.is_none() ? nullptr : h.inc_ref().ptr(); }

/// Hands the fast paths what they need of torch (flashcpp._core at import). Once per process: a
/// second call is ignored.
void eager_bind(nb::handle tensor, nb::handle parameter, nb::handle f16, nb::handle bf16, nb::handle f32,
                nb::handle i32, nb::handle current_device, nb::handle raw_stream, nb::handle empty_like,
                nb::handle check_inference_write, long max_cpu_threads, nb::handle is_grad_enabled,
                nb::handle increment_version, nb::handle check_eps, nb::handle check_window,
                nb::handle check_caches_apart) {
  if (g_torch != nullptr) return;
  auto* t = new Torch();
  t->tensor = owned(tensor);
  t->parameter = owned(parameter);
  t->f16 = owned(f16);
  t->bf16 = owned(bf16);
  t->f32 = owned(f32);
  t->i32 = owned(i32);
  t->current_device = owned(current_device);
  t->raw_stream = owned(raw_stream);
  t->empty_like = owned(empty_like);
  t->check_inference_write = owned(check_inference_write);
  t->is_grad_enabled = owned(is_grad_enabled);
  t->increment_version = owned(increment_version);
  t->check_eps = owned(check_eps);
  t->check_window = owned(check_window);
  t->check_caches_apart = owned(check_caches_apart);
  t->max_cpu_threads = max_cpu_threads;
  t->s_dtype = intern("dtype");
  t->s_shape = intern("shape");
  t->s_stride = intern("stride");
  t->s_data_ptr = intern("data_ptr");
  t->s_requires_grad = intern("requires_grad");
  t->s_is_cuda = intern("is_cuda");
  t->s_is_cpu = intern("is_cpu");
  t->s_get_device = intern("get_device");
  t->s_is_neg = intern("is_neg");
  t->s_is_inference = intern("is_inference");
  t->s_new_empty = intern("new_empty");
  t->s_move_to_end = intern("move_to_end");
  t->s_fast = intern("fast");
  t->s_contiguous = intern("contiguous");
  t->kw_dtype = PyTuple_Pack(1, t->s_dtype);
  if (t->kw_dtype == nullptr) throw nb::python_error();
  t->k_factor = intern("factor");
  t->k_low_freq_factor = intern("low_freq_factor");
  t->k_high_freq_factor = intern("high_freq_factor");
  t->k_original_max_position_embeddings = intern("original_max_position_embeddings");
  t->k_original_max_position = intern("original_max_position");
  g_torch = t;
}

}  // namespace

void bind_eager(nb::module_& m) {
  using namespace nb::literals;
  m.attr("ZERO_SCALE") = kZeroScale;
  m.def("_eager_bind", &eager_bind, "tensor"_a, "parameter"_a, "float16"_a, "bfloat16"_a, "float32"_a, "int32"_a,
        "current_device"_a.none(), "raw_stream"_a.none(), "empty_like"_a, "check_inference_write"_a,
        "max_cpu_threads"_a, "is_grad_enabled"_a, "increment_version"_a, "check_eps"_a, "check_window"_a,
        "check_caches_apart"_a,
        "Hands the eager fast paths torch's tensor types, dtypes, current-device and raw-stream "
        "accessors, torch.is_grad_enabled and torch._C._increment_version, and _core's checks they "
        "call (flashcpp._core, at import).");
  m.def("attention_fast", &attention_fast, "q"_a, "k"_a, "v"_a, "softmax_scale"_a.none(), "causal"_a.none(),
        "window_left"_a, "window_right"_a, "softcap"_a.none(), "return_lse"_a.none(),
        "flash_attn_func's eager fast path: out or (out, lse), or None when the call is not one it takes.");
  m.def("varlen_fast", &varlen_fast, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(),
        "max_seqlen_q"_a.none(), "max_seqlen_k"_a.none(), "softmax_scale"_a.none(), "causal"_a.none(),
        "window_left"_a, "window_right"_a, "softcap"_a.none(), "return_lse"_a.none(),
        "flash_attn_varlen_func's eager fast path: out or (out, lse), or None when the call is not one it takes.");
  m.def("backward_fast", &backward_fast, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dlse"_a.none(),
        "softmax_scale"_a.none(), "causal"_a.none(), "window_left"_a.none(), "window_right"_a.none(),
        "softcap"_a.none(), "deterministic"_a.none(),
        "flash_attn_bwd_eager's fast path: (dq, dk, dv), or None when the call is not one it takes.");
  m.def("varlen_backward_fast", &varlen_backward_fast, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a,
        "dlse"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "max_seqlen_q"_a.none(),
        "max_seqlen_k"_a.none(), "softmax_scale"_a.none(), "causal"_a.none(), "window_left"_a.none(),
        "window_right"_a.none(), "softcap"_a.none(), "deterministic"_a.none(),
        "flash_attn_varlen_bwd_eager's fast path: (dq, dk, dv), or None when the call is not one it takes.");
  m.def("fast_view", &fast_view, "t"_a, "dtype"_a,
        "The TensorView of a plain 4-D torch tensor with a contiguous last dim (a size-1 dim gets the "
        "extent as its stride), or None.");
  m.def("kvcache_fast", &kvcache_fast, "q"_a, "k_cache"_a, "v_cache"_a, "k"_a.none(), "v"_a.none(),
        "cache_seqlens"_a.none(), "block_table"_a.none(), "plan_for"_a, "return_lse"_a, "plan_cache"_a.none(),
        "causal"_a.none(), "window_size"_a.none(), "softcap"_a.none(), "softmax_scale"_a.none(), "num_splits"_a.none(),
        "flash_attn_with_kvcache's eager fast path: (out, lse or None), or None when the step is not one "
        "it takes.");
  m.def("norm_fast", &norm_fast, "x"_a, "residual"_a.none(), "weight"_a, "eps"_a.none(), "cpu_threads"_a.none(),
        "rms_norm (residual None: the new output) or in-place fused_add_rms_norm (True) on the eager fast "
        "path, or None.");
  m.def("silu_and_mul_fast", &silu_and_mul_fast, "x"_a, "cpu_threads"_a.none(),
        "silu_and_mul(x) on the eager fast path: the new output, or None.");
  m.def("rotary_fast", &rotary_fast, "q"_a.none(), "k"_a.none(), "positions"_a.none(), "style"_a.none(),
        "rotary_dim"_a.none(), "theta"_a.none(), "llama3"_a.none(), "cos_sin_cache"_a.none(), "inplace"_a.none(),
        "cpu_threads"_a.none(),
        "apply_rotary on the eager fast path: (q_out, k_out or None), new tensors or q and k themselves "
        "(inplace; the caller moves their version counters), or None.");
}

}  // namespace flashcpp_python
