"""A Qwen3-MoE checkpoint through `python -m surogate_jax.sft`: full fine-tuning trains (the loss falls) and exports
a directory transformers loads; LoRA (the default) is refused with one error line before output_dir is touched."""

from __future__ import annotations

import json
import shutil

import pytest
from sft_cli import cli_env, losses, sft, write_config

from surogate_jax import builtin_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, env):
    """A random Qwen3-MoE (5 experts, top 2) with builtin:tiny-qwen3's tokenizer."""
    d = tmp_path_factory.mktemp("tiny_moe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SUROGATE_JAX_CACHE", env["SUROGATE_JAX_CACHE"])
        tiny = builtin_models.resolve("builtin:tiny-qwen3")
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    cfg = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, d / f.name)
    return d


def test_moe_full_fine_tuning_trains_and_exports(tmp_path, env, moe_dir):
    cfg = write_config(tmp_path, model=str(moe_dir), lora=False, max_steps=8, save_steps=8, eval_steps=0,
                       learning_rate=3e-3)
    r = sft(cfg, env)
    assert "model: qwen3_moe" in r.stderr and "(full)" in r.stderr
    loss = losses(tmp_path / "out")
    assert max(loss) == 8 and loss[8] < loss[1]
    exported = tmp_path / "out" / "model"
    assert json.loads((exported / "config.json").read_text())["model_type"] == "qwen3_moe"
    transformers.AutoModelForCausalLM.from_pretrained(exported)


def test_moe_with_lora_is_refused_before_any_work(tmp_path, env, moe_dir):
    cfg = write_config(tmp_path, model=str(moe_dir))
    r = sft(cfg, env, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "mixture-of-experts model (qwen3_moe, 5 experts): it trains only as full fine-tuning" in r.stderr
    assert not (tmp_path / "out").exists()
