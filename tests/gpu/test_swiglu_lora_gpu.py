"""GPU tests of the SwiGLU+LoRA kernels (impl="ffi") against the reference passes: forward h and
backward dgate_up (packed) or dgate, dup (separate gate/up operands), f32/bf16/f16, odd rows /
widths / ranks (vector and scalar paths, rank chunks of 16 with a remainder, a rank above 64),
bf16 with the scale folded into xa, fresh inputs, outputs poisoned so unwritten elements show;
the whole op's gradients under jit; the model's MLP on the kernel vs SUROGATE_JAX_OPS=ref."""

from __future__ import annotations

import importlib
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.ops import ffi_available, swiglu_lora

sl = importlib.import_module("surogate_jax.ops.swiglu_lora")
pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (leading dims, F, R)
SHAPES = [((7,), 8, 1), ((13,), 1001, 4), ((2, 31), 96, 16), ((3, 5), 1000, 20), ((1, 1), 24, 33),
          ((4099,), 1024, 16), ((257,), 3072, 64), ((2, 2048), 3072, 16), ((33,), 17408, 8),
          ((45,), 520, 80)]
_seed = itertools.count(7000)


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _inputs(lead, F, R, dtype):
    """Random operands. In 16 bits xa and B are multiples of 1/4 and 1/8, so the rank-R products
    are exact in fp32 and round alike on both sides: summed in other orders (the kernel's MMAs,
    XLA's GEMM), inexact ones can round to neighbouring 16-bit values, and that one-unit move of
    gate grew to 10% in dgate at one element of 15000 (bf16, [3, 5, 1000], R = 20)."""
    k = jax.random.split(jax.random.key(next(_seed)), 5)
    gu = (2.0 * jax.random.normal(k[0], (*lead, 2 * F))).astype(dtype)
    xa = jax.random.normal(k[1], (*lead, 2 * R))
    b = 0.5 * jax.random.normal(k[2], (2, R, F))
    if jnp.dtype(dtype).itemsize == 2:
        xa, b = jnp.round(xa * 4) / 4, jnp.round(b * 8) / 8
    xa, b = xa.astype(dtype), b.astype(dtype)
    dh = jax.random.normal(k[3], (*lead, F)).astype(dtype)
    return gu, xa, b, dh, k[4]


def _poison_allocator(nbytes=256 << 20):
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _check(name, got, want, dtype, assert_close):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert bool(jnp.all(jnp.isfinite(got))), f"{name} has non-finite values (unwritten?)"
    assert_close(got, want, dtype, name)


def _passes(fn, dhs_list, base, xa, b, scale, poison):
    """fn's forward and backward passes (one dh, then two) on one base form."""
    outs = []
    for dhs in dhs_list:
        if poison:
            _poison_allocator()
        nd = len(dhs)
        f = jax.jit(lambda *a, nd=nd: fn(a[:nd], a[nd:-2], a[-2], a[-1], scale=scale))
        outs.append(f(*dhs, *base, xa, b))
    return outs


def _check_passes(shape, dtype, scale, assert_close):
    """Both base forms: gate_up packed [.., 2F], and gate, up as two arrays (whose kernel outputs
    must be the packed kernel's halves, bit for bit: same code, other strides)."""
    lead, F, R = shape
    gu, xa, b, dh, _ = _inputs(lead, F, R, dtype)
    dh2 = jax.random.normal(jax.random.key(next(_seed)), dh.shape).astype(dtype)  # split_output's backward
    dhs_list = [(), (dh,), (dh, dh2)]
    sep = (gu[..., :F], gu[..., F:])
    with jax.default_matmul_precision("highest"):  # fp32: no TF32 in the reference's rank product
        want = _passes(sl._pass_ref, dhs_list, (gu,), xa, b, scale, False)
    got = _passes(sl._pass_ffi, dhs_list, (gu,), xa, b, scale, True)
    got_sep = _passes(sl._pass_ffi, dhs_list, sep, xa, b, scale, True)
    for name, g, gs, w in zip(("h", "dgate_up", "dgate_up (split)"), got, got_sep, want, strict=True):
        assert len(g) == 1 and len(gs) == (1 if name == "h" else 2), name
        _check(name, g[0], w[0], dtype, assert_close)
        if name != "h":
            for half, o in zip(("dgate", "dup"), gs, strict=True):
                assert o.shape == (*lead, F) and bool(jnp.all(jnp.isfinite(o))), f"{name} sep {half}"
        np.testing.assert_array_equal(np.asarray(jnp.concatenate(gs, -1) if len(gs) == 2 else gs[0], np.float32),
                                      np.asarray(g[0], np.float32), err_msg=f"{name}: sep vs packed")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_passes_match_reference(shape, dtype, assert_close):
    _check_passes(shape, dtype, 0.75, assert_close)


