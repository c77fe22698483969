"""Preemption: SIGTERM and SIGINT end a run at the next step boundary, after a checkpoint.

SLURM and cloud schedulers send SIGTERM some time before they kill a job; Ctrl-C sends SIGINT.
Inside `StopSignals.at_step_boundary()` (the training loop) the first signal is only recorded: the
loop finishes the step in flight, saves a checkpoint and raises `Interrupted`, so the run stops
within one step plus one save. Elsewhere (data, model load, compile, export) the first signal
raises `Interrupted` at once: nothing there is worth saving, and every output is written
atomically. A second signal always stops at once. The entry points print one line and exit with
128 + the signal number (143 for SIGTERM, 130 for SIGINT), as a shell reports a killed job.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """A stop signal ended the run; the message says what was saved and how to go on."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    def __init__(self):
        self.signum: int | None = None
        self._deferring = False
        self._old: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    @contextlib.contextmanager
    def at_step_boundary(self) -> Iterator[None]:
        """Within this block a first signal waits for the loop to call `requested`."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and self._deferring:
            return
        raise Interrupted(signum, f"stopped by {signal.Signals(signum).name}"
                          + ("" if first else " (second signal)") + " before the next checkpoint")
