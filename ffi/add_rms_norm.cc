// XLA FFI handlers for the fused residual add + RMSNorm: check shapes/dtypes, pick the element
// type, call the launchers in kernels/add_rms_norm.h on XLA's stream. Python side:
// surogate_jax/ops/add_rms_norm.py.
//
//   surogate_add_rms_norm_fwd(x [..., D], res [..., D], w [G.., D]; eps: f32)
//       -> y [..., D], res_out [..., D], rstd [...] (f32)
//   surogate_add_rms_norm_bwd(dy [..., D], dres_out [..., D], res_out [..., D], w [G.., D],
//                             rstd [...])
//       -> dx [..., D], dw [G.., D], ws [.., P, D] (f32, dw partial sums, discarded)
// dx is the gradient of both x and res. ws is an output rather than XLA FFI scratch for the same
// reason as in ffi/rms_norm.cc; its P rows cap the backward's persistent grid. A leading batch
// shape G on w (vmap with broadcast_all) splits the rows into G equal consecutive groups, each
// with its own w row and dw row. All tensors but rstd and ws share one dtype (f32, bf16, f16).
// Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): the launchers only
// read device attributes (host-side, legal while XLA captures the stream) and enqueue kernels and
// async memsets; measured inside jitted train steps (benchmarks/kernels_in_model.py,
// tests/gpu/test_models_gpu.py).
#include <initializer_list>
#include <string>
#include <utility>

#include "ffi/ffi_common.h"
#include "kernels/add_rms_norm.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_add_rms_norm_fwd";
constexpr std::string_view kBwd = "surogate_add_rms_norm_bwd";

using Named = std::pair<const char*, const ffi::AnyBuffer*>;

ffi::Error WeightGroups(std::string_view op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                        int64_t rows, int64_t dim, int64_t* groups) {
  int64_t wrows = 0, wdim = 0;
  if (auto e = RowsAndDim(op, "w", w, &wrows, &wdim); e.failure()) return e;
  if (wdim != dim || wrows < 1 || rows % wrows != 0) {
    return InvalidArg(op, "w has shape " + ShapeStr(w) + ", expected [" + std::to_string(dim) +
                              "] (or a batch of such rows dividing x's rows) for x of shape " +
                              ShapeStr(x));
  }
  *groups = wrows;
  return ffi::Error::Success();
}

ffi::Error SameShapes(std::string_view op, const ffi::AnyBuffer& like, const char* like_name,
                      std::initializer_list<Named> bufs) {
  for (auto [name, b] : bufs) {
    if (!(b->dimensions() == like.dimensions())) {
      return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(*b) + " but " + like_name +
                                " has shape " + ShapeStr(like));
    }
  }
  return ffi::Error::Success();
}

