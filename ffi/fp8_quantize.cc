// XLA FFI handlers for the FP8 delayed-scaling quantizers in kernels/fp8_quantize.h.
// Python side: surogate_jax/ops/fp8_matmul.py.
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
#include "ffi/ffi_common.h"
#include "kernels/fp8_quantize.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kQuant = "surogate_fp8_quantize";
constexpr std::string_view kQuantT = "surogate_fp8_quantize_t";
constexpr std::string_view kTranspose = "surogate_fp8_transpose";

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

Targets Fp8QuantizeTargets() {
  return {SUROGATE_TARGET(kQuant.data(), kFp8QuantizeHandler),
          SUROGATE_TARGET(kQuantT.data(), kFp8QuantizeTHandler),
          SUROGATE_TARGET(kTranspose.data(), kFp8TransposeHandler)};
}

}  // namespace surogate::ffi_bind
