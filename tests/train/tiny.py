"""A tiny Qwen3-shaped model and random packed batches for training tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.models import Decoder, DecoderConfig, LoraSpec

CFG = DecoderConfig(model_type="qwen3", vocab_size=67, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, initializer_range=0.2)
SPEC = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))


def base_params(seed=0, cfg=CFG):
    return nn.meta.unbox(Decoder(cfg).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"])


def random_batch(rng: np.random.Generator, rows: int, T: int, vocab: int = 67) -> dict:
    """Rows of 1-3 packed documents with positions, segment ids, shifted targets and masks."""
    out = {k: np.zeros((rows, T), np.int32) for k in ("input_ids", "targets", "positions", "segment_ids")}
    out["loss_mask"] = np.zeros((rows, T), np.float32)
    for r in range(rows):
        t, seg = 0, 1
        while t < T - 1:
            n = int(rng.integers(2, T - t + 1))
            doc = rng.integers(1, vocab, n)
            out["input_ids"][r, t:t + n] = doc
            out["targets"][r, t:t + n - 1] = doc[1:]
            out["loss_mask"][r, t:t + n - 1] = rng.random(n - 1) < 0.7
            out["positions"][r, t:t + n] = np.arange(n)
            out["segment_ids"][r, t:t + n] = seg
            t, seg = t + n, seg + 1
    return out
