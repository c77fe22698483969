"""Block-scaled FP8 base weights (surogate_jax/qlora/fp8_block.py): bytes against a numpy reference written from the
formulas and against transformers' own quantizer, zero / extreme tiles, the 448 saturation point, ragged edges,
the e4m3 error bound, jit against eager, and the HF round trip with its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax import safetensors_io
from surogate_jax.qlora import fp8_block

F32 = np.float32
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SHAPES = [(130, 200), (1, 1), (7, 300), (256, 128), (513, 65)]
CPU_EXACT = pytest.mark.cpu  # bitwise against numpy / torch: XLA:GPU's f32 division may differ by an ulp


def cdiv(a, b):
    return -(-a // b)


def ref_quantize(w: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The module docstring's formulas in numpy float32 (each op correctly rounded): (codes e4m3, scale_inv f32)."""
    x = np.asarray(w).astype(F32)
    o, i = x.shape
    rows, cols = cdiv(o, b), cdiv(i, b)
    t = np.zeros((rows * b, cols * b), F32)
    t[:o, :i] = x
    t = t.reshape(rows, b, cols, b)
    amax = np.abs(t).max(axis=(1, 3))
    tiny = amax < F32(2.0**-117)
    safe = np.where(tiny, F32(1), amax)
    with np.errstate(over="ignore"):
        scale = np.where(amax >= F32(2.0**126), F32(448) / safe, (F32(1) / safe) * F32(448)).astype(F32)
    scale = np.where(tiny, F32(1), scale)
    scale_inv = F32(1) / scale
    q = np.clip(t * scale[:, None, :, None], F32(-448), F32(448)).astype(E4M3)
    return q.reshape(rows * b, cols * b)[:o, :i], scale_inv


def make_weight(shape, seed, dtype=np.float32, spread=24) -> np.ndarray:
    """Normal values with a per-row magnitude over 2^-spread..2^spread (2^-8..2^8 for float16, whose range is
    small), a few exact +-0s: every tile a different scale."""
    rng = np.random.default_rng(seed)
    spread = min(spread, 8) if np.dtype(dtype) == np.float16 else spread
    w = rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, (shape[0], 1)))
    w[rng.random(shape) < 0.02] = 0.0
    w[rng.random(shape) < 0.02] = -0.0
    return w.astype(dtype)


def u8(a):
    return np.asarray(a).view(np.uint8)


def u32(a):
    return np.asarray(a, F32).view(np.uint32)


def assert_same_bytes(params, codes, scale_inv):
    np.testing.assert_array_equal(u8(params[fp8_block.WEIGHT]), u8(codes))
    np.testing.assert_array_equal(u32(params[fp8_block.SCALE_INV]), u32(scale_inv))


REF_CASES = [(shape, np.float32) for shape in SHAPES] + [
    (shape, dt) for shape in [(130, 200), (7, 300)] for dt in (ml_dtypes.bfloat16, np.float16)]


@CPU_EXACT
@pytest.mark.parametrize("block", fp8_block.BLOCK_SIZES)
@pytest.mark.parametrize("shape,dtype", REF_CASES, ids=[f"{o}x{i}-{np.dtype(d).name}" for (o, i), d in REF_CASES])
def test_quantize_matches_numpy_reference(shape, dtype, block):
    w = make_weight(shape, seed=shape[0] * 1000 + shape[1], dtype=dtype)
    p = fp8_block.quantize(jnp.asarray(w), block_size=block)
    assert p[fp8_block.WEIGHT].dtype == jnp.float8_e4m3fn and p[fp8_block.WEIGHT].shape == shape
    assert p[fp8_block.SCALE_INV].dtype == jnp.float32
    assert p[fp8_block.SCALE_INV].shape == (cdiv(shape[0], block), cdiv(shape[1], block))
    assert_same_bytes(p, *ref_quantize(w, block))


