// 8-bit AdamW update kernel (see adamw_8bit.h for the math and the launcher contract).
//
// Floor: memory bound. Bytes that must move per element: parameter read + write (2 * sizeof(TP)),
// gradient read (sizeof(TG)), both 8-bit states read + write (4), plus 2 x (4 + 4) bytes of absmax
// per 256 elements (0.0625). f32 params + f32 grads: 16.06 B/elem; bf16 + bf16: 10.06 B/elem. At
// the H100's ~3000 GB/s measured copy bandwidth, 0.6e9 f32 params -> 9.6 GB -> ~3.2 ms; 1e9 bf16
// params -> 10 GB -> ~3.4 ms. Target >= 75% of that bandwidth. FLOPs are ~30 per element, far
// below the compute roof (~0.3 TFLOP/s needed at full bandwidth).
//
// Design (why):
//  * One warp owns one quantization block of 256 elements, 8 consecutive elements per lane: the
//    loads are 16-byte vectors (two for f32), the block's new absmax is a 5-step shuffle max, and
//    no __syncthreads is needed after the prologue. A persistent grid of 256-thread CTAs strides
//    over the blocks; the last partial block (and misaligned pointers) take a scalar path with
//    bounds checks, padding like the reference (g = 0, p = 0, code of 0.0).
//  * Every operation is written with __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn / __fsqrt_rn:
//    these are never contracted into FMAs, so the rounding follows the reference's op order
//    exactly (the reference pins its own products against XLA's contraction, see the .py file).
//  * Code tables (codes, midpoints) and the bucket guesses live in shared memory (7.3 KB per CTA,
//    loaded once per CTA). Nearest code: bucket of |x|'s float bits -> lower bound of the index ->
//    scan forward over the midpoints (at most 2 steps for these maps). Negative x (signed map)
//    uses the mirror symmetry of the map: index = 254 - (midpoints <= |x|), then the sign guard.
//    That is ~2-3 shared loads per state instead of 8 for a binary search.
//  * Parameters and codes are updated in place (the FFI call aliases them to its outputs); each
//    element is read and then written by the same lane, and a block's absmax is read by all lanes
//    before lane 0 writes it (the shuffles order them), so in-place is safe. Streaming cache hints
//    (ld/st .cs): every byte is touched once.
//  * Deterministic: no atomics; max is order independent.
#include "kernels/adamw_8bit.h"

#include <algorithm>
#include <cstring>

namespace surogate {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kPerLane = kAdamw8bitBlock / kWarp;  // 8
constexpr int kZeroS = 127;                       // index of 0.0 in the signed map
constexpr int kTableSize = 256;

struct Tables {
  float code_s[kTableSize];
  float mid_s[kTableSize];  // 255 midpoints + inf
  float code_u[kTableSize];
  float mid_u[kTableSize];
  uint8_t guess_s[kAdamw8bitBuckets];
  uint8_t guess_u[kAdamw8bitBuckets];
};

struct Scalars {
  float b1, omb1, b2, omb2, step, eps_hat, decay, gscale;
};

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);  // round to nearest even, as XLA's convert
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// 8 consecutive elements from `base` as floats. kVec: the 8 are in range and 16-byte aligned.
template <typename T, bool kVec>
__device__ __forceinline__ void load8(const T* ptr, int64_t base, int64_t n, float (&out)[kPerLane]) {
  if constexpr (kVec) {
    constexpr int kChunks = kPerLane * sizeof(T) / 16;
    uint4 raw[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) raw[c] = __ldcs(reinterpret_cast<const uint4*>(ptr + base) + c);
    T v[kPerLane];
    memcpy(v, raw, sizeof(v));
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) out[k] = to_float(v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) out[k] = base + k < n ? to_float(ptr[base + k]) : 0.f;
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store8(T* ptr, int64_t base, int64_t n, const float (&in)[kPerLane]) {
  if constexpr (kVec) {
    constexpr int kChunks = kPerLane * sizeof(T) / 16;
    T v[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) v[k] = from_float<T>(in[k]);
    uint4 raw[kChunks];
    memcpy(raw, v, sizeof(v));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) __stcs(reinterpret_cast<uint4*>(ptr + base) + c, raw[c]);
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (base + k < n) ptr[base + k] = from_float<T>(in[k]);
    }
  }
}

