"""Block-scaled FP8 base weights: the Hugging Face "fp8" (fine-grained FP8) quantization format.

Format (as in the Qwen3-*-FP8 and DeepSeek-V3 checkpoints; config.json
`quantization_config: {"quant_method": "fp8", "weight_block_size": [b, b], ...}`), for a linear weight
W [out, in] in the HF/PyTorch layout (in = the GEMM reduction axis):
  * `weight`           float8_e4m3fn [out, in]                      (max 448, subnormals down to 2^-9, no inf)
  * `weight_scale_inv` float32 [ceil(out/b), ceil(in/b)]            (one scale per b x b tile)
  * dequantized W[r, c] = float(weight[r, c]) * weight_scale_inv[r // b, c // b]; the last tile row / column may
    be ragged (partial tiles use the same scale over the elements they have).

Quantization math, matched to transformers' `Fp8Quantize._quantize_one`
(transformers/integrations/finegrained_fp8.py, reached through
transformers/quantizers/quantizer_finegrained_fp8.py `get_quantize_ops`; transformers 5.24, `scale_fmt="float"`),
each step one correctly rounded float32 operation:
  x       = float32(W)
  amax_t  = max |x| over the tile
  scale_t = (1 / amax_t) * 448, or 1 for a zero tile (amax_t == 0)
  scale_inv_t = 1 / scale_t                                       (stored; 1 for a zero tile)
  weight  = e4m3_rne(clamp(x * scale_t, -448, 448))               (multiplied by scale_t, not divided by scale_inv_t)
The source writes `_FP8_MAX / safe_max_abs` and `1.0 / scales`, but torch evaluates a Python number divided by a
tensor as `tensor.reciprocal() * number` (torch/_tensor.py `__rdiv__`), so scale_t is rounded twice: first the
reciprocal, then the product with 448; a single correctly rounded 448 / amax_t differs in about a quarter of tiles
(by an ulp). Each tile's largest magnitude still maps to exactly +-448 (x * scale_t is within a few float32 ulps
of 448; e4m3's neighbours of 448 are 416 below and the clamp above), so the cast cannot overflow. The result is
byte-identical to transformers' for tiles with 2^-117 <= amax_t < 2^126 (every real weight; tested on CPU). Two
extensions of ours, both outside what transformers does:
  * ragged shapes: transformers passes a weight whose dims are not multiples of b through unquantized; here the
    partial edge tiles are quantized as if zero-padded to whole tiles (zeros do not change a tile's amax), which is
    what the checkpoints' ceil-shaped scale grids and transformers' own `FP8Linear` dequantization assume;
  * extreme tiles, so that no scale or scale_inv is subnormal or infinite (XLA:CPU flushes float32 subnormals to
    zero, and transformers would emit inf * 0 = NaN codes where scale_t overflows): a tile with amax_t < 2^-117
    (~6e-36) is quantized as a zero tile (scale 1; its elements round to +-0 codes, an error below amax_t), and a
    tile with amax_t >= 2^126 (~8.5e37, where 1 / amax_t is subnormal) gets scale_t = 448 / amax_t, one rounding.
A tile holding NaN or +-inf gets scale_inv NaN, so the whole tile dequantizes to NaN (loud, not silently wrong).
float32 subnormal elements (|x| < 2^-126) count as zeros on XLA:CPU; they can only matter in tiles with amax_t
below about 2^-107.

Error bound (e4m3 has 3 mantissa bits): with v = x * scale_t, |v - e4m3(v)| <= 2^-4 * max(|v|, 2^-6) (half an ulp;
2^-10 absolute in the subnormal range below 2^-6), so |W - dequantized| <= 2^-4 * max(|W|, 2^-6 * scale_inv_t) up
to float32 rounding, and never more than 16 * scale_inv_t = amax_t / 28 within a tile.

XLA's algebraic simplifier may merge (1 / a) * 448 into 448 / a and rewrite 1 / (c * r) or divisions by constants,
which would change bits, so the reciprocal and the scale go through optimization barriers. XLA:GPU's float32
division may differ from a correctly rounded one by an ulp, so on a GPU a scale (and then codes) may differ from
transformers' by that ulp; the tests that assert exact bytes are CPU-only.

Model parameters (one linear): "fp8_weight" float8_e4m3fn [out, in], "fp8_scale_inv" float32
[ceil(out/b), ceil(in/b)]. `to_hf` / `from_hf` convert to and from the checkpoint's `weight` / `weight_scale_inv`
(from_hf also accepts bfloat16 / float16 scales, as some Qwen3 FP8 checkpoints ship, widened exactly to float32).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from surogate_jax.names import FP8_BLOCK_SIZES as BLOCK_SIZES
from surogate_jax.ops.fp8_formats import E4M3, current_scale
from surogate_jax.ops.tile_dequantize import tile_amax, tile_dequantize
from surogate_jax.qlora import _checks

FP8_MAX = 448.0
# Tiles with amax below TINY_AMAX are quantized as zero tiles; at or above HUGE_AMAX the scale is one division (the
# module docstring says why). Both keep every scale and scale_inv a normal float32.
TINY_AMAX = 2.0**-117
HUGE_AMAX = 2.0**126
WEIGHT = "fp8_weight"
SCALE_INV = "fp8_scale_inv"
HF_WEIGHT = "weight"
HF_SCALE_INV = "weight_scale_inv"
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_F32 = np.dtype(np.float32)
# Scale dtypes from_hf widens exactly to float32.
_HF_SCALE_DTYPES = (_F32, np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_block(size) -> int:
    return _checks.block_size(size, BLOCK_SIZES, "fp8_block")


def _check_shape(shape) -> tuple[int, int]:
    return _checks.weight_shape(shape, "fp8_block")


def scale_shape(shape, *, block_size: int = 128) -> tuple[int, int]:
    """[ceil(out/b), ceil(in/b)]: the scale grid of a weight of `shape`."""
    out, inp = _check_shape(shape)
    b = _check_block(block_size)
    return _cdiv(out, b), _cdiv(inp, b)


def param_shapes(shape, *, block_size: int = 128) -> dict[str, jax.ShapeDtypeStruct]:
    """The model parameters of one quantized [out, in] weight: {"fp8_weight", "fp8_scale_inv"}."""
    return {
        WEIGHT: jax.ShapeDtypeStruct(_check_shape(shape), jnp.float8_e4m3fn),
        SCALE_INV: jax.ShapeDtypeStruct(scale_shape(shape, block_size=block_size), jnp.float32),
    }


def quantize(w, *, block_size: int = 128) -> dict[str, jax.Array]:
    """Quantizes a float weight [out, in] (any float dtype; math in float32) to {"fp8_weight", "fp8_scale_inv"}.

    The formulas of the module docstring (transformers' byte for byte). Works eagerly and under jax.jit.
    """
    b = _check_block(block_size)
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"fp8_block.quantize: w must be floating point, got {w.dtype}")
    if w.ndim != 2 or w.size == 0:
        raise ValueError(f"fp8_block.quantize: w must be a non-empty 2-D [out, in] weight, got shape {w.shape}")
    out, inp = w.shape
    rows, cols = _cdiv(out, b), _cdiv(inp, b)
    x = w.astype(jnp.float32)
    x = jnp.pad(x, ((0, rows * b - out), (0, cols * b - inp)))  # zeros leave every tile's amax unchanged
    tiles = x.reshape(rows, b, cols, b)
    amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
    # torch evaluates `448.0 / t` as t.reciprocal() * 448.0: two roundings, kept apart by a barrier (XLA might fuse
    # them back into one division); the second barrier keeps 1 / scale from being rewritten either.
    tiny = amax < TINY_AMAX  # zero tiles, and tiles whose scale or scale_inv would leave float32's normal range
    safe = jnp.where(tiny, jnp.float32(1.0), amax)
    recip = jax.lax.optimization_barrier(jnp.float32(1.0) / safe)
    scale = jnp.where(amax >= HUGE_AMAX, jnp.float32(FP8_MAX) / safe, recip * jnp.float32(FP8_MAX))
    scale = jnp.where(tiny, jnp.float32(1.0), scale)
    scale_inv = jnp.float32(1.0) / jax.lax.optimization_barrier(scale)
    # Not isfinite(amax): XLA:CPU's vectorized max reduction can drop a NaN (max over 64 x 64 of ones and one NaN
    # gives 1.0 in jax 0.12), so the tile's NaN/inf are looked for directly.
    finite = jnp.all(jnp.isfinite(tiles), axis=(1, 3))
    scale_inv = jnp.where(finite, scale_inv, jnp.float32(jnp.nan))
    v = tiles * scale[:, None, :, None]
    q = jnp.clip(v, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    q = q.reshape(rows * b, cols * b)[:out, :inp]
    return {WEIGHT: q, SCALE_INV: scale_inv}


def _check_params(params: Mapping, shape, block_size: int, fn: str) -> None:
    want = param_shapes(shape, block_size=block_size)
    for name, sds in want.items():
        if name not in params:
            raise ValueError(f"fp8_block.{fn}: missing parameter {name!r} (have {sorted(params)})")
        a = params[name]
        if tuple(a.shape) != sds.shape or np.dtype(a.dtype) != np.dtype(sds.dtype):
            raise ValueError(f"fp8_block.{fn}: parameter {name!r} must be {np.dtype(sds.dtype).name} {sds.shape} "
                             f"for a {tuple(shape)} weight with block {block_size}, got {np.dtype(a.dtype).name} "
                             f"{tuple(a.shape)}")


def dequantize(params: Mapping, shape, *, block_size: int = 128, dtype=jnp.bfloat16, mesh=None,
               group_sizes=None) -> jax.Array:
    """float(fp8_weight) * fp8_scale_inv broadcast over the b x b tiles: [out, in] in `dtype` (float32 math, one
    rounding to dtype at the end), through ops.tile_dequantize (our CUDA kernel on a GPU). mesh: the devices it
    runs on, group_sizes: stacked MoE experts' token counts for a selective dequantization (the op's)."""
    b = _check_block(block_size)
    shape = _check_shape(shape)
    _check_params(params, shape, b, "dequantize")
    return tile_dequantize(params[WEIGHT], params[SCALE_INV], fmt="fp8", shape=shape, tile=b, out_dtype=dtype,
                           group_sizes=group_sizes, mesh=mesh)


def fp8_weight(params: Mapping, shape, *, block_size: int = 128, dtype=jnp.bfloat16,
               mesh=None, group_sizes=None) -> tuple[jax.Array, jax.Array]:
    """(wq float8_e4m3fn [out, in], scale f32 []) = fp8-hybrid's frozen cache of the weight dequantized in `dtype`:
    scale = 448 / max|W| (current scaling; max|W| from each tile's largest code, ops.tile_amax), wq =
    E4M3(clip(W * scale)), one kernel pass from the block-scaled codes (no `dtype` copy of the weight is written)."""
    b = _check_block(block_size)
    shape = _check_shape(shape)
    _check_params(params, shape, b, "fp8_weight")
    q, s = params[WEIGHT], params[SCALE_INV]
    scale = current_scale(tile_amax(q, s, fmt="fp8", shape=shape, tile=b, via_dtype=dtype))
    wq = tile_dequantize(q, s, None, scale, fmt="fp8", shape=shape, tile=b, out_dtype=E4M3, via_dtype=dtype,
                         group_sizes=group_sizes, mesh=mesh)
    return wq, scale


def to_hf(params: Mapping, shape, *, block_size: int = 128) -> dict[str, np.ndarray]:
    """The checkpoint tensors {"weight": float8_e4m3fn [out, in], "weight_scale_inv": float32 grid} as numpy."""
    b = _check_block(block_size)
    _check_params(params, shape, b, "to_hf")
    return {HF_WEIGHT: np.asarray(params[WEIGHT]), HF_SCALE_INV: np.asarray(params[SCALE_INV])}


def from_hf(parts: Mapping, shape, block_size: int) -> dict[str, np.ndarray]:
    """Checkpoint tensors {"weight", "weight_scale_inv"} (numpy, e.g. from safetensors_io) -> model parameters.

    weight must be float8_e4m3fn [out, in]; weight_scale_inv float32 (bfloat16 / float16 are widened exactly)
    [ceil(out/b), ceil(in/b)], with finite scales. ValueError naming the part otherwise.
    """
    b = _check_block(block_size)
    shape = _check_shape(shape)
    want = {HF_WEIGHT: (shape, (_FP8,)), HF_SCALE_INV: (scale_shape(shape, block_size=b), _HF_SCALE_DTYPES)}
    arrays = {}
    for name, (wshape, dtypes) in want.items():
        if name not in parts:
            raise ValueError(f"fp8_block.from_hf: missing part {name!r} (have {sorted(parts)})")
        a = np.asarray(parts[name])
        if a.dtype not in dtypes or a.shape != wshape:
            names = " or ".join(d.name for d in dtypes)
            raise ValueError(f"fp8_block.from_hf: part {name!r} must be {names} {wshape} for a {shape} weight with "
                             f"block {b}, got {a.dtype.name} {a.shape}")
        arrays[name] = a
    scale = arrays[HF_SCALE_INV].astype(np.float32)
    if not np.all(np.isfinite(scale)):
        raise ValueError(f"fp8_block.from_hf: part {HF_SCALE_INV!r} holds non-finite scales")
    return {WEIGHT: arrays[HF_WEIGHT], SCALE_INV: scale}
