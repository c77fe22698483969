"""The code passes the repository's linter configuration ([tool.ruff] in pyproject.toml: pycodestyle
errors and warnings, pyflakes, import order, lines up to 120 characters). Skipped where ruff is not
installed (it is in the `dev` extra)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PATHS = ["surogate_jax", "models", "tests", "benchmarks", "examples"]


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e .[dev])")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check found problems:\n{r.stdout}{r.stderr}"
