"""CPU tests of surogate_jax.ops.nf4_dequantize: the reference against surogate_jax.qlora.nf4.dequantize (which is
bitsandbytes-exact) and against an independent numpy computation (scale, float8 saturation), argument checks,
jit / vmap, gradients of functions that call it, the per-device mesh path."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, nf4_dequantize, nf4_dequantize_ref
from surogate_jax.qlora import nf4

BLOCK_SIZES = (64, 128, 256, 512)
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
TABLE = nf4.NF4_CODE


def _quantized(shape, block_size, double_quant, seed=0):
    """(codes, fp32 absmax, params) of a random weight quantized by nf4 (DQ: absmax decoded as nf4 does)."""
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.05
    params = nf4.quantize(w, block_size=block_size, double_quant=double_quant)
    absmax = nf4.double_quant_absmax(params) if double_quant else params["nf4_absmax"]
    return params["nf4_codes"], jnp.asarray(absmax, jnp.float32), params


def _numpy_dequant(codes, absmax, n, block_size, scale=None, table=TABLE):
    """fp32 values computed independently of jax: nibbles by hand, numpy's IEEE float32 multiplies."""
    c = np.asarray(codes)
    q = np.empty(2 * c.size, np.uint8)
    q[0::2], q[1::2] = c >> 4, c & 15
    v = table[q[:n]] * np.asarray(absmax, np.float32)[np.arange(n) // block_size]
    if scale is not None:
        v = v * np.float32(scale)
    return v.astype(np.float32)


def _numpy_cast(v, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float8_e4m3fn:
        return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return v.astype(dtype)  # numpy / ml_dtypes round to nearest even


@pytest.mark.parametrize("double_quant", [False, True], ids=["fp32_absmax", "dq"])
@pytest.mark.parametrize("shape", [(7, 49), (24, 100), (16, 512)], ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_matches_nf4_dequantize(block_size, shape, double_quant, assert_bits):
    """Odd n (343), n not a multiple of the block (2400), n a multiple of every block size (8192). Checked against
    nf4.dequantize and against numpy (nf4.dequantize may itself call this op, so numpy keeps the test honest)."""
    codes, absmax, params = _quantized(shape, block_size, double_quant, seed=block_size + shape[0])
    n = shape[0] * shape[1]
    exact = _numpy_dequant(codes, absmax, n, block_size).reshape(shape)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        name = jnp.dtype(dtype).name
        got = nf4_dequantize(codes, absmax, TABLE, shape=shape, block_size=block_size, out_dtype=dtype, impl="ref")
        assert_bits(got, _numpy_cast(exact, dtype), name + " vs numpy")
        want = nf4.dequantize(params, shape, block_size=block_size, double_quant=double_quant, dtype=dtype)
        assert_bits(got, want, name + " vs nf4.dequantize")
        got = nf4_dequantize_ref(codes, absmax, TABLE, shape=shape, block_size=block_size, out_dtype=dtype)
        assert_bits(got, want, "ref " + name)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_against_numpy_with_scale(block_size, out_dtype, assert_bits):
    """Random codes and absmax over a wide range (so e4m3 saturates and goes subnormal), times a scale."""
    rng = np.random.default_rng(block_size)
    shape = (5, 3 * block_size + 37)  # n odd, the last block short
    n = shape[0] * shape[1]
    codes = rng.integers(0, 256, size=(n + 1) // 2, dtype=np.uint8)
    absmax = (2.0 ** rng.uniform(-12, 12, size=-(-n // block_size))).astype(np.float32)
    scale = np.float32(1.7)
    got = nf4_dequantize(
        codes, absmax, TABLE, jnp.asarray(scale), shape=shape, block_size=block_size, out_dtype=out_dtype, impl="ref"
    )
    want = _numpy_cast(_numpy_dequant(codes, absmax, n, block_size, scale), out_dtype).reshape(shape)
    assert_bits(got, want, jnp.dtype(out_dtype).name)
    if jnp.dtype(out_dtype) == jnp.float8_e4m3fn:
        g = np.asarray(got, np.float32)
        assert np.isfinite(g).all() and np.abs(g).max() == 448.0  # saturated, never NaN


def test_scale_is_a_second_multiply(assert_bits):
    """code * absmax, rounded, then * scale: the fused or reassociated orders give other bits here."""
    rng = np.random.default_rng(1)
    shape, block_size = (64, 64), 64
    n = shape[0] * shape[1]
    codes = rng.integers(0, 256, size=n // 2, dtype=np.uint8)
    absmax = rng.uniform(0.01, 1.0, size=n // block_size).astype(np.float32)
    scale = np.float32(0.7071)
    want = _numpy_dequant(codes, absmax, n, block_size, scale)
    q = np.empty(n, np.uint8)
    q[0::2], q[1::2] = codes >> 4, codes & 15
    reassociated = TABLE[q] * (absmax[np.arange(n) // block_size] * scale)
    assert (reassociated != want).any()  # the test can tell the orders apart
    got = nf4_dequantize(
        codes, absmax, TABLE, scale, shape=shape, block_size=block_size, out_dtype=jnp.float32, impl="ref"
    )
    assert_bits(got, want.reshape(shape))
    got_py = nf4_dequantize(
        codes, absmax, TABLE, 0.7071, shape=shape, block_size=block_size, out_dtype=jnp.float32, impl="ref"
    )
    assert_bits(got_py, want.reshape(shape), "python float scale")


@pytest.mark.parametrize("via", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("out_dtype", [jnp.float8_e4m3fn, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_via_dtype_rounds_each_product_before_the_scale(via, out_dtype, assert_bits):
    """via_dtype: the weight as the model dtype holds it, then scaled (fp8-hybrid's cache of a bf16 weight)."""
    rng = np.random.default_rng(7)
    shape, block_size = (9, 130), 64
    n = shape[0] * shape[1]
    codes = rng.integers(0, 256, size=(n + 1) // 2, dtype=np.uint8)
    absmax = rng.uniform(0.001, 2.0, size=-(-n // block_size)).astype(np.float32)
    scale = np.float32(223.3)
    v = _numpy_dequant(codes, absmax, n, block_size).astype(jnp.dtype(via)).astype(np.float32) * scale
    want = _numpy_cast(v, out_dtype).reshape(shape)
    got = nf4_dequantize(
        codes, absmax, TABLE, scale, shape=shape, block_size=block_size, out_dtype=out_dtype, via_dtype=via, impl="ref"
    )
    assert_bits(got, want, "via")
    direct = nf4_dequantize(
        codes, absmax, TABLE, scale, shape=shape, block_size=block_size, out_dtype=out_dtype, impl="ref"
    )
    if jnp.dtype(out_dtype) == jnp.float32 or jnp.dtype(via) == jnp.bfloat16:  # f16 then e4m3 rarely differs
        assert (np.asarray(direct, np.float32) != np.asarray(want, np.float32)).any()  # the rounding shows
    same = nf4_dequantize(
        codes,
        absmax,
        TABLE,
        scale,
        shape=shape,
        block_size=block_size,
        out_dtype=out_dtype,
        via_dtype=jnp.float32,
        impl="ref",
    )
    assert_bits(same, np.asarray(direct), "via float32 is no rounding")
    with pytest.raises(TypeError, match="via_dtype"):
        nf4_dequantize(codes, absmax, TABLE, scale, shape=shape, block_size=block_size, via_dtype=jnp.int8)


def test_code_table_is_an_input(assert_bits):
    codes, absmax, _ = _quantized((8, 64), 64, False)
    table = np.linspace(-3, 3, 16).astype(np.float32)
    got = nf4_dequantize(codes, absmax, table, shape=(8, 64), block_size=64, out_dtype=jnp.float32, impl="ref")
    assert_bits(got, _numpy_dequant(codes, absmax, 512, 64, table=table).reshape(8, 64))
    assert not np.array_equal(got, _numpy_dequant(codes, absmax, 512, 64).reshape(8, 64))


def test_bad_arguments():
    codes, absmax, _ = _quantized((4, 64), 64, False)
    ok = dict(shape=(4, 64), block_size=64, impl="ref")
    with pytest.raises(ValueError, match="codes must have shape"):
        nf4_dequantize(codes[:-1], absmax, TABLE, **ok)
    with pytest.raises(ValueError, match="absmax must have shape"):
        nf4_dequantize(codes, absmax[:-1], TABLE, **ok)
    with pytest.raises(ValueError, match="absmax must have shape"):
        nf4_dequantize(codes, absmax, TABLE, shape=(4, 64), block_size=128, impl="ref")
    with pytest.raises(TypeError, match="codes must be uint8"):
        nf4_dequantize(codes.astype(jnp.int8), absmax, TABLE, **ok)
    with pytest.raises(TypeError, match="absmax must be float32"):
        nf4_dequantize(codes, absmax.astype(jnp.bfloat16), TABLE, **ok)
    with pytest.raises(ValueError, match="code_table must have shape"):
        nf4_dequantize(codes, absmax, TABLE[:15], **ok)
    with pytest.raises(TypeError, match="code_table must be float32"):
        nf4_dequantize(codes, absmax, TABLE.astype(np.float64), **ok)
    with pytest.raises(ValueError, match="block_size"):
        nf4_dequantize(codes, absmax, TABLE, shape=(4, 64), block_size=32, impl="ref")
    with pytest.raises(ValueError, match="shape"):
        nf4_dequantize(codes, absmax, TABLE, shape=(2, 2, 64), block_size=64, impl="ref")
    with pytest.raises(ValueError, match="negative"):
        nf4_dequantize(codes, absmax, TABLE, shape=(-4, -64), block_size=64, impl="ref")
    with pytest.raises(TypeError, match="out_dtype"):
        nf4_dequantize(codes, absmax, TABLE, out_dtype=jnp.int8, **ok)
    with pytest.raises(TypeError, match="out_dtype"):
        nf4_dequantize(codes, absmax, TABLE, out_dtype=jnp.float8_e5m2, **ok)
    with pytest.raises(TypeError, match="scale must be a float32"):
        nf4_dequantize(codes, absmax, TABLE, jnp.bfloat16(2.0), **ok)
    with pytest.raises(ValueError, match="scale must be a scalar"):
        nf4_dequantize(codes, absmax, TABLE, jnp.ones((1,), jnp.float32), **ok)
    with pytest.raises(ValueError, match="impl"):
        nf4_dequantize(codes, absmax, TABLE, shape=(4, 64), block_size=64, impl="cuda")


def test_empty_weight():
    out = nf4_dequantize(jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.float32), TABLE, shape=(0, 64), block_size=64)
    assert out.shape == (0, 64) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("impl", [None, "ref"])
def test_jit_and_vmap(impl, assert_bits):
    shape, block_size = (6, 130), 128  # n = 780: a short last block
    stacked = [_quantized(shape, block_size, False, seed=s)[:2] for s in range(3)]
    codes = jnp.stack([c for c, _ in stacked])
    absmax = jnp.stack([a for _, a in stacked])
    scales = jnp.asarray([0.5, 1.25, 3.0], jnp.float32)
    fn = lambda c, a, s: nf4_dequantize(c, a, TABLE, s, shape=shape, block_size=block_size, impl=impl)  # noqa: E731
    got = jax.jit(jax.vmap(fn))(codes, absmax, scales)
    assert got.shape == (3, *shape) and got.dtype == jnp.bfloat16
    for i in range(3):
        want = _numpy_cast(_numpy_dequant(codes[i], absmax[i], 780, block_size, scales[i]), jnp.bfloat16)
        assert_bits(got[i], want.reshape(shape), f"weight {i}")
        assert_bits(jax.jit(fn)(codes[i], absmax[i], scales[i]), want.reshape(shape), f"jit weight {i}")


@pytest.mark.parametrize("impl", [None, "ref"])
def test_gradient_through_it(impl):
    """d/dx of f(x, W) with W = nf4_dequantize(...): equals the gradient with the dense weight; asking for the
    gradient with respect to absmax or scale too works and gives zeros (a frozen weight)."""
    shape = (32, 64)
    codes, absmax, params = _quantized(shape, 64, False)
    w = nf4.dequantize(params, shape, block_size=64, double_quant=False, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(5), (3, 32), jnp.float32)

    def loss(x, absmax, scale):
        w = nf4_dequantize(codes, absmax, TABLE, scale, shape=shape, block_size=64, out_dtype=jnp.float32, impl=impl)
        return jnp.sum(jnp.tanh(x @ w))

    gx, ga, gs = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, absmax, jnp.float32(1.0))
    np.testing.assert_allclose(gx, jax.grad(lambda x: jnp.sum(jnp.tanh(x @ w)))(x), rtol=1e-6, atol=1e-6)
    assert not np.asarray(ga).any() and float(gs) == 0.0
    assert float(jnp.abs(gx).sum()) > 0


@pytest.mark.skipif(not ffi_available(),
                    reason="the CUDA extension is not built (installed without nvcc); the test only traces its call")
def test_ffi_path_traces_under_grad_and_vmap():
    """The kernel path has no differentiation rule of its own: stop_gradient must keep JVP tracers off it."""
    codes, absmax, _ = _quantized((8, 64), 64, False)
    x = jnp.ones((2, 8), jnp.float32)

    def loss(x, absmax):
        w = nf4_dequantize(codes, absmax, TABLE, 2.0, shape=(8, 64), block_size=64, impl="ffi")
        return jnp.sum(x @ w.astype(jnp.float32))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, absmax))
    assert "surogate_nf4_dequantize" in jaxpr
    jaxpr = str(jax.make_jaxpr(jax.vmap(lambda a: loss(x, a)))(jnp.stack([absmax, absmax])))
    assert "surogate_nf4_dequantize" in jaxpr


def test_env_forces_reference(force_ref):
    force_ref("ref:nf4_dequantize")
    codes, absmax, _ = _quantized((4, 64), 64, False)
    jaxpr = jax.make_jaxpr(lambda c, a: nf4_dequantize(c, a, TABLE, shape=(4, 64), block_size=64, impl="ffi"))(
        codes, absmax
    )
    assert "surogate_nf4_dequantize" not in str(jaxpr)


def test_checkpoint_name_tag():
    codes, absmax, _ = _quantized((4, 64), 64, False)
    jaxpr = str(
        jax.make_jaxpr(lambda c, a: nf4_dequantize(c, a, TABLE, shape=(4, 64), block_size=64, impl="ref"))(
            codes, absmax
        )
    )
    assert "name=nf4_dequantize" in jaxpr.replace(" ", ""), jaxpr


_SHARD_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import nf4_dequantize
from surogate_jax.qlora import nf4
assert len(jax.devices()) == 4
shape = (16, 192)
p = nf4.quantize(jax.random.normal(jax.random.key(0), shape), block_size=64, double_quant=False)
codes, absmax = p["nf4_codes"], p["nf4_absmax"]
x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)

def loss(x, mesh=None):
    w = nf4_dequantize(codes, absmax, nf4.NF4_CODE, 0.5, shape=shape, block_size=64, mesh=mesh)
    return jnp.sum(jnp.tanh(x @ w.astype(jnp.float32)))

want_w = nf4_dequantize(codes, absmax, nf4.NF4_CODE, 0.5, shape=shape, block_size=64)
want = jax.grad(loss)(x)
for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    f = jax.jit(jax.grad(lambda x: loss(x, mesh)))
    got = f(xs)
    hlo = f.lower(xs).as_text()
    assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    w = jax.jit(lambda c, a: nf4_dequantize(c, a, nf4.NF4_CODE, 0.5, shape=shape, block_size=64, mesh=mesh))(
        jax.device_put(codes, NamedSharding(mesh, P("data"))), absmax)
    assert np.array_equal(np.asarray(w).view(np.uint16), np.asarray(want_w).view(np.uint16))
print("ok")
"""


def test_mesh_runs_on_every_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
