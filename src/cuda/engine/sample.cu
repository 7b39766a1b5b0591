// The sampling kernel's launch: one CTA of kSampleThreads per logits row.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/engine/engine_common.cuh"
#include "cuda/engine/engine_launch.h"
#include "cuda/engine/sample_kernel.cuh"

namespace flashcpp::cuda::engine {

Status sample(const float* logits, int rows, int vocab, const SampleArgs& args, std::int32_t* tokens_out,
              std::int32_t* history, const std::int32_t* step_counter, Stream stream) {
  sample_kernel<<<rows, kSampleThreads, 0, stream>>>(logits, rows, vocab, args, tokens_out, history, step_counter);
  return cuda_status(cudaGetLastError(), "sample launch");
}

}  // namespace flashcpp::cuda::engine
