// The Python exception of a non-ok flashcpp::Status, for every source of the extension
// (flashcpp_module.cc, engine_module.cc): one mapping, one place.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "flashcpp/status.h"

namespace flashcpp_python {

/// Raises the Python exception that matches a non-ok Status: ValueError for an invalid argument,
/// NotImplementedError for what is not supported, RuntimeError otherwise (with the code in the
/// text, so "cuda_error: ..." / "internal: ..." stay visible). Call with the GIL held.
[[noreturn]] inline void raise_status(const flashcpp::Status& st) {
  PyObject* type = PyExc_RuntimeError;
  std::string msg = st.message();
  switch (st.code()) {
    case flashcpp::StatusCode::kInvalidArgument: type = PyExc_ValueError; break;
    case flashcpp::StatusCode::kUnsupported: type = PyExc_NotImplementedError; break;
    default: msg = st.to_string(); break;
  }
  PyErr_SetString(type, msg.c_str());
  throw nanobind::python_error();
}

/// Runs a C++ entry point without the GIL (the CPU backends compute for a while, a CUDA launch
/// may wait on the driver; neither touches Python objects) and raises its Status.
template <class F>
void call_released(F&& f) {
  flashcpp::Status st;
  {
    nanobind::gil_scoped_release release;
    st = f();
  }
  if (!st.ok()) raise_status(st);
}

}  // namespace flashcpp_python
