// NF4 dequantization CUDA launcher (framework-free: no XLA/JAX headers; ffi/nf4_dequantize.cc
// binds it to XLA).
//
//   codes uint8 [ceil(n/2)], absmax f32 [ceil(n/block_size)], code_table f32 [16]
//   -> out [n] (the weight flattened row-major)
//   idx_i   = high nibble of codes[i/2] for even i, low nibble for odd i
//   value_i = code_table[idx_i] * absmax[i / block_size]         (fp32, correctly rounded)
//   value_i = float(round_to_via(value_i))                        (via kBf16 / kF16 only: the
//   weight
//                                                                 as the model dtype holds it)
//   value_i = value_i * *scale                                   (only when scale != nullptr; a
//                                                                 second rounding, never fused)
//   out_i   = value_i rounded once to OutT, to nearest even; float8_e4m3fn saturates to +-448
//             first (cvt .satfinite), as jnp.clip(v, -448, 448).astype(float8_e4m3fn) does.
// An odd n leaves the low nibble of the last byte unread (padding).
//
// Selective MoE dequantization: with group_sizes (device int32 [n / weights_per_group], one per
// expert of a stacked [E * out, in] weight, weights_per_group = out * in), the weights of an expert
// whose size is <= 0 are neither computed nor written: those outputs are left unspecified (the
// grouped GEMM never reads an expert without rows). group_sizes == nullptr: every weight is
// written.
//
// OutT is float, __nv_bfloat16, __half or __nv_fp8_e4m3. block_size is 64, 128, 256 or 512; any
// other value, n < 0, or group_sizes with weights_per_group <= 0 or not dividing n, returns
// cudaErrorInvalidValue. n == 0 launches nothing. `scale` is a
// device pointer to one float, or nullptr. Enqueues on `stream`, never synchronizes, and returns
// the first CUDA error it sees (cudaSuccess otherwise).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "kernels/dequant_via.h"

namespace surogate {

template <typename OutT>
cudaError_t nf4_dequantize(const uint8_t* codes, const float* absmax, const float* code_table,
                           const float* scale, OutT* out, int64_t n, int block_size, DequantVia via,
                           const int32_t* group_sizes, int64_t weights_per_group,
                           cudaStream_t stream);

}  // namespace surogate