ffi::Error SameDtypes(std::string_view op, ffi::DataType t, std::initializer_list<Named> bufs) {
  for (auto [name, b] : bufs) {
    if (auto e = ExpectDtype(op, name, *b, t); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error CheckRstd(std::string_view op, const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& x,
                     int64_t rows) {
  if (auto e = ExpectDtype(op, "rstd", rstd, ffi::DataType::F32); e.failure()) return e;
  if (static_cast<int64_t>(rstd.element_count()) != rows) {
    return InvalidArg(op, "rstd has shape " + ShapeStr(rstd) + ", expected " +
                              std::to_string(rows) + " elements for x of shape " + ShapeStr(x));
  }
  return ffi::Error::Success();
}

ffi::Error AddRmsNormFwd(cudaStream_t stream, float eps, ffi::AnyBuffer x, ffi::AnyBuffer res,
                         ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> res_out, ffi::Result<ffi::AnyBuffer> rstd) {
  int64_t rows = 0, dim = 0, groups = 1;
  if (auto e = RowsAndDim(kFwd, "x", x, &rows, &dim); e.failure()) return e;
  if (dim == 0) return InvalidArg(kFwd, "the normalized (last) dimension of x is empty");
  if (auto e = WeightGroups(kFwd, x, w, rows, dim, &groups); e.failure()) return e;
  const ffi::DataType t = x.element_type();
  if (auto e = SameDtypes(kFwd, t, {{"res", &res}, {"w", &w}, {"y", &*y}, {"res_out", &*res_out}});
      e.failure()) {
    return e;
  }
  if (auto e = SameShapes(kFwd, x, "x", {{"res", &res}, {"y", &*y}, {"res_out", &*res_out}});
      e.failure()) {
    return e;
  }
  if (auto e = CheckRstd(kFwd, *rstd, x, rows); e.failure()) return e;
  const int64_t per = rows / groups;
  return DispatchFloat(kFwd, t, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* rp = static_cast<const T*>(res.untyped_data());
    const T* wp = static_cast<const T*>(w.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    T* op = static_cast<T*>(res_out->untyped_data());
    float* sp = static_cast<float*>(rstd->untyped_data());
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t o = g * per * dim;
      const cudaError_t err = add_rms_norm_fwd<T>(xp + o, rp + o, wp + g * dim, yp + o, op + o,
                                                  sp + g * per, per, dim, eps, stream);
      if (err != cudaSuccess) return CudaError(kFwd, err);
    }
    return ffi::Error::Success();
  });
}

ffi::Error AddRmsNormBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dres_out,
                         ffi::AnyBuffer res_out, ffi::AnyBuffer w, ffi::AnyBuffer rstd,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                         ffi::Result<ffi::AnyBuffer> ws) {
  int64_t rows = 0, dim = 0, groups = 1;
  if (auto e = RowsAndDim(kBwd, "res_out", res_out, &rows, &dim); e.failure()) return e;
  if (dim == 0) return InvalidArg(kBwd, "the normalized (last) dimension of res_out is empty");
  if (auto e = WeightGroups(kBwd, res_out, w, rows, dim, &groups); e.failure()) return e;
  const ffi::DataType t = res_out.element_type();
  if (auto e = SameDtypes(
          kBwd, t, {{"dy", &dy}, {"dres_out", &dres_out}, {"w", &w}, {"dx", &*dx}, {"dw", &*dw}});
      e.failure()) {
    return e;
  }
  if (auto e = ExpectDtype(kBwd, "ws", *ws, ffi::DataType::F32); e.failure()) return e;
  if (auto e = SameShapes(kBwd, res_out, "res_out",
                          {{"dy", &dy}, {"dres_out", &dres_out}, {"dx", &*dx}});
      e.failure()) {
    return e;
  }
  if (auto e = SameShapes(kBwd, w, "w", {{"dw", &*dw}}); e.failure()) return e;
  if (auto e = CheckRstd(kBwd, rstd, res_out, rows); e.failure()) return e;
  const size_t ws_bytes = ws->element_count() * sizeof(float);
  if (ws_bytes < static_cast<size_t>(dim) * sizeof(float)) {
    return InvalidArg(kBwd, "ws has shape " + ShapeStr(*ws) + ", expected at least one row of " +
                                std::to_string(dim) + " floats");
  }
  const int64_t per = rows / groups;
  return DispatchFloat(kBwd, t, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    void* wsp = ws->untyped_data();
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* drp = static_cast<const T*>(dres_out.untyped_data());
    const T* sp = static_cast<const T*>(res_out.untyped_data());
    const T* wp = static_cast<const T*>(w.untyped_data());
    const float* rp = static_cast<const float*>(rstd.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    T* dwp = static_cast<T*>(dw->untyped_data());
    for (int64_t g = 0; g < groups; ++g) {  // groups run in stream order, so they share `ws`
      const int64_t o = g * per * dim;
      const cudaError_t err =
          add_rms_norm_bwd<T>(dyp + o, drp + o, sp + o, wp + g * dim, rp + g * per, dxp + o,
                              dwp + g * dim, per, dim, wsp, ws_bytes, stream);
      if (err != cudaSuccess) return CudaError(kBwd, err);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kAddRmsNormFwdHandler, AddRmsNormFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("eps")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // res
                            .Arg<ffi::AnyBuffer>()    // w
                            .Ret<ffi::AnyBuffer>()    // y
                            .Ret<ffi::AnyBuffer>()    // res_out
                            .Ret<ffi::AnyBuffer>());  // rstd

SUROGATE_DEFINE_HANDLER(kAddRmsNormBwdHandler, AddRmsNormBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // dy
                            .Arg<ffi::AnyBuffer>()    // dres_out
                            .Arg<ffi::AnyBuffer>()    // res_out
                            .Arg<ffi::AnyBuffer>()    // w
                            .Arg<ffi::AnyBuffer>()    // rstd
                            .Ret<ffi::AnyBuffer>()    // dx (= dres)
                            .Ret<ffi::AnyBuffer>()    // dw
                            .Ret<ffi::AnyBuffer>());  // ws (dw partial sums, discarded)

Targets AddRmsNormTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kAddRmsNormFwdHandler),
          SUROGATE_TARGET(kBwd.data(), kAddRmsNormBwdHandler)};
}

}  // namespace surogate::ffi_bind
