"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention with a mixture-of-experts feed-forward (a softmax router over
`num_experts`, the top `num_experts_per_tok` experts of `moe_intermediate_size` each, drop-free; models/moe.py); the
layers listed in `mlp_only_layers`, and with `decoder_sparse_step` s > 1 those whose (index + 1) is not a multiple of
s, keep Qwen3's dense MLP of `intermediate_size`.

HF reference: transformers `models/qwen3_moe` (`Qwen3MoeForCausalLM`). The Hub's config.json names the expert count
`num_experts`; transformers 5 writes `num_local_experts`: both are read. Shared experts (Qwen2-MoE's
`shared_expert_intermediate_size`) are refused by name. `router_aux_loss_coef` is the default weight of the
load-balancing loss in training (transformers adds it only with `output_router_logits`; we add it always,
`router_aux_loss_coef: 0` turns it off); `output_router_logits` does not change the forward.
"""

from __future__ import annotations

from surogate_jax.errors import ModelLoadError

from . import qwen3
from .hf_config import FIX, refuse, required_size
from .llamalike import DecoderConfig

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
KNOWN = frozenset("num_experts num_local_experts num_experts_per_tok moe_intermediate_size norm_topk_prob "
                  "decoder_sparse_step mlp_only_layers router_aux_loss_coef output_router_logits".split())


def config_from_hf(d: dict, **numerics) -> DecoderConfig:
    """Qwen3's config (read by models/qwen3.py, the MoE fields left out) with the experts."""
    if d.get("shared_expert_intermediate_size"):
        raise refuse("shared_expert_intermediate_size", d["shared_expert_intermediate_size"],
                     "shared experts are not implemented")
    step = d.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"config.json: decoder_sparse_step={step!r} must be an integer >= 1; {FIX}")
    dense_layers = d.get("mlp_only_layers") or []
    n_layers = d.get("num_hidden_layers")
    if not isinstance(dense_layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and (not isinstance(n_layers, int) or 0 <= i < n_layers)
            for i in dense_layers):
        raise ModelLoadError(f"config.json: mlp_only_layers={dense_layers!r} must be a list of layer indices in "
                             f"[0, num_hidden_layers={n_layers}); {FIX}")
    field = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    if d.get(field) is None:
        raise ModelLoadError(f"config.json: the required field 'num_experts' (or 'num_local_experts') is missing; "
                             f"{FIX}")
    experts = required_size(d, field)
    k = required_size(d, "num_experts_per_tok")
    if k > experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok={k} exceeds {field}={experts}; {FIX}")
    dense = qwen3.config_from_hf({f: v for f, v in d.items() if f not in KNOWN}, **numerics)
    return dense.replace(model_type=MODEL_TYPE, num_experts=experts, num_experts_per_tok=k,
                         moe_intermediate_size=required_size(d, "moe_intermediate_size"),
                         norm_topk_prob=bool(d.get("norm_topk_prob", False)),  # transformers' default
                         decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(dense_layers))),
                         router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)))  # likewise


def config_to_hf(cfg: DecoderConfig) -> dict:
    return {
        **qwen3.config_to_hf(cfg),
        "architectures": [ARCHITECTURE],
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
    }
