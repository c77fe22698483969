// XLA FFI handlers for the NVFP4 quantizer: check shapes/dtypes, pick the element type, call the
// launchers in kernels/nvfp4_quantize.h on XLA's stream. Python side:
// surogate_jax/ops/nvfp4_quantize.py (quantize / fake_quantize with impl="ffi").
//
//   surogate_nvfp4_amax(x [..., K]; rht_sign_mask: i32) -> amax [1] f32
//   surogate_nvfp4_quantize(x [..., K], amax [1] f32, seed [2] u32;
//                           tile_2d, four_over_six, stochastic, rht_sign_mask: i32)
//       -> codes [..., K/2] u8, scales f8e4m3fn [..., K/16] (1x16) or [..., ceil(M/16), K/16]
//          (tile_2d, x [..., M, K]), global_scale [] f32
// K must be a positive multiple of 16; x is float32, bfloat16 or float16, 16-byte aligned (XLA's
// buffers are; the kernels only vector-load). rht_sign_mask = -1 means no Hadamard transform. The
// Python wrapper uses vmap_method="sequential": every vmapped slice is a separate tensor with its
// own global scale. Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h):
// the launchers only read device attributes and enqueue kernels and async memsets.
#include <string>

#include "ffi/ffi_common.h"
#include "kernels/nvfp4_quantize.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kAmax = "surogate_nvfp4_amax";
constexpr std::string_view kQuant = "surogate_nvfp4_quantize";

ffi::Error CheckBlockAxis(std::string_view op, const ffi::AnyBuffer& x, int64_t* rows, int64_t* k) {
  if (auto e = RowsAndDim(op, "x", x, rows, k); e.failure()) return e;
  if (*k <= 0 || *k % 16 != 0) {
    return InvalidArg(
        op,
        "the last (block) axis of x must be a positive multiple of 16, got shape " + ShapeStr(x));
  }
  return ExpectAligned16(op, "x", x.untyped_data(), "the quantizer's vector loads");
}

ffi::Error CheckMask(std::string_view op, int32_t mask) {
  if (mask < -1 || mask >= (1 << 16)) {
    return InvalidArg(op, "rht_sign_mask must be -1 or in [0, 65535], got " + std::to_string(mask));
  }
  return ffi::Error::Success();
}

ffi::Error CheckCount(std::string_view op, const char* name, const ffi::AnyBuffer& b, size_t n) {
  if (b.element_count() == n) return ffi::Error::Success();
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + ", expected " +
                            std::to_string(n) + " element(s)");
}

ffi::Error CheckDims(std::string_view op, const char* name, const ffi::AnyBuffer& b,
                     const std::vector<int64_t>& want) {
  const auto dims = b.dimensions();
  bool ok = dims.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = dims[i] == want[i];
  if (ok) return ffi::Error::Success();
  std::string w = "[";
  for (size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
  return InvalidArg(op, std::string(name) + " has shape " + ShapeStr(b) + ", expected " + w + "]");
}

ffi::Error Nvfp4Amax(cudaStream_t stream, int32_t rht_sign_mask, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> amax) {
  int64_t rows = 0, k = 0;
  if (auto e = CheckBlockAxis(kAmax, x, &rows, &k); e.failure()) return e;
  if (auto e = CheckMask(kAmax, rht_sign_mask); e.failure()) return e;
  if (auto e = ExpectDtype(kAmax, "amax", *amax, ffi::DataType::F32); e.failure()) return e;
  if (auto e = CheckCount(kAmax, "amax", *amax, 1); e.failure()) return e;
  return DispatchFloat(kAmax, x.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(kAmax,
                     nvfp4_amax<T>(static_cast<const T*>(x.untyped_data()), rows * k, rht_sign_mask,
                                   static_cast<float*>(amax->untyped_data()), stream));
  });
}

