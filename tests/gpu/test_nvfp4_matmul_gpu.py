"""GPU tests of the native NVFP4 GEMM path (surogate_jax/ops/nvfp4_matmul.py, kernels/nvfp4_matmul.cu,
ffi/nvfp4_matmul.cc).

Run on any CUDA GPU (H100 included): the scale-swizzle kernel against `swizzle_scales_ref` byte for
byte (padding zeros included, outputs on poisoned memory), the code-transpose kernel and the W^T
operand against the references, and the GEMM handler's argument checks (bad shapes, dtypes, and a
pre-SM100 GPU named in the error).
Run only on SM100+ (skipped with the reason on Hopper; not yet run on hardware in this project): the
cuBLASLt block-scaled FP4 GEMM against `nvfp4_gemm_ref` within an fp32-accumulation bound, and
the native linear against the emulated one."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, nvfp4_quantize
from surogate_jax.ops import nvfp4_matmul as g

pytestmark = pytest.mark.gpu
_seed = itertools.count(7000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _needs_sm100():
    if not g.native_available():
        dev = jax.devices()[0]
        pytest.skip(f"the native FP4 GEMM needs an SM100+ GPU; this is {dev.device_kind} "
                    f"(compute capability {getattr(dev, 'compute_capability', '?')}): expected on H100")


def _cpu():
    return jax.devices("cpu")[0]


def _poison_allocator(nbytes=64 << 20):
    junk = jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32)  # 0xFF bytes: NaN in bf16/f32, nonzero scales
    junk.block_until_ready()
    del junk


def _key():
    return jax.random.key(next(_seed))


def _scales(shape):
    b = jax.random.randint(_key(), shape, 1, 127).astype(jnp.uint8)  # never 0: padding stands out
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)


def _on_cpu(fn, *args):
    with jax.default_device(_cpu()):
        return np.asarray(fn(*(jax.device_put(a, _cpu()) for a in args)))


# ---------------------------------------------------------------------------------------------
# Operand preparation (any GPU)


@pytest.mark.parametrize("rows,cols", [(1, 1), (127, 3), (129, 4), (300, 5), (300, 9), (4097, 256), (16384, 256)])
def test_swizzle_kernel_equals_reference(rows, cols):
    s = _scales((rows, cols))
    want = _on_cpu(lambda s: g.swizzle_scales_ref(s, rows), s)
    _poison_allocator()
    got = np.asarray(jax.jit(lambda s: g.swizzle_scales(s, rows, impl="ffi"))(s))
    np.testing.assert_array_equal(got, want)
    assert int(np.count_nonzero(got)) == rows * cols
    # uint8 input: the same bytes
    got8 = np.asarray(g.swizzle_scales(jax.lax.bitcast_convert_type(s, jnp.uint8), rows, impl="ffi"))
    np.testing.assert_array_equal(got8, want)


@pytest.mark.parametrize("rows,cols", [(16, 1), (40, 5), (300, 7), (4096, 896), (14336, 256)])
def test_swizzle_kernel_of_16x16_tiles_equals_reference(rows, cols):
    s = _scales((-(-rows // 16), cols))
    want = _on_cpu(lambda s: g.swizzle_scales_ref(s, rows, row_div=16), s)
    _poison_allocator()
    got = np.asarray(g.swizzle_scales(s, rows, row_div=16, impl="ffi"))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows,cols", [(2, 2), (16, 32), (66, 130), (130, 66), (1000, 1002), (4096, 14336)])
def test_transpose_codes_kernel_equals_reference(rows, cols):
    codes = jax.random.randint(_key(), (rows, cols // 2), 0, 256).astype(jnp.uint8)
    want = _on_cpu(g.transpose_codes_ref, codes)
    _poison_allocator()
    got = np.asarray(g.transpose_codes(codes, impl="ffi"))
    assert got.shape == (cols, rows // 2)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [(48, 80), (4096, 1024)])
def test_weight_transpose_operand_equals_reference(shape):
    w = (jax.random.t(_key(), 3.0, shape) * 0.02).astype(jnp.bfloat16)
    q = nvfp4_quantize.quantize(w, tile_2d=True, impl="ffi")
    t = g.transpose(q, impl="ffi")
    with jax.default_device(_cpu()):
        qc = jax.device_put(q, _cpu())
        tr = g.transpose(qc, impl="ref")
        want_deq = np.asarray(nvfp4_quantize.dequantize(qc)).T
        want_sw = np.asarray(g.swizzle_scales_ref(*g.operand_scales(tr)))
    np.testing.assert_array_equal(np.asarray(t.codes), np.asarray(tr.codes))
    np.testing.assert_array_equal(np.asarray(nvfp4_quantize.dequantize(t)), want_deq)
    np.testing.assert_array_equal(np.asarray(g.swizzle_scales(*g.operand_scales(t), impl="ffi")), want_sw)


# ---------------------------------------------------------------------------------------------
# The GEMM handler's checks (any GPU)


def _gemm_call(a, sa, b, sb, out_dtype=jnp.bfloat16, m=None, n=None):
    m = a.shape[0] if m is None else m
    n = b.shape[0] if n is None else n
    out = (jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((g.WORKSPACE_BYTES,), jnp.uint8))
    d, _ = jax.ffi.ffi_call(g.GEMM_TARGET, out, vmap_method="sequential")(
        a, sa, b, sb, jnp.float32(1.0), jnp.float32(1.0))
    return np.asarray(d)


def _valid(m=64, n=32, k=64):
    a = jnp.zeros((m, k // 2), jnp.uint8)
    b = jnp.zeros((n, k // 2), jnp.uint8)
    sa = jnp.zeros((g.swizzled_scale_bytes(m, k // 16),), jnp.uint8)
    sb = jnp.zeros((g.swizzled_scale_bytes(n, k // 16),), jnp.uint8)
    return a, sa, b, sb


def test_gemm_handler_rejects_bad_arguments():
    a, sa, b, sb = _valid()
    with pytest.raises(Exception, match="K % 32"):  # K = 48
        _gemm_call(a[:, :24], jnp.zeros((g.swizzled_scale_bytes(64, 3),), jnp.uint8), b[:, :24],
                   jnp.zeros((g.swizzled_scale_bytes(32, 3),), jnp.uint8))
    with pytest.raises(Exception, match="reduction dims differ"):
        _gemm_call(a, sa, b[:, :16], sb)
    with pytest.raises(Exception, match="a has dtype float32, expected uint8"):
        _gemm_call(a.astype(jnp.float32), sa, b, sb)
    with pytest.raises(Exception, match="b_scales has shape"):
        _gemm_call(a, sa, b, sb[:100])
    with pytest.raises(Exception, match="d has shape"):
        _gemm_call(a, sa, b, sb, m=63)
    with pytest.raises(Exception, match="d has dtype"):
        _gemm_call(a, sa, b, sb, out_dtype=jnp.int32)


def test_gemm_handler_names_a_pre_sm100_gpu():
    if g.native_available():
        pytest.skip("this GPU has FP4 tensor cores")
    with pytest.raises(Exception, match=r"SM100\+ GPU.*compute capability"):
        _gemm_call(*_valid())
    with pytest.raises(RuntimeError, match="SM100"):
        a = nvfp4_quantize.quantize(jnp.ones((8, 64)), impl="ffi")
        g.nvfp4_gemm(a, a, backend="native")


# ---------------------------------------------------------------------------------------------
# The native GEMM (SM100+ only; skipped on Hopper)


def _bound(a, b, k, out_dtype):
    """fp32 accumulation in any order: |err| <= ~K eps32 sum|a||b| (16x margin); plus one
    rounding of the output."""
    mag = (np.abs(np.asarray(nvfp4_quantize.dequantize(a), np.float64))
           @ np.abs(np.asarray(nvfp4_quantize.dequantize(b), np.float64)).T)
    tol = 16 * k * 2.0 ** -24 * mag
    ref = np.asarray(g.nvfp4_gemm_ref(a, b), np.float64)
    if jnp.dtype(out_dtype) != jnp.dtype(jnp.float32):
        tol = tol + np.abs(ref) * (2.0 ** -8 if jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16) else 2.0 ** -11)
    return ref, tol + 1e-30


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (129, 48, 96), (300, 256, 512), (2048, 4096, 4096)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_native_gemm_matches_reference(m, n, k, out_dtype):
    _needs_sm100()
    x = jax.random.t(_key(), 3.0, (m, k)) * jnp.exp(jax.random.normal(_key(), (m, 1)))
    y = jax.random.normal(_key(), (n, k)) * 0.05
    a = nvfp4_quantize.quantize(x, impl="ffi")
    b = nvfp4_quantize.quantize(y, impl="ffi")
    _poison_allocator()
    d = np.asarray(g.nvfp4_gemm(a, b, out_dtype, backend="native"), np.float64)
    assert np.isfinite(d).all()
    ref, tol = _bound(a, b, k, out_dtype)
    bad = np.abs(d - ref) > tol
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outside the fp32-accumulation bound; "
                           f"worst {np.abs(d - ref).max()}")


@pytest.mark.parametrize("k,n", [(64, 48), (4096, 1024)])
def test_native_gemm_with_a_transposed_tile_weight(k, n):
    _needs_sm100()
    x = jax.random.normal(_key(), (77, k))
    w = jax.random.normal(_key(), (k, n)) * 0.02
    xq = nvfp4_quantize.quantize(x, impl="ffi")
    wt = g.transpose(nvfp4_quantize.quantize(w, tile_2d=True, impl="ffi"))
    d = np.asarray(g.nvfp4_gemm(xq, wt, jnp.float32, backend="native"), np.float64)
    ref, tol = _bound(xq, wt, k, jnp.float32)
    assert (np.abs(d - ref) <= tol).all()


def test_native_linear_close_to_emulated():
    _needs_sm100()
    x = jax.random.normal(_key(), (4, 100, 512), jnp.bfloat16)
    w = (jax.random.normal(_key(), (512, 256)) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(_key(), (4, 100, 256), jnp.bfloat16)

    def run(impl):
        f = lambda x, w: g.nvfp4_linear_emulated(x, w, jax.random.key(0), stochastic_grad=False,
                                                     rht_sign_mask=None, impl=impl)
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    for nat, emu in zip(run(None), run("ref"), strict=True):  # impl="ref": emulated GEMMs
        nat, emu = np.asarray(nat, np.float32), np.asarray(emu, np.float32)
        assert np.linalg.norm(nat - emu) / np.linalg.norm(emu) < 0.02
