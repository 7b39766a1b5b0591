// The public Engine (include/flashcpp/engine.h): a backend's Ops and the model loaded on it,
// behind one handle, so the CLI includes no src/engine header.
#include <string>
#include <utility>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/ops.h"
#include "flashcpp/engine.h"

namespace flashcpp::engine {

struct Engine::Impl {
  // Declared before the model: the model's buffers are released through the Ops, so the model
  // is destroyed first.
  std::unique_ptr<Ops> ops;
  std::unique_ptr<LlamaModel> model;
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

std::unique_ptr<Engine> Engine::cpu(int threads) {
  auto impl = std::make_unique<Impl>();
  impl->ops = make_cpu_ops(threads);
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::cuda(std::unique_ptr<Engine>* out) {
  auto impl = std::make_unique<Impl>();
  FLASHCPP_RETURN_IF_ERROR(make_cuda_ops(&impl->ops));
  out->reset(new Engine(std::move(impl)));
  return Status::Ok();
}

bool Engine::is_cuda() const { return impl_->ops->cuda(); }
std::string Engine::describe() const { return impl_->ops->describe(); }
Status Engine::set_gemm_mode(const std::string& mode) { return impl_->ops->set_gemm_mode(mode); }

Status Engine::load(const std::string& dir) {
  if (impl_->model) return Status::Invalid("a model is loaded on this engine already (" + dir + " was not read)");
  return LlamaModel::load(dir, impl_->ops.get(), &impl_->model);
}

ModelInfo Engine::model() const {
  ModelInfo m;
  if (!impl_->model) return m;
  const LlamaConfig& c = impl_->model->config();
  m.num_hidden_layers = c.num_hidden_layers;
  m.hidden_size = c.hidden_size;
  m.num_attention_heads = c.num_attention_heads;
  m.num_key_value_heads = c.num_key_value_heads;
  m.vocab_size = c.vocab_size;
  m.weight_bytes = impl_->model->weight_bytes();
  m.step_weight_bytes = impl_->model->step_weight_bytes();
  return m;
}

Status Engine::generate(const GenerateOptions& opt, GenerateResult* out) const {
  if (!impl_->model) return Status::Invalid("generate: no model is loaded (Engine::load first)");
  return engine::generate(*impl_->model, opt, out);
}

}  // namespace flashcpp::engine
