// 8-bit AdamW update kernel (see adamw_8bit.h for the math, the tables and the launcher contract).
//
// Floor: memory bound. Bytes that must move per element: parameter read + write (2 * sizeof(TP)),
// gradient read (sizeof(TG)), both 8-bit states read + write (4), plus 2 x (4 + 4) bytes of absmax
// per 256 elements (0.0625): 16.06 B/elem for f32 params and grads, 10.06 for bf16/bf16. The
// binding budget besides DRAM is the instruction issue rate: at 3 TB/s an H100 has ~160
// thread-instructions per element for f32/f32 and ~100 for bf16/bf16, so the code below is kept
// straight-line and short (~95 per element; benchmarks/notes_adamw_8bit.md has the counts and the
// measured 86% / 78% of the copy bandwidth).
//
// Design (why):
//  * One warp owns one quantization block of 256 elements, 8 per lane: the block's new absmax is a
//    5-step shuffle max and no __syncthreads is needed after the prologue. Lane l holds elements
//    4l..4l+3 and 128+4l..128+4l+3 when a 4-byte type is involved (each load instruction then
//    covers 512 contiguous bytes, no sector is fetched twice), else 8l..8l+7 (one 16-byte load).
//    A persistent grid of 256-thread CTAs strides over the blocks; the last partial block (and
//    misaligned pointers) take a scalar path with bounds checks, padding like the reference
//    (g = 0, p = 0, code of 0.0).
//  * Every operation is written with __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn / __fsqrt_rn:
//    these are never contracted into FMAs, so the rounding follows the reference's op order
//    exactly (the reference pins its own products against XLA's contraction, see the .py file).
//  * Nearest code: one shared-memory probe, no loop, no branch (a scan over the midpoints loops a
//    data-dependent number of times and diverges on the sign within a warp). The float bits of
//    t = |x| pick a bucket (exponent and top 6 / 7 mantissa bits); the tables are built so every
//    bucket holds at most one midpoint, so searchsorted(mid, t) = (midpoints below the bucket)
//    + (that midpoint < t), and inside one bucket float order is the integer order of the low
//    mantissa bits, so the entry packs both into one word. Negative x (signed map) uses the
//    mirror symmetry: index = 254 - (midpoints <= |x|), then the sign guard, as a clamp to
//    [0, 126]. adamw_8bit.py `lookup_np` is the same arithmetic, tested against searchsorted.
//  * The skip of non-finite gradients is a select, not a branch, so the divide and square root
//    of all 8 elements are independent and overlap the shuffle reduction.
//  * Parameters and codes are updated in place (the FFI call aliases them to its outputs); each
//    element is read and then written by the same lane, and a block's absmax is read by all lanes
//    before lane 0 writes it (the shuffles order them), so in-place is safe. Streaming cache hints
//    (ld/st .cs): every byte is touched once.
//  * Deterministic: no atomics; max is order independent.
#include "kernels/adamw_8bit.h"
#include "kernels/device_common.cuh"

#include <algorithm>
#include <cstddef>
#include <type_traits>

namespace surogate {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarp;
constexpr int kPerLane = kAdamw8bitBlock / kWarp;  // 8
constexpr int kZeroS = 127;                        // index of 0.0 in the signed map
constexpr int kTableSize = 256;

struct Scalars {
  float b1, omb1, b2, omb2, step, eps_hat, decay, gscale;
};

__device__ __forceinline__ Scalars load_scalars(const float* __restrict__ s) {
  return Scalars{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]};
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Smem {
  float code_s[kTableSize];
  float code_u[kTableSize];
  uint32_t look_s[kAdamw8bitBucketsS];
  uint32_t look_u[kAdamw8bitBucketsU];
};
// The kernel copies aux into Smem word for word: the layouts must agree.
static_assert(offsetof(Smem, look_s) == 4 * kAdamw8bitAuxLookupS &&
                  offsetof(Smem, look_u) == 4 * kAdamw8bitAuxLookupU &&
                  sizeof(Smem) == 4 * kAdamw8bitAuxWords,
              "Smem must match the aux layout of adamw_8bit.h");
static_assert(sizeof(Smem) % 16 == 0, "Smem is filled with 16-byte copies");

// The 8 elements of a lane as raw 32-bit words, in element order (2 * sizeof(T) words each).
template <typename TP, typename TG>
struct Raw {
  uint32_t p[2 * sizeof(TP)];
  uint32_t g[2 * sizeof(TG)];
  uint32_t cm[2], cv[2];
  float am, av;
};

template <typename TP, typename TG>
constexpr bool kSplit = sizeof(TP) == 4 || sizeof(TG) == 4;

template <typename T>
__device__ __forceinline__ float word_get(const uint32_t* w, int k) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[k]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float((k & 1) ? (w[k >> 1] & 0xffff0000u) : (w[k >> 1] << 16));
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w[k >> 1] >> (16 * (k & 1)))));
  }
}