@pytest.mark.parametrize("scale", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[4], SHAPES[7]], ids=str)
def test_folded_scale_matches_reference(shape, scale, assert_close):
    """bf16 with a power-of-two scale >= 1: the kernel folds the scale into xa (exact) and skips the
    epilogue's multiply and rounding; vector and scalar paths, a rank remainder."""
    _check_passes(shape, jnp.bfloat16, scale, assert_close)


@pytest.mark.parametrize("form", ["packed", "sep"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [((3, 5), 1000, 20), ((2, 2048), 3072, 16)], ids=str)
def test_op_gradients_match_reference(shape, dtype, form, assert_close):
    """The whole op under jit (custom_vjp, factor GEMMs, both base forms)."""
    lead, F, R = shape
    gu, xa, b, _, kp = _inputs(lead, F, R, dtype)
    if form == "sep":
        gu = (gu[..., :F], gu[..., F:])
    proj = jax.random.normal(kp, (*lead, F), jnp.float32)

    def run(impl):
        def loss(*a):
            return jnp.sum(swiglu_lora(*a, 2.0, impl=impl).astype(jnp.float32) * proj)

        h = jax.jit(lambda *a: swiglu_lora(*a, 2.0, impl=impl))(gu, xa, b)
        return h, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(gu, xa, b)

    with jax.default_matmul_precision("highest"):
        (h_ref, g_ref), (h, g) = run("ref"), run("ffi")
    _check("h", h, h_ref, dtype, assert_close)  # (a summed loss cancels: its bf16 error is not relative)
    for name, a, r in zip(("dgate_up", "dxa", "dlora_b"), g, g_ref, strict=True):
        for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(r), strict=True)):
            _check(f"{name}[{i}]", x, y, dtype, assert_close)


def test_deterministic():
    gu, xa, b, dh, _ = _inputs((4096,), 3072, 16, jnp.bfloat16)
    f = jax.jit(lambda *a: sl._pass_ffi(a[:1], a[1:2], a[2], a[3], scale=2.0))
    np.testing.assert_array_equal(np.asarray(f(dh, gu, xa, b)[0]), np.asarray(f(dh, gu, xa, b)[0]))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["packed", "sep"])
def test_model_uses_kernel_and_matches_reference(form, monkeypatch, force_ref):
    lora = LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "gate_proj", "up_proj", "down_proj"))
    cfg = DecoderConfig(model_type="qwen3", vocab_size=1001, hidden_size=256, intermediate_size=704,
                        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True,
                        initializer_range=0.05, dtype=jnp.float32, attention_impl="xla", lora=lora,
                        kernels=("swiglu_lora",))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 1001, (2, 130)), jnp.int32)
    if form == "sep":  # the 2 x 256 x 704 fp32 gate/up kernels above the packing limit
        from surogate_jax.models import llamalike

        monkeypatch.setattr(llamalike, "PACK_GATE_UP_MAX_BYTES", 1 << 20)
    model = Decoder(cfg)
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids[:, :4])
    params = nn.meta.unbox(v["params"])
    lo = jax.tree.map(lambda a: a + 0.05, nn.meta.unbox(v["lora"]))

    def loss(lo):
        logits = model.apply({"params": params, "lora": lo}, ids).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[..., None], -1)[..., 0])

    grad = jax.jit(jax.value_and_grad(loss))
    text = grad.lower(lo).as_text()
    pre = "surogate_swiglu_lora_" + ("sep_" if form == "sep" else "")
    assert f"{pre}fwd" in text and f"{pre}bwd_split" in text  # down_proj has LoRA
    with jax.default_matmul_precision("highest"):
        l_ffi, g_ffi = grad(lo)
        force_ref("ref")
        l_ref, g_ref = jax.jit(jax.value_and_grad(loss))(lo)
    np.testing.assert_allclose(float(l_ffi), float(l_ref), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_ffi)[0], jax.tree.leaves(g_ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-12, path
