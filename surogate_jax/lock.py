"""One run per output_dir: an advisory lock file, taken before the run writes anything there.

Two runs on one output_dir would interleave metrics.jsonl and prune each other's checkpoints, so
the second is refused with the holder's pid and host. The lock is `flock` on
`<output_dir>/.surogate_jax.lock` (released by the kernel when the process dies, so a killed run
never leaves a stale lock). The file also marks the directory as written by surogate_jax: a run
that fails before it commits (see `commit`) removes the lock file it created, and the directory
when it created that too and left it empty, so a refused run leaves no trace.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .config import ConfigError

LOCK_NAME = ".surogate_jax.lock"


def is_marked(directory: Path) -> bool:
    """True when a surogate_jax run has committed to `directory` (it holds our lock file)."""
    return (Path(directory) / LOCK_NAME).is_file()


class OutputLock:
    """`with OutputLock(dir) as lock:` holds the lock; `lock.commit()` once the run writes outputs."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / LOCK_NAME
        self.fd: int | None = None
        self.created_dir = False
        self.created_file = False
        self.committed = False

    def __enter__(self) -> OutputLock:
        self.created_dir = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        while True:
            existed = self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                self._cleanup_dir()
                raise ConfigError(f"output_dir {str(self.dir)!r} is in use by a running training ({holder}); "
                                  "wait for it to finish, stop it, or use another output_dir") from None
            # A holder that was finishing may have unlinked the file between our open and flock: retry.
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        self.fd, self.created_file = fd, not existed
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return self

    def commit(self) -> None:
        """From here on the run writes outputs: keep the lock file as the directory's marker."""
        self.committed = True

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        if self.created_file and not self.committed:
            self.path.unlink(missing_ok=True)  # before closing, so no other run can lock the orphan
        os.close(self.fd)
        self.fd = None
        if not self.committed:
            self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self.created_dir:
            try:
                self.dir.rmdir()  # only when empty
            except OSError:
                pass
