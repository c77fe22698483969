// Fused residual add + RMSNorm CUDA launchers (framework-free; ffi/add_rms_norm.cc binds them).
//
//   forward : x, res [rows, dim], w [dim] -> y [rows, dim], res_out [rows, dim], rstd [rows] (f32)
//             res_out = round_T(x + res)                 (the residual stream stays in T)
//             rstd = rsqrt(mean(res_out^2) + eps), y = res_out * rstd * w (fp32 math, y rounded
//             once)
//   backward: dy, dres_out, res_out [rows, dim], w [dim], rstd -> dx [rows, dim], dw [dim]
//             shat = res_out * rstd, g = dy * w
//             dx = rstd * (g - shat * mean(g * shat)) + dres_out   (= d x = d res: one tensor)
//             dw = sum_rows(dy * shat)                              (fp32 accumulation)
//
// T is float, __nv_bfloat16 or __half (every tensor but rstd and the workspace). Every launcher
// enqueues on `stream`, never synchronizes, and returns the first CUDA error it sees.
// Kernels, floor and design: rms_norm_common.cuh (shared with rms_norm.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

template <typename T>
cudaError_t add_rms_norm_fwd(const T* x, const T* res, const T* w, T* y, T* res_out, float* rstd,
                             int64_t rows, int64_t dim, float eps, cudaStream_t stream);

// `workspace`: float32 scratch of `workspace_bytes` (16-byte aligned) for per-block dw partial
// sums, at least one row of `dim` floats (see rms_norm.h).
template <typename T>
cudaError_t add_rms_norm_bwd(const T* dy, const T* dres_out, const T* res_out, const T* w,
                             const float* rstd, T* dx, T* dw, int64_t rows, int64_t dim,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace surogate
