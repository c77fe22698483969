// Device code and launch planning shared by rms_norm.cu and add_rms_norm.cu: RMSNorm over rows,
// optionally fused with a residual add in front (forward) and the residual gradient (backward).
//
//   forward : s = round_T(x + res)  (kRes; else s = x),  res_out = s
//             rstd = rsqrt(mean(s^2) + eps),  y = s * rstd * w        (fp32 math, y rounded once)
//   backward: shat = s * rstd,  g = dy * w
//             dx = rstd * (g - shat * mean(g * shat)) (+ dres when kRes),  dw = sum_rows(dy * shat)
//
// Floor: memory bound. Bytes per row: forward 2 x dim x sizeof(T) (read x, write y; +2 with the
// residual: read res, write res_out), backward 3 x (read dy and s, write dx; +1 reading dres).
// H100 ~3.0 TB/s copy bandwidth: 16384 x 4096 bf16 fwd 268 MB -> ~89 us, bwd 403 MB -> ~134 us;
// add_rms_norm fwd 537 MB -> ~179 us, bwd 537 MB -> ~179 us.
//
// Design (why):
//  * Register path (every hidden size a transformer uses): a row is split over a group of
//    threads, each holding a few 16-byte vectors of it in registers (forward 4, backward 2, as
//    packed uint4s), so the row is read from DRAM exactly once (a two-pass kernel re-reads it:
//    usually an L2 hit, but still issue slots and L2 bandwidth) and all of a thread's loads are
//    issued before their first use. The group is a power-of-two slice of a warp when it needs
//    <= 32 threads (forward D <= 1024 bf16 / 512 fp32, backward half that; a head-dim norm of 128
//    gets 4 lanes per row, 64 rows per block) -- shuffles only, no barriers -- and otherwise a
//    block of <= kMaxRegBlock threads (forward D <= 16384 bf16 / 8192 fp32, backward half that)
//    reduced through shared memory.
//  * Registers are capped (__maxnreg__) so 768-1280 threads stay resident per SM: with each
//    thread's whole slice of a row in flight at once that is ~50-100 KB of loads in flight per
//    SM, above the ~25-40 KB Little's law asks for at ~3 TB/s (132 SMs, ~1 us latency).
//  * Forward: one row per group and a grid of all row groups (a grid-stride loop only past the
//    grid limit), w re-read from L1 at use. The block scheduler overlaps one block's reduce/store
//    phase with other blocks' loads, and there is no wave-quantization tail. (Persistent grids,
//    with w in registers or the next row prefetched, measured slower; see git tag pre-cleanup.)
//  * Backward: persistent grid (SMs x resident blocks, grid-stride over rows), so each thread
//    always owns the same columns and keeps its dw partial sums in registers across all its rows
//    (w is re-read from L1). At the end the groups of a block add their partials in shared memory
//    in a fixed order, each block writes one fp32 row of the workspace [blocks, dim], and a tiny
//    second kernel sums the workspace over blocks (~1-2% of the bytes). No atomics: results are
//    deterministic.
//  * Load hints: inputs read once use streaming loads (ld.global.cs) so they do not evict w or
//    the workspace, except in the residual forward (kFwdStream).
//  * Backward rows too long for 2 vectors a thread in one block (fp32 D > 4096, bf16 D > 8192)
//    take a "wide" register kernel holding 4 vectors a thread (8 scalars), so they still read
//    each row once and add dres in the same pass.
//  * 16-byte vectors when dim is a multiple of 16 / sizeof(T) and the pointers are 16-byte
//    aligned; one element per "vector" otherwise (dim = 7, 1001, ...).
//  * Loop path (fallback for rows too long for the register path, e.g. 65536, fp32 backward
//    beyond 8192, scalar dims beyond 2048 forward / 4096 backward): a block per row, the row
//    reduced and then re-read (L1/L2). With the residual it runs the add (forward) or the dres
//    add (backward) as a separate element-wise pass: correct, slower, for shapes no model here
//    uses.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "kernels/dw_col_sum.cuh"
#include "kernels/device_common.cuh"

