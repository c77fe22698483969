"""Tile-scaled weight dequantization: an FP8 block-scaled or NVFP4 weight to a dense matrix, optionally times a scale.

A weight W [rows, cols] (HF layout [out, in]) stored as codes with one scale per `tile` x `tile` square (row-major
grid; the last tile row / column may be ragged), in one of two formats:
  fmt "fp8"   codes float8_e4m3fn [rows, cols], tile_scales float32 [ceil(rows/tile), ceil(cols/tile)] (HF
              fine-grained FP8's weight_scale_inv; surogate_jax/qlora/fp8_block.py); tile 16..512, a power of two.
              v = f32(code) * tile_scale
  fmt "nvfp4" codes uint8 [rows, cols/2] (E2M1, element 2j in the LOW nibble, bit 3 the sign), tile_scales
              float8_e4m3fn [ceil(rows/16), cols/16], global_scale float32 [] (the NVFP4 16x16-tile weight format of
              ops/nvfp4_quantize.py); tile 16, cols % 16 == 0.
              v = (e2m1(code) * f32(tile_scale)) * global_scale            (the first product is exact)
Then, each step one correctly rounded fp32 operation, in this order:
  v = f32(via_dtype(v))      (only with via_dtype bfloat16 / float16: the weight as the model dtype holds it, e.g.
                              before fp8-hybrid's per-tensor scaling)
  v = v * scale              (only with a scale: a second multiply, never fused)
  out = v rounded once to out_dtype (float32, bfloat16, float16 or float8_e4m3fn), to nearest even; for
        float8_e4m3fn v is first clipped to [-448, 448] (saturating, as the kernel's cvt .satfinite).
Without via_dtype and scale this is bit for bit `qlora.fp8_block.dequantize` and `nvfp4_quantize.dequantize`.
The CUDA kernel (kernels/tile_dequantize.cu via ffi/tile_dequantize.cc) and `tile_dequantize_ref` agree bit for bit.

Selective MoE dequantization: group_sizes int32 [E] (on the device; E divides rows) says the weight is E stacked
experts of rows / E rows each, and how many token rows each expert received. Expert e's rows come out as above when
group_sizes[e] > 0. Otherwise the reference gives zeros there, and the kernel leaves them UNSPECIFIED (never written,
nor are their codes read: the saving): only a consumer that never reads an expert without rows may take the kernel's
output, as our grouped GEMM (ops/grouped_matmul.py) is; jax.lax.ragged_dot may read every expert.

`tile_amax` gives max|W| as via_dtype holds it without dequantizing: each tile's largest code magnitude times its
scale (rounding is monotonic, so this is exactly the max of the dequantized weight), reading only the codes.

No backward: the inputs are a frozen quantized weight. Every operand goes through `lax.stop_gradient`.
Implementations: `tile_dequantize_ref` (pure jnp), the FFI kernel `surogate_tile_dequantize`, and the public
`tile_dequantize` picking one of them (see ops/_loader.py for `impl`). The output is tagged
`checkpoint_name(out, "tile_dequantize")` for remat policies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.ops._expert_groups import check_group_sizes, zero_empty_experts
from surogate_jax.ops._loader import pick, resolve_impl
from surogate_jax.ops._sharding import on_shards
from surogate_jax.ops.nvfp4_quantize import E2M1_VALUES

OP = "tile_dequantize"  # the name SUROGATE_JAX_OPS=ref:<op> and impl resolution use
TARGET = "surogate_tile_dequantize"
FORMATS = {"fp8": 0, "nvfp4": 1}  # the kernel's `format` attribute
NVFP4_TILE = 16
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
VIA = {None: 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}  # the kernel's `via` attribute


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_grid(a: jax.Array, tile: int, shape: tuple[int, int]) -> jax.Array:
    """A per-tile array [ceil(rows/tile), ceil(cols/tile)] broadcast to every element of [rows, cols]."""
    r, c = a.shape
    full = jnp.broadcast_to(a[:, None, :, None], (r, tile, c, tile)).reshape(r * tile, c * tile)
    return full[: shape[0], : shape[1]]


def _values(codes, tile_scales, global_scale, *, fmt, shape, tile):
    """The dequantized weight in float32, before via and scale (the module docstring's first line per format)."""
    s = _tile_grid(jnp.asarray(tile_scales).astype(jnp.float32), tile, shape)
    if fmt == "fp8":
        return jnp.asarray(codes).astype(jnp.float32) * s
    codes = jnp.asarray(codes)
    nib = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(shape)
    mag = jnp.asarray(E2M1_VALUES)[(nib & 7).astype(jnp.int32)]
    val = jnp.where((nib & 8) != 0, -mag, mag)
    return (val * s) * jnp.asarray(global_scale, jnp.float32)


def _round_via(v, via_dtype):
    if via_dtype is None or jnp.dtype(via_dtype) == jnp.float32:
        return v
    # the barrier keeps XLA:GPU from folding the f32 -> via -> f32 converts away (fp8_formats.quantize)
    return jax.lax.optimization_barrier(v.astype(via_dtype)).astype(jnp.float32)


def tile_dequantize_ref(codes, tile_scales, global_scale=None, scale=None, *, fmt: str, shape, tile: int, out_dtype,
                        via_dtype=None, group_sizes=None):
    """Reference: the module docstring's math in jnp, experts without rows as zeros (no argument checks;
    `tile_dequantize` does them)."""
    shape = tuple(shape)
    v = _round_via(_values(codes, tile_scales, global_scale, fmt=fmt, shape=shape, tile=tile), via_dtype)
    if scale is not None:
        v = v * jnp.asarray(scale, jnp.float32)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype == jnp.float8_e4m3fn:
        v = jnp.clip(v, -FP8_MAX, FP8_MAX)
    out = v.astype(out_dtype)
    return zero_empty_experts(out, group_sizes)


def _tile_max_code(codes, *, fmt, shape, tile):
    """Per tile, the value of its largest code magnitude ([ceil(rows/tile), ceil(cols/tile)] float32, >= 0)."""
    rows, cols = shape
    if fmt == "fp8":
        mag = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.uint8) & jnp.uint8(0x7F)  # e4m3 order = bit order
        width = tile
    else:
        codes = jnp.asarray(codes)
        mag = jnp.maximum(codes & jnp.uint8(7), (codes >> 4) & jnp.uint8(7))  # E2M1 order = code order
        cols, width = cols // 2, tile // 2
    gr, gc = _cdiv(rows, tile), _cdiv(cols, width)
    mag = jnp.pad(mag, ((0, gr * tile - rows), (0, gc * width - cols)))  # zeros never raise a tile's max
    top = jnp.max(mag.reshape(gr, tile, gc, width), axis=(1, 3))
    if fmt == "fp8":
        return jax.lax.bitcast_convert_type(top, jnp.float8_e4m3fn).astype(jnp.float32)
    return jnp.asarray(E2M1_VALUES)[top.astype(jnp.int32)]


