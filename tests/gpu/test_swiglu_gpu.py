"""GPU tests of the SwiGLU CUDA kernels (impl="ffi") against `swiglu_ref`: forward and both
gradients, f32/bf16/f16, odd and large shapes (vector and scalar paths), the packed [.., 2F]
form, fresh random inputs per test, outputs poisoned so unwritten elements show, jit and vmap."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, swiglu, swiglu_packed, swiglu_ref
from surogate_jax.ops.swiglu import _bwd_ffi, _fwd_ffi, _packed_bwd_ffi, _packed_fwd_ffi

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [
    (7,), (1, 8), (13, 128), (127, 1000), (31, 1001), (2, 3, 1001), (3, 5, 3072),
    (4099, 1024), (257, 17408), (65537, 8),
]
_seed = itertools.count(2000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inputs(shape, dtype):
    kg, ku, kp = jax.random.split(jax.random.key(next(_seed)), 3)  # fresh inputs per call
    gate = (3.0 * jax.random.normal(kg, shape, jnp.float32)).astype(dtype)
    up = jax.random.normal(ku, shape, jnp.float32).astype(dtype)
    return gate, up, kp


def _poison_allocator(nbytes=64 << 20):
    """Allocate and free a NaN-filled buffer so the next outputs likely land on NaN memory."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _run(fn, args, proj):
    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) * proj)

    @jax.jit
    def go(*a):
        return fn(*a), jax.grad(loss, argnums=tuple(range(len(a))))(*a)

    return go(*args)


def _check(named, assert_close, dtype):
    for name, got, want in named:
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert bool(jnp.all(jnp.isfinite(got))), f"{name} has non-finite values (unwritten?)"
        assert_close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ffi_matches_reference(shape, dtype, assert_close):
    gate, up, kp = _inputs(shape, dtype)
    proj = jax.random.normal(kp, shape, jnp.float32)
    h_ref, (dg_ref, du_ref) = _run(swiglu_ref, (gate, up), proj)
    _poison_allocator()
    h, (dg, du) = _run(lambda g, u: swiglu(g, u, impl="ffi"), (gate, up), proj)
    _check((("h", h, h_ref), ("dgate", dg, dg_ref), ("dup", du, du_ref)), assert_close, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(31, 1001), (4099, 1024), (70001, 64), (65601, 2048)], ids=str)
def test_ffi_targets_match_reference(shape, dtype, assert_close):
    """Each FFI target, plain and packed, writes the reference's values: (31, 1001) takes the scalar
    path, (65601, 2048) more row groups than the grid's 65535 (the kernels' row loop)."""
    gate, up, kp = _inputs(shape, dtype)
    dh = jax.random.normal(kp, shape, jnp.float32).astype(dtype)
    h_ref = swiglu_ref(gate, up)
    dg_ref, du_ref = jax.vjp(swiglu_ref, gate, up)[1](dh)
    _poison_allocator()
    h = jax.jit(_fwd_ffi)(gate, up)
    dg, du = jax.jit(_bwd_ffi)(dh, gate, up)
    _check((("h", h, h_ref), ("dgate", dg, dg_ref), ("dup", du, du_ref)), assert_close, dtype)
    gu = jnp.concatenate([gate, up], -1)
    _poison_allocator()
    hp = jax.jit(_packed_fwd_ffi)(gu)
    dgu = jax.jit(_packed_bwd_ffi)(dh, gu)
    _check((("packed h", hp, h_ref), ("packed dgate_up", dgu, jnp.concatenate([dg_ref, du_ref], -1))),
           assert_close, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(14,), (13, 256), (31, 2002), (3, 7, 2 * 1001), (1025, 6144)], ids=str)
def test_packed_matches_reference(shape, dtype, assert_close):
    gu, _, kp = _inputs(shape, dtype)
    F = shape[-1] // 2
    proj = jax.random.normal(kp, (*shape[:-1], F), jnp.float32)
    ref = lambda gu: swiglu_ref(gu[..., :F], gu[..., F:])  # noqa: E731
    h_ref, (dgu_ref,) = _run(ref, (gu,), proj)
    _poison_allocator()
    h, (dgu,) = _run(lambda gu: swiglu_packed(gu, impl="ffi"), (gu,), proj)
    _check((("h", h, h_ref), ("dgate_up", dgu, dgu_ref)), assert_close, dtype)


def test_unaligned_views_take_the_scalar_path(assert_close):
    # Slicing off one column makes gate/up start 2 bytes past a 16-byte boundary inside XLA's
    # buffers only if XLA keeps the slice as a view; either way the result must be right.
    gate, up, kp = _inputs((67, 1025), jnp.bfloat16)
    proj = jax.random.normal(kp, (67, 1024), jnp.float32)
    fn = lambda g, u: swiglu(g[:, 1:], u[:, 1:], impl="ffi")  # noqa: E731
    ref = lambda g, u: swiglu_ref(g[:, 1:], u[:, 1:])  # noqa: E731
    h, (dg, du) = _run(fn, (gate, up), proj)
    h_ref, (dg_ref, du_ref) = _run(ref, (gate, up), proj)
    _check((("h", h, h_ref), ("dgate", dg, dg_ref), ("dup", du, du_ref)), assert_close, jnp.bfloat16)


def test_extreme_gates_are_finite():
    gate = jnp.asarray([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 3.0]], jnp.float32)
    up = jnp.ones_like(gate)
    h, (dg, du) = _run(lambda g, u: swiglu(g, u, impl="ffi"), (gate, up), jnp.ones_like(gate))
    h_ref, (dg_ref, du_ref) = _run(swiglu_ref, (gate, up), jnp.ones_like(gate))
    for got, want in ((h, h_ref), (dg, dg_ref), (du, du_ref)):
        assert bool(jnp.all(jnp.isfinite(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_vmap(assert_close):
    gate, up, kp = _inputs((3, 33, 1000), jnp.bfloat16)
    proj = jax.random.normal(kp, gate.shape, jnp.float32)
    fn = jax.vmap(lambda g, u: swiglu(g, u, impl="ffi"))
    ref = jax.vmap(swiglu_ref)
    h, (dg, du) = _run(fn, (gate, up), proj)
    h_ref, (dg_ref, du_ref) = _run(ref, (gate, up), proj)
    _check((("h", h, h_ref), ("dgate", dg, dg_ref), ("dup", du, du_ref)), assert_close, jnp.bfloat16)


def test_ffi_is_in_the_compiled_program():
    gate, up, _ = _inputs((8, 128), jnp.bfloat16)
    hlo = jax.jit(lambda g, u: swiglu(g, u)).lower(gate, up).as_text()
    assert "surogate_swiglu_fwd" in hlo  # impl=None on GPU picks the kernel
    hlo = jax.jit(lambda gu: swiglu_packed(gu)).lower(gate).as_text()
    assert "surogate_swiglu_packed_fwd" in hlo


def test_zero_rows():
    gate = jnp.zeros((0, 128), jnp.bfloat16)
    h, dg = jax.jit(
        lambda g: (swiglu(g, g, impl="ffi"), jax.grad(lambda g: swiglu(g, g, impl="ffi").astype(jnp.float32).sum())(g))
    )(gate)
    assert h.shape == (0, 128) and dg.shape == (0, 128)
