// SwiGLU + in-kernel LoRA update of gate and up (see swiglu_lora.h for the math and the contract).
//
// Why: inside a LoRA train step the model's SwiGLU inputs are sums, gate = x W_g + s (x A_g) B_g.
// XLA fuses those adds into its SwiGLU loop fusion; a plain SwiGLU kernel needs them materialized,
// which cost 3% of the Qwen3-0.6B step. Here the rank-R products
// are computed in-kernel from xa [rows, 2R] and B [2, R, F], so the [rows, F] LoRA outputs XLA's
// Triton GEMMs would write (and its fusion read back) never exist.
//
// Floor (per element of h, T = bf16): forward reads gate_up (4 B), writes h (2 B): 6 B; backward
// reads dh + gate_up (6 B), writes dgate_up (4 B): 10 B. xa and B add (2R / F + 2R / 32) elements
// per element (a few %). [4096, 3072], R = 16: forward 75.5 MB -> 25 us, backward 126 MB -> 42 us
// at ~3.0 TB/s. The products add 2R FMAs per element of each half: 0.4 G FMAs at R = 16, ~14 us at
// the H100's fp32 FMA rate, a few us on its tensor cores.
//
// Design:
//  * A block (256 threads) owns a 32-row x 256-column tile of h. Each thread's rows are asked of
//    L2 first (prefetch, no registers held), then the rank products are formed, then the
//    element-wise epilogue runs with warp w on rows 4w..4w+3 and lane l on the 16-byte vector of
//    columns 8l..8l+7 (the layout of swiglu.cu).
//  * bf16 / f16: the products run on tensor cores (mma.sync m16n8k16, fp32 accumulate), one half
//    (gate, then up) at a time, in 16-rank chunks staged in shared memory; they are rounded to T
//    (the model's first rounding) into a shared 2 x 32 x 256 tile the epilogue reads. 80
//    registers, 43 KB of shared memory: 3 blocks per SM (fp32 FMAs on CUDA cores need 128
//    registers, 2 blocks per SM, and ran the [4096, 3072] R = 16 forward 1.5x slower).
//  * f32: the FMA version (register tile 4 rows x 8 columns x 2 halves, B and xa as fp32 in
//    shared memory).
//  * fp32 accumulation, rounding to T at the same three places as the unfused model, two values
//    per conversion; sigmoid from ex2.approx and rcp.approx (scalar conversions and the IEEE
//    division's slow path double the SASS instructions an element, 48 vs 24).
//  * The epilogue's loads go out in groups (four rows forward, two backward) and its stores are
//    16 bytes: one row at a time left it latency-bound (no eligible warp in 50% of cycles). The
//    backward does not prefetch (its lines were evicted before use). Forward 68% / 79%, backward
//    78% / 86% of the copy floor at Qwen3-0.6B's [4096, 3072] / 8B's [4096, 12288]. Slower, so not
//    used: a persistent block per column tile with B staged once (+25% DRAM reads from L2
//    evictions), and the whole rank of both halves staged in one round trip (54 KB of dynamic
//    shared memory).
//  * bf16 with a power-of-two scale >= 1 folds the scale into xa (exact), dropping a multiply and
//    a rounding an element (kFold); no measurable speed change, 13% fewer instructions.
#include "kernels/swiglu_lora.h"

#include <cmath>
#include <type_traits>

#include "kernels/device_common.cuh"

