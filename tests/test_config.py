"""The YAML config: Surogate keys and defaults, strictness, overrides, every example parses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from surogate_jax.config import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).parents[1]
BASE = {"model": "some/model", "datasets": [{"path": "data.jsonl"}]}


@pytest.mark.parametrize("path", sorted(ROOT.glob("examples/**/*.yaml")), ids=lambda p: p.name)
def test_every_example_parses(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # example paths are relative to the repo root, and exact_match_file is checked at load
    cfg = load_config(path)
    assert cfg.model.model and cfg.data.datasets


def test_surogate_defaults():
    c = config_from_dict(BASE)
    assert (c.run.per_device_train_batch_size, c.run.gradient_accumulation_steps, c.model.sequence_len) == (2, 4, 1024)
    assert (c.lora.lora, c.lora.lora_rank, c.lora.lora_alpha, c.lora.targets[0]) == (True, 16, 32.0, "q_proj")
    assert (c.optim.learning_rate, c.optim.lr_scheduler_type, c.optim.max_grad_norm) == (2e-4, "linear", 1.0)
    assert c.optim.optimizer == "adamw_8bit"  # Surogate's default optimizer
    assert (c.run.save_steps, c.run.save_total_limit, c.run.resume_from_checkpoint) == (50, 5, True)
    assert c.data.sample_packing and c.data.validation_split_ratio == 0.1 and c.precision.lora_dtype == "fp32"


def test_validation_datasets_turn_the_split_off():
    c = config_from_dict({**BASE, "validation_datasets": ["val.jsonl"]})
    assert c.data.validation_split_ratio == 0.0 and c.data.validation_datasets[0].path == "val.jsonl"


@pytest.mark.parametrize("raw, message", [
    ({"learnin_rate": 1e-3}, "did you mean 'learning_rate'"),
    ({"lora_rnak": 8}, "did you mean 'lora_rank'"),
    ({"zero_level": 4}, "zero_level=4: use 1, 2 or 3"),
    ({"offload_grads": True}, "offload_grads: true needs sharded gradients"),
    ({"distributed": {"num_node": 2}}, "distributed.num_node: unknown key (did you mean 'num_nodes'?)"),
    ({"distributed": {"num_nodes": "two"}}, "distributed.num_nodes: expected int"),
    ({"recompute": "some"}, "recompute='some': use true, false or one of"),
    ({"unroll_layers": "some"}, "unroll_layers='some': use true, false or auto"),
    ({"cpu_training": True}, "cpu_training: not supported yet"),
    ({"qlora_fp8": True, "qlora_fp4": True}, "qlora_fp8 and qlora_fp4: pick one QLoRA base format"),
    ({"use_fused_rope": True}, "use_fused_rope: not supported yet"),
    ({"recipe": "fp4"}, "recipe='fp4': use bf16, fp8-hybrid (alias fp8_hybrid) or nvfp4"),
    ({"optimizer": "sgd"}, "use one of adamw, adamw_8bit, normuon"),
    ({"adamw_beta2": 1.0}, "adamw_beta2=1.0: must be in [0, 1)"),
    ({"sequence_len": 1}, "sequence_len=1: must be >= 2"),
    ({"sequence_len": "long"}, "sequence_len: expected int"),
    ({"lora": "yes"}, "lora: expected bool"),
    ({"lora_target_modules": ["q_proj", "qq_proj"]}, "lora_target_modules: unknown ['qq_proj']"),
    ({"datasets": []}, "at least one dataset"),
    ({"datasets": [{"path": "a", "tpye": "text"}]}, "did you mean 'type'"),
    ({"datasets": [{"type": "text"}]}, "'path' is required"),
    ({"lr_scheduler_type": "cosine_with_restarts"}, "use constant, linear, cosine or wsd"),
    ({"loss_scale": "thinking_only"}, "not supported yet"),
])
def test_bad_configs_name_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **raw})
    assert message in str(e.value)


def test_normuon_keys():
    c = config_from_dict({**BASE, "optimizer": "normuon"})
    assert (c.optim.optimizer, c.optim.normuon_momentum, c.optim.normuon_beta2, c.optim.normuon_cautious_wd) == (
        "normuon", 0.95, 0.95, True)
    c = config_from_dict({**BASE, "optimizer": "normuon", "normuon_momentum": 0.9, "normuon_beta2": "5e-1",
                          "normuon_cautious_wd": False})
    assert (c.optim.normuon_momentum, c.optim.normuon_beta2, c.optim.normuon_cautious_wd) == (0.9, 0.5, False)
    for raw, message in (({"normuon_beta2": 1.0}, "normuon_beta2=1.0: must be in [0, 1)"),
                         ({"normuon_cautious_wd": "yes"}, "normuon_cautious_wd: expected bool"),
                         ({"optimizer": "muon"}, "optimizer='muon': use one of")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_dict({**BASE, **raw})


def test_parallel_keys():
    c = config_from_dict({**BASE, "zero_level": 3, "offload_optimizer": True, "offload_grads": True, "gpus": 0,
                          "recompute": "dots", "distributed": {"num_nodes": 2, "gpus_per_node": 8}})
    p = c.parallel
    assert (p.zero_level, p.offload_optimizer, p.offload_grads, p.gpus, c.run.recompute) == (3, True, True, 0, "dots")
    assert (p.distributed.num_nodes, p.distributed.gpus_per_node, p.distributed.ray_address) == (2, 8, "auto")
    flat = c.to_flat()
    assert flat["zero_level"] == 3 and flat["distributed"]["num_nodes"] == 2
    assert config_from_dict({**BASE, **{k: v for k, v in flat.items() if v is not None}}).parallel == p
    d = config_from_dict(BASE).parallel  # Surogate's defaults
    assert (d.zero_level, d.gpus, d.distributed, d.offload_optimizer) == (1, 1, None, False)


def test_not_yet_keys_at_default_are_accepted():
    assert config_from_dict({**BASE, "zero_level": 0, "use_cuda_graphs": True}).run


def test_overrides_and_file_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: m\ndatasets:\n  - path: d.jsonl\nlearning_rate: 1e-4\n")
    c = load_config(p, ["learning_rate=3e-4", "lora=false", "lora_target_modules=[q_proj, v_proj]"])
    assert c.optim.learning_rate == 3e-4 and not c.lora.lora and c.lora.targets == ("q_proj", "v_proj")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(p, ["learning_rate"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_to_flat_roundtrips():
    c = config_from_dict({**BASE, "lora_rank": 8, "datasets": [{"path": "x.jsonl", "type": "text"}]})
    again = config_from_dict({k: v for k, v in c.to_flat().items()})
    assert again == c
