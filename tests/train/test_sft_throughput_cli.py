"""benchmarks/sft_throughput.py's multi-device options on 4 CPU devices (--size tiny): a full
fine-tuning ZeRO-3 run with every offload option, an offload-free LoRA run and a ZeRO-3 QLoRA (NF4) run all
train and print their table line and json (the GPU matrix in benchmarks/multi_gpu_session.sh runs the same code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SMALL = ["--size", "tiny", "--gpus", "4", "--steps", "1", "--seq", "64", "--batch", "1", "--accum", "2"]
CASES = [
    SMALL + ["--zero-level", "3", "--full-ft", "--offload-optimizer", "--offload-master", "--offload-grads",
             "--offload-residual", "--baseline-tps", "1000"],
    SMALL + ["--zero-level", "1"],
    SMALL + ["--zero-level", "3", "--qlora", "bnb"],
]
# Both cases in one process (one jax start-up); each through the script's own main().
SCRIPT = r'''
import os, sys, runpy
sys.path.insert(0, os.path.dirname(PATH))  # as `python3 benchmarks/sft_throughput.py` sets it (its _qwen3 import)
for argv in CASES:
    sys.argv = ["sft_throughput.py", *argv]
    runpy.run_path(PATH, run_name="__main__")
'''


def test_gpus_zero3_offload_full_ft_and_lora_on_4_cpu_devices(tmp_path):
    out = tmp_path / "r.jsonl"
    cases = [c + ["--out", str(out)] for c in CASES]
    code = f"CASES = {cases!r}\nPATH = {str(ROOT / 'benchmarks/sft_throughput.py')!r}\n" + SCRIPT
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    full, lora, qlora = [json.loads(x) for x in out.read_text().splitlines()]
    assert full["gpus"] == 4 and full["mode"] == "full" and full["zero_level"] == 3
    assert full["offload"] == ["optimizer", "master", "grads", "residual"] and full["remat"] == "offload_residual"
    assert "zero: optimizer,gradients,weights" in full["parallel"] and "pinned_host" in full["parallel"]
    assert abs(full["scaling_efficiency"] - full["tokens_per_s_per_gpu"] / 1000) < 1e-9
    assert lora["mode"] == "lora" and lora["offload"] == [] and lora["parallel"] == "4 device(s); zero: optimizer"
    assert qlora["mode"] == "qlora-bnb" and "zero: optimizer,gradients,weights" in qlora["parallel"]
    for res in (full, lora, qlora):
        assert res["tokens_per_s"] > 0 and len(res["peak_gb_per_gpu"]) == 4
        assert len(res["losses"]) == 2 and all(0 < x < 20 for x in res["losses"]), res["losses"]
        # 4 GPUs x 1 row x 2 micro-batches x 64 tokens per step
        assert abs(res["tokens_per_s"] * res["step_s"] - 4 * 2 * 64) < 1e-6
    lines = [x for x in r.stdout.splitlines() if x.startswith("| Qwen3-TINY |")]
    assert len(lines) == 3 and "| full | 4 | zero 3 |" in lines[0] and "| lora | 4 | zero 1 | none |" in lines[1], lines


def test_multi_gpu_session_plans_the_matrix_and_skips_what_does_not_fit(tmp_path):
    """benchmarks/multi_gpu_session.sh with no budget left: every run of the matrix is listed as
    skipped with its exact command (2 GPUs present: 1 and 2 GPU scaling runs, full FT on 2)."""
    env = {**os.environ, "OUT": str(tmp_path), "NGPU": "2", "SKIP_BUILD": "1", "BUDGET_S": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks/multi_gpu_session.sh")], check=False, env=env,
                       capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = (tmp_path / "status.txt").read_text().splitlines()
    skipped = [x.split(": ", 1)[1] for x in status if x.startswith("SKIPPED")]
    run = "python3 benchmarks/sft_throughput.py "
    assert skipped[:4] == [run + "--size 0.6b --gpus 1 --steps 6", run + "--size 0.6b --gpus 2 --steps 6",
                           run + "--size 8b --gpus 1 --steps 4", run + "--size 8b --gpus 2 --steps 4"], skipped
    full = run + "--size 8b --gpus 2 --full-ft --zero-level 3 --accum 2 --steps 2 --optimizer adamw_8bit"
    assert skipped[4:] == [full + " --offload-optimizer", full, full + " --offload-master", full + " --offload-grads",
                           full + " --offload-residual",
                           full + " --offload-optimizer --offload-master --offload-grads --offload-residual"], skipped
    assert "| model | mode | GPUs |" in (tmp_path / "summary.md").read_text()
    assert {p.name for p in tmp_path.iterdir()} == {"env.txt", "status.txt", "summary.md", "logs.tar.gz"}
