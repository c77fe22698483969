"""Selective MoE dequantization's group sizes, shared by the dequantization ops (nf4_dequantize, tile_dequantize):
the weight [rows, cols] is E stacked experts of rows / E rows each, group_sizes int32 [E] how many token rows each
received (the kernels' counterpart is `Groups` in kernels/dequant_common.cuh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_group_sizes(op: str, group_sizes, rows: int):
    """group_sizes as int32 [E] with E dividing rows (None stays None); TypeError / ValueError naming `op`."""
    if group_sizes is None:
        return None
    if not hasattr(group_sizes, "dtype") or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{op}: group_sizes must be an integer array, got "
                        f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}")
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1 or rows % group_sizes.shape[0]:
        raise ValueError(f"{op}: group_sizes must have shape (E,) with E dividing the {rows} rows, got "
                         f"{tuple(group_sizes.shape)}")
    return jnp.asarray(group_sizes).astype(jnp.int32)


def zero_empty_experts(out: jax.Array, group_sizes) -> jax.Array:
    """out [rows, cols] with the rows of experts whose group size is 0 set to zeros (the references' choice for the
    rows the kernels leave unspecified); group_sizes None: out."""
    if group_sizes is None:
        return out
    experts = jnp.asarray(group_sizes).shape[0]
    active = (jnp.asarray(group_sizes) > 0)[:, None, None]
    rows, cols = out.shape
    per_expert = out.reshape(experts, rows // experts, cols)
    return jnp.where(active, per_expert, jnp.zeros((), out.dtype)).reshape(rows, cols)
