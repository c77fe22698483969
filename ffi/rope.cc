// XLA FFI handlers for RoPE (optionally fused with the per-head RMSNorm in front of it): check
// shapes/dtypes, pick the element type, call the launchers in kernels/rope.h on XLA's stream.
// Python side: surogate_jax/ops/rope.py.
//
//   surogate_rope_fwd(x [..., H, K], a, b, w; eps: f32, norm: i32, inverse: i32) -> y [..., H, K]
//   surogate_rope_bwd(dy [..., H, K], x [..., H, K], a, b, w; eps: f32)
//       -> dx [..., H, K], dw [G.., K], ws [P, K] (f32)
//   surogate_rope_qk_fwd(q, k, a, b, wq, wk; eps, norm, inverse) -> yq, yk
//   surogate_rope_qk_bwd(dyq, dyk, q, k, a, b, wq, wk; eps) -> dq, dk, dwq, dwk, ws
//       the same for q [..., Hq, K] and k [..., Hk, K] of a layer (same leading dims, angles and
//       K), in one launch each way (kernels/rope.h rope_fwd_pair / rope_norm_bwd_pair).
// The angle source is told by a's dtype:
//   int32 a: positions mode, a = positions [...] (x's leading dims), b = inv_freq [G.., K/2] f32;
//   f32 a  : table mode, a = cos, b = sin, both [..., S] f32 with S >= K/2 (the first K/2 entries
//            of each token's row are used, so HF-style [..., K] tables work as they are).
// norm != 0: y = rope(x * rsqrt(mean(x^2) + eps) * w), w [G.., K] in x's dtype; norm == 0: w is
// ignored (any shape). inverse != 0 rotates by -angle (the rotation's backward).
// surogate_rope_bwd is the backward of the fused norm + rope (the rotation-only backward is
// surogate_rope_fwd with inverse = 1). ws holds the per-block dw partial sums; it is an output
// the caller discards rather than XLA FFI scratch (jax 0.11's GPU runtime refused
// ScratchAllocator requests). Its P (rows of K floats) caps the backward's grid.
//
// Leading group dims G on inv_freq / w appear under jax.vmap (vmap_method="broadcast_all"): the
// tokens then split into G equal consecutive groups, group g using inv_freq[g] / w[g] and summing
// into dw[g] (one launch per group).
// Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): the launchers only
// read device attributes (host-side, legal while XLA captures the stream) and enqueue kernels and
// async memsets; measured inside jitted train steps (benchmarks/kernels_in_model.py,
// tests/gpu/test_models_gpu.py).
#include <algorithm>
#include <tuple>

#include "ffi/ffi_common.h"
#include "kernels/rope.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_rope_fwd";
constexpr std::string_view kBwd = "surogate_rope_bwd";
constexpr std::string_view kQkFwd = "surogate_rope_qk_fwd";
constexpr std::string_view kQkBwd = "surogate_rope_qk_bwd";

// What the handlers need to know about one call, validated.
struct RopeCall {
  int64_t tokens = 0, heads = 0, dim = 0, half = 0;
  bool by_positions = false;
  int64_t stride = 0;       // table mode: floats per token in cos / sin
  int64_t freq_groups = 1;  // positions mode: inv_freq rows
  int64_t w_groups = 1;     // norm: w rows
  int64_t groups = 1;       // launches
};

