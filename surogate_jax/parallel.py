"""Mesh, DDP/ZeRO shardings, host offload placement, remat mapping and multi-host start-up.

Everything here is JAX's own machinery: `jax.jit` with `NamedSharding`s decides what lives where
and XLA inserts the collectives; there is no communication code of ours.

Mesh. One axis, "data", over the devices of the run (all processes). It splits the batch (data
parallelism) AND is the axis ZeRO shards state over, like Surogate's single data-parallel group;
the ops' `on_shards` (ops/_sharding.py) splits rows over the same axis. Expert parallelism
(`ep_size` > 1, Surogate's key) makes it ("data", "expert") of n / ep_size x ep_size: the batch
splits over both, ZeRO over "data", and the MoE experts' stacked leaves split their expert axis over
"expert" (zero.expert_spec); the MoE layers dispatch tokens within each expert group
(models/moe.py).

ZeRO (Surogate's `zero_level`, `shard_gradients`, `shard_weights`):
  0  DDP: everything replicated, gradients all-reduced (a surogate_jax extension of the key);
  1  + optimizer state sharded (Surogate's default);
  2  + gradients sharded: the accumulated gradients are constrained to the sharded layout, so XLA
     reduce-scatters each micro-batch's gradients instead of all-reducing them;
  3  + weights sharded (frozen base and trainable adapters for LoRA, the fp32 masters for full
     fine-tuning). Inside the `nn.scan` layer stack XLA all-gathers one layer slice per loop
     iteration, so the whole model is never gathered at once (tests/train/test_zero.py reads the
     compiled HLO to check it).
`shard_gradients` / `shard_weights` switch levels 2 / 3 on individually.

Which dimension is sharded: a shape rule (zero.py), not logical axis names (the optimizer state of
any optax transform has the param shapes but no names, so one rule serves every tree). Per leaf we
take the largest dimension that the "data" axis size divides, never the leading layer axis of leaves
under a `layers` key (the scan slices that axis; sharding it would make every iteration fetch its
layer from one device); a leaf with no such dimension (scalars, odd vocab sizes) stays replicated.
The same rule for params, gradients and optimizer state keeps the element-wise update local to each
shard (MaxText's FSDP rules pick the embed dimension in the same spirit).

Host offload (memory kinds): `offload_optimizer` keeps the optimizer state and `offload_master`
the trainable/master weights in `pinned_host` memory between steps; the step copies them to the
device where they are used and hands them back through its out_shardings (MaxText's pattern).
`offload_grads` (needs sharded gradients, as in Surogate) keeps the gradient accumulator in
pinned host memory between micro-batches. `offload_residual` offloads each layer's input (the
residual stream) in backward-saved activations through a remat policy; `recompute` picks the
remat policy (see `remat_policy`).

Multi-host: `initialize_distributed` calls `jax.distributed.initialize` only when a launcher
says so: our variables SUROGATE_COORDINATOR_ADDRESS (host:port), SUROGATE_NUM_PROCESSES,
SUROGATE_PROCESS_ID and optionally SUROGATE_LOCAL_DEVICE_IDS (comma list), or a SLURM step with
more than one task (JAX's own SLURM detection; one process per node gets all of the node's GPUs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ConfigError, ParallelConfig
from .zero import DATA, EXPERT, expert_spec, is_expert_leaf, zero_spec

log = logging.getLogger("surogate_jax")

HOST = "pinned_host"
DEVICE = "device"

ENV_COORDINATOR = "SUROGATE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "SUROGATE_NUM_PROCESSES"
ENV_PROCESS_ID = "SUROGATE_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "SUROGATE_LOCAL_DEVICE_IDS"


# ---------------------------------------------------------------------------------------------
# Multi-host start-up


@dataclasses.dataclass(frozen=True)
class DistributedParams:
    source: str  # "env" | "slurm"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment {key}={env[key]!r}: expected an integer") from None


def _ids(text: str, key: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"environment {key}={text!r}: expected comma-separated device ids") from None


def distributed_params(env: Mapping[str, str] | None = None) -> DistributedParams | None:
    """What `jax.distributed.initialize` needs, from the environment; None for a single process."""
    env = os.environ if env is None else env
    ours = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(k)]
    local = _ids(env[ENV_LOCAL_DEVICE_IDS], ENV_LOCAL_DEVICE_IDS) if env.get(ENV_LOCAL_DEVICE_IDS) else None
    if ours:
        missing = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in ours]
        if missing:
            raise ConfigError(f"multi-process launch: {', '.join(ours)} set but {', '.join(missing)} missing "
                              "(set all three, see README 'Scaling')")
        n, pid = _int_env(env, ENV_NUM_PROCESSES), _int_env(env, ENV_PROCESS_ID)
        if n < 1 or not 0 <= pid < n:
            raise ConfigError(f"{ENV_PROCESS_ID}={pid} must be in [0, {ENV_NUM_PROCESSES}={n})")
        if n == 1:
            return None
        return DistributedParams("env", env[ENV_COORDINATOR], n, pid, local)
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and _int_env(env, "SLURM_NTASKS") > 1:
        if local is None:
            local = _slurm_node_gpus(env)
        return DistributedParams("slurm", local_device_ids=local)
    return None


def _slurm_node_gpus(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """With one task per node, that task drives all of the node's GPUs (JAX's SLURM default is one
    GPU per task, indexed by SLURM_LOCALID); with several tasks per node, JAX's default holds."""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    m = re.match(r"(\d+)", per_node)
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if m and int(m.group(1)) == 1 and gpus.isdigit() and int(gpus) > 1:
        return tuple(range(int(gpus)))
    return None


