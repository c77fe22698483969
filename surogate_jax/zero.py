"""ZeRO's sharding rule: which dimension of a tensor the "data" mesh axis splits.

A shape rule, shared by parallel.py (weights, gradients, optimizer state) and by optimizer states
that shard in their own way (adamw_8bit's block-quantized moments declare their shardings from
it), so neither side imports the other. Per leaf: the largest dimension that the axis size
divides, never the leading layer axis of a leaf under a `layers` key (the layer scan slices that
axis; sharding it would make every iteration fetch its layer from one device); else replicated.
Under expert parallelism the MoE experts' stacked leaves split their expert axis over "expert" instead
(`expert_spec`).
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from .names import layer_stack_start

DATA = "data"  # data parallelism, and the axis ZeRO shards state over
EXPERT = "expert"  # expert parallelism (ep_size): splits the batch too, and the MoE layers' experts


def under_layers(path) -> bool:
    """Whether a pytree path runs through the scanned layer stack."""
    return any(layer_stack_start(getattr(k, "key", getattr(k, "name", None))) is not None for k in path)


def zero_spec(path, shape: tuple[int, ...], n: int) -> P:
    """The largest dim divisible by n (never a `layers` leaf's leading axis), else replicated."""
    if n <= 1:
        return P()
    first = 1 if under_layers(path) else 0
    best = None
    for d in range(first, len(shape)):
        if shape[d] >= n and shape[d] % n == 0 and (best is None or shape[d] > shape[best]):
            best = d
    if best is None:
        return P()
    return P(*([None] * best), DATA)


def is_expert_leaf(path) -> bool:
    """Whether a pytree path is a stacked MoE expert leaf ([L, E, ...] under a layer stack's `experts`)."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return "experts" in keys and under_layers(path)


def expert_spec(path, shape: tuple[int, ...], ep: int) -> P | None:
    """Expert parallelism: a stacked MoE expert leaf [L, E, ...] under `experts` (the weights, their adapters, and
    optimizer state of their shape) splits E over the "expert" axis; None for every other leaf (and ep 1)."""
    if ep <= 1 or not is_expert_leaf(path) or len(shape) < 2 or shape[1] % ep:
        return None
    return P(None, EXPERT)
