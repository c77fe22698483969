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
//  * Variants 0-5: each thread handles 4 rows (backward: 2) per iteration and issues all their
//    loads before any math: 8 (6) 16-byte loads in flight per thread, registers capped at 64 (4
//    blocks of 256 threads per SM): ~100-130 KB in flight per SM, well above the ~25-40 KB
//    Little's law asks for at ~3 TB/s over 132 SMs. Variant 6 gets its bytes in flight from
//    occupancy instead (2 or 3 loads per thread, 1536-2048 threads per SM).
//  * Seven launch variants (algo, swiglu.h): that persistent grid or a one-shot grid (a block per
//    row group), streaming (ld.global.cs) or plain loads, a thread's rows interleaved across the
//    grid or adjacent, or one row per thread. On the H100 (2026-11-23) the first design
//    (persistent + streaming, variant 0) ran at 80-88% of copy bandwidth and 6-10% behind XLA's
//    fusion; variant 2 (one-shot, plain loads) came to 1-5% of XLA in chained timings; under
//    Nsight Compute its forward was still 3-5% slower than XLA's loop fusion
//    (98 vs 94 us at [16384, 3072] bf16), which runs one 8-byte vector per thread in 128-thread
//    blocks at full occupancy. Variant 6 (one 16-byte vector of one row per thread, 256-thread
//    blocks, <= 32 registers: 2048 resident threads per SM) matches XLA's fusion in both passes
//    and is the default (ops/swiglu.py ALGO): many small blocks balance the end of the grid
//    better than fewer blocks with four rows each. The others stay selectable for sweeps.
//  * fp32 math, one rounding of each output; sigmoid from ex2.approx and rcp.approx
//    (device_common.cuh).
//  * Scalar path when F or the row stride is not a multiple of the vector or a pointer is not
//    16-byte aligned (F = 1001, ...).
#include "kernels/swiglu.h"

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "kernels/device_common.cuh"

namespace surogate {
namespace {

using vec::kVec;
using vec::Raw;

// Rows per thread per iteration (all loads of them are issued before any math); as many as fit
// in 64 registers without spilling.
// kWalk (the launch variant's row walk): 0 a thread's rows interleaved across the grid, 1 a
// block's rows adjacent, 2 one row per thread (XLA's loop-fusion shape: more, smaller blocks at
// full occupancy instead of loads in flight per thread).
template <int kWalk>
constexpr int kFwdUnroll = kWalk == 2 ? 1 : 4;
template <int kWalk>
constexpr int kBwdUnroll = kWalk == 2 ? 1 : 2;
// Resident 256-thread blocks asked of ptxas: walk 2 forward 8 (<= 32 registers, 2048 threads),
// backward 6 (<= 40: at 32 the bf16 backward spilled 56 bytes).
template <int kWalk>
constexpr int kFwdMinBlocks = kWalk == 2 ? 8 : 4;
template <int kWalk>
constexpr int kBwdMinBlocks = kWalk == 2 ? 6 : 4;
constexpr int kThreads = 256;
constexpr int kMinBlocks = 4;  // <= 64 registers: 1024 resident threads per SM (walks 0, 1)

struct Grid2 {
  dim3 grid, block;
};

// Block: up to kThreads threads along the row's vectors, the rest of the block along rows.
Grid2 plan(int64_t rows, int64_t nvec, int sms, int unroll, bool one_shot) {
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
  const int64_t per_block = static_cast<int64_t>(by) * unroll;
  const int64_t row_groups = (rows + per_block - 1) / per_block;
  // Persistent: about two full waves of resident blocks, more rows loop in-kernel. One-shot: a
  // block per row group (the loop only runs past 65535 groups).
  const int64_t want_y =
      one_shot ? row_groups
               : std::max<int64_t>(1, (static_cast<int64_t>(sms) * 2 * kMinBlocks + gx - 1) / gx);
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>({row_groups, want_y, 65535}));
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(bx, by)};
}

