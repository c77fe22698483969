"""GPU tests of the grouped-matmul CUDA kernels (impl="ffi") against a float64 loop over the groups, with w stored
[E, K, M] or transposed [E, M, K]: forward, the input gradient (w read the other way) and the weight gradient
(contraction over each group's rows), on odd row counts, empty groups, rows past the groups, more experts than row
tiles, and Qwen3-30B-A3B's expert shapes; outputs poisoned so unwritten elements show; group sizes traced inside
jit."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import ffi_available
from surogate_jax.ops.grouped_matmul import grouped_matmul

pytestmark = pytest.mark.gpu
_seed = itertools.count(7300)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _sizes(rng, rows, E, empty):
    """E group sizes summing to at most rows (some zero when `empty`), random."""
    cuts = np.sort(rng.integers(0, rows + 1, E - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [rows - rng.integers(0, 3)]])).clip(min=0)
    if empty:
        sizes[rng.choice(E, E // 3, replace=False)] = 0
    return sizes.astype(np.int32)


def _want(x, w, sizes, dy):
    x, w, dy = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    s = 0
    for e, n in enumerate(sizes):
        y[s:s + n] = x[s:s + n] @ w[e]
        dx[s:s + n] = dy[s:s + n] @ w[e].T
        dw[e] = x[s:s + n].T @ dy[s:s + n]
        s += n
    return y, dx, dw


CASES = [  # rows, K, M, E, some groups empty
    (257, 40, 24, 4, True),
    (1000, 136, 264, 7, False),
    (3001, 64, 128, 128, True),  # more experts than row tiles
    (4096, 2048, 768, 16, False),  # 30B-A3B's gate/up shape
    (4096, 768, 2048, 16, True),  # its down projection
]


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("rows,K,M,E,empty", CASES)
def test_kernels_match_a_loop_over_groups(rows, K, M, E, empty, transpose_w, assert_close):
    rng = np.random.default_rng(next(_seed))
    sizes = _sizes(rng, rows, E, empty)
    kx, kw, kd = jax.random.split(jax.random.key(next(_seed)), 3)
    x = jax.random.normal(kx, (rows, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, M), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (rows, M), jnp.float32).astype(jnp.bfloat16)
    junk = jnp.full((64 << 20) // 4, jnp.nan, jnp.float32).block_until_ready()  # poison the allocator
    del junk

    @jax.jit
    def go(x, w, gs, dy):
        if transpose_w:  # w stored [E, M, K] (a dequantized frozen base's HF layout)
            y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, transpose_w=True, impl="ffi"), x,
                             jnp.swapaxes(w, 1, 2))
            dx, dwt = vjp(dy)
            return y, dx, jnp.swapaxes(dwt, 1, 2)
        y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, impl="ffi"), x, w)
        return (y, *vjp(dy))

    y, dx, dw = go(x, w, jnp.asarray(sizes), dy)
    want_y, want_dx, want_dw = _want(x, w, sizes, dy)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert_close(y, want_y, jnp.bfloat16, "y")
    past = int(sizes.sum())
    assert not np.any(np.asarray(y[past:], np.float32)), "rows past the groups must be written as zeros"
    want_dx[past:] = 0.0
    assert_close(dx, want_dx, jnp.bfloat16, "dx")
    assert_close(dw, want_dw, jnp.bfloat16, "dw")


def test_every_gpu_of_the_process_runs_the_kernel(assert_close):
    """The kernels' shared-memory attribute is per device: each GPU of a multi-GPU process must launch them
    (expert parallelism runs them on both GPUs of one process); forward and both gradients on each GPU."""
    gpus = jax.devices()
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs in one process")
    rng = np.random.default_rng(next(_seed))
    rows, K, M, E = 300, 64, 72, 5
    sizes = _sizes(rng, rows, E, False)
    x, dy = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((rows, K), (rows, M)))
    w = jnp.asarray(rng.standard_normal((E, K, M)) / np.sqrt(K), jnp.bfloat16)
    want_y, want_dx, want_dw = _want(x, w, sizes, dy)
    want_dx[int(sizes.sum()):] = 0.0

    @jax.jit
    def go(x, w, gs, dy):
        y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, impl="ffi"), x, w)
        return (y, *vjp(dy))

    for dev in gpus:
        y, dx, dw = go(*jax.device_put((x, w, jnp.asarray(sizes), dy), dev))
        assert y.devices() == {dev}
        assert_close(y, want_y, jnp.bfloat16, f"y on {dev}")
        assert_close(dx, want_dx, jnp.bfloat16, f"dx on {dev}")
        assert_close(dw, want_dw, jnp.bfloat16, f"dw on {dev}")
