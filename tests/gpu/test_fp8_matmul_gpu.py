"""GPU tests of the FP8 GEMM stack: the fused quantizer kernels bit-exact against
`precision.fp8_formats.quantize`, the cuBLASLt FP8 GEMM handler against the fp32 GEMM of its dequantized
operands, the public `fp8_matmul` ("ffi" and "xla") against the reference (forward, dx, dw, amaxes)
and against unquantized GEMMs within the formats' error, the compiled HLO (XLA's rewrite into
`__cublas$lt$matmul$f8`, our custom calls), odd row counts, and outputs over poisoned memory; the
fp8 byte transpose (frozen weights) against jnp.transpose, and the temporary memory of a layer
scan over stacked frozen E4M3 weights (XLA must not hoist whole-stack transposed copies)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import ffi_available, fp8_formats
from surogate_jax.ops.fp8_matmul import (
    TRANSPOSE_TARGET,
    WORKSPACE_BYTES,
    _gemm_ffi,
    _quantize_ffi,
    _transpose_ffi,
    fp8_matmul,
    fp8_matmul_frozen,
    resolve_fp8_impl,
)
from surogate_jax.precision import fp8

pytestmark = pytest.mark.gpu

FORMATS = {"e4m3": fp8_formats.E4M3, "e5m2": fp8_formats.E5M2}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
_seed = itertools.count(2000)
HI = jax.lax.Precision.HIGHEST


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _key():
    return jax.random.key(next(_seed))  # fresh inputs per call


def _poison_allocator(nbytes=256 << 20):
    """Allocate and free a NaN-filled buffer so the next outputs likely land on NaN memory."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _bits(a):
    return np.asarray(jax.device_get(a)).view(np.uint8)


def _same_fp8(got, want, what):
    g, w = np.asarray(jax.device_get(got)), np.asarray(jax.device_get(want))
    assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
    nan_g, nan_w = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    np.testing.assert_array_equal(nan_g, nan_w, err_msg=what)
    np.testing.assert_array_equal(g.view(np.uint8)[~nan_w], w.view(np.uint8)[~nan_w], err_msg=what)


def _np_quantize(x, scale, f8):
    """Host reference of fp8_formats.quantize: one f32 multiply, clip, ml_dtypes' round-to-nearest-even
    cast (independent of how XLA's GPU backend lowers f32 -> f8 converts)."""
    fmax = fp8_formats.fp8_max(f8)
    xs = np.asarray(jax.device_get(jnp.asarray(x, jnp.float32)), np.float32) * np.float32(scale)
    return np.clip(xs, -fmax, fmax).astype(jnp.dtype(f8))


def _wide_range(shape, dtype):
    k1, k2 = jax.random.split(_key())
    mag = jnp.exp2(jax.random.randint(k2, shape, -20, 10).astype(jnp.float32))
    return (jax.random.normal(k1, shape, jnp.float32) * mag).astype(dtype)


# ---- quantizer kernels -------------------------------------------------------------------

