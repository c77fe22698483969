"""GPU checks of parallel.py that a CPU cannot show: host offload really moves bytes out of device
memory (compiled memory analysis) without changing the losses; activation offload uses host
memory; and, with 2+ GPUs, ZeRO-1/2/3 give the one-GPU losses, ZeRO-2 reduce-scatters and ZeRO-3
gathers one layer at a time inside the scanned stack and holds a fraction of the weights per GPU.

Run: python -m pytest -q tests/gpu/test_parallel_gpu.py  (2+ GPUs for the ZeRO part)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
from tiny import CFG, SPEC, base_params, random_batch

from surogate_jax import lora as L
from surogate_jax import parallel as par
from surogate_jax import train as T
from surogate_jax.config import ParallelConfig
from surogate_jax.models import Decoder

pytestmark = pytest.mark.gpu

# Large enough that state bytes dominate the compiled argument sizes; small enough to compile fast.
BIG = CFG.replace(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                  num_kv_heads=4, head_dim=64)


def _batches(n=3, rows=8, T_=64, accum=2):
    rng = np.random.default_rng(0)
    return [{k: v.reshape(accum, rows // accum, T_) for k, v in random_batch(rng, rows, T_, BIG.vocab_size).items()}
            for _ in range(n)]


def _run(devices, remat="none", lora=False, tx=None, **keys):
    model = Decoder(BIG.replace(remat_policy=remat, lora=SPEC if lora else None))
    if lora:
        params = base_params(cfg=BIG)
        trainable = L.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    else:
        params, trainable = {}, base_params(cfg=BIG)
    mesh = T.make_mesh(devices)
    layout = par.Layout(mesh, par.Plan.from_config(ParallelConfig(**keys)))
    tx = tx or optax.adamw(1e-3, weight_decay=0.1)
    state = T.init_state(model, tx, params, trainable, 0, mesh, layout)
    batches = _batches(rows=4 * len(jax.devices()))  # the same global batches on 1 GPU and on all of them
    step = T.jit_train_step(model, tx, lambda s: 1e-3, mesh, state, layout)
    compiled = step.lower(state, T.global_batch(mesh, batches[0], True)).compile()
    losses = []
    for b in batches:
        state, m = compiled(state, T.global_batch(mesh, b, True))
        losses.append(float(m["loss"]))
    return losses, compiled.memory_analysis(), compiled.as_text(), state


# Offload streams state through the step layer by layer (surogate_jax/offload.py): XLA fuses the
# gradient accumulation and the update differently there, so results agree to rounding, which
# Adam would amplify into +-lr steps on near-zero gradients (see test_residual_offload_uses_host_
# memory). Momentum SGD has optimizer state to offload and keeps differences at rounding level.
# (The CPU tests run AdamW since commit 7e7eb2e fixed the streamed update's zeroed step count, which
# had looked like amplified rounding there; an AdamW version of these GPU comparisons has not run yet.)
def _sgd():
    return optax.sgd(0.05, momentum=0.9)


@pytest.mark.slow
def test_optimizer_and_master_offload_free_device_memory():
    dev = jax.devices()[:1]
    ref, mem0, _, _ = _run(dev, tx=_sgd())
    for keys in ({"offload_optimizer": True}, {"offload_master": True},
                 {"offload_optimizer": True, "offload_master": True}):
        got, mem, _, state = _run(dev, tx=_sgd(), **keys)
        np.testing.assert_allclose(got, ref, rtol=1e-5)
        assert mem.host_argument_size_in_bytes > 0, keys
        assert mem.argument_size_in_bytes < mem0.argument_size_in_bytes, (keys, mem, mem0)
        part = "opt_state" if "offload_optimizer" in keys else "trainable"
        assert {x.sharding.memory_kind for x in jax.tree.leaves(getattr(state, part))} == {"pinned_host"}


def _device_bytes(mem) -> int:
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)


def test_streamed_offload_lowers_the_device_total():
    """Offloaded state crosses to the device one layer at a time (surogate_jax/offload.py), so the
    step's device bytes (arguments + outputs + temporaries) fall by most of what was offloaded;
    the old whole-tree fetch gave the bytes back as temporaries."""
    dev = jax.devices()[:1]
    ref, mem0, _, _ = _run(dev, zero_level=2, tx=_sgd())
    got, mem, _, _ = _run(dev, zero_level=2, tx=_sgd(), offload_optimizer=True, offload_master=True, offload_grads=True)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    offloaded = mem.host_argument_size_in_bytes
    print("device bytes: none", _device_bytes(mem0), "offload all three", _device_bytes(mem), "offloaded", offloaded)
    assert offloaded > 0
    assert _device_bytes(mem) <= _device_bytes(mem0) - offloaded // 2, (mem, mem0)


def test_grad_offload_keeps_the_losses():
    dev = jax.devices()[:1]
    ref, _, _, _ = _run(dev, zero_level=2, tx=_sgd())
    got, _, _, _ = _run(dev, zero_level=2, tx=_sgd(), offload_grads=True)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_residual_offload_uses_host_memory():
    dev = jax.devices()[:1]
    # Plain SGD here: the two remat policies compile to different fusions, so gradients may differ
    # in the last fp32 bit, and Adam turns a last-bit difference of a near-zero gradient into a
    # full +-lr step (seen on the H100, 2026-11-22: step-2 loss 2.4e-5 apart under AdamW, step-1
    # losses identical). SGD keeps the comparison at rounding level, which is what "offload
    # changes memory, not results" means.
    # rtol 1e-4 (LOOSENED from 1e-5): on the H100 the step-2/3 losses differed by 1.45e-5 at lr 0.5
    # (2026-11-22) and by 2.9e-5 at lr 0.05 (2026-11-23, commit d0e7c75): not proportional to the
    # step size, so it is the bf16 forward rounded in different fusions, not an amplified update.
    # A wrong saved residual moves the loss by O(1e-2) or more.
    sgd = optax.sgd(0.05)
    ref, mem_full, _, _ = _run(dev, remat="full", lora=True, tx=sgd)
    got, mem, _, _ = _run(dev, remat="offload_residual", lora=True, tx=sgd)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    assert mem.host_temp_size_in_bytes > 0 or mem.host_output_size_in_bytes > 0, mem
    print("device temp bytes: full", mem_full.temp_size_in_bytes, "offload_residual", mem.temp_size_in_bytes)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2+ GPUs")
def test_zero_levels_on_several_gpus():
    devs = jax.devices()
    one, _, _, _ = _run(devs[:1], zero_level=0)
    args = {}
    for level in (0, 1, 2, 3):
        got, mem, hlo, _ = _run(devs, zero_level=level)
        np.testing.assert_allclose(got, one, rtol=2e-4)
        args[level] = mem.argument_size_in_bytes
        if level == 2:
            assert "reduce-scatter" in hlo, "ZeRO-2 should reduce-scatter the gradients"
        if level == 3:
            stacked = {tuple(x.shape) for x in jax.tree.leaves(base_params(cfg=BIG)["layers"])}
            shapes = []  # the output shape of each all-gather (the last one of an async start's tuple)
            for line in hlo.splitlines():
                if " all-gather(" in line or " all-gather-start(" in line:
                    dims = re.findall(r"\[([\d,]*)\]", line.split(" all-gather")[0])[-1]
                    shapes.append(tuple(int(d) for d in dims.split(",") if d))
            assert shapes and not [s for s in shapes if s in stacked], shapes
    assert args[1] < args[0] and args[3] < args[2], args  # sharded optimizer state / weights per GPU


def test_checkpoint_roundtrip_keeps_host_memory(tmp_path):
    """Orbax writes offloaded (pinned_host) state and restores it into the same memory kinds."""
    from surogate_jax.checkpoint import Checkpointer, abstract_like, strip_scratch

    _, _, _, state = _run(jax.devices()[:1], offload_optimizer=True, offload_master=True)
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(3, state, {"pos": 1}, {"m": 1})
    ckpt.wait()
    state = strip_scratch(state)
    restored, data, _ = ckpt.restore(abstract_like(state))
    ckpt.close()
    assert data == {"pos": 1}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.sharding.memory_kind == b.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
