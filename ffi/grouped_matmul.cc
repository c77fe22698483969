// XLA FFI handlers for the MoE grouped GEMMs: check shapes and dtypes, call the launchers in
// kernels/grouped_matmul.h on XLA's stream. Python side: surogate_jax/ops/grouped_matmul.py.
//
//   surogate_grouped_matmul(x [rows, K], w [E, K, N] | [E, N, K] (w_nk), offsets [E + 1] int32)
//       -> y [rows, N]
//   surogate_grouped_matmul_dw(x [rows, M], dy [rows, N], offsets [E + 1] int32) -> dw [E, M, N]
//   surogate_grouped_matmul_fp8(xq [rows, K] f8e4m3fn | f8e5m2, wq f8e4m3fn [E, N, K] | [N, E, K]
//       (w_nek), offsets [E + 1] int32, x_inv f32 [], w_inv f32 [E]) -> y [rows, N] bf16
// bf16 operands; K, M, N multiples of 8 (the fp8 K of 16). Graph-safe: the launchers only enqueue
// kernels (the dynamic shared-memory attribute is set once per process, outside any stream).
#include <initializer_list>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "ffi/ffi_common.h"
#include "kernels/grouped_matmul.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_grouped_matmul";
constexpr std::string_view kDw = "surogate_grouped_matmul_dw";
constexpr std::string_view kFp8 = "surogate_grouped_matmul_fp8";

ffi::Error Rank(std::string_view op, const char* name, const ffi::AnyBuffer& b, size_t rank) {
  if (b.dimensions().size() == rank) return ffi::Error::Success();
  return InvalidArg(
      op, std::string(name) + " must have rank " + std::to_string(rank) + ", got " + ShapeStr(b));
}

