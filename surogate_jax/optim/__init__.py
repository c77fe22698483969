"""Optimizers (optax GradientTransformations) and learning-rate schedules, built from OptimConfig.

`make_optimizer(cfg, total_steps)` -> (tx, schedule). Decoupled weight decay skips norm scales and
biases. Global-norm clipping (max_grad_norm > 0) comes first, as in Surogate.
`optimizer: adamw_8bit` is `adamw_8bit.adamw_8bit` (blockwise 8-bit moments; its fused path,
`apply_fused`, writes the parameters in the kernel and folds the clip in as a gradient scale).
`optimizer: normuon` is `normuon.normuon` (NorMuon on hidden matrices, AdamW on the rest).
"""

from __future__ import annotations

import jax
import optax

from ..config import OptimConfig
from .adamw_8bit import adamw_8bit
from .fused import FusedGradientTransformation, apply_fused, chain_clip
from .normuon import normuon
from .schedules import make_schedule


def decay_mask(params):
    """True for matrices (kernels, embeddings, adapters); False for norm scales and biases."""
    def keep(path, _):
        leaf = getattr(path[-1], "key", None)
        return leaf not in ("scale", "bias")
    return jax.tree_util.tree_map_with_path(keep, params)


def fp32_state_mask(params):
    """True for norm scales and biases: adamw_8bit keeps their moments in fp32."""
    return jax.tree.map(lambda d: not d, decay_mask(params))


def make_optimizer(cfg: OptimConfig, total_steps: int, mesh: jax.sharding.Mesh | None = None):
    """mesh: the mesh the optimizer state is ZeRO-sharded over, where the 8-bit update then runs per
    shard; None where the state is replicated (one device, DDP)."""
    schedule = make_schedule(cfg, total_steps)
    if cfg.optimizer == "adamw_8bit":  # norms and biases keep fp32 moments (bitsandbytes' small tensors)
        tx = adamw_8bit(schedule, b1=cfg.adamw_beta1, b2=cfg.adamw_beta2, eps=cfg.adamw_epsilon,
                        weight_decay=cfg.weight_decay, mask=decay_mask, fp32_mask=fp32_state_mask, mesh=mesh)
        return (chain_clip(cfg.max_grad_norm, tx) if cfg.max_grad_norm > 0 else tx), schedule
    if cfg.optimizer == "normuon":
        tx = normuon(schedule, momentum=cfg.normuon_momentum, beta2=cfg.normuon_beta2,
                     weight_decay=cfg.weight_decay, cautious_wd=cfg.normuon_cautious_wd,
                     adam_b1=cfg.adamw_beta1, adam_b2=cfg.adamw_beta2, adam_eps=cfg.adamw_epsilon, mesh=mesh)
    else:
        tx = optax.adamw(schedule, b1=cfg.adamw_beta1, b2=cfg.adamw_beta2, eps=cfg.adamw_epsilon,
                         weight_decay=cfg.weight_decay, mask=decay_mask)
    # chain_clip = optax.chain(clip_by_global_norm, tx) (same state) that can also clip by a norm
    # computed elsewhere (the layer-streamed update of offloaded state, surogate_jax/offload.py)
    return (chain_clip(cfg.max_grad_norm, tx) if cfg.max_grad_norm > 0 else tx), schedule


__all__ = ["FusedGradientTransformation", "adamw_8bit", "apply_fused", "chain_clip", "decay_mask",
           "fp32_state_mask", "make_optimizer", "make_schedule", "normuon"]
