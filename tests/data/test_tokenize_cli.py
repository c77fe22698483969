"""`python -m surogate_jax.tokenize` end to end in a subprocess (stats, --debug, cache, errors)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
from tiny_tokenizers import save_tokenizer, write_jsonl

from surogate_jax import tokenize


def run_cli(tmp_path, *args):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1",
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "surogate_jax.tokenize", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def config(tmp_path):
    save_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "qa.jsonl", [{"question": f"what is {i}?", "answer": f"it is {i}"} for i in range(10)])
    (tmp_path / "cfg.yaml").write_text("model: tok\nsequence_len: 64\noutput_dir: out\ndatasets:\n  - path: qa.jsonl\n")
    return tmp_path / "cfg.yaml"


def test_tokenize_prints_stats_and_debug_tokens(tmp_path, config):
    r = run_cli(tmp_path, "cfg.yaml", "validation_split_ratio=0.2", "--debug", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"train: 10 rows -> 8 documents, \d+ tokens \(\d+ supervised, [\d.]+%\)", lines[0])
    assert re.fullmatch(r"validation: 2 documents split from train, \d+ tokens \(\d+ supervised, [\d.]+%\)", lines[1])
    assert re.fullmatch(r"--- document 0: \d+ tokens, \d+ supervised \(\+\)", lines[2])
    tokens = [line.split(maxsplit=3) for line in lines[3:]]
    assert [int(t[0]) for t in tokens] == list(range(len(tokens)))
    text = {m: "".join(ast.literal_eval(t[3]) for t in tokens if t[2] == m) for m in "+."}
    assert text["+"] == "it is 0<|im_end|>\n"
    assert text["."] == "<|im_start|>user\nwhat is 0?<|im_end|>\n<|im_start|>assistant\n"
    assert len(list((tmp_path / "out" / "tokenized").glob("*.npz"))) == 1
    again = run_cli(tmp_path, "cfg.yaml", "validation_split_ratio=0")
    assert again.returncode == 0, again.stderr
    assert "[from cache out/tokenized/" in again.stdout and "validation: none" in again.stdout


def test_missing_dataset_file_is_one_error_line(tmp_path, config):
    r = run_cli(tmp_path, "cfg.yaml", "datasets=[missing.jsonl]")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: missing.jsonl: no such file or directory"]
    assert r.stderr.strip().splitlines()[-1] == errors[0]


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        tokenize.main(["--help"])
    assert e.value.code == 0 and "--debug N" in capsys.readouterr().out
