"""The decoder with mixture-of-experts layers (DecoderConfig.num_experts, models/llamalike.SparseMoeMLP) against
transformers' Qwen3MoeForCausalLM: fp32 logits within 1e-4 on tiny random configs (uneven expert counts, top-k with
and without renormalisation). The weights are copied by hand: loading Qwen3-MoE checkpoints is not built yet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import hf_experts, hf_logits, rel_err

from surogate_jax.models import Decoder, config_from_hf
from surogate_jax.models import hf_names as names

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_moe(E, k, norm, seed):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
        num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _ours(hf, E, k, norm):
    d = {**hf.config.to_dict(), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"):
        d.pop(key, None)
    cfg = config_from_hf(d).replace(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=40,
                                    norm_topk_prob=norm)
    model = Decoder(cfg)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    sd = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    I = cfg.moe_intermediate_size

    def leaf(kp, sds):
        path = tuple(p.key for p in kp)
        if not names.is_stacked(path):
            return jnp.asarray(names.from_hf(path, sd[names.hf_name(path)], sds.shape))
        per = []
        for layer in range(sds.shape[0]):
            if path[1:3] == ("mlp", "experts"):
                per.append(hf_experts(sd, f"model.layers.{layer}.mlp.experts", E, I)[path[3]])
            else:
                per.append(names.from_hf(path, sd[names.hf_name(path, layer)], sds.shape[1:]))
        return jnp.asarray(np.stack(per))

    return model, jax.tree_util.tree_map_with_path(leaf, abstract)


@pytest.mark.parametrize(("E", "k", "norm"), [(6, 2, True), (5, 3, False), (7, 1, True)])
def test_moe_logits_match_transformers(E, k, norm):
    hf = _hf_moe(E, k, norm, seed=E + k)
    model, params = _ours(hf, E, k, norm)
    ids = np.random.default_rng(E).integers(0, 101, size=(2, 13), dtype=np.int32)
    ours = model.apply({"params": params}, jnp.asarray(ids))
    assert rel_err(ours, hf_logits(hf, ids)) < 1e-4


def test_moe_config_is_checked():
    hf = _hf_moe(4, 2, True, seed=0)
    model, _ = _ours(hf, 4, 2, True)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        model.config.replace(num_experts_per_tok=5)
    from surogate_jax.models import LoraSpec

    with pytest.raises(ValueError, match="do not take LoRA"):
        model.config.replace(lora=LoraSpec(rank=4, alpha=8.0, targets=("q_proj",)))
