"""NorMuon (surogate_jax.optim.normuon): Newton-Schulz math and bounds, several steps against a
float64 numpy implementation of the official algorithm, the parameter partition on the real model
tree, cautious weight decay, schedules, jit with donated state, Orbax round trip, and training."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from surogate_jax.config import OptimConfig
from surogate_jax.optim import adamw_8bit, make_optimizer, normuon
from surogate_jax.optim.normuon import (
    MUON_COEFFS,
    POLAR_EXPRESS_COEFFS,
    MatrixDims,
    default_matrix_dims,
    newton_schulz,
    normuon_labels,
    scale_by_normuon,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from tiny import CFG, SPEC, base_params, random_batch  # noqa: E402  (tests/train/tiny.py)

_base_params = functools.cache(base_params)  # one init per test session (its XLA compile is the cost)


def _abstract_params(cfg=CFG):
    """The tiny model's parameter tree as ShapeDtypeStructs (no compile, no compute)."""
    from surogate_jax.models import Decoder
    return jax.eval_shape(
        lambda: nn.meta.unbox(Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))
TABLES = {"muon": (MUON_COEFFS, 1.0, 1e-7), "polar_express": (POLAR_EXPRESS_COEFFS, 1.02, 1e-6)}


# ---------------------------------------------------------------------------------------------
# float64 numpy reference (zichongli5/NorMuon normuon.py's algorithm, our (in, out) layout)


def np_newton_schulz(x, coeffs="muon"):
    table, mult, eps = TABLES[coeffs]
    x = np.asarray(x, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = np.swapaxes(x, -1, -2)
    x = x / (np.sqrt(np.sum(x * x, axis=(-2, -1), keepdims=True)) * mult + eps)
    for a, b, c in table:
        gram = x @ np.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return np.swapaxes(x, -1, -2) if tall else x


def scalar_map(s, coeffs="muon", mult=None):
    """What NS does to each singular value s of X / ||X||_F (X / (mult ||X||_F) is iterated)."""
    table, default_mult, _ = TABLES[coeffs]
    s = np.asarray(s, np.float64) / (default_mult if mult is None else mult)
    for a, b, c in table:
        s = a * s + b * s**3 + c * s**5
    return s


def np_normuon_step(p, g, mu, nu, lr, d: MatrixDims, *, momentum, beta2, wd, cautious, nesterov, lr_rule, coeffs):
    eps = 1e-10
    lead = p.shape[: d.lead]
    m = math.prod(p.shape[d.lead : d.lead + d.n_in])
    n = math.prod(p.shape[d.lead + d.n_in :])
    mu = momentum * mu + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * mu if nesterov else mu
    o = np_newton_schulz(u.reshape(*lead, m, n), coeffs)
    nu = beta2 * nu + (1 - beta2) * np.mean(o * o, axis=-2).reshape(nu.shape)
    oh = o / (np.sqrt(nu.reshape(*lead, 1, n)) + eps)
    fro = lambda a: np.sqrt(np.sum(a * a, axis=(-2, -1), keepdims=True))  # noqa: E731
    oh = oh * fro(o) / (fro(oh) + eps)
    if lr_rule == "muon":
        oh = oh * math.sqrt(max(1.0, n / m))
    else:
        oh = oh * 0.2 * math.sqrt(m * n) / (fro(oh) + eps)
    upd = oh.reshape(p.shape)
    decay = wd * p * ((upd * p >= 0) if cautious else 1.0)
    return p - lr * (upd + decay), mu, nu


# ---------------------------------------------------------------------------------------------
# Newton-Schulz


SHAPES = [(16, 16), (9, 23), (23, 9), (3, 12, 30), (2, 2, 40, 7)]


@pytest.mark.parametrize("coeffs", ["muon", "polar_express"])
@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_fp32_is_the_scalar_map_on_singular_values(shape, coeffs):
    """In exact arithmetic NS maps X = U S V^T to U f(S/||X||_F) V^T with f the 5-step polynomial;
    fp32 GEMMs must reproduce both the float64 iteration and that spectral form."""
    x = np.random.default_rng(0).normal(size=shape)
    got = np.asarray(newton_schulz(jnp.asarray(x, jnp.float32), coeffs=coeffs, dtype=jnp.float32), np.float64)
    want = np_newton_schulz(x, coeffs)
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    fro = np.sqrt(np.sum(s * s, axis=-1, keepdims=True))
    _, mult, eps = TABLES[coeffs]
    spectral = u @ (scalar_map(s / (fro * mult + eps), coeffs, mult=1.0)[..., None] * vt)
    np.testing.assert_allclose(want, spectral, atol=1e-9)
    # fp32 vs float64: each step can amplify rounding by |f'| <= a (3.4445; 8.16 for Polar
    # Express's first step), so allow 1e-4 instead of the plain fp32 tolerance.
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_newton_schulz_band_of_the_polynomials():
    """The guarantee: singular values s of X/||X||_F lie in (0, 1]; for s >= 2e-3 five steps land
    in [0.68, 1.21] (Muon's quintic) and [0.85, 1.15] (Polar Express)."""
    s = np.geomspace(2e-3, 1.0, 200001)
    y = scalar_map(s, "muon")
    assert 0.68 < y.min() < 0.69 and 1.20 < y.max() < 1.21, (y.min(), y.max())
    y = scalar_map(s, "polar_express")
    assert 0.85 < y.min() and y.max() < 1.15, (y.min(), y.max())
    assert scalar_map(1e-4, "muon") < 0.1  # tiny directions are not amplified to 1: no blow-up, no miracle


@pytest.mark.parametrize("coeffs, band", [("muon", (0.68, 1.21)), ("polar_express", (0.85, 1.15))])
@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (4, 48, 40), (100, 30)])
def test_newton_schulz_bf16_singular_values_in_band(shape, coeffs, band):
    """bf16 GEMM inputs (the default): singular values stay in the polynomial's band, widened by
    a few bf16 ulps (8 * 2^-8 ~ 0.03) for the rounding of five iterations."""
    x = np.random.default_rng(1).normal(size=shape)
    s_in = np.linalg.svd(x, compute_uv=False)
    assert (s_in.min(-1) / np.sqrt((s_in**2).sum(-1)) > 2e-3).all()  # inputs inside the band's domain
    o = newton_schulz(jnp.asarray(x, jnp.float32))  if coeffs == "muon" else \
        newton_schulz(jnp.asarray(x, jnp.float32), coeffs=coeffs)
    s = np.linalg.svd(np.asarray(o, np.float64), compute_uv=False)
    slack = 8 * 2.0**-8
    assert band[0] - slack < s.min() and s.max() < band[1] + slack, (s.min(), s.max())


