// RMSNorm CUDA launchers (framework-free: no XLA/JAX headers; ffi/rms_norm.cc binds them to XLA).
//
//   forward : x [rows, dim], w [dim]            -> y [rows, dim], rstd [rows] (float32)
//             rstd = rsqrt(mean(x^2) + eps), y = x * rstd * w (fp32 math, rounded once to T)
//   backward: dy, x [rows, dim], w [dim], rstd  -> dx [rows, dim], dw [dim]
//             xhat = x * rstd, g = dy * w
//             dx = rstd * (g - xhat * mean(g * xhat)),  dw = sum_rows(dy * xhat) (fp32
//             accumulation)
//
// T is float, __nv_bfloat16 or __half (x, w, y, dy, dx, dw all share it). Every launcher enqueues
// on `stream`, never synchronizes, and returns the first CUDA error it sees (cudaSuccess
// otherwise).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

template <typename T>
cudaError_t rms_norm_fwd(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t dim,
                         float eps, cudaStream_t stream);

// `workspace`: float32 scratch of `workspace_bytes` (16-byte aligned) for per-block dw partial
// sums, at least one row of `dim` floats; the grid uses at most workspace_bytes / (4 * dim) blocks
// (about SMs x resident blocks is enough for full speed).
template <typename T>
cudaError_t rms_norm_bwd(const T* dy, const T* x, const T* w, const float* rstd, T* dx, T* dw,
                         int64_t rows, int64_t dim, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

}  // namespace surogate
