// The eager fast paths of the Python API, marshalled in C++ (eager_fast.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace flashcpp_python {

/// Adds _eager_bind, fast_view, attention_fast, varlen_fast, backward_fast, varlen_backward_fast,
/// kvcache_fast, norm_fast, silu_and_mul_fast and rotary_fast to the module.
void bind_eager(nanobind::module_& m);

}  // namespace flashcpp_python
