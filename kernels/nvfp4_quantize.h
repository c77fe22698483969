// NVFP4 quantizer CUDA launchers (framework-free; ffi/nvfp4_quantize.cc binds them to XLA).
//
// Formulas and float32 operation order: surogate_jax/ops/nvfp4_quantize.py (module docstring); the
// kernels reproduce the pure-JAX reference bit for bit for round-to-nearest, with and without
// Four Over Six, 1x16 blocks and 16x16 tiles, with and without the fused 16-point RHT.
//
//   nvfp4_amax    : x [n elements, rows of 16 along the last axis] -> amax [1] (float32)
//                   amax = max |x| (of the RHT of each 16-element group when rht_sign_mask >= 0);
//                   NaN anywhere -> NaN. Reduced with an integer atomicMax on the float bits,
//                   which is order independent (deterministic); the launcher zeroes amax first.
//   nvfp4_quantize: x [batch, rows, cols] (cols % 16 == 0), amax [1], seed [2] (uint32, device)
//                   -> codes  [batch, rows, cols/2] uint8 (element 2j in the low nibble)
//                      scales [batch * rows, cols/16] E4M3 bytes (1x16 blocks), or
//                             [batch, ceil(rows/16), cols/16] (tile_2d: 16x16 tiles; a partial
//                             last row tile counts its missing rows as zeros)
//                      global_scale [1] float32 = s_dec = 1 / s_enc
//                   For 1x16 blocks `batch` may be 1 with rows = all leading dims.
//
// T is float, __nv_bfloat16 or __half; x must be 16-byte aligned (cudaErrorMisalignedAddress
// otherwise: the kernels only vector-load). rht_sign_mask: -1 = no transform, else the 16-bit sign
// mask of surogate_jax/ops/hadamard.py. Stochastic rounding draws Philox4x32-10 bits keyed
// by seed[0..1] with counter (16-element block index, sub-block j in 0..3): different bits from
// the JAX reference's jax.random stream (equal in distribution only).
// Every launcher enqueues on `stream`, never synchronizes, and returns the first CUDA error.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

struct Nvfp4Options {
  bool tile_2d = false;       // 16x16 tiles over (rows, cols) instead of 1x16 blocks along cols
  bool four_over_six = true;  // per-block choice between block max -> 6 and -> 4 (global M = 256)
  bool stochastic = false;    // stochastic rounding of the elements (scale choice stays RNE)
  int rht_sign_mask = -1;     // < 0: no random Hadamard transform; else its 16-bit sign mask
};

template <typename T>
cudaError_t nvfp4_amax(const T* x, int64_t n, int rht_sign_mask, float* amax, cudaStream_t stream);

template <typename T>
cudaError_t nvfp4_quantize(const T* x, int64_t batch, int64_t rows, int64_t cols, const float* amax,
                           const uint32_t* seed, const Nvfp4Options& opt, uint8_t* codes,
                           uint8_t* scales, float* global_scale, cudaStream_t stream);

}  // namespace surogate
