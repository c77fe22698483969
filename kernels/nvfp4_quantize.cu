// NVFP4 quantizer kernels (see nvfp4_quantize.h for the contract,
// surogate_jax/ops/nvfp4_quantize.py for the formulas).
//
// Floor: memory bound. Per element the quantize pass reads x (2 B bf16 / 4 B f32) and writes
// 0.5 B of codes + 1/16 B of scale (1x16; 1/256 B for 16x16 tiles): 2.5625 B/elt for bf16 1x16.
// The global scale needs amax(x) first, so unless the caller passes amax the amax pass reads x
// once more (+2 B/elt): 4.5625 B/elt. At the H100's ~3000 GB/s measured copy bandwidth:
//   [16384, 4096] bf16 (67.1 M elt): quantize only 172 MB -> 57 us; with the amax pass 306 MB ->
//   102 us [8192, 14336] bf16 (117 M elt):  quantize only 301 MB -> 100 us; with the amax pass 536
//   MB -> 179 us
// (~90 MB total / 50 MB L2, so the second read comes from DRAM.) Compute: about 40 float ops per
// element with Four Over Six (two candidates, squared-error tree) plus ~20 for the RHT butterflies;
// at 1.2 G elt/ms that is ~70 TFLOP/s-equivalent of simple ALU work, close to the H100's fp32 rate,
// so Four Over Six may become ALU bound: the benchmark reports which.
//
// Design (why):
//  * One thread owns one 16-element block (1x16) or one 16-element row segment of a 16x16 tile
//    (the 16 lanes of a half-warp hold the tile's 16 rows and combine amax and squared errors
//    with xor shuffles, whose butterfly order equals the reference's halving tree).
//  * All float arithmetic that the reference rounds uses __f*_rn intrinsics, so nvcc never
//    contracts a multiply and an add into an FMA (that would change bits vs the reference).
//  * 16-byte vector loads only: x must be 16-byte aligned, as every XLA buffer is (and, with
//    cols % 16 == 0, every row). Codes go out as one 8-byte store per block.
//  * amax: an integer atomicMax over float bits (|x| bits order like the floats, NaN above inf),
//    so the result does not depend on the order: deterministic.
#include "kernels/nvfp4_quantize.h"
#include "kernels/device_common.cuh"

#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstring>

namespace surogate {
namespace {

constexpr int kThreads = 256;
constexpr float kFltMax = 3.402823466e+38f;

// 16 consecutive elements as float32 (p 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load16(const T* __restrict__ p, float (&v)[16]) {
  constexpr int kPer = 16 / sizeof(T);  // elements per 16-byte load
#pragma unroll
  for (int q = 0; q < 16 / kPer; ++q) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + q);
    T e[kPer];
    memcpy(e, &raw, sizeof(raw));
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[q * kPer + k] = to_float(e[k]);
  }
}

// v <- (1/4) H16 diag(s) v: sign flips, butterflies h = 1, 2, 4, 8, then * 0.25 (hadamard.py).
__device__ __forceinline__ void rht16(float (&v)[16], int mask) {
#pragma unroll
  for (int j = 0; j < 16; ++j) v[j] = ((mask >> j) & 1) ? -v[j] : v[j];
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = __fadd_rn(a, b);
        v[i + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) v[j] = __fmul_rn(v[j], 0.25f);
}

__device__ __forceinline__ float global_encode_scale(float amax, bool four_over_six) {
  const float num = four_over_six ? 6.0f * 256.0f : 6.0f * 448.0f;
  float s = __fdiv_rn(num, amax);
  if (s > kFltMax) s = kFltMax;
  if (amax == 0.0f) s = 1.0f;
  if (!isfinite(amax)) s = __int_as_float(0x7fc00000);
  return s;
}

__device__ __forceinline__ uint8_t e4m3_rne(float t) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(t, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_to_float(uint8_t s) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(s), __NV_E4M3);
  return __half2float(__half(h));
}

// Round-to-nearest-even E2M1 magnitude code of a >= 0 (> 6 saturates to 7; NaN -> 0).
__device__ __forceinline__ uint32_t e2m1_rne(float a) {
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
         (a > 5.0f);
}

__device__ __forceinline__ float e2m1_value(uint32_t c) {
  return c < 4 ? 0.5f * static_cast<float>(c)
               : (c == 4 ? 2.0f : (c == 5 ? 3.0f : (c == 6 ? 4.0f : 6.0f)));
}

