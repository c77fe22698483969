"""Pre-quantized Qwen3-MoE checkpoints: fine-grained FP8 experts (one tensor pair per expert, as Qwen's FP8 releases
store them) and bitsandbytes NF4 experts (their absmax kept in fp32) stack exactly into the QLoRA base's
[experts x out, in] weight; FP8 experts whose rows do not fill whole scale tiles are refused naming the tensor."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from qlora_checkpoints import FP8_CONFIG, fp8_parts, write_prequantized

from surogate_jax.errors import ModelLoadError
from surogate_jax.hf import dequantize_base, load_pretrained
from surogate_jax.models import hf_names as names
from surogate_jax.qlora import fp8_block
from surogate_jax.qlora.base import QloraSpec
from surogate_jax.safetensors_io import CheckpointReader

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_moe(d, moe_intermediate_size, **layout):
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=256,
                                      moe_intermediate_size=moe_intermediate_size, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, **layout)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(d)
    return d


def test_fp8_experts_stack_exactly_and_the_model_runs_on_them(tmp_path, assert_close):
    src = _hf_moe(tmp_path / "bf16", 128, mlp_only_layers=[0])  # layer 0 dense: its MLP is FP8 too
    qdir = write_prequantized(src, tmp_path / "fp8", fp8_parts, FP8_CONFIG)
    reader = CheckpointReader(qdir)
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in reader.names()
    model, params = load_pretrained(qdir, dtype=jnp.float32)
    assert model.config.qlora == QloraSpec("fp8", 128)
    plain, dq = dequantize_base(model, params, jnp.float32)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        got = np.asarray(dq["layers_1"]["mlp"]["experts"][proj])  # [1 layer, E, in, out]
        for e in range(4):
            name = names.hf_name(("layers_1", "mlp", "experts", proj), 0, e)
            w, scale = reader.get(name), reader.get(name.removesuffix("weight") + "weight_scale_inv")
            p = fp8_block.from_hf({"weight": w, "weight_scale_inv": scale}, w.shape, 128)
            want = fp8_block.dequantize({k: jnp.asarray(v) for k, v in p.items()}, w.shape, block_size=128,
                                        dtype=jnp.float32)
            np.testing.assert_array_equal(got[0, e], np.asarray(want).T, err_msg=f"{proj} expert {e}")
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 7)), jnp.int32)
    assert_close(model.apply({"params": params}, ids), plain.apply({"params": dq}, ids), jnp.float32)


def test_fp8_experts_that_split_a_scale_tile_are_refused(tmp_path):
    qdir = write_prequantized(_hf_moe(tmp_path / "bf16", 96), tmp_path / "fp8", fp8_parts, FP8_CONFIG)
    with pytest.raises(ModelLoadError, match="experts of 96 rows are not whole 128-row scale tiles"):
        load_pretrained(qdir, dtype=jnp.float32)


def test_nf4_experts_keep_their_absmax_in_fp32_and_dequantize_as_stored(tmp_path, assert_close):
    """bitsandbytes NF4 with double quantization: every expert has its own second-level offset, so the stacked
    experts keep the fp32 absmax that each expert's parts dequantize to; the weights equal the per-expert
    dequantization bit for bit, and the rest of the model keeps double quantization."""
    from surogate_jax.qlora import nf4  # noqa: PLC0415

    src = _hf_moe(tmp_path / "bf16", 128)
    qdir = write_prequantized(src, tmp_path / "nf4", lambda w: nf4.quantize_nf4(w, block_size=64, double_quant=True),
                              {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})
    model, params = load_pretrained(qdir, dtype=jnp.float32)
    assert model.config.qlora == QloraSpec("nf4", 64, True, expert_double_quant=False)
    assert "(off for the experts)" in model.config.qlora.describe()
    up = params["layers"]["mlp"]["experts"]["up_proj"]
    assert set(up) == {"nf4_codes", "nf4_absmax"} and up["nf4_absmax"].dtype == jnp.float32
    assert "nf4_offset" in params["layers"]["self_attn"]["q_proj"]
    plain, dq = dequantize_base(model, params, jnp.float32)
    reader = CheckpointReader(qdir)
    for e in (0, 3):
        name = names.hf_name(("layers", "mlp", "experts", "down_proj"), 1, e)
        module = name.removesuffix(".weight")
        got = {p: reader.get(f"{module}.{p}") for p in ("weight", "weight.absmax", "weight.quant_map",
                                                          "weight.nested_absmax", "weight.nested_quant_map",
                                                          "weight.quant_state.bitsandbytes__nf4")}
        parts, _, _ = nf4.from_hf(got, (128, 128))
        want = nf4.dequantize({k: jnp.asarray(v) for k, v in parts.items()}, (128, 128), block_size=64,
                              dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(dq["layers"]["mlp"]["experts"]["down_proj"][1, e]),
                                      np.asarray(want).T, err_msg=f"expert {e}")
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 7)), jnp.int32)
    assert_close(model.apply({"params": params}, ids), plain.apply({"params": dq}, ids), jnp.float32)
