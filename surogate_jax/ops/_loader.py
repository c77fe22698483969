"""Find the compiled CUDA extension `surogate_jax._ffi` once and register its XLA FFI targets.

Every op asks `resolve_impl(impl)` which implementation to trace:
  "auto" -> `jax.lax.platform_dependent`: the FFI kernel on CUDA, the pure-JAX reference elsewhere;
  "ffi"  -> always the FFI kernel (fails at lowering on a non-CUDA backend);
  "ref"  -> always the pure-JAX reference.
`impl=None` means "auto", which degrades to "ref" when the extension is missing (one log line on
the "surogate_jax" logger says why). `SUROGATE_JAX_OPS=ref` in the environment forces "ref"
everywhere, whatever the caller asked for (used by CPU-only tests and for debugging);
`SUROGATE_JAX_OPS=ref:rope,swiglu` forces it only for the named ops (for A/B measurements), and
`SUROGATE_JAX_OPS=ref:rms_norm.bwd` only for one pass of an op (its kernel forward with XLA's fusion
of the reference backward, or `.fwd` the other way round); see `pick`. The variable is read once per
process, when the first op is traced (a malformed value raises ValueError there); `force_ref(spec)`
sets the same switch from code (tests, benchmarks, library users) and `force_ref(None)` re-reads the
environment. It applies to ops traced afterwards: an already jitted function keeps its choice.

`SUROGATE_JAX_FFI_GRAPHS=0` registers handlers that do not declare command-buffer compatibility, so
XLA runs each of our calls outside its CUDA graphs (default 1: XLA records them into the graphs of
the layer scan, see ffi/ffi_common.h). Read once, when the extension is registered.
"""

from __future__ import annotations

import functools
import logging
import os

import jax

_log = logging.getLogger("surogate_jax")

ENV_VAR = "SUROGATE_JAX_OPS"
GRAPHS_ENV_VAR = "SUROGATE_JAX_FFI_GRAPHS"
IMPLS = ("auto", "ffi", "ref")


@functools.cache
def _load() -> str | None:
    """Imports and registers the extension; returns None on success, else why it is unusable."""
    try:
        from surogate_jax import _ffi  # noqa: PLC0415  (optional compiled module)
    except ModuleNotFoundError as e:
        if e.name != "surogate_jax._ffi":
            return f"importing surogate_jax._ffi failed: {e}"
        return (
            "surogate_jax._ffi is not built (no CUDA compiler at build time, or built with "
            "SUROGATE_JAX_CUDA=OFF); reinstall with nvcc on PATH to get the CUDA kernels"
        )
    except ImportError as e:
        return f"importing surogate_jax._ffi failed: {e}"
    graphs = graph_safe_handlers()  # a malformed value raises here, it does not fall back
    try:
        for name, capsule in _ffi.registrations(graph_safe=graphs).items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    except Exception as e:  # a jax without CUDA support may refuse CUDA targets
        return f"registering the CUDA FFI targets failed ({type(e).__name__}: {e})"
    return None


def graph_safe_handlers() -> bool:
    """Whether the handlers to register declare command-buffer compatibility (SUROGATE_JAX_FFI_GRAPHS)."""
    v = os.environ.get(GRAPHS_ENV_VAR, "1").strip().lower()
    if v in ("1", "true", "on", "yes", ""):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{GRAPHS_ENV_VAR}={v!r} is not understood; use 1 (default) or 0")


@functools.cache
def _report() -> bool:
    """Logs the outcome once per process; returns whether the FFI kernels are usable."""
    reason = _load()
    if reason is None:
        _log.debug("surogate_jax: CUDA FFI kernels registered")
        return True
    try:
        on_gpu = jax.default_backend() == "gpu"
    except RuntimeError:
        on_gpu = False
    # Only worth a warning when a GPU is there to use them; on CPU the references are expected.
    level = logging.WARNING if on_gpu else logging.INFO
    _log.log(level, "surogate_jax ops use pure-JAX references: %s", reason)
    return False