QSHAPES = [(1, 16), (7, 33), (65, 130), (1000, 4096), (4097, 24), (129, 1001)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", QSHAPES, ids=str)
def test_quantize_kernels_bit_exact(shape, dtype, fmt):
    x = _wide_range(shape, dtype)
    scale = jnp.float32(np.random.default_rng(next(_seed)).uniform(0.5, 50.0))
    f8 = FORMATS[fmt]
    _poison_allocator()
    q, qt, amax = jax.jit(lambda x, s: _quantize_ffi(x, s, f8, transposed=True))(x, scale)
    q2, none, amax2 = jax.jit(lambda x, s: _quantize_ffi(x, s, f8, transposed=False))(x, scale)
    assert none is None
    want = _np_quantize(x, scale, f8)
    rows = shape[0]
    assert qt.shape == (shape[1], (rows + 15) // 16 * 16)
    _same_fp8(q, want, "q (cast+transpose kernel)")
    _same_fp8(q2, want, "q (cast kernel)")
    _same_fp8(qt[:, :rows], want.T, "qt")
    assert np.all(_bits(qt[:, rows:]) == 0), "qt padding must be zeros"
    want_amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    assert float(amax) == want_amax and float(amax2) == want_amax


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_special_values(fmt):
    f8 = FORMATS[fmt]
    vals = jnp.asarray([0.0, -0.0, 1e30, -1e30, jnp.inf, -jnp.inf, 1e-30, 3.0, jnp.nan, -2.5], jnp.float32)
    x = jnp.tile(vals, (33, 4))  # [33, 40]: odd rows, non-vector columns
    for data, want_amax in ((x, np.nan), (jnp.where(jnp.isnan(x), 0.0, x), np.inf),
                            (jnp.where(jnp.isfinite(x), x, 0.0), 1e30)):
        q, qt, amax = jax.jit(lambda x: _quantize_ffi(x, jnp.float32(2.0), f8, transposed=True))(data)
        want = _np_quantize(data, 2.0, f8)
        _same_fp8(q, want, "q")
        _same_fp8(qt[:, :33], want.T, "qt")
        got = float(amax)
        assert (np.isnan(got) and np.isnan(want_amax)) or got == np.float32(want_amax), (got, want_amax)


# ---- byte transpose of fp8 data (frozen weights) ------------------------------------------

TROWS = [1, 63, 65, 1000]
TCOLS = [16, 48, 4096 + 16]


def _random_fp8_bytes(shape, f8):
    """Every byte pattern equally likely (NaNs with their payloads, infs for e5m2, -0)."""
    b = np.random.default_rng(next(_seed)).integers(0, 256, size=shape, dtype=np.uint8)
    return jax.lax.bitcast_convert_type(jnp.asarray(b), f8)


def _u8(a):
    return np.asarray(jax.device_get(jax.lax.bitcast_convert_type(a, jnp.uint8)))


def _poison_bytes(nbytes=64 << 20, value=0xA5):
    """Like _poison_allocator, but with a byte pattern that is never 0 (NaN f32 has zero bytes)."""
    junk = jnp.full((nbytes,), value, jnp.uint8)
    junk.block_until_ready()
    del junk


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("cols", TCOLS)
@pytest.mark.parametrize("rows", TROWS)
def test_transpose_kernel_bytes_exact(rows, cols, fmt):
    f8 = FORMATS[fmt]
    x = _random_fp8_bytes((rows, cols), f8)
    want = _u8(x).T
    _poison_bytes()
    qt = jax.jit(_transpose_ffi)(x)  # ld_t = rows
    assert qt.shape == (cols, rows) and qt.dtype == jnp.dtype(f8)
    np.testing.assert_array_equal(_u8(qt), want, err_msg="qt vs jnp.transpose bytes")
    np.testing.assert_array_equal(_u8(jax.jit(jnp.transpose)(x)), want)  # the bytes jnp.transpose gives
    ld = (rows + 15) // 16 * 16 + 16  # always > rows: a padded reduction dim
    _poison_bytes()
    qp = jax.jit(lambda x: _transpose_ffi(x, ld))(x)
    assert qp.shape == (cols, ld) and qp.dtype == jnp.dtype(f8)
    np.testing.assert_array_equal(_u8(qp)[:, :rows], want, err_msg="padded qt, data part")
    assert np.all(_u8(qp)[:, rows:] == 0), "padded qt: rows past x must be zero bytes"


def test_transpose_kernel_leading_dims_and_vmap():
    x = _random_fp8_bytes((5, 7, 48), fp8_formats.E5M2)  # the handler takes x [..., C]: R = 35 rows
    call = jax.ffi.ffi_call(TRANSPOSE_TARGET, jax.ShapeDtypeStruct((48, 40), x.dtype), vmap_method="sequential")
    got = _u8(jax.jit(call)(x))
    np.testing.assert_array_equal(got[:, :35], _u8(x).reshape(35, 48).T)
    assert np.all(got[:, 35:] == 0)
    xb = _random_fp8_bytes((3, 35, 48), fp8_formats.E4M3)  # vmap: one call per example
    got = jax.jit(jax.vmap(_transpose_ffi))(xb)
    np.testing.assert_array_equal(_u8(got), np.stack([_u8(xb[i]).T for i in range(3)]))


def test_transpose_rejects_non_fp8_and_short_ld():
    with pytest.raises(Exception, match="float8"):
        jax.jit(_transpose_ffi)(jnp.ones((32, 16), jnp.bfloat16)).block_until_ready()
    with pytest.raises(ValueError, match="ld_t"):
        _transpose_ffi(_random_fp8_bytes((32, 16), fp8_formats.E4M3), 16)


# ---- cuBLASLt FP8 GEMM handler -----------------------------------------------------------

GSHAPES = [(1, 16, 16), (17, 32, 48), (1000, 256, 512), (257, 4096, 1024), (4096, 1024, 12288)]
# (a format, b format, output dtype, fast accumulation): fprop-, dgrad- and wgrad-like calls
COMBOS = [("e4m3", "e4m3", jnp.bfloat16, True), ("e4m3", "e4m3", jnp.float32, True),
          ("e4m3", "e4m3", jnp.float16, False), ("e5m2", "e4m3", jnp.bfloat16, False),
          ("e4m3", "e5m2", jnp.float32, False)]


def _random_fp8(shape, f8):
    return fp8_formats.quantize(jax.random.normal(_key(), shape, jnp.float32), 64.0, f8)


@pytest.mark.parametrize("ta,tb,out_dtype,fast_accum", COMBOS,
                         ids=lambda c: jnp.dtype(c).name if not isinstance(c, (str, bool)) else str(c))
@pytest.mark.parametrize("m,k,n", GSHAPES, ids=str)
def test_gemm_matches_dequantized_fp32_gemm(m, k, n, ta, tb, out_dtype, fast_accum, assert_close):
    a, b = _random_fp8((m, k), FORMATS[ta]), _random_fp8((n, k), FORMATS[tb])
    sa, sb = jnp.float32(1 / 64.0), jnp.float32(1 / 48.0)
    _poison_allocator()
    d = jax.jit(lambda a, b: _gemm_ffi(a, b, sa, sb, out_dtype, fast_accum))(a, b)
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=HI) * (sa * sb)
    assert d.shape == (m, n) and d.dtype == jnp.dtype(out_dtype)
    assert bool(jnp.all(jnp.isfinite(d))), "non-finite output (unwritten memory?)"
    # Operands are exact; differences come from rounding the output and from the FP8 tensor
    # cores' accumulator, which keeps fewer mantissa bits than fp32 between promotions (fast
    # accumulation never promotes): bf16's tolerance even for f32 outputs (still ~10x below the
    # FP8 rounding error of the operands themselves).
    assert_close(d, want, jnp.bfloat16 if out_dtype == jnp.float32 else out_dtype)


def test_gemm_rejects_unaligned_and_e5m2_pairs():
    a = _random_fp8((32, 24), fp8_formats.E4M3)
    with pytest.raises(Exception, match="multiples of 16"):
        jax.jit(lambda a: _gemm_ffi(a, a[:16], 1.0, 1.0, jnp.bfloat16, True))(a).block_until_ready()
    g = _random_fp8((32, 32), fp8_formats.E5M2)
    with pytest.raises(Exception, match="e5m2"):
        jax.jit(lambda g: _gemm_ffi(g, g, 1.0, 1.0, jnp.bfloat16, True))(g).block_until_ready()


# ---- the public op -----------------------------------------------------------------------

OP_SHAPES = [((1000,), 256, 512), ((3, 77), 512, 1024), ((5,), 16, 16), ((4096,), 4096, 1024)]


def _state_for(x, w, dy, h=4):
    """A state whose scales are the delayed-scaling scales after one step that saw x, w, dy."""
    st = fp8_formats.init_matmul_state(h)
    d = fp8_formats.Fp8MatmulState(*(fp8_formats.Fp8TensorState(fp8_formats.amax(t), jnp.zeros(h)) for t in (x, w, dy)))
    return fp8.update(st, d)


def _inputs(lead, k, n, dtype):
    kx, kw, kg = jax.random.split(_key(), 3)
    x = jax.random.normal(kx, (*lead, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    dy = (1e-3 * jax.random.normal(kg, (*lead, n), jnp.float32)).astype(dtype)
    return x, w, dy


def _grads(impl, x, w, dy, st):
    def go(x, w, st, dy):  # dy is an argument: a closed-over array would be constant-folded
        y, vjp = jax.vjp(lambda x, w, s: fp8_matmul(x, w, s, impl=impl), x, w, st)
        return (y, *vjp(dy.astype(y.dtype)))

    return jax.jit(go)(x, w, st, dy)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lead,k,n", OP_SHAPES, ids=str)
def test_public_op_matches_reference(lead, k, n, dtype, impl, assert_close):
    x, w, dy = _inputs(lead, k, n, dtype)
    st = _state_for(x, w, dy)
    want = _grads("ref", x, w, dy, st)
    _poison_allocator()
    got = _grads(impl, x, w, dy, st)
    for name, g, r in zip(("y", "dx", "dw"), got[:3], want[:3], strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert bool(jnp.all(jnp.isfinite(g))), f"{name} has non-finite values (unwritten?)"
        # both sides use the same quantized operands; the xla path rounds the dequantization
        # scale to bf16 (<= 2^-8 relative for two operands) and accumulation order differs:
        # bf16's tolerance for every dtype
        assert_close(g, r, jnp.bfloat16, f"{impl} {name}")
    for t in ("x", "w", "g"):  # amaxes are exact maxima
        assert float(getattr(got[3], t).scale) == float(getattr(want[3], t).scale), t


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_error_against_bf16_gemm_within_fp8_bounds(impl):
    """Relative Frobenius error vs the unquantized GEMMs within the bound the formats imply (see
    tests/ops/test_fp8_matmul.py::test_fp8_error_against_unquantized_gemm)."""
    e4, e5 = 2.0 ** -4 / np.sqrt(3), 2.0 ** -3 / np.sqrt(3)
    x, w, dy = _inputs((1000,), 1024, 2048, jnp.bfloat16)
    y, dx, dw, _ = _grads(impl, x, w, dy, _state_for(x, w, dy))
    f = lambda a: a.astype(jnp.float32)
    rel = lambda a, b: float(jnp.linalg.norm(f(a) - b) / jnp.linalg.norm(b))
    assert rel(y, jnp.dot(f(x), f(w), precision=HI)) < 1.5 * np.hypot(e4, e4)
    assert rel(dx, jnp.dot(f(dy), f(w).T, precision=HI)) < 1.5 * np.hypot(e4, e5)
    assert rel(dw, jnp.dot(f(x).T, f(dy), precision=HI)) < 1.5 * np.hypot(e4, e5)


def _compiled_hlo(impl, lead=(256,), k=512, n=1024):
    x, w, dy = _inputs(lead, k, n, jnp.bfloat16)
    st = _state_for(x, w, dy)

    def loss(x, w, st, dy):
        return jnp.sum(fp8_matmul(x, w, st, impl=impl).astype(jnp.float32) * dy.astype(jnp.float32))

    # value_and_grad: with jax.grad alone the loss value is unused, so y = x @ w is dead code and
    # XLA removes the forward GEMM (only dgrad and wgrad would be left to count).
    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(fn).lower(x, w, st, dy).compile().as_text()


def _gemm_lines(hlo, limit=6000):
    """The compiled program's GEMM-related instructions (the failure messages show these rather
    than the metadata at the top of the module)."""
    keep = ("custom-call(", "custom_call_target", " dot(", "kind=kCustom", "__triton")
    return "\n".join(ln.strip()[:400] for ln in hlo.splitlines() if any(k in ln for k in keep))[:limit]


def _fp8_gemm_count(hlo):
    """GEMMs that read FP8 operands in compiled HLO: cuBLASLt FP8 custom calls, plus fused
    computations (XLA may emit such dots as Triton / custom GEMM fusions) that take f8
    parameters and contain a dot."""
    n = hlo.count("__cublas$lt$matmul$f8")
    fused = 0
    for block in hlo.split("\n\n"):
        header = block.strip().splitlines()[0] if block.strip() else ""
        if ("f8e4m3fn[" in header or "f8e5m2[" in header) and " dot(" in block and "ENTRY" not in header:
            fused += 1
    return n + fused


def test_xla_backend_is_not_rewritten_to_fp8_gemms():
    """Why `ffi` is the default FP8 backend: XLA (jax 0.11.2, H100) compiles the `xla` backend's dequantize-dot
    pattern as plain GEMMs, no FP8 one (README, Not done yet). If a jax starts rewriting it this fails, and the
    default should be re-measured."""
    hlo = _compiled_hlo("xla")
    assert _fp8_gemm_count(hlo) == 0, _gemm_lines(hlo)


def test_ffi_backend_hlo_has_our_calls():
    hlo = _compiled_hlo("ffi")
    assert hlo.count("surogate_fp8_matmul") >= 3 and "surogate_fp8_quantize_t" in hlo, _gemm_lines(hlo)
    assert "__cublas$lt$matmul$f8" not in hlo


def test_auto_picks_a_gpu_backend():
    assert resolve_fp8_impl(None, 512, 1024) in ("ffi", "xla")
    assert resolve_fp8_impl(None, 24, 1024) == "xla"  # unaligned K: the xla path pads
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_matmul(jnp.ones((4, 24), jnp.bfloat16), jnp.ones((24, 32), jnp.bfloat16),
                   fp8_formats.init_matmul_state(4), impl="ffi")


def test_vmap_runs_per_example(assert_close):
    x, w, _ = _inputs((3, 65), 64, 32, jnp.bfloat16)
    st = _state_for(x, w, jnp.ones((1,)))
    f = lambda impl: jax.jit(jax.vmap(lambda x: fp8_matmul(x, w, st, impl=impl)))
    assert_close(f("ffi")(x), f("ref")(x), jnp.bfloat16)


def test_device_supports_fp8():
    assert fp8.check_fp8_supported(jax.devices()[0]) is True  # H100 / H200: compute capability 9.0


# ---- frozen E4M3 weights in a layer scan: no hoisted whole-stack transposes ----------------
#
# The Qwen3-8B LoRA step on the H100 (2026-11-22) held transposed copies of the WHOLE stacked
# frozen cache ([L, K, N] -> [K, L, N] / [L, N, K], hoisted out of the layer scan by XLA's layout
# assignment) while fp8_matmul_frozen's ffi path transposed each layer's slice with jnp.transpose.
# The per-layer transpose is now our custom call (surogate_fp8_transpose), whose operand is the
# loop-variant slice. A layer of the scan below is a Qwen3-8B-sized MLP (up [D, F], down [F, D]
# frozen E4M3, per-layer scales); the program is only compiled (abstract arguments, no memory).

SCAN_L, SCAN_D, SCAN_F, SCAN_M = 6, 4096, 12288, 64


def _frozen_scan_temp_bytes(matmul):
    """Temporary bytes of jit(grad w.r.t. x) of a scan over SCAN_L frozen up/down layers."""
    def loss(x, wu, su, wd, sd, st):
        def layer(h, lw):
            wu_l, su_l, wd_l, sd_l = lw
            u = jax.nn.silu(matmul(h, wu_l, su_l, st))
            return h + matmul(u, wd_l, sd_l, st), None

        h, _ = jax.lax.scan(layer, x, (wu, su, wd, sd))
        return jnp.sum(h.astype(jnp.float32) ** 2)

    S = jax.ShapeDtypeStruct
    L, D, F, M = SCAN_L, SCAN_D, SCAN_F, SCAN_M
    st = fp8_formats.init_matmul_state(4)
    args = (S((M, D), jnp.bfloat16), S((L, D, F), fp8_formats.E4M3), S((L,), jnp.float32),
            S((L, F, D), fp8_formats.E4M3), S((L,), jnp.float32), st)
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    hlo = compiled.as_text()
    lines = [ln.strip()[:300] for ln in hlo.splitlines()
             if "f8e4m3fn[" in ln and ("transpose" in ln or "copy" in ln)][:12]
    return compiled.memory_analysis().temp_size_in_bytes, "\n".join(lines)


def _scan_budget():
    """2 x one layer's weight bytes (its transposed operands) + activations (every layer's
    [M, D] input and two [M, F] MLP values, generously in fp32, plus a few [M, D] gradients) +
    the cuBLASLt workspace outputs of four GEMM calls (32 MiB each)."""
    L, D, F, M = SCAN_L, SCAN_D, SCAN_F, SCAN_M
    layer_w = 2 * D * F  # fp8: one byte each
    act = L * M * (D + 2 * F) * 4 + 4 * M * D * 4
    return layer_w, 2 * layer_w + act + 4 * WORKSPACE_BYTES


def test_frozen_scan_does_not_hoist_weight_transposes():
    layer_w, budget = _scan_budget()
    temp, lines = _frozen_scan_temp_bytes(
        lambda x, w, s, st: fp8_matmul_frozen(x, w, s, st, impl="ffi"))
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    assert temp < budget, (
        f"temp {mib(temp)} >= budget {mib(budget)} (2 x layer weights {mib(2 * layer_w)} + activations "
        f"+ 4 cuBLASLt workspaces); the whole stack is {mib(SCAN_L * layer_w)}: XLA hoisted "
        f"transposed copies of stacked weights?\nf8 transpose/copy instructions:\n{lines}")


def _old_frozen_matmul():
    """The frozen forward as it was before surogate_fp8_transpose: jnp.transpose of the per-layer
    fp8 slice feeding our GEMM (dx only in the backward). Scales are irrelevant to the layout."""
    @jax.custom_vjp
    def mm(x2, wq):
        xq, _, _ = _quantize_ffi(x2, jnp.float32(1.0), fp8_formats.E4M3, transposed=False)
        return _gemm_ffi(xq, jnp.transpose(wq), 1.0, 1.0, x2.dtype, True)

    def fwd(x2, wq):
        return mm(x2, wq), wq

    def bwd(wq, dy):
        gq, _, _ = _quantize_ffi(dy, jnp.float32(1.0), fp8_formats.E5M2, transposed=False)
        return _gemm_ffi(gq, wq, 1.0, 1.0, dy.dtype, False), None

    mm.defvjp(fwd, bwd)
    return lambda x, w, s, st: mm(x, w)


def test_frozen_scan_budget_catches_the_old_transpose():
    """The budget above discriminates: with the old jnp.transpose XLA hoists whole-stack copies
    at this size too (H100, 2026-11-22), so the regression test would catch their return."""
    _, budget = _scan_budget()
    temp, lines = _frozen_scan_temp_bytes(_old_frozen_matmul())
    assert temp >= budget, (f"old jnp.transpose path: temp {temp / 2**20:.1f} MiB < budget "
                            f"{budget / 2**20:.1f} MiB: the budget no longer tells the two apart\n{lines}")
