// The shared cuBLASLt GEMM setup (contract and layout mapping: cublaslt_matmul.h).
#include "ffi/cublaslt_matmul.h"

#if SUROGATE_HAVE_CUBLASLT

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

namespace surogate::ffi_bind::lt {
namespace {

#define SUROGATE_LT_TRY(what, expr)                                \
  do {                                                             \
    const cublasStatus_t st_ = (expr);                             \
    if (st_ != CUBLAS_STATUS_SUCCESS) return Error(op, what, st_); \
  } while (0)

// One cached GEMM configuration. Never destroyed (a handful per model, for the process lifetime).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A, B, C = D
  cublasLtMatmulAlgo_t algo{};
  std::mutex mu;  // the scale pointers are set on the shared descriptor per call
};

auto Key(const MatmulSpec& s) {
  return std::make_tuple(s.device, s.m, s.n, s.k, static_cast<int>(s.a_type),
                         static_cast<int>(s.b_type), static_cast<int>(s.d_type), s.align_a,
                         s.align_b, s.align_d, s.ws_bytes, s.fast_accum, s.vec16_scales,
                         s.device_alpha);
}
using PlanKey = decltype(Key(MatmulSpec{}));

std::string Dims(const MatmulSpec& s) {
  return "M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k);
}

// Descriptor, layouts and the heuristic's best algorithm for s (under the cache's lock).
ffi::Error MakePlan(std::string_view op, cublasLtHandle_t handle, const MatmulSpec& s, Plan* p) {
  const Api& lt = Get();
  SUROGATE_LT_TRY("cublasLtMatmulDescCreate",
                  lt.DescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  SUROGATE_LT_TRY("set TRANSA",
                  lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  SUROGATE_LT_TRY("set TRANSB",
                  lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  if (s.fast_accum >= 0) {
    const int8_t fast = static_cast<int8_t>(s.fast_accum);
    SUROGATE_LT_TRY("set FAST_ACCUM", lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                          &fast, sizeof(fast)));
  }
  if (s.device_alpha) {
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    SUROGATE_LT_TRY(
        "set POINTER_MODE",
        lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm)));
  }
  if (s.vec16_scales) {
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120800
    const cublasLtMatmulMatrixScale_t vec16 = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    SUROGATE_LT_TRY(
        "set A_SCALE_MODE",
        lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec16, sizeof(vec16)));
    SUROGATE_LT_TRY(
        "set B_SCALE_MODE",
        lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec16, sizeof(vec16)));
#else
    return ffi::Error::Internal(std::string(op) +
                                ": block scales need cuBLAS >= 12.8 headers at build time");
#endif
  }
  SUROGATE_LT_TRY("layout A", lt.LayoutCreate(&p->a, s.b_type, s.k, s.n, s.k));
  SUROGATE_LT_TRY("layout B", lt.LayoutCreate(&p->b, s.a_type, s.k, s.m, s.k));
  SUROGATE_LT_TRY("layout D", lt.LayoutCreate(&p->d, s.d_type, s.n, s.m, s.n));

  cublasLtMatmulPreference_t pref = nullptr;
  SUROGATE_LT_TRY("cublasLtMatmulPreferenceCreate", lt.PrefCreate(&pref));
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, decltype(lt.PrefDestroy)>
      guard(pref, lt.PrefDestroy);
  const uint64_t ws = s.ws_bytes;
  const uint32_t align_a = static_cast<uint32_t>(s.align_b),
                 align_b = static_cast<uint32_t>(s.align_a),
                 align_d = static_cast<uint32_t>(s.align_d);
  SUROGATE_LT_TRY(
      "set workspace",
      lt.PrefSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  SUROGATE_LT_TRY("set align A",
                  lt.PrefSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                      sizeof(align_a)));
  SUROGATE_LT_TRY("set align B",
                  lt.PrefSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                      sizeof(align_b)));
  SUROGATE_LT_TRY("set align C",
                  lt.PrefSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                      sizeof(align_d)));
  SUROGATE_LT_TRY("set align D",
                  lt.PrefSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                      sizeof(align_d)));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  SUROGATE_LT_TRY(
      "cublasLtMatmulAlgoGetHeuristic",
      lt.AlgoGetHeuristic(handle, p->desc, p->a, p->b, p->d, p->d, pref, 1, &result, &found));
  if (found == 0) {
    return ffi::Error::Internal(std::string(op) + ": cuBLASLt has no algorithm for " + Dims(s) +
                                " (workspace " + std::to_string(s.ws_bytes) +
                                " bytes, alignments " + std::to_string(s.align_a) + "/" +
                                std::to_string(s.align_b) + "/" + std::to_string(s.align_d) + ")");
  }
  p->algo = result.algo;
  return ffi::Error::Success();
}

ffi::Error GetPlan(std::string_view op, cublasLtHandle_t handle, const MatmulSpec& s, Plan** out) {
  static std::mutex mu;
  static std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::lock_guard<std::mutex> lock(mu);
  const PlanKey key = Key(s);
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto p = std::make_unique<Plan>();
    if (auto e = MakePlan(op, handle, s, p.get()); e.failure()) return e;  // leaks partial descs
    it = plans.emplace(key, std::move(p)).first;
  }
  *out = it->second.get();
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Matmul(std::string_view op, cublasLtHandle_t handle, const MatmulSpec& spec,
                  const void* a, const void* b, const void* a_scale, const void* b_scale,
                  const float* alpha, const float* beta, void* d, void* ws, cudaStream_t stream) {
  Plan* plan = nullptr;
  if (auto e = GetPlan(op, handle, spec, &plan); e.failure()) return e;
  const Api& lt = Get();
  std::lock_guard<std::mutex> lock(plan->mu);
  const void* lt_a_scale = b_scale;  // cuBLASLt's A is our b
  const void* lt_b_scale = a_scale;
  SUROGATE_LT_TRY("set A_SCALE_POINTER",
                  lt.DescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &lt_a_scale,
                                      sizeof(lt_a_scale)));
  SUROGATE_LT_TRY("set B_SCALE_POINTER",
                  lt.DescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &lt_b_scale,
                                      sizeof(lt_b_scale)));
  SUROGATE_LT_TRY("cublasLtMatmul", lt.Matmul(handle, plan->desc, alpha, b, plan->a, a, plan->b,
                                              beta, d, plan->d, d, plan->d, &plan->algo,
                                              spec.ws_bytes ? ws : nullptr, spec.ws_bytes, stream));
  return ffi::Error::Success();
}

#undef SUROGATE_LT_TRY

}  // namespace surogate::ffi_bind::lt

#endif  // SUROGATE_HAVE_CUBLASLT