def test_newton_schulz_commutes_with_transpose():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 17, 29)), jnp.float32)
    a = newton_schulz(x, dtype=jnp.float32)
    b = jnp.swapaxes(newton_schulz(jnp.swapaxes(x, -1, -2), dtype=jnp.float32), -1, -2)
    np.testing.assert_allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The whole step against the float64 reference


def _tree(rng):
    """Stacked [L, in..., out...] kernels of every layout, plain 2-D wide/tall, and aux leaves."""
    f = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)  # noqa: E731
    return {
        "layers": {"self_attn": {"q_proj": {"kernel": f(3, 12, 2, 5)}, "o_proj": {"kernel": f(3, 2, 5, 12)}},
                   "mlp": {"down_proj": {"kernel": f(3, 20, 12)}, "up_proj": {"kernel": f(3, 12, 20)}},
                   "input_layernorm": {"scale": f(3, 12)}},
        "wide": {"kernel": f(7, 19)},
        "tall": {"kernel": f(19, 7)},
        "embedding": f(11, 12),
        "norm": {"scale": f(12)},
    }


CASES = [
    {"nesterov": True, "lr_rule": "adamw", "wd": 0.1, "cautious": True, "coeffs": "muon"},
    {"nesterov": False, "lr_rule": "muon", "wd": 0.3, "cautious": False, "coeffs": "muon"},
    {"nesterov": True, "lr_rule": "muon", "wd": 0.0, "cautious": True, "coeffs": "polar_express"},
]


