"""Qwen3 dense: GQA decoder with per-head RMSNorm on q and k before RoPE; head_dim is its own field
(e.g. Qwen3-0.6B: hidden 1024, 16 heads of 128).

HF reference: transformers `models/qwen3` (`Qwen3ForCausalLM`). `attention_bias=true` (which would
also bias o_proj) and sliding windows are refused by name.
"""

from __future__ import annotations

from .hf_config import check_full_attention, common_fields, common_to_hf, read_rope, require, warn_unknown
from .llamalike import DecoderConfig

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"


def config_from_hf(d: dict, **numerics) -> DecoderConfig:
    require(d, "attention_bias", (False, None), False, "Qwen3 attention projections without bias")
    check_full_attention(d)
    warn_unknown(d, frozenset())
    theta, scaling = read_rope(d, ("default",))
    return DecoderConfig(
        **common_fields(d, MODEL_TYPE, numerics),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=True,
    )


def config_to_hf(cfg: DecoderConfig) -> dict:
    return {
        **common_to_hf(cfg, ARCHITECTURE),
        "attention_bias": False,
        "use_sliding_window": False,
        "max_window_layers": cfg.num_layers,
    }
