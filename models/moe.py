"""Mixture-of-experts feed-forward as Qwen3-MoE computes it (transformers `models/qwen3_moe`): the model's path
(`moe_mlp`: tokens sorted by expert through grouped GEMMs) and the dense reference it is tested against.

Routing (`route`): router logits [T, E] = x @ W_router^T; softmax in f32; the top-k experts of each token; with
`norm_topk_prob` their probabilities renormalised to sum to 1; the weights cast back to the logits' dtype.
Drop-free: every token reaches its k experts (no capacity factor).

Experts: expert e computes down_e(silu(gate_e(x)) * up_e(x)); a token's output is the sum over its k experts of
weight x expert output. `moe_mlp_ref` computes every expert on every token and combines with a dense [T, E] weight
matrix (zero off the top-k): exact, E/k times the work. `moe_mlp` computes only the routed pairs: the T*K (token,
expert) pairs sorted by expert (a stable argsort of the expert ids, on the device), the tokens gathered in that
order, three grouped GEMMs (ops/grouped_matmul.py) with SwiGLU between, and the results gathered back to
[T, K, D] and summed with the routing weights in fp32.

Router losses (`router_losses`, from each layer's `router_stats`: sums over its rows, so that data shards and layers
add up): the auxiliary load-balancing loss (Switch Transformer eqs. 4-6, as transformers' `load_balancing_loss_func`)
over the rows of every MoE layer together (padding excluded by a mask), E x sum_e f_e x P_e with f_e = top-k
assignments of expert e per row and P_e = the mean router probability of e; the router z-loss (ST-MoE, Zoph et al.
2022, eq. 5), the mean over rows of logsumexp(logits)^2; and the expert load (max / mean tokens per expert,
averaged over layers; 1 = balanced).

Shapes: T tokens, D hidden, E experts, I the experts' intermediate size, K = top-k.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from surogate_jax.names import EXPERT_PROJECTIONS
from surogate_jax.ops import swiglu
from surogate_jax.ops.grouped_matmul import grouped_matmul

# expert parallelism's fast path: the sorted rows a device computes, per (token, expert) pair it owns on average
# (balanced routing gives it 1x; beyond this the step takes the exact full-buffer branch)
EP_CAPACITY = 1.25


def route(logits_TE: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights [T, K] in the logits' dtype, expert ids [T, K] int32, router probabilities [T, E] f32) of each
    token's top-k experts; the probabilities also feed the router statistics."""
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    top_TK, idx_TK = jax.lax.top_k(probs_TE, k)
    if norm_topk_prob:
        top_TK = top_TK / jnp.sum(top_TK, axis=-1, keepdims=True)
    return top_TK.astype(logits_TE.dtype), idx_TK.astype(jnp.int32), probs_TE


def combine_weights(weights_TK: jax.Array, idx_TK: jax.Array, num_experts: int) -> jax.Array:
    """[T, E]: each token's routing weight for every expert (zero where the expert is not among its top-k)."""
    onehot_TKE = jax.nn.one_hot(idx_TK, num_experts, dtype=weights_TK.dtype)
    return jnp.einsum("tk,tke->te", weights_TK, onehot_TKE)


