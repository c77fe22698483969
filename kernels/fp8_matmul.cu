// FP8 cast (+ transpose) + amax kernels (see fp8_matmul.h for the math and the contract).
//
// Floor: memory bound. Bytes per element: sizeof(T) read + 1 written per fp8 copy. For the
// Qwen3-8B activations (4096 tokens x 4096, bf16) cast+transpose moves 16.8M x (2 + 1 + 1) = 67 MB,
// ~22 us at the H100's ~3000 GB/s copy bandwidth; the cast alone 50 MB, ~17 us. The GEMMs they
// feed take ~70 us (4096^3 at ~1979 TFLOP/s FP8 dense peak), so quantization is not free:
// it is the price of FP8's operand layout and delayed-scaling amax.
// fp8_transpose (already-fp8 data, bytes only): 2 bytes moved per element (1 read + 1 written).
// A Qwen3-8B layer's seven frozen projections hold ~193 MB of E4M3 (q 4096x4096, k/v 4096x1024
// each, o 4096x4096, gate/up 4096x12288 each, down 12288x4096), so their transposes move ~386 MB:
// ~0.13 ms per layer at ~3000 GB/s, against ~1.6 ms of FP8 forward + dgrad GEMMs per layer at
// 4096 tokens (2 x 2 x 4096 x 193M FLOP at the 1979 TFLOP/s FP8 dense peak): <10% at worst.
//
// Design:
//  * cast only: a persistent grid-stride loop over the flat tensor with 16-byte vector loads. Every
//    cast the FP8 GEMM asks for allows them (K and N are multiples of 16, XLA's buffers 16-byte
//    aligned); any other shape goes through the tile kernel below without its transpose.
//  * cast + transpose: 64 x 64 tiles through shared memory (256 threads). Phase 1 reads rows
//    (16-byte loads when aligned), converts, writes the row-major copy and the tile; phase 2 writes
//    16-byte chunks of the transposed rows. The smem row stride of 66 bytes keeps the column reads
//    of phase 2 free of bank conflicts. The same kernel with kCopy = true (T = uint8_t) is the
//    byte transpose of fp8_transpose: phase 1 copies bytes (8-byte loads when aligned), no scale,
//    no amax.
//  * amax: per-thread max of the |x| bit patterns (monotone for non-negative floats, and NaN's bits
//    are above +inf's, so NaN wins), a block reduction, one atomicMax per block.
#include "kernels/fp8_matmul.h"
#include "kernels/device_common.cuh"

#include <algorithm>
#include <cstring>

#include <cuda_fp8.h>

namespace surogate {
namespace {

constexpr int kTile = 64;
constexpr int kTileThreads = 256;
constexpr int kSmemStride = kTile + 2;
constexpr int kFlatThreads = 256;

template <Fp8Format F>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  constexpr __nv_fp8_interpretation_t kind = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind));
}

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// Max of `bits` over the block, then one atomicMax into *amax. Every thread must call it.
__device__ __forceinline__ void block_amax(unsigned bits, float* amax) {
  __shared__ unsigned warp_max[32];
  bits = __reduce_max_sync(0xffffffffu, bits);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    unsigned b = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0u;
    b = __reduce_max_sync(0xffffffffu, b);
    if (lane == 0 && b != 0u) atomicMax(reinterpret_cast<unsigned*>(amax), b);
  }
}

// N consecutive elements of x as floats (one or two 16-byte loads).
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "whole 16-byte vectors");
  constexpr int kLoads = N * sizeof(T) / 16;
  constexpr int kPer = 16 / sizeof(T);
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const uint4 raw = reinterpret_cast<const uint4*>(p)[l];
    T v[kPer];
    memcpy(v, &raw, sizeof(raw));
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[l * kPer + k] = to_float(v[k]);
  }
}

// ---- cast only: q = fp8(x * scale) over the flat tensor, N = 16 / sizeof(T) per step ----
template <typename T, Fp8Format F, int N>
__global__ void __launch_bounds__(kFlatThreads)
    quantize_flat_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                         uint8_t* __restrict__ q, int64_t n, float* __restrict__ amax) {
  const float s = *scale;
  unsigned bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nvec = n / N;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += stride) {
    float v[N];
    load_vec<T, N>(x + i * N, v);
    uint8_t o[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      bits = max(bits, abs_bits(v[k]));
      o[k] = to_fp8<F>(v[k] * s);
    }
    if constexpr (N == 4) {
      uint32_t w;
      memcpy(&w, o, 4);
      reinterpret_cast<uint32_t*>(q)[i] = w;
    } else {
      uint2 w;
      memcpy(&w, o, 8);
      reinterpret_cast<uint2*>(q)[i] = w;
    }
  }
  block_amax(bits, amax);
}