namespace surogate {
namespace {

constexpr int kThreads = 256;
constexpr int kTileRows = 32;
constexpr int kRowsPerThread = 4;  // kTileRows / (kThreads / 32)
constexpr int kTileCols = 256;     // 32 lanes x 8
constexpr int kCols = 8;           // per thread
constexpr int kRankChunk = 16;

template <typename T>
constexpr int kWords = kCols * static_cast<int>(sizeof(T)) / 16;  // uint4 per 8 elements

// 8 consecutive elements in storage form (bf16/f16: one uint4; f32: two).
template <typename T>
struct Raw8 {
  uint4 u[kWords<T>];
};

template <typename T, bool kVec>
__device__ __forceinline__ Raw8<T> load8(const T* p, int64_t n_ok) {
  Raw8<T> r;
  if constexpr (kVec) {
#pragma unroll
    for (int w = 0; w < kWords<T>; ++w) r.u[w] = reinterpret_cast<const uint4*>(p)[w];
  } else {
    T e[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) e[j] = j < n_ok ? p[j] : T(0.f);
    memcpy(&r, e, sizeof(r));
  }
  return r;
}

template <typename T>
__device__ __forceinline__ void unpack8(const Raw8<T>& r, float (&f)[kCols]) {
  constexpr int N = vec::kVec<T>;
#pragma unroll
  for (int w = 0; w < kWords<T>; ++w) {
    vec::Raw<T, N> part;
    part.u = r.u[w];
    float g[N];
    vec::unpack(part, g);
#pragma unroll
    for (int j = 0; j < N; ++j) f[w * N + j] = g[j];
  }
}

// One 16-byte global store. Through a uint4 lvalue (vec::store_raw) the compiler split the
// epilogue's stores into four 32-bit ones (st.global.u32 in the PTX): 4x the store instructions
// and partial-sector writes.
__device__ __forceinline__ void st_global_16(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
}

template <typename T, bool kVec>
__device__ __forceinline__ void store8(T* p, const float (&f)[kCols], int64_t n_ok) {
  if constexpr (kVec) {
    constexpr int N = vec::kVec<T>;
#pragma unroll
    for (int w = 0; w < kWords<T>; ++w) {
      float g[N];
#pragma unroll
      for (int j = 0; j < N; ++j) g[j] = f[w * N + j];
      st_global_16(p + w * N, vec::pack<T, N>(g).u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      if (j < n_ok) p[j] = vec::from_float<T>(f[j]);
    }
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Rounds eight fp32 values to T and back, two per conversion (cvt.rn.bf16x2 / f16x2: one SFU-rate
// instruction for two values, where a scalar round trip costs one each).
template <typename T>
__device__ __forceinline__ void round8(float (&f)[kCols]) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int j = 0; j < kCols; j += 2) vec::unpack_pair<T>(vec::pack_pair<T>(f + j), f + j);
  }
}

// acc[half][i][j] = sum_k xa[row_i, half*R + k] * B[half, k, col_j] over the whole rank.
template <typename T, bool kVec>
__device__ __forceinline__ void lora_products(const T* __restrict__ xa,
                                              const T* __restrict__ lora_b, int64_t rows, int64_t F,
                                              int64_t R, int64_t tile_row, int64_t tile_col,
                                              float (&acc)[2][kRowsPerThread][kCols]) {
  // xa as fp32, [half][k][row]: a warp's 4 rows are one float4 (a broadcast load). B in storage
  // form, [half][k][lane]: a lane's 8 columns are one 16-byte word (bf16/f16; f32 uses two).
  __shared__ __align__(16) float xs[2][kRankChunk][kTileRows];
  __shared__ Raw8<T> bs[2][kRankChunk][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[h][i][j] = 0.f;

  for (int64_t k0 = 0; k0 < R; k0 += kRankChunk) {
    if (k0 > 0) __syncthreads();  // the previous chunk's reads are done
    // xa chunk: 2 x 32 rows x 16 values, 4 per thread (consecutive threads walk k: coalesced).
#pragma unroll
    for (int q = 0; q < 2 * kTileRows * kRankChunk / kThreads; ++q) {
      const int idx = tid + q * kThreads;
      const int k = idx % kRankChunk, r = (idx / kRankChunk) % kTileRows,
                h = idx / (kRankChunk * kTileRows);
      const int64_t row = tile_row + r, kk = k0 + k;
      xs[h][k][r] = (row < rows && kk < R) ? vec::to_float<T>(xa[row * 2 * R + h * R + kk]) : 0.f;
    }
    // B chunk: 2 x 16 rank rows x 256 columns, one 8-column word per thread and step.
#pragma unroll
    for (int q = 0; q < 2 * kRankChunk * 32 / kThreads; ++q) {
      const int idx = tid + q * kThreads;  // (half, k, lane8)
      const int l8 = idx % 32, k = (idx / 32) % kRankChunk, h = idx / (32 * kRankChunk);
      const int64_t col = tile_col + l8 * kCols, kk = k0 + k;
      if (kk < R && col < F) {
        bs[h][k][l8] = load8<T, kVec>(lora_b + (h * R + kk) * F + col, F - col);
      } else {
        Raw8<T> z;  // all-zero bits: 0 in every storage type
#pragma unroll
        for (int w = 0; w < kWords<T>; ++w) z.u[w] = make_uint4(0u, 0u, 0u, 0u);
        bs[h][k][l8] = z;
      }
    }
    __syncthreads();
    const int kn = static_cast<int>(R - k0 < kRankChunk ? R - k0 : kRankChunk);
#pragma unroll 2
    for (int k = 0; k < kn; ++k) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float b[kCols];
        unpack8<T>(bs[h][k][lane], b);
        const float4 a4 = *reinterpret_cast<const float4*>(&xs[h][k][warp * kRowsPerThread]);
        const float a[kRowsPerThread] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
          for (int j = 0; j < kCols; ++j) acc[h][i][j] = fmaf(a[i], b[j], acc[h][i][j]);
      }
    }
  }
}

// 16-bit types: the rank products on tensor cores (mma.sync m16n8k16, fp32 accumulate). One half
// (gate, then up) at a time: warp w computes rows 16 (w & 1) .. +16 and columns 64 (w >> 1) .. +64
// of the tile (8 MMAs per 16-rank chunk, 32 accumulators), rounds them to T (the model's first
// rounding) and stores them to shared memory `lo` [2][32][kLoStride], from which the element-wise
// epilogue reads them back in its own 16-byte-vector layout. Staging (one half's xa and B chunk)
// and `lo` are separate, so no barrier sits between the MMAs and the stores.
constexpr int kXsStride = 24;   // xa tile row: 16 ranks + 8 pad (conflict-free A-fragment loads)
constexpr int kBsStride = 264;  // B tile row (one rank): 256 columns + 8 pad
constexpr int kLoStride = 264;  // products tile row: 256 columns + 8 pad (conflict-free C stores)
template <typename T>
constexpr int kMmaSmem =
    (kTileRows * kXsStride + kRankChunk * kBsStride + 2 * kTileRows * kLoStride) *
    static_cast<int>(sizeof(T));

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t pack2(uint16_t lo16, uint16_t hi16) {
  return static_cast<uint32_t>(lo16) | (static_cast<uint32_t>(hi16) << 16);
}

// kFold: the scale is a power of two >= 1 and T is bf16, so xa * scale is exact in T and the MMA's
// fp32 sums scale exactly: round(xa @ B) * scale == round((xa * scale) @ B) bit for bit (up to
// overflow past bf16's 3.4e38). The products then come out scaled and rounded, and the epilogue
// skips its multiply and its second rounding (5 of its 24 instructions an element).
template <typename T, bool kVec, bool kFold>
__device__ __forceinline__ const T* lora_products_mma(const T* __restrict__ xa,
                                                      const T* __restrict__ lora_b, int64_t rows,
                                                      int64_t F, int64_t R, int64_t tile_row,
                                                      int64_t tile_col, float scale,
                                                      unsigned char* smem) {
  T* xs = reinterpret_cast<T*>(smem);   // [32][kXsStride]: one half's xa chunk
  T* bs = xs + kTileRows * kXsStride;   // [16][kBsStride]: one half's B chunk
  T* lo = bs + kRankChunk * kBsStride;  // [2][32][kLoStride]: the rounded products
  const uint16_t* bs16 = reinterpret_cast<const uint16_t*>(bs);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wr = (warp & 1) * 16, wc = (warp >> 1) * 64;
  bool first = true;
#pragma unroll 1
  for (int h = 0; h < 2; ++h) {
    float acc[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll 1
    for (int64_t k0 = 0; k0 < R; k0 += kRankChunk) {
      if (!first) __syncthreads();  // the previous chunk's fragment reads are done
      first = false;
#pragma unroll
      for (int q = 0; q < kTileRows * kRankChunk / kThreads; ++q) {
        const int idx = tid + q * kThreads;
        const int k = idx % kRankChunk, r = idx / kRankChunk;
        const int64_t row = tile_row + r, kk = k0 + k;
        T x = (row < rows && kk < R) ? xa[row * 2 * R + h * R + kk] : T(0.f);
        if constexpr (kFold) x = vec::from_float<T>(vec::to_float<T>(x) * scale);
        xs[r * kXsStride + k] = x;
      }
#pragma unroll
      for (int q = 0; q < kRankChunk * 32 / kThreads; ++q) {
        const int idx = tid + q * kThreads;  // (k, lane8)
        const int l8 = idx % 32, k = idx / 32;
        const int64_t col = tile_col + l8 * kCols, kk = k0 + k;
        Raw8<T> v;
        if (kk < R && col < F) {
          v = load8<T, kVec>(lora_b + (h * R + kk) * F + col, F - col);
        } else {
#pragma unroll
          for (int w = 0; w < kWords<T>; ++w) v.u[w] = make_uint4(0u, 0u, 0u, 0u);
        }
        *reinterpret_cast<Raw8<T>*>(bs + k * kBsStride + l8 * kCols) = v;
      }
      __syncthreads();
      const uint32_t* xr = reinterpret_cast<const uint32_t*>(xs + wr * kXsStride);
      uint32_t a[4];  // rows g / g + 8, ranks 2t.. / 2t + 8..
      a[0] = xr[(g * kXsStride + 2 * t) / 2];
      a[1] = xr[((g + 8) * kXsStride + 2 * t) / 2];
      a[2] = xr[(g * kXsStride + 2 * t + 8) / 2];
      a[3] = xr[((g + 8) * kXsStride + 2 * t + 8) / 2];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int c = wc + n * 8 + g;  // B fragment: ranks 2t, 2t + 1 (and + 8) of column c
        const uint32_t b0 = pack2(bs16[(2 * t) * kBsStride + c], bs16[(2 * t + 1) * kBsStride + c]);
        const uint32_t b1 =
            pack2(bs16[(2 * t + 8) * kBsStride + c], bs16[(2 * t + 9) * kBsStride + c]);
        mma16816<T>(acc[n], a, b0, b1);
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int c = wc + n * 8 + 2 * t;  // C fragment: rows g, g + 8; columns 2t, 2t + 1
      T* p0 = lo + (h * kTileRows + wr + g) * kLoStride + c;  // c even: 4-byte aligned pairs
      *reinterpret_cast<uint32_t*>(p0) = vec::pack_pair<T>(acc[n]);
      *reinterpret_cast<uint32_t*>(p0 + 8 * kLoStride) = vec::pack_pair<T>(acc[n] + 2);
    }
  }
  __syncthreads();  // every warp's products are in `lo`
  return lo;
}

// v = base + round(acc * scale), rounded to T: the unfused model's last two roundings. Its first,
// of the rank product itself, is already done: the MMA path stores the products as T, and the f32
// path's rounding to T is the identity. kFold: acc is already round(acc * scale) (see above).
template <typename T, bool kFold>
__device__ __forceinline__ void with_lora(float (&v)[kCols], const float (&acc)[kCols],
                                          float scale) {
  if constexpr (kFold) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) v[j] += acc[j];
  } else {
    float t[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) t[j] = acc[j] * scale;
    round8<T>(t);
#pragma unroll
    for (int j = 0; j < kCols; ++j) v[j] += t[j];
  }
  round8<T>(v);
}

// Asks L2 for this thread's rows of gate and up (no registers held): they arrive while the
// products are formed, and the epilogue's loads then wait on L2 rather than DRAM. Forward only:
// the backward (four input rows a thread, not two) ran 10% faster without it, with 17% fewer DRAM
// reads: prefetched lines were evicted before their loads came.
template <typename T>
__device__ __forceinline__ void prefetch_rows(const T* gate, const T* up, int64_t ld, int64_t rows,
                                              int64_t F, int64_t row0, int64_t col) {
  if (col >= F) return;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t row = row0 + i;
    if (row < rows) {
      prefetch_l2(gate + row * ld + col);
      prefetch_l2(up + row * ld + col);
    }
  }
}

