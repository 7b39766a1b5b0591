// flashcpp._flashcpp.engine: the Llama decode engine (include/flashcpp/engine.h) from Python.
// Registered into the extension by flashcpp_module.cc's NB_MODULE; python/src/engine_module.cc.
#pragma once

#include <nanobind/nanobind.h>

namespace flashcpp_python {

/// Adds the submodule `engine` to `m`: the Engine class when the build has the engine
/// (FLASHCPP_HAS_ENGINE), else only AVAILABLE = False and the sentence REASON.
void bind_engine(nanobind::module_& m);

}  // namespace flashcpp_python
