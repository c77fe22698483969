"""CPU tests of surogate_jax.precision.fp8: quantization bit-exact against numpy/ml_dtypes
(round-to-nearest-even ties, saturation, NaN, subnormals), amax, the delayed-scaling update
(history roll, formula, margin, zero / inf / NaN amax), stacked states, pytree and checkpoint round
trips, and the SM89 check."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.ops import fp8_formats
from surogate_jax.precision import fp8

FORMATS = [(fp8_formats.E4M3, 448.0, ml_dtypes.float8_e4m3fn), (fp8_formats.E5M2, 57344.0, ml_dtypes.float8_e5m2)]


def np_quantize(x, scale, np_dtype, fmax):
    """numpy twin of fp8_formats.quantize: one f32 multiply, clip, ml_dtypes' round-to-nearest-even cast."""
    xs = np.asarray(x, np.float32) * np.float32(scale)
    return np.clip(xs, -fmax, fmax).astype(np_dtype)


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _same_fp8(got, want):
    got, want = np.asarray(got), np.asarray(want)
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(nan_g, nan_w)
    np.testing.assert_array_equal(_bits(got)[~nan_w], _bits(want)[~nan_w])


@pytest.mark.parametrize("fmt,fmax,np_dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_quantize_matches_numpy_bit_exact(fmt, fmax, np_dtype, in_dtype):
    rng = np.random.default_rng(0)
    # wide dynamic range: saturating, normal, subnormal and underflowing values after scaling
    x = rng.normal(size=(37, 53)) * np.exp2(rng.integers(-24, 12, size=(37, 53)))
    x = np.asarray(jnp.asarray(x, in_dtype).astype(jnp.float32))  # representable in in_dtype
    for scale in (1.0, 3.7, 0.011, 1e4):
        got = fp8_formats.quantize(jnp.asarray(x, in_dtype), jnp.float32(scale), fmt)
        assert got.dtype == jnp.dtype(fmt)
        _same_fp8(got, np_quantize(x, scale, np_dtype, fmax))


def test_e4m3_rounding_ties_and_saturation():
    # E4M3 spacing in [1, 2) is 1/8: ties go to the even mantissa
    x = np.array([1.0625, 1.1875, 1.3125, -1.0625, 447.0, 464.0, 480.0, 500.0, 1e9, -1e9,
                  np.inf, -np.inf, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.5, 0.0], np.float32)
    want = np.array([1.0, 1.25, 1.25, -1.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0,
                     448.0, -448.0, 2.0 ** -9, 0.0, 2.0 ** -9, 0.0], np.float32)
    got = np.asarray(fp8_formats.quantize(jnp.asarray(x), 1.0, fp8_formats.E4M3).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert np.isnan(np.asarray(fp8_formats.quantize(jnp.float32(np.nan), 1.0, fp8_formats.E4M3).astype(jnp.float32)))


def test_e5m2_saturation_and_nan():
    x = np.array([57344.0, 61440.0, 1e6, -np.inf, np.inf, 1.125, 1.375, np.nan], np.float32)
    got = np.asarray(fp8_formats.quantize(jnp.asarray(x), 1.0, fp8_formats.E5M2).astype(jnp.float32))
    np.testing.assert_array_equal(got[:7], [57344.0, 57344.0, 57344.0, -57344.0, 57344.0, 1.0, 1.5])
    assert np.isnan(got[7])


def test_dequantize_and_amax():
    x = jnp.asarray([[0.5, -3.0], [2.0, 1.0]], jnp.bfloat16)
    q = fp8_formats.quantize(x, 4.0, fp8_formats.E4M3)
    np.testing.assert_array_equal(np.asarray(fp8_formats.dequantize(q, 4.0)), np.asarray(x, np.float32))
    assert float(fp8_formats.amax(x)) == 3.0
    assert float(fp8_formats.amax(jnp.zeros((0, 3)))) == 0.0
    assert np.isnan(float(fp8_formats.amax(jnp.asarray([1.0, np.nan, 2.0]))))
    assert float(fp8_formats.amax(jnp.asarray([1.0, -np.inf]))) == np.inf


def _np_update(scale, hist, amax, fmax, margin=0.0):
    hist = np.roll(hist, 1)
    hist[0] = amax
    ref = np.max(hist)  # NaN if any NaN
    new = np.float32(fmax) / np.float32(ref) / np.float32(2.0 ** margin) if ref > 0 and np.isfinite(ref) else scale
    return np.float32(new), hist


def test_update_follows_the_formula_over_many_steps():
    h = 4
    state = fp8_formats.init_tensor_state(h)
    np_scale, np_hist = np.float32(1.0), np.zeros(h, np.float32)
    amaxes = [2.0, 0.5, 0.0, 8.0, 1.0, 0.25, 0.1, 0.3, np.inf, 0.2, 0.2, 0.2, 0.2, 0.2, np.nan, 3.0]
    for a in amaxes:
        state = fp8.update_tensor_state(state, jnp.float32(a), 448.0)
        np_scale, np_hist = _np_update(np_scale, np_hist, a, 448.0)
        np.testing.assert_array_equal(np.asarray(state.amax_history), np_hist)
        assert np.float32(state.scale) == np_scale, (a, float(state.scale), np_scale)
    # spot checks of the rule: history max, not the latest amax
    s = fp8_formats.init_tensor_state(3)
    s = fp8.update_tensor_state(s, 4.0, 448.0)
    s = fp8.update_tensor_state(s, 1.0, 448.0)
    assert float(s.scale) == 112.0  # 448 / max(4, 1)
    s = fp8.update_tensor_state(s, 1.0, 448.0)
    s = fp8.update_tensor_state(s, 1.0, 448.0)  # 4.0 rolled out of the 3-entry window
    assert float(s.scale) == 448.0


def test_zero_and_nonfinite_amax_keep_the_scale_and_margin():
    s = fp8_formats.Fp8TensorState(jnp.float32(7.0), jnp.zeros(2, jnp.float32))
    assert float(fp8.update_tensor_state(s, 0.0, 448.0).scale) == 7.0  # all-zero history
    assert float(fp8.update_tensor_state(s, np.inf, 448.0).scale) == 7.0
    assert float(fp8.update_tensor_state(s, np.nan, 448.0).scale) == 7.0
    assert float(fp8.update_tensor_state(s, 1e-40, 448.0).scale) == 7.0  # 448 / 1e-40 overflows
    assert float(fp8.update_tensor_state(s, 2.0, 57344.0, margin=1.0).scale) == 57344.0 / 2.0 / 2.0


def test_stacked_states_update_per_layer():
    st = fp8_formats.init_matmul_state(5, shape=(3,))
    assert st.x.scale.shape == (3,) and st.g.amax_history.shape == (3, 5)
    d = jax.tree.map(jnp.zeros_like, st)
    d = fp8_formats.Fp8MatmulState(fp8_formats.Fp8TensorState(jnp.asarray([1.0, 2.0, 0.0]), d.x.amax_history), d.w,
                           fp8_formats.Fp8TensorState(jnp.asarray([4.0, 8.0, 16.0]), d.g.amax_history))
    new = fp8.update({"layers": st}, {"layers": d})["layers"]
    np.testing.assert_array_equal(np.asarray(new.x.scale), [448.0, 224.0, 1.0])
    np.testing.assert_array_equal(np.asarray(new.w.scale), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(new.g.scale), [14336.0, 7168.0, 3584.0])
    np.testing.assert_array_equal(np.asarray(new.g.amax_history[:, 0]), [4.0, 8.0, 16.0])


def test_combine_observations_is_max():
    a = fp8_formats.init_matmul_state(2)
    b = jax.tree.map(lambda v: v + 3.0, a)
    c = fp8.combine_observations(a, b)
    assert float(c.x.scale) == 4.0
    nan = jax.tree.map(lambda v: v * np.nan, a)
    assert np.isnan(float(fp8.combine_observations(b, nan).g.scale))


def test_state_is_a_checkpointable_pytree(tmp_path):
    st = {"q_proj": fp8_formats.init_matmul_state(16), "mlp": fp8_formats.init_matmul_state(16, shape=(2,))}
    st = jax.tree.map(lambda v: v + jnp.arange(v.size, dtype=v.dtype).reshape(v.shape), st)
    leaves, treedef = jax.tree.flatten(st)
    assert len(leaves) == 12 and all(v.dtype == jnp.float32 for v in leaves)
    assert jax.tree.structure(jax.tree.map(lambda v: v, st)) == treedef
    # through host numpy files, keyed by tree path (what a checkpointer does)
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(st)[0]}
    np.savez(tmp_path / "fp8.npz", **flat)
    loaded = np.load(tmp_path / "fp8.npz")
    restored = jax.tree.unflatten(treedef, [jnp.asarray(loaded[k]) for k in flat])
    assert isinstance(restored["mlp"], fp8_formats.Fp8MatmulState)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), st, restored)
    # jit carries it, and an update of the restored state equals the update of the original
    d = jax.tree.map(lambda v: jnp.full_like(v, 2.0), st)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 jax.jit(fp8.update)(st, d), fp8.update(restored, d))


def _device(platform, cc, kind="NVIDIA A100-SXM4-80GB"):
    return types.SimpleNamespace(platform=platform, compute_capability=cc, device_kind=kind, id=0)


def test_check_fp8_supported():
    assert fp8.check_fp8_supported(jax.devices("cpu")[0]) is False
    assert fp8.check_fp8_supported(_device("gpu", "9.0", "NVIDIA H100 80GB HBM3")) is True
    assert fp8.check_fp8_supported(_device("gpu", "8.9", "NVIDIA L4")) is True
    assert fp8.check_fp8_supported(_device("gpu", "12.0", "NVIDIA RTX 5090")) is True
    with pytest.raises(fp8.Fp8UnsupportedError, match=r"A100.*8\.0.*bf16"):
        fp8.check_fp8_supported(_device("gpu", "8.0"))
    with pytest.raises(fp8.Fp8UnsupportedError, match="gfx90a"):
        fp8.check_fp8_supported(_device("gpu", "gfx90a", "AMD MI250"))
