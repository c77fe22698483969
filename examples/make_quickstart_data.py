"""Writes the quickstart chat dataset: examples/data/quickstart_{train,eval}.jsonl.

Regenerate (deterministic: same code, same bytes) with

    python examples/make_quickstart_data.py            # rewrites examples/data/*.jsonl
    python examples/make_quickstart_data.py --check    # exit 1 if the committed files are stale

Each line is one chat row `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}` from six
tasks with short exact answers, two phrasings each: reverse / count / first letter / last letter of
a random 3-8 letter string written one letter per word ("reverse: q x k" -> "k x q"), sort three
digits ("sort: 3 1 2" -> "1 2 3"), and the number after n < 1000 ("add one to 99" -> "100"). The 4000
train rows and 200 eval rows share no (task, input) pair, so eval exact-match measures what the
model learned, not what it memorized.

The generator itself is `surogate_jax.builtin_models.quickstart_rows`: the built-in model
`builtin:tiny-qwen3` trains its tokenizer on the same rows in-process, so the tokenizer and these
files always agree, and a wheel install (which has no examples/ folder) can still build the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from surogate_jax.builtin_models import (
    QUICKSTART_EVAL_ROWS,
    QUICKSTART_SEED,
    QUICKSTART_TRAIN_ROWS,
    quickstart_rows,
)

DATA_DIR = Path(__file__).resolve().parent / "data"


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=DATA_DIR, help="where to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="only compare with the files in --out-dir")
    args = ap.parse_args(argv)

    train, evaluation = quickstart_rows(QUICKSTART_TRAIN_ROWS, QUICKSTART_EVAL_ROWS, QUICKSTART_SEED)
    files = {"quickstart_train.jsonl": render(train), "quickstart_eval.jsonl": render(evaluation)}
    if args.check:
        stale = [n for n, text in files.items() if not (args.out_dir / n).is_file()
                 or (args.out_dir / n).read_text(encoding="utf-8") != text]
        for n in stale:
            print(f"error: {args.out_dir / n} is missing or stale; rerun {Path(__file__).name}", file=sys.stderr)
        return 1 if stale else 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = args.out_dir / name
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        print(f"wrote {path} ({text.count(chr(10))} rows, {len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
