"""Shared test settings: the one dtype-based tolerance rule, the `gpu` and `cpu` markers' auto-skips, and `--quick`.

Tolerances come only from `tolerance(dtype)`; a test that needs more must say why in a comment.
Tests get the helpers as fixtures (`tolerance`, `assert_close`, `assert_bits`, `benchmark_module`) so they work
whatever pytest's import mode is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def tolerance(dtype) -> dict[str, float]:
    """rtol/atol for comparing an op against its reference in `dtype`.

    16-bit results are rounded once from fp32 math, so they may differ by about two units in the
    last place: 2.5 * eps (bf16 ~2.0e-2, fp16 ~2.4e-3). fp32 results differ by accumulation order
    over long reductions: eps ** (2/3) (~2.4e-5).
    """
    finfo = jnp.finfo(dtype)
    eps = float(finfo.eps)
    tol = 2.5 * eps if finfo.bits <= 16 else eps ** (2.0 / 3.0)
    return {"rtol": tol, "atol": tol}


def assert_close(actual, expected, dtype, err_msg: str = "") -> None:
    """Elementwise check with `tolerance(dtype)`; atol is relative to the reference's RMS.

    Scaling atol by the RMS keeps the check meaningful for sums over many rows (dw), whose values
    and rounding errors both grow with the number of rows. Large arrays (e.g. a [1024, 151936] head
    gradient) are first checked where they live, in fp32; only an array that fails there goes
    through the float64 host check, which is the authoritative one and writes the report.
    """
    assert tuple(jnp.shape(actual)) == tuple(jnp.shape(expected)), (jnp.shape(actual), jnp.shape(expected))
    tol = tolerance(dtype)
    if jnp.size(expected) >= _DEVICE_CHECK_MIN and _device_check(actual, expected, tol):
        return
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    scale = max(float(np.sqrt(np.mean(np.square(expected)))) if expected.size else 0.0, 1e-30)
    np.testing.assert_allclose(
        actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=err_msg
    )


_DEVICE_CHECK_MIN = 1 << 20


@jax.jit
def _device_violation(a, e, rtol, atol):
    a, e = a.astype(jnp.float32), e.astype(jnp.float32)
    scale = jnp.maximum(jnp.sqrt(jnp.mean(jnp.square(e))), 1e-30)
    bad = ~(jnp.abs(a - e) <= atol * scale + rtol * jnp.abs(e))  # NaN counts as a violation
    return jnp.any(bad)


def _device_check(actual, expected, tol) -> bool:
    """True when every element is within tolerance (fp32 on the arrays' device)."""
    return not bool(_device_violation(jnp.asarray(actual), jnp.asarray(expected), tol["rtol"], tol["atol"]))


def assert_bits(actual, expected, what: str = "") -> None:
    """Same dtype, shape and bit patterns (NaN payloads and signed zeros included); the report names the first
    differing element."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        what, actual.dtype, expected.dtype, actual.shape, expected.shape)
    as_int = lambda a: a.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    diff = np.flatnonzero(as_int(actual) != as_int(expected))
    assert diff.size == 0, (f"{what}: {diff.size} of {actual.size} differ, first at flat index {diff[0]}: "
                            f"{actual.reshape(-1)[diff[0]]} vs {expected.reshape(-1)[diff[0]]}")


@pytest.fixture(name="tolerance")
def _tolerance_fixture():
    return tolerance


@pytest.fixture(name="assert_close")
def _assert_close_fixture():
    return assert_close


@pytest.fixture(name="assert_bits")
def _assert_bits_fixture():
    return assert_bits


def benchmark_module(name: str):
    """benchmarks/<name>.py loaded as a module (benchmarks/ is not a package), for tests of its pure parts;
    `name` may name a subfolder: "profile/ncu_summary", "experiments/recipe_accuracy"."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(Path(name).name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(name="force_ref")
def _force_ref_fixture():
    """SUROGATE_JAX_OPS's switch set from a test (the variable itself is read once per process), put back to the
    environment's value when the test ends."""
    from surogate_jax.ops import _loader  # noqa: PLC0415  (imported where used: most tests never need it)

    yield _loader.force_ref
    _loader.force_ref(None)


@pytest.fixture(name="benchmark_module")
def _benchmark_module_fixture():
    return benchmark_module


QUICK_CASES = 1  # parametrized cases kept per GPU test function under --quick
# Whole-model and memory-placement GPU tests (cuDNN attention, offload): no kernel-vs-reference check of their own,
# and the slowest GPU tests (50-100 s each on an H100), so --quick leaves them to the full suite.
QUICK_SKIPS_FILES = ("test_models_gpu.py", "test_parallel_gpu.py")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help=f"GPU quick suite: the first {QUICK_CASES} parametrized case(s) of each GPU test function "
                          "(every kernel's forward and gradients against its reference, not every shape), "
                          "without the whole-model and offload tests")


def _quick_selection(config, items):
    """--quick: deselects all but the first QUICK_CASES cases of each `gpu`-marked test function."""
    seen: dict[tuple[str, str], int] = {}
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("gpu") is None:
            keep.append(item)
            continue
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if key[0].endswith(QUICK_SKIPS_FILES):
            drop.append(item)
            continue
        seen[key] = seen.get(key, 0) + 1
        (keep if seen[key] <= QUICK_CASES else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        _quick_selection(config, items)
    # slow tests first: under xdist a minute-long test started last ends the suite alone
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if jax.default_backend() != "cpu":
        skip_cpu = pytest.mark.skip(reason="asserts the CPU backend's exact numerics; tests/gpu holds the GPU form")
        for item in items:
            if item.get_closest_marker("cpu") is not None:
                item.add_marker(skip_cpu)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)
