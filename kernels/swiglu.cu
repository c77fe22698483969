// SwiGLU forward/backward kernels (see swiglu.h for the math and the launcher contract).
//
// Floor: purely element-wise and memory bound. Bytes that must move per element:
//   forward  read gate + up, write h                 = 3 * sizeof(T)
//   backward read dh + gate + up, write dgate + dup  = 5 * sizeof(T)
// At the H100's measured ~3.0 TB/s copy bandwidth (read + write):
//   [16384, 3072] bf16: fwd 302 MB -> ~101 us, bwd 503 MB -> ~168 us
//   [8192, 17408] bf16: fwd 856 MB -> ~285 us, bwd 1426 MB -> ~475 us
// FLOPs (~20 per element incl. one exp) are far below what the SMs can issue in that time, so the
// kernel only has to keep enough bytes in flight.
//
// Design (why):
//  * 2-D grid: x walks 16-byte column vectors of a row, y walks rows. No integer division per
//    element, and row-strided views (a packed gate_up [rows, 2F]) cost nothing extra.
//  * One 16-byte vector of one row per thread, 256-thread blocks, one block per row group (rows
//    loop in-kernel only past 65535 groups): the shape of XLA's loop fusion. The bytes in flight
//    come from occupancy (2 or 3 loads per thread, 1536-2048 resident threads per SM), and many
//    small blocks balance the end of the grid; on the H100 this matches XLA's fusion in both
//    passes, where persistent grids, several rows per thread or streaming loads ran 1-10% behind
//    it (those launch shapes: see git tag pre-cleanup).
//  * fp32 math, one rounding of each output; sigmoid from ex2.approx and rcp.approx
//    (device_common.cuh).
//  * Scalar path when F or the row stride is not a multiple of the vector or a pointer is not
//    16-byte aligned (F = 1001, ...).
#include "kernels/swiglu.h"

#include <algorithm>
#include <initializer_list>

#include "kernels/device_common.cuh"

namespace surogate {
namespace {

using vec::kVec;

constexpr int kThreads = 256;
// Resident 256-thread blocks asked of ptxas: forward 8 (<= 32 registers, 2048 threads), backward
// 6 (<= 40: at 32 the bf16 backward spilled 56 bytes).
constexpr int kFwdMinBlocks = 8;
constexpr int kBwdMinBlocks = 6;

struct Grid2 {
  dim3 grid, block;
};

// Block: up to kThreads threads along the row's vectors, the rest of the block along rows; one
// block per blockDim.y rows (capped at 65535: the kernels loop over the rest).
Grid2 plan(int64_t rows, int64_t nvec) {
  // The widest power-of-two x extent that leaves few idle lanes in the row's last block (idle
  // warps still hold their block's slot): e.g. 384 vectors -> 3 x 128, not 2 x 256.
  int bx = 32;
  while (bx < nvec && bx < kThreads) bx *= 2;
  for (int cand = bx; cand >= 32; cand /= 2) {
    const int64_t waste = (nvec + cand - 1) / cand * cand - nvec;
    if (waste * 16 <= nvec) {
      bx = cand;
      break;
    }
  }
  const int by = kThreads / bx;
  const int64_t gx = (nvec + bx - 1) / bx;
  const int64_t row_groups = (rows + by - 1) / by;
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>(row_groups, 65535));
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(bx, by)};
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads, kFwdMinBlocks)
    swiglu_fwd_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ h,
                      int64_t rows, int64_t nvec, int64_t ld_in, int64_t ld_out) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t col = v * N;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
       r += step) {
    const vec::Raw<T, N> g = vec::load_raw<T, N>(gate + r * ld_in + col);
    const vec::Raw<T, N> u = vec::load_raw<T, N>(up + r * ld_in + col);
    float gf[N], uf[N], o[N];
    vec::unpack(g, gf);
    vec::unpack(u, uf);
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] = gf[e] * sigmoid(gf[e]) * uf[e];
    vec::store<T, N>(h + r * ld_out + col, o);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads, kBwdMinBlocks)
    swiglu_bwd_kernel(const T* __restrict__ dh, const T* __restrict__ gate,
                      const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                      int64_t rows, int64_t nvec, int64_t ld_in, int64_t ld_dh) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t col = v * N;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
       r += step) {
    const vec::Raw<T, N> d = vec::load_raw<T, N>(dh + r * ld_dh + col);
    const vec::Raw<T, N> g = vec::load_raw<T, N>(gate + r * ld_in + col);
    const vec::Raw<T, N> u = vec::load_raw<T, N>(up + r * ld_in + col);
    float df[N], gf[N], uf[N], dg[N], du[N];
    vec::unpack(d, df);
    vec::unpack(g, gf);
    vec::unpack(u, uf);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float s = sigmoid(gf[e]);
      const float silu = gf[e] * s;
      du[e] = df[e] * silu;
      dg[e] = df[e] * uf[e] * s * (1.f + gf[e] * (1.f - s));
    }
    vec::store<T, N>(dgate + r * ld_in + col, dg);
    vec::store<T, N>(dup + r * ld_in + col, du);
  }
}