namespace surogate {
namespace {  // internal linkage: each including .cu gets its own copy
namespace normk {

using vec::kVec;
using vec::Raw;

constexpr int kWarp = 32;
constexpr int kFwdVecs = 4;  // vectors per thread in the register path (forward)
// Backward: dy, s (and dres) plus the fp32 dw partials per thread, so a thread holds two 16-byte
// vectors (four scalars on the scalar path) to stay within its register cap without spilling.
template <int N>
constexpr int kBwdVecs = N == 1 ? 4 : 2;
// The wide backward (rows beyond the default's kMaxRegBlock threads) holds twice as many.
template <int N>
constexpr int kBwdWideVecs = 2 * kBwdVecs<N>;
constexpr int kSubWarpThreads = 256;  // block size when row groups are warp slices
constexpr int kMaxRegBlock = 512;     // largest row group (block) of the register path
// Register caps (__maxnreg__): the smallest multiples of 8 at which ptxas (nvcc 13, sm_90a)
// spills nothing for any instantiation, so as many threads as possible stay resident per SM and
// enough rows are in flight to cover DRAM latency. Forward: 4 packed vectors (4 registers each)
// of x, and of res with kRes.
template <typename T, bool kRes>
constexpr int fwd_reg_cap() {
  return kRes ? 64 : (sizeof(T) == 4 ? 56 : 48);
}
// Load hint of the forward: plain loads measured 2-15% faster with the residual, and did not beat
// streaming loads without it.
template <bool kRes>
constexpr bool kFwdStream = !kRes;
// Backward (V = kBwdVecs): 64-72. Wide backward (V = kBwdWideVecs): a 16-bit vector thread keeps
// 4 x 8 fp32 dw partials, hence its higher cap. fp32 D = 5120 with the residual: 320-thread blocks
// at 96 registers, two blocks resident per SM.
template <typename T, int N, int V, bool kRes>
constexpr int bwd_reg_cap() {
  if (V == kBwdVecs<N>) return kRes ? 72 : 64;
  if (N == 8) return kRes ? 128 : 112;
  return kRes ? 96 : 88;
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

// Block mode: groups of `width` threads (a multiple of 32) each own a row; blockDim.x is a
// multiple of width (one group per block for long rows, several for medium ones).
template <bool kBlockRow>
__device__ __forceinline__ RowLoop row_loop(int width) {
  if constexpr (kBlockRow) {
    const int groups = static_cast<int>(blockDim.x) / width;
    return {static_cast<int64_t>(blockIdx.x) * groups, static_cast<int64_t>(gridDim.x) * groups,
            static_cast<int>(threadIdx.x) / width, static_cast<int>(threadIdx.x) % width, width};
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

// Sum of v over the thread's group. All threads of the warp (block) must call it. Block mode:
// each warp reduces by shuffles, then every thread adds its group's warp sums in a fixed order.
template <bool kBlockRow>
__device__ __forceinline__ float group_sum(float v, int width, float* red) {
  if constexpr (!kBlockRow) {
    return xor_sum(v, width);  // xor offsets < width stay inside the aligned group
  } else {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    v = xor_sum(v, kWarp);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const int per = width / kWarp, first = (static_cast<int>(threadIdx.x) / width) * per;
    float t = 0.f;
    for (int q = 0; q < per; ++q) t += red[first + q];
    __syncthreads();  // red is rewritten by the next call
    return t;
  }
}

// ---------------------------------------------------------------------------------------------
// Register path.

template <typename T, int N, int R, bool kRes, bool kStream>
__device__ __forceinline__ void fwd_load_row(const T* __restrict__ x, const T* __restrict__ res,
                                             int64_t row, int64_t rows, int dim, int nvec,
                                             const RowLoop& L, Raw<T, N> (&xr)[R],
                                             Raw<T, N> (&rr)[kRes ? R : 1]) {
  if (row >= rows) return;
  const int64_t off = row * dim;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int i = L.lane + j * L.width;
    if (i < nvec) {
      xr[j] = vec::load_raw_hint<T, N, kStream>(x + off + static_cast<int64_t>(i) * N);
      if constexpr (kRes)
        rr[j] = vec::load_raw_hint<T, N, kStream>(res + off + static_cast<int64_t>(i) * N);
    }
  }
}

// Forward: each group normalizes one row per iteration (the loop only runs again when the rows
// outnumber the grid's row groups). The residual stream is kept in T: round s, then normalize.
template <typename T, int N, bool kBlockRow, bool kRes>
__global__ void __maxnreg__((fwd_reg_cap<T, kRes>()))
    fwd_reg_kernel(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                   T* __restrict__ y, T* __restrict__ res_out, float* __restrict__ rstd,
                   int64_t rows, int dim, int width, float eps) {
  constexpr int R = kFwdVecs;
  __shared__ float red[kWarp + 1];
  const RowLoop L = row_loop<kBlockRow>(width);
  const int nvec = dim / N;
  Raw<T, N> xr[R], rr[kRes ? R : 1];
  for (int64_t base = L.first; base < rows; base += L.stride) {
    const int64_t row = base + L.sub;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * dim;
    // Every load of the row is issued before the first use.
    fwd_load_row<T, N, R, kRes, kFwdStream<kRes>>(x, res, row, rows, dim, nvec, L, xr, rr);
    float ss = 0.f;
    if (active) {
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int i = L.lane + j * L.width;
        if (i < nvec) {
          float v[N];
          vec::unpack(xr[j], v);
          if constexpr (kRes) {
            float b[N];
            vec::unpack(rr[j], b);
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] += b[k];
            xr[j] = vec::pack<T, N>(v);
            vec::store_raw<T, N>(res_out + off + static_cast<int64_t>(i) * N, xr[j]);
            vec::unpack(xr[j], v);
          }
#pragma unroll
          for (int k = 0; k < N; ++k) ss += v[k] * v[k];
        }
      }
    }
    ss = group_sum<kBlockRow>(ss, L.width, red);
    if (active) {  // no shuffle or barrier inside
      const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
      if (L.lane == 0) rstd[row] = r;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int i = L.lane + j * L.width;
        if (i < nvec) {
          float v[N], g[N], o[N];
          vec::unpack(xr[j], v);
          vec::load<T, N>(w + static_cast<int64_t>(i) * N, g);
#pragma unroll
          for (int k = 0; k < N; ++k) o[k] = v[k] * r * g[k];
          vec::store<T, N>(y + off + static_cast<int64_t>(i) * N, o);
        }
      }
    }
  }
}

// ws: [gridDim.x, dim] fp32; block b writes its dw partial sums to row b. Sub-warp mode needs
// (blockDim.x / width) x dim floats of dynamic shared memory to add its groups' partials.
template <typename T, int N, int V, bool kBlockRow, bool kRes>
__global__ void __maxnreg__((bwd_reg_cap<T, N, V, kRes>()))
    bwd_reg_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                   const float* __restrict__ rstd, const T* __restrict__ dres, T* __restrict__ dx,
                   float* __restrict__ ws, int64_t rows, int dim, int width) {
  extern __shared__ float smem[];
  __shared__ float red[kWarp + 1];
  const RowLoop L = row_loop<kBlockRow>(width);
  const int nvec = dim / N;
  // w is re-read per row from L1 (not held in registers like in the forward): the backward
  // already holds dy, s (and dres) and the fp32 dw partials, and more would spill.
  float acc[V][N];
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int k = 0; k < N; ++k) acc[j][k] = 0.f;
  }
  for (int64_t base = L.first; base < rows; base += L.stride) {
    const int64_t row = base + L.sub;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * dim;
    Raw<T, N> ar[V], br[V], dr[kRes ? V : 1];
    float r = 0.f, dot = 0.f;  // dot = sum(dy * w * s)
    if (active) {
      r = rstd[row];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = L.lane + j * L.width;
        if (i < nvec) {
          const int64_t c = off + static_cast<int64_t>(i) * N;
          ar[j] = vec::load_raw_stream<T, N>(dy + c);
          br[j] = vec::load_raw_stream<T, N>(x + c);
          if constexpr (kRes) dr[j] = vec::load_raw_stream<T, N>(dres + c);
        }
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = L.lane + j * L.width;
        if (i < nvec) {
          float a[N], b[N], g[N];
          vec::unpack(ar[j], a);
          vec::unpack(br[j], b);
          vec::load<T, N>(w + static_cast<int64_t>(i) * N, g);
#pragma unroll
          for (int k = 0; k < N; ++k) dot += a[k] * g[k] * b[k];
        }
      }
    }
    dot = group_sum<kBlockRow>(dot, L.width, red);
    if (!active) continue;
    const float m = r * dot / static_cast<float>(dim);  // mean(g * shat)
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = L.lane + j * L.width;
      if (i < nvec) {
        float a[N], b[N], g[N], o[N];
        vec::unpack(ar[j], a);
        vec::unpack(br[j], b);
        vec::load<T, N>(w + static_cast<int64_t>(i) * N, g);
        if constexpr (kRes) vec::unpack(dr[j], o);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float shat = b[k] * r;
          const float d = r * (a[k] * g[k] - shat * m);
          o[k] = kRes ? o[k] + d : d;
          acc[j][k] += a[k] * shat;
        }
        vec::store<T, N>(dx + off + static_cast<int64_t>(i) * N, o);
      }
    }
  }

  // dw partials: one group per block writes its own row of ws; several add theirs in shared
  // memory ([groups, dim], in group order) first.
  float* block_ws = ws + static_cast<int64_t>(blockIdx.x) * dim;
  const int groups = static_cast<int>(blockDim.x) / width;
  float* part = groups == 1 ? block_ws : smem + static_cast<int64_t>(threadIdx.x / width) * dim;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = L.lane + j * L.width;
    if (i < nvec) {
#pragma unroll
      for (int k = 0; k < N; ++k) part[i * N + k] = acc[j][k];
    }
  }
  if (groups > 1) {
    __syncthreads();
    for (int col = threadIdx.x; col < dim; col += blockDim.x) {
      float s = 0.f;
      for (int q = 0; q < groups; ++q) s += smem[q * dim + col];
      block_ws[col] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Loop path (rows too long for the register path): a block per row (width = blockDim.x threads),
// persistent grid; reduce, then re-read the row.

template <typename T, int N>
__global__ void __launch_bounds__(1024)
    fwd_loop_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                    float* __restrict__ rstd, int64_t rows, int dim, int width, float eps) {
  __shared__ float red[kWarp + 1];
  const RowLoop L = row_loop<true>(width);
  const int nvec = dim / N;
  for (int64_t base = L.first; base < rows; base += L.stride) {
    const int64_t row = base + L.sub;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * dim;
    float ss = 0.f;
    if (active) {
      for (int i = L.lane; i < nvec; i += L.width) {
        float v[N];
        vec::load<T, N>(x + off + static_cast<int64_t>(i) * N, v);
#pragma unroll
        for (int k = 0; k < N; ++k) ss += v[k] * v[k];
      }
    }
    ss = group_sum<true>(ss, width, red);
    if (!active) continue;
    const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
    if (L.lane == 0) rstd[row] = r;
    for (int i = L.lane; i < nvec; i += L.width) {
      const int64_t c = static_cast<int64_t>(i) * N;
      float v[N], g[N], o[N];
      vec::load<T, N>(x + off + c, v);
      vec::load<T, N>(w + c, g);
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = v[k] * r * g[k];
      vec::store<T, N>(y + off + c, o);
    }
  }
}

// With smem_partials the block's partials live in dynamic shared memory ([dim], transposed so
// consecutive lanes hit consecutive banks); otherwise (dim too large for shared memory) directly
// in the block's workspace row.
template <typename T, int N>
__global__ void __launch_bounds__(1024)
    bwd_loop_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                    const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ ws,
                    int64_t rows, int dim, int width, bool smem_partials) {
  extern __shared__ float smem[];
  __shared__ float red[kWarp + 1];
  const RowLoop L = row_loop<true>(width);
  const int nvec = dim / N;
  float* block_ws = ws + static_cast<int64_t>(blockIdx.x) * dim;
  float* part = smem_partials ? smem : block_ws;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) part[i] = 0.f;
  __syncthreads();

  for (int64_t base = L.first; base < rows; base += L.stride) {
    const int64_t row = base + L.sub;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * dim;
    const float r = active ? rstd[row] : 0.f;
    float dot = 0.f;
    if (active) {
      for (int i = L.lane; i < nvec; i += L.width) {
        const int64_t c = static_cast<int64_t>(i) * N;
        float a[N], b[N], g[N];
        vec::load<T, N>(dy + off + c, a);
        vec::load<T, N>(x + off + c, b);
        vec::load<T, N>(w + c, g);
#pragma unroll
        for (int k = 0; k < N; ++k) dot += a[k] * g[k] * b[k];
      }
    }
    dot = group_sum<true>(dot, width, red);
    if (!active) continue;
    const float m = r * dot / static_cast<float>(dim);
    for (int i = L.lane; i < nvec; i += L.width) {
      const int64_t c = static_cast<int64_t>(i) * N;
      float a[N], b[N], g[N], o[N];
      vec::load<T, N>(dy + off + c, a);
      vec::load<T, N>(x + off + c, b);
      vec::load<T, N>(w + c, g);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xhat = b[k] * r;
        o[k] = r * (a[k] * g[k] - xhat * m);
        part[smem_partials ? k * nvec + i : i * N + k] += a[k] * xhat;
      }
      vec::store<T, N>(dx + off + c, o);
    }
  }

  __syncthreads();
  if (smem_partials) {
    for (int col = threadIdx.x; col < dim; col += blockDim.x) {
      block_ws[col] = smem[(col % N) * nvec + col / N];
    }
  }
}

