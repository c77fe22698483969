// Grouped GEMMs for MoE experts (see grouped_matmul.h for the contract).
//
// Why our own: XLA's ragged_dot lowers, on the GPU machine's jax 0.11.2 / cuDNN 9.19, to a zero-
// padded dense dot: 19.4 ms for the Qwen3-30B-A3B up-projection of a 4096-token micro-batch that
// one plain GEMM of the same FLOPs does in 0.23 ms (H100; benchmarks/bench_grouped_matmul.py).
// cuBLAS's grouped GEMM takes the group sizes from the host, which would sync the step on the
// routing.
//
// Floor (Qwen3-30B-A3B, 4096 tokens x top-8 = 32768 rows, D 2048, I 768, 128 experts, bf16): each
// of the forward / input-gradient GEMMs is 2 x 32768 x 2048 x 768 = 103 GFLOP and reads every
// expert's weights once (403 MB) plus x (134 MB) and writes y (50 MB): max(103 GFLOP / 989 TFLOP/s,
// 0.59 GB / 3.35 TB/s) = 0.18 ms. The weight gradient writes [E, D, I] (403 MB): >= 0.16 ms.
//
// Design: 128 x 128 output tiles, 64-deep k steps, 3-stage cp.async pipeline (108 KB of dynamic
// shared memory, two blocks an SM; rows padded by 16 bytes so ldmatrix reads are conflict-free), 8
// warps of 64 x 32, mma.sync m16n8k16 with fp32 accumulators. Forward / input gradient: a block
// owns one row tile of one expert (a row tile never straddles two experts); blocks are ordered
// column tile fastest, so that the blocks of one row tile run together and read x once from DRAM,
// and an expert's two-odd row tiles run close enough to share its weights in L2 (the intent; no
// profiler has measured the L2 hit rate). Each block finds its (expert, row tile) from the device
// offsets with a block-wide scan of the per-expert tile counts (no host round trip, no second
// kernel). Weight gradient: a block owns one (expert, 128 x 128 tile of dw) and runs its k loop
// over the expert's rows.
//
// FP8 (grouped_matmul_fp8): the forward kernel's pipeline and tiles over bytes: a stage is 128
// rows x 128 bytes of each operand either way (64 bf16 or 128 fp8 values of k), and the same
// ldmatrix addresses give m16n8k32 fp8 fragments (PTX ISA, "mma.m16n8k32" fragment layouts: a
// thread holds 4 consecutive k bytes of a row, exactly what ldmatrix hands out for an 8 x 16-byte
// matrix). FP8 mma exists only K-major ("row.col"), so the weight comes as [E, N, K] or [N, E, K]
// (the byte transpose of a whole [E, K, N] cache, no per-expert copy). Floor at the shapes above:
// 103 GFLOP at the 1979 TFLOP/s FP8 dense peak = 52 us; bytes halve (0.30 GB: 90 us at 3.35 TB/s),
// so memory bound at the floor. The epilogue multiplies by x_inv * w_inv[e] (per-expert scales).
// Measured (H200): 0.435 ms, 0.85x the bf16 kernel's 0.370 ms: mma.sync fp8 is no faster on Hopper.
#include "kernels/grouped_matmul.h"

#include <algorithm>

#include "kernels/device_common.cuh"

namespace surogate {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3, kThreads = 256, kPad = 8;
constexpr int kRowTile = kBM * (kBK + kPad);       // [128][72]: a row-major tile (rows x k)
constexpr int kColTile = kBK * (kBM + kPad);       // [64][136]: a k-major tile (k x columns)
constexpr int kChunks = kBM * kBK / 8 / kThreads;  // 16-byte copies per thread per tile
constexpr int kTile = kRowTile > kColTile ? kRowTile : kColTile;
constexpr size_t kSmem = size_t(kStages) * 2 * kTile * sizeof(bf16);
constexpr int kRowBytes =
    (kBK + kPad) * int(sizeof(bf16));  // a row-major tile's smem row: 144 bytes

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
  }
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// m16n8k32 with fp8 operands (A e4m3 or e5m2, B e4m3), fp32 accumulators; SM89+.
template <bool kE5M2>
__device__ __forceinline__ void mma16832_fp8(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kE5M2) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the launcher refuses GPUs below SM89
#endif
}

