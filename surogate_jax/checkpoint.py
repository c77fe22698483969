"""Orbax checkpoints of the whole TrainState plus the data position and run metadata.

Layout: <checkpoint_dir>/checkpoints/<step>/{state, data, meta}. Saves are asynchronous (device
arrays are copied to host before `save` returns, so the next step may donate them); Orbax writes
each step into a temporary directory and renames it when complete, so a process killed mid-save
leaves the previous checkpoint as the latest complete one. `meta` records what the state belongs
to (model shape, LoRA spec, mode); resuming with a different model is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .config import ConfigError


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int, async_save: bool = True):
        self.dir = Path(directory).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_names=("state", "data", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        if getattr(state, "grad_buf", None):  # scratch accumulator (train.TrainState): not saved
            state = state.replace(grad_buf={})
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))

    def check_meta(self, meta: dict, step: int | None = None) -> None:
        """Refuses (ConfigError) to resume a checkpoint written for another model or setup."""
        step = self.latest_step() if step is None else step
        saved = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        diff = sorted(k for k in set(meta) | set(saved) if meta.get(k) != saved.get(k))
        if diff:
            k = diff[0]
            raise ConfigError(
                f"resume: the checkpoint in {self.dir} belongs to a different run ({k}: checkpoint has "
                f"{saved.get(k)!r}, this config gives {meta.get(k)!r}); use another output_dir, or "
                f"resume_from_checkpoint: false with a fresh output_dir")

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        step = self.latest_step() if step is None else step
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with the shardings of `tree` (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
