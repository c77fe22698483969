// XLA FFI handler for FP8 GEMMs through cuBLASLt (Python side: surogate_jax/ops/fp8_matmul.py).
//
//   surogate_fp8_gemm(a [.., M, K] f8, b [.., N, K] f8, a_scale f32[], b_scale f32[];
//                     fast_accum: i32) -> d [M, N] (float32 | bfloat16 | float16), ws u8[W]
//   d[m, n] = a_scale * b_scale * sum_k f32(a[m, k]) * f32(b[n, k])     (fp32 accumulation)
// a's and b's leading dims are flattened into M and N (row-major, K contiguous: the "TN" layout
// FP8 cuBLASLt requires on Hopper). a_scale / b_scale are DEQUANTIZATION factors (1 / the
// delayed-scaling scale) read from device memory at run time (CUBLASLT_MATMUL_DESC_{A,B}_
// SCALE_POINTER), so the scales never leave the GPU. fast_accum = 1 lets cuBLASLt accumulate
// in the tensor cores' reduced-precision FP8 accumulator (forward GEMM, as Transformer Engine
// does); 0 promotes partial sums to fp32 regularly ("split accumulation": dgrad and wgrad).
// E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 are supported (cuBLASLt has no E5M2 x E5M2).
// Requirements (cuBLASLt FP8): K and N multiples of 16, operands 16-byte aligned; M is free.
// ws is cuBLASLt's workspace, an output the caller discards (jax 0.11's GPU runtime refused FFI
// ScratchAllocator requests, see ffi/rms_norm.cc).
//
// Mapping to column-major cuBLASLt: D_cm [N, M] (= our row-major d) = op(A) B with A := b viewed
// col-major [K, N] (transa = T) and B := a viewed col-major [K, M] (transb = N), lda = ldb = K,
// ldd = N. So cuBLASLt's A scale is our b_scale and its B scale our a_scale.
//
// cuBLASLt is not linked: it is dlopen()ed at first use (ffi/cublaslt_api.h, shared with the
// NVFP4 GEMM in ffi/nvfp4_matmul.cc; SUROGATE_JAX_CUBLASLT may name the file). Descriptors, layouts
// and the heuristic's algorithm are cached per (device, shape, dtypes, fast_accum, alignments,
// workspace size); only the scale pointers change per call (under the plan's mutex).
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "ffi/cublaslt_api.h"
#include "ffi/ffi_common.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kGemm = "surogate_fp8_gemm";

std::string Dims(int64_t m, int64_t n, int64_t k) {
  return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

#if SUROGATE_HAVE_CUBLASLT

const lt::Api& Lt() { return lt::Get(); }

#define SUROGATE_LT_TRY(what, expr)                                       \
  do {                                                                    \
    const cublasStatus_t st_ = (expr);                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS) return lt::Error(kGemm, what, st_); \
  } while (0)

// One cached GEMM configuration. Never destroyed (a handful per model, for the process lifetime).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A, B, C = D
  cublasLtMatmulAlgo_t algo{};
  std::mutex mu;  // the scale pointers are set on the shared descriptor per call
};

using PlanKey =
    std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, int, int, size_t>;

cudaDataType_t LtType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN:
      return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2:
      return CUDA_R_8F_E5M2;
    case ffi::DataType::BF16:
      return CUDA_R_16BF;
    case ffi::DataType::F16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// Builds the plan for key (under the caller's lock): descriptors + the heuristic's best algorithm.
