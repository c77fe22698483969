"""GPU tests of the NVFP4 quantizer kernels (surogate_jax.ops.nvfp4_quantize with impl="ffi") against
the pure-JAX reference run on the CPU backend (XLA:GPU may contract or reorder float ops, XLA:CPU
with our barriers does not): round-to-nearest codes, block scales and global scale bit for bit,
1x16 and 16x16, Four Over Six on/off, fused RHT, f32/bf16/f16, odd row counts, poisoned outputs;
the amax kernel exactly; stochastic rounding by its statistics (its bits come from Philox, not
from jax.random)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats as stats  # a dependency of jax

from surogate_jax.ops import ffi_available, hadamard, nvfp4_matmul, nvfp4_quantize

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (shape, dtype): odd row counts, batched leading dims, partial 16-row tiles, one large tensor.
CASES = [((1, 16), jnp.float32), ((13, 48), jnp.bfloat16), ((7, 5, 160), jnp.float16),
         ((129, 1024), jnp.bfloat16), ((1001, 272), jnp.float32), ((2048, 4096), jnp.bfloat16)]
_seed = itertools.count(5000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _cpu():
    return jax.devices("cpu")[0]


def _input(shape, dtype, heavy=True):
    k1, k2 = jax.random.split(jax.random.key(next(_seed)))  # fresh inputs per call
    x = jax.random.t(k1, 3.0, shape) if heavy else jax.random.normal(k1, shape)
    x = x * jnp.exp(jax.random.normal(k2, shape[:-1] + (1,)))  # rows of different magnitude
    return x.astype(dtype)


def _poison_allocator(nbytes=64 << 20):
    """Allocate and free a NaN-filled buffer so the next outputs likely land on garbage."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _ref_on_cpu(x, **kw):
    with jax.default_device(_cpu()):
        q = nvfp4_quantize.quantize_ref(jax.device_put(x, _cpu()), **kw)
        return q, nvfp4_quantize.dequantize(q)


def _u8(a):
    return np.asarray(jax.device_get(a)).view(np.uint8)


def _assert_same(q, ref, what):
    got_codes, want_codes = np.asarray(jax.device_get(q.codes)), np.asarray(ref.codes)
    assert got_codes.shape == want_codes.shape and got_codes.dtype == np.uint8, what
    bad = got_codes != want_codes
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} code bytes differ"
    gs, ws = _u8(q.scales), _u8(ref.scales)
    assert gs.shape == ws.shape, (what, gs.shape, ws.shape)
    bad = gs != ws
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} scales differ"
    assert np.asarray(q.global_scale).view(np.uint32) == np.asarray(ref.global_scale).view(np.uint32), what


@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
@pytest.mark.parametrize("four_over_six", [True, False], ids=["4over6", "6only"])
@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: str(c) if isinstance(c, tuple) else jnp.dtype(c).name)
def test_rne_matches_reference_bitwise(shape, dtype, tile_2d, four_over_six, rht):
    x = _input(shape, dtype)
    mask = hadamard.DEFAULT_SIGN_MASK if rht else None
    kw = {"tile_2d": tile_2d, "four_over_six": four_over_six, "rht_sign_mask": mask}
    ref, ref_deq = _ref_on_cpu(x, **kw)
    _poison_allocator()
    q = jax.jit(lambda x: nvfp4_quantize.quantize(x, impl="ffi", **kw))(x)
    _assert_same(q, ref, f"{shape} {jnp.dtype(dtype).name} {kw}")
    deq = np.asarray(jax.device_get(nvfp4_quantize.dequantize(q)))
    assert np.array_equal(deq.view(np.uint32), np.asarray(ref_deq).view(np.uint32))


@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x16", "16x16"])
def test_fake_quantize_ffi_equals_reference(tile_2d):
    x = _input((333, 512), jnp.bfloat16)
    got = jax.jit(lambda x: nvfp4_quantize.fake_quantize(x, tile_2d=tile_2d, impl="ffi"))(x)
    with jax.default_device(_cpu()):
        want = nvfp4_quantize.fake_quantize_ref(jax.device_put(x, _cpu()), tile_2d=tile_2d)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    hlo = jax.jit(lambda x: nvfp4_quantize.fake_quantize(x, tile_2d=tile_2d)).lower(x).as_text()
    assert "surogate_nvfp4_quantize" in hlo  # impl=None on GPU picks the kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_amax_kernel_exact(dtype):
    for shape in [(1, 16), (77, 4096), (3, 1000, 64), (8192, 1024)]:
        x = _input(shape, dtype)
        got = jax.jit(lambda x: nvfp4_quantize.global_amax(x, impl="ffi"))(x)
        assert float(got) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
        mask = hadamard.signs_from_seed(7)
        got = jax.jit(lambda x: nvfp4_quantize.global_amax(x, rht_sign_mask=mask, impl="ffi"))(x)
        with jax.default_device(_cpu()):
            want = nvfp4_quantize.global_amax(jax.device_put(x, _cpu()), rht_sign_mask=mask, impl="ref")
        assert float(got) == float(want)


