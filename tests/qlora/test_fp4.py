"""NVFP4 base weights (surogate_jax/qlora/fp4.py): dequantize(quantize(w)) is the NVFP4 op's own 16x16-tile
fake quantization bit for bit on ragged shapes, the parameter shapes and dtypes, jit against eager, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import nvfp4_quantize as nvfp4
from surogate_jax.qlora import fp4

SHAPES = [(17, 32), (1, 16), (100, 48), (16, 16), (33, 64)]
CPU_EXACT = pytest.mark.cpu  # bitwise against the reference: XLA:GPU's f32 division may differ by an ulp


def make_weight(shape, seed, dtype=jnp.float32):
    """Normal values with per-row magnitudes over 2^-6..2^6 (tiles of different scales) and a few exact zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp2(rng.uniform(-6, 6, (shape[0], 1)))
    w[rng.random(shape) < 0.05] = 0.0
    return jnp.asarray(w.astype(np.float32), dtype)


def bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


@CPU_EXACT
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("four_over_six", [True, False], ids=["4over6", "max6"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_dequantize_equals_fake_quantize_ref(shape, four_over_six, dtype):
    w = make_weight(shape, seed=shape[0] * 100 + shape[1], dtype=dtype)
    p = fp4.quantize(w, four_over_six=four_over_six)
    want = nvfp4.fake_quantize_ref(w, tile_2d=True, four_over_six=four_over_six)
    got = fp4.dequantize(p, shape, dtype=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(bits(got), bits(want))
    # the default bf16 result is the float32 one rounded once
    got16 = fp4.dequantize(p, shape)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(got16), bits(np.asarray(want).astype(ml_dtypes.bfloat16)))
    # the op's own quantize/dequantize pair, and its packed bytes
    q = nvfp4.quantize(w, tile_2d=True, four_over_six=four_over_six)
    np.testing.assert_array_equal(bits(nvfp4.dequantize(q)), bits(got))
    np.testing.assert_array_equal(bits(p[fp4.CODES]), bits(q.codes))
    np.testing.assert_array_equal(bits(p[fp4.SCALES]), bits(q.scales))
    np.testing.assert_array_equal(bits(p[fp4.GLOBAL_SCALE]), bits(q.global_scale))


@CPU_EXACT
def test_options_reach_the_op():
    """The data above tells the settings apart: 16x16 tiles (not 1x16 blocks) and four_over_six both change bits,
    so a quantize that dropped either would fail the reference comparison."""
    shape = (100, 48)
    w = make_weight(shape, seed=1)
    for fos in (True, False):
        got = fp4.dequantize(fp4.quantize(w, four_over_six=fos), shape, dtype=jnp.float32)
        assert np.any(bits(got) != bits(nvfp4.fake_quantize_ref(w, tile_2d=False, four_over_six=fos)))
        assert np.any(bits(got) != bits(nvfp4.fake_quantize_ref(w, tile_2d=True, four_over_six=not fos)))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_param_shapes(shape):
    out, inp = shape
    want = {
        "fp4_codes": jax.ShapeDtypeStruct((out, inp // 2), jnp.uint8),
        "fp4_scales": jax.ShapeDtypeStruct((-(-out // 16), inp // 16), jnp.float8_e4m3fn),
        "fp4_global_scale": jax.ShapeDtypeStruct((), jnp.float32),
    }
    assert fp4.param_shapes(shape) == want
    p = fp4.quantize(make_weight(shape, seed=0))
    assert {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in p.items()} == want


@pytest.mark.parametrize("four_over_six", [True, False], ids=["4over6", "max6"])
def test_jit_equals_eager(four_over_six):
    shape = (33, 64)
    w = make_weight(shape, seed=4, dtype=jnp.bfloat16)
    eager = fp4.quantize(w, four_over_six=four_over_six)
    jitted = jax.jit(lambda w: fp4.quantize(w, four_over_six=four_over_six))(w)
    for k in eager:
        np.testing.assert_array_equal(bits(jitted[k]), bits(eager[k]), err_msg=k)
    deq = lambda p: fp4.dequantize(p, shape, dtype=jnp.float32)
    np.testing.assert_array_equal(bits(jax.jit(deq)(eager)), bits(deq(eager)))


def test_errors():
    for shape in [(16, 24), (4, 8), (32, 1)]:
        with pytest.raises(ValueError, match="`in` dim"):
            fp4.quantize(jnp.ones(shape))
        with pytest.raises(ValueError, match="`in` dim"):
            fp4.param_shapes(shape)
    for bad in (jnp.ones((16,)), jnp.ones((2, 16, 16)), jnp.ones((0, 16)), jnp.ones((4, 16), jnp.int32)):
        with pytest.raises(ValueError):
            fp4.quantize(bad)
    p = fp4.quantize(jnp.ones((17, 32)))
    with pytest.raises(ValueError, match="fp4_codes"):  # params of a [17, 32] weight read as [33, 32]
        fp4.dequantize(p, (33, 32))
    with pytest.raises(ValueError, match="fp4_scales"):
        fp4.dequantize({**p, "fp4_scales": p["fp4_scales"].astype(jnp.float32)}, (17, 32))
    with pytest.raises(ValueError, match="fp4_codes"):
        fp4.dequantize({**p, "fp4_codes": p["fp4_codes"].astype(jnp.int8)}, (17, 32))
    with pytest.raises(ValueError, match="fp4_global_scale"):
        fp4.dequantize({k: v for k, v in p.items() if k != "fp4_global_scale"}, (17, 32))
