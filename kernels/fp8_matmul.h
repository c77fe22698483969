// Operand preparation for the FP8 GEMM (framework-free launchers; ffi/fp8_matmul.cc binds them):
// the delayed-scaling cast (+ transpose) + amax, and the byte transpose of data already in fp8.
//
//   x [rows, cols] (T = float / __nv_bfloat16 / __half), scale: device pointer to one float.
//   q  [rows, cols]  q[r, c]  = fp8(x[r, c] * scale)       (row-major copy; may be null)
//   qt [cols, ld_t]  qt[c, r] = q[r, c] for r < rows, 0 for rows <= r < ld_t   (may be null)
//   amax: device pointer to one float, = max |x| over all elements (NaN if any x is NaN).
//
// fp8(v): round to nearest even, saturating to +-max (+-inf too); NaN stays NaN (the CUDA
// __NV_SATFINITE conversion). Format E4M3 (max 448) or E5M2 (max 57344). The product x * scale is
// one fp32 multiply, so results match `surogate_jax.precision.fp8.quantize` bit for bit.
//
// qt is the operand layout FP8 cuBLASLt needs on Hopper (both operands K-major): the transposed
// copy of an activation or gradient feeds the weight-gradient GEMM (reduction over rows), and ld_t
// (>= rows, a multiple of 16 in practice) pads the reduction dim with zeros, which add nothing.
// Launchers enqueue on `stream` (amax is zeroed there first), never synchronize, and return the
// first CUDA error. The amax is combined with atomicMax on the float bits: max is exact and
// order-independent, so results are deterministic.
//
// fp8_transpose: the same transposed layout for data that is ALREADY fp8 (e.g. a frozen weight
// cached in E4M3): x [rows, cols] bytes -> qt [cols, ld_t], qt[c, r] = x[r, c] for r < rows, 0 for
// rows <= r < ld_t. Bytes are copied as they are (either fp8 format, NaN payloads kept); no
// scale, no amax. Done in our own kernel so that XLA cannot hoist or re-lay-out the transpose
// (see surogate_jax/ops/fp8_matmul.py, "Frozen weights").
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

template <typename T>
cudaError_t fp8_quantize(const T* x, const float* scale, int64_t rows, int64_t cols,
                         Fp8Format format, uint8_t* q, uint8_t* qt, int64_t ld_t, float* amax,
                         cudaStream_t stream);

cudaError_t fp8_transpose(const uint8_t* x, int64_t rows, int64_t cols, uint8_t* qt, int64_t ld_t,
                          cudaStream_t stream);

}  // namespace surogate