def initialize_distributed(env: Mapping[str, str] | None = None) -> DistributedParams | None:
    """Starts jax.distributed when the environment describes a multi-process run (idempotent)."""
    p = distributed_params(env)
    if p is None or jax.distributed.is_initialized():
        return p
    kw = {"local_device_ids": list(p.local_device_ids) if p.local_device_ids is not None else None}
    if p.source == "env":
        kw.update(coordinator_address=p.coordinator_address, num_processes=p.num_processes, process_id=p.process_id)
    jax.distributed.initialize(**kw)
    log.info("jax.distributed (%s): process %d of %d, %d local device(s)", p.source, jax.process_index(),
             jax.process_count(), jax.local_device_count())
    return p


# ---------------------------------------------------------------------------------------------
# Mesh


def make_mesh(devices=None, ep_size: int = 1) -> Mesh:
    """A 1-D ("data",) mesh over `devices` (default: every device of every process); with ep_size > 1 a
    ("data", "expert") mesh of n / ep_size x ep_size (consecutive devices form an expert-parallel group)."""
    devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
    if ep_size <= 1:
        return Mesh(devices, (DATA,))
    if devices.size % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {devices.size} devices")
    return Mesh(devices.reshape(-1, ep_size), (DATA, EXPERT))


def run_devices(gpus: int) -> list:
    """The devices a run uses. One process: the first `gpus` local devices (0 = all; Surogate's
    `gpus` key). Several processes: every device of every process (the launcher decides what each
    process sees), so all processes hold the same number of mesh devices."""
    if jax.process_count() > 1:
        if gpus not in (0, 1) and gpus != jax.local_device_count():
            log.warning("gpus=%d ignored in a multi-process run: each process uses its %d local device(s)",
                        gpus, jax.local_device_count())
        return jax.devices()
    local = jax.local_devices()
    if gpus == 0:
        return local
    if gpus > len(local):
        raise ConfigError(f"gpus={gpus}: only {len(local)} {local[0].platform} device(s) here")
    if gpus < len(local):
        log.info("using %d of %d local devices (gpus: %d; gpus: 0 uses all)", gpus, len(local), gpus)
    return local[:gpus]