def by_key(tree) -> dict:
    """{"['layers']['mlp']...": leaf} for a pytree."""
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['lr_rule']}-{c['coeffs']}-nesterov{c['nesterov']}")
def test_several_steps_match_float64_reference(case):
    rng = np.random.default_rng(3)
    params = _tree(rng)
    sched = lambda t: 0.05 / (1.0 + t)  # noqa: E731  (a schedule: step t uses lr 0.05 / (1 + t))
    hyper = {"momentum": 0.9, "beta2": 0.8, "wd": case["wd"], "cautious": case["cautious"],
             "nesterov": case["nesterov"], "lr_rule": case["lr_rule"], "coeffs": case["coeffs"]}
    tx = normuon(sched, momentum=0.9, beta2=0.8, weight_decay=case["wd"], cautious_wd=case["cautious"],
                 nesterov=case["nesterov"], ns_coeffs=case["coeffs"], ns_dtype=jnp.float32, lr_rule=case["lr_rule"])
    update = jax.jit(tx.update)
    state = tx.init(params)
    labels = by_key(normuon_labels(params))
    # The AdamW half must equal adamw_8bit run on those leaves alone (norm scales never decayed).
    pick = lambda t, lab: {k: v for k, v in by_key(t).items() if labels[k] == lab}  # noqa: E731
    adams = {"adamw": adamw_8bit(sched, weight_decay=case["wd"]),
             "adamw_nodecay": adamw_8bit(sched, weight_decay=0.0, fp32_mask=True)}
    adam_params = {lab: pick(params, lab) for lab in adams}
    adam_states = {lab: adams[lab].init(adam_params[lab]) for lab in adams}
    # The NorMuon half: float64 reference state per matrix leaf.
    dims = {k: default_matrix_dims(path, x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if labels[(k := jax.tree_util.keystr(path))] == "normuon"}
    ref = {k: (np.asarray(x, np.float64), np.zeros(x.shape), np.zeros(x.shape[: dims[k].lead] + x.shape[sum(dims[k]):]))
           for k, x in pick(params, "normuon").items()}
    for t in range(4):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        upd, state = update(grads, state, params)
        params = optax.apply_updates(params, upd)
        got = by_key(params)
        for lab, adam in adams.items():
            u, adam_states[lab] = jax.jit(adam.update)(pick(grads, lab), adam_states[lab], adam_params[lab])
            adam_params[lab] = optax.apply_updates(adam_params[lab], u)
            for k, want in adam_params[lab].items():
                np.testing.assert_allclose(got[k], want, rtol=1e-6, atol=1e-7, err_msg=f"step {t} {k}")
        g64 = {k: np.asarray(x, np.float64) for k, x in by_key(grads).items()}
        for k, (p, mu, nu) in ref.items():
            ref[k] = np_normuon_step(p, g64[k], mu, nu, sched(t), dims[k], **hyper)
            # 1e-4 of the parameter RMS: fp32 NS vs float64 (see the NS test) plus float32 state.
            scale = float(np.sqrt(np.mean(ref[k][0] ** 2)))
            np.testing.assert_allclose(got[k], ref[k][0], rtol=0, atol=1e-4 * scale, err_msg=f"step {t} {k}")


def test_bf16_newton_schulz_step_close_to_reference():
    """The default bf16 GEMMs give the fp32 direction to within bf16 rounding (cosine > 0.999)."""
    t = _tree(np.random.default_rng(4))
    params = {"layers": {"self_attn": t["layers"]["self_attn"]}, "tall": t["tall"]}
    grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(5).normal(size=p.shape), jnp.float32), params)
    u16, _ = jax.jit(normuon(1.0).update)(grads, normuon(1.0).init(params), params)
    u32, _ = jax.jit(normuon(1.0, ns_dtype=jnp.float32).update)(grads, normuon(1.0).init(params), params)
    for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(u32), strict=True):
        a, b = np.ravel(a), np.ravel(b)
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999


def test_second_moment_equalizes_output_neurons_and_update_rms():
    """beta2 = 0: after normalization every output neuron (column of the (in, out) view) has the
    same mean square, and lr_rule='adamw' makes the update RMS exactly 0.2 (x lr)."""
    g = {"k": {"kernel": jnp.asarray(np.random.default_rng(6).normal(size=(24, 10)) * np.arange(1, 11), jnp.float32)}}
    tx = scale_by_normuon(momentum=0.0, beta2=0.0, ns_dtype=jnp.float32)
    u, state = jax.jit(tx.update)(g, tx.init(g))
    col_ms = np.mean(np.square(np.asarray(u["k"]["kernel"], np.float64)), axis=0)
    np.testing.assert_allclose(col_ms, col_ms.mean(), rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(np.mean(np.square(u["k"]["kernel"]))), 0.2, rtol=1e-5)
    assert state.nu["k"]["kernel"].shape == (10,)


