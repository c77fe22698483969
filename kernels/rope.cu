// RoPE forward / backward, optionally fused with the per-head RMSNorm in front of it (Qwen3's
// q_norm / k_norm). Math and launcher contract: rope.h.
//
// Floor: memory bound. Bytes that must move per call = rows * K * sizeof(T) * (2 forward: read
// x, write y; 2 for the rotation-only backward: read dy, write dx; 3 for the norm backward: read
// dy and x, write dx) + the angle source: 4 bytes per token (positions mode) or 2 * 4 * F per
// token (table mode; typically L2 hits when q and k share it). FLOPs are ~10 per element plus
// one sincosf per (token, pair, row group) in positions mode, far below the bandwidth cost.
// At the H100's ~3.0 TB/s measured copy bandwidth, e.g. Qwen3-0.6B q [4, 2048, 16, 128] bf16:
// 2 * 33.5 MB -> ~22 us forward, ~34 us norm backward; Qwen3-8B q [2, 2048, 32, 128]: same sizes.
// Target: >= 75% of that, never slower than XLA's fusion of the reference (ops/rope.py).
//
// Design (why):
//  * A row (one head of one token, K = 64..256 typically) is owned by a group of `width` lanes
//    (power of two <= 32); a lane owns the same columns (a 16-byte vector in each half, j and
//    j + F, so the rotation pairs meet in one thread) for every row it touches. Groups of a warp
//    share a token and walk its heads, so a lane computes cos/sin (sincosf or a table read) once
//    per token and reuses it for all heads it handles; the norm's sum of squares is a shuffle
//    reduction inside the group (no barriers, no shared memory).
//  * The whole row stays in registers between the reduction and the write (one DRAM read).
//  * 16-byte vector loads/stores when F is a multiple of 16 / sizeof(T) and the pointers are
//    16-byte aligned; a scalar path otherwise (any even K up to rope_max_head_dim()).
//  * Persistent grid (<= SMs x resident blocks) striding over tokens.
//  * Norm backward: rstd is recomputed from x (x is read anyway), so the forward saves nothing.
//    dw: every lane accumulates fp32 partials of its own columns in registers over all its rows,
//    the block combines them (shuffles across groups, shared memory across warps) into one
//    workspace row, and a second small kernel sums the rows over blocks. No atomics, so results
//    are deterministic.
//
// Forward variants (fwd_algo, issue 4: variant 0's forward measured 0.82-0.91x of XLA's fusion on
// the H100 for 0.6B q and 8B k with tables). Why 0 loses: (a) its persistent grid gives every
// warp whole tokens, and at ~100-120 registers only 4-5 128-thread blocks fit per SM, so 4096-
// 8192 tokens take 1.55-3.1 rounds -> 2 or 4 with the last partly idle (up to ~30% lost);
// (b) rows are unpacked to fp32 on load (twice the registers of packed 16-bit pairs), which is
// what caps occupancy; (c) each launch queried the device (cudaGetDevice, attribute, occupancy:
// microseconds of host time) -- now memoized for every variant -- which matters when the kernel
// itself is ~5 us (8B k: 8.4 MB + 2 MB of table). Variants 1-3 (rope_fwd_flat_kernel): one-shot
// grid, a lane group per U = 1 / 2 / 4 heads of one token, rows held packed, w re-read from L1,
// register caps 64 / 80 / 128 -> 1024 / 768 / 512 threads per SM; U trades the per-unit angle
// read (L1 broadcast to the token's groups) and loads in flight per thread against occupancy.
// Same math as 0 (identical per-row sums for the same lane width), so results match bitwise
// except for possible FMA contraction differences.
#include "kernels/rope.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <initializer_list>

#include "kernels/dw_col_sum.cuh"
#include "kernels/device_common.cuh"

namespace surogate {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 128;  // small blocks: finer occupancy steps at ~100 registers
constexpr int kWarpsPerBlock = kThreads / kWarp;

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

// How lanes map onto rows: a warp holds 32 / width groups; `tpw` tokens per warp iteration,
// `hslots` groups per token (tpw * hslots <= groups; the rest idle). Group g handles token
// offset g / hslots and heads g % hslots, + hslots, ...
struct Layout {
  int half;     // F = K / 2
  int nchunks;  // F / V: vectors per half row
  int width;    // lanes per group
  int tpw;
  int hslots;
  bool table_vec4;  // table rows can be read as float4 (16-byte aligned, stride % 4 == 0)
};

struct Lane {
  int lane;       // index inside the group
  unsigned mask;  // the group's lanes (for shuffles)
  int tok_off;    // >= tpw: this group idles
  int h0;         // first head
};

__device__ __forceinline__ Lane lane_of(const Layout& L) {
  const int lw = static_cast<int>(threadIdx.x) % kWarp;
  const int group = lw / L.width;
  Lane r;
  r.lane = lw % L.width;
  r.mask = L.width == kWarp ? 0xffffffffu : ((1u << L.width) - 1u) << (group * L.width);
  r.tok_off = group / L.hslots;
  r.h0 = group % L.hslots;
  return r;
}

// Chunk (vector index within a half row) i of this lane.
__device__ __forceinline__ int lane_chunk(int lane, int i, const Layout& L) {
  return lane + i * L.width;
}

__device__ __forceinline__ float group_sum(float v, unsigned mask, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);  // stays in group
  return v;
}

// cos and sgn * sin of this lane's pairs for token `tok`.
template <int V, int PER>
__device__ __forceinline__ void token_angles(const RopeAngles& a, int64_t tok, int lane,
                                             const Layout& L, float sgn, float (&c)[PER][V],
                                             float (&s)[PER][V]) {
  if (a.positions != nullptr) {
    const float p = static_cast<float>(a.positions[tok]);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int ch = lane_chunk(lane, i, L);
      if (ch < L.nchunks) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          float sv, cv;
          sincosf(p * a.inv_freq[ch * V + k], &sv, &cv);
          c[i][k] = cv;
          s[i][k] = sgn * sv;
        }
      }
    }
  } else {
    const float* cp = a.cos + tok * a.stride;
    const float* sp = a.sin + tok * a.stride;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int ch = lane_chunk(lane, i, L);
      if (ch < L.nchunks) {
        if constexpr (V % 4 == 0) {
          if (L.table_vec4) {
#pragma unroll
            for (int k = 0; k < V; k += 4) {
              const float4 cv = *reinterpret_cast<const float4*>(cp + ch * V + k);
              const float4 sv = *reinterpret_cast<const float4*>(sp + ch * V + k);
              c[i][k] = cv.x, c[i][k + 1] = cv.y, c[i][k + 2] = cv.z, c[i][k + 3] = cv.w;
              s[i][k] = sgn * sv.x, s[i][k + 1] = sgn * sv.y, s[i][k + 2] = sgn * sv.z,
              s[i][k + 3] = sgn * sv.w;
            }
            continue;
          }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          c[i][k] = cp[ch * V + k];
          s[i][k] = sgn * sp[ch * V + k];
        }
      }
    }
  }
}

