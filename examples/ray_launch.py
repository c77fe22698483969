"""Multi-node training on a Ray cluster (Surogate's multi-node engine), one process per node.

    ray start --head                          # on node 0
    ray start --address=<node0-ip>:6379       # on every other node
    python examples/ray_launch.py examples/multinode.yaml [key=value ...]   # on node 0

Reads the config's `distributed:` block (Surogate's keys): `ray_address` (the cluster to join),
`num_nodes`, `gpus_per_node` (0 = every GPU of a node). It reserves one bundle of GPUs on each of
`num_nodes` distinct nodes (a STRICT_SPREAD placement group), asks the first bundle's node for its IP
and a free port (the jax.distributed coordinator), then runs `python -m surogate_jax.sft CONFIG
[key=value ...]` once per node with SUROGATE_COORDINATOR_ADDRESS, SUROGATE_NUM_PROCESSES and
SUROGATE_PROCESS_ID set; Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPUs. Worker output is
forwarded to this terminal; the exit code is the first non-zero one of the workers. The config
path and output_dir must be valid on every node (a shared filesystem). Needs `pip install ray`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from surogate_jax.config import ConfigError, load_config
from surogate_jax.parallel import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def worker_env(rank: int, num_nodes: int, coordinator: str) -> dict[str, str]:
    """What parallel.initialize_distributed reads in each worker."""
    return {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_nodes), ENV_PROCESS_ID: str(rank)}


def worker_command(config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "surogate_jax.sft", str(Path(config).absolute()), *overrides]


def plan(config: str, overrides: list[str]):
    """(DistributedConfig, command) after validating the config exactly as the workers will."""
    cfg = load_config(config, overrides)
    dist = cfg.parallel.distributed
    if dist is None:
        raise ConfigError(f"{config}: no `distributed:` block (ray_address, num_nodes, gpus_per_node)")
    return dist, worker_command(config, overrides)


def _node_gpus() -> int:
    import ray

    per_node = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]]
    return min(per_node) if per_node else 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        dist, cmd = plan(argv[0], argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=dist.ray_address)
    gpus = dist.gpus_per_node or _node_gpus()
    bundles = [{"GPU": gpus, "CPU": 1} if gpus else {"CPU": 1} for _ in range(dist.num_nodes)]
    pg = placement_group(bundles, strategy="STRICT_SPREAD")
    ray.get(pg.ready())

    def on(rank: int):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)

    @ray.remote(num_cpus=1)
    def address() -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    @ray.remote(num_cpus=1)
    def worker(rank: int, coordinator: str) -> int:
        env = {**os.environ, **worker_env(rank, dist.num_nodes, coordinator)}
        return subprocess.run(cmd, env=env, check=False).returncode

    coordinator = ray.get(address.options(scheduling_strategy=on(0)).remote())
    print(f"ray_launch: {dist.num_nodes} node(s) x {gpus or 'no'} GPU(s), coordinator {coordinator}", file=sys.stderr)
    codes = ray.get([worker.options(num_gpus=gpus, scheduling_strategy=on(r)).remote(r, coordinator)
                     for r in range(dist.num_nodes)])
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
