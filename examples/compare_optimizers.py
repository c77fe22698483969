"""Train the quickstart task once per value of one config key; plot the loss curves together.

By default the key is `optimizer` (adamw, adamw_8bit and normuon); `--key`/`--values` compare any
other key, e.g. the precision recipes:

    .venv/bin/python examples/compare_optimizers.py                       # 1000 steps each (the quickstart)
    .venv/bin/python examples/compare_optimizers.py --steps 30 --out output/compare_smoke exact_match_samples=20
    # -> output/compare_recipe:
    .venv/bin/python examples/compare_optimizers.py --key recipe --values bf16,fp8-hybrid,nvfp4

Each run is exactly what a user types,
    python -m surogate_jax.sft examples/quickstart.yaml <key>=<value> max_steps=<N> output_dir=<out>/<value> \\
        [key=value ...]
in a subprocess (same config, seed and data order; only that key differs; for optimizers
`learning_rate` is shared, as in Surogate, which is what NorMuon's AdamW-scale step rule is made
for). Extra key=value arguments are passed to every run. Writes into --out (default
output/compare_optimizers for the optimizer key, output/compare_<key> otherwise):
    loss_curves.png   train loss (thin) and eval loss (markers) of every run, one colour per value
    results.md        table: final train loss (mean of the last 4 logged), final eval loss, held-out
                      exact match, wall time of the run; for several values also the final train
                      loss relative to the first value's (e.g. fp8-hybrid vs bf16)
    results.json      the same numbers
A run whose <out>/<value>/summary.json already reports the requested steps is reused (not retrained);
a run that fails is reported in the table (with the last line of its error) and the others go on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "adamw_8bit", "normuon")
COLORS = {"adamw": "tab:blue", "adamw_8bit": "tab:orange", "normuon": "tab:green",
          "bf16": "tab:blue", "fp8-hybrid": "tab:orange", "nvfp4": "tab:green"}
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(opt: str, args, overrides: list[str]) -> dict:
    out = args.out / opt
    summary_path = out / "summary.json"
    if summary_path.is_file() and json.loads(summary_path.read_text()).get("steps") == args.steps:
        print(f"[{opt}] reusing {out}", flush=True)
        return {"reused": True, "seconds": None}
    cmd = [sys.executable, "-m", "surogate_jax.sft", str(args.config), f"{args.key}={opt}", f"max_steps={args.steps}",
           f"output_dir={out}", *overrides]
    print(f"[{opt}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    log = args.out / f"{opt}.log"
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit code {r.returncode}", "seconds": seconds}
    return {"seconds": seconds}


def collect(opt: str, args, run: dict) -> dict:
    out = args.out / opt
    rows = read_jsonl(out / "metrics.jsonl")
    train_rows = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    last = [r["loss"] for r in train_rows[-4:]]
    return {
        args.key: opt,
        "error": run.get("error"),
        "seconds": run.get("seconds"),
        "train_steps": [r["step"] for r in train_rows],
        "train_loss": [r["loss"] for r in train_rows],
        "eval_steps": [r["step"] for r in evals],
        "eval_loss": [r["eval_loss"] for r in evals],
        "final_train_loss": sum(last) / len(last) if last else None,
        "final_eval_loss": summary.get("eval_loss"),
        "exact_match": summary.get("exact_match"),
    }


def plot(results: list[dict], path: Path, title: str, key: str = "optimizer") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(results):
        name = r[key]
        c = COLORS.get(name, PALETTE[i % len(PALETTE)])
        if r["train_loss"]:
            ax.plot(r["train_steps"], r["train_loss"], lw=1, color=c, alpha=0.8, label=f"{name} train")
        if r["eval_loss"]:
            ax.plot(r["eval_steps"], r["eval_loss"], "o--", color=c, label=f"{name} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict], steps: int, key: str = "optimizer") -> str:
    rel = key != "optimizer" and len(results) > 1  # e.g. recipes: final loss vs the first value's
    first = results[0]["final_train_loss"] if results else None
    head = f"| {key} | final train loss (last 4 logs) | final eval loss | exact match | wall time (s) |"
    lines = [head + (f" vs {results[0][key]} |" if rel else ""),
             "| --- | --- | --- | --- | --- |" + (" --- |" if rel else "")]
    for r in results:
        em = None if r["exact_match"] is None else 100 * r["exact_match"]
        row = (f"| {r[key]} | {fmt(r['final_train_loss'], '.4f')} | {fmt(r['final_eval_loss'], '.4f')} | "
               f"{fmt(em, '.1f')}{'%' if em is not None else ''} | {fmt(r['seconds'], '.0f')} |")
        if rel:
            gap = (100 * (r["final_train_loss"] / first - 1) if first and r["final_train_loss"] is not None else None)
            row += f" {'-' if gap is None else format(gap, '+.2f') + '%'} |"
        if r["error"]:
            row += f" failed: {r['error']}"
        lines.append(row)
    return f"{steps} steps each\n\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default output/compare_optimizers, or output/compare_<key>)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--key", default="optimizer", help="the config key that differs between runs (default optimizer)")
    p.add_argument("--values", default=None,
                   help="comma-separated values of --key (e.g. bf16,fp8-hybrid,nvfp4); default: --optimizers")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = p.parse_args(argv)
    if args.values is None and args.key != "optimizer":
        p.error("--values is required with --key")
    values = [v.strip() for v in args.values.split(",") if v.strip()] if args.values else args.optimizers
    if args.out is None:
        args.out = ROOT / "output" / ("compare_optimizers" if args.key == "optimizer" else f"compare_{args.key}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for opt in values:
        run = train(opt, args, args.overrides)
        results.append(collect(opt, args, run))
        print(f"[{opt}] " + ("failed: " + run["error"] if run.get("error") else
                             f"final train loss {fmt(results[-1]['final_train_loss'], '.4f')}"), flush=True)
    plot(results, args.out / "loss_curves.png", f"{args.config.name}: {args.steps} steps per {args.key}", args.key)
    text = table(results, args.steps, args.key)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    print(f"plot: {args.out / 'loss_curves.png'}")
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
