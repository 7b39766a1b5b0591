// Kernel launches with an optional programmatic dependent launch (PDL, sm_90+): the launch may
// begin while the previous kernel on the stream is still running; the kernel must wait for it
// (pdl_wait_then_release) before touching memory that kernel reads or writes.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashcpp::cuda {

/// Waits until the previous grid on the stream has completed and its writes are visible (returns
/// at once for an ordinary launch), then allows the next programmatic launch to begin; its CTAs
/// wait the same way, so only the launch overlaps. First statement of a PDL-aware kernel.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// A launch configuration with its attributes in `attr`: thread-block clusters of `cluster_x` CTAs
/// along x when cluster_x > 1 (sm_90+; grid.x a multiple of it), programmatic when `pdl`. Also what
/// cudaOccupancyMaxActiveClusters takes.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool pdl,
                                        unsigned cluster_x, cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  unsigned n = 0;
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cfg;
}

/// kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster_x` CTAs (launch_config).
template <class... KArgs, class... Args>
cudaError_t launch_kernel_clustered(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem,
                                    cudaStream_t stream, bool pdl, unsigned cluster_x, Args&&... args) {
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, pdl, cluster_x, attr);
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/// kernel<<<grid, block, smem, stream>>>(args...), programmatic when `pdl`.
template <class... KArgs, class... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  return launch_kernel_clustered(kernel, grid, block, smem, stream, pdl, 1u, std::forward<Args>(args)...);
}

}  // namespace flashcpp::cuda