ffi::Error MakePlan(cublasLtHandle_t handle, const PlanKey& key, Plan* p) {
  const auto [device, m, n, k, ta, tb, td, fast, al_a, al_b, al_d, ws_bytes] = key;
  (void)device;
  const auto& lt = Lt();
  SUROGATE_LT_TRY("cublasLtMatmulDescCreate",
                  lt.DescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  const int8_t fast_accum = static_cast<int8_t>(fast);
  SUROGATE_LT_TRY("set TRANSA",
                  lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  SUROGATE_LT_TRY("set TRANSB",
                  lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  SUROGATE_LT_TRY("set FAST_ACCUM", lt.DescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                        &fast_accum, sizeof(fast_accum)));
  // cuBLASLt A = our b ([N, K] row-major = col-major K x N), B = our a (col-major K x M).
  const auto ta_lt = static_cast<cudaDataType_t>(tb), tb_lt = static_cast<cudaDataType_t>(ta);
  const auto td_lt = static_cast<cudaDataType_t>(td);
  SUROGATE_LT_TRY("layout A", lt.LayoutCreate(&p->a, ta_lt, k, n, k));
  SUROGATE_LT_TRY("layout B", lt.LayoutCreate(&p->b, tb_lt, k, m, k));
  SUROGATE_LT_TRY("layout D", lt.LayoutCreate(&p->d, td_lt, n, m, n));

  cublasLtMatmulPreference_t pref = nullptr;
  SUROGATE_LT_TRY("cublasLtMatmulPreferenceCreate", lt.PrefCreate(&pref));
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, decltype(lt.PrefDestroy)>
      guard(pref, lt.PrefDestroy);
  const uint64_t ws = ws_bytes;
  const uint32_t align_a = static_cast<uint32_t>(al_b), align_b = static_cast<uint32_t>(al_a),
                 align_d = static_cast<uint32_t>(al_d);
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
    return ffi::Error::Internal(std::string(kGemm) + ": cuBLASLt has no FP8 algorithm for " +
                                Dims(m, n, k) + " (workspace " + std::to_string(ws_bytes) +
                                " bytes, alignments " + std::to_string(al_a) + "/" +
                                std::to_string(al_b) + "/" + std::to_string(al_d) + ")");
  }
  p->algo = result.algo;
  return ffi::Error::Success();
}

ffi::Error GetPlan(cublasLtHandle_t handle, const PlanKey& key, Plan** out) {
  static std::mutex mu;
  static std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto p = std::make_unique<Plan>();
    if (auto e = MakePlan(handle, key, p.get()); e.failure()) return e;  // leaks the partial descs
    it = plans.emplace(key, std::move(p)).first;
  }
  *out = it->second.get();
  return ffi::Error::Success();
}

#endif  // SUROGATE_HAVE_CUBLASLT

bool IsFp8(ffi::DataType t) { return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2; }

ffi::Error Fp8Gemm(cudaStream_t stream, int32_t fast_accum, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> d,
                   ffi::Result<ffi::AnyBuffer> ws) {
  int64_t m = 0, k = 0, n = 0, kb = 0;
  if (auto e = RowsAndDim(kGemm, "a", a, &m, &k); e.failure()) return e;
  if (auto e = RowsAndDim(kGemm, "b", b, &n, &kb); e.failure()) return e;
  if (!IsFp8(a.element_type()) || !IsFp8(b.element_type())) {
    return InvalidArg(kGemm, "a and b must be float8_e4m3fn or float8_e5m2, got " +
                                 DtypeName(a.element_type()) + " and " +
                                 DtypeName(b.element_type()));
  }
  if (a.element_type() == ffi::DataType::F8E5M2 && b.element_type() == ffi::DataType::F8E5M2) {
    return InvalidArg(kGemm,
                      "cuBLASLt has no float8_e5m2 x float8_e5m2 GEMM; one operand must be "
                      "float8_e4m3fn");
  }
  if (kb != k) {
    return InvalidArg(kGemm, "a has shape " + ShapeStr(a) + " and b has shape " + ShapeStr(b) +
                                 ": their last (reduction) dims differ");
  }
  if (k % 16 != 0 || n % 16 != 0) {
    return InvalidArg(kGemm,
                      "FP8 cuBLASLt needs the reduction dim and the output columns to be "
                      "multiples of 16; got " +
                          Dims(m, n, k) + " (use the 'xla' backend, which pads, for such shapes)");
  }
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"a_scale", &a_scale},
                           {"b_scale", &b_scale}}) {
    if (auto e = ExpectDtype(kGemm, name, *buf, ffi::DataType::F32); e.failure()) return e;
    if (buf->element_count() != 1) {
      return InvalidArg(
          kGemm, std::string(name) + " has shape " + ShapeStr(*buf) + ", expected one element");
    }
  }
  const ffi::DataType td = d->element_type();
  if (td != ffi::DataType::F32 && td != ffi::DataType::BF16 && td != ffi::DataType::F16) {
    return InvalidArg(kGemm,
                      "d has dtype " + DtypeName(td) + ", expected float32, bfloat16 or float16");
  }
  if (static_cast<int64_t>(d->element_count()) != m * n) {
    return InvalidArg(kGemm, "d has shape " + ShapeStr(*d) + ", expected " + std::to_string(m) +
                                 " x " + std::to_string(n) + " elements");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    const size_t bytes = static_cast<size_t>(m * n) * (td == ffi::DataType::F32 ? 4 : 2);
    return CudaError(kGemm, cudaMemsetAsync(d->untyped_data(), 0, bytes, stream));
  }
  for (auto [name, p] : {std::pair<const char*, const void*>{"a", a.untyped_data()},
                         {"b", b.untyped_data()},
                         {"d", d->untyped_data()}}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return InvalidArg(kGemm,
                        std::string(name) + " is not 16-byte aligned, which FP8 cuBLASLt requires");
    }
  }
