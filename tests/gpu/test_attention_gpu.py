"""On the GPU: packed attention through cuDNN's ragged layout (surogate_jax.ops.attention with `segments`)
against the dense same-document mask, forward and gradients, at Qwen3's head shapes (GQA, head_dim 128), with
loader-style rows (documents, a padding run), single-segment rows, many short documents, a loose bound; and the
compiled program: no [B, 1, T, T] mask, the offsets' cuDNN call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops.attention import attention, attention_ref, segments

pytestmark = pytest.mark.gpu


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _rows(rng, B, T, lo, hi, pad):
    """Loader-style rows: documents of lo..hi tokens (ids 1, 2, ...), the rest padding (0) when `pad`, else the last
    document cut to fit."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        t, s = 0, 1
        while t < T:
            n = int(rng.integers(lo, hi + 1))
            if t + n > T:
                if pad:
                    break
                n = T - t
            seg[b, t:t + n] = s
            t, s = t + n, s + 1
    return seg


def _qkv(B, T, N=16, KV=8, H=128, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(kk, (B, T, n, H), jnp.bfloat16) for kk, n in zip(ks, (N, KV, KV), strict=True))


CASES = [  # (T, lo, hi, pad, bound slack)
    (2048, 64, 1024, False, 0),  # the benchmark's rows
    (2048, 64, 1024, True, 7),  # padding runs, a loose bound
    (512, 1, 24, True, 0),  # many short documents, single-token ones
    (1024, 2048, 2048, False, 3),  # one document a row
]


@pytest.mark.parametrize("T,lo,hi,pad,slack", CASES, ids=str)
def test_packed_matches_masked(T, lo, hi, pad, slack):
    B = 2
    seg = _rows(np.random.default_rng(T + lo), B, T, lo, hi, pad)
    m = int(max(len(np.unique(r)) for r in seg)) + slack
    q, k, v = _qkv(B, T, seed=lo)
    seg = jnp.asarray(seg)
    packed = jax.jit(lambda q, k, v, s: attention(q, k, v, segments(s, m), impl="cudnn"))
    text = packed.lower(q, k, v, seg).as_text()
    assert f"{T}x{T}" not in text  # no dense mask
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want = attention_ref(*f32, seg)
    got = packed(q, k, v, seg).astype(jnp.float32)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert _rel(got, want) < 1e-2
    masked = attention(q, k, v, seg, impl="cudnn").astype(jnp.float32)  # the dense-mask cuDNN path, for scale
    assert _rel(got, want) < 2 * _rel(masked, want) + 1e-3

    def loss(fn, q, k, v):
        return jnp.sum(jnp.tanh(fn(q, k, v).astype(jnp.float32)))

    g = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: attention(q, k, v, segments(seg, m), impl="cudnn"), *a),
                         (0, 1, 2)))(q, k, v)
    g_ref = jax.grad(lambda *a: loss(lambda q, k, v: attention_ref(q, k, v, seg), *a), (0, 1, 2))(*f32)
    for name, a, b in zip("qkv", g, g_ref, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert _rel(a.astype(jnp.float32), b) < 3e-2, name


def test_unpacked_rows_unchanged():
    q, k, v = _qkv(2, 512, seed=3)
    got = attention(q, k, v, None, impl="cudnn").astype(jnp.float32)
    want = attention_ref(*[a.astype(jnp.float32) for a in (q, k, v)])
    assert _rel(got, want) < 1e-2