// ---- cast + transpose: one 64 x 64 tile per block ----
// Block (blockIdx.x, blockIdx.y) covers rows [64 bx, +64) and columns [64 by, +64).
// kCopy: x is already fp8 (T = uint8_t): bytes are copied, scale / q / amax are unused (null).
template <typename T, Fp8Format F, bool kCopy = false>
__global__ void __launch_bounds__(kTileThreads)
    quantize_transpose_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                              uint8_t* __restrict__ q, uint8_t* __restrict__ qt, int64_t rows,
                              int64_t cols, int64_t ld_t, bool vec_in, bool vec_q, bool vec_t,
                              float* __restrict__ amax) {
  static_assert(!kCopy || sizeof(T) == 1, "the copy variant moves fp8 bytes");
  __shared__ uint8_t tile[kTile * kSmemStride];
  float s = 1.0f;
  if constexpr (!kCopy) s = *scale;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  unsigned bits = 0;

  // Phase 1: 8 threads per row, 8 columns each; 32 rows per pass, 2 passes.
  constexpr int kCols = 8;
  const int cseg = (threadIdx.x % (kTile / kCols)) * kCols;
#pragma unroll
  for (int pass = 0; pass < kTile / (kTileThreads / (kTile / kCols)); ++pass) {
    const int r = pass * (kTileThreads / (kTile / kCols)) + threadIdx.x / (kTile / kCols);
    const int64_t gr = row0 + r, gc = col0 + cseg;
    uint8_t o[kCols];
    if constexpr (kCopy) {
      if (gr < rows && vec_in && gc + kCols <= cols) {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + gr * cols + gc);
        memcpy(o, &raw, kCols);
      } else {
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          o[k] = gr < rows && gc + k < cols ? x[gr * cols + gc + k] : uint8_t{0};
        }
      }
    } else if (gr < rows && vec_in && gc + kCols <= cols) {
      float v[kCols];
      load_vec<T, kCols>(x + gr * cols + gc, v);
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        bits = max(bits, abs_bits(v[k]));
        o[k] = to_fp8<F>(v[k] * s);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        o[k] = 0;
        if (gr < rows && gc + k < cols) {
          const float v = to_float(x[gr * cols + gc + k]);
          bits = max(bits, abs_bits(v));
          o[k] = to_fp8<F>(v * s);
        }
      }
    }
    if (q != nullptr && gr < rows) {
      if (vec_q && gc + kCols <= cols) {
        uint2 w;
        memcpy(&w, o, 8);
        *reinterpret_cast<uint2*>(q + gr * cols + gc) = w;
      } else {
        for (int k = 0; k < kCols && gc + k < cols; ++k) q[gr * cols + gc + k] = o[k];
      }
    }
