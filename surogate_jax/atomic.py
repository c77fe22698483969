"""Writing outputs atomically: assemble a directory or file in a temporary sibling, rename into place.

A crash or an exception part-way leaves the previous directory or file (or nothing) at the path,
never a half-written model, adapter, config or metrics file that a later run would pick up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_directory(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yields a temporary directory; on success it replaces `out`. A non-empty existing `out` is
    refused (FileExistsError) unless `overwrite`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """Yields a temporary file open in `mode` beside `path` (its parent must exist); on success it
    replaces `path`, on an exception it is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def probe_creatable(d: Path) -> Path:
    """Checks that `d` (a directory to be written) exists writable or can be created: returns its
    nearest existing ancestor after creating and removing a probe file there (permission bits say
    nothing for root, read-only mounts or ACLs). NotADirectoryError when that ancestor is a file,
    the probe's OSError when it cannot be written."""
    p = Path(d).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise NotADirectoryError(20, "not a directory", str(p))
    fd, probe = tempfile.mkstemp(prefix=".surogate_jax_probe.", dir=p)
    os.close(fd)
    os.unlink(probe)
    return p