template <typename T, int V, int PER>
__device__ __forceinline__ void load_weights(const T* w, const Layout& L, int lane,
                                             float (&w1)[PER][V], float (&w2)[PER][V]) {
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int ch = lane_chunk(lane, i, L);
#pragma unroll
    for (int k = 0; k < V; ++k) w1[i][k] = w2[i][k] = 0.f;
    if (ch < L.nchunks) {
      load<T, V>(w + ch * V, w1[i]);
      load<T, V>(w + L.half + ch * V, w2[i]);
    }
  }
}

// U rows (heads h, h + hslots, ...) per group and iteration: their loads are all issued before
// any math, so a warp keeps U times more bytes in flight.
template <typename T, int V, int PER, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    rope_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, RopeAngles ang,
                    const T* __restrict__ w, int64_t tokens, int heads, Layout L, float eps,
                    float sgn) {
  constexpr int U = PER == 1 ? 2 : 1;
  const Lane me = lane_of(L);
  if (me.tok_off >= L.tpw) return;  // no block-level synchronization below
  const int K = 2 * L.half;
  float w1[PER][V], w2[PER][V];
  if constexpr (kNorm) load_weights<T, V, PER>(w, L, me.lane, w1, w2);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock * L.tpw;
  for (int64_t tok = warp * L.tpw + me.tok_off; tok < tokens; tok += step) {
    float c[PER][V], s[PER][V];
    token_angles<V, PER>(ang, tok, me.lane, L, sgn, c, s);
    for (int h = me.h0; h < heads; h += U * L.hslots) {
      float a[U][PER][V], b[U][PER][V];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hu = h + u * L.hslots;
        const int64_t off = (tok * heads + hu) * K;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int ch = lane_chunk(me.lane, i, L);
          if (hu < heads && ch < L.nchunks) {
            load<T, V>(x + off + ch * V, a[u][i]);
            load<T, V>(x + off + L.half + ch * V, b[u][i]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hu = h + u * L.hslots;
        if (hu >= heads) break;  // uniform over the group
        const int64_t off = (tok * heads + hu) * K;
        float r = 1.f;
        if constexpr (kNorm) {
          float ss = 0.f;
#pragma unroll
          for (int i = 0; i < PER; ++i) {
            if (lane_chunk(me.lane, i, L) < L.nchunks) {
#pragma unroll
              for (int k = 0; k < V; ++k) ss += a[u][i][k] * a[u][i][k] + b[u][i][k] * b[u][i][k];
            }
          }
          ss = group_sum(ss, me.mask, L.width);
          r = rsqrtf(ss / static_cast<float>(K) + eps);
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int ch = lane_chunk(me.lane, i, L);
          if (ch < L.nchunks) {
            float o1[V], o2[V];
#pragma unroll
            for (int k = 0; k < V; ++k) {
              float n1 = a[u][i][k], n2 = b[u][i][k];
              if constexpr (kNorm) {
                n1 = n1 * r * w1[i][k];
                n2 = n2 * r * w2[i][k];
              }
              o1[k] = n1 * c[i][k] - n2 * s[i][k];
              o2[k] = n2 * c[i][k] + n1 * s[i][k];
            }
            store<T, V>(y + off + ch * V, o1);
            store<T, V>(y + off + L.half + ch * V, o2);
          }
        }
      }
    }
  }
}

// Forward variants 1-3 ("flat", fwd_algo = 1, 2, 3 -> U = 1, 2, 4): the work unit is U
// consecutive heads of one token for one lane group; unit u = (token u / ceil(H / U), heads
// (u % ceil(H / U)) * U + 0..U-1). Consecutive groups of a warp take consecutive units, so groups
// of one token read the same angle entries (L1 broadcast). One unit per group and a one-shot grid
// (no grid-stride unless the grid would exceed its limit): the block scheduler balances, where
// the persistent grid of variant 0 ran whole tokens per warp in 1.55-3.1 rounds (2 or 4 with
// the last one partly idle) for the table's shapes. Rows are held packed (16-bit pairs share a
// register) and w is re-read from L1, so at ~40-70 registers 2-3x more threads are resident
// than with variant 0's ~100.
constexpr int kFwdAlgos = 4;

// Resident 128-thread blocks per SM asked of ptxas (register caps 64 / 80 / 128 for U = 1 / 2 / 4)
// for the common head dims (one chunk per lane: K <= 512 on the vector path); long rows (PER > 1,
// 130+-dim scalar rows, K = 1024) keep their registers rather than spill.
template <int PER, int U>
constexpr int flat_min_blocks() {
  return PER > 1 ? 1 : U == 1 ? 8 : U == 2 ? 6 : 4;
}

// The flat forward over one tensor, as block `block` of `nblocks` (the kernels below pass
// blockIdx.x / gridDim.x, or a block range of a two-tensor launch).
template <typename T, int V, int PER, bool kNorm, int U>
__device__ __forceinline__ void rope_fwd_flat(const T* __restrict__ x, T* __restrict__ y,
                                              const RopeAngles& ang, const T* __restrict__ w,
                                              int64_t tokens, int heads, const Layout& L, float eps,
                                              float sgn, int64_t block, int64_t nblocks) {
  using R = vec::Raw<T, V>;
  const int K = 2 * L.half;
  const int lw = static_cast<int>(threadIdx.x) % kWarp;
  const int groups = kWarp / L.width;
  const int lane = lw % L.width;
  const int group = lw / L.width;
  const unsigned mask =
      L.width == kWarp ? 0xffffffffu : ((1u << L.width) - 1u) << (group * L.width);
  const int upt = (heads + U - 1) / U;  // units per token
  const int64_t units = tokens * upt;
  const int64_t stride = nblocks * kWarpsPerBlock * groups;
  for (int64_t unit = (block * kWarpsPerBlock + threadIdx.x / kWarp) * groups + group; unit < units;
       unit += stride) {  // uniform over a group: shuffles stay inside it
    const int64_t tok = unit / upt;
    const int h0 = static_cast<int>(unit - tok * upt) * U;
    R a[U][PER], b[U][PER];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t off = (tok * heads + h0 + u) * K;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(lane, i, L);
        if (h0 + u < heads && ch < L.nchunks) {
          a[u][i] = vec::load_raw_stream<T, V>(x + off + ch * V);
          b[u][i] = vec::load_raw_stream<T, V>(x + off + L.half + ch * V);
        }
      }
    }
    float c[PER][V], s[PER][V];
    token_angles<V, PER>(ang, tok, lane, L, sgn, c, s);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (h0 + u >= heads) break;  // uniform over the group
      const int64_t off = (tok * heads + h0 + u) * K;
      float r = 1.f;
      if constexpr (kNorm) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          if (lane_chunk(lane, i, L) < L.nchunks) {
            float p[V], q[V];
            vec::unpack(a[u][i], p);
            vec::unpack(b[u][i], q);
#pragma unroll
            for (int k = 0; k < V; ++k) ss += p[k] * p[k] + q[k] * q[k];
          }
        }
        ss = group_sum(ss, mask, L.width);
        r = rsqrtf(ss / static_cast<float>(K) + eps);
      }
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(lane, i, L);
        if (ch < L.nchunks) {
          float n1[V], n2[V], o1[V], o2[V];
          vec::unpack(a[u][i], n1);
          vec::unpack(b[u][i], n2);
          if constexpr (kNorm) {
            float w1[V], w2[V];
            vec::load<T, V>(w + ch * V, w1);
            vec::load<T, V>(w + L.half + ch * V, w2);
#pragma unroll
            for (int k = 0; k < V; ++k) {
              n1[k] = n1[k] * r * w1[k];
              n2[k] = n2[k] * r * w2[k];
            }
          }
#pragma unroll
          for (int k = 0; k < V; ++k) {
            o1[k] = n1[k] * c[i][k] - n2[k] * s[i][k];
            o2[k] = n2[k] * c[i][k] + n1[k] * s[i][k];
          }
          vec::store<T, V>(y + off + ch * V, o1);
          vec::store<T, V>(y + off + L.half + ch * V, o2);
        }
      }
    }
  }
}

