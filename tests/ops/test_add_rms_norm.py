"""CPU tests of surogate_jax.ops.add_rms_norm: the public custom_vjp op (impl="ref") against
autodiff of `add_rms_norm_ref` and of the unfused `x + residual` then `rms_norm_ref`, and the
reference against float64 numpy."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import add_rms_norm, add_rms_norm_ref, rms_norm_ref

SHAPES = [(1, 7), (13, 128), (31, 1001), (2, 3, 1000), (4, 5, 64)]
DTYPES = [jnp.float32, jnp.bfloat16]
EPS = 1e-5


def _inputs(key, shape, dtype):
    kx, kr, kw, kp, kq = jax.random.split(key, 5)
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    res = (2.0 * jax.random.normal(kr, shape, jnp.float32)).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    proj_y = jax.random.normal(kp, shape, jnp.float32)
    proj_s = jax.random.normal(kq, shape, jnp.float32)
    return x, res, w, proj_y, proj_s


def _loss_and_grads(fn, x, res, w, proj_y, proj_s):
    """Both outputs feed the loss, so the backward sees dy and a nonzero residual gradient."""

    def loss(x, res, w):
        y, s = fn(x, res, w)
        return jnp.sum(y.astype(jnp.float32) * proj_y) + jnp.sum(s.astype(jnp.float32) * proj_s)

    return fn(x, res, w), jax.grad(loss, argnums=(0, 1, 2))(x, res, w)


def _unfused(x, res, w):
    s = x + res
    return rms_norm_ref(s, w, EPS), s


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_public_op_matches_reference(shape, dtype, assert_close):
    x, res, w, py, ps = _inputs(jax.random.key(sum(shape)), shape, dtype)
    (y, s), (dx, dr, dw) = _loss_and_grads(lambda *a: add_rms_norm(*a, EPS, impl="ref"), x, res, w, py, ps)
    for ref in (lambda *a: add_rms_norm_ref(*a, EPS), _unfused):
        (y_ref, s_ref), (dx_ref, dr_ref, dw_ref) = _loss_and_grads(ref, x, res, w, py, ps)
        assert y.dtype == dtype and s.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
        assert_close(y, y_ref, dtype, "y")
        assert_close(dx, dx_ref, dtype, "dx")
        assert_close(dr, dr_ref, dtype, "dresidual")
        assert_close(dw, dw_ref, dtype, "dw")
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dr, np.float32))


def test_only_y_used(assert_close):
    # The residual output unused: its cotangent is zero and dx is the plain norm gradient.
    x, res, w, py, _ = _inputs(jax.random.key(5), (9, 256), jnp.float32)

    def loss(fn):
        return lambda x, res, w: jnp.sum(fn(x, res, w)[0] * py)

    g = jax.grad(loss(lambda *a: add_rms_norm(*a, EPS, impl="ref")), argnums=(0, 1, 2))(x, res, w)
    g_ref = jax.grad(loss(_unfused), argnums=(0, 1, 2))(x, res, w)
    for a, b in zip(g, g_ref, strict=True):
        assert_close(a, b, jnp.float32)


def test_jit_vmap_and_default_impl(assert_close):
    x, res, w, py, ps = _inputs(jax.random.key(2), (4, 9, 128), jnp.float32)
    ws = w * jnp.arange(1, 5, dtype=jnp.float32)[:, None]  # per-example weights
    fn = jax.jit(jax.vmap(lambda x, r, w: add_rms_norm(x, r, w, EPS)))  # impl=None
    (y, s), grads = jax.jit(lambda *a: _loss_and_grads(fn, *a, py, ps))(x, res, ws)
    (y_ref, s_ref), grads_ref = _loss_and_grads(jax.vmap(_unfused), x, res, ws, py, ps)
    assert_close(y, y_ref, jnp.float32)
    assert_close(s, s_ref, jnp.float32)
    for a, b in zip(grads, grads_ref, strict=True):
        assert_close(a, b, jnp.float32)


def test_weight_dtype_differs_from_x(assert_close):
    x, res, w, py, ps = _inputs(jax.random.key(3), (8, 256), jnp.bfloat16)
    w32 = w.astype(jnp.float32) + 1e-3
    _, (_, _, dw) = _loss_and_grads(lambda *a: add_rms_norm(*a, EPS, impl="ref"), x, res, w32, py, ps)
    _, (_, _, dw_ref) = _loss_and_grads(lambda x, r, w: _unfused(x, r, w.astype(jnp.bfloat16)), x, res, w32, py, ps)
    assert dw.dtype == jnp.float32
    assert_close(dw, dw_ref, jnp.bfloat16)


def test_env_forces_reference(force_ref):
    force_ref("ref")
    jaxpr = jax.make_jaxpr(lambda x, r, w: add_rms_norm(x, r, w, impl="ffi"))(
        jnp.ones((2, 8)), jnp.ones((2, 8)), jnp.ones(8)
    )
    assert "surogate_add_rms_norm" not in str(jaxpr)


def test_bad_arguments():
    with pytest.raises(ValueError, match="shape"):
        add_rms_norm(jnp.ones((2, 8)), jnp.ones((2, 8)), jnp.ones(4))
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm(jnp.ones((2, 8)), jnp.ones((3, 8)), jnp.ones(8))


def test_checkpoint_name_tags():
    jaxpr = str(jax.make_jaxpr(lambda x, r, w: add_rms_norm(x, r, w, impl="ref"))(
        jnp.ones((2, 8)), jnp.ones((2, 8)), jnp.ones(8)))
    assert "add_rms_norm" in jaxpr and "residual" in jaxpr and "name" in jaxpr


@pytest.mark.parametrize("shape", [(1, 7), (37, 1001), (3, 4, 128)], ids=str)
def test_reference_against_float64_numpy(shape, assert_close):
    rng = np.random.default_rng(sum(shape))
    x, r = rng.standard_normal(shape), 2.0 * rng.standard_normal(shape)
    w = 1.0 + 0.5 * rng.standard_normal(shape[-1])
    dy, ds = rng.standard_normal(shape), rng.standard_normal(shape)

    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    s = np.asarray(f32(x) + f32(r), np.float64)  # the fp32 sum the op rounds to
    rstd = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
    y = s * rstd * w
    shat, g = s * rstd, dy * w
    dx = rstd * (g - shat * np.mean(g * shat, axis=-1, keepdims=True)) + ds
    dw = np.sum((dy * shat).reshape(-1, shape[-1]), axis=0)

    for fn in (lambda *a: add_rms_norm_ref(*a, EPS), lambda *a: add_rms_norm(*a, EPS, impl="ref")):
        (y_ref, s_ref), vjp = jax.vjp(fn, f32(x), f32(r), f32(w))
        dx_ref, dr_ref, dw_ref = vjp((f32(dy), f32(ds)))
        assert_close(s_ref, s, jnp.float32, "s")
        assert_close(y_ref, y, jnp.float32, "y")
        assert_close(dx_ref, dx, jnp.float32, "dx")
        assert_close(dr_ref, dx, jnp.float32, "dresidual")
        assert_close(dw_ref, dw, jnp.float32, "dw")


_SHARD_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import add_rms_norm
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
x, r, dy, ds = (jnp.asarray(rng.normal(size=(8, 5, 12)), jnp.float32) for _ in range(4))
w = jnp.asarray(rng.normal(size=(12,)), jnp.float32)

def loss(x, r, w, mesh=None):
    y, s = add_rms_norm(x, r, w, mesh=mesh)
    return jnp.sum(y * dy) + jnp.sum(s * ds)

want = jax.grad(loss, argnums=(0, 1, 2))(x, r, w)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
xs, rs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, r))
f = jax.jit(jax.grad(lambda x, r, w: loss(x, r, w, mesh), argnums=(0, 1, 2)))
got = f(xs, rs, w)
hlo = f.lower(xs, rs, w).as_text()
assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_per_shard_matches_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


def test_kernel_calls_carry_the_handlers_attributes():
    """The custom calls pass exactly the attributes ffi/add_rms_norm.cc binds: eps (forward), none
    (backward). Lowering only: the CUDA target is not needed."""
    import importlib

    mod = importlib.import_module("surogate_jax.ops.add_rms_norm")  # the package exports a function of that name

    x, w, rstd = jnp.zeros((4, 8), jnp.bfloat16), jnp.ones((8,), jnp.bfloat16), jnp.ones((4,), jnp.float32)
    fwd = jax.jit(lambda x, r, w: mod._fwd_ffi(x, r, w, EPS)).lower(x, x, w).as_text()
    bwd = jax.jit(mod._bwd_ffi).lower(x, x, x, w, rstd).as_text()
    assert re.search(r"custom_call @surogate_add_rms_norm_fwd\(.*backend_config = \{eps = [^,}]* : f32\}", fwd)
    assert re.search(r"custom_call @surogate_add_rms_norm_bwd\(.*backend_config = \{\}", bwd)