template <typename T>
__device__ __forceinline__ void word_put(uint32_t* w, int k, float v) {
  if constexpr (sizeof(T) == 4) {
    w[k] = __float_as_uint(v);
  } else {
    unsigned short b;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      b = __bfloat16_as_ushort(__float2bfloat16(v));
    } else {
      b = __half_as_ushort(__float2half(v));
    }
    if (k & 1) {
      w[k >> 1] |= static_cast<uint32_t>(b) << 16;
    } else {
      w[k >> 1] = b;
    }
  }
}

// Vector load / store of a lane's 8 elements (kSplitMap: two halves of 4, else 8 contiguous).
template <typename T, bool kSplitMap>
__device__ __forceinline__ void load_words(const T* ptr, int64_t base, int lane,
                                           uint32_t (&w)[2 * sizeof(T)]) {
  if constexpr (kSplitMap) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const T* a = ptr + base + h * (kAdamw8bitBlock / 2) + 4 * lane;
      if constexpr (sizeof(T) == 4) {
        const uint4 v = __ldcs(reinterpret_cast<const uint4*>(a));
        w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
      } else {
        const uint2 v = __ldcs(reinterpret_cast<const uint2*>(a));
        w[2 * h] = v.x, w[2 * h + 1] = v.y;
      }
    }
  } else {
    static_assert(sizeof(T) == 2, "the contiguous map is for 16-bit types");
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(ptr + base + kPerLane * lane));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
}

template <typename T, bool kSplitMap>
__device__ __forceinline__ void store_words(T* ptr, int64_t base, int lane,
                                            const uint32_t (&w)[2 * sizeof(T)]) {
  if constexpr (kSplitMap) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      T* a = ptr + base + h * (kAdamw8bitBlock / 2) + 4 * lane;
      if constexpr (sizeof(T) == 4) {
        __stcs(reinterpret_cast<uint4*>(a),
               make_uint4(w[4 * h], w[4 * h + 1], w[4 * h + 2], w[4 * h + 3]));
      } else {
        __stcs(reinterpret_cast<uint2*>(a), make_uint2(w[2 * h], w[2 * h + 1]));
      }
    }
  } else {
    __stcs(reinterpret_cast<uint4*>(ptr + base + kPerLane * lane),
           make_uint4(w[0], w[1], w[2], w[3]));
  }
}

template <bool kSplitMap>
__device__ __forceinline__ void load_code_words(const uint8_t* q, int64_t base, int lane,
                                                uint32_t (&w)[2]) {
  if constexpr (kSplitMap) {
    w[0] = __ldcs(reinterpret_cast<const unsigned int*>(q + base + 4 * lane));
    w[1] = __ldcs(reinterpret_cast<const unsigned int*>(q + base + kAdamw8bitBlock / 2 + 4 * lane));
  } else {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(q + base + kPerLane * lane));
    w[0] = v.x, w[1] = v.y;
  }
}

template <bool kSplitMap>
__device__ __forceinline__ void store_code_words(uint8_t* q, int64_t base, int lane,
                                                 const uint32_t (&w)[2]) {
  if constexpr (kSplitMap) {
    __stcs(reinterpret_cast<unsigned int*>(q + base + 4 * lane), w[0]);
    __stcs(reinterpret_cast<unsigned int*>(q + base + kAdamw8bitBlock / 2 + 4 * lane), w[1]);
  } else {
    __stcs(reinterpret_cast<uint2*>(q + base + kPerLane * lane), make_uint2(w[0], w[1]));
  }
}