def moe_mlp_ref(x_TD: jax.Array, router_ED: jax.Array, gate_EDI: jax.Array, up_EDI: jax.Array,
                down_EID: jax.Array, *, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(y [T, D], router logits [T, E]): the MoE block on tokens x (every expert on every token, combined by the
    routing weights)."""
    logits_TE = x_TD @ router_ED.T
    weights_TK, idx_TK, _ = route(logits_TE, k, norm_topk_prob)
    h_ETI = jax.nn.silu(jnp.einsum("td,edi->eti", x_TD, gate_EDI)) * jnp.einsum("td,edi->eti", x_TD, up_EDI)
    y_ETD = jnp.einsum("eti,eid->etd", h_ETI, down_EID)
    w_TE = combine_weights(weights_TK, idx_TK, router_ED.shape[0])
    return jnp.einsum("te,etd->td", w_TE.astype(y_ETD.dtype), y_ETD), logits_TE


def sort_by_expert(idx_TK: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order [T*K]: the (token, slot) pairs, flattened as token * K + slot, sorted by expert (stable); group sizes
    [E] int32)."""
    flat = idx_TK.reshape(-1)
    return jnp.argsort(flat, stable=True).astype(jnp.int32), jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def moe_mlp(x_TD: jax.Array, router_ED: jax.Array, gate_EDI: jax.Array, up_EDI: jax.Array, down_EID: jax.Array,
            *, k: int, norm_topk_prob: bool, mask_T: jax.Array | None = None, impl: str | None = None,
            swiglu_impl: str | None = None, lora: dict | None = None, lora_scale: float = 0.0,
            lora_dropout: tuple[float, jax.Array] | None = None, ep_axis: str | None = None,
            ep_experts: int | None = None, ep_capacity: float = EP_CAPACITY) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(y [T, D], the layer's router statistics: `router_stats` over the rows mask_T marks): the MoE block
    computing only each token's k experts. impl: the grouped
    GEMMs' (ops/grouped_matmul.py), swiglu_impl: SwiGLU's. A projection's weights may instead be a function
    (rows sorted by expert, group sizes) -> its output: a quantized frozen base (qlora.base.frozen_grouped_matmul).
    lora: {"gate_proj" | "up_proj" | "down_proj": (A [E, in, r], B [E, r, out])}: each expert's projection gets +
    lora_scale * (x A_e) B_e (rounded like the dense Linear's LoRA: the product to x's dtype after scaling).
    lora_dropout: (rate, key): the adapters' input is dropout(x), each (token, expert) row and projection its own
    mask (PEFT's dropout before lora_A, per expert call); training only.

    ep_axis: expert parallelism inside a shard_map whose `ep_axis` devices each hold `ep_experts` = E / ep
    consecutive experts (the expert weights, or the quantized base's functions, and adapters here are that device's
    slice; the router is whole). Dispatch by all-gather: the
    group's tokens and routing gather on every device, each runs its own experts' (token, expert) pairs, and a
    reduce-scatter sums the partial outputs back to the tokens' owners. It moves 2 (ep - 1) / ep x T x D values per
    device and layer where an all-to-all of the pairs would move about K (ep - 1) / ep x T x D (fewer bytes for
    ep <= K). Of the group's ep x T x K sorted pairs a device owns T x K on average: it computes the first
    ep_capacity x T x K of them (its own sort first) when they hold all of its pairs, and otherwise (a group
    routing more than that to this device's experts) all ep x T x K, rematerialized so that only the fast branch's
    activations are kept; drop-free either way, with static shapes (a `lax.cond` on a count computed on the
    device)."""
    T, D = x_TD.shape
    E = router_ED.shape[0]
    logits_TE = x_TD @ router_ED.T
    weights_TK, idx_TK, probs_TE = route(logits_TE, k, norm_topk_prob)
    stats = router_stats(logits_TE, probs_TE, idx_TK, mask_T)
    experts = functools.partial(_experts, gate_EDI=gate_EDI, up_EDI=up_EDI, down_EID=down_EID, k=k, impl=impl,
                                swiglu_impl=swiglu_impl, lora=lora or {}, lora_scale=lora_scale, dropout=lora_dropout)
    if ep_axis is None:
        order_N, sizes_E = sort_by_expert(idx_TK, E)
        return experts(x_TD, weights_TK, order_N, sizes_E).astype(x_TD.dtype), stats
    if ep_experts is None:
        raise ValueError("moe_mlp: ep_axis needs ep_experts (the experts each device holds)")
    x_all, w_all, idx_all = (jax.lax.all_gather(a, ep_axis, tiled=True) for a in (x_TD, weights_TK, idx_TK))
    # this device's experts first: ids relative to its first expert, mod E; the others sort past them, fall outside
    # this device's groups (the grouped GEMMs leave those rows zero) and get weight 0
    local_idx = (idx_all - jax.lax.axis_index(ep_axis) * ep_experts) % E
    w_all = jnp.where(local_idx < ep_experts, w_all, jnp.zeros_like(w_all))
    order_N, sizes_E = sort_by_expert(local_idx, E)
    sizes_E = sizes_E[:ep_experts]
    rows = min(order_N.shape[0], math.ceil(ep_capacity * T * k))
    if rows < order_N.shape[0]:
        y_TD = jax.lax.cond(jnp.sum(sizes_E) <= rows,
                            lambda *a: experts(*a, rows=rows),
                            jax.checkpoint(lambda *a: experts(*a)),
                            x_all, w_all, order_N, sizes_E)
    else:
        y_TD = experts(x_all, w_all, order_N, sizes_E)
    return jax.lax.psum_scatter(y_TD, ep_axis, scatter_dimension=0, tiled=True).astype(x_TD.dtype), stats


def _experts(x_TD, weights_TK, order_N, sizes_E, *, gate_EDI, up_EDI, down_EID, k, impl, swiglu_impl, lora,
             lora_scale, dropout, rows=None):
    """sum_k weights[t, k] x expert_{idx[t, k]}(x_t) [T, D] in fp32 from the pairs sorted by expert (`sort_by_expert`:
    order [T*K]) for the experts sizes_E counts (expert parallelism: this device's experts, whose pairs sort first;
    the others' pairs come out as zeros). rows: compute only the first `rows` sorted pairs (they must hold all the
    counted experts' pairs)."""
    T, D = x_TD.shape
    inverse_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(order_N.shape[0], dtype=jnp.int32))
    order_N = order_N if rows is None else order_N[:rows]
    xs_ND = jnp.take(x_TD, order_N // k, axis=0)

    def project(x, w, name):
        y = w(x, sizes_E) if callable(w) else grouped_matmul(x, w, sizes_E, impl=impl)
        if name in lora:
            a, b = lora[name]
            if dropout is not None:
                rate, key = dropout
                keep = jax.random.bernoulli(jax.random.fold_in(key, EXPERT_PROJECTIONS.index(name)), 1.0 - rate,
                                            x.shape)
                x = jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype)
            xa = grouped_matmul(x, a.astype(x.dtype), sizes_E, impl=impl)
            xab = grouped_matmul(xa, b.astype(x.dtype), sizes_E, impl=impl)
            y = y + (xab * lora_scale).astype(y.dtype)
        return y

    g_NI = project(xs_ND, gate_EDI, "gate_proj")
    u_NI = project(xs_ND, up_EDI, "up_proj")
    h_NI = swiglu(g_NI, u_NI, impl=swiglu_impl)
    ys_ND = project(h_NI, down_EID, "down_proj")
    # pairs sorted past `rows` are other devices' (weight 0): zeros
    y_TKD = jnp.take(ys_ND, inverse_N, axis=0, mode="fill", fill_value=0).reshape(T, k, D)
    return jnp.einsum("tk,tkd->td", weights_TK.astype(jnp.float32), y_TKD.astype(jnp.float32))


def router_stats(logits_TE: jax.Array, probs_TE: jax.Array, idx_TK: jax.Array,
                 mask_T: jax.Array | None = None) -> dict[str, jax.Array]:
    """One layer's router statistics from its routing (`route`'s probabilities [T, E] and top-k ids [T, K]) as sums
    over its rows (mask_T: 1 for rows that count, 0 for padding): counts [E] (top-k assignments), probs [E] (router
    probabilities), z (sum of logsumexp(logits)^2), rows."""
    E = logits_TE.shape[-1]
    m_T = jnp.ones(logits_TE.shape[:1], jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
    return {
        "counts": jnp.einsum("t,tke->e", m_T, jax.nn.one_hot(idx_TK, E, dtype=jnp.float32)),
        "probs": jnp.einsum("t,te->e", m_T, probs_TE),
        "z": jnp.sum(m_T * jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2),
        "rows": jnp.sum(m_T),
    }


def router_losses(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """From statistics stacked over layers ([L, E] / [L]): aux_loss (transformers' load_balancing_loss_func over all
    layers' rows together), z_loss (mean logsumexp^2 over those rows) and expert_load (max / mean tokens per expert,
    averaged over layers)."""
    E = stats["counts"].shape[-1]
    rows = jnp.maximum(jnp.sum(stats["rows"]), 1.0)
    counts_E, probs_E = jnp.sum(stats["counts"], axis=0), jnp.sum(stats["probs"], axis=0)
    counts_LE = stats["counts"]
    load = jnp.max(counts_LE, axis=-1) / jnp.maximum(jnp.mean(counts_LE, axis=-1), 1e-9)
    return {
        "aux_loss": E * jnp.sum((counts_E / rows) * (probs_E / rows)),
        "z_loss": jnp.sum(stats["z"]) / rows,
        "expert_load": jnp.mean(load),
    }
