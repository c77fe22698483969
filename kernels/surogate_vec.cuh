// Device helpers shared by the element-wise and row-wise kernels (swiglu, rms_norm, add_rms_norm):
// fp32 <-> storage-type conversion and 16-byte vector loads/stores of N consecutive elements.
// Header-only; everything lives in surogate::vec and is inlined.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate::vec {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);  // round to nearest even
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);  // round to nearest even
}

// Elements of T per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// N (1 or kVec<T>) consecutive elements in their storage form: one 16-byte register vector.
template <typename T, int N>
struct Raw {
  static_assert(N == 1 || N * sizeof(T) == 16, "a vector moves 16 bytes");
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Raw<T, N> load_raw(const T* p) {
  Raw<T, N> r;
  if constexpr (N == 1) {
    r.v[0] = p[0];
  } else {
    const uint4 bits = *reinterpret_cast<const uint4*>(p);
    memcpy(&r, &bits, sizeof(bits));
  }
  return r;
}

// Streaming load (read once, do not keep in L1): for inputs each element of which is used once.
template <typename T, int N>
__device__ __forceinline__ Raw<T, N> load_raw_stream(const T* p) {
  Raw<T, N> r;
  if constexpr (N == 1) {
    r.v[0] = p[0];
  } else {
    const uint4 bits = __ldcs(reinterpret_cast<const uint4*>(p));
    memcpy(&r, &bits, sizeof(bits));
  }
  return r;
}

template <typename T, int N>
__device__ __forceinline__ void unpack(const Raw<T, N>& r, float (&out)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float(r.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  unpack(load_raw<T, N>(p), out);
}

template <typename T, int N>
__device__ __forceinline__ Raw<T, N> pack(const float (&in)[N]) {
  Raw<T, N> r;
#pragma unroll
  for (int k = 0; k < N; ++k) r.v[k] = from_float<T>(in[k]);
  return r;
}

template <typename T, int N>
__device__ __forceinline__ void store_raw(T* p, const Raw<T, N>& r) {
  if constexpr (N == 1) {
    p[0] = r.v[0];
  } else {
    uint4 bits;
    memcpy(&bits, &r, sizeof(bits));
    *reinterpret_cast<uint4*>(p) = bits;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  store_raw<T, N>(p, pack<T, N>(in));
}

}  // namespace surogate::vec
