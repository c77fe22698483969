// Backward of the fused per-head RMSNorm + RoPE (the rotation-only backward is the forward with
// `inverse`, rope_fwd.cu). Design and bytes floor: rope_common.cuh; contract: rope.h.
#include <algorithm>
#include <climits>

#include "kernels/dw_col_sum.cuh"
#include "kernels/rope_common.cuh"

namespace surogate {
namespace {

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

// The norm backward over one tensor as block `block` of `nblocks` (see rope_fwd_rows); its dw
// partials go to row blockIdx.x of ws. `red`: the block's shared memory (block_dw_to_ws). dy and x
// stay packed and are unpacked twice (for the two reductions and for the output) instead of
// holding fp32 copies.
template <typename T, int V, int PER>
__device__ __forceinline__ void rope_norm_bwd_rows(const T* __restrict__ dy,
                                                   const T* __restrict__ x, const RopeAngles& ang,
                                                   const T* __restrict__ w, T* __restrict__ dx,
                                                   float* __restrict__ ws, int64_t tokens,
                                                   int heads, const Layout& L, float eps,
                                                   int64_t block, int64_t nblocks, float* red) {
  constexpr int U = kBwdHeads;
  using R = vec::Raw<T, V>;
  const int K = 2 * L.half;
  const Place me = place_of(L);
  float d1[PER][V], d2[PER][V];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
#pragma unroll
    for (int k = 0; k < V; ++k) d1[i][k] = d2[i][k] = 0.f;
  }
  const int upt = (heads + U - 1) / U;  // units per token
  const int64_t units = tokens * upt;
  const int64_t stride = nblocks * kWarpsPerBlock * me.groups;
  for (int64_t unit = (block * kWarpsPerBlock + threadIdx.x / kWarp) * me.groups + me.group;
       unit < units; unit += stride) {  // uniform over a group: its shuffles stay inside it
    const int64_t tok = unit / upt;
    const int h0 = static_cast<int>(unit - tok * upt) * U;
    R ga[U][PER], gb[U][PER], xa[U][PER], xb[U][PER];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t off = (tok * heads + h0 + u) * K;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
        if (h0 + u < heads && ch < L.nchunks) {
          ga[u][i] = vec::load_raw_stream<T, V>(dy + off + ch * V);
          gb[u][i] = vec::load_raw_stream<T, V>(dy + off + L.half + ch * V);
          xa[u][i] = vec::load_raw_stream<T, V>(x + off + ch * V);
          xb[u][i] = vec::load_raw_stream<T, V>(x + off + L.half + ch * V);
        }
      }
    }
    float c[PER][V], s[PER][V];
    token_angles<V, PER>(ang, tok, me.lane, L, -1.f, c, s);  // R(-ang): (cos, -sin)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (h0 + u >= heads) break;  // uniform over the group
      const int64_t off = (tok * heads + h0 + u) * K;
      // Element by element from the packed vectors (elem), so only a few fp32 values are live at
      // a time: unpacking whole rows of dy, x, w and the outputs spilled at the register caps.
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
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
      ss = group_sum(ss, me.mask, L.width);
      dot = group_sum(dot, me.mask, L.width);
      const float r = rsqrtf(ss / static_cast<float>(K) + eps);
      const float m = r * dot / static_cast<float>(K);  // mean(g * w * xhat)
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
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
  block_dw_to_ws<V, PER>(d1, d2, L, me.lane, red, ws);
}

// ws: [gridDim.x, K] float32; block b writes its dw partial sums to row b.
// Dynamic shared memory: kWarpsPerBlock * K floats.
template <typename T, int V, int PER>
__global__ void __launch_bounds__(kThreads, (min_blocks<PER>()))
    rope_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, RopeAngles ang,
                         const T* __restrict__ w, T* __restrict__ dx, float* __restrict__ ws,
                         int64_t tokens, int heads, Layout L, float eps) {
  extern __shared__ float red[];
  rope_norm_bwd_rows<T, V, PER>(dy, x, ang, w, dx, ws, tokens, heads, L, eps, blockIdx.x, gridDim.x,
                                red);
}

// q and k in one launch (see Pair): blocks [0, blocks0) tensor 0, the rest tensor 1; ws rows
// follow the blocks, so rows [0, blocks0) hold tensor 0's dw partials.
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

template <typename T, int V, int PER>
__global__ void __launch_bounds__(kThreads, (min_blocks<PER>()))
    rope_norm_bwd_pair_kernel(GradPair<T> p, RopeAngles ang, float* __restrict__ ws, int64_t tokens,
                              Layout L, float eps) {
  extern __shared__ float red[];
  const int64_t b = blockIdx.x;
  if (b < p.blocks0) {
    rope_norm_bwd_rows<T, V, PER>(p.dy0, p.x0, ang, p.w0, p.dx0, ws, tokens, p.heads0, L, eps, b,
                                  p.blocks0, red);
  } else {
    rope_norm_bwd_rows<T, V, PER>(p.dy1, p.x1, ang, p.w1, p.dx1, ws, tokens, p.heads1, L, eps,
                                  b - p.blocks0, static_cast<int64_t>(gridDim.x) - p.blocks0, red);
  }
}

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

template <typename T>
using BwdKernel = void (*)(const T*, const T*, RopeAngles, const T*, T*, float*, int64_t, int,
                           Layout, float);

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

}  // namespace

