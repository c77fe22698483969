// 8-bit AdamW update, bitsandbytes-compatible blockwise quantization (framework-free launcher;
// ffi/adamw_8bit.cc binds it to XLA, surogate_jax/optim/adamw_8bit.py holds the exact reference
// and builds the `aux` tables).
//
// One tensor of n elements, split row-major into blocks of 256; every pointer is device memory:
//   p        [n] TP (float / bf16 / half): parameter, read and written in place
//   g        [n] TG (float / bf16 / half): gradient
//   qm, qv   [n] uint8: codes of m (signed map) and v (unsigned map), in place
//   absmax_m, absmax_v [ceil(n / 256)] float: per-block scales, in place
//   scalars  [9] float: b1, 1 - b1, b2, 1 - b2, step, eps_hat, decay, gscale, t (t unused here)
//   aux      [kAdamw8bitAuxWords] uint32: the code tables, built by the .py file (KERNEL_AUX):
//     [0, 256)         signed codes (float bits)
//     [256, 512)       unsigned codes (float bits)
//     [512, 2176)      signed lookup, 1664 buckets (exponent 102..127 x top 6 mantissa bits):
//                      (midpoints below the bucket) << 18 | low 17 bits of the bucket's single
//                      midpoint (1 << 17 when the bucket holds none)
//     [2176, 5504)     unsigned lookup, 3328 buckets (top 7 mantissa bits): below << 17 | low 16
//                      bits of the single midpoint (1 << 16 when none)
// Per element (float32, one IEEE rounding per operation, in this order):
//   gs = g * gscale; skip (keep p, m, v) unless gs is finite
//   m = b1 * (code_s[qm] * am) + (1 - b1) * gs;  v = b2 * (code_u[qv] * av) + ((1 - b2) * gs) * gs
//   am' = max |m|, av' = max v over the block
//   p = (p - step * (m / (sqrt(v) + eps_hat))) * decay
//   qm = nearest signed code to m * (1 / am') with the sign guard, qv likewise (0 if the scale is
//   0)
// The launcher enqueues on `stream`, never synchronizes, and returns the first CUDA error.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

constexpr int kAdamw8bitBlock = 256;
constexpr int kAdamw8bitScalars = 9;
constexpr int kAdamw8bitBucketE0 = 102;  // biased float exponent of bucket 0's upper part (2^-25)
// one-probe lookup: with these mantissa bits each bucket holds at most one midpoint
constexpr int kAdamw8bitBitsS = 6;
constexpr int kAdamw8bitBitsU = 7;
constexpr int kAdamw8bitBucketsS = (127 - kAdamw8bitBucketE0 + 1) << kAdamw8bitBitsS;  // 1664
constexpr int kAdamw8bitBucketsU = (127 - kAdamw8bitBucketE0 + 1) << kAdamw8bitBitsU;  // 3328
constexpr int kAdamw8bitAuxLookupS = 2 * 256;                                          // 512
constexpr int kAdamw8bitAuxLookupU = kAdamw8bitAuxLookupS + kAdamw8bitBucketsS;        // 2176
constexpr int kAdamw8bitAuxWords = kAdamw8bitAuxLookupU + kAdamw8bitBucketsU;          // 5504

template <typename TP, typename TG>
cudaError_t adamw_8bit_update(TP* p, const TG* g, uint8_t* qm, uint8_t* qv, float* absmax_m,
                              float* absmax_v, const float* scalars, const uint32_t* aux, int64_t n,
                              cudaStream_t stream);

}  // namespace surogate
