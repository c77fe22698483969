// Cross-entropy rows of LM-head logits: loss, lse and (optionally) dlogits in one kernel
// (see lm_head_ce.h for the math and the launcher contract).
//
// Floor. Memory bound. Per active row the kernel must read V logits once and, with the gradient,
// write V dlogits:
//   loss only : V * sizeof(TIn)                      fp32, V = 151936: 0.61 MB/row
//   gradient  : V * (sizeof(TIn) + sizeof(TOut))     fp32 -> bf16: 0.91 MB/row, bf16 in place: 0.61
// At the H100's ~3000 GB/s copy bandwidth a 4096-token x 151936-vocab step costs >= 1.24 ms
// (fp32 logits -> bf16 dlogits) or >= 0.83 ms (bf16 in place) with the gradient. The cluster
// kernel below moves exactly these bytes; the two-pass kernel reads the row twice (+0.61 / +0.30
// MB/row: the second read comes from DRAM once more than ~50 MB of rows are in flight).
// The GEMMs around it: 3 x 2 N D V FLOPs = 3.8 TFLOP at N = 4096, D = 1024 -> ~5.2 ms at 740
// TFLOP/s (4x at D = 4096), so even at its floor the kernel is ~19% of the op at D = 1024 with
// fp32 logits (~14% with bf16 logits) and ~6% at D = 4096: worth being at the floor.
// exp count: 2 ex2 per element (one per pass), ~1.5e12/s at full bandwidth for fp32, below the
// ~3.6e12/s MUFU throughput.
//
// Design (why):
//  * Gradient, Hopper (compute capability >= 9.0), rows of 512..~51k 16-byte vectors: a thread-
//    block cluster of K <= 8 CTAs owns a row, each CTA a slice of <= 100 KB (two CTAs per SM) kept
//    in shared memory between pass 1 (DRAM -> smem, running max/sum) and pass 2 (smem -> dlogits);
//    the K partial (max, sum) pairs are merged through distributed shared memory. One DRAM read.
//  * Otherwise (loss only, short or huge rows, older GPUs, algo = kTwoPass): one block per row,
//    grid-striding over rows, pass 2 re-reads the row.
//  * Online softmax (Milakov & Gimelshein 2018): each thread keeps a running max m and sum of
//    exp(x - m), rescaling only when a vector raises the max; exp as ex2.approx of fma(x, log2e,
//    -m log2e) (one FFMA + one MUFU per element).
//  * 16-byte vector loads in the row's aligned middle, scalar head/tail for rows whose start is
//    not 16-byte aligned (odd V such as 32003) or unaligned buffers; up to 4 vectors in flight per
//    thread per iteration for memory-level parallelism.
//  * Rows with weight 0 (masked, ignored, padding) are not read at all: their gradient row is
//    written as zeros (the GEMMs after the kernel still consume it).
//  * In place: dlogits may alias logits when TIn == TOut; every element is read (pass 1, and pass
//    2 in the two-pass kernel) by the thread that later overwrites it, after the row's reduction
//    barrier, and the target logit is read before that barrier.
#include "kernels/lm_head_ce.h"
#include "kernels/device_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <cooperative_groups.h>

namespace surogate {
namespace {

constexpr int kThreads = 512;
constexpr int kWarp = 32;
constexpr int kUnroll = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int kMaxCluster = 8;                    // portable cluster size limit
constexpr size_t kClusterSmemTarget = 100 << 10;  // bytes of row slice per CTA: 2 CTAs per SM

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// N consecutive elements as floats (one 16-byte load when N > 1).
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = to_float(p[0]);
  } else {
    static_assert(N * sizeof(T) == 16, "the vector path loads 16 bytes");
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    T v[N];
    memcpy(v, &raw, sizeof(raw));
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(v[k]);
  }
}

// N consecutive elements rounded to T: N * sizeof(T) bytes (2..32), aligned to that size (<= 16).
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  T v[N];
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = from_float<T>(in[k]);
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  if constexpr (kBytes >= 16) {
#pragma unroll
    for (int q = 0; q < kBytes / 16; ++q) {
      uint4 raw;
      memcpy(&raw, reinterpret_cast<const char*>(v) + 16 * q, 16);
      reinterpret_cast<uint4*>(p)[q] = raw;
    }
  } else if constexpr (kBytes == 8) {
    uint2 raw;
    memcpy(&raw, v, 8);
    *reinterpret_cast<uint2*>(p) = raw;
  } else if constexpr (kBytes == 4) {
    uint32_t raw;
    memcpy(&raw, v, 4);
    *reinterpret_cast<uint32_t*>(p) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = v[k];
  }
}

