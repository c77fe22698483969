"""Reading HF `config.json` dicts strictly: what changes the math is handled or refused by name.

HF adds harmless fields all the time (token ids, generation defaults, library versions), so an
unknown field is logged, not fatal; but every field known to change the computation is checked
against what we implement and refused with `UnsupportedConfigError` naming the field and value.
Both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x layout
(`rope_parameters`) are read. A broken config (a size missing, not a positive integer, or heads that
do not divide) raises `ModelLoadError` naming config.json, the fields and their values, before any
model is built from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from surogate_jax.errors import ModelLoadError, UnsupportedConfigError

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


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Optional sizes: absent or null takes the family default (kv heads = heads, head_dim = hidden / heads).
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
FIX = "fix config.json or re-download the model"


def _size(d: dict, field: str, where: str, required: bool) -> int | None:
    """d[field] as a positive int; None when optional and absent or null."""
    if d.get(field) is None:
        if required:
            raise ModelLoadError(f"{where}: the required field {field!r} is missing; {FIX}")
        return None
    v = d[field]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelLoadError(f"{where}: {field}={v!r} must be a positive integer; {FIX}")
    return v


def required_size(d: dict, field: str, where: str = "config.json") -> int:
    """d[field] as a positive int; ModelLoadError naming it when absent, null or not a positive int."""
    return _size(d, field, where, True)


def number(d: dict, field: str, default: float, where: str = "config.json") -> float:
    """d[field] (or `default` when absent or null) as a float; a string or a list raises ModelLoadError."""
    v = d.get(field)
    if v is None:
        return float(default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelLoadError(f"{where}: {field}={v!r} must be a number; {FIX}")
    return float(v)


def check_sizes(d: dict, where: str = "config.json") -> None:
    """Refuses sizes the decoder cannot be built from: missing, not positive integers, query heads that
    are not a multiple of the key/value heads, a hidden size that does not split into the heads (when
    head_dim is absent), or an odd head_dim (RoPE rotates pairs)."""
    sizes = {f: _size(d, f, where, True) for f in REQUIRED_SIZES}
    sizes.update({f: _size(d, f, where, False) for f in OPTIONAL_SIZES})
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if kv is not None and heads % kv:
        raise ModelLoadError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
            f"(grouped-query attention shares each key/value head among a whole group of query heads); {FIX}"
        )
    head_dim = sizes["head_dim"]
    if head_dim is None:
        hidden = sizes["hidden_size"]
        if hidden % heads:
            raise ModelLoadError(
                f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads} and there is "
                f"no head_dim field; {FIX}"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        field = "head_dim" if sizes["head_dim"] is not None else "hidden_size / num_attention_heads"
        raise UnsupportedConfigError(f"{where}: {field}={head_dim} is odd; RoPE needs an even head dimension")
    if number(d, "rms_norm_eps", 1e-6, where) <= 0:
        raise ModelLoadError(f"{where}: rms_norm_eps={d['rms_norm_eps']!r} must be positive; {FIX}")


def refuse(field: str, value: Any, supported: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"config.json: {field}={value!r} is not supported ({supported})")


def require(d: dict, field: str, allowed: Iterable[Any], default: Any, why: str) -> None:
    value = d.get(field, default)
    if value not in tuple(allowed):
        raise refuse(field, value, why)


def read_rope(d: dict, allowed_types: tuple[str, ...]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either HF layout; other rope types refused."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ModelLoadError(f"config.json: {field}={value!r} must be an object or null; {FIX}")
    params, scaling = dict(params), dict(scaling)
    if "type" in scaling:  # the pre-4.45 spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    params.update(scaling)
    field = "rope_scaling" if scaling else "rope_parameters"
    theta = number(params, "rope_theta", number(d, "rope_theta", 10000.0), f"config.json: {field}")
    rope_type = params.get("rope_type") or "default"
    if rope_type not in allowed_types:
        raise refuse(f"{field}.rope_type", rope_type, f"this model family supports {allowed_types}")
    if number(params, "partial_rotary_factor", 1.0, f"config.json: {field}") != 1.0:
        raise refuse(f"{field}.partial_rotary_factor", params["partial_rotary_factor"], "only 1.0")
    if rope_type == "default":
        return theta, None
    llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in llama3 if params.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json: {field} of rope_type llama3 is missing {missing}; {FIX}")
    where = f"config.json: {field}"
    return theta, RopeScaling(
        factor=number(params, "factor", 0, where),
        low_freq_factor=number(params, "low_freq_factor", 0, where),
        high_freq_factor=number(params, "high_freq_factor", 0, where),
        original_max_position_embeddings=int(number(params, "original_max_position_embeddings", 0, where)),
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
    check_sizes(d)
    require(d, "hidden_act", ("silu",), "silu", "only silu (SwiGLU) MLPs are implemented")
    if number(d, "attention_dropout", 0.0) != 0.0:
        raise refuse("attention_dropout", d["attention_dropout"], "only 0.0")
    heads = d["num_attention_heads"]
    return dict(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=number(d, "rms_norm_eps", 1e-6),
        max_position_embeddings=d.get("max_position_embeddings") or 4096,
        initializer_range=number(d, "initializer_range", 0.02),
        **numerics,
    )


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