template <typename T, int V, int PER, bool kNorm, int U>
__global__ void __launch_bounds__(kThreads, (flat_min_blocks<PER, U>()))
    rope_fwd_flat_kernel(const T* __restrict__ x, T* __restrict__ y, RopeAngles ang,
                         const T* __restrict__ w, int64_t tokens, int heads, Layout L, float eps,
                         float sgn) {
  rope_fwd_flat<T, V, PER, kNorm, U>(x, y, ang, w, tokens, heads, L, eps, sgn, blockIdx.x,
                                     gridDim.x);
}

// q and k of a layer in one launch (same tokens, angles and head_dim; own heads and weights):
// blocks [0, blocks0) run tensor 0, the rest tensor 1. One launch instead of two saves the
// second launch's ramp, which dominated the small k tensors (8 MB at Qwen3-8B: 66% of 3000 GB/s
// forward alone).
template <typename T>
struct Pair {
  const T* in0;
  const T* in1;
  T* out0;
  T* out1;
  const T* w0;
  const T* w1;
  int heads0, heads1;
  int blocks0;
};

template <typename T, int V, int PER, bool kNorm, int U>
__global__ void __launch_bounds__(kThreads, (flat_min_blocks<PER, U>()))
    rope_fwd_flat_pair_kernel(Pair<T> p, RopeAngles ang, int64_t tokens, Layout L, float eps,
                              float sgn) {
  const int64_t b = blockIdx.x;
  if (b < p.blocks0) {
    rope_fwd_flat<T, V, PER, kNorm, U>(p.in0, p.out0, ang, p.w0, tokens, p.heads0, L, eps, sgn, b,
                                       p.blocks0);
  } else {
    rope_fwd_flat<T, V, PER, kNorm, U>(p.in1, p.out1, ang, p.w1, tokens, p.heads1, L, eps, sgn,
                                       b - p.blocks0, static_cast<int64_t>(gridDim.x) - p.blocks0);
  }
}

// End of the norm backward kernels: a lane's dw partials (d1, d2: its columns of the two halves)
// are added over the groups of its warp (they hold the same columns at the same lane), then over
// the block's warps in shared memory (`red`: kWarpsPerBlock * K floats), in a fixed order, into
// row blockIdx.x of ws. Every thread of the block must call it.
template <int V, int PER>
__device__ __forceinline__ void block_dw_to_ws(float (&d1)[PER][V], float (&d2)[PER][V],
                                               const Layout& L, int lane, float* red,
                                               float* __restrict__ ws) {
  const int K = 2 * L.half;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      for (int o = L.width; o < kWarp; o <<= 1) {
        d1[i][k] += __shfl_xor_sync(0xffffffffu, d1[i][k], o);
        d2[i][k] += __shfl_xor_sync(0xffffffffu, d2[i][k], o);
      }
    }
  }
  const int warp_in_block = static_cast<int>(threadIdx.x) / kWarp;
  if (static_cast<int>(threadIdx.x) % kWarp < L.width) {  // group 0 covers every column once
    float* row = red + warp_in_block * K;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int ch = lane_chunk(lane, i, L);
      if (ch < L.nchunks) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          row[ch * V + k] = d1[i][k];
          row[L.half + ch * V + k] = d2[i][k];
        }
      }
    }
  }
  __syncthreads();
  for (int col = threadIdx.x; col < K; col += blockDim.x) {
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < kWarpsPerBlock; ++q) t += red[q * K + col];
    ws[static_cast<int64_t>(blockIdx.x) * K + col] = t;
  }
}

