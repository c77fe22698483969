"""Layer-streamed offload (surogate_jax/offload.py) changes where state lives during the step,
never the results: a streamed step equals the whole-tree step up to float rounding, for every
optimizer, LoRA and full fine-tuning, one device and ZeRO-3 over 4 CPU devices.

The CPU backend cannot show the memory saved (its device memory is host memory; the streamed
code runs here with `Layout(stream=True)` on device memory); tests/gpu/test_parallel_gpu.py and
benchmarks/sft_throughput.py measure it on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import CFG, SPEC, base_params, random_batch

from surogate_jax import lora as L
from surogate_jax import parallel as par
from surogate_jax import train as T
from surogate_jax.config import OptimConfig, ParallelConfig
from surogate_jax.models import Decoder
from surogate_jax.offload import Streamer, num_layers
from surogate_jax.optim import adamw_8bit, apply_fused, make_optimizer

HERE = Path(__file__).parent
CFG3 = CFG.replace(num_layers=3, hidden_size=64, intermediate_size=256)


def _run(opt: str, lora: bool, stream: bool, steps: int = 1, **keys):
    rng = np.random.default_rng(0)
    model = Decoder(CFG3.replace(lora=SPEC if lora else None))
    if lora:
        params = base_params(cfg=CFG3)
        trainable = L.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
        trainable = jax.tree.map(lambda a: a + 0.01, trainable)  # lora_b != 0: every adapter gets gradients
    else:
        params, trainable = {}, base_params(cfg=CFG3)
    mesh = T.make_mesh(jax.devices()[:1])
    layout = par.Layout(mesh, par.Plan.from_config(ParallelConfig(**keys)), stream=stream)
    tx, sched = make_optimizer(OptimConfig(optimizer=opt, learning_rate=1e-2, max_grad_norm=0.5, weight_decay=0.1), 10)
    state = T.init_state(model, tx, params, trainable, 0, mesh, layout)
    step = T.jit_train_step(model, tx, sched, mesh, state, layout)
    metrics = []
    for _ in range(steps):
        b = {k: v.reshape(2, 4, 16) for k, v in random_batch(rng, 8, 16).items()}
        state, m = step(state, T.global_batch(mesh, b, True))
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return metrics, state


def _assert_same_state(a, b, atol=1e-7):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        x, y, name = np.asarray(x), np.asarray(y), jax.tree_util.keystr(path)
        if x.dtype == np.uint8:  # 8-bit codes: a rounding in the update may move one code
            assert np.abs(x.astype(int) - y.astype(int)).max() <= 1, name
        else:
            np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=1e-5, atol=atol, err_msg=name)


# Weights after three AdamW steps at lr 1e-2: Adam divides by sqrt(v), so a gradient element that is
# a near-cancelling sum turns its summation-order rounding (the streamed step adds per layer) into
# a relative error of the whole update; measured on CPU up to 2.2e-6 (of up to 3e-2 moved). 1e-5 is
# 1/1000 of one step. Re-introducing the bias-correction bug this test caught (every layer given a
# zero step count) moves weights by up to 2.3e-2 here, 2000x this bound (and fails the loss check).
WEIGHT_ATOL = 1e-5


@pytest.mark.parametrize("opt,lora",
                         [("adamw", False), ("adamw_8bit", False), ("normuon", False), ("adamw_8bit", True)])
def test_streamed_step_equals_whole_step(opt, lora):
    # three steps: the state owned by no parameter (Adam's count) matters from the second update on
    m_whole, s_whole = _run(opt, lora, stream=False, steps=3)
    m_stream, s_stream = _run(opt, lora, stream=True, steps=3)
    for a, b in zip(m_stream, m_whole, strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    _assert_same_state(s_whole.trainable, s_stream.trainable, WEIGHT_ATOL)
    _assert_same_state(s_whole.opt_state, s_stream.opt_state)


def test_every_stacked_leaf_streams_unless_its_state_does_not_slice():
    params = {"layers": {"w": jnp.ones((3, 64, 64)), "odd": jnp.ones((3, 40)), "norm": jnp.ones((3, 256))},
              "embedding": jnp.ones((50, 64))}
    layout = par.Layout(T.make_mesh(jax.devices()[:1]), stream=True)
    st = Streamer(layout, num_layers(params))
    assert st.L == 3
    # 8-bit moments for every leaf of >= 64 elements: "odd" [3, 40] has 120 elements, no 256-element
    # blocks per layer, so its absmax is flat over the whole stack and cannot be sliced by layer
    tx = adamw_8bit(1e-2, weight_decay=0.1, min_8bit_size=64)
    state = tx.init(params)
    assert st.streamed_params(tx.init, params, state) == ["['layers']['norm']", "['layers']['w']"]
    grads = jax.tree.map(lambda x: jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)), params)
    prep = lambda g, dtype: g.astype(dtype)
    update = jax.jit(lambda g, s, p: st.update(lambda g, s, p: apply_fused(tx, g, s, p), tx.init, g, s, p, prep=prep,
                                               grads_host=False, opt_host=False, params_host=False))
    whole = streamed = (params, state)
    for i in range(3):  # from the second update on, every layer must see the real step count
        g = jax.tree.map(lambda x: jnp.sin(i + x), grads)
        whole = apply_fused(tx, g, whole[1], whole[0])
        streamed = update(g, streamed[1], streamed[0])
        _assert_same_state(whole, streamed)
    # the streamed program has the layer loop (fori_loop with static bounds traces as a scan)
    jaxpr = str(jax.make_jaxpr(lambda g, s, p: st.update(lambda g, s, p: apply_fused(tx, g, s, p), tx.init, g, s, p,
                                                         prep=prep, grads_host=False, opt_host=False,
                                                         params_host=False))(grads, state, params))
    assert "scan[" in jaxpr or "while[" in jaxpr


def test_streamed_multi_step_losses_follow_the_whole_step():
    whole, _ = _run("adamw_8bit", False, stream=False, steps=3)
    streamed, _ = _run("adamw_8bit", False, stream=True, steps=3)
    np.testing.assert_allclose([m[0] for m in streamed], [m[0] for m in whole], rtol=1e-4)


SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from tiny import CFG, base_params, random_batch
from surogate_jax import train as T, parallel as par
from surogate_jax.config import OptimConfig, ParallelConfig
from surogate_jax.optim import make_optimizer
from surogate_jax.models import Decoder
assert len(jax.devices()) == 4
cfg = CFG.replace(num_layers=3, hidden_size=64, intermediate_size=256)

def run(stream, zero_level):
    rng = np.random.default_rng(0)
    model = Decoder(cfg)
    mesh = T.make_mesh()
    layout = par.Layout(mesh, par.Plan.from_config(ParallelConfig(zero_level=zero_level)), stream=stream)
    tx, sched = make_optimizer(OptimConfig(optimizer="adamw_8bit", learning_rate=1e-2, max_grad_norm=0.5), 10,
                               mesh=mesh if zero_level >= 1 else None)
    state = T.init_state(model, tx, {}, base_params(cfg=cfg), 0, mesh, layout)
    step = T.jit_train_step(model, tx, sched, mesh, state, layout)
    out = []
    for _ in range(2):
        b = {k: v.reshape(2, 8, 16) for k, v in random_batch(rng, 16, 16).items()}
        state, m = step(state, T.global_batch(mesh, b, True))
        out.append(float(m["loss"]))
    return out

for z in (0, 3):
    ref, got = run(False, z), run(True, z)
    print(z, ref, got)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
print("OK")
'''


def test_streamed_zero3_on_4_devices_keeps_the_losses():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], check=False, cwd=HERE, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def test_working_copy_casts_the_layer_stack_only():
    params = {"layers": {"w": jnp.linspace(-1, 1, 3 * 8 * 4).reshape(3, 8, 4)}, "embedding": jnp.ones((5, 4))}
    st = Streamer(par.Layout(T.make_mesh(jax.devices()[:1]), stream=True), 3)
    work = jax.jit(lambda p: st.working_copy(p, jnp.bfloat16, host=False, shard=False))(params)
    assert work["layers"]["w"].dtype == jnp.bfloat16 and work["embedding"].dtype == jnp.float32
    np.testing.assert_array_equal(work["layers"]["w"], params["layers"]["w"].astype(jnp.bfloat16))
    np.testing.assert_array_equal(work["embedding"], params["embedding"])
