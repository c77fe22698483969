"""GPU tests of the RoPE CUDA kernels (impl="ffi") against `rope_ref`: forward and gradients
(x and the fused q/k-norm weight), both angle sources (positions x inv_freq computed in-kernel,
and fp32 cos/sin tables), f32/bf16/f16, odd and large shapes, packed and large positions (up to
32768, llama3-scaled frequencies), fresh random inputs per test, outputs on poisoned memory,
jit, vmap and determinism (the model's wiring: test_rope_qk_gpu.py)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models.llamalike import DecoderConfig, RopeScaling, rope_inv_freq
from surogate_jax.ops import ffi_available, rope, rope_ref

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (B, T, H, K): 16-byte vector path (K = 64/96/128/256/1024), scalar path (K/2 not a multiple
# of the vector: 6, 72 in 16-bit, 130, 514), every chunks-per-lane instantiation (1; 4: 1024, 72 in
# 16-bit, 130; 16: 514), heads 1/3/5 (idle row groups, partial head units), T not a multiple of
# anything, and Qwen3-0.6B's q shape (several units per lane group in the norm backward).
SHAPES = [
    (1, 1, 1, 128), (2, 37, 3, 64), (3, 37, 3, 128), (2, 19, 5, 96), (1, 33, 2, 72),
    (2, 7, 3, 6), (2, 5, 4, 130), (2, 5, 3, 514), (2, 513, 8, 256), (1, 9, 2, 1024), (4, 2048, 16, 128),
]
MODES = ["positions", "table", "positions+norm", "table+norm"]
EPS = 1e-6
_seed = itertools.count(2000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inv_freq(K, theta=1e6, scaling=None):
    cfg = DecoderConfig(
        model_type="llama", vocab_size=8, hidden_size=K, intermediate_size=8, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=K, rope_theta=theta, rope_scaling=scaling,
    )
    return jnp.asarray(rope_inv_freq(cfg), jnp.float32)


def _positions(rng, B, T, max_pos):
    """Packed rows: positions restart at random document starts; one row offset to large values."""
    pos = np.empty((B, T), np.int64)
    for b in range(B):
        p = np.arange(T)
        for s in np.sort(rng.choice(np.arange(1, T), size=min(3, T - 1), replace=False)) if T > 1 else []:
            p[s:] = np.arange(T - s)
        pos[b] = p + (rng.integers(0, max(1, max_pos - T)) if b % 2 else 0)
    return jnp.asarray(np.minimum(pos, max_pos - 1), jnp.int32)


def _inputs(shape, dtype, max_pos=32768):
    seed = next(_seed)  # fresh inputs per call
    kx, kw, kp = jax.random.split(jax.random.key(seed), 3)
    x = (2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    proj = jax.random.normal(kp, shape, jnp.float32)
    pos = _positions(np.random.default_rng(seed), shape[0], shape[1], max_pos)
    return x, w, proj, pos


def _tables(pos, inv):
    """HF-style [B, T, K] tables (the model's rope_cos_sin)."""
    ang = pos.astype(jnp.float32)[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def _fns(mode, pos, inv, impl):
    """(op, reference) closures (x, w) -> y for one mode."""
    norm = mode.endswith("norm")
    src = {"table": _tables(pos, inv)} if mode.startswith("table") else {"positions": pos, "inv_freq": inv}
    op = lambda x, w: rope(x, **src, norm_w=w if norm else None, eps=EPS, impl=impl)
    ref = lambda x, w: rope_ref(x, pos, inv, norm_w=w if norm else None, eps=EPS)
    return op, ref


def _run(fn, x, w, proj):
    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32) * proj)

    @jax.jit
    def go(x, w):
        return fn(x, w), jax.grad(loss, argnums=(0, 1))(x, w)

    return go(x, w)


