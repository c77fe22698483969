"""Learning-rate schedules with Surogate's names and shapes (constant, linear, cosine, wsd).

All start with a linear warmup from 0 (warmup_steps, else warmup_ratio x total). `final_lr_fraction`
is where linear/cosine/wsd end. `wsd` holds the peak and decays over the last
`wsd_decay_steps_fraction` of training with a 1 - sqrt(progress) shape; `cooldown_steps` adds the
same 1 - sqrt shape at the end of any schedule (Surogate implements its cooldown that way).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..config import OptimConfig


def make_schedule(cfg: OptimConfig, total_steps: int):
    peak = cfg.learning_rate
    final = cfg.final_lr_fraction
    warm = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    total = max(total_steps, 1)
    cool = min(cfg.cooldown_steps, total)

    def sqrt_decay(progress):  # 1 -> final
        return final + (1.0 - final) * (1.0 - jnp.sqrt(jnp.clip(progress, 0.0, 1.0)))

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        span = jnp.maximum(total - warm, 1)
        p = jnp.clip((step - warm) / span, 0.0, 1.0)
        if cfg.lr_scheduler_type == "constant":
            f = jnp.ones_like(p)
        elif cfg.lr_scheduler_type == "linear":
            f = 1.0 - (1.0 - final) * p
        elif cfg.lr_scheduler_type == "cosine":
            f = final + (1.0 - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        else:  # wsd
            decay = max(int(round(cfg.wsd_decay_steps_fraction * total)), 1)
            f = jnp.where(step < total - decay, 1.0, sqrt_decay((step - (total - decay) + 1) / decay))
        if cool:
            f = jnp.where(step >= total - cool, f * sqrt_decay((step - (total - cool) + 1) / cool), f)
        w = jnp.where(step < warm, (step + 1) / max(warm, 1), 1.0)
        return peak * w * f

    return schedule