__device__ __forceinline__ uint32_t code_byte(const uint32_t (&w)[2], int k) {
  return (w[k >> 2] >> (8 * (k & 3))) & 0xffu;
}

// Bucket of a non-negative float's bits: exponent 102..127 and the top kBits mantissa bits;
// smaller values share bucket 0, larger (and NaN) the last one (neither holds a midpoint).
template <int kBits>
__device__ __forceinline__ uint32_t lookup_bucket(uint32_t bits) {
  const int b = static_cast<int>(bits >> (23 - kBits)) - (kAdamw8bitBucketE0 << kBits);
  return static_cast<uint32_t>(min(max(b, 0), ((127 - kAdamw8bitBucketE0 + 1) << kBits) - 1));
}

// searchsorted(mid_s, x, "left") plus the sign guard, as adamw_8bit.py `quantize`.
__device__ __forceinline__ uint32_t quantize_signed(float x, const uint32_t* __restrict__ look) {
  constexpr int kLow = 23 - kAdamw8bitBitsS;  // 17 low mantissa bits compared inside a bucket
  const uint32_t tb = __float_as_uint(fabsf(x));
  const uint32_t e = look[lookup_bucket<kAdamw8bitBitsS>(tb)];
  const uint32_t neg = x < 0.f ? 1u : 0u;
  // x >= 0: midpoints < t; x < 0: midpoints <= t (that is < t + 1 ulp inside the bucket)
  const uint32_t q =
      (e >> (kLow + 1)) + ((e & ((2u << kLow) - 1)) < (tb & ((1u << kLow) - 1)) + neg ? 1u : 0u);
  const int r = min(max(254 - static_cast<int>(q), 0), kZeroS - 1);  // mirror, then the sign guard
  return neg ? static_cast<uint32_t>(r) : q;
}

// searchsorted(mid_u, x, "left") for x >= 0.
__device__ __forceinline__ uint32_t quantize_unsigned(float x, const uint32_t* __restrict__ look) {
  constexpr int kLow = 23 - kAdamw8bitBitsU;  // 16
  const uint32_t tb = __float_as_uint(x);
  const uint32_t e = look[lookup_bucket<kAdamw8bitBitsU>(tb)];
  return (e >> (kLow + 1)) + ((e & ((2u << kLow) - 1)) < (tb & ((1u << kLow) - 1)) ? 1u : 0u);
}

// The block math of one lane on floats; codes in and out as packed words. Writes p (new
// parameters as floats), cm/cv (new codes) and the block's new absmax (identical in every lane).
__device__ __forceinline__ void block_math(const Smem& sm, const Scalars& s,
                                           const float (&gv)[kPerLane], float (&pv)[kPerLane],
                                           uint32_t (&cm)[2], uint32_t (&cv)[2], float am, float av,
                                           float& am_out, float& av_out) {
  float m[kPerLane], v[kPerLane], u[kPerLane];
  uint32_t ok = 0u;
  float lm = 0.f, lv = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const float gs = __fmul_rn(gv[k], s.gscale);
    const bool fin = isfinite(gs);
    ok |= fin ? 1u << k : 0u;
    const float m0 = __fmul_rn(sm.code_s[code_byte(cm, k)], am);
    const float v0 = __fmul_rn(sm.code_u[code_byte(cv, k)], av);
    const float m1 = __fadd_rn(__fmul_rn(s.b1, m0), __fmul_rn(s.omb1, gs));
    const float v1 = __fadd_rn(__fmul_rn(s.b2, v0), __fmul_rn(__fmul_rn(s.omb2, gs), gs));
    m[k] = fin ? m1 : m0;
    v[k] = fin ? v1 : v0;
    lm = fmaxf(lm, fabsf(m[k]));
    lv = fmaxf(lv, v[k]);
    // ptxas branches to an exact slow path around each div/sqrt; a straight-line form with one
    // fallback (tag pre-cleanup) saves ~8 instructions per element but was not faster end to end.
    u[k] = __fdiv_rn(m[k], __fadd_rn(__fsqrt_rn(v[k]), s.eps_hat));
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const float p1 = __fmul_rn(__fsub_rn(pv[k], __fmul_rn(s.step, u[k])), s.decay);
    pv[k] = (ok & (1u << k)) ? p1 : pv[k];
  }
  lm = warp_max(lm);
  lv = warp_max(lv);
  am_out = lm;
  av_out = lv;
  const float inv_m = lm > 0.f ? __fdiv_rn(1.f, lm) : 0.f;
  const float inv_v = lv > 0.f ? __fdiv_rn(1.f, lv) : 0.f;
  cm[0] = cm[1] = cv[0] = cv[1] = 0u;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    cm[k >> 2] |= quantize_signed(__fmul_rn(m[k], inv_m), sm.look_s) << (8 * (k & 3));
    cv[k >> 2] |= quantize_unsigned(__fmul_rn(v[k], inv_v), sm.look_u) << (8 * (k & 3));
  }
}

