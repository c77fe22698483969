// SwiGLU CUDA launchers (framework-free: no XLA/JAX headers; ffi/swiglu.cc binds them to XLA).
//
//   forward : gate, up [rows, F]          -> h [rows, F]
//             h = silu(gate) * up = gate * sigmoid(gate) * up   (fp32 math, rounded once to T)
//   backward: dh, gate, up [rows, F]      -> dgate, dup [rows, F]
//             s = sigmoid(gate)
//             dgate = dh * up * s * (1 + gate * (1 - s)),   dup = dh * gate * s
//
// Inputs and gradients may be row-strided views: row r of gate starts at gate + r * ld_in (the
// same ld_in for up, dgate and dup), so one packed gate_up [rows, 2F] buffer is gate = base,
// up = base + F, ld_in = 2F. h is dense (row stride F). Contiguous separate tensors: ld_in = F.
//
// T is float, __nv_bfloat16 or __half. Every launcher enqueues on `stream`, never synchronizes,
// and returns the first CUDA error it sees (cudaSuccess otherwise).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

template <typename T>
cudaError_t swiglu_fwd(const T* gate, const T* up, T* h, int64_t rows, int64_t F, int64_t ld_in,
                       cudaStream_t stream);

template <typename T>
cudaError_t swiglu_bwd(const T* dh, const T* gate, const T* up, T* dgate, T* dup, int64_t rows,
                       int64_t F, int64_t ld_in, cudaStream_t stream);

}  // namespace surogate
