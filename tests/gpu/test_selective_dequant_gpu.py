"""GPU tests of selective MoE expert dequantization (qlora_selective_expert_dequant): the dequantization kernels
(NF4; FP8 tiles and NVFP4 through tile_dequantize) given group sizes with zeros, on odd shapes (the vector path's
tail, the scalar path, experts smaller than a block's tile), equal the reference BIT FOR BIT on the rows of the
experts that have tokens (the others are unspecified: never written); and the frozen grouped GEMM forward and
backward with selective dequantization equals it without, through our grouped GEMM kernel and through the fallback
that dequantizes every expert when the reference GEMM (ragged_dot) is forced."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, nf4_dequantize, tile_dequantize
from surogate_jax.qlora import base
from surogate_jax.qlora.base import QloraSpec
from surogate_jax.qlora.nf4 import NF4_CODE

pytestmark = pytest.mark.gpu

OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn)
# (experts, rows per expert, cols): the vector path with a tail (n % 8 != 0), experts of one row (many per block
# tile), experts larger than a tile (blocks skipped whole), 30B-A3B's down_proj shape in miniature
NF4_CASES = [(5, 7, 49), (9, 1, 6), (6, 33, 1001), (16, 128, 768)]
TILE_CASES = [("fp8", 16, 5, 7, 49), ("fp8", 64, 6, 40, 200), ("fp8", 128, 8, 256, 1024), ("nvfp4", 16, 5, 17, 48),
              ("nvfp4", 16, 8, 128, 512), ("nvfp4", 16, 12, 1, 16)]
_seed = itertools.count(7000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _poison_allocator(nbytes=1 << 30):
    """Allocate and free an all-ones-bits buffer (NaN in every output dtype) so the next outputs likely land on it:
    rows a kernel should write and does not then show."""
    junk = jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32)
    junk.block_until_ready()
    del junk


def _sizes(experts):
    """Group sizes with zeros: every third expert empty (the first among them), and the last."""
    s = np.random.default_rng(next(_seed)).integers(1, 9, experts).astype(np.int32)
    s[::3] = 0
    s[-1] = 0
    return s


def _check_active(got, want, sizes, rows, assert_bits, what):
    act = np.repeat(sizes > 0, rows)
    assert_bits(np.asarray(got)[act], np.asarray(want)[act], what)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(("experts", "rows", "cols"), NF4_CASES, ids=str)
def test_nf4_kernel_matches_reference_on_active_experts(experts, rows, cols, out_dtype, assert_bits):
    rng = np.random.default_rng(next(_seed))
    shape = (experts * rows, cols)
    n = shape[0] * cols
    codes = jnp.asarray(rng.integers(0, 256, size=(n + 1) // 2, dtype=np.uint8))
    absmax = jnp.asarray((2.0 ** rng.uniform(-10, 10, size=-(-n // 64))).astype(np.float32))
    sizes = _sizes(experts)
    kw = dict(shape=shape, block_size=64, out_dtype=out_dtype, group_sizes=jnp.asarray(sizes))
    want = jax.jit(functools.partial(nf4_dequantize, impl="ref", **kw))(codes, absmax, NF4_CODE)
    jax.block_until_ready(want)
    _poison_allocator()
    got = jax.jit(functools.partial(nf4_dequantize, impl="ffi", **kw))(codes, absmax, NF4_CODE)
    _check_active(got, want, sizes, rows, assert_bits, "nf4 kernel vs reference")
    # the scalar kernel: codes at an odd offset inside the program
    padded = jnp.concatenate([jnp.zeros((3,), jnp.uint8), codes])
    sliced = jax.jit(lambda c, a: nf4_dequantize(c[3:], a, NF4_CODE, impl="ffi", **kw))(padded, absmax)
    _check_active(sliced, want, sizes, rows, assert_bits, "nf4 scalar kernel vs reference")


def _tile_inputs(rng, fmt, tile, shape):
    rows, cols = shape
    grid = (-(-rows // tile), -(-cols // tile))
    if fmt == "fp8":
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        return (jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)),
                jnp.asarray((2.0 ** rng.uniform(-10, 10, size=grid)).astype(np.float32)), None)
    codes = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    s = rng.integers(1, 0x7F, size=grid, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return jnp.asarray(codes), jnp.asarray(s), jnp.float32(0.37)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(("fmt", "tile", "experts", "rows", "cols"), TILE_CASES, ids=str)
def test_tile_kernel_matches_reference_on_active_experts(fmt, tile, experts, rows, cols, out_dtype, assert_bits):
    rng = np.random.default_rng(next(_seed))
    shape = (experts * rows, cols)
    codes, scales, g = _tile_inputs(rng, fmt, tile, shape)
    sizes = _sizes(experts)
    kw = dict(fmt=fmt, tile=tile, shape=shape, out_dtype=out_dtype, group_sizes=jnp.asarray(sizes))
    want = jax.jit(functools.partial(tile_dequantize, impl="ref", **kw))(codes, scales, g)
    jax.block_until_ready(want)
    _poison_allocator()
    got = jax.jit(functools.partial(tile_dequantize, impl="ffi", **kw))(codes, scales, g)
    _check_active(got, want, sizes, rows, assert_bits, f"{fmt} kernel vs reference")


def test_kernels_with_every_expert_empty_or_full(assert_bits):
    """All experts empty: nothing to compare, the call must still run; all full: the whole weight, as without sizes."""
    shape = (4 * 24, 128)
    rng = np.random.default_rng(next(_seed))
    codes = jnp.asarray(rng.integers(0, 256, size=shape[0] * shape[1] // 2, dtype=np.uint8))
    absmax = jnp.asarray(rng.uniform(0.1, 1, size=shape[0] * shape[1] // 64).astype(np.float32))
    kw = dict(shape=shape, block_size=64, impl="ffi")
    jax.block_until_ready(nf4_dequantize(codes, absmax, NF4_CODE, group_sizes=jnp.zeros((4,), jnp.int32), **kw))
    full = nf4_dequantize(codes, absmax, NF4_CODE, group_sizes=jnp.ones((4,), jnp.int32), **kw)
    assert_bits(full, nf4_dequantize(codes, absmax, NF4_CODE, **kw), "all experts with rows")


def test_handler_checks_group_sizes():
    from surogate_jax.ops.nf4_dequantize import _ffi  # noqa: PLC0415

    shape = (6, 64)
    codes, absmax = jnp.zeros((192,), jnp.uint8), jnp.ones((6,), jnp.float32)
    call = functools.partial(_ffi, shape=shape, block_size=64, out_dtype=jnp.bfloat16, has_scale=False,
                             via_dtype=None)
    with pytest.raises(Exception, match="group_sizes has 5 experts"):
        jax.block_until_ready(jax.jit(call)(codes, absmax, NF4_CODE, jnp.float32(1), jnp.ones((5,), jnp.int32)))
    with pytest.raises(Exception, match="group_sizes has dtype float32, expected int32"):
        jax.block_until_ready(jax.jit(call)(codes, absmax, NF4_CODE, jnp.float32(1), jnp.ones((3,), jnp.float32)))


SPECS = [QloraSpec("nf4", 64, double_quant=True), QloraSpec("fp8", 128), QloraSpec("fp4", 16)]


@pytest.mark.parametrize("force", [None, "ref:grouped_matmul"], ids=["kernel_gemm", "ragged_dot_fallback"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.format)
def test_frozen_grouped_selective_equals_full(spec, force, force_ref, assert_bits):
    """Forward and dX of the frozen grouped GEMM (16 experts, 6 of them without rows; bf16) with selective
    dequantization on equal it off, bit for bit: through our GEMM kernel the empty experts' unwritten rows are never
    read; with the reference GEMM forced, selective falls back to dequantizing every expert."""
    force_ref(force)
    E, out, inp = 16, 256, 384
    k = jax.random.split(jax.random.key(next(_seed)), 3)
    params = base.quantize(spec, jax.random.normal(k[0], (E * out, inp), jnp.float32) * 0.05)
    sizes = np.random.default_rng(next(_seed)).integers(1, 40, E).astype(np.int32)
    sizes[[0, 3, 4, 9, 14, 15]] = 0
    n = int(sizes.sum()) + 5  # rows past the groups: zero outputs
    x = jax.random.normal(k[1], (n, inp), jnp.bfloat16)
    dy = jax.random.normal(k[2], (n, out), jnp.bfloat16)
    assert base.selective_applies(spec, x.shape, (E, out, inp), jnp.bfloat16) == (force is None)

    def run(selective):
        f = base.frozen_grouped(spec, params, shape=(E, out, inp), dtype=jnp.bfloat16, selective=selective)

        @jax.jit
        def go(x, sizes, dy):
            y, vjp = jax.vjp(lambda x: f(x, sizes), x)
            return y, vjp(dy)[0]

        return go(x, jnp.asarray(sizes), dy)

    y0, dx0 = run(False)
    _poison_allocator()
    y1, dx1 = run(True)
    assert_bits(y1, y0, "y")
    assert_bits(dx1, dx0, "dx")
