"""ZeRO's sharding rule: which dimension of a tensor the "data" mesh axis splits.

A shape rule, shared by parallel.py (weights, gradients, optimizer state) and by optimizer states
that shard in their own way (adamw_8bit's block-quantized moments declare their shardings from
it), so neither side imports the other. Per leaf: the largest dimension that the axis size
divides, never the leading layer axis of a leaf under a `layers` key (the layer scan slices that
axis; sharding it would make every iteration fetch its layer from one device); else replicated.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

DATA = "data"  # the one mesh axis: data parallelism, and the axis ZeRO shards state over


def under_layers(path) -> bool:
    """Whether a pytree path runs through the scanned layer stack."""
    return any(getattr(k, "key", getattr(k, "name", None)) == "layers" for k in path)


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