// ws: [gridDim.x, K] float32; block b writes its dw partial sums to row b.
// Dynamic shared memory: kWarpsPerBlock * K floats.
template <typename T, int V, int PER>
__global__ void __launch_bounds__(kThreads)
    rope_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, RopeAngles ang,
                         const T* __restrict__ w, T* __restrict__ dx, float* __restrict__ ws,
                         int64_t tokens, int heads, Layout L, float eps) {
  extern __shared__ float red[];
  const Lane me = lane_of(L);
  const int K = 2 * L.half;
  float w1[PER][V], w2[PER][V], d1[PER][V], d2[PER][V];
  load_weights<T, V, PER>(w, L, me.lane, w1, w2);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
#pragma unroll
    for (int k = 0; k < V; ++k) d1[i][k] = d2[i][k] = 0.f;
  }
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock * L.tpw;
  const int64_t first = me.tok_off < L.tpw ? warp * L.tpw + me.tok_off : tokens;  // idle: none
  for (int64_t tok = first; tok < tokens; tok += step) {
    float c[PER][V], s[PER][V];
    token_angles<V, PER>(ang, tok, me.lane, L, -1.f, c, s);  // R(-ang): (cos, -sin)
    for (int h = me.h0; h < heads; h += L.hslots) {
      const int64_t off = (tok * heads + h) * K;
      float g1[PER][V], g2[PER][V], p[PER][V], q[PER][V];
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
        if (ch < L.nchunks) {
          float a[V], b[V];
          load<T, V>(dy + off + ch * V, a);
          load<T, V>(dy + off + L.half + ch * V, b);
          load<T, V>(x + off + ch * V, p[i]);
          load<T, V>(x + off + L.half + ch * V, q[i]);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            g1[i][k] = a[k] * c[i][k] - b[k] * s[i][k];
            g2[i][k] = b[k] * c[i][k] + a[k] * s[i][k];
            ss += p[i][k] * p[i][k] + q[i][k] * q[i][k];
            dot += g1[i][k] * w1[i][k] * p[i][k] + g2[i][k] * w2[i][k] * q[i][k];
          }
        }
      }
      ss = group_sum(ss, me.mask, L.width);
      dot = group_sum(dot, me.mask, L.width);
      const float r = rsqrtf(ss / static_cast<float>(K) + eps);
      const float m = r * dot / static_cast<float>(K);  // mean(g * w * xhat)
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
        if (ch < L.nchunks) {
          float o1[V], o2[V];
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float xh1 = p[i][k] * r, xh2 = q[i][k] * r;
            o1[k] = r * (g1[i][k] * w1[i][k] - xh1 * m);
            o2[k] = r * (g2[i][k] * w2[i][k] - xh2 * m);
            d1[i][k] += g1[i][k] * xh1;
            d2[i][k] += g2[i][k] * xh2;
          }
          store<T, V>(dx + off + ch * V, o1);
          store<T, V>(dx + off + L.half + ch * V, o2);
        }
      }
    }
  }

  block_dw_to_ws<V, PER>(d1, d2, L, me.lane, red, ws);
}

// Element k (a compile-time constant once unrolled) of a packed vector, as float.
template <typename T, int N>
__device__ __forceinline__ float elem(const vec::Raw<T, N>& r, int k) {
  if constexpr (N == 1) {
    return to_float(r.v);
  } else {
    constexpr int P = N / 4;  // elements per 32-bit word
    const int j = k / P;
    const uint32_t word = j == 0 ? r.u.x : j == 1 ? r.u.y : j == 2 ? r.u.z : r.u.w;
    float out[P];
    vec::detail::unpack_word(T{}, word, out);
    return out[k % P];
  }
}

// Resident 128-thread blocks per SM asked of ptxas: 5 / 4 / 3 for U = 1 / 2 / 4 (register caps
// 96 / 128 / 168: the largest block counts at which the bf16 vector kernels spill nothing, nvcc 13,
// sm_90a; one more block each spilled 24-164 bytes). Variant 0 runs at 128 registers, 4 blocks.
template <int PER, int U>
constexpr int bwd_flat_min_blocks() {
  return PER > 1 ? 1 : U == 1 ? 5 : U == 2 ? 4 : 3;
}

// Norm backward variants 1-3 ("flat", bwd_algo = 1, 2, 3 -> U = 1, 2, 4 heads per unit), written
// after the forward's variants 1-3 made the forward 1.4x faster. On the H100 U = 2
// was the fastest at 7 of 8 benchmarked shapes (55-69% of 3000 GB/s vs variant 0's 43-63%), so it
// is the op's default (ops/rope.py BWD_ALGO). Why variant 0 is slow:
// like the forward's variant 0 it strides over whole tokens per warp (1.55-3.1 uneven rounds for
// the benchmarked shapes) and loads one head's dy and x at a time, unpacked to fp32, at 128
// registers (4 blocks per SM). Here a lane group takes units of U heads of one token, strides over
// units with a grid sized so every group gets the same number of units, issues all U heads' loads
// (held packed) before any math, and re-reads w from L1; dy and x are unpacked twice (for the two
// reductions and for the output) instead of holding fp32 copies. Same per-row math and reduction
// order as variant 0, so dx matches it bitwise (up to FMA contraction); dw sums the same terms in
// another order. The flat norm backward over one tensor as block `block` of `nblocks` (see
// rope_fwd_flat); its dw partials go to row blockIdx.x of ws. `red`: the block's shared memory
// (block_dw_to_ws).
template <typename T, int V, int PER, int U, bool kStream>
__device__ __forceinline__ void rope_norm_bwd_flat(const T* __restrict__ dy,
                                                   const T* __restrict__ x, const RopeAngles& ang,
                                                   const T* __restrict__ w, T* __restrict__ dx,
                                                   float* __restrict__ ws, int64_t tokens,
                                                   int heads, const Layout& L, float eps,
                                                   int64_t block, int64_t nblocks, float* red) {
  using R = vec::Raw<T, V>;
  const int K = 2 * L.half;
  const int lw = static_cast<int>(threadIdx.x) % kWarp;
  const int groups = kWarp / L.width;
  const int lane = lw % L.width;
  const int group = lw / L.width;
  const unsigned mask =
      L.width == kWarp ? 0xffffffffu : ((1u << L.width) - 1u) << (group * L.width);
  float d1[PER][V], d2[PER][V];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
#pragma unroll
    for (int k = 0; k < V; ++k) d1[i][k] = d2[i][k] = 0.f;
  }
  const int upt = (heads + U - 1) / U;  // units per token
  const int64_t units = tokens * upt;
  const int64_t stride = nblocks * kWarpsPerBlock * groups;
  for (int64_t unit = (block * kWarpsPerBlock + threadIdx.x / kWarp) * groups + group; unit < units;
       unit += stride) {  // uniform over a group: its shuffles stay inside it
    const int64_t tok = unit / upt;
    const int h0 = static_cast<int>(unit - tok * upt) * U;
    R ga[U][PER], gb[U][PER], xa[U][PER], xb[U][PER];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t off = (tok * heads + h0 + u) * K;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(lane, i, L);
        if (h0 + u < heads && ch < L.nchunks) {
          ga[u][i] = vec::load_raw_hint<T, V, kStream>(dy + off + ch * V);
          gb[u][i] = vec::load_raw_hint<T, V, kStream>(dy + off + L.half + ch * V);
          xa[u][i] = vec::load_raw_hint<T, V, kStream>(x + off + ch * V);
          xb[u][i] = vec::load_raw_hint<T, V, kStream>(x + off + L.half + ch * V);
        }
      }
    }
    float c[PER][V], s[PER][V];
    token_angles<V, PER>(ang, tok, lane, L, -1.f, c, s);  // R(-ang): (cos, -sin)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (h0 + u >= heads) break;  // uniform over the group
      const int64_t off = (tok * heads + h0 + u) * K;
      // Element by element from the packed vectors (elem), so only a few fp32 values are live at
      // a time: unpacking whole rows of dy, x, w and the outputs spilled at the register caps.
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(lane, i, L);
        if (ch < L.nchunks) {
          const R w1 = vec::load_raw<T, V>(w + ch * V),
                  w2 = vec::load_raw<T, V>(w + L.half + ch * V);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float a = elem(ga[u][i], k), b = elem(gb[u][i], k);
            const float p = elem(xa[u][i], k), q = elem(xb[u][i], k);
            const float g1 = a * c[i][k] - b * s[i][k];
            const float g2 = b * c[i][k] + a * s[i][k];
            ss += p * p + q * q;
            dot += g1 * elem(w1, k) * p + g2 * elem(w2, k) * q;
          }
        }
      }
      ss = group_sum(ss, mask, L.width);
      dot = group_sum(dot, mask, L.width);
      const float r = rsqrtf(ss / static_cast<float>(K) + eps);
      const float m = r * dot / static_cast<float>(K);  // mean(g * w * xhat)
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(lane, i, L);
        if (ch < L.nchunks) {
          const R w1 = vec::load_raw<T, V>(w + ch * V),
                  w2 = vec::load_raw<T, V>(w + L.half + ch * V);
          float o1[V], o2[V];
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float a = elem(ga[u][i], k), b = elem(gb[u][i], k);
            const float g1 = a * c[i][k] - b * s[i][k];
            const float g2 = b * c[i][k] + a * s[i][k];
            const float xh1 = elem(xa[u][i], k) * r, xh2 = elem(xb[u][i], k) * r;
            o1[k] = r * (g1 * elem(w1, k) - xh1 * m);
            o2[k] = r * (g2 * elem(w2, k) - xh2 * m);
            d1[i][k] += g1 * xh1;
            d2[i][k] += g2 * xh2;
          }
          vec::store<T, V>(dx + off + ch * V, o1);
          vec::store<T, V>(dx + off + L.half + ch * V, o2);
        }
      }
    }
  }
  block_dw_to_ws<V, PER>(d1, d2, L, lane, red, ws);
}

