"""Orbax checkpoints of the whole TrainState plus the data position and run metadata.

Layout: <checkpoint_dir>/checkpoints/<step>/{state, data, meta}. Saves are asynchronous (device
arrays are copied to host before `save` returns, so the next step may donate them); Orbax writes
each step into a temporary directory and renames it when complete, so a process killed mid-save
leaves the previous checkpoint as the latest complete one. `meta` records what the state belongs
to (model shape, LoRA spec, mode, optimizer, and a fingerprint of the state's tree); resuming with
a different setup is refused before anything is loaded.

Failures keep what is on disk: a save checks the free space first (the previous checkpoint is
never pruned for a save that cannot complete) and a failed background write stops the run at the
next step with one error naming the directory and the bytes needed. On resume a checkpoint that
cannot be read (a file missing or damaged inside it) is moved to `checkpoints_damaged/` and the
next newest one is used.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .config import ConfigError
from .errors import SurogateError

log = logging.getLogger("surogate_jax")
# Meta keys that older checkpoints lack: compared only when the checkpoint has them.
NEWER_META_KEYS = ("optimizer", "state_tree")
SCRATCH_FIELDS = ("grad_buf", "first_nonfinite")  # train.TrainState fields that are never saved
SAVE_MARGIN_BYTES = 1 << 20  # Orbax's metadata and JSON items on top of the arrays (plus 1%)


class CheckpointError(SurogateError):
    """A checkpoint cannot be written or none can be read; the message names the directory."""


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int, async_save: bool = True):
        root = Path(directory).absolute()
        self.dir = root / "checkpoints"
        self.aside = root / "checkpoints_damaged"
        self.keep, self.async_save = keep, async_save
        self._manager: ocp.CheckpointManager | None = None
        self._need: tuple[int | None, int] = (None, 0)  # (step, bytes) of the save in flight

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Made on first use: a run refused before its first save creates no directory."""
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, enable_async_checkpointing=self.async_save,
                                                   create=True)
            self._manager = ocp.CheckpointManager(self.dir, options=options, item_names=("state", "data", "meta"))
        return self._manager

    def steps(self) -> list[int]:
        """Complete checkpoints' steps, newest first: the directories on disk (Orbax renames a
        step's temporary directory into place when it is complete)."""
        if not self.dir.is_dir():
            return []
        return sorted((int(p.name) for p in self.dir.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Starts an asynchronous save; CheckpointError when it cannot complete."""
        state = strip_scratch(state)
        self.wait()  # Orbax would wait for the previous save too; this also checks it committed
        need = int(tree_bytes(state) * 1.01) + SAVE_MARGIN_BYTES
        free = shutil.disk_usage(_existing_ancestor(self.dir)).free
        if free < need:
            raise self._full_error(step, need, free)
        meta = {**meta, "state_tree": tree_fingerprint(state)}
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - any write failure ends the run with one line
            raise self._write_error(step, e, need) from None
        self._need = (step, need)

    def check_errors(self) -> None:
        """Raises CheckpointError when the save in flight has finished and failed (never waits)."""
        in_progress = getattr(self._manager, "is_saving_in_progress", None)
        if self._need[0] is None or in_progress is None or in_progress():
            return
        self.wait()

    def wait(self) -> None:
        """Waits for the save in flight; CheckpointError when it failed."""
        step, need = self._need
        if self._manager is None or step is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(step, e, need) from None
        if not (self.dir / str(step)).is_dir():  # Orbax logged the failure but committed nothing
            raise self._write_error(step, RuntimeError("the save did not complete"), need)
        self._need = (None, 0)

    def close(self, *, quiet: bool = False) -> None:
        """Waits for the save in flight; `quiet`: its failure is not raised (another error is)."""
        if self._manager is None:
            return
        try:
            self.wait()
        except CheckpointError:
            if not quiet:
                raise
        finally:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 - a failed save was reported by wait()
                pass
            self._manager = None

    def _full_error(self, step: int, need: int, free: int) -> CheckpointError:
        prev = [s for s in self.steps() if s != step]
        kept = f"the checkpoint of step {prev[0]} is intact" if prev else "no earlier checkpoint exists"
        return CheckpointError(
            f"disk full: the checkpoint of step {step} needs about {_gb(need)} ({need:,} bytes) in {self.dir}, "
            f"{_gb(free)} are free; {kept}. Free space or set checkpoint_dir to a larger disk, then run the "
            "same command to resume")

    def _write_error(self, step: int | None, e: BaseException, need: int) -> CheckpointError:
        self._need = (None, 0)
        self._remove_partial()
        free = shutil.disk_usage(_existing_ancestor(self.dir)).free
        if _is_no_space(e) or (need and free < need):
            return self._full_error(step if step is not None else -1, need, free)
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        return CheckpointError(f"cannot write {what} in {self.dir}: {_one_line(e)}")

    def _remove_partial(self) -> None:
        """Orbax's temporary directories of a save that failed (they hold the space that ran out)."""
        if self.dir.is_dir():
            for tmp in self.dir.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)

    # -- resuming ----------------------------------------------------------------------------

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def check_meta(self, meta: dict) -> None:
        """Refuses (ConfigError) to resume checkpoints written for another model or setup; reads
        only, so it can run before the run writes anything. Unreadable metas are skipped here and
        set aside by `restore`."""
        for step in self.steps():
            try:
                saved = self.read_meta(step)
            except Exception:  # noqa: BLE001 - damaged: restore() moves it aside
                continue
            diff = sorted(k for k in set(meta) | set(saved)
                          if k != "state_tree" and meta.get(k) != saved.get(k)
                          and not (k in NEWER_META_KEYS and k not in saved))
            if diff:
                k = diff[0]
                raise ConfigError(
                    f"resume: the checkpoint in {self.dir} belongs to a different run ({k}: checkpoint has "
                    f"{saved.get(k)!r}, this config gives {meta.get(k)!r}); use another output_dir, or "
                    f"resume_from_checkpoint: false with a fresh output_dir")
            return

    def restore(self, abstract_state: Any) -> tuple[Any, dict, int]:
        """(state, data position, step) of the newest checkpoint that reads completely; damaged
        ones are moved to `checkpoints_damaged/` with one log line each."""
        abstract_state = strip_scratch(abstract_state)
        want = tree_fingerprint(abstract_state)
        for step in self.steps():
            try:
                saved = self.read_meta(step)
            except Exception as e:  # noqa: BLE001
                self._set_aside(step, e)
                continue
            if saved.get("state_tree") not in (None, want):
                raise ConfigError(f"resume: the checkpoint of step {step} in {self.dir} holds a training state of "
                                  "another layout (optimizer, LoRA or precision settings differ from this config); "
                                  "use the config it was written with, or a new output_dir")
            hook, sys.unraisablehook = sys.unraisablehook, lambda _: None  # Orbax's orphaned read coroutines
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001
                self._set_aside(step, e)
                continue
            finally:
                gc.collect()  # collect them while the quiet hook is on
                sys.unraisablehook = hook
            return restored["state"], restored["data"], step
        raise CheckpointError(f"no complete checkpoint is left in {self.dir} (damaged ones are in {self.aside}); "
                              "run again to start from step 0, or move a checkpoint back")

    def _set_aside(self, step: int, e: BaseException) -> None:
        self.close()
        self.aside.mkdir(parents=True, exist_ok=True)
        dest = self.aside / str(step)
        n = 1
        while dest.exists():
            dest, n = self.aside / f"{step}.{n}", n + 1
        shutil.move(str(self.dir / str(step)), dest)
        rest = self.steps()
        log.warning("checkpoint %d in %s cannot be read (%s); moved it to %s and %s", step, self.dir,
                    _one_line(e, 160), dest, f"trying step {rest[0]}" if rest else "no checkpoint is left")


def strip_scratch(state: Any) -> Any:
    """The state without the fields that are rebuilt each run (train.TrainState.grad_buf, ...)."""
    fields = {f: {} for f in SCRATCH_FIELDS if hasattr(state, f)}
    return state.replace(**fields) if fields else state


def tree_bytes(tree: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def tree_fingerprint(tree: Any) -> str:
    """Paths, shapes and dtypes of every leaf (not placement: a run may resume on another layout)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    desc = [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with the shardings of `tree` (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _existing_ancestor(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _is_no_space(e: BaseException | None) -> bool:
    while e is not None:
        if getattr(e, "errno", None) == 28 or "No space left" in str(e) or "ENOSPC" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join((str(e) or type(e).__name__).split())
    return text[:limit] + ("..." if len(text) > limit else "")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