// Rows of one thread: r0, r0 + step, ... (kUnroll of them), then r0 += next. Grid-wide
// interleave (kContig false): step = all the grid's rows, so a block's rows lie kUnroll bands
// apart; contiguous (true): step = blockDim.y, a block's rows are adjacent (one band of DRAM
// pages).
template <bool kContig>
struct RowWalk {
  int64_t r0, step, next;
  __device__ __forceinline__ explicit RowWalk(int unroll) {
    const int64_t by = blockDim.y, gy = gridDim.y;
    if constexpr (kContig) {
      r0 = static_cast<int64_t>(blockIdx.y) * by * unroll + threadIdx.y;
      step = by;
    } else {
      r0 = static_cast<int64_t>(blockIdx.y) * by + threadIdx.y;
      step = gy * by;
    }
    next = gy * by * unroll;
  }
};

template <typename T, int N, bool kStream, int kWalk>
__global__ void __launch_bounds__(kThreads, kFwdMinBlocks<kWalk>)
    swiglu_fwd_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ h,
                      int64_t rows, int64_t nvec, int64_t ld_in, int64_t ld_out) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t col = v * N;
  const RowWalk<(kWalk != 0)> w(kFwdUnroll<kWalk>);
  const int64_t step = w.step;
  for (int64_t r0 = w.r0; r0 < rows; r0 += w.next) {
    Raw<T, N> g[kFwdUnroll<kWalk>], u[kFwdUnroll<kWalk>];
#pragma unroll
    for (int k = 0; k < kFwdUnroll<kWalk>; ++k) {
      const int64_t r = r0 + k * step;
      if (r < rows) {
        g[k] = vec::load_raw_hint<T, N, kStream>(gate + r * ld_in + col);
        u[k] = vec::load_raw_hint<T, N, kStream>(up + r * ld_in + col);
      }
    }
#pragma unroll
    for (int k = 0; k < kFwdUnroll<kWalk>; ++k) {
      const int64_t r = r0 + k * step;
      if (r < rows) {
        float gf[N], uf[N], o[N];
        vec::unpack(g[k], gf);
        vec::unpack(u[k], uf);
#pragma unroll
        for (int e = 0; e < N; ++e) o[e] = gf[e] * sigmoid(gf[e]) * uf[e];
        vec::store<T, N>(h + r * ld_out + col, o);
      }
    }
  }
}

