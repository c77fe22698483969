"""The `force_ref` fixture: SUROGATE_JAX_OPS's switch set from a test (the variable itself is read
once per process), put back to the environment's value when the test ends."""

from __future__ import annotations

import pytest

from surogate_jax.ops import _loader


@pytest.fixture(name="force_ref")
def _force_ref_fixture():
    yield _loader.force_ref
    _loader.force_ref(None)
