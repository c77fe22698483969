// Grouped GEMMs for mixture-of-experts layers (framework-free launchers; ffi/grouped_matmul.cc
// binds them to XLA). Rows arrive sorted by expert: group e is rows [offsets[e], offsets[e+1]) and
// every row is multiplied by its own group's matrix. offsets [E + 1] int32 lives on the device (the
// routing never leaves the GPU), offsets[0] = 0, non-decreasing, offsets[E] <= rows (rows past
// offsets[E] belong to no expert).
//
//   grouped_matmul      y[r] = x[r] @ W[e(r)]          x [rows, K], W [E, K, N] (w_nk false)
//                       y[r] = x[r] @ W[e(r)]^T        W [E, N, K] (w_nk true: the input gradient)
//                       -> y [rows, N]; rows past offsets[E] are written as zeros
//   grouped_matmul_dw   dw[e] = x_e^T @ dy_e           x [rows, M], dy [rows, N] -> dw [E, M, N]
//                       (the weight gradient: a GEMM whose contraction runs over the group's rows;
//                       an empty group gives zeros)
//
//   grouped_matmul_fp8  y[r] = (xq[r] @ wq[e(r)]^T) * x_inv * w_inv[e(r)]
//                       xq [rows, K] fp8 (E4M3, or E5M2 with x_e5m2), wq E4M3 [E, N, K] or, with
//                       w_nek, [N, E, K] (the byte transpose of an [E, K, N] weight taken whole);
//                       x_inv: device pointer to one float, w_inv [E] floats -> y [rows, N] bf16;
//                       rows past offsets[E] are written as zeros. SM89+ (fp8 mma), K a multiple
//                       of 16, N of 8; cudaErrorNotSupported below SM89.
//
// bf16 operands, fp32 accumulation on tensor cores (mma.sync m16n8k16), bf16 results rounded once.
// K, M and N must be multiples of 8 (16-byte rows for cp.async); any row counts and group sizes.
// Launchers enqueue on `stream`, never synchronize, and return the first CUDA error.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace surogate {

cudaError_t grouped_matmul(const __nv_bfloat16* x, const __nv_bfloat16* w, const int32_t* offsets,
                           __nv_bfloat16* y, int64_t rows, int64_t K, int64_t N, int64_t E,
                           bool w_nk, cudaStream_t stream);

cudaError_t grouped_matmul_fp8(const uint8_t* x, bool x_e5m2, const uint8_t* w, bool w_nek,
                               const int32_t* offsets, const float* x_inv, const float* w_inv,
                               __nv_bfloat16* y, int64_t rows, int64_t K, int64_t N, int64_t E,
                               cudaStream_t stream);

cudaError_t grouped_matmul_dw(const __nv_bfloat16* x, const __nv_bfloat16* dy,
                              const int32_t* offsets, __nv_bfloat16* dw, int64_t M, int64_t N,
                              int64_t E, cudaStream_t stream);

}  // namespace surogate
