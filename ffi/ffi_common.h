// Helpers shared by the XLA FFI handlers in ffi/*.cc: dtype names and dispatch, shape checks,
// CUDA error -> ffi::Error, and the registration table type that module.cc exports to Python.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

namespace surogate::ffi_bind {

namespace ffi = xla::ffi;

// Trait list for handlers that only launch kernels (or async memset/copy) on XLA's stream: no
// allocation, no synchronization, no stream query. XLA may then record the call into its command
// buffers (CUDA graphs) together with the fusions around it; without the trait every call ends
// the graph of the layer scan's body there (measured in benchmarks/kernels_in_model.py).
#define SUROGATE_GRAPH_SAFE {::xla::ffi::Traits::kCmdBufferCompatible}

// Every handler in ffi/ is defined twice from one binding: `fn` with SUROGATE_GRAPH_SAFE and
// `fn##NoGraph` without. Which set is registered is chosen at import (SUROGATE_JAX_FFI_GRAPHS=0
// picks the second, see surogate_jax/ops/_loader.py): an A/B switch for measurements and a way
// out should a CUDA / XLA version mis-record one of our calls into a graph.
#define SUROGATE_DEFINE_HANDLER(fn, impl, binding)                                     \
  XLA_FFI_DEFINE_HANDLER_EXPLICIT_WITH_TRAITS(fn, impl, binding, SUROGATE_GRAPH_SAFE); \
  XLA_FFI_DEFINE_HANDLER_EXPLICIT(fn##NoGraph, impl, binding)

// One FFI target an ffi/<op>.cc exports: its name and both handler flavours.
struct Target {
  const char* name;
  XLA_FFI_Handler* graph_safe;
  XLA_FFI_Handler* no_graph;
};
#define SUROGATE_TARGET(name, fn) \
  ::surogate::ffi_bind::Target { name, fn, fn##NoGraph }

// The targets an ffi/<op>.cc exports; module.cc registers them all.
using Targets = std::vector<Target>;

inline std::string DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::F8E4M3FN:
      return "float8_e4m3fn";
    case ffi::DataType::F8E5M2:
      return "float8_e5m2";
    default:
      return "dtype#" + std::to_string(static_cast<int>(t));
  }
}

inline ffi::Error InvalidArg(std::string_view op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

inline ffi::Error CudaError(std::string_view op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error " + cudaGetErrorName(err) + " (" +
                              cudaGetErrorString(err) + ")");
}

// A buffer's data as T (after DispatchFloat picked T): an operand, a result.
template <typename T>
const T* In(const ffi::AnyBuffer& b) {
  return static_cast<const T*>(b.untyped_data());
}
template <typename T>
T* Out(ffi::Result<ffi::AnyBuffer>& b) {
  return static_cast<T*>(b->untyped_data());
}

// Calls f(T{}) with T the CUDA type of a float32 / bfloat16 / float16 dtype; errors otherwise.
template <typename F>
ffi::Error DispatchFloat(std::string_view op, ffi::DataType t, F&& f) {
  switch (t) {
    case ffi::DataType::F32:
      return f(float{});
    case ffi::DataType::BF16:
      return f(__nv_bfloat16{});
    case ffi::DataType::F16:
      return f(__half{});
    default:
      return InvalidArg(
          op, "unsupported dtype " + DtypeName(t) + "; expected float32, bfloat16 or float16");
  }
}

// DispatchFloat plus float8_e4m3fn (__nv_fp8_e4m3): the outputs of the dequantization ops.
template <typename F>
ffi::Error DispatchFloatOrE4m3(std::string_view op, ffi::DataType t, F&& f) {
  if (t == ffi::DataType::F8E4M3FN) return f(__nv_fp8_e4m3{});
  if (t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16) {
    return DispatchFloat(op, t, std::forward<F>(f));
  }
  return InvalidArg(op, "unsupported dtype " + DtypeName(t) +
                            "; expected float32, bfloat16, float16 or float8_e4m3fn");
}

inline ffi::Error ExpectDtype(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                              ffi::DataType want) {
  if (b.element_type() == want) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has dtype " + DtypeName(b.element_type()) +
                            ", expected " + DtypeName(want));
}

// InvalidArg unless p is 16-byte aligned; `needs` names what requires it (vector loads, cuBLASLt).
inline ffi::Error ExpectAligned16(std::string_view op, const char* name, const void* p,
                                  const char* needs) {
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return ffi::Error::Success();
  return InvalidArg(op,
                    std::string(name) + " is not 16-byte aligned, which " + needs + " requires");
}

inline std::string ShapeStr(const ffi::AnyBuffer& b) {
  std::string s = "[";
  for (size_t i = 0; i < b.dimensions().size(); ++i) {
    s += (i ? ", " : "") + std::to_string(b.dimensions()[i]);
  }
  return s + "]";
}

// InvalidArg unless b has `want` elements; `why` says where that count comes from.
inline ffi::Error ExpectCount(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                              int64_t want, const std::string& why) {
  if (static_cast<int64_t>(b.element_count()) == want) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + ", expected " +
                            std::to_string(want) + " elements (" + why + ")");
}

// [..., D] -> (rows = product of the leading dims, D). Rank 0 is an error.
inline ffi::Error RowsAndDim(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                             int64_t* rows, int64_t* dim) {
  const auto dims = b.dimensions();
  if (dims.size() == 0) return InvalidArg(op, std::string(name) + " must have rank >= 1");
  *dim = dims.back();
  *rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) *rows *= dims[i];
  return ffi::Error::Success();
}

}  // namespace surogate::ffi_bind