// 128 rows x 128 bytes of a row-major source (T: bf16 or fp8 bytes; row stride ld elements) into
// smem rows of kRowBytes: rows at or past `nrows` and k at or past `kmax` read as zeros.
template <typename T>
__device__ __forceinline__ void load_rows(T* s, const T* src, int64_t ld, int nrows, int k0,
                                          int kmax) {
  constexpr int kPer16 = 16 / sizeof(T), kPerRow = 128 / 16, kStride = kRowBytes / sizeof(T);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * kThreads, r = c / kPerRow, kc = (c % kPerRow) * kPer16;
    const bool ok = r < nrows && k0 + kc < kmax;
    cp_async16(s + r * kStride + kc, ok ? src + r * ld + k0 + kc : src, ok);
  }
}

// kBK k-rows x 128 columns of a row-major source (row stride ld, its k-th row is src + k * ld) into
// [kBK][128 + kPad]: k at or past `krows` and columns at or past `ncols` read as zeros.
__device__ __forceinline__ void load_cols(bf16* s, const bf16* src, int64_t ld, int krows, int c0,
                                          int ncols) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * kThreads, r = c >> 4, cc = (c & 15) * 8;
    const bool ok = r < krows && c0 + cc < ncols;
    cp_async16(s + r * (kBM + kPad) + cc, ok ? src + r * ld + c0 + cc : src, ok);
  }
}

// One kBK-deep step of the block's 128 x 128 tile: warp (wm, wn) adds its 64 x 32 part.
// kAKMajor: A is staged [k][m] (the weight gradient's x^T) rather than [m][k].
// kBNK: B is staged [n][k] (W^T: the input gradient) rather than [k][n].
template <bool kAKMajor, bool kBNK>
__device__ __forceinline__ void mma_stage(float (&acc)[4][4][4], const bf16* As, const bf16* Bs,
                                          int wm, int wn, int lane) {
  const int j = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < kBK; ks += 16) {
    uint32_t a[4][4], b[2][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int m = wm * 64 + mi * 16;
      if constexpr (kAKMajor) {
        ldmatrix_x4<true>(a[mi], As + (ks + r8 + (j >> 1) * 8) * (kBM + kPad) + m + (j & 1) * 8);
      } else {
        ldmatrix_x4<false>(a[mi], As + (m + (lane & 15)) * (kBK + kPad) + ks + (lane >> 4) * 8);
      }
    }
#pragma unroll
    for (int nj = 0; nj < 2; ++nj) {
      const int n = wn * 32 + nj * 16;
      if constexpr (kBNK) {
        ldmatrix_x4<false>(b[nj], Bs + (n + r8 + (j >> 1) * 8) * (kBK + kPad) + ks + (j & 1) * 8);
      } else {
        ldmatrix_x4<true>(b[nj], Bs + (ks + r8 + (j & 1) * 8) * (kBN + kPad) + n + (j >> 1) * 8);
      }
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        mma16816(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
      }
    }
  }
}

// One 128-byte-deep step of fp8 data (128 values of k) staged as load_rows does, both operands
// K-major: the bf16 kBNK path's ldmatrix addresses in bytes, 32 bytes of k per mma.
template <bool kE5M2>
__device__ __forceinline__ void mma_stage_fp8(float (&acc)[4][4][4], const uint8_t* As,
                                              const uint8_t* Bs, int wm, int wn, int lane) {
  const int j = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < 128; ks += 32) {
    uint32_t a[4][4], b[2][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      ldmatrix_x4<false>(
          a[mi], As + (wm * 64 + mi * 16 + (lane & 15)) * kRowBytes + ks + (lane >> 4) * 16);
    }
#pragma unroll
    for (int nj = 0; nj < 2; ++nj) {
      ldmatrix_x4<false>(
          b[nj], Bs + (wn * 32 + nj * 16 + r8 + (j >> 1) * 8) * kRowBytes + ks + (j & 1) * 16);
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        mma16832_fp8<kE5M2>(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2],
                            b[ni >> 1][(ni & 1) * 2 + 1]);
      }
    }
  }
}

