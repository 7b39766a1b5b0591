// cuBLAS and cuBLASLt, opened at their first use (dlopen) instead of linked. Host-only.
//
// Only two paths call them: the fp64 GPU reference (cuBLAS DGEMM, for the harness and the GPU tests)
// and the engine's GEMMs past the GEMV's rows (cuBLASLt). Linked, the two libraries (about 700 MB)
// were mapped and relocated at the start of every process that linked flashcpp, used or not:
// 0.1 s of CPU per process (each ctest case, each CLI call), and the engine stayed out of the
// CUDA wheel, which does not carry cuBLASLt. Opened here, a process that never calls them never
// loads them, and one that does finds the copy already loaded (PyTorch's) or the toolkit's.
//
// Each table holds the functions by their exported names, typed from the CUDA headers
// (decltype), so a call through it is checked like a direct call.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

#include "flashcpp/status.h"

namespace flashcpp::cuda::dl {

// Each function once, by the name the library exports (cublas_v2.h maps cublasCreate & co. to _v2).
#define FLASHCPP_CUBLAS_FUNCTIONS(X) X(cublasCreate_v2) X(cublasDestroy_v2) X(cublasSetStream_v2) X(cublasDgemm_v2)
#define FLASHCPP_CUBLASLT_FUNCTIONS(X)                                                                   \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtMatmul) X(cublasLtMatmulAlgoGetHeuristic)               \
  X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute)             \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulPreferenceCreate)         \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute)

#define FLASHCPP_DL_MEMBER(name) decltype(&::name) name = nullptr;
struct Cublas {
  FLASHCPP_CUBLAS_FUNCTIONS(FLASHCPP_DL_MEMBER)
};
struct CublasLt {
  FLASHCPP_CUBLASLT_FUNCTIONS(FLASHCPP_DL_MEMBER)
};
#undef FLASHCPP_DL_MEMBER

/// cuBLAS's functions. The library is opened at the first call, once per process (thread-safe);
/// an error (the same one every call) names the library and each place it was looked for.
Status cublas(const Cublas** out);
/// cuBLASLt's functions, the same way.
Status cublaslt(const CublasLt** out);

/// Opens the shared library `soname` as the two calls above do: the dynamic loader's search
/// (LD_LIBRARY_PATH, the caller's run path, a copy already loaded), then the folder of the CUDA
/// runtime in use, $CUDA_HOME/lib64 and lib, /usr/local/cuda/lib64 and lib. `what` names it in
/// the error sentence ("cuBLASLt").
Status open_library(const std::string& soname, const char* what, void** handle);

}  // namespace flashcpp::cuda::dl
