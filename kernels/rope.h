// RoPE (HF "rotate half" convention) CUDA launchers, optionally fused with a per-head RMSNorm
// (Qwen3's q_norm / k_norm) in front. Framework-free: ffi/rope.cc binds them to XLA. Forward in
// kernels/rope_fwd.cu, norm backward in rope_bwd.cu (two translation units: compiled in parallel).
//
// Layout: x [tokens, heads, K] (row = one head of one token), K = 2F even; pair j < F is the
// element pair (j, j + F). Every token t has angles ang[t, j] whose cos/sin come either from
//   positions mode: ang = float(positions[t]) * inv_freq[j]  (fp32 product, precise sincosf), or
//   table mode    : cos[t * stride + j], sin[t * stride + j]  (fp32 tables, stride >= F; HF-style
//                   tables of width K with repeated halves are read with stride K).
//
//   forward : n = x                                   (no norm, w == nullptr)
//             n = x * rstd * w, rstd = rsqrt(mean_K(x^2) + eps)        (norm)
//             y[j]   = n[j] * c - n[j+F] * s,   y[j+F] = n[j+F] * c + n[j] * s
//             with (c, s) = (cos, sin) of ang, or (cos, -sin) when `inverse` (rotation by -ang,
//             which is also the backward of the rotation: dx = R(-ang) dy).
//             fp32 math, rounded once to T.
//   norm backward: g = R(-ang) dy;  xhat = x * rstd (rstd recomputed from x);
//             dx = rstd * (g*w - xhat * mean_K(g*w*xhat)),  dw = sum over all rows of g * xhat.
//
// T is float, __nv_bfloat16 or __half (x, y, w, dy, dx, dw share it). Launchers enqueue on
// `stream`, never synchronize, and return the first CUDA error (cudaSuccess otherwise);
// cudaErrorInvalidValue for arguments they cannot handle (see rope_max_head_dim).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

// Where the rotation angles come from: set `positions` + `inv_freq` (positions mode) or
// `cos` + `sin` + `stride` (table mode).
struct RopeAngles {
  const int32_t* positions = nullptr;  // [tokens]
  const float* inv_freq = nullptr;     // [F]
  const float* cos = nullptr;          // [tokens, stride]
  const float* sin = nullptr;          // [tokens, stride]
  int64_t stride = 0;
};

// Largest head_dim the kernels take (1024 for any T): rows are held in registers.
int64_t rope_max_head_dim();

// w == nullptr: rotation only (eps unused).
template <typename T>
cudaError_t rope_fwd(const T* x, T* y, const RopeAngles& ang, const T* w, int64_t tokens,
                     int64_t heads, int64_t head_dim, float eps, bool inverse, cudaStream_t stream);

// Backward of the fused norm + rotation. `workspace`: float32 scratch of `workspace_bytes`
// (16-byte aligned) for per-block dw partial sums, at least head_dim floats; the grid uses at
// most workspace_bytes / (4 * head_dim) blocks.
template <typename T>
cudaError_t rope_norm_bwd(const T* dy, const T* x, const RopeAngles& ang, const T* w, T* dx, T* dw,
                          int64_t tokens, int64_t heads, int64_t head_dim, float eps,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream);

// One tensor of a pair (q and k of a layer: same tokens, angles and head_dim; own rows, heads and
// norm weight). Forward: x -> out (y), w as in rope_fwd. Norm backward: dy, x, w -> out (dx), dw.
template <typename T>
struct RopeTensor {
  const T* x = nullptr;
  const T* dy = nullptr;  // backward only
  T* out = nullptr;
  const T* w = nullptr;
  T* dw = nullptr;  // backward only
  int64_t heads = 0;
};

// The pair's forward / norm backward: rope_fwd / rope_norm_bwd of both tensors (both with or both
// without w), in one launch (and the backward's two dw column sums in one more); rows of more
// than one chunk per lane (long head_dim) and grids beyond one launch run the two tensors one
// after another.
template <typename T>
cudaError_t rope_fwd_pair(const RopeTensor<T>& t0, const RopeTensor<T>& t1, const RopeAngles& ang,
                          int64_t tokens, int64_t head_dim, float eps, bool inverse,
                          cudaStream_t stream);

// workspace as in rope_norm_bwd; the paired launch needs at least two rows of head_dim floats.
template <typename T>
cudaError_t rope_norm_bwd_pair(const RopeTensor<T>& t0, const RopeTensor<T>& t1,
                               const RopeAngles& ang, int64_t tokens, int64_t head_dim, float eps,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace surogate
