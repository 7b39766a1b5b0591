// cuBLAS and cuBLASLt are opened at their first use (src/cuda/common/cublas_dl.h), not linked: a
// process that links flashcpp starts without them, the tables resolve every function from the
// toolkit's libraries, calls go through them, and a library that cannot be found is a sentence.
// A CUDA build only (the toolkit's libraries are on the build machine); needs no GPU.
#include <gtest/gtest.h>

#include <string>

#if FLASHCPP_WITH_CUDA
#include <dlfcn.h>

#include "cuda/common/cublas_dl.h"

namespace {

namespace dl = flashcpp::cuda::dl;

bool loaded(const std::string& soname) {
  void* h = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return false;
  dlclose(h);  // drops the reference RTLD_NOLOAD took
  return true;
}
const std::string kCublas = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
const std::string kCublasLt = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);

// ctest runs each case in a process of its own, so this is the state at a process's start: linking
// flashcpp (and the engine, and the harness) no longer loads either library.
// (It comes first in this file, so a whole-binary run also meets it before the cases below.)
TEST(CublasDl, NeitherLibraryIsLoadedWhenAProcessStarts) {
  EXPECT_FALSE(loaded(kCublas));
  EXPECT_FALSE(loaded(kCublasLt));
}

TEST(CublasDl, TheTablesResolveEveryFunction) {
  const dl::Cublas* blas = nullptr;
  const flashcpp::Status s = dl::cublas(&blas);
  ASSERT_TRUE(s.ok()) << s.message();
  ASSERT_NE(blas, nullptr);
#define FC_EXPECT_SET(name) EXPECT_NE(blas->name, nullptr) << #name;
  FLASHCPP_CUBLAS_FUNCTIONS(FC_EXPECT_SET)
#undef FC_EXPECT_SET
  const dl::CublasLt* lt = nullptr;
  const flashcpp::Status st = dl::cublaslt(&lt);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_NE(lt, nullptr);
#define FC_EXPECT_SET(name) EXPECT_NE(lt->name, nullptr) << #name;
  FLASHCPP_CUBLASLT_FUNCTIONS(FC_EXPECT_SET)
#undef FC_EXPECT_SET
  EXPECT_TRUE(loaded(kCublas));
  EXPECT_TRUE(loaded(kCublasLt));
  // Once per process: the second call hands back the same table.
  const dl::CublasLt* again = nullptr;
  ASSERT_TRUE(dl::cublaslt(&again).ok());
  EXPECT_EQ(again, lt);
}

// cuBLASLt's layout descriptors are host objects: a call through the table that needs no GPU.
TEST(CublasDl, ACallGoesThroughTheTable) {
  const dl::CublasLt* lt = nullptr;
  ASSERT_TRUE(dl::cublaslt(&lt).ok());
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(lt->cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 128, 64, 128), CUBLAS_STATUS_SUCCESS);
  ASSERT_NE(layout, nullptr);
  EXPECT_EQ(lt->cublasLtMatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
}

TEST(CublasDl, ALibraryThatCannotBeFoundIsASentence) {
  void* h = reinterpret_cast<void*>(1);
  const flashcpp::Status s = dl::open_library("libflashcpp_no_such_library.so.7", "cuBLASLt", &h);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(h, nullptr);
  EXPECT_EQ(s.code(), flashcpp::StatusCode::kCudaError);
  const std::string m = s.message();
  EXPECT_NE(m.find("cuBLASLt (libflashcpp_no_such_library.so.7) could not be loaded"), std::string::npos) << m;
  EXPECT_NE(m.find("/usr/local/cuda/lib64"), std::string::npos) << m;
  EXPECT_NE(m.find("LD_LIBRARY_PATH"), std::string::npos) << m;
}

}  // namespace
#endif  // FLASHCPP_WITH_CUDA
