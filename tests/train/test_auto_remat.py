"""`recompute: auto` (train.pick_remat): the first remat policy whose compiled step fits the memory budget is
taken, the last one otherwise or when no device limit is known; the compiled step it returns trains exactly like a
step jitted with that policy; the budget arithmetic (train.step_bytes, train.step_fits) is XLA's memory analysis
against the device's limit, what else is in use and its largest free block."""

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
    """Each policy's StepBytes, from the same analysis pick_remat reads."""
    out = {}
    for p in T.AUTO_REMAT_POLICIES:
        m = model.clone(config=model.config.replace(remat_policy=p))
        out[p] = T.step_bytes(T.jit_train_step(m, tx, lambda s: 1e-2, mesh, state).lower(state, batch).compile())
    return out


def _pick(mesh, model, tx, state, batch, **memory):
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), batch,
                              memory={"bytes_in_use": 0, **memory})
    return m.config.remat_policy, note


@pytest.fixture(scope="module")
def compiled():
    """(mesh, model, tx, state, batch, each policy's StepBytes), shared: pick_remat only compiles (the state is
    never donated), so every test here can reuse them."""
    mesh, model, tx, mk_state, batch = _setup()
    state = mk_state()
    return mesh, model, tx, state, batch, _needs(mesh, model, tx, state, batch)


def test_picks_the_fastest_policy_that_fits(compiled):
    mesh, model, tx, state, batch, needs = compiled
    assert needs["none"].total > needs["dots"].total > needs["full"].total > 0  # each saves less than the one before
    for p in T.AUTO_REMAT_POLICIES:  # a budget p just fits (the ones before it need more)
        got, note = _pick(mesh, model, tx, state, batch, bytes_limit=int(needs[p].total / T.AUTO_REMAT_HEADROOM) + 1)
        assert got == p and f"recompute auto: {p}" in note, (p, note)
    tight = int(needs["full"].total / T.AUTO_REMAT_HEADROOM) - 1  # nothing fits: the last policy all the same
    got, note = _pick(mesh, model, tx, state, batch, bytes_limit=tight)
    assert got == "full" and "none " in note and "dots " in note and "full " in note


def test_memory_in_other_use_counts_against_the_budget(compiled):
    mesh, model, tx, state, batch, needs = compiled
    limit = int(needs["none"].total / T.AUTO_REMAT_HEADROOM) + 1  # "none" fits an otherwise empty device
    in_use = needs["none"].arguments  # the step's own arguments are already allocated: still fits
    assert _pick(mesh, model, tx, state, batch, bytes_limit=limit, bytes_in_use=in_use)[0] == "none"
    others = needs["none"].total - needs["dots"].total  # something else holds this much: "none" no longer fits
    got, note = _pick(mesh, model, tx, state, batch, bytes_limit=limit, bytes_in_use=in_use + others)
    assert got == "dots" and "in other use" in note


def test_a_fragmented_pool_refuses_a_temporary_larger_than_its_largest_free_block(compiled):
    mesh, model, tx, state, batch, needs = compiled
    assert needs["none"].temp > needs["dots"].temp
    limit = 1 << 40
    small = needs["none"].temp - 1  # the bytes fit, the one temporary allocation does not
    full_pool = {"bytes_limit": limit, "largest_free_block_bytes": small, "pool_bytes": limit}
    got, note = _pick(mesh, model, tx, state, batch, **full_pool)
    assert got == "dots" and "largest free block" in note
    growable = dict(full_pool, pool_bytes=limit - needs["none"].temp)  # the pool may still grow a region that big
    assert _pick(mesh, model, tx, state, batch, **growable)[0] == "none"


def test_no_known_limit_keeps_recomputation():
    mesh, model, tx, mk_state, batch = _setup()
    if T.device_memory(mesh) is not None:
        pytest.skip("a GPU reports its memory limit, so the no-limit branch cannot run here (CPU runs it)")
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, mk_state(), T.Layout(mesh), batch)
    assert m.config.remat_policy == "full" and "no device memory limit known" in note


def test_compiled_step_trains_like_the_jitted_one():
    mesh, model, tx, mk_state, batch = _setup()
    state = mk_state()
    abstract = T.abstract_batch(mesh, 2, 4, 32)
    m, compiled, _ = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), abstract,
                                  memory={"bytes_limit": 1 << 40, "bytes_in_use": 0})
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
