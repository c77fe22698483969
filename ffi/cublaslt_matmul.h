// The cuBLASLt GEMM setup shared by the FP8 (ffi/fp8_matmul.cc) and NVFP4 (ffi/nvfp4_matmul.cc)
// handlers: descriptor, layouts, preference, heuristic, workspace and the plan cache.
//
//   d [M, N] = alpha * sum_k a[m, k] b[n, k]      (fp32 compute and scale type, beta = 0)
// a [M, K] and b [N, K] row-major with K contiguous: the "TN" layout, the only one FP8 on Hopper
// and block-scaled FP4 take. Column-major cuBLASLt computes D_cm [N, M] (= our row-major d) =
// op(A) B with A := b viewed col-major [K, N] (transa = T) and B := a viewed col-major [K, M]
// (transb = N), lda = ldb = K (in elements), ldd = N; so cuBLASLt's A is our b and its B our a,
// and their types, scale pointers and alignment preferences swap the same way.
//
// A plan (descriptor, layouts and the heuristic's best algorithm for the spec's workspace and
// alignments) is built at the first call with a spec and kept for the process lifetime (a handful
// per model); per call only the scale pointers are set on its shared descriptor, under its mutex.
#pragma once

#include "ffi/cublaslt_api.h"

#if SUROGATE_HAVE_CUBLASLT

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace surogate::ffi_bind::lt {

struct MatmulSpec {
  int device = 0;
  int64_t m = 0, n = 0, k = 0;
  cudaDataType_t a_type = CUDA_R_32F, b_type = CUDA_R_32F, d_type = CUDA_R_32F;
  int align_a = 1, align_b = 1, align_d = 1;  // Alignment() of our a, b, d
  size_t ws_bytes = 0;                        // cuBLASLt's workspace
  int fast_accum = -1;                        // >= 0: CUBLASLT_MATMUL_DESC_FAST_ACCUM (FP8)
  bool vec16_scales = false;  // A/B_SCALE_MODE VEC16_UE4M3: swizzled E4M3 block scales (NVFP4)
  bool device_alpha = false;  // CUBLASLT_POINTER_MODE_DEVICE: alpha and beta in device memory
};

// Enqueues d = alpha * a b^T (+ beta * d) on `stream`. a_scale / b_scale become the descriptor's
// scale pointers of our a / b (device memory: one float each, or the swizzled block scales under
// vec16_scales); alpha / beta are host floats, or device ones under device_alpha; ws is the
// workspace of spec.ws_bytes bytes. Errors name `op`.
ffi::Error Matmul(std::string_view op, cublasLtHandle_t handle, const MatmulSpec& spec,
                  const void* a, const void* b, const void* a_scale, const void* b_scale,
                  const float* alpha, const float* beta, void* d, void* ws, cudaStream_t stream);

}  // namespace surogate::ffi_bind::lt

#endif  // SUROGATE_HAVE_CUBLASLT
