// XLA FFI handlers for SwiGLU with in-kernel LoRA updates: check shapes/dtypes, pick the element
// type, call kernels/swiglu_lora.h on XLA's stream. Python side: surogate_jax/ops/swiglu_lora.py.
//
// Packed: the frozen gate/up GEMM as one output gate_up [..., 2F] (x @ [W_gate | W_up]):
//   surogate_swiglu_lora_fwd(gate_up, xa [..., 2R], lora_b [2, R, F]; scale) -> h [..., F]
//   surogate_swiglu_lora_bwd(dh [..., F], gate_up, xa, lora_b; scale) -> dgate_up [..., 2F]
//   surogate_swiglu_lora_bwd_split(dh, dh2 [..., F], gate_up, xa, lora_b; scale) -> dgate_up
//       (h's gradient in two parts, from its two uses; summed in the kernel)
// Separate ("sep"): gate and up as two GEMM outputs [..., F] each (no concatenated weight):
//   surogate_swiglu_lora_sep_fwd(gate, up, xa, lora_b; scale) -> h
//   surogate_swiglu_lora_sep_bwd(dh, gate, up, xa, lora_b; scale) -> (dgate, dup)
//   surogate_swiglu_lora_sep_bwd_split(dh, dh2, gate, up, xa, lora_b; scale) -> (dgate, dup)
// One dtype for every operand (f32, bf16 or f16); the leading dims of gate_up (or gate), xa, dh
// and the outputs are one set of rows. Command-buffer compatible (SUROGATE_GRAPH_SAFE): the
// launchers only enqueue kernels on XLA's stream.
#include <string>
#include <string_view>

#include "ffi/ffi_common.h"
#include "kernels/swiglu_lora.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_swiglu_lora_fwd";
constexpr std::string_view kBwd = "surogate_swiglu_lora_bwd";
constexpr std::string_view kBwdSplit = "surogate_swiglu_lora_bwd_split";
constexpr std::string_view kSepFwd = "surogate_swiglu_lora_sep_fwd";
constexpr std::string_view kSepBwd = "surogate_swiglu_lora_sep_bwd";
constexpr std::string_view kSepBwdSplit = "surogate_swiglu_lora_sep_bwd_split";

// b's leading dims equal like's and its last dim is `last`.
ffi::Error Rows(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                const char* like_name, const ffi::AnyBuffer& like, int64_t last,
                const char* last_what) {
  const auto bd = b.dimensions(), ld = like.dimensions();
  bool ok = bd.size() == ld.size() && bd.size() >= 1 && bd.back() == last;
  for (size_t i = 0; ok && i + 1 < bd.size(); ++i) ok = bd[i] == ld[i];
  if (ok) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + ", expected " +
                            like_name + "'s leading dims " + ShapeStr(like) +
                            " and last dimension " + std::to_string(last) + " (" + last_what + ")");
}

// The base GEMM output(s): `first` is gate_up [..., 2F] (up == nullptr) or gate [..., F].
struct Base {
  const ffi::AnyBuffer& first;
  const ffi::AnyBuffer* up;
  const char* name() const { return up ? "gate" : "gate_up"; }
};