def test_special_values():
    # Zero tensor, zero blocks, signed zeros, tiny blocks (E4M3 subnormal / zero scales),
    # saturating blocks; then NaN and inf (all-NaN output).
    x = np.zeros((6, 64), np.float32)
    x[0, 0] = 6.0
    x[1, :16] = np.linspace(-5.7, 5.7, 16)
    x[2, :16] = 1e-4 * np.sign(np.arange(16) - 7.5)
    x[3, 16:32] = -0.0
    x[4, 32:48] = -1e-30
    x[5, :] = np.random.default_rng(0).uniform(-2e-4, 2e-4, 64)
    for fos, tile_2d in itertools.product((True, False), (False, True)):
        kw = {"tile_2d": tile_2d, "four_over_six": fos}
        ref, _ = _ref_on_cpu(jnp.asarray(x), **kw)
        _poison_allocator()
        _assert_same(jax.jit(lambda x: nvfp4_quantize.quantize(x, impl="ffi", **kw))(jnp.asarray(x)), ref, str(kw))
        z = jax.jit(lambda x: nvfp4_quantize.quantize(x, impl="ffi", **kw))(jnp.zeros((3, 32)))
        assert float(z.global_scale) == 1.0 and not np.any(np.asarray(z.codes))
    for bad in (np.nan, np.inf, -np.inf):
        y = np.ones((4, 32), np.float32)
        y[2, 7] = bad
        out = jax.jit(lambda x: nvfp4_quantize.fake_quantize(x, impl="ffi"))(jnp.asarray(y))
        assert np.all(np.isnan(np.asarray(out))), bad


def test_vmap_quantizes_each_slice_separately():
    x = _input((3, 40, 64), jnp.bfloat16)
    got = jax.jit(jax.vmap(lambda x: nvfp4_quantize.fake_quantize(x, impl="ffi")))(x)
    with jax.default_device(_cpu()):
        xc = jax.device_put(x, _cpu())
        want = np.stack([np.asarray(nvfp4_quantize.fake_quantize_ref(xc[i])) for i in range(3)])
    assert np.array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_stochastic_rounding_statistics(tile_2d, rht):
    x = _input((64, 256), jnp.bfloat16)
    mask = hadamard.DEFAULT_SIGN_MASK if rht else None
    kw = {"tile_2d": tile_2d, "rht_sign_mask": mask}
    rne, _ = _ref_on_cpu(x, **kw)
    keys = jax.random.split(jax.random.key(next(_seed)), 1024)

    @jax.jit
    def sample(k):
        q = nvfp4_quantize.quantize(x, stochastic=True, key=k, impl="ffi", **kw)
        return nvfp4_quantize.dequantize(q), q.scales

    deq0, s0 = sample(keys[0])
    assert np.array_equal(_u8(s0), _u8(rne.scales))  # the scale choice is the RNE one
    again, _ = sample(keys[0])
    assert np.array_equal(np.asarray(deq0), np.asarray(again))  # deterministic per key
    samples = np.stack([np.asarray(sample(k)[0], np.float64) for k in keys])
    assert not np.array_equal(samples[0], samples[1])
    # Neighbours only: every sample is lo or hi of the E2M1 interval holding the scaled value.
    with jax.default_device(_cpu()):
        target = np.asarray(hadamard.rht(jax.device_put(x, _cpu()), sign_mask=mask) if rht else
                            jnp.asarray(jax.device_put(x, _cpu()), jnp.float32), np.float64)
    step = np.asarray(nvfp4_quantize.expand_scales(rne), np.float64).repeat(16, -1) * float(rne.global_scale)
    xs = target / np.where(step == 0, 1, step)
    grid = nvfp4_quantize.E2M1_VALUES.astype(np.float64)
    lo_i = np.searchsorted(grid, np.abs(xs), side="right") - 1
    lo = np.sign(xs) * grid[lo_i] * step
    hi = np.sign(xs) * grid[np.minimum(lo_i + 1, 7)] * step
    ok = np.isclose(samples, lo, rtol=1e-5, atol=1e-30) | np.isclose(samples, hi, rtol=1e-5, atol=1e-30)
    assert ok.all(), f"{(~ok).sum()} samples are not neighbouring values"
    # Unbiased: per element the count of rounds up is Binomial(n, p), p = the scaled value's position in its
    # interval. An exact two-sided test (not a normal approximation, which fails for p near 0 or 1) per element,
    # at a family-wise level of 1e-3 over the elements (Bonferroni); saturated elements excluded.
    n = samples.shape[0]
    gap = np.abs(hi - lo)
    p = np.where(gap > 0, np.abs(target - lo) / np.where(gap > 0, gap, 1), 0)
    inside = (np.abs(xs) <= 6) & (gap > 0)
    ups = np.isclose(samples, hi, rtol=1e-5, atol=1e-30).sum(0)
    k, pp = ups[inside], np.clip(p[inside], 0.0, 1.0)
    p_value = np.minimum(1.0, 2 * np.minimum(stats.binom.cdf(k, n, pp), stats.binom.sf(k - 1, n, pp)))
    assert p_value.min() > 1e-3 / k.size, (p_value.min(), k[p_value.argmin()], n * pp[p_value.argmin()])
    se = gap * np.sqrt(p * (1 - p) / n)
    dev = np.abs(samples.mean(0) - target)
    z = dev[inside & (se > 0)] / se[inside & (se > 0)]
    assert np.mean(z) < 1.2, np.mean(z)  # and no systematic bias over the whole tensor


def test_emulated_matmul_runs_on_gpu():
    x = _input((256, 512), jnp.bfloat16, heavy=False)
    w = (_input((512, 384), jnp.float32, heavy=False) * 0.05).astype(jnp.bfloat16)
    y = jax.jit(lambda x, w: nvfp4_matmul.nvfp4_matmul_emulated(x, w, impl="ffi"))(x, w)
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    rel = np.linalg.norm(np.asarray(y, np.float32) - exact) / np.linalg.norm(exact)
    assert y.dtype == jnp.bfloat16 and rel < 0.2, rel
