// The GEMV's launches: one wave of CTAs (or clusters of two for the K split), the row grouping of
// gemv_plan.h, one instantiation per padded row count (1, 2, 4, 8) and output type.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <type_traits>

#include "cuda/common/launch.cuh"
#include "cuda/engine/engine_common.cuh"
#include "cuda/engine/engine_launch.h"
#include "cuda/engine/gemv_kernel.cuh"
#include "cuda/engine/gemv_plan.h"

namespace flashcpp::cuda::engine {
namespace {

/// CTAs of gemv_kernel<M, OutT, R, KS> that fit an SM at this dynamic shared memory, or for KS 2
/// the clusters of two that fit the GPU (cached per instantiation and size).
template <int M, class OutT, int R, int KS>
Status gemv_capacity(std::size_t smem, int* out) {
  auto kernel = gemv_kernel<M, OutT, R, KS>;
  static bool configured = false;  // one attribute call per instantiation (first use is never inside a capture: warm-up runs first)
  if (!configured) {
    FLASHCPP_RETURN_IF_ERROR(cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kGemvMaxSmem)),
        "cudaFuncSetAttribute(gemv)"));
    configured = true;
  }
  static std::map<std::size_t, int> capacity;  // by dynamic smem bytes
  auto it = capacity.find(smem);
  if (it == capacity.end()) {
    int n = 0;
    if constexpr (KS == 1) {
      FLASHCPP_RETURN_IF_ERROR(cuda_status(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kGemvThreads, smem), "gemv occupancy"));
    } else {
      cudaLaunchAttribute attr[2];
      const cudaLaunchConfig_t cfg = cuda::launch_config(dim3(2 * 1024), dim3(kGemvThreads), smem, nullptr, false, 2, attr);
      FLASHCPP_RETURN_IF_ERROR(cuda_status(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg), "gemv cluster occupancy"));
    }
    it = capacity.emplace(smem, std::max(1, n)).first;
  }
  *out = it->second;
  return Status::Ok();
}

// One wave, no more: each CTA builds the prologue once and then strides over row groups (KS 2:
// each cluster of two).
template <int M, class OutT, int R, int KS>
Status launch_gemv_mr(const GemvArgs& a, bool pdl, int num_sms, int cap, std::size_t smem, cudaStream_t s) {
  const int groups = (a.N + R - 1) / R;
  if constexpr (KS == 1) {
    return cuda_status(cuda::launch_kernel(gemv_kernel<M, OutT, R, 1>, dim3(static_cast<unsigned>(std::min(groups, num_sms * cap))),
                                           dim3(kGemvThreads), smem, s, pdl, a),
                       "gemv launch");
  } else {
    return cuda_status(cuda::launch_kernel_clustered(gemv_kernel<M, OutT, R, 2>,
                                                     dim3(2 * static_cast<unsigned>(std::min(groups, cap))),
                                                     dim3(kGemvThreads), smem, s, pdl, 2, a),
                       "gemv launch (clusters of 2)");
  }
}

template <int M, class OutT>
Status launch_gemv_m(const GemvArgs& a, bool pdl, int num_sms, int sm_major, cudaStream_t s) {
  const std::size_t smem = static_cast<std::size_t>(M) * a.K * sizeof(bf16);
  int per_sm = 1;
  FLASHCPP_RETURN_IF_ERROR((gemv_capacity<M, OutT, kGemvRows, 1>(smem, &per_sm)));
  if constexpr (M <= 2 && std::is_same_v<OutT, bf16>) {  // the 2-row and K-split instantiations: bf16 out, 1-2 rows only
    using Kind = GemvPrologueKind;
    const bool can_split_k = sm_major >= 9 && (a.kind == static_cast<int>(Kind::kNone) || a.kind == static_cast<int>(Kind::kSiluMul));
    const GemvGrouping g = gemv_grouping(a.N, a.K, num_sms * per_sm, can_split_k);
    int cap = 1;
    if (g.ksplit == 2) {
      FLASHCPP_RETURN_IF_ERROR((gemv_capacity<M, OutT, kGemvRows, 2>(smem, &cap)));
      return launch_gemv_mr<M, OutT, kGemvRows, 2>(a, pdl, num_sms, cap, smem, s);
    }
    if (g.rows == 2) {
      FLASHCPP_RETURN_IF_ERROR((gemv_capacity<M, OutT, 2, 1>(smem, &cap)));
      return launch_gemv_mr<M, OutT, 2, 1>(a, pdl, num_sms, cap, smem, s);
    }
  }
  return launch_gemv_mr<M, OutT, kGemvRows, 1>(a, pdl, num_sms, per_sm, smem, s);
}

template <class OutT>
Status launch_gemv(const GemvArgs& a, bool pdl, int num_sms, int sm_major, cudaStream_t s) {
  if (a.M <= 1) return launch_gemv_m<1, OutT>(a, pdl, num_sms, sm_major, s);
  if (a.M <= 2) return launch_gemv_m<2, OutT>(a, pdl, num_sms, sm_major, s);
  if (a.M <= 4) return launch_gemv_m<4, OutT>(a, pdl, num_sms, sm_major, s);
  return launch_gemv_m<8, OutT>(a, pdl, num_sms, sm_major, s);
}

}  // namespace

Status gemv(const GemvParams& p, const GemvDevice& dev, Stream stream) {
  const GemvArgs a{static_cast<const bf16*>(p.x), p.ldx, static_cast<const bf16*>(p.w), p.y, p.ldy, p.M, p.N, p.K,
                   static_cast<int>(p.prologue), static_cast<const bf16*>(p.norm_weight), p.eps,
                   static_cast<const bf16*>(p.residual), static_cast<bf16*>(p.residual_out)};
  return p.y_dtype == DType::kF32 ? launch_gemv<float>(a, dev.pdl, dev.num_sms, dev.sm_major, stream)
                                  : launch_gemv<bf16>(a, dev.pdl, dev.num_sms, dev.sm_major, stream);
}

}  // namespace flashcpp::cuda::engine
