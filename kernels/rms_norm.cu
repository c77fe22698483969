// RMSNorm forward/backward launchers (see rms_norm.h for the math and the launcher contract).
// The kernels, the FLOP/byte floor and the design rationale live in rms_norm_common.cuh, shared
// with the fused residual-add variant (add_rms_norm.cu).
#include "kernels/rms_norm.h"

#include "kernels/rms_norm_common.cuh"

namespace surogate {

template <typename T>
cudaError_t rms_norm_fwd(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t dim,
                         float eps, cudaStream_t stream) {
  return normk::norm_fwd<T, false>(x, nullptr, w, y, nullptr, rstd, rows, dim, eps, stream);
}

template <typename T>
cudaError_t rms_norm_bwd(const T* dy, const T* x, const T* w, const float* rstd, T* dx, T* dw,
                         int64_t rows, int64_t dim, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  return normk::norm_bwd<T, false>(dy, x, w, rstd, nullptr, dx, dw, rows, dim, workspace,
                                   workspace_bytes, stream);
}

#define SUROGATE_RMS_NORM_INSTANTIATE(T)                                                        \
  template cudaError_t rms_norm_fwd<T>(const T*, const T*, T*, float*, int64_t, int64_t, float, \
                                       cudaStream_t);                                           \
  template cudaError_t rms_norm_bwd<T>(const T*, const T*, const T*, const float*, T*, T*,      \
                                       int64_t, int64_t, void*, size_t, cudaStream_t);

SUROGATE_RMS_NORM_INSTANTIATE(float)
SUROGATE_RMS_NORM_INSTANTIATE(__nv_bfloat16)
SUROGATE_RMS_NORM_INSTANTIATE(__half)

}  // namespace surogate
