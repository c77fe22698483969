"""`recompute: auto` (train.pick_remat): the first remat policy whose compiled step fits the memory budget is
taken, the last one otherwise or when no device limit is known; the compiled step it returns trains exactly like a
step jitted with that policy; the budget arithmetic (train.step_device_bytes) is XLA's memory analysis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny import CFG, SPEC, base_params, random_batch

from surogate_jax import lora as lora_lib
from surogate_jax import train as T
from surogate_jax.config import ConfigError, RunConfig
from surogate_jax.models import Decoder
from surogate_jax.parallel import remat_policy


def _setup():
    mesh = T.make_mesh(jax.devices()[:1])
    model = Decoder(CFG.replace(lora=SPEC, remat_policy="full"))
    params = base_params()
    adapters = lora_lib.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    tx = optax.adam(1e-2)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the step donates the state)
    state = lambda: T.init_state(model, tx, copy(params), copy(adapters), seed=0, mesh=mesh)  # noqa: E731
    b = random_batch(np.random.default_rng(3), 4, 32)
    batch = T.global_batch(mesh, {k: np.stack([v, v]) for k, v in b.items()}, True)
    return mesh, model, tx, state, batch


def _needs(mesh, model, tx, state, batch):
    """Each policy's step bytes, from the same analysis pick_remat reads."""
    out = {}
    for p in T.AUTO_REMAT_POLICIES:
        m = model.clone(config=model.config.replace(remat_policy=p))
        out[p] = T.step_device_bytes(T.jit_train_step(m, tx, lambda s: 1e-2, mesh, state).lower(state, batch).compile())
    return out


def test_picks_the_fastest_policy_that_fits():
    mesh, model, tx, mk_state, batch = _setup()
    state = mk_state()
    needs = _needs(mesh, model, tx, state, batch)
    assert needs["none"] > needs["full"] > 0  # saving every activation needs more than recomputing
    roomy = int(needs["none"] / T.AUTO_REMAT_HEADROOM) + 1
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), batch, limit=roomy)
    assert m.config.remat_policy == "none" and "recompute auto: none" in note
    tight = int(needs["none"] / T.AUTO_REMAT_HEADROOM) - 1  # "none" is just over the budget
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), batch, limit=tight)
    assert m.config.remat_policy == "full" and "recompute auto: full" in note and "none " in note


def test_no_known_limit_keeps_recomputation():
    mesh, model, tx, mk_state, batch = _setup()
    if T.device_memory_limit(mesh) is not None:
        pytest.skip("a GPU reports its memory limit, so the no-limit branch cannot run here (CPU runs it)")
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, mk_state(), T.Layout(mesh), batch)
    assert m.config.remat_policy == "full" and "no device memory limit known" in note


def test_compiled_step_trains_like_the_jitted_one():
    mesh, model, tx, mk_state, batch = _setup()
    state = mk_state()
    abstract = T.abstract_batch(mesh, 2, 4, 32)
    m, compiled, _ = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), abstract, limit=1 << 40)
    assert m.config.remat_policy == "none"
    plain = T.jit_train_step(m, tx, lambda s: 1e-2, mesh, mk_state())
    s1, s2 = state, mk_state()
    for _ in range(3):
        s1, m1 = compiled(s1, batch)
        s2, m2 = plain(s2, batch)
        assert float(m1["loss"]) == float(m2["loss"])
    for a, b in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(s2.trainable), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_and_policy_names():
    assert RunConfig(recompute="auto").recompute == "auto"
    assert remat_policy("auto", False) == "auto"
    assert remat_policy("auto", True) == "offload_residual"
    with pytest.raises(ConfigError, match="recompute"):
        RunConfig(recompute="sometimes")