ffi::Error Bf16(std::string_view op,
                std::initializer_list<std::pair<const char*, const ffi::AnyBuffer*>> bufs) {
  for (auto [name, buf] : bufs) {
    if (auto e = ExpectDtype(op, name, *buf, ffi::DataType::BF16); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error Offsets(std::string_view op, const ffi::AnyBuffer& offsets, int64_t E) {
  if (auto e = ExpectDtype(op, "offsets", offsets, ffi::DataType::S32); e.failure()) return e;
  return ExpectCount(op, "offsets", offsets, E + 1, "one per expert plus one");
}

ffi::Error Mult8(std::string_view op, const char* what, int64_t v) {
  if (v % 8 == 0) return ffi::Error::Success();
  return InvalidArg(op, std::string(what) + " must be a multiple of 8, got " + std::to_string(v));
}

ffi::Error GroupedMatmul(cudaStream_t stream, bool w_nk, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y) {
  for (auto [name, buf, rank] : {std::tuple<const char*, const ffi::AnyBuffer*, size_t>{"x", &x, 2},
                                 {"w", &w, 3},
                                 {"y", &*y, 2}}) {
    if (auto e = Rank(kFwd, name, *buf, rank); e.failure()) return e;
  }
  if (auto e = Bf16(kFwd, {{"x", &x}, {"w", &w}, {"y", &*y}}); e.failure()) return e;
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t rows = xd[0], K = xd[1], E = wd[0], N = w_nk ? wd[1] : wd[2];
  if ((w_nk ? wd[2] : wd[1]) != K || yd[0] != rows || yd[1] != N) {
    return InvalidArg(kFwd, "shapes x " + ShapeStr(x) + ", w " + ShapeStr(w) + " (w_nk=" +
                                std::to_string(w_nk) + "), y " + ShapeStr(*y) + " do not agree");
  }
  if (auto e = Offsets(kFwd, offsets, E); e.failure()) return e;
  if (auto e = Mult8(kFwd, "K", K); e.failure()) return e;
  if (auto e = Mult8(kFwd, "N", N); e.failure()) return e;
  return CudaError(kFwd,
                   grouped_matmul(In<__nv_bfloat16>(x), In<__nv_bfloat16>(w), In<int32_t>(offsets),
                                  Out<__nv_bfloat16>(y), rows, K, N, E, w_nk, stream));
}

ffi::Error GroupedMatmulDw(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                           ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dw) {
  for (auto [name, buf, rank] : {std::tuple<const char*, const ffi::AnyBuffer*, size_t>{"x", &x, 2},
                                 {"dy", &dy, 2},
                                 {"dw", &*dw, 3}}) {
    if (auto e = Rank(kDw, name, *buf, rank); e.failure()) return e;
  }
  if (auto e = Bf16(kDw, {{"x", &x}, {"dy", &dy}, {"dw", &*dw}}); e.failure()) return e;
  const auto xd = x.dimensions(), dd = dy.dimensions(), wd = dw->dimensions();
  const int64_t rows = xd[0], M = xd[1], N = dd[1], E = wd[0];
  if (dd[0] != rows || wd[1] != M || wd[2] != N) {
    return InvalidArg(kDw, "shapes x " + ShapeStr(x) + ", dy " + ShapeStr(dy) + ", dw " +
                               ShapeStr(*dw) + " do not agree");
  }
  if (auto e = Offsets(kDw, offsets, E); e.failure()) return e;
  if (auto e = Mult8(kDw, "M", M); e.failure()) return e;
  if (auto e = Mult8(kDw, "N", N); e.failure()) return e;
  return CudaError(
      kDw, grouped_matmul_dw(In<__nv_bfloat16>(x), In<__nv_bfloat16>(dy), In<int32_t>(offsets),
                             Out<__nv_bfloat16>(dw), M, N, E, stream));
}

ffi::Error GroupedMatmulFp8(cudaStream_t stream, bool w_nek, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::AnyBuffer offsets, ffi::AnyBuffer x_inv, ffi::AnyBuffer w_inv,
                            ffi::Result<ffi::AnyBuffer> y) {
  for (auto [name, buf, rank] : {std::tuple<const char*, const ffi::AnyBuffer*, size_t>{"x", &x, 2},
                                 {"w", &w, 3},
                                 {"y", &*y, 2}}) {
    if (auto e = Rank(kFp8, name, *buf, rank); e.failure()) return e;
  }
  const bool x_e5m2 = x.element_type() == ffi::DataType::F8E5M2;
  if (!x_e5m2) {
    if (auto e = ExpectDtype(kFp8, "x", x, ffi::DataType::F8E4M3FN); e.failure()) return e;
  }
  if (auto e = ExpectDtype(kFp8, "w", w, ffi::DataType::F8E4M3FN); e.failure()) return e;
  if (auto e = ExpectDtype(kFp8, "y", *y, ffi::DataType::BF16); e.failure()) return e;
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t rows = xd[0], K = xd[1], E = w_nek ? wd[1] : wd[0], N = w_nek ? wd[0] : wd[1];
  if (wd[2] != K || yd[0] != rows || yd[1] != N) {
    return InvalidArg(kFp8, "shapes x " + ShapeStr(x) + ", w " + ShapeStr(w) + " (w_nek=" +
                                std::to_string(w_nek) + "), y " + ShapeStr(*y) + " do not agree");
  }
  if (auto e = Offsets(kFp8, offsets, E); e.failure()) return e;
  for (auto [name, buf, count] :
       {std::tuple<const char*, const ffi::AnyBuffer*, int64_t>{"x_inv", &x_inv, 1},
        {"w_inv", &w_inv, E}}) {
    if (auto e = ExpectDtype(kFp8, name, *buf, ffi::DataType::F32); e.failure()) return e;
    if (auto e = ExpectCount(kFp8, name, *buf, count, "scales"); e.failure()) return e;
  }
  if (K % 16) return InvalidArg(kFp8, "K must be a multiple of 16, got " + std::to_string(K));
  if (auto e = Mult8(kFp8, "N", N); e.failure()) return e;
  return CudaError(kFp8,
                   grouped_matmul_fp8(static_cast<const uint8_t*>(x.untyped_data()), x_e5m2,
                                      static_cast<const uint8_t*>(w.untyped_data()), w_nek,
                                      In<int32_t>(offsets), In<float>(x_inv), In<float>(w_inv),
                                      Out<__nv_bfloat16>(y), rows, K, N, E, stream));
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kGroupedMatmulHandler, GroupedMatmul,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<bool>("w_nk")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // w
                            .Arg<ffi::AnyBuffer>()    // offsets
                            .Ret<ffi::AnyBuffer>());  // y

SUROGATE_DEFINE_HANDLER(kGroupedMatmulDwHandler, GroupedMatmulDw,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // dy
                            .Arg<ffi::AnyBuffer>()    // offsets
                            .Ret<ffi::AnyBuffer>());  // dw

SUROGATE_DEFINE_HANDLER(kGroupedMatmulFp8Handler, GroupedMatmulFp8,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<bool>("w_nek")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // w
                            .Arg<ffi::AnyBuffer>()    // offsets
                            .Arg<ffi::AnyBuffer>()    // x_inv
                            .Arg<ffi::AnyBuffer>()    // w_inv
                            .Ret<ffi::AnyBuffer>());  // y

Targets GroupedMatmulTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kGroupedMatmulHandler),
          SUROGATE_TARGET(kDw.data(), kGroupedMatmulDwHandler),
          SUROGATE_TARGET(kFp8.data(), kGroupedMatmulFp8Handler)};
}

}  // namespace surogate::ffi_bind