template <typename T>
cudaError_t rope_norm_bwd(const T* dy, const T* x, const RopeAngles& ang, const T* w, T* dx, T* dw,
                          int64_t tokens, int64_t heads, int64_t head_dim, float eps,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  SUROGATE_TRY(check_args(ang, tokens, heads, head_dim));
  if (w == nullptr || dw == nullptr) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaMemsetAsync(dw, 0, static_cast<size_t>(head_dim) * sizeof(T), stream);
  const int64_t half = head_dim / 2;
  const int64_t ws_rows =
      static_cast<int64_t>(workspace_bytes / (static_cast<size_t>(head_dim) * sizeof(float)));
  if (workspace == nullptr || ws_rows < 1 || reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  Plan p;
  if (!make_plan(half, pick_vec<T>(half, {dy, x, w, dx}), &p)) return cudaErrorInvalidValue;
  p.smem = static_cast<size_t>(kWarpsPerBlock) * head_dim * sizeof(float);
  const BwdKernel<T> kernel = bwd_kernel<T>(p);
  // As many blocks as fit (and as the workspace has rows), then shrunk so that every lane group
  // gets the same number of units (the last block's groups at most one fewer).
  int sms = 0, per_sm = 0;
  SUROGATE_TRY(occupancy(kernel, p.smem, &per_sm, &sms));
  const int64_t need = unit_blocks(tokens, heads, kBwdHeads, p);
  const int64_t cap = std::max<int64_t>(
      1, std::min<int64_t>(static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1), ws_rows));
  const int64_t rounds = (need + cap - 1) / cap;
  p.blocks = static_cast<int>(std::max<int64_t>(1, (need + rounds - 1) / rounds));
  const RopeAngles a = kernel_angles(ang, &p);
  float* ws = static_cast<float*>(workspace);
  kernel<<<p.blocks, kThreads, p.smem, stream>>>(dy, x, a, w, dx, ws, tokens,
                                                 static_cast<int>(heads), p.L, eps);
  SUROGATE_TRY(cudaGetLastError());
  return colsum::dw_col_sum<T>(ws, dw, p.blocks, static_cast<int>(head_dim), stream);
}

template <typename T>
cudaError_t rope_norm_bwd_pair(const RopeTensor<T>& t0, const RopeTensor<T>& t1,
                               const RopeAngles& ang, int64_t tokens, int64_t head_dim, float eps,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t0.heads, 1), head_dim));
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t1.heads, 1), head_dim));
  if (t0.heads <= 0 || t1.heads <= 0) return cudaErrorInvalidValue;
  auto each = [&]() -> cudaError_t {  // one tensor after the other (stream order: they share ws)
    SUROGATE_TRY(rope_norm_bwd<T>(t0.dy, t0.x, ang, t0.w, t0.out, t0.dw, tokens, t0.heads, head_dim,
                                  eps, workspace, workspace_bytes, stream));
    return rope_norm_bwd<T>(t1.dy, t1.x, ang, t1.w, t1.out, t1.dw, tokens, t1.heads, head_dim, eps,
                            workspace, workspace_bytes, stream);
  };
  const int64_t ws_rows =
      static_cast<int64_t>(workspace_bytes / (static_cast<size_t>(head_dim) * sizeof(float)));
  if (tokens == 0 || ws_rows < 2) return each();
  if (t0.w == nullptr || t0.dw == nullptr || t1.w == nullptr || t1.dw == nullptr)
    return cudaErrorInvalidValue;
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return cudaErrorInvalidValue;
  const int64_t half = head_dim / 2;
  Plan p;
  if (!make_plan(half, pick_vec<T>(half, {t0.dy, t0.x, t0.w, t0.out, t1.dy, t1.x, t1.w, t1.out}),
                 &p)) {
    return cudaErrorInvalidValue;
  }
  if (p.per != 1) return each();  // long rows: see rope_fwd_pair
  p.smem = static_cast<size_t>(kWarpsPerBlock) * head_dim * sizeof(float);
  using Kernel = void (*)(GradPair<T>, RopeAngles, float*, int64_t, Layout, float);
  const Kernel kernel =
      p.vec == 1 ? rope_norm_bwd_pair_kernel<T, 1, 1> : rope_norm_bwd_pair_kernel<T, kVec<T>, 1>;
  // As rope_norm_bwd's grid, over both tensors: the fewest rounds r for which both tensors'
  // blocks (each sized so its lane groups get equal unit counts) fit the device and the workspace.
  int sms = 0, per_sm = 0;
  SUROGATE_TRY(occupancy(kernel, p.smem, &per_sm, &sms));
  const int64_t need0 = unit_blocks(tokens, t0.heads, kBwdHeads, p);
  const int64_t need1 = unit_blocks(tokens, t1.heads, kBwdHeads, p);
  const int64_t cap = std::max<int64_t>(
      2, std::min<int64_t>(static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1), ws_rows));
  int64_t rounds = std::max<int64_t>(1, (need0 + need1 + cap - 1) / cap);
  auto blocks = [&](int64_t need) { return (need + rounds - 1) / rounds; };
  while (blocks(need0) + blocks(need1) > cap) ++rounds;
  const int64_t b0 = blocks(need0), b1 = blocks(need1);
  const RopeAngles a = kernel_angles(ang, &p);
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

#define SUROGATE_ROPE_BWD_INSTANTIATE(T)                                                         \
  template cudaError_t rope_norm_bwd<T>(const T*, const T*, const RopeAngles&, const T*, T*, T*, \
                                        int64_t, int64_t, int64_t, float, void*, size_t,         \
                                        cudaStream_t);                                           \
  template cudaError_t rope_norm_bwd_pair<T>(const RopeTensor<T>&, const RopeTensor<T>&,         \
                                             const RopeAngles&, int64_t, int64_t, float, void*,  \
                                             size_t, cudaStream_t);

SUROGATE_ROPE_BWD_INSTANTIATE(float)
SUROGATE_ROPE_BWD_INSTANTIATE(__nv_bfloat16)
SUROGATE_ROPE_BWD_INSTANTIATE(__half)

}  // namespace surogate
