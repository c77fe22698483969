"""CPU tests of the grouped matmul's reference and its custom_vjp: forward and both gradients against a plain loop
over the groups (each group's rows times its own matrix), empty groups, rows past the groups, odd shapes; the
argument checks."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops.grouped_matmul import grouped_matmul, grouped_matmul_ref, kernel_applies

_seed = itertools.count(7100)


def _loop(x, w, sizes):
    """y and, for dy, (dx, dw) by slicing each group out: the definition, in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, n in enumerate(sizes):
        y[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return y


def _loop_grads(x, w, sizes, dy):
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    start = 0
    for e, n in enumerate(sizes):
        dx[start:start + n] = dy[start:start + n] @ w[e].T
        dw[e] = x[start:start + n].T @ dy[start:start + n]
        start += n
    return dx, dw


CASES = [  # rows, K, M, group sizes (sum <= rows)
    (13, 8, 5, [4, 0, 7]),
    (40, 24, 16, [0, 0, 40]),
    (57, 7, 3, [1, 9, 0, 30, 2]),
    (9, 16, 8, [0, 0, 0]),
]


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("rows,K,M,sizes", CASES)
def test_forward_and_gradients_equal_a_loop_over_groups(rows, K, M, sizes, transpose_w, assert_close):
    kx, kw, kd = jax.random.split(jax.random.key(next(_seed)), 3)
    E = len(sizes)
    x = jax.random.normal(kx, (rows, K), jnp.float32)
    w = jax.random.normal(kw, (E, K, M), jnp.float32)
    dy = jax.random.normal(kd, (rows, M), jnp.float32)
    gs = jnp.array(sizes, jnp.int32)
    if transpose_w:  # the same product with w stored [E, M, K]
        y, vjp_t = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, transpose_w=True), x, jnp.swapaxes(w, 1, 2))
        vjp = lambda d: (lambda dx, dwt: (dx, jnp.swapaxes(dwt, 1, 2)))(*vjp_t(d))  # noqa: E731
    else:
        y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs), x, w)
    assert_close(y, _loop(x, w, sizes), jnp.float32)
    assert not np.any(np.asarray(y)[sum(sizes):]), "rows past the groups must be zero"
    dx, dw = vjp(dy)
    want_dx, want_dw = _loop_grads(x, w, sizes, dy)
    want_dx[sum(sizes):] = 0.0
    assert_close(dx, want_dx, jnp.float32)
    assert_close(dw, want_dw, jnp.float32)


def test_bf16_rounds_once_from_fp32(assert_close):
    kx, kw = jax.random.split(jax.random.key(next(_seed)))
    x = jax.random.normal(kx, (33, 16), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (3, 16, 8), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.array([10, 3, 20], jnp.int32)
    y = grouped_matmul(x, w, gs)
    assert y.dtype == jnp.bfloat16
    assert_close(y, _loop(x.astype(jnp.float32), w.astype(jnp.float32), [10, 3, 20]), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(grouped_matmul_ref(x, w, gs), np.float32))


def test_group_sizes_may_be_traced_inside_jit():
    x = jnp.ones((6, 8))
    w = jnp.stack([jnp.eye(8), 2 * jnp.eye(8)])
    y = jax.jit(lambda s: grouped_matmul(x, w, s))(jnp.array([2, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(y)[:, 0], [1, 1, 2, 2, 2, 2])


def test_kernel_applies_only_to_bf16_multiples_of_8():
    assert kernel_applies((5, 16), (3, 16, 24), jnp.bfloat16)
    assert not kernel_applies((5, 16), (3, 16, 24), jnp.float32)
    assert not kernel_applies((5, 12), (3, 12, 24), jnp.bfloat16)
    assert not kernel_applies((5, 16), (3, 16, 20), jnp.bfloat16)


@pytest.mark.parametrize("xs,ws,gs", [((4, 8), (2, 6, 3), (2,)), ((4, 8), (2, 8, 3), (3,)), ((4,), (2, 4, 3), (2,))])
def test_shape_mismatch_is_a_clear_error(xs, ws, gs):
    with pytest.raises(ValueError, match="grouped_matmul"):
        grouped_matmul(jnp.ones(xs), jnp.ones(ws), jnp.ones(gs, jnp.int32))


def test_fp8_reference_is_the_quantized_products_per_group(assert_close):
    """grouped_matmul_fp8 (reference): y equals a float64 loop over the groups of the E4M3 values of x (one scale)
    and w (one scale per expert), rescaled; dx the E5M2 dy against the same weight; dw the plain x^T dy; the frozen
    form with the weight quantized beforehand gives the same y and dx."""
    from surogate_jax.ops import fp8_formats as f
    from surogate_jax.ops.grouped_matmul import expert_scales, grouped_matmul_fp8, grouped_matmul_fp8_frozen

    rng = np.random.default_rng(31)
    E, K, M, rows = 5, 48, 40, 33
    sizes = np.array([7, 0, 13, 1, 9], np.int32)
    x, dy = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((rows, K), (rows, M)))
    w = jnp.asarray(rng.standard_normal((E, K, M)) * 0.1, jnp.bfloat16)
    y, vjp = jax.vjp(lambda a, b: grouped_matmul_fp8(a, b, jnp.asarray(sizes), impl="ref"), x, w)
    dx, dw = vjp(dy)

    def q(t, fmt, axis=None):
        t = np.asarray(jnp.asarray(t, jnp.float32), np.float64)
        am = np.max(np.abs(t), axis=axis, keepdims=axis is not None)
        s = f.fp8_max(fmt) / am
        return np.asarray(jnp.asarray(np.clip(t * s, -f.fp8_max(fmt), f.fp8_max(fmt)), jnp.float32).astype(fmt),
                          np.float64) / s

    xh, gh, wh = q(x, f.E4M3), q(dy, f.E5M2), q(w, f.E4M3, axis=(1, 2))
    want_y, want_dx, want_dw, s0 = np.zeros((rows, M)), np.zeros((rows, K)), np.zeros((E, K, M)), 0
    xf, df = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, dy))
    for e, n in enumerate(sizes):
        want_y[s0:s0 + n] = xh[s0:s0 + n] @ wh[e]
        want_dx[s0:s0 + n] = gh[s0:s0 + n] @ wh[e].T
        want_dw[e] = xf[s0:s0 + n].T @ df[s0:s0 + n]
        s0 += n
    assert_close(y, want_y, jnp.bfloat16, "y")
    assert not np.any(np.asarray(y[s0:], np.float32))
    assert_close(dx, want_dx, jnp.bfloat16, "dx")
    assert_close(dw, want_dw, jnp.bfloat16, "dw")
    s = expert_scales(w)
    wq = f.quantize(jnp.swapaxes(w, 1, 2), s[:, None, None], f.E4M3)
    yf, vjpf = jax.vjp(lambda a: grouped_matmul_fp8_frozen(a, wq, s, jnp.asarray(sizes), impl="ref"), x)
    np.testing.assert_array_equal(np.asarray(yf, np.float32), np.asarray(y, np.float32))
    np.testing.assert_array_equal(np.asarray(vjpf(dy)[0], np.float32), np.asarray(dx, np.float32))