def tile_amax(codes, tile_scales, global_scale=None, *, fmt: str, shape, tile: int | None = None,
              via_dtype=None) -> jax.Array:
    """max|W| (float32 scalar) of the weight `tile_dequantize` gives with this via_dtype, from each tile's largest
    code magnitude times its scale: the codes are read once, nothing is dequantized. 0 for an empty weight."""
    shape = _check_shape(shape)
    tile = _check_tile(fmt, tile)
    if 0 in shape:
        return jnp.float32(0)
    args = [jax.lax.stop_gradient(jnp.asarray(a)) for a in (codes, tile_scales)]
    top = _tile_max_code(args[0], fmt=fmt, shape=shape, tile=tile) * args[1].astype(jnp.float32)
    if fmt == "nvfp4":
        top = top * jax.lax.stop_gradient(jnp.asarray(global_scale, jnp.float32))
    return jnp.max(_round_via(top, _check_via(via_dtype)))


def _ffi(codes, tile_scales, global_scale, scale, group_sizes=None, *, fmt, shape, tile, out_dtype, has_scale,
         via_dtype):
    # "sequential": a vmapped call is one weight per call, each with its own scales and group sizes.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, out_dtype), vmap_method="sequential")
    has_groups = group_sizes is not None
    groups = group_sizes if has_groups else jnp.zeros((1,), jnp.int32)  # ignored by the handler
    return call(codes, tile_scales, global_scale, scale, groups, format=np.int32(FORMATS[fmt]), tile=np.int64(tile),
                has_scale=np.int32(has_scale), has_groups=np.int32(has_groups), via=np.int32(VIA[via_dtype]))


def _ref(codes, tile_scales, global_scale, scale, group_sizes=None, *, fmt, shape, tile, out_dtype, has_scale,
         via_dtype):
    return tile_dequantize_ref(codes, tile_scales, global_scale, scale if has_scale else None, fmt=fmt, shape=shape,
                               tile=tile, out_dtype=out_dtype, via_dtype=via_dtype, group_sizes=group_sizes)


def _check_shape(shape) -> tuple[int, int]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"tile_dequantize: shape must be a tuple (rows, cols), got {shape!r}") from None
    if len(shape) != 2 or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        raise ValueError(f"tile_dequantize: shape must be two ints (rows, cols), got {shape!r}")
    if min(shape) < 0:
        raise ValueError(f"tile_dequantize: shape must not be negative, got {shape!r}")
    return int(shape[0]), int(shape[1])


def _check_tile(fmt, tile) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"tile_dequantize: fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt == "nvfp4":
        if tile not in (None, NVFP4_TILE):
            raise ValueError(f"tile_dequantize: nvfp4 tiles are {NVFP4_TILE}x{NVFP4_TILE}, got tile={tile!r}")
        return NVFP4_TILE
    ok = isinstance(tile, (int, np.integer)) and not isinstance(tile, bool) and 16 <= tile <= 512
    if not ok or tile & (tile - 1):
        raise ValueError(f"tile_dequantize: fp8 tile must be a power of two in [16, 512], got {tile!r}")
    return int(tile)


