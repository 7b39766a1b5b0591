// Split-KV decode kernel, head-dim class 64 (head dims 8..64, padded inside; bf16 + fp16). See decode_launch.h for the instantiation list.
#include "cuda/decode/decode_launch.cuh"

namespace flashcpp::cuda {
Status decode_split_launch_hd64(const DecodeKernelParams& p, DType dt, int ctas, int smem_pad, Stream stream, int device) {
  return decode_split_dispatch<64>(p, dt, ctas, smem_pad, stream, device);
}
}  // namespace flashcpp::cuda
