// Device math shared by the element-wise kernels. Header-only, inlined.
#pragma once

namespace surogate {

// sigmoid(g) = 1 / (1 + 2^(-g log2 e)) on the SFU: ex2.approx and rcp.approx, each within a couple
// of fp32 ulps, far below the 16-bit outputs' rounding and the fp32 tests' tolerance. `1.f / x`
// would be the IEEE division, whose Newton steps and slow-path branch cost ~8 more instructions
// an element; the SwiGLU+LoRA epilogue was issue-bound with it.
// ftz: a 2^-x that flushes to zero only meets 1 + it.
__device__ __forceinline__ float sigmoid(float g) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return r;
}

}  // namespace surogate
