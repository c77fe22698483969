// Operand preparation kernels for the native NVFP4 GEMM (contract: nvfp4_matmul.h).
//
// Floor: pure data movement, memory bound.
//  * Scale swizzle: reads rows*cols/row_div bytes (L2 hits for the repeated tile rows), writes
//    Rp*Cp bytes: 1/16 B per operand element. [16384, 4096] activations: 4.2 MB written + 4.2 MB
//    read -> ~3 us at 3000 GB/s (launch-latency bound in practice); weights [14336, 4096] tiles:
//    3.7 MB written -> ~1.5 us.
//  * Code transpose: reads and writes rows*cols/2 bytes each: [4096, 14336] (8B MLP weight)
//    29.4 MB + 29.4 MB -> ~20 us; [4096, 4096] 8.4 + 8.4 MB -> ~6 us. The GEMM it feeds
//    ([16384 x 4096 x 14336] at the B200's ~9 PFLOP/s dense FP4 ~ 210 us) dwarfs it; a cached
//    W^T (frozen weights) skips it altogether.
//
// Design: the swizzle gives one thread each 4-byte group (r, c/4) of the destination (one 32-bit
// store, every destination byte written exactly once, padding included), so no memset is
// needed and there are no atomics. The transpose stages a 64 x 64-element tile of nibbles in
// shared memory (unpacked to one byte each) and writes whole output bytes; edges are guarded.
// Deterministic: both are permutations (plus zero fill).
#include "kernels/nvfp4_matmul.h"

namespace surogate {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;  // transpose tile: 64 x 64 elements = 64 x 32 bytes each way

__global__ void swizzle_scales_kernel(const uint8_t* __restrict__ src, int64_t cols, int64_t rows,
                                      int row_div, int64_t col_groups, int64_t n_groups,
                                      uint32_t* __restrict__ dst) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= n_groups) return;
  // Enumerate destination groups in source order (r major, then c/4) for coalesced reads.
  const int64_t r = g / col_groups;
  const int64_t cg = g % col_groups;
  uint32_t word = 0;
  if (r < rows) {
    const uint8_t* row = src + (r / row_div) * cols;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = cg * 4 + i;
      if (c < cols) word |= static_cast<uint32_t>(row[c]) << (8 * i);  // little endian: byte c%4
    }
  }
  const int64_t off = ((r / 128) * col_groups + cg) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4;
  dst[off / 4] = word;
}

__global__ void transpose_codes_kernel(const uint8_t* __restrict__ src, int64_t rows, int64_t cols,
                                       uint8_t* __restrict__ dst) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // [src row][src col] nibbles
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t src_pitch = cols / 2, dst_pitch = rows / 2;
  for (int i = threadIdx.x; i < kTile * (kTile / 2); i += blockDim.x) {
    const int lr = i / (kTile / 2), lb = i % (kTile / 2);
    const int64_t r = r0 + lr, c = c0 + 2 * lb;
    uint8_t v = 0;
    if (r < rows && c < cols) v = src[r * src_pitch + c / 2];
    tile[lr][2 * lb] = v & 0xF;
    tile[lr][2 * lb + 1] = v >> 4;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * (kTile / 2); i += blockDim.x) {
    const int lc = i / (kTile / 2), lb = i % (kTile / 2);
    const int64_t c = c0 + lc, r = r0 + 2 * lb;
    if (c < cols && r < rows) {
      dst[c * dst_pitch + r / 2] =
          static_cast<uint8_t>(tile[2 * lb][lc] | (tile[2 * lb + 1][lc] << 4));
    }
  }
}

__global__ void gemm_alpha_kernel(const float* a_gs, const float* b_gs, float* out) {
  out[0] = __fmul_rn(a_gs[0], b_gs[0]);
  out[1] = 0.0f;
}

}  // namespace

cudaError_t nvfp4_swizzle_scales(const uint8_t* src, int64_t src_rows, int64_t cols, int64_t rows,
                                 int row_div, uint8_t* dst, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (row_div < 1 || (rows + row_div - 1) / row_div > src_rows) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(dst) % 4 != 0) return cudaErrorMisalignedAddress;
  const int64_t col_groups = (cols + 3) / 4;
  const int64_t n_groups = ((rows + 127) / 128) * 128 * col_groups;
  const int64_t blocks = (n_groups + kThreads - 1) / kThreads;
  swizzle_scales_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      src, cols, rows, row_div, col_groups, n_groups, reinterpret_cast<uint32_t*>(dst));
  return cudaGetLastError();
}

cudaError_t nvfp4_transpose_codes(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst,
                                  cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (rows % 2 != 0 || cols % 2 != 0) return cudaErrorInvalidValue;
  const int64_t gx = (cols + kTile - 1) / kTile, gy = (rows + kTile - 1) / kTile;
  if (gy > 65535) return cudaErrorInvalidConfiguration;
  transpose_codes_kernel<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0,
                           stream>>>(src, rows, cols, dst);
  return cudaGetLastError();
}

cudaError_t nvfp4_gemm_alpha(const float* a_gs, const float* b_gs, float* out,
                             cudaStream_t stream) {
  gemm_alpha_kernel<<<1, 1, 0, stream>>>(a_gs, b_gs, out);
  return cudaGetLastError();
}

}  // namespace surogate