#if SUROGATE_HAVE_CUBLASLT
  const auto& lt = Lt();
  if (!lt.error.empty()) return ffi::Error::Internal(std::string(kGemm) + ": " + lt.error);
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(kGemm, err);
  cublasLtHandle_t handle = nullptr;
  if (auto e = lt::Handle(kGemm, device, &handle); e.failure()) return e;
  const size_t ws_bytes = ws->size_bytes();
  const PlanKey key{device,
                    m,
                    n,
                    k,
                    static_cast<int>(LtType(a.element_type())),
                    static_cast<int>(LtType(b.element_type())),
                    static_cast<int>(LtType(td)),
                    fast_accum != 0 ? 1 : 0,
                    lt::Alignment(a.untyped_data()),
                    lt::Alignment(b.untyped_data()),
                    lt::Alignment(d->untyped_data()),
                    ws_bytes};
  Plan* plan = nullptr;
  if (auto e = GetPlan(handle, key, &plan); e.failure()) return e;
  std::lock_guard<std::mutex> lock(plan->mu);
  const void* lt_a_scale = b_scale.untyped_data();  // cuBLASLt's A is our b
  const void* lt_b_scale = a_scale.untyped_data();
  SUROGATE_LT_TRY("set A_SCALE_POINTER",
                  lt.DescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &lt_a_scale,
                                      sizeof(lt_a_scale)));
  SUROGATE_LT_TRY("set B_SCALE_POINTER",
                  lt.DescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &lt_b_scale,
                                      sizeof(lt_b_scale)));
  const float alpha = 1.0f, beta = 0.0f;
  void* dp = d->untyped_data();
  SUROGATE_LT_TRY("cublasLtMatmul",
                  lt.Matmul(handle, plan->desc, &alpha, b.untyped_data(), plan->a, a.untyped_data(),
                            plan->b, &beta, dp, plan->d, dp, plan->d, &plan->algo,
                            ws_bytes ? ws->untyped_data() : nullptr, ws_bytes, stream));
  return ffi::Error::Success();
#else
  (void)stream;
  (void)fast_accum;
  (void)ws;
  return ffi::Error::Internal(
      std::string(kGemm) +
      ": the extension was built without cublasLt.h; "
      "rebuild with the CUDA toolkit's cuBLAS headers (or nvidia-cublas) present");
#endif
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kFp8GemmHandler, Fp8Gemm,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<int32_t>("fast_accum")
                            .Arg<ffi::AnyBuffer>()    // a
                            .Arg<ffi::AnyBuffer>()    // b
                            .Arg<ffi::AnyBuffer>()    // a_scale
                            .Arg<ffi::AnyBuffer>()    // b_scale
                            .Ret<ffi::AnyBuffer>()    // d
                            .Ret<ffi::AnyBuffer>());  // ws (cuBLASLt workspace, discarded)

Targets Fp8GemmTargets() { return {SUROGATE_TARGET(kGemm.data(), kFp8GemmHandler)}; }

}  // namespace surogate::ffi_bind
