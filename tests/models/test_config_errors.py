"""A config.json the decoder cannot be built from (missing, non-integer or non-positive sizes, heads that
do not divide, odd head_dim, malformed rope fields) raises ModelLoadError naming the field and value,
in config_from_hf, in read_hf_config / load_pretrained (with the file's path), and as one `error:`
line from the training CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import surogate_jax
from surogate_jax import ModelLoadError, UnsupportedConfigError
from surogate_jax.hf import read_hf_config
from surogate_jax.models import config_from_hf

ROOT = Path(__file__).parents[2]
GOOD = dict(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)


def without(*keys, **changes) -> dict:
    return {**{k: v for k, v in GOOD.items() if k not in keys}, **changes}


def test_good_config_loads():
    cfg = config_from_hf(GOOD)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    cfg = config_from_hf(without("head_dim", "num_key_value_heads"))  # defaults: kv = heads, hidden / heads
    assert (cfg.num_kv_heads, cfg.head_dim) == (4, 16)


@pytest.mark.parametrize("d, match", [
    (without(num_attention_heads=6, num_key_value_heads=4), "num_attention_heads=6 is not a multiple of "
                                                            "num_key_value_heads=4"),
    (without("head_dim", hidden_size=66), "hidden_size=66 is not divisible by num_attention_heads=4"),
    (without(hidden_size=0), "hidden_size=0 must be a positive integer"),
    (without(num_hidden_layers=-2), "num_hidden_layers=-2 must be a positive integer"),
    (without(num_key_value_heads=0), "num_key_value_heads=0 must be a positive integer"),
    (without(head_dim=-16), "head_dim=-16 must be a positive integer"),
    (without("vocab_size"), "'vocab_size' is missing"),
    (without("num_attention_heads"), "'num_attention_heads' is missing"),
    (without(intermediate_size=None), "'intermediate_size' is missing"),
    (without(hidden_size="64"), "hidden_size='64' must be a positive integer"),
    (without(num_attention_heads=4.0), "num_attention_heads=4.0 must be a positive integer"),
    (without(num_hidden_layers=True), "num_hidden_layers=True must be a positive integer"),
    (without(rms_norm_eps="1e-6"), "rms_norm_eps='1e-6' must be a number"),
    (without(rms_norm_eps=0), "rms_norm_eps=0 must be positive"),
    (without(rope_theta="big"), "rope_theta='big' must be a number"),
    (without(rope_scaling=[1, 2]), r"rope_scaling=\[1, 2\] must be an object"),
    (without(model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0)), "missing"),
])
def test_broken_config_names_the_field(d, match):
    with pytest.raises(ModelLoadError, match=match) as e:
        config_from_hf(d)
    assert "config.json" in str(e.value)


def test_odd_head_dim_is_unsupported():
    with pytest.raises(UnsupportedConfigError, match="head_dim=15 is odd"):
        config_from_hf(without(head_dim=15))
    with pytest.raises(UnsupportedConfigError, match="hidden_size / num_attention_heads=15 is odd"):
        config_from_hf(without("head_dim", hidden_size=60))


def test_read_hf_config_and_load_pretrained_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(without(num_attention_heads=6, num_key_value_heads=4)))
    for load in (read_hf_config, surogate_jax.load_pretrained):
        with pytest.raises(ModelLoadError, match="num_attention_heads=6") as e:
            load(tmp_path)
        assert str(tmp_path / "config.json") in str(e.value)


def test_sft_cli_one_error_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(without(num_attention_heads=6, num_key_value_heads=4)))
    out = tmp_path / "out"
    cfg = {"model": str(model), "output_dir": str(out), "model_dtype": "fp32", "max_steps": 1,
           "datasets": [{"path": str(ROOT / "examples" / "data" / "quickstart_train.jsonl"), "type": "conversation",
                         "samples": 16}],
           "sequence_len": 64, "per_device_train_batch_size": 1, "lora_rank": 4, "lora_alpha": 8}
    (tmp_path / "cfg.yaml").write_text(json.dumps(cfg))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SUROGATE_JAX_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "surogate_jax.sft", str(tmp_path / "cfg.yaml")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "num_attention_heads=6" in errors[0] and str(model / "config.json") in errors[0], errors[0]
    assert not (out / "config.json").exists()  # refused before the run wrote anything
