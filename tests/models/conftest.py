"""Fixtures for model tests; the tiny HF builders live in hf_tiny.py."""

import pytest
from hf_tiny import CASES


@pytest.fixture(params=sorted(CASES))
def case(request):
    return request.param


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """These tests check the math against fp32 references to 1e-4; on GPUs XLA's default fp32
    matmul precision is TF32 (about 1e-3 relative), so ask for full fp32 there."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield
