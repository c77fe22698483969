// XLA FFI handlers for SwiGLU with in-kernel LoRA updates: check shapes/dtypes, pick the element
// type, call kernels/swiglu_lora.h on XLA's stream. Python side: surogate_jax/ops/swiglu_lora.py.
//
//   surogate_swiglu_lora_fwd(gate_up [..., 2F], xa [..., 2R], lora_b [2, R, F]; scale) -> h [..., F]
//   surogate_swiglu_lora_bwd(dh [..., F], gate_up [..., 2F], xa [..., 2R], lora_b [2, R, F]; scale)
//       -> dgate_up [..., 2F]
//   surogate_swiglu_lora_bwd_split(dh, dh2 [..., F], gate_up, xa, lora_b; scale) -> dgate_up
//       (h's gradient in two parts, from its two uses; summed in the kernel)
// One dtype for every operand (f32, bf16 or f16); the leading dims of gate_up, xa, dh and the
// outputs are one set of rows. Command-buffer compatible (SUROGATE_GRAPH_SAFE): the launchers only
// enqueue kernels on XLA's stream.
#include <string>
#include <string_view>

#include "ffi/ffi_common.h"
#include "kernels/swiglu_lora.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kFwd = "surogate_swiglu_lora_fwd";
constexpr std::string_view kBwd = "surogate_swiglu_lora_bwd";
constexpr std::string_view kBwdSplit = "surogate_swiglu_lora_bwd_split";

// b's leading dims equal like's and its last dim is `last`.
ffi::Error Rows(std::string_view op, const char* name, const ffi::AnyBuffer& b, const char* like_name,
                const ffi::AnyBuffer& like, int64_t last, const char* last_what) {
  const auto bd = b.dimensions(), ld = like.dimensions();
  bool ok = bd.size() == ld.size() && bd.size() >= 1 && bd.back() == last;
  for (size_t i = 0; ok && i + 1 < bd.size(); ++i) ok = bd[i] == ld[i];
  if (ok) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + ", expected " + like_name +
                            "'s leading dims " + ShapeStr(like) + " and last dimension " +
                            std::to_string(last) + " (" + last_what + ")");
}