// Stochastic rounding of a >= 0 with u in [0, 1): up with probability (a - lo) / (hi - lo).
__device__ __forceinline__ uint32_t e2m1_stochastic(float a, float u) {
  const uint32_t lo = (a >= 0.5f) + (a >= 1.0f) + (a >= 1.5f) + (a >= 2.0f) + (a >= 3.0f) +
                      (a >= 4.0f) + (a >= 6.0f);
  if (lo == 7) return 7;
  const float step = lo < 4 ? 0.5f : (lo < 6 ? 1.0f : 2.0f);
  return lo + (__fmul_rn(u, step) < __fsub_rn(a, e2m1_value(lo)) ? 1u : 0u);
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
__device__ __forceinline__ uint4 philox(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = c.x * 0xD2511F53u, hi0 = __umulhi(c.x, 0xD2511F53u);
    const uint32_t lo1 = c.z * 0xCD9E8D57u, hi1 = __umulhi(c.z, 0xCD9E8D57u);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

// 16 uniforms in [0, 1) (24 bits each) for the block with linear index `block`.
__device__ __forceinline__ void uniforms16(int64_t block, const uint32_t* seed, float (&u)[16]) {
  const uint32_t k0 = seed[0], k1 = seed[1];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 r = philox(make_uint4(static_cast<uint32_t>(block),
                                      static_cast<uint32_t>(static_cast<uint64_t>(block) >> 32),
                                      static_cast<uint32_t>(j), 0x4E564650u),
                           k0, k1);
    u[4 * j + 0] = static_cast<float>(r.x >> 8) * 0x1p-24f;
    u[4 * j + 1] = static_cast<float>(r.y >> 8) * 0x1p-24f;
    u[4 * j + 2] = static_cast<float>(r.z >> 8) * 0x1p-24f;
    u[4 * j + 3] = static_cast<float>(r.w >> 8) * 0x1p-24f;
  }
}

// Sum over 16 values as [0:8]+[8:16], [0:4]+[4:8], [0:2]+[2:4], [0]+[1] (the reference's tree).
__device__ __forceinline__ float tree16(float (&e)[16]) {
#pragma unroll
  for (int n = 8; n > 0; n >>= 1) {
#pragma unroll
    for (int i = 0; i < n; ++i) e[i] = __fadd_rn(e[i], e[i + n]);
  }
  return e[0];
}

// One scale candidate for a row of 16 values: the E4M3 scale byte, the encode factor r, the
// nibbles (code | sign << 3) packed 2 per byte (element 2j low), and the row's squared error.
struct Candidate {
  uint8_t scale;
  float r;
  uint64_t packed;
  float err;
};

__device__ __forceinline__ Candidate candidate(const float (&v)[16], float block_amax,
                                               float divisor, float s_enc, float s_dec,
                                               bool want_err) {
  Candidate c;
  float t = __fmul_rn(__fdiv_rn(block_amax, divisor), s_enc);
  if (t > 448.0f) t = 448.0f;
  c.scale = e4m3_rne(t);
  const float sf = e4m3_to_float(c.scale);
  c.r = sf == 0.0f ? 0.0f : __fdiv_rn(s_enc, sf);
  c.packed = 0;
  float e[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const float x = __fmul_rn(v[k], c.r);
    const uint32_t code = e2m1_rne(fabsf(x));
    const bool neg = signbit(x);
    c.packed |= static_cast<uint64_t>(code | (neg ? 8u : 0u)) << (4 * k);
    if (want_err) {
      const float mag = e2m1_value(code);
      const float deq = __fmul_rn(__fmul_rn(neg ? -mag : mag, sf), s_dec);
      const float d = __fsub_rn(v[k], deq);
      e[k] = __fmul_rn(d, d);
    }
  }
  c.err = want_err ? tree16(e) : 0.0f;
  return c;
}

__device__ __forceinline__ uint64_t stochastic_codes(const float (&v)[16], float r, int64_t block,
                                                     const uint32_t* seed) {
  float u[16];
  uniforms16(block, seed, u);
  uint64_t packed = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const float x = __fmul_rn(v[k], r);
    const uint32_t code = e2m1_stochastic(fabsf(x), u[k]);
    packed |= static_cast<uint64_t>(code | (signbit(x) ? 8u : 0u)) << (4 * k);
  }
  return packed;
}

