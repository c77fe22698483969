"""FP8 delayed scaling (the fp8-hybrid recipe): per-tensor scaling state, quantize helpers, updates.

Formats (Transformer Engine's "HYBRID"): E4M3 (`float8_e4m3fn`, max 448) for forward operands
(activations x, weights w), E5M2 (`float8_e5m2`, max 57344) for the backward gradient dY.

Per tensor t the state is `Fp8TensorState(scale f32[...], amax_history f32[..., H])` (TE's
convention: q = saturate(x * scale), dequantized as q * (1 / scale)). One training step:
  1. quantize with the PREVIOUS step's scale: q = e4m3/e5m2(clip(x * scale, -max, max)) (round to
     nearest even; NaN stays NaN; +-inf and out-of-range values saturate to +-max);
  2. observe amax = max |x| of this step's tensor (before scaling);
  3. after the step: history <- roll(history, 1) with history[0] = amax, amax_ref = max(history),
     new scale = fp8_max / amax_ref / 2^margin, keeping the old scale when amax_ref is 0 or not
     finite (and, beyond TE, when the new scale itself is not finite: amax_ref < ~1e-36).
(Sources: TE `recipe.DelayedScaling` and its scale-update rule; Flax `linen/fp8_ops.py`.)

How the state is threaded through a custom_vjp (the design choice)
------------------------------------------------------------------
`surogate_jax.ops.fp8_matmul(x, w, state)` takes an `Fp8MatmulState` (x, w and g tensor states)
as an ordinary differentiable input. Its *gradient* carries this step's observations: in
d(state), `.x.scale`, `.w.scale` and `.g.scale` hold the observed amax of x, w and dY, and every
`amax_history` entry is 0. The train step differentiates w.r.t. the state next to the params and
then applies `update(state, d_state)`. This is Flax's "overwrite with gradient" trick, changed in
one respect: the gradient carries the raw amaxes, not the new state, because
  * the backward amax (of dY) only exists inside the VJP, so some cotangent must carry it anyway,
    and carrying all three the same way needs no Flax mutable collection and no aux outputs
    threaded through the model (the state stays plain f32 arrays: a pytree that Orbax saves and
    that can be stacked [L, ...] for a scanned layer stack);
  * amaxes combine exactly across gradient-accumulation micro-batches by elementwise max
    (`combine_observations`), then ONE update per optimizer step; new states do not combine
    exactly (Flax needs a custom max-accumulating dtype for that);
  * under data parallelism the op already reduces the amax over the data shards with a max
    (TE's `reduce_amax=True`).
Rule: differentiate through each state once per gradient computation (one GEMM call per state
per micro-batch); JAX would add the cotangents of two uses, which is not their max.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from surogate_jax.errors import SurogateError

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP8_MAX = {jnp.dtype(E4M3): E4M3_MAX, jnp.dtype(E5M2): E5M2_MAX}
DEFAULT_AMAX_HISTORY = 1024  # fp8_amax_history (Surogate / TE default)
MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)


class Fp8UnsupportedError(SurogateError):
    """The device cannot run FP8 GEMMs (the message names the GPU and what works there)."""


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


def inverse_scale(scale: jax.Array) -> jax.Array:
    """The dequantization factor 1 / scale in f32 (what the GEMMs multiply by)."""
    return 1.0 / jnp.asarray(scale, jnp.float32)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """x_hat = f32(q) * (1 / scale), in f32, then cast to `dtype`."""
    return (q.astype(jnp.float32) * inverse_scale(scale)).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    """max |x| as an f32 scalar (NaN if x has a NaN, 0 for an empty x)."""
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def compute_scale(amax_history: jax.Array, scale: jax.Array, fp8_max_value: float,
                  margin: float = 0.0) -> jax.Array:
    """fp8_max / max(history) / 2^margin, or the old scale when that is not usable."""
    ref = jnp.max(amax_history, axis=-1)
    new = (fp8_max_value / ref) / (2.0 ** margin)
    keep_old = ~((ref > 0) & jnp.isfinite(ref) & jnp.isfinite(new))
    return jnp.where(keep_old, scale, new).astype(jnp.float32)


def update_tensor_state(state: Fp8TensorState, observed_amax: jax.Array, fp8_max_value: float,
                        margin: float = 0.0) -> Fp8TensorState:
    """Records this step's amax (history[..., 0] after a roll) and recomputes the scale."""
    hist = jnp.roll(state.amax_history, 1, axis=-1)
    hist = hist.at[..., 0].set(jnp.asarray(observed_amax, jnp.float32))
    return Fp8TensorState(scale=compute_scale(hist, state.scale, fp8_max_value, margin),
                          amax_history=hist)


def _is_matmul_state(node: Any) -> bool:
    return isinstance(node, Fp8MatmulState)


def observed_amaxes(d_state: Fp8MatmulState) -> dict[str, jax.Array]:
    """The amaxes a gradient w.r.t. an Fp8MatmulState carries: {"x", "w", "g"}."""
    return {"x": d_state.x.scale, "w": d_state.w.scale, "g": d_state.g.scale}


def update(states: Any, d_states: Any, margin: float = 0.0) -> Any:
    """New delayed-scaling state after one optimizer step.

    states: any pytree whose Fp8MatmulState nodes are the current states; d_states: the gradient
    of the loss w.r.t. `states` (same structure), possibly max-combined over micro-batches.
    """

    def one(state: Fp8MatmulState, d: Fp8MatmulState) -> Fp8MatmulState:
        obs = observed_amaxes(d)
        return Fp8MatmulState(**{
            t: update_tensor_state(getattr(state, t), obs[t], fp8_max(MATMUL_FORMATS[t]), margin)
            for t in ("x", "w", "g")
        })

    return jax.tree.map(one, states, d_states, is_leaf=_is_matmul_state)


def combine_observations(a: Any, b: Any) -> Any:
    """Merges the state gradients of two micro-batches of one step (elementwise max; NaN wins)."""
    return jax.tree.map(jnp.maximum, a, b)


def check_fp8_supported(device: Any = None, recipe: str = "fp8-hybrid") -> bool:
    """Whether FP8 GEMMs run natively on `device` (default: the first JAX device).

    Returns True for an NVIDIA GPU with compute capability >= 8.9 and False for a non-GPU device
    (where the ops run their pure-JAX emulation); raises Fp8UnsupportedError, naming the GPU,
    for an older NVIDIA GPU or a GPU without a CUDA compute capability.
    """
    if device is None:
        device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda", "rocm"):
        return False
    name = getattr(device, "device_kind", str(device))
    cc = str(getattr(device, "compute_capability", ""))
    try:
        major, minor = (int(p) for p in cc.split(".")[:2])
    except ValueError:
        raise Fp8UnsupportedError(
            f"recipe {recipe} needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9); "
            f"{name} reports compute capability {cc!r}; use recipe: bf16"
        ) from None
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        raise Fp8UnsupportedError(
            f"recipe {recipe} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
            f"Blackwell); {name} (device {device.id}) has compute capability {major}.{minor}; "
            "use recipe: bf16 on this GPU"
        )
    return True

