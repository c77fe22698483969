"""Qwen2 / Qwen2.5 dense: GQA decoder with biases on q/k/v (not o), tied embeddings at small sizes.

HF reference: transformers `models/qwen2` (`Qwen2ForCausalLM`). Sliding-window attention (off in
every released Qwen2.5 config) and YaRN long-context scaling are refused by name.
"""

from __future__ import annotations

from .hf_config import check_full_attention, common_fields, common_to_hf, read_rope, warn_unknown
from .llamalike import DecoderConfig

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"


def config_from_hf(d: dict, **numerics) -> DecoderConfig:
    check_full_attention(d)
    warn_unknown(d, frozenset())
    theta, scaling = read_rope(d, ("default",))
    return DecoderConfig(
        **common_fields(d, MODEL_TYPE, numerics),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=True,
    )


def config_to_hf(cfg: DecoderConfig) -> dict:
    return {**common_to_hf(cfg, ARCHITECTURE), "use_sliding_window": False, "max_window_layers": cfg.num_layers}
