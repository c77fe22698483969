"""Run an op's FFI calls on each device's local shard instead of on a gathered tensor.

An XLA custom call has no partitioning rule: left alone under a sharded jit, XLA all-gathers its
inputs and runs the kernel redundantly on every device (jax issue #32098). Our activations are
sharded only along their leading (batch / row) axis over the mesh's data axes, and every op in
ops/ is row-local, so `on_shards` wraps the call in `jax.shard_map`: batched operands and outputs
are split along axis 0, the rest (weights, scalars) are replicated, and outputs that are sums over
rows (e.g. a norm weight's gradient) are `psum`-ed across the shards.

The mesh is an argument: every op that runs per shard takes `mesh=` (a `jax.sharding.Mesh` or
`AbstractMesh`; the models pass `DecoderConfig.mesh`, which train.make_train_step / make_eval_step
set to the layout's mesh). The ambient mesh (`jax.set_mesh`, `use_abstract_mesh`) is never read.
With no mesh, a mesh whose data axes are all of size 1, or a leading axis that does not split
evenly, the function is called as is (correct; XLA then gathers).

Explicit meshes (`jax.sharding.AxisType.Explicit`): there a value's sharding is part of its type
and shard_map refuses operands whose sharding differs from its in_specs (e.g. targets that arrive
replicated next to row-split activations, or a ZeRO-3-sharded weight). So when the data axes are
Explicit, `on_shards` first brings every operand to its in_spec itself (`jax.sharding.reshard` to
NamedShardings on `mesh`: batched operands to the row split, the others replicated), and gives its
outputs back the types the operands imply (a replicated input gives a replicated output, a weight's
gradient the weight's sharding), which custom_vjp needs for its cotangents. Every op gets this;
none has to do it.
Auto meshes need nothing: shard_map reshards their operands by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Mesh axes that split the batch (surogate_jax.parallel puts data parallelism and ZeRO on "data"). The "expert" axis
# (expert parallelism, ep_size) splits the batch too and, in the MoE layers, the experts (`split_experts`).
DATA_AXES = ("data", "expert")
EXPERT_AXIS = "expert"


def data_axes(mesh) -> tuple[str, ...]:
    """The data axes of `mesh` (a Mesh, an AbstractMesh or None) with more than one device (may be empty)."""
    if mesh is None or mesh.empty:
        return ()
    shape = dict(mesh.shape)
    return tuple(a for a in DATA_AXES if shape.get(a, 1) > 1)


def expert_parallel(mesh) -> int:
    """The size of `mesh`'s "expert" axis when it has more than one device (else 0: no expert parallelism)."""
    size = 0 if mesh is None or mesh.empty else dict(mesh.shape).get(EXPERT_AXIS, 1)
    return size if size > 1 else 0


def _explicit(mesh, axes) -> bool:
    """True when every one of `axes` is an Explicit axis of `mesh` (sharding in the type)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return all(types[a] == jax.sharding.AxisType.Explicit for a in axes)


def _spec(x) -> P | None:
    """x's sharding spec from its type (Explicit meshes), or None where it has none."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "spec", None)


def _replicated(spec: P | None) -> bool:
    return spec is not None and all(s is None for s in spec)


def _types_back(mesh, outs, args, specs, batched, out_batched):
    """Explicit meshes: gives the outputs the types the caller's operands imply, so an op is
    transparent (a replicated input gives a replicated output) and a custom_vjp's cotangents match
    its primals. A batched output takes the spec of the first batched operand when the ranks agree
    (else replicated if that operand was, else it stays row-split); any other output takes the spec
    of the first unbatched operand of the same shape (a weight and its gradient), else stays
    replicated."""
    lead = next(((a, sp) for a, sp, b in zip(args, specs, batched, strict=True) if b), (None, None))

    def target(o, is_batched):
        if is_batched:
            a, sp = lead
            if sp is not None and a.ndim == o.ndim:
                return sp
            return P() if _replicated(sp) else None
        return next((sp for a, sp, b in zip(args, specs, batched, strict=True)
                     if not b and sp is not None and tuple(a.shape) == tuple(o.shape)), None)

    res = []
    for o, ob in zip(outs, out_batched, strict=True):
        t = target(o, ob)
        res.append(o if t is None else jax.sharding.reshard(o, NamedSharding(mesh, t)))
    return tuple(res)


def on_shards(
    fn: Callable,
    *args,
    mesh,
    batched: Sequence[bool],
    out_batched: Sequence[bool],
    out_summed: Sequence[bool] | None = None,
    split_experts: Sequence[bool] | None = None,
):
    """Calls fn(*args) per shard of the leading axis of the `batched` operands.

    mesh: the device mesh (Mesh or AbstractMesh) whose data axes split the rows; None runs fn whole.
    batched[i]: args[i] is split along axis 0 (else replicated).
    out_batched[j]: output j is split along axis 0 (else it must be identical on every shard, or
      listed in out_summed).
    out_summed[j]: output j is a per-shard partial sum; the shards' values are added (psum).
    split_experts[i]: args[i] (unbatched) is split along axis 0 over the "expert" axis alone (each device of an
      expert-parallel group holds its experts; fn runs collectives over EXPERT_AXIS itself).
    fn must return a tuple of len(out_batched) arrays.

    On an Explicit mesh the operands are first resharded to those specs (batched: split rows,
    others replicated) whatever sharding they arrive with, and the outputs get back the types
    the operands imply (see `_types_back`).
    """
    axes = data_axes(mesh)
    if not axes:
        return fn(*args)
    n = 1
    for a in axes:
        n *= dict(mesh.shape)[a]
    explicit = _explicit(mesh, axes)
    specs = [_spec(a) for a in args] if explicit else None
    if any(b and (a.ndim == 0 or a.shape[0] % n) for a, b in zip(args, batched, strict=True)):
        # rows do not split evenly: the op runs whole (correct, slower); an Explicit mesh gathers
        # the operands here, an Auto one lets XLA do it
        if any(split_experts or ()):
            raise ValueError(f"expert parallelism needs rows that split evenly over the {n} devices; got "
                             f"{[a.shape[0] for a, b in zip(args, batched, strict=True) if b]}")
        if not explicit:
            return fn(*args)
        outs = fn(*(jax.sharding.reshard(a, NamedSharding(mesh, P())) for a in args))
        return _types_back(mesh, outs, args, specs, batched, out_batched)
    out_summed = tuple(out_summed or (False,) * len(out_batched))
    split, rep = P(axes), P()
    experts = P(EXPERT_AXIS) if EXPERT_AXIS in axes else rep
    in_specs = tuple(split if b else experts if e else rep
                     for b, e in zip(batched, split_experts or (False,) * len(args), strict=True))

    def body(*local):
        outs = fn(*local)
        return tuple(jax.lax.psum(o, axes) if s else o for o, s in zip(outs, out_summed, strict=True))

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=tuple(split if b else rep for b in out_batched),
        check_vma=False,
    )
    if not explicit:
        return run(*args)
    outs = run(*(jax.sharding.reshard(a, NamedSharding(mesh, spec)) for a, spec in zip(args, in_specs, strict=True)))
    return _types_back(mesh, outs, args, specs, batched, out_batched)
