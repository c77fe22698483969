// XLA FFI handlers for the native NVFP4 GEMM (cuBLASLt block-scaled FP4, SM100+) and its operand
// preparation (Python side: surogate_jax/ops/nvfp4_matmul.py).
//
// NOT YET RUN ON HARDWARE: the GEMM compiles (sm_100a) but has never run on an SM100 GPU in this
// project (ours are H100s, where it refuses and the caller emulates); only the operand preparation
// (swizzle, transpose) has run, against pure-JAX references on Hopper.
//
//   surogate_nvfp4_swizzle_scales(scales [S, C] u8|f8e4m3fn; rows: i64, row_div: i32)
//       -> u8 [ceil(rows/128)*128 * ceil(C/4)*4]           (kernels/nvfp4_matmul.h has the layout)
//   surogate_nvfp4_transpose_codes(codes [R, C/2] u8) -> u8 [C, R/2]
//   surogate_nvfp4_matmul(a [M, K/2] u8, a_scales (swizzled, M rows), b [N, K/2] u8,
//                         b_scales (swizzled, N rows), a_gs f32 [], b_gs f32 [])
//       -> d [M, N] (bfloat16 | float32 | float16), ws u8 [W]
//   d[m, n] = a_gs * b_gs * sum_k e2m1(a[m, k]) * S_a[m, k/16] * e2m1(b[n, k]) * S_b[n, k/16]
//   (fp32 accumulation in the tensor cores; the order of the partial sums is cuBLASLt's).
//
// cuBLASLt's block-scaled FP4 (cuBLAS >= 12.8;
// https://docs.nvidia.com/cuda/cublas/#cublasltmatmul): A/B type CUDA_R_4F_E2M1,
// CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, A/B_SCALE_MODE =
// CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 with A/B_SCALE_POINTER the swizzled E4M3 block scales,
// only the "TN" layout (both operands K-major). The per-tensor FP32 decode scales have no slot in
// that mode, so they go through alpha: alpha = a_gs * b_gs is computed on the device by a
// one-thread kernel into the first 8 bytes of `ws` (with beta = 0 next to it), and the descriptor
// uses CUBLASLT_POINTER_MODE_DEVICE, which Transformer Engine uses for its NVFP4 GEMMs
// (NVIDIA/TransformerEngine transformer_engine/common/gemm/cublaslt_gemm.cu): the scales never
// leave the GPU and the call stays capturable. The rest of ws (from the first 256-byte boundary
// after alpha/beta) is cuBLASLt's workspace.
//
// The descriptor, layouts, plan cache and the mapping of our row-major a b^T onto column-major
// cuBLASLt (its A is our b, so its A scales are our b_scales) are shared with the FP8 GEMM in
// ffi/cublaslt_matmul.h. Requirements checked here: K % 32 == 0 (rows of K/2 bytes stay 16-byte
// aligned), N % 16 == 0, a, b, d, scale buffers 16-byte aligned; M is free. At run time a device
// below compute capability 10.0 or a cuBLASLt older than 12.8 gets an error naming the GPU / the
// version. Handlers are command-buffer compatible (SUROGATE_GRAPH_SAFE, ffi_common.h): they only
// read device attributes and enqueue work.
#include <string>
#include <tuple>
#include <utility>

#include "ffi/cublaslt_matmul.h"
#include "ffi/ffi_common.h"
#include "kernels/nvfp4_matmul.h"

#if SUROGATE_HAVE_CUBLASLT && defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120800
#define SUROGATE_HAVE_FP4_GEMM 1
#else
#define SUROGATE_HAVE_FP4_GEMM 0
#endif

