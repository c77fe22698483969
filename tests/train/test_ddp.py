"""Data parallelism: the same global batches on 4 (CPU) devices give the losses of 1 device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np, optax
from tiny import CFG, SPEC, base_params, random_batch
from surogate_jax import train as T, lora as L
from surogate_jax.models import Decoder
assert len(jax.devices()) == 4, jax.devices()
model = Decoder(CFG.replace(lora=SPEC))
rng = np.random.default_rng(0)
batches = [{k: v.reshape(2, 4, 16) for k, v in random_batch(rng, 8, 16).items()} for _ in range(3)]
def losses(devices):
    mesh = T.make_mesh(devices)
    adapters = L.init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    state = T.init_state(model, optax.adam(1e-2), base_params(), adapters, 0, mesh)
    step = T.jit_train_step(model, optax.adam(1e-2), lambda s: 1e-2, mesh, state)
    out = []
    for b in batches:
        state, m = step(state, T.global_batch(mesh, b, True))
        out.append(float(m["loss"]))
    assert state.trainable["layers"]["self_attn"]["q_proj"]["lora_a"].sharding.mesh.size == len(devices)
    return out
one, four = losses(jax.devices()[:1]), losses(jax.devices())
print("one", one, "four", four)
np.testing.assert_allclose(four, one, rtol=1e-5)
'''


def test_four_devices_match_one():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=here, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
