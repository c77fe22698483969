"""models/moe.py (the model's sorted grouped-GEMM path `moe_mlp` and the dense reference `moe_mlp_ref`) against
transformers' Qwen3-MoE block and load-balancing loss, fp32, on random weights: uneven expert counts, top-k with and
without renormalisation, padding masks; the per-layer router statistics pooled into the losses; and the routing
rules on their own (softmax in f32, top-k, weights that sum to one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import hf_experts

from surogate_jax.models import moe

torch = pytest.importorskip("torch")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
Qwen3MoeConfig = pytest.importorskip("transformers").Qwen3MoeConfig


def _block(D, I, E, k, norm, seed):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=norm, hidden_act="silu")
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def _weights(block, E, I):
    """(router [E, D], gate [E, D, I], up [E, D, I], down [E, I, D]) of a transformers MoE block."""
    sd = {n: t.detach().numpy() for n, t in block.state_dict().items()}
    ex = hf_experts(sd, "experts", E, I)
    return sd["gate.weight"], ex["gate_proj"], ex["up_proj"], ex["down_proj"]


BLOCKS = {"sorted": lambda *a, **kw: (moe.moe_mlp(*a, **kw)[0], None), "dense": moe.moe_mlp_ref}


@pytest.mark.parametrize("path", sorted(BLOCKS))
@pytest.mark.parametrize(("D", "I", "E", "k", "norm"), [
    (16, 24, 8, 2, True),
    (16, 24, 8, 2, False),
    (12, 20, 5, 3, True),  # uneven expert count, odd top-k
    (8, 12, 7, 1, False),
    (8, 12, 6, 6, True),  # every expert chosen
])
def test_block_matches_transformers(D, I, E, k, norm, path):
    block = _block(D, I, E, k, norm, seed=E * 10 + k)
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        want = block(x).numpy().reshape(-1, D)
    router, gate, up, down = _weights(block, E, I)
    got, logits = BLOCKS[path](jnp.asarray(x.numpy().reshape(-1, D)), jnp.asarray(router), jnp.asarray(gate),
                                  jnp.asarray(up), jnp.asarray(down), k=k, norm_topk_prob=norm)
    scale = np.abs(want).max()
    assert np.abs(np.asarray(got) - want).max() <= 1e-4 * scale
    if logits is not None:
        np.testing.assert_allclose(np.asarray(logits), x.numpy().reshape(-1, D) @ router.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", sorted(BLOCKS))
@pytest.mark.parametrize(("E", "k", "norm"), [(8, 2, True), (5, 3, False)])
def test_block_gradients_match_transformers(E, k, norm, path):
    D, I = 12, 20
    block = _block(D, I, E, k, norm, seed=E)
    x = torch.randn(17, D, requires_grad=True)
    g = torch.randn(17, D)
    (block(x[None])[0] * g).sum().backward()
    router, gate, up, down = _weights(block, E, I)

    def loss(x, router, gate, up, down):
        y, _ = BLOCKS[path](x, router, gate, up, down, k=k, norm_topk_prob=norm)
        return jnp.sum(y * jnp.asarray(g.numpy()))

    got = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(jnp.asarray(x.detach().numpy()), *map(jnp.asarray,
                                                                                          (router, gate, up, down)))
    sd_grads = {n: p.grad.numpy() for n, p in block.named_parameters()}
    ex = hf_experts(sd_grads, "experts", E, I)
    want = (x.grad.numpy(), sd_grads["gate.weight"], ex["gate_proj"], ex["up_proj"], ex["down_proj"])
    for name, a, b in zip(("x", "router", "gate", "up", "down"), got, want, strict=True):
        assert np.abs(np.asarray(a) - b).max() <= 1e-4 * np.abs(b).max(), name


def _stats(logits, k, mask=None):
    _, idx, probs = moe.route(logits, k, False)
    return moe.router_stats(logits, probs, idx, mask)


def _losses(logits_per_layer, k, mask=None):
    """moe.router_losses over the layers' router logits, as the model pools them (per-layer sums, stacked)."""
    per_layer = [_stats(x, k, mask) for x in logits_per_layer]
    return moe.router_losses({n: jnp.stack([s[n] for s in per_layer]) for n in per_layer[0]})


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(("E", "k"), [(8, 2), (5, 3), (6, 1)])
def test_load_balancing_loss_matches_transformers(E, k, masked):
    # transformers concatenates every layer's rows; the model sums per-layer statistics: the same pooled loss
    rng = np.random.default_rng(E + k)
    B, T, layers = 2, 9, 3
    logits = [rng.normal(size=(B * T, E)).astype(np.float32) for _ in range(layers)]
    mask = (rng.random((B, T)) < 0.7).astype(np.int64) if masked else None
    want = qwen3_moe.load_balancing_loss_func(tuple(torch.from_numpy(x) for x in logits), E, k,
                                              None if mask is None else torch.from_numpy(mask))
    got = _losses([jnp.asarray(x) for x in logits], k, None if mask is None else jnp.asarray(mask.reshape(-1)))
    np.testing.assert_allclose(float(got["aux_loss"]), float(want), rtol=1e-5)


def test_expert_load_and_the_router_gradient():
    rng = np.random.default_rng(5)
    E, k, T = 6, 2, 15
    logits = [jnp.asarray(rng.normal(size=(T, E)), jnp.float32) for _ in range(4)]
    per_layer = [_stats(x, k) for x in logits]
    counts = np.stack([np.asarray(s["counts"]) for s in per_layer])
    assert counts.sum() == 4 * T * k
    np.testing.assert_allclose(float(_losses(logits, k)["expert_load"]), np.mean(counts.max(-1) / counts.mean(-1)),
                               rtol=1e-6)
    # the top-k counts carry no gradient; the probabilities and logsumexp do
    g = jax.grad(lambda x: _losses([x], k)["aux_loss"])(logits[0])
    assert float(jnp.abs(g).max()) > 0


def test_balanced_routing_gives_loss_k():
    # uniform router probabilities and every expert taken equally often: E * sum_e (k / E) * (1 / E) = k
    E, k = 4, 2
    logits = jnp.zeros((8, E)).at[jnp.arange(8), jnp.arange(8) % E].add(1e-3)
    logits = logits.at[jnp.arange(8), (jnp.arange(8) + 1) % E].add(1e-3)
    np.testing.assert_allclose(float(_losses([logits], k)["aux_loss"]), k, rtol=1e-3)


def test_route_renormalises_and_keeps_the_logits_dtype():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.bfloat16)
    w, idx, _ = moe.route(logits, 2, True)
    assert w.dtype == jnp.bfloat16 and idx.dtype == jnp.int32 and idx.shape == (6, 2)
    np.testing.assert_allclose(np.asarray(w, np.float32).sum(-1), 1.0, atol=1e-2)
    p = np.asarray(jnp.asarray(logits, jnp.float32))
    assert (np.asarray(idx)[:, 0] == p.argmax(-1)).all()
    w_raw, _, _ = moe.route(logits, 2, False)
    sm = np.exp(p - p.max(-1, keepdims=True))
    sm /= sm.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(w_raw, np.float32), np.sort(sm, -1)[:, ::-1][:, :2], rtol=1e-2)


def test_z_loss_is_the_mean_squared_logsumexp_over_unmasked_rows():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    mask = np.array([1, 0, 1, 1])
    lse = lambda x: np.log(np.exp(x).sum(-1))  # noqa: E731
    want = ((lse(a) ** 2 * mask).sum() + (lse(b) ** 2 * mask).sum()) / (2 * mask.sum())
    got = _losses([jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)], 1, jnp.asarray(mask))["z_loss"]
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