def test_zero_gradient_gives_zero_update():
    """lora_a's first gradient is exactly zero (lora_b starts at zero): no NaN, no motion."""
    p = {"layers": {"q_proj": {"lora_a": jnp.ones((2, 8, 4)), "lora_b": jnp.zeros((2, 4, 6))}}}
    tx = normuon(0.1, weight_decay=0.1)
    u, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)
    for leaf in jax.tree.leaves(u):
        assert np.all(np.isfinite(leaf))
    np.testing.assert_array_equal(u["layers"]["q_proj"]["lora_b"], 0.0)


# ---------------------------------------------------------------------------------------------
# Partition, weight decay, schedule


def test_partition_on_the_tiny_model():
    p = _abstract_params()
    labels = jax.tree_util.tree_flatten_with_path(normuon_labels(p))[0]
    got = {jax.tree_util.keystr(k): v for k, v in labels}
    muon = {k for k, v in got.items() if v == "normuon"}
    assert muon == {f"['layers']['{blk}']['{p}']['kernel']" for blk, ps in
                    (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                     ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps}
    assert got["['embedding']"] == got["['lm_head']"] == "adamw"
    assert all(v == "adamw_nodecay" for k, v in got.items() if k.endswith("['scale']"))
    # Views: q_proj [L, D, H, K] -> L x (D, H*K); o_proj [L, H, K, D] -> L x (H*K, D).
    q = p["layers"]["self_attn"]["q_proj"]["kernel"]
    o = p["layers"]["self_attn"]["o_proj"]["kernel"]
    path = lambda *ks: tuple(jax.tree_util.DictKey(k) for k in ks)  # noqa: E731
    assert default_matrix_dims(path("layers", "self_attn", "q_proj", "kernel"), q) == MatrixDims(1, 1)
    assert default_matrix_dims(path("layers", "self_attn", "o_proj", "kernel"), o) == MatrixDims(1, 2)
    # Qwen2.5-style biases go to the undecayed AdamW group.
    bias_labels = normuon_labels({"q_proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,))}})
    assert bias_labels["q_proj"]["bias"] == "adamw_nodecay"


def test_partition_of_lora_adapters():
    from surogate_jax.lora import init_adapters
    from surogate_jax.models import Decoder

    model = Decoder(CFG.replace(lora=SPEC))
    adapters = jax.eval_shape(lambda: init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32)))
    labels = normuon_labels(adapters)
    assert set(jax.tree.leaves(labels)) == {"normuon"}
    state = jax.eval_shape(normuon(1e-2).init, adapters)
    nu = state.inner_states["normuon"].inner_state[0].nu["layers"]
    # lora_a [L, in..., r]: one second moment per rank row; lora_b [L, r, out...]: per output.
    assert nu["self_attn"]["o_proj"]["lora_a"].shape == (CFG.num_layers, SPEC.rank)
    assert nu["self_attn"]["q_proj"]["lora_b"].shape == (CFG.num_layers, CFG.num_heads, CFG.head_dim)


def test_partition_of_an_moe_model():
    """As Surogate splits them: the router and the stacked experts' own weights go to AdamW; each expert's LoRA
    adapters are their own matrices (the expert axis leads, like the layer axis)."""
    from surogate_jax.lora import init_adapters
    from surogate_jax.models import Decoder

    moe = CFG.replace(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    ids = jnp.zeros((1, 1), jnp.int32)
    full = by_key(normuon_labels(jax.eval_shape(lambda: Decoder(moe).init(jax.random.key(0), ids)["params"])))
    assert full["['layers']['mlp']['gate']['kernel']"] == "adamw"
    assert {full[f"['layers']['mlp']['experts']['{p}']"] for p in ("gate_proj", "up_proj", "down_proj")} == {"adamw"}
    assert full["['layers']['self_attn']['q_proj']['kernel']"] == "normuon"
    model = Decoder(moe.replace(lora=SPEC))
    adapters = jax.eval_shape(lambda: init_adapters(model, jax.random.key(1), ids))
    assert set(jax.tree.leaves(normuon_labels(adapters))) == {"normuon"}
    nu = jax.eval_shape(normuon(1e-2).init, adapters).inner_states["normuon"].inner_state[0].nu["layers"]
    # down_proj lora_a [L, E, I, r]: one second moment per layer, expert and rank row; lora_b [L, E, r, D]: per output
    assert nu["mlp"]["experts"]["down_proj"]["lora_a"].shape == (CFG.num_layers, 4, SPEC.rank)
    assert nu["mlp"]["experts"]["down_proj"]["lora_b"].shape == (CFG.num_layers, 4, CFG.hidden_size)


def test_cautious_weight_decay_only_where_update_and_param_agree():
    rng = np.random.default_rng(7)
    p = {"w": {"kernel": jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)}}
    g = {"w": {"kernel": jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)}}
    lr, wd = 0.1, 0.5
    direction, _ = jax.jit(scale_by_normuon(ns_dtype=jnp.float32).update)(g, scale_by_normuon().init(p))
    u = np.asarray(direction["w"]["kernel"])
    w = np.asarray(p["w"]["kernel"])
    for cautious in (True, False):
        tx = normuon(lr, weight_decay=wd, cautious_wd=cautious, ns_dtype=jnp.float32)
        got = np.asarray(jax.jit(tx.update)(g, tx.init(p), p)[0]["w"]["kernel"])
        decay = got + lr * u  # what the step adds beyond -lr * u
        agree = u * w >= 0
        assert 0.2 < agree.mean() < 0.8  # both cases present
        if cautious:
            np.testing.assert_allclose(decay[agree], -lr * wd * w[agree], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(decay[~agree], 0.0, atol=1e-7)
        else:
            np.testing.assert_allclose(decay, -lr * wd * w, rtol=1e-5, atol=1e-7)


def test_learning_rate_schedule_scales_each_step():
    """momentum = beta2 = 0 and a fixed gradient: the direction repeats, so step t moves by lr(t)."""
    p = {"w": {"kernel": jnp.asarray(np.random.default_rng(8).normal(size=(10, 6)), jnp.float32)}}
    sched = optax.linear_schedule(0.0, 1.0, 4)
    tx = normuon(sched, momentum=0.0, beta2=0.0, ns_dtype=jnp.float32)
    state = tx.init(p)
    sizes = []
    for _ in range(5):
        u, state = jax.jit(tx.update)(p, state, p)
        sizes.append(float(jnp.sqrt(jnp.mean(jnp.square(u["w"]["kernel"])))))
    np.testing.assert_allclose(sizes, [0.2 * float(sched(t)) for t in range(5)], rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# jit + donation, Orbax, config, sharding, training


def _small_tree(rng):
    """One stacked NorMuon matrix, an embedding big enough (>= 4096) for 8-bit AdamW states, a norm."""
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return {"layers": {"mlp": {"up_proj": {"kernel": f(2, 12, 20)}}}, "embedding": f(80, 64), "norm": {"scale": f(12)}}


def test_jit_with_donated_state():
    params = _small_tree(np.random.default_rng(11))
    tx = normuon(1e-2, weight_decay=0.1)
    grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(12).normal(size=p.shape), jnp.float32), params)

    def step(params, state):
        u, state = tx.update(grads, state, params)
        return optax.apply_updates(params, u), state

    plain = jax.jit(step)
    want = plain(*plain(params, tx.init(params)))
    donated = jax.jit(step, donate_argnums=(0, 1))
    # jit(init): eager adamw_8bit init returns one zeros buffer for both fp32 moments, which a
    # donating call refuses ("donate the same buffer twice"); the trainer builds its state under jit.
    p, s = jax.tree.map(jnp.copy, params), jax.jit(tx.init)(params)
    first = jax.tree.leaves(s)[0]
    p, s = donated(*donated(p, s))
    assert first.is_deleted()  # the state buffers were donated
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    params = _small_tree(np.random.default_rng(13))
    tx = normuon(1e-2)
    update = jax.jit(tx.update)
    grads = jax.tree.map(lambda p: jnp.sin(p) * 0.01, params)
    state = update(grads, tx.init(params), params)[1]
    assert any(x.dtype == jnp.uint8 for x in jax.tree.leaves(state))  # 8-bit AdamW states included
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "s", {"opt": state})
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"opt": state})
    restored = ckpt.restore(tmp_path / "s", abstract)["opt"]
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    u1, _ = update(grads, state, params)
    u2, _ = update(grads, restored, params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_make_optimizer_honours_the_normuon_keys():
    cfg = OptimConfig(optimizer="normuon", learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0,
                      normuon_momentum=0.5, normuon_beta2=0.0, normuon_cautious_wd=False, weight_decay=0.2)
    tx, _ = make_optimizer(cfg, 10)
    p = {"w": {"kernel": jnp.asarray(np.random.default_rng(9).normal(size=(8, 6)), jnp.float32)}}
    g = jax.tree.map(lambda x: x[::-1], p)
    ref = normuon(0.1, momentum=0.5, beta2=0.0, weight_decay=0.2, cautious_wd=False)
    a, _ = jax.jit(tx.update)(g, tx.init(p), p)
    b, _ = jax.jit(ref.update)(g, ref.init(p), p)
    np.testing.assert_allclose(a["w"]["kernel"], b["w"]["kernel"], rtol=1e-6)
    other = normuon(0.1, momentum=0.95, beta2=0.0, weight_decay=0.2, cautious_wd=True)
    c, _ = jax.jit(other.update)(g, other.init(p), p)
    assert not np.allclose(a["w"]["kernel"], c["w"]["kernel"])


SHARDING_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from surogate_jax.optim import normuon
assert len(jax.devices()) == 4
mesh = Mesh(np.array(jax.devices()), ("data",))
S = lambda *spec: NamedSharding(mesh, P(*spec))
params = {"layers": {"mlp": {"up_proj": {"kernel": jnp.ones((2, 8, 12)) * jnp.arange(12)},
                             "down_proj": {"kernel": jnp.ones((2, 12, 8)) * jnp.arange(8)}}}}
p_sh = {"layers": {"mlp": {"up_proj": {"kernel": S(None, None, "data")},
                           "down_proj": {"kernel": S(None, "data", None)}}}}
params = jax.device_put(params, p_sh)
tx = normuon(1e-2)
# The state's shape rule: mu has the parameter's shape (same sharding); nu drops the input axes,
# so it keeps the output-axis sharding (or none when the input axis was the sharded one).
abstract = jax.eval_shape(tx.init, params)
mu_sh, nu_sh = p_sh, {"layers": {"mlp": {"up_proj": {"kernel": S(None, "data")}, "down_proj": {"kernel": S()}}}}
def shardings(state):
    inner = state.inner_states["normuon"].inner_state[0]
    return inner._replace(mu=mu_sh, nu=nu_sh)
masked = abstract.inner_states["normuon"]
state_sh = abstract._replace(inner_states={**abstract.inner_states, "normuon": masked._replace(
    inner_state=(shardings(abstract), *masked.inner_state[1:]))})
state_sh = jax.tree.map(lambda x: S() if isinstance(x, jax.ShapeDtypeStruct) else x, state_sh)
state = jax.jit(tx.init, out_shardings=state_sh)(params)
grads = jax.tree.map(lambda x: x * 0.1, params)
u, state2 = jax.jit(tx.update, donate_argnums=(1,))(grads, state, params)
for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state_sh)):
    assert a.sharding.is_equivalent_to(b, a.ndim), (a.shape, a.sharding, b)
for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(p_sh)):
    assert a.sharding.is_equivalent_to(b, a.ndim), (a.shape, a.sharding, b)
ref = normuon(1e-2)
want, _ = ref.update(jax.device_get(grads), ref.init(jax.device_get(params)), jax.device_get(params))
for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
print("ok")
'''


def test_sharded_state_keeps_its_shardings():
    """State placed with the parameters' shardings (as a ZeRO layout would) stays there through a
    jitted, donated update, and the sharded update equals the single-device one."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SHARDING_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_tiny_model_loss_decreases():
    from surogate_jax import train as T
    from surogate_jax.models import Decoder

    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(CFG)
    cfg = OptimConfig(optimizer="normuon", learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.01)
    tx, schedule = make_optimizer(cfg, 100)
    state = T.init_state(model, tx, {}, jax.tree.map(jnp.copy, _base_params()), seed=0, mesh=mesh)
    step = T.jit_train_step(model, tx, schedule, mesh, state)
    b = random_batch(np.random.default_rng(10), 4, 16)
    batch = T.global_batch(mesh, {k: v[None] for k, v in b.items()}, True)
    losses = []
    for _ in range(100):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.3 * losses[0], losses[::10]