template <bool kVec>
__device__ __forceinline__ void load_codes(const uint8_t* ptr, int64_t base, int64_t n, uint8_t fill,
                                           uint8_t (&out)[kPerLane]) {
  if constexpr (kVec) {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(ptr + base));
    memcpy(out, &raw, sizeof(out));
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) out[k] = base + k < n ? ptr[base + k] : fill;
  }
}

template <bool kVec>
__device__ __forceinline__ void store_codes(uint8_t* ptr, int64_t base, int64_t n,
                                            const uint8_t (&in)[kPerLane]) {
  if constexpr (kVec) {
    uint2 raw;
    memcpy(&raw, in, sizeof(raw));
    __stcs(reinterpret_cast<uint2*>(ptr + base), raw);
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (base + k < n) ptr[base + k] = in[k];
    }
  }
}

__device__ __forceinline__ int bucket(float t) {
  const int b = static_cast<int>(__float_as_uint(t) >> (23 - kAdamw8bitBucketBits)) -
                (kAdamw8bitBucketE0 << kAdamw8bitBucketBits);
  return min(max(b, 0), kAdamw8bitBuckets - 1);
}

// searchsorted(mid_s, x, "left") plus the sign guard (see adamw_8bit.py `quantize`).
__device__ __forceinline__ uint8_t quantize_signed(float x, const Tables& tb) {
  const float t = fabsf(x);
  int q = tb.guess_s[bucket(t)];
  if (!(x < 0.f)) {
    while (tb.mid_s[q] < t) ++q;  // mid_s[255] = inf stops it
    return static_cast<uint8_t>(q);
  }
  while (q < 255 && tb.mid_s[q] <= t) ++q;
  q = max(254 - q, 0);
  return static_cast<uint8_t>(q >= kZeroS ? q - 1 : q);
}

__device__ __forceinline__ uint8_t quantize_unsigned(float x, const Tables& tb) {
  int q = tb.guess_u[bucket(x)];
  while (tb.mid_u[q] < x) ++q;
  return static_cast<uint8_t>(q);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename TP, typename TG, bool kVec>
__device__ __forceinline__ void update_block(int64_t blk, int lane, TP* p, const TG* g, uint8_t* qm,
                                             uint8_t* qv, float* absmax_m, float* absmax_v,
                                             int64_t n, const Scalars& s, const Tables& tb) {
  const int64_t base = blk * kAdamw8bitBlock + static_cast<int64_t>(lane) * kPerLane;
  float gv[kPerLane], pv[kPerLane], m[kPerLane], v[kPerLane];
  uint8_t cm[kPerLane], cv[kPerLane];
  load8<TG, kVec>(g, base, n, gv);
  load8<TP, kVec>(p, base, n, pv);
  load_codes<kVec>(qm, base, n, static_cast<uint8_t>(kZeroS), cm);
  load_codes<kVec>(qv, base, n, 0, cv);
  const float am = absmax_m[blk], av = absmax_v[blk];

  bool ok[kPerLane];
  float lm = 0.f, lv = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const float gs = __fmul_rn(gv[k], s.gscale);
    ok[k] = isfinite(gs);
    const float m0 = __fmul_rn(tb.code_s[cm[k]], am);
    const float v0 = __fmul_rn(tb.code_u[cv[k]], av);
    const float m1 = __fadd_rn(__fmul_rn(s.b1, m0), __fmul_rn(s.omb1, gs));
    const float v1 = __fadd_rn(__fmul_rn(s.b2, v0), __fmul_rn(__fmul_rn(s.omb2, gs), gs));
    m[k] = ok[k] ? m1 : m0;
    v[k] = ok[k] ? v1 : v0;
    lm = fmaxf(lm, fabsf(m[k]));
    lv = fmaxf(lv, v[k]);
  }
  lm = warp_max(lm);
  lv = warp_max(lv);
  if (lane == 0) {
    absmax_m[blk] = lm;
    absmax_v[blk] = lv;
  }
  const float inv_m = lm > 0.f ? __fdiv_rn(1.f, lm) : 0.f;
  const float inv_v = lv > 0.f ? __fdiv_rn(1.f, lv) : 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (ok[k]) {
      const float u = __fdiv_rn(m[k], __fadd_rn(__fsqrt_rn(v[k]), s.eps_hat));
      pv[k] = __fmul_rn(__fsub_rn(pv[k], __fmul_rn(s.step, u)), s.decay);
    }
    cm[k] = quantize_signed(__fmul_rn(m[k], inv_m), tb);
    cv[k] = quantize_unsigned(__fmul_rn(v[k], inv_v), tb);
  }
  store8<TP, kVec>(p, base, n, pv);
  store_codes<kVec>(qm, base, n, cm);
  store_codes<kVec>(qv, base, n, cv);
}