template <bool kAKMajor, bool kBNK>
struct Bf16Stage {
  __device__ __forceinline__ void operator()(float (&acc)[4][4][4], const bf16* As, const bf16* Bs,
                                             int wm, int wn, int lane) const {
    mma_stage<kAKMajor, kBNK>(acc, As, Bs, wm, wn, lane);
  }
};

template <bool kE5M2>
struct Fp8Stage {
  __device__ __forceinline__ void operator()(float (&acc)[4][4][4], const uint8_t* As,
                                             const uint8_t* Bs, int wm, int wn, int lane) const {
    mma_stage_fp8<kE5M2>(acc, As, Bs, wm, wn, lane);
  }
};

// The pipelined k loop: `load(stage, kt)` stages k step kt, then every warp multiplies (`Stage`).
// T: the staged element type (kTile bf16 slots = the same bytes for either type).
template <typename Stage, typename T, typename Load>
__device__ __forceinline__ void main_loop(float (&acc)[4][4][4], T* smem, int ktiles, Load&& load) {
  constexpr int kT = kTile * int(sizeof(bf16) / sizeof(T));  // one operand's stage, in T
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(smem + s * 2 * kT, smem + s * 2 * kT + kT, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int nk = kt + kStages - 1;
    if (nk < ktiles) {
      const int s = nk % kStages;
      load(smem + s * 2 * kT, smem + s * 2 * kT + kT, nk);
    }
    cp_async_commit();
    const int s = kt % kStages;
    Stage{}(acc, smem + s * 2 * kT, smem + s * 2 * kT + kT, wm, wn, lane);
  }
  cp_async_wait<0>();
}

// Writes the block's tile times `mul`: rows [row0, row0 + 128) below `nrows` valid, columns below
// `ncols`.
__device__ __forceinline__ void store_tile(const float (&acc)[4][4][4], bf16* out, int64_t ld,
                                           int nrows, int c0, int ncols, float mul = 1.f) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 64 + mi * 16 + (lane >> 2) + h * 8;
      if (r >= nrows) continue;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int c = c0 + wn * 32 + ni * 8 + (lane & 3) * 2;
        if (c >= ncols) continue;
        *reinterpret_cast<__nv_bfloat162*>(out + r * ld + c) =
            __floats2bfloat162_rn(acc[mi][ni][2 * h] * mul, acc[mi][ni][2 * h + 1] * mul);
      }
    }
  }
}

// Finds block `t`'s row tile: its expert (-1: the rows past offsets[E]) and first row. Each thread
// counts the row tiles of a contiguous run of experts; a warp-shuffle scan gives every run its
// first tile index (no serial loop: at 128 experts one was 4.5 us a block).
__device__ void find_tile(const int32_t* offsets, int E, int t, int* expert, int* row0) {
  __shared__ int warp_total[kThreads / 32];
  __shared__ int found[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = (E + kThreads - 1) / kThreads, lo = threadIdx.x * per, hi = min(E, lo + per);
  int mine = 0;
  for (int e = lo; e < hi; ++e) mine += (offsets[e + 1] - offsets[e] + kBM - 1) / kBM;
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  if (threadIdx.x == 0) found[0] = -1;
  __syncthreads();
  int before = incl - mine, total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += warp_total[w];
    total += warp_total[w];
  }
  for (int e = lo; e < hi; ++e) {
    const int c = (offsets[e + 1] - offsets[e] + kBM - 1) / kBM;
    if (t >= before && t < before + c) {
      found[0] = e;
      found[1] = offsets[e] + (t - before) * kBM;
    }
    before += c;
  }
  __syncthreads();
  if (found[0] < 0) {  // past every expert's tiles: the rows after offsets[E]
    *expert = -1;
    *row0 = offsets[E] + (t - total) * kBM;
  } else {
    *expert = found[0];
    *row0 = found[1];
  }
}

