// flashcpp._flashcpp.engine: the binding of flashcpp::engine::Engine (include/flashcpp/engine.h),
// the Llama decode engine that `flashcpp decode` drives. Token ids in, token ids out; the text side
// (Hugging Face `tokenizers`) lives in python/flashcpp/engine.py and generate.py.
//
// The GIL is released while the engine loads and generates; the streaming callback (on_tokens)
// takes it back for each call. An exception the callback raises stops the run and is re-raised
// by generate(). One generate or load at a time per Engine (a mutex): the backend's buffers,
// streams and graphs are shared by the calls.
#include "engine_module.h"
#include "py_status.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "flashcpp/status.h"
#if FLASHCPP_PY_ENGINE
#include "flashcpp/engine.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace flashcpp_python {
namespace {

#if FLASHCPP_PY_ENGINE
using flashcpp::Status;
using flashcpp::StatusCode;
namespace fe = flashcpp::engine;


struct PyEngine {
  std::unique_ptr<fe::Engine> e;
  std::mutex mu;
};

nb::dict model_dict(const fe::ModelInfo& m) {
  nb::dict d;
  d["num_hidden_layers"] = m.num_hidden_layers;
  d["hidden_size"] = m.hidden_size;
  d["num_attention_heads"] = m.num_attention_heads;
  d["num_key_value_heads"] = m.num_key_value_heads;
  d["vocab_size"] = m.vocab_size;
  d["weight_bytes"] = m.weight_bytes;
  d["step_weight_bytes"] = m.step_weight_bytes;
  return d;
}

nb::dict generate(PyEngine& self, std::vector<std::vector<std::int32_t>> prompts, int max_new_tokens,
                  float temperature, float top_p, std::uint64_t seed, std::vector<std::int32_t> stop_ids,
                  nb::object on_tokens, bool eager, int warmup_steps, bool profile, int page_size,
                  const std::string& kv_dtype, float kv_scale) {
  fe::GenerateOptions opt;
  opt.prompts = std::move(prompts);
  opt.max_new_tokens = max_new_tokens;
  opt.sampling.temperature = temperature;
  opt.sampling.top_p = top_p;
  opt.sampling.seed = seed;
  opt.stop_ids = std::move(stop_ids);
  opt.eager = eager;
  opt.warmup_steps = warmup_steps;
  opt.profile = profile;
  opt.page_size = page_size;
  if (kv_dtype != "auto" && kv_dtype != "fp8")
    raise_status(Status::Invalid("kv_dtype must be 'auto' (the backend's dtype) or 'fp8' (e4m3 codes with kv_scale)"));
  opt.kv_fp8 = kv_dtype == "fp8";
  opt.kv_scale = kv_scale;
  if (warmup_steps < 0) raise_status(Status::Invalid("warmup_steps must be >= 0"));
  std::exception_ptr raised;  // what the callback raised (set and rethrown with the GIL held)
  if (!on_tokens.is_none()) {
    if (!PyCallable_Check(on_tokens.ptr())) raise_status(Status::Invalid("on_tokens must be callable or None"));
    // Captures the caller's reference (no refcounting without the GIL).
    opt.on_tokens = [&on_tokens, &raised](int step, const std::vector<std::int32_t>& toks) -> bool {
      nb::gil_scoped_acquire gil;
      try {
        nb::list ids;
        for (std::int32_t t : toks) ids.append(t);
        nb::object r = on_tokens(step, ids);
        return r.is_none() || PyObject_IsTrue(r.ptr()) == 1;
      } catch (...) {
        raised = std::current_exception();
        return false;
      }
    };
  }
  fe::GenerateResult res;
  Status st;
  {
    // The GIL goes first: a thread waiting on the mutex must not hold it while the running
    // generate's callback asks for it.
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mu);
    st = self.e->generate(opt, &res);
  }
  if (raised) std::rethrow_exception(raised);
  if (!st.ok()) raise_status(st);
  nb::dict d;
  nb::list toks;
  for (const auto& seq : res.tokens) {
    nb::list l;
    for (std::int32_t t : seq) l.append(t);
    toks.append(l);
  }
  d["tokens"] = toks;
  d["prompt_len"] = res.prompt_len;
  d["decode_steps"] = res.decode_steps;
  d["mode"] = res.mode;
  d["prefill_ms"] = res.prefill_ms;
  d["decode_ms"] = res.decode_ms;
  d["decode_tok_s"] = res.decode_tok_s;
  return d;
}
#endif  // FLASHCPP_PY_ENGINE

}  // namespace

