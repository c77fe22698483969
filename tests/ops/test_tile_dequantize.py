"""CPU tests of surogate_jax.ops.tile_dequantize: `tile_dequantize` / `tile_dequantize_ref` bit for bit against an
independent numpy / ml_dtypes computation (both formats, every out dtype, via_dtype, scale, e4m3 saturation and
subnormals, ragged tiles), against the format modules' own dequantization (qlora.fp8_block, ops.nvfp4_quantize),
`tile_amax` against max|W|, `qlora.base.frozen_fp8_weight` against current scaling of the dequantized weight,
argument checks, jit / vmap and the absence of gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, fp8_formats, nvfp4_quantize, tile_amax, tile_dequantize, tile_dequantize_ref
from surogate_jax.qlora import base, fp4, fp8_block

OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
VIAS = (None, jnp.bfloat16, jnp.float16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# E2M1 magnitudes written out here (not imported) so the numpy side does not share the op's table.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP8_CODES = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)  # every e4m3 byte but the two NaNs

_name = lambda d: "none" if d is None else jnp.dtype(d).name


def _cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------------------------------------------------------
# The numpy side: the module docstring's math, one IEEE float32 operation at a time.


def _np_grid(tile_scales, shape, tile):
    """The per-tile float32 scales broadcast to every element of [rows, cols] by index arithmetic."""
    rows, cols = shape
    s = np.asarray(tile_scales).astype(np.float32)
    return s[np.arange(rows)[:, None] // tile, np.arange(cols)[None, :] // tile]


def _np_fp8_values(codes_u8, tile_scales, shape, tile):
    return np.asarray(codes_u8, np.uint8).view(E4M3).astype(np.float32) * _np_grid(tile_scales, shape, tile)


def _np_e2m1(codes_u8, shape):
    c = np.asarray(codes_u8, np.uint8)
    nib = np.empty(shape, np.uint8)
    nib[:, 0::2], nib[:, 1::2] = c & 15, c >> 4  # element 2j in the low nibble
    mag = E2M1[nib & 7]
    return np.where((nib & 8) != 0, -mag, mag).astype(np.float32)  # code 8 is -0.0


def _np_nvfp4_values(codes_u8, tile_scales_e4m3, global_scale, shape):
    return (_np_e2m1(codes_u8, shape) * _np_grid(tile_scales_e4m3, shape, 16)) * np.float32(global_scale)


def _np_finish(v, via=None, scale=None, out=jnp.float32):
    """via rounding, then * scale, then one rounding to `out` (e4m3 clipped to +-448 first)."""
    v = np.asarray(v, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if via is not None:
            v = v.astype(jnp.dtype(via)).astype(np.float32)
        if scale is not None:
            v = v * np.float32(scale)
        if jnp.dtype(out) == jnp.float8_e4m3fn:
            return np.clip(v, -448, 448).astype(E4M3)
        return v.astype(jnp.dtype(out))


def _e4m3_subnormal(a):
    b = np.asarray(a).view(np.uint8)
    return ((b & 0x78) == 0) & ((b & 0x07) != 0)


# ------------------------------------------------------------------------------------------------------------------
# Random operands and cached jitted calls (one compilation returns every out dtype, from both entry points).


def _fp8_operands(shape, tile, seed, lo=-12.0, hi=12.0):
    rng = np.random.default_rng(seed)
    codes = rng.choice(FP8_CODES, size=shape)
    grid = (_cdiv(shape[0], tile), _cdiv(shape[1], tile))
    scales = (2.0 ** rng.uniform(lo, hi, size=grid)).astype(np.float32)
    return codes, scales


def _nvfp4_operands(shape, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(shape[0], shape[1] // 2), dtype=np.uint8)
    # positive finite e4m3 scales: bytes 0x01 (2^-9, subnormal) .. 0x7e (448)
    scales = rng.integers(1, 0x7F, size=(_cdiv(shape[0], 16), shape[1] // 16), dtype=np.uint8).view(E4M3)
    return codes, scales


@functools.cache
def _dequant_all(fmt, shape, tile, via, has_scale):
    """jit: [tile_dequantize(out_dtype=d), tile_dequantize_ref(out_dtype=d) for d in OUT_DTYPES]."""

    def f(codes, ts, gs, scale):
        outs = []
        s = scale if has_scale else None
        for d in OUT_DTYPES:
            kw = dict(fmt=fmt, shape=shape, tile=tile, out_dtype=d, via_dtype=via)
            outs.append(tile_dequantize(codes, ts, gs, s, **kw))
            outs.append(tile_dequantize_ref(codes, ts, gs, s, **kw))
        return outs

    return jax.jit(f)


def _check_all_outputs(fmt, codes, ts, gs, values, shape, tile, assert_bits):
    """Every (via, scale, out dtype) against numpy; returns the e4m3 expectations (for the callers' extra checks)."""
    e4m3 = []
    for via in VIAS:
        for scale in (None, np.float32(1.7)):
            outs = _dequant_all(fmt, shape, tile, via, scale is not None)(
                jnp.asarray(codes), jnp.asarray(ts), gs, jnp.float32(1.0) if scale is None else jnp.asarray(scale))
            for i, d in enumerate(OUT_DTYPES):
                want = _np_finish(values, via, scale, d)
                what = f"{fmt} {shape} tile {tile} via {_name(via)} scale {scale} out {_name(d)}"
                assert_bits(outs[2 * i], want, what)
                assert_bits(outs[2 * i + 1], want, "ref " + what)
                if jnp.dtype(d) == jnp.float8_e4m3fn:
                    e4m3.append(want)
    return e4m3


# ------------------------------------------------------------------------------------------------------------------
# 1. fp8 against numpy


@pytest.mark.cpu  # bitwise against numpy on the CPU backend's float32 arithmetic
@pytest.mark.parametrize("shape", [(1, 1), (7, 49), (130, 200), (257, 129), (64, 256)], ids=str)
@pytest.mark.parametrize("tile", [16, 64, 128, 256])
def test_fp8_against_numpy(tile, shape, assert_bits):
    """Every e4m3 byte but NaN, tile scales over 2^-12..2^12: e4m3 outputs saturate and go subnormal, float16 via
    and outputs overflow to inf; ragged edge tiles use their tile's scale."""
    codes, scales = _fp8_operands(shape, tile, seed=tile * 1000 + shape[0])
    values = _np_fp8_values(codes, scales, shape, tile)
    codes_f8 = codes.view(E4M3)
    e4m3 = _check_all_outputs("fp8", codes_f8, scales, None, values, shape, tile, assert_bits)
    if scales.size >= 16:  # the cases the docstring's rules are about really occur (many tiles: a wide scale range)
        assert (np.abs(values) > 464).any()  # beyond 448's rounding range: a cast without the clip gives NaN
        assert all(_e4m3_subnormal(w).any() for w in e4m3)
        assert all((np.abs(w.astype(np.float32)) == 448).any() for w in e4m3)


@pytest.mark.cpu
def test_fp8_saturation_and_subnormals(assert_bits):
    """Tiles chosen so one saturates (values far above 448), one lands in e4m3's subnormal range, one is plain."""
    shape, tile = (32, 48), 16
    rng = np.random.default_rng(3)
    codes = rng.choice(FP8_CODES, size=shape)
    scales = np.array([[2.0**10, 2.0**-14, 1.0], [0.37, 2.0**-11, 3.0e3]], np.float32)
    values = _np_fp8_values(codes, scales, shape, tile)
    for d in OUT_DTYPES:
        got = tile_dequantize(jnp.asarray(codes.view(E4M3)), jnp.asarray(scales), fmt="fp8", shape=shape, tile=tile,
                              out_dtype=d)
        assert_bits(got, _np_finish(values, out=d), _name(d))
    got = np.asarray(tile_dequantize(jnp.asarray(codes.view(E4M3)), jnp.asarray(scales), fmt="fp8", shape=shape,
                                     tile=tile, out_dtype=jnp.float8_e4m3fn))
    f = got.astype(np.float32)
    assert np.isfinite(f).all()
    big = np.abs(values) > 448
    assert big.sum() > 100 and (np.abs(f[big]) == 448).all() and (np.sign(f[big]) == np.sign(values[big])).all()
    assert _e4m3_subnormal(got[:16, 16:32]).sum() > 50  # tile (0, 1): values ~2^-14 * code


@pytest.mark.cpu
def test_fp8_scale_is_a_second_multiply(assert_bits):
    """(code * tile_scale) rounded, then * scale: the reassociated order gives other bits here."""
    shape, tile = (64, 64), 16
    rng = np.random.default_rng(11)
    codes = rng.choice(FP8_CODES, size=shape)
    scales = rng.uniform(0.01, 1.0, size=(4, 4)).astype(np.float32)
    scale = np.float32(0.7071)
    want = _np_fp8_values(codes, scales, shape, tile) * scale
    reassociated = codes.view(E4M3).astype(np.float32) * (_np_grid(scales, shape, tile) * scale)
    assert (reassociated != want).any()  # the test can tell the orders apart
    for s in (jnp.asarray(scale), 0.7071):  # a float32 scalar or a Python number
        got = tile_dequantize(jnp.asarray(codes.view(E4M3)), jnp.asarray(scales), None, s, fmt="fp8", shape=shape,
                              tile=tile, out_dtype=jnp.float32)
        assert_bits(got, want, f"scale {s!r}")


@pytest.mark.cpu
@pytest.mark.parametrize("via", [jnp.bfloat16, jnp.float16], ids=_name)
def test_via_rounds_before_the_scale(via, assert_bits):
    shape, tile = (40, 80), 16
    rng = np.random.default_rng(5)
    codes = rng.choice(FP8_CODES, size=shape)
    scales = rng.uniform(0.001, 0.01, size=(3, 5)).astype(np.float32)
    scale = np.float32(223.3)
    values = _np_fp8_values(codes, scales, shape, tile)
    want = _np_finish(values, via, scale)
    assert (want != _np_finish(values, None, scale)).any()  # the via rounding shows
    args = (jnp.asarray(codes.view(E4M3)), jnp.asarray(scales), None, jnp.asarray(scale))
    kw = dict(fmt="fp8", shape=shape, tile=tile, out_dtype=jnp.float32)
    assert_bits(tile_dequantize(*args, via_dtype=via, **kw), want, "via")
    assert_bits(tile_dequantize(*args, via_dtype=jnp.float32, **kw), _np_finish(values, None, scale), "via float32")


# ------------------------------------------------------------------------------------------------------------------
# 2. nvfp4 against numpy


def test_e2m1_table():
    np.testing.assert_array_equal(nvfp4_quantize.E2M1_VALUES, E2M1)


@pytest.mark.cpu
@pytest.mark.parametrize("global_scale", [0.0137, 37.5], ids=["small_global", "large_global"])
@pytest.mark.parametrize("shape", [(1, 16), (17, 48), (40, 1024)], ids=str)
def test_nvfp4_against_numpy(shape, global_scale, assert_bits):
    codes, scales = _nvfp4_operands(shape, seed=shape[0] + shape[1])
    gs = np.float32(global_scale)
    values = _np_nvfp4_values(codes, scales, gs, shape)
    assert np.signbit(values[values == 0]).any() or values.size < 64  # code 8 (-0.0) is there
    e4m3 = _check_all_outputs("nvfp4", codes, scales, jnp.asarray(gs), values, shape, 16, assert_bits)
    if values.size >= 1000:
        if global_scale > 1:
            assert (np.abs(values) > 464).any() and all((np.abs(w.astype(np.float32)) == 448).any() for w in e4m3)
        else:
            assert all(_e4m3_subnormal(w).any() for w in e4m3)


@pytest.mark.cpu
def test_nvfp4_scale_is_a_separate_multiply(assert_bits):
    """((e2m1 * tile_scale) * global) * scale, each product rounded: folding scale into global gives other bits."""
    shape = (32, 64)
    codes, scales = _nvfp4_operands(shape, seed=9)
    gs, scale = np.float32(0.123456), np.float32(0.7071)
    want = _np_nvfp4_values(codes, scales, gs, shape) * scale
    folded = _np_nvfp4_values(codes, scales, gs * scale, shape)
    assert (folded != want).any()
    got = tile_dequantize(jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(gs), jnp.asarray(scale), fmt="nvfp4",
                          shape=shape, out_dtype=jnp.float32)
    assert_bits(got, want)
    got = tile_dequantize(jnp.asarray(codes), jnp.asarray(scales), 0.123456, 0.7071, fmt="nvfp4", shape=shape,
                          tile=16, out_dtype=jnp.float32)  # Python numbers for the scalars, tile 16 spelled out
    assert_bits(got, want, "python scalars")


# ------------------------------------------------------------------------------------------------------------------
# 3. the format modules' own dequantization


def _weight(shape, seed, scale=0.05):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


@pytest.mark.cpu
@pytest.mark.parametrize("shape", [(7, 49), (130, 200), (64, 256)], ids=str)
@pytest.mark.parametrize("block", [64, 128, 256])
def test_matches_fp8_block(block, shape, assert_bits):
    params = fp8_block.quantize(_weight(shape, block + shape[0]), block_size=block)
    q, s = params[fp8_block.WEIGHT], params[fp8_block.SCALE_INV]
    values = _np_fp8_values(np.asarray(q).view(np.uint8), s, shape, block)
    for d in (jnp.float32, jnp.bfloat16, jnp.float16):
        want = fp8_block.dequantize(params, shape, block_size=block, dtype=d)
        got = tile_dequantize_ref(q, s, fmt="fp8", shape=shape, tile=block, out_dtype=d)
        assert_bits(got, want, _name(d))
        assert_bits(got, _np_finish(values, out=d), "numpy " + _name(d))


@pytest.mark.cpu
@pytest.mark.parametrize("four_over_six", [True, False], ids=["4over6", "plain"])
@pytest.mark.parametrize("shape", [(1, 16), (17, 48), (40, 1024)], ids=str)
def test_matches_nvfp4_dequantize(shape, four_over_six, assert_bits):
    params = fp4.quantize(_weight(shape, shape[0]), four_over_six=four_over_six)
    t = fp4.to_tensor(params, shape)
    values = _np_nvfp4_values(t.codes, t.scales, t.global_scale, shape)
    for d in (jnp.float32, jnp.bfloat16, jnp.float16):
        want = nvfp4_quantize.dequantize(t, d)
        got = tile_dequantize(t.codes, t.scales, t.global_scale, fmt="nvfp4", shape=shape, out_dtype=d, impl="ref")
        assert_bits(got, want, _name(d))
        assert_bits(got, _np_finish(values, out=d), "numpy " + _name(d))
        assert_bits(fp4.dequantize(params, shape, dtype=d), want, "fp4.dequantize " + _name(d))


# ------------------------------------------------------------------------------------------------------------------
# 4. tile_amax


def _max_abs(fmt, codes, ts, gs, shape, tile, via):
    w = tile_dequantize(codes, ts, gs, fmt=fmt, shape=shape, tile=tile, out_dtype=jnp.float32, via_dtype=via)
    return float(np.max(np.abs(np.asarray(w))))


def _assert_amax(fmt, codes, ts, gs, shape, tile, values):
    for via in VIAS:
        got = tile_amax(codes, ts, gs, fmt=fmt, shape=shape, tile=tile, via_dtype=via)
        assert got.dtype == jnp.float32 and got.shape == ()
        want = float(np.max(np.abs(_np_finish(values, via))))
        assert float(got) == want, (fmt, shape, _name(via), float(got), want)
        assert float(got) == _max_abs(fmt, codes, ts, gs, shape, tile, via), (fmt, shape, _name(via))


@pytest.mark.cpu
@pytest.mark.parametrize("shape", [(7, 49), (130, 200), (257, 129)], ids=str)
@pytest.mark.parametrize("block", [64, 128])
def test_tile_amax_fp8_block(block, shape):
    params = fp8_block.quantize(_weight(shape, 3 * block + shape[1], scale=0.37), block_size=block)
    q, s = params[fp8_block.WEIGHT], params[fp8_block.SCALE_INV]
    _assert_amax("fp8", q, s, None, shape, block, _np_fp8_values(np.asarray(q).view(np.uint8), s, shape, block))


@pytest.mark.cpu
@pytest.mark.parametrize("four_over_six", [True, False], ids=["4over6", "plain"])
@pytest.mark.parametrize("shape", [(1, 16), (17, 48), (40, 1024)], ids=str)
def test_tile_amax_fp4(shape, four_over_six):
    params = fp4.quantize(_weight(shape, shape[0] + 7, scale=3.3), four_over_six=four_over_six)
    t = fp4.to_tensor(params, shape)
    _assert_amax("nvfp4", t.codes, t.scales, t.global_scale, shape, 16,
                 _np_nvfp4_values(t.codes, t.scales, t.global_scale, shape))


@pytest.mark.cpu
@pytest.mark.parametrize("shape", [(1, 1), (7, 49), (130, 200), (257, 129)], ids=str)
@pytest.mark.parametrize("tile", [16, 128])
def test_tile_amax_fp8_random_codes(tile, shape):
    """Codes from no quantizer: the largest code of a tile is anything, the largest tile scale holds no largest code
    (scales narrow enough that the via roundings stay finite)."""
    codes, scales = _fp8_operands(shape, tile, seed=7 * tile + shape[1], lo=-3, hi=3)
    codes[codes == 0x7E] = 0x7D  # no +-448 codes: a tile's max comes from whatever code is largest
    codes[codes == 0xFE] = 0x7C
    values = _np_fp8_values(codes, scales, shape, tile)
    _assert_amax("fp8", jnp.asarray(codes.view(E4M3)), jnp.asarray(scales), None, shape, tile, values)


@pytest.mark.cpu
@pytest.mark.parametrize("shape", [(1, 16), (17, 48), (40, 1024)], ids=str)
def test_tile_amax_nvfp4_random_codes(shape):
    codes, scales = _nvfp4_operands(shape, seed=shape[1] + 1)
    codes = (codes & np.uint8(0x66)) | (codes & np.uint8(0x88))  # magnitudes 0..6 (no code 7 = 6.0): max is smaller
    gs = np.float32(0.0731)
    values = _np_nvfp4_values(codes, scales, gs, shape)
    assert not (np.abs(_np_e2m1(codes, shape)) == 6).any()
    _assert_amax("nvfp4", jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(gs), shape, 16, values)


@pytest.mark.cpu
def test_tile_amax_via_rounding_matters():
    """The via rounding changes max|W| here, and tile_amax applies it: 416 * (1 + 2^-10) = 416.40625 in float32,
    416 in bfloat16, 416.5 in float16; the tile holding 448 has scale 0.5 (224), so a smaller code wins."""
    shape, tile = (16, 32), 16
    codes = np.zeros(shape, np.uint8)
    codes[3, 20] = 0x7D  # 416
    codes[5, 2] = 0x7E  # 448
    scales = np.array([[0.5, 1.0 + 2.0**-10]], np.float32)
    values = _np_fp8_values(codes, scales, shape, tile)
    got = {}
    for via in VIAS:
        got[_name(via)] = float(tile_amax(jnp.asarray(codes.view(E4M3)), jnp.asarray(scales), fmt="fp8", shape=shape,
                                          tile=tile, via_dtype=via))
        assert got[_name(via)] == float(np.max(np.abs(_np_finish(values, via)))), _name(via)
    assert got == {"none": 416.40625, "bfloat16": 416.0, "float16": 416.5}, got


@pytest.mark.cpu
def test_tile_amax_zero_and_empty():
    shape = (17, 48)  # shapes other tests quantize too: fp4.quantize compiles once per shape
    zero = jnp.zeros(shape, jnp.float32)
    p8 = fp8_block.quantize(zero, block_size=64)
    assert float(tile_amax(p8[fp8_block.WEIGHT], p8[fp8_block.SCALE_INV], fmt="fp8", shape=shape, tile=64)) == 0.0
    t = fp4.to_tensor(fp4.quantize(zero), shape)
    for via in VIAS:
        assert float(tile_amax(t.codes, t.scales, t.global_scale, fmt="nvfp4", shape=shape, via_dtype=via)) == 0.0
    empty8 = tile_amax(jnp.zeros((0, 16), jnp.float8_e4m3fn), jnp.zeros((0, 1), jnp.float32), fmt="fp8",
                       shape=(0, 16), tile=16)
    assert empty8.dtype == jnp.float32 and float(empty8) == 0.0
    empty4 = tile_amax(jnp.zeros((0, 8), jnp.uint8), jnp.zeros((0, 1), jnp.float8_e4m3fn), jnp.float32(1.0),
                       fmt="nvfp4", shape=(0, 16))
    assert float(empty4) == 0.0


# ------------------------------------------------------------------------------------------------------------------
# 5. frozen_fp8_weight: current scaling of the dequantized weight


def _frozen_cases():
    return [
        pytest.param(base.QloraSpec("fp8", 64), (130, 200), id="fp8_64"),
        pytest.param(base.QloraSpec("fp8", 128), (257, 129), id="fp8_128"),
        pytest.param(base.QloraSpec("fp4", 16), (40, 1024), id="fp4_4over6"),
        pytest.param(base.QloraSpec("fp4", 16, four_over_six=False), (17, 48), id="fp4_plain"),
    ]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=_name)
