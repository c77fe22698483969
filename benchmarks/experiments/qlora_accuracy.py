"""QLoRA accuracy: pre-train a small base once, then LoRA-fine-tune it on a different task over a bf16, NF4, FP8
and NVFP4 (emulated below SM100) frozen base, 3 seeds each, and compare the final eval losses with bf16 LoRA's.

    python3 benchmarks/experiments/qlora_accuracy.py --out output/qlora_accuracy --jobs 12   # GPU (one H100)
    python3 benchmarks/experiments/qlora_accuracy.py --out /tmp/qa --pretrain-steps 20 --ft-steps 10 --seeds 1 \\
        --jobs 2 --train-chars 300000 --eval-chars 20000 --ft-train-chars 200000 --ft-eval-chars 20000  # CPU smoke

Bars: NF4 within 2% of bf16 LoRA's final eval loss (mean over seeds), FP8 within 1%; NVFP4 is reported, not judged.

Base: recipe_accuracy.py's model (builtin:tiny-qwen3 widened, ~3.4M parameters) and pre-training config, bf16
recipe, seed 1, --pretrain-steps on its corpus A (the stdlib's .py files, tests excluded); the run's exported model
(<run>/model, HF format) is the fine-tuning base. Fine-tuning task, corpus B: Python *test* code, a different
domain with the same tokenizer: the stdlib's test/ and tests/ directories (which corpus A leaves out), followed by
the test/ and tests/ directories under site-packages (a Debian/Ubuntu Python ships almost none of its test suite),
cut like corpus A; a file is held out for eval when the SHA-1 of its path is 0 mod 20. Fine-tuning is
`python -m surogate_jax.sft <config> <qlora key> train_seed=S`: `type: text` rows supervise every token, LoRA r16
alpha 32 on q,k,v,o,gate,up,down, fp32 adapters, bf16 model and compute (recipe bf16), AdamW, cosine; the same
data order for a seed across bases, so gaps are also reported per seed (paired). The FP8 base uses
qlora_block_size 128 when every projection dimension is a multiple of 128, else 64 (printed and in results.md).

--jobs runs share one GPU (each gets an equal memory fraction, as in recipe_accuracy). A run whose summary.json
reports the requested steps is reused. Writes into --out: pretrain/ (corpus A, model config, the base run),
finetune/ (corpus B, config, one run per <base>_s<seed>), results.json, results.md, qlora_curves.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# recipe_accuracy is a script, not a package module: loaded from its file so its corpus/model/config code is shared
_spec = importlib.util.spec_from_file_location("recipe_accuracy", HERE / "recipe_accuracy.py")
ra = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ra)

BASES = ("bf16", "nf4", "fp8", "fp4")  # bf16 = plain LoRA; the others: the frozen base stored in that format
BARS = {"nf4": 0.02, "fp8": 0.01}  # final eval loss within this fraction of bf16 LoRA's (means over seeds)
COLORS = {"bf16": "tab:blue", "nf4": "tab:red", "fp8": "tab:orange", "fp4": "tab:green"}
TEST_DIRS = {"test", "tests"}


# ------------------------------------------------------------------------------------------------
# Corpus B and the fine-tuning config


def test_files() -> list[tuple[str, Path]]:
    """Python test code: the stdlib's test dirs first, then site-packages' (sorted; rel paths keep the two apart)."""
    out = []
    for tag, key in (("stdlib", "stdlib"), ("site", "purelib")):
        base = Path(sysconfig.get_paths()[key])
        for p in sorted(base.rglob("*.py")):
            parts = p.relative_to(base).parts
            if tag == "stdlib" and "site-packages" in parts:
                continue  # a venv-less stdlib can hold site-packages; those go in the second pass
            if TEST_DIRS.intersection(parts[:-1]) and "__pycache__" not in parts:
                out.append((f"{tag}/{p.relative_to(base).as_posix()}", p))
    return out


def fp8_block(model: dict) -> int:
    """128 (the default tile) when it divides every projection dimension, else 64 (a tile over padding is no test)."""
    c = model["config"]
    dims = [c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"],
            c["num_key_value_heads"] * c["head_dim"]]
    return 128 if all(d % 128 == 0 for d in dims) else 64


def write_ft_config(path: Path, a, base_model: Path, data_dir: Path) -> None:
    """recipe_accuracy's config (same data keys and schedule shape) for fine-tuning, plus the LoRA keys."""
    ns = SimpleNamespace(seq=a.seq, batch=a.batch, steps=a.ft_steps, lr=a.ft_lr, log_every=a.log_every)
    ra.write_config(path, ns, base_model, data_dir)
    lines = ["lora: true", f"lora_rank: {a.rank}", f"lora_alpha: {2 * a.rank}",
             "lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
             "lora_dtype: fp32", "recipe: bf16"]
    text = path.read_text().replace(f"eval_steps: {max(1, a.ft_steps // 4)}\n",
                                    f"eval_steps: {max(1, a.ft_steps // a.ft_evals)}\n")
    path.write_text(text + "\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------
# Runs


# ------------------------------------------------------------------------------------------------
# Report


def summarize(runs: list[dict], bases: list[str]) -> tuple[str, dict]:
    by = {b: [x for x in runs if x["base"] == b and x["error"] is None] for b in bases}
    ref = {x["seed"]: x for x in by.get("bf16", [])}
    lines = ["| base | seeds | final eval loss: mean (min-max) | gap vs bf16 LoRA (means) | per-seed gaps (paired) "
             "| bar | verdict |", "|---|---|---|---|---|---|---|"]
    verdicts = {}
    for b in bases:
        xs = by[b]
        if not xs:
            lines.append(f"| {b} | 0 | failed | | | | |")
            continue
        ev = np.array([x["final_eval_loss"] for x in xs], float)
        row = f"| {b} | {len(xs)} | {ev.mean():.4f} ({ev.min():.4f}-{ev.max():.4f}) |"
        if b == "bf16" or not ref:
            lines.append(row + (" (reference) | | | |" if b == "bf16" else " no bf16 reference | | | |"))
            continue
        gap = ev.mean() / np.mean([x["final_eval_loss"] for x in ref.values()]) - 1
        paired = [x["final_eval_loss"] / ref[x["seed"]]["final_eval_loss"] - 1 for x in xs if x["seed"] in ref]
        bar = BARS.get(b)
        ok = None if bar is None else bool(gap <= bar)
        verdicts[b] = {"eval_gap": float(gap), "paired_eval_gaps": [float(g) for g in paired], "bar": bar,
                       "within": ok}
        verdict = "reported (no bar)" if ok is None else ("within" if ok else "NOT within")
        lines.append(row + f" {100 * gap:+.2f}% | {', '.join(f'{100 * g:+.2f}%' for g in paired)} | "
                     f"{'-' if bar is None else f'<= {100 * bar:.0f}%'} | {verdict} |")
    return "\n".join(lines), verdicts


def plot(runs: list[dict], bases: list[str], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"warning: no plot ({e}); results.md and results.json are written", flush=True)
        return
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for b in bases:
        for k, x in enumerate(r for r in runs if r["base"] == b and r["error"] is None and r["eval_loss"]):
            ax.plot(x["eval_steps"], x["eval_loss"], color=COLORS.get(b), lw=1.2, alpha=0.8, marker=".",
                    label=b if k == 0 else None)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("eval loss (held-out test files)")
    ax.grid(alpha=0.3)
    ax.legend(title="frozen base (one line per seed)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "output" / "qlora_accuracy")
    p.add_argument("--bases", nargs="+", default=list(BASES), choices=list(BASES))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--pretrain-steps", type=int, default=1500)
    p.add_argument("--ft-steps", type=int, default=600)
    p.add_argument("--ft-lr", type=float, default=1e-3, help="LoRA learning rate (cosine, 5%% warmup)")
    p.add_argument("--ft-evals", type=int, default=10, help="eval points over the fine-tuning run (the curve)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--jobs", type=int, default=4, help="fine-tuning runs at once (they share the GPU)")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="GPU memory fraction per fine-tuning run (default 0.9 / --jobs)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="pre-training learning rate")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--train-chars", type=int, default=12_000_000, help="corpus A (pre-training)")
    p.add_argument("--eval-chars", type=int, default=300_000)
    p.add_argument("--ft-train-chars", type=int, default=6_000_000, help="corpus B (fine-tuning)")
    p.add_argument("--ft-eval-chars", type=int, default=300_000)
    a = p.parse_args(argv)
    if "bf16" not in a.bases:
        p.error("--bases must include bf16 (the reference)")
    t_start = time.perf_counter()
    a.out = a.out.resolve()
    pre, ft = a.out / "pretrain", a.out / "finetune"
    ft.mkdir(parents=True, exist_ok=True)
    pre.mkdir(parents=True, exist_ok=True)

    # Base: recipe_accuracy's model and config, bf16, seed 1
    model = ra.build_model(pre / "model", a)
    cpt = ra.chars_per_token(pre / "model")
    piece = int(0.9 * a.seq * cpt)
    corpus_a = ra.build_corpus(pre / "data", a.train_chars, a.eval_chars, piece)
    ra.write_config(pre / "config.yaml", SimpleNamespace(seq=a.seq, batch=a.batch, steps=a.pretrain_steps, lr=a.lr,
                                                         log_every=a.log_every), pre / "model", pre / "data")
    base_run = pre / "bf16_s1"
    print(f"corpus A (pre-training): {corpus_a}\nmodel: {model}", flush=True)
    job = {"name": "pretrain bf16 s1", "dir": base_run, "steps": a.pretrain_steps, "log": pre / "bf16_s1.log",
           "cmd": [sys.executable, "-m", "surogate_jax.pretrain", str(pre / "config.yaml"), "recipe=bf16",
                   "train_seed=1", f"output_dir={base_run}"]}
    st = ra.run_jobs([job], 1, None)["pretrain bf16 s1"]
    base = ra.collect(base_run)
    base_model = base_run / "model"
    if st["error"] or not (base_model / "config.json").is_file() or base["final_eval_loss"] is None:
        print(f"error: the base pre-training failed ({st['error'] or 'no exported model in ' + str(base_model)}); "
              f"log: {pre / 'bf16_s1.log'}", flush=True)
        return 1
    print(f"base: final eval loss {base['final_eval_loss']} on corpus A after {a.pretrain_steps} steps", flush=True)

    # Fine-tuning: corpus B, one run per (base format, seed)
    files_b = test_files()
    corpus_b = ra.build_corpus(ft / "data", a.ft_train_chars, a.ft_eval_chars, piece, files=files_b)
    corpus_b["sources"] = {t: sum(1 for r, _ in files_b if r.startswith(t + "/")) for t in ("stdlib", "site")}
    write_ft_config(ft / "config.yaml", a, base_model, ft / "data")
    block = fp8_block(model)
    extra = {"bf16": [], "nf4": ["qlora_bnb=true"], "fp8": ["qlora_fp8=true", f"qlora_block_size={block}"],
             "fp4": ["qlora_fp4=true"]}
    print(f"corpus B (fine-tuning, test code): {corpus_b}\nfp8 base: qlora_block_size {block}", flush=True)
    pairs = [(b, s) for s in a.seeds for b in a.bases]
    jobs = [{"name": f"{b} s{s}", "dir": ft / f"{b}_s{s}", "steps": a.ft_steps, "log": ft / f"{b}_s{s}.log",
             "cmd": [sys.executable, "-m", "surogate_jax.sft", str(ft / "config.yaml"), *extra[b], f"train_seed={s}",
                     f"output_dir={ft / f'{b}_s{s}'}"]} for b, s in pairs]
    status = ra.run_jobs(jobs, a.jobs, a.mem_fraction)
    runs = [{"base": b, "seed": s, **status[f"{b} s{s}"], **ra.collect(ft / f"{b}_s{s}")} for b, s in pairs]
    for x in runs:
        if x["error"] is None and (x["final_eval_loss"] is None or not np.isfinite(x["final_eval_loss"])):
            x["error"] = f"no finite eval loss recorded ({x['final_eval_loss']})"

    text, verdicts = summarize(runs, a.bases)
    head = (f"QLoRA accuracy. Base: {model['config']} (~{model['params_approx'] / 1e6:.1f}M params) pre-trained "
            f"{a.pretrain_steps} steps (bf16, seed 1, lr {a.lr}) on Python {corpus_a['python']} stdlib source "
            f"({corpus_a['train_chars']} chars, sha1 {corpus_a['sha1'][:12]}); final eval loss there "
            f"{base['final_eval_loss']:.4f}.\nFine-tuning: LoRA r{a.rank} alpha {2 * a.rank} on q,k,v,o,gate,up,down, "
            f"{a.ft_steps} steps, seq {a.seq} x batch {a.batch}, lr {a.ft_lr} cosine, recipe bf16, on Python test "
            f"code ({corpus_b['train_chars']} train / {corpus_b['eval_chars']} eval chars from "
            f"{corpus_b['sources']['stdlib']} stdlib + {corpus_b['sources']['site']} site-packages test files "
            f"available, sha1 {corpus_b['sha1'][:12]}). Bases: bf16 = plain LoRA, nf4 = qlora_bnb (blocks of 64, "
            f"double quant), fp8 = qlora_fp8 (qlora_block_size {block}), fp4 = qlora_fp4 (NVFP4 16x16, "
            f"emulated below SM100). Seeds {a.seeds}; gaps are of the final eval loss.")
    failed = [x for x in runs if x["error"]]
    tail = "".join(f"\nFAILED {x['base']} s{x['seed']}: {x['error']} (log {ft / (x['base'] + '_s' + str(x['seed']))}"
                   ".log)" for x in failed)
    (a.out / "results.md").write_text(head + "\n\n" + text + "\n" + tail + ("\n" if tail else ""))
    (a.out / "results.json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "model": model,
         "corpus_a": corpus_a, "corpus_b": corpus_b, "fp8_block_size": block,
         "base": {"run": str(base_run), **{k: base[k] for k in ("final_eval_loss", "final_train_loss")}},
         "verdicts": verdicts, "runs": runs}, indent=1))
    plot(runs, a.bases, a.out / "qlora_curves.png",
         f"LoRA r{a.rank} fine-tuning on Python test code over a frozen base, {a.ft_steps} steps\n"
         f"(base: pre-trained {a.pretrain_steps} steps on stdlib source)")
    print("\n" + head + "\n\n" + text + tail, flush=True)
    print(f"total wall time {time.perf_counter() - t_start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