template <typename T>
bool vectorizable(int64_t F, int64_t ld, std::initializer_list<const void*> ptrs) {
  if (F % kVec<T> != 0 || ld % kVec<T> != 0) return false;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

cudaError_t check_args(int64_t rows, int64_t F, int64_t ld_in) {
  if (rows < 0 || F < 0 || ld_in < F) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <typename T, int N>
void launch_fwd(const T* gate, const T* up, T* h, int64_t rows, int64_t F, int64_t ld_in,
                cudaStream_t stream) {
  const Grid2 g = plan(rows, F / N);
  swiglu_fwd_kernel<T, N><<<g.grid, g.block, 0, stream>>>(gate, up, h, rows, F / N, ld_in, F);
}

template <typename T, int N>
void launch_bwd(const T* dh, const T* gate, const T* up, T* dgate, T* dup, int64_t rows, int64_t F,
                int64_t ld_in, cudaStream_t stream) {
  const Grid2 g = plan(rows, F / N);
  swiglu_bwd_kernel<T, N>
      <<<g.grid, g.block, 0, stream>>>(dh, gate, up, dgate, dup, rows, F / N, ld_in, F);
}

}  // namespace

template <typename T>
cudaError_t swiglu_fwd(const T* gate, const T* up, T* h, int64_t rows, int64_t F, int64_t ld_in,
                       cudaStream_t stream) {
  SUROGATE_TRY(check_args(rows, F, ld_in));
  if (rows == 0 || F == 0) return cudaSuccess;
  if (vectorizable<T>(F, ld_in, {gate, up, h})) {
    launch_fwd<T, kVec<T>>(gate, up, h, rows, F, ld_in, stream);
  } else {
    launch_fwd<T, 1>(gate, up, h, rows, F, ld_in, stream);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t swiglu_bwd(const T* dh, const T* gate, const T* up, T* dgate, T* dup, int64_t rows,
                       int64_t F, int64_t ld_in, cudaStream_t stream) {
  SUROGATE_TRY(check_args(rows, F, ld_in));
  if (rows == 0 || F == 0) return cudaSuccess;
  if (vectorizable<T>(F, ld_in, {dh, gate, up, dgate, dup})) {
    launch_bwd<T, kVec<T>>(dh, gate, up, dgate, dup, rows, F, ld_in, stream);
  } else {
    launch_bwd<T, 1>(dh, gate, up, dgate, dup, rows, F, ld_in, stream);
  }
  return cudaGetLastError();
}

#define SUROGATE_SWIGLU_INSTANTIATE(T)                                                       \
  template cudaError_t swiglu_fwd<T>(const T*, const T*, T*, int64_t, int64_t, int64_t,      \
                                     cudaStream_t);                                          \
  template cudaError_t swiglu_bwd<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, \
                                     int64_t, cudaStream_t);

SUROGATE_SWIGLU_INSTANTIATE(float)
SUROGATE_SWIGLU_INSTANTIATE(__nv_bfloat16)
SUROGATE_SWIGLU_INSTANTIATE(__half)

}  // namespace surogate
