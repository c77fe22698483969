// Shared by the dequantization kernels (nf4_dequantize.cu, tile_dequantize.cu): their launch shape
// (256-thread blocks, 4 chunks a thread, a grid-stride loop past kMaxBlocks), the optional rounding
// to the model dtype, the 16-byte stores of fp32 values to any output type, float8_e4m3fn
// included (saturating, as jnp.clip(v, -448, 448).astype(float8_e4m3fn)), and the groups of a
// selective MoE dequantization (which output ranges belong to experts that received no tokens).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "kernels/dequant_via.h"
#include "kernels/device_common.cuh"

namespace surogate::dequant {

constexpr int kThreads = 256;
constexpr int kChunksPerThread = 4;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // larger grids loop; no weight comes near it

// Blocks for `units` work items, `per_block` a block (at least 1, at most kMaxBlocks).
inline unsigned grid_for(int64_t units, int64_t per_block) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((units + per_block - 1) / per_block, 1, kMaxBlocks));
}

template <typename OutT>
constexpr int kElems = 16 / static_cast<int>(sizeof(OutT));  // outputs per 16-byte store

template <typename OutT>
constexpr bool kIsFp8 = std::is_same_v<OutT, __nv_fp8_e4m3>;

// The value as the model dtype holds it (RNE), back in fp32.
__device__ __forceinline__ float round_via(float v, DequantVia via) {
  if (via == DequantVia::kBf16) return __bfloat162float(__float2bfloat16_rn(v));
  if (via == DequantVia::kF16) return __half2float(__float2half_rn(v));
  return v;
}

// kElems<OutT> fp32 values as one 16-byte vector of OutT (RNE; e4m3 through cvt .satfinite).
template <typename OutT>
__device__ __forceinline__ uint4 pack16(const float* v) {
  if constexpr (kIsFp8<OutT>) {
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      // .x goes to the low byte (the lower address)
      const uint32_t lo =
          __nv_cvt_float2_to_fp8x2(make_float2(v[4 * q], v[4 * q + 1]), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[4 * q + 2], v[4 * q + 3]),
                                                   __NV_SATFINITE, __NV_E4M3);
      w[q] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    float in[kElems<OutT>];
#pragma unroll
    for (int e = 0; e < kElems<OutT>; ++e) in[e] = v[e];
    return vec::pack<OutT, kElems<OutT>>(in).u;
  }
}

// Stacked MoE experts dequantized selectively: group g (expert g) owns `units` consecutive units
// of the output (weights for NF4's flat layout, rows for the tile layout); a group whose size is
// <= 0 received no tokens, so its outputs are left unwritten (the grouped GEMM never reads them).
// sizes == nullptr: one group, always active.
struct Groups {
  const int32_t* sizes;  // device [num groups], or nullptr
  int64_t units;         // units per group (> 0 when sizes != nullptr)

  // Whether any group overlapping units [first, last] has rows (a handful of cached loads).
  __device__ __forceinline__ bool any_active(int64_t first, int64_t last) const {
    if (sizes == nullptr) return true;
    for (int64_t g = first / units; g <= last / units; ++g) {
      if (__ldg(sizes + g) > 0) return true;
    }
    return false;
  }
};

template <typename OutT>
__device__ __forceinline__ void store_one(OutT* out, int64_t i, float v) {
  if constexpr (kIsFp8<OutT>) {
    reinterpret_cast<__nv_fp8_storage_t*>(out)[i] =
        __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  } else {
    out[i] = from_float<OutT>(v);
  }
}

}  // namespace surogate::dequant
