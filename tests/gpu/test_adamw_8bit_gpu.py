"""GPU tests of the fused 8-bit AdamW kernel (surogate_adamw_8bit_update) against the reference.

Bit for bit: at every step the kernel and `update_8bit_ref` get the same inputs (the kernel's state
so far) and must agree exactly on parameters, codes and absmax, with the reference run by XLA on
the CPU (which rounds every float32 op as written: its products are pinned against FMA
contraction, see optim/adamw_8bit.py). Inputs stay clear of float32 denormals, which XLA's CPU
runtime flushes and the kernel keeps. Against the same reference compiled by XLA for the GPU the
test reports the differences and allows one code step on a tiny fraction (XLA GPU's own rounding
of division/sqrt is not pinned). Also: f32/bf16/f16 params and grads, odd sizes (4096, 4097,
1000003: last partial block), NaN/Inf gradients, all-zero blocks, in-place donation, unwritten
outputs (every parameter changes each step, so an unwritten element shows), the whole transform.
Every kernel variant (0 the first kernel, 1-4 the lookup kernels, see kernels/adamw_8bit.h) must
give the same bits; one case runs tiny/zero/huge moments through the div/sqrt fast-path checks of
variants 3-4 (their exact fallback), and absmax arrays take their state shape (absmax_shape)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import ffi_available
from surogate_jax.optim import adamw_8bit, apply_fused, chain_clip
from surogate_jax.optim.adamw_8bit import (
    B1,
    B2,
    DECAY,
    EPS_HAT,
    GSCALE,
    N_SCALARS,
    N_VARIANTS,
    OMB1,
    OMB2,
    STEP,
    ZERO_S,
    ZERO_U,
    T,
    absmax_shape,
    update_8bit,
    update_8bit_ref,
)

pytestmark = pytest.mark.gpu

SIZES = [(4096,), (4097,), (1000003,), (37, 1001), (3, 256, 130), (5, 512, 768)]
VARIANTS = list(range(N_VARIANTS))
DTYPES = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
          (jnp.float16, jnp.float32)]
STEPS = 4
_seed = itertools.count(2000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _scalars(t, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, gscale=0.9):
    f32 = np.float32
    s = np.zeros(N_SCALARS, np.float32)
    sq = np.sqrt(1 - b2**t)
    s[[B1, OMB1, B2, OMB2]] = [f32(b1), f32(1) - f32(b1), f32(b2), f32(1) - f32(b2)]
    s[[STEP, EPS_HAT, DECAY, GSCALE, T]] = [lr * sq / (1 - b1**t), eps * sq, 1 - lr * wd, gscale, t]
    return s


def _grad(rng, shape, dtype, step):
    g = rng.standard_normal(shape).astype(np.float32) * np.float32(1e-2)
    flat = g.reshape(-1)
    if flat.size > 600:
        flat[rng.integers(0, flat.size, 3)] = [np.nan, np.inf, -np.inf]  # skipped elements
        flat[256:512] = 0.0 if step == 0 else flat[256:512]  # block 1 stays all-zero on step 1
    return jnp.asarray(g, dtype)


def _cpu(x):
    return jax.device_put(x, jax.devices("cpu")[0])


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32) if x.dtype.itemsize == 4 else x


def _ffi(*args, variant=None):
    return jax.jit(lambda *a: update_8bit(*a, impl="ffi", variant=variant))(*args)


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"p{jnp.dtype(d[0]).name}-g{jnp.dtype(d[1]).name}")
@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_kernel_matches_reference_bit_for_bit(shape, dtypes):
    """Every variant, step by step from the same inputs (variant 0's state, so all see one
    trajectory); the XLA GPU build of the reference within one code."""
    pdt, gdt = dtypes
    rng = np.random.default_rng(next(_seed))
    p = jnp.asarray(0.1 * rng.standard_normal(shape).astype(np.float32), pdt)  # updates exceed an ulp
    qm = jnp.full(shape, ZERO_S, jnp.uint8)
    qv = jnp.full(shape, ZERO_U, jnp.uint8)
    am = jnp.zeros(absmax_shape(shape), jnp.float32)
    av = jnp.zeros(absmax_shape(shape), jnp.float32)
    ref_cpu = jax.jit(update_8bit_ref)
    ref_gpu = jax.jit(update_8bit_ref)
    for step in range(STEPS):
        g = _grad(rng, shape, gdt, step)
        s = jnp.asarray(_scalars(step + 1))
        args = (g, p, qm, qv, am, av, s)
        want = jax.device_get(ref_cpu(*(_cpu(a) for a in args)))
        xla_gpu = jax.device_get(ref_gpu(*args))
        first = None
        for variant in VARIANTS:
            got = jax.device_get(_ffi(*args, variant=variant))
            for name, a, b, c in zip(("p", "qm", "qv", "am", "av"), got, want, xla_gpu, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                np.testing.assert_array_equal(
                    _bits(a), _bits(b), err_msg=f"variant {variant}: {name} at step {step + 1} (vs CPU reference)")
                if a.dtype == np.uint8:  # XLA's GPU build of the reference: within one code, rarely off
                    d = np.abs(a.astype(int) - c.astype(int))
                    assert d.max() <= 1 and d.mean() < 1e-3, (name, step, d.max(), d.mean())
            first = got if first is None else first
        # the check can see unwritten outputs: the reference changes almost every parameter
        gf = np.asarray(g, np.float32).reshape(-1)
        moved = np.asarray(want[0], np.float32).reshape(-1) != np.asarray(p, np.float32).reshape(-1)
        assert moved[np.isfinite(gf) & (gf != 0)].mean() > 0.9
        p, qm, qv, am, av = (jnp.asarray(x) for x in first)
    assert float(jnp.max(am)) > 0 and float(jnp.max(av)) > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_path_edges_bit_for_bit(variant):
    """Moments at the edges of the straight-line div/sqrt ranges (variants 3, 4 fall back to the
    exact ops there): zero and -0 gradients and parameters, tiny gradients (v below 2^-101, m below
    2^-60), huge ones (v near overflow). Everything against variant 0 (__fdiv_rn / __fsqrt_rn
    throughout); against the CPU reference only in the groups whose float32 intermediates stay
    normal (XLA:CPU flushes subnormals to 0, the kernel keeps them): the 1e-16, 3e-17 and 1e-19
    groups have v = (1 - b2) g^2 in or near the subnormal range (seen on the H100, 2026-11-22:
    every variant equal to variant 0, and 255 qv codes of the 1e-16 group off the CPU's)."""
    rng = np.random.default_rng(next(_seed))
    n = 256 * 64
    scales = np.float32([0.0, 1e-16, 1e-19, 1e-12, 3e-17, 1.0, 1e15, 1e18])
    scale = np.repeat(scales, n // 8)  # 8 blocks per scale
    g = (rng.standard_normal(n).astype(np.float32) * scale).astype(np.float32)
    g[::97] = -0.0
    p = rng.standard_normal(n).astype(np.float32)
    p[::89] = -0.0
    p[::83] = 0.0
    keep = ~np.isin(scale, np.float32([1e-16, 3e-17, 1e-19]))  # no subnormal intermediates
    keep_blocks = keep.reshape(-1, 256).all(1)
    state = (jnp.asarray(p), jnp.full((n,), ZERO_S, jnp.uint8), jnp.full((n,), ZERO_U, jnp.uint8),
             jnp.zeros((n // 256,), jnp.float32), jnp.zeros((n // 256,), jnp.float32))
    for step in range(3):
        s = jnp.asarray(_scalars(step + 1, gscale=1.0))
        args = (jnp.asarray(g * np.float32(0.5**step)), *state, s)
        want = jax.device_get(jax.jit(update_8bit_ref)(*(_cpu(a) for a in args)))
        got = jax.device_get(_ffi(*args, variant=variant))
        ref0 = jax.device_get(_ffi(*args, variant=0))
        for name, a, b, c in zip(("p", "qm", "qv", "am", "av"), got, want, ref0, strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(c),
                                          err_msg=f"variant {variant} vs 0: {name} at step {step + 1}")
            sel = keep if a.shape == (n,) else keep_blocks
            np.testing.assert_array_equal(_bits(a)[sel], _bits(b)[sel],
                                          err_msg=f"variant {variant} vs CPU reference: {name} at step {step + 1}")
        state = tuple(jnp.asarray(x) for x in got)


def test_in_place_with_donation():
    rng = np.random.default_rng(next(_seed))
    shape = (4099, 257)
    p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    g = _grad(rng, shape, jnp.float32, 1)
    ams = absmax_shape(shape)
    st = [jnp.full(shape, ZERO_S, jnp.uint8), jnp.zeros(shape, jnp.uint8), jnp.zeros(ams), jnp.zeros(ams)]
    s = jnp.asarray(_scalars(1))
    want = jax.device_get(jax.jit(update_8bit_ref)(*(_cpu(a) for a in (g, p, *st, s))))
    step = jax.jit(lambda g, p, qm, qv, am, av, s: update_8bit(g, p, qm, qv, am, av, s, impl="ffi"),
                   donate_argnums=(1, 2, 3, 4, 5))
    ptr = p.unsafe_buffer_pointer()
    out = step(g, p, *st, s)
    assert p.is_deleted() and out[0].unsafe_buffer_pointer() == ptr  # updated in place
    for a, b in zip(jax.device_get(out), want, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_transform_uses_the_kernel_and_matches_the_reference():
    rng = np.random.default_rng(next(_seed))
    params = {"w": jnp.asarray(rng.standard_normal((512, 1000)), jnp.float32),
              "e": jnp.asarray(rng.standard_normal((5003,)), jnp.bfloat16),
              "norm": jnp.asarray(rng.standard_normal((100,)), jnp.float32)}
    tx = chain_clip(1.0, adamw_8bit(1e-3, weight_decay=0.1))
    tx_ref = chain_clip(1.0, adamw_8bit(1e-3, weight_decay=0.1, impl="ref"))
    step = jax.jit(lambda p, s, g: apply_fused(tx, g, s, p))
    step_ref = jax.jit(lambda p, s, g: apply_fused(tx_ref, g, s, p))
    hlo = step.lower(params, tx.init(params), params).as_text()
    assert "surogate_adamw_8bit_update" in hlo
    p, s = params, tx.init(params)
    pr, sr = params, tx_ref.init(params)
    for _ in range(5):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype), params)
        p, s = step(p, s, g)
        pr, sr = step_ref(pr, sr, g)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(pr), strict=True):
        # XLA's GPU build of the reference may round a code differently now and then (see above);
        # such an element then differs by at most about one step (lr = 1e-3), seen once in 512000
        # on the H100 (2026-11-22). Everything else agrees to the dtype's rounding.
        tol = 1e-4 if a.dtype == jnp.float32 else 1e-2
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a))
        bad = ~np.isclose(a, b, rtol=tol, atol=tol * 0.1)
        assert bad.mean() <= 1e-4, bad.mean()
        assert not bad.any() or np.abs(a - b)[bad].max() <= 2e-3, np.abs(a - b)[bad].max()
