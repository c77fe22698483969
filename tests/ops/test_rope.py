"""CPU tests of surogate_jax.ops.rope: the public custom_vjp op (impl="ref", both angle sources,
with and without the fused per-head RMSNorm) against `rope_ref` and against the model's former
direct formulation (HF cos/sin tables + rms_norm_ref + rotate-half), forward and gradients; odd
shapes, llama3-scaled frequencies, packed (restarting) positions, vmap, and sharding over a
4-device CPU mesh."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models.llamalike import DecoderConfig, RopeScaling, rope_inv_freq
from surogate_jax.ops import resolve_impl, rms_norm_ref, rope, rope_ref

EPS = 1e-6
DTYPES = [jnp.float32, jnp.bfloat16]
# (B, T, H, K): head dims 64 / 128 / 96 and odd ones, 3 heads, T = 37.
SHAPES = [(2, 37, 3, 64), (1, 37, 3, 128), (2, 5, 3, 96), (3, 4, 5, 6)]


def _inv_freq(K, theta=10000.0, scaling=None):
    cfg = DecoderConfig(
        model_type="llama", vocab_size=8, hidden_size=K, intermediate_size=8, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=K, rope_theta=theta, rope_scaling=scaling,
    )
    return jnp.asarray(rope_inv_freq(cfg), jnp.float32)


def _packed_positions(rng, B, T):
    """Per-row positions that restart at random document boundaries."""
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        starts = np.sort(rng.choice(np.arange(1, T), size=min(2, T - 1), replace=False)) if T > 2 else []
        p = np.arange(T)
        for s in starts:
            p[s:] = np.arange(T - s)
        pos[b] = p + (b * 7 if b else 0)  # one row not starting at 0
    return jnp.asarray(pos)


def _inputs(seed, shape, dtype):
    kx, kw, kp = jax.random.split(jax.random.key(seed), 3)
    x = (2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    proj = jax.random.normal(kp, shape, jnp.float32)
    pos = _packed_positions(np.random.default_rng(seed), *shape[:2])
    return x, w, proj, pos


def _tables(positions, inv_freq):
    """The model's former rope_cos_sin: [..., K] float32 tables, each frequency repeated."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def _direct(x, positions, inv_freq, w=None, eps=EPS):
    """The model's former code path: rms_norm_ref (rounded to x.dtype), then HF apply_rope."""
    cos, sin = _tables(positions, inv_freq)
    if w is not None:
        x = rms_norm_ref(x, w, eps)
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


def _value_and_grads(fn, x, w, proj):
    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32) * proj)

    return fn(x, w), jax.grad(loss, argnums=(0, 1))(x, w)


def _variants(pos, inv):
    """Public-op closures (x, w) -> y for every angle source x norm combination."""
    tab = _tables(pos, inv)
    return {
        "positions": lambda x, w: rope(x, pos, inv, impl="ref"),
        "table": lambda x, w: rope(x, table=tab, impl="ref"),
        "positions+norm": lambda x, w: rope(x, pos, inv, norm_w=w, eps=EPS, impl="ref"),
        "table+norm": lambda x, w: rope(x, table=tab, norm_w=w, eps=EPS, impl="ref"),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_public_op_matches_reference_and_direct_formula(shape, dtype, assert_close):
    x, w, proj, pos = _inputs(sum(shape), shape, dtype)
    inv = _inv_freq(shape[-1])

    @jax.jit  # one compiled program per case: much faster on CPU than op-by-op dispatch
    def run(x, w, pos):
        out = {}
        for name, fn in _variants(pos, inv).items():
            norm_w = (lambda w: w) if name.endswith("norm") else (lambda w: None)
            ref = lambda x, w: rope_ref(x, pos, inv, norm_w=norm_w(w), eps=EPS)  # noqa: B023
            direct = lambda x, w: _direct(x, pos, inv, norm_w(w))  # noqa: B023
            out[name] = [_value_and_grads(f, x, w, proj) for f in (fn, ref, direct)]
        return out

    for name, ((y, (dx, dw)), (y_ref, (dx_ref, dw_ref)), (y_dir, (dx_dir, dw_dir))) in run(x, w, pos).items():
        assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype, name
        for what, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("y/direct", y, y_dir), ("dx/direct", dx, dx_dir)):
            assert_close(got, want, dtype, f"{name} {what}")
        if name.endswith("norm"):
            assert_close(dw, dw_ref, dtype, f"{name} dw")
            assert_close(dw, dw_dir, dtype, f"{name} dw/direct")
        else:
            assert not np.any(np.asarray(dw, np.float32)), "w is unused without norm_w"


