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


def _fp8_want(xq, x_inv, wq_emk, w_inv, sizes):
    """float64 loop over the groups of the fp8 GEMM: y[r] = (xq[r] . wq[e][m, :]) x_inv w_inv[e]."""
    xq, wq = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (xq, wq_emk))
    w_inv = np.asarray(w_inv, np.float64)
    y, s = np.zeros((xq.shape[0], wq.shape[1])), 0
    for e, n in enumerate(sizes):
        y[s:s + n] = xq[s:s + n] @ wq[e].T * float(x_inv) * w_inv[e]
        s += n
    return y


FP8_CASES = [  # rows, K, M, E, some groups empty
    (257, 48, 24, 4, True),
    (1000, 144, 264, 7, False),
    (3001, 64, 128, 128, True),
    (4096, 2048, 768, 16, False),  # 30B-A3B's gate/up shape
    (4096, 768, 2048, 16, True),  # its down projection
]


@pytest.mark.parametrize("rows,K,M,E,empty", FP8_CASES)
@pytest.mark.parametrize("x_fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("w_nek", [False, True])
def test_fp8_kernel_matches_a_loop_over_groups(rows, K, M, E, empty, x_fmt, w_nek, assert_close):
    """surogate_grouped_matmul_fp8 on fp8 operands, weights [E, M, K] or [M, E, K], per-expert scales: equal to a
    float64 loop over the same fp8 values (products are exact; only the summation order and the bf16 rounding of y
    differ); rows past the groups written as zeros."""
    from surogate_jax.ops import fp8_formats
    from surogate_jax.ops.grouped_matmul import _fp8_gemm_ffi

    rng = np.random.default_rng(next(_seed))
    sizes = _sizes(rng, rows, E, empty)
    fmt = fp8_formats.E4M3 if x_fmt == "e4m3" else fp8_formats.E5M2
    xq = jnp.asarray(rng.standard_normal((rows, K)) * 8, jnp.float32).astype(fmt)
    wq = jnp.asarray(rng.standard_normal((E, M, K)) * 16, jnp.float32).astype(fp8_formats.E4M3)
    x_inv, w_inv = jnp.float32(0.37), jnp.asarray(rng.uniform(0.001, 0.01, E), jnp.float32)
    junk = jnp.full((64 << 20) // 4, jnp.nan, jnp.float32).block_until_ready()
    del junk
    w_in = jnp.transpose(wq, (1, 0, 2)) if w_nek else wq
    y = jax.jit(lambda a, b, gs: _fp8_gemm_ffi(a, b, gs, x_inv, w_inv, w_nek=w_nek))(xq, w_in, jnp.asarray(sizes))
    assert y.dtype == jnp.bfloat16
    assert_close(y, _fp8_want(xq, x_inv, wq, w_inv, sizes), jnp.bfloat16, "y")
    assert not np.any(np.asarray(y[int(sizes.sum()):], np.float32)), "rows past the groups must be zeros"


@pytest.mark.parametrize("trained", [False, True])
def test_fp8_ops_kernel_equals_reference(trained, assert_close):
    """grouped_matmul_fp8 / _frozen through the kernels (dx through the byte transpose) against impl="ref" on the
    GPU: forward, dx and (trained) dw."""
    from surogate_jax.ops import fp8_formats
    from surogate_jax.ops.grouped_matmul import expert_scales, grouped_matmul_fp8, grouped_matmul_fp8_frozen

    rng = np.random.default_rng(next(_seed))
    rows, K, M, E = 1500, 272, 144, 9
    sizes = jnp.asarray(_sizes(rng, rows, E, True))
    x, dy = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((rows, K), (rows, M)))
    w = jnp.asarray(rng.standard_normal((E, K, M)) / np.sqrt(K), jnp.bfloat16)
    s = expert_scales(w)
    wq = fp8_formats.quantize(jnp.swapaxes(w, 1, 2), s[:, None, None], fp8_formats.E4M3)

    def run(impl):
        if trained:
            f = jax.jit(lambda x, w: jax.vjp(lambda a, b: grouped_matmul_fp8(a, b, sizes, impl=impl), x, w))
            y, vjp = f(x, w)
            return (y, *vjp(dy))
        y, vjp = jax.vjp(lambda a: grouped_matmul_fp8_frozen(a, wq, s, sizes, impl=impl), x)
        return (y, *vjp(dy))

    got, want = run("ffi"), run("ref")
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert_close(a, b, jnp.bfloat16, name)
