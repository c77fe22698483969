"""Mixture-of-experts feed-forward as Qwen3-MoE computes it (transformers `models/qwen3_moe`): the pure-JAX reference
that later grouped-GEMM paths are tested against.

Routing (`route`): router logits [T, E] = x @ W_router^T; softmax in f32; the top-k experts of each token; with
`norm_topk_prob` their probabilities renormalised to sum to 1; the weights cast back to the logits' dtype.
Drop-free: every token reaches its k experts (no capacity factor).

Experts (`moe_mlp_ref`): expert e computes down_e(silu(gate_e(x)) * up_e(x)); a token's output is the sum over its
k experts of weight x expert output. The reference computes every expert on every token and combines with a dense
[T, E] weight matrix (zero off the top-k): exact, and cheap enough for the small shapes tests use.

Auxiliary load-balancing loss (`load_balancing_loss`, Switch Transformer eqs. 4-6, as transformers'
`load_balancing_loss_func`): over the rows of every MoE layer together (padding excluded by a mask),
E x sum_e f_e x P_e with f_e = top-k assignments of expert e per row and P_e = the mean router probability of e.
`router_z_loss` (ST-MoE, Zoph et al. 2022, eq. 5): mean over rows of logsumexp(logits)^2.

Shapes: T tokens, D hidden, E experts, I the experts' intermediate size, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def route(logits_TE: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, K] in the logits' dtype, expert ids [T, K] int32) of each token's top-k experts."""
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    top_TK, idx_TK = jax.lax.top_k(probs_TE, k)
    if norm_topk_prob:
        top_TK = top_TK / jnp.sum(top_TK, axis=-1, keepdims=True)
    return top_TK.astype(logits_TE.dtype), idx_TK.astype(jnp.int32)


def combine_weights(weights_TK: jax.Array, idx_TK: jax.Array, num_experts: int) -> jax.Array:
    """[T, E]: each token's routing weight for every expert (zero where the expert is not among its top-k)."""
    onehot_TKE = jax.nn.one_hot(idx_TK, num_experts, dtype=weights_TK.dtype)
    return jnp.einsum("tk,tke->te", weights_TK, onehot_TKE)


def moe_mlp_ref(x_TD: jax.Array, router_ED: jax.Array, gate_EDI: jax.Array, up_EDI: jax.Array,
                down_EID: jax.Array, *, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(y [T, D], router logits [T, E]): the MoE block on tokens x (every expert on every token, combined by the
    routing weights)."""
    logits_TE = x_TD @ router_ED.T
    weights_TK, idx_TK = route(logits_TE, k, norm_topk_prob)
    h_ETI = jax.nn.silu(jnp.einsum("td,edi->eti", x_TD, gate_EDI)) * jnp.einsum("td,edi->eti", x_TD, up_EDI)
    y_ETD = jnp.einsum("eti,eid->etd", h_ETI, down_EID)
    w_TE = combine_weights(weights_TK, idx_TK, router_ED.shape[0])
    return jnp.einsum("te,etd->td", w_TE.astype(y_ETD.dtype), y_ETD), logits_TE


def load_balancing_loss(logits_per_layer: Sequence[jax.Array], k: int, mask_T: jax.Array | None = None) -> jax.Array:
    """Scalar f32: E x sum_e (top-k assignments of e per row) x (mean router probability of e), over the rows of all
    layers' router logits [T, E] (mask_T: 1 for rows that count, 0 for padding)."""
    E = logits_per_layer[0].shape[-1]
    counts_E = jnp.zeros((E,), jnp.float32)
    probs_E = jnp.zeros((E,), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    for logits_TE in logits_per_layer:
        m_T = jnp.ones(logits_TE.shape[:1], jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
        p_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
        _, idx_TK = jax.lax.top_k(p_TE, k)
        counts_E += jnp.einsum("t,tke->e", m_T, jax.nn.one_hot(idx_TK, E, dtype=jnp.float32))
        probs_E += jnp.einsum("t,te->e", m_T, p_TE)
        rows += jnp.sum(m_T)
    return E * jnp.sum((counts_E / rows) * (probs_E / rows))


def router_z_loss(logits_per_layer: Sequence[jax.Array], mask_T: jax.Array | None = None) -> jax.Array:
    """Scalar f32: the mean over rows (all layers; mask_T as above) of logsumexp(router logits)^2."""
    total = jnp.zeros((), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    for logits_TE in logits_per_layer:
        m_T = jnp.ones(logits_TE.shape[:1], jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
        z_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)
        total += jnp.sum(m_T * z_T**2)
        rows += jnp.sum(m_T)
    return total / rows