def test_llama3_scaled_frequencies_and_large_positions(assert_close):
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    inv = _inv_freq(128, theta=500000.0, scaling=scaling)
    assert not np.allclose(np.asarray(inv), np.asarray(_inv_freq(128, theta=500000.0)))  # scaling bites
    x, w, proj, _ = _inputs(5, (2, 9, 4, 128), jnp.float32)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 32768, size=(2, 9)), jnp.int32)
    for name, fn in _variants(pos, inv).items():
        norm = name.endswith("norm")
        y, (dx, dw) = _value_and_grads(fn, x, w, proj)
        direct = lambda x, w: _direct(x, pos, inv, w if norm else None)  # noqa: B023, E731
        y_dir, (dx_dir, dw_dir) = _value_and_grads(direct, x, w, proj)
        assert_close(y, y_dir, jnp.float32, name)
        assert_close(dx, dx_dir, jnp.float32, name)
        if norm:
            assert_close(dw, dw_dir, jnp.float32, name)


def test_against_float64_numpy(assert_close):
    """rope_ref and the kernel-form backward against float64 math on the same fp32 angles."""
    rng = np.random.default_rng(3)
    B, T, H, K = 2, 6, 3, 10
    F = K // 2
    x = rng.standard_normal((B, T, H, K))
    w = 1.0 + 0.5 * rng.standard_normal(K)
    dy = rng.standard_normal((B, T, H, K))
    pos = rng.integers(0, 5000, size=(B, T)).astype(np.int32)
    inv = np.asarray(_inv_freq(K), np.float32)
    ang = (pos.astype(np.float32)[..., None] * inv).astype(np.float64)[..., None, :]
    c, s = np.cos(ang), np.sin(ang)

    def rot(v, s):
        return np.concatenate([v[..., :F] * c - v[..., F:] * s, v[..., F:] * c + v[..., :F] * s], axis=-1)

    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    xhat = x * rstd
    y = rot(xhat * w, s)
    g = rot(dy, -s)
    gw = g * w
    dx = rstd * (gw - xhat * np.mean(gw * xhat, axis=-1, keepdims=True))
    dw = np.sum((g * xhat).reshape(-1, K), axis=0)

    f32 = lambda a: jnp.asarray(a, jnp.float32)
    fn = lambda x, w: rope(x, jnp.asarray(pos), jnp.asarray(inv), norm_w=w, eps=EPS, impl="ref")
    y_op, vjp = jax.vjp(fn, f32(x), f32(w))
    dx_op, dw_op = vjp(f32(dy))
    assert_close(y_op, y, jnp.float32, "y")
    assert_close(dx_op, dx, jnp.float32, "dx")
    assert_close(dw_op, dw, jnp.float32, "dw")
    # rotation only: dx = R(-a) dy
    _, vjp = jax.vjp(lambda x: rope(x, jnp.asarray(pos), jnp.asarray(inv), impl="ref"), f32(x))
    assert_close(vjp(f32(dy))[0], rot(dy, -s), jnp.float32, "dx rotation only")


