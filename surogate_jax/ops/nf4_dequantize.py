"""NF4 dequantization: a bitsandbytes-NF4 packed weight to a dense matrix, optionally times a scale.

Shapes and dtypes (n = rows * cols, the weight flattened row-major):
  codes      uint8 [ceil(n/2)]           weight i's 4-bit index in byte i // 2: the HIGH nibble for even i,
                                         the low nibble for odd i (an odd n's last low nibble is padding)
  absmax     float32 [ceil(n/block_size)] one per block of block_size consecutive weights (64, 128, 256, 512)
  code_table float32 [16]                the value of each code (callers pass surogate_jax.qlora.nf4.NF4_CODE)
  scale      float32 [] or None
  -> out [rows, cols] in out_dtype: float32, bfloat16, float16 or float8_e4m3fn.

Math (fp32, each step one correctly rounded operation, in this order):
  v_i = code_table[idx_i] * absmax[i // block_size]
  v_i = f32(via_dtype(v_i))                          (only with via_dtype bfloat16 / float16: the weight as
                                                     the model dtype holds it, e.g. before fp8-hybrid's scaling)
  v_i = v_i * scale                                  (only with a scale: a second multiply, never fused)
  out_i = v_i rounded once to out_dtype, to nearest even; for float8_e4m3fn v_i is first clipped to
          [-448, 448] (saturating, as the kernel's cvt .satfinite), since a plain cast overflows to NaN.
Under double quantization the caller dequantizes absmax first (surogate_jax.qlora.nf4) and passes it in fp32.
The CUDA kernel (kernels/nf4_dequantize.cu via ffi/nf4_dequantize.cc) and `nf4_dequantize_ref` agree bit for bit.

Selective MoE dequantization: group_sizes int32 [E] (on the device; E divides rows) says the weight is E stacked
experts of rows / E rows each, and how many token rows each expert received. Expert e's rows come out as above when
group_sizes[e] > 0. Otherwise the reference gives zeros there, and the kernel leaves them UNSPECIFIED (never written,
nor are their codes read: the saving): only a consumer that never reads an expert without rows may take the kernel's
output, as our grouped GEMM (ops/grouped_matmul.py) is; jax.lax.ragged_dot may read every expert.

No backward: the inputs are a frozen quantized weight. Every operand goes through `lax.stop_gradient`, so a
function that calls this can be differentiated with respect to its other inputs (its output has a zero tangent).

Implementations: `nf4_dequantize_ref` (pure jnp), the FFI kernel `surogate_nf4_dequantize`, and the public
`nf4_dequantize` picking one of them (see ops/_loader.py for `impl`). The output is tagged
`checkpoint_name(out, "nf4_dequantize")` for remat policies.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.names import NF4_BLOCK_SIZES
from surogate_jax.ops._expert_groups import check_group_sizes, zero_empty_experts
from surogate_jax.ops._loader import pick, resolve_impl
from surogate_jax.ops._sharding import on_shards

OP = "nf4_dequantize"  # the name SUROGATE_JAX_OPS=ref:<op> and impl resolution use
TARGET = "surogate_nf4_dequantize"
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
VIA = {None: 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}  # the kernel's `via` attribute


def nf4_dequantize_ref(codes, absmax, code_table, scale=None, *, shape, block_size: int, out_dtype, via_dtype=None,
                       group_sizes=None):
    """Reference: the module docstring's math in jnp, experts without rows as zeros (no argument checks;
    `nf4_dequantize` does them)."""
    n = math.prod(shape)
    nblocks = -(-n // block_size)
    codes = jnp.asarray(codes)
    q = jnp.stack([codes >> 4, codes & jnp.uint8(15)], axis=-1).reshape(-1)
    padded = nblocks * block_size  # whole blocks, so absmax broadcasts over a [nblocks, block_size] view
    q = jnp.pad(q, (0, padded - q.shape[0]))  # q has n or n + 1 codes, padded >= either
    vals = jnp.asarray(code_table, jnp.float32)[q.astype(jnp.int32)].reshape(nblocks, block_size)
    v = (vals * jnp.asarray(absmax, jnp.float32)[:, None]).reshape(-1)[:n]
    if via_dtype is not None and jnp.dtype(via_dtype) != jnp.float32:
        # the barrier keeps XLA:GPU from folding the f32 -> via -> f32 converts away (fp8_formats.quantize)
        v = jax.lax.optimization_barrier(v.astype(via_dtype)).astype(jnp.float32)
    if scale is not None:
        v = v * jnp.asarray(scale, jnp.float32)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype == jnp.float8_e4m3fn:
        v = jnp.clip(v, -FP8_MAX, FP8_MAX)
    out = v.reshape(shape).astype(out_dtype)
    return zero_empty_experts(out, group_sizes)


def _ffi(codes, absmax, code_table, scale, group_sizes=None, *, shape, block_size, out_dtype, has_scale, via_dtype):
    # "sequential": a vmapped call is one weight per call, each with its own absmax, scale and group sizes.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, out_dtype), vmap_method="sequential")
    has_groups = group_sizes is not None
    return call(
        codes,
        absmax,
        code_table,
        scale,
        group_sizes if has_groups else jnp.zeros((1,), jnp.int32),  # ignored by the handler
        block_size=np.int64(block_size),
        has_scale=np.int32(has_scale),
        has_groups=np.int32(has_groups),
        via=np.int32(VIA[via_dtype]),
    )


def _ref(codes, absmax, code_table, scale, group_sizes=None, *, shape, block_size, out_dtype, has_scale, via_dtype):
    return nf4_dequantize_ref(
        codes,
        absmax,
        code_table,
        scale if has_scale else None,
        shape=shape,
        block_size=block_size,
        out_dtype=out_dtype,
        via_dtype=via_dtype,
        group_sizes=group_sizes,
    )


def _check_shape(shape) -> tuple[int, int]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"nf4_dequantize: shape must be a tuple (rows, cols), got {shape!r}") from None
    if len(shape) != 2 or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        raise ValueError(f"nf4_dequantize: shape must be two ints (rows, cols), got {shape!r}")
    if min(shape) < 0:
        raise ValueError(f"nf4_dequantize: shape must not be negative, got {shape!r}")
    return int(shape[0]), int(shape[1])


def _check_operand(name: str, x, dtype, size: int, why: str):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"nf4_dequantize: {name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"nf4_dequantize: {name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(x.dtype).name}")
    if tuple(x.shape) != (size,):
        raise ValueError(f"nf4_dequantize: {name} must have shape ({size},) ({why}), got {tuple(x.shape)}")


def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return jnp.float32(scale)
    if not hasattr(scale, "dtype") or jnp.dtype(scale.dtype) != jnp.float32:
        raise TypeError(
            f"nf4_dequantize: scale must be a float32 scalar or None, got "
            f"{getattr(scale, 'dtype', type(scale).__name__)}"
        )
    if tuple(scale.shape) != ():
        raise ValueError(f"nf4_dequantize: scale must be a scalar (shape ()), got shape {tuple(scale.shape)}")
    return scale


def nf4_dequantize(
    codes: jax.Array,
    absmax: jax.Array,
    code_table: jax.Array,
    scale: jax.Array | None = None,
    *,
    shape: tuple[int, int],
    block_size: int,
    out_dtype=jnp.bfloat16,
    via_dtype=None,
    group_sizes: jax.Array | None = None,
    impl: str | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> jax.Array:
    """The dense weight [rows, cols] = `shape` of an NF4-packed one, in out_dtype (module docstring: layout, math).

    codes uint8 [ceil(n/2)], absmax float32 [ceil(n/block_size)], code_table float32 [16] (NF4_CODE), scale a
    float32 scalar (or a Python number) or None; block_size 64, 128, 256 or 512; out_dtype float32, bfloat16,
    float16 or float8_e4m3fn (saturated to +-448); via_dtype None, float32 (the same), bfloat16 or float16: round
    each product to it before the scale. group_sizes: None, or int [E] on the device (E divides rows) for selective
    MoE dequantization: the rows of an expert whose size is 0 are zeros from the reference and left unspecified by
    the kernel (never read by our grouped GEMM; see the module docstring). impl: None/"auto" (CUDA kernel on GPU,
    reference elsewhere), "ffi" or "ref"; SUROGATE_JAX_OPS=ref forces the reference. mesh: with data axes, every
    device dequantizes the whole weight from replicated operands (ops/_sharding.py; None: one call). No gradient
    flows to the operands. Tagged `checkpoint_name(out, "nf4_dequantize")`.
    """
    shape = _check_shape(shape)
    if isinstance(block_size, bool) or block_size not in NF4_BLOCK_SIZES:
        raise ValueError(f"nf4_dequantize: block_size must be one of {NF4_BLOCK_SIZES}, got {block_size!r}")
    block_size = int(block_size)
    try:
        out_dtype = jnp.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"nf4_dequantize: out_dtype {out_dtype!r} is not a dtype") from None
    if out_dtype not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise TypeError(
            f"nf4_dequantize: out_dtype must be one of float32, bfloat16, float16, float8_e4m3fn, got {out_dtype.name}"
        )
    n = shape[0] * shape[1]
    _check_operand("codes", codes, jnp.uint8, -(-n // 2), f"ceil(n / 2) for shape {shape}")
    _check_operand("absmax", absmax, jnp.float32, -(-n // block_size), f"ceil(n / {block_size}) for shape {shape}")
    _check_operand("code_table", code_table, jnp.float32, 16, "one value per 4-bit code")
    scale = _check_scale(scale)
    group_sizes = check_group_sizes("nf4_dequantize", group_sizes, shape[0])
    via_dtype = None if via_dtype is None or jnp.dtype(via_dtype) == jnp.float32 else jnp.dtype(via_dtype)
    if via_dtype not in VIA:
        raise TypeError(f"nf4_dequantize: via_dtype must be None, float32, bfloat16 or float16, got {via_dtype.name}")
    impl = resolve_impl(impl, OP)

    has_scale = scale is not None
    args = [jax.lax.stop_gradient(a) for a in (codes, absmax, code_table)]
    args.append(jax.lax.stop_gradient(scale) if has_scale else jnp.zeros((), jnp.float32))
    if group_sizes is not None:
        args.append(group_sizes)
    static = dict(shape=shape, block_size=block_size, out_dtype=out_dtype, has_scale=has_scale, via_dtype=via_dtype)
    ref = functools.partial(_ref, **static)
    if n == 0:
        out = ref(*args)
    else:
        fn = pick(impl, functools.partial(_ffi, **static), ref, OP, "fwd")
        (out,) = on_shards(lambda *a: (fn(*a),), *args, mesh=mesh, batched=(False,) * len(args),
                           out_batched=(False,))
    return checkpoint_name(out, "nf4_dequantize")