// out = round_T(a + b), element-wise (out may alias a). Loop path's residual adds only.
template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = vec::from_float<T>(vec::to_float(a[i]) + vec::to_float(b[i]));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: launch plans.

struct Plan {
  int vec = 1;             // elements per vector (1 or 16 / sizeof(T))
  bool reg = true;         // register path (else loop path)
  bool block_row = false;  // a block per row (else warp-slice groups of `width` lanes)
  int width = kWarp;       // threads per row group
  int threads = 0;
  int rows_per_block = 1;     // rows one block handles per iteration
  size_t smem = 0;            // dynamic shared memory bytes
  bool smem_partials = true;  // loop path backward: dw partials in shared (else global) memory
  int blocks = 0;
};

template <typename T>
int pick_vec(int64_t dim, std::initializer_list<const void*> ptrs) {
  if (dim % kVec<T> != 0) return 1;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVec<T>;
}

// Thread layout; depends only on the number of vectors per row and how many a thread holds.
inline Plan layout_plan(int64_t dim, int vec, int vecs_per_thread) {
  Plan p;
  p.vec = vec;
  const int64_t nvec = dim / vec;
  const int64_t per = (nvec + vecs_per_thread - 1) / vecs_per_thread;  // threads a row needs
  if (per <= kWarp) {
    int width = 1;
    while (width < per) width *= 2;
    p.reg = true;
    p.block_row = false;
    p.width = width;
    p.threads = kSubWarpThreads;
    p.rows_per_block = kSubWarpThreads / width;
  } else if (per <= kMaxRegBlock) {
    // Whole warps per row; rows of < 256 threads share a block (several rows per block keep
    // blocks of a useful size and the number of dw partial rows down).
    p.reg = true;
    p.block_row = true;
    p.width = static_cast<int>((per + kWarp - 1) / kWarp * kWarp);
    p.rows_per_block = std::max(1, kSubWarpThreads / p.width);
    p.threads = p.rows_per_block * p.width;
  } else {
    // Loop path: about two vectors per thread per pass, a whole number of warps, <= 1024 threads.
    const int64_t t = ((nvec + 1) / 2 + kWarp - 1) / kWarp * kWarp;
    p.reg = false;
    p.block_row = true;
    p.width = static_cast<int>(std::min<int64_t>(t, 1024));
    p.threads = p.width;
    p.rows_per_block = 1;
  }
  return p;
}

