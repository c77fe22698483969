"""Config load-time checks: duplicate YAML keys, ~ / $VAR expansion of path keys, and values that would
otherwise fail only after data loading or after training (exact-match file and samples, seeds, formats)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from surogate_jax.config import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).parents[1]
BASE = {"model": "some/model", "datasets": [{"path": "data.jsonl"}]}
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- duplicate keys ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, key, lines", [
    ("model: m\nlearning_rate: 1e-4\ndatasets: [d.jsonl]\n\nlearning_rate: 2e-4\n", "learning_rate", (2, 5)),
    ("model: m\ndatasets:\n  - path: a.jsonl\n    type: text\n    split: train\n    type: auto\n", "type", (4, 6)),
    ("model: m\ndatasets: [d.jsonl]\ndistributed:\n  num_nodes: 2\n  num_nodes: 3\n", "num_nodes", (4, 5)),
], ids=["top-level", "dataset-entry", "distributed"])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, key, lines):
    p = write(tmp_path / "config.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}: key {key!r} is given twice (lines {lines[0]} and {lines[1]})")


def test_overrides_replace_file_keys_and_each_other(tmp_path):
    p = write(tmp_path / "c.yaml", "model: m\ndatasets: [d.jsonl]\nlearning_rate: 1e-4\nmodel_dtype: bf16\n")
    c = load_config(p, ["learning_rate=3e-4", "learning_rate=5e-4", "torch_dtype=fp32"])
    assert c.optim.learning_rate == 5e-4 and c.precision.model_dtype == "fp32"


def test_a_key_and_its_alias_together_are_refused():
    with pytest.raises(ConfigError, match="torch_dtype and model_dtype: the same key under two names"):
        config_from_dict({**BASE, "torch_dtype": "fp32", "model_dtype": "bf16"})


# --- path expansion ---------------------------------------------------------------------------------------------

# key -> (raw config with the path, the path as the config holds it)
PATHS = {
    "output_dir": (lambda v: {"output_dir": v}, lambda c: c.run.output_dir),
    "checkpoint_dir": (lambda v: {"checkpoint_dir": v}, lambda c: c.run.checkpoint_dir),
    "exact_match_file": (lambda v: {"exact_match_file": v}, lambda c: c.run.exact_match_file),
    "model": (lambda v: {"model": v}, lambda c: c.model.model),
    "datasets[0].path": (lambda v: {"datasets": [{"path": v}]}, lambda c: c.data.datasets[0].path),
    "datasets[0].path (short form)": (lambda v: {"datasets": [v]}, lambda c: c.data.datasets[0].path),
    "validation_datasets[0].path": (lambda v: {"validation_datasets": [{"path": v}]},
                                    lambda c: c.data.validation_datasets[0].path),
    "distributed.worker_output_dir": (lambda v: {"distributed": {"worker_output_dir": v}},
                                      lambda c: c.parallel.distributed.worker_output_dir),
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME and DATA point into tmp_path, each holding em.jsonl (exact_match_file must exist)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DATA", str(tmp_path / "data"))
    monkeypatch.delenv("SUROGATE_UNSET_VAR", raising=False)
    for d in ("home", "data"):
        (tmp_path / d).mkdir()
        write(tmp_path / d / "em.jsonl", json.dumps(CHAT) + "\n")
    return tmp_path


@pytest.mark.parametrize("key", PATHS)
@pytest.mark.parametrize("value, expected", [
    ("~/em.jsonl", "home/em.jsonl"), ("$HOME/em.jsonl", "home/em.jsonl"), ("${DATA}/em.jsonl", "data/em.jsonl"),
])
def test_path_keys_expand_home_and_variables(home, key, value, expected):
    raw, get = PATHS[key]
    assert get(config_from_dict({**BASE, **raw(value)})) == str(home / expected)


@pytest.mark.parametrize("key", PATHS)
def test_unset_variable_names_the_key_and_the_variable(home, key):
    raw, _ = PATHS[key]
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **raw("$SUROGATE_UNSET_VAR/em.jsonl")})
    assert str(e.value).startswith(key.split(" ")[0]) and "$SUROGATE_UNSET_VAR is not set" in str(e.value)


@pytest.mark.parametrize("key", PATHS)
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_path_is_refused(key, value):
    raw, _ = PATHS[key]
    with pytest.raises(ConfigError, match="^" + re.escape(f"{key.split(' ')[0]}: must not be empty")):
        config_from_dict({**BASE, **raw(value)})


def test_empty_output_dir_override_is_refused(tmp_path):
    p = write(tmp_path / "c.yaml", "model: m\ndatasets: [d.jsonl]\n")
    with pytest.raises(ConfigError, match="^output_dir: must not be empty"):
        load_config(p, ["output_dir="])


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "builtin:tiny-qwen3", "gpt2", "org/name~v2"])
def test_hub_ids_and_builtins_are_untouched(home, model):
    c = config_from_dict({**BASE, "model": model, "datasets": ["HuggingFaceH4/no_robots"]})
    assert c.model.model == model and c.data.datasets[0].path == "HuggingFaceH4/no_robots"


def test_relative_paths_stay_relative(home):
    c = config_from_dict({**BASE, "model": "./models/m", "output_dir": "output/run", "datasets": ["data/a.jsonl"]})
    assert (c.model.model, c.run.output_dir, c.data.datasets[0].path) == ("./models/m", "output/run", "data/a.jsonl")


# --- late checks moved to load ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3])
def test_exact_match_samples_must_be_positive(n):
    with pytest.raises(ConfigError, match=rf"exact_match_samples={n}: must be >= 1"):
        config_from_dict({**BASE, "exact_match_samples": n})


def test_missing_exact_match_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=f"exact_match_file={missing}: file not found"):
        config_from_dict({**BASE, "exact_match_file": str(missing)})


@pytest.mark.parametrize("lines, message", [
    ([], "has no rows"),
    ([CHAT, "{not json"], "line 2 is not valid JSON"),
    ([CHAT, {"messages": [{"role": "user", "content": "q"}]}], "line 2: expected"),
    ([CHAT, {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "a"}]}], "line 2: expected"),
    ([{"text": "x"}], "line 1: expected"),
])
def test_exact_match_file_rows_are_checked_at_load(tmp_path, lines, message):
    f = write(tmp_path / "em.jsonl", "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**BASE, "exact_match_file": str(f)})


def test_exact_match_rows_past_the_samples_need_only_be_json(tmp_path):
    f = write(tmp_path / "em.jsonl", json.dumps(CHAT) + "\n\n" + json.dumps({"other": 1}) + "\n")
    assert config_from_dict({**BASE, "exact_match_file": str(f), "exact_match_samples": 1}).run.exact_match_file
    with pytest.raises(ConfigError, match="line 3: expected"):
        config_from_dict({**BASE, "exact_match_file": str(f), "exact_match_samples": 2})


@pytest.mark.parametrize("raw, message", [
    ({"train_seed": -1}, "train_seed=-1: must be in [0"),
    ({"eval_seed": 2**63}, "eval_seed=9223372036854775808: must be in [0"),
    ({"dataloader_num_workers": -1}, "dataloader_num_workers=-1: must be >= 0"),
    ({"datasets": [{"path": "a", "type": "instruction", "system_prompt_type": "field"}]},
     "datasets[0].system_prompt_type=field needs system_prompt_field"),
    ({"datasets": [{"path": "a", "system_prompt_type": "fixed"}]}, "datasets[0].system_prompt_type=fixed needs"),
    ({"validation_datasets": [{"path": "a", "type": "instruction", "prompt_format": "{question}"}]},
     "validation_datasets[0].prompt_format='{question}' is not a valid format string"),
    ({"datasets": [{"path": "a", "type": "conversation", "message_property_mappings": {"speaker": "from"}}]},
     "datasets[0].message_property_mappings: unknown keys ['speaker']"),
    ({"datasets": [{"path": "a", "message_property_mappings": {"role": 1}}]}, "must be field names"),
])
def test_values_that_failed_after_loading_data_fail_at_load(raw, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **raw})
    assert message in str(e.value)


def test_format_keys_of_other_types_are_not_checked():
    d = {"path": "a", "type": "text", "system_prompt_type": "field", "message_property_mappings": {"x": "y"}}
    assert config_from_dict({**BASE, "datasets": [d]}).data.datasets[0].type == "text"


# --- the command line -------------------------------------------------------------------------------------------


def test_cli_duplicate_key_is_one_error_line_and_exit_2(tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path / "cfg.yaml", f"model: builtin:tiny-qwen3\noutput_dir: {out}\ndatasets: [d.jsonl]\n"
                                       "max_steps: 1\nmax_steps: 2\n")
    r = subprocess.run([sys.executable, "-m", "surogate_jax.sft", str(cfg)], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and "(lines 4 and 5)" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not out.exists()
