// NF4 dequantization kernel (see nf4_dequantize.h for the math and the launcher contract).
//
// Floor: memory bound. Bytes that must move per weight: read 0.5 (codes) + 4 / block_size
// (absmax), write sizeof(OutT). At block_size 64 and the H100's measured ~3.0 TB/s copy bandwidth:
//   [4096, 12288] (50.3 M weights): bf16 2.5625 B/w = 129.0 MB -> ~43.0 us
//                                   e4m3 1.5625 B/w =  78.6 MB -> ~26.2 us
//                                   f32  4.5625 B/w = 229.6 MB -> ~76.5 us
//   [25600, 5120] (131 M weights):  bf16 335.9 MB -> ~112.0 us, e4m3 204.8 MB -> ~68.3 us,
//                                   f32 598.0 MB -> ~199.3 us
// (block_size 512 saves 0.05 B/w.) Per weight the SMs do a nibble extract, one shared-memory
// lookup, one or two fp32 multiplies and a conversion: far below what they can issue meanwhile.
//
// Design (why):
//  * A chunk is the outputs of one 16-byte store: E = 16 / sizeof(OutT) weights (4 f32, 8 bf16 /
//    f16, 16 e4m3), from E/2 code bytes. E divides every block size, so a chunk needs one absmax.
//  * Thread t of a 256-thread block handles chunks base + u * 256 + t, u < 4: every load and every
//    store instruction of a warp covers one contiguous range (codes 64-256 B, out 512 B). The
//    alternative of one uint4 of codes per thread (32 weights) makes each warp store 16 B at a
//    64-128 B stride, i.e. twice the L2 sector writes, or a shared-memory transpose to avoid it.
//  * The four chunks' code and absmax loads are issued before any store, so a thread keeps 8-32 B
//    of reads in flight; neighbouring chunks share an absmax, which the load broadcasts.
//  * code_table is read by index, so it lives in shared memory (16 floats, 16 banks: no
//    conflicts), loaded once per block.
//  * Products are __fmul_rn: never contracted with the scale multiply, bit-equal to XLA's fp32
//    multiplies. Conversions: RNE pairs (vec::pack) and cvt.rn.satfinite for e4m3.
//  * Grid-stride over tiles of 1024 chunks (one pass for any real weight). The n % E weights past
//    the last chunk (an odd n's last one included) are done by threads of the last block.
//  * Scalar kernel, one weight per thread, when codes or out is not aligned for the vector path
//    (XLA's buffers always are; a sliced view from another caller may not be).
//  * Selective MoE dequantization (groups.sizes != nullptr): a tile whose weights all belong to
//    experts without tokens is skipped, and a block with no other tile returns before loading
//    anything; that saves the output write (2 B a weight in bf16) and the code reads. The check is
//    block-uniform, so the early return cannot split a __syncthreads.
#include "kernels/nf4_dequantize.h"

#include "kernels/dequant_common.cuh"