// D: the span type AnyBuffer::dimensions() returns (spelled through a template for portability
// across jax versions' ffi.h).
template <typename D>
std::string DimsStr(const D& d, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

template <typename D>
bool LeadingDimsEqual(const D& a, size_t na, const D& b, size_t nb) {
  if (na != nb) return false;
  for (size_t i = 0; i < na; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Rows of a [G.., n] buffer whose last dim must be n; G must divide tokens.
ffi::Error GroupRows(std::string_view op, const char* name, const ffi::AnyBuffer& b, int64_t n,
                     int64_t tokens, int64_t* groups) {
  int64_t rows = 0, last = 0;
  if (auto e = RowsAndDim(op, name, b, &rows, &last); e.failure()) return e;
  if (last != n || rows < 1 || (tokens > 0 && tokens % rows != 0)) {
    return InvalidArg(
        op, std::string(name) + " has shape " + ShapeStr(b) + ", expected [" + std::to_string(n) +
                "] (or a batch of such rows dividing the tokens, " + std::to_string(tokens) + ")");
  }
  *groups = rows;
  return ffi::Error::Success();
}

ffi::Error Inspect(std::string_view op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
                   const ffi::AnyBuffer& b, const ffi::AnyBuffer* w, RopeCall* c) {
  const auto xd = x.dimensions();
  if (xd.size() < 2) return InvalidArg(op, "x must be [..., heads, head_dim], got " + ShapeStr(x));
  c->dim = xd[xd.size() - 1];
  c->heads = xd[xd.size() - 2];
  c->half = c->dim / 2;
  c->tokens = 1;
  for (size_t i = 0; i + 2 < xd.size(); ++i) c->tokens *= xd[i];
  if (c->dim <= 0 || c->dim % 2 != 0 || c->dim > rope_max_head_dim()) {
    return InvalidArg(op, "head_dim (last dim of x " + ShapeStr(x) + ") must be even and in [2, " +
                              std::to_string(rope_max_head_dim()) + "]");
  }
  if (c->heads <= 0) return InvalidArg(op, "x " + ShapeStr(x) + " has no heads");
  const size_t lead = xd.size() - 2;
  if (a.element_type() == ffi::DataType::S32) {
    c->by_positions = true;
    if (!LeadingDimsEqual(a.dimensions(), a.dimensions().size(), xd, lead)) {
      return InvalidArg(op, "positions has shape " + ShapeStr(a) + ", expected " +
                                DimsStr(xd, lead) + " (x's dims before heads, head_dim)");
    }
    if (auto e = ExpectDtype(op, "inv_freq", b, ffi::DataType::F32); e.failure()) return e;
    if (auto e = GroupRows(op, "inv_freq", b, c->half, c->tokens, &c->freq_groups); e.failure()) {
      return e;
    }
  } else if (a.element_type() == ffi::DataType::F32) {
    const auto ad = a.dimensions();
    if (ad.size() != lead + 1 || !LeadingDimsEqual(ad, lead, xd, lead) || ad[lead] < c->half) {
      return InvalidArg(op, "cos table has shape " + ShapeStr(a) + ", expected " +
                                DimsStr(xd, lead) +
                                " + [S] with S >= head_dim / 2 = " + std::to_string(c->half));
    }
    if (auto e = ExpectDtype(op, "sin table", b, ffi::DataType::F32); e.failure()) return e;
    if (!(b.dimensions() == ad)) {
      return InvalidArg(op, "sin table has shape " + ShapeStr(b) + " but cos has " + ShapeStr(a));
    }
    c->stride = ad[lead];
  } else {
    return InvalidArg(op,
                      "the angle source must be int32 positions or float32 cos/sin tables, "
                      "got " +
                          DtypeName(a.element_type()));
  }
  if (w != nullptr) {
    if (auto e = ExpectDtype(op, "w", *w, x.element_type()); e.failure()) return e;
    if (auto e = GroupRows(op, "w", *w, c->dim, c->tokens, &c->w_groups); e.failure()) return e;
  }
  c->groups = std::max(c->freq_groups, c->w_groups);
  if ((c->freq_groups != 1 && c->freq_groups != c->groups) ||
      (c->w_groups != 1 && c->w_groups != c->groups)) {
    return InvalidArg(op, "inv_freq has " + std::to_string(c->freq_groups) + " rows and w " +
                              std::to_string(c->w_groups) + "; batched rows must agree");
  }
  return ffi::Error::Success();
}

// The angle source of token group g.
RopeAngles AnglesOf(const RopeCall& c, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                    int64_t g) {
  RopeAngles ang;
  const int64_t t0 = g * (c.tokens / c.groups);
  if (c.by_positions) {
    ang.positions = static_cast<const int32_t*>(a.untyped_data()) + t0;
    ang.inv_freq =
        static_cast<const float*>(b.untyped_data()) + (c.freq_groups > 1 ? g * c.half : 0);
  } else {
    ang.cos = static_cast<const float*>(a.untyped_data()) + t0 * c.stride;
    ang.sin = static_cast<const float*>(b.untyped_data()) + t0 * c.stride;
    ang.stride = c.stride;
  }
  return ang;
}

ffi::Error CheckSameShape(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                          const ffi::AnyBuffer& like, const char* like_name) {
  if (b.dimensions() == like.dimensions()) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + " but " + like_name +
                            " has shape " + ShapeStr(like));
}

ffi::Error RopeFwd(cudaStream_t stream, float eps, int32_t norm, int32_t inverse, ffi::AnyBuffer x,
                   ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> y) {
  RopeCall c;
  if (auto e = Inspect(kFwd, x, a, b, norm ? &w : nullptr, &c); e.failure()) return e;
  if (auto e = ExpectDtype(kFwd, "y", *y, x.element_type()); e.failure()) return e;
  if (auto e = CheckSameShape(kFwd, "y", *y, x, "x"); e.failure()) return e;
  const int64_t per = c.tokens / c.groups, row = c.heads * c.dim;
  return DispatchFloat(kFwd, x.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* wp = norm ? static_cast<const T*>(w.untyped_data()) : nullptr;
    T* yp = static_cast<T*>(y->untyped_data());
    for (int64_t g = 0; g < c.groups; ++g) {
      const cudaError_t err =
          rope_fwd<T>(xp + g * per * row, yp + g * per * row, AnglesOf(c, a, b, g),
                      wp == nullptr ? nullptr : wp + (c.w_groups > 1 ? g * c.dim : 0), per, c.heads,
                      c.dim, eps, inverse != 0, stream);
      if (err != cudaSuccess) return CudaError(kFwd, err);
    }
    return ffi::Error::Success();
  });
}

ffi::Error RopeBwd(cudaStream_t stream, float eps, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                   ffi::Result<ffi::AnyBuffer> ws) {
  RopeCall c;
  if (auto e = Inspect(kBwd, x, a, b, &w, &c); e.failure()) return e;
  const ffi::DataType t = x.element_type();
  for (auto [name, buf] :
       {std::pair<const char*, const ffi::AnyBuffer*>{"dy", &dy}, {"dx", &*dx}, {"dw", &*dw}}) {
    if (auto e = ExpectDtype(kBwd, name, *buf, t); e.failure()) return e;
  }
  if (auto e = ExpectDtype(kBwd, "ws", *ws, ffi::DataType::F32); e.failure()) return e;
  if (auto e = CheckSameShape(kBwd, "dy", dy, x, "x"); e.failure()) return e;
  if (auto e = CheckSameShape(kBwd, "dx", *dx, x, "x"); e.failure()) return e;
  if (auto e = CheckSameShape(kBwd, "dw", *dw, w, "w"); e.failure()) return e;
  if (c.w_groups != c.groups) {
    return InvalidArg(kBwd, "w has " + std::to_string(c.w_groups) + " rows but inv_freq " +
                                std::to_string(c.freq_groups) + "; dw needs one row per group");
  }
  const size_t ws_bytes = ws->element_count() * sizeof(float);
  if (ws_bytes < static_cast<size_t>(c.dim) * sizeof(float)) {
    return InvalidArg(kBwd, "ws has shape " + ShapeStr(*ws) + ", expected at least one row of " +
                                std::to_string(c.dim) + " floats");
  }
  const int64_t per = c.tokens / c.groups, row = c.heads * c.dim;
  return DispatchFloat(kBwd, t, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* wp = static_cast<const T*>(w.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    T* dwp = static_cast<T*>(dw->untyped_data());
    for (int64_t g = 0; g < c.groups; ++g) {  // groups run in stream order, so they share `ws`
      const int64_t o = g * per * row;
      const cudaError_t err = rope_norm_bwd<T>(
          dyp + o, xp + o, AnglesOf(c, a, b, g), wp + g * c.dim, dxp + o, dwp + g * c.dim, per,
          c.heads, c.dim, eps, ws->untyped_data(), ws_bytes, stream);
      if (err != cudaSuccess) return CudaError(kBwd, err);
    }
    return ffi::Error::Success();
  });
}

// q and k of a layer (surogate_rope_qk_*): both inspected as single calls, then required to agree
// on everything but heads and w.
ffi::Error InspectPair(std::string_view op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                       const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer* wq,
                       const ffi::AnyBuffer* wk, RopeCall* cq, RopeCall* ck) {
  if (auto e = Inspect(op, q, a, b, wq, cq); e.failure()) return e;
  if (q.element_type() != k.element_type()) {
    return InvalidArg(
        op, "q is " + DtypeName(q.element_type()) + " but k is " + DtypeName(k.element_type()));
  }
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (kd.size() != qd.size() || !LeadingDimsEqual(qd, qd.size() - 2, kd, kd.size() - 2) ||
      qd[qd.size() - 1] != kd[kd.size() - 1]) {
    return InvalidArg(op, "q " + ShapeStr(q) + " and k " + ShapeStr(k) +
                              " must share the leading dims and head_dim (heads may differ)");
  }
  if (auto e = Inspect(op, k, a, b, wk, ck); e.failure()) return e;
  if (cq->groups != ck->groups || cq->w_groups != ck->w_groups) {
    return InvalidArg(op, "wq and wk must have the same number of rows");
  }
  return ffi::Error::Success();
}

ffi::Error RopeQkFwd(cudaStream_t stream, float eps, int32_t norm, int32_t inverse,
                     ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::AnyBuffer wq, ffi::AnyBuffer wk, ffi::Result<ffi::AnyBuffer> yq,
                     ffi::Result<ffi::AnyBuffer> yk) {
  RopeCall cq, ck;
  if (auto e =
          InspectPair(kQkFwd, q, k, a, b, norm ? &wq : nullptr, norm ? &wk : nullptr, &cq, &ck);
      e.failure()) {
    return e;
  }
  for (auto [name, out, like] :
       {std::tuple<const char*, const ffi::AnyBuffer*, const ffi::AnyBuffer*>{"yq", &*yq, &q},
        {"yk", &*yk, &k}}) {
    if (auto e = ExpectDtype(kQkFwd, name, *out, q.element_type()); e.failure()) return e;
    if (auto e = CheckSameShape(kQkFwd, name, *out, *like, name[1] == 'q' ? "q" : "k"); e.failure())
      return e;
  }
  const int64_t per = cq.tokens / cq.groups, rq = cq.heads * cq.dim, rk = ck.heads * ck.dim;
  return DispatchFloat(kQkFwd, q.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    for (int64_t g = 0; g < cq.groups; ++g) {
      const int64_t wo = cq.w_groups > 1 ? g * cq.dim : 0;
      RopeTensor<T> t0, t1;
      t0.x = static_cast<const T*>(q.untyped_data()) + g * per * rq;
      t0.out = static_cast<T*>(yq->untyped_data()) + g * per * rq;
      t0.w = norm ? static_cast<const T*>(wq.untyped_data()) + wo : nullptr;
      t0.heads = cq.heads;
      t1.x = static_cast<const T*>(k.untyped_data()) + g * per * rk;
      t1.out = static_cast<T*>(yk->untyped_data()) + g * per * rk;
      t1.w = norm ? static_cast<const T*>(wk.untyped_data()) + wo : nullptr;
      t1.heads = ck.heads;
      const cudaError_t err =
          rope_fwd_pair<T>(t0, t1, AnglesOf(cq, a, b, g), per, cq.dim, eps, inverse != 0, stream);
      if (err != cudaSuccess) return CudaError(kQkFwd, err);
    }
    return ffi::Error::Success();
  });
}

