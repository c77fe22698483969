// dw[col] = sum over rows of a [parts, dim] fp32 workspace: the second pass of the norm backwards
// (rms_norm_common.cuh, rope_bwd.cu), whose blocks each write one row of weight-gradient partials.
// Deterministic (fixed order of additions, no atomics).
//
// Why its own kernel file: the sum is latency-bound, not bandwidth-bound (a few hundred rows of
// ~1-4% of the backward's bytes, just written, so L2 hits), and a loop that issues one dependent
// load at a time costs ~0.3 us per row in flight (one sum per thread over 528 rows: ~10 us a call,
// a third of rope's 34 us backward). Here a block is 32 columns x kColSumRows row slices, and each
// thread keeps four independent sums so four loads are in flight at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/device_common.cuh"

namespace surogate {
namespace {  // internal linkage: each including .cu gets its own copy
namespace colsum {

constexpr int kColSumCols = 32;
constexpr int kColSumRows = 32;

// blockIdx.y == 0: dw0 = sums of rows [0, parts0); 1: dw1 = sums of rows [parts0, parts0 + parts1)
// (the two tensors of a paired launch, rope_bwd.cu).
template <typename T>
__global__ void __launch_bounds__(kColSumCols* kColSumRows)
    dw_col_sum_kernel(const float* __restrict__ ws, T* __restrict__ dw0, int parts0,
                      T* __restrict__ dw1, int parts1, int dim) {
  __shared__ float acc[kColSumRows][kColSumCols + 1];
  const int col = blockIdx.x * kColSumCols + threadIdx.x;
  const bool second = blockIdx.y != 0;
  T* __restrict__ dw = second ? dw1 : dw0;
  const int parts = second ? parts1 : parts0;
  if (second) ws += static_cast<int64_t>(parts0) * dim;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  if (col < dim) {
    const float* c = ws + col;
    const int64_t step = static_cast<int64_t>(kColSumRows) * dim;
    int p = threadIdx.y;
    for (; p + 3 * kColSumRows < parts; p += 4 * kColSumRows) {
      const float* q = c + static_cast<int64_t>(p) * dim;
      s0 += q[0];
      s1 += q[step];
      s2 += q[2 * step];
      s3 += q[3 * step];
    }
    for (; p < parts; p += kColSumRows) s0 += c[static_cast<int64_t>(p) * dim];
  }
  acc[threadIdx.y][threadIdx.x] = (s0 + s1) + (s2 + s3);
  __syncthreads();
  if (threadIdx.y == 0 && col < dim) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < kColSumRows; ++j) t += acc[j][threadIdx.x];
    dw[col] = vec::from_float<T>(t);
  }
}

// Enqueues dw0 = column sums of ws[:parts0, :dim] and, when dw1 != nullptr, dw1 = those of the
// next parts1 rows, in one launch on `stream`.
template <typename T>
cudaError_t dw_col_sum(const float* ws, T* dw0, int parts0, int dim, cudaStream_t stream,
                       T* dw1 = nullptr, int parts1 = 0) {
  const dim3 block(kColSumCols, kColSumRows);
  const dim3 grid(static_cast<unsigned>((dim + kColSumCols - 1) / kColSumCols),
                  dw1 != nullptr ? 2u : 1u);
  dw_col_sum_kernel<T><<<grid, block, 0, stream>>>(ws, dw0, parts0, dw1, parts1, dim);
  return cudaGetLastError();
}

}  // namespace colsum
}  // namespace
}  // namespace surogate