# ---------------------------------------------------------------------------------------------
# ZeRO shardings and offload placement


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which parts of the TrainState are sharded over "data" / kept in pinned host memory."""

    shard_optimizer: bool = False
    shard_gradients: bool = False
    shard_weights: bool = False
    offload_optimizer: bool = False
    offload_master: bool = False
    offload_grads: bool = False
    offload_experts: bool = False  # qlora_offload_experts: the frozen base's MoE experts (models stream them)

    @classmethod
    def from_config(cls, c: ParallelConfig) -> Plan:
        return cls(shard_optimizer=c.zero_level >= 1, shard_gradients=c.zero_level >= 2 or c.shard_gradients,
                   shard_weights=c.zero_level >= 3 or c.shard_weights, offload_optimizer=c.offload_optimizer,
                   offload_master=c.offload_master, offload_grads=c.offload_grads)

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer or self.offload_master or self.offload_grads


def _shards_itself(x) -> bool:
    return callable(getattr(x, "zero_specs", None))


class Layout:
    """Shardings of a TrainState on a mesh per a Plan, and the in-step device placement."""

    def __init__(self, mesh: Mesh | None, plan: Plan | None = None, stream: bool | None = None):
        """mesh None: no mesh known (a bare make_train_step): every placement is a no-op.
        stream: move state through the step layer by layer (surogate_jax/offload.py); default:
        whenever the plan offloads (True without offload runs the same code on device memory)."""
        self.mesh, self.plan = mesh, plan or Plan()
        self.stream = (self.plan.offloads if stream is None else stream) and mesh is not None
        self.n = mesh.shape[DATA] if mesh is not None else 1
        self.ep = dict(mesh.shape).get(EXPERT, 1) if mesh is not None else 1
        if mesh is None and self.plan != Plan():
            raise ValueError("a Layout with a sharding/offload plan needs a mesh")
        if self.plan.offloads or self.plan.offload_experts:
            check_memory_kind(mesh, HOST)

    def shardings(self, tree, shard: bool, host: bool = False, device_kind: bool = False,
                  host_experts: bool = False):
        """A NamedSharding per leaf of `tree`: ZeRO-sharded when `shard`, in pinned_host when `host` (or, with
        `host_experts`, when it is a stacked MoE expert leaf) else explicitly in device memory when `device_kind`;
        8-bit moments keep codes and absmax together."""
        kind = HOST if host else (DEVICE if device_kind else None)

        def one(path, x):
            spec = expert_spec(path, tuple(x.shape), self.ep)
            if spec is None:
                spec = zero_spec(path, tuple(x.shape), self.n) if shard else P()
            return NamedSharding(self.mesh, spec, memory_kind=HOST if host_experts and is_expert_leaf(path) else kind)

        def own(path, x):
            # a state that shards its own way (an 8-bit moment keeps each block's codes and absmax
            # on one shard) gives a spec per part, or None for the rule above on each part
            specs = x.zero_specs(path, self.n) if shard else None
            if specs is None:
                return type(x)(*(one(path, part) for part in x))
            return type(x)(*(NamedSharding(self.mesh, s, memory_kind=kind) for s in specs))

        return jax.tree_util.tree_map_with_path(
            lambda path, x: own(path, x) if _shards_itself(x) else one(path, x), tree, is_leaf=_shards_itself)

    def state_shardings(self, state):
        """Like `state` (arrays or ShapeDtypeStructs): a NamedSharding per leaf."""
        p = self.plan
        return state.replace(
            step=NamedSharding(self.mesh, P()),
            rng=NamedSharding(self.mesh, P()),
            params=self.shardings(state.params, p.shard_weights, host_experts=p.offload_experts),
            trainable=self.shardings(state.trainable, p.shard_weights, host=p.offload_master),
            opt_state=self.shardings(state.opt_state, p.shard_optimizer, host=p.offload_optimizer),
        )

    def weight_shardings(self, weights, *, trainable: bool):
        """Where loaded weights go: the frozen base (trainable False) or the trainable masters."""
        return self.shardings(weights, self.plan.shard_weights, host=trainable and self.plan.offload_master,
                              host_experts=not trainable and self.plan.offload_experts)

    def grad_shardings(self, trainable, host: bool = False):
        return self.shardings(trainable, self.plan.shard_gradients, host=host, device_kind=self.plan.offloads)

    # -- inside the traced step ----------------------------------------------------------------

    def fetch(self, tree, shard: bool):
        """device_put a pinned-host tree onto the device (same layout) inside the step."""
        return jax.tree.map(jax.device_put, tree, self.shardings(tree, shard, device_kind=True))

    def fetch_trainable(self, trainable):
        return self.fetch(trainable, self.plan.shard_weights) if self.plan.offload_master else trainable

    def fetch_opt_state(self, opt_state):
        return self.fetch(opt_state, self.plan.shard_optimizer) if self.plan.offload_optimizer else opt_state

    def fetch_state(self, state):
        """The step's view of the state: offloaded trainable / optimizer state copied to the device."""
        return state.replace(trainable=self.fetch_trainable(state.trainable),
                             opt_state=self.fetch_opt_state(state.opt_state))

    def constrain_grads(self, grads):
        """ZeRO-2: the accumulated gradients take the sharded layout (XLA reduce-scatters)."""
        if not self.plan.shard_gradients or self.n == 1:
            return grads
        return jax.lax.with_sharding_constraint(grads, self.grad_shardings(grads))

    def grads_to_host(self, grads):
        if not self.plan.offload_grads:
            return grads
        return jax.tree.map(jax.device_put, grads, self.grad_shardings(grads, host=True))

    def grads_to_device(self, grads):
        if not self.plan.offload_grads:
            return grads
        return jax.tree.map(jax.device_put, grads, self.shardings(grads, self.plan.shard_gradients, device_kind=True))

    def describe(self) -> str:
        p = self.plan
        parts = [f"{self.n * self.ep} device(s)"]
        if self.ep > 1:
            parts.append(f"expert parallel: {self.n} group(s) of {self.ep} (each device holds 1/{self.ep} of the "
                         "experts)")
        parts += ["zero: " + ",".join(
            name for name, on in (("optimizer", p.shard_optimizer), ("gradients", p.shard_gradients),
                                  ("weights", p.shard_weights)) if on) or "none"]
        off = [name for name, on in (("optimizer", p.offload_optimizer), ("master", p.offload_master),
                                     ("grads", p.offload_grads), ("experts", p.offload_experts)) if on]
        if off:
            parts.append("offload to pinned_host: " + ",".join(off))
        return "; ".join(parts)