// Resident blocks per SM of `kernel` at (threads, smem) and the SM count, memoized per host
// thread (the occupancy query costs microseconds of host time on every XLA launch otherwise).
template <typename Kernel>
cudaError_t occupancy(Kernel kernel, int threads, size_t smem, int* per_sm, int* sms) {
  struct Entry {
    const void* kernel;
    int threads, dev, per_sm, sms;
    size_t smem;
  };
  constexpr int kEntries = 32;
  thread_local Entry cache[kEntries] = {};
  thread_local int next = 0;
  int dev = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  const void* key = reinterpret_cast<const void*>(kernel);
  for (const Entry& e : cache) {
    if (e.kernel == key && e.threads == threads && e.smem == smem && e.dev == dev) {
      *per_sm = e.per_sm;
      *sms = e.sms;
      return cudaSuccess;
    }
  }
  SUROGATE_TRY(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
  if (smem > 48 * 1024) {
    SUROGATE_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  }
  SUROGATE_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, smem));
  cache[next] = {key, threads, dev, *per_sm, *sms, smem};
  next = (next + 1) % kEntries;
  return cudaSuccess;
}

// Persistent grid: as many blocks as fit on the device at once, but no more than there is work.
template <typename Kernel>
cudaError_t size_grid(Kernel kernel, int64_t rows, Plan& p) {
  int sms = 0, per_sm = 0;
  SUROGATE_TRY(occupancy(kernel, p.threads, p.smem, &per_sm, &sms));
  const int64_t need = (rows + p.rows_per_block - 1) / p.rows_per_block;
  const int64_t fit = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  p.blocks = static_cast<int>(std::max<int64_t>(1, std::min(need, fit)));
  return cudaSuccess;
}

