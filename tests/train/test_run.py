"""End to end through `python -m surogate_jax.sft` on the builtin tiny model: outputs, exact
resume, a SIGKILL during checkpointing, and one-line errors for user mistakes."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from sft_cli import cli_env, losses, sft, write_config


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("cache"))


def test_lora_run_outputs_and_exact_resume(tmp_path, env):
    cfg = write_config(tmp_path, merge_adapter=True)
    r = sft(cfg, env)
    assert re.search(r"attention: packed, at most \d+ segments a row", r.stderr)  # the packed path's bound is set
    out = tmp_path / "out"
    for f in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "merged/config.json",
              "metrics.jsonl", "training_plot.png", "summary.json", "checkpoints/6", "checkpoints/3"):
        assert (out / f).exists(), f
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(rows[0])
    assert any(r.get("eval_loss") is not None for r in rows)
    first = losses(out)
    assert sorted(first) == list(range(1, 7))
    adapter_config = json.loads((out / "adapter/adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "builtin:tiny-qwen3"

    # Resume from step 3: drop the later checkpoint and the exports, run again to step 6.
    shutil.rmtree(out / "checkpoints" / "6")
    for d in ("adapter", "merged"):
        shutil.rmtree(out / d)
    (out / "metrics.jsonl").write_text("")
    sft(cfg, env)
    again = losses(out)
    assert sorted(again) == [4, 5, 6]
    for s in (4, 5, 6):
        assert again[s] == first[s], (s, again[s], first[s])  # bit-exact continuation


def test_sigkill_during_checkpointing_resumes(tmp_path, env):
    cfg = write_config(tmp_path, max_steps=30, save_steps=1, eval_steps=0, save_total_limit=2)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "surogate_jax.sft", str(cfg)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not any((out / "checkpoints").glob("[3-9]")):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)  # saves every step: this lands in or next to a save
    p.wait()
    assert p.returncode == -signal.SIGKILL
    r = sft(cfg, env)
    assert "resumed from" in r.stderr
    final = losses(out)
    assert max(final) == 30 and (out / "adapter/adapter_model.safetensors").is_file()


def test_recompute_auto_says_what_it_picked(tmp_path, env):
    cfg = write_config(tmp_path, recompute="auto", max_steps=2, save_steps=2, eval_steps=0)
    r = sft(cfg, env)
    assert "recompute auto: loop full" in r.stderr and "no device memory limit known" in r.stderr  # CPU: no limit
    assert "remat full, layers in a loop" in r.stderr
    assert max(losses(tmp_path / "out")) == 2


def test_unroll_layers_with_an_explicit_recompute(tmp_path, env):
    cfg = write_config(tmp_path, recompute="dots", unroll_layers=True, max_steps=2, save_steps=2, eval_steps=0)
    r = sft(cfg, env)
    assert "remat dots, layers unrolled" in r.stderr and "recompute auto" not in r.stderr
    assert max(losses(tmp_path / "out")) == 2


def test_rows_of_many_tiny_documents_take_the_dense_mask(tmp_path, env):
    text = tmp_path / "tiny_docs.txt"
    text.write_text("a\n" * 3000)  # a few tokens each: a 256-token row holds far more than the packed path's bound
    cfg = write_config(tmp_path, datasets=[{"path": str(text), "type": "text"}], sequence_len=256, max_steps=2,
                       save_steps=2, eval_steps=0, validation_split_ratio=0.0)
    r = sft(cfg, env)
    assert re.search(r"attention: dense same-document mask \(rows hold up to \d+ segments, over the packed path's 64\)",
                     r.stderr), r.stderr[-2000:]
    assert max(losses(tmp_path / "out")) == 2


def test_full_finetune_writes_a_model(tmp_path, env):
    cfg = write_config(tmp_path, lora=False, max_steps=2, save_steps=2, eval_steps=0, learning_rate=1e-3)
    sft(cfg, env)
    assert (tmp_path / "out/model/config.json").is_file() and (tmp_path / "out/model/tokenizer.json").is_file()


@pytest.mark.parametrize("over, message", [
    ({"learnin_rate": 1e-3}, "did you mean 'learning_rate'"),
    ({"datasets": [{"path": "/does/not/exist.jsonl"}]}, "exist"),
    ({"sequence_len": 1}, "sequence_len=1"),
    ({"output_dir": "/proc/forbidden/out"}, "cannot be written"),
    pytest.param({"report_to": ["wandb"]}, "report_to: wandb needs", marks=pytest.mark.skipif(
        importlib.util.find_spec("wandb") is not None,
        reason="wandb is installed, so its missing-backend error cannot occur")),
])
def test_user_mistakes_are_one_error_line(tmp_path, env, over, message):
    r = sft(write_config(tmp_path, **over), env, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_malformed_yaml(tmp_path, env):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [oops\n")
    r = sft(p, env, check=False)
    assert r.returncode == 2 and r.stderr.strip().startswith("error:") and "malformed YAML" in r.stderr


def test_resume_with_a_different_model_is_refused(tmp_path, env):
    cfg = write_config(tmp_path, max_steps=1, save_steps=1, eval_steps=0)
    sft(cfg, env)
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    r = sft(write_config(tmp_path, max_steps=2, save_steps=1, eval_steps=0, lora_rank=4), env, check=False)
    assert r.returncode == 2 and "belongs to a different run" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == before  # nothing lost or added


def test_pretrain_from_scratch_on_raw_text(tmp_path, env):
    text = tmp_path / "corpus.txt"
    rng = __import__("random").Random(0)
    text.write_text("\n".join(" ".join(rng.choice(["abc", "de", "fgh", "ij"]) for _ in range(20)) for _ in range(300)))
    cfg = write_config(tmp_path, datasets=[{"path": str(text), "type": "text"}], max_steps=8, save_steps=8,
                       eval_steps=0, validation_split_ratio=0.0, learning_rate=3e-3)
    r = subprocess.run([sys.executable, "-m", "surogate_jax.pretrain", str(cfg)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "model/config.json").is_file() and not (out / "adapter").exists()
    saved = json.loads((out / "config.json").read_text())
    assert saved["from_scratch"] is True and saved["lora"] is False and saved["loss_scale"] == "all"
    ls = losses(out)
    assert ls[8] < ls[1]  # learns the tiny language
