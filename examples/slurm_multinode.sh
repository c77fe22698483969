#!/bin/bash
# Multi-node training under SLURM: one process per node drives all of its GPUs.
#
#   sbatch examples/slurm_multinode.sh examples/multinode.yaml [key=value ...]
#
# srun starts one `python -m surogate_jax.sft` per node. surogate_jax sees a SLURM step with more
# than one task and calls jax.distributed.initialize() (coordinator = the first node of the step,
# process id = SLURM_PROCID); with one task per node each process gets all SLURM_GPUS_ON_NODE GPUs.
# For one process per GPU instead, use --ntasks-per-node=8 (JAX then gives each task the GPU of its
# SLURM_LOCALID). Other launchers: set SUROGATE_COORDINATOR_ADDRESS=host:port,
# SUROGATE_NUM_PROCESSES and SUROGATE_PROCESS_ID (+ optional SUROGATE_LOCAL_DEVICE_IDS) per process.
# output_dir must be on a shared filesystem. Expect: the log of process 0 in %x-%j.out shows
# "jax.distributed (slurm): process 0 of 2, 8 local device(s)" and "parallel: 16 device(s); zero: ...".
#SBATCH --job-name=surogate-jax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch examples/slurm_multinode.sh CONFIG.yaml [key=value ...]}
shift

# Let the GPUs' memory be used by XLA (the rest is for cuDNN / NCCL workspaces).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
# Overlap the ZeRO all-gathers / reduce-scatters with compute (MaxText's GPU settings).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
# Site-specific NCCL settings go here, e.g. export NCCL_SOCKET_IFNAME=ib0

PYTHON=${PYTHON:-python}
srun --kill-on-bad-exit=1 "$PYTHON" -m surogate_jax.sft "$CONFIG" "$@"