template <typename TP, typename TG>
__device__ __forceinline__ void load_block(Raw<TP, TG>& r, int64_t blk, int lane, const TP* p,
                                           const TG* g, const uint8_t* qm, const uint8_t* qv,
                                           const float* absmax_m, const float* absmax_v) {
  constexpr bool kS = kSplit<TP, TG>;
  const int64_t base = blk * kAdamw8bitBlock;
  load_words<TG, kS>(g, base, lane, r.g);
  load_words<TP, kS>(p, base, lane, r.p);
  load_code_words<kS>(qm, base, lane, r.cm);
  load_code_words<kS>(qv, base, lane, r.cv);
  r.am = absmax_m[blk];
  r.av = absmax_v[blk];
}

template <typename TP, typename TG>
__device__ __forceinline__ void update_full_block(Raw<TP, TG>& r, int64_t blk, int lane, TP* p,
                                                  uint8_t* qm, uint8_t* qv, float* absmax_m,
                                                  float* absmax_v, const Scalars& s,
                                                  const Smem& sm) {
  constexpr bool kS = kSplit<TP, TG>;
  float gv[kPerLane], pv[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    gv[k] = word_get<TG>(r.g, k);
    pv[k] = word_get<TP>(r.p, k);
  }
  float am1, av1;
  block_math(sm, s, gv, pv, r.cm, r.cv, r.am, r.av, am1, av1);
  if (lane == 0) {
    absmax_m[blk] = am1;
    absmax_v[blk] = av1;
  }
  uint32_t pw[2 * sizeof(TP)];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) word_put<TP>(pw, k, pv[k]);
  const int64_t base = blk * kAdamw8bitBlock;
  store_words<TP, kS>(p, base, lane, pw);
  store_code_words<kS>(qm, base, lane, r.cm);
  store_code_words<kS>(qv, base, lane, r.cv);
}

// Any block (the partial last one, or misaligned pointers): element loads with bounds checks.
template <typename TP, typename TG>
__device__ __forceinline__ void update_any_block(int64_t blk, int lane, TP* p, const TG* g,
                                                 uint8_t* qm, uint8_t* qv, float* absmax_m,
                                                 float* absmax_v, int64_t n, const Scalars& s,
                                                 const Smem& sm) {
  const int64_t base = blk * kAdamw8bitBlock + static_cast<int64_t>(lane) * kPerLane;
  float gv[kPerLane], pv[kPerLane];
  uint32_t cm[2] = {0u, 0u}, cv[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const bool in = base + k < n;
    gv[k] = in ? to_float(g[base + k]) : 0.f;
    pv[k] = in ? to_float(p[base + k]) : 0.f;
    cm[k >> 2] |= static_cast<uint32_t>(in ? qm[base + k] : static_cast<uint8_t>(kZeroS))
                  << (8 * (k & 3));
    cv[k >> 2] |= static_cast<uint32_t>(in ? qv[base + k] : 0) << (8 * (k & 3));
  }
  float am1, av1;
  block_math(sm, s, gv, pv, cm, cv, absmax_m[blk], absmax_v[blk], am1, av1);
  if (lane == 0) {
    absmax_m[blk] = am1;
    absmax_v[blk] = av1;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (base + k < n) {
      p[base + k] = from_float<TP>(pv[k]);
      qm[base + k] = static_cast<uint8_t>(code_byte(cm, k));
      qv[base + k] = static_cast<uint8_t>(code_byte(cv, k));
    }
  }
}

