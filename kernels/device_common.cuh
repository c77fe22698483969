// The one device-helper header of the kernels: fp32 <-> storage-type conversion, the SFU
// sigmoid, the cudaError_t early-return macro, and 16-byte vector loads/stores (surogate::vec).
// Header-only; everything is inlined.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

// Host launchers return the first CUDA error instead of launching the next kernel.
#define SUROGATE_TRY(expr)                \
  do {                                    \
    const cudaError_t err_ = (expr);      \
    if (err_ != cudaSuccess) return err_; \
  } while (0)

namespace surogate {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);  // round to nearest even, as XLA's convert
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);  // round to nearest even
}

// sigmoid(g) = 1 / (1 + 2^(-g log2 e)) on the SFU: ex2.approx and rcp.approx, each within a couple
// of fp32 ulps, far below the 16-bit outputs' rounding and the fp32 tests' tolerance. `1.f / x`
// would be the IEEE division, whose Newton steps and slow-path branch cost ~8 more instructions
// an element; the SwiGLU+LoRA epilogue was issue-bound with it.
// ftz: a 2^-x that flushes to zero only meets 1 + it.
__device__ __forceinline__ float sigmoid(float g) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return r;
}

namespace vec {

using surogate::from_float;
using surogate::to_float;

// Elements of T per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// N (1 or kVec<T>) consecutive elements in their storage form. A vector is kept as one uint4
// (four 32-bit registers; 16-bit elements stay packed in pairs) rather than an array of T, which
// the compiler would spread over one register per 16-bit element.
template <typename T, int N>
struct Raw {
  static_assert(N * sizeof(T) == 16, "a vector moves 16 bytes");
  uint4 u;
};
template <typename T>
struct Raw<T, 1> {
  T v;
};

namespace detail {

__device__ __forceinline__ void unpack_word(float, uint32_t w, float* out) {
  out[0] = __uint_as_float(w);
}
__device__ __forceinline__ void unpack_word(__nv_bfloat16, uint32_t w, float* out) {
  out[0] = __uint_as_float(w << 16);  // element at the lower address sits in the low half
  out[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_word(__half, uint32_t w, float* out) {
  __half2 h;
  memcpy(&h, &w, sizeof(w));
  const float2 f = __half22float2(h);
  out[0] = f.x;
  out[1] = f.y;
}

__device__ __forceinline__ uint32_t pack_word(float, const float* in) {
  return __float_as_uint(in[0]);
}
__device__ __forceinline__ uint32_t pack_word(__nv_bfloat16, const float* in) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(in[0], in[1]);  // round to nearest even
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}
__device__ __forceinline__ uint32_t pack_word(__half, const float* in) {
  const __half2 h = __floats2half2_rn(in[0], in[1]);  // round to nearest even
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}

}  // namespace detail

// Two fp32 values as one 32-bit word of a 16-bit T (round to nearest even; `in[0]` in the low
// half, at the lower address), and back: one packed conversion for two values.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(const float* in) {
  static_assert(sizeof(T) == 2, "pairs of 16-bit elements");
  return detail::pack_word(T{}, in);
}
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t w, float* out) {
  static_assert(sizeof(T) == 2, "pairs of 16-bit elements");
  detail::unpack_word(T{}, w, out);
}

template <typename T, int N>
__device__ __forceinline__ Raw<T, N> load_raw(const T* p) {
  Raw<T, N> r;
  if constexpr (N == 1) {
    r.v = p[0];
  } else {
    r.u = *reinterpret_cast<const uint4*>(p);
  }
  return r;
}

// Streaming load (read once, do not keep in L1): for inputs each element of which is used once.
template <typename T, int N>
__device__ __forceinline__ Raw<T, N> load_raw_stream(const T* p) {
  Raw<T, N> r;
  if constexpr (N == 1) {
    r.v = p[0];
  } else {
    r.u = __ldcs(reinterpret_cast<const uint4*>(p));
  }
  return r;
}

// load_raw_stream when kStream, else load_raw: kernels with a load-hint template flag (launch
// variants measured both ways) call this.
template <typename T, int N, bool kStream>
__device__ __forceinline__ Raw<T, N> load_raw_hint(const T* p) {
  if constexpr (kStream) {
    return load_raw_stream<T, N>(p);
  } else {
    return load_raw<T, N>(p);
  }
}

template <typename T, int N>
__device__ __forceinline__ void unpack(const Raw<T, N>& r, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = to_float(r.v);
  } else {
    constexpr int P = N / 4;  // elements per 32-bit word
    detail::unpack_word(T{}, r.u.x, out + 0 * P);
    detail::unpack_word(T{}, r.u.y, out + 1 * P);
    detail::unpack_word(T{}, r.u.z, out + 2 * P);
    detail::unpack_word(T{}, r.u.w, out + 3 * P);
  }
}

template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  unpack(load_raw<T, N>(p), out);
}

template <typename T, int N>
__device__ __forceinline__ Raw<T, N> pack(const float (&in)[N]) {
  Raw<T, N> r;
  if constexpr (N == 1) {
    r.v = from_float<T>(in[0]);
  } else {
    constexpr int P = N / 4;
    r.u.x = detail::pack_word(T{}, in + 0 * P);
    r.u.y = detail::pack_word(T{}, in + 1 * P);
    r.u.z = detail::pack_word(T{}, in + 2 * P);
    r.u.w = detail::pack_word(T{}, in + 3 * P);
  }
  return r;
}

template <typename T, int N>
__device__ __forceinline__ void store_raw(T* p, const Raw<T, N>& r) {
  if constexpr (N == 1) {
    p[0] = r.v;
  } else {
    *reinterpret_cast<uint4*>(p) = r.u;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  store_raw<T, N>(p, pack<T, N>(in));
}

}  // namespace vec
}  // namespace surogate