// Checks gate_up / xa / lora_b (and dh when given); sets rows, F, R.
ffi::Error Check(std::string_view op, const ffi::AnyBuffer& gate_up, const ffi::AnyBuffer& xa,
                 const ffi::AnyBuffer& lora_b, const ffi::AnyBuffer* dh, int64_t* rows, int64_t* F,
                 int64_t* R) {
  int64_t F2 = 0;
  if (auto e = RowsAndDim(op, "gate_up", gate_up, rows, &F2); e.failure()) return e;
  if (F2 % 2 != 0) {
    return InvalidArg(op, "gate_up has shape " + ShapeStr(gate_up) + "; its last dimension (2F) must be even");
  }
  *F = F2 / 2;
  const auto bd = lora_b.dimensions();
  if (bd.size() != 3 || bd[0] != 2 || bd[1] < 1 || bd[2] != *F) {
    return InvalidArg(op, "lora_b has shape " + ShapeStr(lora_b) + ", expected [2, R, " +
                              std::to_string(*F) + "] (B_gate, B_up) with R >= 1");
  }
  *R = bd[1];
  if (auto e = Rows(op, "xa", xa, "gate_up", gate_up, 2 * *R, "2R"); e.failure()) return e;
  if (dh != nullptr) {
    if (auto e = Rows(op, "dh", *dh, "gate_up", gate_up, *F, "F"); e.failure()) return e;
  }
  const auto t = gate_up.element_type();
  if (auto e = ExpectDtype(op, "xa", xa, t); e.failure()) return e;
  if (auto e = ExpectDtype(op, "lora_b", lora_b, t); e.failure()) return e;
  if (dh != nullptr) {
    if (auto e = ExpectDtype(op, "dh", *dh, t); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error Fwd(cudaStream_t stream, float scale, ffi::AnyBuffer gate_up, ffi::AnyBuffer xa,
               ffi::AnyBuffer lora_b, ffi::Result<ffi::AnyBuffer> h) {
  int64_t rows = 0, F = 0, R = 0;
  if (auto e = Check(kFwd, gate_up, xa, lora_b, nullptr, &rows, &F, &R); e.failure()) return e;
  if (auto e = Rows(kFwd, "h", *h, "gate_up", gate_up, F, "F"); e.failure()) return e;
  if (auto e = ExpectDtype(kFwd, "h", *h, gate_up.element_type()); e.failure()) return e;
  return DispatchFloat(kFwd, gate_up.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(kFwd, swiglu_lora_fwd<T>(In<T>(gate_up), In<T>(xa), In<T>(lora_b), Out<T>(h),
                                              rows, F, R, scale, stream));
  });
}

// dh2: nullptr (one dh) or the second part of h's gradient (kBwdSplit).
ffi::Error BwdImpl(std::string_view op, cudaStream_t stream, float scale, const ffi::AnyBuffer& dh,
                   const ffi::AnyBuffer* dh2, const ffi::AnyBuffer& gate_up, const ffi::AnyBuffer& xa,
                   const ffi::AnyBuffer& lora_b, ffi::Result<ffi::AnyBuffer>& dgate_up) {
  int64_t rows = 0, F = 0, R = 0;
  if (auto e = Check(op, gate_up, xa, lora_b, &dh, &rows, &F, &R); e.failure()) return e;
  if (dh2 != nullptr) {
    if (auto e = Rows(op, "dh2", *dh2, "gate_up", gate_up, F, "F"); e.failure()) return e;
    if (auto e = ExpectDtype(op, "dh2", *dh2, gate_up.element_type()); e.failure()) return e;
  }
  if (auto e = Rows(op, "dgate_up", *dgate_up, "gate_up", gate_up, 2 * F, "2F"); e.failure()) return e;
  if (auto e = ExpectDtype(op, "dgate_up", *dgate_up, gate_up.element_type()); e.failure()) return e;
  return DispatchFloat(op, gate_up.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(op, swiglu_lora_bwd<T>(In<T>(dh), dh2 ? In<T>(*dh2) : nullptr, In<T>(gate_up),
                                            In<T>(xa), In<T>(lora_b), Out<T>(dgate_up), rows, F, R,
                                            scale, stream));
  });
}

ffi::Error Bwd(cudaStream_t stream, float scale, ffi::AnyBuffer dh, ffi::AnyBuffer gate_up,
               ffi::AnyBuffer xa, ffi::AnyBuffer lora_b, ffi::Result<ffi::AnyBuffer> dgate_up) {
  return BwdImpl(kBwd, stream, scale, dh, nullptr, gate_up, xa, lora_b, dgate_up);
}

ffi::Error BwdSplit(cudaStream_t stream, float scale, ffi::AnyBuffer dh, ffi::AnyBuffer dh2,
                    ffi::AnyBuffer gate_up, ffi::AnyBuffer xa, ffi::AnyBuffer lora_b,
                    ffi::Result<ffi::AnyBuffer> dgate_up) {
  return BwdImpl(kBwdSplit, stream, scale, dh, &dh2, gate_up, xa, lora_b, dgate_up);
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kSwigluLoraFwdHandler, Fwd,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Attr<float>("scale")   // LoRA alpha / r
                           .Arg<ffi::AnyBuffer>()   // gate_up
                           .Arg<ffi::AnyBuffer>()   // xa
                           .Arg<ffi::AnyBuffer>()   // lora_b
                           .Ret<ffi::AnyBuffer>());  // h

SUROGATE_DEFINE_HANDLER(kSwigluLoraBwdHandler, Bwd,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Attr<float>("scale")   // LoRA alpha / r
                           .Arg<ffi::AnyBuffer>()   // dh
                           .Arg<ffi::AnyBuffer>()   // gate_up
                           .Arg<ffi::AnyBuffer>()   // xa
                           .Arg<ffi::AnyBuffer>()   // lora_b
                           .Ret<ffi::AnyBuffer>());  // dgate_up

SUROGATE_DEFINE_HANDLER(kSwigluLoraBwdSplitHandler, BwdSplit,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Attr<float>("scale")   // LoRA alpha / r
                           .Arg<ffi::AnyBuffer>()   // dh (from h's first use)
                           .Arg<ffi::AnyBuffer>()   // dh2 (from its second use)
                           .Arg<ffi::AnyBuffer>()   // gate_up
                           .Arg<ffi::AnyBuffer>()   // xa
                           .Arg<ffi::AnyBuffer>()   // lora_b
                           .Ret<ffi::AnyBuffer>());  // dgate_up

Targets SwigluLoraTargets() {
  return {SUROGATE_TARGET(kFwd.data(), kSwigluLoraFwdHandler),
          SUROGATE_TARGET(kBwd.data(), kSwigluLoraBwdHandler),
          SUROGATE_TARGET(kBwdSplit.data(), kSwigluLoraBwdSplitHandler)};
}

}  // namespace surogate::ffi_bind
