"""Run an op's FFI calls on each device's local shard instead of on a gathered tensor.

An XLA custom call has no partitioning rule: left alone under a sharded jit, XLA all-gathers its
inputs and runs the kernel redundantly on every device (jax issue #32098). Our activations are
sharded only along their leading (batch / row) axis over the mesh's data axes, and every op in
ops/ is row-local, so `on_shards` wraps the call in `jax.shard_map`: batched operands and outputs
are split along axis 0, the rest (weights, scalars) are replicated, and outputs that are sums over
rows (e.g. a norm weight's gradient) are `psum`-ed across the shards.

The mesh comes from the tracing context (`jax.set_mesh(mesh)`, which the train step uses). With no
mesh, a mesh whose data axes are all of size 1, or a leading axis that does not split evenly, the
function is called as is (correct; XLA then gathers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

# Mesh axes that split the batch (surogate_jax.parallel puts data parallelism and ZeRO on these).
DATA_AXES = ("data",)


def data_axes() -> tuple[str, ...]:
    """The data axes of the current abstract mesh with more than one device (may be empty)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    shape = dict(mesh.shape)
    return tuple(a for a in DATA_AXES if shape.get(a, 1) > 1)


def on_shards(
    fn: Callable,
    *args,
    batched: Sequence[bool],
    out_batched: Sequence[bool],
    out_summed: Sequence[bool] | None = None,
):
    """Calls fn(*args) per shard of the leading axis of the `batched` operands.

    batched[i]: args[i] is split along axis 0 (else replicated).
    out_batched[j]: output j is split along axis 0 (else it must be identical on every shard, or
      listed in out_summed).
    out_summed[j]: output j is a per-shard partial sum; the shards' values are added (psum).
    fn must return a tuple of len(out_batched) arrays.
    """
    axes = data_axes()
    if not axes:
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    n = 1
    for a in axes:
        n *= dict(mesh.shape)[a]
    if any(b and (a.ndim == 0 or a.shape[0] % n) for a, b in zip(args, batched, strict=True)):
        return fn(*args)  # rows do not split evenly: let XLA gather (correct, slower)
    out_summed = tuple(out_summed or (False,) * len(out_batched))
    split, rep = P(axes), P()

    def body(*local):
        outs = fn(*local)
        return tuple(jax.lax.psum(o, axes) if s else o for o, s in zip(outs, out_summed, strict=True))

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(split if b else rep for b in batched),
        out_specs=tuple(split if b else rep for b in out_batched),
        check_vma=False,
    )(*args)