def _hf_quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Fp8Quantize on a zero-padded copy of w (it passes ragged weights through), cropped back."""
    import torch  # noqa: PLC0415  (dev extras; the byte-equality claim rests on this comparison, so no skip)
    from transformers.integrations.finegrained_fp8 import Fp8Quantize  # noqa: PLC0415
    from transformers.utils.quantization_config import FineGrainedFP8Config  # noqa: PLC0415
    o, i = w.shape
    padded = np.zeros((cdiv(o, block) * block, cdiv(i, block) * block), w.dtype)
    padded[:o, :i] = w
    hf = type("HfQuantizer", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=(block, block))})()
    src = torch.from_numpy(padded.astype(F32))
    if w.dtype == np.dtype(ml_dtypes.bfloat16):
        src = src.to(torch.bfloat16)  # exact: the values are bf16 already
    out = Fp8Quantize(hf).convert({"layer.weight": src})
    codes = out["layer.weight"].view(torch.uint8).numpy().view(E4M3)[:o, :i]
    return codes, out["layer.weight_scale_inv"].numpy()


@CPU_EXACT
def test_matches_transformers():
    """One test (importing transformers once per worker is most of its time): quantize's bytes equal transformers'
    Fp8Quantize for every block size, whole and ragged shapes, float32 and bf16; the data can tell torch's
    reciprocal-then-multiply scale from one correctly rounded 448 / amax; transformers' load-time Fp8Dequantize of
    our to_hf tensors equals our float32 dequantize."""
    for block in fp8_block.BLOCK_SIZES:
        for shape in [(512, 768), (130, 200), (7, 300)]:
            for dtype in (np.float32, ml_dtypes.bfloat16):
                w = make_weight(shape, seed=7 + block, dtype=dtype)
                codes, scale_inv = _hf_quantize(w, block)
                assert_same_bytes(fp8_block.quantize(jnp.asarray(w), block_size=block), codes, scale_inv)

    w = make_weight((64 * 32, 64 * 32), seed=3)
    _, scale_inv = _hf_quantize(w, 64)
    amax = np.abs(w.reshape(32, 64, 32, 64)).max(axis=(1, 3))
    one_division = F32(1) / (F32(448) / amax)
    assert np.mean(u32(one_division) != u32(scale_inv)) > 0.05
    np.testing.assert_array_equal(u32(ref_quantize(w, 64)[1]), u32(scale_inv))

    import torch  # noqa: PLC0415  (present: _hf_quantize skipped otherwise)
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: PLC0415

    shape = (384, 256)
    hf = fp8_block.to_hf(fp8_block.quantize(make_weight(shape, seed=11)), shape)
    weight = torch.from_numpy(hf["weight"].view(np.uint8).copy()).view(torch.float8_e4m3fn)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, torch.from_numpy(hf["weight_scale_inv"].copy()), torch.float32)
    ours = fp8_block.dequantize(fp8_block.from_hf(hf, shape, 128), shape, dtype=jnp.float32)
    np.testing.assert_array_equal(u32(ours), u32(theirs.numpy()))


@pytest.mark.parametrize("block", fp8_block.BLOCK_SIZES)
def test_zero_and_tiny_tiles(block):
    shape = (block + 3, 2 * block + 5)
    w = make_weight(shape, seed=5)
    w[:block, :block] = 0.0  # a whole zero tile
    w[:block, block : 2 * block] = -0.0  # a negative-zero tile
    w[block:, 2 * block :] = 1e-37  # the ragged corner tile: tiny (below 2^-117), quantized as zero
    p = fp8_block.quantize(jnp.asarray(w), block_size=block)
    q, s = np.asarray(p[fp8_block.WEIGHT]), np.asarray(p[fp8_block.SCALE_INV])
    assert s[0, 0] == 1.0 and s[0, 1] == 1.0 and s[1, 2] == 1.0
    assert np.all(u8(q[:block, :block]) == 0x00)
    assert np.all(u8(q[:block, block : 2 * block]) == 0x80)  # -0 keeps its sign, as torch's cast does
    assert np.all(u8(q[block:, 2 * block :]) == 0x00)
    dq = np.asarray(fp8_block.dequantize(p, shape, block_size=block, dtype=jnp.float32))
    assert np.all(dq[:block, : 2 * block] == 0.0) and np.all(dq[block:, 2 * block :] == 0.0)
    assert np.all(np.isfinite(dq)) and np.all(np.isfinite(s))
    zeros = fp8_block.quantize(jnp.zeros(shape, jnp.bfloat16), block_size=block)
    assert np.all(u8(zeros[fp8_block.WEIGHT]) == 0) and np.all(np.asarray(zeros[fp8_block.SCALE_INV]) == 1.0)


def test_tile_max_maps_to_448_without_nan():
    """Each tile's largest magnitude becomes exactly +-448 (the cast saturates there, never to NaN), over tile
    magnitudes from 2^-110 to float32's maximum."""
    b, n = 64, 16
    rng = np.random.default_rng(1)
    mags = np.exp2(rng.uniform(-110, 127, (n, 1, n, 1))).astype(F32)
    mags[0, 0, 0, 0] = np.finfo(F32).max
    mags[1, 0, 1, 0] = F32(2.0**126)
    mags[2, 0, 2, 0] = F32(2.0**-117)
    t = rng.uniform(-1, 1, (n, b, n, b)).astype(F32)
    flat = t.reshape(n, b, n, b).transpose(0, 2, 1, 3).reshape(n, n, b * b)
    idx = np.argmax(np.abs(flat), axis=-1)
    np.put_along_axis(flat, idx[..., None], np.sign(np.take_along_axis(flat, idx[..., None], -1)), -1)  # max = +-1
    w = (flat.reshape(n, n, b, b).transpose(0, 2, 1, 3) * mags).reshape(n * b, n * b).astype(F32)
    p = fp8_block.quantize(jnp.asarray(w), block_size=b)
    q = np.asarray(p[fp8_block.WEIGHT]).astype(F32).reshape(n, b, n, b).transpose(0, 2, 1, 3).reshape(n, n, b * b)
    top = np.take_along_axis(q, idx[..., None], -1)[..., 0]
    sign = np.sign(np.take_along_axis(flat, idx[..., None], -1)[..., 0])
    np.testing.assert_array_equal(top, 448.0 * sign)
    assert not np.any((u8(p[fp8_block.WEIGHT]) & 0x7F) == 0x7F)  # e4m3fn's NaN codes
    s = np.asarray(p[fp8_block.SCALE_INV])
    assert np.all(np.isfinite(s) & (s > 0))
    dq = np.asarray(fp8_block.dequantize(p, w.shape, block_size=b, dtype=jnp.float32))
    assert np.all(np.isfinite(dq))