def _check_via(via_dtype):
    via = None if via_dtype is None or jnp.dtype(via_dtype) == jnp.float32 else jnp.dtype(via_dtype)
    if via not in VIA:
        raise TypeError(f"tile_dequantize: via_dtype must be None, float32, bfloat16 or float16, got {via.name}")
    return via


def _check_operand(name: str, x, dtype, shape: tuple[int, ...], why: str):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"tile_dequantize: {name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"tile_dequantize: {name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(x.dtype).name}")
    if tuple(x.shape) != shape:
        raise ValueError(f"tile_dequantize: {name} must have shape {shape} ({why}), got {tuple(x.shape)}")


def _check_scalar(name: str, x):
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return jnp.float32(x)
    _check_operand(name, x, jnp.float32, (), "a scalar")
    return x


def tile_dequantize(
    codes: jax.Array,
    tile_scales: jax.Array,
    global_scale: jax.Array | None = None,
    scale: jax.Array | None = None,
    *,
    fmt: str,
    shape: tuple[int, int],
    tile: int | None = None,
    out_dtype=jnp.bfloat16,
    via_dtype=None,
    group_sizes: jax.Array | None = None,
    impl: str | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> jax.Array:
    """The dense weight [rows, cols] = `shape` of a tile-scaled one, in out_dtype (module docstring: formats, math).

    fmt "fp8": codes float8_e4m3fn [rows, cols], tile_scales float32 [ceil(rows/tile), ceil(cols/tile)], tile a
    power of two in [16, 512], no global_scale. fmt "nvfp4": codes uint8 [rows, cols/2], tile_scales float8_e4m3fn
    [ceil(rows/16), cols/16], global_scale a float32 scalar, tile 16 (or None). scale: a float32 scalar (or a
    Python number) or None. out_dtype float32, bfloat16, float16 or float8_e4m3fn (saturated to +-448); via_dtype
    None, float32 (the same), bfloat16 or float16: round each value to it before the scale. group_sizes: None, or
    int [E] on the device (E divides rows) for selective MoE dequantization: the rows of an expert whose size is 0
    are zeros from the reference and left unspecified by the kernel (never read by our grouped GEMM; see the module
    docstring). impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref"; SUROGATE_JAX_OPS=ref
    forces the reference. mesh: with data axes, every device dequantizes the whole weight from replicated operands
    (ops/_sharding.py; None: one call). No gradient flows to the operands. Tagged
    `checkpoint_name(out, "tile_dequantize")`.
    """
    shape = _check_shape(shape)
    tile = _check_tile(fmt, tile)
    rows, cols = shape
    try:
        out_dtype = jnp.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"tile_dequantize: out_dtype {out_dtype!r} is not a dtype") from None
    if out_dtype not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise TypeError(f"tile_dequantize: out_dtype must be one of float32, bfloat16, float16, float8_e4m3fn, got "
                        f"{out_dtype.name}")
    grid = (_cdiv(rows, tile), _cdiv(cols, tile))
    if fmt == "fp8":
        _check_operand("codes", codes, jnp.float8_e4m3fn, shape, "the weight's shape")
        _check_operand("tile_scales", tile_scales, jnp.float32, grid, f"one per {tile}x{tile} tile of {shape}")
        if global_scale is not None:
            raise ValueError("tile_dequantize: fp8 has no global_scale (pass None)")
        global_scale = jnp.zeros((), jnp.float32)
    else:
        if cols % NVFP4_TILE:
            raise ValueError(f"tile_dequantize: nvfp4 needs cols % 16 == 0, got shape {shape}")
        _check_operand("codes", codes, jnp.uint8, (rows, cols // 2), "two E2M1 codes a byte")
        _check_operand("tile_scales", tile_scales, jnp.float8_e4m3fn, grid, f"one per 16x16 tile of {shape}")
        if global_scale is None:
            raise ValueError("tile_dequantize: nvfp4 needs its global_scale")
        global_scale = _check_scalar("global_scale", global_scale)
    has_scale = scale is not None
    scale = _check_scalar("scale", scale) if has_scale else jnp.zeros((), jnp.float32)
    via_dtype = _check_via(via_dtype)
    group_sizes = check_group_sizes("tile_dequantize", group_sizes, rows)
    impl = resolve_impl(impl, OP)

    args = [jax.lax.stop_gradient(a) for a in (codes, tile_scales, global_scale, scale)]
    if group_sizes is not None:
        args.append(group_sizes)
    static = dict(fmt=fmt, shape=shape, tile=tile, out_dtype=out_dtype, has_scale=has_scale, via_dtype=via_dtype)
    ref = functools.partial(_ref, **static)
    if rows * cols == 0:
        out = ref(*args)
    else:
        fn = pick(impl, functools.partial(_ffi, **static), ref, OP, "fwd")
        (out,) = on_shards(lambda *a: (fn(*a),), *args, mesh=mesh, batched=(False,) * len(args),
                           out_batched=(False,))
    return checkpoint_name(out, "tile_dequantize")
