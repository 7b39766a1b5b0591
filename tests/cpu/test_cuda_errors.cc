// The sentence CUDA paths report for a device or driver failure (src/cuda/common/device.h), and what
// `flashcpp check --backend cuda` says on a machine without an NVIDIA driver. A CUDA build only;
// the end-to-end case needs a machine with no usable GPU (CI) and skips where one is present.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#if FLASHCPP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/common/device.h"
#include "harness/harness.h"

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(CudaErrors, NoDriverSaysNoDriverAndTheCpuBackend) {
  // cudaDriverGetVersion reports 0 when no driver is installed; the runtime still says
  // cudaErrorInsufficientDriver ("CUDA driver version is insufficient for CUDA runtime version").
  const std::string s = flashcpp::cuda::error_string(cudaErrorInsufficientDriver, 0, 13000);
  EXPECT_TRUE(has(s, "no NVIDIA driver or GPU was found")) << s;
  EXPECT_TRUE(has(s, "--backend cpu")) << s;
  EXPECT_FALSE(has(s, "insufficient")) << s;
}

TEST(CudaErrors, OldDriverSaysBothVersions) {
  const std::string s = flashcpp::cuda::error_string(cudaErrorInsufficientDriver, 12020, 13000);
  EXPECT_TRUE(has(s, "CUDA 12.2")) << s;
  EXPECT_TRUE(has(s, "CUDA 13.0 runtime")) << s;
  EXPECT_TRUE(has(s, "update the driver")) << s;
}

TEST(CudaErrors, NoDeviceSaysNoGpu) {
  const std::string s = flashcpp::cuda::error_string(cudaErrorNoDevice, 13000, 13000);
  EXPECT_TRUE(has(s, "no NVIDIA GPU was found")) << s;
  EXPECT_TRUE(has(s, "--backend cpu")) << s;
}

TEST(CudaErrors, OtherErrorsKeepTheRuntimeText) {
  EXPECT_EQ(flashcpp::cuda::error_string(cudaErrorMemoryAllocation), cudaGetErrorString(cudaErrorMemoryAllocation));
  EXPECT_EQ(flashcpp::cuda::error_string(cudaErrorInvalidValue, 0, 0), cudaGetErrorString(cudaErrorInvalidValue));
}

// What `flashcpp check --backend cuda --quick` prints where the runtime finds no driver or no GPU.
TEST(CudaErrors, CheckWithoutADriverSaysSoAndExits2) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (e == cudaSuccess && n > 0) GTEST_SKIP() << "a CUDA device is present: the no-driver message cannot be shown here";
  if (e != cudaErrorInsufficientDriver && e != cudaErrorNoDevice)
    GTEST_SKIP() << "the runtime reports " << cudaGetErrorName(e) << ", not a missing driver or GPU";
  flashcpp::harness::CheckOptions o;
  o.backend = flashcpp::Backend::kCuda;
  o.table = flashcpp::harness::TableKind::kQuick;
  std::ostringstream out, err;
  EXPECT_EQ(flashcpp::harness::run_check(o, out, err), 2);
  EXPECT_TRUE(has(err.str(), flashcpp::cuda::error_string(e))) << err.str();
  EXPECT_TRUE(has(err.str(), "--backend cpu")) << err.str();
  EXPECT_FALSE(has(err.str(), "insufficient")) << err.str();
}

}  // namespace

#else

TEST(CudaErrors, NeedsACudaBuild) {
  GTEST_SKIP() << "this build has no CUDA (FLASHCPP_CUDA=OFF): the CUDA error sentences are not compiled";
}

#endif
