"""benchmarks/cli_throughput.py on the CPU (--size tiny): it builds the model directory and the documents, runs the
trainer's CLI at the seed configuration and reports the median of its logged tokens/s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[2]


def test_tiny_cli_run_reports_its_logged_throughput(tmp_path):
    out, work = tmp_path / "r.jsonl", tmp_path / "work"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SUROGATE_JAX_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/cli_throughput.py"), "--size", "tiny", "--steps", "3",
                        "--skip", "1", "--work", str(work), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    (res,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert [s for s, _ in res["per_step"]][-2:] == [2, 3]
    assert res["tokens_per_s"] == float(np.median([t for s, t in res["per_step"] if s > 1])) > 0
    assert any("attention: packed, at most" in ln for ln in res["log"])  # the trainer's packed-attention bound
    cfg = json.loads((work / "out/config.json").read_text())
    assert (cfg["sequence_len"], cfg["per_device_train_batch_size"], cfg["gradient_accumulation_steps"]) == (2048, 2, 4)
    assert cfg["lora_rank"] == 16 and cfg["optimizer"] == "adamw_8bit" and cfg["sample_packing"] is True
