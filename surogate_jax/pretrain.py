"""`python -m surogate_jax.pretrain config.yaml [key=value ...]`: pre-training from scratch.

The same keys as sft, with pre-training defaults: random init from the model's config.json
(`from_scratch: true`), full training (`lora: false`), loss on every token (`loss_scale: all`),
raw text documents (`type: text` rows; other types are flattened through the chat template).
"""

from __future__ import annotations

from .cli import run as run_cli
from .sft import main as sft_main

DEFAULTS = {"from_scratch": True, "lora": False, "loss_scale": "all"}


def main(argv):
    return sft_main(argv, mode="pretrain", defaults=DEFAULTS, prog="python -m surogate_jax.pretrain", doc=__doc__)


if __name__ == "__main__":
    run_cli(main)
