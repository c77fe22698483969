"""Multi-host: launcher environments -> jax.distributed parameters, and two real processes on
localhost (2 CPU devices each, ZeRO-3) through `python -m surogate_jax.sft` giving the losses of one
device, writing one checkpoint collectively and one adapter."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from surogate_jax.config import ConfigError
from surogate_jax.parallel import DistributedParams, distributed_params

sys.path.insert(0, str(Path(__file__).parent))
from test_zero import losses, write_config

OURS = {"SUROGATE_COORDINATOR_ADDRESS": "10.0.0.1:1234", "SUROGATE_NUM_PROCESSES": "4", "SUROGATE_PROCESS_ID": "2"}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}


def test_launcher_environments():
    assert distributed_params({}) is None
    assert distributed_params(OURS) == DistributedParams("env", "10.0.0.1:1234", 4, 2, None)
    assert distributed_params({**OURS, "SUROGATE_LOCAL_DEVICE_IDS": "0,1"}).local_device_ids == (0, 1)
    assert distributed_params({**OURS, "SUROGATE_NUM_PROCESSES": "1", "SUROGATE_PROCESS_ID": "0"}) is None
    # SLURM: JAX detects coordinator/count/id; one task per node drives all the node's GPUs.
    assert distributed_params(SLURM) == DistributedParams("slurm")
    one_per_node = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "8"}
    assert distributed_params(one_per_node).local_device_ids == tuple(range(8))
    assert distributed_params({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_GPUS_ON_NODE": "8"}) \
        == DistributedParams("slurm")
    assert distributed_params({**SLURM, "SLURM_NTASKS": "1"}) is None  # a single-task job: no coordinator
    assert distributed_params({**OURS, **SLURM}).source == "env"  # explicit variables win


@pytest.mark.parametrize("env, message", [
    ({"SUROGATE_COORDINATOR_ADDRESS": "h:1"}, "SUROGATE_NUM_PROCESSES, SUROGATE_PROCESS_ID missing"),
    ({**OURS, "SUROGATE_PROCESS_ID": "4"}, "must be in [0, SUROGATE_NUM_PROCESSES=4)"),
    ({**OURS, "SUROGATE_NUM_PROCESSES": "four"}, "expected an integer"),
    ({**OURS, "SUROGATE_LOCAL_DEVICE_IDS": "0;1"}, "comma-separated"),
])
def test_bad_launcher_environments(env, message):
    with pytest.raises(ConfigError) as e:
        distributed_params(env)
    assert message in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device(tmp_path, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "SUROGATE_JAX_CACHE": cache}
    one = tmp_path / "one"
    one.mkdir()
    cfg1 = write_config(one)
    r = subprocess.run([sys.executable, "-m", "surogate_jax.sft", str(cfg1)], capture_output=True, text=True,
                       check=False, timeout=900, env={**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert r.returncode == 0, r.stderr[-4000:]
    ref = losses(one / "out")

    two = tmp_path / "two"
    two.mkdir()
    cfg2 = write_config(two)
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "SUROGATE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "SUROGATE_NUM_PROCESSES": "2",
               "SUROGATE_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "surogate_jax.sft", str(cfg2), "zero_level=3", "per_device_train_batch_size=1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    assert "process 0 of 2" in outs[0][1] and "4 device(s)" in outs[0][1], outs[0][1][-2000:]
    got = losses(two / "out")
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)], rtol=1e-4)
    out = two / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert (out / "adapter/adapter_model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_launch_examples():
    """The Ray launcher builds the worker environment our initialization reads; the SLURM script parses."""
    import importlib.util

    root = Path(__file__).parents[2]
    spec = importlib.util.spec_from_file_location("ray_launch", root / "examples/ray_launch.py")
    ray_launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ray_launch)
    env = ray_launch.worker_env(1, 2, "10.1.2.3:4567")
    assert distributed_params(env) == DistributedParams("env", "10.1.2.3:4567", 2, 1, None)
    dist, cmd = ray_launch.plan(str(root / "examples/multinode.yaml"), ["max_steps=3"])
    assert (dist.num_nodes, dist.gpus_per_node, dist.ray_address) == (2, 8, "auto")
    assert cmd[1:3] == ["-m", "surogate_jax.sft"] and cmd[-1] == "max_steps=3"
    assert ray_launch.main(["/does/not/exist.yaml"]) == 2
    r = subprocess.run(["bash", "-n", str(root / "examples/slurm_multinode.sh")], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
