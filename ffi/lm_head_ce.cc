// XLA FFI handlers for the LM-head cross-entropy row kernel: check shapes/dtypes, pick the element
// types, call kernels/lm_head_ce.h on XLA's stream. Python side: surogate_jax/ops/lm_head_ce.py.
//
//   surogate_lm_head_ce_loss(logits [..., V], targets [...] s32, weights [...] f32; z_loss: f32)
//       -> loss [...] f32, lse [...] f32
//   surogate_lm_head_ce_grad(same; algo: s32 0 auto / 1 two-pass)
//       -> loss [...] f32, lse [...] f32, dlogits [..., V]
// logits: float32 / bfloat16 / float16; dlogits: float32 / bfloat16 / float16 (bf16/f16 logits
// with fp32 dlogits, or fp32 logits with any dlogits). dlogits may be the same buffer as logits
// (input_output_aliases) when the dtypes match. Leading dims are flattened into rows, so a
// vmapped call (vmap_method="broadcast_all") is just more rows.
// Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): the launchers only
// read device attributes (host-side, legal while XLA captures the stream) and enqueue kernels and
// async memsets; measured inside jitted train steps (benchmarks/kernels_in_model.py,
// tests/gpu/test_models_gpu.py).
#include <type_traits>

#include "ffi/ffi_common.h"
#include "kernels/lm_head_ce.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kLoss = "surogate_lm_head_ce_loss";
constexpr std::string_view kGrad = "surogate_lm_head_ce_grad";

ffi::Error CheckRows(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                     ffi::DataType want, int64_t rows, const ffi::AnyBuffer& logits) {
  if (auto e = ExpectDtype(op, name, b, want); e.failure()) return e;
  if (static_cast<int64_t>(b.element_count()) != rows) {
    return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + ", expected " +
                              std::to_string(rows) + " elements (one per row of logits " +
                              ShapeStr(logits) + ")");
  }
  return ffi::Error::Success();
}

// Validates the common operands; returns rows and vocab.
ffi::Error CheckCommon(std::string_view op, const ffi::AnyBuffer& logits,
                       const ffi::AnyBuffer& targets, const ffi::AnyBuffer& weights,
                       const ffi::AnyBuffer& loss, const ffi::AnyBuffer& lse, int64_t* rows,
                       int64_t* vocab) {
  if (auto e = RowsAndDim(op, "logits", logits, rows, vocab); e.failure()) return e;
  if (*vocab <= 0 || *vocab > INT32_MAX) {
    return InvalidArg(
        op, "logits " + ShapeStr(logits) + ": the vocab (last) dimension must be in [1, 2^31)");
  }
  if (auto e = CheckRows(op, "targets", targets, ffi::DataType::S32, *rows, logits); e.failure())
    return e;
  if (auto e = CheckRows(op, "weights", weights, ffi::DataType::F32, *rows, logits); e.failure())
    return e;
  if (auto e = CheckRows(op, "loss", loss, ffi::DataType::F32, *rows, logits); e.failure())
    return e;
  if (auto e = CheckRows(op, "lse", lse, ffi::DataType::F32, *rows, logits); e.failure()) return e;
  return ffi::Error::Success();
}

ffi::Error LmHeadCeLoss(cudaStream_t stream, float z_loss, ffi::AnyBuffer logits,
                        ffi::AnyBuffer targets, ffi::AnyBuffer weights,
                        ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse) {
  int64_t rows = 0, vocab = 0;
  if (auto e = CheckCommon(kLoss, logits, targets, weights, *loss, *lse, &rows, &vocab);
      e.failure()) {
    return e;
  }
  return DispatchFloat(kLoss, logits.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(kLoss, lm_head_ce_loss<T>(static_cast<const T*>(logits.untyped_data()),
                                               static_cast<const int32_t*>(targets.untyped_data()),
                                               static_cast<const float*>(weights.untyped_data()),
                                               static_cast<float*>(loss->untyped_data()),
                                               static_cast<float*>(lse->untyped_data()), rows,
                                               vocab, z_loss, stream));
  });
}