struct Params {
  bool four_over_six;
  bool stochastic;
  int rht_sign_mask;
};

__device__ __forceinline__ void scales_of(const float* amax, bool four_over_six, float* s_enc,
                                          float* s_dec) {
  *s_enc = global_encode_scale(*amax, four_over_six);
  *s_dec = __fdiv_rn(1.0f, *s_enc);
}

// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, int64_t nblocks,
                                                        int mask, unsigned int* __restrict__ out) {
  unsigned int m = 0;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < nblocks;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[16];
    load16<T>(x + b * 16, v);
    if (mask >= 0) rht16(v, mask);
#pragma unroll
    for (int k = 0; k < 16; ++k) m = max(m, __float_as_uint(v[k]) & 0x7fffffffu);
  }
  m = __reduce_max_sync(0xffffffffu, m);
  __shared__ unsigned int warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0u;
    m = __reduce_max_sync(0xffffffffu, m);
    if (threadIdx.x == 0 && m != 0) atomicMax(out, m);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quant_1x16_kernel(const T* __restrict__ x, int64_t nblocks, const float* __restrict__ amax,
                      const uint32_t* __restrict__ seed, Params p, uint8_t* __restrict__ codes,
                      uint8_t* __restrict__ scales, float* __restrict__ global_scale) {
  float s_enc, s_dec;
  scales_of(amax, p.four_over_six, &s_enc, &s_dec);
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (first == 0) global_scale[0] = s_dec;
  for (int64_t b = first; b < nblocks; b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[16];
    load16<T>(x + b * 16, v);
    if (p.rht_sign_mask >= 0) rht16(v, p.rht_sign_mask);
    float bmax = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) bmax = fmaxf(bmax, fabsf(v[k]));
    Candidate c = candidate(v, bmax, 6.0f, s_enc, s_dec, p.four_over_six);
    if (p.four_over_six) {
      const Candidate c4 = candidate(v, bmax, 4.0f, s_enc, s_dec, true);
      if (c4.err < c.err) c = c4;  // ties keep 6
    }
    if (p.stochastic) c.packed = stochastic_codes(v, c.r, b, seed);
    reinterpret_cast<uint2*>(codes)[b] =
        make_uint2(static_cast<uint32_t>(c.packed), static_cast<uint32_t>(c.packed >> 32));
    scales[b] = c.scale;
  }
}

// 16x16 tiles. A block of 256 threads covers one row tile (16 rows) x 16 column blocks: the
// half-warp h (0..15) owns column block blockIdx.x % col_groups * 16 + h, its lane l (0..15)
// row l of the tile. Grid: row_tiles_total * col_groups blocks.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quant_16x16_kernel(const T* __restrict__ x, int64_t rows, int64_t kb, int64_t row_tiles,
                       int64_t col_groups, const float* __restrict__ amax,
                       const uint32_t* __restrict__ seed, Params p, uint8_t* __restrict__ codes,
                       uint8_t* __restrict__ scales, float* __restrict__ global_scale) {
  float s_enc, s_dec;
  scales_of(amax, p.four_over_six, &s_enc, &s_dec);
  if (blockIdx.x == 0 && threadIdx.x == 0) global_scale[0] = s_dec;
  const int lane = threadIdx.x & 15, half = threadIdx.x >> 4;
  const int64_t tile_row = blockIdx.x / col_groups;  // over batch * row_tiles
  const int64_t cb = (blockIdx.x % col_groups) * 16 + half;
  const int64_t mat = tile_row / row_tiles, rt = tile_row % row_tiles;
  const int64_t row = rt * 16 + lane;
  const bool active = row < rows && cb < kb;
  const int64_t block = (mat * rows + row) * kb + cb;  // the 1x16 linear index (Philox counter)

  float v[16];
  if (active) {
    load16<T>(x + block * 16, v);
    if (p.rht_sign_mask >= 0) rht16(v, p.rht_sign_mask);
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = 0.0f;
  }
  float bmax = 0.0f;
#pragma unroll
  for (int k = 0; k < 16; ++k) bmax = fmaxf(bmax, fabsf(v[k]));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, o));

  Candidate c = candidate(v, bmax, 6.0f, s_enc, s_dec, p.four_over_six);
  if (p.four_over_six) {
    Candidate c4 = candidate(v, bmax, 4.0f, s_enc, s_dec, true);
    float e6 = c.err, e4 = c4.err;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {  // = the reference's halving tree over the 16 rows
      e6 = __fadd_rn(e6, __shfl_xor_sync(0xffffffffu, e6, o));
      e4 = __fadd_rn(e4, __shfl_xor_sync(0xffffffffu, e4, o));
    }
    if (e4 < e6) c = c4;
  }
  if (!active) return;
  if (p.stochastic) c.packed = stochastic_codes(v, c.r, block, seed);
  reinterpret_cast<uint2*>(codes)[block] =
      make_uint2(static_cast<uint32_t>(c.packed), static_cast<uint32_t>(c.packed >> 32));
  if (lane == 0) scales[(mat * row_tiles + rt) * kb + cb] = c.scale;
}

