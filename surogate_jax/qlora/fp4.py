"""NVFP4 base weights: a frozen [out, in] projection weight stored as NVFP4 with 16x16 tiles.

Format: the project's NVFP4 quantizer (surogate_jax/ops/nvfp4_quantize.py, whose docstring has every formula;
NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149; Four Over Six: arXiv 2512.02010) with
`tile_2d=True` and no stochastic rounding, applied to the weight in the HF/PyTorch layout W [out, in]:
  * "fp4_codes"        uint8 [out, in/2]: E2M1 codes, element 2j in the low nibble, 2j+1 in the high nibble;
  * "fp4_scales"       float8_e4m3fn [ceil(out/16), in/16]: one scale per 16x16 tile (the reduction axis `in` is
                       the tiles' last axis; a ragged last tile row behaves as if padded with zero rows);
  * "fp4_global_scale" float32 []: the per-tensor decode scale s_dec.
  dequantized W = (e2m1_value(code) * float(scale)) * s_dec, in float32, then one cast to the requested dtype;
  bit for bit the op's own `dequantize` (and, in float32, `fake_quantize_ref(w, tile_2d=True, ...)`).
`in` must be a multiple of 16 (ValueError otherwise: we do not pad); `out` may be any length. There is no Hugging
Face checkpoint format for NVFP4 bases here, so there is no to_hf / from_hf: the bases are quantized at load time
from the bf16/fp32 checkpoint weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import nvfp4_quantize as nvfp4
from ..ops.fp8_formats import E4M3, current_scale
from ..ops.tile_dequantize import tile_amax, tile_dequantize
from . import _checks

BLOCK = nvfp4.BLOCK  # 16
CODES = "fp4_codes"
SCALES = "fp4_scales"
GLOBAL_SCALE = "fp4_global_scale"


def _check_shape(shape, fn: str) -> tuple[int, int]:
    shape = _checks.weight_shape(shape, f"fp4.{fn}")
    if shape[1] % BLOCK:
        raise ValueError(f"fp4.{fn}: the weight's `in` dim (the reduction axis, shape[1]) must be a multiple of "
                         f"{BLOCK} for NVFP4, got shape {shape}")
    return shape


def param_shapes(shape) -> dict[str, jax.ShapeDtypeStruct]:
    """The model parameters of one quantized [out, in] weight: {"fp4_codes", "fp4_scales", "fp4_global_scale"}."""
    out, inp = _check_shape(shape, "param_shapes")
    return {
        CODES: jax.ShapeDtypeStruct((out, inp // 2), jnp.uint8),
        SCALES: jax.ShapeDtypeStruct((-(-out // BLOCK), inp // BLOCK), jnp.float8_e4m3fn),
        GLOBAL_SCALE: jax.ShapeDtypeStruct((), jnp.float32),
    }


def quantize(w, *, four_over_six: bool = True, impl: str | None = None) -> dict[str, jax.Array]:
    """Quantizes a float weight [out, in] (in % 16 == 0) with nvfp4_quantize.quantize(tile_2d=True).

    four_over_six: the per-tile choice between scaling the tile max to 4 or to 6 (see the op). impl: the op's
    implementation switch (None/"auto": CUDA kernels on a GPU when built, the reference elsewhere; "ref"; "ffi");
    the kernels and the reference agree bit for bit.
    """
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"fp4.quantize: w must be floating point, got {w.dtype}")
    _check_shape(w.shape, "quantize")
    q = nvfp4.quantize(w, tile_2d=True, four_over_six=bool(four_over_six), impl=impl)
    return {CODES: q.codes, SCALES: q.scales, GLOBAL_SCALE: q.global_scale}


def to_tensor(params: Mapping, shape) -> nvfp4.NVFP4Tensor:
    """The parameters as the op's NVFP4Tensor (for the NVFP4 GEMMs), after checking their shapes and dtypes."""
    shape = _check_shape(shape, "to_tensor")
    for name, sds in param_shapes(shape).items():
        if name not in params:
            raise ValueError(f"fp4: missing parameter {name!r} (have {sorted(params)})")
        a = params[name]
        if tuple(a.shape) != sds.shape or np.dtype(a.dtype) != np.dtype(sds.dtype):
            raise ValueError(f"fp4: parameter {name!r} must be {np.dtype(sds.dtype).name} {sds.shape} for a "
                             f"{shape} weight, got {np.dtype(a.dtype).name} {tuple(a.shape)}")
    return nvfp4.NVFP4Tensor(params[CODES], params[SCALES], params[GLOBAL_SCALE], shape, True)


def dequantize(params: Mapping, shape, *, dtype=jnp.bfloat16, mesh=None, group_sizes=None) -> jax.Array:
    """[out, in] in `dtype`: the op's dequantize (float32 math, one cast at the end), through ops.tile_dequantize
    (our CUDA kernel on a GPU). mesh: the devices it runs on, group_sizes: stacked MoE experts' token counts for a
    selective dequantization (the op's)."""
    t = to_tensor(params, shape)
    return tile_dequantize(t.codes, t.scales, t.global_scale, fmt="nvfp4", shape=t.shape, out_dtype=dtype,
                           group_sizes=group_sizes, mesh=mesh)


def fp8_weight(params: Mapping, shape, *, dtype=jnp.bfloat16, mesh=None,
               group_sizes=None) -> tuple[jax.Array, jax.Array]:
    """(wq float8_e4m3fn [out, in], scale f32 []) = fp8-hybrid's frozen cache of the weight dequantized in `dtype`:
    scale = 448 / max|W| (current scaling; max|W| from each tile's largest code, ops.tile_amax), wq =
    E4M3(clip(W * scale)), one kernel pass from the 4-bit codes (no `dtype` copy of the weight is written)."""
    t = to_tensor(params, shape)
    args = (t.codes, t.scales, t.global_scale)
    scale = current_scale(tile_amax(*args, fmt="nvfp4", shape=t.shape, via_dtype=dtype))
    wq = tile_dequantize(*args, scale, fmt="nvfp4", shape=t.shape, out_dtype=E4M3, via_dtype=dtype,
                         group_sizes=group_sizes, mesh=mesh)
    return wq, scale
