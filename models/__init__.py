"""Flax Linen model definitions: one llama-like decoder and its Llama 3 / Qwen2.5 / Qwen3 / Qwen3-MoE variants.

Installed as `surogate_jax.models` (the source lives in the top-level `models/` folder).
`config_from_hf(hf_config_dict, dtype=..., param_dtype=...)` picks the family from `model_type` /
`architectures` and refuses anything it cannot compute exactly; `Decoder(config)` is the module.
"""

from __future__ import annotations

from surogate_jax.errors import UnsupportedConfigError

from . import llama, qwen2, qwen3, qwen3_moe
from .hf_config import check_sizes
from .llamalike import REMAT_POLICIES, Decoder, DecoderConfig, LoraSpec, RopeScaling, expert_shape, projection_shape

FAMILIES = {m.MODEL_TYPE: m for m in (llama, qwen2, qwen3, qwen3_moe)}
ARCHITECTURES = {m.ARCHITECTURE: m for m in (llama, qwen2, qwen3, qwen3_moe)}


def _family(d: dict, where: str = "config.json"):
    model_type = d.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for arch in d.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise UnsupportedConfigError(
        f"{where}: model_type={model_type!r} (architectures={d.get('architectures')}) is not "
        f"supported; supported model types: {sorted(FAMILIES)} ({sorted(ARCHITECTURES)})"
    )


def config_from_hf(d: dict, **numerics) -> DecoderConfig:
    """HF config.json dict -> DecoderConfig; `numerics` sets dtype, param_dtype, attention_impl..."""
    return _family(d).config_from_hf(d, **numerics)


def check_hf_config(d: dict, where: str = "config.json") -> None:
    """Refuses, naming `where` and the fields, a config.json dict of an unknown family or whose sizes
    are missing, not positive integers or inconsistent (heads that do not divide). Cheap: readers
    call it on the file itself so the error names its path, before anything is built."""
    _family(d, where)
    check_sizes(d, where)


def config_to_hf(cfg: DecoderConfig) -> dict:
    """DecoderConfig -> an HF config.json dict transformers loads."""
    return FAMILIES[cfg.model_type].config_to_hf(cfg)


__all__ = [
    "ARCHITECTURES",
    "Decoder",
    "DecoderConfig",
    "FAMILIES",
    "LoraSpec",
    "REMAT_POLICIES",
    "RopeScaling",
    "check_hf_config",
    "config_from_hf",
    "config_to_hf",
    "expert_shape",
    "projection_shape",
]
