"""`python -m surogate_jax.export --base MODEL --adapter DIR --out DIR`: merge a PEFT LoRA adapter
(ours or any PEFT LoRA on the supported modules) into its base model and write an HF directory.

The adapter's rank, alpha and target modules come from its adapter_config.json; the merge runs in
fp32 and the output takes --dtype (default: the base's parameter dtype as loaded, bf16).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .atomic import probe_creatable
from .cli import run as run_cli

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def check_out(out: Path) -> None:
    """Refuses an --out that cannot take the merged model, before anything is loaded: an existing
    file, a non-empty directory, or a place where it cannot be created. The model is assembled in a
    temporary sibling (atomic.py), so the nearest existing ancestor of its parent must be a directory
    we can write; a probe file is created and removed there (permission bits alone say nothing for
    root, read-only mounts or ACLs)."""
    if out.exists():
        if not out.is_dir():
            raise NotADirectoryError(f"{out}: --out exists and is not a directory; choose another --out")
        if any(out.iterdir()):
            raise FileExistsError(f"{out}: --out exists and is not empty; choose a new --out (nothing was written)")
    try:
        probe_creatable(out.absolute().parent)
    except NotADirectoryError as e:
        raise NotADirectoryError(f"{out}: --out cannot be created because {e.filename} is a file; "
                                 "choose another --out") from None
    except OSError as e:
        raise PermissionError(f"{out}: --out cannot be created there ({e.strerror or e}); "
                              "choose another --out") from None


def main(argv):
    p = argparse.ArgumentParser(prog="python -m surogate_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="base model: HF directory, hub id or builtin:NAME")
    p.add_argument("--adapter", required=True,
                   help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args(argv)

    out = Path(args.out).expanduser()
    check_out(out)

    import jax.numpy as jnp

    from . import lora as L
    from .hf import load_pretrained, read_hf_config, save_pretrained
    from .models import Decoder, config_from_hf
    from .run import resolve_model

    # Cheap checks first: the adapter against the base's config.json, before the base weights load.
    spec = L.peft_spec(L.read_adapter_config(args.adapter))
    base_dir = resolve_model(args.base)
    adapters = L.load_peft(args.adapter, Decoder(config_from_hf(read_hf_config(base_dir)).replace(lora=spec)))
    base, params = load_pretrained(base_dir, dtype=getattr(jnp, DTYPES[args.dtype]))
    merged = L.merge(params, adapters, spec)
    save_pretrained(out, base, merged, copy_side_files_from=base_dir)
    print(f"wrote merged model to {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