template <bool kWNK>
__global__ void __launch_bounds__(kThreads)
    grouped_matmul_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w,
                          const int32_t* __restrict__ offsets, bf16* __restrict__ y, int rows,
                          int K, int N, int E) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  int e = 0, row0 = 0;
  find_tile(offsets, E, blockIdx.y, &e, &row0);
  if (row0 >= rows) return;
  const int end = e < 0 ? rows : offsets[e + 1];
  const int nrows = min(kBM, end - row0), n0 = blockIdx.x * kBN;
  float acc[4][4][4] = {};  // stays zero for the rows past offsets[E]
  if (e >= 0) {
    const bf16* xr = x + int64_t(row0) * K;
    const bf16* we = w + int64_t(e) * K * N;
    main_loop<Bf16Stage<false, kWNK>>(
        acc, smem, (K + kBK - 1) / kBK, [&](bf16* As, bf16* Bs, int kt) {
          load_rows(As, xr, K, nrows, kt * kBK, K);
          if constexpr (kWNK) {
            load_rows(Bs, we + int64_t(n0) * K, K, N - n0, kt * kBK, K);
          } else {
            load_cols(Bs, we + int64_t(kt) * kBK * N, N, K - kt * kBK, n0, N);
          }
        });
  }
  store_tile(acc, y + int64_t(row0) * N, N, nrows, n0, N);
}

__global__ void __launch_bounds__(kThreads)
    grouped_matmul_dw_kernel(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                             const int32_t* __restrict__ offsets, bf16* __restrict__ dw, int M,
                             int N) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  const int e = blockIdx.z, n0 = blockIdx.x * kBN, m0 = blockIdx.y * kBM;
  const int start = offsets[e], count = offsets[e + 1] - start;
  float acc[4][4][4];
  const bf16* xe = x + int64_t(start) * M;
  const bf16* de = dy + int64_t(start) * N;
  main_loop<Bf16Stage<true, false>>(acc, smem, (count + kBK - 1) / kBK,
                                    [&](bf16* As, bf16* Bs, int kt) {
                                      const int k0 = kt * kBK;
                                      load_cols(As, xe + int64_t(k0) * M, M, count - k0, m0, M);
                                      load_cols(Bs, de + int64_t(k0) * N, N, count - k0, n0, N);
                                    });
  store_tile(acc, dw + int64_t(e) * M * N + int64_t(m0) * N, N, M - m0, n0, N);
}

// y[r] = (xq[r] . wq[e][n, :]) * x_inv * w_inv[e]: the forward kernel over fp8 bytes. Expert e's
// row n of w starts at w + e * w_e + n * w_n (w_e, w_n: strides in bytes).
template <bool kE5M2>
__global__ void __launch_bounds__(kThreads)
    grouped_matmul_fp8_kernel(const uint8_t* __restrict__ x, const uint8_t* __restrict__ w,
                              const int32_t* __restrict__ offsets, const float* __restrict__ x_inv,
                              const float* __restrict__ w_inv, bf16* __restrict__ y, int rows,
                              int K, int N, int E, int64_t w_e, int64_t w_n) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int e = 0, row0 = 0;
  find_tile(offsets, E, blockIdx.y, &e, &row0);
  if (row0 >= rows) return;
  const int end = e < 0 ? rows : offsets[e + 1];
  const int nrows = min(kBM, end - row0), n0 = blockIdx.x * kBN;
  float acc[4][4][4] = {};
  float mul = 0.f;
  if (e >= 0) {
    const uint8_t* xr = x + int64_t(row0) * K;
    const uint8_t* we = w + int64_t(e) * w_e + int64_t(n0) * w_n;
    main_loop<Fp8Stage<kE5M2>>(acc, smem_raw, (K + 127) / 128,
                               [&](uint8_t* As, uint8_t* Bs, int kt) {
                                 load_rows(As, xr, K, nrows, kt * 128, K);
                                 load_rows(Bs, we, w_n, N - n0, kt * 128, K);
                               });
    mul = *x_inv * w_inv[e];
  }
  store_tile(acc, y + int64_t(row0) * N, N, nrows, n0, N, mul);
}