def ffi_available() -> bool:
    """True when the compiled extension imported and its FFI targets were registered."""
    return _report()


def unavailable_reason() -> str | None:
    """Why the FFI kernels cannot be used (None when they can)."""
    return _load()


_UNREAD = object()
# The parsed switch: None (nothing forced), True (every op) or a frozenset of "<op>" / "<op>.<pass>";
# _UNREAD until the first op reads the environment (or force_ref sets it).
_forced: object = _UNREAD


def _parse(spec: str, source: str) -> bool | frozenset[str] | None:
    v = spec.strip().lower()
    if v in ("", "auto"):
        return None
    if v == "ref":
        return True
    if v.startswith("ref:"):
        return frozenset(n.strip() for n in v[4:].split(",") if n.strip())
    raise ValueError(f"{source}{v!r} is not understood; use 'ref', 'ref:<op>,<op>' or leave {ENV_VAR} unset")


def force_ref(spec: str | None) -> None:
    """Forces the reference like SUROGATE_JAX_OPS, from code: "ref" (every op), "ref:a,b" (those),
    "ref:a.fwd" / "ref:a.bwd" (one pass), "" or "auto" (none); None goes back to the environment's
    value (read again now). A malformed spec raises ValueError and changes nothing. Ops traced
    afterwards see it; a function jitted before keeps what it traced."""
    global _forced
    if spec is None:
        _forced = _parse(os.environ.get(ENV_VAR, ""), f"{ENV_VAR}=")
    else:
        _forced = _parse(spec, f"force_ref: {ENV_VAR} value ")


def forced_ref(op: str | None, phase: str | None = None) -> bool:
    """Whether SUROGATE_JAX_OPS (read once, at the first call) or force_ref forces the reference for
    `op` ("ref" = all, "ref:a,b" = those; with `phase` ("fwd" / "bwd") also "ref:a.fwd" / "ref:a.bwd",
    that pass of `a` only)."""
    if _forced is _UNREAD:
        force_ref(None)
    forced = _forced
    if forced is None or forced is True:
        return forced is True
    return op is not None and (op in forced or (phase is not None and f"{op}.{phase}" in forced))


def resolve_impl(impl: str | None, op: str | None = None) -> str:
    """Maps a caller's impl (None, "auto", "ffi", "ref") to the one to trace ("auto"/"ffi"/"ref").

    op: the op's name, so `SUROGATE_JAX_OPS=ref:<op>` can force its reference alone.
    """
    if impl is None:
        impl = "auto"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if forced_ref(op) or impl == "ref":
        return "ref"
    if ffi_available():
        return impl
    if impl == "ffi":
        raise RuntimeError(f"impl='ffi' requested but the CUDA kernels are unavailable: {_load()}")
    return "ref"


def traced_impl(impl: str | None, op: str, phase: str = "fwd") -> str:
    """What `pick` will trace for one pass of `op`: resolve_impl's answer, or "ref" where
    SUROGATE_JAX_OPS=ref:<op>.<phase> swaps in the reference for that pass (for callers whose
    choice depends on another op's: "auto" is the kernel on CUDA, the reference elsewhere)."""
    impl = resolve_impl(impl, op)
    return "ref" if forced_ref(op, phase) else impl


def pick(impl: str, ffi, ref, op: str | None = None, phase: str | None = None):
    """The function to trace for one pass ("fwd"/"bwd") of `op`, given resolve_impl's answer:
    `ref`, `ffi`, or both behind `jax.lax.platform_dependent` (kernel on CUDA, reference elsewhere).
    SUROGATE_JAX_OPS=ref:<op>.<phase> swaps in the reference for that pass alone."""
    if impl == "ref" or forced_ref(op, phase):
        return ref
    if impl == "ffi":
        return ffi
    return functools.partial(jax.lax.platform_dependent, cuda=ffi, default=ref)
