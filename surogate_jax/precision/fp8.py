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

from typing import Any

import jax
import jax.numpy as jnp

from surogate_jax.errors import SurogateError
from surogate_jax.ops.fp8_formats import MATMUL_FORMATS, Fp8MatmulState, Fp8TensorState, fp8_max

MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)


class Fp8UnsupportedError(SurogateError):
    """The device cannot run FP8 GEMMs (the message names the GPU and what works there)."""


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


def check_fp8_supported(device: Any = None, recipe: str = "fp8-hybrid", *, what: str | None = None,
                        instead: str = "use recipe: bf16") -> bool:
    """Whether FP8 GEMMs run natively on `device` (default: the first JAX device).

    Returns True for an NVIDIA GPU with compute capability >= 8.9 and False for a non-GPU device
    (where the ops run their pure-JAX emulation); raises Fp8UnsupportedError, naming the GPU,
    for an older NVIDIA GPU or a GPU without a CUDA compute capability. what / instead: the
    message's subject (default "recipe <recipe>") and its advice.
    """
    what = what or f"recipe {recipe}"
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
            f"{what} needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9); "
            f"{name} reports compute capability {cc!r}; {instead}"
        ) from None
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        raise Fp8UnsupportedError(
            f"{what} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
            f"Blackwell); {name} (device {device.id}) has compute capability {major}.{minor}; "
            f"{instead} on this GPU"
        )
    return True

