"""The fused-update protocol the train step calls: optax transforms that can also write the parameters.

`FusedGradientTransformation` is an optax GradientTransformation with one more method,
`fused_update(grads, state, params, grad_scale=None) -> (new_params, new_state)`, which computes
`params + update(grads * grad_scale)` in one pass (adamw_8bit: one kernel per tensor that writes
the parameter in place). `apply_fused(tx, ...)` takes that path when tx has it and optax's
`update` + `apply_updates` otherwise; `chain_clip` is optax's global-norm clip in front of tx, whose
fused path folds the clip into the update as the gradient scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


class FusedGradientTransformation(optax.GradientTransformation):
    """An optax GradientTransformation (init, update) with one more method:

    fused_update(grads, state, params, grad_scale=None) -> (new_params, new_state)

    which computes `params + update(grads * grad_scale)` directly (for adamw_8bit: one kernel pass
    per tensor that writes the parameter in place). Use it through `apply_fused`."""

    def __new__(cls, init, update, fused_update):
        self = super().__new__(cls, init, update)
        self.fused_update = fused_update
        return self


def apply_fused(tx: optax.GradientTransformation, grads, opt_state, params, norm: jax.Array | None = None):
    """(new_params, new_opt_state): tx's fused path when it has one, else
    `tx.update` + `optax.apply_updates` (the same result, one more pass over memory).
    norm: the gradients' global norm when the caller knows it (a clipping chain then uses it
    instead of the norm of `grads`: the layer-streamed update passes one layer's gradients)."""
    fused = getattr(tx, "fused_update", None)
    if fused is not None:
        if isinstance(tx, ClipChain):
            return fused(grads, opt_state, params, norm=norm)
        return fused(grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def global_norm(tree) -> jax.Array:
    """sqrt of the float32 sum of squares of every leaf (the train step's grad_norm formula)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


class ClipChain(FusedGradientTransformation):
    """optax.chain(optax.clip_by_global_norm(max_norm), inner) with a fused_update that also
    takes the global norm from the caller (see `chain_clip`)."""


def chain_clip(max_norm: float, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """optax.chain(optax.clip_by_global_norm(max_norm), tx) (same init, update and state), as a
    ClipChain whose `fused_update(grads, state, params, grad_scale=None, norm=None)` clips by
    `norm` when given (else the norm of `grads`). When tx is fused, its kernel scales the
    gradients by min(1, max_norm / norm) instead of writing clipped gradients first (equal to the
    optax clip up to one float32 rounding of the scale); otherwise the clip is optax's formula,
    then tx.update and optax.apply_updates."""
    chained = optax.chain(optax.clip_by_global_norm(max_norm), tx)
    inner = getattr(tx, "fused_update", None)

    def fused_update(grads, state, params, grad_scale=None, norm=None):
        norm = global_norm(grads) if norm is None else norm
        if inner is not None:
            scale = jnp.where(norm < max_norm, jnp.float32(1.0), jnp.float32(max_norm) / norm)
            if grad_scale is not None:
                scale = scale * grad_scale
            new_params, inner_state = inner(grads, state[1], params, scale)
            return new_params, (state[0], inner_state)
        if grad_scale is not None:
            raise ValueError("chain_clip: grad_scale needs a fused inner transformation")
        trigger = norm < max_norm  # optax.clip_by_global_norm's formula, with the given norm
        grads = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)
        updates, inner_state = tx.update(grads, state[1], params)
        return optax.apply_updates(params, updates), (state[0], inner_state)

    return ClipChain(chained.init, chained.update, fused_update)


__all__ = ["ClipChain", "FusedGradientTransformation", "apply_fused", "chain_clip", "global_norm"]
