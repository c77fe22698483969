// Tile-scaled weight dequantization kernels (see tile_dequantize.h for the formats, the math and
// the launcher contract).
//
// Floor: memory bound. Bytes that must move per weight: the codes (1 B for FP8, 0.5 B for NVFP4)
// read, sizeof(OutT) written; the tile scales are 4 / tile^2 (FP8) or 1 / 256 (NVFP4) B, nothing.
// At the H100's measured ~3.0 TB/s copy bandwidth, per 1 G weights:
//   FP8   -> bf16 3 B/w: 1.00 ms,  -> e4m3 2 B/w: 0.67 ms,  -> f32 5 B/w: 1.67 ms
//   NVFP4 -> bf16 2.5 B/w: 0.83 ms, -> e4m3 1.5 B/w: 0.50 ms
// Per weight the SMs do one conversion or table lookup, two or three fp32 multiplies and a store
// conversion: far below what they can issue meanwhile.
//
// Design (why):
//  * A chunk is the outputs of one 16-byte store: E = 16 / sizeof(OutT) consecutive weights of one
//    row (4 f32, 8 bf16 / f16, 16 e4m3; cols % E == 0), from E (FP8) or E / 2 (NVFP4) code bytes
//    and one tile scale (every tile is a multiple of 16 wide). With 16-weight chunks a bf16 warp
//    stored 16 B per thread at a 32 B stride (half-used sectors per instruction): 0.89x XLA's
//    fusion at [4096, 12288] on the H100.
//  * Thread t of a 256-thread block handles chunks base + u * 256 + t, u < 4: every load and store
//    instruction of a warp covers one contiguous range; the four chunks' code and scale loads are
//    issued before any store. Neighbouring chunks share a tile scale, which the load broadcasts.
//  * NVFP4's 16 signed E2M1 values live in shared memory (16 banks, no conflicts); FP8 codes go
//    through the exact e4m3x2 -> half2 conversion.
//  * Products are __fmul_rn: never contracted into an FMA, bit-equal to XLA's fp32 multiplies.
//  * Scalar kernel, one weight per thread, when cols % E != 0 (FP8 only) or a pointer is not
//    aligned for the vector path (XLA's buffers always are; a sliced view may not be).
//  * Selective MoE dequantization (groups.sizes != nullptr): a tile whose rows all belong to
//    experts without tokens is skipped, and a block with no other tile returns before loading
//    anything (the NVFP4 table included); that saves the output write and the code reads. The
//    check is block-uniform, so the early return cannot split a __syncthreads.
#include "kernels/tile_dequantize.h"

#include "kernels/dequant_common.cuh"

namespace surogate {
namespace {

using namespace dequant;  // the launch shape, round_via, pack16, store_one

// E2M1 values by 4-bit code (bit 3 the sign; code 8 is -0).
__constant__ float kE2m1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

template <TileFormat F, typename OutT>
constexpr int kCodeBytes = F == TileFormat::kFp8 ? kElems<OutT> : kElems<OutT> / 2;  // per chunk

__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __half2float(__half(h));
}

// Tile scale t of the grid: f32 for FP8, e4m3 for NVFP4.
template <TileFormat F>
__device__ __forceinline__ float tile_scale(const void* tile_scales, int64_t t) {
  if constexpr (F == TileFormat::kFp8) {
    return __ldg(static_cast<const float*>(tile_scales) + t);
  } else {
    return e4m3_to_float(__ldg(static_cast<const uint8_t*>(tile_scales) + t));
  }
}

// (e2m1 * tile scale) * global for NVFP4, code * tile scale for FP8: the weight before `via`.
template <TileFormat F>
__device__ __forceinline__ float weight_value(uint32_t code, float ts, float g,
                                              const float* table) {
  if constexpr (F == TileFormat::kFp8) {
    return __fmul_rn(e4m3_to_float(code), ts);
  } else {
    return __fmul_rn(__fmul_rn(table[code], ts), g);
  }
}

// Code e of a chunk, as an e4m3 byte (FP8) or a 4-bit E2M1 code (NVFP4).
template <TileFormat F>
__device__ __forceinline__ uint32_t chunk_code(const uint4& w, int e) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  if constexpr (F == TileFormat::kFp8) {
    return (words[e >> 2] >> (8 * (e & 3))) & 0xffu;
  } else {  // byte e/2: element 2j in the low nibble
    const int byte = e >> 1;
    return (words[byte >> 2] >> (8 * (byte & 3) + ((e & 1) ? 4 : 0))) & 15u;
  }
}