// Running (max, sum of exp(x - max)); m == -inf means nothing finite seen yet (s == 0).
struct Online {
  float m = -INFINITY;
  float s = 0.f;

  __device__ __forceinline__ float shift() const { return m == -INFINITY ? 0.f : m * kLog2e; }

  template <int N>
  __device__ __forceinline__ void add(const float (&x)[N]) {
    float vm = x[0];
#pragma unroll
    for (int k = 1; k < N; ++k) vm = fmaxf(vm, x[k]);
    if (vm > m) {  // rescale (rare once the row's max is found)
      s *= ex2(shift() - vm * kLog2e);
      m = vm;
    }
    const float sh = shift();
#pragma unroll
    for (int k = 0; k < N; ++k) s += ex2(fmaf(x[k], kLog2e, -sh));
  }

  __device__ __forceinline__ void merge(float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;
    s = s * ex2((m - mn) * kLog2e) + s2 * ex2((m2 - mn) * kLog2e);
    m = mn;
  }
};

// Block-wide merge of every thread's (m, s); all threads get the result. `red` holds
// 2 * (kWarp + 1) floats; the broadcast slot is rewritten only after the next call's first barrier.
__device__ __forceinline__ Online block_merge(Online o, float* red) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, o.m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, o.s, off);
    o.merge(m2, s2);
  }
  if (lane == 0) {
    red[2 * warp] = o.m;
    red[2 * warp + 1] = o.s;
  }
  __syncthreads();
  if (warp == 0) {
    Online t;
    if (lane < static_cast<int>(blockDim.x / kWarp)) {
      t.m = red[2 * lane];
      t.s = red[2 * lane + 1];
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, t.m, off);
      const float s2 = __shfl_xor_sync(0xffffffffu, t.s, off);
      t.merge(m2, s2);
    }
    if (lane == 0) {
      red[2 * kWarp] = t.m;
      red[2 * kWarp + 1] = t.s;
    }
  }
  __syncthreads();
  Online r;
  r.m = red[2 * kWarp];
  r.s = red[2 * kWarp + 1];
  return r;
}

// Fills one gradient row with `v` (masked rows: 0, bad targets: NaN) without reading logits.
template <typename TOut, int N>
__device__ __forceinline__ void fill_row(TOut* dr, int64_t h0, int64_t nv, int64_t V, float v) {
  float vals[N];
#pragma unroll
  for (int k = 0; k < N; ++k) vals[k] = v;
  const TOut fv = from_float<TOut>(v);
  for (int64_t j = threadIdx.x; j < h0; j += blockDim.x) dr[j] = fv;
  for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) store_vec<TOut, N>(dr + h0 + i * N, vals);
  for (int64_t j = h0 + nv * N + threadIdx.x; j < V; j += blockDim.x) dr[j] = fv;
}

