"""Tiny random HF models of every family, built locally with transformers (no downloads)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
# head_dim 16, theta 5e5: wavelengths 6.3 (high), 32.5 (medium band [16, 64]), 167+ (low): all three branches run.

# name -> (config class, kwargs). Each exercises one family feature.
CASES = {
    "llama3_untied_scaled_rope": ("LlamaConfig", dict(BASE, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama3_tied": ("LlamaConfig", dict(BASE, tie_word_embeddings=True, head_dim=16)),
    "qwen2_bias_tied": ("Qwen2Config", dict(BASE, tie_word_embeddings=True,
                                            rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3_qknorm_head_dim": ("Qwen3Config", dict(BASE, head_dim=24, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", dict(BASE, head_dim=16, tie_word_embeddings=True, num_key_value_heads=4)),
}


def build_hf(case: str, seed: int = 0):
    """A random HF causal LM with non-trivial norm weights and biases (so a missing one shows)."""
    cls_name, kw = CASES[case]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                # Sharp attention, so position (RoPE) errors move the logits well above tolerance.
                p.mul_(15.0)
    return model


def hf_logits(model, ids: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {} if positions is None else {"position_ids": torch.from_numpy(positions).long()}
        return model(input_ids=torch.from_numpy(ids).long(), **kw).logits.float().numpy()


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))




def hf_experts(sd: dict, prefix: str, num_experts: int, inter: int) -> dict[str, np.ndarray]:
    """Our expert arrays (gate_proj / up_proj [E, D, I], down_proj [E, I, D]) from a Qwen3-MoE state dict (numpy)
    under `prefix` ("model.layers.0.mlp.experts"), in either layout transformers uses: fused 3-D tensors
    (gate_up_proj [E, 2I, D], down_proj [E, D, I]) or one module per expert."""
    if f"{prefix}.gate_up_proj" in sd:
        gu, down = sd[f"{prefix}.gate_up_proj"], sd[f"{prefix}.down_proj"]
        return {"gate_proj": gu[:, :inter].transpose(0, 2, 1), "up_proj": gu[:, inter:].transpose(0, 2, 1),
                "down_proj": down.transpose(0, 2, 1)}
    return {n: np.stack([sd[f"{prefix}.{e}.{n}.weight"].T for e in range(num_experts)])
            for n in ("gate_proj", "up_proj", "down_proj")}