#pragma unroll
    for (int k = 0; k < kCols; ++k) tile[r * kSmemStride + cseg + k] = o[k];
  }
  __syncthreads();

  // Phase 2: output row c (a column of x), 16 consecutive entries (rows of x) per thread.
  if (qt != nullptr) {
    constexpr int kRows = 16;
    const int c = threadIdx.x / (kTile / kRows);
    const int rseg = (threadIdx.x % (kTile / kRows)) * kRows;
    const int64_t gc = col0 + c, gr = row0 + rseg;
    if (gc < cols) {
      uint8_t o[kRows];
#pragma unroll
      for (int k = 0; k < kRows; ++k) o[k] = tile[(rseg + k) * kSmemStride + c];  // 0 past rows
      uint8_t* dst = qt + gc * ld_t + gr;
      if (vec_t && gr + kRows <= ld_t) {
        uint4 w;
        memcpy(&w, o, 16);
        *reinterpret_cast<uint4*>(dst) = w;
      } else {
        for (int k = 0; k < kRows && gr + k < ld_t; ++k) dst[k] = o[k];
      }
    }
  }
  if constexpr (!kCopy) block_amax(bits, amax);
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// The 64 x 64 tile kernel over rows [0, max(rows, ld_t)) (tiles past `rows` write qt's zero
// padding) and all columns. Phase 1 loads 8 elements per thread: 16-byte vectors for the cast
// (8 x 2-byte T; two for f32), 8-byte ones for the byte copy.
template <typename T, Fp8Format F, bool kCopy>
cudaError_t launch_tiles(const T* x, const float* scale, int64_t rows, int64_t cols, uint8_t* q,
                         uint8_t* qt, int64_t ld_t, float* amax, cudaStream_t stream) {
  const int64_t row_tiles = (std::max(rows, ld_t) + kTile - 1) / kTile;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  if (row_tiles == 0 || col_tiles == 0) return cudaSuccess;
  if (col_tiles > 65535 || row_tiles > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vec_in = cols % 8 == 0 && aligned(x, kCopy ? 8 : 16);
  const bool vec_q = q != nullptr && cols % 8 == 0 && aligned(q, 8);
  const bool vec_t = ld_t % 16 == 0 && aligned(qt, 16);
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  quantize_transpose_kernel<T, F, kCopy><<<grid, kTileThreads, 0, stream>>>(
      x, scale, q, qt, rows, cols, ld_t, vec_in, vec_q, vec_t, amax);
  return cudaGetLastError();
}

template <typename T, Fp8Format F>
cudaError_t launch(const T* x, const float* scale, int64_t rows, int64_t cols, uint8_t* q,
                   uint8_t* qt, int64_t ld_t, float* amax, cudaStream_t stream) {
  const int64_t n = rows * cols;
  constexpr int kN = 16 / sizeof(T);
  if (qt != nullptr || n % kN != 0 || !aligned(x, 16) || !aligned(q, kN)) {
    // The tile kernel writes the same bytes (qt == nullptr skips its transposed half).
    return launch_tiles<T, F, false>(x, scale, rows, cols, q, qt, qt ? ld_t : 0, amax, stream);
  }
  if (n == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  SUROGATE_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>((n / kN + kFlatThreads - 1) / kFlatThreads, int64_t{sms} * 8));
  quantize_flat_kernel<T, F, kN>
      <<<static_cast<unsigned>(blocks), kFlatThreads, 0, stream>>>(x, scale, q, n, amax);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t fp8_quantize(const T* x, const float* scale, int64_t rows, int64_t cols,
                         Fp8Format format, uint8_t* q, uint8_t* qt, int64_t ld_t, float* amax,
                         cudaStream_t stream) {
  if (rows < 0 || cols < 0 || amax == nullptr || scale == nullptr) return cudaErrorInvalidValue;
  if (qt != nullptr && ld_t < rows) return cudaErrorInvalidValue;
  if (q == nullptr && qt == nullptr) return cudaErrorInvalidValue;
  SUROGATE_TRY(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (format == Fp8Format::kE4M3) {
    return launch<T, Fp8Format::kE4M3>(x, scale, rows, cols, q, qt, ld_t, amax, stream);
  }
  return launch<T, Fp8Format::kE5M2>(x, scale, rows, cols, q, qt, ld_t, amax, stream);
}

cudaError_t fp8_transpose(const uint8_t* x, int64_t rows, int64_t cols, uint8_t* qt, int64_t ld_t,
                          cudaStream_t stream) {
  if (rows < 0 || cols < 0 || ld_t < rows) return cudaErrorInvalidValue;
  if (cols == 0 || ld_t == 0) return cudaSuccess;  // qt is empty
  if (qt == nullptr || (rows > 0 && x == nullptr)) return cudaErrorInvalidValue;
  // Fp8Format is irrelevant to a byte copy; kE4M3 only names one instantiation.
  return launch_tiles<uint8_t, Fp8Format::kE4M3, true>(x, nullptr, rows, cols, nullptr, qt, ld_t,
                                                       nullptr, stream);
}

#define SUROGATE_FP8_QUANTIZE_INSTANTIATE(T)                                                \
  template cudaError_t fp8_quantize<T>(const T*, const float*, int64_t, int64_t, Fp8Format, \
                                       uint8_t*, uint8_t*, int64_t, float*, cudaStream_t);

SUROGATE_FP8_QUANTIZE_INSTANTIATE(float)
SUROGATE_FP8_QUANTIZE_INSTANTIATE(__nv_bfloat16)
SUROGATE_FP8_QUANTIZE_INSTANTIATE(__half)

}  // namespace surogate
