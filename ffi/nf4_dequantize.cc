// XLA FFI handler for NF4 dequantization: check sizes/dtypes, pick the output type, call the
// launcher in kernels/nf4_dequantize.h on XLA's stream. Python side:
// surogate_jax/ops/nf4_dequantize.py.
//
//   surogate_nf4_dequantize(codes u8 [ceil(n/2)], absmax f32 [ceil(n/block_size)],
//                           code_table f32 [16], scale f32 [], group_sizes s32 [E];
//                           block_size: i64, has_scale: i32, has_groups: i32,
//                           via: i32 (0 none, 1 bf16, 2 f16: each product rounded to it first))
//       -> out [rows, cols] (f32, bf16, f16 or f8e4m3fn), n = rows * cols
// The output's element count is n, whatever its rank. has_scale == 0: the scale operand is
// ignored (neither read nor checked) and no multiply happens. has_groups == 0: group_sizes is
// ignored; else out is E stacked experts of n / E weights each (E must divide n) and the weights
// of an expert whose group size is <= 0 are left unwritten (selective MoE dequantization).
// The Python wrapper uses vmap_method="sequential" (one call per vmapped weight). The handler is
// command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): the launcher only enqueues a
// kernel.
#include <string>
#include <string_view>

#include "ffi/ffi_common.h"
#include "kernels/nf4_dequantize.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kOp = "surogate_nf4_dequantize";

ffi::Error Nf4Dequantize(cudaStream_t stream, int64_t block_size, int32_t has_scale,
                         int32_t has_groups, int32_t via, ffi::AnyBuffer codes,
                         ffi::AnyBuffer absmax, ffi::AnyBuffer code_table, ffi::AnyBuffer scale,
                         ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  if (block_size != 64 && block_size != 128 && block_size != 256 && block_size != 512) {
    return InvalidArg(kOp,
                      "block_size must be 64, 128, 256 or 512, got " + std::to_string(block_size));
  }
  if (via < 0 || via > 2) {
    return InvalidArg(
        kOp, "via must be 0 (none), 1 (bfloat16) or 2 (float16), got " + std::to_string(via));
  }
  const int64_t n = static_cast<int64_t>(out->element_count());
  const std::string bs = std::to_string(block_size);
  if (auto e = ExpectDtype(kOp, "codes", codes, ffi::DataType::U8); e.failure()) return e;
  if (auto e = ExpectCount(kOp, "codes", codes, (n + 1) / 2,
                           "ceil(n / 2) for out " + ShapeStr(*out) + ", n = " + std::to_string(n));
      e.failure()) {
    return e;
  }
  if (auto e = ExpectDtype(kOp, "absmax", absmax, ffi::DataType::F32); e.failure()) return e;
  if (auto e = ExpectCount(kOp, "absmax", absmax, (n + block_size - 1) / block_size,
                           "ceil(n / " + bs + ") for out " + ShapeStr(*out));
      e.failure()) {
    return e;
  }
  if (auto e = ExpectDtype(kOp, "code_table", code_table, ffi::DataType::F32); e.failure()) {
    return e;
  }
  if (auto e = ExpectCount(kOp, "code_table", code_table, 16, "one float per 4-bit code");
      e.failure()) {
    return e;
  }
  if (has_scale) {
    if (auto e = ExpectDtype(kOp, "scale", scale, ffi::DataType::F32); e.failure()) return e;
    if (auto e = ExpectCount(kOp, "scale", scale, 1, "a scalar"); e.failure()) return e;
  }
  const int32_t* groups = nullptr;
  int64_t per_group = 0;
  if (has_groups) {
    if (auto e = ExpectDtype(kOp, "group_sizes", group_sizes, ffi::DataType::S32); e.failure()) {
      return e;
    }
    const int64_t num_groups = static_cast<int64_t>(group_sizes.element_count());
    if (num_groups < 1 || n % num_groups != 0) {
      return InvalidArg(kOp, "group_sizes has " + std::to_string(num_groups) +
                                 " experts, which must divide the " + std::to_string(n) +
                                 " weights of out " + ShapeStr(*out));
    }
    groups = In<int32_t>(group_sizes);
    per_group = n / num_groups;
  }
  const auto* sc = has_scale ? static_cast<const float*>(scale.untyped_data()) : nullptr;
  return DispatchFloatOrE4m3(kOp, out->element_type(), [&](auto tag) -> ffi::Error {
    using OutT = decltype(tag);
    return CudaError(
        kOp, nf4_dequantize<OutT>(In<uint8_t>(codes), In<float>(absmax), In<float>(code_table), sc,
                                  Out<OutT>(out), n, static_cast<int>(block_size),
                                  static_cast<DequantVia>(via), groups, per_group, stream));
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kNf4DequantizeHandler, Nf4Dequantize,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<int64_t>("block_size")
                            .Attr<int32_t>("has_scale")
                            .Attr<int32_t>("has_groups")
                            .Attr<int32_t>("via")
                            .Arg<ffi::AnyBuffer>()    // codes
                            .Arg<ffi::AnyBuffer>()    // absmax
                            .Arg<ffi::AnyBuffer>()    // code_table
                            .Arg<ffi::AnyBuffer>()    // scale
                            .Arg<ffi::AnyBuffer>()    // group_sizes
                            .Ret<ffi::AnyBuffer>());  // out

Targets Nf4DequantizeTargets() { return {SUROGATE_TARGET(kOp.data(), kNf4DequantizeHandler)}; }

}  // namespace surogate::ffi_bind
