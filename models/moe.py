"""Mixture-of-experts feed-forward as Qwen3-MoE computes it (transformers `models/qwen3_moe`): the model's path
(`moe_mlp`: tokens sorted by expert through grouped GEMMs) and the dense reference it is tested against.

Routing (`route`): router logits [T, E] = x @ W_router^T; softmax in f32; the top-k experts of each token; with
`norm_topk_prob` their probabilities renormalised to sum to 1; the weights cast back to the logits' dtype.
Drop-free: every token reaches its k experts (no capacity factor).

Experts: expert e computes down_e(silu(gate_e(x)) * up_e(x)); a token's output is the sum over its k experts of
weight x expert output. `moe_mlp_ref` computes every expert on every token and combines with a dense [T, E] weight
matrix (zero off the top-k): exact, E/k times the work. `moe_mlp` computes only the routed pairs: the T*K (token,
expert) pairs sorted by expert (a stable argsort of the expert ids, on the device), the tokens gathered in that
order, three grouped GEMMs (ops/grouped_matmul.py) with SwiGLU between, each row times its routing weight in
fp32, gathered back to [T, K, D] and summed over K.

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
import numpy as np

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
    (rows sorted by expert, group sizes) -> its output: a quantized frozen base (qlora.base.frozen_grouped, a
    `jax.tree_util.Partial` over the quantized parts).
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
    rate, key = lora_dropout if lora_dropout is not None else (0.0, None)
    if ep_axis is None:
        order_N, sizes_E = sort_by_expert(idx_TK, E)
        y_TD = _experts(x_TD, weights_TK, order_N, sizes_E, gate_EDI, up_EDI, down_EID, lora or {}, key, k=k,
                        impl=impl, swiglu_impl=swiglu_impl, lora_scale=lora_scale, dropout_rate=rate)
        return y_TD.astype(x_TD.dtype), stats
    if ep_experts is None:
        raise ValueError("moe_mlp: ep_axis needs ep_experts (the experts each device holds)")
    x_all, w_all, idx_all = (jax.lax.all_gather(a, ep_axis, tiled=True) for a in (x_TD, weights_TK, idx_TK))
    # this device's experts first: ids relative to its first expert, mod E; the others sort past them, fall outside
    # this device's groups (the grouped GEMMs leave those rows zero) and get weight 0
    local_idx = (idx_all - jax.lax.axis_index(ep_axis) * ep_experts) % E
    w_all = jnp.where(local_idx < ep_experts, w_all, jnp.zeros_like(w_all))
    order_N, sizes_E = sort_by_expert(local_idx, E)
    sizes_E = sizes_E[:ep_experts]
    operands = (x_all, w_all, order_N, sizes_E, gate_EDI, up_EDI, down_EID, lora or {}, key)
    experts = functools.partial(_experts, k=k, impl=impl, swiglu_impl=swiglu_impl, lora_scale=lora_scale,
                                dropout_rate=rate)
    rows = min(order_N.shape[0], math.ceil(ep_capacity * T * k))
    if rows < order_N.shape[0]:
        y_TD = fast_or_exact(jnp.sum(sizes_E) <= rows, functools.partial(experts, rows=rows), experts, operands)
    else:
        y_TD = experts(*operands)
    return jax.lax.psum_scatter(y_TD, ep_axis, scatter_dimension=0, tiled=True).astype(x_TD.dtype), stats


def fast_or_exact(pred: jax.Array, fast, exact, operands):
    """fast(*operands) where pred holds, else exact(*operands) (same result), differentiable in the operands' float
    leaves (callables among them: `jax.tree_util.Partial`s, their arguments leaves). The backward keeps fast's
    residuals and recomputes exact's, and residuals that are operands stay references: `jax.lax.cond` under autodiff
    (jax 0.11) keeps both branches' residuals and returns copies of operands, e.g. the experts' weights every layer."""
    leaves, tree = jax.tree.flatten(operands)
    diff = [jnp.issubdtype(jnp.result_type(v), jnp.inexact) for v in leaves]
    box = {}

    def split(leaves):
        return [v for v, d in zip(leaves, diff) if d], [v for v, d in zip(leaves, diff) if not d]

    def merge(floats, others):
        it_f, it_o = iter(floats), iter(others)
        return [next(it_f) if d else next(it_o) for d in diff]

    def join(floats, others):
        return jax.tree.unflatten(tree, merge(floats, others))

    def fast_fwd(*leaves):
        floats, others = split(leaves)
        y, vjp_fn = jax.vjp(lambda *f: fast(*join(f, others)), *floats)
        res, res_tree = jax.tree.flatten(vjp_fn)
        where = {id(v): i for i, v in enumerate(leaves)}
        box.update(tree=res_tree, src=[where.get(id(v)) for v in res],
                   kept=[jax.ShapeDtypeStruct(v.shape, v.dtype) for v in res if id(v) not in where])
        return y, [v for v in res if id(v) not in where]

    def exact_fwd(*leaves):
        return exact(*jax.tree.unflatten(tree, leaves)), [jnp.zeros(a.shape, a.dtype) for a in box["kept"]]

    @jax.custom_vjp
    def run(pred, leaves):
        return jax.lax.cond(pred, lambda *a: fast(*jax.tree.unflatten(tree, a)),
                            lambda *a: exact(*jax.tree.unflatten(tree, a)), *leaves)

    def run_fwd(pred, leaves):
        jax.eval_shape(fast_fwd, *leaves)  # the residuals' layout, before the cond traces exact_fwd
        y, kept = jax.lax.cond(pred, fast_fwd, exact_fwd, *leaves)
        return y, (pred, leaves, kept)

    def run_bwd(res, dy):
        pred, leaves, kept = res

        def fast_bwd(leaves, kept, dy):
            it = iter(kept)
            vjp_fn = jax.tree.unflatten(box["tree"], [next(it) if i is None else leaves[i] for i in box["src"]])
            return list(vjp_fn(dy))

        def exact_bwd(leaves, kept, dy):
            floats, others = split(leaves)
            return list(jax.vjp(lambda *f: exact(*join(f, others)), *floats)[1](dy))

        d_floats = jax.lax.cond(pred, fast_bwd, exact_bwd, list(leaves), kept, dy)
        zeros = [np.zeros(jnp.shape(v), jax.dtypes.float0) for v in split(leaves)[1]]
        return np.zeros(jnp.shape(pred), jax.dtypes.float0), merge(d_floats, zeros)

    run.defvjp(run_fwd, run_bwd)
    return run(pred, leaves)


def _experts(x_TD, weights_TK, order_N, sizes_E, gate_EDI, up_EDI, down_EID, lora, key, *, k, impl, swiglu_impl,
             lora_scale, dropout_rate, rows=None):
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
            if key is not None:  # LoRA dropout
                keep = jax.random.bernoulli(jax.random.fold_in(key, EXPERT_PROJECTIONS.index(name)),
                                            1.0 - dropout_rate, x.shape)
                x = jnp.where(keep, x / (1.0 - dropout_rate), jnp.zeros_like(x)).astype(x.dtype)
            xa = grouped_matmul(x, a.astype(x.dtype), sizes_E, impl=impl)
            xab = grouped_matmul(xa, b.astype(x.dtype), sizes_E, impl=impl)
            y = y + (xab * lora_scale).astype(y.dtype)
        return y

    g_NI = project(xs_ND, gate_EDI, "gate_proj")
    u_NI = project(xs_ND, up_EDI, "up_proj")
    h_NI = swiglu(g_NI, u_NI, impl=swiglu_impl)
    ys_ND = project(h_NI, down_EID, "down_proj")
    w_N = jnp.take(weights_TK.reshape(-1), order_N)  # each sorted pair's routing weight
    # weighted in fp32 per sorted row, the backward keeping ys in its dtype (not a [T, K, D] fp32 copy)
    yw_ND = jax.checkpoint(lambda ys, w: ys.astype(jnp.float32) * w.astype(jnp.float32)[:, None])(ys_ND, w_N)
    # back to [T, K, D] (pairs sorted past `rows` are other devices': zeros) and summed over each token's k
    return jnp.sum(jnp.take(yw_ND, inverse_N, axis=0, mode="fill", fill_value=0).reshape(T, k, D), axis=1)


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