template <typename T, int N, bool kStream, int kWalk>
__global__ void __launch_bounds__(kThreads, kBwdMinBlocks<kWalk>)
    swiglu_bwd_kernel(const T* __restrict__ dh, const T* __restrict__ gate,
                      const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                      int64_t rows, int64_t nvec, int64_t ld_in, int64_t ld_dh) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t col = v * N;
  const RowWalk<(kWalk != 0)> w(kBwdUnroll<kWalk>);
  const int64_t step = w.step;
  for (int64_t r0 = w.r0; r0 < rows; r0 += w.next) {
    Raw<T, N> d[kBwdUnroll<kWalk>], g[kBwdUnroll<kWalk>], u[kBwdUnroll<kWalk>];
#pragma unroll
    for (int k = 0; k < kBwdUnroll<kWalk>; ++k) {
      const int64_t r = r0 + k * step;
      if (r < rows) {
        d[k] = vec::load_raw_hint<T, N, kStream>(dh + r * ld_dh + col);
        g[k] = vec::load_raw_hint<T, N, kStream>(gate + r * ld_in + col);
        u[k] = vec::load_raw_hint<T, N, kStream>(up + r * ld_in + col);
      }
    }
#pragma unroll
    for (int k = 0; k < kBwdUnroll<kWalk>; ++k) {
      const int64_t r = r0 + k * step;
      if (r < rows) {
        float df[N], gf[N], uf[N], dg[N], du[N];
        vec::unpack(d[k], df);
        vec::unpack(g[k], gf);
        vec::unpack(u[k], uf);
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

cudaError_t sm_count(int* sms) {
  int dev = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  SUROGATE_TRY(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
  *sms = std::max(*sms, 1);
  return cudaSuccess;
}

cudaError_t check_args(int64_t rows, int64_t F, int64_t ld_in) {
  if (rows < 0 || F < 0 || ld_in < F) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <typename T, int N, bool kStream, int kWalk>
void launch_fwd(const T* gate, const T* up, T* h, int64_t rows, int64_t F, int64_t ld_in, int sms,
                bool one_shot, cudaStream_t stream) {
  const Grid2 g = plan(rows, F / N, sms, kFwdUnroll<kWalk>, one_shot);
  swiglu_fwd_kernel<T, N, kStream, kWalk>
      <<<g.grid, g.block, 0, stream>>>(gate, up, h, rows, F / N, ld_in, F);
}

template <typename T, int N, bool kStream, int kWalk>
void launch_bwd(const T* dh, const T* gate, const T* up, T* dgate, T* dup, int64_t rows, int64_t F,
                int64_t ld_in, int sms, bool one_shot, cudaStream_t stream) {
  const Grid2 g = plan(rows, F / N, sms, kBwdUnroll<kWalk>, one_shot);
  swiglu_bwd_kernel<T, N, kStream, kWalk>
      <<<g.grid, g.block, 0, stream>>>(dh, gate, up, dgate, dup, rows, F / N, ld_in, F);
}

// Variant `algo` (swiglu.h) as its three switches; calls f(one_shot, stream_tag, walk_tag).
template <typename Fn>
void with_variant(int algo, Fn&& f) {
  using S = std::true_type;
  using P = std::false_type;
  using W0 = std::integral_constant<int, 0>;
  using W1 = std::integral_constant<int, 1>;
  using W2 = std::integral_constant<int, 2>;
  switch (algo) {
    case 0:
      f(false, S{}, W0{});
      break;
    case 1:
      f(true, S{}, W0{});
      break;
    case 2:
      f(true, P{}, W0{});
      break;
    case 3:
      f(false, P{}, W0{});
      break;
    case 4:
      f(true, P{}, W1{});
      break;
    case 5:
      f(true, S{}, W1{});
      break;
    default:
      f(true, P{}, W2{});
      break;
  }
}

}  // namespace

template <typename T>
cudaError_t swiglu_fwd(const T* gate, const T* up, T* h, int64_t rows, int64_t F, int64_t ld_in,
                       cudaStream_t stream, int algo) {
  SUROGATE_TRY(check_args(rows, F, ld_in));
  if (algo < 0 || algo >= kSwigluAlgos) return cudaErrorInvalidValue;
  if (rows == 0 || F == 0) return cudaSuccess;
  int sms = 0;
  SUROGATE_TRY(sm_count(&sms));
  const bool vector = vectorizable<T>(F, ld_in, {gate, up, h});
  with_variant(algo, [&](bool one_shot, auto stream_tag, auto walk_tag) {
    constexpr bool kS = decltype(stream_tag)::value;
    constexpr int kC = decltype(walk_tag)::value;
    (vector ? launch_fwd<T, kVec<T>, kS, kC>
            : launch_fwd<T, 1, kS, kC>)(gate, up, h, rows, F, ld_in, sms, one_shot, stream);
  });
  return cudaGetLastError();
}

template <typename T>
cudaError_t swiglu_bwd(const T* dh, const T* gate, const T* up, T* dgate, T* dup, int64_t rows,
                       int64_t F, int64_t ld_in, cudaStream_t stream, int algo) {
  SUROGATE_TRY(check_args(rows, F, ld_in));
  if (algo < 0 || algo >= kSwigluAlgos) return cudaErrorInvalidValue;
  if (rows == 0 || F == 0) return cudaSuccess;
  int sms = 0;
  SUROGATE_TRY(sm_count(&sms));
  const bool vector = vectorizable<T>(F, ld_in, {dh, gate, up, dgate, dup});
  with_variant(algo, [&](bool one_shot, auto stream_tag, auto walk_tag) {
    constexpr bool kS = decltype(stream_tag)::value;
    constexpr int kC = decltype(walk_tag)::value;
    (vector ? launch_bwd<T, kVec<T>, kS, kC> : launch_bwd<T, 1, kS, kC>)(dh, gate, up, dgate, dup,
                                                                         rows, F, ld_in, sms,
                                                                         one_shot, stream);
  });
  return cudaGetLastError();
}

#define SUROGATE_SWIGLU_INSTANTIATE(T)                                                       \
  template cudaError_t swiglu_fwd<T>(const T*, const T*, T*, int64_t, int64_t, int64_t,      \
                                     cudaStream_t, int);                                     \
  template cudaError_t swiglu_bwd<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, \
                                     int64_t, cudaStream_t, int);

SUROGATE_SWIGLU_INSTANTIATE(float)
SUROGATE_SWIGLU_INSTANTIATE(__nv_bfloat16)
SUROGATE_SWIGLU_INSTANTIATE(__half)

}  // namespace surogate
