// cuBLAS and cuBLASLt opened at their first use (cublas_dl.h says why).
#include "cuda/common/cublas_dl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace flashcpp::cuda::dl {
namespace {

// Where open_library looks after the loader's own search, in order, without repeats.
std::vector<std::string> fallback_folders() {
  std::vector<std::string> out;
  auto add = [&out](const std::string& folder) {
    if (!folder.empty() && std::find(out.begin(), out.end(), folder) == out.end()) out.push_back(folder);
  };
  // The CUDA runtime in use (a shared libcudart sits beside the toolkit's cuBLAS; with the static
  // runtime this is the module that holds it, which costs one more look).
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&cudaRuntimeGetVersion), &info) != 0 && info.dli_fname != nullptr)
    add(std::filesystem::path(info.dli_fname).parent_path().string());
  if (const char* home = std::getenv("CUDA_HOME"); home != nullptr && *home != '\0') {
    add(std::string(home) + "/lib64");
    add(std::string(home) + "/lib");
  }
  add("/usr/local/cuda/lib64");
  add("/usr/local/cuda/lib");
  return out;
}

// One library's table and how its loading went, made once per process (cublas(), cublaslt()).
template <class Table>
struct Loaded {
  Table table;
  Status status = Status::Ok();
};

#define FLASHCPP_DL_RESOLVE(name)                                           \
  if (void* f = dlsym(handle, #name)) {                                     \
    t->name = reinterpret_cast<decltype(t->name)>(f);                       \
  } else {                                                                  \
    missing += missing.empty() ? #name : ", " #name;                        \
  }

// Fills the table from the opened library; the names it lacks go to `missing`.
void resolve(void* handle, Cublas* t, std::string& missing) { FLASHCPP_CUBLAS_FUNCTIONS(FLASHCPP_DL_RESOLVE) }
void resolve(void* handle, CublasLt* t, std::string& missing) { FLASHCPP_CUBLASLT_FUNCTIONS(FLASHCPP_DL_RESOLVE) }
#undef FLASHCPP_DL_RESOLVE

template <class Table>
Loaded<Table> load(const char* stem, const char* what) {
  Loaded<Table> out;
  const std::string soname = std::string(stem) + ".so." + std::to_string(CUBLAS_VER_MAJOR);
  void* handle = nullptr;
  out.status = open_library(soname, what, &handle);
  if (!out.status.ok()) return out;
  std::string missing;
  resolve(handle, &out.table, missing);
  if (!missing.empty())
    out.status = Status::Cuda(std::string(what) + " (" + soname + ") was loaded but lacks " + missing +
                              "; flashcpp was built against cuBLAS " + std::to_string(CUBLAS_VER_MAJOR) +
                              ", so that library's version does not match");
  return out;  // the handle stays open for the life of the process
}

}  // namespace

Status open_library(const std::string& soname, const char* what, void** handle) {
  *handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (*handle != nullptr) return Status::Ok();
  const char* first = dlerror();
  const std::string first_error = first != nullptr ? first : "not found";
  std::string looked = "the dynamic loader's search path";
  for (const std::string& folder : fallback_folders()) {
    const std::string path = folder + "/" + soname;
    *handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (*handle != nullptr) return Status::Ok();
    looked += ", " + folder;
  }
  return Status::Cuda(std::string(what) + " (" + soname + ") could not be loaded: " + first_error + ". Looked in " +
                      looked + ". It comes with the CUDA toolkit (or pip's nvidia-cublas package): put its lib " +
                      "folder on LD_LIBRARY_PATH or set CUDA_HOME");
}

namespace {
// The table, loaded at the first call for each Table (a function-local static: once, thread-safe).
template <class Table>
Status opened(const char* stem, const char* what, const Table** out) {
  static const Loaded<Table> loaded = load<Table>(stem, what);
  *out = loaded.status.ok() ? &loaded.table : nullptr;
  return loaded.status;
}
}  // namespace

Status cublas(const Cublas** out) { return opened("libcublas", "cuBLAS", out); }
Status cublaslt(const CublasLt** out) { return opened("libcublasLt", "cuBLASLt", out); }

}  // namespace flashcpp::cuda::dl
