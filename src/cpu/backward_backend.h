// The CPU backward backends (include/flashcpp/backward.h): the fp64 reference and the fp32 tiled
// backward that walks the GPU kernels' blocks. Host memory; called after validate_backward.
#pragma once

#include <vector>

#include "flashcpp/attention.h"
#include "flashcpp/backward.h"

namespace flashcpp::cpu {

/// Backend::kCpuReference: reference_attention_backward, then dq, dk, dv stored in their dtype
/// (fp64 exactly), and the uncovered varlen rows zeroed.
Status reference_backward(const AttnBackwardParams& p, const RunOptions& opt);

/// Backend::kCpu: the tiled fp32 backward (tiled_backward.cc) in p.workspace, whose layout
/// attention_backward_workspace_size gave (validated against it).
Status tiled_backward(const AttnBackwardParams& p, const RunOptions& opt, const BackwardWorkspaceLayout& layout);

/// The tiled backward's query tile height (and so the workspace's row padding): opt.cpu_block_m (0:
/// 64), and with a block-sparse mask its largest divisor of the mask's block_m that is not above
/// that, so that query tiles never straddle a sparse block and each is one padded row block.
int tiled_backward_block_m(const AttnBackwardParams& p, const RunOptions& opt);
/// Its key tile width: opt.cpu_block_n (0: 64), at most the mask's block_n (the forward's rule).
int tiled_backward_block_n(const AttnBackwardParams& p, const RunOptions& opt);

/// Varlen rows no sequence covers, when their count is known (mask.total_q for dq, total_k for dk
/// and dv): set to 0. Every row when batch is 0. Host memory; does nothing without varlen.
void zero_uncovered_grads(const AttnBackwardParams& p);

}  // namespace flashcpp::cpu
