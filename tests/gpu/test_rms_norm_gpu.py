"""GPU tests of the RMSNorm CUDA kernels (impl="ffi") against `rms_norm_ref`: forward and both
gradients, f32/bf16/f16, odd and large shapes, fresh random inputs per test, jit and vmap."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, rms_norm, rms_norm_ref

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [
    (1, 7), (1, 128), (13, 128), (127, 1000), (31, 1001), (2, 3, 1001), (3, 5, 4096),
    (4096, 4096), (16385, 128), (257, 8192), (5, 16384), (3, 65536 + 8),
]
EPS = 1e-6
_seed = itertools.count(1000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inputs(shape, dtype):
    kx, kw, kp = jax.random.split(jax.random.key(next(_seed)), 3)  # fresh inputs per call
    x = (2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    proj = jax.random.normal(kp, shape, jnp.float32)
    return x, w, proj


def _run(fn, x, w, proj):
    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32) * proj)

    @jax.jit
    def go(x, w):
        return fn(x, w), jax.grad(loss, argnums=(0, 1))(x, w)

    return go(x, w)


def _poison_allocator(nbytes=64 << 20):
    """Allocate and free a NaN-filled buffer so the next outputs likely land on NaN memory."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ffi_matches_reference(shape, dtype, assert_close):
    x, w, proj = _inputs(shape, dtype)
    y_ref, (dx_ref, dw_ref) = _run(lambda x, w: rms_norm_ref(x, w, EPS), x, w, proj)
    _poison_allocator()
    y, (dx, dw) = _run(lambda x, w: rms_norm(x, w, EPS, impl="ffi"), x, w, proj)
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert bool(jnp.all(jnp.isfinite(got))), f"{name} has non-finite values (unwritten?)"
        assert_close(got, want, dtype, name)


def test_ffi_is_in_the_compiled_program():
    x, w, _ = _inputs((8, 128), jnp.bfloat16)
    hlo = jax.jit(lambda x, w: rms_norm(x, w)).lower(x, w).as_text()
    assert "surogate_rms_norm_fwd" in hlo  # impl=None on GPU picks the kernel


def test_rstd_matches_reference(assert_close):
    from surogate_jax.ops.rms_norm import _fwd_ffi, _fwd_ref

    x, w, _ = _inputs((129, 1000), jnp.bfloat16)
    _, rstd = jax.jit(lambda x, w: _fwd_ffi(x, w, EPS))(x, w)
    _, rstd_ref = _fwd_ref(x, w, EPS)
    assert rstd.dtype == jnp.float32
    assert_close(rstd, rstd_ref, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_vmap_shared_and_per_example_weights(dtype, assert_close):
    x, w, proj = _inputs((3, 33, 1000), dtype)

    def per_example_grads(fn, w_axis, w):
        def loss(x, w, p):
            return jnp.sum(fn(x, w).astype(jnp.float32) * p)

        return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, w_axis, 0)))(
            x, w, proj
        )

    ffi = lambda x, w: rms_norm(x, w, EPS, impl="ffi")  # noqa: E731
    ref = lambda x, w: rms_norm_ref(x, w, EPS)  # noqa: E731
    ws = (w[None, :] * jnp.asarray([[1.0], [0.5], [-2.0]])).astype(dtype)
    for w_axis, weights in ((None, w), (0, ws)):
        (v, (dx, dw)) = per_example_grads(ffi, w_axis, weights)
        (v_ref, (dx_ref, dw_ref)) = per_example_grads(ref, w_axis, weights)
        assert dw.shape == (3, 1000)  # one weight gradient per example
        assert_close(v, v_ref, dtype)  # v sums outputs rounded to `dtype`, so dtype's tolerance
        assert_close(dx, dx_ref, dtype)
        assert_close(dw, dw_ref, dtype)


def test_grad_of_vmapped_batch(assert_close):
    x, w, proj = _inputs((4, 65, 128), jnp.bfloat16)

    def loss(fn):
        return lambda x, w: jnp.sum(jax.vmap(fn, in_axes=(0, None))(x, w).astype(jnp.float32) * proj)

    g = jax.jit(jax.grad(loss(lambda x, w: rms_norm(x, w, EPS, impl="ffi")), argnums=(0, 1)))(x, w)
    g_ref = jax.jit(jax.grad(loss(lambda x, w: rms_norm_ref(x, w, EPS)), argnums=(0, 1)))(x, w)
    assert_close(g[0], g_ref[0], jnp.bfloat16)
    assert_close(g[1], g_ref[1], jnp.bfloat16)


def test_zero_rows():
    x = jnp.zeros((0, 128), jnp.bfloat16)
    w = jnp.ones((128,), jnp.bfloat16)
    y, dw = jax.jit(
        lambda x, w: (rms_norm(x, w, impl="ffi"), jax.grad(lambda w: rms_norm(x, w, impl="ffi").sum())(w))
    )(x, w)
    assert y.shape == (0, 128) and np.all(np.asarray(dw, np.float32) == 0)


# The forward alone (y and the saved rstd) against the reference, on shapes that reach every
# layout: warp slices, blocks and the loop path, vector and scalar.
FWD_SHAPES = [
    (1, 7), (13, 128), (100003, 128), (31, 1001), (20001, 1001), (4099, 1024), (3, 5, 4096),
    (2000, 4096), (257, 5120), (5, 16384), (3, 65536 + 8),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", FWD_SHAPES, ids=str)
def test_fwd_matches_reference(shape, dtype, assert_close):
    from surogate_jax.ops.rms_norm import _fwd_ffi, _fwd_ref

    x, w, _ = _inputs(shape, dtype)
    y_ref, rstd_ref = jax.jit(lambda x, w: _fwd_ref(x, w, EPS))(x, w)
    _poison_allocator()
    y, rstd = jax.jit(lambda x, w: _fwd_ffi(x, w, EPS))(x, w)
    for name, got, want, dt in (("y", y, y_ref, dtype), ("rstd", rstd, rstd_ref, jnp.float32)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert bool(jnp.all(jnp.isfinite(got))), f"{name} has non-finite values (unwritten?)"
        assert_close(got, want, dt, name)


# The backward alone on shapes that reach every layout: warp slices, blocks, the wide register
# kernel (fp32 rows of 4097-8192, 16-bit rows of 8193-16384, scalar rows of 2049-4096) and the
# loop path; dx and dw against the reference backward given the same saved rstd, outputs poisoned
# first.
BWD_SHAPES = [
    (1, 7), (13, 128), (31, 1001), (4099, 1024), (257, 3001), (129, 4100), (257, 5120),
    (33, 9000), (5, 16384), (3, 65536 + 8),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=str)
def test_bwd_matches_reference(shape, dtype, assert_close):
    from surogate_jax.ops.rms_norm import _bwd_ffi, _bwd_ref, _fwd_ffi

    x, w, proj = _inputs(shape, dtype)
    _, rstd = jax.jit(lambda x, w: _fwd_ffi(x, w, EPS))(x, w)
    dy = proj.astype(dtype)
    want = jax.jit(_bwd_ref)(dy, x, w, rstd)
    _poison_allocator()
    got = jax.jit(_bwd_ffi)(dy, x, w, rstd)
    for name, g, r in zip(("dx", "dw"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert bool(jnp.all(jnp.isfinite(g))), f"{name} has non-finite values (unwritten?)"
        assert_close(g, r, dtype, name)
