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