@pytest.mark.parametrize(("spec", "shape"), _frozen_cases())
def test_frozen_fp8_weight(spec, shape, dtype, assert_bits):
    params = base.quantize(spec, _weight(shape, shape[0] + shape[1], scale=0.02))
    wq, scale = base.frozen_fp8_weight(spec, params, shape, dtype)
    w = base.dequantize(spec, params, shape, dtype)
    want_scale = fp8_formats.current_scale(jnp.max(jnp.abs(w.astype(jnp.float32))))
    want_wq = fp8_formats.quantize(w, want_scale, fp8_formats.E4M3)
    assert wq.dtype == jnp.float8_e4m3fn and wq.shape == shape
    assert_bits(scale, want_scale, "scale")
    assert_bits(wq, want_wq, "wq")
    # numpy: the same from the dequantized weight's values
    wn = np.asarray(w).astype(np.float32)
    np_scale = np.float32(448.0) / np.max(np.abs(wn))
    assert_bits(scale, np.asarray(np_scale, np.float32), "numpy scale")
    assert_bits(wq, np.clip(wn * np_scale, -448, 448).astype(E4M3), "numpy wq")
    assert (np.abs(np.asarray(wq).astype(np.float32)) == 448).any()


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_frozen_fp8_weight_zero(fmt):
    spec = base.QloraSpec(fmt, 64 if fmt == "fp8" else 16)
    shape = (17, 48)
    params = base.quantize(spec, jnp.zeros(shape, jnp.float32))
    wq, scale = base.frozen_fp8_weight(spec, params, shape, jnp.bfloat16)
    assert float(scale) == 1.0 and not np.asarray(wq).view(np.uint8).any()


