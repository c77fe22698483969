"""`python -m surogate_jax.export --base MODEL --adapter DIR --out DIR`: merge a PEFT LoRA adapter
(ours or any PEFT LoRA on the supported modules) into its base model and write an HF directory.

The adapter's rank, alpha and target modules come from its adapter_config.json; the merge runs in
fp32 and the output takes --dtype (default: the base's parameter dtype as loaded, bf16).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .cli import run as run_cli
from .errors import ModelLoadError

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def main(argv):
    p = argparse.ArgumentParser(prog="python -m surogate_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="base model: HF directory, hub id or builtin:NAME")
    p.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from . import lora as L
    from .hf import load_pretrained, save_pretrained
    from .models import Decoder, LoraSpec
    from .run import resolve_model

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    adapter_cfg = Path(args.adapter) / "adapter_config.json"
    if not adapter_cfg.is_file():
        raise ModelLoadError(f"{args.adapter}: not a PEFT adapter directory (no adapter_config.json)")
    acfg = json.loads(adapter_cfg.read_text())
    if acfg.get("peft_type") != "LORA" or acfg.get("use_dora") or acfg.get("use_rslora"):
        raise ModelLoadError(f"{adapter_cfg}: only plain LoRA adapters are supported (peft_type LORA, no DoRA/rsLoRA)")
    targets = acfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ModelLoadError(f"{adapter_cfg}: target_modules must be a list of module names, got {targets!r}")
    base_dir = resolve_model(args.base)
    base, params = load_pretrained(base_dir, dtype=getattr(jnp, DTYPES[args.dtype]))
    spec = LoraSpec(rank=int(acfg["r"]), alpha=float(acfg["lora_alpha"]), targets=tuple(sorted(targets)))
    adapters = L.load_peft(args.adapter, Decoder(base.config.replace(lora=spec)))
    merged = L.merge(params, adapters, spec)
    save_pretrained(out, base, merged, copy_side_files_from=base_dir)
    print(f"wrote merged model to {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
