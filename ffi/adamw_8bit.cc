// XLA FFI handler for the fused 8-bit AdamW update (kernels/adamw_8bit.h): check shapes/dtypes,
// pick the element types, run the launcher on XLA's stream. Python side:
// surogate_jax/optim/adamw_8bit.py (`_update_8bit_ffi`, reference `update_8bit_ref`).
//
//   surogate_adamw_8bit_update(g [S], p [S], qm [S] u8, qv [S] u8, am [A] f32, av [A] f32,
//                              scalars [9] f32, aux [5504] u32)
//     -> p' [S], qm' [S], qv' [S], am' [A], av' [A]     (prod(A) = ceil(prod(S) / 256); A is any
//                                                        shape, the Python side picks it)
//
// The Python wrapper aliases p, qm, qv, am, av to the five outputs (input_output_aliases), so with
// donated buffers the update is in place; if XLA ever hands us distinct output buffers, the inputs
// are copied into them first and updated there. g and p may be float32, bfloat16 or float16
// independently. Graph-safe like every handler (ffi_common.h): no allocation, no synchronization.
#include "ffi/ffi_common.h"
#include "kernels/adamw_8bit.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kOp = "surogate_adamw_8bit_update";

ffi::Error SameShape(const char* name, const ffi::AnyBuffer& b, const ffi::AnyBuffer& like,
                     const char* like_name) {
  if (b.dimensions() == like.dimensions()) return ffi::Error::Success();
  return InvalidArg(kOp, std::string(name) + " has shape " + ShapeStr(b) + " but " + like_name +
                             " has shape " + ShapeStr(like));
}

// Output `out` must look like input `in`; when XLA did not alias them, copy in -> out.
ffi::Error Prepare(const char* name, const ffi::AnyBuffer& in, ffi::AnyBuffer& out,
                   cudaStream_t stream) {
  if (out.element_type() != in.element_type() || !(out.dimensions() == in.dimensions())) {
    return InvalidArg(kOp, std::string("output ") + name + " (" + DtypeName(out.element_type()) +
                               " " + ShapeStr(out) + ") does not match the input (" +
                               DtypeName(in.element_type()) + " " + ShapeStr(in) + ")");
  }
  if (out.untyped_data() == in.untyped_data() || in.size_bytes() == 0) return ffi::Error::Success();
  return CudaError(kOp, cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), in.size_bytes(),
                                        cudaMemcpyDeviceToDevice, stream));
}

ffi::Error Adamw8bitUpdate(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer p,
                           ffi::AnyBuffer qm, ffi::AnyBuffer qv, ffi::AnyBuffer am,
                           ffi::AnyBuffer av, ffi::AnyBuffer scalars, ffi::AnyBuffer aux,
                           ffi::Result<ffi::AnyBuffer> p_out, ffi::Result<ffi::AnyBuffer> qm_out,
                           ffi::Result<ffi::AnyBuffer> qv_out, ffi::Result<ffi::AnyBuffer> am_out,
                           ffi::Result<ffi::AnyBuffer> av_out) {
  const int64_t n = static_cast<int64_t>(p.element_count());
  const int64_t nblocks = (n + kAdamw8bitBlock - 1) / kAdamw8bitBlock;
  if (auto e = SameShape("g", g, p, "p"); e.failure()) return e;
  if (auto e = SameShape("qm", qm, p, "p"); e.failure()) return e;
  if (auto e = SameShape("qv", qv, p, "p"); e.failure()) return e;
  if (auto e = ExpectDtype(kOp, "qm", qm, ffi::DataType::U8); e.failure()) return e;
  if (auto e = ExpectDtype(kOp, "qv", qv, ffi::DataType::U8); e.failure()) return e;
  if (auto e = ExpectDtype(kOp, "aux", aux, ffi::DataType::U32); e.failure()) return e;
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"am", &am},
                           {"av", &av},
                           {"scalars", &scalars}}) {
    if (auto e = ExpectDtype(kOp, name, *buf, ffi::DataType::F32); e.failure()) return e;
  }
  const std::string blocks = "one per 256-element block of p " + ShapeStr(p);
  if (auto e = ExpectCount(kOp, "am", am, nblocks, blocks); e.failure()) return e;
  if (auto e = ExpectCount(kOp, "av", av, nblocks, blocks); e.failure()) return e;
  if (auto e = ExpectCount(kOp, "scalars", scalars, kAdamw8bitScalars,
                           "b1, 1-b1, b2, 1-b2, step, eps_hat, decay, gscale, t");
      e.failure()) {
    return e;
  }
  if (auto e = ExpectCount(kOp, "aux", aux, kAdamw8bitAuxWords,
                           "the code tables of adamw_8bit.py KERNEL_AUX");
      e.failure()) {
    return e;
  }
  if (auto e = Prepare("p", p, *p_out, stream); e.failure()) return e;
  if (auto e = Prepare("qm", qm, *qm_out, stream); e.failure()) return e;
  if (auto e = Prepare("qv", qv, *qv_out, stream); e.failure()) return e;
  if (auto e = Prepare("am", am, *am_out, stream); e.failure()) return e;
  if (auto e = Prepare("av", av, *av_out, stream); e.failure()) return e;
  if (n == 0) return ffi::Error::Success();

  return DispatchFloat(kOp, p.element_type(), [&](auto ptag) -> ffi::Error {
    return DispatchFloat(kOp, g.element_type(), [&](auto gtag) -> ffi::Error {
      using TP = decltype(ptag);
      using TG = decltype(gtag);
      const cudaError_t err = adamw_8bit_update<TP, TG>(
          static_cast<TP*>(p_out->untyped_data()), static_cast<const TG*>(g.untyped_data()),
          static_cast<uint8_t*>(qm_out->untyped_data()),
          static_cast<uint8_t*>(qv_out->untyped_data()),
          static_cast<float*>(am_out->untyped_data()), static_cast<float*>(av_out->untyped_data()),
          static_cast<const float*>(scalars.untyped_data()),
          static_cast<const uint32_t*>(aux.untyped_data()), n, stream);
      return CudaError(kOp, err);
    });
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kAdamw8bitUpdateHandler, Adamw8bitUpdate,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // g
                            .Arg<ffi::AnyBuffer>()    // p
                            .Arg<ffi::AnyBuffer>()    // qm
                            .Arg<ffi::AnyBuffer>()    // qv
                            .Arg<ffi::AnyBuffer>()    // am
                            .Arg<ffi::AnyBuffer>()    // av
                            .Arg<ffi::AnyBuffer>()    // scalars
                            .Arg<ffi::AnyBuffer>()    // aux
                            .Ret<ffi::AnyBuffer>()    // p'
                            .Ret<ffi::AnyBuffer>()    // qm'
                            .Ret<ffi::AnyBuffer>()    // qv'
                            .Ret<ffi::AnyBuffer>()    // am'
                            .Ret<ffi::AnyBuffer>());  // av'

Targets Adamw8bitTargets() { return {SUROGATE_TARGET(kOp.data(), kAdamw8bitUpdateHandler)}; }

}  // namespace surogate::ffi_bind
