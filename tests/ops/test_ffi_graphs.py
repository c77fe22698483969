"""SUROGATE_JAX_FFI_GRAPHS picks which handler flavour is registered (ffi/ffi_common.h): command-buffer
compatible by default, plain with 0. CPU: the switch's parsing, and the extension's two tables (the
extension is built wherever nvcc is, CI included; no GPU needed to import it)."""

from __future__ import annotations

import ctypes

import pytest

import surogate_jax.ops._loader as loader


@pytest.mark.parametrize("value, want", [(None, True), ("1", True), ("on", True), ("0", False), ("false", False)])
def test_switch_values(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(loader.GRAPHS_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(loader.GRAPHS_ENV_VAR, value)
    assert loader.graph_safe_handlers() is want


def test_malformed_switch_raises(monkeypatch):
    monkeypatch.setenv(loader.GRAPHS_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="SUROGATE_JAX_FFI_GRAPHS"):
        loader.graph_safe_handlers()


def test_extension_exports_both_flavours():
    _ffi = pytest.importorskip("surogate_jax._ffi", reason="CUDA extension not built here")
    graph, plain = _ffi.registrations(graph_safe=True), _ffi.registrations(graph_safe=False)
    assert set(graph) == set(plain) == set(_ffi.registrations())
    assert {"surogate_rms_norm_fwd", "surogate_fp8_matmul", "surogate_adamw_8bit_update"} <= set(graph)
    # Different handler functions behind the same names; the same ones on every call.
    ptr = _capsule_pointer
    assert all(ptr(graph[n]) != ptr(plain[n]) for n in graph)
    assert all(ptr(graph[n]) == ptr(g) for n, g in _ffi.registrations().items())


def _capsule_pointer(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, None)
