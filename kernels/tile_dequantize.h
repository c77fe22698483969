// Tile-scaled weight dequantization CUDA launcher (framework-free: no XLA/JAX headers;
// ffi/tile_dequantize.cc binds it to XLA). A weight W [rows, cols] (HF layout [out, in]) is stored
// as codes with one scale per tile x tile square (row-major grid, ragged last tiles), in one of:
//   kFp8    codes float8_e4m3fn [rows, cols] (bytes), tile_scales f32 [ceil(rows/tile),
//   ceil(cols/tile)]
//           (HF fine-grained FP8's weight_scale_inv); tile 16..512, a power of two.
//           value = f32(code) * tile_scale                                   (one rounding)
//   kNvfp4  codes uint8 [rows, cols/2] (E2M1, element 2j in the LOW nibble, bit 3 the sign),
//           tile_scales float8_e4m3fn [ceil(rows/16), cols/16], global_scale f32 []; tile == 16,
//           cols % 16 == 0.
//           value = (e2m1(code) * f32(tile_scale)) * global_scale            (the first product
//           exact)
// then, in this order (each an fp32 operation rounded once):
//   value = f32(round_to_via(value))     (via kBf16 / kF16 only: the weight as the model dtype
//   holds it) value = value * *scale               (only when scale != nullptr: a per-tensor output
//   scale) out   = value rounded once to OutT, to nearest even; float8_e4m3fn saturates to +-448
//   first
//           (cvt .satfinite), as jnp.clip(v, -448, 448).astype(float8_e4m3fn) does.
//
// Selective MoE dequantization: with group_sizes (device int32 [rows / rows_per_group], one per
// expert of a stacked [E * out, in] weight, rows_per_group = out), the rows of an expert whose
// size is <= 0 are neither computed nor written: those outputs are left unspecified (the grouped
// GEMM never reads an expert without rows). group_sizes == nullptr: every row is written.
//
// OutT is float, __nv_bfloat16, __half or __nv_fp8_e4m3. A bad format, tile or shape, or
// group_sizes with rows_per_group <= 0 or not dividing rows, returns cudaErrorInvalidValue; an
// empty weight launches nothing. `scale` is a device pointer to one
// float, or nullptr; `global_scale` is read for kNvfp4 only. Enqueues on `stream`, never
// synchronizes, and returns the first CUDA error it sees (cudaSuccess otherwise).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "kernels/dequant_via.h"

namespace surogate {

enum class TileFormat : int { kFp8 = 0, kNvfp4 = 1 };

template <typename OutT>
cudaError_t tile_dequantize(TileFormat format, const uint8_t* codes, const void* tile_scales,
                            const float* global_scale, const float* scale, OutT* out, int64_t rows,
                            int64_t cols, int tile, DequantVia via, const int32_t* group_sizes,
                            int64_t rows_per_group, cudaStream_t stream);

}  // namespace surogate
