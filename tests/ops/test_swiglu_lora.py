"""CPU tests of surogate_jax.ops.swiglu_lora: the public op (its custom_vjp on the reference
passes) against autodiff of `swiglu_lora_ref` and against the model's unfused formula (Linear +
LoRA + swiglu), argument errors, the model's MLP on either path, and the lowered FFI call."""

from __future__ import annotations

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.ops import swiglu_lora, swiglu_lora_ref, swiglu_ref

# (leading dims, F, R): odd rows and widths, rank below / at / above the kernel's chunk of 16
SHAPES = [((7,), 8, 1), ((13,), 1001, 4), ((2, 31), 96, 16), ((3, 5), 1000, 20), ((1, 1), 24, 33)]
DTYPES = [jnp.float32, jnp.bfloat16]
# the float32 reference's dots run in TF32 on XLA:GPU, too coarse for the float32 tolerance
DTYPES_EXACT_FP32 = [pytest.param(jnp.float32, marks=pytest.mark.cpu), jnp.bfloat16]


def _inputs(seed, lead, F, R, dtype):
    k = jax.random.split(jax.random.key(seed), 4)
    gu = (2.0 * jax.random.normal(k[0], (*lead, 2 * F))).astype(dtype)
    xa = jax.random.normal(k[1], (*lead, 2 * R)).astype(dtype)
    b = (0.5 * jax.random.normal(k[2], (2, R, F))).astype(dtype)
    proj = jax.random.normal(k[3], (*lead, F))
    return gu, xa, b, proj


def _truth(gu, xa, b, scale):
    """fp32 math on the inputs; gate/up carry the op's roundings in value, not in gradient."""
    dtype = gu.dtype
    gu, xa, b = (a.astype(jnp.float32) for a in (gu, xa, b))
    F, R = b.shape[2], b.shape[1]

    def rnd(v):  # the dtype's rounding in value only
        return v + jax.lax.stop_gradient(v.astype(dtype).astype(jnp.float32) - v)

    def one(base, x, bb):  # the model's three roundings: x @ B, * scale, + base
        return rnd(base + rnd(rnd(x @ bb) * scale))

    gate, up = one(gu[..., :F], xa[..., :R], b[0]), one(gu[..., F:], xa[..., R:], b[1])
    return (jax.nn.silu(gate) * up).astype(dtype)


def _value_and_grads(fn, gu, xa, b, proj):
    def loss(g, x, bb):
        return jnp.sum(fn(g, x, bb).astype(jnp.float32) * proj)

    return fn(gu, xa, b), jax.grad(loss, argnums=(0, 1, 2))(gu, xa, b)


def _as(form, gu):
    """The op's base argument: one [..., 2F] array (packed) or the (gate, up) pair (sep)."""
    F = gu.shape[-1] // 2
    return gu if form == "packed" else (gu[..., :F], gu[..., F:])


def _to_packed(dbase):
    return jnp.concatenate(dbase, axis=-1) if isinstance(dbase, tuple) else dbase


