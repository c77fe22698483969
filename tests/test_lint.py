"""The code passes the repository's linter configurations: ruff ([tool.ruff] in pyproject.toml: pycodestyle
errors and warnings, pyflakes, import order, lines up to 120 characters) over the Python, clang-format
(.clang-format) over the C++/CUDA in kernels/ and ffi/. Each is skipped where its tool is not installed
(both are in the `dev` extra)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PATHS = ["surogate_jax", "models", "tests", "benchmarks", "examples"]
CXX = sorted(p.relative_to(ROOT).as_posix() for d in ("kernels", "ffi") for p in (ROOT / d).iterdir()
             if p.suffix in (".cu", ".cuh", ".h", ".cc"))


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e .[dev])")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check found problems:\n{r.stdout}{r.stderr}"


def _clang_format() -> str | None:
    """The clang-format of the `clang-format` wheel (dev extra), else one on PATH."""
    exe = Path(sys.executable).with_name("clang-format")
    if exe.exists():
        return str(exe)
    return shutil.which("clang-format")


def test_clang_format_passes():
    exe = _clang_format()
    if exe is None:
        pytest.skip("clang-format is not installed (pip install -e .[dev])")
    r = subprocess.run([exe, "--dry-run", "--Werror", *CXX], check=False, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"clang-format would change (run: clang-format -i kernels/* ffi/*):\n{r.stderr[-4000:]}"