namespace surogate::ffi_bind {
namespace {

constexpr std::string_view kSwizzle = "surogate_nvfp4_swizzle_scales";
constexpr std::string_view kTranspose = "surogate_nvfp4_transpose_codes";
constexpr std::string_view kGemm = "surogate_nvfp4_matmul";
constexpr size_t kWsHead =
    256;  // room for alpha, beta (device) and the 256-byte alignment of the workspace

bool IsScaleType(ffi::DataType t) { return t == ffi::DataType::U8 || t == ffi::DataType::F8E4M3FN; }

ffi::Error Check2d(std::string_view op, const char* name, const ffi::AnyBuffer& b, int64_t* r,
                   int64_t* c) {
  const auto dims = b.dimensions();
  if (dims.size() != 2) {
    return InvalidArg(op, std::string(name) + " must be 2-D, got shape " + ShapeStr(b));
  }
  *r = dims[0];
  *c = dims[1];
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------------------------

ffi::Error SwizzleScales(cudaStream_t stream, int64_t rows, int32_t row_div, ffi::AnyBuffer scales,
                         ffi::Result<ffi::AnyBuffer> out) {
  int64_t s_rows = 0, cols = 0;
  if (auto e = Check2d(kSwizzle, "scales", scales, &s_rows, &cols); e.failure()) return e;
  if (!IsScaleType(scales.element_type())) {
    return InvalidArg(kSwizzle, "scales has dtype " + DtypeName(scales.element_type()) +
                                    ", expected uint8 or float8_e4m3fn");
  }
  if (auto e = ExpectDtype(kSwizzle, "out", *out, ffi::DataType::U8); e.failure()) return e;
  if (row_div != 1 && row_div != 16) {
    return InvalidArg(kSwizzle, "row_div must be 1 (1x16 blocks) or 16 (16x16 tiles), got " +
                                    std::to_string(row_div));
  }
  if (rows < 0 || (rows + row_div - 1) / row_div > s_rows) {
    return InvalidArg(
        kSwizzle, "rows = " + std::to_string(rows) + " with row_div " + std::to_string(row_div) +
                      " needs more scale rows than scales " + ShapeStr(scales) + " has");
  }
  const int64_t want = nvfp4_swizzled_scale_bytes(rows, cols);
  if (static_cast<int64_t>(out->element_count()) != want) {
    return InvalidArg(kSwizzle, "out has shape " + ShapeStr(*out) + ", expected " +
                                    std::to_string(want) + " bytes for " + std::to_string(rows) +
                                    " rows x " + std::to_string(cols) + " scale columns");
  }
  return CudaError(
      kSwizzle,
      nvfp4_swizzle_scales(static_cast<const uint8_t*>(scales.untyped_data()), s_rows, cols, rows,
                           row_div, static_cast<uint8_t*>(out->untyped_data()), stream));
}

ffi::Error TransposeCodes(cudaStream_t stream, ffi::AnyBuffer codes,
                          ffi::Result<ffi::AnyBuffer> out) {
  int64_t rows = 0, half_cols = 0;
  if (auto e = Check2d(kTranspose, "codes", codes, &rows, &half_cols); e.failure()) return e;
  if (auto e = ExpectDtype(kTranspose, "codes", codes, ffi::DataType::U8); e.failure()) return e;
  if (auto e = ExpectDtype(kTranspose, "out", *out, ffi::DataType::U8); e.failure()) return e;
  const int64_t cols = 2 * half_cols;
  if (rows % 2 != 0) {
    return InvalidArg(kTranspose,
                      "codes has " + std::to_string(rows) +
                          " rows; the transpose packs two rows per byte, so it must be even");
  }
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != cols || od[1] != rows / 2) {
    return InvalidArg(kTranspose, "out has shape " + ShapeStr(*out) + ", expected [" +
                                      std::to_string(cols) + ", " + std::to_string(rows / 2) + "]");
  }
  return CudaError(kTranspose,
                   nvfp4_transpose_codes(static_cast<const uint8_t*>(codes.untyped_data()), rows,
                                         cols, static_cast<uint8_t*>(out->untyped_data()), stream));
}

// ----------------------------------------------------------------------------------------------
// The GEMM

std::string Dims(int64_t m, int64_t n, int64_t k) {
  return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

std::string DeviceName(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess)
    return "device " + std::to_string(device);
  return std::string(prop.name) + " (device " + std::to_string(device) + ", compute capability " +
         std::to_string(prop.major) + "." + std::to_string(prop.minor) + ")";
}

#if SUROGATE_HAVE_FP4_GEMM
cudaDataType_t OutType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16:
      return CUDA_R_16BF;
    case ffi::DataType::F16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}
#endif

ffi::Error Nvfp4Gemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                     ffi::AnyBuffer b, ffi::AnyBuffer b_scales, ffi::AnyBuffer a_gs,
                     ffi::AnyBuffer b_gs, ffi::Result<ffi::AnyBuffer> d,
                     ffi::Result<ffi::AnyBuffer> ws) {
  int64_t m = 0, ka = 0, n = 0, kb = 0;
  if (auto e = Check2d(kGemm, "a", a, &m, &ka); e.failure()) return e;
  if (auto e = Check2d(kGemm, "b", b, &n, &kb); e.failure()) return e;
  if (auto e = ExpectDtype(kGemm, "a", a, ffi::DataType::U8); e.failure()) return e;
  if (auto e = ExpectDtype(kGemm, "b", b, ffi::DataType::U8); e.failure()) return e;
  if (ka != kb) {
    return InvalidArg(kGemm, "a has shape " + ShapeStr(a) + " and b has shape " + ShapeStr(b) +
                                 " (packed codes, K/2 bytes per row): their reduction dims differ");
  }
  const int64_t k = 2 * ka;
  if (k % 32 != 0 || n % 16 != 0) {
    return InvalidArg(kGemm, "the FP4 GEMM needs K % 32 == 0 and N % 16 == 0; got " +
                                 Dims(m, n, k) +
                                 " (pad K with zeros, or use the emulated backend)");
  }
  for (auto [name, buf, rows] :
       {std::tuple<const char*, const ffi::AnyBuffer*, int64_t>{"a_scales", &a_scales, m},
        {"b_scales", &b_scales, n}}) {
    if (!IsScaleType(buf->element_type())) {
      return InvalidArg(kGemm,
                        std::string(name) + " has dtype " + DtypeName(buf->element_type()) +
                            ", expected uint8 or float8_e4m3fn (swizzled E4M3 block scales)");
    }
    const int64_t want = nvfp4_swizzled_scale_bytes(rows, k / 16);
    if (static_cast<int64_t>(buf->element_count()) != want) {
      return InvalidArg(kGemm, std::string(name) + " has shape " + ShapeStr(*buf) + ", expected " +
                                   std::to_string(want) + " bytes (swizzled scales of " +
                                   std::to_string(rows) + " rows x " + std::to_string(k / 16) +
                                   " blocks, padded to 128 x 4)");
    }
  }
  for (auto [name, buf] :
       {std::pair<const char*, const ffi::AnyBuffer*>{"a_gs", &a_gs}, {"b_gs", &b_gs}}) {
    if (auto e = ExpectDtype(kGemm, name, *buf, ffi::DataType::F32); e.failure()) return e;
    if (buf->element_count() != 1) {
      return InvalidArg(
          kGemm, std::string(name) + " has shape " + ShapeStr(*buf) + ", expected one element");
    }
  }
  const ffi::DataType td = d->element_type();
  if (td != ffi::DataType::BF16 && td != ffi::DataType::F32 && td != ffi::DataType::F16) {
    return InvalidArg(kGemm,
                      "d has dtype " + DtypeName(td) + ", expected bfloat16, float32 or float16");
  }
  const auto dd = d->dimensions();
  if (dd.size() != 2 || dd[0] != m || dd[1] != n) {
    return InvalidArg(kGemm, "d has shape " + ShapeStr(*d) + ", expected [" + std::to_string(m) +
                                 ", " + std::to_string(n) + "]");
  }
  if (auto e = ExpectDtype(kGemm, "ws", *ws, ffi::DataType::U8); e.failure()) return e;
  if (ws->size_bytes() < kWsHead) {
    return InvalidArg(kGemm, "ws has " + std::to_string(ws->size_bytes()) +
                                 " bytes, need at least " + std::to_string(kWsHead));
  }
  for (auto [name, p] : {std::pair<const char*, const void*>{"a", a.untyped_data()},
                         {"b", b.untyped_data()},
                         {"a_scales", a_scales.untyped_data()},
                         {"b_scales", b_scales.untyped_data()},
                         {"d", d->untyped_data()},
                         {"ws", ws->untyped_data()}}) {
    if (auto e = ExpectAligned16(kGemm, name, p, "the FP4 GEMM"); e.failure()) return e;
  }
  // The device check comes before the empty-shape shortcuts, so a wrong GPU always says so.
  int device = 0, major = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(kGemm, err);
  if (cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      err != cudaSuccess) {
    return CudaError(kGemm, err);
  }
  if (major < 10) {
    return ffi::Error(
        ffi::ErrorCode::kUnimplemented,
        std::string(kGemm) + ": block-scaled FP4 GEMMs need an SM100+ GPU (Blackwell); " +
            DeviceName(device) + " has none. Use the emulated NVFP4 backend on this GPU");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
#if SUROGATE_HAVE_FP4_GEMM
  // From here on: not yet run on hardware (see the top of this file).
  const auto& lt = lt::Get();
  if (!lt.error.empty()) return ffi::Error::Internal(std::string(kGemm) + ": " + lt.error);
  if (lt.GetVersion() < 120800) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(kGemm) + ": the loaded cuBLASLt (version " +
                          std::to_string(lt.GetVersion()) +
                          ") has no block-scaled FP4 GEMM; it needs 12.8 or newer");
  }
  auto* head = static_cast<float*>(ws->untyped_data());  // [alpha, beta]
  if (auto e = CudaError(
          kGemm, nvfp4_gemm_alpha(static_cast<const float*>(a_gs.untyped_data()),
                                  static_cast<const float*>(b_gs.untyped_data()), head, stream));
      e.failure()) {
    return e;
  }
  cublasLtHandle_t handle = nullptr;
  if (auto e = lt::Handle(kGemm, device, &handle); e.failure()) return e;
  // cuBLASLt's workspace: the first 256-byte boundary at or after byte 8 (TE aligns it to 256 too).
  const auto base = reinterpret_cast<uintptr_t>(ws->untyped_data());
  const uintptr_t start = (base + 2 * sizeof(float) + 255) & ~static_cast<uintptr_t>(255);
  lt::MatmulSpec spec;
  spec.device = device;
  spec.m = m;
  spec.n = n;
  spec.k = k;
  spec.a_type = CUDA_R_4F_E2M1;
  spec.b_type = CUDA_R_4F_E2M1;
  spec.d_type = OutType(td);
  spec.align_a = lt::Alignment(a.untyped_data());
  spec.align_b = lt::Alignment(b.untyped_data());
  spec.align_d = lt::Alignment(d->untyped_data());
  spec.ws_bytes = ws->size_bytes() - static_cast<size_t>(start - base);
  spec.vec16_scales = true;
  spec.device_alpha = true;
  return lt::Matmul(kGemm, handle, spec, a.untyped_data(), b.untyped_data(),
                    a_scales.untyped_data(), b_scales.untyped_data(), head, head + 1,
                    d->untyped_data(), reinterpret_cast<void*>(start), stream);
