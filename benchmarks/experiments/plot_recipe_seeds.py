"""One PNG of the precision recipes over several seeds: examples/compare_optimizers.py's results.json,
one file per seed (run with `--key recipe ... train_seed=N`), eval loss per recipe: a thin line per
seed, the mean thick; plus a table (mean, min, max of the final eval loss and exact match).

    python3 benchmarks/experiments/plot_recipe_seeds.py output/seed*/results.json \\
        --out benchmarks/experiments/figures/recipes_quickstart_seeds.png

Why: on the quickstart one seed cannot separate the recipes from run-to-run spread. The plotted
run's per-seed files are in git history: `git show 7e7eb2e:benchmarks/figures/recipes_seeds/seed1.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

COLORS = {"bf16": "tab:blue", "fp8-hybrid": "tab:orange", "nvfp4": "tab:green"}


def load(paths: list[Path]) -> dict[str, list[dict]]:
    """recipe -> its run per seed (runs that failed are left out)."""
    runs: dict[str, list[dict]] = {}
    for p in paths:
        for r in json.loads(p.read_text()):
            if r.get("error") is None:
                runs.setdefault(r["recipe"], []).append(r)
    return runs


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| recipe | seeds | final eval loss: mean (min-max) | exact match: mean (min-max) |", "|---|---|---|---|"]
    for name, rs in runs.items():
        ev = np.array([r["final_eval_loss"] for r in rs])
        em = np.array([100 * r["exact_match"] for r in rs if r.get("exact_match") is not None])
        lines.append(f"| {name} | {len(rs)} | {ev.mean():.3f} ({ev.min():.3f}-{ev.max():.3f}) "
                     f"| {em.mean():.1f}% ({em.min():.1f}-{em.max():.1f}%) |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    for name, rs in runs.items():
        c = COLORS.get(name, None)
        for axis, xs, ys in ((ax_t, "train_steps", "train_loss"), (ax, "eval_steps", "eval_loss")):
            curves = [np.asarray(r[ys], float) for r in rs]
            steps = np.asarray(rs[0][xs])
            for y in curves:
                axis.plot(steps[:len(y)], y, color=c, lw=0.7, alpha=0.4)
            n = min(len(y) for y in curves)
            axis.plot(steps[:n], np.mean([y[:n] for y in curves], 0), color=c, lw=2.2,
                      label=f"{name} (mean of {len(rs)})")
    for axis, what in ((ax_t, "train loss"), (ax, "eval loss")):
        axis.set_xlabel("step")
        axis.set_ylabel(what)
        axis.set_yscale("log")
        axis.legend()
    fig.suptitle("quickstart task: precision recipes (thin: one seed each, thick: mean over seeds)")
    fig.tight_layout()
    fig.savefig(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="results.json of compare_optimizers.py, one per seed")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    a = ap.parse_args()
    runs = load(a.results)
    plot(runs, a.out)
    print(table(runs))


if __name__ == "__main__":
    main()
