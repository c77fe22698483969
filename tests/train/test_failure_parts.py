"""The parts the trainer leans on when things go wrong, in process: metrics.jsonl repair and
truncation, the flat-loss warning, the output_dir lock, checkpoint fallback past a damaged
checkpoint, and the disk-space check before a save (tests/train/test_faults.py runs the CLI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import namedtuple

import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax import checkpoint as ck
from surogate_jax.config import ConfigError
from surogate_jax.lock import LOCK_NAME, OutputLock, is_marked
from surogate_jax.metrics import PlateauWatch, read_metrics, truncate


def test_metrics_partial_last_line_is_skipped_and_truncate_cuts_back(tmp_path):
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)] + [{"step": 3, "eval_loss": 0.5}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(p)] == [1, 2, 3, 4, 5, 3]
    assert truncate(p, 3) == 3  # steps 4, 5 and the partial line
    assert [(r["step"], "eval_loss" in r) for r in read_metrics(p)] == [(1, False), (2, False), (3, False), (3, True)]
    assert p.read_text().endswith("\n") and truncate(p, 3) == 0
    assert truncate(p, 0) == 4 and p.read_text() == ""


def test_plateau_warns_once_on_a_flat_loss_only():
    w = PlateauWatch(window=50)
    rng = np.random.default_rng(0)
    assert all(w.update(s, 2.0 + 0.05 * rng.standard_normal(), 2e-4) is None for s in range(1, 200))  # noisy: fine
    w = PlateauWatch(window=50)
    msgs = [w.update(s, 11.93 + 1e-7 * (s % 2), 1e6) for s in range(1, 120)]
    hits = [s for s, m in zip(range(1, 120), msgs) if m]
    assert hits == [51] and "learning rate 1e+06" in msgs[50]
    w = PlateauWatch(window=50)  # flat at a tiny learning rate (end of a decay): no warning
    assert all(w.update(s, 1.0, 1e-9) is None for s in range(1, 200))


def test_lock_refuses_a_second_holder_and_cleans_up_when_not_committed(tmp_path):
    out = tmp_path / "new" / "out"
    with OutputLock(out) as first:
        assert (out / LOCK_NAME).read_text().startswith(f"pid {os.getpid()}")
        with pytest.raises(ConfigError, match=f"in use by a running training \\(pid {os.getpid()}"):
            with OutputLock(out):
                pass
    assert not out.exists() and (tmp_path / "new").exists()  # created by the lock: removed again
    with OutputLock(out) as first:
        first.commit()
    assert is_marked(out)
    with OutputLock(out):  # a committed lock file stays as the directory's marker
        pass
    assert is_marked(out)


def test_lock_is_released_when_its_process_dies(tmp_path):
    code = ("import os, sys; from surogate_jax.lock import OutputLock; "
            "l = OutputLock(sys.argv[1]).__enter__(); l.commit(); os._exit(9)")
    r = subprocess.run([os.sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 9
    with OutputLock(tmp_path):
        pass


def _state(x: float):
    return {"w": jnp.full((64, 32), x, jnp.float32), "b": jnp.arange(7, dtype=jnp.int32) + int(x)}


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_restored(tmp_path, caplog):
    c = ck.Checkpointer(tmp_path, keep=5, async_save=False)
    for step in (1, 2, 3):
        c.save(step, _state(step), {"pos": step}, {"mode": "sft"})
    c.close()
    (victim,) = (tmp_path / "checkpoints" / "3" / "state" / "d").iterdir()  # the arrays' data file
    victim.unlink()  # a file missing inside the newest checkpoint's state/
    shutil.rmtree(tmp_path / "checkpoints" / "2" / "meta")  # and the next one's metadata gone
    c = ck.Checkpointer(tmp_path, keep=5, async_save=False)
    c.check_meta({"mode": "sft"})  # skips the unreadable meta, compares with a readable one
    abstract = jax_abstract(_state(0))
    state, data, step = c.restore(abstract)
    c.close()
    assert step == 1 and data == {"pos": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((64, 32), 1.0, np.float32))
    assert sorted(p.name for p in (tmp_path / "checkpoints_damaged").iterdir()) == ["2", "3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert "checkpoint 3" in caplog.text and "trying step 2" in caplog.text


def test_no_readable_checkpoint_left_is_one_error(tmp_path):
    c = ck.Checkpointer(tmp_path, keep=5, async_save=False)
    c.save(1, _state(1), {}, {})
    c.close()
    shutil.rmtree(tmp_path / "checkpoints" / "1" / "state")
    c = ck.Checkpointer(tmp_path, keep=5, async_save=False)
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint is left"):
        c.restore(jax_abstract(_state(0)))


def test_restoring_another_state_layout_is_refused_not_set_aside(tmp_path):
    c = ck.Checkpointer(tmp_path, keep=5, async_save=False)
    c.save(1, _state(1), {}, {})
    c.close()
    other = {"w": jnp.zeros((64, 32), jnp.float32), "b": jnp.zeros(7, jnp.int32), "extra": jnp.zeros(3)}
    c = ck.Checkpointer(tmp_path, keep=5, async_save=False)
    with pytest.raises(ConfigError, match="another layout"):
        c.restore(jax_abstract(other))
    assert (tmp_path / "checkpoints" / "1").is_dir() and not (tmp_path / "checkpoints_damaged").exists()


def test_a_save_that_cannot_fit_is_refused_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    c = ck.Checkpointer(tmp_path, keep=1, async_save=False)
    c.save(1, _state(1), {"pos": 1}, {})
    c.wait()
    before = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    pattern = r"disk full: the checkpoint of step 2 needs about .* in .*checkpoints, .* free; the checkpoint of step 1"
    with pytest.raises(ck.CheckpointError, match=pattern + " is intact"):
        c.save(2, _state(2), {"pos": 2}, {})
    c.close()
    after = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
    assert after == before


@pytest.fixture
def tiny_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_disk_that_fills_during_the_write_is_one_error_and_keeps_the_previous_checkpoint(tiny_disk, monkeypatch):
    c = ck.Checkpointer(tiny_disk, keep=1, async_save=True)
    noise = np.random.default_rng(0).standard_normal((2000, 1000), np.float32)  # incompressible
    c.save(1, {"w": jnp.asarray(noise[:100])}, {}, {})  # 0.4 MB (+ the 1 MB margin): fits
    c.wait()
    before = {p: p.read_bytes() for p in (tiny_disk / "checkpoints").rglob("*") if p.is_file()}
    Usage = namedtuple("Usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: Usage(10**12, 0, 10**12))  # the check is fooled
    with pytest.raises(ck.CheckpointError, match="disk full: the checkpoint of step 2 needs about"):
        c.save(2, {"w": jnp.asarray(noise)}, {}, {})  # 8 MB: cannot fit
        c.wait()
    monkeypatch.setattr(ck.shutil, "disk_usage", real)
    c.close(quiet=True)
    after = {p: p.read_bytes() for p in (tiny_disk / "checkpoints").rglob("*") if p.is_file()}
    assert after == before  # the previous checkpoint is intact and the partial one is gone
    assert not list((tiny_disk / "checkpoints").glob("*tmp*"))


def jax_abstract(tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def test_scratch_fields_are_not_saved():
    from surogate_jax.train import TrainState

    s = TrainState(step=jnp.zeros((), jnp.int32), params={}, trainable={"a": jnp.ones(3)}, opt_state={},
                   rng=jnp.zeros(2, jnp.uint32), grad_buf={"a": jnp.ones(3)}, first_nonfinite=jnp.zeros((), jnp.int32))
    stripped = ck.strip_scratch(s)
    assert stripped.grad_buf == {} and stripped.first_nonfinite == {}
    assert ck.tree_fingerprint(stripped) != ck.tree_fingerprint(s)