// N: elements per vector (16 / sizeof(TIn), or 1 for the all-scalar path).
template <typename TIn, typename TOut, int N, bool kGrad>
__global__ void __launch_bounds__(kThreads)
    lm_head_ce_kernel(const TIn* logits, const int32_t* __restrict__ targets,
                      const float* __restrict__ weights, float* __restrict__ loss,
                      float* __restrict__ lse_out, TOut* dlogits, int64_t rows, int64_t V,
                      float z) {
  // logits/dlogits are not __restrict__: they may alias (in place).
  __shared__ float red[2 * (kWarp + 1)];
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t g0 = row * V;
    const int64_t h0 = std::min<int64_t>((N - g0 % N) % N, V);  // scalar head to 16-byte alignment
    const int64_t nv = (V - h0) / N;
    const int64_t t0 = h0 + nv * N;  // scalar tail start
    const TIn* xr = logits + g0;
    const float w = weights[row];
    const int32_t t = targets[row];
    if (w == 0.f || t < 0 || t >= V) {  // uniform over the block: no barrier is skipped unevenly
      const float v = w == 0.f ? 0.f : NAN;
      if (tid == 0) {
        loss[row] = v;
        lse_out[row] = v;
      }
      if constexpr (kGrad) fill_row<TOut, N>(dlogits + g0, h0, nv, V, v);
      continue;
    }
    const float xt = tid == 0 ? to_float(xr[t]) : 0.f;

    // Pass 1: running max and sum of exp.
    Online o;
    for (int64_t j = tid; j < h0; j += bd) {
      const float x[1] = {to_float(xr[j])};
      o.add(x);
    }
    const TIn* xv = xr + h0;
    for (int64_t i0 = tid; i0 < nv; i0 += static_cast<int64_t>(kUnroll) * bd) {
      float x[kUnroll][N];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * bd;
        if (i < nv) load_vec<TIn, N>(xv + i * N, x[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + static_cast<int64_t>(u) * bd < nv) o.add(x[u]);
      }
    }
    for (int64_t j = t0 + tid; j < V; j += bd) {
      const float x[1] = {to_float(xr[j])};
      o.add(x);
    }
    const Online r = block_merge(o, red);
    const float lse = r.m + logf(r.s);
    if (tid == 0) {
      loss[row] = w * (lse - xt + z * lse * lse);
      lse_out[row] = lse;
    }
    if constexpr (kGrad) {
      // Pass 2: dlogits = coef * exp(x - m) - w [j == t],  coef = w (1 + 2 z lse) / s.
      const float coef = w * (1.f + 2.f * z * lse) / r.s;
      const float sh = r.m * kLog2e;
      TOut* dr = dlogits + g0;
      auto grad = [&](float x, int64_t j) {
        return coef * ex2(fmaf(x, kLog2e, -sh)) - (j == t ? w : 0.f);
      };
      for (int64_t j = tid; j < h0; j += bd) dr[j] = from_float<TOut>(grad(to_float(xr[j]), j));
      TOut* dv = dr + h0;
      for (int64_t i0 = tid; i0 < nv; i0 += static_cast<int64_t>(kUnroll) * bd) {
        float x[kUnroll][N];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + static_cast<int64_t>(u) * bd;
          if (i < nv) load_vec<TIn, N>(xv + i * N, x[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + static_cast<int64_t>(u) * bd;
          if (i < nv) {
            float d[N];
#pragma unroll
            for (int k = 0; k < N; ++k) d[k] = grad(x[u][k], h0 + i * N + k);
            store_vec<TOut, N>(dv + i * N, d);
          }
        }
      }
      for (int64_t j = t0 + tid; j < V; j += bd) dr[j] = from_float<TOut>(grad(to_float(xr[j]), j));
    }
  }
}

// Single-read variant (Hopper thread-block clusters): a cluster of K CTAs owns one row, each CTA
// one contiguous slice of the row's aligned vectors. Pass 1 streams the slice from DRAM into the
// CTA's shared memory while accumulating (max, sum); the K partial results are merged through
// distributed shared memory (every CTA merges all K in rank order: identical, deterministic);
// pass 2 reads the slice back from shared memory, so DRAM sees each logit once. Each thread reads
// back exactly the vectors it stored, so the cache needs no barrier. The scalar head/tail of an
// unaligned row (< 16 bytes each) stay in global memory (rank 0 / rank K-1).
namespace cg = cooperative_groups;

template <typename TIn, typename TOut, int N>
__global__ void __launch_bounds__(kThreads)
    lm_head_ce_cluster_kernel(const TIn* logits, const int32_t* __restrict__ targets,
                              const float* __restrict__ weights, float* __restrict__ loss,
                              float* __restrict__ lse_out, TOut* dlogits, int64_t rows, int64_t V,
                              float z) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // launched only on compute capability >= 9.0 (see launch())
