"""NVFP4 GEMMs: native block-scaled FP4 through cuBLASLt on SM100+, emulated elsewhere.

    nvfp4_gemm(a, b, out_dtype, backend) = a @ b^T
    a: NVFP4Tensor [M, K], b: NVFP4Tensor [N, K], both quantized along K (the reduction axis):
       1x16 blocks, or 16x16 tiles (tile_2d, weights). Output [M, N] in out_dtype.

Backends ("auto" picks native where `native_available()`, else emulated):
  * native   (SM100+ only): cuBLASLt's block-scaled FP4 GEMM (ffi/nvfp4_matmul.cc): E2M1 x E2M1
    products with per-16-element E4M3 scales, fp32 accumulation, alpha = the product of the two
    FP32 global decode scales. It approximates `nvfp4_gemm_ref` up to the accumulation order.
    NOT YET RUN ON HARDWARE: written and compiled for sm_100a, never run on an SM100 GPU in this
    project (our GPUs are H100s).
  * emulated (everywhere): dequantize both operands to bfloat16, bf16 GEMM with fp32
    accumulation (`nvfp4_gemm_emulated`; what the recipe always did on Hopper and CPU).
  `nvfp4_gemm_ref` is the exact target: both operands dequantized in float32, fp32 matmul.

Operand preparation for native (runs on any CUDA GPU, so it is tested on Hopper):
  * block scales -> cuBLASLt's swizzled VEC16 layout (`swizzle_scales`, CUDA kernel; reference
    `swizzle_scales_ref`). cuBLAS docs, "1D Block Scaling Factors Layout"
    (https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout): for an
    operand with R rows (M or N) and C = K/16 scale columns, pad to Rp = ceil(R/128)*128 and
    Cp = ceil(C/4)*4 with zeros; scale (r, c) goes to byte
        ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    (128x4 tiles of 512 bytes, tile-row-major; inside a tile a 32 x 4 x 4 interleave). Anchors from
    NVIDIA's nvmath-python `get_block_scale_offset` docs: for a [128, 128] operand (C = 8) scale
    (5, 2) -> 82 and (5, 5) -> 593. For a 16x16-tile operand row r takes tile row r // 16.
  * the fprop weight: y = X W needs W^T [N, K] K-major. The stored W [K, N] in 16x16 tiles is
    transposed exactly (`transpose`: a nibble transpose of the codes, `transpose_codes`, plus the
    transposed tile-scale grid); the tiles are the same 256 elements either way. Quantizing W^T
    afresh would give the same tile partition and amax, but Four Over Six's float32 error sums
    run over the other axis first (columns then rows), so a tile whose two candidate errors are
    within rounding could pick the other scale: the transpose is the exact choice.
  * dgrad dX = dY W^T: W's stored codes [K, N/2] are already reduction(N)-major, used as is.
  * wgrad dW = X^T dY: both operands are quantized along tokens ([K, T] and [N, T]), so K(=T)-major
    as they are; T is padded with zero tokens to a multiple of 32 (the GEMM's K % 32 rule).

Requirements of the native GEMM: K % 32 == 0, N % 16 == 0 (backend "auto" falls back to the
emulated GEMM for other shapes, "native" raises). Both operands must carry the same RHT sign mask
(or none): H is orthogonal, so the product of transformed operands equals the untransformed one.

fp4_backend (Surogate's key, values "cutlass" / "cudnn" naming its CUTLASS or cuDNN FP4 kernels):
we have neither kernel; both values select the same native cuBLASLt GEMM where available (SM100+),
the emulated GEMM elsewhere. Forcing emulation on an SM100 GPU: SUROGATE_JAX_OPS=ref:nvfp4_matmul
(or ref), or backend="emulated".
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from . import hadamard, nvfp4_quantize
from ._loader import resolve_impl
from ._sharding import on_shards
from .nvfp4_quantize import BLOCK, NVFP4Tensor, check_flags, dequantize, fake_quantize, quantize

_log = logging.getLogger("surogate_jax")

OP = "nvfp4_matmul"  # SUROGATE_JAX_OPS=ref:nvfp4_matmul forces the emulated GEMM and the jnp operand prep
SWIZZLE_TARGET = "surogate_nvfp4_swizzle_scales"
TRANSPOSE_TARGET = "surogate_nvfp4_transpose_codes"
GEMM_TARGET = "surogate_nvfp4_matmul"
BACKENDS = ("auto", "native", "emulated")
MIN_COMPUTE_CAPABILITY = 10  # major: Blackwell (sm_100 / sm_103 / sm_120 ...)
WS_HEAD = 256  # alpha/beta at the head of the handler's workspace output
WORKSPACE_BYTES = WS_HEAD + (32 << 20)
K_MULTIPLE = 32  # native: rows of K/2 bytes stay 16-byte aligned
N_MULTIPLE = 16


# --------------------------------------------------------------------------------------------
# Scale swizzle


def swizzled_scale_bytes(rows: int, cols: int) -> int:
    """Bytes of the swizzled VEC16 scale buffer of an operand with `rows` rows, `cols` = K/16."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


