"""LM-head + token cross-entropy for the train step: the fused op `surogate_jax.ops.lm_head_ce`.

Returns the SUM of per-token losses over supervised tokens and their count; the train step divides
by the count of the whole optimizer step (all micro-batches), so gradient accumulation equals one
big batch. The op runs chunked (over tokens, and for the head's gradient over vocabulary blocks)
so [tokens, vocab] fp32 logits never exist whole (CUDA row kernel between cuBLAS GEMMs on GPU, the
same chunked algorithm in pure JAX elsewhere); see ops/lm_head_ce.py.
"""

from __future__ import annotations

from .ops.lm_head_ce import lm_head_ce


def cross_entropy_sum(hidden_BTD, head_DV, targets_BT, mask_BT, *, chunk: int | None = None,
                      head_layout: str = "DV", z_loss: float = 0.0, mesh=None):
    """(sum of CE over tokens weighted by mask (> 0 = supervised), sum of mask), float32 scalars.

    head_DV is [D, V]; pass head_layout="VD" to give a tied [V, D] embedding table as is (no
    transposed copy). chunk: tokens per chunk (None: the op's default). z_loss: weight of the
    auxiliary z-loss z * lse^2 added to each token's loss. mesh: the device mesh whose data axes
    split the tokens (ops/_sharding.py; None: one call on all of them).
    """
    return lm_head_ce(hidden_BTD, head_DV, targets_BT, mask_BT, head_layout=head_layout, z_loss=z_loss,
                      chunk=chunk, mesh=mesh)
