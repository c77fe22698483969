"""LM-head + token cross-entropy, chunked over tokens so [tokens, vocab] fp32 logits never exist.

Returns the SUM of per-token losses over supervised tokens and their count; the train step divides
by the count of the whole optimizer step (all micro-batches), so gradient accumulation equals one
big batch. Each chunk's logits are rematerialized in the backward pass (jax.checkpoint), keeping
peak memory at one chunk of [chunk, vocab] fp32. Pure JAX; issue 4 replaces it with a fused kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sum(hidden_BTD, head_DV, targets_BT, mask_BT, *, chunk: int = 2048):
    """(sum of CE over tokens with mask > 0, number of such tokens), both float32 scalars."""
    D = hidden_BTD.shape[-1]
    h_ND = hidden_BTD.reshape(-1, D)
    t_N = targets_BT.reshape(-1)
    m_N = mask_BT.reshape(-1).astype(jnp.float32)
    n = h_ND.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    if pad:
        h_ND = jnp.pad(h_ND, ((0, pad), (0, 0)))
        t_N = jnp.pad(t_N, (0, pad))
        m_N = jnp.pad(m_N, (0, pad))
    k = h_ND.shape[0] // chunk

    @jax.checkpoint
    def chunk_loss(h_CD, t_C, m_C):
        logits = jnp.dot(h_CD, head_DV.astype(h_CD.dtype), preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, t_C[:, None], axis=-1)[:, 0]
        return jnp.sum((lse - tgt) * m_C)

    def body(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (h_ND.reshape(k, chunk, D), t_N.reshape(k, chunk), m_N.reshape(k, chunk)))
    return total, jnp.sum(m_N)