// B (2, 4, 8 or 16) code bytes, byte 0 in the low bits of .x.
template <int B>
__device__ __forceinline__ uint4 load_chunk_codes(const uint8_t* p) {
  if constexpr (B == 16) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else if constexpr (B == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    return make_uint4(v.x, v.y, 0u, 0u);
  } else if constexpr (B == 4) {
    return make_uint4(__ldg(reinterpret_cast<const unsigned int*>(p)), 0u, 0u, 0u);
  } else {
    static_assert(B == 2, "2, 4, 8 or 16 code bytes a chunk");
    return make_uint4(__ldg(reinterpret_cast<const unsigned short*>(p)), 0u, 0u, 0u);
  }
}

template <TileFormat F>
__device__ __forceinline__ const float* load_table(float* table) {
  if constexpr (F == TileFormat::kNvfp4) {
    if (threadIdx.x < 16) table[threadIdx.x] = kE2m1[threadIdx.x];
    __syncthreads();
  }
  return table;
}

template <TileFormat F, typename OutT>
__global__ void __launch_bounds__(kThreads)
    tile_dequant_vec_kernel(const uint8_t* __restrict__ codes, const void* __restrict__ tile_scales,
                            const float* __restrict__ global_scale, const float* __restrict__ scale,
                            OutT* __restrict__ out, int64_t nchunks, int64_t chunks_per_row,
                            int64_t scale_cols, int log2_tile, DequantVia via, Groups groups) {
  constexpr int U = kChunksPerThread, CB = kCodeBytes<F, OutT>, E = kElems<OutT>;
  const int64_t span = int64_t{kThreads} * U;
  // the rows of the span at chunk `base` (the last span may be short)
  auto span_active = [&](int64_t base) {
    return groups.any_active(base / chunks_per_row,
                             (std::min(base + span, nchunks) - 1) / chunks_per_row);
  };
  bool work = false;
  for (int64_t base = int64_t{blockIdx.x} * span; base < nchunks && !work;
       base += int64_t{gridDim.x} * span) {
    work = span_active(base);
  }
  if (!work) return;  // every row of this block is an empty expert's: nothing read or written
  __shared__ float table_smem[16];
  const float* table = load_table<F>(table_smem);
  const float g = F == TileFormat::kNvfp4 ? __ldg(global_scale) : 1.f;
  const bool has_scale = scale != nullptr;
  const float s = has_scale ? __ldg(scale) : 1.f;
  for (int64_t base = int64_t{blockIdx.x} * span; base < nchunks;
       base += int64_t{gridDim.x} * span) {
    if (!span_active(base)) continue;
    uint4 w[U];
    float ts[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * kThreads + threadIdx.x;
      w[u] = make_uint4(0u, 0u, 0u, 0u);
      ts[u] = 0.f;
      if (c < nchunks) {
        const int64_t r = c / chunks_per_row;
        const int64_t col = (c - r * chunks_per_row) * E;
        w[u] = load_chunk_codes<CB>(codes + c * CB);
        ts[u] = tile_scale<F>(tile_scales, (r >> log2_tile) * scale_cols + (col >> log2_tile));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * kThreads + threadIdx.x;
      if (c >= nchunks) continue;
      float v[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        v[e] = round_via(weight_value<F>(chunk_code<F>(w[u], e), ts[u], g, table), via);
        if (has_scale) v[e] = __fmul_rn(v[e], s);
      }
      *reinterpret_cast<uint4*>(out + c * E) = pack16<OutT>(v);
    }
  }
}

template <TileFormat F, typename OutT>
__global__ void __launch_bounds__(kThreads)
    tile_dequant_scalar_kernel(const uint8_t* __restrict__ codes,
                               const void* __restrict__ tile_scales,
                               const float* __restrict__ global_scale,
                               const float* __restrict__ scale, OutT* __restrict__ out,
                               int64_t rows, int64_t cols, int64_t scale_cols, int log2_tile,
                               DequantVia via, Groups groups) {
  __shared__ float table_smem[16];
  const float* table = load_table<F>(table_smem);
  const float g = F == TileFormat::kNvfp4 ? __ldg(global_scale) : 1.f;
  const int64_t n = rows * cols, step = int64_t{gridDim.x} * kThreads;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < n; i += step) {
    const int64_t r = i / cols, col = i - r * cols;
    if (!groups.any_active(r, r)) continue;
    uint32_t code;
    if constexpr (F == TileFormat::kFp8) {
      code = __ldg(codes + i);
    } else {
      const uint32_t byte = __ldg(codes + r * (cols / 2) + col / 2);
      code = (col & 1) ? (byte >> 4) : (byte & 15u);
    }
    const float ts = tile_scale<F>(tile_scales, (r >> log2_tile) * scale_cols + (col >> log2_tile));
    float v = round_via(weight_value<F>(code, ts, g, table), via);
    if (scale != nullptr) v = __fmul_rn(v, __ldg(scale));
    store_one(out, i, v);
  }
}