// Checks the base, xa, lora_b (and dh when given); sets rows, F, R.
ffi::Error Check(std::string_view op, const Base& base, const ffi::AnyBuffer& xa,
                 const ffi::AnyBuffer& lora_b, const ffi::AnyBuffer* dh, int64_t* rows, int64_t* F,
                 int64_t* R) {
  int64_t last = 0;
  if (auto e = RowsAndDim(op, base.name(), base.first, rows, &last); e.failure()) return e;
  if (base.up == nullptr && last % 2 != 0) {
    return InvalidArg(
        op, "gate_up has shape " + ShapeStr(base.first) + "; its last dimension (2F) must be even");
  }
  *F = base.up ? last : last / 2;
  const auto t = base.first.element_type();
  if (base.up != nullptr) {
    if (auto e = Rows(op, "up", *base.up, "gate", base.first, *F, "F"); e.failure()) return e;
    if (auto e = ExpectDtype(op, "up", *base.up, t); e.failure()) return e;
  }
  const auto bd = lora_b.dimensions();
  if (bd.size() != 3 || bd[0] != 2 || bd[1] < 1 || bd[2] != *F) {
    return InvalidArg(op, "lora_b has shape " + ShapeStr(lora_b) + ", expected [2, R, " +
                              std::to_string(*F) + "] (B_gate, B_up) with R >= 1");
  }
  *R = bd[1];
  if (auto e = Rows(op, "xa", xa, base.name(), base.first, 2 * *R, "2R"); e.failure()) return e;
  if (dh != nullptr) {
    if (auto e = Rows(op, "dh", *dh, base.name(), base.first, *F, "F"); e.failure()) return e;
  }
  if (auto e = ExpectDtype(op, "xa", xa, t); e.failure()) return e;
  if (auto e = ExpectDtype(op, "lora_b", lora_b, t); e.failure()) return e;
  if (dh != nullptr) {
    if (auto e = ExpectDtype(op, "dh", *dh, t); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// out has base's leading dims, last dimension `last` and base's dtype.
ffi::Error CheckOut(std::string_view op, const char* name, const ffi::AnyBuffer& out,
                    const Base& base, int64_t last, const char* last_what) {
  if (auto e = Rows(op, name, out, base.name(), base.first, last, last_what); e.failure()) return e;
  return ExpectDtype(op, name, out, base.first.element_type());
}

ffi::Error FwdImpl(std::string_view op, cudaStream_t stream, float scale, const Base& base,
                   const ffi::AnyBuffer& xa, const ffi::AnyBuffer& lora_b,
                   ffi::Result<ffi::AnyBuffer>& h) {
  int64_t rows = 0, F = 0, R = 0;
  if (auto e = Check(op, base, xa, lora_b, nullptr, &rows, &F, &R); e.failure()) return e;
  if (auto e = CheckOut(op, "h", *h, base, F, "F"); e.failure()) return e;
  return DispatchFloat(op, base.first.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* gate = In<T>(base.first);
    const T* up = base.up ? In<T>(*base.up) : gate + F;
    const int64_t ld = base.up ? F : 2 * F;
    return CudaError(op, swiglu_lora_fwd<T>(gate, up, ld, In<T>(xa), In<T>(lora_b), Out<T>(h), rows,
                                            F, R, scale, stream));
  });
}

// dh2: nullptr (one dh) or the second part of h's gradient (the _split targets). dup: nullptr
// (packed: dgate is dgate_up [..., 2F]) or the second output (sep: dgate, dup [..., F]).
ffi::Error BwdImpl(std::string_view op, cudaStream_t stream, float scale, const ffi::AnyBuffer& dh,
                   const ffi::AnyBuffer* dh2, const Base& base, const ffi::AnyBuffer& xa,
                   const ffi::AnyBuffer& lora_b, ffi::Result<ffi::AnyBuffer>& dgate,
                   ffi::Result<ffi::AnyBuffer>* dup) {
  int64_t rows = 0, F = 0, R = 0;
  if (auto e = Check(op, base, xa, lora_b, &dh, &rows, &F, &R); e.failure()) return e;
  if (dh2 != nullptr) {
    if (auto e = CheckOut(op, "dh2", *dh2, base, F, "F"); e.failure()) return e;
  }
  if (dup != nullptr) {
    if (auto e = CheckOut(op, "dgate", *dgate, base, F, "F"); e.failure()) return e;
    if (auto e = CheckOut(op, "dup", **dup, base, F, "F"); e.failure()) return e;
  } else if (auto e = CheckOut(op, "dgate_up", *dgate, base, 2 * F, "2F"); e.failure()) {
    return e;
  }
  return DispatchFloat(op, base.first.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    const T* gate = In<T>(base.first);
    const T* up = base.up ? In<T>(*base.up) : gate + F;
    const int64_t ld = base.up ? F : 2 * F;
    T* dg = Out<T>(dgate);
    T* du = dup ? Out<T>(*dup) : dg + F;
    return CudaError(
        op, swiglu_lora_bwd<T>(In<T>(dh), dh2 ? In<T>(*dh2) : nullptr, gate, up, ld, In<T>(xa),
                               In<T>(lora_b), dg, du, dup ? F : 2 * F, rows, F, R, scale, stream));
  });
}

ffi::Error Fwd(cudaStream_t stream, float scale, ffi::AnyBuffer gate_up, ffi::AnyBuffer xa,
               ffi::AnyBuffer lora_b, ffi::Result<ffi::AnyBuffer> h) {
  return FwdImpl(kFwd, stream, scale, Base{gate_up, nullptr}, xa, lora_b, h);
}

ffi::Error Bwd(cudaStream_t stream, float scale, ffi::AnyBuffer dh, ffi::AnyBuffer gate_up,
               ffi::AnyBuffer xa, ffi::AnyBuffer lora_b, ffi::Result<ffi::AnyBuffer> dgate_up) {
  return BwdImpl(kBwd, stream, scale, dh, nullptr, Base{gate_up, nullptr}, xa, lora_b, dgate_up,
                 nullptr);
}

ffi::Error BwdSplit(cudaStream_t stream, float scale, ffi::AnyBuffer dh, ffi::AnyBuffer dh2,
                    ffi::AnyBuffer gate_up, ffi::AnyBuffer xa, ffi::AnyBuffer lora_b,
                    ffi::Result<ffi::AnyBuffer> dgate_up) {
  return BwdImpl(kBwdSplit, stream, scale, dh, &dh2, Base{gate_up, nullptr}, xa, lora_b, dgate_up,
                 nullptr);
}

ffi::Error SepFwd(cudaStream_t stream, float scale, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                  ffi::AnyBuffer xa, ffi::AnyBuffer lora_b, ffi::Result<ffi::AnyBuffer> h) {
  return FwdImpl(kSepFwd, stream, scale, Base{gate, &up}, xa, lora_b, h);
}

ffi::Error SepBwd(cudaStream_t stream, float scale, ffi::AnyBuffer dh, ffi::AnyBuffer gate,
                  ffi::AnyBuffer up, ffi::AnyBuffer xa, ffi::AnyBuffer lora_b,
                  ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup) {
  return BwdImpl(kSepBwd, stream, scale, dh, nullptr, Base{gate, &up}, xa, lora_b, dgate, &dup);
}

ffi::Error SepBwdSplit(cudaStream_t stream, float scale, ffi::AnyBuffer dh, ffi::AnyBuffer dh2,
                       ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer xa,
                       ffi::AnyBuffer lora_b, ffi::Result<ffi::AnyBuffer> dgate,
                       ffi::Result<ffi::AnyBuffer> dup) {
  return BwdImpl(kSepBwdSplit, stream, scale, dh, &dh2, Base{gate, &up}, xa, lora_b, dgate, &dup);
}

}  // namespace
SUROGATE_DEFINE_HANDLER(kSwigluLoraFwdHandler, Fwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("scale")     // LoRA alpha / r
                            .Arg<ffi::AnyBuffer>()    // gate_up
                            .Arg<ffi::AnyBuffer>()    // xa
                            .Arg<ffi::AnyBuffer>()    // lora_b
                            .Ret<ffi::AnyBuffer>());  // h