@pytest.mark.parametrize("form", ["packed", "sep"])
@pytest.mark.parametrize("dtype", DTYPES_EXACT_FP32, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_public_op_matches_autodiff_of_reference(shape, dtype, form, assert_close):
    """Against fp32 autodiff that rounds only where the op specifies (gate and up in the dtype):
    autodiff of the bf16 reference rounds every step of silu's derivative, which sums over rows
    amplify past bf16 tolerance. The (gate, up) form's gradient comes back as a pair."""
    lead, F, R = shape
    gu, xa, b, proj = _inputs(F + R, lead, F, R, dtype)
    scale = 1.5
    base = _as(form, gu)
    h, grads = _value_and_grads(lambda g, x, bb: swiglu_lora(g, x, bb, scale, impl="ref"), base, xa, b, proj)
    h_ref, grads_ref = _value_and_grads(lambda g, x, bb: _truth(g, x, bb, scale), gu, xa, b, proj)
    assert h.shape == (*lead, F) and h.dtype == dtype
    assert isinstance(grads[0], tuple) == (form == "sep")
    assert_close(h, h_ref, dtype, "h")
    for name, a, r in zip(("dgate_up", "dxa", "dlora_b"), (_to_packed(grads[0]), *grads[1:]), grads_ref, strict=True):
        assert a.dtype == dtype, name
        assert_close(a, r, dtype, name)


def test_reference_is_the_models_unfused_formula():
    gu, xa, b, _ = _inputs(3, (4, 9), 40, 6, jnp.float32)
    F, R = 40, 6
    gate = gu[..., :F] + (xa[..., :R] @ b[0]) * 0.25
    up = gu[..., F:] + (xa[..., R:] @ b[1]) * 0.25
    want = np.asarray(jax.nn.silu(gate) * up)
    np.testing.assert_allclose(swiglu_lora_ref(gu, xa, b, 0.25), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(swiglu_lora(gu, xa, b, 0.25, impl="ref"), swiglu_ref(gate, up), rtol=1e-5, atol=1e-5)


def test_argument_errors():
    gu, xa, b, _ = _inputs(0, (5,), 8, 2, jnp.float32)
    with pytest.raises(ValueError, match="even"):
        swiglu_lora(gu[..., :-1], xa, b, 1.0)
    with pytest.raises(ValueError, match="lora_b"):
        swiglu_lora(gu, xa, b[:1], 1.0)
    with pytest.raises(ValueError, match="xa"):
        swiglu_lora(gu, xa[..., :-1], b, 1.0)
    with pytest.raises(TypeError, match="dtype"):
        swiglu_lora(gu, xa.astype(jnp.bfloat16), b, 1.0)
    with pytest.raises(ValueError, match="gate, up"):
        swiglu_lora((gu[..., :8], gu[..., 8:15]), xa, b, 1.0)
    with pytest.raises(ValueError, match="lora_b"):
        swiglu_lora(_as("sep", gu), xa, b[:, :, :4], 1.0)
    with pytest.raises(TypeError, match="gate, up"):
        swiglu_lora((gu[..., :8], gu[..., 8:].astype(jnp.bfloat16)), xa, b, 1.0)


def test_checkpoint_name_and_lowered_ffi_calls():
    gu, xa, b, _ = _inputs(1, (4, 6), 16, 4, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda *a: swiglu_lora(*a, 2.0, impl="ref"))(gu, xa, b)
    assert "name=swiglu" in str(jaxpr)
    mod = importlib.import_module("surogate_jax.ops.swiglu_lora")  # the package attribute is the function
    dh = jnp.zeros((4, 6, 16), jnp.bfloat16)
    for form in ("packed", "sep"):
        base = (gu,) if form == "packed" else _as("sep", gu)
        for dhs, target, n_out in [((), "fwd", 1), ((dh,), "bwd", len(base)), ((dh, dh), "bwd_split", len(base))]:
            name = f"surogate_swiglu_lora_{'sep_' if form == 'sep' else ''}{target}"
            fn = jax.jit(lambda *a, nd=len(dhs): mod._pass_ffi(a[:nd], a[nd:-2], a[-2], a[-1], scale=2.0))
            lowered = fn.lower(*dhs, *base, xa, b)
            assert f'"{name}"' in lowered.as_text() or f"@{name}" in lowered.as_text(), name
            assert "scale = 2.0" in lowered.as_text()
            outs = jax.eval_shape(fn, *dhs, *base, xa, b)
            want = [(4, 6, 16)] if not dhs else [b.shape for b in base]  # h [.., F], or the base's form
            assert [o.shape for o in outs] == want and len(outs) == n_out, name


LORA = LoraSpec(rank=4, alpha=8.0, targets=("gate_proj", "up_proj", "down_proj"))
CFG = DecoderConfig(model_type="qwen3", vocab_size=67, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, initializer_range=0.2, lora=LORA)


def _model_loss_and_grads(cfg, ids):
    model = Decoder(cfg)
    variables = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids[:, :4])
    params = nn.meta.unbox(variables["params"])
    # non-zero B so the LoRA path matters
    lora = jax.tree.map(lambda a: a + 0.1, nn.meta.unbox(variables["lora"]))

    def loss(lo):
        logits = model.apply({"params": params, "lora": lo}, ids).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[..., None], -1)[..., 0])

    return jax.value_and_grad(loss)(lora), model, params, lora