template <typename T, int V, int PER, int U, bool kStream>
__global__ void __launch_bounds__(kThreads, (bwd_flat_min_blocks<PER, U>()))
    rope_norm_bwd_flat_kernel(const T* __restrict__ dy, const T* __restrict__ x, RopeAngles ang,
                              const T* __restrict__ w, T* __restrict__ dx, float* __restrict__ ws,
                              int64_t tokens, int heads, Layout L, float eps) {
  extern __shared__ float red[];
  rope_norm_bwd_flat<T, V, PER, U, kStream>(dy, x, ang, w, dx, ws, tokens, heads, L, eps,
                                            blockIdx.x, gridDim.x, red);
}

// q and k in one launch (rope_fwd_flat_pair_kernel): blocks [0, blocks0) tensor 0, the rest tensor
// 1; ws rows follow the blocks, so rows [0, blocks0) hold tensor 0's dw partials.
template <typename T>
struct GradPair {
  const T* dy0;
  const T* dy1;
  const T* x0;
  const T* x1;
  const T* w0;
  const T* w1;
  T* dx0;
  T* dx1;
  int heads0, heads1;
  int blocks0;
};

template <typename T, int V, int PER, int U, bool kStream>
__global__ void __launch_bounds__(kThreads, (bwd_flat_min_blocks<PER, U>()))
    rope_norm_bwd_flat_pair_kernel(GradPair<T> p, RopeAngles ang, float* __restrict__ ws,
                                   int64_t tokens, Layout L, float eps) {
  extern __shared__ float red[];
  const int64_t b = blockIdx.x;
  if (b < p.blocks0) {
    rope_norm_bwd_flat<T, V, PER, U, kStream>(p.dy0, p.x0, ang, p.w0, p.dx0, ws, tokens, p.heads0,
                                              L, eps, b, p.blocks0, red);
  } else {
    rope_norm_bwd_flat<T, V, PER, U, kStream>(p.dy1, p.x1, ang, p.w1, p.dx1, ws, tokens, p.heads1,
                                              L, eps, b - p.blocks0,
                                              static_cast<int64_t>(gridDim.x) - p.blocks0, red);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: launch plans.

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

constexpr int kMaxPerScalar = 16;  // chunks per lane: scalar path instantiates 1, 4, 16
constexpr int kMaxPerVector = 4;   // vector path: 1, 4

struct Plan {
  int vec = 1;
  int per = 1;  // chunks per lane the kernel is instantiated for
  Layout L{};
  int blocks = 0;
  size_t smem = 0;
};

template <typename T>
int pick_vec(int64_t half, std::initializer_list<const void*> ptrs) {
  if (half % kVec<T> != 0) return 1;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVec<T>;
}

// false when head_dim is too large for the register-resident rows.
bool make_plan(int64_t heads, int64_t half, int vec, Plan* out) {
  Plan p;
  p.vec = vec;
  const int nchunks = static_cast<int>(half / vec);
  int width = 1;
  while (width < nchunks && width < kWarp) width *= 2;
  const int need = (nchunks + width - 1) / width;
  if (vec == 1) {
    p.per = need <= 1 ? 1 : need <= 4 ? 4 : kMaxPerScalar;
  } else {
    p.per = need <= 1 ? 1 : kMaxPerVector;
  }
  if (need > p.per) return false;
  const int groups = kWarp / width;
  p.L.half = static_cast<int>(half);
  p.L.nchunks = nchunks;
  p.L.width = width;
  p.L.table_vec4 = false;
  if (heads >= groups) {
    p.L.tpw = 1;
    p.L.hslots = groups;
  } else {
    p.L.tpw = groups / static_cast<int>(heads);
    p.L.hslots = groups / p.L.tpw;
  }
  *out = p;
  return true;
}

// Resident blocks per SM of `kernel` (kThreads threads, `smem` bytes) and the SM count, memoized
// per host thread: the queries cost microseconds of host time per launch, which a ~5 us kernel
// (rope of k at 8B shapes) cannot afford when XLA enqueues it.
template <typename Kernel>
cudaError_t occupancy(Kernel kernel, size_t smem, int* per_sm, int* sms) {
  struct Entry {
    const void* kernel;
    int dev, per_sm, sms;
    size_t smem;
  };
  constexpr int kEntries = 32;
  thread_local Entry cache[kEntries] = {};
  thread_local int next = 0;
  int dev = 0;
  SUROGATE_TRY(cudaGetDevice(&dev));
  const void* key = reinterpret_cast<const void*>(kernel);
  for (const Entry& e : cache) {
    if (e.kernel == key && e.smem == smem && e.dev == dev) {
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
  SUROGATE_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, kThreads, smem));
  cache[next] = {key, dev, *per_sm, *sms, smem};
  next = (next + 1) % kEntries;
  return cudaSuccess;
}

// Persistent grid: as many blocks as fit on the device at once, but no more than there is work.
template <typename Kernel>
cudaError_t size_grid(Kernel kernel, int64_t tokens, Plan& p) {
  int sms = 0, per_sm = 0;
  SUROGATE_TRY(occupancy(kernel, p.smem, &per_sm, &sms));
  const int64_t per_block = static_cast<int64_t>(kWarpsPerBlock) * p.L.tpw;
  const int64_t need = (tokens + per_block - 1) / per_block;
  const int64_t fit = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  p.blocks = static_cast<int>(std::max<int64_t>(1, std::min(need, fit)));
  return cudaSuccess;
}

template <typename T>
using FwdKernel = void (*)(const T*, T*, RopeAngles, const T*, int64_t, int, Layout, float, float);
template <typename T>
using BwdKernel = void (*)(const T*, const T*, RopeAngles, const T*, T*, float*, int64_t, int,
                           Layout, float);

template <typename T, bool kNorm>
FwdKernel<T> fwd_kernel(const Plan& p) {
  if (p.vec == 1) {
    switch (p.per) {
      case 1:
        return rope_fwd_kernel<T, 1, 1, kNorm>;
      case 4:
        return rope_fwd_kernel<T, 1, 4, kNorm>;
      default:
        return rope_fwd_kernel<T, 1, kMaxPerScalar, kNorm>;
    }
  }
  if (p.per == 1) return rope_fwd_kernel<T, kVec<T>, 1, kNorm>;
  return rope_fwd_kernel<T, kVec<T>, kMaxPerVector, kNorm>;
}

template <typename T, bool kNorm, int U>
FwdKernel<T> flat_kernel_u(const Plan& p) {
  if (p.vec == 1) {
    switch (p.per) {
      case 1:
        return rope_fwd_flat_kernel<T, 1, 1, kNorm, U>;
      case 4:
        return rope_fwd_flat_kernel<T, 1, 4, kNorm, U>;
      default:
        return rope_fwd_flat_kernel<T, 1, kMaxPerScalar, kNorm, U>;
    }
  }
  if (p.per == 1) return rope_fwd_flat_kernel<T, kVec<T>, 1, kNorm, U>;
  return rope_fwd_flat_kernel<T, kVec<T>, kMaxPerVector, kNorm, U>;
}

// Heads per lane group and unit of flat variant `algo` (1, 2, 3 -> 1, 2, 4).
constexpr int flat_heads(int algo) { return algo == 1 ? 1 : algo == 2 ? 2 : 4; }

template <typename T, bool kNorm>
FwdKernel<T> flat_kernel(const Plan& p, int algo) {
  switch (flat_heads(algo)) {
    case 1:
      return flat_kernel_u<T, kNorm, 1>(p);
    case 2:
      return flat_kernel_u<T, kNorm, 2>(p);
    default:
      return flat_kernel_u<T, kNorm, 4>(p);
  }
}

template <typename T>
BwdKernel<T> bwd_kernel(const Plan& p) {
  if (p.vec == 1) {
    switch (p.per) {
      case 1:
        return rope_norm_bwd_kernel<T, 1, 1>;
      case 4:
        return rope_norm_bwd_kernel<T, 1, 4>;
      default:
        return rope_norm_bwd_kernel<T, 1, kMaxPerScalar>;
    }
  }
  if (p.per == 1) return rope_norm_bwd_kernel<T, kVec<T>, 1>;
  return rope_norm_bwd_kernel<T, kVec<T>, kMaxPerVector>;
}

template <typename T, int U, bool kStream>
BwdKernel<T> bwd_flat_kernel_u(const Plan& p) {
  if (p.vec == 1) {
    switch (p.per) {
      case 1:
        return rope_norm_bwd_flat_kernel<T, 1, 1, U, kStream>;
      case 4:
        return rope_norm_bwd_flat_kernel<T, 1, 4, U, kStream>;
      default:
        return rope_norm_bwd_flat_kernel<T, 1, kMaxPerScalar, U, kStream>;
    }
  }
  if (p.per == 1) return rope_norm_bwd_flat_kernel<T, kVec<T>, 1, U, kStream>;
  return rope_norm_bwd_flat_kernel<T, kVec<T>, kMaxPerVector, U, kStream>;
}

constexpr int kBwdAlgos = 5;

// Heads per unit of flat norm backward variant `algo` (1-4).
constexpr int bwd_flat_heads(int algo) { return algo == 1 ? 1 : algo == 3 ? 4 : 2; }

// Norm backward variant `algo`: 0 per-token persistent; flat with U heads per unit and streaming
// loads: 1, 2, 3 -> U = 1, 2, 4; 4: U = 2 with plain loads (fastest on the smallest, 8 MB, tensors;
// 5-7% slower elsewhere). Variants that also issued the next unit's
// loads before this unit's math (U = 1, 2; c0c0828) were 0.79-1.0x of variant 2 at every
// benchmarked shape, so they were removed: the backward is not waiting on its loads' latency.
template <typename T>
BwdKernel<T> bwd_kernel(const Plan& p, int algo) {
  switch (algo) {
    case 0:
      return bwd_kernel<T>(p);
    case 1:
      return bwd_flat_kernel_u<T, 1, true>(p);
    case 2:
      return bwd_flat_kernel_u<T, 2, true>(p);
    case 3:
      return bwd_flat_kernel_u<T, 4, true>(p);
    default:
      return bwd_flat_kernel_u<T, 2, false>(p);
  }
}

cudaError_t check_args(const RopeAngles& ang, int64_t tokens, int64_t heads, int64_t head_dim) {
  if (tokens < 0 || heads <= 0 || heads > INT_MAX || head_dim <= 0 || head_dim % 2 != 0 ||
      head_dim > rope_max_head_dim()) {
    return cudaErrorInvalidValue;
  }
  const bool by_pos = ang.positions != nullptr && ang.inv_freq != nullptr;
  const bool by_table = ang.cos != nullptr && ang.sin != nullptr && ang.stride >= head_dim / 2;
  if (by_pos == by_table && tokens > 0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

bool table_vec4(const RopeAngles& a) {
  return a.cos != nullptr && a.stride % 4 == 0 && reinterpret_cast<uintptr_t>(a.cos) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.sin) % 16 == 0;
}

}  // namespace

int64_t rope_max_head_dim() { return 1024; }
static_assert(kRopeFwdAlgos == kFwdAlgos && kRopeBwdAlgos == kBwdAlgos,
              "rope.h and the kernels disagree");

template <typename T>
cudaError_t rope_fwd(const T* x, T* y, const RopeAngles& ang, const T* w, int64_t tokens,
                     int64_t heads, int64_t head_dim, float eps, bool inverse, cudaStream_t stream,
                     int algo) {
  SUROGATE_TRY(check_args(ang, tokens, heads, head_dim));
  if (algo < 0 || algo >= kFwdAlgos) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  const int64_t half = head_dim / 2;
  Plan p;
  if (!make_plan(heads, half, pick_vec<T>(half, {x, y, w}), &p)) return cudaErrorInvalidValue;
  FwdKernel<T> kernel;
  if (algo == 0) {
    kernel = w != nullptr ? fwd_kernel<T, true>(p) : fwd_kernel<T, false>(p);
    SUROGATE_TRY(size_grid(kernel, tokens, p));
  } else {  // one-shot grid: one unit (U heads of a token) per lane group
    kernel = w != nullptr ? flat_kernel<T, true>(p, algo) : flat_kernel<T, false>(p, algo);
    const int64_t U = flat_heads(algo);
    const int64_t units = tokens * ((heads + U - 1) / U);
    const int64_t per_block = static_cast<int64_t>(kWarpsPerBlock) * (kWarp / p.L.width);
    p.blocks = static_cast<int>(std::min<int64_t>((units + per_block - 1) / per_block, INT_MAX));
  }
  RopeAngles a = ang;
  if (a.positions != nullptr) a.cos = a.sin = nullptr;
  p.L.table_vec4 = table_vec4(a);
  kernel<<<p.blocks, kThreads, 0, stream>>>(x, y, a, w, tokens, static_cast<int>(heads), p.L, eps,
                                            inverse ? -1.f : 1.f);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_norm_bwd(const T* dy, const T* x, const RopeAngles& ang, const T* w, T* dx, T* dw,
                          int64_t tokens, int64_t heads, int64_t head_dim, float eps,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream, int algo) {
  SUROGATE_TRY(check_args(ang, tokens, heads, head_dim));
  if (w == nullptr || dw == nullptr) return cudaErrorInvalidValue;
  if (algo < 0 || algo >= kBwdAlgos) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaMemsetAsync(dw, 0, static_cast<size_t>(head_dim) * sizeof(T), stream);
  const int64_t half = head_dim / 2;
  const int64_t ws_rows =
      static_cast<int64_t>(workspace_bytes / (static_cast<size_t>(head_dim) * sizeof(float)));
  if (workspace == nullptr || ws_rows < 1 || reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  Plan p;
  if (!make_plan(heads, half, pick_vec<T>(half, {dy, x, w, dx}), &p)) return cudaErrorInvalidValue;
  p.smem = static_cast<size_t>(kWarpsPerBlock) * head_dim * sizeof(float);
  const BwdKernel<T> kernel = bwd_kernel<T>(p, algo);
  if (algo == 0) {
    SUROGATE_TRY(size_grid(kernel, tokens, p));
    // The grid strides over tokens, so fewer workspace rows just mean fewer, longer-lived blocks.
    p.blocks = static_cast<int>(std::min<int64_t>(p.blocks, ws_rows));
  } else {
    // Flat: as many blocks as fit (and as the workspace has rows), then shrunk so that every lane
    // group gets the same number of units (the last block's groups at most one fewer).
    int sms = 0, per_sm = 0;
    SUROGATE_TRY(occupancy(kernel, p.smem, &per_sm, &sms));
    const int64_t U = bwd_flat_heads(algo);
    const int64_t units = tokens * ((heads + U - 1) / U);
    const int64_t per_block = static_cast<int64_t>(kWarpsPerBlock) * (kWarp / p.L.width);
    const int64_t need = (units + per_block - 1) / per_block;
    const int64_t cap = std::max<int64_t>(
        1,
        std::min<int64_t>(static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1), ws_rows));
    const int64_t rounds = (need + cap - 1) / cap;
    p.blocks = static_cast<int>(std::max<int64_t>(1, (need + rounds - 1) / rounds));
  }
  RopeAngles a = ang;
  if (a.positions != nullptr) a.cos = a.sin = nullptr;
  p.L.table_vec4 = table_vec4(a);
  float* ws = static_cast<float*>(workspace);
  kernel<<<p.blocks, kThreads, p.smem, stream>>>(dy, x, a, w, dx, ws, tokens,
                                                 static_cast<int>(heads), p.L, eps);
  SUROGATE_TRY(cudaGetLastError());
  return colsum::dw_col_sum<T>(ws, dw, p.blocks, static_cast<int>(head_dim), stream);
}

template <typename T>
cudaError_t rope_fwd_pair(const RopeTensor<T>& t0, const RopeTensor<T>& t1, const RopeAngles& ang,
                          int64_t tokens, int64_t head_dim, float eps, bool inverse,
                          cudaStream_t stream, int algo) {
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t0.heads, 1), head_dim));
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t1.heads, 1), head_dim));
  if ((t0.w == nullptr) != (t1.w == nullptr) || t0.heads <= 0 || t1.heads <= 0)
    return cudaErrorInvalidValue;
  auto each = [&]() -> cudaError_t {  // one launch per tensor
    SUROGATE_TRY(rope_fwd<T>(t0.x, t0.out, ang, t0.w, tokens, t0.heads, head_dim, eps, inverse,
                             stream, algo));
    return rope_fwd<T>(t1.x, t1.out, ang, t1.w, tokens, t1.heads, head_dim, eps, inverse, stream,
                       algo);
  };
  if (algo != kRopePairFwdAlgo) return each();
  if (tokens == 0) return cudaSuccess;
  const int64_t half = head_dim / 2;
  Plan p;
  if (!make_plan(1, half, pick_vec<T>(half, {t0.x, t0.out, t0.w, t1.x, t1.out, t1.w}), &p)) {
    return cudaErrorInvalidValue;
  }
  constexpr int U = flat_heads(kRopePairFwdAlgo);
  const int64_t per_block = static_cast<int64_t>(kWarpsPerBlock) * (kWarp / p.L.width);
  const int64_t b0 = (tokens * ((t0.heads + U - 1) / U) + per_block - 1) / per_block;
  const int64_t b1 = (tokens * ((t1.heads + U - 1) / U) + per_block - 1) / per_block;
  // Beyond one grid, or rows of more than one chunk per lane (head_dim > 256 in 16-bit: two inlined
  // copies of those long-row bodies spill): one launch each.
  if (b0 + b1 > INT_MAX || p.per != 1) return each();
  using Kernel = void (*)(Pair<T>, RopeAngles, int64_t, Layout, float, float);
  const bool norm = t0.w != nullptr;
  const Kernel kernel = p.vec == 1 ? (norm ? rope_fwd_flat_pair_kernel<T, 1, 1, true, U>
                                           : rope_fwd_flat_pair_kernel<T, 1, 1, false, U>)
                                   : (norm ? rope_fwd_flat_pair_kernel<T, kVec<T>, 1, true, U>
                                           : rope_fwd_flat_pair_kernel<T, kVec<T>, 1, false, U>);
  RopeAngles a = ang;
  if (a.positions != nullptr) a.cos = a.sin = nullptr;
  p.L.table_vec4 = table_vec4(a);
  const Pair<T> pr{t0.x,
                   t1.x,
                   t0.out,
                   t1.out,
                   t0.w,
                   t1.w,
                   static_cast<int>(t0.heads),
                   static_cast<int>(t1.heads),
                   static_cast<int>(b0)};
  kernel<<<static_cast<unsigned>(b0 + b1), kThreads, 0, stream>>>(pr, a, tokens, p.L, eps,
                                                                  inverse ? -1.f : 1.f);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_norm_bwd_pair(const RopeTensor<T>& t0, const RopeTensor<T>& t1,
                               const RopeAngles& ang, int64_t tokens, int64_t head_dim, float eps,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream,
                               int algo) {
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t0.heads, 1), head_dim));
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t1.heads, 1), head_dim));
  if (t0.heads <= 0 || t1.heads <= 0) return cudaErrorInvalidValue;
  auto each = [&]() -> cudaError_t {  // one tensor after the other (stream order: they share ws)
    SUROGATE_TRY(rope_norm_bwd<T>(t0.dy, t0.x, ang, t0.w, t0.out, t0.dw, tokens, t0.heads, head_dim,
                                  eps, workspace, workspace_bytes, stream, algo));
    return rope_norm_bwd<T>(t1.dy, t1.x, ang, t1.w, t1.out, t1.dw, tokens, t1.heads, head_dim, eps,
                            workspace, workspace_bytes, stream, algo);
  };
  const int64_t ws_rows =
      static_cast<int64_t>(workspace_bytes / (static_cast<size_t>(head_dim) * sizeof(float)));
  if (algo != kRopePairBwdAlgo || tokens == 0 || ws_rows < 2) return each();
  if (t0.w == nullptr || t0.dw == nullptr || t1.w == nullptr || t1.dw == nullptr)
    return cudaErrorInvalidValue;
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return cudaErrorInvalidValue;
  const int64_t half = head_dim / 2;
  Plan p;
  if (!make_plan(1, half, pick_vec<T>(half, {t0.dy, t0.x, t0.w, t0.out, t1.dy, t1.x, t1.w, t1.out}),
                 &p)) {
    return cudaErrorInvalidValue;
  }
  if (p.per != 1) return each();  // long rows: see rope_fwd_pair
  p.smem = static_cast<size_t>(kWarpsPerBlock) * head_dim * sizeof(float);
  constexpr int U = bwd_flat_heads(kRopePairBwdAlgo);
  constexpr bool kStream = kRopePairBwdAlgo != 4;
  using Kernel = void (*)(GradPair<T>, RopeAngles, float*, int64_t, Layout, float);
  const Kernel kernel = p.vec == 1 ? rope_norm_bwd_flat_pair_kernel<T, 1, 1, U, kStream>
                                   : rope_norm_bwd_flat_pair_kernel<T, kVec<T>, 1, U, kStream>;
  // As rope_norm_bwd's flat grid, over both tensors: the fewest rounds r for which both tensors'
  // blocks (each sized so its lane groups get equal unit counts) fit the device and the workspace.
  int sms = 0, per_sm = 0;
  SUROGATE_TRY(occupancy(kernel, p.smem, &per_sm, &sms));
  const int64_t per_block = static_cast<int64_t>(kWarpsPerBlock) * (kWarp / p.L.width);
  const int64_t need0 = (tokens * ((t0.heads + U - 1) / U) + per_block - 1) / per_block;
  const int64_t need1 = (tokens * ((t1.heads + U - 1) / U) + per_block - 1) / per_block;
  const int64_t cap = std::max<int64_t>(
      2, std::min<int64_t>(static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1), ws_rows));
  int64_t rounds = std::max<int64_t>(1, (need0 + need1 + cap - 1) / cap);
  auto blocks = [&](int64_t need) { return (need + rounds - 1) / rounds; };
  while (blocks(need0) + blocks(need1) > cap) ++rounds;
  const int64_t b0 = blocks(need0), b1 = blocks(need1);
  RopeAngles a = ang;
  if (a.positions != nullptr) a.cos = a.sin = nullptr;
  p.L.table_vec4 = table_vec4(a);
  float* ws = static_cast<float*>(workspace);
  const GradPair<T> pr{t0.dy,
                       t1.dy,
                       t0.x,
                       t1.x,
                       t0.w,
                       t1.w,
                       t0.out,
                       t1.out,
                       static_cast<int>(t0.heads),
                       static_cast<int>(t1.heads),
                       static_cast<int>(b0)};
  kernel<<<static_cast<unsigned>(b0 + b1), kThreads, p.smem, stream>>>(pr, a, ws, tokens, p.L, eps);
  SUROGATE_TRY(cudaGetLastError());
  return colsum::dw_col_sum<T>(ws, t0.dw, static_cast<int>(b0), static_cast<int>(head_dim), stream,
                               t1.dw, static_cast<int>(b1));
}

#define SUROGATE_ROPE_INSTANTIATE(T)                                                             \
  template cudaError_t rope_fwd<T>(const T*, T*, const RopeAngles&, const T*, int64_t, int64_t,  \
                                   int64_t, float, bool, cudaStream_t, int);                     \
  template cudaError_t rope_norm_bwd<T>(const T*, const T*, const RopeAngles&, const T*, T*, T*, \
                                        int64_t, int64_t, int64_t, float, void*, size_t,         \
                                        cudaStream_t, int);                                      \
  template cudaError_t rope_fwd_pair<T>(const RopeTensor<T>&, const RopeTensor<T>&,              \
                                        const RopeAngles&, int64_t, int64_t, float, bool,        \
                                        cudaStream_t, int);                                      \
  template cudaError_t rope_norm_bwd_pair<T>(const RopeTensor<T>&, const RopeTensor<T>&,         \
                                             const RopeAngles&, int64_t, int64_t, float, void*,  \
                                             size_t, cudaStream_t, int);

SUROGATE_ROPE_INSTANTIATE(float)
SUROGATE_ROPE_INSTANTIATE(__nv_bfloat16)
SUROGATE_ROPE_INSTANTIATE(__half)

}  // namespace surogate
