// RMSNorm forward/backward kernels (see rms_norm.h for the math and the launcher contract).
//
// Floor: the op is memory bound. Bytes that must move = rows * dim * sizeof(T) * 2 forward
// (read x, write y) and * 3 backward (read dy and x, write dx), plus rows * 4 for rstd and a few
// dim-sized vectors. At the H100's measured ~3.0 TB/s device copy bandwidth (read + write) that is
// e.g. 16384 x 4096 bf16: fwd 268 MB -> ~89 us, bwd 403 MB -> ~134 us; 1M x 128 bf16 (head-dim
// norms): fwd 537 MB -> ~179 us. Anything close to these numbers is as fast as the op can be.
//
// Design (why):
//  * One row is owned by a group of threads: a power-of-two slice of a warp (<= 32 lanes) when the
//    row has <= 128 vectors, so small rows (head dims) do not idle lanes and need no barriers; the
//    whole block otherwise (large hidden sizes), reduced through shared memory.
//  * 16-byte vector loads/stores when dim is a multiple of 16 / sizeof(T) and the pointers are
//    16-byte aligned; a scalar path otherwise (dim = 7, 1001, ...).
//  * Persistent grid: at most (SMs x resident blocks per SM) blocks that stride over the rows.
//    The row is read twice per pass; the second read hits L1/L2, not DRAM.
//  * dw: each row group keeps fp32 partial sums for its columns (shared memory; global memory for
//    enormous dim), each block writes one partial row to the workspace [blocks, dim], and a second
//    small kernel sums the workspace over blocks. No atomics, so results are deterministic.
#include "kernels/rms_norm.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <initializer_list>

namespace surogate {
namespace {

constexpr int kWarp = 32;
constexpr int kSubWarpMaxVecs = 128;  // rows with <= this many vectors: sub-warp groups
constexpr int kSubWarpThreads = 256;  // block size in sub-warp mode
constexpr int kFinalRows = 16;        // threadIdx.y extent of the dw finalize kernel

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);  // round to nearest even
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);  // round to nearest even
}

