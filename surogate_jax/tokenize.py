"""`python -m surogate_jax.tokenize config.yaml [key=value ...] [--debug N]`: tokenize a config's data.

Runs the same `build_datasets` call as training (tokenizer of `model`, `sequence_len`, the data keys,
cache in <output_dir>/tokenized, train_seed for the validation split), so a later training run finds
the splits already cached. Prints one stats line per split; `--debug N` then prints the first N
training documents token by token: index, token id, loss mask (+ = supervised target, . = context)
and the token's text. `--mode pretrain` tokenizes as pretraining does (loss on every token).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from .cli import run
from .config import load_config
from .data import build_datasets
from .data.build import MODES, describe
from .data.sources import resolve
from .errors import ModelLoadError


def load_tokenizer(model: str):
    """The tokenizer of an HF model directory or hub id (or of a `builtin:` model)."""
    if model.startswith("builtin:"):
        from . import builtin_models  # another component; only needed for builtin: models

        resolved = builtin_models.resolve(model)
        if hasattr(resolved, "apply_chat_template"):  # a tokenizer itself
            return resolved
        if hasattr(resolved, "tokenizer"):
            return resolved.tokenizer
        if not isinstance(resolved, (str, os.PathLike)):
            raise ModelLoadError(f"model={model}: resolves to a {type(resolved).__name__}, which has no tokenizer")
        model = os.fspath(resolved)
    from transformers import AutoTokenizer

    if not Path(model).exists() and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise ModelLoadError(f"model={model}: no such directory")
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - missing files, no network, bad id: the user's to fix
        raise ModelLoadError(f"model={model}: cannot load its tokenizer: {' '.join(str(e).split())[:300]}") from None


def show_document(tokenizer, ids, mask, index: int) -> None:
    print(f"--- document {index}: {len(ids)} tokens, {int(mask.sum())} supervised (+)")
    for i, (tok, m) in enumerate(zip(ids.tolist(), mask.tolist())):
        print(f"{i:6d} {tok:8d} {'+' if m else '.'} {tokenizer.decode([tok])!r}")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m surogate_jax.tokenize",
        description="Tokenize a training config's datasets exactly as training will (cached in "
                    "<output_dir>/tokenized) and print their stats.")
    parser.add_argument("config", help="the training YAML config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--debug", type=int, default=0, metavar="N",
                        help="print the first N training documents token by token with their loss mask")
    parser.add_argument("--mode", choices=MODES, default="sft", help="sft (default) or pretrain")
    args = parser.parse_intermixed_args(argv)
    for name in ("surogate_jax.data", "datasets"):  # we print the stats ourselves; keep stderr for problems
        logging.getLogger(name).setLevel(logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    for ds in (*cfg.data.datasets, *cfg.data.validation_datasets):
        resolve(ds)  # a missing file fails here, before the (slow) tokenizer load
    tokenizer = load_tokenizer(cfg.model.model)
    T = cfg.model.sequence_len
    train, valid = build_datasets(cfg.data, tokenizer, sequence_len=T, cache_dir=Path(cfg.run.output_dir) / "tokenized",
                                  seed=cfg.run.train_seed, mode=args.mode)
    for name, docs in (("train", train), ("validation", valid)):
        if docs is not None:
            print(describe(name, docs.stats, T))
    if valid is None:
        print("validation: none")
    for d in range(min(args.debug, len(train))):
        show_document(tokenizer, *train.doc(d), d)
    return 0


if __name__ == "__main__":
    run(main)
