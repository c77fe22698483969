"""GPU tests of the tile dequantization kernel (impl="ffi") against `tile_dequantize_ref`, BIT FOR BIT: both formats
(FP8 block-scaled, NVFP4), every FP8 tile size QLoRA uses, every output dtype, with and without a scale and a via
rounding, ragged tile grids, FP8 widths that are not a multiple of 16 (the scalar kernel), and Qwen3-sized weights;
random codes (every byte pattern) and tile scales over a wide range (so float8 saturates and goes subnormal);
outputs poisoned so unwritten elements show; jit and vmap; the QLoRA fp8-hybrid weight; the handler's checks."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, tile_dequantize, tile_dequantize_ref
from surogate_jax.ops.tile_dequantize import _ffi

pytestmark = pytest.mark.gpu

OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
# (fmt, tile, shape): ragged grids, an FP8 width off the 16-grid, a single tile row, Qwen3-8B gate/up and down.
CASES = [
    ("fp8", 16, (1, 5)),
    ("fp8", 64, (7, 49)),
    ("fp8", 64, (130, 200)),
    ("fp8", 128, (257, 1000)),
    ("fp8", 256, (300, 512)),
    ("fp8", 128, (12288, 4096)),
    ("nvfp4", 16, (1, 16)),
    ("nvfp4", 16, (17, 48)),
    ("nvfp4", 16, (1000, 1504)),
    ("nvfp4", 16, (4096, 12288)),
]
SCALE = 1.7
_seed = itertools.count(5000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inputs(fmt, tile, shape):
    """Random codes over every byte (NaN codes excluded for FP8) and tile scales in [2^-10, 2^10] (FP8) or every
    positive finite e4m3 (NVFP4, global 0.37): values reach past e4m3's 448 and below its subnormals."""
    rng = np.random.default_rng(next(_seed))
    rows, cols = shape
    grid = (-(-rows // tile), -(-cols // tile))
    if fmt == "fp8":
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        codes = b.view(ml_dtypes.float8_e4m3fn)
        scales = (2.0 ** rng.uniform(-10, 10, size=grid)).astype(np.float32)
        return jnp.asarray(codes), jnp.asarray(scales), None
    codes = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    s = rng.integers(1, 0x7F, size=grid, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return jnp.asarray(codes), jnp.asarray(s), jnp.float32(0.37)


def _poison_allocator(nbytes=1 << 30):
    """Allocate and free an all-ones-bits buffer (NaN in every output dtype) so the next outputs likely land on it."""
    junk = jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32)
    junk.block_until_ready()
    del junk


def _key(dtype, scaled, via=None):
    return f"{jnp.dtype(dtype).name}/{'scale' if scaled else 'plain'}" + (f"/via-{jnp.dtype(via).name}" if via else "")


@functools.cache
def _all_outputs(impl, fmt, tile, shape):
    """One jitted program returning every (out dtype, scale or not, via) output."""
    fn = tile_dequantize_ref if impl == "ref" else functools.partial(tile_dequantize, impl="ffi")
    kw = dict(fmt=fmt, shape=shape, tile=tile)

    @jax.jit
    def go(codes, scales, g, scale):
        outs = {_key(d, s): fn(codes, scales, g, scale if s else None, out_dtype=d, **kw)
                for d in OUT_DTYPES for s in (False, True)}
        outs |= {_key(d, True, v): fn(codes, scales, g, scale, out_dtype=d, via_dtype=v, **kw)
                 for d in (jnp.float8_e4m3fn, jnp.float32) for v in (jnp.bfloat16, jnp.float16)}
        return outs

    return go


@pytest.mark.parametrize("fmt,tile,shape", CASES, ids=str)
def test_kernel_matches_reference(fmt, tile, shape, assert_bits):
    codes, scales, g = _inputs(fmt, tile, shape)
    want = _all_outputs("ref", fmt, tile, shape)(codes, scales, g, jnp.float32(SCALE))
    jax.block_until_ready(want)
    _poison_allocator()
    got = _all_outputs("ffi", fmt, tile, shape)(codes, scales, g, jnp.float32(SCALE))
    for k in want:
        assert_bits(got[k], want[k], k)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_reference_on_gpu_matches_numpy(fmt, assert_bits):
    """XLA:GPU's fusion of the reference rounds like numpy / ml_dtypes (so a kernel mismatch above is the kernel's)."""
    tile, shape = (64, (70, 200)) if fmt == "fp8" else (16, (40, 96))
    codes, scales, g = _inputs(fmt, tile, shape)
    r, c = np.indices(shape)
    s = np.asarray(scales).astype(np.float32)[r // tile, c // tile]
    if fmt == "fp8":
        v = np.asarray(codes).astype(np.float32) * s
    else:
        b = np.asarray(codes)
        nib = np.stack([b & 15, b >> 4], -1).reshape(shape)
        mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)[nib & 7]
        v = (np.where(nib & 8, -mag, mag) * s) * np.float32(g)
    v = (v.astype(ml_dtypes.bfloat16).astype(np.float32) * np.float32(SCALE)).astype(np.float32)
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    kw = dict(fmt=fmt, tile=tile, shape=shape, out_dtype=jnp.float8_e4m3fn, via_dtype=jnp.bfloat16)
    assert_bits(jax.jit(functools.partial(tile_dequantize_ref, **kw))(codes, scales, g, jnp.float32(SCALE)), want,
                "reference vs numpy")
    assert_bits(tile_dequantize(codes, scales, g, SCALE, impl="ffi", **kw), want, "kernel vs numpy")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_vmap(fmt, assert_bits):
    """vmap_method="sequential": each weight of the stack with its own tile scales and output scale."""
    tile, shape = (128, (200, 256)) if fmt == "fp8" else (16, (48, 256))
    stacked = [_inputs(fmt, tile, shape) for _ in range(3)]
    codes = jnp.stack([c for c, _, _ in stacked])
    scales = jnp.stack([s for _, s, _ in stacked])
    g = None if fmt == "fp8" else jnp.asarray([0.5, 1.0, 3.0], jnp.float32)
    out_scales = jnp.asarray([0.5, 1.0, 3.0], jnp.float32)

    def fn(impl):
        def one(c, s, g, o):
            return tile_dequantize(c, s, g, o, fmt=fmt, shape=shape, tile=tile, out_dtype=jnp.float8_e4m3fn,
                                   impl=impl)
        return jax.vmap(one, in_axes=(0, 0, None if g is None else 0, 0))

    want = jax.jit(fn("ref"))(codes, scales, g, out_scales)
    _poison_allocator()
    assert_bits(jax.jit(fn("ffi"))(codes, scales, g, out_scales), want, "vmap")


def test_sliced_inputs(assert_bits):
    """Codes sliced inside the program: the kernel sees whatever buffers XLA passes; the result is the reference's."""
    codes, scales, _ = _inputs("fp8", 64, (41, 128))

    def fn(impl):
        return jax.jit(lambda c, s: tile_dequantize(c[1:], s, fmt="fp8", shape=(40, 128), tile=64, impl=impl))

    want = fn("ref")(codes, scales)
    _poison_allocator()
    assert_bits(fn("ffi")(codes, scales), want, "sliced")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_qlora_fp8_weight_through_kernel(fmt, assert_bits):
    """fp8-hybrid's QLoRA weight (frozen_fp8_weight: kernel on the GPU) equals the E4M3 quantization of the base
    dequantized in bf16, computed by the references."""
    from surogate_jax.ops import fp8_formats
    from surogate_jax.qlora import base

    spec = base.QloraSpec("fp8", 128) if fmt == "fp8" else base.QloraSpec("fp4", 16)
    shape = (1000, 1024)
    w = jax.random.normal(jax.random.key(7), shape, jnp.float32) * jnp.exp(jax.random.normal(jax.random.key(8),
                                                                                             (shape[0], 1)))
    params = base.quantize(spec, w)
    wq, scale = jax.jit(lambda p: base.frozen_fp8_weight(spec, p, shape, jnp.bfloat16))(params)
    assert "surogate_tile_dequantize" in jax.jit(
        lambda p: base.frozen_fp8_weight(spec, p, shape, jnp.bfloat16)).lower(params).as_text()
    dense = base.dequantize(spec, params, shape, jnp.bfloat16)
    want_scale = fp8_formats.current_scale(jnp.max(jnp.abs(dense.astype(jnp.float32))))
    assert_bits(scale, want_scale, "scale")
    ref = jax.jit(lambda d, s: jnp.clip(d.astype(jnp.float32) * s, -448, 448).astype(jnp.float8_e4m3fn))
    assert_bits(wq, ref(dense, want_scale), "E4M3 weight")


def test_kernel_is_in_the_compiled_program():
    codes, scales, _ = _inputs("fp8", 128, (256, 256))
    hlo = jax.jit(lambda c, s: tile_dequantize(c, s, fmt="fp8", shape=(256, 256), tile=128)).lower(codes, scales)
    assert "surogate_tile_dequantize" in hlo.as_text()  # impl=None on GPU picks the kernel


def test_handler_checks_sizes():
    codes, scales, _ = _inputs("fp8", 64, (64, 128))
    zero = jnp.zeros((), jnp.float32)
    kw = dict(shape=(64, 128), out_dtype=jnp.bfloat16, has_scale=False, via_dtype=None)
    call = functools.partial(_ffi, fmt="fp8", tile=64, **kw)
    with pytest.raises(Exception, match="tile_scales has shape"):
        jax.block_until_ready(jax.jit(call)(codes, scales[:, :1], zero, zero))
    with pytest.raises(Exception, match="codes has shape"):
        jax.block_until_ready(jax.jit(call)(codes[:-1], scales, zero, zero))
    with pytest.raises(Exception, match="fp8 tile must be"):
        jax.block_until_ready(jax.jit(functools.partial(_ffi, fmt="fp8", tile=48, **kw))(codes, scales, zero, zero))
    with pytest.raises(Exception, match="codes has dtype"):
        jax.block_until_ready(jax.jit(functools.partial(_ffi, fmt="nvfp4", tile=16, **kw))(
            codes, scales, zero, zero))
