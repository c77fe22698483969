// Cross-entropy rows of LM-head logits: loss, lse and (optionally) dlogits in one kernel
// (see lm_head_ce.h for the math and the launcher contract).
//
// Floor. Memory bound: per active row the kernel must read V logits once (pass 1: running max and
// sum of exp) and, with the gradient, write V dlogits; this implementation reads the row a second
// time in pass 2 (hits in L2 only when few rows are in flight, so count it as DRAM traffic):
//   loss only : V * sizeof(TIn)                   e.g. V = 151936 fp32: 0.61 MB/row
//   gradient  : V * (2 * sizeof(TIn) + sizeof(TOut))   fp32 -> bf16: 1.52 MB/row,
//                                                       bf16 -> bf16 (in place): 0.91 MB/row
// At the H100's ~3000 GB/s copy bandwidth, a 4096-token x 151936-vocab chunk costs >= 2.1 ms
// (fp32 logits) or >= 1.2 ms (bf16 logits) with the gradient; the single-read floor would be
// 1.2 ms / 0.8 ms. Compare the GEMMs around it: 3 x 2 N D V FLOPs = 7.6 TFLOP at D = 1024 ->
// ~10 ms at 740 TFLOP/s, 4x that at D = 4096. So the kernel is ~15-20% of the op at D = 1024 and
// ~5% at D = 4096, and the GEMMs decide the op's speed. (exp count: 2 ex2 per element, ~1.5e12/s
// needed at full bandwidth for fp32 in pass 1 + 2, under the ~3.6e12/s MUFU throughput.)
//
// Design (why):
//  * One block (kThreads) per row, grid-striding over rows: a 150k-wide row gives every thread
//    ~75 16-byte vectors per pass, and the block reduction of (max, sum) costs two barriers.
//  * Online softmax (Milakov & Gimelshein 2018): each thread keeps a running max m and sum of
//    exp(x - m), rescaling only when a vector raises the max; exp as ex2.approx of fma(x, log2e,
//    -m log2e) (one FFMA + one MUFU per element).
//  * 16-byte vector loads in the row's aligned middle, scalar head/tail for rows whose start is
//    not 16-byte aligned (odd V such as 32003) or unaligned buffers; up to 4 vectors in flight per
//    thread per iteration for memory-level parallelism.
//  * Rows with weight 0 (masked, ignored, padding) are not read at all: their gradient row is
//    written as zeros (the GEMMs after the kernel still consume it).
//  * In place: dlogits may alias logits when TIn == TOut; pass 2 reads each element before the
//    same thread overwrites it, and pass 1 finished for the whole row (block barrier) before.
#include "kernels/lm_head_ce.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace surogate {
namespace {

constexpr int kThreads = 512;
constexpr int kWarp = 32;
constexpr int kUnroll = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

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
    const int64_t t0 = h0 + nv * N;                                // scalar tail start
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

#define SUROGATE_TRY(expr)                \
  do {                                    \
    const cudaError_t err_ = (expr);      \
    if (err_ != cudaSuccess) return err_; \
  } while (0)

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename TIn, typename TOut, bool kGrad>
cudaError_t launch(const TIn* logits, const int32_t* targets, const float* weights, float* loss,
                   float* lse, TOut* dlogits, int64_t rows, int64_t vocab, float z,
                   cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 || vocab > INT32_MAX) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  constexpr int kVec = 16 / static_cast<int>(sizeof(TIn));
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kMaxBlocks));
  const bool vec = aligned16(logits) && (!kGrad || aligned16(dlogits));
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
  return launch<TIn, TIn, false>(logits, targets, weights, loss, lse, nullptr, rows, vocab,
                                 z_loss, stream);
}

template <typename TIn, typename TOut>
cudaError_t lm_head_ce_grad(const TIn* logits, const int32_t* targets, const float* weights,
                            float* loss, float* lse, TOut* dlogits, int64_t rows, int64_t vocab,
                            float z_loss, cudaStream_t stream) {
  if (dlogits == nullptr) return cudaErrorInvalidValue;
  return launch<TIn, TOut, true>(logits, targets, weights, loss, lse, dlogits, rows, vocab,
                                 z_loss, stream);
}

#define SUROGATE_LM_HEAD_CE_LOSS(TIn)                                                          \
  template cudaError_t lm_head_ce_loss<TIn>(const TIn*, const int32_t*, const float*, float*, \
                                            float*, int64_t, int64_t, float, cudaStream_t);
#define SUROGATE_LM_HEAD_CE_GRAD(TIn, TOut)                                              \
  template cudaError_t lm_head_ce_grad<TIn, TOut>(const TIn*, const int32_t*, const float*, \
                                                  float*, float*, TOut*, int64_t, int64_t,   \
                                                  float, cudaStream_t);

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
