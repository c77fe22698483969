// XLA FFI handlers of the FP8 GEMM op (Python side: surogate_jax/ops/fp8_matmul.py): the
// delayed-scaling operand quantizers of kernels/fp8_matmul.h and the cuBLASLt FP8 GEMM.
//
//   surogate_fp8_quantize(x [..., C], scale f32[]) -> q [..., C] (f8e4m3fn | f8e5m2), amax f32[]
//   surogate_fp8_quantize_t(x [..., C], scale f32[]) -> q [..., C], qt [.., C, L] (same fp8 type),
//                                                        amax f32[]
// with R = the product of x's leading dims, qt viewed as [C, L] (L = its last dim, L >= R):
// qt[c, r] = q[r, c] and qt[c, r] = 0 for R <= r < L. The fp8 format is the dtype of q (and qt).
// x is float32, bfloat16 or float16; scale is the quantization scale (q = x * scale, saturated).
//
//   surogate_fp8_transpose(x [..., C] (f8e4m3fn | f8e5m2)) -> qt [C, L] (x's dtype), L >= R:
// qt[c, r] = x[r, c], 0 for R <= r < L; a byte copy (the transposed operand of an fp8 tensor that
// is already quantized, e.g. a frozen E4M3 weight; see ops/fp8_matmul.py "Frozen weights").
//
//   surogate_fp8_matmul(a [.., M, K] f8, b [.., N, K] f8, a_scale f32[], b_scale f32[];
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
// ScratchAllocator requests, see ffi/rms_norm.cc). cuBLASLt is dlopen()ed at first use
// (ffi/cublaslt_api.h; SUROGATE_JAX_CUBLASLT may name the file); the descriptor, layouts, plan
// cache and the mapping of our row-major GEMM onto column-major cuBLASLt are shared with the NVFP4
// GEMM in ffi/cublaslt_matmul.h.
#include <utility>

#include "ffi/cublaslt_matmul.h"
#include "ffi/ffi_common.h"
#include "kernels/fp8_matmul.h"

namespace surogate::ffi_bind {
namespace {

// ----------------------------------------------------------------------------------------------
// The operand quantizers

constexpr std::string_view kQuant = "surogate_fp8_quantize";
constexpr std::string_view kQuantT = "surogate_fp8_quantize_t";
constexpr std::string_view kTranspose = "surogate_fp8_transpose";
constexpr std::string_view kGemm = "surogate_fp8_matmul";

ffi::Error Fp8FormatOf(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                       Fp8Format* fmt) {
  switch (b.element_type()) {
    case ffi::DataType::F8E4M3FN:
      *fmt = Fp8Format::kE4M3;
      return ffi::Error::Success();
    case ffi::DataType::F8E5M2:
      *fmt = Fp8Format::kE5M2;
      return ffi::Error::Success();
    default:
      return InvalidArg(op, std::string(name) + " has dtype " + DtypeName(b.element_type()) +
                                ", expected float8_e4m3fn or float8_e5m2");
  }
}

ffi::Error CheckScalarF32(std::string_view op, const char* name, const ffi::AnyBuffer& b) {
  if (auto e = ExpectDtype(op, name, b, ffi::DataType::F32); e.failure()) return e;
  if (b.element_count() != 1) {
    return InvalidArg(op,
                      std::string(name) + " has shape " + ShapeStr(b) + ", expected one element");
  }
  return ffi::Error::Success();
}

ffi::Error Quantize(std::string_view op, cudaStream_t stream, const ffi::AnyBuffer& x,
                    const ffi::AnyBuffer& scale, ffi::AnyBuffer* q, ffi::AnyBuffer* qt,
                    ffi::AnyBuffer* amax) {
  int64_t rows = 0, cols = 0;
  if (auto e = RowsAndDim(op, "x", x, &rows, &cols); e.failure()) return e;
  if (auto e = CheckScalarF32(op, "scale", scale); e.failure()) return e;
  if (auto e = CheckScalarF32(op, "amax", *amax); e.failure()) return e;
  Fp8Format fmt;
  if (auto e = Fp8FormatOf(op, "q", *q, &fmt); e.failure()) return e;
  if (!(q->dimensions() == x.dimensions())) {
    return InvalidArg(op, "q has shape " + ShapeStr(*q) + " but x has shape " + ShapeStr(x));
  }
  int64_t ld_t = 0;
  if (qt != nullptr) {
    if (qt->element_type() != q->element_type()) {
      return InvalidArg(op, "qt has dtype " + DtypeName(qt->element_type()) + " but q has " +
                                DtypeName(q->element_type()));
    }
    const auto d = qt->dimensions();
    ld_t = d.size() == 0 ? 0 : d.back();
    if (d.size() < 2 || ld_t < rows || static_cast<int64_t>(qt->element_count()) != cols * ld_t) {
      return InvalidArg(op, "qt has shape " + ShapeStr(*qt) + ", expected [.., " +
                                std::to_string(cols) + ", L] with L >= " + std::to_string(rows) +
                                " for x of shape " + ShapeStr(x));
    }
  }
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = qt != nullptr ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr;
  auto* ap = static_cast<float*>(amax->untyped_data());
  const auto* sp = static_cast<const float*>(scale.untyped_data());
  return DispatchFloat(op, x.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    return CudaError(op, fp8_quantize<T>(xp, sp, rows, cols, fmt, qp, qtp, ld_t, ap, stream));
  });
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> amax) {
  return Quantize(kQuant, stream, x, scale, &*q, nullptr, &*amax);
}

ffi::Error QuantizeTImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                         ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                         ffi::Result<ffi::AnyBuffer> amax) {
  return Quantize(kQuantT, stream, x, scale, &*q, &*qt, &*amax);
}

