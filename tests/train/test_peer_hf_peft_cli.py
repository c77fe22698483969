"""benchmarks/peer_hf_peft.py (the HF transformers + PEFT peer) runs on the CPU at --size tiny, with and without
gradient checkpointing: it trains (the loss falls over the steps), prints its table line and json, and counts the
LoRA adapters of the seven projections."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("gc", [False, True])
def test_peer_runs_on_cpu(tmp_path, gc):
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("peft") is None:
        pytest.skip("torch and peft are needed (pip install -e .[dev])")
    out = tmp_path / "peer.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks/peer_hf_peft.py"), "--size", "tiny", "--device", "cpu", "--steps",
           "3", "--seq", "32", "--out", str(out)] + (["--gradient-checkpointing"] if gc else [])
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "| Qwen3-TINY | HF+PEFT (checkpointing " + ("on" if gc else "off") in r.stdout
    (res,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert res["peer"] == "hf+peft" and res["gradient_checkpointing"] is gc
    assert res["tokens_per_s"] > 0 and len(res["losses"]) == 4
    assert res["losses"][-1] < res["losses"][0]  # lr 2e-4 on one fixed batch: it learns
    # rank 16 on q/k/v/o/gate/up/down of 2 layers (tiny: hidden 64, heads 4 x 16, kv 2 x 16, intermediate 128)
    per_layer = 16 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert res["trainable_params"] == 2 * per_layer
