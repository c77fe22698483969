// dw[col] = sum over rows of a [parts, dim] fp32 workspace: the second pass of the norm backwards
// (rms_norm_common.cuh, rope.cu), whose blocks each write one row of weight-gradient partials.
// Deterministic (fixed order of additions, no atomics).
//
// Why its own kernel file: the sum is latency-bound, not bandwidth-bound (a few hundred rows of
// ~1-4% of the backward's bytes, just written, so L2 hits), and a loop that issues one dependent
// load at a time costs ~0.3 us per row in flight: rope.cu's first version (block 32 x 16, one sum
// per thread, 528 rows -> 33 serial loads) spent ~10 us per call this way, a third of a 34 us
// backward (eighth/ninth session). Here a block is 32 columns x kColSumRows row slices, and each
// thread keeps kColSumInFlight independent sums, so that many loads are in flight at once: up to
// 32 x 16 = 512 rows take one L2 round trip. Four in flight (ninth session) took 3.4-3.8 us per call
// for 512 rows under Nsight Compute on the H100 (eleventh session).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/surogate_vec.cuh"

namespace surogate {
namespace {  // internal linkage: each including .cu gets its own copy
namespace colsum {

constexpr int kColSumCols = 32;
constexpr int kColSumRows = 32;
constexpr int kColSumInFlight = 16;

template <typename T>
__global__ void __launch_bounds__(kColSumCols * kColSumRows)
    dw_col_sum_kernel(const float* __restrict__ ws, T* __restrict__ dw, int parts, int dim) {
  __shared__ float acc[kColSumRows][kColSumCols + 1];
  const int col = blockIdx.x * kColSumCols + threadIdx.x;
  float s[kColSumInFlight] = {};
  if (col < dim) {
    const float* c = ws + col;
    for (int p = threadIdx.y; p < parts; p += kColSumInFlight * kColSumRows) {
#pragma unroll
      for (int j = 0; j < kColSumInFlight; ++j) {  // all loads issued before the adds need them
        const int q = p + j * kColSumRows;
        if (q < parts) s[j] += c[static_cast<int64_t>(q) * dim];
      }
    }
  }
#pragma unroll
  for (int w = kColSumInFlight / 2; w > 0; w /= 2) {
#pragma unroll
    for (int j = 0; j < w; ++j) s[j] += s[j + w];
  }
  acc[threadIdx.y][threadIdx.x] = s[0];
  __syncthreads();
  if (threadIdx.y == 0 && col < dim) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < kColSumRows; ++j) t += acc[j][threadIdx.x];
    dw[col] = vec::from_float<T>(t);
  }
}

// Enqueues dw = column sums of ws[:parts, :dim] on `stream`.
template <typename T>
cudaError_t dw_col_sum(const float* ws, T* dw, int parts, int dim, cudaStream_t stream) {
  const dim3 block(kColSumCols, kColSumRows);
  const unsigned grid = static_cast<unsigned>((dim + kColSumCols - 1) / kColSumCols);
  dw_col_sum_kernel<T><<<grid, block, 0, stream>>>(ws, dw, parts, dim);
  return cudaGetLastError();
}

}  // namespace colsum
}  // namespace
}  // namespace surogate