ffi::Error Nvfp4Quantize(cudaStream_t stream, int32_t tile_2d, int32_t four_over_six,
                         int32_t stochastic, int32_t rht_sign_mask, ffi::AnyBuffer x,
                         ffi::AnyBuffer amax, ffi::AnyBuffer seed,
                         ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                         ffi::Result<ffi::AnyBuffer> global_scale) {
  int64_t rows = 0, k = 0;
  if (auto e = CheckBlockAxis(kQuant, x, &rows, &k); e.failure()) return e;
  if (auto e = CheckMask(kQuant, rht_sign_mask); e.failure()) return e;
  const auto dims = x.dimensions();
  if (tile_2d && dims.size() < 2) {
    return InvalidArg(kQuant, "tile_2d needs x of rank >= 2, got shape " + ShapeStr(x));
  }
  if (auto e = ExpectDtype(kQuant, "amax", amax, ffi::DataType::F32); e.failure()) return e;
  if (auto e = CheckCount(kQuant, "amax", amax, 1); e.failure()) return e;
  if (auto e = ExpectDtype(kQuant, "seed", seed, ffi::DataType::U32); e.failure()) return e;
  if (auto e = CheckCount(kQuant, "seed", seed, 2); e.failure()) return e;
  if (auto e = ExpectDtype(kQuant, "codes", *codes, ffi::DataType::U8); e.failure()) return e;
  if (auto e = ExpectDtype(kQuant, "scales", *scales, ffi::DataType::F8E4M3FN); e.failure())
    return e;
  if (auto e = ExpectDtype(kQuant, "global_scale", *global_scale, ffi::DataType::F32);
      e.failure()) {
    return e;
  }
  if (auto e = CheckCount(kQuant, "global_scale", *global_scale, 1); e.failure()) return e;

  std::vector<int64_t> want(dims.begin(), dims.end());
  want.back() = k / 2;
  if (auto e = CheckDims(kQuant, "codes", *codes, want); e.failure()) return e;
  int64_t batch = 1, m = rows;
  want.back() = k / 16;
  if (tile_2d) {
    m = dims[dims.size() - 2];
    batch = m == 0 ? 0 : rows / m;
    want[want.size() - 2] = (m + 15) / 16;
  }
  if (auto e = CheckDims(kQuant, "scales", *scales, want); e.failure()) return e;

  Nvfp4Options opt;
  opt.tile_2d = tile_2d != 0;
  opt.four_over_six = four_over_six != 0;
  opt.stochastic = stochastic != 0;
  opt.rht_sign_mask = rht_sign_mask;
  return DispatchFloat(kQuant, x.element_type(), [&](auto tag) -> ffi::Error {
    using T = decltype(tag);
    return CudaError(kQuant,
                     nvfp4_quantize<T>(static_cast<const T*>(x.untyped_data()), batch, m, k,
                                       static_cast<const float*>(amax.untyped_data()),
                                       static_cast<const uint32_t*>(seed.untyped_data()), opt,
                                       static_cast<uint8_t*>(codes->untyped_data()),
                                       static_cast<uint8_t*>(scales->untyped_data()),
                                       static_cast<float*>(global_scale->untyped_data()), stream));
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kNvfp4AmaxHandler, Nvfp4Amax,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<int32_t>("rht_sign_mask")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Ret<ffi::AnyBuffer>());  // amax

SUROGATE_DEFINE_HANDLER(kNvfp4QuantizeHandler, Nvfp4Quantize,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<int32_t>("tile_2d")
                            .Attr<int32_t>("four_over_six")
                            .Attr<int32_t>("stochastic")
                            .Attr<int32_t>("rht_sign_mask")
                            .Arg<ffi::AnyBuffer>()    // x
                            .Arg<ffi::AnyBuffer>()    // amax
                            .Arg<ffi::AnyBuffer>()    // seed
                            .Ret<ffi::AnyBuffer>()    // codes
                            .Ret<ffi::AnyBuffer>()    // scales
                            .Ret<ffi::AnyBuffer>());  // global_scale

Targets Nvfp4QuantizeTargets() {
  return {SUROGATE_TARGET(kAmax.data(), kNvfp4AmaxHandler),
          SUROGATE_TARGET(kQuant.data(), kNvfp4QuantizeHandler)};
}

}  // namespace surogate::ffi_bind
