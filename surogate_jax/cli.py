"""Shared command-line plumbing: user mistakes become one `error:` line and exit code 2.

Entry points call `run(main)`; `main(argv)` raises `SurogateError` (or `FileNotFoundError`,
`FileExistsError`, `PermissionError`, `IsADirectoryError`) for anything the user must fix. Those
print `error: <message>` on stderr and exit 2, never a traceback. Ctrl-C exits 130 quietly.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from .errors import SurogateError

USER_ERRORS = (SurogateError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def quiet_logging() -> None:
    """Our logger speaks at INFO; libraries (absl, Orbax, JAX, datasets) only at WARNING."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    ours = logging.getLogger("surogate_jax")
    ours.setLevel(logging.INFO)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass
    for name in ("absl", "jax._src.xla_bridge", "orbax", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR if name == "jax._src.xla_bridge" else logging.WARNING)


def run(main: Callable[[Sequence[str]], int | None], argv: Sequence[str] | None = None) -> None:
    quiet_logging()
    try:
        code = main(list(sys.argv[1:] if argv is None else argv))
    except USER_ERRORS as e:
        fail(str(e) if isinstance(e, SurogateError) else f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
