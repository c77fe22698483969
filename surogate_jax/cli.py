"""Shared command-line plumbing: user mistakes become one `error:` line and exit code 2.

Entry points call `run(main)`; `main(argv)` raises `SurogateError` (or an `OSError` such as
`FileNotFoundError`, `PermissionError` or a full disk) for anything the user must fix. Those print
`error: <message>` on stderr and exit 2, never a traceback; so do running out of host memory
(`MemoryError`) and out of device memory (XLA's RESOURCE_EXHAUSTED), which come from sizes the
user chose. A stop signal (stop.Interrupted, or Ctrl-C outside a training loop) prints one line and
exits 128 + the signal number. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable, Sequence

from .errors import SurogateError
from .ops import _loader
from .stop import Interrupted

USER_ERRORS = (SurogateError, OSError, MemoryError)


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
    # A failed background save is reported once by the checkpointer; Orbax's own thread logs repeat it
    # with tracebacks (hundreds of lines on a full disk).
    logging.getLogger("absl").addFilter(lambda r: r.levelno < logging.ERROR or "orbax" not in r.pathname)


def describe(e: BaseException) -> str:
    """One line for an error the user must act on."""
    if isinstance(e, SurogateError):
        return str(e)
    if isinstance(e, MemoryError):
        return ("out of host memory" + (f" ({e})" if str(e) else "") + ": lower per_device_train_batch_size, "
                "gradient_accumulation_steps or sequence_len")
    if isinstance(e, OSError):
        what = e.strerror or str(e) or errno.errorcode.get(e.errno or 0, type(e).__name__)
        return f"{what}: {e.filename}" if getattr(e, "filename", None) else what
    return str(e)


def device_out_of_memory(e: BaseException) -> bool:
    return type(e).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(e)


def read_op_switches() -> None:
    """The ops' environment switches (SUROGATE_JAX_OPS, SUROGATE_JAX_FFI_GRAPHS), read once before any work, so a
    malformed value is one error line at start rather than a traceback from the first traced op."""
    try:
        _loader.force_ref(None)
        _loader.graph_safe_handlers()
    except ValueError as e:
        raise SurogateError(str(e)) from None


def run(main: Callable[[Sequence[str]], int | None], argv: Sequence[str] | None = None) -> None:
    quiet_logging()
    try:
        read_op_switches()
        code = main(list(sys.argv[1:] if argv is None else argv))
    except USER_ERRORS as e:
        fail(describe(e))
        sys.exit(2)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if not device_out_of_memory(e):
            raise
        first = " ".join(str(e).split())[:240]
        fail(f"out of device memory ({first}): lower per_device_train_batch_size or sequence_len, keep recompute "
             "on, or spread the state with zero_level / offload_* (README 'Scaling')")
        sys.exit(2)
    sys.exit(code or 0)