// The element-wise part for this thread's rows row0.. row0 + 3 and columns col.. col + 7 of a tile:
// the LoRA products come from `lo` (MMA path: shared memory, rounded to T, the tile's rows) or
// from acc (FMA path: fp32 registers). The rows' loads are issued in groups (all four
// rows forward, two backward) before any of them is used: one row at a time, a warp waited a full
// memory round trip per row with two 16-byte loads in flight (ncu: no eligible warp half the
// time).
template <typename T, bool kBwd, bool kVec, bool kFold, bool kMma>
__device__ __forceinline__ void epilogue(const T* __restrict__ dh, const T* __restrict__ dh2,
                                         const T* __restrict__ gate, const T* __restrict__ up,
                                         int64_t ld, const T* lo,
                                         float (&acc)[2][kRowsPerThread][kCols],
                                         T* __restrict__ out0, T* __restrict__ out1, int64_t ld_out,
                                         int64_t rows, int64_t F, int64_t row0, int64_t col,
                                         float scale) {
  constexpr int kGroup = sizeof(T) == 4 ? 1
                         : kBwd         ? 2
                                        : kRowsPerThread;  // f32: 128 registers already
  const bool col_ok = col < F;
  const int64_t n_ok = F - col;
  const int lane = threadIdx.x & 31,
            r_lo = (threadIdx.x >> 5) * kRowsPerThread;  // row0's row in the tile
#pragma unroll
  for (int i0 = 0; i0 < kRowsPerThread; i0 += kGroup) {
    Raw8<T> rg[kGroup], ru[kGroup], rd[kGroup], rd2[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int64_t row = row0 + i0 + i;
      if (col_ok && row < rows) {
        rg[i] = load8<T, kVec>(gate + row * ld + col, n_ok);
        ru[i] = load8<T, kVec>(up + row * ld + col, n_ok);
        if constexpr (kBwd) {
          rd[i] = load8<T, kVec>(dh + row * F + col, n_ok);
          if (dh2 != nullptr) rd2[i] = load8<T, kVec>(dh2 + row * F + col, n_ok);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int64_t row = row0 + i0 + i;
      if (!col_ok || row >= rows) break;
      float g[kCols], u[kCols];
      unpack8<T>(rg[i], g);
      unpack8<T>(ru[i], u);
      float (&pg)[kCols] = acc[0][i0 + i];
      float (&pu)[kCols] = acc[1][i0 + i];
      if constexpr (kMma) {
        const int r = r_lo + i0 + i;
        unpack8<T>(*reinterpret_cast<const Raw8<T>*>(lo + r * kLoStride + lane * kCols), pg);
        unpack8<T>(
            *reinterpret_cast<const Raw8<T>*>(lo + (kTileRows + r) * kLoStride + lane * kCols), pu);
      }
      with_lora<T, kFold>(g, pg, scale);
      with_lora<T, kFold>(u, pu, scale);
      if constexpr (!kBwd) {
        float h[kCols];
#pragma unroll
        for (int j = 0; j < kCols; ++j) h[j] = g[j] * sigmoid(g[j]) * u[j];
        store8<T, kVec>(out0 + row * ld_out + col, h, n_ok);
      } else {
        float d[kCols], dg[kCols], du[kCols];
        unpack8<T>(rd[i], d);
        if (dh2 != nullptr) {  // h's two uses' gradients: their sum, rounded like autodiff's add
          float d2[kCols];
          unpack8<T>(rd2[i], d2);
#pragma unroll
          for (int j = 0; j < kCols; ++j) d[j] += d2[j];
          round8<T>(d);
        }
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const float s = sigmoid(g[j]);
          dg[j] = d[j] * u[j] * s * (1.f + g[j] * (1.f - s));
          du[j] = d[j] * g[j] * s;
        }
        store8<T, kVec>(out0 + row * ld_out + col, dg, n_ok);
        store8<T, kVec>(out1 + row * ld_out + col, du, n_ok);
      }
    }
  }
}

template <typename T, bool kBwd, bool kVec, bool kFold>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 2)
    swiglu_lora_kernel(const T* __restrict__ dh, const T* __restrict__ dh2,
                       const T* __restrict__ gate, const T* __restrict__ up, int64_t ld,
                       const T* __restrict__ xa, const T* __restrict__ lora_b, T* __restrict__ out0,
                       T* __restrict__ out1, int64_t ld_out, int64_t rows, int64_t F, int64_t R,
                       float scale) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t tile_row = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t tile_col = static_cast<int64_t>(blockIdx.y) * kTileCols;
  const int64_t row0 = tile_row + warp * kRowsPerThread;
  const int64_t col = tile_col + lane * kCols;
  if constexpr (!kBwd) prefetch_rows<T>(gate, up, ld, rows, F, row0, col);
  constexpr bool kMma = sizeof(T) == 2;
  float acc[2][kRowsPerThread][kCols];  // the FMA path's products (fp32)
  const T* lo = nullptr;                // the MMA path's products (rounded to T, shared memory)
  if constexpr (kMma) {
    __shared__ __align__(16) unsigned char smem[kMmaSmem<T>];
    lo = lora_products_mma<T, kVec, kFold>(xa, lora_b, rows, F, R, tile_row, tile_col, scale, smem);
  } else {
    lora_products<T, kVec>(xa, lora_b, rows, F, R, tile_row, tile_col, acc);
  }
  epilogue<T, kBwd, kVec, kFold, kMma>(dh, dh2, gate, up, ld, lo, acc, out0, out1, ld_out, rows, F,
                                       row0, col, scale);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, bool kBwd>
