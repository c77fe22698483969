// XLA FFI handlers for SwiGLU: check shapes/dtypes, pick the element type, call the launchers in
// kernels/swiglu.h on XLA's stream. Python side: surogate_jax/ops/swiglu.py.
//
//   surogate_swiglu_fwd(gate [..., F], up [..., F]) -> h [..., F]
//   surogate_swiglu_bwd(dh [..., F], gate [..., F], up [..., F]) -> dgate [..., F], dup [..., F]
//   surogate_swiglu_packed_fwd(gate_up [..., 2F]) -> h [..., F]        (gate = first F columns)
//   surogate_swiglu_packed_bwd(dh [..., F], gate_up [..., 2F]) -> dgate_up [..., 2F]
// All operands share one dtype (f32, bf16 or f16). The op is element-wise, so any leading shape
// (including the batch axes vmap's broadcast_all adds) is just more rows.
// Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): the launchers only
// enqueue kernels on XLA's stream; measured inside jitted train steps
// (benchmarks/kernels_in_model.py, tests/gpu/test_models_gpu.py).
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "ffi/ffi_common.h"
#include "kernels/swiglu.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_swiglu_fwd";
constexpr std::string_view kBwd = "surogate_swiglu_bwd";
constexpr std::string_view kPackedFwd = "surogate_swiglu_packed_fwd";
constexpr std::string_view kPackedBwd = "surogate_swiglu_packed_bwd";

ffi::Error SameShape(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                     const ffi::AnyBuffer& like, const char* like_name) {
  if (b.dimensions() == like.dimensions()) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + " but " + like_name +
                            " has shape " + ShapeStr(like));
}

ffi::Error SameDtypes(std::string_view op, const ffi::AnyBuffer& like,
                      std::initializer_list<std::pair<const char*, const ffi::AnyBuffer*>> bufs) {
  for (auto [name, buf] : bufs) {
    if (auto e = ExpectDtype(op, name, *buf, like.element_type()); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// h [..., F] against gate_up [..., 2F]: same leading dims, last dim half.
ffi::Error HalfOf(std::string_view op, const char* name, const ffi::AnyBuffer& h,
                  const ffi::AnyBuffer& gu) {
  const auto hd = h.dimensions(), gd = gu.dimensions();
  bool ok = hd.size() == gd.size() && hd.size() >= 1 && gd.back() == 2 * hd.back();
  for (size_t i = 0; ok && i + 1 < hd.size(); ++i) ok = hd[i] == gd[i];
  if (ok) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(h) +
                            ", expected gate_up's shape " + ShapeStr(gu) +
                            " with the last dimension halved");
}

ffi::Error SwigluFwd(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                     ffi::Result<ffi::AnyBuffer> h) {
  int64_t rows = 0, F = 0;
  if (auto e = RowsAndDim(kFwd, "gate", gate, &rows, &F); e.failure()) return e;
  if (auto e = SameShape(kFwd, "up", up, gate, "gate"); e.failure()) return e;
  if (auto e = SameShape(kFwd, "h", *h, gate, "gate"); e.failure()) return e;
  if (auto e = SameDtypes(kFwd, gate, {{"up", &up}, {"h", &*h}}); e.failure()) return e;
  return DispatchFloat(kFwd, gate.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(kFwd, swiglu_fwd<T>(In<T>(gate), In<T>(up), Out<T>(h), rows, F, F, stream));
  });
}

ffi::Error SwigluBwd(cudaStream_t stream, ffi::AnyBuffer dh, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                     ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup) {
  int64_t rows = 0, F = 0;
  if (auto e = RowsAndDim(kBwd, "gate", gate, &rows, &F); e.failure()) return e;
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"dh", &dh},
                           {"up", &up},
                           {"dgate", &*dgate},
                           {"dup", &*dup}}) {
    if (auto e = SameShape(kBwd, name, *buf, gate, "gate"); e.failure()) return e;
  }
  if (auto e =
          SameDtypes(kBwd, gate, {{"dh", &dh}, {"up", &up}, {"dgate", &*dgate}, {"dup", &*dup}});
      e.failure()) {
    return e;
  }
  return DispatchFloat(kBwd, gate.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(kBwd, swiglu_bwd<T>(In<T>(dh), In<T>(gate), In<T>(up), Out<T>(dgate),
                                         Out<T>(dup), rows, F, F, stream));
  });
}

