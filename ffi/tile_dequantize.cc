// XLA FFI handler for tile-scaled weight dequantization (FP8 block-scaled and NVFP4 bases): check
// sizes/dtypes, pick the output type, call the launcher in kernels/tile_dequantize.h on XLA's
// stream. Python side: surogate_jax/ops/tile_dequantize.py.
//
//   surogate_tile_dequantize(codes, tile_scales, global_scale f32 [], scale f32 [],
//                            group_sizes s32 [E];
//                            format: i32 (0 fp8, 1 nvfp4), tile: i64, has_scale: i32,
//                            has_groups: i32,
//                            via: i32 (0 none, 1 bf16, 2 f16: each value rounded to it first))
//       -> out [rows, cols] (f32, bf16, f16 or f8e4m3fn)
//   fp8:   codes f8e4m3fn [rows, cols], tile_scales f32 [ceil(rows/tile), ceil(cols/tile)]
//   nvfp4: codes u8 [rows, cols/2], tile_scales f8e4m3fn [ceil(rows/16), cols/16], tile == 16
// global_scale is read for nvfp4 only; has_scale == 0: the scale operand is ignored (neither read
// nor checked). has_groups == 0: group_sizes is ignored; else out's rows are E stacked experts of
// rows / E rows each (E must divide rows) and the rows of an expert whose group size is <= 0 are
// left unwritten (selective MoE dequantization). The Python wrapper uses
// vmap_method="sequential". The handler is command-buffer compatible (SUROGATE_GRAPH_SAFE,
// ffi_common.h): the launcher only enqueues a kernel.
#include <string>
#include <string_view>

#include "ffi/ffi_common.h"
#include "kernels/tile_dequantize.h"

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kOp = "surogate_tile_dequantize";

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error TileDequantize(cudaStream_t stream, int32_t format, int64_t tile, int32_t has_scale,
                          int32_t has_groups, int32_t via, ffi::AnyBuffer codes,
                          ffi::AnyBuffer tile_scales, ffi::AnyBuffer global_scale,
                          ffi::AnyBuffer scale, ffi::AnyBuffer group_sizes,
                          ffi::Result<ffi::AnyBuffer> out) {
  if (format != 0 && format != 1) {
    return InvalidArg(kOp, "format must be 0 (fp8) or 1 (nvfp4), got " + std::to_string(format));
  }
  const bool nvfp4 = format == 1;
  if (nvfp4 ? tile != 16 : (tile < 16 || tile > 512 || (tile & (tile - 1)))) {
    return InvalidArg(kOp, std::string(nvfp4 ? "nvfp4 tiles are 16"
                                             : "fp8 tile must be a power of "
                                               "two in [16, 512]") +
                               ", got " + std::to_string(tile));
  }
  if (via < 0 || via > 2) {
    return InvalidArg(
        kOp, "via must be 0 (none), 1 (bfloat16) or 2 (float16), got " + std::to_string(via));
  }
  const auto dims = out->dimensions();
  if (dims.size() != 2) return InvalidArg(kOp, "out must be [rows, cols], got " + ShapeStr(*out));
  const int64_t rows = dims[0], cols = dims[1];
  if (nvfp4 && cols % 16) {
    return InvalidArg(kOp, "nvfp4 needs cols % 16 == 0, got out " + ShapeStr(*out));
  }
  const std::string shape = "out " + ShapeStr(*out) + ", tile " + std::to_string(tile);
  const int64_t ncodes = nvfp4 ? rows * (cols / 2) : rows * cols;
  if (auto e =
          ExpectDtype(kOp, "codes", codes, nvfp4 ? ffi::DataType::U8 : ffi::DataType::F8E4M3FN);
      e.failure()) {
    return e;
  }
  if (auto e = ExpectCount(kOp, "codes", codes, ncodes,
                           (nvfp4 ? "rows * cols / 2 for " : "rows * cols for ") + shape);
      e.failure()) {
    return e;
  }
  if (auto e = ExpectDtype(kOp, "tile_scales", tile_scales,
                           nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F32);
      e.failure()) {
    return e;
  }
  if (auto e = ExpectCount(kOp, "tile_scales", tile_scales,
                           CeilDiv(rows, tile) * CeilDiv(cols, tile), "one per tile of " + shape);
      e.failure()) {
    return e;
  }
  if (nvfp4) {
    if (auto e = ExpectDtype(kOp, "global_scale", global_scale, ffi::DataType::F32); e.failure()) {
      return e;
    }
    if (auto e = ExpectCount(kOp, "global_scale", global_scale, 1, "a scalar"); e.failure()) {
      return e;
    }
  }
  if (has_scale) {
    if (auto e = ExpectDtype(kOp, "scale", scale, ffi::DataType::F32); e.failure()) return e;
    if (auto e = ExpectCount(kOp, "scale", scale, 1, "a scalar"); e.failure()) return e;
  }
  const int32_t* groups = nullptr;
  int64_t rows_per_group = 0;
  if (has_groups) {
    if (auto e = ExpectDtype(kOp, "group_sizes", group_sizes, ffi::DataType::S32); e.failure()) {
      return e;
    }
    const int64_t num_groups = static_cast<int64_t>(group_sizes.element_count());
    if (num_groups < 1 || rows % num_groups != 0) {
      return InvalidArg(kOp, "group_sizes has " + std::to_string(num_groups) +
                                 " experts, which must divide the rows of out " + ShapeStr(*out));
    }
    groups = In<int32_t>(group_sizes);
    rows_per_group = rows / num_groups;
  }
  const auto* sc = has_scale ? static_cast<const float*>(scale.untyped_data()) : nullptr;
  const auto* gs = nvfp4 ? static_cast<const float*>(global_scale.untyped_data()) : nullptr;
  return DispatchFloatOrE4m3(kOp, out->element_type(), [&](auto tag) -> ffi::Error {
    using OutT = decltype(tag);
    return CudaError(
        kOp, tile_dequantize<OutT>(static_cast<TileFormat>(format), In<uint8_t>(codes),
                                   tile_scales.untyped_data(), gs, sc, Out<OutT>(out), rows, cols,
                                   static_cast<int>(tile), static_cast<DequantVia>(via), groups,
                                   rows_per_group, stream));
  });
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kTileDequantizeHandler, TileDequantize,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<int32_t>("format")
                            .Attr<int64_t>("tile")
                            .Attr<int32_t>("has_scale")
                            .Attr<int32_t>("has_groups")
                            .Attr<int32_t>("via")
                            .Arg<ffi::AnyBuffer>()    // codes
                            .Arg<ffi::AnyBuffer>()    // tile_scales
                            .Arg<ffi::AnyBuffer>()    // global_scale
                            .Arg<ffi::AnyBuffer>()    // scale
                            .Arg<ffi::AnyBuffer>()    // group_sizes
                            .Ret<ffi::AnyBuffer>());  // out

Targets TileDequantizeTargets() { return {SUROGATE_TARGET(kOp.data(), kTileDequantizeHandler)}; }

}  // namespace surogate::ffi_bind
