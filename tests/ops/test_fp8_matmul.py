"""CPU tests of surogate_jax.ops.fp8_matmul: the reference path (forward, dx, dw, the amaxes the
state gradient carries) against a float64 numpy formulation of the formulas, delayed scaling
through several training steps, the "xla" dequantize-dot path, the FP8 error against an
unquantized GEMM, errors, the env override, jit/vmap/remat, and per-shard runs on 4 CPU devices."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, fp8_formats
from surogate_jax.ops.fp8_matmul import (
    fp8_matmul,
    fp8_matmul_grads_ref,
    fp8_matmul_ref,
    resolve_fp8_impl,
)
from surogate_jax.precision import fp8


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    # These tests also run in the GPU session, where fp32 dots would default to TF32.
    with jax.default_matmul_precision("highest"):
        yield


def _state(sx, sw, sg, h=4):
    mk = lambda s: fp8_formats.Fp8TensorState(jnp.float32(s), jnp.zeros(h, jnp.float32))
    return fp8_formats.Fp8MatmulState(mk(sx), mk(sw), mk(sg))


def _np_q(x, scale, np_dtype, fmax):
    xs = np.asarray(jnp.asarray(x, jnp.float32), np.float32) * np.float32(scale)
    return np.clip(xs, -fmax, fmax).astype(np_dtype).astype(np.float64)


def _np_formulas(x, w, dy, sx, sw, sg):
    """float64 numpy: y, dx, dw from the quantized operands (the docstring's formulas)."""
    k, n = w.shape
    xq = _np_q(x, sx, ml_dtypes.float8_e4m3fn, 448.0).reshape(-1, k)
    wq = _np_q(w, sw, ml_dtypes.float8_e4m3fn, 448.0)
    gq = _np_q(dy, sg, ml_dtypes.float8_e5m2, 57344.0).reshape(-1, n)
    ix, iw, ig = (1.0 / np.float64(np.float32(s)) for s in (sx, sw, sg))
    y = (xq @ wq) * ix * iw
    dx = (gq @ wq.T) * ig * iw
    dw = (xq.T @ gq) * ix * ig
    return y.reshape(*x.shape[:-1], n), dx.reshape(x.shape), dw


def _inputs(key, lead, k, n, dtype, xs=1.0, ws=0.05, gs=1e-3):
    kx, kw, kg = jax.random.split(key, 3)
    x = (xs * jax.random.normal(kx, (*lead, k), jnp.float32)).astype(dtype)
    w = (ws * jax.random.normal(kw, (k, n), jnp.float32)).astype(dtype)
    dy = (gs * jax.random.normal(kg, (*lead, n), jnp.float32)).astype(dtype)
    return x, w, dy


def _run(impl, x, w, dy, state, **kw):
    def go(x, w, state, dy):  # jitted: one compilation instead of one per eager primitive
        y, vjp = jax.vjp(lambda x, w, s: fp8_matmul(x, w, s, impl=impl, **kw), x, w, state)
        return (y, *vjp(dy.astype(y.dtype)))

    return jax.jit(go)(x, w, state, dy)


SHAPES = [((7,), 32, 48), ((3, 5), 64, 16), ((1,), 16, 32), ((2, 3, 4), 48, 80)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lead,k,n", SHAPES, ids=str)
def test_reference_path_matches_numpy_formulas(lead, k, n, dtype, assert_close):
    x, w, dy = _inputs(jax.random.key(k * n), lead, k, n, dtype)
    sx, sw, sg = 61.0, 3000.0, 2.0e5  # chosen so some x saturate and dy uses E5M2's range
    y, dx, dw, ds = _run("ref", x, w, dy, _state(sx, sw, sg))
    y_np, dx_np, dw_np = _np_formulas(x, w, dy, sx, sw, sg)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert_close(y, y_np, dtype, "y")
    assert_close(dx, dx_np, dtype, "dx")
    assert_close(dw, dw_np, dtype, "dw")
    # the state's gradient carries the amaxes (histories get zeros)
    for got, want in ((ds.x.scale, x), (ds.w.scale, w), (ds.g.scale, dy)):
        assert float(got) == float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    assert all(float(jnp.max(jnp.abs(t.amax_history))) == 0.0 for t in (ds.x, ds.w, ds.g))
    # the stand-alone formula helpers agree
    assert_close(jax.jit(fp8_matmul_ref)(x, w, _state(sx, sw, sg)), y_np, dtype)
    dxr, dwr, am = jax.jit(fp8_matmul_grads_ref)(x, w, dy, _state(sx, sw, sg))
    assert_close(dxr, dx_np, dtype)
    assert_close(dwr, dw_np, dtype)
    assert float(am["g"]) == float(ds.g.scale)


def test_out_dtype_and_mixed_input_dtypes(assert_close):
    x, w, dy = _inputs(jax.random.key(1), (9,), 32, 16, jnp.bfloat16)
    w32 = w.astype(jnp.float32)
    y, dx, dw, _ = _run("ref", x, w32, dy.astype(jnp.float32), _state(50.0, 4000.0, 1e5), out_dtype=jnp.float32)
    assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    y_np, _, dw_np = _np_formulas(x, w32, dy.astype(jnp.float32), 50.0, 4000.0, 1e5)
    assert_close(y, y_np, jnp.float32)
    assert_close(dw, dw_np, jnp.float32)


@pytest.mark.cpu  # scales compared exactly: XLA:GPU's f32 division may differ by an ulp
def test_delayed_scaling_through_training_steps():
    """Each step quantizes with the previous step's scale; scales follow the formula exactly."""
    h, steps = 3, 6
    state = fp8_formats.init_matmul_state(h)
    np_s = {"x": np.float32(1.0), "w": np.float32(1.0), "g": np.float32(1.0)}
    np_h = {t: np.zeros(h, np.float32) for t in "xwg"}
    fmax = {"x": 448.0, "w": 448.0, "g": 57344.0}

    @jax.jit
    def step(x, w, dy, state):
        def loss(x, w, state):
            return jnp.sum(fp8_matmul(x, w, state, impl="ref").astype(jnp.float32) * dy)

        (gx, gw, gs) = jax.grad(loss, argnums=(0, 1, 2))(x, w, state)
        return fp8_matmul(x, w, state, impl="ref"), gx, gw, fp8.update(state, gs)

    for t in range(steps):
        mag = 2.0 ** (3 * t - 6)  # amaxes change by 8x per step
        x, w, dy = _inputs(jax.random.key(100 + t), (13,), 32, 16, jnp.float32, xs=mag, ws=0.1 * mag, gs=1e-4 * mag)
        y, gx, _, new_state = step(x, w, dy, state)
        y_np, dx_np, _ = _np_formulas(x, w, dy, np_s["x"], np_s["w"], np_s["g"])  # previous scales
        np.testing.assert_allclose(np.asarray(y), y_np, rtol=1e-5, atol=1e-6 * np.abs(y_np).max())
        np.testing.assert_allclose(np.asarray(gx), dx_np, rtol=1e-5, atol=1e-6 * np.abs(dx_np).max())
        for name, arr in (("x", x), ("w", w), ("g", dy)):
            a = np.float32(np.max(np.abs(np.asarray(arr, np.float32))))
            np_h[name] = np.roll(np_h[name], 1)
            np_h[name][0] = a
            np_s[name] = np.float32(np.float32(fmax[name]) / np.max(np_h[name]))
            got = getattr(new_state, name)
            np.testing.assert_array_equal(np.asarray(got.amax_history), np_h[name])
            assert float(got.scale) == float(np_s[name]), (t, name)
        state = new_state


def test_fp8_error_against_unquantized_gemm():
    """Relative Frobenius error vs the f32 GEMM of the unquantized inputs stays within the bound
    that the formats imply: per-operand RMS relative rounding error <= 2^-(m+1)/sqrt(3) (m mantissa
    bits: E4M3 3, E5M2 2), combined in quadrature, times 1.5 for margin."""
    e4, e5 = 2.0 ** -4 / np.sqrt(3), 2.0 ** -3 / np.sqrt(3)
    fwd_bound, bwd_bound = 1.5 * np.hypot(e4, e4), 1.5 * np.hypot(e4, e5)
    x, w, dy = _inputs(jax.random.key(7), (64,), 256, 64, jnp.float32)
    sx = 448.0 / float(jnp.max(jnp.abs(x)))
    sw = 448.0 / float(jnp.max(jnp.abs(w)))
    sg = 57344.0 / float(jnp.max(jnp.abs(dy)))
    y, dx, dw, _ = _run("ref", x, w, dy, _state(sx, sw, sg))
    hi = jax.lax.Precision.HIGHEST
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel(y, jnp.dot(x, w, precision=hi)) < fwd_bound
    assert rel(dx, jnp.dot(dy, w.T, precision=hi)) < bwd_bound
    assert rel(dw, jnp.dot(x.T, dy, precision=hi)) < bwd_bound


@pytest.mark.parametrize("lead,k,n", [((11,), 32, 48), ((2, 3), 24, 40)], ids=str)
def test_xla_path_matches_reference(lead, k, n, assert_close):
    # On CPU XLA does not rewrite the pattern; the math equals the reference up to the bf16
    # rounding of each dequantized operand (rel. <= 2^-9) and of the dequant scale: bf16 tolerance.
    x, w, dy = _inputs(jax.random.key(3), lead, k, n, jnp.bfloat16)
    st = _state(61.0, 3000.0, 2.0e5)
    got = _run("xla", x, w, dy, st)
    want = _run("ref", x, w, dy, st)
    for name, g, r in zip(("y", "dx", "dw"), got[:3], want[:3], strict=True):
        assert g.dtype == r.dtype
        assert_close(g, r, jnp.bfloat16, name)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got[3], want[3])


def test_jit_vmap_remat(assert_close):
    x, w, dy = _inputs(jax.random.key(4), (3, 6), 32, 16, jnp.float32)
    st = _state(61.0, 3000.0, 2.0e5)
    f = lambda x: fp8_matmul(x, w, st, impl="ref")
    assert_close(jax.jit(f)(x), f(x), jnp.float32)
    assert_close(jax.jit(jax.vmap(f))(x), f(x), jnp.float32)  # rows are independent
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(f)(x) * dy)))(x)
    g_ref = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * dy)))(x)
    assert_close(g, g_ref, jnp.float32)


