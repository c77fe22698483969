"""A QLoRA adapter is a plain PEFT LoRA adapter: HF PEFT loads it over the bf16 base it was trained from, and over the
dequantized base it reproduces our QLoRA logits."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from hf_tiny import build_hf, hf_logits, rel_err  # noqa: E402

import surogate_jax  # noqa: E402
from surogate_jax import lora as L  # noqa: E402
from surogate_jax.hf import dequantize_base  # noqa: E402
from surogate_jax.models import Decoder, LoraSpec  # noqa: E402
from surogate_jax.qlora.base import QloraSpec  # noqa: E402

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("spec", "case"), [(QloraSpec("nf4", 64, True), "qwen3_qknorm_head_dim"),
                                            (QloraSpec("fp8", 64), "qwen2_bias_tied")],  # q/k/v biases kept
                         ids=["nf4-qwen3", "fp8-qwen2"])
def test_qlora_adapter_loads_in_peft(spec, case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path / "base")
    base_q, params_q = surogate_jax.load_pretrained(tmp_path / "base", qlora=spec)
    if base_q.config.qkv_bias:  # biases stay plain beside a quantized base
        got = np.asarray(params_q["layers"]["self_attn"]["q_proj"]["bias"][0])
        np.testing.assert_array_equal(got, hf.model.layers[0].self_attn.q_proj.bias.detach().numpy().reshape(got.shape))
    lora = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"))
    model = Decoder(base_q.config.replace(lora=lora))
    adapters = L.init_adapters(model, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    adapters = jax.tree_util.tree_map_with_path(  # non-zero B: the adapters change the output
        lambda p, x: 0.3 * jax.random.normal(jax.random.key(len(str(p))), x.shape) if p[-1].key == "lora_b" else x,
        adapters)
    ids = np.random.default_rng(0).integers(0, 101, (2, 9)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        ours = model.apply({"params": params_q, "lora": adapters}, jnp.asarray(ids))
    out = L.save_peft(tmp_path / "adapter", model, adapters, base_model=str(tmp_path / "base"))

    # Over the dequantized base, PEFT gives our QLoRA logits.
    plain, plain_params = dequantize_base(base_q, params_q)
    surogate_jax.save_pretrained(tmp_path / "dequantized", plain, plain_params)
    hf_dq = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype="float32")
    assert rel_err(hf_logits(peft.PeftModel.from_pretrained(hf_dq, str(out)).eval(), ids), ours) < 1e-4
    # Over the original base (what a user serves) it loads and the adapter acts (the rest is the base's quantization
    # error, large on this random tiny model).
    over_bf16 = hf_logits(peft.PeftModel.from_pretrained(build_hf(case), str(out)).eval(), ids)
    assert np.isfinite(over_bf16).all() and rel_err(over_bf16, hf_logits(build_hf(case), ids)) > 1e-2
