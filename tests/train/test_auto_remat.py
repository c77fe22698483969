"""`recompute: auto` (train.pick_remat): the first (remat policy, layers unrolled) choice whose compiled step fits the
memory budget is taken, the last one otherwise or when no device limit is known; the compiled step it returns trains
exactly like a step jitted with that choice; the budget arithmetic (train.step_bytes, train.step_fits) is XLA's memory
analysis against the device's limit, what else is in use and its largest free block."""

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
    """Each auto choice's StepBytes, from the same analysis pick_remat reads."""
    out = {}
    for p, u in T.AUTO_REMAT_CHOICES:
        m = model.clone(config=model.config.replace(remat_policy=p, unroll_layers=u))
        out[p, u] = T.step_bytes(T.jit_train_step(m, tx, lambda s: 1e-2, mesh, state).lower(state, batch).compile())
    return out


def _pick(mesh, model, tx, state, batch, unroll=None, **memory):
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), batch,
                              memory={"bytes_in_use": 0, **memory}, unroll=unroll)
    return (m.config.remat_policy, m.config.unroll_layers), note


def _name(choice):
    return f"{'unrolled' if choice[1] else 'loop'} {choice[0]}"


@pytest.fixture(scope="module")
def compiled():
    """(mesh, model, tx, state, batch, each choice's StepBytes), shared: pick_remat only compiles (the state is
    never donated), so every test here can reuse them."""
    mesh, model, tx, mk_state, batch = _setup()
    state = mk_state()
    return mesh, model, tx, state, batch, _needs(mesh, model, tx, state, batch)


def test_picks_the_first_choice_that_fits(compiled):
    mesh, model, tx, state, batch, needs = compiled
    none_u, full_l = ("none", True), ("full", False)
    assert needs[none_u].total > needs["dots", True].total and needs["dots", False].total > needs[full_l].total > 0
    assert needs[none_u].total == max(n.total for n in needs.values())  # unrolled, nothing recomputed: the most
    for c in T.AUTO_REMAT_CHOICES:  # a budget c just fits: the first choice that fits it is taken
        budget = needs[c].total
        want = next(d for d in T.AUTO_REMAT_CHOICES if needs[d].total <= budget)
        got, note = _pick(mesh, model, tx, state, batch, bytes_limit=int(budget / T.AUTO_REMAT_HEADROOM) + 1)
        assert got == want and f"recompute auto: {_name(want)} (" in note, (c, note)
    tight = int(min(n.total for n in needs.values()) / T.AUTO_REMAT_HEADROOM) - 1  # nothing fits: the last choice
    got, note = _pick(mesh, model, tx, state, batch, bytes_limit=tight)
    assert got == full_l and all(f"{_name(c)} " in note for c in T.AUTO_REMAT_CHOICES)


def test_unroll_layers_narrows_the_choices(compiled):
    mesh, model, tx, state, batch, _ = compiled
    assert _pick(mesh, model, tx, state, batch, unroll=False, bytes_limit=1 << 40)[0] == ("dots", False)
    assert _pick(mesh, model, tx, state, batch, unroll=True, bytes_limit=1 << 40)[0] == ("none", True)
    got, note = _pick(mesh, model, tx, state, batch, unroll=True, bytes_limit=1)  # nothing fits
    assert got == ("full", True) and "loop" not in note
    got, note = _pick(mesh, model, tx, state, batch, unroll=False, bytes_limit=1)
    assert got == ("full", False) and "unrolled" not in note


def test_memory_in_other_use_counts_against_the_budget(compiled):
    mesh, model, tx, state, batch, needs = compiled
    first, second = T.AUTO_REMAT_CHOICES[:2]
    limit = int(needs[first].total / T.AUTO_REMAT_HEADROOM) + 1  # the first choice fits an otherwise empty device
    in_use = needs[first].arguments  # the step's own arguments are already allocated: still fits
    assert _pick(mesh, model, tx, state, batch, bytes_limit=limit, bytes_in_use=in_use)[0] == first
    others = needs[first].total - needs[second].total  # something else holds this much: the first no longer fits
    got, note = _pick(mesh, model, tx, state, batch, bytes_limit=limit, bytes_in_use=in_use + others)
    assert got == second and "in other use" in note


def test_a_fragmented_pool_refuses_a_temporary_larger_than_its_largest_free_block(compiled):
    mesh, model, tx, state, batch, needs = compiled
    first, second = T.AUTO_REMAT_CHOICES[:2]
    assert needs[first].temp > needs[second].temp
    limit = 1 << 40
    small = needs[first].temp - 1  # the bytes fit, the one temporary allocation does not
    full_pool = {"bytes_limit": limit, "largest_free_block_bytes": small, "pool_bytes": limit}
    got, note = _pick(mesh, model, tx, state, batch, **full_pool)
    assert got == second and "largest free block" in note
    growable = dict(full_pool, pool_bytes=limit - needs[first].temp)  # the pool may still grow a region that big
    assert _pick(mesh, model, tx, state, batch, **growable)[0] == first


def test_no_known_limit_keeps_recomputation():
    mesh, model, tx, mk_state, batch = _setup()
    if T.device_memory(mesh) is not None:
        pytest.skip("a GPU reports its memory limit, so the no-limit branch cannot run here (CPU runs it)")
    m, _, note = T.pick_remat(model, tx, lambda s: 1e-2, mesh, mk_state(), T.Layout(mesh), batch)
    assert (m.config.remat_policy, m.config.unroll_layers) == T.AUTO_REMAT_CHOICES[-1]
    assert "no device memory limit known" in note


def test_compiled_step_trains_like_the_jitted_one():
    mesh, model, tx, mk_state, batch = _setup()
    state = mk_state()
    abstract = T.abstract_batch(mesh, 2, 4, 32)
    m, compiled, _ = T.pick_remat(model, tx, lambda s: 1e-2, mesh, state, T.Layout(mesh), abstract,
                                  memory={"bytes_limit": 1 << 40, "bytes_in_use": 0})
    assert (m.config.remat_policy, m.config.unroll_layers) == ("none", True)
    plain = T.jit_train_step(m, tx, lambda s: 1e-2, mesh, mk_state())
    s1, s2 = state, mk_state()
    for _ in range(3):
        s1, m1 = compiled(s1, batch)
        s2, m2 = plain(s2, batch)
        assert float(m1["loss"]) == float(m2["loss"])
    for a, b in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(s2.trainable), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_and_policy_names():
    assert RunConfig(recompute="auto").recompute == "auto" and RunConfig().unroll_layers == "auto"
    with pytest.raises(ConfigError, match="unroll_layers"):
        RunConfig(unroll_layers="sometimes")
    assert remat_policy("auto", False) == "auto"
    assert remat_policy("auto", True) == "offload_residual"
    with pytest.raises(ConfigError, match="recompute"):
        RunConfig(recompute="sometimes")


def test_qlora_on_experts_keeps_the_layer_loop():
    from surogate_jax.qlora.base import QloraSpec  # noqa: PLC0415

    moe = CFG.replace(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    q = QloraSpec("nf4", 64, True)
    assert T.auto_unroll(moe.replace(qlora=q), None) is False  # auto: the loop
    assert T.auto_unroll(moe.replace(qlora=q), True) is True  # an explicit choice stands
    assert T.auto_unroll(moe, None) is None and T.auto_unroll(CFG.replace(qlora=q), None) is None
