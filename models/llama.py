"""Llama 3.x (3.1 / 3.2 / 3.3, and Llama 2-shaped configs): plain GQA decoder, `llama3` RoPE scaling.

HF reference: transformers `models/llama` (`LlamaForCausalLM`). Tied embeddings appear at 1B/3B (3.2).
"""

from __future__ import annotations

from .hf_config import check_full_attention, common_fields, common_to_hf, read_rope, require, warn_unknown
from .llamalike import DecoderConfig

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"


def config_from_hf(d: dict, **numerics) -> DecoderConfig:
    require(d, "attention_bias", (False, None), False, "Llama attention projections without bias")
    require(d, "mlp_bias", (False, None), False, "Llama MLP without bias")
    check_full_attention(d)
    warn_unknown(d, frozenset())
    theta, scaling = read_rope(d, ("default", "llama3"))
    return DecoderConfig(
        **common_fields(d, MODEL_TYPE, numerics),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def config_to_hf(cfg: DecoderConfig) -> dict:
    return {**common_to_hf(cfg, ARCHITECTURE), "attention_bias": False, "mlp_bias": False}
