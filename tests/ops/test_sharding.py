"""on_shards: ops given `mesh=` run per data shard (split rows, replicated weights, psum-ed weight
grads) and give the results of the unsharded op; checked with rms_norm on a 4-device CPU mesh. The
ambient mesh (jax.set_mesh / use_abstract_mesh) is never read: without mesh= an op runs whole."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import rms_norm
from surogate_jax.ops._sharding import data_axes
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(8, 5, 12)), jnp.float32)
w = jnp.asarray(rng.normal(size=(12,)), jnp.float32)
dy = jnp.asarray(rng.normal(size=(8, 5, 12)), jnp.float32)

def loss(x, w, mesh=None):
    return jnp.sum(rms_norm(x, w, mesh=mesh) * dy)

want = jax.grad(loss, argnums=(0, 1))(x, w)
assert data_axes(None) == () and data_axes(jax.make_mesh((1,), ("data",))) == ()
for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    concrete = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    xs = jax.device_put(x, NamedSharding(concrete, P("data")))
    for mesh in (concrete, concrete.abstract_mesh):  # either form of the mesh is taken
        assert data_axes(mesh) == ("data",)
        f = jax.jit(jax.grad(lambda x, w: loss(x, w, mesh), argnums=(0, 1)))
        got = f(xs, w)
        hlo = f.lower(xs, w).as_text()
        # rows that do not split over 4 devices fall back to the plain call
        x3 = jax.device_put(x[:3], NamedSharding(concrete, P()))
        np.testing.assert_allclose(jax.jit(lambda a: rms_norm(a, w, mesh=mesh))(x3), rms_norm(x[:3], w), rtol=1e-6)
        assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_rms_norm_per_shard_matches_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


EXPLICIT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import lm_head_ce, rms_norm
assert len(jax.devices()) == 4
rng = np.random.default_rng(1)
x = jnp.asarray(rng.normal(size=(8, 5, 12)), jnp.float32)
w = jnp.asarray(rng.normal(size=(12,)), jnp.float32)
W = jnp.asarray(rng.normal(size=(12, 36)) * 0.3, jnp.float32)
t = jnp.asarray(rng.integers(0, 36, (8, 5)), jnp.int32)
m = jnp.asarray(rng.random((8, 5)) < 0.8, jnp.float32)

def loss(x, w, W, t, m, mesh=None):
    h = rms_norm(x, w, mesh=mesh)
    l, c = lm_head_ce(h, W, t, m, mesh=mesh)
    return l / c, h

f = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
(want_l, want_h), want_g = f(x, w, W, t, m)  # one device, no mesh
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
fm = jax.value_and_grad(lambda *a: loss(*a, mesh=mesh), argnums=(0, 1, 2), has_aux=True)
put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
cases = {
    "all replicated": (put(x), put(w), put(W), put(t), put(m)),
    "rows split, targets/mask replicated": (put(x, "data"), put(w), put(W), put(t), put(m)),
    "hidden split on D, head sharded (ZeRO-3-like)": (put(x, None, None, "data"), put(w), put(W, None, "data"),
                                                       put(t, "data"), put(m)),
    "rows that do not split over 4 (fallback)": (put(x[:6]), put(w), put(W), put(t[:6]), put(m[:6])),
}
# An Explicit-sharding program runs under its mesh (JAX types fresh arrays, e.g. the ops' fallback's
# zeros, by the context mesh); the ops still take the mesh from mesh=, never from the context.
with jax.set_mesh(mesh):
    for name, args in cases.items():
        (l, h), g = jax.jit(fm)(*args)
        n = args[0].shape[0]
        (rl, rh), rg = (want_l, want_h), want_g
        if n != 8:
            (rl, rh), rg = f(x[:n], w, W, t[:n], m[:n])
        # the op is transparent on an Explicit mesh: outputs and gradients keep their inputs' types
        assert jax.typeof(h).sharding.spec == jax.typeof(args[0]).sharding.spec, (name, jax.typeof(h))
        for gi, ai in zip(g, args):
            assert jax.typeof(gi).sharding.spec == jax.typeof(ai).sharding.spec, (name, jax.typeof(gi))
        np.testing.assert_allclose(l, rl, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(h, rh, rtol=1e-5, atol=1e-6, err_msg=name)
        for a, b in zip(g, rg):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)
        print("ok", name)
    # the per-shard path really ran (no gathered custom call): shard_map in the lowered program
    hlo = jax.jit(fm).lower(*cases["all replicated"]).as_text()
    assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
print("ok")
'''


def test_explicit_mesh_reshards_operands_and_matches_one_device():
    """On an Explicit mesh (sharding in the type) replicated targets/mask/activations, a hidden
    split on the wrong axis and a sharded head all go through rms_norm + lm_head_ce (forward and
    gradients): on_shards reshards operands itself and hands back the callers' types."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", EXPLICIT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


AMBIENT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import lm_head_ce, rms_norm, rope_qk, swiglu
assert len(jax.devices()) == 4
rng = np.random.default_rng(2)
x = jnp.asarray(rng.normal(size=(8, 5, 16)), jnp.float32)
w = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
W = jnp.asarray(rng.normal(size=(16, 36)) * 0.3, jnp.float32)
t = jnp.asarray(rng.integers(0, 36, (8, 5)), jnp.int32)
pos = jnp.asarray(rng.integers(0, 50, (8, 5)), jnp.int32)
inv = jnp.ones(2, jnp.float32)

def loss(x, w, W, mesh=None):
    h = rms_norm(x, w, mesh=mesh)
    q, k = rope_qk(h.reshape(8, 5, 4, 4), h.reshape(8, 5, 4, 4), pos, inv, mesh=mesh)
    h = swiglu(q.reshape(8, 5, 16), k.reshape(8, 5, 16), mesh=mesh)
    return lm_head_ce(h, W, t, mesh=mesh)[0]

grad = jax.grad(loss, argnums=(0, 1, 2))
want = grad(x, w, W)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))  # parallel.make_mesh's kind
xs = jax.device_put(x, NamedSharding(mesh, P("data")))
for ctx in (lambda: jax.set_mesh(mesh), lambda: jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
    with ctx():
        whole = str(jax.make_jaxpr(grad)(xs, w, W))
        split = str(jax.make_jaxpr(lambda *a: grad(*a, mesh=mesh))(xs, w, W))
        got = jax.jit(grad)(xs, w, W)
    assert "shard_map" not in whole, "an op without mesh= read the ambient mesh"
    assert "shard_map" in split
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_ambient_mesh_is_not_read():
    """Ops traced inside jax.set_mesh(mesh) / use_abstract_mesh but called without mesh= run whole
    (no shard_map in the jaxpr); the same calls with mesh= split."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", AMBIENT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