def check_memory_kind(mesh: Mesh, kind: str) -> None:
    dev = mesh.devices.flat[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    if kind not in kinds:
        raise ConfigError(f"offload_*: the {dev.platform} backend has no {kind!r} memory (has {sorted(kinds)})")


def gather_to_host(tree):
    """Every leaf as one fully replicated array in host memory of each process (for exports).
    Collective: all processes call it. Leaf by leaf, so at most one extra leaf on the device."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_replicated:
            return x
        mesh = x.sharding.mesh
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        kind = HOST if HOST in kinds else None
        return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P(), memory_kind=kind))(x)

    return jax.tree.map(one, tree)


def host_view(tree):
    """Leaves an export can read whole: a leaf sharded across processes is gathered (collective;
    all processes call this) and, like a leaf in pinned host memory, returned as numpy; other
    leaves are returned as they are."""

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if not x.is_fully_addressable:
            x = gather_to_host(x)
        elif x.sharding.memory_kind != HOST:
            return x
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


# ---------------------------------------------------------------------------------------------
# Remat policy


def remat_policy(recompute: bool | str, offload_residual: bool) -> str:
    """Surogate's `recompute` (+ `offload_residual`) -> the decoder's remat_policy name.

    true -> "full" (each layer keeps only its input and recomputes the rest in backward, like
    Surogate's block-boundary recompute); false -> "none" (save everything); a policy name
    ("none", "full", "dots", "dots_no_batch") is passed through, and so is "auto" (the run picks
    "none" or "full" from the compiled step's memory: train.pick_remat). offload_residual needs
    recomputation: the layer input then lives in pinned host memory ("offload_residual")."""
    name = {True: "full", False: "none"}.get(recompute, recompute) if isinstance(recompute, bool) else recompute
    if offload_residual:
        if name not in ("full", "auto"):
            raise ConfigError(f"offload_residual: true needs recompute: true (got recompute: {recompute!r}); the "
                              "offloaded layer input is what the recomputation starts from")
        return "offload_residual"
    return name


def process_local_rows(per_device: int, mesh: Mesh) -> int:
    """Rows this process loads per micro-batch: per-device rows x this process's mesh devices."""
    pid = jax.process_index()
    return per_device * sum(1 for d in mesh.devices.flat if d.process_index == pid)


__all__ = [
    "DATA", "DistributedParams", "Layout", "Plan", "check_memory_kind", "distributed_params", "gather_to_host",
    "host_view", "initialize_distributed", "make_mesh", "process_local_rows", "remat_policy", "run_devices",
    "zero_spec",
]