cudaError_t launch(const T* dh, const T* dh2, const T* gate, const T* up, int64_t ld, const T* xa,
                   const T* lora_b, T* out0, T* out1, int64_t ld_out, int64_t rows, int64_t F,
                   int64_t R, float scale, cudaStream_t stream) {
  if (rows <= 0 || F <= 0) return cudaSuccess;
  if (R <= 0 || ld < F || ld_out < F) return cudaErrorInvalidValue;
  const int64_t gx = (rows + kTileRows - 1) / kTileRows, gy = (F + kTileCols - 1) / kTileCols;
  if (gx > 0x7fffffff || gy > 65535) return cudaErrorInvalidValue;
  const bool vec = F % kCols == 0 && ld % kCols == 0 && ld_out % kCols == 0 && aligned16(gate) &&
                   aligned16(up) && aligned16(lora_b) && aligned16(out0) &&
                   (!kBwd || aligned16(out1)) && (!kBwd || aligned16(dh)) &&
                   (dh2 == nullptr || aligned16(dh2));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  auto go = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(dh, dh2, gate, up, ld, xa, lora_b, out0, out1, ld_out,
                                          rows, F, R, scale);
  };
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    int e = 0;
    if (std::frexp(scale, &e) == 0.5f && e >= 1) {  // scale = 2^(e-1) >= 1: fold it into xa
      vec ? go(swiglu_lora_kernel<T, kBwd, true, true>)
          : go(swiglu_lora_kernel<T, kBwd, false, true>);
      return cudaGetLastError();
    }
  }
  vec ? go(swiglu_lora_kernel<T, kBwd, true, false>)
      : go(swiglu_lora_kernel<T, kBwd, false, false>);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t swiglu_lora_fwd(const T* gate, const T* up, int64_t ld, const T* xa, const T* lora_b,
                            T* h, int64_t rows, int64_t F, int64_t R, float scale,
                            cudaStream_t stream) {
  return launch<T, false>(nullptr, nullptr, gate, up, ld, xa, lora_b, h, nullptr, F, rows, F, R,
                          scale, stream);
}

