"""`python -m surogate_jax.sft config.yaml [key=value ...]`: supervised fine-tuning (LoRA or full).

Keys are Surogate's (see README "Config keys"); `key=value` overrides any of them. Writes
checkpoints, metrics.jsonl, training_plot.png and the PEFT adapter (or full model) to output_dir.
"""

from __future__ import annotations

import argparse

from .cli import run as run_cli


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config file (Surogate keys)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. max_steps=10")
    return p


def main(argv, *, mode: str = "sft", defaults: dict | None = None, prog: str = "python -m surogate_jax.sft",
         doc: str = __doc__):
    args = parser(prog, doc).parse_args(argv)
    from .config import load_config
    from .run import run

    cfg = load_config(args.config, args.overrides, defaults=defaults)
    summary = run(cfg, mode=mode)
    print("done: " + ", ".join(f"{k}={v}" for k, v in summary.items() if v is not None))
    return 0


if __name__ == "__main__":
    run_cli(main)
