"""benchmarks/gpu_session.sh checks its arguments before any work: an unknown SUITE is one line and exit 2, and every
tests/gpu file belongs to one of the full suite's three parts (SUITE=full-1/2/3), so timing the parts times it all."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks/gpu_session.sh"


def _run(tmp_path, suite: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "SUITE": suite}
    return subprocess.run(["bash", str(SCRIPT)], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_unknown_suite_is_refused_before_any_work(tmp_path):
    r = _run(tmp_path, "fulll")
    assert r.returncode == 2
    assert r.stdout.strip() == "SUITE=fulll: use quick, full, full-1, full-2, full-3 or none"
    assert not (tmp_path / "build.log").exists()  # nothing built, nothing measured


def test_the_full_suites_parts_cover_tests_gpu_once():
    text = SCRIPT.read_text()
    parts = [re.search(rf"^part{i}=\(([^)]*)\)", text, re.M).group(1).split() for i in (1, 2, 3)]
    named = [f"test_{n}_gpu.py" for p in parts for n in p]
    assert len(named) == len(set(named)), "a GPU test file is in two parts"
    assert sorted(named) == sorted(p.name for p in (ROOT / "tests/gpu").glob("test_*_gpu.py"))