#else
  extern __shared__ uint4 cache[];  // this CTA's slice of the row, raw 16-byte vectors
  __shared__ float red[2 * (kWarp + 1)];
  __shared__ float slots[2][2];  // this CTA's (m, s), double-buffered by row parity
  cg::cluster_group cluster = cg::this_cluster();
  const int K = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, bd = blockDim.x;
  int parity = 0;
  for (int64_t row = blockIdx.x / K; row < rows; row += gridDim.x / K) {
    const int64_t g0 = row * V;
    const int64_t h0 = std::min<int64_t>((N - g0 % N) % N, V);
    const int64_t nv = (V - h0) / N;
    const int64_t t0 = h0 + nv * N;
    const int64_t v0 = nv * rank / K, v1 = nv * (rank + 1) / K;  // this CTA's vectors
    const TIn* xr = logits + g0;
    const TIn* xv = xr + h0;
    TOut* dr = dlogits + g0;
    TOut* dv = dr + h0;
    const float w = weights[row];
    const int32_t t = targets[row];
    const bool head = rank == 0, tail = rank == K - 1;
    if (w == 0.f || t < 0 || t >= V) {  // uniform over the cluster: no cluster barrier here
      const float v = w == 0.f ? 0.f : NAN;
      if (head && tid == 0) {
        loss[row] = v;
        lse_out[row] = v;
      }
      float vals[N];
#pragma unroll
      for (int k = 0; k < N; ++k) vals[k] = v;
      for (int64_t i = v0 + tid; i < v1; i += bd) store_vec<TOut, N>(dv + i * N, vals);
      if (head)
        for (int64_t j = tid; j < h0; j += bd) dr[j] = from_float<TOut>(v);
      if (tail)
        for (int64_t j = t0 + tid; j < V; j += bd) dr[j] = from_float<TOut>(v);
      continue;
    }
    const float xt = head && tid == 0 ? to_float(xr[t]) : 0.f;

    Online o;
    if (head) {
      for (int64_t j = tid; j < h0; j += bd) {
        const float x[1] = {to_float(xr[j])};
        o.add(x);
      }
    }
    if (tail) {
      for (int64_t j = t0 + tid; j < V; j += bd) {
        const float x[1] = {to_float(xr[j])};
        o.add(x);
      }
    }
    for (int64_t i0 = v0 + tid; i0 < v1; i0 += static_cast<int64_t>(kUnroll) * bd) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * bd;
        if (i < v1) raw[u] = *reinterpret_cast<const uint4*>(xv + i * N);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * bd;
        if (i < v1) {
          cache[i - v0] = raw[u];
          float x[N];
          load_vec<TIn, N>(reinterpret_cast<const TIn*>(&raw[u]), x);
          o.add(x);
        }
      }
    }
    const Online mine = block_merge(o, red);
    if (tid == 0) {
      slots[parity][0] = mine.m;
      slots[parity][1] = mine.s;
    }
    cluster.sync();  // every CTA's slot for this row is written
    Online r;
    for (int q = 0; q < K; ++q) {
      const float* remote = cluster.map_shared_rank(&slots[parity][0], q);
      r.merge(remote[0], remote[1]);
    }
    parity ^= 1;  // only rows that passed a cluster barrier flip it (see the masked branch)
    const float lse = r.m + logf(r.s);
    if (head && tid == 0) {
      loss[row] = w * (lse - xt + z * lse * lse);
      lse_out[row] = lse;
    }
    const float coef = w * (1.f + 2.f * z * lse) / r.s;
    const float sh = r.m * kLog2e;
    auto grad = [&](float x, int64_t j) {
      return coef * ex2(fmaf(x, kLog2e, -sh)) - (j == t ? w : 0.f);
    };
    for (int64_t i = v0 + tid; i < v1; i += bd) {
      float x[N], d[N];
      load_vec<TIn, N>(reinterpret_cast<const TIn*>(&cache[i - v0]), x);
#pragma unroll
      for (int k = 0; k < N; ++k) d[k] = grad(x[k], h0 + i * N + k);
      store_vec<TOut, N>(dv + i * N, d);
    }
    if (head)
      for (int64_t j = tid; j < h0; j += bd) dr[j] = from_float<TOut>(grad(to_float(xr[j]), j));
    if (tail)
      for (int64_t j = t0 + tid; j < V; j += bd) dr[j] = from_float<TOut>(grad(to_float(xr[j]), j));
  }
  cluster.sync();  // no CTA leaves while another may still read its slots
#endif
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Cluster size for the single-read kernel: the smallest power of two whose slice fits the shared
// memory target (two CTAs per SM), up to kMaxCluster; 0 when the row is too long (or too short to
// be worth it) or the device/driver cannot run such a cluster.
template <typename TIn, typename TOut>
int cluster_plan(int64_t vocab, size_t* smem) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(TIn));
  const int64_t nv = vocab / kVec;
  if (nv < kThreads) return 0;  // short rows: the two-pass kernel's second read hits L1/L2 anyway
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      major < 9) {
    return 0;
  }
  for (int k = 1; k <= kMaxCluster; k *= 2) {
    const size_t bytes = static_cast<size_t>((nv + k - 1) / k) * 16;
    if (bytes > kClusterSmemTarget) continue;
    auto kernel = lm_head_ce_cluster_kernel<TIn, TOut, kVec>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)) != cudaSuccess) {
      return 0;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(k);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = bytes;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = k;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters < 1) {
      cudaGetLastError();  // clear a sticky-free query error; fall back to two passes
      return 0;
    }
    *smem = bytes;
    return k;
  }
  return 0;
}