@pytest.mark.cpu  # agreement to 1e-6 holds where both paths are the reference; on a GPU one is the kernel
def test_model_mlp_same_with_fused_lora_path():
    """kernels with "swiglu_lora" route the MLP through swiglu_lora (one gate/up GEMM); on CPU both
    paths are references, so loss and LoRA gradients agree, and the parameters are the same."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 67, (2, 11)), jnp.int32)
    (l0, g0), _, p0, _ = _model_loss_and_grads(CFG.replace(kernels=()), ids)
    (l1, g1), model, p1, lora = _model_loss_and_grads(CFG.replace(kernels=("swiglu_lora",)), ids)
    assert jax.tree.structure(p0) == jax.tree.structure(p1)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    text = str(jax.make_jaxpr(lambda lo: model.apply({"params": p1, "lora": lo}, ids))(lora))
    assert "_swiglu_lora_split" in text and "name=swiglu" in text  # down_proj has LoRA: split output


@pytest.mark.parametrize("targets", [("gate_proj", "down_proj"), ("q_proj",)])
def test_model_falls_back_without_lora_on_gate_and_up(targets):
    cfg = CFG.replace(kernels=("swiglu_lora",), lora=LoraSpec(rank=2, alpha=2.0, targets=targets))
    ids = jnp.zeros((1, 5), jnp.int32)
    model = Decoder(cfg)
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids)
    text = str(jax.make_jaxpr(lambda v: model.apply(v, ids))(v))
    assert "swiglu_lora" not in text


@pytest.mark.parametrize("form", ["packed", "sep"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_split_output_gradients_sum(dtype, form, assert_close):
    """split_output gives h twice; gradients through both uses equal those of one h whose
    cotangent is their sum."""
    gu, xa, b, p1 = _inputs(11, (3, 17), 40, 5, dtype)
    p2 = jax.random.normal(jax.random.key(99), p1.shape)
    base = _as(form, gu)

    def two(g, x, bb):
        h1, h2 = swiglu_lora(g, x, bb, 0.5, impl="ref", split_output=True)
        return jnp.sum(h1.astype(jnp.float32) * p1) + jnp.sum(h2.astype(jnp.float32) * p2)

    def one(g, x, bb):
        return jnp.sum(swiglu_lora(g, x, bb, 0.5, impl="ref").astype(jnp.float32) * (p1 + p2))

    h1, h2 = swiglu_lora(base, xa, b, 0.5, impl="ref", split_output=True)
    np.testing.assert_array_equal(np.asarray(h1, np.float32), np.asarray(h2, np.float32))
    for name, a, r in zip(("dgate_up", "dxa", "dlora_b"), jax.grad(two, argnums=(0, 1, 2))(base, xa, b),
                          jax.grad(one, argnums=(0, 1, 2))(base, xa, b), strict=True):
        assert_close(_to_packed(a), _to_packed(r), dtype, name)


@pytest.mark.cpu  # tight agreement holds where both paths are the reference; on a GPU one is the kernel
@pytest.mark.parametrize("big", [False, True], ids=["packed", "sep"])
def test_model_gate_up_form_by_kernel_size(big, monkeypatch):
    """Gate/up kernels within PACK_GATE_UP_MAX_BYTES: one GEMM over the concatenated kernels;
    above it (8B: the per-step concat cost more than the op saved) two GEMMs, the op's pair form.
    Same loss and LoRA gradients either way (CPU: references)."""
    from surogate_jax.models import llamalike

    seen = []

    def spy(base, *a, **kw):
        seen.append([b.shape[-1] for b in base] if isinstance(base, tuple) else [base.shape[-1]])
        return swiglu_lora(base, *a, **kw)

    monkeypatch.setattr(llamalike, "swiglu_lora", spy)
    if big:  # the test model's kernels (2 x 32 x 48 x 4 bytes) above the limit
        monkeypatch.setattr(llamalike, "PACK_GATE_UP_MAX_BYTES", 2 * 32 * 48 * 4 - 1)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 67, (2, 9)), jnp.int32)
    base = CFG.replace(num_layers=1)
    (l1, g1), _, _, _ = _model_loss_and_grads(base.replace(kernels=("swiglu_lora",)), ids)
    assert seen and all(w == ([48, 48] if big else [96]) for w in seen), seen
    (l0, g0), _, _, _ = _model_loss_and_grads(base.replace(kernels=()), ids)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