template <typename TP, typename TG>
__global__ void __launch_bounds__(kThreads, 4)  // 64 registers: 32 warps per SM
    kernel(TP* p, const TG* __restrict__ g, uint8_t* qm, uint8_t* qv, float* absmax_m,
           float* absmax_v, const float* __restrict__ scalars, const uint32_t* __restrict__ aux,
           int64_t n, int64_t nblocks, int64_t nvec) {
  __shared__ __align__(16) Smem sm;
  {
    uint4* dst = reinterpret_cast<uint4*>(&sm);  // aux is laid out as Smem
    const uint4* src = reinterpret_cast<const uint4*>(aux);
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(Smem) / 16); i += blockDim.x) {
      dst[i] = src[i];
    }
  }
  const Scalars s = load_scalars(scalars);
  __syncthreads();

  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  for (int64_t blk = first; blk < nvec; blk += warps) {
    Raw<TP, TG> r;
    load_block(r, blk, lane, p, g, qm, qv, absmax_m, absmax_v);
    update_full_block<TP, TG>(r, blk, lane, p, qm, qv, absmax_m, absmax_v, s, sm);
  }
  // the partial last block, or every block when the pointers do not allow vector access
  for (int64_t blk = nvec + first; blk < nblocks; blk += warps) {
    update_any_block<TP, TG>(blk, lane, p, g, qm, qv, absmax_m, absmax_v, n, s, sm);
  }
}

bool aligned_to(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// CTAs per SM that fit, memoized per host thread (device, kernel): the query costs microseconds
// and every leaf of every step launches.
int ctas_per_sm(const void* kernel, int dev) {
  struct Entry {
    const void* kernel;
    int dev, value;
  };
  thread_local Entry cache[32];
  thread_local int used = 0;
  for (int i = 0; i < used; ++i) {
    if (cache[i].kernel == kernel && cache[i].dev == dev) return cache[i].value;
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess) {
    cudaGetLastError();  // clear it; fall back to one CTA per SM
    per_sm = 1;
  }
  per_sm = std::max(per_sm, 1);
  if (used < 32) cache[used++] = Entry{kernel, dev, per_sm};
  return per_sm;
}

int sm_count(int dev) {
  thread_local int cached_dev = -1, cached = 0;
  if (dev != cached_dev) {
    if (cudaDeviceGetAttribute(&cached, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      cached = 0;
    }
    cached_dev = dev;
  }
  return std::max(cached, 1);
}

}  // namespace

template <typename TP, typename TG>
cudaError_t adamw_8bit_update(TP* p, const TG* g, uint8_t* qm, uint8_t* qv, float* absmax_m,
                              float* absmax_v, const float* scalars, const uint32_t* aux, int64_t n,
                              cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t nblocks = (n + kAdamw8bitBlock - 1) / kAdamw8bitBlock;
  const bool aligned =
      aligned_to(p, 16) && aligned_to(g, 16) && aligned_to(qm, 8) && aligned_to(qv, 8);
  int dev = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  const int64_t need = (nblocks + kWarpsPerCta - 1) / kWarpsPerCta;
  const int64_t nvec = aligned ? n / kAdamw8bitBlock : 0;  // full blocks on the vector path
  const void* fn = reinterpret_cast<const void*>(kernel<TP, TG>);
  const int64_t fit = static_cast<int64_t>(sm_count(dev)) * ctas_per_sm(fn, dev);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(need, fit)));
  kernel<TP, TG><<<grid, kThreads, 0, stream>>>(p, g, qm, qv, absmax_m, absmax_v, scalars, aux, n,
                                                nblocks, nvec);
  return cudaGetLastError();
}

#define SUROGATE_ADAMW8_INSTANTIATE(TP, TG)                                                      \
  template cudaError_t adamw_8bit_update<TP, TG>(TP*, const TG*, uint8_t*, uint8_t*, float*,     \
                                                 float*, const float*, const uint32_t*, int64_t, \
                                                 cudaStream_t);

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
