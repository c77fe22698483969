// Fused residual add + RMSNorm launchers (see add_rms_norm.h for the math and the contract).
//
// Floor (H100, ~3.0 TB/s copy bandwidth): forward reads x and res and writes y and res_out,
// 4 x rows x dim x sizeof(T) (16384 x 4096 bf16: 537 MB -> ~179 us; unfused it is an add
// (3 passes) plus a norm (2 passes), 5 passes); backward reads dy, dres_out and res_out and writes
// dx, 4 passes (unfused: norm backward 3 + gradient add 3 = 6).
// The kernels and the design rationale are in rms_norm_common.cuh: one row per warp slice or
// block, the row held in registers (a single DRAM read), the residual sum rounded to T before
// it is normalized (exactly what the unfused model computes), deterministic dw.
#include "kernels/add_rms_norm.h"

#include "kernels/rms_norm_common.cuh"

namespace surogate {

template <typename T>
cudaError_t add_rms_norm_fwd(const T* x, const T* res, const T* w, T* y, T* res_out, float* rstd,
                             int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (res == nullptr || res_out == nullptr) return cudaErrorInvalidValue;
  return normk::norm_fwd<T, true>(x, res, w, y, res_out, rstd, rows, dim, eps, stream);
}

template <typename T>
cudaError_t add_rms_norm_bwd(const T* dy, const T* dres_out, const T* res_out, const T* w,
                             const float* rstd, T* dx, T* dw, int64_t rows, int64_t dim,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (dres_out == nullptr) return cudaErrorInvalidValue;
  return normk::norm_bwd<T, true>(dy, res_out, w, rstd, dres_out, dx, dw, rows, dim, workspace,
                                  workspace_bytes, stream);
}

#define SUROGATE_ADD_RMS_NORM_INSTANTIATE(T)                                                      \
  template cudaError_t add_rms_norm_fwd<T>(const T*, const T*, const T*, T*, T*, float*, int64_t, \
                                           int64_t, float, cudaStream_t);                         \
  template cudaError_t add_rms_norm_bwd<T>(const T*, const T*, const T*, const T*, const float*,  \
                                           T*, T*, int64_t, int64_t, void*, size_t, cudaStream_t);

SUROGATE_ADD_RMS_NORM_INSTANTIATE(float)
SUROGATE_ADD_RMS_NORM_INSTANTIATE(__nv_bfloat16)
SUROGATE_ADD_RMS_NORM_INSTANTIATE(__half)

}  // namespace surogate
