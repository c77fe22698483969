"""A packed row (segment_ids + positions restarting per document) equals each document run alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models import Decoder, DecoderConfig

CFG = DecoderConfig(
    model_type="qwen3", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, initializer_range=0.2,
)


@pytest.mark.parametrize("lengths", [(5, 3, 7), (1, 14), (4, 4, 4, 3)])
def test_packed_row_equals_documents_alone(lengths):
    model = Decoder(CFG)
    rng = np.random.default_rng(sum(lengths))
    docs = [rng.integers(0, CFG.vocab_size, size=n, dtype=np.int32) for n in lengths]
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    ids = np.concatenate(docs)[None]
    seg = np.concatenate([np.full(n, k + 1, np.int32) for k, n in enumerate(lengths)])[None]
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])[None]
    packed = model.apply({"params": params}, jnp.asarray(ids), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    alone = np.concatenate([np.asarray(model.apply({"params": params}, jnp.asarray(d[None])))[0] for d in docs])
    np.testing.assert_allclose(np.asarray(packed[0]), alone, rtol=2e-5, atol=2e-5)


def test_without_segment_ids_documents_do_leak():
    """The check above is not vacuous: dropping segment_ids changes the later documents."""
    model = Decoder(CFG)
    params = model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, size=(1, 10), dtype=np.int32))
    seg = jnp.asarray([[1] * 5 + [2] * 5], jnp.int32)
    pos = jnp.asarray([list(range(5)) * 2], jnp.int32)
    a = model.apply({"params": params}, ids, positions=pos, segment_ids=seg)
    b = model.apply({"params": params}, ids, positions=pos)
    np.testing.assert_allclose(a[0, :5], b[0, :5], rtol=2e-5, atol=2e-5)
    assert float(jnp.max(jnp.abs(a[0, 5:] - b[0, 5:]))) > 1e-3


def test_remat_and_plain_params():
    """Remat changes memory, not results; parameters are plain arrays (parallel.py shards by shape,
    so no logical axis names ride along)."""
    ids = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6))
    params = Decoder(CFG).init(jax.random.key(2), ids)["params"]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params, is_leaf=lambda x: not isinstance(x, dict)))

    def loss(p, cfg):
        return jnp.mean(Decoder(cfg).apply({"params": p}, ids) ** 2)

    g0 = jax.grad(loss)(params, CFG)
    g1 = jax.grad(loss)(params, CFG.replace(remat_policy="full"))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
