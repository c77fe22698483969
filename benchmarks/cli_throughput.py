"""The trainer's own throughput: `python -m surogate_jax.sft` at the seed benchmark's configuration, its logged
tokens/s, to set beside sft_throughput.py's figure for the same shape (the two must agree).

Builds, under --work: a random-init Qwen3-<size>-shaped HF directory (bf16 safetensors, sft_throughput.qwen3's
shapes and vocabulary, the tokenizer of builtin:tiny-qwen3: token ids stay below its 512, which changes no cost)
and a text dataset of documents of 64..1024 tokens (uniform, as sft_throughput's rows). Then runs the CLI:
LoRA r16 alpha 32 on the seven projections, sequence 2048, batch 2, grad-accum 4, sample packing, adamw_8bit,
recompute as --recompute says, logging every step. Tokens/s = the median of metrics.jsonl's tokens_per_s over the
steps after the first --skip (compilation). One JSON line per run (--out appends it).

    python benchmarks/cli_throughput.py --size 0.6b [--recipe fp8-hybrid] [--recompute auto] [--steps 12] \
        [--work /tmp/cli_bench] [--out f.jsonl] [key=value ...]   # extra config keys for the run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from sft_throughput import qwen3

ROWS, ACCUM, SEQ = 2, 4, 2048


def build_model(size: str, out: Path) -> None:
    """out/: config.json + bf16 safetensors of a random Qwen3-<size> + the tiny tokenizer (once per size)."""
    if (out / "config.json").is_file():
        return
    import jax
    import jax.numpy as jnp

    from surogate_jax.builtin_models import resolve
    from surogate_jax.hf import save_pretrained
    from surogate_jax.models import Decoder

    tiny = resolve("builtin:tiny-qwen3")
    model = Decoder(qwen3(size, True).replace(lora=None))
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(tmp, model, params, dtype=jnp.bfloat16)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, tmp / f.name)
    cfg, tiny_cfg = json.loads((tmp / "config.json").read_text()), json.loads((tiny / "config.json").read_text())
    cfg.update({k: tiny_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)


def build_data(model_dir: Path, out: Path, n_docs: int, seed: int = 0) -> None:
    """out: jsonl of {"text"} documents whose token counts are uniform in 64..1024 (random tokens, decoded)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    ids = np.array([i for i in range(len(tok)) if i not in special])
    rng = np.random.default_rng(seed)
    with open(out, "w") as f:
        for _ in range(n_docs):
            m = int(rng.integers(64, 1025))
            # decoded random tokens re-tokenize longer: keep the first m tokens of the re-tokenized text
            again = tok.encode(tok.decode(rng.choice(ids, m).tolist()), add_special_tokens=False)[:m]
            f.write(json.dumps({"text": tok.decode(again)}) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", required=True, help="a Qwen3 size of sft_throughput.py (0.6b, 8b, ...)")
    ap.add_argument("--recipe", default="bf16", choices=("bf16", "fp8-hybrid", "nvfp4"))
    ap.add_argument("--recompute", default="auto", choices=("true", "false", "auto"), help="default: the trainer's")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first logged steps left out of the median (compilation)")
    ap.add_argument("--work", default="/tmp/cli_bench")
    ap.add_argument("--out")
    ap.add_argument("--build-only", action="store_true", help="only build the model directory (run in a child)")
    ap.add_argument("overrides", nargs="*", help="key=value config keys for the run")
    a = ap.parse_args()
    if a.steps <= a.skip:
        ap.error(f"--steps {a.steps} must exceed --skip {a.skip}")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data = work / f"qwen3-{a.size}", work / "docs.jsonl"
    t0 = time.perf_counter()
    if a.build_only:
        build_model(a.size, model_dir)
        return
    if not (model_dir / "config.json").is_file():  # in a child process: this one must hold no GPU memory
        subprocess.run([sys.executable, __file__, "--size", a.size, "--work", str(work), "--build-only"], check=True)
    if not data.is_file():  # enough documents for the steps (about 3.5 a row) and some spare
        build_data(model_dir, data, n_docs=int(a.steps * ROWS * ACCUM * 5) + 200)
    built_s = time.perf_counter() - t0
    run_dir = work / "out"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = {"model": str(model_dir), "output_dir": str(run_dir), "model_dtype": "bf16",
           "datasets": [{"path": str(data), "type": "text"}], "validation_split_ratio": 0.0,
           "exact_match_file": None, "sequence_len": SEQ, "sample_packing": True,
           "per_device_train_batch_size": ROWS, "gradient_accumulation_steps": ACCUM, "max_steps": a.steps,
           "lora": True, "lora_rank": 16, "lora_alpha": 32, "lora_target_modules": "all", "optimizer": "adamw_8bit",
           "recipe": a.recipe, "recompute": {"true": True, "false": False}.get(a.recompute, a.recompute),
           "logging_steps": 1, "save_steps": 10**6, "eval_steps": 0, "learning_rate": 2e-4}
    for kv in a.overrides:
        k, _, v = kv.partition("=")
        try:
            cfg[k] = json.loads(v)  # numbers, true/false/null, lists
        except json.JSONDecodeError:
            cfg[k] = v  # a plain string
    cfg_path = work / "cfg.yaml"
    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "surogate_jax.sft", str(cfg_path)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"the CLI run failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [(x["step"], x["tokens_per_s"]) for x in rows if x.get("tokens_per_s") is not None]
    timed = [t for s, t in tps if s > a.skip]
    log = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("data:", "remat", "precision:", "model:"))]
    res = dict(size=a.size, recipe=a.recipe, recompute=a.recompute, steps=a.steps,
               tokens_per_s=statistics.median(timed), tokens_per_s_spread=max(timed) - min(timed), per_step=tps,
               run_wall_s=wall, build_s=built_s, overrides=a.overrides, log=log)
    print(json.dumps(res))
    print(f"CLI Qwen3-{a.size} {a.recipe} recompute {a.recompute}: {res['tokens_per_s'] / 1e3:.2f}k tokens/s "
          f"(median of {len(timed)} steps, spread {res['tokens_per_s_spread'] / 1e3:.2f}k)")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
