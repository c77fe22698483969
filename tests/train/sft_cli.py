"""Running `python -m surogate_jax.sft` from tests: the environment (CPU, a private model cache),
the call, and the losses a run logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
DATA = ROOT / "examples" / "data"


# The builtin tiny model on the bundled quickstart chats: a LoRA run of a few CPU seconds.
TINY_RUN = {
    "model": "builtin:tiny-qwen3", "model_dtype": "fp32",
    "datasets": [{"path": str(DATA / "quickstart_train.jsonl"), "type": "conversation", "samples": 400}],
    "validation_split_ratio": 0.05, "sequence_len": 128, "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2, "max_steps": 6, "save_steps": 3, "eval_steps": 3,
    "learning_rate": 3e-3, "warmup_steps": 1, "lora_rank": 8, "lora_alpha": 16, "logging_steps": 1,
}


def write_config(tmp: Path, base: dict = TINY_RUN, **over) -> Path:
    """tmp/cfg.yaml: `base` with output_dir tmp/out and the keys in `over`."""
    p = tmp / "cfg.yaml"
    p.write_text(json.dumps({**base, "output_dir": str(tmp / "out"), **over}))  # JSON is YAML
    return p


def cli_env(cache: Path) -> dict:
    return {**os.environ, "SUROGATE_JAX_CACHE": str(cache), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def sft(cfg: Path, env, *extra, check=True, **kw):
    r = subprocess.run([sys.executable, "-m", "surogate_jax.sft", str(cfg), *extra], env=env, capture_output=True,
                       text=True, timeout=900, **kw)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}