// N consecutive elements as floats: one 16-byte load when N > 1.
template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = to_float(p[0]);
  } else {
    static_assert(N * sizeof(T) == 16, "the vector path moves 16 bytes");
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    T v[N];
    memcpy(v, &raw, sizeof(raw));
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(v[k]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  if constexpr (N == 1) {
    p[0] = from_float<T>(in[0]);
  } else {
    T v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = from_float<T>(in[k]);
    uint4 raw;
    memcpy(&raw, v, sizeof(raw));
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

// How a thread walks the rows. `first` and `stride` are uniform over a warp (sub-warp mode) or a
// block (block mode), so every thread reaches the same shuffles and barriers; a group whose row
// is past the end just contributes zeros.
struct RowLoop {
  int64_t first;   // row of group 0 of this warp/block in the first iteration
  int64_t stride;  // rows advanced per iteration
  int sub;         // this thread's group offset from `first`
  int lane;        // index within the group
  int width;       // threads per group
};

template <bool kBlockRow>
__device__ __forceinline__ RowLoop row_loop(int width) {
  if constexpr (kBlockRow) {
    return {static_cast<int64_t>(blockIdx.x), static_cast<int64_t>(gridDim.x), 0,
            static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
  } else {
    const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, per_warp = kWarp / width;
    return {(static_cast<int64_t>(blockIdx.x) * warps + warp) * per_warp,
            static_cast<int64_t>(gridDim.x) * warps * per_warp,
            static_cast<int>(threadIdx.x % kWarp) / width, static_cast<int>(threadIdx.x) % width,
            width};
  }
}

__device__ __forceinline__ float xor_sum(float v, int span) {
  for (int o = span / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the thread's group. All threads of the warp (block) must call it.
template <bool kBlockRow>
__device__ __forceinline__ float group_sum(float v, int width, float* red) {
  if constexpr (!kBlockRow) {
    return xor_sum(v, width);  // xor offsets < width stay inside the aligned group
  } else {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    v = xor_sum(v, kWarp);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
      float t = lane < static_cast<int>(blockDim.x / kWarp) ? red[lane] : 0.f;
      t = xor_sum(t, kWarp);
      if (lane == 0) red[kWarp] = t;
    }
    __syncthreads();
    return red[kWarp];  // next write to red[kWarp] comes after the next call's first barrier
  }
}

template <typename T, int N, bool kBlockRow>
__global__ void __launch_bounds__(1024)
    rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                        float* __restrict__ rstd, int64_t rows, int dim, int width, float eps) {
  __shared__ float red[kWarp + 1];
  const RowLoop L = row_loop<kBlockRow>(width);
  const int nvec = dim / N;
  for (int64_t base = L.first; base < rows; base += L.stride) {
    const int64_t row = base + L.sub;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * dim;
    float ss = 0.f;
    if (active) {
      for (int i = L.lane; i < nvec; i += L.width) {
        float v[N];
        load<T, N>(x + off + static_cast<int64_t>(i) * N, v);
#pragma unroll
        for (int k = 0; k < N; ++k) ss += v[k] * v[k];
      }
    }
    ss = group_sum<kBlockRow>(ss, width, red);
    if (!active) continue;  // no shuffle or barrier below
    const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
    if (L.lane == 0) rstd[row] = r;
    for (int i = L.lane; i < nvec; i += L.width) {
      const int64_t c = static_cast<int64_t>(i) * N;
      float v[N], g[N], o[N];
      load<T, N>(x + off + c, v);
      load<T, N>(w + c, g);
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = v[k] * r * g[k];
      store<T, N>(y + off + c, o);
    }
  }
}

// ws: [gridDim.x, dim] float32; block b writes its dw partial sums to row b. With smem_partials
// the group partials live in dynamic shared memory ([groups, dim], transposed within a row so
// consecutive lanes hit consecutive banks); otherwise (block mode, dim too large for shared
// memory) directly in the block's workspace row.
template <typename T, int N, bool kBlockRow>
__global__ void __launch_bounds__(1024)
    rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                        const T* __restrict__ w, const float* __restrict__ rstd,
                        T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int dim,
                        int width, bool smem_partials) {
  extern __shared__ float smem[];
  __shared__ float red[kWarp + 1];
  const RowLoop L = row_loop<kBlockRow>(width);
  const int nvec = dim / N;
  const int groups = kBlockRow ? 1 : static_cast<int>(blockDim.x) / width;
  const int group = kBlockRow ? 0 : static_cast<int>(threadIdx.x) / width;
  float* block_ws = ws + static_cast<int64_t>(blockIdx.x) * dim;
  float* part = smem_partials ? smem + static_cast<int64_t>(group) * dim : block_ws;
  float* zero_base = smem_partials ? smem : block_ws;
  const int zero_n = smem_partials ? groups * dim : dim;
  for (int i = threadIdx.x; i < zero_n; i += blockDim.x) zero_base[i] = 0.f;
  __syncthreads();

  for (int64_t base = L.first; base < rows; base += L.stride) {
    const int64_t row = base + L.sub;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * dim;
    const float r = active ? rstd[row] : 0.f;
    float dot = 0.f;  // sum(dy * w * x)
    if (active) {
      for (int i = L.lane; i < nvec; i += L.width) {
        const int64_t c = static_cast<int64_t>(i) * N;
        float a[N], b[N], g[N];
        load<T, N>(dy + off + c, a);
        load<T, N>(x + off + c, b);
        load<T, N>(w + c, g);
#pragma unroll
        for (int k = 0; k < N; ++k) dot += a[k] * g[k] * b[k];
      }
    }
    dot = group_sum<kBlockRow>(dot, width, red);
    if (!active) continue;
    const float m = r * dot / static_cast<float>(dim);  // mean(g * xhat)
    for (int i = L.lane; i < nvec; i += L.width) {
      const int64_t c = static_cast<int64_t>(i) * N;
      float a[N], b[N], g[N], o[N];
      load<T, N>(dy + off + c, a);
      load<T, N>(x + off + c, b);
      load<T, N>(w + c, g);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xhat = b[k] * r;
        o[k] = r * (a[k] * g[k] - xhat * m);
        part[smem_partials ? k * nvec + i : i * N + k] += a[k] * xhat;
      }
      store<T, N>(dx + off + c, o);
    }
  }

  __syncthreads();
  if (smem_partials) {
    for (int col = threadIdx.x; col < dim; col += blockDim.x) {
      const int idx = (col % N) * nvec + col / N;
      float s = 0.f;
      for (int q = 0; q < groups; ++q) s += smem[q * dim + idx];
      block_ws[col] = s;
    }
  }
}

// dw[col] = sum over the `parts` rows of ws[:, col]. Block (32, kFinalRows), one column per x.
template <typename T>
__global__ void rms_norm_dw_finalize_kernel(const float* __restrict__ ws, T* __restrict__ dw,
                                            int parts, int dim) {
  __shared__ float acc[kFinalRows][kWarp + 1];
  const int col = blockIdx.x * kWarp + threadIdx.x;
  float s = 0.f;
  if (col < dim) {
    for (int p = threadIdx.y; p < parts; p += kFinalRows) s += ws[static_cast<int64_t>(p) * dim + col];
  }
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < dim) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < kFinalRows; ++j) t += acc[j][threadIdx.x];
    dw[col] = from_float<T>(t);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: launch plans.

struct Plan {
  int vec = 1;              // elements per load (1 or 16 / sizeof(T))
  bool block_row = false;   // a block per row (else sub-warp groups of `width` lanes)
  int width = kWarp;        // threads per row group (sub-warp mode)
  int threads = 0;
  int rows_per_block = 1;
  size_t smem = 0;          // dynamic shared memory bytes
  bool smem_partials = true;
  int blocks = 0;
};

#define SUROGATE_TRY(expr)                   \
  do {                                       \
    const cudaError_t err_ = (expr);         \
    if (err_ != cudaSuccess) return err_;    \
  } while (0)

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
int pick_vec(int64_t dim, std::initializer_list<const void*> ptrs) {
  if (dim % kVec<T> != 0) return 1;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVec<T>;
}

// Thread layout: depends only on how many vectors a row has.
Plan layout_plan(int64_t dim, int vec) {
  Plan p;
  p.vec = vec;
  const int64_t nvec = dim / vec;
  if (nvec <= kSubWarpMaxVecs) {
    int width = 1;
    while (width < nvec && width < kWarp) width *= 2;
    p.block_row = false;
    p.width = width;
    p.threads = kSubWarpThreads;
    p.rows_per_block = kSubWarpThreads / width;
  } else {
    // About two vectors per thread per pass, a whole number of warps, at most 1024 threads.
    const int64_t t = ((nvec + 1) / 2 + kWarp - 1) / kWarp * kWarp;
    p.block_row = true;
    p.width = static_cast<int>(std::min<int64_t>(t, 1024));
    p.threads = p.width;
    p.rows_per_block = 1;
  }
  return p;
}

// Persistent grid: as many blocks as fit on the device at once, but no more than there is work.
template <typename Kernel>
cudaError_t size_grid(Kernel kernel, int64_t rows, Plan& p) {
  int dev = 0, sms = 0, per_sm = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  SUROGATE_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (p.smem > 48 * 1024) {
    SUROGATE_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(p.smem)));
  }
  SUROGATE_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, p.threads, p.smem));
  const int64_t need = (rows + p.rows_per_block - 1) / p.rows_per_block;
  const int64_t fit = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  p.blocks = static_cast<int>(std::max<int64_t>(1, std::min(need, fit)));
  return cudaSuccess;
}