def test_inverse_rotation_undoes_forward(assert_close):
    from surogate_jax.ops.rope import _fwd_ref

    x, w, _, pos = _inputs(11, (2, 13, 3, 64), jnp.float32)
    inv = _inv_freq(64)
    y = _fwd_ref(x, pos, inv, w, eps=EPS, norm=False, inverse=False)
    back = _fwd_ref(y, pos, inv, w, eps=EPS, norm=False, inverse=True)
    assert_close(back, x, jnp.float32)


def test_leading_dims_and_jit(assert_close):
    # [T, H, K] with positions [T] (no batch axis), and a jitted default-impl call.
    x, w, proj, pos = _inputs(2, (1, 21, 2, 32), jnp.float32)
    x, proj, pos = x[0], proj[0], pos[0]
    inv = _inv_freq(32)
    fn = jax.jit(lambda x, w: rope(x, pos, inv, norm_w=w, eps=EPS))  # impl=None: auto or ref on CPU
    y, (dx, dw) = jax.jit(lambda x, w: _value_and_grads(fn, x, w, proj))(x, w)
    y_ref, (dx_ref, dw_ref) = _value_and_grads(lambda x, w: rope_ref(x, pos, inv, norm_w=w, eps=EPS), x, w, proj)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert_close(got, want, jnp.float32)


def test_vmap_matches_reference(assert_close):
    x, w, proj, pos = _inputs(4, (3, 9, 2, 16), jnp.float32)
    ws = w * jnp.arange(1, 4, dtype=jnp.float32)[:, None]  # per-example weights
    inv = _inv_freq(16)

    def per_example(fn):
        def loss(x, w, p, pos):
            return jnp.sum(fn(x[None], w, pos[None])[0] * p)

        return jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)))(x, ws, proj, pos)

    got = per_example(lambda x, w, pos: rope(x, pos, inv, norm_w=w, eps=EPS, impl="ref"))
    want = per_example(lambda x, w, pos: rope_ref(x, pos, inv, norm_w=w, eps=EPS))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, r, jnp.float32)


def test_weight_dtype_differs_from_x(assert_close):
    # fp32 weights with bf16 activations: the op casts w to bf16; dw comes back in fp32.
    x, w, proj, pos = _inputs(3, (2, 8, 2, 64), jnp.bfloat16)
    inv = _inv_freq(64)
    w32 = w.astype(jnp.float32) + 1e-3
    _, (_, dw) = _value_and_grads(lambda x, w: rope(x, pos, inv, norm_w=w, impl="ref"), x, w32, proj)
    _, (_, dw_ref) = _value_and_grads(
        lambda x, w: rope_ref(x, pos, inv, norm_w=w.astype(jnp.bfloat16)), x, w32, proj
    )
    assert dw.dtype == jnp.float32
    assert_close(dw, dw_ref, jnp.bfloat16)


def test_env_forces_reference(force_ref):
    force_ref("ref")
    assert resolve_impl("ffi") == "ref"
    x, pos, inv = jnp.ones((1, 2, 1, 8)), jnp.zeros((1, 2), jnp.int32), jnp.ones(4)
    jaxpr = jax.make_jaxpr(lambda x: rope(x, pos, inv, norm_w=jnp.ones(8), impl="ffi"))(x)
    assert "surogate_rope" not in str(jaxpr)


def test_checkpoint_name_tag():
    x, pos, inv = jnp.ones((1, 2, 1, 8)), jnp.zeros((1, 2), jnp.int32), jnp.ones(4)
    jaxpr = str(jax.make_jaxpr(lambda x: rope(x, pos, inv, impl="ref"))(x))
    assert "rope" in jaxpr and "name" in jaxpr