def test_zero_rows():
    w = jnp.ones((32, 16), jnp.bfloat16)
    y, dx, dw, ds = _run(None, jnp.zeros((0, 32), jnp.bfloat16), w, jnp.zeros((0, 16), jnp.bfloat16),
                         _state(1.0, 1.0, 1.0))
    assert y.shape == (0, 16) and dx.shape == (0, 32) and float(jnp.max(jnp.abs(dw))) == 0.0
    assert float(ds.x.scale) == 0.0 and float(ds.w.scale) == 1.0


def test_errors_and_impl_resolution(force_ref):
    st = _state(1.0, 1.0, 1.0)
    x = jnp.ones((4, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="w \\[K, N\\]"):
        fp8_matmul(x, jnp.ones((16, 8)), st)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fp8_matmul(x.astype(jnp.int32), jnp.ones((32, 16)), st)
    with pytest.raises(ValueError, match="impl must be"):
        fp8_matmul(x, jnp.ones((32, 16)), st, impl="cuda")
    with pytest.raises(ValueError, match="scalar"):
        fp8_matmul(x, jnp.ones((32, 16)), fp8_formats.init_matmul_state(4, shape=(2,)))
    if jax.default_backend() != "gpu":
        assert resolve_fp8_impl(None, 32, 16) == "ref"
    if ffi_available():
        with pytest.raises(ValueError, match="multiples of 16"):
            resolve_fp8_impl("ffi", 24, 40)
    else:
        with pytest.raises(RuntimeError, match="unavailable"):
            resolve_fp8_impl("ffi", 32, 16)
    assert resolve_fp8_impl("xla", 24, 40) == "xla"
    force_ref("ref")
    assert resolve_fp8_impl("xla", 32, 16) == "ref" and resolve_fp8_impl("ffi", 32, 16) == "ref"
    jaxpr = str(jax.make_jaxpr(lambda x: fp8_matmul(x, jnp.ones((32, 16)), st, impl="xla"))(x))
    assert "surogate_fp8" not in jaxpr and "HIGHEST" in jaxpr  # the reference's fp32 dot
    force_ref("ref:rope,fp8_matmul")  # the per-op form every op honours
    assert resolve_fp8_impl("xla", 32, 16) == "ref"
    force_ref("ref:rope")  # another op's reference: fp8_matmul unchanged
    assert resolve_fp8_impl("xla", 32, 16) == "xla"
    with pytest.raises(ValueError, match="not understood"):
        force_ref("reff")
    assert resolve_fp8_impl("xla", 32, 16) == "xla"  # the malformed value changed nothing


SHARD_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import ffi_available
from surogate_jax.ops.fp8_matmul import fp8_matmul
from surogate_jax.ops import fp8_formats
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(8, 5, 32)), jnp.float32)
x = x.at[6, 2, 3].set(9.5)  # the amax lives on the last shard
w = jnp.asarray(0.05 * rng.normal(size=(32, 16)), jnp.float32)
dy = jnp.asarray(1e-3 * rng.normal(size=(8, 5, 16)), jnp.float32)
dy = dy.at[1, 0, 0].set(0.25)  # the dy amax on the first
st = fp8_formats.Fp8MatmulState(
    *(fp8_formats.Fp8TensorState(jnp.float32(s), jnp.zeros(4)) for s in (40.0, 5000.0, 1e5)))