# ------------------------------------------------------------------------------------------------------------------
# 6. argument checks


def test_bad_arguments():
    shape = (20, 48)
    c8, s8 = _fp8_operands(shape, 16, seed=0)
    c8, s8 = jnp.asarray(c8.view(E4M3)), jnp.asarray(s8)
    c4, s4 = (jnp.asarray(a) for a in _nvfp4_operands(shape, seed=0))
    g = jnp.float32(0.5)
    fp8 = dict(fmt="fp8", shape=shape, tile=16, impl="ref")
    nv = dict(fmt="nvfp4", shape=shape, impl="ref")
    with pytest.raises(ValueError, match="fmt must be one of"):
        tile_dequantize(c8, s8, fmt="int4", shape=shape, tile=16)
    with pytest.raises(ValueError, match="fmt must be one of"):
        tile_amax(c8, s8, fmt="mxfp4", shape=shape, tile=16)
    for tile in (48, 24, 8, 1024, None, True, 16.0):
        with pytest.raises(ValueError, match="fp8 tile must be a power of two in \\[16, 512\\]"):
            tile_dequantize(c8, s8, fmt="fp8", shape=shape, tile=tile)
    with pytest.raises(ValueError, match="fp8 tile must be a power of two"):
        tile_amax(c8, s8, fmt="fp8", shape=shape, tile=12)
    with pytest.raises(ValueError, match="nvfp4 tiles are 16x16"):
        tile_dequantize(c4, s4, g, fmt="nvfp4", shape=shape, tile=32)
    with pytest.raises(ValueError, match="nvfp4 needs cols % 16 == 0"):
        tile_dequantize(jnp.zeros((20, 12), jnp.uint8), jnp.zeros((2, 1), jnp.float8_e4m3fn), g, fmt="nvfp4",
                        shape=(20, 24))
    with pytest.raises(TypeError, match="codes must be float8_e4m3fn, got uint8"):
        tile_dequantize(jnp.zeros(shape, jnp.uint8), s8, **fp8)
    with pytest.raises(TypeError, match="codes must be uint8, got int8"):
        tile_dequantize(c4.astype(jnp.int8), s4, g, **nv)
    with pytest.raises(TypeError, match="codes must be an array"):
        tile_dequantize([[0.0]], s8, **fp8)
    with pytest.raises(ValueError, match="codes must have shape \\(20, 48\\)"):
        tile_dequantize(c8[:-1], s8, **fp8)
    with pytest.raises(ValueError, match="codes must have shape \\(20, 24\\)"):
        tile_dequantize(jnp.zeros(shape, jnp.uint8), s4, g, **nv)
    with pytest.raises(TypeError, match="tile_scales must be float32, got bfloat16"):
        tile_dequantize(c8, s8.astype(jnp.bfloat16), **fp8)
    with pytest.raises(TypeError, match="tile_scales must be float8_e4m3fn, got float32"):
        tile_dequantize(c4, s4.astype(jnp.float32), g, **nv)
    with pytest.raises(ValueError, match="tile_scales must have shape \\(2, 3\\)"):
        tile_dequantize(c8, s8[:, :2], **fp8)
    with pytest.raises(ValueError, match="tile_scales must have shape \\(1, 1\\)"):
        tile_dequantize(c8, s8, fmt="fp8", shape=shape, tile=64)
    with pytest.raises(ValueError, match="tile_scales must have shape \\(2, 3\\)"):
        tile_dequantize(c4, s4[:1], g, **nv)
    with pytest.raises(ValueError, match="fp8 has no global_scale"):
        tile_dequantize(c8, s8, g, **fp8)
    with pytest.raises(ValueError, match="nvfp4 needs its global_scale"):
        tile_dequantize(c4, s4, **nv)
    with pytest.raises(TypeError, match="global_scale must be float32"):
        tile_dequantize(c4, s4, jnp.bfloat16(0.5), **nv)
    with pytest.raises(ValueError, match="global_scale must have shape \\(\\) \\(a scalar\\)"):
        tile_dequantize(c4, s4, jnp.ones((1,), jnp.float32), **nv)
    for bad in (jnp.int8, jnp.float8_e5m2, jnp.float64):
        with pytest.raises(TypeError, match="out_dtype must be one of float32, bfloat16, float16, float8_e4m3fn"):
            tile_dequantize(c8, s8, out_dtype=bad, **fp8)
    with pytest.raises(TypeError, match="out_dtype .* is not a dtype"):
        tile_dequantize(c8, s8, out_dtype="not_a_dtype", **fp8)
    for bad in (jnp.int32, jnp.float8_e4m3fn):
        with pytest.raises(TypeError, match="via_dtype must be None, float32, bfloat16 or float16"):
            tile_dequantize(c8, s8, via_dtype=bad, **fp8)
    with pytest.raises(TypeError, match="via_dtype must be None"):
        tile_amax(c8, s8, fmt="fp8", shape=shape, tile=16, via_dtype=jnp.int32)
    with pytest.raises(ValueError, match="scale must have shape \\(\\) \\(a scalar\\), got \\(1,\\)"):
        tile_dequantize(c8, s8, None, jnp.ones((1,), jnp.float32), **fp8)
    with pytest.raises(TypeError, match="scale must be float32, got float16"):
        tile_dequantize(c8, s8, None, jnp.float16(2.0), **fp8)
    with pytest.raises(ValueError, match="shape must be two ints"):
        tile_dequantize(c8, s8, fmt="fp8", shape=(20, 48, 1), tile=16)
    with pytest.raises(ValueError, match="shape must be two ints"):
        tile_dequantize(c8, s8, fmt="fp8", shape=(20.0, 48), tile=16)
    with pytest.raises(TypeError, match="shape must be a tuple"):
        tile_dequantize(c8, s8, fmt="fp8", shape=20, tile=16)
    with pytest.raises(ValueError, match="must not be negative"):
        tile_dequantize(c8, s8, fmt="fp8", shape=(-20, 48), tile=16)
    with pytest.raises(ValueError, match="impl"):
        tile_dequantize(c8, s8, fmt="fp8", shape=shape, tile=16, impl="cuda")


