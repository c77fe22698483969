"""Fixtures for model tests; the tiny HF builders live in hf_tiny.py."""

import pytest
from hf_tiny import CASES


@pytest.fixture(params=sorted(CASES))
def case(request):
    return request.param