namespace surogate {
namespace {

using namespace dequant;  // the launch shape, round_via, pack16, store_one

// The B code bytes of one chunk as 32-bit words, byte 0 in the low bits of word 0.
template <int B>
__device__ __forceinline__ void load_codes(const uint8_t* p, uint32_t (&w)[(B + 3) / 4]) {
  if constexpr (B == 2) {
    w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  } else if constexpr (B == 4) {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    static_assert(B == 8, "2, 4 or 8 code bytes a chunk");
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x;
    w[1] = v.y;
  }
}

// Code of weight e of a chunk: byte e/2, high nibble for even e (bitsandbytes' packing).
template <int W>
__device__ __forceinline__ uint32_t nibble(const uint32_t (&w)[W], int e) {
  const int byte = e >> 1;
  const int shift = 8 * (byte & 3) + ((e & 1) ? 0 : 4);
  return (w[byte >> 2] >> shift) & 15u;
}

// One weight, for the scalar kernel and the vector kernel's tail. `table` is in shared memory.
template <typename OutT>
__device__ __forceinline__ void dequant_one(const uint8_t* codes, const float* absmax,
                                            const float* table, const float* scale, OutT* out,
                                            int64_t i, int log2_block, DequantVia via) {
  const uint32_t byte = __ldg(codes + (i >> 1));
  const uint32_t idx = (i & 1) ? (byte & 15u) : (byte >> 4);
  float v = round_via(__fmul_rn(table[idx], __ldg(absmax + (i >> log2_block))), via);
  if (scale != nullptr) v = __fmul_rn(v, __ldg(scale));
  store_one(out, i, v);
}

__device__ __forceinline__ void load_table(const float* code_table, float* table) {
  if (threadIdx.x < 16) table[threadIdx.x] = __ldg(code_table + threadIdx.x);
  __syncthreads();
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads)
    nf4_dequant_vec_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                           const float* __restrict__ code_table, const float* __restrict__ scale,
                           OutT* __restrict__ out, int64_t n, int64_t nchunks, int log2_block,
                           DequantVia via, Groups groups) {
  constexpr int E = kElems<OutT>, B = E / 2, W = (B + 3) / 4, U = kChunksPerThread;
  const int64_t tile = int64_t{kThreads} * U;
  // the weights of the tile at chunk `base` (the last tile may be short)
  auto tile_active = [&](int64_t base) {
    return groups.any_active(base * E, std::min(base + tile, nchunks) * E - 1);
  };
  const bool has_tail = blockIdx.x == gridDim.x - 1 && nchunks * E < n;
  bool work = has_tail && groups.any_active(nchunks * E, n - 1);
  for (int64_t base = int64_t{blockIdx.x} * tile; base < nchunks && !work;
       base += int64_t{gridDim.x} * tile) {
    work = tile_active(base);
  }
  if (!work) return;  // every weight of this block is an empty expert's: nothing read or written
  __shared__ float table[16];
  load_table(code_table, table);
  const bool has_scale = scale != nullptr;
  const float s = has_scale ? __ldg(scale) : 1.f;
  for (int64_t base = int64_t{blockIdx.x} * tile; base < nchunks;
       base += int64_t{gridDim.x} * tile) {
    if (!tile_active(base)) continue;
    uint32_t w[U][W] = {};
    float a[U] = {};
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * kThreads + threadIdx.x;
      if (c < nchunks) {
        load_codes<B>(codes + c * B, w[u]);
        a[u] = __ldg(absmax + ((c * E) >> log2_block));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * kThreads + threadIdx.x;
      if (c >= nchunks) continue;
      float v[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        v[e] = round_via(__fmul_rn(table[nibble(w[u], e)], a[u]), via);
        if (has_scale) v[e] = __fmul_rn(v[e], s);
      }
      *reinterpret_cast<uint4*>(out + c * E) = pack16<OutT>(v);
    }
  }
  if (has_tail) {  // the < E weights past the last whole chunk
    const int64_t i = nchunks * E + threadIdx.x;
    if (i < n && groups.any_active(i, i)) {
      dequant_one(codes, absmax, table, scale, out, i, log2_block, via);
    }
  }
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads)
    nf4_dequant_scalar_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                              const float* __restrict__ code_table, const float* __restrict__ scale,
                              OutT* __restrict__ out, int64_t n, int log2_block, DequantVia via,
                              Groups groups) {
  __shared__ float table[16];
  load_table(code_table, table);
  const int64_t step = int64_t{gridDim.x} * kThreads;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < n; i += step) {
    if (groups.any_active(i, i)) dequant_one(codes, absmax, table, scale, out, i, log2_block, via);
  }
}

int log2_block_size(int block_size) {
  switch (block_size) {
    case 64:
      return 6;
    case 128:
      return 7;
    case 256:
      return 8;
    case 512:
      return 9;
    default:
      return -1;
  }
}

}  // namespace

template <typename OutT>
cudaError_t nf4_dequantize(const uint8_t* codes, const float* absmax, const float* code_table,
                           const float* scale, OutT* out, int64_t n, int block_size, DequantVia via,
                           const int32_t* group_sizes, int64_t weights_per_group,
                           cudaStream_t stream) {
  const int log2_block = log2_block_size(block_size);
  const int v = static_cast<int>(via);
  if (n < 0 || log2_block < 0 || v < 0 || v > 2) return cudaErrorInvalidValue;
  if (group_sizes != nullptr && (weights_per_group <= 0 || n % weights_per_group != 0)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  const Groups groups{group_sizes, weights_per_group};
  constexpr int E = kElems<OutT>;
  const bool aligned = reinterpret_cast<uintptr_t>(codes) % (E / 2) == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (aligned) {
    const int64_t nchunks = n / E;
    nf4_dequant_vec_kernel<OutT>
        <<<grid_for(nchunks, int64_t{kThreads} * kChunksPerThread), kThreads, 0, stream>>>(
            codes, absmax, code_table, scale, out, n, nchunks, log2_block, via, groups);
  } else {
    nf4_dequant_scalar_kernel<OutT><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        codes, absmax, code_table, scale, out, n, log2_block, via, groups);
  }
  return cudaGetLastError();
}

#define SUROGATE_NF4_DEQUANTIZE_INSTANTIATE(OutT)                                          \
  template cudaError_t nf4_dequantize<OutT>(const uint8_t*, const float*, const float*,    \
                                            const float*, OutT*, int64_t, int, DequantVia, \
                                            const int32_t*, int64_t, cudaStream_t);

SUROGATE_NF4_DEQUANTIZE_INSTANTIATE(float)
SUROGATE_NF4_DEQUANTIZE_INSTANTIATE(__nv_bfloat16)
SUROGATE_NF4_DEQUANTIZE_INSTANTIATE(__half)
SUROGATE_NF4_DEQUANTIZE_INSTANTIATE(__nv_fp8_e4m3)

}  // namespace surogate