template <typename T>
cudaError_t swiglu_lora_bwd(const T* dh, const T* dh2, const T* gate, const T* up, int64_t ld,
                            const T* xa, const T* lora_b, T* dgate, T* dup, int64_t ld_out,
                            int64_t rows, int64_t F, int64_t R, float scale, cudaStream_t stream) {
  return launch<T, true>(dh, dh2, gate, up, ld, xa, lora_b, dgate, dup, ld_out, rows, F, R, scale,
                         stream);
}

#define SUROGATE_SWIGLU_LORA_INSTANTIATE(T)                                                      \
  template cudaError_t swiglu_lora_fwd<T>(const T*, const T*, int64_t, const T*, const T*, T*,   \
                                          int64_t, int64_t, int64_t, float, cudaStream_t);       \
  template cudaError_t swiglu_lora_bwd<T>(const T*, const T*, const T*, const T*, int64_t,       \
                                          const T*, const T*, T*, T*, int64_t, int64_t, int64_t, \
                                          int64_t, float, cudaStream_t);
SUROGATE_SWIGLU_LORA_INSTANTIATE(float)
SUROGATE_SWIGLU_LORA_INSTANTIATE(__nv_bfloat16)
SUROGATE_SWIGLU_LORA_INSTANTIATE(__half)
#undef SUROGATE_SWIGLU_LORA_INSTANTIATE

}  // namespace surogate