template <typename TP, typename TG>
__global__ void __launch_bounds__(kThreads, 4)  // 64 registers: 32 warps per SM, plenty of loads in flight
    adamw_8bit_kernel(TP* p, const TG* __restrict__ g, uint8_t* qm, uint8_t* qv, float* absmax_m,
                      float* absmax_v, const float* __restrict__ scalars,
                      const float* __restrict__ tables, const uint8_t* __restrict__ guess,
                      int64_t n, int64_t nblocks, bool aligned) {
  __shared__ Tables tb;
  {
    float* dst = tb.code_s;  // code_s, mid_s, code_u, mid_u are contiguous
    for (int i = threadIdx.x; i < 4 * kTableSize; i += blockDim.x) dst[i] = tables[i];
    for (int i = threadIdx.x; i < 2 * kAdamw8bitBuckets; i += blockDim.x) {
      (i < kAdamw8bitBuckets ? tb.guess_s[i] : tb.guess_u[i - kAdamw8bitBuckets]) = guess[i];
    }
  }
  const Scalars s{scalars[0], scalars[1], scalars[2], scalars[3],
                  scalars[4], scalars[5], scalars[6], scalars[7]};
  __syncthreads();

  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarp);
  const int64_t full = n / kAdamw8bitBlock;  // blocks with all 256 elements in range
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
       blk < nblocks; blk += warps) {
    if (aligned && blk < full) {
      update_block<TP, TG, true>(blk, lane, p, g, qm, qv, absmax_m, absmax_v, n, s, tb);
    } else {
      update_block<TP, TG, false>(blk, lane, p, g, qm, qv, absmax_m, absmax_v, n, s, tb);
    }
  }
}

#define SUROGATE_TRY(expr)                \
  do {                                    \
    const cudaError_t err_ = (expr);      \
    if (err_ != cudaSuccess) return err_; \
  } while (0)

bool aligned_to(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

template <typename TP, typename TG>
cudaError_t adamw_8bit_update(TP* p, const TG* g, uint8_t* qm, uint8_t* qv, float* absmax_m,
                              float* absmax_v, const float* scalars, const float* tables,
                              const uint8_t* guess, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t nblocks = (n + kAdamw8bitBlock - 1) / kAdamw8bitBlock;
  const bool aligned = aligned_to(p, 16) && aligned_to(g, 16) && aligned_to(qm, 8) && aligned_to(qv, 8);
  int dev = 0, sms = 0, per_sm = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  SUROGATE_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  SUROGATE_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adamw_8bit_kernel<TP, TG>,
                                                             kThreads, 0));
  const int64_t need = (nblocks + kThreads / kWarp - 1) / (kThreads / kWarp);
  const int64_t fit = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(need, fit)));
  adamw_8bit_kernel<TP, TG><<<grid, kThreads, 0, stream>>>(p, g, qm, qv, absmax_m, absmax_v, scalars,
                                                           tables, guess, n, nblocks, aligned);
  return cudaGetLastError();
}

#define SUROGATE_ADAMW8_INSTANTIATE(TP, TG)                                                      \
  template cudaError_t adamw_8bit_update<TP, TG>(TP*, const TG*, uint8_t*, uint8_t*, float*,    \
                                                 float*, const float*, const float*,             \
                                                 const uint8_t*, int64_t, cudaStream_t);

SUROGATE_ADAMW8_INSTANTIATE(float, float)
SUROGATE_ADAMW8_INSTANTIATE(float, __nv_bfloat16)
SUROGATE_ADAMW8_INSTANTIATE(float, __half)
SUROGATE_ADAMW8_INSTANTIATE(__nv_bfloat16, float)
SUROGATE_ADAMW8_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
SUROGATE_ADAMW8_INSTANTIATE(__nv_bfloat16, __half)
SUROGATE_ADAMW8_INSTANTIATE(__half, float)
SUROGATE_ADAMW8_INSTANTIATE(__half, __nv_bfloat16)
SUROGATE_ADAMW8_INSTANTIATE(__half, __half)

}  // namespace surogate
