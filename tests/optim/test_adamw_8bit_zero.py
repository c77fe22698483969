"""adamw_8bit under ZeRO on 4 CPU devices, given the mesh explicitly (`adamw_8bit(..., mesh=mesh)`): each 8-bit
leaf is updated per shard (jax.shard_map on parallel.zero_spec's dim), the result equals 1 device bit for bit, and
the compiled step moves no 8-bit codes: with absmax shardings paired to their codes (`shard_specs`, as
parallel.Layout places the optimizer state) there is no collective at all; with parallel.zero_spec applied to every
leaf as it stands, only the absmax of leaves sharded along their block dim is resharded (an f32 all-to-all, 1/64 of
the codes' bytes). Leaves whose blocks would straddle shards are updated unsharded with a logged line, still equal.
The mesh comes from the argument only: the "paired" runs trace with no context mesh, the "zero" run under one (as
train.jit_train_step does); without a mesh (DDP) the update is never split, whatever the context."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import logging, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from surogate_jax.optim import adamw_8bit, apply_fused
from surogate_jax.optim.adamw_8bit import QuantizedMoment, shard_specs
from surogate_jax.parallel import Layout, Plan, zero_spec
assert len(jax.devices()) == 4, jax.devices()
mode, straddle = sys.argv[1], sys.argv[2] == "1"
# embed: dim 0 sharded, blocks within rows; q: [L, D, H, K] sharded on D, 2 heads per block;
# up: [L, D, F] sharded on F = the block dim (4 blocks per row, one per shard); norm: fp32 path
SHAPES = {"embed": (1024, 256), "layers": {"q": (2, 64, 4, 64), "up": (2, 32, 1024), "norm": (2, 64)}}
if straddle:  # 2 blocks per row over 4 shards; a size that is no multiple of 256
    SHAPES["layers"]["wide"] = (2, 8, 512)
    SHAPES["odd"] = (4100,)
rng = np.random.default_rng(0)
is_shape = lambda x: isinstance(x, tuple)
mk = lambda scale: jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32), SHAPES,
                                is_leaf=is_shape)
params, grads = mk(0.1), [mk(1e-2) for _ in range(3)]
make_tx = lambda mesh: adamw_8bit(1e-2, weight_decay=0.1, impl="ref", mesh=mesh)
is_q = lambda x: isinstance(x, QuantizedMoment)

def specs(tree, n):
    def one(path, x):
        if is_q(x):
            codes = zero_spec(path, x.codes.shape, n)
            if mode == "paired":
                plan = shard_specs(path, x.codes.shape, n)
                return QuantizedMoment(codes, plan[1] if isinstance(plan, tuple) else P())
            return QuantizedMoment(codes, zero_spec(path, x.absmax.shape, n))
        return zero_spec(path, tuple(x.shape), n)
    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_q)

def run(devs):  # ZeRO-3 placement: params, grads and state sharded by the rule
    mesh = Mesh(np.array(devs), ("data",))
    tx = make_tx(mesh)
    ns = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t, is_leaf=lambda x: isinstance(x, P))
    st_sh, p_sh = ns(specs(jax.eval_shape(tx.init, params), len(devs))), ns(specs(params, len(devs)))
    if mode == "paired":  # the trainer's own placement (parallel.Layout pairs absmax with codes)
        st_sh = Layout(mesh, Plan(shard_optimizer=True)).shardings(jax.eval_shape(tx.init, params), True)
    p = jax.device_put(jax.tree.map(jnp.copy, params), p_sh)
    st = jax.jit(tx.init, out_shardings=st_sh)(p)
    def step(p, s, g):
        if mode == "paired":
            return apply_fused(tx, g, s, p)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return apply_fused(tx, g, s, p)
    f = jax.jit(step, in_shardings=(p_sh, st_sh, p_sh), out_shardings=(p_sh, st_sh), donate_argnums=(0, 1))
    comp = f.lower(p, st, jax.device_put(grads[0], p_sh)).compile()
    for g in grads:
        p, st = comp(p, st, jax.device_put(g, p_sh))
    assert all(x.sharding.spec == s.spec for x, s in zip(jax.tree.leaves(st), jax.tree.leaves(st_sh)))
    return jax.device_get((p, st)), comp.as_text()

jaxpr = lambda tx: str(jax.make_jaxpr(lambda p, s, g: apply_fused(tx, g, s, p))(params, tx.init(params), grads[0]))
mesh4 = Mesh(np.array(jax.devices()), ("data",))
assert "shard_map" in jaxpr(make_tx(mesh4)), "a mesh given: the update runs per shard"
with jax.sharding.use_abstract_mesh(mesh4.abstract_mesh):  # a context mesh alone does not split it
    assert "shard_map" not in jaxpr(make_tx(None))
one, _ = run(jax.devices()[:1])
four, hlo = run(jax.devices())
for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four), strict=True):
    np.testing.assert_array_equal(a, b)
colls = []
for line in hlo.splitlines():
    m = re.search(r"= (.*?) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(", line)
    if m:
        colls.append((m.group(2), tuple(sorted(set(re.findall(r"\b(u8|f32|s32|bf16|pred)\[", m.group(1)))))))
print("collectives", sorted(set(colls)))
if not straddle:
    assert not [c for c in colls if "u8" in c[1]], colls  # codes never move
    if mode == "paired":
        assert not colls, colls
    else:
        assert colls and all(c == ("all-to-all", ("f32",)) for c in colls), colls
print("OK")
'''


@pytest.mark.parametrize("mode,straddle", [("paired", "0"), ("zero", "0"), ("paired", "1")])
def test_sharded_update_matches_one_device_without_gathering_codes(mode, straddle):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode, straddle], env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    if straddle == "1":
        assert "would straddle the 4 ZeRO shards" in r.stderr, r.stderr[-3000:]