#else
  (void)stream;
  return ffi::Error(
      ffi::ErrorCode::kUnimplemented,
      std::string(kGemm) +
          ": the extension was built without a cuBLAS >= 12.8 cublasLt.h "
          "(no block-scaled FP4 in its headers); rebuild against CUDA 12.8+ to use the native "
          "NVFP4 GEMM on " +
          DeviceName(device));
#endif
}

}  // namespace

SUROGATE_DEFINE_HANDLER(kNvfp4SwizzleHandler, SwizzleScales,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Attr<int64_t>("rows")
                            .Attr<int32_t>("row_div")
                            .Arg<ffi::AnyBuffer>()    // scales
                            .Ret<ffi::AnyBuffer>());  // swizzled

SUROGATE_DEFINE_HANDLER(kNvfp4TransposeHandler, TransposeCodes,
                        ffi::Ffi::Bind()
                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                            .Arg<ffi::AnyBuffer>()    // codes
                            .Ret<ffi::AnyBuffer>());  // transposed codes

SUROGATE_DEFINE_HANDLER(
    kNvfp4GemmHandler, Nvfp4Gemm,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()    // a codes
        .Arg<ffi::AnyBuffer>()    // a_scales (swizzled)
        .Arg<ffi::AnyBuffer>()    // b codes
        .Arg<ffi::AnyBuffer>()    // b_scales (swizzled)
        .Arg<ffi::AnyBuffer>()    // a_gs
        .Arg<ffi::AnyBuffer>()    // b_gs
        .Ret<ffi::AnyBuffer>()    // d
        .Ret<ffi::AnyBuffer>());  // ws (alpha/beta + cuBLASLt workspace, discarded)

Targets Nvfp4MatmulTargets() {
  return {SUROGATE_TARGET(kSwizzle.data(), kNvfp4SwizzleHandler),
          SUROGATE_TARGET(kTranspose.data(), kNvfp4TransposeHandler),
          SUROGATE_TARGET(kGemm.data(), kNvfp4GemmHandler)};
}

}  // namespace surogate::ffi_bind
