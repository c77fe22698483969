"""On the GPU: the precision recipes inside the decoder and the train step.

fp8-hybrid through our FFI (cuBLASLt FP8 + fused cast kernels) agrees with the pure-JAX reference
within FP8 accumulation tolerance (loss and every gradient, full fine-tuning and the LoRA base cache
through fp8_matmul_frozen); the XLA dequantize-dot path too; a few train steps are finite and
learn; nvfp4 (emulated, CUDA quantizers) trains finitely; skipped layers run through lax.cond.
Run: `.venv/bin/python -m pytest -q tests/gpu/test_recipe_gpu.py` (or python3 on the GPU machine)."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from surogate_jax import lora as lora_lib
from surogate_jax import train as T
from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.ops import fp8_formats
from surogate_jax.ops._loader import ffi_available
from surogate_jax.ops.fp8_matmul import resolve_fp8_impl
from surogate_jax.precision import fp8
from surogate_jax.precision.recipe import (
    QuantRecipe,
    cache_frozen_weights,
    init_quant_state,
)

pytestmark = pytest.mark.gpu

# Every projection dim a multiple of 16 (cuBLASLt FP8, NVFP4 blocks): 256, 704, 8*64, 2*64.
CFG = DecoderConfig(
    model_type="qwen3", vocab_size=1001, hidden_size=256, intermediate_size=704, num_layers=3,
    num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True, initializer_range=0.05,
    dtype=jnp.bfloat16, param_dtype=jnp.float32,
)
SPEC = LoraSpec(rank=8, alpha=16.0,
                targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
B, S = 2, 256


def _rel(a, b):
    a, b = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _ids(seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, S)), jnp.int32)


def _params(seed=0):
    return nn.meta.unbox(Decoder(CFG).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"])


def _loss(model, variables, ids):
    logits = model.apply(variables, ids).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[..., None], -1)[..., 0])


def _check_grads(g, g_ref, g_bf16):
    """Every gradient leaf finite and about as close to the reference as the bf16 model's is (the
    FP8 tolerance measured in place: on a random-init model the gradients are sums that largely
    cancel, so FP8 vs bf16 differ by ~20% norm-wise; a wiring error (transposed or mis-scaled
    operand) gives ~100%). Dry-run on CPU with impl=xla (bf16 dots there): ratios up to 1.09."""
    flat = jax.tree_util.tree_flatten_with_path(g)[0]
    for (path, a), b, c in zip(flat, jax.tree.leaves(g_ref), jax.tree.leaves(g_bf16), strict=True):
        name = jax.tree_util.keystr(path)
        assert bool(jnp.all(jnp.isfinite(a))), name
        got, fp8_err = _rel(a, b), _rel(c, b)
        print(f"  {name}: rel to ref {got:.4f} (bf16 vs ref {fp8_err:.4f})")
        assert got < max(0.05, 1.5 * fp8_err), (name, got, fp8_err)


def _calibrated_state(model, params, ids):
    """The fp8 state after one observation (scale-1 states would flush the small dY to zero in E5M2,
    making every gradient comparison vacuous)."""
    quant = init_quant_state(model)
    obs = jax.jit(jax.grad(lambda q: _loss(model, {"params": params, "fp8": q}, ids)))(quant)
    return fp8.update(quant, obs)


def test_ffi_is_what_auto_picks():
    assert ffi_available(), "the FFI extension is not built: build it before the GPU session"
    for k, n in ((256, 512), (256, 704), (704, 256), (512, 256)):
        assert resolve_fp8_impl(None, k, n) == "ffi"


@pytest.mark.parametrize("m,k,n", [(1000, 256, 704), (512, 704, 256), (37, 128, 48)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_fp8_matmul_frozen_ffi_matches_reference(m, k, n, dtype, layout, assert_close):
    from surogate_jax.ops.fp8_matmul import fp8_matmul_frozen

    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32)
    s_w = jnp.float32(fp8_formats.E4M3_MAX / float(jnp.max(jnp.abs(w))))
    wq = fp8_formats.quantize(w, s_w, fp8_formats.E4M3)
    wq = wq.T if layout == "nk" else wq  # "nk": a QLoRA base's [N, K], transposed only for dx
    st = fp8_formats.init_matmul_state(4)
    st = fp8_formats.Fp8MatmulState(fp8_formats.Fp8TensorState(jnp.float32(100.0), st.x.amax_history), st.w,
                            fp8_formats.Fp8TensorState(jnp.float32(2.0 ** 12), st.g.amax_history))
    dy = jnp.asarray(rng.standard_normal((m, n)) * 1e-3, dtype)

    def run(impl, x, wq, s_w, st, dy):  # arguments, not closures: closed-over arrays get constant-folded
        y, vjp = jax.vjp(lambda x, s: fp8_matmul_frozen(x, wq, s_w, s, impl=impl, w_layout=layout), x, st)
        dx, ds = vjp(dy)
        return y, dx, ds

    y, dx, ds = jax.jit(functools.partial(run, "ffi"))(x, wq, s_w, st, dy)
    y_ref, dx_ref, ds_ref = jax.jit(functools.partial(run, "ref"))(x, wq, s_w, st, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(dx)))
    # identical quantized operands; the FP8 tensor cores' accumulator keeps fewer mantissa bits than
    # fp32 between promotions (none with the forward's fast accumulation): bf16's tolerance for every
    # dtype, as tests/gpu/test_fp8_matmul_gpu.py
    assert_close(y, y_ref, jnp.bfloat16)
    assert_close(dx, dx_ref, jnp.bfloat16)
    np.testing.assert_allclose(float(ds.x.scale), float(ds_ref.x.scale))
    np.testing.assert_allclose(float(ds.g.scale), float(ds_ref.g.scale))
    assert float(ds.w.scale) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_fp8_model_matches_reference_loss_and_grads(impl):
    params, ids = _params(0), _ids(1)
    ref_model = Decoder(CFG.replace(recipe=QuantRecipe("fp8-hybrid", fp8_impl="ref")))
    model = Decoder(CFG.replace(recipe=QuantRecipe("fp8-hybrid", fp8_impl=impl)))
    quant = _calibrated_state(ref_model, params, ids)

    def f(m, p, q):
        return _loss(m, {"params": p, "fp8": q}, ids)

    (l_ref, (g_ref, o_ref)) = jax.jit(
        jax.value_and_grad(lambda p, q: f(ref_model, p, q), argnums=(0, 1)))(params, quant)
    (l, (g, o)) = jax.jit(jax.value_and_grad(lambda p, q: f(model, p, q), argnums=(0, 1)))(params, quant)
    l_bf16, g_bf16 = jax.jit(jax.value_and_grad(lambda p: _loss(Decoder(CFG), {"params": p}, ids)))(params)
    print(f"{impl}: loss {float(l):.6f} ref {float(l_ref):.6f} bf16 {float(l_bf16):.6f}")
    assert np.isfinite(float(l))
    assert abs(float(l) - float(l_ref)) < 2e-3 * abs(float(l_ref))  # same quantized operands, GEMM accumulation differs
    assert abs(float(l) - float(l_bf16)) < 2e-2 * abs(float(l_bf16))  # FP8 vs bf16
    _check_grads(g, g_ref, g_bf16)
    # the observed scales agree: w's exactly (the same weights); x's where the input is the same tensor
    # for every backend (the first layer's q/k/v input: the normed embedding) up to half a bf16 ulp
    # (2^-8): xla and the reference are exact, but the ffi kernel takes the normed x as stored in bf16,
    # while XLA may fuse the norm into the reference's amax without that rounding (excess precision;
    # measured 1.7e-3 on the H100, 2026-11-23); elsewhere up to
    # what differently accumulated GEMMs upstream change in a max: 10% for both (ffi LOOSENED from 5%:
    # with the model's norm/RoPE kernels on by default, in both models, down_proj's x scale measured
    # 5.26% apart on the H100, 2026-11-23, vs 2.2% with XLA's norms on the same inputs: a max over
    # activations after two layers of differently accumulated FP8 GEMMs, not a kernel error; xla
    # LOOSENED earlier: its GEMMs are dequantize + bf16 dot, measured 5.6%); dY's (a max over noisy
    # sums after E5M2 roundings in every later layer) loosely
    devs = []
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(o)[0], jax.tree.leaves(o_ref), strict=True):
        name = jax.tree_util.keystr(path)
        if "scale" not in name:
            continue
        a, b = np.atleast_1d(np.asarray(a, np.float64)), np.atleast_1d(np.asarray(b, np.float64))
        rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-30)  # per layer
        if ".w." in name:
            devs.append((float(rel.max()), 0.0, name))
        elif ".x." in name:
            same_input = any(f"['{p}']" in name for p in ("q_proj", "k_proj", "v_proj"))
            if same_input:
                devs.append((float(rel[0]), 1e-6 if impl == "xla" else 2.0 ** -8, name + "[layer 0]"))
            x_rtol = 0.1
            devs.append((float(rel[1:].max() if same_input and rel.size > 1 else rel.max()), x_rtol, name))
        else:
            devs.append((float(rel.max()), 0.25, name))
    print(impl, "largest scale deviations (dev, rtol, leaf):", sorted(devs, reverse=True)[:8],
          "layer-0 q/k/v x:", [d for d in devs if "layer 0" in d[2]])
    for dev, rtol, name in devs:
        assert dev <= rtol, (name, dev, rtol)


@pytest.mark.slow
def test_fp8_lora_cache_through_ffi_matches_reference():
    params, ids = _params(0), _ids(2)
    base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ref_r, r = QuantRecipe("fp8-hybrid", fp8_impl="ref"), QuantRecipe("fp8-hybrid", fp8_impl="ffi")
    ref_model = Decoder(CFG.replace(recipe=ref_r, lora=SPEC))
    model = Decoder(CFG.replace(recipe=r, lora=SPEC))
    adapters = jax.tree.map(lambda a: a + 0.01,
                            lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32)))
    cached = cache_frozen_weights(base, r, CFG.num_layers)
    assert cached["layers"]["mlp"]["up_proj"]["kernel_nk"].dtype == jnp.float8_e4m3fn
    quant = init_quant_state(model)
    obs = jax.grad(lambda q: _loss(ref_model, {"params": cached, "lora": adapters, "fp8": q}, ids))(quant)
    quant = fp8.update(quant, obs)

    def f(m, a):
        return _loss(m, {"params": cached, "lora": a, "fp8": quant}, ids)

    l_ref, g_ref = jax.jit(jax.value_and_grad(lambda a: f(ref_model, a)))(adapters)
    l, g = jax.jit(jax.value_and_grad(lambda a: f(model, a)))(adapters)
    plain = Decoder(CFG.replace(lora=SPEC))
    g_bf16 = jax.jit(jax.grad(lambda a: _loss(plain, {"params": base, "lora": a}, ids)))(adapters)
    print(f"lora cache: loss {float(l):.6f} ref {float(l_ref):.6f}")
    assert abs(float(l) - float(l_ref)) < 2e-3 * abs(float(l_ref))
    _check_grads(g, g_ref, g_bf16)


def _train(recipe, lora=False, steps=6):
    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(CFG.replace(recipe=recipe, lora=SPEC if lora else None))
    tx = optax.adam(3e-3)
    if lora:
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params(0))
        trainable = lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    else:
        params, trainable = {}, _params(0)
    state = T.init_state(model, tx, params, trainable, seed=0, mesh=mesh)
    step = T.jit_train_step(model, tx, lambda s: 3e-3, mesh, state)
    ids = np.asarray(_ids(3))
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, 1), "loss_mask": np.ones((B, S), np.float32),
             "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(),
             "segment_ids": np.ones((B, S), np.int32)}
    batch = {k: np.stack([v[:1], v[1:]]) for k, v in batch.items()}  # 2 micro-batches of 1 row
    losses = []
    for _ in range(steps):
        state, m = step(state, T.global_batch(mesh, batch, True))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("recipe,lora", [
    (QuantRecipe("fp8-hybrid"), False),
    (QuantRecipe("fp8-hybrid"), True),
    (QuantRecipe("fp8-hybrid", skip_first=1, skip_last=1), False),
    (QuantRecipe("nvfp4"), False),
    (QuantRecipe("nvfp4"), True),
], ids=["fp8", "fp8-lora", "fp8-skip", "nvfp4", "nvfp4-lora"])
def test_train_steps_are_finite_and_learn(recipe, lora):
    state, losses = _train(recipe, lora)
    print(recipe.describe(), "lora" if lora else "full", [round(x, 4) for x in losses])
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    if recipe.has_state:
        for leaf in jax.tree.leaves(state.quant):
            assert bool(jnp.all(jnp.isfinite(leaf)))
        if recipe.skips:  # layers 0 and 2 skipped: only layer 1 observed amaxes
            st = state.quant["layers"]["mlp"]["up_proj"]["state"]
            h = np.asarray(st.x.amax_history)
            assert (h[1, :6] > 0).all() and (h[0] == 0).all() and (h[2] == 0).all(), h


def test_recipes_track_bf16_over_a_few_steps():
    _, bf16 = _train(None, steps=6)
    _, f8 = _train(dataclasses.replace(QuantRecipe("fp8-hybrid")), steps=6)
    _, f4 = _train(QuantRecipe("nvfp4"), steps=6)
    print("bf16", bf16, "fp8", f8, "nvfp4", f4)
    assert abs(f8[-1] - bf16[-1]) < 0.02 * bf16[0]
    assert abs(f4[-1] - bf16[-1]) < 0.10 * bf16[0]
