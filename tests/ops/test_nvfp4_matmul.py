"""NVFP4 GEMM paths on CPU (surogate_jax/precision/g.py): the cuBLASLt scale swizzle
reference against an independent loop over the documented formula, the exact W^T transpose, the
emulated and reference GEMMs, the backend choice (never native on CPU), the one log line, and the
native linear's plumbing (operand orientation, padding, gradients) with the cuBLASLt call replaced
by the fp32 reference GEMM. The native GEMM itself needs an SM100 GPU (tests/gpu/test_nvfp4_matmul_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import nvfp4_matmul as g
from surogate_jax.ops import nvfp4_quantize


def _loop_swizzle(s: np.ndarray, rows: int, row_div: int) -> np.ndarray:
    """The cuBLAS "1D Block Scaling Factors Layout" formula, element by element."""
    cols = s.shape[1]
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros(rp * cp, np.uint8)
    for r in range(rows):
        for c in range(cols):
            off = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            out[off] = s[r // row_div, c]
    return out


def _random_scales(key, shape):
    """E4M3 bytes 1..126 (positive, finite, never 0 so that padding zeros stand out)."""
    b = jax.random.randint(jax.random.key(key), shape, 1, 127).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)


@pytest.mark.parametrize("rows", [1, 127, 129, 300])
@pytest.mark.parametrize("cols", [1, 3, 4, 5, 9])
def test_swizzle_ref_matches_the_documented_formula(rows, cols):
    s = _random_scales(rows * 31 + cols, (rows, cols))
    got = np.asarray(g.swizzle_scales_ref(s, rows))
    want = _loop_swizzle(np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8)), rows, 1)
    assert got.dtype == np.uint8 and got.shape == (g.swizzled_scale_bytes(rows, cols),)
    np.testing.assert_array_equal(got, want)
    assert int(np.count_nonzero(got)) == rows * cols  # everything else is zero padding
    # the dispatching wrapper takes the reference on CPU, and uint8 input is the same bytes
    np.testing.assert_array_equal(np.asarray(g.swizzle_scales(s, rows)), want)
    np.testing.assert_array_equal(np.asarray(g.swizzle_scales_ref(jax.lax.bitcast_convert_type(s, jnp.uint8))), want)


@pytest.mark.parametrize("rows", [16, 40, 300])
def test_swizzle_ref_of_16x16_tiles_repeats_each_tile_row(rows):
    s = _random_scales(rows, (-(-rows // 16), 5))
    got = np.asarray(g.swizzle_scales_ref(s, rows, row_div=16))
    want = _loop_swizzle(np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8)), rows, 16)
    np.testing.assert_array_equal(got, want)
    assert int(np.count_nonzero(got)) == rows * 5


def test_swizzle_anchors_from_the_nvmath_docs():
    # nvmath-python get_block_scale_offset: NVFP4 operand [128, 128] (8 scale columns):
    # scale (5, 2) lands at offset 82, (5, 5) at 593.
    for (r, c), off in (((5, 2), 82), ((5, 5), 593)):
        s = jnp.zeros((128, 8), jnp.uint8).at[r, c].set(7)
        assert np.flatnonzero(np.asarray(g.swizzle_scales_ref(s))).tolist() == [off]


def test_swizzle_rejects_bad_arguments():
    s = _random_scales(0, (4, 3))
    with pytest.raises(ValueError, match="row_div"):
        g.swizzle_scales_ref(s, 4, row_div=8)
    with pytest.raises(ValueError, match="scale rows"):
        g.swizzle_scales_ref(s, 5)
    with pytest.raises(TypeError, match="float8_e4m3fn or uint8"):
        g.swizzle_scales_ref(jnp.ones((4, 3), jnp.float32))


# ---------------------------------------------------------------------------------------------


def test_transpose_of_a_tiled_weight_is_exact():
    w = jax.random.t(jax.random.key(1), 3.0, (48, 80))
    q = nvfp4_quantize.quantize_ref(w, tile_2d=True)
    t = g.transpose(q, impl="ref")
    assert t.shape == (80, 48) and t.tile_2d and t.codes.shape == (80, 24) and t.scales.shape == (5, 3)
    np.testing.assert_array_equal(np.asarray(nvfp4_quantize.dequantize(t)), np.asarray(nvfp4_quantize.dequantize(q)).T)
    # the codes against an independent numpy transpose of the nibbles
    c = np.asarray(q.codes)
    nib = np.stack([c & 15, c >> 4], -1).reshape(48, 80).T
    np.testing.assert_array_equal(np.asarray(t.codes), nib[:, 0::2] | (nib[:, 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(g.transpose_codes(q.codes)), np.asarray(t.codes))
    # Quantizing W^T afresh gives the same tiles here (Four Over Six could only differ where the
    # two candidate errors are equal up to float32 rounding); transpose() is exact by construction.
    qt = nvfp4_quantize.quantize_ref(w.T, tile_2d=True)
    np.testing.assert_array_equal(np.asarray(nvfp4_quantize.dequantize(qt)), np.asarray(nvfp4_quantize.dequantize(t)))
    with pytest.raises(ValueError, match="16x16-tile"):
        g.transpose(nvfp4_quantize.quantize_ref(w))
    with pytest.raises(ValueError, match="multiple of 16"):
        g.transpose(nvfp4_quantize.quantize_ref(w[:40], tile_2d=True))


def test_requantizing_a_cached_weight_recovers_codes_and_block_scales():
    """The native frozen path quantizes the cached bf16 weight again (nvfp4_linear_frozen)."""
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jax.random.t(jax.random.key(2), 3.0, (64, 96)).astype(dtype)
        q0 = nvfp4_quantize.quantize_ref(w, tile_2d=True)
        q1 = nvfp4_quantize.quantize_ref(g.fake_quantize_weight(w, impl="ref"), tile_2d=True)
        np.testing.assert_array_equal(np.asarray(q1.codes), np.asarray(q0.codes))
        np.testing.assert_array_equal(np.asarray(q1.scales.astype(jnp.float32)),
                                      np.asarray(q0.scales.astype(jnp.float32)))
        assert abs(float(q1.global_scale / q0.global_scale) - 1.0) < 2.0 ** -7


# ---------------------------------------------------------------------------------------------


def _operands(m=24, n=48, k=64, seed=3):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = nvfp4_quantize.quantize_ref(jax.random.normal(ka, (m, k)))
    b = nvfp4_quantize.quantize_ref(jax.random.normal(kb, (n, k)) * 0.1)
    return a, b


def test_reference_and_emulated_gemms():
    a, b = _operands()
    da, db = np.asarray(nvfp4_quantize.dequantize(a), np.float64), np.asarray(nvfp4_quantize.dequantize(b), np.float64)
    ref = g.nvfp4_gemm_ref(a, b)
    assert ref.shape == (24, 48) and ref.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ref), da @ db.T, rtol=1e-5, atol=1e-6 * np.abs(da @ db.T).max())
    emu = g.nvfp4_gemm(a, b, jnp.bfloat16, backend="emulated")
    want = jnp.matmul(nvfp4_quantize.dequantize(a).astype(jnp.bfloat16),
                      nvfp4_quantize.dequantize(b).astype(jnp.bfloat16).T,
                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(emu.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # auto on CPU = emulated
    np.testing.assert_array_equal(np.asarray(g.nvfp4_gemm(a, b).astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
    with pytest.raises(ValueError, match="reduction"):
        g.nvfp4_gemm_ref(a, nvfp4_quantize.quantize_ref(jnp.ones((8, 32))))
    with pytest.raises(ValueError, match="backend"):
        g.nvfp4_gemm(a, b, backend="cutlass")


def test_no_native_backend_on_cpu():
    assert not g.native_available()
    assert g.resolve_backend("auto") == "emulated"
    a, b = _operands()
    with pytest.raises(RuntimeError, match="SM100"):
        g.nvfp4_gemm(a, b, backend="native")


def test_one_log_line_says_emulated_and_that_native_is_unrun(caplog):
    from surogate_jax.precision.recipe import QuantRecipe, check_device

    g.log_emulation.cache_clear()
    with caplog.at_level("INFO", logger="surogate_jax"):
        check_device(QuantRecipe("nvfp4"))
        g.nvfp4_linear_emulated(jnp.ones((2, 32)), jnp.ones((32, 32)), jax.random.key(0))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nvfp4:")]
    assert len(lines) == 1, lines
    assert "emulated" in lines[0] and "SM100+" in lines[0] and "has not run on hardware" in lines[0]


# ---------------------------------------------------------------------------------------------
# The native linear's plumbing, with cuBLASLt replaced by the fp32 reference GEMM


@pytest.fixture
def fake_native(monkeypatch):
    calls = []

    def native(a, b, out_dtype=jnp.bfloat16, *, mesh=None):
        assert mesh is None  # these tests run without a mesh (no per-shard split)
        # what the handler demands: 2-D operands sharing K, quantized along K, K % 32, N % 16
        assert len(a.shape) == 2 and len(b.shape) == 2 and a.shape[1] == b.shape[1]
        assert g.native_shape_ok(a.shape[1], b.shape[0]), (a.shape, b.shape)
        assert a.codes.shape == (a.shape[0], a.shape[1] // 2) and b.codes.shape == (b.shape[0], b.shape[1] // 2)
        calls.append((a.shape, a.tile_2d, b.shape, b.tile_2d, jnp.dtype(out_dtype)))
        return g.nvfp4_gemm_ref(a, b, out_dtype)

    monkeypatch.setattr(g, "native_available", lambda device=None, impl=None: True)
    monkeypatch.setattr(g, "nvfp4_gemm_native", native)
    return calls


def _deq(x, **kw):
    return np.asarray(nvfp4_quantize.dequantize(nvfp4_quantize.quantize_ref(x, **kw)), np.float64)


def test_native_linear_orients_operands_and_pads_tokens(fake_native):
    kx, kw, kd = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (2, 19, 64), jnp.float32)  # 38 tokens: padded to 64 for wgrad
    w = jax.random.normal(kw, (64, 96)) * 0.1
    dy = jax.random.normal(kd, (2, 19, 96))
    f = lambda x, w: g.nvfp4_linear_emulated(x, w, jax.random.key(3), stochastic_grad=False,
                                                 rht_sign_mask=None, impl="ref")
    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(dy)
    assert [c[:4] for c in fake_native] == [((38, 64), False, (96, 64), True),   # X @ (W^T tiles)
                                             ((38, 96), False, (64, 96), True),   # dY @ W (stored tiles)
                                             ((64, 64), False, (96, 64), False)]  # X^T @ dY^T^T, T 38 -> 64
    wq = _deq(w, tile_2d=True)
    np.testing.assert_allclose(np.asarray(y).reshape(38, 96), _deq(x.reshape(38, 64)) @ wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx).reshape(38, 64), _deq(dy.reshape(38, 96)) @ wq.T, rtol=1e-5, atol=1e-5)
    xt = jnp.pad(x.reshape(38, 64), ((0, 26), (0, 0))).T
    dyt = jnp.pad(dy.reshape(38, 96), ((0, 26), (0, 0))).T
    np.testing.assert_allclose(np.asarray(dw), _deq(xt) @ _deq(dyt).T, rtol=1e-5, atol=1e-5)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    # close to the emulated path (which rounds the dequantized operands to bf16)
    emu = g.nvfp4_matmul_emulated(x, w, impl="ref")
    np.testing.assert_allclose(np.asarray(y), np.asarray(emu), rtol=0.05, atol=0.05 * float(jnp.abs(emu).max()))


def test_native_linear_with_rht_and_stochastic_rounding_runs(fake_native):
    x = jax.random.normal(jax.random.key(6), (40, 64), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(7), (64, 32)) * 0.1).astype(jnp.bfloat16)
    dx, dw = jax.grad(lambda x, w: jnp.sum(g.nvfp4_linear_emulated(x, w, jax.random.key(1), impl="ref")
                                           .astype(jnp.float32) ** 2), argnums=(0, 1))(x, w)
    exact = jax.grad(lambda x, w: jnp.sum((x.astype(jnp.float32) @ w.astype(jnp.float32)) ** 2), argnums=(0, 1))
    for got, want in zip((dx, dw), exact(x, w), strict=True):
        assert got.dtype == jnp.bfloat16
        got, want = np.asarray(got, np.float32), np.asarray(want)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.3
    assert len(fake_native) == 3 and fake_native[2][0] == (64, 64)  # T = 40 -> 64


def test_native_frozen_linear_matches_the_native_linear(fake_native):
    x = jax.random.normal(jax.random.key(8), (3, 11, 64), jnp.float32)
    w = (jax.random.normal(jax.random.key(9), (64, 32)) * 0.1).astype(jnp.bfloat16)
    key = jax.random.key(4)
    wq = g.fake_quantize_weight(w, impl="ref")
    f1 = lambda x: jnp.sum(jnp.sin(g.nvfp4_linear_frozen(x, wq, key, impl="ref")))
    f2 = lambda x: jnp.sum(jnp.sin(g.nvfp4_linear_emulated(x, w, key, impl="ref")))
    (y1, g1), (y2, g2) = jax.value_and_grad(f1)(x), jax.value_and_grad(f2)(x)
    # bf16 weight: the re-quantized cache has the same codes, scales and global scale
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


def test_shapes_the_native_gemm_does_not_take_stay_emulated(fake_native):
    x = jax.random.normal(jax.random.key(10), (8, 48), jnp.float32)  # K = 48: not a multiple of 32
    w = jax.random.normal(jax.random.key(11), (48, 32)) * 0.1
    y = g.nvfp4_linear_emulated(x, w, jax.random.key(0), impl="ref")
    assert fake_native == []
    np.testing.assert_array_equal(np.asarray(y), np.asarray(g.nvfp4_matmul_emulated(x, w, impl="ref")))