def _as_u8(scales: jax.Array) -> jax.Array:
    if scales.dtype == jnp.uint8:
        return scales
    if scales.dtype != jnp.dtype(jnp.float8_e4m3fn):
        raise TypeError(f"nvfp4 scales must be float8_e4m3fn or uint8, got {scales.dtype}")
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def _check_scales(scales, rows, row_div):
    if scales.ndim != 2:
        raise ValueError(f"swizzle_scales: scales must be 2-D [rows, K/16], got shape {scales.shape}")
    if row_div not in (1, BLOCK):
        raise ValueError(f"swizzle_scales: row_div must be 1 (1x16 blocks) or 16 (16x16 tiles), got {row_div}")
    rows = scales.shape[0] * row_div if rows is None else int(rows)
    if rows < 0 or -(-rows // row_div) > scales.shape[0]:
        raise ValueError(f"swizzle_scales: {rows} rows with row_div {row_div} need more than the "
                         f"{scales.shape[0]} scale rows given")
    return rows


def swizzle_scales_ref(scales: jax.Array, rows: int | None = None, row_div: int = 1) -> jax.Array:
    """Pure-jnp swizzle (module docstring formula): scales [S, C] (float8_e4m3fn or uint8 bytes)
    -> uint8 [swizzled_scale_bytes(rows, C)]. Operand row r uses scale row r // row_div
    (row_div 16 for 16x16 tiles); rows defaults to S * row_div. Padding bytes are zero."""
    rows = _check_scales(scales, rows, row_div)
    s = _as_u8(scales)
    if row_div > 1:
        s = jnp.repeat(s, row_div, axis=0)
    s = s[:rows]
    cols = s.shape[1]
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    s = jnp.pad(s, ((0, rp - rows), (0, cp - cols)))
    # r = rb*128 + i*32 + j (i = (r % 128) // 32, j = r % 32), c = cb*4 + l  ->  (rb, cb, j, i, l)
    s = s.reshape(rp // 128, 4, 32, cp // 4, 4).transpose(0, 3, 2, 1, 4)
    return s.reshape(-1)


def _swizzle_ffi(scales, rows, row_div):
    out = jax.ShapeDtypeStruct((swizzled_scale_bytes(rows, scales.shape[1]),), jnp.uint8)
    call = jax.ffi.ffi_call(SWIZZLE_TARGET, out, vmap_method="sequential")
    return call(scales, rows=np.int64(rows), row_div=np.int32(row_div))


def _pick(impl, ffi, ref):
    impl = resolve_impl(impl, OP)
    if impl == "ref":
        return ref
    if impl == "ffi":
        return ffi
    return functools.partial(jax.lax.platform_dependent, cuda=ffi, default=ref)


def swizzle_scales(scales: jax.Array, rows: int | None = None, row_div: int = 1,
                   impl: str | None = None) -> jax.Array:
    """`swizzle_scales_ref` through the CUDA kernel on GPU (impl None/"auto"/"ffi"/"ref")."""
    rows = _check_scales(scales, rows, row_div)
    if rows == 0 or scales.shape[1] == 0:
        return jnp.zeros((swizzled_scale_bytes(rows, scales.shape[1]),), jnp.uint8)
    fn = _pick(impl, lambda s: _swizzle_ffi(s, rows, row_div), lambda s: swizzle_scales_ref(s, rows, row_div))
    return fn(scales)


def operand_scales(q: NVFP4Tensor) -> tuple[jax.Array, int, int]:
    """(scales [S, K/16], rows, row_div) of a 2-D NVFP4 operand, for `swizzle_scales`."""
    if len(q.shape) != 2:
        raise ValueError(f"nvfp4_gemm: operands must be 2-D, got shape {q.shape}")
    return q.scales, q.shape[0], (BLOCK if q.tile_2d else 1)


# --------------------------------------------------------------------------------------------
# Exact transpose of a 16x16-tile operand


def transpose_codes_ref(codes: jax.Array) -> jax.Array:
    """Packed E2M1 codes [R, C/2] -> [C, R/2] of the transposed matrix (R even), pure jnp."""
    if codes.ndim != 2 or codes.shape[0] % 2:
        raise ValueError(f"transpose_codes: codes must be 2-D with an even row count, got {codes.shape}")
    u = nvfp4_quantize.unpack_codes(codes).T
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _transpose_ffi(codes):
    out = jax.ShapeDtypeStruct((codes.shape[1] * 2, codes.shape[0] // 2), jnp.uint8)
    return jax.ffi.ffi_call(TRANSPOSE_TARGET, out, vmap_method="sequential")(codes)


def transpose_codes(codes: jax.Array, impl: str | None = None) -> jax.Array:
    """`transpose_codes_ref` through the CUDA kernel on GPU."""
    if codes.ndim != 2 or codes.shape[0] % 2:
        raise ValueError(f"transpose_codes: codes must be 2-D with an even row count, got {codes.shape}")
    if codes.size == 0:
        return jnp.zeros((codes.shape[1] * 2, codes.shape[0] // 2), jnp.uint8)
    return _pick(impl, _transpose_ffi, transpose_codes_ref)(codes)


def transpose(q: NVFP4Tensor, impl: str | None = None) -> NVFP4Tensor:
    """The exact transpose of a 2-D 16x16-tile NVFP4 tensor [M, N] (M % 16 == 0): [N, M], the
    same tiles, codes nibble-transposed, the tile-scale grid transposed, the same global scale.
    dequantize(transpose(q)) == dequantize(q).T bit for bit."""
    if not q.tile_2d or len(q.shape) != 2:
        raise ValueError(f"nvfp4 transpose: needs a 2-D 16x16-tile tensor (tile_2d=True), got shape "
                         f"{q.shape}, tile_2d={q.tile_2d}; 1x16 blocks are not transposable")
    if q.rht_sign_mask is not None:
        raise ValueError("nvfp4 transpose: a tensor with an RHT along its last axis has no exact transpose")
    m, n = q.shape
    if m % BLOCK:
        raise ValueError(f"nvfp4 transpose: the row count {m} must be a multiple of {BLOCK} "
                         "(it becomes the block axis)")
    return NVFP4Tensor(transpose_codes(q.codes, impl), q.scales.T, q.global_scale, (n, m), True, None)


# --------------------------------------------------------------------------------------------
# Reference and emulated GEMMs


def _check_operands(a, b, fn):
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, NVFP4Tensor) or len(q.shape) != 2:
            raise ValueError(f"{fn}: {name} must be a 2-D NVFP4Tensor, got "
                             f"{getattr(q, 'shape', type(q).__name__)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{fn}: a {a.shape} and b {b.shape} must share the last (reduction) axis: a @ b^T")
    if a.rht_sign_mask != b.rht_sign_mask:
        raise ValueError(f"{fn}: a and b carry different RHT sign masks ({a.rht_sign_mask} vs "
                         f"{b.rht_sign_mask}); their product would not equal the untransformed one")


def nvfp4_gemm_ref(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype=jnp.float32) -> jax.Array:
    """a @ b^T with both operands dequantized in float32 and an fp32 matmul (HIGHEST precision):
    the values the native GEMM approximates up to its accumulation order."""
    _check_operands(a, b, "nvfp4_gemm_ref")
    y = jnp.matmul(nvfp4_quantize.dequantize(a), nvfp4_quantize.dequantize(b).T, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def nvfp4_gemm_emulated(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype=jnp.bfloat16) -> jax.Array:
    """The emulated GEMM: dequantize both operands to bfloat16, bf16 GEMM, fp32 accumulation."""
    _check_operands(a, b, "nvfp4_gemm_emulated")
    da = nvfp4_quantize.dequantize(a).astype(jnp.bfloat16)
    db = nvfp4_quantize.dequantize(b).astype(jnp.bfloat16)
    return jnp.matmul(da, db.T, preferred_element_type=jnp.float32).astype(out_dtype)


# --------------------------------------------------------------------------------------------
# Native GEMM and the backend choice


def _device_cc(device) -> tuple[int, int] | None:
    cc = str(getattr(device, "compute_capability", ""))
    try:
        major, minor = (int(p) for p in cc.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def native_available(device=None, impl: str | None = None) -> bool:
    """Whether NVFP4 GEMMs run natively: an NVIDIA GPU of compute capability >= 10.0 (the first
    JAX device by default), the CUDA extension built, and neither impl="ref" nor
    SUROGATE_JAX_OPS=ref / ref:nvfp4_matmul forcing emulation. False on CPU and Hopper."""
    if resolve_impl(impl, OP) == "ref":  # also "ref" when the extension is missing
        return False
    if device is None:
        try:
            device = jax.devices()[0]
        except RuntimeError:
            return False
    if device.platform not in ("gpu", "cuda"):
        return False
    cc = _device_cc(device)
    return cc is not None and cc[0] >= MIN_COMPUTE_CAPABILITY


def _device_words(device=None) -> str:
    try:
        device = device or jax.devices()[0]
    except RuntimeError:
        return "no JAX device"
    cc = _device_cc(device)
    kind = getattr(device, "device_kind", device.platform)
    return f"{kind} ({device.platform}{'' if cc is None else f', compute capability {cc[0]}.{cc[1]}'})"


def resolve_backend(backend: str = "auto", impl: str | None = None) -> str:
    """"native" or "emulated" for a requested backend ("auto" | "native" | "emulated")."""
    if backend not in BACKENDS:
        raise ValueError(f"nvfp4_gemm: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulated":
        return "emulated"
    if native_available(impl=impl):
        return "native"
    if backend == "native":
        raise RuntimeError(f"nvfp4_gemm: backend='native' needs an SM100+ GPU (compute capability >= 10.0), "
                           f"the CUDA extension, and no SUROGATE_JAX_OPS=ref; this is {_device_words()}")
    return "emulated"


def native_shape_ok(k: int, n: int) -> bool:
    """Whether the native GEMM takes a reduction dim k and output columns n."""
    return k % K_MULTIPLE == 0 and n % N_MULTIPLE == 0


def _native_local(a_codes, a_scales, b_codes, b_scales, a_gs, b_gs, *, a_rows_div, b_rows_div, out_dtype):
    m, n = a_codes.shape[0], b_codes.shape[0]
    sa = swizzle_scales(a_scales, m, a_rows_div, impl="ffi")
    sb = swizzle_scales(b_scales, n, b_rows_div, impl="ffi")
    out = (jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8))
    d, _ = jax.ffi.ffi_call(GEMM_TARGET, out, vmap_method="sequential")(
        a_codes, sa, b_codes, sb, a_gs.astype(jnp.float32).reshape(()), b_gs.astype(jnp.float32).reshape(()))
    return (d,)


def nvfp4_gemm_native(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype=jnp.bfloat16, *,
                      mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """The cuBLASLt block-scaled FP4 GEMM (SM100+; the handler errors, naming the GPU, elsewhere).
    Given a mesh with data axes it runs per shard of a's rows (b replicated), like fp8_matmul."""
    _check_operands(a, b, "nvfp4_gemm_native")
    k, n = a.shape[1], b.shape[0]
    if not native_shape_ok(k, n):
        raise ValueError(f"nvfp4_gemm: the native GEMM needs K % {K_MULTIPLE} == 0 and N % {N_MULTIPLE} == 0, "
                         f"got a {a.shape}, b {b.shape} (pad K with zeros, or use backend='emulated')")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise TypeError(f"nvfp4_gemm: out_dtype must be bfloat16, float32 or float16, got {out_dtype}")
    local = functools.partial(_native_local, a_rows_div=BLOCK if a.tile_2d else 1,
                              b_rows_div=BLOCK if b.tile_2d else 1, out_dtype=out_dtype)
    (d,) = on_shards(local, a.codes, a.scales, b.codes, b.scales, a.global_scale, b.global_scale, mesh=mesh,
                     batched=(True, True, False, False, False, False), out_batched=(True,))
    return d


def nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype=jnp.bfloat16, backend: str = "auto",
               impl: str | None = None, *, mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """a [M, K] @ b [N, K]^T of two NVFP4 operands quantized along K (see the module docstring).

    backend: "auto" (native on SM100+, else emulated; also emulated for shapes the native GEMM
    does not take), "native" (error off SM100+), "emulated" (dequantize to bf16, bf16 GEMM).
    impl="ref" (or SUROGATE_JAX_OPS=ref[:nvfp4_matmul]) forces emulation. mesh: the native GEMM
    runs per data shard of a's rows (`nvfp4_gemm_native`); the emulated one is plain XLA."""
    _check_operands(a, b, "nvfp4_gemm")
    chosen = resolve_backend(backend, impl)
    if chosen == "native" and (backend == "native" or native_shape_ok(a.shape[1], b.shape[0])):
        return nvfp4_gemm_native(a, b, out_dtype, mesh=mesh)
    return nvfp4_gemm_emulated(a, b, out_dtype)


# --------------------------------------------------------------------------------------------
# The one log line


def log_backend(native: bool) -> None:
    """Logs which NVFP4 GEMM path runs (log_emulation calls it once per process)."""
    if native:
        _log.info("nvfp4: GEMMs run natively (cuBLASLt block-scaled FP4 on %s; fp4_backend cutlass and "
                  "cudnn both select it)", _device_words())
    else:
        _log.info("nvfp4: GEMMs are emulated (operands quantized to NVFP4, dequantized to bf16, bf16 "
                  "GEMM): this device has no FP4 tensor cores. The native cuBLASLt block-scaled FP4 path "
                  "exists for SM100+ GPUs but has not run on hardware in this project")


# --------------------------------------------------------------------------------------------
# Emulated NVFP4 GEMM (Hopper and CPU: no FP4 tensor cores)


@functools.cache
def log_emulation() -> None:
    """The one log line (once per process) saying whether NVFP4 GEMMs run natively (SM100+ GPU)
    or emulated (elsewhere; the line says the native path exists for SM100+ and has not run on
    hardware in this project). Text: `log_backend`."""
    log_backend(native_available())


def nvfp4_matmul_emulated(x: jax.Array, w: jax.Array, *, four_over_six: bool = True,
                          out_dtype=None, impl: str | None = None,
                          mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """y = Q(x) @ Q(w) with x [..., K] quantized in 1x16 blocks along K and w [K, N] in 16x16
    tiles, both dequantized to bfloat16, bf16 GEMM with float32 accumulation; out_dtype defaults
    to x.dtype. K and N must be multiples of 16. Forward only (no custom gradient). mesh: the
    quantizer kernels run per data shard (nvfp4_quantize.quantize)."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"nvfp4_matmul_emulated: need x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    if w.shape[1] % BLOCK:
        raise ValueError(f"nvfp4_matmul_emulated: N = {w.shape[1]} must be a multiple of {BLOCK}")
    log_emulation()
    xq = fake_quantize(x, four_over_six=four_over_six, impl=impl, mesh=mesh).astype(jnp.bfloat16)
    wq = fake_quantize(w, tile_2d=True, four_over_six=four_over_six, impl=impl, mesh=mesh).astype(jnp.bfloat16)
    y = jnp.matmul(xq, wq, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _flat_tokens(a, multiple=BLOCK):
    """[..., D] -> [T, D] with T padded with zero rows to a multiple of `multiple` (16; 32 for the
    native GEMM) (leaves sums over T unchanged)."""
    a2 = a.reshape(-1, a.shape[-1])
    pad = (-a2.shape[0]) % multiple
    return jnp.pad(a2, ((0, pad), (0, 0))) if pad else a2


def _use_native(k: int, n: int, impl) -> bool:
    """Trace-time choice of the native (SM100+ cuBLASLt) GEMMs for a linear x [.., K] @ w [K, N]:
    the device has them and the three GEMMs' shapes fit (K and N multiples of 32)."""
    m = K_MULTIPLE
    return k % m == 0 and n % m == 0 and resolve_backend("auto", impl) == "native"


def _gemm_dtype(dtype):
    """The native GEMM's output dtype for a wanted dtype (it writes bf16, f16 or f32)."""
    d = jnp.dtype(dtype)
    return d if d in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


def _native_gemm(a, b, dtype, mesh):
    return nvfp4_gemm_native(a, b, _gemm_dtype(dtype), mesh=mesh).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _linear_emulated(x, w, key, four_over_six, stochastic_grad, rht_sign_mask, impl, native, mesh):
    return _linear_fwd(x, w, key, four_over_six, stochastic_grad, rht_sign_mask, impl, native, mesh)[0]


def _linear_fwd_native(x, w, key, four_over_six, impl, mesh):
    """y = Q(x) Q(w) on the FP4 tensor cores: X [M, K] 1x16 along K, W^T [N, K] the exact
    transpose of W's 16x16 tiles (the same quantized W serves dgrad)."""
    k = x.shape[-1]
    xq = quantize(x.reshape(-1, k), four_over_six=four_over_six, impl=impl, mesh=mesh)
    wq = quantize(w, tile_2d=True, four_over_six=four_over_six, impl=impl, mesh=mesh)
    y = _native_gemm(xq, transpose(wq, impl=impl), x.dtype, mesh)
    return y.reshape(*x.shape[:-1], w.shape[1]), wq


def _linear_fwd(x, w, key, four_over_six, stochastic_grad, rht_sign_mask, impl, native, mesh):
    if native:
        y, wq = _linear_fwd_native(x, w, key, four_over_six, impl, mesh)
        return y, (x, wq, key, w)
    wq = fake_quantize(w, tile_2d=True, four_over_six=four_over_six, impl=impl, mesh=mesh).astype(jnp.bfloat16)
    xq = fake_quantize(x, four_over_six=four_over_six, impl=impl, mesh=mesh).astype(jnp.bfloat16)
    y = jnp.matmul(xq, wq, preferred_element_type=jnp.float32).astype(x.dtype)
    return y, (x, wq, key, w)  # w only for its dtype (a parameter: no extra memory)


def _linear_bwd_native(four_over_six, stochastic_grad, rht_sign_mask, impl, mesh, res, dy):
    """dX = Q(dY) Q(W)^T with W's stored tiles as the [K, N] operand (already N-major);
    dW = Q(X^T) Q(dY^T)^T with both along tokens (padded to a multiple of 32, RHT)."""
    x, wq, key, w = res
    k_dgrad, k_wgrad = jax.random.split(key)
    n = dy.shape[-1]
    sr = {"stochastic": True, "key": k_dgrad} if stochastic_grad else {}
    dyq = quantize(dy.reshape(-1, n), four_over_six=four_over_six, impl=impl, mesh=mesh, **sr)
    dx = _native_gemm(dyq, wq, x.dtype, mesh).reshape(x.shape)
    xt = _flat_tokens(x, K_MULTIPLE).T
    dyt = _flat_tokens(dy, K_MULTIPLE).T
    sr = {"stochastic": True, "key": k_wgrad} if stochastic_grad else {}
    xtq = quantize(xt, four_over_six=four_over_six, rht_sign_mask=rht_sign_mask, impl=impl, mesh=mesh)
    dytq = quantize(dyt, four_over_six=four_over_six, rht_sign_mask=rht_sign_mask, impl=impl, mesh=mesh, **sr)
    dw = _native_gemm(xtq, dytq, w.dtype, mesh)
    return dx, dw, None


def _linear_bwd(four_over_six, stochastic_grad, rht_sign_mask, impl, native, mesh, res, dy):
    if native:
        return _linear_bwd_native(four_over_six, stochastic_grad, rht_sign_mask, impl, mesh, res, dy)
    x, wq, key, w = res
    k_dgrad, k_wgrad = jax.random.split(key)
    sr = {"stochastic": True, "key": k_dgrad} if stochastic_grad else {}
    # dgrad: dX = Q(dY) @ Q(W)^T, dY in 1x16 blocks along N (the reduction axis), the same 16x16
    # quantized W as the forward.
    dyq = fake_quantize(dy, four_over_six=four_over_six, impl=impl, mesh=mesh, **sr).astype(jnp.bfloat16)
    dx = jnp.matmul(dyq, wq.T, preferred_element_type=jnp.float32).astype(x.dtype)
    # wgrad: dW = X^T dY reduces over tokens T: both operands transposed to [., T], optional RHT
    # along T, 1x16 blocks along T (X round-to-nearest, dY stochastic).
    xt = _flat_tokens(x).T
    dyt = _flat_tokens(dy).T
    sr = {"stochastic": True, "key": k_wgrad} if stochastic_grad else {}
    xtq = dequantize(quantize(xt, four_over_six=four_over_six, rht_sign_mask=rht_sign_mask, impl=impl, mesh=mesh))
    dytq = dequantize(quantize(dyt, four_over_six=four_over_six, rht_sign_mask=rht_sign_mask,
                               impl=impl, mesh=mesh, **sr))
    dw = jnp.matmul(xtq.astype(jnp.bfloat16), dytq.astype(jnp.bfloat16).T,
                    preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw, None


_linear_emulated.defvjp(_linear_fwd, _linear_bwd)


def nvfp4_linear_emulated(x: jax.Array, w: jax.Array, key: jax.Array, *, four_over_six: bool = True,
                          stochastic_grad: bool = True, rht_sign_mask: int | None = hadamard.DEFAULT_SIGN_MASK,
                          impl: str | None = None, mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """Differentiable y = x @ w with the NVFP4 training recipe, emulated (bf16 GEMMs).

    x [..., K] (K % 16 == 0), w [K, N] (N % 16 == 0), key: PRNG key for the gradient's stochastic
    rounding (use a fresh one per step). Forward: x in 1x16 blocks along K (round to nearest), w in
    16x16 tiles (the same quantized w serves the backward's dX = dY w^T). Backward: dY in 1x16
    blocks with stochastic rounding (stochastic_grad); for dW = X^T dY both operands are taken
    along the token axis, transformed by the 16-point RHT (rht_sign_mask; None disables it) and
    quantized in 1x16 blocks along tokens. Output in x.dtype; dx in x.dtype, dw in w.dtype.
    mesh: the quantizers (and native GEMMs) run per data shard of their leading axis (on_shards).
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"nvfp4_linear_emulated: need x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    if w.shape[0] % BLOCK or w.shape[1] % BLOCK:
        raise ValueError(f"nvfp4_linear_emulated: K and N must be multiples of {BLOCK}, got w {w.shape}")
    check_flags(False, None, rht_sign_mask)
    log_emulation()
    mask = None if rht_sign_mask is None else int(rht_sign_mask)
    native = _use_native(w.shape[0], w.shape[1], impl)
    return _linear_emulated(x, w, key, bool(four_over_six), bool(stochastic_grad), mask, impl, native, mesh)


# --------------------------------------------------------------------------------------------
# Frozen weights (LoRA base): quantized once, cached, no weight gradient


def fake_quantize_weight(w: jax.Array, *, four_over_six: bool = True, impl: str | None = None,
                         mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """The bf16 operand the recipe's forward uses for a weight w [K, N]: 16x16 tiles, round to
    nearest, dequantized to bfloat16 (what `nvfp4_linear_emulated` computes every step). Caching
    it once for a frozen weight gives bit-identical results (`nvfp4_linear_frozen`)."""
    return fake_quantize(w, tile_2d=True, four_over_six=four_over_six, impl=impl, mesh=mesh).astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _linear_frozen(x, wq, key, four_over_six, stochastic_grad, impl, native, mesh):
    return _linear_frozen_fwd(x, wq, key, four_over_six, stochastic_grad, impl, native, mesh)[0]


def _linear_frozen_fwd(x, wq, key, four_over_six, stochastic_grad, impl, native, mesh):
    if native:
        # The cache holds bf16 values on the NVFP4 grid; quantizing them again (16x16 tiles)
        # recovers the codes and block scales (tests/precision/test_py checks it on
        # random weights) with a global scale from max|wq| (within bf16 rounding of the original).
        y, wq4 = _linear_fwd_native(x, wq.astype(jnp.bfloat16), key, four_over_six, impl, mesh)
        return y, (wq4, key, jnp.zeros((0,), x.dtype))
    xq = fake_quantize(x, four_over_six=four_over_six, impl=impl, mesh=mesh).astype(jnp.bfloat16)
    y = jnp.matmul(xq, wq.astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(x.dtype)
    return y, (wq, key, jnp.zeros((0,), x.dtype))


def _linear_frozen_bwd(four_over_six, stochastic_grad, impl, native, mesh, res, dy):
    wq, key, x_like = res
    k_dgrad, _ = jax.random.split(key)  # the same dgrad key as nvfp4_linear_emulated
    sr = {"stochastic": True, "key": k_dgrad} if stochastic_grad else {}
    if native:
        dyq = quantize(dy.reshape(-1, dy.shape[-1]), four_over_six=four_over_six, impl=impl, mesh=mesh, **sr)
        dx = _native_gemm(dyq, wq, x_like.dtype, mesh).reshape(*dy.shape[:-1], wq.shape[0])
        return dx, None, None
    dyq = fake_quantize(dy, four_over_six=four_over_six, impl=impl, mesh=mesh, **sr).astype(jnp.bfloat16)
    dx = jnp.matmul(dyq, wq.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32).astype(x_like.dtype)
    return dx, None, None


_linear_frozen.defvjp(_linear_frozen_fwd, _linear_frozen_bwd)


def nvfp4_linear_frozen(x: jax.Array, wq: jax.Array, key: jax.Array, *, four_over_six: bool = True,
                        stochastic_grad: bool = True, impl: str | None = None,
                        mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """`nvfp4_linear_emulated` for a frozen weight cached by `fake_quantize_weight` (wq [K, N],
    bf16 values; stored in any float dtype that holds them exactly). Forward and dX are identical
    to `nvfp4_linear_emulated(x, w, key)`; there is no weight gradient (no wgrad GEMM, no RHT).
    mesh: as for `nvfp4_linear_emulated`."""
    if wq.ndim != 2 or x.shape[-1] != wq.shape[0]:
        raise ValueError(f"nvfp4_linear_frozen: need x [..., K] and wq [K, N], got {x.shape} and {wq.shape}")
    if wq.shape[0] % BLOCK or wq.shape[1] % BLOCK:
        raise ValueError(f"nvfp4_linear_frozen: K and N must be multiples of {BLOCK}, got wq {wq.shape}")
    log_emulation()
    native = _use_native(wq.shape[0], wq.shape[1], impl)
    return _linear_frozen(x, wq, key, bool(four_over_six), bool(stochastic_grad), impl, native, mesh)