ffi::Error LmHeadCeGrad(cudaStream_t stream, float z_loss, int32_t algo, ffi::AnyBuffer logits,
                        ffi::AnyBuffer targets, ffi::AnyBuffer weights,
                        ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                        ffi::Result<ffi::AnyBuffer> dlogits) {
  int64_t rows = 0, vocab = 0;
  if (auto e = CheckCommon(kGrad, logits, targets, weights, *loss, *lse, &rows, &vocab);
      e.failure()) {
    return e;
  }
  if (!(dlogits->dimensions() == logits.dimensions())) {
    return InvalidArg(kGrad, "dlogits has shape " + ShapeStr(*dlogits) + " but logits has shape " +
                                 ShapeStr(logits));
  }
  if (algo != static_cast<int32_t>(LmHeadCeAlgo::kAuto) &&
      algo != static_cast<int32_t>(LmHeadCeAlgo::kTwoPass)) {
    return InvalidArg(kGrad, "algo must be 0 (auto) or 1 (two-pass), got " + std::to_string(algo));
  }
  const ffi::DataType tin = logits.element_type(), tout = dlogits->element_type();
  if (tin != tout && tin != ffi::DataType::F32 && tout != ffi::DataType::F32) {
    return InvalidArg(kGrad, "unsupported dtype pair logits " + DtypeName(tin) + " -> dlogits " +
                                 DtypeName(tout) + "; one of them must be float32 or both equal");
  }
  return DispatchFloat(kGrad, tin, [&](auto in_tag) -> ffi::Error {
    using TIn = decltype(in_tag);
    return DispatchFloat(kGrad, tout, [&](auto out_tag) -> ffi::Error {
      using TOut = decltype(out_tag);
      constexpr bool kF32In = std::is_same_v<TIn, float>, kF32Out = std::is_same_v<TOut, float>;
      if constexpr (std::is_same_v<TIn, TOut> || kF32In || kF32Out) {
        return CudaError(kGrad, lm_head_ce_grad<TIn, TOut>(
                                    static_cast<const TIn*>(logits.untyped_data()),
                                    static_cast<const int32_t*>(targets.untyped_data()),
                                    static_cast<const float*>(weights.untyped_data()),
                                    static_cast<float*>(loss->untyped_data()),
                                    static_cast<float*>(lse->untyped_data()),
                                    static_cast<TOut*>(dlogits->untyped_data()), rows, vocab,
                                    z_loss, static_cast<LmHeadCeAlgo>(algo), stream));
      } else {
        return InvalidArg(kGrad, "unsupported dtype pair");  // excluded above
      }
    });
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kLmHeadCeLossHandler, LmHeadCeLoss,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("z_loss")
                            .Arg<ffi::AnyBuffer>()    // logits
                            .Arg<ffi::AnyBuffer>()    // targets
                            .Arg<ffi::AnyBuffer>()    // weights
                            .Ret<ffi::AnyBuffer>()    // loss
                            .Ret<ffi::AnyBuffer>());  // lse

SUROGATE_DEFINE_HANDLER(kLmHeadCeGradHandler, LmHeadCeGrad,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<float>("z_loss")
                            .Attr<int32_t>("algo")
                            .Arg<ffi::AnyBuffer>()    // logits
                            .Arg<ffi::AnyBuffer>()    // targets
                            .Arg<ffi::AnyBuffer>()    // weights
                            .Ret<ffi::AnyBuffer>()    // loss
                            .Ret<ffi::AnyBuffer>()    // lse
                            .Ret<ffi::AnyBuffer>());  // dlogits

Targets LmHeadCeTargets() {
  return {SUROGATE_TARGET(kLoss.data(), kLmHeadCeLossHandler),
          SUROGATE_TARGET(kGrad.data(), kLmHeadCeGradHandler)};
}

}  // namespace surogate::ffi_bind
