"""fp8-hybrid under data parallelism: on 4 (CPU) devices the observed amaxes are reduced with a max
over the data shards, so the delayed-scaling state after each step equals the 1-device run's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np, optax
from tiny import CFG, base_params, random_batch
from surogate_jax import train as T
from surogate_jax.models import Decoder
from surogate_jax.precision.recipe import QuantRecipe
assert len(jax.devices()) == 4, jax.devices()
model = Decoder(CFG.replace(recipe=QuantRecipe("fp8-hybrid", fp8_impl="ref", amax_history=4)))
rng = np.random.default_rng(0)
batches = [{k: v.reshape(2, 4, 16) for k, v in random_batch(rng, 8, 16).items()} for _ in range(2)]
def run(devices):
    mesh = T.make_mesh(devices)
    state = T.init_state(model, optax.adam(1e-2), {}, base_params(), 0, mesh)
    step = T.jit_train_step(model, optax.adam(1e-2), lambda s: 1e-2, mesh, state)
    losses = []
    for b in batches:
        state, m = step(state, T.global_batch(mesh, b, True))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(state.quant)
(l1, q1), (l4, q4) = run(jax.devices()[:1]), run(jax.devices())
print("one", l1, "four", l4)
np.testing.assert_allclose(l4, l1, rtol=1e-5)
hist = [np.asarray(h) for h in jax.tree.leaves(q4)]
assert all((h[..., :2] > 0).all() for h in hist if h.ndim == 2), "histories not filled"
for a, b in zip(jax.tree.leaves(q4), jax.tree.leaves(q1), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
print("ok")
'''


def test_fp8_state_on_four_devices_matches_one():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=here, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