// ---------------------------------------------------------------------------------------------

template <typename T>
bool aligned16(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int grid_cap() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 1024;
  }
  return std::max(sms, 1) * 8;  // 8 resident blocks of 256 threads per SM
}

}  // namespace

template <typename T>
cudaError_t nvfp4_amax(const T* x, int64_t n, int rht_sign_mask, float* amax, cudaStream_t stream) {
  if (n < 0 || n % 16 != 0 || rht_sign_mask >= (1 << 16)) return cudaErrorInvalidValue;
  SUROGATE_TRY(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  const int64_t nblocks = n / 16;
  if (nblocks == 0) return cudaSuccess;
  const int64_t want = (nblocks + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(std::min<int64_t>(want, grid_cap()));
  if (!aligned16(x)) return cudaErrorMisalignedAddress;
  amax_kernel<T><<<grid, kThreads, 0, stream>>>(x, nblocks, rht_sign_mask,
                                                reinterpret_cast<unsigned int*>(amax));
  return cudaGetLastError();
}

template <typename T>
cudaError_t nvfp4_quantize(const T* x, int64_t batch, int64_t rows, int64_t cols, const float* amax,
                           const uint32_t* seed, const Nvfp4Options& opt, uint8_t* codes,
                           uint8_t* scales, float* global_scale, cudaStream_t stream) {
  if (batch < 0 || rows < 0 || cols <= 0 || cols % 16 != 0 || opt.rht_sign_mask >= (1 << 16)) {
    return cudaErrorInvalidValue;
  }
  if (!aligned16(x)) return cudaErrorMisalignedAddress;
  const Params p{opt.four_over_six, opt.stochastic, opt.rht_sign_mask};
  const int64_t kb = cols / 16;
  if (!opt.tile_2d) {
    const int64_t nblocks = batch * rows * kb;
    const int64_t want = std::max<int64_t>(1, (nblocks + kThreads - 1) / kThreads);
    const int grid = static_cast<int>(std::min<int64_t>(want, INT_MAX));
    quant_1x16_kernel<T>
        <<<grid, kThreads, 0, stream>>>(x, nblocks, amax, seed, p, codes, scales, global_scale);
    return cudaGetLastError();
  }
  const int64_t row_tiles = (rows + 15) / 16;
  const int64_t col_groups = (kb + 15) / 16;
  const int64_t blocks = std::max<int64_t>(1, batch * row_tiles * col_groups);
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  quant_16x16_kernel<T><<<static_cast<int>(blocks), kThreads, 0, stream>>>(
      x, rows, kb, std::max<int64_t>(row_tiles, 1), std::max<int64_t>(col_groups, 1), amax, seed, p,
      codes, scales, global_scale);
  return cudaGetLastError();
}

#define SUROGATE_NVFP4_INSTANTIATE(T)                                                              \
  template cudaError_t nvfp4_amax<T>(const T*, int64_t, int, float*, cudaStream_t);                \
  template cudaError_t nvfp4_quantize<T>(const T*, int64_t, int64_t, int64_t, const float*,        \
                                         const uint32_t*, const Nvfp4Options&, uint8_t*, uint8_t*, \
                                         float*, cudaStream_t);

SUROGATE_NVFP4_INSTANTIATE(float)
SUROGATE_NVFP4_INSTANTIATE(__nv_bfloat16)
SUROGATE_NVFP4_INSTANTIATE(__half)

}  // namespace surogate