def test_empty_weight():
    out = tile_dequantize(jnp.zeros((0, 16), jnp.float8_e4m3fn), jnp.zeros((0, 1), jnp.float32), fmt="fp8",
                          shape=(0, 16), tile=16)
    assert out.shape == (0, 16) and out.dtype == jnp.bfloat16
    out = tile_dequantize(jnp.zeros((0, 8), jnp.uint8), jnp.zeros((0, 1), jnp.float8_e4m3fn), jnp.float32(1.0),
                          fmt="nvfp4", shape=(0, 16), out_dtype=jnp.float8_e4m3fn)
    assert out.shape == (0, 16) and out.dtype == jnp.float8_e4m3fn


# ------------------------------------------------------------------------------------------------------------------
# 7. gradients, jit, vmap, tracing


@pytest.mark.parametrize("impl", [None, "ref"])
def test_no_gradient(impl):
    """d/dx of f(x, W) with W = tile_dequantize(...) is the dense weight's; d/d(tile_scales, scale, global) are 0."""
    shape, tile = (32, 48), 16
    codes, scales = _fp8_operands(shape, tile, seed=4, lo=-2, hi=2)
    codes = jnp.asarray(codes.view(E4M3))
    w = jnp.asarray(_np_fp8_values(np.asarray(codes).view(np.uint8), scales, shape, tile) * np.float32(0.01))
    x = jax.random.normal(jax.random.key(5), (3, 32), jnp.float32)

    def loss8(x, ts, scale):
        w = tile_dequantize(codes, ts, None, scale, fmt="fp8", shape=shape, tile=tile, out_dtype=jnp.float32,
                            impl=impl)
        return jnp.sum(jnp.tanh(x @ w))

    gx, gts, gs = jax.jit(jax.grad(loss8, argnums=(0, 1, 2)))(x, jnp.asarray(scales), jnp.float32(0.01))
    np.testing.assert_allclose(gx, jax.grad(lambda x: jnp.sum(jnp.tanh(x @ w)))(x), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(gx).sum()) > 0
    assert gts.shape == scales.shape and not np.asarray(gts).any() and float(gs) == 0.0

    c4, s4 = (jnp.asarray(a) for a in _nvfp4_operands(shape, seed=4))

    def loss4(x, glob, scale):
        w = tile_dequantize(c4, s4, glob, scale, fmt="nvfp4", shape=shape, out_dtype=jnp.float32, impl=impl)
        return jnp.sum(jnp.tanh(x @ w))

    gx, gg, gs = jax.grad(loss4, argnums=(0, 1, 2))(x, jnp.float32(0.01), jnp.float32(0.5))
    assert float(jnp.abs(gx).sum()) > 0 and float(gg) == 0.0 and float(gs) == 0.0
    g_amax = jax.grad(lambda ts: tile_amax(codes, ts, fmt="fp8", shape=shape, tile=tile))(jnp.asarray(scales))
    assert not np.asarray(g_amax).any()


