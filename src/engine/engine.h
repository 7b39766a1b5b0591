// generate() on a loaded model: prompts in, token ids out, with the timings the engine report
// needs. The options and results are public (include/flashcpp/engine.h, where the Engine facade
// that the CLI uses calls this); tests call it on a model they load themselves.
#pragma once

#include "engine/model.h"
#include "flashcpp/engine.h"

namespace flashcpp::engine {

Status generate(const LlamaModel& model, const GenerateOptions& opt, GenerateResult* out);

}  // namespace flashcpp::engine
