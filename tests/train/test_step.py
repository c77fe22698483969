"""The pure train step: accumulation equals one big batch, LoRA never touches the base, and the
optimizer actually learns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tiny import CFG, SPEC, base_params, random_batch

from surogate_jax import lora as lora_lib
from surogate_jax import train as T
from surogate_jax.models import Decoder


def _state(model, tx, params, trainable, mesh):
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the step donates the state)
    return T.init_state(model, tx, copy(params), copy(trainable), seed=0, mesh=mesh)


def _run(model, tx, params, trainable, batches, mesh):
    state = _state(model, tx, params, trainable, mesh)
    step = T.jit_train_step(model, tx, lambda s: 0.1, mesh, state)
    losses = []
    for b in batches:
        state, m = step(state, T.global_batch(mesh, b, True))
        losses.append(float(m["loss"]))
    return state, losses


def test_grad_accumulation_equals_one_big_batch():
    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(CFG)
    params = base_params()
    b = random_batch(np.random.default_rng(0), 4, 16)
    accum = {k: v.reshape(2, 2, 16) for k, v in b.items()}  # 2 micro-batches of 2 rows
    big = {k: v[None] for k, v in b.items()}  # 1 micro-batch of 4 rows
    tx = optax.sgd(1.0)  # the update is the gradient itself
    s1, l1 = _run(model, tx, {}, params, [accum], mesh)
    s2, l2 = _run(model, tx, {}, params, [big], mesh)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, c in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(s2.trainable), strict=True):
        np.testing.assert_allclose(a, c, rtol=2e-5, atol=1e-6)


def test_lora_keeps_base_bit_identical_and_learns():
    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(CFG.replace(lora=SPEC))
    params = base_params()
    adapters = lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    b = random_batch(np.random.default_rng(1), 4, 16)
    batch = {k: v[None] for k, v in b.items()}
    tx = optax.adam(3e-2)
    state, losses = _run(model, tx, params, adapters, [batch] * 30, mesh)
    for a, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(c))
    assert losses[-1] < 0.7 * losses[0], losses
    moved = [float(jnp.max(jnp.abs(a - c)))
             for a, c in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(adapters))]
    assert min(moved) > 0  # every adapter (A and B) was trained


def test_full_finetune_overfits_one_batch():
    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(CFG)
    b = random_batch(np.random.default_rng(2), 2, 16)
    _, losses = _run(model, optax.adam(1e-2), {}, base_params(), [{k: v[None] for k, v in b.items()}] * 40, mesh)
    assert losses[-1] < 0.3 * losses[0], losses


def test_lora_dropout_changes_training_but_not_eval():
    model = Decoder(CFG.replace(lora=SPEC.__class__(**{**SPEC.__dict__, "dropout": 0.5})))
    params = base_params()
    adapters = lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # B != 0 so the branch matters
    b = {k: jnp.asarray(v) for k, v in random_batch(np.random.default_rng(3), 2, 16).items()}
    l_eval = T.batch_loss(model, params, adapters, b, None)[0]
    assert float(T.batch_loss(model, params, adapters, b, None)[0]) == float(l_eval)
    assert float(T.batch_loss(model, params, adapters, b, jax.random.key(0))[0]) != float(l_eval)