SUROGATE_DEFINE_HANDLER(kSwigluLoraBwdHandler, Bwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("scale")     // LoRA alpha / r
                            .Arg<ffi::AnyBuffer>()    // dh
                            .Arg<ffi::AnyBuffer>()    // gate_up
                            .Arg<ffi::AnyBuffer>()    // xa
                            .Arg<ffi::AnyBuffer>()    // lora_b
                            .Ret<ffi::AnyBuffer>());  // dgate_up

SUROGATE_DEFINE_HANDLER(kSwigluLoraBwdSplitHandler, BwdSplit,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("scale")     // LoRA alpha / r
                            .Arg<ffi::AnyBuffer>()    // dh (from h's first use)
                            .Arg<ffi::AnyBuffer>()    // dh2 (from its second use)
                            .Arg<ffi::AnyBuffer>()    // gate_up
                            .Arg<ffi::AnyBuffer>()    // xa
                            .Arg<ffi::AnyBuffer>()    // lora_b
                            .Ret<ffi::AnyBuffer>());  // dgate_up

SUROGATE_DEFINE_HANDLER(kSwigluLoraSepFwdHandler, SepFwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("scale")     // LoRA alpha / r
                            .Arg<ffi::AnyBuffer>()    // gate
                            .Arg<ffi::AnyBuffer>()    // up
                            .Arg<ffi::AnyBuffer>()    // xa
                            .Arg<ffi::AnyBuffer>()    // lora_b
                            .Ret<ffi::AnyBuffer>());  // h

SUROGATE_DEFINE_HANDLER(kSwigluLoraSepBwdHandler, SepBwd,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("scale")     // LoRA alpha / r
                            .Arg<ffi::AnyBuffer>()    // dh
                            .Arg<ffi::AnyBuffer>()    // gate
                            .Arg<ffi::AnyBuffer>()    // up
                            .Arg<ffi::AnyBuffer>()    // xa
                            .Arg<ffi::AnyBuffer>()    // lora_b
                            .Ret<ffi::AnyBuffer>()    // dgate
                            .Ret<ffi::AnyBuffer>());  // dup

SUROGATE_DEFINE_HANDLER(kSwigluLoraSepBwdSplitHandler, SepBwdSplit,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("scale")     // LoRA alpha / r
                            .Arg<ffi::AnyBuffer>()    // dh (from h's first use)
                            .Arg<ffi::AnyBuffer>()    // dh2 (from its second use)
                            .Arg<ffi::AnyBuffer>()    // gate
                            .Arg<ffi::AnyBuffer>()    // up
                            .Arg<ffi::AnyBuffer>()    // xa
                            .Arg<ffi::AnyBuffer>()    // lora_b
                            .Ret<ffi::AnyBuffer>()    // dgate
                            .Ret<ffi::AnyBuffer>());  // dup

Targets SwigluLoraTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kSwigluLoraFwdHandler),
          SUROGATE_TARGET(kBwd.data(), kSwigluLoraBwdHandler),
          SUROGATE_TARGET(kBwdSplit.data(), kSwigluLoraBwdSplitHandler),
          SUROGATE_TARGET(kSepFwd.data(), kSwigluLoraSepFwdHandler),
          SUROGATE_TARGET(kSepBwd.data(), kSwigluLoraSepBwdHandler),
          SUROGATE_TARGET(kSepBwdSplit.data(), kSwigluLoraSepBwdSplitHandler)};
}

}  // namespace surogate::ffi_bind
