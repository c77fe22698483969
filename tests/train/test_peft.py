"""Our LoRA adapters exported in PEFT format: HF PEFT loads them and reproduces our logits; the
merged model equals the LoRA forward."""

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
from surogate_jax.models import Decoder, LoraSpec  # noqa: E402

peft = pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("case", ["qwen3_qknorm_head_dim", "qwen2_bias_tied", "llama3_tied"])
def test_peft_adapter_reproduces_our_logits(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path / "base")
    base, params = surogate_jax.load_pretrained(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0,
                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    model = Decoder(base.config.replace(lora=spec))
    adapters = L.init_adapters(model, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    # Make B non-zero so the adapters change the output.
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.3 * jax.random.normal(jax.random.key(len(str(p))), x.shape) if p[-1].key == "lora_b" else x,
        adapters)
    ids = np.random.default_rng(0).integers(0, 101, (2, 9)).astype(np.int32)
    ours = model.apply({"params": params, "lora": adapters}, jnp.asarray(ids))
    assert rel_err(ours, base.apply({"params": params}, jnp.asarray(ids))) > 1e-2  # adapters matter

    out = L.save_peft(tmp_path / "adapter", model, adapters, base_model=str(tmp_path / "base"))
    peft_model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    assert rel_err(hf_logits(peft_model, ids), ours) < 1e-4

    back = L.load_peft(out, model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    merged = L.merge(params, adapters, spec)
    assert rel_err(base.apply({"params": merged}, jnp.asarray(ids)), ours) < 1e-4