def loss(x, w, st, mesh=None):
    return jnp.sum(fp8_matmul(x, w, st, impl="ref", mesh=mesh) * dy)

want = jax.grad(loss, argnums=(0, 1, 2))(x, w, st)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
xs = jax.device_put(x, NamedSharding(mesh, P("data")))
f = jax.jit(jax.grad(lambda x, w, st: loss(x, w, st, mesh), argnums=(0, 1, 2)))
got = f(xs, w, st)
hlo = f.lower(xs, w, st).as_text()
assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-7)
np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
assert float(got[2].x.scale) == 9.5 and float(got[2].g.scale) == 0.25, got[2]
jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got[2], want[2])
print("ok")
'''


def test_per_shard_matches_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SHARD_SCRIPT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


def _emulated_quantize_ffi(x2, scale, dtype, transposed):
    """jnp stand-in for the CUDA quantizers with their exact output layout (qt zero-padded)."""
    q = fp8_formats.quantize(x2, scale, dtype)
    if not transposed:
        return q, None, fp8_formats.amax(x2)
    pad = -x2.shape[0] % 16
    return q, jnp.pad(q.T, ((0, 0), (0, pad))), fp8_formats.amax(x2)


def _emulated_gemm_ffi(a, b, a_inv, b_inv, out_dtype, fast_accum):
    """jnp stand-in for the cuBLASLt handler: d [M, N] = (a [.., M, K] a_inv) (b [.., N, K] b_inv)^T."""
    del fast_accum
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    acc = jnp.dot(a2.astype(jnp.float32), b2.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return (acc * (a_inv * b_inv)).astype(out_dtype)


@pytest.mark.parametrize("lead,k,n", [((13,), 32, 48), ((2, 17), 64, 16)], ids=str)
def test_ffi_path_wiring_with_emulated_kernels(lead, k, n, monkeypatch, assert_close):
    """The "ffi" backend's Python wiring (operand layouts, transposes, padding of odd row counts,
    residuals, amaxes) with the two CUDA calls replaced by jnp emulations of their contracts."""
    mod = importlib.import_module("surogate_jax.ops.fp8_matmul")  # the package attribute is the function

    monkeypatch.setattr(mod, "_quantize_ffi", _emulated_quantize_ffi)
    monkeypatch.setattr(mod, "_gemm_ffi", _emulated_gemm_ffi)
    x, w, dy = _inputs(jax.random.key(5), lead, k, n, jnp.bfloat16)
    st = _state(61.0, 3000.0, 2.0e5)
    scales = jnp.stack([st.x.scale, st.w.scale, st.g.scale])
    x2 = x.reshape(-1, k)

    def run(impl):
        cfg = mod._Cfg(impl, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16))

        @jax.jit
        def go(x2, w, scales, dy):
            y, vjp = jax.vjp(lambda x2, w, s: mod._fp8_mm(x2, w, s, cfg), x2, w, scales)
            return (y, *vjp(dy.reshape(-1, n)))

        return go(x2, w, scales, dy)

    got, want = run("ffi"), run("ref")
    for name, g, r in zip(("y", "dx", "dw"), got[:3], want[:3], strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert_close(g, r, jnp.bfloat16, name)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))  # amaxes
