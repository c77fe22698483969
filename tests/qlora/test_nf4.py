"""surogate_jax.qlora.nf4 against bitsandbytes (the oracle): the same bytes, the same dequantized bits.

bitsandbytes runs on the CPU here (its CPU backend is what nf4.py reproduces); torch's sum is serial below 32768
elements, which covers every absmax vector quantized below except where a test pins torch to one thread.
"""

from __future__ import annotations

import json

import bitsandbytes.functional as bnbF
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from surogate_jax.qlora import nf4

SHAPES = [(7, 33), (1, 1), (13, 1000), (64, 64), (100, 130)]
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _torch(w: np.ndarray) -> torch.Tensor:
    if w.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(w).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(w).copy())


def _bnb(w: np.ndarray, block_size: int, double_quant: bool):
    """bnb's packed weight + as_dict(packed=True), keyed as transformers saves them; and (q, state) for dequant."""
    q, st = bnbF.quantize_4bit(_torch(w), blocksize=block_size, quant_type="nf4", compress_statistics=double_quant)
    parts = {"weight": q.numpy()}
    parts.update({"weight." + k: v.numpy() for k, v in st.as_dict(packed=True).items()})
    return parts, q, st


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def _assert_parts_equal(ours: dict, ref: dict) -> None:
    assert list(ours) == list(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype, (k, ours[k].dtype, ref[k].dtype)
        assert ours[k].shape == ref[k].shape, (k, ours[k].shape, ref[k].shape)
        if ours[k].tobytes() != ref[k].tobytes():
            a, b = ours[k].reshape(-1), ref[k].reshape(-1)
            bad = np.nonzero(_bits(a) != _bits(b))[0]
            raise AssertionError(f"{k}: {bad.size} differ, first at {bad[:5]}: ours {a[bad[:5]]}, bnb {b[bad[:5]]}")


def _weights(shape, dtype, seed):
    """A standard normal weight and an outlier-heavy one (a few values x100), in `dtype`."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(shape).astype(np.float32) * 0.02
    outliers = rng.standard_normal(shape).astype(np.float32)
    flat = outliers.reshape(-1)
    flat[rng.integers(0, flat.size, max(1, flat.size // 200))] *= 100.0
    return [normal.astype(dtype), outliers.astype(dtype)]


def test_tables_match_bnb():
    assert _bits(nf4.NF4_CODE).tolist() == _bits(bnbF.get_4bit_type("nf4", device="cpu").numpy()).tolist()
    assert _bits(nf4.DYNAMIC_MAP).tolist() == _bits(bnbF.create_dynamic_map().numpy()).tolist()
    # Anchors from the reference text (4a/4e): no -1.0 in the signed map, exact 0 in NF4.
    assert nf4.DYNAMIC_MAP.dtype == np.float32 and nf4.DYNAMIC_MAP.shape == (256,)
    assert nf4.DYNAMIC_MAP[0] == np.float32(-0.99296875) and nf4.DYNAMIC_MAP[-1] == 1.0
    assert np.unique(nf4.DYNAMIC_MAP).size == 256
    assert abs(nf4.DYNAMIC_MAP[nf4.DYNAMIC_MAP > 0].min() - 5.5e-7) < 1e-12
    assert nf4.NF4_CODE[0] == -1.0 and nf4.NF4_CODE[7] == 0.0 and nf4.NF4_CODE[15] == 1.0
    assert np.all(np.diff(nf4.NF4_CODE) > 0)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("block_size", nf4.BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_bytes_equal_bnb(shape, block_size, double_quant):
    """Normal and outlier-heavy weights, fp32 and bf16 inputs (one compile: the input is cast before the jit)."""
    for dtype in sorted(DTYPES):
        for w in _weights(shape, DTYPES[dtype], seed=shape[0] * 7 + shape[1] + block_size):
            ours = nf4.quantize_nf4(w, block_size=block_size, double_quant=double_quant)
            ref, _, _ = _bnb(w, block_size, double_quant)
            _assert_parts_equal(ours, ref)
            assert json.loads(bytes(ours["weight.quant_state.bitsandbytes__nf4"]))["dtype"] == dtype


def test_float16_input_and_larger_absmax_vectors():
    """fp16 input; absmax vectors of thousands of blocks (the mean's cascade sum, many DQ blocks)."""
    rng = np.random.default_rng(3)
    w16 = (rng.standard_normal((96, 200)) * 0.05).astype(np.float16)
    _assert_parts_equal(nf4.quantize_nf4(w16, block_size=64), _bnb(w16, 64, True)[0])
    heavy = (rng.standard_t(2, (512, 1024)) * 0.02).astype(np.float32)  # 8192 blocks of 64
    _assert_parts_equal(nf4.quantize_nf4(heavy, block_size=64), _bnb(heavy, 64, True)[0])


@pytest.mark.parametrize("double_quant", [False, True])
def test_special_blocks(double_quant):
    """Zero blocks, all-equal blocks, all-negative blocks, values exactly on NF4 decision midpoints, a zero tail."""
    rng = np.random.default_rng(4)
    mids = (nf4.NF4_CODE[:-1] + nf4.NF4_CODE[1:]) / np.float32(2)  # bnb's decision thresholds, hit exactly
    blocks = [
        np.zeros(64),
        np.full(64, 0.37),
        np.full(64, -2.5),
        -np.abs(rng.standard_normal(64)) - 0.1,
        np.concatenate([[1.0], mids, -mids, rng.uniform(-1, 1, 33)]),
        rng.standard_normal(64),
        np.zeros(64),
    ]
    flat = np.concatenate(blocks + [np.zeros(24)]).astype(np.float32)  # 7 full blocks + a 24-value zero tail
    w = flat.reshape(8, 59)
    ours = nf4.quantize_nf4(w, block_size=64, double_quant=double_quant)
    _assert_parts_equal(ours, _bnb(w, 64, double_quant)[0])
    params = nf4.quantize(w, block_size=64, double_quant=double_quant)
    if not double_quant:
        absmax = np.asarray(params["nf4_absmax"])
        assert absmax[0] == 0.0 and absmax[6] == 0.0  # an all-zero full block stores 0 ...
        assert _bits(absmax[7]) == _bits(np.float32(1e-38))  # ... an all-zero tail stores the 1e-38 clamp
    codes = np.asarray(params["nf4_codes"])
    assert np.all(codes[:32] == 0x77)  # zero block: every code is 7 (0.0)
    assert np.all(codes[32:64] == 0xFF) and np.all(codes[64:96] == 0x00)  # +x block -> 15, -x block -> 0


def test_scaling_op_order_full_blocks_vs_tail():
    """bnb scales full blocks by x * (1 / absmax) but the short tail by x / absmax: values where the two orders
    pick different NF4 codes must follow bnb's order in each place."""
    bounds = (nf4.NF4_CODE[:-1] + nf4.NF4_CODE[1:]) / np.float32(2)
    picks = {}
    for a in np.float32([3.0, 0.7, 1.3, 5.1, 2.9]):
        for b in bounds:
            xs = (np.float32(b * a).view(np.int32) + np.arange(-40, 41, dtype=np.int32)).view(np.float32)
            xs = xs[np.abs(xs) < a]
            split = ((xs / a) > b) != ((xs * (np.float32(1) / a)) > b)
            picks.setdefault(float(a), []).extend(xs[split].tolist())
    a, xs = max(picks.items(), key=lambda kv: len(kv[1]))
    assert len(xs) >= 3  # the two orders really disagree on these values
    block = np.resize(np.array([a] + xs, np.float32), 64)
    tail = np.array([a] + xs, np.float32)
    w = np.concatenate([block, block, tail]).reshape(1, -1)  # two full blocks and a short tail of the same values
    for double_quant in (False, True):
        _assert_parts_equal(nf4.quantize_nf4(w, double_quant=double_quant), _bnb(w, 64, double_quant)[0])
    codes = np.asarray(nf4.quantize(w, double_quant=False)["nf4_codes"])
    q = np.stack([codes >> 4, codes & 15], 1).reshape(-1)[: w.size]
    n = len(xs) + 1
    assert not np.array_equal(q[1:n], q[128 + 1 : 128 + n])  # same values, different codes: the orders differ


def test_odd_numel_pads_low_nibble_with_code_of_zero():
    w = np.full((3, 7), -1.0, np.float32)  # 21 values: every code 0, the pad nibble is 7
    codes = np.asarray(nf4.quantize(w, double_quant=False)["nf4_codes"])
    assert codes.shape == (11,) and codes[:10].tolist() == [0] * 10 and codes[10] == 0x07
    _assert_parts_equal(nf4.quantize_nf4(w, double_quant=False), _bnb(w, 64, False)[0])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("block_size", nf4.BLOCK_SIZES)
def test_dequantize_equals_bnb(block_size, double_quant, dtype):
    # bnb 0.50.2's AVX512 CPU kernel reads absmax wrongly unless `in` is a multiple of the block (or odd), so the
    # bnb comparison uses such a shape; the others are checked against the formula in numpy below.
    w = _weights((24, 1024), DTYPES[dtype], seed=block_size)[1]
    ref_parts, q, st = _bnb(w, block_size, double_quant)
    ref = bnbF.dequantize_4bit(q, st, quant_type="nf4")
    params, bs, dq = nf4.from_hf(ref_parts, w.shape)
    ours = nf4.dequantize(params, w.shape, block_size=bs, double_quant=dq, dtype=jnp.dtype(dtype))
    assert ours.dtype == jnp.dtype(dtype) and ref.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    ref_np = ref.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if dtype == "bfloat16" else ref.numpy()
    np.testing.assert_array_equal(_bits(ours), _bits(ref_np))


def test_dequantize_odd_in_features_equals_bnb():
    w = _weights((9, 77), np.float32, seed=5)[1]  # odd `in`: bnb's CPU backend falls back to its torch code
    ref_parts, q, st = _bnb(w, 64, True)
    ref = bnbF.dequantize_4bit(q, st, quant_type="nf4").numpy()
    np.testing.assert_array_equal(_bits(nf4.dequantize_nf4(ref_parts)), _bits(ref))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantize_formula(shape, double_quant):
    """dequantize = NF4_CODE[q] * absmax, absmax = DYNAMIC_MAP[q2] * absmax2 + offset (fp32, numpy here)."""
    w = _weights(shape, np.float32, seed=6)[1]
    params = {k: np.asarray(v) for k, v in nf4.quantize(w, block_size=64, double_quant=double_quant).items()}
    n = w.size
    q = np.stack([params["nf4_codes"] >> 4, params["nf4_codes"] & 15], 1).reshape(-1)[:n]
    if double_quant:
        a2 = np.repeat(params["nf4_absmax2"], 256)[: params["nf4_absmax"].size]
        absmax = nf4.DYNAMIC_MAP[params["nf4_absmax"]] * a2 + params["nf4_offset"]
    else:
        absmax = params["nf4_absmax"]
    expect = (nf4.NF4_CODE[q] * np.repeat(absmax, 64)[:n]).reshape(shape)
    got = nf4.dequantize(params, shape, block_size=64, double_quant=double_quant, dtype=jnp.float32)
    np.testing.assert_array_equal(_bits(got), _bits(expect.astype(np.float32)))
    # And a faithful 4-bit copy: within half the widest NF4 gap of each block's true absmax, plus the DQ error.
    true_absmax = np.repeat(np.abs(np.pad(w.reshape(-1), (0, -n % 64))).reshape(-1, 64).max(1), 64)[:n]
    dq_err = np.abs(np.repeat(absmax, 64)[:n] - true_absmax)
    bound = true_absmax * np.max(np.diff(nf4.NF4_CODE)) / 2 * (1 + 1e-6) + dq_err
    assert np.all(np.abs(np.asarray(got) - w).reshape(-1) <= bound)


@pytest.mark.parametrize("double_quant", [False, True])
def test_hf_round_trip(double_quant, tmp_path):
    from safetensors.numpy import load_file, save_file

    w = _weights((100, 130), ml_dtypes.bfloat16, seed=7)[1]
    params = nf4.quantize(w, block_size=128, double_quant=double_quant)
    parts = nf4.to_hf(params, w.shape, block_size=128, double_quant=double_quant, dtype="bfloat16")
    assert parts["weight"].shape == (6500, 1) and parts["weight"].dtype == np.uint8
    save_file({"model.layers.0.mlp.down_proj." + k: v for k, v in parts.items()}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    loaded = {k.removeprefix("model.layers.0.mlp.down_proj."): v for k, v in loaded.items()}
    back, bs, dq = nf4.from_hf(loaded, w.shape)
    assert (bs, dq) == (128, double_quant) and sorted(back) == sorted(params)
    for k in params:
        assert back[k].dtype == np.asarray(params[k]).dtype and back[k].shape == np.shape(params[k])
        np.testing.assert_array_equal(_bits(back[k]), _bits(params[k]))
    # A checkpoint bnb made reads into params that write it back byte for byte.
    ref, _, _ = _bnb(w, 128, double_quant)
    p2, bs2, dq2 = nf4.from_hf(ref, w.shape)
    _assert_parts_equal(nf4.to_hf(p2, w.shape, block_size=bs2, double_quant=dq2, dtype="bfloat16"), ref)


def _dq_parts():
    w = _weights((7, 33), np.float32, seed=8)[0]
    return nf4.quantize_nf4(w, block_size=64, double_quant=True), w.shape


def _with_blob(parts, **changes):
    blob = json.loads(bytes(parts["weight.quant_state.bitsandbytes__nf4"]))
    blob.update(changes)
    out = dict(parts)
    out["weight.quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(blob).encode(), np.uint8)
    return out


def test_from_hf_errors():
    parts, shape = _dq_parts()
    nf4.from_hf(parts, shape)  # the unmodified parts read fine

    bad_map = dict(parts, **{"weight.quant_map": nf4.NF4_CODE[::-1].copy()})
    with pytest.raises(ValueError, match="weight.quant_map"):
        nf4.from_hf(bad_map, shape)
    bad_nested = dict(parts, **{"weight.nested_quant_map": np.linspace(-1, 1, 256, dtype=np.float32)})
    with pytest.raises(ValueError, match="weight.nested_quant_map"):
        nf4.from_hf(bad_nested, shape)
    with pytest.raises(ValueError, match=r"shape \[7, 33\] does not match the expected \[33, 7\]"):
        nf4.from_hf(parts, (33, 7))
    with pytest.raises(ValueError, match="quant_type must be 'nf4', got 'fp4'"):
        nf4.from_hf(_with_blob(parts, quant_type="fp4"), shape)
    fp4 = {k.replace("bitsandbytes__nf4", "bitsandbytes__fp4"): v for k, v in parts.items()}
    with pytest.raises(ValueError, match="quant_type.*bitsandbytes__fp4"):
        nf4.from_hf(fp4, shape)
    with pytest.raises(ValueError, match="blocksize must be one of"):
        nf4.from_hf(_with_blob(parts, blocksize=32), shape)
    with pytest.raises(ValueError, match="nested_blocksize"):
        nf4.from_hf(_with_blob(parts, nested_blocksize=128), shape)
    for key in ("weight", "weight.absmax", "weight.quant_map", "weight.nested_quant_map",
                "weight.quant_state.bitsandbytes__nf4"):
        with pytest.raises(ValueError, match=f"missing part '{key}'"):
            nf4.from_hf({k: v for k, v in parts.items() if k != key}, shape)
    no_nested = {k: v for k, v in parts.items() if k != "weight.nested_absmax"}
    with pytest.raises(ValueError, match="nested fields present"):
        nf4.from_hf(no_nested, shape)
    with pytest.raises(ValueError, match="'weight.absmax' must be uint8 \\[4\\]"):
        nf4.from_hf(dict(parts, **{"weight.absmax": parts["weight.absmax"][:3]}), shape)
    with pytest.raises(ValueError, match="'weight' must hold 116 bytes"):
        nf4.from_hf(dict(parts, **{"weight": parts["weight"][:-1]}), shape)
    with pytest.raises(ValueError, match="'weight.nested_absmax' must be float32"):
        nf4.from_hf(dict(parts, **{"weight.nested_absmax": parts["weight.nested_absmax"].astype(np.float16)}), shape)
    garbage = dict(parts, **{"weight.quant_state.bitsandbytes__nf4": np.frombuffer(b"{not json", np.uint8)})
    with pytest.raises(ValueError, match="not a UTF-8 JSON object"):
        nf4.from_hf(garbage, shape)


def test_argument_errors():
    w = np.ones((4, 8), np.float32)
    for bs in (32, 1024, True):
        with pytest.raises(ValueError, match="block_size"):
            nf4.quantize(w, block_size=bs)
    with pytest.raises(ValueError, match="block_size"):
        nf4.param_shapes((4, 8), block_size=100)
    for bad in (np.ones(8, np.float32), np.ones((2, 2, 2), np.float32)):
        with pytest.raises(ValueError, match="w must be a 2-D"):
            nf4.quantize(bad)
    with pytest.raises(ValueError, match="w must be a floating-point"):
        nf4.quantize(np.ones((4, 8), np.int32))
    with pytest.raises(ValueError, match="w must be float32, bfloat16 or float16"):
        nf4.quantize_nf4(np.ones((4, 8), np.float64))
    params = nf4.quantize(w)
    with pytest.raises(ValueError, match="dtype must be one of"):
        nf4.to_hf(params, (4, 8), dtype="float64")
    with pytest.raises(ValueError, match=r"params\['nf4_codes'\] must be uint8 \(18,\)"):
        nf4.dequantize(params, (4, 9))
    with pytest.raises(ValueError, match="params is missing 'nf4_offset'"):
        nf4.dequantize({k: v for k, v in params.items() if k != "nf4_offset"}, (4, 8))


@pytest.mark.parametrize("double_quant", [False, True])
def test_jit_equals_eager_and_param_shapes(double_quant):
    w = jnp.asarray(_weights((100, 130), ml_dtypes.bfloat16, seed=9)[1])
    eager = nf4.quantize(w, block_size=256, double_quant=double_quant)
    jitted = jax.jit(lambda a: nf4.quantize(a, block_size=256, double_quant=double_quant))(w)
    shapes = nf4.param_shapes((100, 130), block_size=256, double_quant=double_quant)
    assert sorted(eager) == sorted(jitted) == sorted(shapes)
    for k in eager:
        assert eager[k].shape == jitted[k].shape == shapes[k].shape and eager[k].dtype == shapes[k].dtype
        np.testing.assert_array_equal(_bits(eager[k]), _bits(jitted[k]))
    assert jax.eval_shape(lambda a: nf4.quantize(a, block_size=256, double_quant=double_quant), w) == shapes
    deq = jax.jit(lambda p: nf4.dequantize(p, (100, 130), block_size=256, double_quant=double_quant))(eager)
    assert deq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        _bits(deq), _bits(nf4.dequantize(eager, (100, 130), block_size=256, double_quant=double_quant))
    )


def test_public_api_round_trip():
    w = _weights((13, 1000), np.float32, seed=10)[1]
    parts = nf4.quantize_nf4(w)
    ref_parts, q, st = _bnb(w, 64, True)
    _assert_parts_equal(parts, ref_parts)
    ours = nf4.dequantize_nf4(parts)
    assert ours.dtype == np.float32 and ours.shape == w.shape
    # 1000 % 64 != 0 trips bnb's AVX512 CPU kernel; its portable torch path is the reference here.
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = bnbF.dequantize_blockwise(st.absmax, st.state2) + st.offset
    fn = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    ref = fn(q.reshape(-1), absmax, bnbF.get_4bit_type("nf4", device="cpu"), 64, w.shape, torch.float32)
    np.testing.assert_array_equal(_bits(ours), _bits(ref.numpy()))


def test_torch_cpu_sum_order():
    """The DQ offset's sum follows torch's serial CPU order, also past the cascade's deeper levels."""
    rng = np.random.default_rng(11)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in [1, 3, 7, 8, 9, 31, 64, 100, 1000, 4097, 70001, 140000]:
            x = np.abs(rng.standard_normal(n)).astype(np.float32) * 3
            got = jax.jit(nf4._torch_cpu_sum)(jnp.asarray(x))
            assert _bits(got) == _bits(np.float32(torch.from_numpy(x).sum().item())), n
            mean = torch.from_numpy(x).mean().numpy()
            assert _bits(nf4._div_rn(got, jnp.float32(n))) == _bits(mean), n
    finally:
        torch.set_num_threads(threads)


def test_dq_8bit_codes_equal_bnb():
    """The 8-bit DQ quantizer (bnb CPU lookup table, via thresholds) on many values, short last block included."""
    rng = np.random.default_rng(12)
    c = np.concatenate([rng.uniform(-1, 1, 200_000), rng.standard_normal(100_000) * 1e-3, rng.standard_t(1, 999)])
    c = c.astype(np.float32)
    q_ref, st = bnbF.quantize_blockwise(torch.from_numpy(c), blocksize=256)
    q, a2 = jax.jit(nf4._quantize_8bit)(jnp.asarray(c))
    np.testing.assert_array_equal(_bits(a2), _bits(st.absmax.numpy()))
    np.testing.assert_array_equal(np.asarray(q), q_ref.numpy())


def test_div_rn_is_correctly_rounded():
    rng = np.random.default_rng(13)
    x = np.concatenate([rng.standard_normal(20000), [1.0, -1.0, 3.0, 0.0, -0.0, 7e-39]]).astype(np.float32)
    y = np.concatenate([np.exp(rng.uniform(-80, 80, 20000)), [3.0, 1e-38, 0.75, 2.0, 5.0, 1e-38]]).astype(np.float32)
    with np.errstate(all="ignore"):
        expect = x / y
    normal = (np.abs(expect) >= np.finfo(np.float32).tiny) | (expect == 0)
    got = np.asarray(jax.jit(nf4._div_rn)(jnp.asarray(x), jnp.asarray(y)))
    assert normal.sum() > 15000
    np.testing.assert_array_equal(_bits(got[normal]), _bits(expect[normal]))
    recip = np.asarray(jax.jit(nf4._div_rn)(jnp.ones_like(y), jnp.asarray(y)))
    ok = np.abs(1 / y) < np.finfo(np.float32).max
    np.testing.assert_array_equal(_bits(recip[ok]), _bits((np.float32(1) / y)[ok]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(("block_size", "double_quant"), [(64, True), (64, False), (256, True)])
def test_fp8_weight_equals_the_recipe_cache_of_the_dequantized_weight(block_size, double_quant, dtype):
    """fp8-hybrid's QLoRA weight (one kernel pass, max|W| from the absmaxes) is, bit for bit, what the frozen cache
    (precision.recipe.cache_kernel) makes of the weight dequantized in the model dtype; zero blocks included."""
    from surogate_jax.ops import fp8_formats
    from surogate_jax.precision.recipe import QuantRecipe, cache_kernel

    shape = (96, 200)
    w = np.random.default_rng(block_size).standard_normal(shape).astype(np.float32) * 0.02
    w[3, :] = 0.0  # whole zero blocks
    w[5, 7] = -0.9  # an outlier: the tensor's max |value| is a negative one
    params = nf4.quantize(jnp.asarray(w), block_size=block_size, double_quant=double_quant)
    wq, scale = nf4.fp8_weight(params, shape, block_size=block_size, double_quant=double_quant, dtype=dtype)
    deq = nf4.dequantize(params, shape, block_size=block_size, double_quant=double_quant, dtype=dtype)
    want_q, want_scale = cache_kernel(QuantRecipe("fp8-hybrid"), "q_proj", deq.T[None], 1)
    assert wq.dtype == jnp.dtype(fp8_formats.E4M3) and wq.shape == shape
    np.testing.assert_array_equal(np.float32(scale), np.float32(want_scale[0]))
    np.testing.assert_array_equal(_bits(wq), _bits(np.asarray(want_q[0])))  # the cache is [L, out, in] too
    assert float(scale) == pytest.approx(448 / 0.9, rel=2e-2)  # the outlier sets the scale (NF4's error aside)