template <typename TIn, typename TOut, bool kGrad>
cudaError_t launch(const TIn* logits, const int32_t* targets, const float* weights, float* loss,
                   float* lse, TOut* dlogits, int64_t rows, int64_t vocab, float z,
                   LmHeadCeAlgo algo, cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 || vocab > INT32_MAX) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  constexpr int kVec = 16 / static_cast<int>(sizeof(TIn));
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kMaxBlocks));
  const bool vec = aligned16(logits) && (!kGrad || aligned16(dlogits));
  size_t smem = 0;
  const int k =
      kGrad && vec && algo != LmHeadCeAlgo::kTwoPass ? cluster_plan<TIn, TOut>(vocab, &smem) : 0;
  if (k > 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(std::min(rows, kMaxBlocks) * k));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = k;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, lm_head_ce_cluster_kernel<TIn, TOut, kVec>, logits, targets,
                              weights, loss, lse, dlogits, rows, vocab, z);
  }
  if (vec) {
    lm_head_ce_kernel<TIn, TOut, kVec, kGrad><<<blocks, kThreads, 0, stream>>>(
        logits, targets, weights, loss, lse, dlogits, rows, vocab, z);
  } else {
    lm_head_ce_kernel<TIn, TOut, 1, kGrad><<<blocks, kThreads, 0, stream>>>(
        logits, targets, weights, loss, lse, dlogits, rows, vocab, z);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename TIn>
cudaError_t lm_head_ce_loss(const TIn* logits, const int32_t* targets, const float* weights,
                            float* loss, float* lse, int64_t rows, int64_t vocab, float z_loss,
                            cudaStream_t stream) {
  return launch<TIn, TIn, false>(logits, targets, weights, loss, lse, nullptr, rows, vocab, z_loss,
                                 LmHeadCeAlgo::kTwoPass, stream);
}

template <typename TIn, typename TOut>
cudaError_t lm_head_ce_grad(const TIn* logits, const int32_t* targets, const float* weights,
                            float* loss, float* lse, TOut* dlogits, int64_t rows, int64_t vocab,
                            float z_loss, LmHeadCeAlgo algo, cudaStream_t stream) {
  if (dlogits == nullptr) return cudaErrorInvalidValue;
  return launch<TIn, TOut, true>(logits, targets, weights, loss, lse, dlogits, rows, vocab, z_loss,
                                 algo, stream);
}

#define SUROGATE_LM_HEAD_CE_LOSS(TIn)                                                         \
  template cudaError_t lm_head_ce_loss<TIn>(const TIn*, const int32_t*, const float*, float*, \
                                            float*, int64_t, int64_t, float, cudaStream_t);
#define SUROGATE_LM_HEAD_CE_GRAD(TIn, TOut)                                                       \
  template cudaError_t lm_head_ce_grad<TIn, TOut>(const TIn*, const int32_t*, const float*,       \
                                                  float*, float*, TOut*, int64_t, int64_t, float, \
                                                  LmHeadCeAlgo, cudaStream_t);

SUROGATE_LM_HEAD_CE_LOSS(float)
SUROGATE_LM_HEAD_CE_LOSS(__nv_bfloat16)
SUROGATE_LM_HEAD_CE_LOSS(__half)
SUROGATE_LM_HEAD_CE_GRAD(float, float)
SUROGATE_LM_HEAD_CE_GRAD(float, __nv_bfloat16)
SUROGATE_LM_HEAD_CE_GRAD(float, __half)
SUROGATE_LM_HEAD_CE_GRAD(__nv_bfloat16, __nv_bfloat16)
SUROGATE_LM_HEAD_CE_GRAD(__nv_bfloat16, float)
SUROGATE_LM_HEAD_CE_GRAD(__half, __half)
SUROGATE_LM_HEAD_CE_GRAD(__half, float)

}  // namespace surogate
