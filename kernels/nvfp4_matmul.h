// Operand preparation for the native NVFP4 GEMM (cuBLASLt block-scaled FP4, SM100+); framework-free
// launchers, bound to XLA by ffi/nvfp4_matmul.cc. These kernels run on any CUDA GPU (they only
// move bytes), so they are tested on Hopper against surogate_jax/ops/nvfp4_matmul.py's
// pure-JAX references even though the GEMM itself needs SM100.
//
//   nvfp4_swizzle_scales(src, src_rows, cols, rows, row_div, dst):
//     src  E4M3 block scales, row-major [src_rows, cols] (cols = K/16; the NVFP4Tensor layout).
//     Operand row r (0 <= r < rows) uses src row r / row_div: row_div = 1 for 1x16 blocks,
//     16 for 16x16 tiles (the tile scale repeated over the tile's 16 rows).
//     dst  cuBLASLt's VEC16_UE4M3 layout ("1D Block Scaling Factors Layout",
//          https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout):
//          rows padded to Rp = ceil(rows/128)*128, cols to Cp = ceil(cols/4)*4, Rp*Cp bytes,
//            dst[((r/128) * (Cp/4) + c/4) * 512 + (r%32) * 16 + ((r%128)/32) * 4 + c%4]
//              = (r < rows && c < cols) ? src[(r/row_div) * cols + c] : 0.
//          (128x4 tiles of 512 bytes, tiles row-block-major; inside a tile 32 x 4 x 4.)
//   nvfp4_transpose_codes(src, rows, cols, dst):
//     src  packed E2M1 codes [rows, cols/2] (element (r, 2j) in the low nibble of byte (r, j),
//          (r, 2j+1) in the high nibble), rows and cols even;
//     dst  the transpose [cols, rows/2] in the same packing: dst element (c, r) = src (r, c).
//     Exact (a permutation of nibbles); used for the fprop weight operand W^T.
//   nvfp4_gemm_alpha(a_gs, b_gs, out): out[0] = a_gs[0] * b_gs[0], out[1] = 0 (device alpha/beta
//     for cuBLASLt's CUBLASLT_POINTER_MODE_DEVICE).
// Every launcher enqueues on `stream`, never synchronizes, and returns the first CUDA error.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace surogate {

// Bytes of the swizzled scale buffer for an operand of `rows` rows and `cols` scale columns.
inline int64_t nvfp4_swizzled_scale_bytes(int64_t rows, int64_t cols) {
  return ((rows + 127) / 128) * 128 * ((cols + 3) / 4) * 4;
}

cudaError_t nvfp4_swizzle_scales(const uint8_t* src, int64_t src_rows, int64_t cols, int64_t rows,
                                 int row_div, uint8_t* dst, cudaStream_t stream);

cudaError_t nvfp4_transpose_codes(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst,
                                  cudaStream_t stream);

cudaError_t nvfp4_gemm_alpha(const float* a_gs, const float* b_gs, float* out, cudaStream_t stream);

}  // namespace surogate
