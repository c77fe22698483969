"""GPU tests of the fused residual add + RMSNorm kernels (impl="ffi") against the reference:
forward (y and the new residual), all three gradients, f32/bf16/f16, odd and large shapes (warp-
slice, block and long-row loop paths, vector and scalar), fresh random inputs per test, outputs
poisoned so unwritten elements show, jit and vmap."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import add_rms_norm, add_rms_norm_ref, ffi_available

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [
    (1, 7), (1, 128), (13, 128), (127, 1000), (31, 1001), (2, 3, 1001), (3, 5, 4096),
    (4099, 1024), (16385, 128), (257, 5120), (33, 8192), (5, 16384), (3, 65536 + 8), (7, 3001),
]
EPS = 1e-6
_seed = itertools.count(3000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inputs(shape, dtype):
    kx, kr, kw, kp, kq = jax.random.split(jax.random.key(next(_seed)), 5)  # fresh per call
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    res = (2.0 * jax.random.normal(kr, shape, jnp.float32)).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    py = jax.random.normal(kp, shape, jnp.float32)
    ps = jax.random.normal(kq, shape, jnp.float32)
    return x, res, w, py, ps


def _run(fn, x, res, w, py, ps):
    def loss(x, res, w):
        y, s = fn(x, res, w)
        return jnp.sum(y.astype(jnp.float32) * py) + jnp.sum(s.astype(jnp.float32) * ps)

    @jax.jit
    def go(x, res, w):
        return fn(x, res, w), jax.grad(loss, argnums=(0, 1, 2))(x, res, w)

    return go(x, res, w)


def _poison_allocator(nbytes=64 << 20):
    """Allocate and free a NaN-filled buffer so the next outputs likely land on NaN memory."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _check(got_all, want_all, dtype, assert_close):
    (y, s), (dx, dr, dw) = got_all
    (y_ref, s_ref), (dx_ref, dr_ref, dw_ref) = want_all
    for name, got, want in (("y", y, y_ref), ("s", s, s_ref), ("dx", dx, dx_ref),
                            ("dresidual", dr, dr_ref), ("dw", dw, dw_ref)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert bool(jnp.all(jnp.isfinite(got))), f"{name} has non-finite values (unwritten?)"
        assert_close(got, want, dtype, name)
    # The new residual is one rounded add: bit-identical to the reference's.
    np.testing.assert_array_equal(np.asarray(s.astype(jnp.float32)), np.asarray(s_ref.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ffi_matches_reference(shape, dtype, assert_close):
    x, res, w, py, ps = _inputs(shape, dtype)
    want = _run(lambda *a: add_rms_norm_ref(*a, EPS), x, res, w, py, ps)
    _poison_allocator()
    got = _run(lambda *a: add_rms_norm(*a, EPS, impl="ffi"), x, res, w, py, ps)
    _check(got, want, dtype, assert_close)


def test_ffi_is_in_the_compiled_program():
    x, res, w, _, _ = _inputs((8, 128), jnp.bfloat16)
    hlo = jax.jit(lambda *a: add_rms_norm(*a)).lower(x, res, w).as_text()
    assert "surogate_add_rms_norm_fwd" in hlo  # impl=None on GPU picks the kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_vmap_shared_and_per_example_weights(dtype, assert_close):
    x, res, w, py, ps = _inputs((3, 33, 1000), dtype)
    ws = (w[None, :] * jnp.asarray([[1.0], [0.5], [-2.0]])).astype(dtype)

    def run(fn, w_axis, weights):
        def loss(x, r, w, py, ps):
            y, s = fn(x, r, w)
            return jnp.sum(y.astype(jnp.float32) * py) + jnp.sum(s.astype(jnp.float32) * ps)

        vg = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, w_axis, 0, 0))
        return jax.jit(vg)(x, res, weights, py, ps)

    ffi = lambda x, r, w: add_rms_norm(x, r, w, EPS, impl="ffi")  # noqa: E731
    ref = lambda x, r, w: add_rms_norm_ref(x, r, w, EPS)  # noqa: E731
    for w_axis, weights in ((None, w), (0, ws)):
        v, grads = run(ffi, w_axis, weights)
        v_ref, grads_ref = run(ref, w_axis, weights)
        assert grads[2].shape == (3, 1000)  # one weight gradient per example
        assert_close(v, v_ref, dtype)
        for a, b in zip(grads, grads_ref, strict=True):
            assert_close(a, b, dtype)


def test_zero_rows():
    x = jnp.zeros((0, 128), jnp.bfloat16)
    w = jnp.ones((128,), jnp.bfloat16)
    (y, s), dw = jax.jit(
        lambda x, w: (add_rms_norm(x, x, w, impl="ffi"),
                      jax.grad(lambda w: add_rms_norm(x, x, w, impl="ffi")[0].astype(jnp.float32).sum())(w))
    )(x, w)
    assert y.shape == (0, 128) and s.shape == (0, 128) and np.all(np.asarray(dw, np.float32) == 0)


# The forward alone (y, the new residual and rstd) against the reference, on shapes that reach
# every layout: warp slices, blocks and the loop path, vector and scalar.
FWD_SHAPES = [
    (1, 7), (13, 128), (100003, 128), (31, 1001), (20001, 1001), (4099, 1024), (3, 5, 4096),
    (2000, 4096), (257, 5120), (5, 16384), (3, 65536 + 8),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", FWD_SHAPES, ids=str)
def test_fwd_matches_reference(shape, dtype, assert_close):
    from surogate_jax.ops.add_rms_norm import _fwd_ffi, _fwd_ref

    x, res, w, _, _ = _inputs(shape, dtype)
    # the reference runs eagerly: under jit XLA may drop its round-to-dtype of s = x + res before the
    # rstd reduction (excess precision), and rstd is compared at fp32's tolerance
    want = _fwd_ref(x, res, w, EPS)
    _poison_allocator()
    got = jax.jit(lambda x, r, w: _fwd_ffi(x, r, w, EPS))(x, res, w)
    for name, g, r, dt in zip(("y", "res_out", "rstd"), got, want, (dtype, dtype, jnp.float32)):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert bool(jnp.all(jnp.isfinite(g))), f"{name} has non-finite values (unwritten?)"
        assert_close(g, r, dt, name)


# The backward alone on shapes that reach every layout: warp slices, blocks, the wide register
# kernel (fp32 rows of 4097-8192, 16-bit rows of 8193-16384, scalar rows of 2049-4096) and the
# loop path; dx (with dres added) and dw against the reference backward given the same saved s and
# rstd, outputs poisoned first.
BWD_SHAPES = [
    (1, 7), (13, 128), (31, 1001), (4099, 1024), (257, 3001), (129, 4100), (257, 5120),
    (33, 9000), (5, 16384), (3, 65536 + 8),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=str)
def test_bwd_matches_reference(shape, dtype, assert_close):
    from surogate_jax.ops.add_rms_norm import _bwd_ffi, _bwd_ref, _fwd_ffi

    x, res, w, py, ps = _inputs(shape, dtype)
    _, s, rstd = jax.jit(lambda x, r, w: _fwd_ffi(x, r, w, EPS))(x, res, w)
    dy, ds = py.astype(dtype), ps.astype(dtype)
    want = _bwd_ref(dy, ds, s, w, rstd)  # eagerly, as the forward's reference
    _poison_allocator()
    got = jax.jit(_bwd_ffi)(dy, ds, s, w, rstd)
    for name, g, r in zip(("dx", "dw"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert bool(jnp.all(jnp.isfinite(g))), f"{name} has non-finite values (unwritten?)"
        assert_close(g, r, dtype, name)
