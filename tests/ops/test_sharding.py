"""on_shards: ops run per data shard (split rows, replicated weights, psum-ed weight grads) and
give the results of the unsharded op; checked with rms_norm on a 4-device CPU mesh."""

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

def loss(x, w):
    return jnp.sum(rms_norm(x, w) * dy)

want = jax.grad(loss, argnums=(0, 1))(x, w)
for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        assert data_axes() == ("data",)
        f = jax.jit(jax.grad(loss, argnums=(0, 1)))
        got = f(xs, w)
        hlo = f.lower(xs, w).as_text()
        # rows that do not split over 4 devices fall back to the plain call
        x3 = x[:3]
        np.testing.assert_allclose(jax.jit(lambda a: rms_norm(a, w))(x3), rms_norm(x3, w), rtol=1e-6)
    assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_rms_norm_per_shard_matches_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
