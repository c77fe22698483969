"""GPU tests of the NF4 dequantization kernel (impl="ffi") against `nf4_dequantize_ref`, BIT FOR BIT: every block
size, every output dtype, with and without a scale, shapes that take the tail path only (n < 16), odd n, n not a
multiple of 32, and Qwen3-sized weights; random codes and absmax over a wide range (so float8 saturates and goes
subnormal); outputs poisoned so unwritten elements show; jit and vmap; the handler's argument checks."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, nf4_dequantize, nf4_dequantize_ref
from surogate_jax.ops.nf4_dequantize import _ffi
from surogate_jax.qlora.nf4 import NF4_CODE

pytestmark = pytest.mark.gpu

BLOCK_SIZES = (64, 128, 256, 512)
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
SHAPES = [(1, 5), (7, 48), (7, 49), (33, 1001), (1000, 1504), (1001, 1503), (4096, 12288)]
SCALE = 1.7
_seed = itertools.count(3000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inputs(shape, block_size):
    """Random codes (every nibble value) and absmax in [2^-10, 2^10]: |v| reaches 1024 * 1.7, past e4m3's 448."""
    rng = np.random.default_rng(next(_seed))
    n = shape[0] * shape[1]
    codes = rng.integers(0, 256, size=(n + 1) // 2, dtype=np.uint8)
    absmax = (2.0 ** rng.uniform(-10, 10, size=-(-n // block_size))).astype(np.float32)
    return jnp.asarray(codes), jnp.asarray(absmax)


def _poison_allocator(nbytes=1 << 30):
    """Allocate and free an all-ones-bits buffer (NaN in every output dtype, e4m3's 0xFF included) so the next
    outputs likely land on it."""
    junk = jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32)
    junk.block_until_ready()
    del junk


def _key(dtype, scaled, via=None):
    return f"{jnp.dtype(dtype).name}/{'scale' if scaled else 'plain'}" + (f"/via-{jnp.dtype(via).name}" if via else "")


@functools.cache
def _all_outputs(impl, shape, block_size):
    """One jitted program returning every (out dtype, scale or not) output."""
    if impl == "ref":
        fn = nf4_dequantize_ref
    else:
        fn = functools.partial(nf4_dequantize, impl="ffi")

    @jax.jit
    def go(codes, absmax, scale):
        return {
            _key(d, s): fn(
                codes, absmax, NF4_CODE, scale if s else None, shape=shape, block_size=block_size, out_dtype=d
            )
            for d in OUT_DTYPES
            for s in (False, True)
        } | {  # fp8-hybrid's QLoRA weight: rounded to the model dtype, scaled, to e4m3 (f32 shows the rounding)
            _key(d, True, v): fn(
                codes, absmax, NF4_CODE, scale, shape=shape, block_size=block_size, out_dtype=d, via_dtype=v
            )
            for d in (jnp.float8_e4m3fn, jnp.float32)
            for v in (jnp.bfloat16, jnp.float16)
        }

    return go


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(shape, block_size, assert_bits):
    codes, absmax = _inputs(shape, block_size)
    scale = jnp.float32(SCALE)
    want = _all_outputs("ref", shape, block_size)(codes, absmax, scale)
    jax.block_until_ready(want)
    _poison_allocator()
    got = _all_outputs("ffi", shape, block_size)(codes, absmax, scale)
    for k in want:
        assert_bits(got[k], want[k], k)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_reference_on_gpu_matches_numpy(out_dtype, assert_bits):
    """XLA:GPU's fusion of the reference rounds like numpy / ml_dtypes (so a kernel mismatch above is the kernel's)."""
    shape, block_size = (33, 1001), 64
    codes, absmax = _inputs(shape, block_size)
    n = shape[0] * shape[1]
    c = np.asarray(codes)
    q = np.stack([c >> 4, c & 15], -1).reshape(-1)[:n]
    v = NF4_CODE[q] * np.asarray(absmax)[np.arange(n) // block_size]
    v = (v * np.float32(SCALE)).astype(np.float32)
    if jnp.dtype(out_dtype) == jnp.float8_e4m3fn:
        want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    else:
        want = v.astype(out_dtype)
    got = jax.jit(functools.partial(nf4_dequantize_ref, shape=shape, block_size=block_size, out_dtype=out_dtype))(
        codes, absmax, NF4_CODE, jnp.float32(SCALE)
    )
    assert_bits(got, want.reshape(shape), jnp.dtype(out_dtype).name)
    assert_bits(
        nf4_dequantize(
            codes, absmax, NF4_CODE, SCALE, shape=shape, block_size=block_size, out_dtype=out_dtype, impl="ffi"
        ),
        want.reshape(shape),
        "kernel vs numpy",
    )


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_vmap(out_dtype, assert_bits):
    """vmap_method="sequential": each weight of the stack with its own absmax and scale."""
    shape, block_size = (31, 257), 128
    stacked = [_inputs(shape, block_size) for _ in range(3)]
    codes = jnp.stack([c for c, _ in stacked])
    absmax = jnp.stack([a for _, a in stacked])
    scales = jnp.asarray([0.5, 1.0, 3.0], jnp.float32)

    def fn(impl):
        return lambda c, a, s: nf4_dequantize(
            c, a, NF4_CODE, s, shape=shape, block_size=block_size, out_dtype=out_dtype, impl=impl
        )

    want = jax.jit(jax.vmap(fn("ref")))(codes, absmax, scales)
    _poison_allocator()
    got = jax.jit(jax.vmap(fn("ffi")))(codes, absmax, scales)
    assert_bits(got, want, "vmap")
    for i in range(3):
        assert_bits(got[i], fn("ref")(codes[i], absmax[i], scales[i]), f"weight {i}")


def test_sliced_inputs(assert_bits):
    """codes and absmax sliced inside the program: the kernel sees whatever buffers XLA passes (views at odd
    offsets would take the scalar path); either way the result must be the reference's."""
    shape, block_size = (40, 96), 64
    n = shape[0] * shape[1]
    codes, absmax = _inputs((1, n + 6), block_size)

    def fn(impl):
        return jax.jit(
            lambda c, a: nf4_dequantize(
                c[3:], a[1:], NF4_CODE, shape=shape, block_size=block_size, out_dtype=jnp.bfloat16, impl=impl
            )
        )

    want = fn("ref")(codes, absmax)
    _poison_allocator()
    assert_bits(fn("ffi")(codes, absmax), want, "sliced")


def test_gradient_through_kernel():
    shape = (64, 128)
    codes, absmax = _inputs(shape, 64)
    x = jax.random.normal(jax.random.key(1), (8, 64), jnp.float32)

    def loss(x, absmax, impl):
        w = nf4_dequantize(codes, absmax, NF4_CODE, shape=shape, block_size=64, out_dtype=jnp.float32, impl=impl)
        return jnp.sum(jnp.tanh(x @ w * 1e-3))

    got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, absmax, "ffi")
    want = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, absmax, "ref")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-7)
    assert not np.asarray(got[1]).any()


def test_kernel_is_in_the_compiled_program():
    codes, absmax = _inputs((8, 128), 64)
    hlo = jax.jit(lambda c, a: nf4_dequantize(c, a, NF4_CODE, shape=(8, 128), block_size=64)).lower(codes, absmax)
    assert "surogate_nf4_dequantize" in hlo.as_text()  # impl=None on GPU picks the kernel


def test_handler_checks_sizes():
    codes, absmax = _inputs((8, 128), 64)
    kw = dict(shape=(8, 128), out_dtype=jnp.bfloat16, has_scale=False, via_dtype=None)
    call = functools.partial(_ffi, block_size=64, **kw)
    with pytest.raises(Exception, match="absmax has shape"):
        jax.block_until_ready(jax.jit(call)(codes, absmax[:-1], NF4_CODE, jnp.float32(1)))
    with pytest.raises(Exception, match="codes has shape"):
        jax.block_until_ready(jax.jit(call)(codes[:-1], absmax, NF4_CODE, jnp.float32(1)))
    bad_block = functools.partial(_ffi, block_size=32, **kw)
    with pytest.raises(Exception, match="block_size must be"):
        jax.block_until_ready(jax.jit(bad_block)(codes, absmax, NF4_CODE, jnp.float32(1)))
