"""ZeRO-1/2/3 through shardings: the placement rule, the same losses as one device on 4 CPU
devices (library and `python -m surogate_jax.sft zero_level=N`), ZeRO-3 gathering one layer at a
time inside the scanned stack (read from the compiled HLO), and a ZeRO-3 checkpoint resumed on
another device count continuing the same loss curve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey

from surogate_jax.config import ParallelConfig
from surogate_jax.parallel import Plan, zero_spec

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def test_zero_spec_rule():
    layers = (DictKey("layers"), DictKey("mlp"), DictKey("kernel"))
    assert zero_spec(layers, (4, 32, 48), 4) == P(None, None, "data")  # largest divisible, never the layer axis
    assert zero_spec(layers, (8, 6, 5), 4) == P()  # nothing divisible: replicated
    assert zero_spec((DictKey("embedding"),), (67, 32), 4) == P(None, "data")
    assert zero_spec((DictKey("embedding"),), (64, 32), 4) == P("data")
    assert zero_spec((DictKey("embedding"),), (64, 32), 1) == P()
    assert zero_spec((), (), 4) == P()


def test_plan_from_surogate_keys():
    assert Plan.from_config(ParallelConfig()) == Plan(shard_optimizer=True)  # Surogate's default zero_level: 1
    assert Plan.from_config(ParallelConfig(zero_level=0)) == Plan()
    p2 = Plan.from_config(ParallelConfig(zero_level=2))
    assert p2.shard_optimizer and p2.shard_gradients and not p2.shard_weights
    p3 = Plan.from_config(ParallelConfig(zero_level=3))
    assert p3.shard_optimizer and p3.shard_gradients and p3.shard_weights
    assert Plan.from_config(ParallelConfig(zero_level=1, shard_weights=True)).shard_weights
    assert Plan.from_config(ParallelConfig(zero_level=1, shard_gradients=True)).shard_gradients


LIBRARY = r'''
import re
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import PartitionSpec as P
from tiny import CFG, SPEC, base_params, random_batch
from surogate_jax import train as T, lora as L, parallel as par
from surogate_jax.config import ParallelConfig
from surogate_jax.models import Decoder
assert len(jax.devices()) == 4, jax.devices()
rng = np.random.default_rng(0)
batches = [{k: v.reshape(2, 4, 16) for k, v in random_batch(rng, 8, 16).items()} for _ in range(3)]
cfg = CFG.replace(num_layers=3, hidden_size=64, intermediate_size=96)

def run(model, make, devices, level):
    params, trainable = make()  # fresh arrays: the step donates (consumes) the state
    mesh = T.make_mesh(devices)
    layout = par.Layout(mesh, par.Plan.from_config(ParallelConfig(zero_level=level)))
    tx = optax.adamw(1e-2, weight_decay=0.1)
    state = T.init_state(model, tx, params, trainable, 0, mesh, layout)
    step = T.jit_train_step(model, tx, lambda s: 1e-2, mesh, state, layout)
    step = step.lower(state, T.global_batch(mesh, batches[0], True)).compile()  # compiled once, HLO kept
    hlo = step.as_text()
    out = []
    for b in batches:
        state, m = step(state, T.global_batch(mesh, b, True))
        out.append(float(m["loss"]))
    return out, state, hlo

def sharded(tree):
    return any(x.sharding.spec != P() for x in jax.tree.leaves(tree))

lora_model = Decoder(cfg.replace(lora=SPEC))
for name, model, make in [
        ("lora", lora_model, lambda: (base_params(cfg=cfg),
                                      L.init_adapters(lora_model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32)))),
        ("full", Decoder(cfg), lambda: ({}, base_params(cfg=cfg)))]:
    one, _, _ = run(model, make, jax.devices()[:1], 1)
    for level in ((0, 1, 2, 3) if name == "lora" else (3,)):
        four, state, hlo = run(model, make, jax.devices(), level)
        print(name, level, one, four)
        np.testing.assert_allclose(four, one, rtol=2e-5)
        mu = state.opt_state  # the adam moments: sharded from ZeRO-1 on
        assert sharded(mu) == (level >= 1), level
        assert sharded(state.trainable) == (level >= 3), level
        if name == "lora":
            assert sharded(state.params) == (level >= 3), level
        if name == "full" and level == 3:
            # ZeRO-3: every stacked [L, ...] layer weight stays sharded; all-gathers only produce one
            # layer's slice, inside the scan's while bodies, never the whole stack.
            stacked = {tuple(x.shape) for x in jax.tree.leaves(base_params(cfg=cfg)["layers"])}
            per_layer = {s[1:] for s in stacked}
            comp, gathers = None, []
            for line in hlo.splitlines():
                if line and not line.startswith(" ") and line.rstrip().endswith("{"):
                    comp = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
                m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", line)
                if m:
                    gathers.append((comp, tuple(int(d) for d in m.group(2).split(",") if d)))
            assert not [g for g in gathers if g[1] in stacked], gathers
            inside = {shape for comp, shape in gathers if comp != "ENTRY"}
            assert {(64, 96), (96, 64)} <= inside & per_layer, gathers  # the MLP kernels, one layer at a time
print("OK")
'''


def _env(n: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def test_zero_levels_match_one_device_and_gather_per_layer():
    r = subprocess.run([sys.executable, "-c", LIBRARY], check=False, cwd=HERE, env=_env(4), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


# ---------------------------------------------------------------------------------------------
# End to end through `python -m surogate_jax.sft`


def write_config(tmp: Path, **over) -> Path:
    cfg = {
        "model": "builtin:tiny-qwen3", "output_dir": str(tmp / "out"), "model_dtype": "fp32",
        "datasets": [{"path": str(ROOT / "examples/data/quickstart_train.jsonl"), "type": "conversation",
                      "samples": 200}],
        "validation_split_ratio": 0.0, "sequence_len": 64, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "max_steps": 4, "save_steps": 2, "eval_steps": 0,
        "learning_rate": 3e-3, "warmup_steps": 1, "lora_rank": 8, "lora_alpha": 16, "logging_steps": 1,
        "dataloader_num_workers": 1,
    }
    cfg.update(over)
    p = tmp / "cfg.yaml"
    p.write_text(json.dumps(cfg))
    return p


def sft(cfg: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "surogate_jax.sft", str(cfg), *overrides], check=False, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_sft_zero3_matches_one_device_and_resumes_on_fewer_devices(tmp_path, cache):
    env1 = {**_env(1), "SUROGATE_JAX_CACHE": cache}
    one = tmp_path / "one"
    one.mkdir()
    sft(write_config(one), env1)
    ref = losses(one / "out")

    # 4 devices x 1 row = the same 4 rows per micro-batch, optimizer state/grads/weights sharded.
    z3 = tmp_path / "z3"
    z3.mkdir()
    r = sft(write_config(z3), {**_env(4), "SUROGATE_JAX_CACHE": cache}, "zero_level=3", "gpus=0",
            "per_device_train_batch_size=1")
    assert "zero: optimizer,gradients,weights" in r.stderr and "4 device(s)" in r.stderr, r.stderr[-2000:]
    got = losses(z3 / "out")
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)], rtol=1e-4)

    # The ZeRO-3 checkpoint of step 2, restored onto 2 devices (2 rows each): steps 3-4 continue the curve.
    shutil.rmtree(z3 / "out/checkpoints/4")
    shutil.rmtree(z3 / "out/adapter")
    (z3 / "out/metrics.jsonl").write_text("")
    r = sft(write_config(z3), {**_env(2), "SUROGATE_JAX_CACHE": cache}, "zero_level=3", "gpus=0",
            "per_device_train_batch_size=2")
    assert "resumed from" in r.stderr and "2 device(s)" in r.stderr, r.stderr[-2000:]
    again = losses(z3 / "out")
    assert sorted(again) == [3, 4]
    np.testing.assert_allclose([again[3], again[4]], [got[3], got[4]], rtol=1e-4)
    assert (z3 / "out/adapter/adapter_model.safetensors").is_file()


RANDOM_INIT = r'''
import jax, jax.numpy as jnp, numpy as np
from surogate_jax import parallel as par
from surogate_jax.config import ParallelConfig
from surogate_jax.models import Decoder, DecoderConfig
from surogate_jax.run import random_init

cfg = DecoderConfig(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
model = Decoder(cfg)
mesh = par.make_mesh(jax.devices())
key = jax.random.key(7)
whole = random_init(model, None, trainable=True)(key)  # unsharded: the reference values
total = sum(x.nbytes for x in jax.tree.leaves(whole))
for level, spread in ((3, True), (1, False)):
    layout = par.Layout(mesh, par.Plan.from_config(ParallelConfig(zero_level=level)))
    init = random_init(model, layout, trainable=True)
    mem = init.lower(key).compile().memory_analysis()
    params = init(key)
    per_device = max(sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
                         if s.device == d) for d in jax.devices())
    if spread:  # ZeRO-3: each device computes and holds about a quarter; no temporary of the whole model
        assert per_device < 0.3 * total, (per_device, total)
        if mem is not None:
            assert mem.output_size_in_bytes < 0.3 * total and mem.temp_size_in_bytes < 0.3 * total, (mem, total)
    else:  # replicated weights: each device holds them all
        assert per_device == total, (per_device, total)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same weights however they are placed
print("OK")
'''


def test_random_init_builds_zero3_weights_in_their_shards():
    """pretrain's from-scratch init is jitted with the ZeRO-3 shardings as out_shardings: no device
    holds (or computes a temporary of) the whole model, and the weights equal the unsharded init."""
    r = subprocess.run([sys.executable, "-c", RANDOM_INIT], check=False, cwd=HERE, env=_env(4), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
