// RoPE forward (also the rotation-only backward: the rotation by -angle), optionally fused with
// the per-head RMSNorm. Design and bytes floor: rope_common.cuh; contract: rope.h.
#include <algorithm>
#include <climits>

#include "kernels/rope_common.cuh"

namespace surogate {
namespace {

// The forward over one tensor, as block `block` of `nblocks` (the kernels below pass
// blockIdx.x / gridDim.x, or a block range of a two-tensor launch). Unit u = (token u / ceil(H /
// U), heads (u % ceil(H / U)) * U + 0..U-1). w == nullptr: rotation only (a runtime switch, uniform
// over the grid: rope_common.cuh).
template <typename T, int V, int PER>
__device__ __forceinline__ void rope_fwd_rows(const T* __restrict__ x, T* __restrict__ y,
                                              const RopeAngles& ang, const T* __restrict__ w,
                                              int64_t tokens, int heads, const Layout& L, float eps,
                                              float sgn, int64_t block, int64_t nblocks) {
  constexpr int U = kFwdHeads;
  using R = vec::Raw<T, V>;
  const int K = 2 * L.half;
  const Place me = place_of(L);
  const int upt = (heads + U - 1) / U;  // units per token
  const int64_t units = tokens * upt;
  const int64_t stride = nblocks * kWarpsPerBlock * me.groups;
  for (int64_t unit = (block * kWarpsPerBlock + threadIdx.x / kWarp) * me.groups + me.group;
       unit < units; unit += stride) {  // uniform over a group: shuffles stay inside it
    const int64_t tok = unit / upt;
    const int h0 = static_cast<int>(unit - tok * upt) * U;
    R a[U][PER], b[U][PER];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t off = (tok * heads + h0 + u) * K;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
        if (h0 + u < heads && ch < L.nchunks) {
          a[u][i] = vec::load_raw_stream<T, V>(x + off + ch * V);
          b[u][i] = vec::load_raw_stream<T, V>(x + off + L.half + ch * V);
        }
      }
    }
    float c[PER][V], s[PER][V];
    token_angles<V, PER>(ang, tok, me.lane, L, sgn, c, s);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (h0 + u >= heads) break;  // uniform over the group
      const int64_t off = (tok * heads + h0 + u) * K;
      float r = 1.f;
      if (w != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          if (lane_chunk(me.lane, i, L) < L.nchunks) {
            float p[V], q[V];
            vec::unpack(a[u][i], p);
            vec::unpack(b[u][i], q);
#pragma unroll
            for (int k = 0; k < V; ++k) ss += p[k] * p[k] + q[k] * q[k];
          }
        }
        ss = group_sum(ss, me.mask, L.width);
        r = rsqrtf(ss / static_cast<float>(K) + eps);
      }
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int ch = lane_chunk(me.lane, i, L);
        if (ch < L.nchunks) {
          float n1[V], n2[V], o1[V], o2[V];
          vec::unpack(a[u][i], n1);
          vec::unpack(b[u][i], n2);
          if (w != nullptr) {
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

template <typename T, int V, int PER>
__global__ void __launch_bounds__(kThreads, (min_blocks<PER>()))
    rope_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, RopeAngles ang,
                    const T* __restrict__ w, int64_t tokens, int heads, Layout L, float eps,
                    float sgn) {
  rope_fwd_rows<T, V, PER>(x, y, ang, w, tokens, heads, L, eps, sgn, blockIdx.x, gridDim.x);
}

// q and k of a layer in one launch (same tokens, angles and head_dim; own heads and weights):
// blocks [0, blocks0) run tensor 0, the rest tensor 1.
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

template <typename T, int V, int PER>
__global__ void __launch_bounds__(kThreads, (min_blocks<PER>()))
    rope_fwd_pair_kernel(Pair<T> p, RopeAngles ang, int64_t tokens, Layout L, float eps,
                         float sgn) {
  const int64_t b = blockIdx.x;
  if (b < p.blocks0) {
    rope_fwd_rows<T, V, PER>(p.in0, p.out0, ang, p.w0, tokens, p.heads0, L, eps, sgn, b, p.blocks0);
  } else {
    rope_fwd_rows<T, V, PER>(p.in1, p.out1, ang, p.w1, tokens, p.heads1, L, eps, sgn, b - p.blocks0,
                             static_cast<int64_t>(gridDim.x) - p.blocks0);
  }
}

template <typename T>
using FwdKernel = void (*)(const T*, T*, RopeAngles, const T*, int64_t, int, Layout, float, float);

template <typename T>
FwdKernel<T> fwd_kernel(const Plan& p) {
  if (p.vec == 1) {
    switch (p.per) {
      case 1:
        return rope_fwd_kernel<T, 1, 1>;
      case 4:
        return rope_fwd_kernel<T, 1, 4>;
      default:
        return rope_fwd_kernel<T, 1, kMaxPerScalar>;
    }
  }
  if (p.per == 1) return rope_fwd_kernel<T, kVec<T>, 1>;
  return rope_fwd_kernel<T, kVec<T>, kMaxPerVector>;
}

}  // namespace

int64_t rope_max_head_dim() { return 1024; }

template <typename T>
cudaError_t rope_fwd(const T* x, T* y, const RopeAngles& ang, const T* w, int64_t tokens,
                     int64_t heads, int64_t head_dim, float eps, bool inverse,
                     cudaStream_t stream) {
  SUROGATE_TRY(check_args(ang, tokens, heads, head_dim));
  if (tokens == 0) return cudaSuccess;
  const int64_t half = head_dim / 2;
  Plan p;
  if (!make_plan(half, pick_vec<T>(half, {x, y, w}), &p)) return cudaErrorInvalidValue;
  const FwdKernel<T> kernel = fwd_kernel<T>(p);
  p.blocks = static_cast<int>(std::min<int64_t>(unit_blocks(tokens, heads, kFwdHeads, p), INT_MAX));
  const RopeAngles a = kernel_angles(ang, &p);
  kernel<<<p.blocks, kThreads, 0, stream>>>(x, y, a, w, tokens, static_cast<int>(heads), p.L, eps,
                                            inverse ? -1.f : 1.f);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_fwd_pair(const RopeTensor<T>& t0, const RopeTensor<T>& t1, const RopeAngles& ang,
                          int64_t tokens, int64_t head_dim, float eps, bool inverse,
                          cudaStream_t stream) {
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t0.heads, 1), head_dim));
  SUROGATE_TRY(check_args(ang, tokens, std::max<int64_t>(t1.heads, 1), head_dim));
  if ((t0.w == nullptr) != (t1.w == nullptr) || t0.heads <= 0 || t1.heads <= 0)
    return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  const int64_t half = head_dim / 2;
  Plan p;
  if (!make_plan(half, pick_vec<T>(half, {t0.x, t0.out, t0.w, t1.x, t1.out, t1.w}), &p)) {
    return cudaErrorInvalidValue;
  }
  const int64_t b0 = unit_blocks(tokens, t0.heads, kFwdHeads, p);
  const int64_t b1 = unit_blocks(tokens, t1.heads, kFwdHeads, p);
  // Beyond one grid, or rows of more than one chunk per lane (see make_plan; two inlined copies of
  // those long-row bodies spill): one launch each.
  if (b0 + b1 > INT_MAX || p.per != 1) {
    SUROGATE_TRY(
        rope_fwd<T>(t0.x, t0.out, ang, t0.w, tokens, t0.heads, head_dim, eps, inverse, stream));
    return rope_fwd<T>(t1.x, t1.out, ang, t1.w, tokens, t1.heads, head_dim, eps, inverse, stream);
  }
  using Kernel = void (*)(Pair<T>, RopeAngles, int64_t, Layout, float, float);
  const Kernel kernel =
      p.vec == 1 ? rope_fwd_pair_kernel<T, 1, 1> : rope_fwd_pair_kernel<T, kVec<T>, 1>;
  const RopeAngles a = kernel_angles(ang, &p);
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

#define SUROGATE_ROPE_FWD_INSTANTIATE(T)                                                        \
  template cudaError_t rope_fwd<T>(const T*, T*, const RopeAngles&, const T*, int64_t, int64_t, \
                                   int64_t, float, bool, cudaStream_t);                         \
  template cudaError_t rope_fwd_pair<T>(const RopeTensor<T>&, const RopeTensor<T>&,             \
                                        const RopeAngles&, int64_t, int64_t, float, bool,       \
                                        cudaStream_t);

SUROGATE_ROPE_FWD_INSTANTIATE(float)
SUROGATE_ROPE_FWD_INSTANTIATE(__nv_bfloat16)
SUROGATE_ROPE_FWD_INSTANTIATE(__half)

}  // namespace surogate
