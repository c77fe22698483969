"""Reading HF `config.json` dicts strictly: what changes the math is handled or refused by name.

HF adds harmless fields all the time (token ids, generation defaults, library versions), so an
unknown field is logged, not fatal; but every field known to change the computation is checked
against what we implement and refused with `UnsupportedConfigError` naming the field and value.
Both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x layout
(`rope_parameters`) are read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from surogate_jax.errors import UnsupportedConfigError

from .llamalike import DecoderConfig, RopeScaling

log = logging.getLogger("surogate_jax")

# Fields with no effect on the forward math (bookkeeping, generation, tokenizer ids).
IGNORED = frozenset(
    """architectures model_type transformers_version torch_dtype dtype bos_token_id eos_token_id
    pad_token_id use_cache output_attentions output_hidden_states return_dict tie_encoder_decoder
    is_encoder_decoder id2label label2id problem_type chunk_size_feed_forward pruned_heads
    cross_attention_hidden_size add_cross_attention tokenizer_class prefix sep_token_id
    decoder_start_token_id task_specific_params finetuning_task _name_or_path quantization_config
    max_window_layers sliding_window use_sliding_window layer_types pretraining_tp
    attention_dropout mlp_bias attention_bias hidden_act rope_scaling rope_parameters rope_theta
    head_dim initializer_range tie_word_embeddings max_position_embeddings use_return_dict
    _attn_implementation_autoset is_decoder""".split()
)
COMMON = frozenset(
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads rms_norm_eps".split()
)


def refuse(field: str, value: Any, supported: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"config field {field}={value!r} is not supported ({supported})")


def require(d: dict, field: str, allowed: Iterable[Any], default: Any, why: str) -> None:
    value = d.get(field, default)
    if value not in tuple(allowed):
        raise refuse(field, value, why)


def read_rope(d: dict, allowed_types: tuple[str, ...]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either HF layout; other rope types refused."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    if "type" in scaling:  # the pre-4.45 spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    params.update(scaling)
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or "default"
    field = "rope_scaling" if scaling else "rope_parameters"
    if rope_type not in allowed_types:
        raise refuse(f"{field}.rope_type", rope_type, f"this model family supports {allowed_types}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(f"{field}.partial_rotary_factor", params["partial_rotary_factor"], "only 1.0")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def check_full_attention(d: dict) -> None:
    """Sliding-window attention changes which tokens attend; we only do full causal attention."""
    if d.get("use_sliding_window"):
        raise refuse("use_sliding_window", True, "only full attention is implemented")
    layer_types = d.get("layer_types") or []
    bad = sorted({t for t in layer_types if t != "full_attention"})
    if bad:
        raise refuse("layer_types", bad, "only 'full_attention' layers are implemented")


def warn_unknown(d: dict, known: frozenset[str]) -> None:
    unknown = sorted(set(d) - IGNORED - COMMON - known)
    if unknown:
        log.warning("config.json fields not read by surogate_jax (assumed harmless): %s", unknown)


def common_fields(d: dict, model_type: str, numerics: dict) -> dict:
    """DecoderConfig kwargs shared by every family."""
    require(d, "hidden_act", ("silu",), "silu", "only silu (SwiGLU) MLPs are implemented")
    if float(d.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise refuse("attention_dropout", d["attention_dropout"], "only 0.0")
    heads = int(d["num_attention_heads"])
    try:
        return dict(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            **numerics,
        )
    except KeyError as e:
        raise UnsupportedConfigError(f"config.json is missing the required field {e.args[0]!r}") from None


def common_to_hf(cfg: DecoderConfig, architecture: str) -> dict:
    """The HF config.json fields every family writes (transformers 4.x layout, read by 5.x too)."""
    rope: dict[str, Any] | None = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = dict(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return dict(
        architectures=[architecture],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        attention_dropout=0.0,
        use_cache=True,
    )