ffi::Error RopeQkBwd(cudaStream_t stream, float eps, ffi::AnyBuffer dyq, ffi::AnyBuffer dyk,
                     ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::AnyBuffer wq, ffi::AnyBuffer wk, ffi::Result<ffi::AnyBuffer> dq,
                     ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dwq,
                     ffi::Result<ffi::AnyBuffer> dwk, ffi::Result<ffi::AnyBuffer> ws) {
  RopeCall cq, ck;
  if (auto e = InspectPair(kQkBwd, q, k, a, b, &wq, &wk, &cq, &ck); e.failure()) return e;
  if (cq.w_groups != cq.groups) {
    return InvalidArg(kQkBwd, "wq has " + std::to_string(cq.w_groups) + " rows but inv_freq " +
                                  std::to_string(cq.freq_groups) + "; dw needs one row per group");
  }
  const ffi::DataType t = q.element_type();
  using Check = std::tuple<const char*, const ffi::AnyBuffer*, const ffi::AnyBuffer*, const char*>;
  for (auto [name, buf, like, like_name] :
       {Check{"dyq", &dyq, &q, "q"}, Check{"dyk", &dyk, &k, "k"}, Check{"dq", &*dq, &q, "q"},
        Check{"dk", &*dk, &k, "k"}, Check{"dwq", &*dwq, &wq, "wq"},
        Check{"dwk", &*dwk, &wk, "wk"}}) {
    if (auto e = ExpectDtype(kQkBwd, name, *buf, t); e.failure()) return e;
    if (auto e = CheckSameShape(kQkBwd, name, *buf, *like, like_name); e.failure()) return e;
  }
  if (auto e = ExpectDtype(kQkBwd, "ws", *ws, ffi::DataType::F32); e.failure()) return e;
  const size_t ws_bytes = ws->element_count() * sizeof(float);
  if (ws_bytes < static_cast<size_t>(cq.dim) * sizeof(float)) {
    return InvalidArg(kQkBwd, "ws has shape " + ShapeStr(*ws) + ", expected at least one row of " +
                                  std::to_string(cq.dim) + " floats");
  }
  const int64_t per = cq.tokens / cq.groups, rq = cq.heads * cq.dim, rk = ck.heads * ck.dim;
  return DispatchFloat(kQkBwd, t, [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    for (int64_t g = 0; g < cq.groups; ++g) {  // groups run in stream order, so they share `ws`
      RopeTensor<T> t0, t1;
      t0.dy = static_cast<const T*>(dyq.untyped_data()) + g * per * rq;
      t0.x = static_cast<const T*>(q.untyped_data()) + g * per * rq;
      t0.out = static_cast<T*>(dq->untyped_data()) + g * per * rq;
      t0.w = static_cast<const T*>(wq.untyped_data()) + g * cq.dim;
      t0.dw = static_cast<T*>(dwq->untyped_data()) + g * cq.dim;
      t0.heads = cq.heads;
      t1.dy = static_cast<const T*>(dyk.untyped_data()) + g * per * rk;
      t1.x = static_cast<const T*>(k.untyped_data()) + g * per * rk;
      t1.out = static_cast<T*>(dk->untyped_data()) + g * per * rk;
      t1.w = static_cast<const T*>(wk.untyped_data()) + g * cq.dim;
      t1.dw = static_cast<T*>(dwk->untyped_data()) + g * cq.dim;
      t1.heads = ck.heads;
      const cudaError_t err = rope_norm_bwd_pair<T>(t0, t1, AnglesOf(cq, a, b, g), per, cq.dim, eps,
                                                    ws->untyped_data(), ws_bytes, stream);
      if (err != cudaSuccess) return CudaError(kQkBwd, err);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kRopeFwdHandler, RopeFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("eps")
                            .Attr<int32_t>("norm")
                            .Attr<int32_t>("inverse")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // positions | cos
                            .Arg<ffi::AnyBuffer>()    // inv_freq | sin
                            .Arg<ffi::AnyBuffer>()    // w (ignored unless norm)
                            .Ret<ffi::AnyBuffer>());  // y

SUROGATE_DEFINE_HANDLER(kRopeBwdHandler, RopeBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("eps")
                            .Arg<ffi::AnyBuffer>()    // dy
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // positions | cos
                            .Arg<ffi::AnyBuffer>()    // inv_freq | sin
                            .Arg<ffi::AnyBuffer>()    // w
                            .Ret<ffi::AnyBuffer>()    // dx
                            .Ret<ffi::AnyBuffer>()    // dw
                            .Ret<ffi::AnyBuffer>());  // ws (dw partial sums, discarded)

SUROGATE_DEFINE_HANDLER(kRopeQkFwdHandler, RopeQkFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("eps")
                            .Attr<int32_t>("norm")
                            .Attr<int32_t>("inverse")
                            .Arg<ffi::AnyBuffer>()    // q
                            .Arg<ffi::AnyBuffer>()    // k
                            .Arg<ffi::AnyBuffer>()    // positions | cos
                            .Arg<ffi::AnyBuffer>()    // inv_freq | sin
                            .Arg<ffi::AnyBuffer>()    // wq (ignored unless norm)
                            .Arg<ffi::AnyBuffer>()    // wk (ignored unless norm)
                            .Ret<ffi::AnyBuffer>()    // yq
                            .Ret<ffi::AnyBuffer>());  // yk

SUROGATE_DEFINE_HANDLER(kRopeQkBwdHandler, RopeQkBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("eps")
                            .Arg<ffi::AnyBuffer>()    // dyq
                            .Arg<ffi::AnyBuffer>()    // dyk
                            .Arg<ffi::AnyBuffer>()    // q
                            .Arg<ffi::AnyBuffer>()    // k
                            .Arg<ffi::AnyBuffer>()    // positions | cos
                            .Arg<ffi::AnyBuffer>()    // inv_freq | sin
                            .Arg<ffi::AnyBuffer>()    // wq
                            .Arg<ffi::AnyBuffer>()    // wk
                            .Ret<ffi::AnyBuffer>()    // dq
                            .Ret<ffi::AnyBuffer>()    // dk
                            .Ret<ffi::AnyBuffer>()    // dwq
                            .Ret<ffi::AnyBuffer>()    // dwk
                            .Ret<ffi::AnyBuffer>());  // ws (dw partial sums of both, discarded)

Targets RopeTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kRopeFwdHandler),
          SUROGATE_TARGET(kBwd.data(), kRopeBwdHandler),
          SUROGATE_TARGET(kQkFwd.data(), kRopeQkFwdHandler),
          SUROGATE_TARGET(kQkBwd.data(), kRopeQkBwdHandler)};
}

}  // namespace surogate::ffi_bind