template <typename T, bool kRes>
using FwdRegKernel = void (*)(const T*, const T*, const T*, T*, T*, float*, int64_t, int, int,
                              float);
template <typename T, bool kRes>
using BwdRegKernel = void (*)(const T*, const T*, const T*, const float*, const T*, T*, float*,
                              int64_t, int, int);
template <typename T>
using FwdLoopKernel = void (*)(const T*, const T*, T*, float*, int64_t, int, int, float);
template <typename T>
using BwdLoopKernel = void (*)(const T*, const T*, const T*, const float*, T*, float*, int64_t, int,
                               int, bool);

template <typename T, bool kRes>
FwdRegKernel<T, kRes> fwd_reg(const Plan& p) {
  constexpr int V = kVec<T>;
  if (p.vec == 1) {
    return p.block_row ? fwd_reg_kernel<T, 1, true, kRes> : fwd_reg_kernel<T, 1, false, kRes>;
  }
  return p.block_row ? fwd_reg_kernel<T, V, true, kRes> : fwd_reg_kernel<T, V, false, kRes>;
}

template <typename T, bool kRes>
BwdRegKernel<T, kRes> bwd_reg(const Plan& p, bool wide) {
  constexpr int V = kVec<T>;
  if (wide) {  // only rows of more than 32 threads (block mode) are long enough to need it
    return p.vec == 1 ? bwd_reg_kernel<T, 1, kBwdWideVecs<1>, true, kRes>
                      : bwd_reg_kernel<T, V, kBwdWideVecs<V>, true, kRes>;
  }
  if (p.vec == 1) {
    return p.block_row ? bwd_reg_kernel<T, 1, kBwdVecs<1>, true, kRes>
                       : bwd_reg_kernel<T, 1, kBwdVecs<1>, false, kRes>;
  }
  return p.block_row ? bwd_reg_kernel<T, V, kBwdVecs<V>, true, kRes>
                     : bwd_reg_kernel<T, V, kBwdVecs<V>, false, kRes>;
}