template <typename T>
using FwdKernel = void (*)(const T*, const T*, T*, float*, int64_t, int, int, float);
template <typename T>
using BwdKernel = void (*)(const T*, const T*, const T*, const float*, T*, float*, int64_t, int,
                           int, bool);

template <typename T>
FwdKernel<T> fwd_kernel(const Plan& p) {
  if (p.vec == 1) {
    return p.block_row ? rms_norm_fwd_kernel<T, 1, true> : rms_norm_fwd_kernel<T, 1, false>;
  }
  return p.block_row ? rms_norm_fwd_kernel<T, kVec<T>, true> : rms_norm_fwd_kernel<T, kVec<T>, false>;
}

template <typename T>
BwdKernel<T> bwd_kernel(const Plan& p) {
  if (p.vec == 1) {
    return p.block_row ? rms_norm_bwd_kernel<T, 1, true> : rms_norm_bwd_kernel<T, 1, false>;
  }
  return p.block_row ? rms_norm_bwd_kernel<T, kVec<T>, true> : rms_norm_bwd_kernel<T, kVec<T>, false>;
}

template <typename T>
cudaError_t bwd_plan(int64_t rows, int64_t dim, int vec, Plan* out) {
  Plan p = layout_plan(dim, vec);
  const size_t row_bytes = static_cast<size_t>(dim) * sizeof(float);
  if (p.block_row) {
    int dev = 0, optin = 0;
    SUROGATE_TRY(cudaGetDevice(&dev));
    SUROGATE_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    // Leave room for the static `red` array; beyond that keep partials in global memory.
    p.smem_partials = row_bytes + 1024 <= static_cast<size_t>(optin);
    p.smem = p.smem_partials ? row_bytes : 0;
  } else {
    p.smem_partials = true;
    p.smem = static_cast<size_t>(p.threads / p.width) * row_bytes;  // <= 32 KiB by construction
  }
  SUROGATE_TRY(size_grid(bwd_kernel<T>(p), rows, p));
  *out = p;
  return cudaSuccess;
}

}  // namespace

