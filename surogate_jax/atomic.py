"""Writing an output directory atomically: assemble it in a temporary sibling, rename into place.

A crash or an exception part-way leaves the previous directory (or nothing) at `out`, never a
half-written model or adapter that a later run or a serving stack would pick up.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
