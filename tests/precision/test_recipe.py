"""The recipe's GEMM entries on their own: the frozen (pre-quantized weight) FP8 and NVFP4 paths
equal the per-step paths given the same weight quantization and return no weight gradient; the
bf16 recipe's mixed-dtype GEMM rounds where the tables say."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import fp8_formats, nvfp4_matmul
from surogate_jax.ops.fp8_matmul import fp8_matmul, fp8_matmul_frozen
from surogate_jax.precision.recipe import QuantRecipe, linear, mixed_linear


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    # the mixed-GEMM comparisons use plain fp32 dots (TF32 on a GPU otherwise)
    with jax.default_matmul_precision("highest"):
        yield


def _state(s_x=2.0, s_w=3.0, s_g=5.0):
    st = fp8_formats.init_matmul_state(4)
    return fp8_formats.Fp8MatmulState(*(fp8_formats.Fp8TensorState(jnp.float32(s), t.amax_history) for s, t in
                                zip((s_x, s_w, s_g), (st.x, st.w, st.g), strict=True)))


@pytest.mark.parametrize("impl", ["ref", "xla"])
def test_fp8_frozen_equals_fp8_matmul_with_the_same_weight_scale(impl):
    x = jax.random.normal(jax.random.key(0), (7, 48), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (48, 32), jnp.float32)
    s_w = fp8_formats.E4M3_MAX / float(jnp.max(jnp.abs(w)))  # current scaling, as the cache does
    st = _state(s_w=s_w)
    wq = fp8_formats.quantize(w, s_w, fp8_formats.E4M3)

    def f_frozen(x, st):
        return jnp.sum(jnp.sin(fp8_matmul_frozen(x, wq, jnp.float32(s_w), st, impl=impl)))

    def f_plain(x, st):
        return jnp.sum(jnp.sin(fp8_matmul(x, w, st, impl=impl)))

    (y1, (dx1, ds1)) = jax.value_and_grad(f_frozen, argnums=(0, 1))(x, st)
    (y2, (dx2, ds2)) = jax.value_and_grad(f_plain, argnums=(0, 1))(x, st)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx2))
    # observations: x and dY amaxes as usual; the frozen weight's amax is not observed
    assert float(ds1.x.scale) == float(ds2.x.scale) and float(ds1.g.scale) == float(ds2.g.scale)
    assert float(ds1.w.scale) == 0.0 and float(ds2.w.scale) == float(jnp.max(jnp.abs(w)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_matmul_frozen(x, w, jnp.float32(1.0), st)


@pytest.mark.parametrize("impl", ["ref", "xla"])
def test_fp8_frozen_nk_layout_equals_kn(impl):
    """w_layout="nk" (a QLoRA base's HF layout) gives the same y, dx and observations as the [K, N] cache."""
    x = jax.random.normal(jax.random.key(0), (7, 48), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (48, 32), jnp.float32)
    s_w = jnp.float32(fp8_formats.E4M3_MAX / float(jnp.max(jnp.abs(w))))
    wq = fp8_formats.quantize(w, s_w, fp8_formats.E4M3)
    st = _state(s_w=float(s_w))

    def f(x, st, wq, layout):
        return jnp.sum(jnp.sin(fp8_matmul_frozen(x, wq, s_w, st, impl=impl, w_layout=layout)))

    y1, g1 = jax.value_and_grad(f, argnums=(0, 1))(x, st, wq, "kn")
    y2, g2 = jax.value_and_grad(f, argnums=(0, 1))(x, st, wq.T, "nk")
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="wq \\[N, K\\]"):
        fp8_matmul_frozen(x, wq, s_w, st, w_layout="nk")
    with pytest.raises(ValueError, match="w_layout"):
        fp8_matmul_frozen(x, wq, s_w, st, w_layout="t")


def test_nvfp4_frozen_equals_emulated_linear():
    x = jax.random.normal(jax.random.key(0), (2, 9, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 48), jnp.float32)
    key = jax.random.key(4)
    wq = nvfp4_matmul.fake_quantize_weight(w, impl="ref")
    f1 = lambda x: jnp.sum(jnp.sin(nvfp4_matmul.nvfp4_linear_frozen(x, wq, key, impl="ref")))
    f2 = lambda x: jnp.sum(jnp.sin(nvfp4_matmul.nvfp4_linear_emulated(x, w, key, impl="ref")))
    (y1, g1), (y2, g2) = jax.value_and_grad(f1)(x), jax.value_and_grad(f2)(x)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


def test_mixed_linear_rounds_operands_and_gradients():
    x = jax.random.normal(jax.random.key(0), (6, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (6, 16), jnp.float32)
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
    y, vjp = jax.vjp(lambda x, w: mixed_linear(x, w, jnp.bfloat16, jnp.float32, jnp.float32), x, w)
    np.testing.assert_allclose(y, bf(x) @ bf(w), rtol=1e-6, atol=1e-6)
    dx, dw = vjp(dy)  # gradient_dtype fp32: the backward GEMMs see the unrounded operands
    np.testing.assert_allclose(dx, dy @ w.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, x.T @ dy, rtol=1e-6, atol=1e-6)
    _, vjp = jax.vjp(lambda x, w: mixed_linear(x, w, jnp.float32, jnp.bfloat16, jnp.float32), x, w)
    dx, dw = vjp(dy)
    np.testing.assert_allclose(dx, bf(dy) @ bf(w).T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, bf(x).T @ bf(dy), rtol=1e-6, atol=1e-6)


def test_linear_reshapes_o_proj_style_kernels():
    x = jax.random.normal(jax.random.key(0), (2, 5, 4, 16), jnp.float32)  # [B, T, H, K]
    w = jax.random.normal(jax.random.key(1), (4, 16, 32), jnp.float32)  # [H, K, D]
    st = _state()
    y = linear(QuantRecipe("fp8-hybrid", fp8_impl="ref"), x, w, in_dims=2, dtype=jnp.float32, fp8_state=st)
    want = fp8_matmul(x.reshape(-1, 64), w.reshape(64, 32), st, impl="ref").reshape(2, 5, 32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    with pytest.raises(ValueError, match="does not contract"):
        linear(QuantRecipe("fp8-hybrid"), x, w.reshape(64, 32), in_dims=2, dtype=jnp.float32, fp8_state=st)