// Every launch: the attribute belongs to the current device's context, so a process driving two
// GPUs must set it on each (once per process left the second GPU's launch invalid). A function
// attribute, not a stream operation, so it is allowed while a graph is captured.
template <auto kKernel>
cudaError_t allow_smem() {
  return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(kSmem));
}

}  // namespace

cudaError_t grouped_matmul_fp8(const uint8_t* x, bool x_e5m2, const uint8_t* w, bool w_nek,
                               const int32_t* offsets, const float* x_inv, const float* w_inv,
                               bf16* y, int64_t rows, int64_t K, int64_t N, int64_t E,
                               cudaStream_t stream) {
  if (rows == 0 || N == 0) return cudaSuccess;
  if (K % 16 || N % 8 || E < 1) return cudaErrorInvalidValue;
  int device = 0, major = 0, minor = 0;
  SUROGATE_TRY(cudaGetDevice(&device));
  SUROGATE_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  SUROGATE_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major * 10 + minor < 89) return cudaErrorNotSupported;  // no fp8 mma below SM89
  const int64_t w_e = w_nek ? K : N * K, w_n = w_nek ? E * K : K;
  const dim3 grid((N + kBN - 1) / kBN, (rows + kBM - 1) / kBM + E + 1);
  if (x_e5m2) {
    SUROGATE_TRY(allow_smem<grouped_matmul_fp8_kernel<true>>());
    grouped_matmul_fp8_kernel<true><<<grid, kThreads, kSmem, stream>>>(x, w, offsets, x_inv, w_inv,
                                                                       y, rows, K, N, E, w_e, w_n);
  } else {
    SUROGATE_TRY(allow_smem<grouped_matmul_fp8_kernel<false>>());
    grouped_matmul_fp8_kernel<false><<<grid, kThreads, kSmem, stream>>>(x, w, offsets, x_inv, w_inv,
                                                                        y, rows, K, N, E, w_e, w_n);
  }
  return cudaGetLastError();
}

cudaError_t grouped_matmul(const bf16* x, const bf16* w, const int32_t* offsets, bf16* y,
                           int64_t rows, int64_t K, int64_t N, int64_t E, bool w_nk,
                           cudaStream_t stream) {
  if (rows == 0 || N == 0) return cudaSuccess;
  if (K % 8 || N % 8 || E < 1) return cudaErrorInvalidValue;
  // row tiles: at most one partial tile per expert beyond the full ones, plus the rows past
  // offsets[E]
  const dim3 grid((N + kBN - 1) / kBN, (rows + kBM - 1) / kBM + E + 1);
  if (w_nk) {
    SUROGATE_TRY(allow_smem<grouped_matmul_kernel<true>>());
    grouped_matmul_kernel<true><<<grid, kThreads, kSmem, stream>>>(x, w, offsets, y, rows, K, N, E);
  } else {
    SUROGATE_TRY(allow_smem<grouped_matmul_kernel<false>>());
    grouped_matmul_kernel<false>
        <<<grid, kThreads, kSmem, stream>>>(x, w, offsets, y, rows, K, N, E);
  }
  return cudaGetLastError();
}

cudaError_t grouped_matmul_dw(const bf16* x, const bf16* dy, const int32_t* offsets, bf16* dw,
                              int64_t M, int64_t N, int64_t E, cudaStream_t stream) {
  if (M == 0 || N == 0 || E == 0) return cudaSuccess;
  if (M % 8 || N % 8) return cudaErrorInvalidValue;
  SUROGATE_TRY(allow_smem<grouped_matmul_dw_kernel>());
  const dim3 grid((N + kBN - 1) / kBN, (M + kBM - 1) / kBM, E);
  grouped_matmul_dw_kernel<<<grid, kThreads, kSmem, stream>>>(x, dy, offsets, dw, M, N);
  return cudaGetLastError();
}

}  // namespace surogate
