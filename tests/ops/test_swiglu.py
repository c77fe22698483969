"""CPU tests of surogate_jax.ops.swiglu: the public custom_vjp ops (impl="ref") against autodiff of
`swiglu_ref`, the packed form against the split form, and the reference against float64 numpy."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import swiglu, swiglu_packed, swiglu_ref

SHAPES = [(7,), (1, 7), (13, 128), (31, 1001), (2, 3, 1000), (4, 5, 64)]
DTYPES = [jnp.float32, jnp.bfloat16]


def _inputs(key, shape, dtype):
    kg, ku, kp = jax.random.split(key, 3)
    gate = (3.0 * jax.random.normal(kg, shape, jnp.float32)).astype(dtype)
    up = jax.random.normal(ku, shape, jnp.float32).astype(dtype)
    proj = jax.random.normal(kp, shape, jnp.float32)
    return gate, up, proj


def _loss_and_grads(fn, gate, up, proj):
    def loss(g, u):
        return jnp.sum(fn(g, u).astype(jnp.float32) * proj)

    return fn(gate, up), jax.grad(loss, argnums=(0, 1))(gate, up)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_public_op_matches_reference(shape, dtype, assert_close):
    gate, up, proj = _inputs(jax.random.key(sum(shape)), shape, dtype)
    h, (dg, du) = _loss_and_grads(lambda g, u: swiglu(g, u, impl="ref"), gate, up, proj)
    h_ref, (dg_ref, du_ref) = _loss_and_grads(swiglu_ref, gate, up, proj)
    assert h.dtype == dtype and dg.dtype == dtype and du.dtype == dtype
    assert_close(h, h_ref, dtype, "h")
    assert_close(dg, dg_ref, dtype, "dgate")
    assert_close(du, du_ref, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(6,), (13, 128), (2, 3, 1002)], ids=str)
def test_packed_matches_split(shape, dtype, assert_close):
    gu, _, _ = _inputs(jax.random.key(7 + sum(shape)), shape, dtype)
    F = shape[-1] // 2
    proj = jax.random.normal(jax.random.key(1), (*shape[:-1], F), jnp.float32)

    def loss_packed(gu):
        return jnp.sum(swiglu_packed(gu, impl="ref").astype(jnp.float32) * proj)

    def loss_split(gu):
        return jnp.sum(swiglu_ref(gu[..., :F], gu[..., F:]).astype(jnp.float32) * proj)

    h = swiglu_packed(gu, impl="ref")
    assert h.shape == (*shape[:-1], F) and h.dtype == dtype
    assert_close(h, swiglu_ref(gu[..., :F], gu[..., F:]), dtype, "h")
    assert_close(jax.grad(loss_packed)(gu), jax.grad(loss_split)(gu), dtype, "dgate_up")


def test_jit_vmap_and_default_impl(assert_close):
    gate, up, proj = _inputs(jax.random.key(3), (3, 17, 64), jnp.float32)
    fn = jax.jit(jax.vmap(lambda g, u: swiglu(g, u)))  # impl=None: "auto" or "ref" on CPU
    _, (dg, du) = jax.jit(lambda g, u: _loss_and_grads(fn, g, u, proj))(gate, up)
    _, (dg_ref, du_ref) = _loss_and_grads(swiglu_ref, gate, up, proj)
    assert_close(fn(gate, up), swiglu_ref(gate, up), jnp.float32)
    assert_close(dg, dg_ref, jnp.float32)
    assert_close(du, du_ref, jnp.float32)


def test_mixed_dtypes_promote(assert_close):
    gate, up, _ = _inputs(jax.random.key(4), (5, 32), jnp.bfloat16)
    h = swiglu(gate, up.astype(jnp.float32), impl="ref")
    assert h.dtype == jnp.float32
    assert_close(h, swiglu_ref(gate.astype(jnp.float32), up.astype(jnp.float32)), jnp.float32)


def test_extreme_gates_are_finite():
    gate = jnp.asarray([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4]], jnp.float32)
    up = jnp.ones_like(gate)
    h, (dg, du) = _loss_and_grads(lambda g, u: swiglu(g, u, impl="ref"), gate, up, jnp.ones_like(gate))
    for a in (h, dg, du):
        assert bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(np.asarray(h)[0, [0, 3, 6]], [0.0, 0.0, 1e4], atol=1e-6)


def test_env_forces_reference(force_ref):
    force_ref("ref")
    jaxpr = jax.make_jaxpr(lambda g, u: swiglu(g, u, impl="ffi"))(jnp.ones((2, 8)), jnp.ones((2, 8)))
    assert "surogate_swiglu" not in str(jaxpr)


def test_bad_arguments():
    with pytest.raises(ValueError, match="shape"):
        swiglu(jnp.ones((2, 8)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="even"):
        swiglu_packed(jnp.ones((2, 7)))
    with pytest.raises(TypeError, match="floating"):
        swiglu(jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))


def test_checkpoint_name_tag():
    jaxpr = jax.make_jaxpr(lambda g, u: swiglu(g, u, impl="ref"))(jnp.ones((2, 8)), jnp.ones((2, 8)))
    assert "swiglu" in str(jaxpr) and "name" in str(jaxpr)
    jaxpr = jax.make_jaxpr(lambda gu: swiglu_packed(gu, impl="ref"))(jnp.ones((2, 8)))
    assert "swiglu" in str(jaxpr) and "name" in str(jaxpr)


@pytest.mark.parametrize("shape", [(1, 7), (37, 1001), (3, 4, 128)], ids=str)
def test_reference_against_float64_numpy(shape, assert_close):
    rng = np.random.default_rng(sum(shape))
    g = 3.0 * rng.standard_normal(shape)
    u = rng.standard_normal(shape)
    dh = rng.standard_normal(shape)
    s = 1.0 / (1.0 + np.exp(-g))
    h = g * s * u
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * g * s

    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for fn in (swiglu_ref, lambda a, b: swiglu(a, b, impl="ref")):
        h_ref, vjp = jax.vjp(fn, f32(g), f32(u))
        dg_ref, du_ref = vjp(f32(dh))
        assert_close(h_ref, h, jnp.float32, "h")
        assert_close(dg_ref, dg, jnp.float32, "dgate")
        assert_close(du_ref, du, jnp.float32, "dup")


_SHARD_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import swiglu, swiglu_packed
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
g, u, dh = (jnp.asarray(rng.normal(size=(8, 5, 12)), jnp.float32) for _ in range(3))

def loss(g, u, mesh=None):
    return (jnp.sum(swiglu(g, u, mesh=mesh) * dh)
            + jnp.sum(swiglu_packed(jnp.concatenate([g, u], -1), mesh=mesh) * dh))

want = jax.grad(loss, argnums=(0, 1))(g, u)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
gs, us = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (g, u))
f = jax.jit(jax.grad(lambda g, u: loss(g, u, mesh), argnums=(0, 1)))
got = f(gs, us)
hlo = f.lower(gs, us).as_text()
assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
print("ok")
'''


def test_per_shard_matches_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
