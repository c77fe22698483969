// XLA FFI handlers for RMSNorm: check shapes/dtypes, pick the element type, call the launchers in
// kernels/rms_norm.h on XLA's stream. Python side: surogate_jax/ops/rms_norm.py.
//
//   surogate_rms_norm_fwd(x [..., D], w [G.., D]; eps: f32) -> y [..., D], rstd [...] (f32)
//   surogate_rms_norm_bwd(dy [..., D], x [..., D], w [G.., D], rstd [...])
//       -> dx [..., D], dw [G.., D], ws [.., P, D] (f32)
// ws holds the backward's per-block dw partial sums; it is an output (the caller discards it)
// rather than XLA FFI scratch, because jax 0.11's GPU runtime refused ScratchAllocator requests.
// Its P (rows of D floats) caps the backward's persistent grid.
//
// w normally has shape [D] (G = 1). Under jax.vmap the Python wrapper uses
// vmap_method="broadcast_all", which gives w (and dw) a leading batch shape: then the rows of x
// split into G equal consecutive groups, group g normalized with w[g] and summed into dw[g]
// (one launch per group). x, w, y, dy, dx and dw share one dtype (f32, bf16 or f16).
// Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): the launchers only
// read device attributes (host-side, legal while XLA captures the stream) and enqueue kernels and
// async memsets; measured inside jitted train steps (benchmarks/kernels_in_model.py,
// tests/gpu/test_models_gpu.py).
#include "ffi/ffi_common.h"
#include "kernels/rms_norm.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_rms_norm_fwd";
constexpr std::string_view kBwd = "surogate_rms_norm_bwd";

// Checks w ([G.., D]) against x ([..., D]) and returns G; rows must split evenly into G groups.
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

ffi::Error CheckSameShape(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                          const ffi::AnyBuffer& like, const char* like_name) {
  if (b.dimensions() == like.dimensions()) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + " but " + like_name +
                            " has shape " + ShapeStr(like));
}

ffi::Error RmsNormFwd(cudaStream_t stream, float eps, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> rstd) {
  int64_t rows = 0, dim = 0, groups = 1;
  if (auto e = RowsAndDim(kFwd, "x", x, &rows, &dim); e.failure()) return e;
  if (auto e = WeightGroups(kFwd, x, w, rows, dim, &groups); e.failure()) return e;
  const ffi::DataType t = x.element_type();
  if (auto e = ExpectDtype(kFwd, "w", w, t); e.failure()) return e;
  if (auto e = ExpectDtype(kFwd, "y", *y, t); e.failure()) return e;
  if (auto e = ExpectDtype(kFwd, "rstd", *rstd, ffi::DataType::F32); e.failure()) return e;
  if (auto e = CheckSameShape(kFwd, "y", *y, x, "x"); e.failure()) return e;
  if (static_cast<int64_t>(rstd->element_count()) != rows) {
    return InvalidArg(kFwd, "rstd has shape " + ShapeStr(*rstd) + ", expected " +
                                std::to_string(rows) + " elements for x of shape " + ShapeStr(x));
  }
  if (dim == 0) return InvalidArg(kFwd, "the normalized (last) dimension of x is empty");
  const int64_t per = rows / groups;
  return DispatchFloat(kFwd, t, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* wp = static_cast<const T*>(w.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    float* rp = static_cast<float*>(rstd->untyped_data());
    for (int64_t g = 0; g < groups; ++g) {
      const cudaError_t err = rms_norm_fwd<T>(xp + g * per * dim, wp + g * dim, yp + g * per * dim,
                                              rp + g * per, per, dim, eps, stream);
      if (err != cudaSuccess) return CudaError(kFwd, err);
    }
    return ffi::Error::Success();
  });
}

ffi::Error RmsNormBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> ws) {
  int64_t rows = 0, dim = 0, groups = 1;
  if (auto e = RowsAndDim(kBwd, "x", x, &rows, &dim); e.failure()) return e;
  if (auto e = WeightGroups(kBwd, x, w, rows, dim, &groups); e.failure()) return e;
  const ffi::DataType t = x.element_type();
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"dy", &dy},
                           {"w", &w},
                           {"dx", &*dx},
                           {"dw", &*dw}}) {
    if (auto e = ExpectDtype(kBwd, name, *buf, t); e.failure()) return e;
  }
  if (auto e = ExpectDtype(kBwd, "rstd", rstd, ffi::DataType::F32); e.failure()) return e;
  if (auto e = ExpectDtype(kBwd, "ws", *ws, ffi::DataType::F32); e.failure()) return e;
  if (auto e = CheckSameShape(kBwd, "dy", dy, x, "x"); e.failure()) return e;
  if (auto e = CheckSameShape(kBwd, "dx", *dx, x, "x"); e.failure()) return e;
  if (auto e = CheckSameShape(kBwd, "dw", *dw, w, "w"); e.failure()) return e;
  if (static_cast<int64_t>(rstd.element_count()) != rows) {
    return InvalidArg(kBwd, "rstd has shape " + ShapeStr(rstd) + ", expected " +
                                std::to_string(rows) + " elements for x of shape " + ShapeStr(x));
  }
  if (dim == 0) return InvalidArg(kBwd, "the normalized (last) dimension of x is empty");
  const int64_t per = rows / groups;
  return DispatchFloat(kBwd, t, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const size_t ws_bytes = ws->element_count() * sizeof(float);
    if (ws_bytes < static_cast<size_t>(dim) * sizeof(float)) {
      return InvalidArg(kBwd, "ws has shape " + ShapeStr(*ws) + ", expected at least one row of " +
                                  std::to_string(dim) + " floats");
    }
    void* wsp = ws->untyped_data();
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* wp = static_cast<const T*>(w.untyped_data());
    const float* rp = static_cast<const float*>(rstd.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    T* dwp = static_cast<T*>(dw->untyped_data());
    for (int64_t g = 0; g < groups; ++g) {  // groups run in stream order, so they share `ws`
      const int64_t o = g * per * dim;
      const cudaError_t err = rms_norm_bwd<T>(dyp + o, xp + o, wp + g * dim, rp + g * per, dxp + o,
                                              dwp + g * dim, per, dim, wsp, ws_bytes, stream);
      if (err != cudaSuccess) return CudaError(kBwd, err);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kRmsNormFwdHandler, RmsNormFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("eps")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // w
                            .Ret<ffi::AnyBuffer>()    // y
                            .Ret<ffi::AnyBuffer>());  // rstd

SUROGATE_DEFINE_HANDLER(kRmsNormBwdHandler, RmsNormBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // dy
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // w
                            .Arg<ffi::AnyBuffer>()    // rstd
                            .Ret<ffi::AnyBuffer>()    // dx
                            .Ret<ffi::AnyBuffer>()    // dw
                            .Ret<ffi::AnyBuffer>());  // ws (dw partial sums, discarded)

Targets RmsNormTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kRmsNormFwdHandler),
          SUROGATE_TARGET(kBwd.data(), kRmsNormBwdHandler)};
}

}  // namespace surogate::ffi_bind
