// The backend-independent default of Ops::gemv_fused: prologue through the flashcpp fused entry
// points into the scratch buffer, then a plain GEMM.
#include "engine/ops.h"
#include "flashcpp/fused.h"

namespace flashcpp::engine {

Status Ops::gemv_fused(int M, int N, int K, const void* x, std::int64_t ldx, const GemvPrologue& pro, const void* w,
                       void* y, std::int64_t ldy, DType y_dtype) {
  using Kind = GemvPrologue::Kind;
  if (pro.kind == Kind::kNone) return gemm(M, N, K, x, ldx, w, y, ldy, y_dtype);
  if (!pro.scratch) return Status::Internal("gemv_fused: the unfused path needs a scratch buffer");
  RunOptions ro;
  ro.backend = cuda() ? Backend::kCuda : Backend::kCpu;
  ro.stream = stream();
  const DType dt = dtype();
  if (pro.kind == Kind::kSiluMul) {
    FLASHCPP_RETURN_IF_ERROR(silu_and_mul(
        SiluMulParams::from_fused(const_cast<void*>(x), dt, M, K, ldx, contiguous_matrix(pro.scratch, dt, K)), ro));
  } else {
    RmsNormParams p;
    p.rows = M;
    p.hidden = K;
    p.x = MatrixView{const_cast<void*>(x), dt, ldx};
    p.weight = pro.weight;
    p.y = contiguous_matrix(pro.scratch, dt, K);
    p.eps = pro.eps;
    if (pro.kind == Kind::kRmsNorm) {
      FLASHCPP_RETURN_IF_ERROR(rms_norm(p, ro));
    } else {
      p.residual = contiguous_matrix(const_cast<void*>(pro.residual), dt, K);
      p.residual_out = contiguous_matrix(pro.residual_out, dt, K);
      FLASHCPP_RETURN_IF_ERROR(fused_add_rms_norm(p, ro));
    }
  }
  return gemm(M, N, K, pro.scratch, K, w, y, ldy, y_dtype);
}

}  // namespace flashcpp::engine
