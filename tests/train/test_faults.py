"""What a user sees when things go wrong, through `python -m surogate_jax.sft` on the builtin tiny
model: one `error:` line and exit code 2 with output_dir untouched for mistakes; a stop signal
that saves and resumes exactly; a non-finite step that is never saved; a damaged checkpoint that
is set aside; one run per output_dir; metrics.jsonl cut back on resume."""

from __future__ import annotations

import fcntl
import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sft_cli
from sft_cli import DATA, TINY_RUN, cli_env, losses, sft


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("cache"))


# Smaller than test_run's: no eval, no validation split, one micro-batch a step.
FAST = {**TINY_RUN, "validation_split_ratio": 0.0, "gradient_accumulation_steps": 1, "save_steps": 2, "eval_steps": 0,
        "datasets": [{"path": str(DATA / "quickstart_train.jsonl"), "type": "conversation", "samples": 200}]}


def write_config(tmp: Path, **over) -> Path:
    return sft_cli.write_config(tmp, FAST, **over)


def snapshot(d: Path) -> dict[str, str]:
    """Every file under `d` (relative path -> sha256); directories included as '<dir>'."""
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
            for p in sorted(d.rglob("*"))}


def assert_one_error(r, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def ckpt_steps(out: Path) -> list[int]:
    d = out / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


# --- mistakes refused before anything is written ------------------------------------------------


def test_a_users_own_config_json_is_never_replaced(tmp_path, env):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}\n')
    (out / "notes.txt").write_text("keep me\n")
    before = snapshot(out)
    assert_one_error(sft(write_config(tmp_path), env, check=False), "config.json", "not written by a surogate_jax run")
    assert snapshot(out) == before


def test_unusable_data_leaves_no_output_dir(tmp_path, env):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) for _ in range(5)))
    r = sft(write_config(tmp_path, datasets=[{"path": str(bad), "type": "conversation"}]), env, check=False)
    assert_one_error(r, "no usable rows")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("over, needles", [
    ({"checkpoint_dir": "{file}/ckpt"}, ("checkpoint_dir=", "is not a directory")),
    ({"per_device_train_batch_size": 10**9}, ("host memory", "per_device_train_batch_size=1000000000")),
    ({"exact_match_file": "{long_rows}"}, ("exact_match_file=", "exceeds the model's max_position_embeddings=512")),
])
def test_bad_paths_and_sizes_are_refused_before_any_work(tmp_path, env, over, needles):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    long_rows = tmp_path / "held_out.jsonl"  # a prompt the tiny model (512 positions) cannot take
    long_rows.write_text(json.dumps({"messages": [{"role": "user", "content": "word " * 2000},
                                                  {"role": "assistant", "content": "ok"}]}) + "\n")
    over = {k: v.format(file=blocker, long_rows=long_rows) if isinstance(v, str) else v for k, v in over.items()}
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    before = snapshot(out)
    assert_one_error(sft(write_config(tmp_path, **over), env, check=False), *needles)
    assert snapshot(out) == before


def test_a_second_run_on_a_busy_output_dir_is_refused(tmp_path, env):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".surogate_jax.lock", "w") as f:  # what a running training holds
        f.write("pid 4242 on node7\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(out)
        assert_one_error(sft(write_config(tmp_path), env, check=False), "in use by a running training",
                         "pid 4242 on node7")
        assert snapshot(out) == before


# --- runs that stop on the way ------------------------------------------------------------------


def test_sigterm_saves_at_the_step_boundary_and_resumes_exactly(tmp_path, env):
    """An uninterrupted run vs one stopped by SIGTERM mid-run and resumed: the same losses. The
    resumed run also gets a partial last metrics line (a kill mid-write) and repairs it."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    run_dir.mkdir()
    sft(write_config(ref_dir, max_steps=12, save_steps=100), env)
    reference = losses(ref_dir / "out")

    cfg = write_config(run_dir, max_steps=12, save_steps=100)
    out = run_dir / "out"
    p = subprocess.Popen([sys.executable, "-m", "surogate_jax.sft", str(cfg)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and len(_metric_lines(out)) < 3:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "stopped by SIGTERM after step" in err, err[-3000:]
    (stopped_at,) = ckpt_steps(out)  # save_steps 100: the only checkpoint is the one the signal asked for
    assert 3 <= stopped_at < 12 and not (out / "adapter").exists()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "lo')  # as a kill during a write leaves it

    r = sft(cfg, env)
    assert f"at step {stopped_at}" in r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, 13))  # re-done steps are logged once
    assert losses(out) == reference  # bit-exact continuation
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def _metric_lines(out: Path) -> list[str]:
    p = out / "metrics.jsonl"
    return p.read_text().splitlines() if p.is_file() else []


def test_sigint_before_training_exits_at_once_and_writes_nothing(tmp_path, env):
    cfg = write_config(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "surogate_jax.sft", str(cfg)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "out" / ".surogate_jax.lock").exists():
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGINT" in err
    assert all(k.startswith("tokenized") for k in snapshot(tmp_path / "out"))  # at most the data cache


def test_a_non_finite_step_is_never_saved(tmp_path, env):
    cfg = write_config(tmp_path, learning_rate=1e30, max_grad_norm=0.0, warmup_steps=0, max_steps=12, save_steps=1,
                       lr_scheduler_type="constant", optimizer="adamw")
    line = assert_one_error(sft(cfg, env, check=False), "not finite at step")
    bad = int(line.split("not finite at step ")[1].split()[0])
    out = tmp_path / "out"
    saved = ckpt_steps(out)
    assert all(s < bad for s in saved), (saved, bad)
    if saved:
        assert f"last good checkpoint is step {max(saved)}" in line
    assert not (out / "adapter").exists()


def test_a_damaged_checkpoint_is_set_aside_and_an_optimizer_switch_refused(tmp_path, env):
    cfg = write_config(tmp_path, max_steps=3, save_steps=1, save_total_limit=3)
    sft(cfg, env)
    out = tmp_path / "out"
    assert ckpt_steps(out) == [1, 2, 3]
    before = snapshot(out)
    r = sft(write_config(tmp_path, max_steps=5, save_steps=1, optimizer="normuon"), env, check=False)
    assert_one_error(r, "belongs to a different run", "optimizer")
    assert snapshot(out) == before

    data_files = list((out / "checkpoints" / "3" / "state" / "d").iterdir())  # the arrays' data
    assert data_files
    data_files[0].write_bytes(b"\0" * 16)  # damaged inside state/
    r = sft(write_config(tmp_path, max_steps=5, save_steps=1, save_total_limit=3), env)
    assert "checkpoint 3" in r.stderr and "cannot be read" in r.stderr and "resumed from" in r.stderr
    assert (out / "checkpoints_damaged" / "3").is_dir()
    assert ckpt_steps(out) == [3, 4, 5]
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]


def test_a_diverged_run_with_a_flat_loss_gets_one_warning(tmp_path, env):
    cfg = write_config(tmp_path, learning_rate=1e6, warmup_steps=0, lr_scheduler_type="constant", max_steps=60,
                       save_steps=100)
    r = sft(cfg, env)
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning:") and "has not moved" in x]
    assert len(warnings) == 1 and "learning rate 1e+06" in warnings[0], r.stderr[-3000:]