def _poison_allocator(nbytes=256 << 20):
    """Allocate and free a NaN-filled buffer so the next outputs likely land on NaN memory."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _check(got, want, dtype, assert_close, norm):
    (y, (dx, dw)), (y_ref, (dx_ref, dw_ref)) = got, want
    names = ("y", "dx", "dw") if norm else ("y", "dx")
    for name, g, r in zip(names, (y, dx, dw), (y_ref, dx_ref, dw_ref)):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert bool(jnp.all(jnp.isfinite(g))), f"{name} has non-finite values (unwritten?)"
        assert_close(g, r, dtype, name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ffi_matches_reference(shape, dtype, mode, assert_close):
    x, w, proj, pos = _inputs(shape, dtype)
    inv = _inv_freq(shape[-1])
    op, ref = _fns(mode, pos, inv, "ffi")
    want = _run(ref, x, w, proj)
    _poison_allocator()
    got = _run(op, x, w, proj)
    _check(got, want, dtype, assert_close, mode.endswith("norm"))


@pytest.mark.parametrize("mode", MODES)
def test_llama3_scaled_frequencies_large_positions(mode, assert_close):
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    inv = _inv_freq(128, theta=500000.0, scaling=scaling)
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w, proj, pos = _inputs((2, 300, 8, 128), dtype, max_pos=131072)
        op, ref = _fns(mode, pos, inv, "ffi")
        _check(_run(op, x, w, proj), _run(ref, x, w, proj), dtype, assert_close, mode.endswith("norm"))


def test_in_kernel_angles_vs_tables_accuracy():
    """Positions mode (sincosf in the kernel) and table mode (XLA's cos/sin) against float64."""
    x, _, _, pos = _inputs((2, 1024, 4, 128), jnp.float32)
    inv = _inv_freq(128, theta=10000.0)
    xs = np.asarray(x, np.float64)
    ang = (np.asarray(pos, np.float32)[..., None] * np.asarray(inv)).astype(np.float64)[..., None, :]
    c, s = np.cos(ang), np.sin(ang)
    want = np.concatenate([xs[..., :64] * c - xs[..., 64:] * s, xs[..., 64:] * c + xs[..., :64] * s], -1)
    errs = {}
    for mode in ("positions", "table"):
        op, _ = _fns(mode, pos, inv, "ffi")
        got = np.asarray(jax.jit(lambda x: op(x, None))(x), np.float64)  # noqa: B023
        errs[mode] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print("max relative error vs float64:", errs)
    assert max(errs.values()) < 1e-6, errs


def test_ffi_is_in_the_compiled_program():
    x, w, _, pos = _inputs((2, 8, 4, 128), jnp.bfloat16)
    inv = _inv_freq(128)
    hlo = jax.jit(lambda x, w: rope(x, pos, inv, norm_w=w)).lower(x, w).as_text()
    assert "surogate_rope_fwd" in hlo  # impl=None on GPU picks the kernel


def test_norm_backward_is_deterministic():
    x, w, proj, pos = _inputs((4, 512, 8, 128), jnp.bfloat16)
    op, _ = _fns("positions+norm", pos, _inv_freq(128), "ffi")
    a = _run(op, x, w, proj)
    b = _run(op, x, w, proj)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("mode", ["positions+norm", "table+norm"])
def test_vmap_per_example_weights(mode, assert_close):
    """vmap_method="broadcast_all": each example's tokens use their own w (and inv_freq) rows."""
    dtype = jnp.float32
    x, w, proj, pos = _inputs((3, 33, 4, 64), dtype)
    ws = (w[None, :] * jnp.asarray([[1.0], [0.5], [-2.0]])).astype(dtype)
    inv = _inv_freq(64)

    def per_example(impl):
        def loss(x, w, p, pos):
            op, _ = _fns(mode, pos[None], inv, impl)
            return jnp.sum(op(x[None], w)[0].astype(jnp.float32) * p)

        return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1))))(x, ws, proj, pos)

    got, want = per_example("ffi"), per_example("ref")
    assert got[1][1].shape == (3, 64)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, r, dtype)


def test_zero_tokens():
    x = jnp.zeros((0, 4, 2, 64), jnp.bfloat16)
    pos = jnp.zeros((0, 4), jnp.int32)
    w = jnp.ones((64,), jnp.bfloat16)
    inv = _inv_freq(64)
    y, dw = jax.jit(
        lambda x, w: (rope(x, pos, inv, norm_w=w, impl="ffi"),
                      jax.grad(lambda w: rope(x, pos, inv, norm_w=w, impl="ffi").sum())(w))
    )(x, w)
    assert y.shape == x.shape and np.all(np.asarray(dw, np.float32) == 0)