template <typename T>
FwdLoopKernel<T> fwd_loop(const Plan& p) {
  return p.vec == 1 ? fwd_loop_kernel<T, 1> : fwd_loop_kernel<T, kVec<T>>;
}

template <typename T>
BwdLoopKernel<T> bwd_loop(const Plan& p) {
  return p.vec == 1 ? bwd_loop_kernel<T, 1> : bwd_loop_kernel<T, kVec<T>>;
}

template <typename T>
cudaError_t launch_add(const T* a, const T* b, T* out, int64_t n, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 4096);
  add_kernel<T>
      <<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), 256, 0, stream>>>(a, b, out, n);
  return cudaGetLastError();
}

// Forward: kRes = false -> plain RMSNorm of x (res, res_out unused); else s = x + res is
// written to res_out and normalized.
template <typename T, bool kRes>
cudaError_t norm_fwd(const T* x, const T* res, const T* w, T* y, T* res_out, float* rstd,
                     int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (dim <= 0 || dim > INT_MAX || rows < 0) return cudaErrorInvalidValue;
  if (kRes && (res == nullptr || res_out == nullptr)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if constexpr (!kRes) res = res_out = nullptr;
  Plan p = layout_plan(dim, pick_vec<T>(dim, {x, res, w, y, res_out}), kFwdVecs);
  const int d = static_cast<int>(dim);
  if (p.reg) {
    // One row per group; the kernel still strides if rows exceed the grid limit.
    const int64_t need = (rows + p.rows_per_block - 1) / p.rows_per_block;
    p.blocks = static_cast<int>(std::min<int64_t>(need, INT_MAX));
    fwd_reg<T, kRes>(p)<<<p.blocks, p.threads, 0, stream>>>(x, res, w, y, res_out, rstd, rows, d,
                                                            p.width, eps);
    return cudaGetLastError();
  }
  const T* src = x;
  if constexpr (kRes) {
    SUROGATE_TRY(launch_add<T>(x, res, res_out, rows * dim, stream));
    src = res_out;
  }
  const auto k = fwd_loop<T>(p);
  SUROGATE_TRY(size_grid(k, rows, p));
  k<<<p.blocks, p.threads, 0, stream>>>(src, w, y, rstd, rows, d, p.width, eps);
  return cudaGetLastError();
}

// Backward: x is the normalized input (s); kRes = false -> plain RMSNorm backward (dres
// unused), else dx = norm backward + dres.
// `workspace`: fp32 scratch of workspace_bytes (16-byte aligned), at least one row of dim floats;
// the grid uses at most workspace_bytes / (4 * dim) blocks.
template <typename T, bool kRes>
cudaError_t norm_bwd(const T* dy, const T* x, const T* w, const float* rstd, const T* dres, T* dx,
                     T* dw, int64_t rows, int64_t dim, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  if (dim <= 0 || dim > INT_MAX || rows < 0) return cudaErrorInvalidValue;
  if (kRes && dres == nullptr) return cudaErrorInvalidValue;
  if (rows == 0) return cudaMemsetAsync(dw, 0, static_cast<size_t>(dim) * sizeof(T), stream);
  const int64_t ws_rows =
      static_cast<int64_t>(workspace_bytes / (static_cast<size_t>(dim) * sizeof(float)));
  if (workspace == nullptr || ws_rows < 1 || reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  if constexpr (!kRes) dres = nullptr;
  float* ws = static_cast<float*>(workspace);
  const int d = static_cast<int>(dim);
  const size_t row_bytes = static_cast<size_t>(dim) * sizeof(float);
  const int vec = pick_vec<T>(dim, {dy, x, w, dres, dx});
  const int vecs = vec == 1 ? kBwdVecs<1> : kBwdVecs<kVec<T>>;
  Plan p = layout_plan(dim, vec, vecs);
  bool wide = false;
  if (!p.reg) {  // too long for the default register kernel: the wide one, if it fits
    const Plan q = layout_plan(dim, vec, 2 * vecs);
    if (q.reg) {
      p = q;
      wide = true;
    }
  }
  if (p.reg) {
    const int groups = p.threads / p.width;
    p.smem = groups > 1 ? static_cast<size_t>(groups) * row_bytes : 0;  // <= 16 KiB
    const auto k = bwd_reg<T, kRes>(p, wide);
    SUROGATE_TRY(size_grid(k, rows, p));
    p.blocks = static_cast<int>(std::min<int64_t>(p.blocks, ws_rows));
    k<<<p.blocks, p.threads, p.smem, stream>>>(dy, x, w, rstd, dres, dx, ws, rows, d, p.width);
    SUROGATE_TRY(cudaGetLastError());
  } else {
    int dev = 0, optin = 0;
    SUROGATE_TRY(cudaGetDevice(&dev));
    SUROGATE_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    // Leave room for the static `red` array; beyond that keep partials in global memory.
    p.smem_partials = row_bytes + 1024 <= static_cast<size_t>(optin);
    p.smem = p.smem_partials ? row_bytes : 0;
    const auto k = bwd_loop<T>(p);
    SUROGATE_TRY(size_grid(k, rows, p));
    p.blocks = static_cast<int>(std::min<int64_t>(p.blocks, ws_rows));
    k<<<p.blocks, p.threads, p.smem, stream>>>(dy, x, w, rstd, dx, ws, rows, d, p.width,
                                               p.smem_partials);
    SUROGATE_TRY(cudaGetLastError());
    if constexpr (kRes) SUROGATE_TRY(launch_add<T>(dx, dres, dx, rows * dim, stream));
  }
  return colsum::dw_col_sum<T>(ws, dw, p.blocks, d, stream);
}

#undef SUROGATE_TRY

}  // namespace normk
}  // namespace
}  // namespace surogate