int log2_exact(int x) {
  if (x <= 0 || (x & (x - 1))) return -1;
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

template <TileFormat F, typename OutT>
cudaError_t launch(const uint8_t* codes, const void* tile_scales, const float* global_scale,
                   const float* scale, OutT* out, int64_t rows, int64_t cols, int log2_tile,
                   DequantVia via, Groups groups, cudaStream_t stream) {
  const int64_t scale_cols = (cols + (int64_t{1} << log2_tile) - 1) >> log2_tile;
  constexpr int E = kElems<OutT>;
  const bool aligned = cols % E == 0 &&
                       reinterpret_cast<uintptr_t>(codes) % kCodeBytes<F, OutT> == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (aligned) {
    const int64_t nchunks = rows * cols / E;
    tile_dequant_vec_kernel<F, OutT>
        <<<grid_for(nchunks, int64_t{kThreads} * kChunksPerThread), kThreads, 0, stream>>>(
            codes, tile_scales, global_scale, scale, out, nchunks, cols / E, scale_cols, log2_tile,
            via, groups);
  } else {
    tile_dequant_scalar_kernel<F, OutT><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(
        codes, tile_scales, global_scale, scale, out, rows, cols, scale_cols, log2_tile, via,
        groups);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename OutT>
cudaError_t tile_dequantize(TileFormat format, const uint8_t* codes, const void* tile_scales,
                            const float* global_scale, const float* scale, OutT* out, int64_t rows,
                            int64_t cols, int tile, DequantVia via, const int32_t* group_sizes,
                            int64_t rows_per_group, cudaStream_t stream) {
  const int log2_tile = log2_exact(tile);
  const int v = static_cast<int>(via);
  if (rows < 0 || cols < 0 || log2_tile < 4 || log2_tile > 9 || v < 0 || v > 2) {
    return cudaErrorInvalidValue;
  }
  if (format == TileFormat::kNvfp4 && (tile != 16 || cols % 16 != 0)) return cudaErrorInvalidValue;
  if (group_sizes != nullptr && (rows_per_group <= 0 || rows % rows_per_group != 0)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || cols == 0) return cudaSuccess;
  const Groups groups{group_sizes, rows_per_group};
  switch (format) {
    case TileFormat::kFp8:
      return launch<TileFormat::kFp8>(codes, tile_scales, global_scale, scale, out, rows, cols,
                                      log2_tile, via, groups, stream);
    case TileFormat::kNvfp4:
      return launch<TileFormat::kNvfp4>(codes, tile_scales, global_scale, scale, out, rows, cols,
                                        log2_tile, via, groups, stream);
  }
  return cudaErrorInvalidValue;
}

#define SUROGATE_TILE_DEQUANTIZE_INSTANTIATE(OutT)                                         \
  template cudaError_t tile_dequantize<OutT>(                                              \
      TileFormat, const uint8_t*, const void*, const float*, const float*, OutT*, int64_t, \
      int64_t, int, DequantVia, const int32_t*, int64_t, cudaStream_t);

SUROGATE_TILE_DEQUANTIZE_INSTANTIATE(float)
SUROGATE_TILE_DEQUANTIZE_INSTANTIATE(__nv_bfloat16)
SUROGATE_TILE_DEQUANTIZE_INSTANTIATE(__half)
SUROGATE_TILE_DEQUANTIZE_INSTANTIATE(__nv_fp8_e4m3)

}  // namespace surogate