@pytest.mark.cpu
@pytest.mark.parametrize("impl", [None, "ref"])
def test_jit_and_vmap(impl, assert_bits):
    shape, tile = (40, 72), 32  # ragged in both dims
    ops = [_fp8_operands(shape, tile, seed=s, lo=-4, hi=4) for s in range(3)]
    codes = jnp.asarray(np.stack([c for c, _ in ops]).view(E4M3))
    scales = jnp.asarray(np.stack([s for _, s in ops]))
    mult = jnp.asarray([0.5, 1.25, 3.0], jnp.float32)
    fn = lambda c, s, m: tile_dequantize(c, s, None, m, fmt="fp8", shape=shape, tile=tile, via_dtype=jnp.bfloat16,
                                         out_dtype=jnp.float8_e4m3fn, impl=impl)
    got = jax.jit(jax.vmap(fn))(codes, scales, mult)
    assert got.shape == (3, *shape) and got.dtype == jnp.float8_e4m3fn
    outs = []
    for i in range(3):
        want = _np_finish(_np_fp8_values(np.asarray(codes[i]).view(np.uint8), scales[i], shape, tile),
                          jnp.bfloat16, mult[i], jnp.float8_e4m3fn)
        assert_bits(got[i], want, f"vmap weight {i}")
        assert_bits(jax.jit(fn)(codes[i], scales[i], mult[i]), want, f"jit weight {i}")
        assert_bits(fn(codes[i], scales[i], mult[i]), want, f"eager weight {i}")
        outs.append(want)
    assert not np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))  # the weights differ

    shape4 = (24, 32)
    ops4 = [_nvfp4_operands(shape4, seed=10 + s) for s in range(3)]
    c4 = jnp.asarray(np.stack([c for c, _ in ops4]))
    s4 = jnp.asarray(np.stack([s for _, s in ops4]))
    glob = jnp.asarray([0.01, 0.2, 3.0], jnp.float32)
    fn4 = lambda c, s, g: tile_dequantize(c, s, g, fmt="nvfp4", shape=shape4, out_dtype=jnp.bfloat16, impl=impl)
    got = jax.jit(jax.vmap(fn4))(c4, s4, glob)
    amax = jax.vmap(lambda c, s, g: tile_amax(c, s, g, fmt="nvfp4", shape=shape4, via_dtype=jnp.bfloat16))(c4, s4, glob)
    for i in range(3):
        values = _np_nvfp4_values(c4[i], s4[i], glob[i], shape4)
        assert_bits(got[i], _np_finish(values, out=jnp.bfloat16), f"vmap nvfp4 {i}")
        assert_bits(jax.jit(fn4)(c4[i], s4[i], glob[i]), _np_finish(values, out=jnp.bfloat16), f"jit nvfp4 {i}")
        assert float(amax[i]) == float(np.max(np.abs(_np_finish(values, jnp.bfloat16)))), i


