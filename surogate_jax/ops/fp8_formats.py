"""FP8 formats and the per-tensor scaling state that `fp8_matmul` consumes: E4M3 / E5M2, the
saturating quantize and its inverse, amax, and the `Fp8TensorState` / `Fp8MatmulState` pytrees.

The state's meaning and how the fp8-hybrid recipe updates it between steps (delayed scaling) are in
precision/fp8.py; this module is what the op needs to run, so ops never import precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP8_MAX = {jnp.dtype(E4M3): E4M3_MAX, jnp.dtype(E5M2): E5M2_MAX}
DEFAULT_AMAX_HISTORY = 1024  # fp8_amax_history (Surogate / TE default)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scale", "amax_history"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Fp8TensorState:
    """Delayed-scaling state of one tensor. scale: f32[...] (q = x * scale); amax_history:
    f32[..., H], index 0 the newest. Leading dims [...] allow stacked (scanned) layers."""

    scale: jax.Array
    amax_history: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "w", "g"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Fp8MatmulState:
    """State of one FP8 GEMM y = x @ w: x and w (E4M3, forward), g = dY (E5M2, backward)."""

    x: Fp8TensorState
    w: Fp8TensorState
    g: Fp8TensorState


# Which format each tensor of an Fp8MatmulState is quantized to.
MATMUL_FORMATS = {"x": E4M3, "w": E4M3, "g": E5M2}


def init_tensor_state(history_len: int = DEFAULT_AMAX_HISTORY, shape: tuple[int, ...] = ()) -> Fp8TensorState:
    """Scale 1, empty (zero) history; `shape` = leading dims for stacked layers."""
    if history_len < 1:
        raise ValueError(f"fp8_amax_history must be >= 1, got {history_len}")
    return Fp8TensorState(scale=jnp.ones(shape, jnp.float32),
                          amax_history=jnp.zeros((*shape, history_len), jnp.float32))


def init_matmul_state(history_len: int = DEFAULT_AMAX_HISTORY, shape: tuple[int, ...] = ()) -> Fp8MatmulState:
    return Fp8MatmulState(*(init_tensor_state(history_len, shape) for _ in range(3)))


def fp8_max(dtype) -> float:
    return FP8_MAX[jnp.dtype(dtype)]


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q = dtype(clip(f32(x) * scale, -max, max)): round to nearest even, saturating, NaN kept.

    (A plain astype does not saturate: 500 -> NaN in E4M3, so the clip matters.)

    The result passes through `jax.lax.optimization_barrier`: XLA's GPU compiler (with its default
    xla_allow_excess_precision) folds a chain of converts such as f32 -> f8 -> f32/bf16 into one
    convert (SimplifyFPConversions; openxla/xla issue 41605), which silently drops the FP8
    rounding wherever a consumer widens q in the same program (the reference GEMMs, the "xla"
    dequantize-dot path). The barrier is opaque to that pass and is removed only after
    scheduling, so q really is rounded to `dtype`; it changes nothing on CPU."""
    m = fp8_max(dtype)
    xs = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return jax.lax.optimization_barrier(jnp.clip(xs, -m, m).astype(dtype))


def current_scale(am: jax.Array, dtype=E4M3) -> jax.Array:
    """Current scaling to `dtype` (E4M3 by default) of a tensor whose max |x| is `am` (any shape): fmt_max / am, or 1
    where am is 0 or not finite (an all-zero or broken tensor keeps its values)."""
    am = jnp.asarray(am, jnp.float32)
    ok = (am > 0) & jnp.isfinite(am)
    return jnp.where(ok, fp8_max(dtype) / jnp.where(ok, am, 1.0), 1.0).astype(jnp.float32)


def inverse_scale(scale: jax.Array) -> jax.Array:
    """The dequantization factor 1 / scale in f32 (what the GEMMs multiply by)."""
    return 1.0 / jnp.asarray(scale, jnp.float32)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """x_hat = f32(q) * (1 / scale), in f32, then cast to `dtype`."""
    return (q.astype(jnp.float32) * inverse_scale(scale)).astype(dtype)


def amax(x: jax.Array, axis=None) -> jax.Array:
    """max |x| in f32 over `axis` (all by default; NaN if a NaN is there, 0 for an empty x). Taken in x's own dtype
    (exact) and widened after: an f32 copy of x shared by this reduction and a quantization of x got materialized
    (the CPU compiler's temporaries for an fp8 weight cache: 4x; see precision/recipe.cache_experts)."""
    return jnp.max(jnp.abs(x), axis=axis, initial=0).astype(jnp.float32)