void bind_engine(nb::module_& m) {
  nb::module_ e = m.def_submodule("engine", "The Llama decode engine (flashcpp::engine::Engine): token ids in and out");
#if FLASHCPP_PY_ENGINE
  e.attr("AVAILABLE") = true;
  e.attr("REASON") = "";
  e.attr("MAX_BATCH") = fe::kMaxBatch;
  nb::class_<PyEngine>(e, "Engine", "A backend (CPU threads or one CUDA device) with at most one Llama model loaded")
      .def_static(
          "cpu",
          [](int threads) {
            if (threads < 0) raise_status(Status::Invalid("threads must be >= 0 (0: all cores)"));
            auto p = std::make_unique<PyEngine>();
            p->e = fe::Engine::cpu(threads);
            return p.release();
          },
          "threads"_a = 0, nb::rv_policy::take_ownership, "The CPU backend (fp32) with `threads` threads (0: all).")
      .def_static(
          "cuda",
          []() {
            auto p = std::make_unique<PyEngine>();
            Status st;
            {
              nb::gil_scoped_release release;
              st = fe::Engine::cuda(&p->e);
            }
            if (!st.ok()) raise_status(st);
            return p.release();
          },
          nb::rv_policy::take_ownership, "The CUDA backend (bf16) on the current device.")
      .def_prop_ro("is_cuda", [](PyEngine& s) { return s.e->is_cuda(); })
      .def("describe", [](PyEngine& s) { return s.e->describe(); })
      .def(
          "set_gemm_mode",
          [](PyEngine& s, const std::string& mode) {
            const Status st = s.e->set_gemm_mode(mode);
            if (!st.ok()) raise_status(st);
          },
          "mode"_a)
      .def(
          "load",
          [](PyEngine& s, const std::string& dir) {
            Status st;
            {
              nb::gil_scoped_release release;
              std::lock_guard<std::mutex> lock(s.mu);
              st = s.e->load(dir);
            }
            if (!st.ok()) raise_status(st);
          },
          "dir"_a, "Reads config.json and the safetensors of `dir` onto the backend.")
      .def("model", [](PyEngine& s) { return model_dict(s.e->model()); },
           "The loaded model's shape and weight bytes (zeros before load()).")
      .def("generate", &generate, "prompts"_a, "max_new_tokens"_a = 32, "temperature"_a = 0.f, "top_p"_a = 1.f,
           "seed"_a = 0, "stop_ids"_a = std::vector<std::int32_t>{}, "on_tokens"_a = nb::none(), "eager"_a = true,
           "warmup_steps"_a = 0, "profile"_a = false, "page_size"_a = 16, "kv_dtype"_a = "auto", "kv_scale"_a = 1.f,
           "Prefills the prompts (lists of ids) and decodes; on_tokens(step, ids) is called after every token "
           "of the batch (-1 for a stopped sequence; a false return ends the run). Returns a dict: tokens "
           "(per sequence), prompt_len, decode_steps, mode, prefill_ms, decode_ms, decode_tok_s.");
#else
  e.attr("AVAILABLE") = false;
  e.attr("REASON") =
      "this build leaves out the Llama decode engine (FLASHCPP_WITH_ENGINE=OFF, or FLASHCPP_PYTHON_ENGINE=OFF)";
#endif
}

}  // namespace flashcpp_python
