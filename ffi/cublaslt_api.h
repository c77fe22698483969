// cuBLASLt, dlopen()ed once per process: the API table, the per-device handles and the pointer
// alignments; the GEMM setup the FP8 and NVFP4 handlers share builds on it (ffi/cublaslt_matmul.h).
//
// cuBLASLt is not linked: the first call dlopen()s libcublasLt.so.<major of the header>, which
// finds the copy jax's CUDA plugin already loaded into the process (the environment variable
// SUROGATE_JAX_CUBLASLT may name another file). That keeps `import surogate_jax._ffi` free of a
// libcublasLt dependency and avoids a ~0.5 GB static library.
//
// Everything here is `inline` in a named namespace, so the function-local statics (the loaded
// API table, the per-device handles) exist once in the process, whichever handler asks first.
// Without cublasLt.h at build time SUROGATE_HAVE_CUBLASLT is 0 and only that macro is defined;
// the handlers then report an error at run time.
#pragma once

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define SUROGATE_HAVE_CUBLASLT 1
#else
#define SUROGATE_HAVE_CUBLASLT 0
#endif

#if SUROGATE_HAVE_CUBLASLT

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "ffi/ffi_common.h"

#define SUROGATE_LT_STR2(x) #x
#define SUROGATE_LT_STR(x) SUROGATE_LT_STR2(x)

namespace surogate::ffi_bind::lt {

// The cuBLASLt entry points the handlers use.
struct Api {
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtGetVersion) GetVersion = nullptr;
  decltype(&cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&cublasLtMatmulDescCreate) DescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) DescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) DescSetAttribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) LayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) LayoutDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) PrefCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) PrefDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) PrefSetAttribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) AlgoGetHeuristic = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;
  std::string error;  // non-empty: unusable, and why
};

template <typename F>
inline bool Resolve(void* lib, const char* name, F* out, std::string* error) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr && error->empty()) *error = std::string("symbol ") + name + " not found";
  return *out != nullptr;
}

inline Api Load() {
  Api api;
  std::string tried;
  void* lib = nullptr;
  const char* env = std::getenv("SUROGATE_JAX_CUBLASLT");
  for (const char* name :
       {env, "libcublasLt.so." SUROGATE_LT_STR(CUBLAS_VER_MAJOR), "libcublasLt.so"}) {
    if (name == nullptr || *name == '\0') continue;
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* why = dlerror();
    tried += std::string(tried.empty() ? "" : "; ") + (why ? why : name);
  }
  if (lib == nullptr) {
    api.error = "cannot load cuBLASLt (" + tried +
                "); set SUROGATE_JAX_CUBLASLT to the path of "
                "libcublasLt.so." SUROGATE_LT_STR(CUBLAS_VER_MAJOR);
    return api;
  }
  std::string& e = api.error;
  Resolve(lib, "cublasLtCreate", &api.Create, &e);
  Resolve(lib, "cublasLtGetVersion", &api.GetVersion, &e);
  Resolve(lib, "cublasLtGetStatusString", &api.GetStatusString, &e);
  Resolve(lib, "cublasLtMatmulDescCreate", &api.DescCreate, &e);
  Resolve(lib, "cublasLtMatmulDescDestroy", &api.DescDestroy, &e);
  Resolve(lib, "cublasLtMatmulDescSetAttribute", &api.DescSetAttribute, &e);
  Resolve(lib, "cublasLtMatrixLayoutCreate", &api.LayoutCreate, &e);
  Resolve(lib, "cublasLtMatrixLayoutDestroy", &api.LayoutDestroy, &e);
  Resolve(lib, "cublasLtMatmulPreferenceCreate", &api.PrefCreate, &e);
  Resolve(lib, "cublasLtMatmulPreferenceDestroy", &api.PrefDestroy, &e);
  Resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &api.PrefSetAttribute, &e);
  Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &api.AlgoGetHeuristic, &e);
  Resolve(lib, "cublasLtMatmul", &api.Matmul, &e);
  if (e.empty() && api.GetVersion() / 10000 != CUBLAS_VER_MAJOR) {
    e = "loaded cuBLASLt version " + std::to_string(api.GetVersion()) + " but was built against " +
        "major version " SUROGATE_LT_STR(CUBLAS_VER_MAJOR);
  }
  return api;
}

// The process-wide API table (loaded at the first call, thread-safe).
inline const Api& Get() {
  static const Api api = Load();
  return api;
}

// "<op>: <what> failed: <cuBLAS status string> (status N)".
inline ffi::Error Error(std::string_view op, const char* what, cublasStatus_t s) {
  const char* msg = Get().GetStatusString != nullptr ? Get().GetStatusString(s) : "?";
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " + msg + " (status " +
                              std::to_string(static_cast<int>(s)) + ")");
}

// One cuBLASLt handle per device, created on first use and kept for the process lifetime.
inline ffi::Error Handle(std::string_view op, int device, cublasLtHandle_t* out) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasLtHandle_t h = nullptr;
    const cublasStatus_t s = Get().Create(&h);
    if (s != CUBLAS_STATUS_SUCCESS) return Error(op, "cublasLtCreate", s);
    it = handles.emplace(device, h).first;
  }
  *out = it->second;
  return ffi::Error::Success();
}

// Largest power of two <= 256 dividing the address (cuBLASLt's MIN_ALIGNMENT preferences).
inline int Alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

}  // namespace surogate::ffi_bind::lt

#endif  // SUROGATE_HAVE_CUBLASLT