def test_bad_arguments():
    x, pos, inv = jnp.ones((1, 2, 1, 8)), jnp.zeros((1, 2), jnp.int32), jnp.ones(4)
    with pytest.raises(ValueError, match="even head_dim"):
        rope(jnp.ones((1, 2, 1, 7)), pos, jnp.ones(3))
    with pytest.raises(ValueError, match="positions"):
        rope(x, pos[:, :1], inv)
    with pytest.raises(ValueError, match="positions"):
        rope(x, pos.astype(jnp.float32), inv)
    with pytest.raises(ValueError, match="inv_freq"):
        rope(x, pos, jnp.ones(8))
    with pytest.raises(ValueError, match="table"):
        rope(x, table=(jnp.ones((1, 2, 3)), jnp.ones((1, 2, 3))))
    with pytest.raises(ValueError, match="either"):
        rope(x, pos, inv, table=(jnp.ones((1, 2, 8)), jnp.ones((1, 2, 8))))
    with pytest.raises(ValueError, match="norm_w"):
        rope(x, pos, inv, norm_w=jnp.ones(4))
    with pytest.raises(TypeError, match="floating"):
        rope(jnp.ones((1, 2, 1, 8), jnp.int32), pos, inv)


SHARD_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import rope
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(8, 5, 3, 16)), jnp.float32)
w = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
dy = jnp.asarray(rng.normal(size=(8, 5, 3, 16)), jnp.float32)
pos = jnp.asarray(rng.integers(0, 100, size=(8, 5)), jnp.int32)
inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, 16, 2) / 16), jnp.float32)
ang = pos.astype(jnp.float32)[..., None] * inv
tab = (jnp.cos(ang), jnp.sin(ang))

def losses(x, w, pos, tab, mesh):
    return (jnp.sum(rope(x, pos, inv, norm_w=w, mesh=mesh) * dy),
            jnp.sum(rope(x, table=tab, norm_w=w, mesh=mesh) * dy), jnp.sum(rope(x, pos, inv, mesh=mesh) * dy))

def grads(x, w, pos, tab, mesh=None):
    return [jax.grad(lambda x, w: losses(x, w, pos, tab, mesh)[i], argnums=(0, 1))(x, w) for i in range(3)]

want = grads(x, w, pos, tab)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
sh = NamedSharding(mesh, P("data"))
xs, ps, ts = jax.device_put(x, sh), jax.device_put(pos, sh), jax.device_put(tab, sh)
f = jax.jit(lambda *a: grads(*a, mesh=mesh))
got = f(xs, w, ps, ts)
hlo = f.lower(xs, w, ps, ts).as_text()
assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
print("ok")
'''


def run_on_4_cpu_devices(script: str) -> None:
    """Runs `script` in a fresh process with 4 host CPU devices; it must print "ok"."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


def test_per_shard_matches_unsharded():
    run_on_4_cpu_devices(SHARD_SCRIPT)


def test_ffi_wrappers_carry_attributes_and_workspace():
    """Lowering only (the CUDA target is not needed): the calls name their targets and carry eps, norm
    and inverse; the norm backward's workspace has one row per token up to WS_BLOCKS."""
    import importlib

    mod = importlib.import_module("surogate_jax.ops.rope")  # the package exports a function of that name
    x = jnp.zeros((2, 3, 4, 8), jnp.bfloat16)
    pos, inv, w = jnp.zeros((2, 3), jnp.int32), jnp.ones((4,), jnp.float32), jnp.ones((8,), jnp.bfloat16)
    fwd = lambda x, a, b, w: mod._fwd_ffi(x, a, b, w, eps=EPS, norm=True, inverse=True)  # noqa: E731
    text = jax.jit(fwd).lower(x, pos, inv, w).as_text()
    assert mod.FWD_TARGET in text and "inverse = 1 : i32" in text and "norm = 1 : i32" in text
    assert "algo" not in text
    bwd = lambda dy, x, a, b, w: mod._bwd_ffi(dy, x, a, b, w, eps=EPS)  # noqa: E731
    text = jax.jit(bwd).lower(x, x, pos, inv, w).as_text()
    assert mod.BWD_TARGET in text and "tensor<6x8xf32>" in text  # ws: 6 tokens' rows of K floats