ffi::Error SwigluPackedFwd(cudaStream_t stream, ffi::AnyBuffer gate_up,
                           ffi::Result<ffi::AnyBuffer> h) {
  int64_t rows = 0, F2 = 0;
  if (auto e = RowsAndDim(kPackedFwd, "gate_up", gate_up, &rows, &F2); e.failure()) return e;
  if (F2 % 2 != 0) {
    return InvalidArg(kPackedFwd, "gate_up has shape " + ShapeStr(gate_up) +
                                      "; its last dimension (2F) must be even");
  }
  if (auto e = HalfOf(kPackedFwd, "h", *h, gate_up); e.failure()) return e;
  if (auto e = SameDtypes(kPackedFwd, gate_up, {{"h", &*h}}); e.failure()) return e;
  const int64_t F = F2 / 2;
  return DispatchFloat(kPackedFwd, gate_up.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* gu = In<T>(gate_up);
    return CudaError(kPackedFwd, swiglu_fwd<T>(gu, gu + F, Out<T>(h), rows, F, F2, stream));
  });
}

ffi::Error SwigluPackedBwd(cudaStream_t stream, ffi::AnyBuffer dh, ffi::AnyBuffer gate_up,
                           ffi::Result<ffi::AnyBuffer> dgate_up) {
  int64_t rows = 0, F2 = 0;
  if (auto e = RowsAndDim(kPackedBwd, "gate_up", gate_up, &rows, &F2); e.failure()) return e;
  if (F2 % 2 != 0) {
    return InvalidArg(kPackedBwd, "gate_up has shape " + ShapeStr(gate_up) +
                                      "; its last dimension (2F) must be even");
  }
  if (auto e = HalfOf(kPackedBwd, "dh", dh, gate_up); e.failure()) return e;
  if (auto e = SameShape(kPackedBwd, "dgate_up", *dgate_up, gate_up, "gate_up"); e.failure()) {
    return e;
  }
  if (auto e = SameDtypes(kPackedBwd, gate_up, {{"dh", &dh}, {"dgate_up", &*dgate_up}});
      e.failure()) {
    return e;
  }
  const int64_t F = F2 / 2;
  return DispatchFloat(kPackedBwd, gate_up.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* gu = In<T>(gate_up);
    T* dgu = Out<T>(dgate_up);
    return CudaError(kPackedBwd,
                     swiglu_bwd<T>(In<T>(dh), gu, gu + F, dgu, dgu + F, rows, F, F2, stream));
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kSwigluFwdHandler, SwigluFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // gate
                            .Arg<ffi::AnyBuffer>()    // up
                            .Ret<ffi::AnyBuffer>());  // h

SUROGATE_DEFINE_HANDLER(kSwigluBwdHandler, SwigluBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // dh
                            .Arg<ffi::AnyBuffer>()    // gate
                            .Arg<ffi::AnyBuffer>()    // up
                            .Ret<ffi::AnyBuffer>()    // dgate
                            .Ret<ffi::AnyBuffer>());  // dup

SUROGATE_DEFINE_HANDLER(kSwigluPackedFwdHandler, SwigluPackedFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // gate_up
                            .Ret<ffi::AnyBuffer>());  // h

SUROGATE_DEFINE_HANDLER(kSwigluPackedBwdHandler, SwigluPackedBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // dh
                            .Arg<ffi::AnyBuffer>()    // gate_up
                            .Ret<ffi::AnyBuffer>());  // dgate_up

Targets SwigluTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kSwigluFwdHandler),
          SUROGATE_TARGET(kBwd.data(), kSwigluBwdHandler),
          SUROGATE_TARGET(kPackedFwd.data(), kSwigluPackedFwdHandler),
          SUROGATE_TARGET(kPackedBwd.data(), kSwigluPackedBwdHandler)};
}

}  // namespace surogate::ffi_bind