template <typename T>
cudaError_t rms_norm_fwd(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t dim,
                         float eps, cudaStream_t stream) {
  if (dim <= 0 || dim > INT_MAX || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  Plan p = layout_plan(dim, pick_vec<T>(dim, {x, w, y}));
  const FwdKernel<T> kernel = fwd_kernel<T>(p);
  SUROGATE_TRY(size_grid(kernel, rows, p));
  kernel<<<p.blocks, p.threads, 0, stream>>>(x, w, y, rstd, rows, static_cast<int>(dim), p.width,
                                              eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rms_norm_bwd(const T* dy, const T* x, const T* w, const float* rstd, T* dx, T* dw,
                         int64_t rows, int64_t dim, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  if (dim <= 0 || dim > INT_MAX || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaMemsetAsync(dw, 0, static_cast<size_t>(dim) * sizeof(T), stream);
  Plan p;
  SUROGATE_TRY(bwd_plan<T>(rows, dim, pick_vec<T>(dim, {dy, x, w, dx}), &p));
  // The grid strides over rows, so a workspace with fewer partial rows than the device could
  // run blocks just means fewer, longer-lived blocks.
  const int64_t ws_rows = static_cast<int64_t>(workspace_bytes / (static_cast<size_t>(dim) * sizeof(float)));
  if (workspace == nullptr || ws_rows < 1 || reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  p.blocks = static_cast<int>(std::min<int64_t>(p.blocks, ws_rows));
  float* ws = static_cast<float*>(workspace);
  bwd_kernel<T>(p)<<<p.blocks, p.threads, p.smem, stream>>>(dy, x, w, rstd, dx, ws, rows,
                                                            static_cast<int>(dim), p.width,
                                                            p.smem_partials);
  SUROGATE_TRY(cudaGetLastError());
  const dim3 block(kWarp, kFinalRows);
  const unsigned grid = static_cast<unsigned>((dim + kWarp - 1) / kWarp);
  rms_norm_dw_finalize_kernel<T><<<grid, block, 0, stream>>>(ws, dw, p.blocks,
                                                             static_cast<int>(dim));
  return cudaGetLastError();
}

#define SUROGATE_RMS_NORM_INSTANTIATE(T)                                                        \
  template cudaError_t rms_norm_fwd<T>(const T*, const T*, T*, float*, int64_t, int64_t, float, \
                                       cudaStream_t);                                           \
  template cudaError_t rms_norm_bwd<T>(const T*, const T*, const T*, const float*, T*, T*,      \
                                       int64_t, int64_t, void*, size_t, cudaStream_t);

SUROGATE_RMS_NORM_INSTANTIATE(float)
SUROGATE_RMS_NORM_INSTANTIATE(__nv_bfloat16)
SUROGATE_RMS_NORM_INSTANTIATE(__half)

}  // namespace surogate
