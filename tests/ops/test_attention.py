"""CPU tests of surogate_jax/ops/attention.py: `segment_offsets` against an independent numpy walk of the segment
runs (loader-style ids, padding runs, single-token segments, the M bound); the reference path against each document
attended alone (the packed-row contract); the public op's fallbacks off GPU; argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops.attention import Segments, attention, attention_impl, attention_ref, segment_offsets, segments


def _runs(row):
    """(start, length) of each contiguous run of equal ids, by a plain walk."""
    runs, start = [], 0
    for t in range(1, len(row) + 1):
        if t == len(row) or row[t] != row[t - 1]:
            runs.append((start, t - start))
            start = t
    return runs


def _expected(seg, m):
    B = seg.shape[0]
    lengths = -np.ones((B, m), np.int32)
    offsets = -np.ones((B, m + 1), np.int32)
    for b in range(B):
        for j, (s, n) in enumerate(_runs(list(seg[b]))[:m]):
            lengths[b, j], offsets[b, j] = n, s
    return lengths, offsets


def _loader_row(rng, T, max_doc=None):
    """ids 1, 2, ... per document, 0 for the padding at the end (the loader's layout)."""
    row, t, seg = np.zeros(T, np.int32), 0, 1
    while t < T:
        n = int(rng.integers(1, max_doc or T // 3 + 2))
        if t + n > T:
            break
        row[t:t + n] = seg
        t, seg = t + n, seg + 1
    return row


@pytest.mark.parametrize("seed", range(6))
def test_segment_offsets_matches_runs(seed):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(2, 300))
    seg = np.stack([_loader_row(rng, T, max_doc=int(rng.integers(1, 40))) for _ in range(3)])
    m = max(len(_runs(list(r))) for r in seg)
    for bound in (m, m + 5):
        got = jax.jit(segment_offsets, static_argnums=1)(jnp.asarray(seg), bound)
        want = _expected(seg, bound)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert (np.asarray(got[0]).clip(0).sum(1) == T).all()  # every token in a segment


def test_segment_offsets_examples():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 7]], jnp.int32)
    lengths, offsets = segment_offsets(seg, 4)
    np.testing.assert_array_equal(lengths, [[3, 2, 2, -1], [7, -1, -1, -1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, -1]])


def test_segment_offsets_drops_segments_past_the_bound():
    seg = jnp.asarray([[1, 2, 2, 3, 3, 3]], jnp.int32)
    lengths, offsets = segment_offsets(seg, 2)
    np.testing.assert_array_equal(lengths, [[1, 2]])
    np.testing.assert_array_equal(offsets, [[0, 1, -1]])


def _qkv(B, T, N, KV, H, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H), dtype), jax.random.normal(ks[1], (B, T, KV, H), dtype),
            jax.random.normal(ks[2], (B, T, KV, H), dtype))


def test_reference_equals_each_document_alone():
    """A packed row computes what each document computes alone (GQA, a padding run, uneven documents)."""
    B, T, N, KV, H = 2, 40, 4, 2, 8
    q, k, v = _qkv(B, T, N, KV, H)
    seg = np.stack([_loader_row(np.random.default_rng(b), T, max_doc=15) for b in range(B)])
    out = attention_ref(q, k, v, jnp.asarray(seg))
    for b in range(B):
        for s, n in _runs(list(seg[b])):
            alone = jax.nn.dot_product_attention(q[b:b + 1, s:s + n], k[b:b + 1, s:s + n], v[b:b + 1, s:s + n],
                                                 is_causal=True)
            np.testing.assert_allclose(out[b:b + 1, s:s + n], alone, rtol=1e-5, atol=1e-5)


def test_public_op_off_gpu_is_the_reference():
    q, k, v = _qkv(2, 24, 4, 4, 8, seed=1)
    seg = jnp.asarray(np.stack([_loader_row(np.random.default_rng(b), 24, 9) for b in range(2)]))
    for segs, kw in ((seg, {}), (segments(seg, 8), {}), (segments(seg, 8), {"impl": "xla"})):
        np.testing.assert_array_equal(attention(q, k, v, segs, **kw), attention_ref(q, k, v, seg))
    np.testing.assert_array_equal(attention(q, k, v), attention_ref(q, k, v))
    assert attention_impl("auto", jnp.float32) == "xla"


def test_gradients_match_reference():
    q, k, v = _qkv(1, 16, 2, 1, 8, seed=2)
    seg = jnp.asarray([[1] * 5 + [2] * 9 + [0] * 2], jnp.int32)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.tanh(fn(q, k, v)))

    segs = segments(seg, 4)
    got = jax.grad(lambda *a: loss(lambda q, k, v: attention(q, k, v, segs), *a), (0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(lambda q, k, v: attention_ref(q, k, v, seg), *a), (0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)  # off GPU the op is the reference itself


@pytest.mark.parametrize("bad", [0, -1, True])
def test_bad_max_segments(bad):
    with pytest.raises(ValueError, match="max_segments"):
        segments(jnp.ones((1, 4), jnp.int32), bad)


def test_segments_carry_the_offsets():
    ids = jnp.asarray([[1, 1, 2, 0]], jnp.int32)
    segs = segments(ids, 4)
    assert isinstance(segs, Segments)
    np.testing.assert_array_equal(segs.ids, ids)
    np.testing.assert_array_equal(segs.lengths, segment_offsets(ids, 4)[0])
    np.testing.assert_array_equal(segs.offsets, segment_offsets(ids, 4)[1])


def test_bad_impl():
    q, k, v = _qkv(1, 4, 1, 1, 8)
    with pytest.raises(ValueError, match="attention impl"):
        attention(q, k, v, impl="flash")


def test_decoder_computes_segments_once_and_matches_the_mask():
    """With max_segments the decoder builds the segments' offsets once for all layers (one more cumsum in the
    program, however many layers), and off GPU its logits are those of the dense-mask path."""
    import flax.linen as nn

    from surogate_jax.models import Decoder, DecoderConfig

    cfg = DecoderConfig(model_type="qwen3", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 24)), jnp.int32)
    seg = jnp.asarray(np.stack([_loader_row(np.random.default_rng(b), 24, 9) for b in range(2)]))
    params = nn.meta.unbox(Decoder(cfg).init(jax.random.key(0), ids[:, :4])["params"])
    packed = Decoder(cfg.replace(max_segments=8))
    def cumsums_outside_scans(model):
        """cumsum equations reachable without entering a scan (the layer stack is one)."""
        def walk(jaxpr):
            n = 0
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "cumsum":
                    n += 1
                elif eqn.primitive.name != "scan":
                    subs = [getattr(v, "jaxpr", v) for v in eqn.params.values()]
                    n += sum(walk(j) for j in subs if hasattr(j, "eqns"))
            return n

        return walk(jax.make_jaxpr(lambda p: model.apply({"params": p}, ids, segment_ids=seg))(params).jaxpr)

    assert cumsums_outside_scans(packed) == 1 and cumsums_outside_scans(Decoder(cfg)) == 0
    np.testing.assert_array_equal(packed.apply({"params": params}, ids, segment_ids=seg),
                                  Decoder(cfg).apply({"params": params}, ids, segment_ids=seg))