def _e4m3_error_bound(w: np.ndarray, scale_inv_full: np.ndarray) -> np.ndarray:
    """Half an e4m3 ulp of the scaled value, 2^-4 * max(|v|, 2^-6), back in w's units, plus float32 slack for the
    scale products (s * scale_inv = 1 within an ulp; v and the dequantized product each rounded once)."""
    a = np.abs(w.astype(np.float64))
    return 2.0**-4 * np.maximum(a, 2.0**-6 * scale_inv_full) * (1 + 2.0**-20) + 2.0**-21 * a


@pytest.mark.parametrize("block", fp8_block.BLOCK_SIZES)
@pytest.mark.parametrize("shape", [(130, 200), (7, 300), (300, 7)], ids=["130x200", "7x300", "300x7"])
def test_dequantize_error_bound(shape, block):
    w = make_weight(shape, seed=block + shape[1])
    p = fp8_block.quantize(jnp.asarray(w), block_size=block)
    dq = np.asarray(fp8_block.dequantize(p, shape, block_size=block, dtype=jnp.float32), np.float64)
    s = np.asarray(p[fp8_block.SCALE_INV], np.float64)
    s_full = np.repeat(np.repeat(s, block, 0), block, 1)[: shape[0], : shape[1]]
    err = np.abs(w.astype(np.float64) - dq)
    bound = _e4m3_error_bound(w, s_full)
    assert np.all(err <= bound), float(np.max(err / bound))
    assert np.max(err / bound) > 0.75  # the bound is nearly reached: it is the right one, not a loose one
    assert np.all(err <= 16 * s_full * (1 + 2.0**-20))  # the tile-wide bound, amax / 28
    # bf16 output: the float32 result rounded once
    bf = fp8_block.dequantize(p, shape, block_size=block)
    assert bf.dtype == jnp.bfloat16
    want = dq.astype(F32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("block", fp8_block.BLOCK_SIZES)
@pytest.mark.parametrize("shape", [(130, 200), (1, 1), (513, 65)], ids=["130x200", "1x1", "513x65"])
def test_jit_equals_eager(shape, block):
    w = jnp.asarray(make_weight(shape, seed=2, dtype=ml_dtypes.bfloat16))
    eager = fp8_block.quantize(w, block_size=block)
    jitted = jax.jit(lambda w: fp8_block.quantize(w, block_size=block))(w)
    assert_same_bytes(jitted, eager[fp8_block.WEIGHT], eager[fp8_block.SCALE_INV])
    deq = lambda p: fp8_block.dequantize(p, shape, block_size=block, dtype=jnp.float32)
    np.testing.assert_array_equal(u32(jax.jit(deq)(eager)), u32(deq(eager)))


def test_param_shapes():
    shapes = fp8_block.param_shapes((130, 200), block_size=64)
    assert shapes == {
        "fp8_weight": jax.ShapeDtypeStruct((130, 200), jnp.float8_e4m3fn),
        "fp8_scale_inv": jax.ShapeDtypeStruct((3, 4), jnp.float32),
    }
    assert fp8_block.param_shapes((1, 1))["fp8_scale_inv"].shape == (1, 1)
    assert fp8_block.param_shapes((4096, 12288), block_size=128)["fp8_scale_inv"].shape == (32, 96)
    out = jax.eval_shape(lambda w: fp8_block.quantize(w, block_size=256), jax.ShapeDtypeStruct((7, 300), jnp.float32))
    assert out == fp8_block.param_shapes((7, 300), block_size=256)


def test_hf_round_trip_through_safetensors(tmp_path):
    shape, block = (130, 200), 64
    p = fp8_block.quantize(jnp.asarray(make_weight(shape, seed=9, spread=8)), block_size=block)
    hf = fp8_block.to_hf(p, shape, block_size=block)
    assert set(hf) == {"weight", "weight_scale_inv"}
    assert hf["weight"].dtype == E4M3 and hf["weight"].shape == shape and isinstance(hf["weight"], np.ndarray)
    assert hf["weight_scale_inv"].dtype == np.float32 and hf["weight_scale_inv"].shape == (3, 4)
    entries = [(f"m.{k}", v.dtype, v.shape) for k, v in hf.items()]
    safetensors_io.write_file(tmp_path / "w.safetensors", entries, hf.values())
    f = safetensors_io.SafetensorsFile(tmp_path / "w.safetensors")
    back = fp8_block.from_hf({k: f.get(f"m.{k}") for k in hf}, shape, block)
    assert_same_bytes(back, p[fp8_block.WEIGHT], p[fp8_block.SCALE_INV])
    # bf16 / f16 scales (as some Qwen3 FP8 checkpoints ship) widen exactly to float32
    for dt in (ml_dtypes.bfloat16, np.float16):
        narrow = hf["weight_scale_inv"].astype(dt)
        got = fp8_block.from_hf({"weight": hf["weight"], "weight_scale_inv": narrow}, shape, block)
        assert got["fp8_scale_inv"].dtype == np.float32
        np.testing.assert_array_equal(got["fp8_scale_inv"], narrow.astype(F32))


def test_from_hf_errors():
    shape, block = (130, 200), 64
    good = fp8_block.to_hf(fp8_block.quantize(jnp.ones(shape), block_size=block), shape, block_size=block)
    bad_parts = {
        "weight": [good["weight"].astype(ml_dtypes.bfloat16), good["weight"][:, :128], good["weight"].view(np.uint8)],
        "weight_scale_inv": [good["weight_scale_inv"].astype(np.int32), good["weight_scale_inv"][:, :2],
                             np.full((3, 4), np.inf, F32), good["weight_scale_inv"].astype(np.float64)],
    }
    for part, values in bad_parts.items():
        for v in values:
            with pytest.raises(ValueError, match=f"'{part}'"):
                fp8_block.from_hf({**good, part: v}, shape, block)
        with pytest.raises(ValueError, match=f"missing part '{part}'"):
            fp8_block.from_hf({k: a for k, a in good.items() if k != part}, shape, block)
    with pytest.raises(ValueError, match="weight_scale_inv"):  # the scale grid of another block size
        fp8_block.from_hf(good, shape, 128)


def test_argument_errors():
    w = jnp.ones((130, 200), jnp.float32)
    for b in (32, 100, 512, True, 128.0):
        with pytest.raises(ValueError, match="block_size"):
            fp8_block.quantize(w, block_size=b)
        with pytest.raises(ValueError, match="block_size"):
            fp8_block.param_shapes((130, 200), block_size=b)
    for bad in (jnp.ones((16,)), jnp.ones((2, 16, 16)), jnp.ones((0, 16)), jnp.ones((4, 16), jnp.int32)):
        with pytest.raises(ValueError):
            fp8_block.quantize(bad)
    p = fp8_block.quantize(w, block_size=64)
    with pytest.raises(ValueError, match="fp8_scale_inv"):  # params quantized with another block size
        fp8_block.dequantize(p, (130, 200), block_size=128)
    with pytest.raises(ValueError, match="fp8_weight"):
        fp8_block.dequantize({**p, "fp8_weight": p["fp8_weight"].astype(jnp.bfloat16)}, (130, 200), block_size=64)
    with pytest.raises(ValueError, match="2-D"):
        fp8_block.dequantize(p, (130, 200, 1), block_size=64)
    with pytest.raises(ValueError, match="fp8_weight"):
        fp8_block.to_hf({"fp8_scale_inv": p["fp8_scale_inv"]}, (130, 200), block_size=64)


def test_non_finite_tile_dequantizes_to_nan():
    """A NaN or inf poisons its whole tile (through scale_inv) and nothing else."""
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((130, 200), F32)
        w[70, 5] = bad  # tile (1, 0) of block 64
        dq = np.array(fp8_block.dequantize(fp8_block.quantize(jnp.asarray(w), block_size=64), w.shape,
                                           block_size=64, dtype=jnp.float32))
        assert np.all(np.isnan(dq[64:128, :64])), bad
        dq[64:128, :64] = 1.0
        assert np.all(dq == 1.0), bad