def test_checkpoint_name_tag():
    c, s = _fp8_operands((4, 32), 16, seed=0)
    jaxpr = str(jax.make_jaxpr(lambda c, s: tile_dequantize(c, s, fmt="fp8", shape=(4, 32), tile=16, impl="ref"))(
        jnp.asarray(c.view(E4M3)), jnp.asarray(s)))
    assert "name=tile_dequantize" in jaxpr.replace(" ", ""), jaxpr


@pytest.mark.skipif(not ffi_available(),
                    reason="the CUDA extension is not built (installed without nvcc); the test only traces its call")
def test_ffi_path_traces_under_grad_and_vmap():
    """The kernel path has no differentiation rule of its own: stop_gradient must keep JVP tracers off it."""
    c, s = _fp8_operands((8, 32), 16, seed=1, lo=-2, hi=2)
    c = jnp.asarray(c.view(E4M3))
    x = jnp.ones((2, 8), jnp.float32)

    def loss(x, s):
        w = tile_dequantize(c, s, None, 2.0, fmt="fp8", shape=(8, 32), tile=16, impl="ffi")
        return jnp.sum(x @ w.astype(jnp.float32))

    assert "surogate_tile_dequantize" in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, jnp.asarray(s)))
    jaxpr = str(jax.make_jaxpr(jax.vmap(lambda s: loss(x, s)))(jnp.stack([jnp.asarray(s)] * 2)))
    assert "surogate_tile_dequantize" in jaxpr


def test_env_forces_reference(force_ref):
    force_ref("ref:tile_dequantize")
    c, s = _fp8_operands((4, 32), 16, seed=0)
    jaxpr = jax.make_jaxpr(lambda c, s: tile_dequantize(c, s, fmt="fp8", shape=(4, 32), tile=16, impl="ffi"))(
        jnp.asarray(c.view(E4M3)), jnp.asarray(s))
    assert "surogate_tile_dequantize" not in str(jaxpr)