ffi::Error TransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> qt) {
  const std::string_view op = kTranspose;
  int64_t rows = 0, cols = 0;
  if (auto e = RowsAndDim(op, "x", x, &rows, &cols); e.failure()) return e;
  Fp8Format fmt;
  if (auto e = Fp8FormatOf(op, "x", x, &fmt); e.failure()) return e;
  if (qt->element_type() != x.element_type()) {
    return InvalidArg(op, "qt has dtype " + DtypeName(qt->element_type()) + " but x has " +
                              DtypeName(x.element_type()) + "; the transpose keeps the fp8 type");
  }
  const auto d = qt->dimensions();
  if (d.size() != 2 || d[0] != cols || d[1] < rows) {
    return InvalidArg(op, "qt has shape " + ShapeStr(*qt) + ", expected [" + std::to_string(cols) +
                              ", L] with L >= " + std::to_string(rows) + " for x of shape " +
                              ShapeStr(x));
  }
  return CudaError(op, fp8_transpose(static_cast<const uint8_t*>(x.untyped_data()), rows, cols,
                                     static_cast<uint8_t*>(qt->untyped_data()), d[1], stream));
}

// ----------------------------------------------------------------------------------------------
// The GEMM

std::string Dims(int64_t m, int64_t n, int64_t k) {
  return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

#if SUROGATE_HAVE_CUBLASLT
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
#endif

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
    if (auto e = ExpectAligned16(kGemm, name, p, "FP8 cuBLASLt"); e.failure()) return e;
  }
#if SUROGATE_HAVE_CUBLASLT
  const auto& lt = lt::Get();
  if (!lt.error.empty()) return ffi::Error::Internal(std::string(kGemm) + ": " + lt.error);
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(kGemm, err);
  cublasLtHandle_t handle = nullptr;
  if (auto e = lt::Handle(kGemm, device, &handle); e.failure()) return e;
  lt::MatmulSpec spec;
  spec.device = device;
  spec.m = m;
  spec.n = n;
  spec.k = k;
  spec.a_type = LtType(a.element_type());
  spec.b_type = LtType(b.element_type());
  spec.d_type = LtType(td);
  spec.align_a = lt::Alignment(a.untyped_data());
  spec.align_b = lt::Alignment(b.untyped_data());
  spec.align_d = lt::Alignment(d->untyped_data());
  spec.ws_bytes = ws->size_bytes();
  spec.fast_accum = fast_accum != 0 ? 1 : 0;
  const float alpha = 1.0f, beta = 0.0f;
  return lt::Matmul(kGemm, handle, spec, a.untyped_data(), b.untyped_data(), a_scale.untyped_data(),
                    b_scale.untyped_data(), &alpha, &beta, d->untyped_data(), ws->untyped_data(),
                    stream);
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

SUROGATE_DEFINE_HANDLER(kFp8QuantizeHandler, QuantizeImpl,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // scale
                            .Ret<ffi::AnyBuffer>()    // q
                            .Ret<ffi::AnyBuffer>());  // amax

SUROGATE_DEFINE_HANDLER(kFp8QuantizeTHandler, QuantizeTImpl,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // scale
                            .Ret<ffi::AnyBuffer>()    // q
                            .Ret<ffi::AnyBuffer>()    // qt
                            .Ret<ffi::AnyBuffer>());  // amax

SUROGATE_DEFINE_HANDLER(kFp8TransposeHandler, TransposeImpl,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // x
                            .Ret<ffi::AnyBuffer>());  // qt

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

Targets Fp8MatmulTargets() {
  return {SUROGATE_TARGET(kQuant.data(), kFp8QuantizeHandler),
          SUROGATE_TARGET(kQuantT.data(), kFp8QuantizeTHandler),
          SUROGATE_TARGET(kTranspose.data(), kFp8TransposeHandler),
          SUROGATE_TARGET(kGemm.data(), kFp8GemmHandler)};
}

}  // namespace surogate::ffi_bind
