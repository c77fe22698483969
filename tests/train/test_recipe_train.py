"""Precision recipes in the train step (tiny model, CPU references of the quantized GEMMs):
fp8-hybrid and nvfp4 train close to bf16, the delayed-scaling state moves and combines micro-batches
with a max, resumes bit-exactly, skipped layers are exactly the plain model, and the LoRA base cache
(float8 for fp8) computes what quantizing every step computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny import CFG, SPEC, base_params, random_batch

from surogate_jax import lora as lora_lib
from surogate_jax import train as T
from surogate_jax.checkpoint import Checkpointer, abstract_like, strip_scratch
from surogate_jax.models import Decoder
from surogate_jax.ops import fp8_formats
from surogate_jax.precision import recipe as R
from surogate_jax.precision.recipe import (
    KERNEL_NK,
    KERNEL_SCALE,
    QuantRecipe,
    cache_frozen_weights,
)

FP8 = QuantRecipe("fp8-hybrid", fp8_impl="ref", amax_history=8)
NVFP4 = QuantRecipe("nvfp4", fp4_impl="ref")
IDS = jnp.asarray(np.random.default_rng(7).integers(1, 67, (2, 16)), jnp.int32)


def _copy(t):
    return jax.tree.map(jnp.copy, t)


def _batches(n, seed=0, accum=1, rows=2):
    rng = np.random.default_rng(seed)
    return [{k: v.reshape(accum, rows // accum, 16) for k, v in random_batch(rng, rows, 16).items()} for _ in range(n)]


def _setup(recipe, lora=False, tx=None, cfg=CFG):
    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(cfg.replace(recipe=recipe, lora=SPEC if lora else None))
    tx = tx or optax.adam(1e-2)
    if lora:
        params = base_params(cfg=cfg)
        trainable = lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
        trainable = jax.tree.map(lambda x: x + 0.05, trainable)  # B != 0: the base GEMMs' dY matter
    else:
        params, trainable = {}, base_params(cfg=cfg)
    state = T.init_state(model, tx, _copy(params), _copy(trainable), seed=0, mesh=mesh)
    step = T.jit_train_step(model, tx, lambda s: 1e-2, mesh, state)
    return mesh, model, state, step


def _train(recipe, batches, lora=False, tx=None):
    mesh, _model, state, step = _setup(recipe, lora, tx)
    losses = []
    for b in batches:
        state, m = step(state, T.global_batch(mesh, b, True))
        losses.append(float(m["loss"]))
    return state, losses


def _states(quant):
    """{projection: Fp8MatmulState [L]} of the fp8 collection."""
    out = {}
    for group in ("self_attn", "mlp"):
        for name, node in quant["layers"][group].items():
            out[name] = node["state"]
    return out


STEPS = 4


@pytest.fixture(scope="module")
def bf16_losses():
    return _train(None, _batches(1) * STEPS)[1]


@pytest.mark.parametrize("recipe,rel", [(FP8, 0.03), (NVFP4, 0.15)], ids=["fp8", "nvfp4"])
def test_recipe_trains_close_to_bf16(recipe, rel, bf16_losses):
    # rel: the first-step loss gap, and the gap of the loss drop after 4 steps on one tiny batch as a
    # fraction of the initial loss (NVFP4's 4-bit operands on a 32-wide model err by ~10% per GEMM
    # and the overfitting run amplifies it; FP8 E4M3 by ~3%); both must learn like bf16.
    ref = bf16_losses
    state, got = _train(recipe, _batches(1) * STEPS)
    assert all(np.isfinite(got)), got
    assert got[-1] < 0.6 * got[0], got
    np.testing.assert_allclose(got[0], ref[0], rtol=rel)
    assert abs(got[-1] - ref[-1]) < rel * ref[0], (got, ref)  # the loss drop is within rel of bf16's
    if not recipe.has_state:
        assert state.quant == {}
        return
    # the delayed-scaling state moved: STEPS amaxes recorded (newest first), scales = max / history max
    for name, st in _states(state.quant).items():
        for t in ("x", "w", "g"):
            ts = getattr(st, t)
            hist = np.asarray(ts.amax_history)  # [L, 8]
            assert (hist[:, :STEPS] > 0).all() and (hist[:, STEPS:] == 0).all(), (name, t, hist)
            want = fp8_formats.fp8_max(fp8_formats.MATMUL_FORMATS[t]) / hist.max(axis=1)
            np.testing.assert_allclose(np.asarray(ts.scale), want, rtol=1e-6, err_msg=f"{name}.{t}")


def test_fp8_accumulation_takes_the_max_of_micro_batches():
    (both,) = _batches(1, seed=3, accum=2, rows=4)
    halves = [{k: v[i:i + 1] for k, v in both.items()} for i in range(2)]
    tx = optax.sgd(0.0)
    s_ab, _ = _train(FP8, [both], tx=tx)
    mesh, _, s0, step = _setup(FP8, tx=tx)  # one compile for both halves (same shapes)
    s_a, _ = step(_copy(s0), T.global_batch(mesh, halves[0], True))
    s_b, _ = step(s0, T.global_batch(mesh, halves[1], True))
    newest = lambda s: jax.tree.map(lambda h: np.asarray(h)[..., 0], [(st.x.amax_history, st.g.amax_history)
                                                                      for st in _states(s.quant).values()])
    ab, a, b = newest(s_ab), newest(s_a), newest(s_b)
    for u, v, w in zip(jax.tree.leaves(ab), jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, np.maximum(v, w))
        assert not np.allclose(u, v + w)  # a sum would be wrong


def test_fp8_quant_state_and_cached_base_resume_bit_exactly(tmp_path):
    batches = _batches(4, seed=5)
    mesh, _model, state, step = _setup(FP8, lora=True)
    for b in batches[:2]:
        state, _ = step(state, T.global_batch(mesh, b, True))
    ck = Checkpointer(tmp_path, keep=2, async_save=False)
    ck.save(2, state, {"pos": 2}, {})
    ck.wait()
    restored, data, at = ck.restore(abstract_like(strip_scratch(state)))
    ck.close()
    assert data == {"pos": 2} and at == 2
    assert restored.params["layers"]["self_attn"]["q_proj"][KERNEL_NK].dtype == jnp.float8_e4m3fn
    for a, c in zip(jax.tree.leaves(restored), jax.tree.leaves(strip_scratch(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32) if a.dtype == jnp.float8_e4m3fn else a),
                                      np.asarray(c.astype(jnp.float32) if c.dtype == jnp.float8_e4m3fn else c))
    hist = _states(restored.quant)["q_proj"].x.amax_history
    assert (np.asarray(hist)[:, :2] > 0).all()

    def cont(s):
        out = []
        for b in batches[2:]:
            s, m = step(s, T.global_batch(mesh, b, True))
            out.append(float(m["loss"]))
        return out, s

    l1, s1 = cont(restored.replace(first_nonfinite=T.fresh_flag(mesh)))
    l2, s2 = cont(state)
    assert l1 == l2
    for a, c in zip(jax.tree.leaves(s1.quant), jax.tree.leaves(s2.quant), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("recipe", [FP8, NVFP4], ids=["fp8", "nvfp4"])
def test_all_layers_skipped_is_exactly_the_plain_model(recipe):
    import dataclasses

    params = base_params()
    skip = dataclasses.replace(recipe, skip_first=1, skip_last=1)  # both layers of the tiny model
    plain = Decoder(CFG)
    model = Decoder(CFG.replace(recipe=skip))
    v = {"params": params}
    if skip.has_state:
        from surogate_jax.precision.recipe import init_quant_state

        v["fp8"] = init_quant_state(model)

    def loss(m, p):
        return jnp.sum(jnp.square(m.apply({**v, "params": p}, IDS, rngs={"quant": jax.random.key(3)})))

    np.testing.assert_array_equal(np.asarray(model.apply(v, IDS)), np.asarray(plain.apply({"params": params}, IDS)))
    g1, g2 = jax.grad(lambda p: loss(model, p))(params), jax.grad(lambda p: loss(plain, p))(params)
    for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_skipped_layer_is_plain_and_gets_no_observations():
    import dataclasses

    skip_last = dataclasses.replace(FP8, skip_last=1)
    state, losses = _train(skip_last, _batches(2))
    assert all(np.isfinite(losses))
    for name, st in _states(state.quant).items():
        for t in ("x", "g"):
            h = np.asarray(getattr(st, t).amax_history)
            assert (h[0, :2] > 0).all() and (h[1] == 0).all(), (name, t, h)  # layer 1 skipped
            assert float(getattr(st, t).scale[1]) == 1.0
    # the choice itself: layers 0 and 2 of 3 skipped, layer 1 quantized
    # integer operands up to 40: every sum is exact in fp32 (any order), and E4M3 (3 mantissa bits)
    # still rounds values such as 17 or 37, so the quantized GEMM differs from the plain one
    x = jnp.asarray(np.random.default_rng(0).integers(-40, 41, (3, 5, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).integers(-40, 41, (32, 4, 8)), jnp.float32)
    st = fp8_formats.init_matmul_state(4)
    r = dataclasses.replace(FP8, skip_first=1, skip_last=1)
    f = jax.jit(lambda layer: R.linear(r, x, w, in_dims=1, dtype=jnp.float32, fp8_state=st, layer=layer, num_layers=3))
    plain = jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())))
    quant = R.linear(FP8, x, w, in_dims=1, dtype=jnp.float32, fp8_state=st)
    np.testing.assert_array_equal(np.asarray(f(0)), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(f(2)), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(f(1)), np.asarray(quant))
    assert not np.array_equal(np.asarray(quant), np.asarray(plain))


@pytest.mark.parametrize("recipe", [FP8, NVFP4, QuantRecipe("fp8-hybrid", fp8_impl="ref", skip_first=1)],
                         ids=["fp8", "nvfp4", "fp8-skip-first"])
def test_lora_base_cache_equals_quantizing_every_step(recipe):
    params = base_params()
    model = Decoder(CFG.replace(recipe=recipe, lora=SPEC))
    adapters = jax.tree.map(lambda x: x + 0.05,
                            lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32)))
    cached = cache_frozen_weights(params, recipe, CFG.num_layers)
    q = cached["layers"]["self_attn"]["q_proj"]
    assert q[KERNEL_SCALE].shape == (CFG.num_layers,)
    if recipe.name == "fp8-hybrid" and not recipe.skips:
        assert q[KERNEL_NK].dtype == jnp.float8_e4m3fn  # half the bf16 memory
        assert "kernel" not in q  # the [L, out, in] layout the forward GEMM reads:
        assert q[KERNEL_NK].shape == (CFG.num_layers, CFG.num_heads * CFG.head_dim, CFG.hidden_size)
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(cached)[0]]
    assert {p[-2] for p in paths if p[-1] == KERNEL_SCALE} == set(R.PROJECTIONS)  # only the seven
    v = {}
    if recipe.has_state:
        from surogate_jax.precision.recipe import init_quant_state

        quant = init_quant_state(model)
        # quantizing every step with the scale the cache used (current scaling): set state.w.scale
        def with_w_scale(node, path=()):
            if isinstance(node, dict) and "state" in node:
                proj = path[-1]
                group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                s = cached["layers"][group][proj][KERNEL_SCALE]
                st = node["state"]
                return {"state": fp8_formats.Fp8MatmulState(st.x, fp8_formats.Fp8TensorState(s, st.w.amax_history),
                                                            st.g)}
            return {k: with_w_scale(c, (*path, k)) for k, c in node.items()} if isinstance(node, dict) else node

        v["fp8"] = with_w_scale(quant)

    def loss(p, a):
        out = model.apply({**v, "params": p, "lora": a}, IDS, rngs={"quant": jax.random.key(3)})
        return jnp.sum(jnp.square(out.astype(jnp.float32))), out

    (_l1, y1), g1 = jax.value_and_grad(loss, argnums=1, has_aux=True)(cached, adapters)
    (_l2, y2), g2 = jax.value_and_grad(loss, argnums=1, has_aux=True)(params, adapters)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("recipe", [FP8, NVFP4], ids=["fp8", "nvfp4"])
def test_lora_training_under_recipe_keeps_the_cache(recipe):
    mesh, _model, state, step = _setup(recipe, lora=True)
    before = _copy(state.params)
    losses = []
    for b in _batches(1, seed=9) * 5:
        state, m = step(state, T.global_batch(mesh, b, True))
        losses.append(float(m["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    for a, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        assert a.dtype == c.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(c.astype(jnp.float32)))


@pytest.mark.parametrize("recipe", [FP8, QuantRecipe("fp8-hybrid", fp8_impl="ref", skip_first=1)],
                         ids=["fp8", "fp8-skip-first"])
def test_dequantize_cache_restores_each_kernel_shape(recipe):
    """The [L, out, in] cache goes back to each kernel's own [L, in..., out...] (o_proj contracts two dims), within
    E4M3's half-ulp of the weights; the skipped layer comes back exact."""
    params = base_params()
    cached = cache_frozen_weights(params, recipe, CFG.num_layers)
    back = R.dequantize_cache(cached, recipe, CFG.num_layers, params)
    for p, w in jax.tree_util.tree_flatten_with_path(params)[0]:
        got = back
        for k in p:
            got = got[k.key]
        assert got.shape == w.shape, p
        w32 = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), w32, rtol=2**-4, atol=np.abs(w32).max() * 2**-9)
        if recipe.skips and "kernel" in str(p[-1]) and any(k.key in R.PROJECTIONS for k in p):
            np.testing.assert_array_equal(np.asarray(got[0], np.float32), w32[0])  # layer 0 is not quantized
